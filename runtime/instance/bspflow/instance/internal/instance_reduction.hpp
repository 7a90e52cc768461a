// The instance room's internal API for the pipeline room (not for users, not installed): a
// distributed Pipeline's second level of gradient reduction,
// across instances, in buckets. Per step, each device slot of local replica 0 writes its
// stages' gradients (already summed over the local replicas) into its segment of one buffer
// and posts it. Consecutive segments, in call order (last slot first: the order a backward
// pass frees them, the last stage's device finishing first), make a bucket until it holds at
// least PipelineConfig::exchange_bucket_bytes; each bucket is one MPI_Allreduce, made as soon
// as its slots have posted and its turn has come, so it is reduced while earlier stages still
// compute (PyTorch DDP's bucketing). The last bucket (the one with slot 0) also carries a
// small tail per instance saying whether it contributes (or stopped), how many steps its run
// has and, every few steps, a checksum of its weights: it decides whether the step is
// applied. MPI runs at MPI_THREAD_SERIALIZED (any thread, one call at a time): a bucket's
// call is made by whoever finds it posted and its turn come, a slot posting into it or the
// thread that finished the bucket before (a turn word claimed by compare-and-swap, so
// exactly one thread makes each call, in order). No thread hand-off on the way: the host
// thread (the one in Pipeline::run) sleeps unless this instance stops, and then makes the
// rest of the step's calls itself, the buckets its devices did not post as zeros and the
// tail as stopped. Every instance makes the same calls in the same order: a step is applied
// everywhere or nowhere, and no instance waits for a collective that will never come.
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
#include "bspflow/instance/instance.hpp"

namespace bspflow::detail {

class InstanceReduction {
 public:
  // Floats each instance adds after the gradients: code, steps (3), checksum flag,
  // checksum (3).
  static constexpr std::size_t kTail = 8;

  // Host thread. `slot_sizes`: floats per device slot (each slot posts once per step).
  // `check_interval`: a weight checksum every that many steps (counted over every run;
  // 0: never). `bucket_bytes`: a bucket takes slots until it holds at least this many bytes
  // (0: a bucket per slot). Allocates.
  InstanceReduction(Instance& instance, std::vector<std::size_t> slot_sizes,
                    std::uint32_t check_interval, std::size_t bucket_bytes);

  // Host thread, before a run of `steps` steps. `cancel` stops this instance's run: called
  // (any thread) as soon as a step is known not to be applied everywhere, before the devices
  // waiting for that step are released. Never blocks.
  void begin_run(std::uint64_t steps, std::function<void()> cancel);

  // Device thread of `slot`: where its gradients go for the current step. Never blocks.
  std::span<float> segment(std::uint32_t slot) noexcept;
  // Device thread: whether run-relative `step` carries a weight checksum.
  bool check_due(std::uint64_t step) const noexcept;
  // Device thread of `slot`: its segment is filled for run-relative `step` (`checksum`: of
  // its stages' weights when check_due(step), else ignored). Makes the bucket's MPI call if
  // its turn has come (and the calls of the buckets posted after it), then blocks (spin
  // `spin`, then park) until the step's last bucket is done. Returns whether the step is
  // applied in every instance (then the segment holds the sum over the instances). Throws
  // bspflow::Error if `step` is not the one being exchanged (an internal schedule error). An
  // MPI error ends every instance (Instance::abort, after logging it): one instance's error
  // may not reach the others, which would wait for ever.
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
  // serve() look): then it makes the rest of the current step's calls itself, as stopped
  // (the buckets no device posted as zeros). Never throws.
  void serve(const StopFlag& stop) noexcept;
  // Host thread, for a run of 0 steps (begin_run(0)): this instance's part of one step's
  // calls, so an instance asked for 0 steps meets the others' step 0 (a step-count mismatch).
  void exchange_nothing() noexcept;
  // Any thread. Never blocks, never throws.
  void wake() noexcept;
  // Any thread: buckets per step, and the bucket calls finished this run. Never block.
  std::uint32_t buckets() const noexcept { return static_cast<std::uint32_t>(buckets_.size()); }
  std::uint64_t buckets_done() const noexcept {
    const std::uint64_t turn = turn_.load(std::memory_order_seq_cst);
    return turn == kClosed ? done_.load(std::memory_order_seq_cst) * buckets() : turn / 2;
  }

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
  // The turn word: 2n while bucket n (counted over the run: step * buckets() + its place
  // in the call order) may be claimed, 2n + 1 while its call is made; kClosed when nothing
  // more is exchanged this run.
  static constexpr std::uint64_t kClosed = ~std::uint64_t{0};
  // One call: slots `high` down to `low` (consecutive), wire_[begin, end) (with the tails
  // when low is 0).
  struct Bucket {
    std::uint32_t high, low;
    std::size_t begin, end;
  };
  // Whether every slot of bucket `b` posted run-relative `step`.
  bool posted(const Bucket& b, std::uint64_t step) const noexcept;
  // Makes the calls of the buckets whose turn has come, while they are posted (`host`: as
  // stopped, posted or not). Returns when a bucket is not posted, another thread holds the
  // turn, or the run's exchanges are over.
  void pump(bool host) noexcept;
  // The claimed bucket n's call (`nothing`: a run of 0 steps, only the step count matters).
  // The step's last bucket publishes the step's result. Never throws (an MPI error: abort).
  void send(std::uint64_t n, bool nothing) noexcept;
  // The step's last bucket, after its call: reads every instance's tail (`tails`), notes
  // who stopped and what did not match. Returns whether the step is applied everywhere.
  bool read_tails(std::uint64_t step, const float* tails);
  bool finished() const noexcept { return finished_.load(std::memory_order_seq_cst); }

  Instance& instance_;
  std::vector<std::size_t> offsets_;  // per slot, into wire_: slot S-1 first (the call order)
  std::vector<std::size_t> sizes_;
  std::size_t payload_ = 0;
  std::uint32_t check_interval_;
  std::vector<float> wire_;     // gradients of every slot, then count x kTail
  std::vector<float> stopped_;  // what a stopped instance sends: zeros, then the tail
  std::vector<std::atomic<std::uint64_t>> checksums_;  // per slot, written before its post
  std::vector<std::atomic<std::uint64_t>> posted_;     // per slot: 1 + the step it posted
  std::vector<Bucket> buckets_;                        // in call order

  std::function<void()> cancel_;
  std::uint32_t mismatch_instance_ = 0, stopped_instance_ = 0;
  std::uint64_t steps_ = 0;        // this run's
  std::uint64_t total_steps_ = 0;  // steps exchanged before this run (for check_interval)
  std::atomic<std::uint64_t> turn_{0};
  std::atomic<bool> stopping_{false};      // the host makes the rest of the calls, as stopped
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
