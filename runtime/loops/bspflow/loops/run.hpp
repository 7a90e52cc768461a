// Run<State>: the host's handle on a loop launched with loops::repeat_async, and what a
// loop returns: RepeatResult<State> (a RunResult, bspflow/run/run_result.hpp, with the
// loop's iterations and final states). Iteration: where one loop iteration runs. The shared
// state behind a Run is machinery (detail/run_control.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/run/detail/run_control.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

// Where one loop iteration runs; an optional last argument of a loop body (passed by const
// reference, valid for that call).
struct Iteration {
  std::uint32_t device = 0;
  std::uint32_t replica = 0;
  std::uint64_t index = 0;  // 0-based iteration
  std::uint64_t count = 0;  // iterations requested
};

// A plain value: any thread may read it once Run::get() has returned it.
// How a loop ended (RunResult; the host link is counted for a loop with a HostIO), and
// its iterations and final states.
template <class State>
struct RepeatResult : RunResult {
  std::uint64_t requested = 0;            // iterations asked for, per replica
  std::vector<std::uint64_t> iterations;  // iterations completed, per replica
  std::vector<State> states;              // final loop state, per replica (as each left it)
  // With BSPFLOW_TRACE=FILE set: the loop's trace (one track per replica), also written to
  // FILE; else null.
  std::shared_ptr<const Trace> trace;

  // Replica `replica`'s final state. Never blocks, never allocates. Throws std::out_of_range
  // (not bspflow::Error: it is states.at()) if replica >= states.size().
  const State& state(std::uint32_t replica = 0) const { return states.at(replica); }
};

// Handle on a running loop. Destroying it before the loop ends cancels the loop and waits
// for it (like std::jthread), so the feeds the loop uses are never left dangling.
//
// One handle, one owner: ready(), wait(), wait_for() and cancel() may be called from any
// thread, but not while another thread calls get(), moves or destroys the handle.
template <class State>
class Run {
 public:
  // An empty handle (valid() is false). Never blocks, never allocates, never throws.
  Run() = default;
  // Leaves the source empty. Never blocks, never allocates, never throws.
  Run(Run&&) noexcept = default;
  // Host thread. First cancels the loop this handle holds (if any, and not yet ended) and
  // blocks (spin, then park) until it has ended. Never allocates, never throws.
  Run& operator=(Run&& o) noexcept {
    if (this != &o) {
      stop_and_wait();
      state_ = std::move(o.state_);
      on_stop_ = std::move(o.on_stop_);
    }
    return *this;
  }
  // Host thread. Cancels the loop if it has not ended and blocks (spin, then park) until
  // it has. Never allocates, never throws.
  ~Run() { stop_and_wait(); }

  // Any thread. False for an empty handle (default-made, moved from, or after get()).
  // Never blocks, never allocates, never throws.
  bool valid() const noexcept { return state_ != nullptr; }
  // Any thread. Every replica has ended (false for an empty handle). Never blocks, never
  // allocates, never throws.
  bool ready() const noexcept { return state_ && state_->control.done(); }
  // Any thread. Blocks (spin, then park) until every replica has ended. Never allocates.
  // Throws bspflow::Error on an empty handle.
  void wait() const { checked().control.wait(); }
  // Any thread. Blocks (spin, then park) for at most `d`; returns ready(). Never
  // allocates. Throws bspflow::Error on an empty handle.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return checked().control.wait_for(std::chrono::duration_cast<std::chrono::nanoseconds>(d));
  }
  // Any thread. Stops the loop at each replica's next iteration or wait (a replica it
  // stops ends as kCancelled). Idempotent; a no-op on an empty handle or after the end.
  // (A std::stop_token given to loops::repeat_async as a feed does the same when stopped,
  // as long as the handle lives.) Never blocks for long, never throws.
  void cancel() noexcept {
    if (state_) state_->control.cancel();
  }

  // Host thread. Blocks (spin, then park) until every replica has ended, then returns the
  // result (once: the handle is empty afterwards, even when it throws). Allocates (the
  // result). Throws bspflow::Error on an empty handle, DeviceError (device, replica,
  // iteration, cause) if a replica's body threw or a device refused its job. With
  // BSPFLOW_TRACE=FILE and no failure, also writes the trace to FILE (blocking on file
  // I/O; a write failure is logged, not thrown).
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
  // What loops::repeat_async returns (through detail::RunAccess).
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
  // The loop's std::stop_token feed, watched until the loop's end is read (get()) or the
  // handle lets go (null: none). Points into *state_: reset before it.
  std::unique_ptr<std::stop_callback<detail::CancelRun>> on_stop_;
};

}  // namespace bspflow
