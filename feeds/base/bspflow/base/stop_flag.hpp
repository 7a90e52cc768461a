// StopFlag: a stop request that waiting threads observe.
//
//   bspflow::StopFlag stop;
//   reader.pop(x, &stop);      // a device thread: returns false once stop is set
//   stop.set();                // another thread asks it to stop ...
//   infeed.wake_all();         // ... and wakes it, if it is parked, to see the flag
//
// Every bspflow wait that can be stopped (a reader's pop(), an outfeed writer's write(), a
// SyncGroup's arrive_and_wait(), a HostLinkTimeline's copies, a codelet's own waits through
// ComputeContext::stop) takes one. Setting the flag does not wake anybody: whoever sets it
// then wakes what the stopped work may be parked on (InfeedQueue::wake_all(),
// SyncGroup::wake(), ...). Once set, a flag stays set.
#pragma once

#include <atomic>

namespace bspflow {

class StopFlag {
 public:
  // Not set. Never blocks, never allocates, never throws.
  StopFlag() = default;
  StopFlag(const StopFlag&) = delete;
  StopFlag& operator=(const StopFlag&) = delete;

  // Any thread. Whether set() was called. Never blocks, never allocates, never throws.
  bool requested() const noexcept { return flag_.load(std::memory_order_seq_cst); }
  // Any thread. Sets the flag (idempotent); does not wake waiters. Never blocks, never
  // allocates, never throws.
  void set() noexcept { flag_.store(true, std::memory_order_seq_cst); }

 private:
  std::atomic<bool> flag_{false};
};

}  // namespace bspflow
