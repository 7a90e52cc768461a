// Internal (not installed): a distributed Pipeline's second level of gradient reduction,
// across instances. Per step, each device slot of local replica 0 writes its stages'
// gradients (already summed over the local replicas) into its segment of one buffer and
// posts it; the last slot to post makes one MPI_Allreduce of the whole buffer itself (MPI
// runs at MPI_THREAD_SERIALIZED: any thread, one call at a time), with a small tail per
// instance saying whether it contributes (or stopped), how many steps its run has and,
// every few steps, a checksum of its weights; the other slots wait for the result. No
// thread hand-off on the way: the host thread (the one in Pipeline::run) sleeps unless this
// instance stops, and then makes the call for the step the devices will not finish, with
// the stopped flag. One collective per step, made by every instance in the same order: a
// step is applied everywhere or nowhere, and no instance waits for a collective that will
// never come. Who makes a step's call is decided by one compare-and-swap (claim).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
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
  InstanceReduction(Instance& instance, std::vector<std::size_t> slot_sizes,
                    std::uint32_t check_interval);

  // Host thread, before a run of `steps` steps. `cancel` stops this instance's run: called
  // (any thread) as soon as a step is known not to be applied everywhere, before the devices
  // waiting for that step are released. Never blocks.
  void begin_run(std::uint64_t steps, std::function<void()> cancel);

  // Device thread of `slot`: where its gradients go for the current step. Never blocks.
  std::span<float> segment(std::uint32_t slot) noexcept;
  // Device thread: whether run-relative `step` carries a weight checksum.
  bool check_due(std::uint64_t step) const noexcept;
  // Device thread of `slot`: its segment is filled for run-relative `step` (`checksum`: of
  // its stages' weights when check_due(step), else ignored). The last slot to post makes
  // the step's MPI call; the others block (spin `spin`, then park) until it is done.
  // Returns whether the step is applied in every instance (then the segment holds the sum
  // over the instances). Throws bspflow::Error if `step` is not the one being exchanged
  // (an internal schedule error). An MPI error ends every instance (Instance::abort, after
  // logging it): one instance's error may not reach the others, which would wait for ever.
  bool exchange(std::uint32_t slot, std::uint64_t step, std::uint64_t checksum, Spin spin);
  // Device thread of a local replica r > 0: blocks until `step`'s exchange is done (made by
  // replica 0's devices or, if this instance stopped, the host). Returns applied(step).
  bool wait_done(std::uint64_t step, Spin spin);
  // Any thread, after exchange(step) returned in some slot. Never blocks.
  bool applied(std::uint64_t step) const noexcept {
    return step < applied_.load(std::memory_order_acquire);
  }

  // Host thread, during the run: sleeps until the run's exchanges are over (every step
  // done, or one not applied) or `stop` (this instance's run has stopped; wake() makes
  // serve() look): then it makes the call for the step the devices will not finish, as
  // stopped. Never throws.
  void serve(const StopFlag& stop) noexcept;
  // Host thread, for a run of 0 steps (begin_run(0)): this instance's part of one exchange,
  // so an instance asked for 0 steps meets the others' step 0 (a step-count mismatch).
  void exchange_nothing() noexcept;
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
  // With a mismatch: the first instance that differs from instance 0. With a step not
  // applied: the first instance that stopped (count() when none did).
  std::uint32_t mismatch_instance() const noexcept { return mismatch_instance_; }
  std::uint32_t stopped_instance() const noexcept { return stopped_instance_; }
  // Whether serve() ran this run (a run that failed before its devices started did not:
  // then the caller serves with a stopped flag, so the others' step 0 gets its partner).
  bool served() const noexcept { return served_; }

 private:
  // Claims run-relative `step`'s call for the calling thread. Exactly one thread wins.
  bool claim(std::uint64_t step) noexcept {
    std::uint64_t expected = step;
    return claimed_.compare_exchange_strong(expected, step + 1, std::memory_order_seq_cst);
  }
  // What this instance sends for a step: its gradients, or that it stopped, or (a run of
  // 0 steps) only its step count.
  enum class Kind { kContributing, kStopped, kNothing };
  static constexpr std::uint64_t kNoMoreClaims = ~std::uint64_t{0};
  // The claimed step's call; publishes the result. Never throws (an MPI error: abort).
  void exchange_step(std::uint64_t step, Kind kind) noexcept;
  bool finished() const noexcept { return finished_.load(std::memory_order_seq_cst); }

  Instance& instance_;
  std::vector<std::size_t> offsets_;  // per slot, into wire_
  std::vector<std::size_t> sizes_;
  std::size_t payload_ = 0;
  std::uint32_t check_interval_;
  std::vector<float> wire_;     // gradients of every slot, then count x kTail
  std::vector<float> stopped_;  // what a stopped instance sends: zeros, then the tail
  std::vector<std::atomic<std::uint64_t>> checksums_;  // per slot, written before its post

  std::function<void()> cancel_;
  std::uint32_t mismatch_instance_ = 0, stopped_instance_ = 0;
  std::uint64_t steps_ = 0;                // this run's
  std::uint64_t total_steps_ = 0;          // steps exchanged before this run (for check_interval)
  std::atomic<std::uint64_t> claimed_{0};  // steps whose call has been claimed, this run
  std::atomic<std::uint32_t> posted_{0};
  std::atomic<std::uint64_t> done_{0};     // steps whose exchange has finished, this run
  std::atomic<std::uint64_t> applied_{0};  // of those, applied in every instance
  std::atomic<bool> closed_{false};        // nothing more is exchanged this run
  // The host needs to look: every step done, or one not applied.
  std::atomic<bool> finished_{false};
  bool stopped_by_peer_ = false;
  bool served_ = false;
  std::string mismatch_;
  WaitPoint host_point_, device_point_;
  // What a device waiting for a step's exchange waits for (its run's stall check).
  WaitSite exchange_site_{WaitKind::kOther,
                          "the step's exchange across instances (every instance's devices, and "
                          "the MPI call)",
                          {}};
};

}  // namespace bspflow::detail
