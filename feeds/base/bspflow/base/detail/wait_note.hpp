// What a device waits for, for a run's stall check (machinery, not API). A run gives each of
// its devices a WaitNote; the device thread sets it as its thread's note while it runs, and
// every bspflow wait (an infeed's pop, an outfeed's room, a sync, a hand-off) marks it with
// its WaitSite for as long as it waits. The runtime's monitor reads the notes now and then:
// a run whose devices all wait, none of them moving for the stall limit, is stalled.
//
// Cost: a mark is made only on a wait's slow path, where the thread is about to wait (after
// a try failed): a thread-local load and two relaxed stores to the device's own cache line.
// Nothing is marked on the fast path, and no shared atomic is written.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "bspflow/base/tunables.hpp"

namespace bspflow::detail {

// What kind of thing a device waits for (the stall report's advice follows from it).
enum class WaitKind : std::uint8_t {
  kInfeed,   // an element of an infeed lane
  kOutfeed,  // room in an outfeed
  kSync,     // the other devices of a sync group
  kHandoff,  // a neighbouring stage
  kTurn,     // its device, busy with an earlier job
  kEnded,    // nothing: the device's part of the run has ended
  kOther,
};

// One thing a device may wait for: "an element of the infeed's lane 0", and its state when
// the report is written ("empty, not closed"). Lives as long as what it describes (a queue,
// a sync group, a run); state() is called by the monitor thread while the run is watched.
struct WaitSite {
  WaitKind kind = WaitKind::kOther;
  std::string what;
  std::function<std::string()> state;  // may be empty
};

// One device's record for one run, on a cache line of its own: written by that device's
// thread only, read by the monitor. Both fields relaxed: the monitor only needs to see a
// change eventually (a period late at most), and acts on no data they would publish.
struct alignas(tunables::kCacheLine) WaitNote {
  std::atomic<const WaitSite*> site{nullptr};  // what it waits for now; null: not waiting
  std::atomic<std::uint64_t> moves{0};         // waits it has come out of
};

// The calling thread's note (null on a thread that runs no device of a watched run: a host
// thread, a Stream's device). Never blocks, never throws.
WaitNote* this_thread_wait_note() noexcept;
// Device thread: sets the calling thread's note (null: none) and returns the one before.
WaitNote* set_this_thread_wait_note(WaitNote* note) noexcept;

// Marks `note` (default: the calling thread's) as waiting at `site` while it lives, unless it
// already is (an outer, more specific mark wins); when it ends, the note counts a move. A
// null note or site marks nothing. Never blocks, never throws.
class WaitMark {
 public:
  explicit WaitMark(const WaitSite* site) noexcept
      : WaitMark(site != nullptr ? this_thread_wait_note() : nullptr, site) {}
  WaitMark(WaitNote* note, const WaitSite* site) noexcept {
    // relaxed: see WaitNote; only this thread writes the note.
    if (note != nullptr && site != nullptr &&
        note->site.load(std::memory_order_relaxed) == nullptr) {
      note_ = note;
      note->site.store(site, std::memory_order_relaxed);
    }
  }
  ~WaitMark() {
    if (note_ == nullptr) return;
    note_->site.store(nullptr, std::memory_order_relaxed);
    note_->moves.store(note_->moves.load(std::memory_order_relaxed) + 1,
                       std::memory_order_relaxed);  // one writer: no read-modify-write
  }
  WaitMark(const WaitMark&) = delete;
  WaitMark& operator=(const WaitMark&) = delete;

 private:
  WaitNote* note_ = nullptr;
};

}  // namespace bspflow::detail
