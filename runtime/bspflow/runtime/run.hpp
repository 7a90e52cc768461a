// How a run ended, for every entry point: RunStatus and RunResult (status, message, wall
// time, what crossed the host link). Each entry point's result extends RunResult with what it
// has more to say: RepeatResult<State> (loops::repeat), EngineResult, PipelineResult,
// StreamResult. Run<State> is the host's handle on a loop launched with
// loops::repeat_async; detail::RunControl is the shared state behind a Run and behind an
// Engine run.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/runtime/trace.hpp"

namespace bspflow {

// How a run ended. A loop, an Engine or a Pipeline that fails throws (DeviceError,
// StageError) instead of returning kFailed; a Stream with OnError::kFailFast returns kFailed.
enum class RunStatus {
  kCompleted,  // every replica ran all requested iterations; a Stream: its infeed was
               // closed and every accepted request answered
  kEndOfData,  // an infeed was closed and drained before the requested iterations
  kCancelled,  // cancel() (Run, Engine, Pipeline, Stream), or the Run handle, the Stream or
               // a device was destroyed mid-run
  kFailed,     // a Stream stopped at its first stage failure (OnError::kFailFast)
  kDrained = kCompleted,  // a Stream's old name for kCompleted (StreamStatus::kDrained)
};
// Any thread. "completed", "end of data", "cancelled", "failed". Never blocks, never
// allocates, never throws.
const char* to_string(RunStatus s) noexcept;

// What every run returns, extended by each entry point. A plain value: any thread may read
// it once the run has returned it.
struct RunResult {
  RunStatus status = RunStatus::kCompleted;
  std::string message;                  // one line saying how the run ended
  std::chrono::nanoseconds elapsed{0};  // wall time of the run
  // The modeled host link, all devices: bytes of elements in and of outputs out (none with
  // synthetic data, none for a loop without a HostIO or a Stream), and how long devices
  // waited for it.
  std::uint64_t host_bytes_in = 0, host_bytes_out = 0;
  std::chrono::nanoseconds host_wait{0};

  // Never blocks, never allocates, never throws.
  bool completed() const noexcept { return status == RunStatus::kCompleted; }
  bool end_of_data() const noexcept { return status == RunStatus::kEndOfData; }
  bool cancelled() const noexcept { return status == RunStatus::kCancelled; }
  bool failed() const noexcept { return status == RunStatus::kFailed; }
};

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
  std::uint64_t requested = 0;             // iterations asked for, per replica
  std::vector<std::uint64_t> iterations;   // iterations completed, per replica
  std::vector<State> states;               // final loop state, per replica (as each left it)
  // With BSPFLOW_TRACE=FILE set: the loop's trace (one track per replica), also written to
  // FILE; else null.
  std::shared_ptr<const Trace> trace;

  // Replica `replica`'s final state. Never blocks, never allocates. Throws std::out_of_range
  // (not bspflow::Error: it is states.at()) if replica >= states.size().
  const State& state(std::uint32_t replica = 0) const { return states.at(replica); }
};

namespace detail {

// The non-template part of a run's shared state: stop flag, completion, first failure.
// Shared by the host and every device thread of one run (loops::repeat_async, Engine::run).
class RunControl {
 public:
  struct Failure {
    std::uint32_t device = 0;
    std::uint32_t replica = 0;
    std::uint64_t iteration = 0;
    std::exception_ptr cause;
  };
  struct ReplicaEnd {
    std::uint32_t device = 0;
    std::uint64_t iterations = 0;
    RunStatus status = RunStatus::kCompleted;
    bool failed = false;
  };

  // Setup path. Allocates (one end record per replica). Throws only std::bad_alloc.
  RunControl(std::uint32_t replicas, std::uint64_t requested);

  // Any thread. Stops every replica at its next iteration or wait, and wakes feeds (calls
  // the waker while the run is open, under a mutex). Idempotent. Never blocks for long,
  // never throws.
  void cancel() noexcept;
  // Device thread (or the host thread, for a device that refused its job). Records a body
  // failure (first one wins; later ones are counted) and cancels the rest. Never blocks for
  // long, never throws.
  void fail(Failure f) noexcept;
  // Device thread (or the host thread, for an abandoned replica), once per replica, after it
  // released its feeds. The last one makes done() true and wakes waiters. Never blocks for
  // long, never allocates, never throws.
  void replica_done(std::uint32_t replica, ReplicaEnd end) noexcept;

  // Any thread. Never blocks, never allocates, never throws.
  const StopFlag& stop() const noexcept { return stop_; }
  std::uint64_t requested() const noexcept { return requested_; }
  // Any thread, once done(): from construction to the last replica's end.
  std::chrono::nanoseconds elapsed() const noexcept { return ended_ - started_; }
  bool done() const noexcept { return done_.load(std::memory_order_seq_cst); }
  // Any thread. Blocks (spin, then park) until done(). Never allocates.
  void wait() {
    done_point_.wait([&] { return done(); });
  }
  // Any thread. Blocks (spin, then park) until done() or for at most `d`; returns done().
  // Never allocates.
  bool wait_for(std::chrono::nanoseconds d) {
    return done_point_.wait_until([&] { return done(); }, std::chrono::steady_clock::now() + d);
  }
  // Setup path. Set once, before the run starts (not thread-safe against cancel()): wakes
  // whatever the replicas may be parked on. `waker` must not throw (cancel() is noexcept
  // and calls it). May allocate (the std::function).
  void set_waker(std::function<void()> waker) { waker_ = std::move(waker); }

  // Host thread, once, after done(): throws DeviceError if a replica failed; else the
  // overall status and message. Per-replica iterations are written to `iterations`. The
  // failure's exception moves into the DeviceError, so the host thread that reads it also
  // frees it (a device thread dropping the last reference would race with that read as far
  // as ThreadSanitizer can tell: exception_ptr counts references inside libsupc++).
  // Never blocks for long. Allocates (the message, `iterations`).
  RunStatus finish(std::vector<std::uint64_t>& iterations, std::string& message);

 private:
  // A count this large is no count: a run meant to go until its infeed ends (a service
  // loop asking for 2^62 iterations). Messages then leave the count out.
  bool open_ended() const noexcept { return requested_ >= (std::uint64_t{1} << 53); }
  // " of 10", or "" for an open-ended run. Allocates.
  std::string of_requested() const { return open_ended() ? std::string() : " of " + std::to_string(requested_); }

  StopFlag stop_;
  std::function<void()> waker_;  // touches the run's feeds: only while !done_
  // Orders waker_ calls against the end of the run: the last replica_done() sets done_ under
  // it, so a cancel() after the end (a device destructor, a late Run::cancel) never wakes
  // feeds the host may already have destroyed, and one during a wake keeps the run open.
  std::mutex wake_mutex_;
  std::uint64_t requested_;
  std::vector<ReplicaEnd> ends_;
  std::atomic<std::uint32_t> remaining_;
  std::atomic<bool> done_{false};
  WaitPoint done_point_;
  std::chrono::steady_clock::time_point started_, ended_;
  mutable std::mutex mutex_;
  std::optional<Failure> failure_;
  std::uint32_t more_failures_ = 0;
};

// Host thread. Writes a loop's trace; a failure is logged, not thrown (the run's result
// matters more). Blocks on file I/O; allocates. Never throws.
void write_trace_or_log(const Trace& trace, const std::string& path) noexcept;
// Any thread. BSPFLOW_TRACE, or "" when unset. Never blocks; may allocate (the returned
// string). Throws only std::bad_alloc.
std::string trace_path_from_env();

// One loop's shared state: the Run handle and every replica's device job hold it.
template <class State>
struct RunState {
  RunState(std::uint32_t replicas, std::uint64_t requested)
      : control(replicas, requested), states(replicas), links(replicas) {}
  RunControl control;
  std::vector<std::optional<State>> states;  // written by replica r's device thread only
  struct LinkTotals {
    std::uint64_t bytes_in = 0, bytes_out = 0;
    std::chrono::nanoseconds wait{0};
  };
  std::vector<LinkTotals> links;  // the host link, per replica (written as states)
  // With BSPFLOW_TRACE=FILE: one track per replica, written by its device thread, read by
  // the host after the run.
  std::unique_ptr<Trace> trace;
  std::vector<TraceTrack*> tracks;
  std::string trace_path;
  // Any thread. Replica `replica`'s track, or nullptr when not tracing. Never blocks, never
  // allocates, never throws.
  TraceTrack* track(std::uint32_t replica) const noexcept {
    return trace ? tracks[replica] : nullptr;
  }
};

}  // namespace detail

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
  // What loops::repeat_async returns. Never blocks, never allocates, never throws.
  explicit Run(std::shared_ptr<detail::RunState<State>> s) : state_(std::move(s)) {}
  // Leaves the source empty. Never blocks, never allocates, never throws.
  Run(Run&&) noexcept = default;
  // Host thread. First cancels the loop this handle holds (if any, and not yet ended) and
  // blocks (spin, then park) until it has ended. Never allocates, never throws.
  Run& operator=(Run&& o) noexcept {
    if (this != &o) {
      stop_and_wait();
      state_ = std::move(o.state_);
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
  // Never blocks for long, never throws.
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
    if (!s) throw Error("Run::get() on an empty Run: it was default-constructed, moved from, or get() was already called");
    s->control.wait();
    RepeatResult<State> r;
    r.status = s->control.finish(r.iterations, r.message);
    r.requested = s->control.requested();
    r.elapsed = s->control.elapsed();
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
  detail::RunState<State>& checked() const {
    if (!state_) throw Error("Run: an empty handle: it was default-constructed, moved from, or get() was already called");
    return *state_;
  }
  void stop_and_wait() noexcept {
    if (!state_) return;
    if (!state_->control.done()) {
      state_->control.cancel();
      state_->control.wait();
    }
    state_.reset();
  }
  std::shared_ptr<detail::RunState<State>> state_;
};

}  // namespace bspflow
