// loops::repeat: run n device iterations of a body on a device (or one replica per device
// of a group) without returning to the host (TF-IPU loops.repeat, PopTorch
// deviceIterations).
//
//   InfeedQueue<Pair> infeed;  OutfeedQueue<Result> outfeed;  Device device(0);
//   auto r = loops::repeat(device, 10, [](int& counter, Pair& x) {
//     ++counter;
//     return Result{x.a + x.b};
//   }, 0, infeed, outfeed);
//   // r.state() == 10, outfeed holds 10 entries
//
// One signature: repeat(devices, n, body, init, feeds...) and the same for repeat_async,
// where feeds are what the loop uses, each at most once, in any order: an InfeedQueue<In>&,
// an OutfeedQueue<Out>&, a const HostIO& (the modeled host link, Options::host_io()), and a
// std::stop_token. The token stops the loop when its stop is requested, as Run::cancel()
// does: requested before the call (or while it sets up), no replica takes anything from the
// infeed and the loop ends kCancelled with 0 iterations; later, at each replica's next
// iteration or wait. repeat_async's Run watches it until get() has returned or the handle
// is destroyed; repeat() until it returns (std::jthread's token gives a loop on that thread
// its shutdown for free).
//
// The body is called as body(State&, In&) with an infeed, body(State&) without one, each
// optionally with a trailing `const Iteration&`. With an outfeed its return value is the
// iteration's output (converted to Out), shaped by the outfeed's OutputMode; without one,
// what it returns is discarded. Each replica gets its own copy of the body and of the
// initial state; the host thread destroys the body's copies by the time Run::get() (or the
// Run handle's destructor) returns, and each replica's final state moves into the result.
//
// Ending: after n iterations (kCompleted); when a replica reads past a closed, drained
// infeed (kEndOfData — TF-IPU aborts the process here, bspflow ends the loop and says so);
// on cancel (kCancelled). A body exception stops every replica and reaches the host as
// DeviceError with device, replica and iteration; outfeed entries written before it are
// still delivered. Every device thread is left idle and joinable; nothing hangs.
//
// The feeds must have one lane per replica (replicas = devices.size()) and outlive the run
// (the Run handle waits for the loop when destroyed, so keep the feeds alive at least as
// long as it).
//
// The host link (a HostIO). Without one, elements move at memory speed (what the queue
// benchmarks measure). With one, each element taken off the infeed is a copy of
// host_bytes(element) bytes in, and each output the outfeed delivers (every iteration for
// all(), each n-th for every_n(n), one at the end for final() and sum(), measured as the last
// output) a copy out, timed by host_link (HostLinkTimeline): without I/O tiles the device
// waits for each copy; with io_tiles the tiles copy up to the infeed's prefetch_depth
// elements ahead while the body computes (their memory, io_tiles x bytes per tile, is taken
// from each device's arena for the run, and must hold prefetch_depth elements). A loop moves
// what its infeed prefetches: InfeedConfig::prefetch_depth (Options sets both from one
// value). synthetic_data: each replica reads one element from its lane and its body sees that
// same element (as left by the previous iteration) every iteration; nothing crosses the link
// in either direction: the upper bound real data is measured against.
// RepeatResult::host_bytes_in / host_bytes_out / host_wait say what crossed.
//
// Bytes of an element: host_bytes(element) if such a function is found by argument-dependent
// lookup (bspflow::Tensor, bspflow::Batch: data and labels; define one for your own types that
// own heap memory), else size() x sizeof(value) for a std::vector of trivially copyable
// values, else sizeof(T) for a trivially copyable T; any other type does not compile with a
// HostIO.
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
//
// Host thread. Does not wait for the loop: it queues one job per device and returns; the
// body runs on the device threads. Allocates (the run's shared state, a copy of the body
// and of the initial state per replica, each replica's infeed prefetch buffer in its
// device's arena). Throws, before anything runs: bspflow::Error if `devices` is empty, a
// feed's replica count differs from devices.size(), an infeed lane already has a reader
// (another loop or a Pipeline is consuming it) or the outfeed is already attached to a
// running loop; with a HostIO, bspflow::Error if it is invalid or its io_tiles are not below
// a device's tiles, and OutOfMemoryError if a device's arena cannot hold its I/O tiles;
// OutOfMemoryError (a bspflow::Error) if a device's arena cannot hold its prefetch buffer.
// A body exception, a device that refuses the job (shutting down), or I/O tiles that
// cannot hold prefetch_depth elements are not thrown here: Run::get() throws them as
// DeviceError (naming the device; for the I/O tiles, their room and the element's bytes).
// Logs a warning when an every_n outfeed would deliver no entry in n iterations. A call
// naming anything else than the feeds above does not compile (the message says what is
// allowed).
template <class State, class Body, class... Feeds>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        Feeds&&... feeds) {
  (void)detail::Feeds<Feeds...>{};  // checks the feeds (static_asserts)
  return detail::launch_with(devices, n, std::move(body), std::move(init), feeds...);
}

// ---- synchronous: returns the result when every replica has ended ----
//
// Host thread, not one of `devices`' own (it would wait for a job queued behind itself).
// Blocks (spin, then park) until every replica has ended, so an infeed must already hold
// enough elements (or be closed) or be fed by another thread. Allocates (as
// repeat_async). Throws what repeat_async throws, and, before anything runs (with an
// outfeed), bspflow::Error if a bounded outfeed's capacity is below the entries this run
// delivers plus those already in it (an earlier run's, unread; with ConsumerType::kSingle
// the fullest replica's ring) — nothing reads it until the call returns: read it first, use
// repeat_async and read while it runs, or capacity 0; then what Run::get() throws: DeviceError
// (device, replica, iteration, cause) if a replica's body threw. Returns the RepeatResult:
// kCompleted, kEndOfData or kCancelled (a device destroyed mid-run).
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
