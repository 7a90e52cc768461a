// SyncGroup (see bspflow/runtime/sync_group.hpp).
#include "bspflow/runtime/sync_group.hpp"

#include <algorithm>
#include <bit>
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

bool SyncGroup::arrive_and_wait(const StopFlag& stop, Spin spin, double* modeled) {
  // Every arrival reads state_'s line (aborted_, the generation), then writes it (the
  // modeled slot, the count), and the line was last written by another participant: asked
  // for writing first, it comes over once, not once to read and again to write. On this
  // 2-core VM that is one cross-core transfer less on the critical path of every superstep.
  detail::prefetch_for_write(&state_);
  if (aborted_.load(std::memory_order_acquire)) return false;
  if (modeled != nullptr) {
    // Before arriving: nobody can open this generation without this arrival, so the one
    // read now is the one joined. relaxed loads and CAS: the arrival's acq_rel RMW publishes
    // the slot to the last arrival, whose seq_cst store publishes it to the waiters.
    const std::uint64_t g = generation(state_.load(std::memory_order_relaxed));
    std::atomic<std::int64_t>& slot = modeled_[g & 1];
    const std::int64_t mine = std::bit_cast<std::int64_t>(std::max(*modeled, 0.0));
    std::int64_t seen = slot.load(std::memory_order_relaxed);
    while (seen < mine && !slot.compare_exchange_weak(seen, mine, std::memory_order_relaxed)) {
    }
  }
  const std::uint64_t before = state_.fetch_add(1, std::memory_order_acq_rel);
  const std::uint64_t gen = generation(before);
  if ((before & kCountMask) + 1 == participants_) {
    if (modeled != nullptr) {
      *modeled = std::bit_cast<double>(modeled_[gen & 1].load(std::memory_order_relaxed));
    }
    // The other parity's slot served the round before this one, which everybody has left
    // (they all arrived here): it starts the next round empty. relaxed: published below.
    modeled_[(gen + 1) & 1].store(0, std::memory_order_relaxed);
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
  const bool opened = generation(state_.load(std::memory_order_acquire)) != gen;
  if (opened && modeled != nullptr) {
    *modeled = std::bit_cast<double>(modeled_[gen & 1].load(std::memory_order_relaxed));
  }
  return opened;
}

}  // namespace bspflow
