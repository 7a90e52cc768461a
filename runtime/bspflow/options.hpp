// Options: run-wide settings in the spirit of poptorch.Options. Each setter validates its
// value at once and throws bspflow::Error naming the option, the value given and what is
// allowed; validate() checks the rules that tie options together.
//
//   bspflow::Options opts;
//   opts.device_iterations(10).replication_factor(2).prefetch_depth(3);
//   bspflow::InfeedQueue<Sample> infeed(opts.infeed_config());
//
// Samples per host step = micro-batch x device iterations x gradient accumulation x replicas.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "bspflow/device.hpp"
#include "bspflow/infeed_queue.hpp"
#include "bspflow/outfeed_queue.hpp"
#include "bspflow/output_mode.hpp"
#include "bspflow/tunables.hpp"

namespace bspflow {

class Options {
 public:
  // Loop trips per host call (deviceIterations). >= 1.
  Options& device_iterations(std::uint64_t n);
  std::uint64_t device_iterations() const noexcept { return device_iterations_; }

  // Copies of the program on separate devices, each fed different data. 1..kMaxReplicas.
  Options& replication_factor(std::uint32_t n);
  std::uint32_t replication_factor() const noexcept { return replication_factor_; }

  // Micro-batches per weight update. >= 1.
  Options& gradient_accumulation(std::uint32_t n);
  std::uint32_t gradient_accumulation() const noexcept { return gradient_accumulation_; }

  Options& output_mode(OutputMode mode) noexcept;
  OutputMode output_mode() const noexcept { return output_mode_; }

  // Elements per replica moved toward the device ahead of use. 1..255.
  Options& prefetch_depth(std::uint32_t depth);
  std::uint32_t prefetch_depth() const noexcept { return prefetch_depth_; }

  // Infeed lane capacity per replica, elements. prefetch_depth..kMaxQueueCapacity.
  Options& infeed_capacity(std::size_t elements);
  std::size_t infeed_capacity() const noexcept { return infeed_capacity_; }

  // Outfeed capacity, entries; 0 = unbounded.
  Options& outfeed_capacity(std::size_t entries);
  std::size_t outfeed_capacity() const noexcept { return outfeed_capacity_; }

  // Tiles per device reserved for I/O (stream copies overlapping compute). 0, or an even
  // number below tiles_per_device. Used by the program Engine (EngineConfig::from), which
  // also checks that the I/O tiles hold one micro-batch; loops::repeat does not model them.
  Options& io_tiles(std::uint32_t tiles);
  std::uint32_t io_tiles() const noexcept { return io_tiles_; }

  // No host copies: the device generates its input (EngineConfig::from: random normal).
  Options& synthetic_data(bool on) noexcept;
  bool synthetic_data() const noexcept { return synthetic_data_; }

  // Device memory: tiles x bytes per tile.
  Options& tiles_per_device(std::uint32_t tiles);
  std::uint32_t tiles_per_device() const noexcept { return tiles_per_device_; }
  Options& bytes_per_tile(std::size_t bytes);
  std::size_t bytes_per_tile() const noexcept { return bytes_per_tile_; }

  // Pin device threads to cores (needs hwloc).
  Options& pin_devices(bool on) noexcept;
  bool pin_devices() const noexcept { return pin_devices_; }

  // Cross-option rules (io_tiles below tiles_per_device, infeed_capacity >= prefetch_depth).
  // Throws bspflow::Error.
  void validate() const;

  // micro_batch x device_iterations x gradient_accumulation x replication_factor.
  // Throws bspflow::Error if micro_batch is 0 or the product overflows.
  std::uint64_t samples_per_step(std::uint64_t micro_batch) const;

  // Configs for the pieces these options describe (each calls validate()).
  InfeedConfig infeed_config() const;
  OutfeedConfig outfeed_config() const;
  DeviceConfig device_config() const;

  // One line per option, "name = value".
  std::string describe() const;

 private:
  std::uint64_t device_iterations_ = 1;
  std::uint32_t replication_factor_ = 1;
  std::uint32_t gradient_accumulation_ = 1;
  OutputMode output_mode_ = OutputMode::all();
  std::uint32_t prefetch_depth_ = tunables::kDefaultPrefetchDepth;
  std::size_t infeed_capacity_ = tunables::kDefaultInfeedCapacity;
  std::size_t outfeed_capacity_ = tunables::kDefaultOutfeedCapacity;
  std::uint32_t io_tiles_ = 0;
  bool synthetic_data_ = false;
  std::uint32_t tiles_per_device_ = tunables::kDefaultTiles;
  std::size_t bytes_per_tile_ = tunables::kDefaultBytesPerTile;
  bool pin_devices_ = true;
};

}  // namespace bspflow
