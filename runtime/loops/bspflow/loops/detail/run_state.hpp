// Internal to loops (installed because loops::repeat's templates include it): one loop's
// shared state, held by its Run handle and by every replica's device job, and the one place a
// Run is made from it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/run/internal/run_control.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

template <class State>
class Run;

namespace detail {

// One loop's shared state: the Run handle and every replica's device job hold it.
template <class State>
struct RunState {
  RunState(std::uint32_t replicas, std::uint64_t requested)
      : control(replicas, requested), states(replicas), links(replicas) {}
  // The host thread (the Run handle's last copy): after every device job has detached.
  ~RunState() { control.wait_detached(); }
  RunState(const RunState&) = delete;
  RunState& operator=(const RunState&) = delete;
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
  // What the device jobs run (loops::repeat's replicas and their programs), freed with the
  // state on the host thread.
  std::shared_ptr<void> jobs;
  // Any thread. Replica `replica`'s track, or nullptr when not tracing. Never blocks, never
  // allocates, never throws.
  TraceTrack* track(std::uint32_t replica) const noexcept {
    return trace ? tracks[replica] : nullptr;
  }
};

// Makes the handle loops::repeat_async returns: a Run is made from its RunState only here
// (the constructor is private), with the callback that cancels it when the loop's
// std::stop_token is stopped (null: none). Never blocks, never allocates, never throws.
struct RunAccess {
  template <class State>
  static Run<State> make(std::shared_ptr<RunState<State>> state,
                         std::unique_ptr<std::stop_callback<CancelRun>> on_stop) noexcept {
    return Run<State>(std::move(state), std::move(on_stop));
  }
};

}  // namespace detail

}  // namespace bspflow
