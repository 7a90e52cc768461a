#include "bspflow/devices/host_link_timeline.hpp"

#include <algorithm>
#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device_tunables.hpp"
#include "bspflow/devices/io_engine.hpp"

namespace bspflow {

HostLinkTimeline::HostLinkTimeline(const Shape& shape)
    : shape_(shape), in_buffer_free_(std::max<std::uint32_t>(shape.host_io.prefetch_depth, 1)),
      out_buffer_free_(std::max<std::uint32_t>(shape.host_io.prefetch_depth, 1)) {}

void HostLinkTimeline::start(Clock::time_point now) noexcept {
  in_link_free_ = out_link_free_ = now;
  std::fill(in_buffer_free_.begin(), in_buffer_free_.end(), now);
  std::fill(out_buffer_free_.begin(), out_buffer_free_.end(), now);
  copies_in_ = copies_out_ = bytes_in_ = bytes_out_ = 0;
  waited_ = std::chrono::nanoseconds{0};
  modeled_pending_ = clock_ != nullptr;  // started at the first copy (see modeled_link())
}

void HostLinkTimeline::start_modeled() noexcept {
  // The device thread's clock is reset when its program starts, which may be after start()
  // (a Pipeline starts its links on the host thread): the modeled link starts then, when the
  // program did.
  modeled_.start(clock_->launched(), shape_.host_io.io_tiles, shape_.host_io.prefetch_depth);
  modeled_pending_ = false;
}

bool HostLinkTimeline::wait(Clock::time_point now, Clock::time_point until, const StopFlag* stop,
                            Clock::time_point& after) noexcept {
  // A wait shorter than tunables::kShortestRealWait is not made: it would end before the clock
  // reads that time it (two more), so the real time would land further from the model. The
  // link's timeline still holds the copy, so short copies add up: once their backlog reaches
  // that length, the device waits it out.
  if (until - now < tunables::kShortestRealWait) return true;
  const bool ok = wait_until_deadline(until, stop, shape_.shares_core);
  after = Clock::now();
  waited_ += after - now;
  return ok;
}

bool HostLinkTimeline::copy_in(std::size_t bytes, bool waited, const StopFlag* stop) {
  if (shape_.host_io.io_tiles > 0 && bytes != in_cost_.bytes) {  // a size seen fitted
    const std::size_t room = std::size_t{shape_.host_io.io_tiles} * shape_.bytes_per_tile;
    if (bytes * shape_.host_io.prefetch_depth > room) {
      throw Error("the I/O tiles of device " + std::to_string(shape_.device) + " (" +
                  std::to_string(shape_.host_io.io_tiles) + " x " +
                  format_bytes(shape_.bytes_per_tile) + " = " + format_bytes(room) +
                  ") cannot hold prefetch_depth " + std::to_string(shape_.host_io.prefetch_depth) +
                  " x " + shape_.element + " of " + format_bytes(bytes) +
                  ": raise io_tiles or lower prefetch_depth");
    }
  }
  const Cost& cost = cost_of(in_cost_, bytes);
  const std::chrono::nanoseconds duration = cost.duration;
  if (clock_ != nullptr) {
    modeled_link().copy_in(*clock_, static_cast<double>(duration.count()), cost.handover_ns);
  }
  if (duration.count() == 0) {  // a link that costs nothing: no clock to read
    bytes_in_ += bytes;
    ++copies_in_;
    return true;
  }
  const Clock::time_point now = Clock::now();
  Clock::time_point start = std::max(now, in_link_free_);
  Clock::time_point& buffer = in_buffer_free_[copies_in_ % in_buffer_free_.size()];
  if (shape_.host_io.io_tiles > 0) {
    // The copy could start once its I/O-tile buffer was free and the link was free; if the
    // lane was empty, only now.
    start = std::max(buffer, in_link_free_);
    if (waited) start = std::max(start, now);
  }
  const Clock::time_point done = start + duration;
  in_link_free_ = done;
  Clock::time_point consumed = now;
  if (!wait(now, done, stop, consumed)) return false;
  buffer = consumed;  // its I/O-tile buffer takes the element prefetch_depth later
  bytes_in_ += bytes;
  ++copies_in_;
  return true;
}

bool HostLinkTimeline::copy_out(std::size_t bytes, const StopFlag* stop) noexcept {
  const Cost& cost = cost_of(out_cost_, bytes);
  const std::chrono::nanoseconds duration = cost.duration;
  if (clock_ != nullptr) {
    modeled_link().copy_out(*clock_, static_cast<double>(duration.count()), cost.handover_ns);
  }
  if (duration.count() == 0) {
    bytes_out_ += bytes;
    ++copies_out_;
    return true;
  }
  const Clock::time_point now = Clock::now();
  const Clock::time_point done = std::max(now, out_link_free_) + duration;
  out_link_free_ = done;
  Clock::time_point until = done;  // without I/O tiles: the device waits for its copy
  if (shape_.host_io.io_tiles > 0) {
    Clock::time_point& buffer = out_buffer_free_[copies_out_ % out_buffer_free_.size()];
    until = buffer;
    buffer = done;
  }
  Clock::time_point after = now;
  if (!wait(now, until, stop, after)) return false;
  bytes_out_ += bytes;
  ++copies_out_;
  return true;
}

bool HostLinkTimeline::finish_out(const StopFlag* stop) noexcept {
  if (clock_ != nullptr) modeled_link().finish_out(*clock_);
  if (copies_out_ == 0 || shape_.host_io.io_tiles == 0) return true;  // nothing left in flight
  const Clock::time_point now = Clock::now();
  Clock::time_point after = now;
  return wait(now, out_link_free_, stop, after);
}

}  // namespace bspflow
