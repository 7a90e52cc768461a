/// @file
/// `Run<State>`: the host's handle on a loop launched with loops::repeat_async, and what a
/// loop returns: `RepeatResult<State>` (a RunResult, bspflow/run/run_result.hpp, with the
/// loop's iterations and final states). Iteration: where one loop iteration runs. The shared
/// state behind a Run is machinery (detail/run_state.hpp).
/// Guide: runtime/loops/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/loops/detail/run_state.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

/// Where one loop iteration runs; an optional last argument of a loop body (passed by const
/// reference, valid for that call).
struct Iteration {
  std::uint32_t device = 0;   ///< the device's id (Device::id())
  std::uint32_t replica = 0;  ///< the device's index in the loop's device list
  std::uint64_t index = 0;    ///< 0-based iteration
  std::uint64_t count = 0;    ///< iterations requested
};

/// How a loop ended (RunResult; the host link is counted for a loop with a HostIO), and
/// its iterations and final states. A plain value: any thread may read it once Run::get()
/// has returned it.
template <class State>
struct RepeatResult : RunResult {
  std::uint64_t requested = 0;            ///< iterations asked for, per replica
  std::vector<std::uint64_t> iterations;  ///< iterations completed, per replica
  std::vector<State> states;              ///< final loop state, per replica (as each left it)
  /// With BSPFLOW_TRACE=FILE set: the loop's trace (one track per replica), also written to
  /// FILE; else null.
  std::shared_ptr<const Trace> trace;

  /// Replica `replica`'s final state. Throws std::out_of_range (not bspflow::Error: it is
  /// states.at()) if replica >= states.size().
  /// Contract: any; non-blocking; no-alloc; throws std::out_of_range.
  const State& state(std::uint32_t replica = 0) const { return states.at(replica); }
};

/// Handle on a running loop. Destroying it before the loop ends cancels the loop and waits
/// for it (like std::jthread), so the feeds the loop uses are never left dangling.
///
/// One handle, one owner: ready(), wait(), wait_for() and cancel() may be called from any
/// thread, but not while another thread calls get(), moves or destroys the handle.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class State>
class Run {
 public:
  /// An empty handle (valid() is false).
  Run() noexcept = default;
  /// Leaves the source empty.
  Run(Run&&) noexcept = default;
  /// First cancels the loop this handle holds (if any, and not yet ended) and blocks (spin,
  /// then park) until it has ended.
  /// Contract: host; blocks; no-alloc; noexcept.
  Run& operator=(Run&& o) noexcept {
    if (this != &o) {
      stop_and_wait();
      state_ = std::move(o.state_);
      on_stop_ = std::move(o.on_stop_);
    }
    return *this;
  }
  /// Cancels the loop if it has not ended and blocks (spin, then park) until it has.
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Run() { stop_and_wait(); }

  /// False for an empty handle (default-made, moved from, or after get()).
  bool valid() const noexcept { return state_ != nullptr; }
  /// Whether every replica has ended (false for an empty handle).
  bool ready() const noexcept { return state_ && state_->control.done(); }
  /// Blocks (spin, then park) until every replica has ended. Throws bspflow::Error on an
  /// empty handle.
  /// Contract: any; blocks; no-alloc; throws Error.
  void wait() const { checked().control.wait(); }
  /// Blocks (spin, then park) until every replica has ended, for at most `d`; returns
  /// ready(). Throws bspflow::Error on an empty handle.
  /// Contract: any; blocks; no-alloc; throws Error.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return checked().control.wait_for(std::chrono::duration_cast<std::chrono::nanoseconds>(d));
  }
  /// Stops the loop at each replica's next iteration or wait (a replica it stops ends as
  /// kCancelled). Idempotent; a no-op on an empty handle or after the end. (A std::stop_token
  /// given to loops::repeat_async as a feed does the same when stopped, as long as the handle
  /// lives.)
  void cancel() noexcept {
    if (state_) state_->control.cancel();
  }

  /// Blocks (spin, then park) until every replica has ended, then returns the result (once:
  /// the handle is empty afterwards, even when it throws). Throws bspflow::Error on an empty
  /// handle, DeviceError (device, replica, iteration, cause) if a replica's body threw or a
  /// device refused its job, StallError if the loop stalled with OnStall::kFail. With
  /// BSPFLOW_TRACE=FILE and no failure, also writes the trace to FILE (file I/O; a write
  /// failure is logged, not thrown).
  /// Contract: host; blocks; allocates; throws Error.
  RepeatResult<State> get() {
    auto s = std::move(state_);
    auto on_stop = std::move(on_stop_);
    if (!s)
      throw Error(
          "Run::get() on an empty Run: it was default-constructed, moved from, or get() was "
          "already called");
    s->control.wait();
    on_stop.reset();  // after the end: a stop requested while get() waited still landed
    RepeatResult<State> r;
    r.status = s->control.finish(r.iterations, r.message);
    r.requested = s->control.requested();
    r.elapsed = s->control.elapsed();
    r.modeled = s->control.modeled();
    r.states.reserve(s->states.size());
    for (auto& st : s->states) r.states.push_back(std::move(*st));
    for (const auto& l : s->links) {
      r.host_bytes_in += l.bytes_in;
      r.host_bytes_out += l.bytes_out;
      r.host_wait += l.wait;
    }
    if (s->trace) {
      s->trace->end_at_last_event();
      if (!s->trace_path.empty()) detail::write_trace_or_log(*s->trace, s->trace_path);
      r.trace = std::move(s->trace);
    }
    return r;
  }

 private:
  friend struct detail::RunAccess;
  /// What loops::repeat_async returns (through detail::RunAccess).
  Run(std::shared_ptr<detail::RunState<State>> s,
      std::unique_ptr<std::stop_callback<detail::CancelRun>> on_stop) noexcept
      : state_(std::move(s)), on_stop_(std::move(on_stop)) {}
  detail::RunState<State>& checked() const {
    if (!state_)
      throw Error(
          "Run: an empty handle: it was default-constructed, moved from, or get() was already "
          "called");
    return *state_;
  }
  void stop_and_wait() noexcept {
    if (!state_) return;
    if (!state_->control.done()) {
      state_->control.cancel();
      state_->control.wait();
    }
    on_stop_.reset();  // before the state it points into
    state_.reset();
  }
  std::shared_ptr<detail::RunState<State>> state_;
  /// The loop's std::stop_token feed, watched until the loop's end is read (get()) or the
  /// handle lets go (null: none). Points into *state_: reset before it.
  std::unique_ptr<std::stop_callback<detail::CancelRun>> on_stop_;
};

}  // namespace bspflow
