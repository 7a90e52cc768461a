/// @file
/// HostIO: the host side of a run, stated once: the modeled host link, the I/O tiles that move
/// elements while the device computes, how far ahead they move them, or that nothing crosses
/// at all. Options::host_io() builds one from a run's Options.
/// Guide: devices/README.md.
#pragma once

#include <cstdint>

#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/link_model.hpp"

namespace bspflow {

/// How elements cross the modeled host link. Every entry point that moves host data takes
/// one: loops::repeat (its last feed), and EngineConfig and PipelineConfig, which are HostIOs
/// with more fields; HostLinkTimeline::Shape holds one for one device's copies. A plain value
/// type.
struct HostIO {
  /// The modeled host link (default LinkModel::host(): 10 GB/s, 5 us per copy).
  LinkModel host_link = LinkModel::host();
  /// Tiles per device reserved for I/O: 0 (every copy waited for before compute), or an even
  /// number below the device's tiles (copies overlap compute; their memory, io_tiles x bytes
  /// per tile, is taken from the device's arena; a loop's and a Pipeline's must hold
  /// prefetch_depth elements, an Engine's one micro-batch).
  std::uint32_t io_tiles = 0;
  /// Elements per replica moved toward the device ahead of use, from kMinPrefetchDepth to
  /// kMaxPrefetchDepth (1 to 255). A loop with an infeed moves what the infeed prefetches
  /// (InfeedConfig::prefetch_depth; Options sets both from one value), not this field.
  std::uint32_t prefetch_depth = tunables::kDefaultPrefetchDepth;
  /// No host copies: the upper bound of device throughput that real data is measured
  /// against. What a device sees instead depends on the entry point (a loop and a Pipeline
  /// reuse one element per replica; an Engine generates its input, EngineConfig::synthetic_fill).
  bool synthetic_data = false;

  /// Checks each field on its own: throws bspflow::Error for an odd io_tiles, a prefetch_depth
  /// out of 1..255, or a host link that LinkModel::validate refuses. Whether io_tiles is below
  /// a device's tiles and holds what it must is checked where a run meets its devices.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

}  // namespace bspflow
