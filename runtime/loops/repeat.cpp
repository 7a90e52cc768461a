// loops::repeat's non-template part: a replica's host link.
#include "bspflow/loops/repeat.hpp"

namespace bspflow::loops::detail {

namespace {
// The loop's HostIO with the infeed's prefetch depth (what its reader moves ahead).
HostIO with_depth(HostIO io, std::uint32_t prefetch_depth) {
  io.prefetch_depth = prefetch_depth;
  return io;
}
}  // namespace

ReplicaLink::ReplicaLink(const HostIO& config, Device& device, std::uint32_t replica,
                         std::uint32_t prefetch_depth)
    : timeline(HostLinkTimeline::Shape{with_depth(config, prefetch_depth),
                                       device.config().bytes_per_tile, device.id(),
                                       device.placement().shares_core()}),
      synthetic(config.synthetic_data) {
  if (config.io_tiles == 0 || config.synthetic_data) return;  // synthetic: nothing crosses
  if (config.io_tiles >= device.config().tiles) {
    bspflow::detail::throw_bad_value("io_tiles", config.io_tiles,
                                     "must be below device " + std::to_string(device.id()) +
                                         "'s tiles (" + std::to_string(device.config().tiles) +
                                         "), leaving tiles for compute");
  }
  arena_ = &device.arena();
  io_tiles_ = arena_->allocate(std::size_t{config.io_tiles} * device.config().bytes_per_tile,
                               "I/O tiles (loop, replica " + std::to_string(replica) + ")");
}

ReplicaLink::~ReplicaLink() {
  if (io_tiles_) arena_->release(io_tiles_);
}

}  // namespace bspflow::loops::detail
