// HostIO: the host side of a run, stated once. How elements cross the modeled host link
// (host_link), how many tiles move them while the device computes (io_tiles), how far
// ahead they move (prefetch_depth), or that nothing crosses at all (synthetic_data).
//
// Every entry point that moves host data takes it: loops::repeat (its last feed), EngineConfig and
// PipelineConfig (each is a HostIO with more fields) and HostLinkTimeline::Shape (one device's
// copies). Options::host_io() derives it from the run's Options, so a run states these once.
//
//   bspflow::Options opts;
//   opts.io_tiles(32).prefetch_depth(3);    // copies overlap compute, 3 elements ahead
//   bspflow::HostIO io = opts.host_io();    // the same four fields, validated together
//
// A plain value type: any thread may read a const one. validate() checks the ranges of the
// fields on their own; io_tiles against a device's tiles and the room they need are checked
// where a run meets its devices.
#pragma once

#include <cstdint>

#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/link_model.hpp"

namespace bspflow {

struct HostIO {
  // The modeled host link (default LinkModel::host(): 10 GB/s, 5 us per copy).
  LinkModel host_link = LinkModel::host();
  // Tiles per device reserved for I/O: 0 (every copy waited for before compute), or an even
  // number below the device's tiles (copies overlap compute; their memory, io_tiles x bytes
  // per tile, is taken from the device's arena; a loop's and a Pipeline's must hold
  // prefetch_depth elements, an Engine's one micro-batch).
  std::uint32_t io_tiles = 0;
  // Elements per replica moved toward the device ahead of use, kMinPrefetchDepth..
  // kMaxPrefetchDepth (1..255). A loop with an infeed moves what the infeed prefetches
  // (InfeedConfig::prefetch_depth; Options sets both from one value), not this field.
  std::uint32_t prefetch_depth = tunables::kDefaultPrefetchDepth;
  // No host copies: the upper bound of device throughput that real data is measured
  // against. What a device sees instead depends on the entry point (a loop and a Pipeline
  // reuse one element per replica; an Engine generates its input, EngineConfig::synthetic_fill).
  bool synthetic_data = false;

  // Any thread. Throws bspflow::Error naming the field, the value given and what is allowed
  // (an odd io_tiles, a prefetch_depth out of 1..255, a host link LinkModel::validate
  // refuses). Never blocks; allocates only for the message.
  void validate() const;
};

}  // namespace bspflow
