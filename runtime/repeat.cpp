// loops::repeat's non-template parts: LoopConfig and a replica's host link.
#include "bspflow/runtime/repeat.hpp"

namespace bspflow::loops {

LoopConfig LoopConfig::from(const Options& options) {
  options.validate();
  LoopConfig c;
  c.host_link = options.host_link();
  c.io_tiles = options.io_tiles();
  c.synthetic_data = options.synthetic_data();
  return c;
}

void LoopConfig::validate() const {
  if (io_tiles % 2 != 0) {
    bspflow::detail::throw_bad_value("LoopConfig::io_tiles", io_tiles, "must be 0 or an even number");
  }
  host_link.validate("host link");
}

namespace detail {

ReplicaLink::ReplicaLink(const LoopConfig& config, Device& device, std::uint32_t replica,
                         std::uint32_t prefetch_depth)
    : timeline(HostLinkTimeline::Shape{config.host_link, config.io_tiles, device.config().bytes_per_tile,
                                       prefetch_depth, device.id(), device.placement().shares_core()}),
      synthetic(config.synthetic_data) {
  if (config.io_tiles == 0 || config.synthetic_data) return;  // synthetic: nothing crosses
  if (config.io_tiles >= device.config().tiles) {
    bspflow::detail::throw_bad_value("LoopConfig::io_tiles", config.io_tiles,
                                     "must be below device " + std::to_string(device.id()) + "'s tiles (" +
                                         std::to_string(device.config().tiles) + "), leaving tiles for compute");
  }
  arena_ = &device.arena();
  io_tiles_ = arena_->allocate(std::size_t{config.io_tiles} * device.config().bytes_per_tile,
                               "I/O tiles (loop, replica " + std::to_string(replica) + ")");
}

ReplicaLink::~ReplicaLink() {
  if (io_tiles_) arena_->release(io_tiles_);
}

}  // namespace detail
}  // namespace bspflow::loops
