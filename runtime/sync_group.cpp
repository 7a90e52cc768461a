// SyncGroup (see bspflow/runtime/sync_group.hpp).
#include "bspflow/runtime/sync_group.hpp"

#include <string>
#include <thread>

#include "bspflow/base/error.hpp"

namespace bspflow {

SyncGroup::SyncGroup(std::uint32_t participants) : participants_(participants) {
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

bool SyncGroup::arrive_and_wait(const StopFlag& stop, Spin spin) {
  if (aborted_.load(std::memory_order_acquire)) return false;
  const std::uint64_t before = state_.fetch_add(1, std::memory_order_acq_rel);
  const std::uint64_t gen = generation(before);
  if ((before & kCountMask) + 1 == participants_) {
    // Last to arrive: the next generation with no arrivals, in one store. Nobody arrives for
    // the next round before seeing it, so no arrival can be lost. seq_cst: see
    // WaitPoint::notify(). The generation wraps after 2^32 rounds; waiters compare for
    // inequality, so that is harmless.
    state_.store(((gen + 1) & kCountMask) << 32, std::memory_order_seq_cst);
    point_.notify();
    // Sharing a core: let a participant just woken on it run now, instead of at the end of
    // our time slice (a scheduler tick, milliseconds) while we compute the next superstep.
    if (spin == detail::Spin::kYield) std::this_thread::yield();
    return true;
  }
  const detail::WaitMark mark(&site_);  // the stall check's record, while this device waits
  point_.wait(
      [&] {
        return generation(state_.load(std::memory_order_seq_cst)) != gen || stop.requested() ||
               aborted_.load(std::memory_order_seq_cst);
      },
      spin, detail::Fence::kSymmetric,
      spin == detail::Spin::kYield ? tunables::kSpinBudget : tunables::kSyncSpinBudget);
  return generation(state_.load(std::memory_order_acquire)) != gen;
}

}  // namespace bspflow
