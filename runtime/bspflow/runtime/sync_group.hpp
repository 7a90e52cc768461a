// SyncGroup: the barrier of a BSP superstep across devices (program::Sync).
#pragma once

#include <atomic>
#include <cstdint>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/spin.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

// A barrier across `participants` devices. The arrival count and the generation share one
// atomic word, so the last arrival opens the barrier on the cache line it already holds
// (one line moves between cores per arrival, asked for writing from the start, and one per
// release, the least a barrier can do). Waiting spins briefly (tunables::kSpinBudget), then parks,
// so it is live with more devices than cores.
class SyncGroup {
 public:
  explicit SyncGroup(std::uint32_t participants);
  // Device thread. Returns when every participant has arrived (true), or when `stop` is set
  // or the group was aborted (false; the group is then unusable for this run). Spin::kYield
  // for a device that shares its core: it gives the core to the others between checks.
  // `modeled`: this device's modeled clock in, the latest of every participant's out (the
  // time they go on together; null: no modeled clock).
  bool arrive_and_wait(const StopFlag& stop, Spin spin = Spin::kTight, double* modeled = nullptr);
  // Device thread: a participant that will not arrive again this run (its infeed ended).
  // Every wait on the group, now and until reset(), returns false, so the others end at
  // their next Sync instead of waiting for it forever; what they do before it still runs.
  // Never blocks, never throws.
  void abort() noexcept;
  // Any thread: whether abort() was called this run.
  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  // Any thread: wakes parked participants so they re-check their stop flag.
  void wake() noexcept { point_.notify(); }
  // Between runs only (nobody waiting): forgets arrivals of a run that was stopped midway,
  // and an abort.
  void reset() noexcept {
    state_.store(0, std::memory_order_relaxed);  // relaxed: no waiters
    modeled_[0].store(0, std::memory_order_relaxed);
    modeled_[1].store(0, std::memory_order_relaxed);
    aborted_.store(false, std::memory_order_relaxed);
  }
  std::uint32_t participants() const noexcept { return participants_; }
  // Any thread: participants arrived in the current round (approximate while they arrive).
  // Never blocks, never throws.
  std::uint32_t arrived() const noexcept {
    // relaxed: a moment's view, for reports.
    return static_cast<std::uint32_t>(state_.load(std::memory_order_relaxed) & kCountMask);
  }

 private:
  static constexpr std::uint64_t kCountMask = 0xffff'ffffu;  // low half: arrivals this round
  static std::uint64_t generation(std::uint64_t state) noexcept { return state >> 32; }

  const std::uint32_t participants_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> state_{
      0};                             // generation << 32 | arrivals
  std::atomic<bool> aborted_{false};  // on state_'s line: read at every arrival
  // The latest modeled clock of the arrivals, by generation parity (a non-negative double's
  // bits order as the double), on state_'s line: written just before each arrival.
  std::atomic<std::int64_t> modeled_[2] = {};
  detail::WaitPoint point_;
  detail::WaitSite site_;  // what a device waiting here waits for (a run's stall check)
};

}  // namespace bspflow
