/// @file
/// Options: where a run's shape is stated once, in the spirit of poptorch.Options. The configs
/// of the rooms below (feeds, devices) come from its members (infeed_config(), ...); the rooms
/// above build theirs with XConfig::from(options). Guide: runtime/run/README.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/devices/link_model.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/feeds/output_mode.hpp"
#include "bspflow/run/precision.hpp"
#include "bspflow/run/stall.hpp"

namespace bspflow {

/// A run's shape (poptorch.Options). Each setter checks its value at once and returns *this;
/// a refused value is not stored, and the Error names the field, the value and what is
/// allowed. Each getter returns the stored value.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Options {
 public:
  /// Loop trips per host call (deviceIterations; Pipeline::run's device_iterations). >= 1.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& device_iterations(std::uint64_t n);
  /// Loop trips per host call.
  std::uint64_t device_iterations() const noexcept { return device_iterations_; }

  /// Copies of the program on separate devices, each fed different data. 1..kMaxReplicas.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& replicas(std::uint32_t n);
  /// Copies of the program, one per device.
  std::uint32_t replicas() const noexcept { return replicas_; }

  /// Micro-batches per weight update. >= 1.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& gradient_accumulation(std::uint32_t n);
  /// Micro-batches per weight update.
  std::uint32_t gradient_accumulation() const noexcept { return gradient_accumulation_; }

  /// What the host sees of the outfeed (outfeed_config()).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& output_mode(OutputMode mode) noexcept;
  /// What the host sees of the outfeed.
  OutputMode output_mode() const noexcept { return output_mode_; }

  /// Elements per replica moved toward the device ahead of use.
  /// kMinPrefetchDepth..kMaxPrefetchDepth (1..255).
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& prefetch_depth(std::uint32_t depth);
  /// Elements per replica moved toward the device ahead of use.
  std::uint32_t prefetch_depth() const noexcept { return host_io_.prefetch_depth; }

  /// Infeed lane capacity per replica, elements. The setter takes 1..kMaxQueueCapacity;
  /// validate() also asks for at least prefetch_depth.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& infeed_capacity(std::size_t elements);
  /// Infeed lane capacity per replica, elements.
  std::size_t infeed_capacity() const noexcept { return infeed_capacity_; }

  /// Outfeed capacity, entries; 0 = unbounded. 0..kMaxQueueCapacity. (With
  /// consumer_type(kSingle): per replica, and validate() asks for at least 1.)
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& outfeed_capacity(std::size_t entries);
  /// Outfeed capacity, entries; 0 = unbounded.
  std::size_t outfeed_capacity() const noexcept { return outfeed_capacity_; }

  /// One producer thread per infeed (kSingle: a ring per lane, faster) or several (kMulti,
  /// default). InfeedConfig::producer_type takes it.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& producer_type(ProducerType type) noexcept;
  /// Whether an infeed takes one producer thread or several.
  ProducerType producer_type() const noexcept { return producer_type_; }
  /// One reading thread per outfeed (kSingle: a ring per replica, needs a bounded
  /// outfeed_capacity) or several (kMulti, default). OutfeedConfig::consumer_type takes it.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& consumer_type(ConsumerType type) noexcept;
  /// Whether an outfeed takes one reading thread or several.
  ConsumerType consumer_type() const noexcept { return consumer_type_; }

  /// Tiles per device reserved for I/O (stream copies overlapping compute): 0, or an even
  /// number below tiles; the setter checks evenness, validate() the bound (each entry point
  /// also checks that the I/O tiles hold prefetch_depth of what crosses the link). Part of
  /// the host side of the run (host_io()), with host_link, synthetic_data and prefetch_depth.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& io_tiles(std::uint32_t tiles);
  /// Tiles per device reserved for I/O (0: none).
  std::uint32_t io_tiles() const noexcept { return host_io_.io_tiles; }
  /// The modeled host link (default LinkModel::host(): 10 GB/s, 5 us per copy). Throws what
  /// LinkModel::validate("host link") throws.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& host_link(const LinkModel& link);
  /// The modeled host link.
  const LinkModel& host_link() const noexcept { return host_io_.host_link; }
  /// No host copies: an Engine's device generates its input (random normal); a Pipeline or a
  /// loop reads one element per replica and reuses it every iteration.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& synthetic_data(bool on) noexcept;
  /// Whether runs make no host copies.
  bool synthetic_data() const noexcept { return host_io_.synthetic_data; }

  /// Device memory: tiles x bytes per tile (DeviceConfig::tiles, bytes_per_tile). Tiles per
  /// device, 1..kMaxTiles.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& tiles(std::uint32_t n);
  /// Tiles per device.
  std::uint32_t tiles() const noexcept { return tiles_; }
  /// Bytes per tile, kArenaAlignment..kMaxBytesPerTile.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& bytes_per_tile(std::size_t bytes);
  /// Bytes per tile.
  std::size_t bytes_per_tile() const noexcept { return bytes_per_tile_; }

  /// What a real IPU would take for the devices' declared work: the modeled clock's figures
  /// (DeviceConfig::model; default DeviceModel::mk2()). Throws what DeviceModel::validate()
  /// throws.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& device_model(const DeviceModel& model);
  /// The modeled clock's figures.
  const DeviceModel& device_model() const noexcept { return device_model_; }
  /// The modeled link between devices (EngineConfig and PipelineConfig::device_link; default
  /// LinkModel::device(): 32 GB/s, 1 us). Throws what LinkModel::validate("device link")
  /// throws.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& device_link(const LinkModel& link);
  /// The modeled link between devices.
  const LinkModel& device_link() const noexcept { return device_link_; }

  /// How a Pipeline stores and accumulates values (PipelineConfig::from copies it): fp32
  /// (default) or fp16 storage, fp32 or fp16 partials, static loss scaling. Throws what
  /// Precision::validate() throws.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& precision(const Precision& p);
  /// How a Pipeline stores and accumulates values.
  const Precision& precision() const noexcept { return precision_; }

  /// Pin device threads to cores (DeviceConfig::pin; needs hwloc, without it devices run
  /// unpinned).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& pin(bool on) noexcept;
  /// Whether device threads are pinned to cores.
  bool pin() const noexcept { return pin_; }

  /// When a run cannot make progress (StallCheck, bspflow/run/stall.hpp): how long every
  /// running device may wait with none moving before the run says what each waits for
  /// (0: no check; else kMinRunStallLimit..kMaxRunStallLimit, 1 ms..24 h; default 30 s), and
  /// whether it then ends with StallError (OnStall::kFail) or only logs (kLog, the default).
  /// EngineConfig::from and PipelineConfig::from take both; a loop takes the Options (or
  /// their stall_check()) as a feed. Throws what StallCheck::validate() throws.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Options& run_stall_limit(std::chrono::nanoseconds limit);
  /// How long devices may wait with none moving before the run says so (0: no check).
  std::chrono::nanoseconds run_stall_limit() const noexcept { return stall_.limit; }
  /// What a stalled run does besides logging once (StallCheck::on_stall; see run_stall_limit()).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Options& on_stall(OnStall action) noexcept;
  /// What a stalled run does besides logging once.
  OnStall on_stall() const noexcept { return stall_.on_stall; }
  /// The stall check: run_stall_limit() and on_stall() together.
  const StallCheck& stall_check() const noexcept { return stall_; }

  /// Checks the cross-option rules: io_tiles below tiles, infeed_capacity >= prefetch_depth,
  /// a bounded outfeed_capacity with consumer_type kSingle.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;

  /// Returns micro_batch x device_iterations x gradient_accumulation x replicas. Throws
  /// bspflow::Error if micro_batch is 0 or the product overflows 64 bits.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  std::uint64_t samples_per_step(std::uint64_t micro_batch) const;

  /// The infeed's config: replicas, infeed_capacity, prefetch_depth, producer_type. Like
  /// outfeed_config(), device_config() and host_io(), it calls validate() and throws what it
  /// throws, and leaves every other field of the config at its default. The rooms above
  /// build theirs: EngineConfig::from(options), PipelineConfig::from(options),
  /// StreamConfig::from(options).
  /// Contract: any; non-blocking; no-alloc; throws Error.
  InfeedConfig infeed_config() const;
  /// The outfeed's config (see infeed_config()): replicas, output_mode, outfeed_capacity,
  /// consumer_type.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  OutfeedConfig outfeed_config() const;
  /// The devices' config (see infeed_config()): tiles, bytes_per_tile, pin, device_model.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  DeviceConfig device_config() const;
  /// The host side (see infeed_config()): host_link, io_tiles, prefetch_depth,
  /// synthetic_data; a loop's host link, and the host side of an Engine's or Pipeline's
  /// config.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  HostIO host_io() const;

  /// One line per option, "name = value".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;

 private:
  std::uint64_t device_iterations_ = 1;
  std::uint32_t replicas_ = 1;
  std::uint32_t gradient_accumulation_ = 1;
  OutputMode output_mode_ = OutputMode::all();
  HostIO host_io_{};  ///< host_link, io_tiles, prefetch_depth, synthetic_data
  std::size_t infeed_capacity_ = tunables::kDefaultInfeedCapacity;
  std::size_t outfeed_capacity_ = tunables::kDefaultOutfeedCapacity;
  ProducerType producer_type_ = ProducerType::kMulti;
  ConsumerType consumer_type_ = ConsumerType::kMulti;
  std::uint32_t tiles_ = tunables::kDefaultTiles;
  std::size_t bytes_per_tile_ = tunables::kDefaultBytesPerTile;
  bool pin_ = true;
  Precision precision_{};
  DeviceModel device_model_{};
  LinkModel device_link_ = LinkModel::device();
  StallCheck stall_{};
};

}  // namespace bspflow
