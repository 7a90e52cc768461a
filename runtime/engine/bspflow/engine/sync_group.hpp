/// @file
/// SyncGroup: the barrier of a BSP superstep across devices (program::Sync).
/// Guide: runtime/engine/README.md.
#pragma once

#include <atomic>
#include <cstdint>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/spin.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

/// A barrier across `participants` devices. One atomic word counts every arrival of the run,
/// and the last arrival's own increment opens the round (it ends when the count reaches the
/// round's end), so no second write follows on the line the waiters spin on: one line moves
/// between cores per arrival, asked for writing from the start, and one per release, the
/// least a barrier can do. Waiting spins briefly (tunables::kSpinBudget), then parks,
/// so it is live with more devices than cores.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class SyncGroup {
 public:
  /// A barrier for `participants` devices. Throws bspflow::Error if `participants` is
  /// outside 1..tunables::kMaxReplicas.
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit SyncGroup(std::uint32_t participants);
  /// Waits until every participant has arrived (returns true), or until `stop` is set or
  /// the group is aborted (returns false; the group is then unusable for this run). Spin::kYield
  /// for a device that shares its core: it gives the core to the others between checks.
  /// `modeled`: this device's modeled clock in, the latest of every participant's out (the
  /// time they go on together; null: no modeled clock).
  /// Contract: device; blocks; no-alloc; noexcept.
  bool arrive_and_wait(const StopFlag& stop, Spin spin = Spin::kTight,
                       double* modeled = nullptr) noexcept;
  /// Called by a participant that will not arrive again this run (its infeed ended). Every
  /// wait on the group, now and until reset(), returns false, so the others end at their
  /// next Sync instead of waiting for it forever; what they do before it still runs.
  /// Contract: device; non-blocking; no-alloc; noexcept.
  void abort() noexcept;
  /// Whether abort() was called this run.
  bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  /// Wakes parked participants so they re-check their stop flag.
  void wake() noexcept { point_.notify(); }
  /// Between runs only (nobody waiting): forgets arrivals of a run that was stopped midway,
  /// an abort, and the run's modeled clocks. Every run must start with it (Engine::run does):
  /// the modeled slots are not emptied between rounds, so a group reused without a reset
  /// would hand the next run the last run's latest clock.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  void reset() noexcept {
    arrivals_.store(0, std::memory_order_relaxed);  // relaxed: no waiters
    modeled_[0].store(0, std::memory_order_relaxed);
    modeled_[1].store(0, std::memory_order_relaxed);
    aborted_.store(false, std::memory_order_relaxed);
  }
  /// How many devices each round waits for.
  std::uint32_t participants() const noexcept { return participants_; }
  /// Participants arrived in the current round (approximate while they arrive).
  std::uint32_t arrived() const noexcept {
    // relaxed: a moment's view, for reports.
    return static_cast<std::uint32_t>(arrivals_.load(std::memory_order_relaxed) % participants_);
  }

 private:
  /// The round a count of arrivals is in: a shift for 2, 4, 8... participants (no division
  /// on the arrival's path).
  std::uint64_t round_of(std::uint64_t count) const noexcept {
    return shift_ >= 0 ? count >> shift_ : count / participants_;
  }

  const std::uint32_t participants_;
  const int shift_;  ///< log2(participants_) when a power of two, else -1
  /// Every arrival this run (64 bits: never wraps): round r ends when it reaches
  /// (r + 1) x participants, by the last arrival's own increment.
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> arrivals_{0};
  std::atomic<bool> aborted_{false};  ///< on arrivals_' line: read at every arrival
  /// The latest modeled clock of the arrivals, by round parity (a non-negative double's bits
  /// order as the double), on arrivals_' line: written just before each arrival.
  std::atomic<std::int64_t> modeled_[2] = {};
  detail::WaitPoint point_;
  detail::WaitSite site_;  ///< what a device waiting here waits for (a run's stall check)
};

}  // namespace bspflow
