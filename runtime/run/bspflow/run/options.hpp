// Options: where a run's shape is stated once, in the spirit of poptorch.Options. The configs
// of the rooms below (feeds, devices) come from its members (infeed_config(), ...); the rooms
// above build theirs with XConfig::from(options). Guide: runtime/run/README.md.
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

class Options {
 public:
  // Each setter: setup path. Never blocks, never allocates. Returns *this. Throws
  // bspflow::Error naming the field, the value and what is allowed (the value is then not
  // stored). Setters taking a bool or an OutputMode never throw. Each getter: any thread.
  // Never blocks, never allocates, never throws.

  // Loop trips per host call (deviceIterations; Pipeline::run's device_iterations). >= 1.
  Options& device_iterations(std::uint64_t n);
  std::uint64_t device_iterations() const noexcept { return device_iterations_; }

  // Copies of the program on separate devices, each fed different data. 1..kMaxReplicas.
  Options& replicas(std::uint32_t n);
  std::uint32_t replicas() const noexcept { return replicas_; }

  // Micro-batches per weight update. >= 1.
  Options& gradient_accumulation(std::uint32_t n);
  std::uint32_t gradient_accumulation() const noexcept { return gradient_accumulation_; }

  // What the host sees of the outfeed (outfeed_config()). Never throws.
  Options& output_mode(OutputMode mode) noexcept;
  OutputMode output_mode() const noexcept { return output_mode_; }

  // Elements per replica moved toward the device ahead of use.
  // kMinPrefetchDepth..kMaxPrefetchDepth (1..255).
  Options& prefetch_depth(std::uint32_t depth);
  std::uint32_t prefetch_depth() const noexcept { return host_io_.prefetch_depth; }

  // Infeed lane capacity per replica, elements. The setter takes 1..kMaxQueueCapacity;
  // validate() also asks for at least prefetch_depth.
  Options& infeed_capacity(std::size_t elements);
  std::size_t infeed_capacity() const noexcept { return infeed_capacity_; }

  // Outfeed capacity, entries; 0 = unbounded. 0..kMaxQueueCapacity. (With
  // consumer_type(kSingle): per replica, and validate() asks for at least 1.)
  Options& outfeed_capacity(std::size_t entries);
  std::size_t outfeed_capacity() const noexcept { return outfeed_capacity_; }

  // One producer thread per infeed (kSingle: a ring per lane, faster) or several (kMulti,
  // default); one reading thread per outfeed (kSingle: a ring per replica, needs a bounded
  // outfeed_capacity) or several (kMulti, default). InfeedConfig::producer_type and
  // OutfeedConfig::consumer_type take them. Never throw.
  Options& producer_type(ProducerType type) noexcept;
  ProducerType producer_type() const noexcept { return producer_type_; }
  Options& consumer_type(ConsumerType type) noexcept;
  ConsumerType consumer_type() const noexcept { return consumer_type_; }

  // The host side of the run (host_io(); prefetch_depth above is its fourth field).
  // Tiles per device reserved for I/O (stream copies overlapping compute): 0, or an even
  // number below tiles; the setter checks evenness, validate() the bound (each entry point
  // also checks that the I/O tiles hold prefetch_depth of what crosses the link).
  Options& io_tiles(std::uint32_t tiles);
  std::uint32_t io_tiles() const noexcept { return host_io_.io_tiles; }
  // The modeled host link (default LinkModel::host(): 10 GB/s, 5 us per copy). Throws what
  // LinkModel::validate("host link") throws.
  Options& host_link(const LinkModel& link);
  const LinkModel& host_link() const noexcept { return host_io_.host_link; }
  // No host copies: an Engine's device generates its input (random normal); a Pipeline or a
  // loop reads one element per replica and reuses it every iteration. Never throws.
  Options& synthetic_data(bool on) noexcept;
  bool synthetic_data() const noexcept { return host_io_.synthetic_data; }

  // Device memory: tiles x bytes per tile (DeviceConfig::tiles, bytes_per_tile). tiles
  // 1..kMaxTiles; bytes_per_tile kArenaAlignment..kMaxBytesPerTile.
  Options& tiles(std::uint32_t n);
  std::uint32_t tiles() const noexcept { return tiles_; }
  Options& bytes_per_tile(std::size_t bytes);
  std::size_t bytes_per_tile() const noexcept { return bytes_per_tile_; }

  // What a real IPU would take for the devices' declared work: the modeled clock's figures
  // (DeviceConfig::model; default DeviceModel::mk2()). Throws what DeviceModel::validate()
  // throws.
  Options& device_model(const DeviceModel& model);
  const DeviceModel& device_model() const noexcept { return device_model_; }
  // The modeled link between devices (EngineConfig and PipelineConfig::device_link; default
  // LinkModel::device(): 32 GB/s, 1 us). Throws what LinkModel::validate("device link")
  // throws.
  Options& device_link(const LinkModel& link);
  const LinkModel& device_link() const noexcept { return device_link_; }

  // How a Pipeline stores and accumulates values (PipelineConfig::from copies it): fp32
  // (default) or fp16 storage, fp32 or fp16 partials, static loss scaling. Throws what
  // Precision::validate() throws.
  Options& precision(const Precision& p);
  const Precision& precision() const noexcept { return precision_; }

  // Pin device threads to cores (DeviceConfig::pin; needs hwloc, without it devices run
  // unpinned). Never throws.
  Options& pin(bool on) noexcept;
  bool pin() const noexcept { return pin_; }

  // When a run cannot make progress (StallCheck, bspflow/run/stall.hpp): how long every
  // running device may wait with none moving before the run says what each waits for
  // (0: no check; else kMinRunStallLimit..kMaxRunStallLimit, 1 ms..24 h; default 30 s), and
  // whether it then ends with StallError (OnStall::kFail) or only logs (kLog, the default).
  // run_stall_limit throws what StallCheck::validate() throws; on_stall never throws.
  // EngineConfig::from and PipelineConfig::from take both; a loop takes the Options (or
  // their stall_check()) as a feed.
  Options& run_stall_limit(std::chrono::nanoseconds limit);
  std::chrono::nanoseconds run_stall_limit() const noexcept { return stall_.limit; }
  Options& on_stall(OnStall action) noexcept;
  OnStall on_stall() const noexcept { return stall_.on_stall; }
  const StallCheck& stall_check() const noexcept { return stall_; }

  // Any thread. Cross-option rules (io_tiles below tiles, infeed_capacity >=
  // prefetch_depth, a bounded outfeed_capacity with consumer_type kSingle). Never blocks,
  // never allocates. Throws bspflow::Error naming the field, the value and what is allowed.
  void validate() const;

  // Any thread. micro_batch x device_iterations x gradient_accumulation x replicas. Never
  // blocks, never allocates. Throws bspflow::Error naming the field, the value and what is
  // allowed if micro_batch is 0, or bspflow::Error if the product overflows 64 bits.
  std::uint64_t samples_per_step(std::uint64_t micro_batch) const;

  // Any thread. Configs for the rooms below these options (each calls validate(), and
  // throws what it throws). Never blocks, never allocates.
  //   infeed_config():   replicas, infeed_capacity, prefetch_depth, producer_type
  //   outfeed_config():  replicas, output_mode, outfeed_capacity, consumer_type
  //   device_config():   tiles, bytes_per_tile, pin, device_model
  //   host_io():         host_link, io_tiles, prefetch_depth, synthetic_data (a loop's
  //                      host link, and the host side of an Engine's or Pipeline's config)
  // The rooms above build theirs: EngineConfig::from(options), PipelineConfig::from(options),
  // StreamConfig::from(options). Every other field of a config keeps its default.
  InfeedConfig infeed_config() const;
  OutfeedConfig outfeed_config() const;
  DeviceConfig device_config() const;
  HostIO host_io() const;

  // Any thread. One line per option, "name = value". Never blocks; allocates (the returned
  // string). Throws only std::bad_alloc.
  std::string describe() const;

 private:
  std::uint64_t device_iterations_ = 1;
  std::uint32_t replicas_ = 1;
  std::uint32_t gradient_accumulation_ = 1;
  OutputMode output_mode_ = OutputMode::all();
  HostIO host_io_{};  // host_link, io_tiles, prefetch_depth, synthetic_data
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
