/// @file
/// StopFlag: a stop request that waiting threads observe. Every bspflow wait that can be
/// stopped (a reader's pop(), an outfeed writer's write(), SyncGroup::arrive_and_wait(), a
/// HostLinkTimeline's copies, a codelet's waits through ComputeContext::stop) takes one.
/// Guide: feeds/README.md.
#pragma once

#include <atomic>

namespace bspflow {

/// A stop request; once set, it stays set. Setting it wakes nobody: whoever sets it then
/// wakes what the stopped work may be parked on (InfeedQueue::wake_all(), SyncGroup::wake()).
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
class StopFlag {
 public:
  /// Not set.
  StopFlag() noexcept = default;
  StopFlag(const StopFlag&) = delete;
  StopFlag& operator=(const StopFlag&) = delete;

  /// Whether set() was called.
  bool requested() const noexcept { return flag_.load(std::memory_order_seq_cst); }
  /// Sets the flag (idempotent); does not wake waiters.
  void set() noexcept { flag_.store(true, std::memory_order_seq_cst); }

 private:
  std::atomic<bool> flag_{false};
};

}  // namespace bspflow
