/// @file
/// HostLinkTimeline: one device's host link as a timeline of stream copies, in (host to
/// device) and out (device to host), for a device thread that moves its own data: a
/// loops::repeat replica and a Pipeline's first and last stages use it.
/// Guide: devices/README.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "bspflow/base/stop_flag.hpp"
#include "bspflow/devices/device_model.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/devices/link_model.hpp"
#include "bspflow/devices/modeled_clock.hpp"

namespace bspflow {

/// One device's host link as a timeline of stream copies. Without I/O tiles each copy starts
/// when the device asks for it (or when the link is free) and the device waits for it to end.
/// With I/O tiles the tiles copy while the device computes: copy k in starts when its I/O-tile
/// buffer (k mod prefetch_depth) is free again and the link is free (or, when the element
/// reached an empty lane just now, no earlier than now), and the device waits only for what
/// is left of it; an output is dropped into an I/O-tile buffer, and the device waits only
/// while the copy that last used that buffer still runs. Durations come from the LinkModel; a
/// link that costs nothing reads no clock.
/// Not thread-safe: the host sets it up, then one device thread makes the copies; its counters
/// may be read by any thread once that thread is done (a run's end).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class HostLinkTimeline {
 public:
  /// The clock the timeline's time points are on.
  using Clock = std::chrono::steady_clock;

  /// What the timeline models: one device's link and I/O tiles.
  struct Shape {
    /// The link, the I/O tiles (0: every copy waited for), prefetch_depth (I/O-tile buffers
    /// per direction) and synthetic_data (not read here: a caller with synthetic data makes
    /// no copies).
    HostIO host_io{};
    std::size_t bytes_per_tile = 0;      ///< the device's, for the I/O tiles' room
    std::uint32_t device = 0;            ///< named in errors
    bool shares_core = false;            ///< the device yields its core while it waits
    const char* element = "an element";  ///< what one copy in moves, for errors
  };

  /// A timeline of `shape` (2 x prefetch_depth time points). The shape is the caller's,
  /// already validated (an Engine checks io_tiles and the link).
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  explicit HostLinkTimeline(const Shape& shape);
  /// A timeline of the default Shape.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  HostLinkTimeline() : HostLinkTimeline(Shape{}) {}

  /// The copies also advance `clock` (the device's modeled clock; null: none) in modeled time
  /// (ModeledLink), the hand-over between I/O tiles and compute tiles at `model`'s exchange
  /// rate.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  void attach(ModeledClock* clock, const DeviceModel& model) {
    clock_ = clock;
    handover_per_byte_ns_ = model.ns(1.0 / (model.exchange_bytes_per_tile_cycle *
                                            std::max<std::uint32_t>(shape_.host_io.io_tiles, 1)));
    handover_fixed_ns_ = model.ns(model.sync_cycles_on_chip);
    in_cost_ = out_cost_ = Cost{};
    modeled_.start(0, shape_.host_io.io_tiles, shape_.host_io.prefetch_depth);
  }

  /// Before a run, on the thread that then owns it (the host, or the device thread at its
  /// run's start): the link is free from `now`, every I/O-tile buffer empty, the counters
  /// zero (and, attached, the modeled link free from the clock's now).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  void start(Clock::time_point now) noexcept;

  /// An element of `bytes` was just taken off the infeed (`waited`: the lane was empty, so its
  /// copy could not have started earlier): waits until its modeled copy has ended. false:
  /// `stop` was set while waiting (the copy is not counted). Throws bspflow::Error naming the
  /// device, its I/O tiles' room, prefetch_depth and the element's bytes if the I/O tiles
  /// cannot hold prefetch_depth elements (checked for inputs; outputs go through the same
  /// buffers one at a time).
  /// Contract: device; blocks; no-alloc; throws Error.
  bool copy_in(std::size_t bytes, bool waited, const StopFlag* stop);
  /// An output of `bytes` leaves: waits until its copy has ended (without I/O tiles) or until
  /// its I/O-tile buffer is free (with them). false: `stop` was set while waiting.
  /// Contract: device; blocks; no-alloc; noexcept.
  bool copy_out(std::size_t bytes, const StopFlag* stop) noexcept;
  /// At the end of a run: waits until every output copy has ended (with I/O tiles the device
  /// did not wait for the last ones). false: `stop` was set while waiting.
  /// Contract: device; blocks; no-alloc; noexcept.
  bool finish_out(const StopFlag* stop) noexcept;

  /// Bytes copied in. These counters count copies that ended (or, out with I/O tiles, were
  /// handed to them).
  std::uint64_t bytes_in() const noexcept { return bytes_in_; }
  /// Bytes copied out.
  std::uint64_t bytes_out() const noexcept { return bytes_out_; }
  /// Copies in.
  std::uint64_t copies_in() const noexcept { return copies_in_; }
  /// Copies out.
  std::uint64_t copies_out() const noexcept { return copies_out_; }
  /// How long the device waited for the link (both directions).
  std::chrono::nanoseconds waited() const noexcept { return waited_; }
  /// The link and I/O tiles the timeline models.
  const Shape& shape() const noexcept { return shape_; }

 private:
  /// Waits from `now` until `until` (counted in waited_), setting `after` to when the wait
  /// ended (left alone if there was nothing to wait for). false: stopped.
  bool wait(Clock::time_point now, Clock::time_point until, const StopFlag* stop,
            Clock::time_point& after) noexcept;

  double handover_ns(std::size_t bytes) const noexcept {
    return shape_.host_io.io_tiles > 0
               ? static_cast<double>(bytes) * handover_per_byte_ns_ + handover_fixed_ns_
               : 0.0;
  }
  /// One direction's copy of `bytes`: its link time and its hand-over to the compute tiles.
  /// Kept for the last size seen (usually a run's only one: a Pipeline's copies are all of one
  /// size): the link's division and rounding and the hand-over are worked out once, not with
  /// every micro-batch.
  struct Cost {
    std::size_t bytes = ~std::size_t{0};  ///< none yet (no copy is that large)
    std::chrono::nanoseconds duration{0};
    double handover_ns = 0;
  };
  const Cost& cost_of(Cost& memo, std::size_t bytes) noexcept {
    if (memo.bytes != bytes) {
      memo.duration = shape_.host_io.host_link.duration(bytes);
      memo.handover_ns = handover_ns(bytes);
      memo.bytes = bytes;
    }
    return memo;
  }

  ModeledLink& modeled_link() noexcept {
    if (modeled_pending_) start_modeled();
    return modeled_;
  }
  void start_modeled() noexcept;

  Shape shape_;
  ModeledClock* clock_ = nullptr;
  ModeledLink modeled_;
  bool modeled_pending_ = false;
  double handover_per_byte_ns_ = 0, handover_fixed_ns_ = 0;
  Cost in_cost_, out_cost_;  ///< cost_of's memos (reset by attach: the hand-over changes)
  Clock::time_point in_link_free_{}, out_link_free_{};
  std::vector<Clock::time_point> in_buffer_free_, out_buffer_free_;
  std::uint64_t copies_in_ = 0, copies_out_ = 0;
  std::uint64_t bytes_in_ = 0, bytes_out_ = 0;
  std::chrono::nanoseconds waited_{0};
};

}  // namespace bspflow
