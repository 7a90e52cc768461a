// SyncGroup (see bspflow/engine/sync_group.hpp).
#include "bspflow/engine/sync_group.hpp"

#include <algorithm>
#include <bit>
#include <string>
#include <thread>

#include "bspflow/base/error.hpp"

namespace bspflow {

SyncGroup::SyncGroup(std::uint32_t participants)
    : participants_(participants),
      shift_(std::has_single_bit(participants) ? std::countr_zero(participants) : -1) {
  if (participants < 1 || participants > tunables::kMaxReplicas) {
    detail::throw_bad_value("sync group participants", participants,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
  site_ = {detail::WaitKind::kSync,
           "the other devices of a sync group of " + std::to_string(participants), [this] {
             return std::to_string(arrived()) + " of " + std::to_string(participants_) +
                    " arrived" + (aborted() ? ", aborted" : "");
           }};
}

void SyncGroup::abort() noexcept {
  aborted_.store(true, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
  point_.notify();
}

bool SyncGroup::arrive_and_wait(const StopFlag& stop, Spin spin, double* modeled) noexcept {
  // Every arrival reads arrivals_' line (aborted_, the count), then writes it (the modeled
  // slot, the count), and the line was last written by another participant: asked for
  // writing first, it comes over once, not once to read and again to write. On this 2-core
  // VM that is one cross-core transfer less on the critical path of every superstep.
  detail::prefetch_for_write(&arrivals_);
  if (aborted_.load(std::memory_order_acquire)) return false;
  // The round this arrival joins: nobody can finish it without this arrival, so the count
  // read now is in it. relaxed: the RMW below orders.
  const std::uint64_t round = round_of(arrivals_.load(std::memory_order_relaxed));
  if (modeled != nullptr) {
    // relaxed loads and CAS: published to the last arrival and the waiters by this arrival's
    // RMW (the RMWs of a round form one release sequence). The slot of a round's parity is
    // not emptied for its next use: the clocks only grow in a run, so every arrival two
    // rounds later brings a clock at least as late as what the slot holds.
    std::atomic<std::int64_t>& slot = modeled_[round & 1];
    const std::int64_t mine = std::bit_cast<std::int64_t>(std::max(*modeled, 0.0));
    std::int64_t seen = slot.load(std::memory_order_relaxed);
    while (seen < mine && !slot.compare_exchange_weak(seen, mine, std::memory_order_relaxed)) {
    }
  }
  // The last arrival's RMW opens the round itself (the count reaches the round's end): no
  // second write follows it, which a spinning waiter's read could take the line away from
  // and make cross the cores twice more. seq_cst: see WaitPoint::notify().
  const std::uint64_t end = (round + 1) * participants_;
  if (arrivals_.fetch_add(1, std::memory_order_seq_cst) + 1 == end) {
    if (modeled != nullptr) {
      *modeled = std::bit_cast<double>(modeled_[round & 1].load(std::memory_order_relaxed));
    }
    point_.notify();
    // Sharing a core: let a participant just woken on it run now, instead of at the end of
    // our time slice (a scheduler tick, milliseconds) while we compute the next superstep.
    if (spin == Spin::kYield) std::this_thread::yield();
    return true;
  }
  const detail::WaitMark mark(&site_);  // the stall check's record, while this device waits
  point_.wait(
      [&] {
        return arrivals_.load(std::memory_order_seq_cst) >= end || stop.requested() ||
               aborted_.load(std::memory_order_seq_cst);
      },
      spin, detail::Fence::kSymmetric,
      spin == Spin::kYield ? tunables::kSpinBudget : tunables::kSyncSpinBudget);
  const bool opened = arrivals_.load(std::memory_order_acquire) >= end;
  if (opened && modeled != nullptr) {
    *modeled = std::bit_cast<double>(modeled_[round & 1].load(std::memory_order_relaxed));
  }
  return opened;
}

}  // namespace bspflow
