/// @file
/// loops::repeat and loops::repeat_async: run n device iterations of a body on a device (or
/// one replica per device of a group) without returning to the host (TF-IPU loops.repeat,
/// PopTorch deviceIterations), with the feeds the loop uses given in any order.
/// Guide: runtime/loops/README.md.
#pragma once

#include <cstdint>
#include <utility>

#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/loops/detail/repeat_launch.hpp"
#include "bspflow/loops/run.hpp"
#include "bspflow/run/options.hpp"

namespace bspflow::loops {

// ---- asynchronous: returns at once with a Run handle ----

/// Runs `body` n times per replica (replica r on device r of `devices`) from a copy of
/// `init`, with `feeds`: any of `InfeedQueue<In>&`, `OutfeedQueue<Out>&`, `const HostIO&`,
/// `const Options&`, `const Work&`, `std::stop_token` and `const StallCheck&`, each at most
/// once, in any order (anything else does not compile). Queues one job per device and returns
/// the Run handle at once; the body runs on the device threads. Allocates the run's state, a
/// copy of the body and of `init` per replica, and each replica's prefetch buffer in its
/// device's arena.
/// Throws before anything runs: bspflow::Error for an empty `devices`, a feed whose replica
/// count differs from devices.size(), an infeed lane that already has a reader, an outfeed
/// attached to a running loop, an invalid HostIO or io_tiles not below a device's tiles;
/// OutOfMemoryError if an arena cannot hold the prefetch buffer or the I/O tiles. A body
/// exception, a refused job or I/O tiles too small for prefetch_depth elements reach
/// Run::get() as DeviceError. Logs a warning when an every_n outfeed would deliver no entry.
/// Contract: host; non-blocking; allocates; throws Error.
template <class State, class Body, class... Feeds>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        Feeds&&... feeds) {
  (void)detail::Feeds<Feeds...>{};  // checks the feeds (static_asserts)
  return detail::launch_with(devices, n, std::move(body), std::move(init), feeds...);
}

// ---- synchronous: returns the result when every replica has ended ----

/// repeat_async(...).get(): runs the loop and returns its result once every replica has
/// ended. Blocks (spin, then park) until then, so call it from a thread that is not one of
/// `devices`' own (it would wait for a job queued behind itself), with an infeed that already
/// holds enough elements (or is closed) or is fed by another thread. Throws what repeat_async
/// and Run::get() throw (DeviceError, StallError), and, before anything runs, bspflow::Error
/// if a bounded outfeed's capacity is below the entries this run delivers plus those already
/// in it (with ConsumerType::kSingle: the fullest replica's ring), since nothing reads it
/// until the call returns: read it first, use repeat_async and read while it runs, or use
/// capacity 0. Returns the RepeatResult: kCompleted, kEndOfData or kCancelled (a device
/// destroyed mid-run).
/// Contract: host; blocks; allocates; throws Error.
template <class State, class Body, class... Feeds>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           Feeds&&... feeds) {
  using OutQ = typename detail::Feeds<Feeds...>::Out;
  if constexpr (!std::is_same_v<OutQ, detail::NoFeed>) {
    detail::check_sync_outfeed(detail::find_feed<OutQ>(feeds...), n);
  }
  return repeat_async(devices, n, std::move(body), std::move(init), std::forward<Feeds>(feeds)...)
      .get();
}

}  // namespace bspflow::loops
