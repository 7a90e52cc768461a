// Internal (not installed): a distributed Pipeline's second level of gradient reduction,
// across instances. Per step, each device slot of local replica 0 writes its stages'
// gradients (already summed over the local replicas) into its segment of one buffer and
// posts it; the host thread (the one in Pipeline::run, which otherwise only waits) then
// makes one MPI_Allreduce of the whole buffer, with a small tail per instance saying
// whether it contributes (or stopped), how many steps its run has and, every few steps, a
// checksum of its weights; the devices wait for the result. One collective per step, made
// by every instance in the same order: a step is applied everywhere or nowhere, and an
// instance that stops (failure, end of data, cancel) still makes the step's call, so no
// instance waits for a collective that will never come.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/runtime/instance.hpp"

namespace bspflow::detail {

class InstanceReduction {
 public:
  // Floats each instance adds after the gradients: code, steps (3), checksum flag,
  // checksum (3).
  static constexpr std::size_t kTail = 8;

  // Host thread. `slot_sizes`: floats per device slot (each slot posts once per step).
  // `check_interval`: a weight checksum every that many steps (counted over every run;
  // 0: never). Allocates.
  InstanceReduction(Instance& instance, std::vector<std::size_t> slot_sizes, std::uint32_t check_interval);

  // Host thread, before a run of `steps` (>= 1) steps. Never blocks.
  void begin_run(std::uint64_t steps);

  // Device thread of `slot`: where its gradients go for the current step. Never blocks.
  std::span<float> segment(std::uint32_t slot) noexcept;
  // Device thread: whether run-relative `step` carries a weight checksum.
  bool check_due(std::uint64_t step) const noexcept;
  // Device thread of `slot`: its segment is filled for run-relative `step` (`checksum`: of
  // its stages' weights when check_due(step), else ignored). Blocks (spin `spin`, then
  // park) until the step's exchange is done; returns whether the step is applied in every
  // instance (then the segment holds the sum over the instances). Throws bspflow::Error if
  // `step` is not the one being exchanged (an internal schedule error).
  bool exchange(std::uint32_t slot, std::uint64_t step, std::uint64_t checksum, Spin spin);
  // Any thread, after exchange(step) returned in some slot. Never blocks.
  bool applied(std::uint64_t step) const noexcept { return step < applied_.load(std::memory_order_acquire); }

  // Host thread, during the run: the run's exchanges, one per step, until every step is
  // done or one is not applied (then `cancel` stops this instance's run). `stop`: this
  // instance's run has stopped; wake() makes serve() look at it. Never throws: an MPI error
  // ends the run (error()).
  void serve(const StopFlag& stop, const std::function<void()>& cancel) noexcept;
  // Any thread. Never blocks, never throws.
  void wake() noexcept;

  // Host thread, after the run. Steps applied in every instance.
  std::uint64_t applied_steps() const noexcept { return applied_.load(std::memory_order_acquire); }
  // Whether a step was not applied although this instance contributed to it: another
  // instance stopped (or a mismatch, see mismatch()).
  bool stopped_by_peer() const noexcept { return stopped_by_peer_; }
  // "" or what did not match across instances (the weight checksums, the runs' step
  // counts), said the same way in every instance.
  const std::string& mismatch() const noexcept { return mismatch_; }
  std::exception_ptr error() const noexcept { return error_; }
  std::size_t payload() const noexcept { return payload_; }  // gradient floats per step
  // Whether serve() ran this run (a run that failed before its devices started did not:
  // then the caller serves with a stopped flag, so the others' step 0 gets its partner).
  bool served() const noexcept { return served_; }

 private:
  void exchange_step(bool contributing);

  Instance& instance_;
  std::vector<std::size_t> offsets_;  // per slot, into wire_
  std::vector<std::size_t> sizes_;
  std::size_t payload_ = 0;
  std::uint32_t check_interval_;
  std::vector<float> wire_;     // gradients of every slot, then count x kTail
  std::vector<float> stopped_;  // what a stopped instance sends: zeros, then the tail
  std::vector<std::atomic<std::uint64_t>> checksums_;  // per slot, written before its post

  std::uint64_t steps_ = 0;        // this run's
  std::uint64_t total_steps_ = 0;  // steps exchanged before this run (for check_interval)
  std::uint64_t current_ = 0;      // the step being exchanged
  std::atomic<std::uint32_t> posted_{0};
  std::atomic<std::uint64_t> done_{0};     // steps whose exchange has finished, this run
  std::atomic<std::uint64_t> applied_{0};  // of those, applied in every instance
  std::atomic<bool> closed_{false};        // serve() has returned: nothing more is exchanged
  bool stopped_by_peer_ = false;
  bool served_ = false;
  std::string mismatch_;
  std::exception_ptr error_;
  WaitPoint host_point_, device_point_;
};

}  // namespace bspflow::detail
