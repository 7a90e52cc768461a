// SpscLane<T>: an infeed lane with one producer (InfeedConfig::producer_type = kSingle), and
// one replica's share of an outfeed with one reader (OutfeedConfig::consumer_type = kSingle).
//
// A bounded ring (a power-of-two slot count) with what an infeed lane needs on top: close()
// from any thread, bulk push and pop, stop flags and the lane's wait policy.
//
// The producer publishes in parts (one element for push, up to kPublishEvery for push_bulk),
// and marks each part in its first slot, beside the element: where the part ends (a mark per
// slot, as in rigtorp's SPSCQueue or Vyukov's queue, but one per part). The consumer reads the
// mark, not the producer's index, so a waiting consumer sees the next element arrive with one
// cache line: the element's own. (An index and then the element cost a second transfer each
// way wherever prefetching the element's line while watching the index does not hide it.) The
// producer still publishes its index (tail_), for size queries, drained() and a reader of
// several lanes, and reads the consumer's index only when its cached copy says full.
//
// close() and a push racing it: the producer marks itself busy (a plain store and a light
// fence) before it checks the closed flag and clears the mark after publishing; close()
// sets the flag, runs a heavy fence and waits until the producer is not busy, then seals
// the lane. So a push either fails (it saw the flag) or is published before the seal, and
// the consumer, which reports end of data only once sealed and drained, never misses it.
// The hot path has no locked instruction (fence.hpp).
//
// Threads: one producer thread at a time (push, try_push, push_bulk), one consumer thread
// at a time (pop_bulk, try_pop_bulk); close, wake_all and the queries from any thread;
// reopen only while no producer is active.
//
// Several lanes with one consumer (an outfeed's replicas) may share the WaitPoint that says
// "something to read": the consumer then waits once for all of them (readable()).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/base/detail/fence.hpp"
#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/feeds/push_result.hpp"

namespace bspflow::detail {

template <class T>
class SpscLane {
  // push_bulk publishes this many elements at a time.
  static constexpr std::size_t kPublishEvery = tunables::kBulkPublishElements<T>;

 public:
  // Setup path: room for `capacity` elements (>= 1; the caller validates the range).
  // `readable`: the WaitPoint publishes and close() notify, shared by lanes with one consumer
  // (null: the lane's own). `spare`: slots beyond the capacity that only push_bulk_spare
  // fills (an outfeed lane keeps room for a stopped writer's staged entries).
  explicit SpscLane(std::size_t capacity, WaitPoint* readable = nullptr, std::size_t spare = 0)
      : slots_(std::bit_ceil(capacity + spare)), capacity_(capacity), mask_(slots_.size() - 1),
        readable_(readable != nullptr ? readable : &not_empty_) {}
  SpscLane(const SpscLane&) = delete;
  SpscLane& operator=(const SpscLane&) = delete;

  // ---- producer ----

  // Never blocks. kOk (moved from value), kFull or kClosed (value untouched).
  PushResult try_push(T&& value) {
    if (!enter()) return PushResult::kClosed;
    const bool room = has_room(1);
    if (room) put(std::move(value));
    leave();
    return room ? PushResult::kOk : PushResult::kFull;
  }

  // Blocks while full. false (value untouched) once closed, or if `stop` was set first.
  // `site`: what a device waiting here waits for (its stall check's record; null: none).
  bool push(T&& value, const StopFlag* stop = nullptr, const WaitSite* site = nullptr) {
    for (;;) {
      if (!enter()) return false;
      if (has_room(1)) {
        put(std::move(value));
        leave();
        return true;
      }
      leave();
      if (!wait_for_room(stop, site)) return false;
    }
  }

  // Moves n elements from `first`, in order, as many as fit at a time. Blocks while full.
  // Returns how many were pushed: n, or fewer once closed or stopped. Publishes a part every
  // kPublishEvery elements (tunables::kBulkPublishBytes), so the reader starts early; a
  // part can be read once it is all written.
  template <class It>
  std::size_t push_bulk(It first, std::size_t n, const StopFlag* stop = nullptr,
                        const WaitSite* site = nullptr) {
    std::size_t done = 0;
    while (done < n) {
      if (!enter()) return done;
      const std::size_t fit = room_for(n - done);
      for (std::size_t i = 0; i < fit;) {
        const std::size_t part = std::min(fit - i, kPublishEvery);
        const std::uint64_t tail = producer_.tail;
        for (std::size_t k = 0; k < part; ++k, ++first) slot(tail + k).value = std::move(*first);
        publish(part);
        i += part;
      }
      leave();
      done += fit;
      if (done < n && fit == 0 && !wait_for_room(stop, site)) return done;
    }
    return done;
  }

  // Never blocks. As push_bulk, but the bound is the slots, spare ones included, not the
  // capacity: for entries that must not be dropped when nobody reads (a stopped outfeed
  // writer's last ones). Returns how many fit (fewer than n only once closed or out of slots).
  template <class It>
  std::size_t push_bulk_spare(It first, std::size_t n) {
    if (!enter()) return 0;
    producer_.head_seen = head_.load(std::memory_order_acquire);
    const std::uint64_t used = producer_.tail - producer_.head_seen;
    const std::size_t fit =
        static_cast<std::size_t>(std::min<std::uint64_t>(slots_.size() - used, n));
    for (std::size_t i = 0; i < fit; ++i, ++first)
      slot(producer_.tail + i).value = std::move(*first);
    if (fit != 0) publish(fit);
    leave();
    return fit;
  }

  // ---- consumer ----

  // Never blocks. Moves up to `max` elements into out[0..); returns the count.
  std::size_t try_pop_bulk(T* out, std::size_t max) {
    const std::uint64_t h = consumer_.head;
    if (consumer_.readable_end <= h) {
      // The next part's mark, in its first slot: the element's own line (see Slot).
      const std::uint64_t end = slot(h).end.load(std::memory_order_acquire);
      if (end <= h) return 0;
      consumer_.readable_end = end;
    }
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(consumer_.readable_end - h, max));
    for (std::size_t i = 0; i < n; ++i) out[i] = std::move(slot(h + i).value);
    if (n != 0) {
      consumer_.head = h + n;
      head_.store(consumer_.head, std::memory_order_release);  // done with the slots
      not_full_.notify_light();
    }
    return n;
  }

  // Blocks until at least one element is there and returns how many it moved (1..max);
  // 0 once the lane is closed and drained, or `stop` is set. Waits as `policy` says (null:
  // the default spin, then park).
  std::size_t pop_bulk(T* out, std::size_t max, const StopFlag* stop = nullptr,
                       const WaitPolicy* policy = nullptr) {
    for (;;) {
      if (const std::size_t n = try_pop_bulk(out, max)) return n;
      if (sealed_.load(std::memory_order_seq_cst)) {
        if (const std::size_t n = try_pop_bulk(out, max)) return n;  // published before the seal
        return 0;
      }
      if (stopped(stop)) return 0;
      const std::uint64_t h = consumer_.head;
      wait_with(
          *readable_, policy ? *policy : WaitPolicy{},
          [&] {
            return slot(h).end.load(std::memory_order_seq_cst) > h ||
                   sealed_.load(std::memory_order_seq_cst) || stopped(stop);
          },
          Fence::kAsymmetric);
    }
  }

  // ---- any thread ----

  // End of data: pushes fail from now on; the consumer drains what was pushed, then sees the
  // end. Idempotent. Waits (briefly) for a push in progress to finish.
  void close() noexcept {
    closed_.store(true, std::memory_order_seq_cst);
    heavy_fence();  // pairs with enter()'s light fence
    while (busy_.load(std::memory_order_acquire)) std::this_thread::yield();
    sealed_.store(true, std::memory_order_seq_cst);
    readable_->notify();
    not_full_.notify();
  }
  // close() for a lane whose producers are all done: the caller is the last producer, or
  // has synchronized with every producer's last push (an outfeed's last writer, after the
  // writers' acq_rel countdown reached 0), and nobody pushes until reopen(). No push can race
  // it, so it needs neither close()'s heavy fence (a process-wide barrier, microseconds to tens
  // of microseconds on a VM, paid once per run) nor the wait for a busy producer.
  void close_quiescent() noexcept {
    closed_.store(true, std::memory_order_seq_cst);
    sealed_.store(true, std::memory_order_seq_cst);
    readable_->notify();
    not_full_.notify();
  }
  // Accept pushes again (an outfeed's next run). Only while no producer is active.
  void reopen() noexcept {
    sealed_.store(false, std::memory_order_seq_cst);
    closed_.store(false, std::memory_order_seq_cst);
  }
  bool is_closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  // Sealed and every pushed element popped.
  bool drained() const noexcept {
    return sealed_.load(std::memory_order_seq_cst) &&
           tail_.load(std::memory_order_seq_cst) == head_.load(std::memory_order_seq_cst);
  }
  // What a consumer of several lanes waits for (seq_cst reads, for WaitPoint::wait with
  // Fence::kAsymmetric): something to pop, or the end.
  bool has_entries() const noexcept {
    return tail_.load(std::memory_order_seq_cst) != head_.load(std::memory_order_seq_cst);
  }
  bool sealed() const noexcept { return sealed_.load(std::memory_order_seq_cst); }
  void wake_all() noexcept {
    readable_->notify();
    not_full_.notify();
  }
  std::size_t size_approx() const noexcept {
    const std::uint64_t h = head_.load(std::memory_order_acquire);
    const std::uint64_t t = tail_.load(std::memory_order_acquire);
    return t >= h ? static_cast<std::size_t>(t - h) : 0;
  }
  std::uint64_t total_pushed() const noexcept { return tail_.load(std::memory_order_acquire); }

 private:
  static bool stopped(const StopFlag* stop) noexcept {
    return stop != nullptr && stop->requested();
  }

  // The producer's way in: busy, light fence, then the closed flag (see the file comment).
  bool enter() noexcept {
    busy_.store(true, std::memory_order_relaxed);  // relaxed: ordered by the fence below
    light_fence();
    if (closed_.load(std::memory_order_relaxed)) {  // relaxed: the fences order it
      busy_.store(false, std::memory_order_release);
      return false;
    }
    return true;
  }
  void leave() noexcept { busy_.store(false, std::memory_order_release); }  // after the publish

  // Room for up to `want`, checked against the producer's cached head first.
  // (push_bulk_spare may have filled the lane past the capacity: then there is no room.)
  std::size_t room_for(std::size_t want) noexcept {
    std::uint64_t free_slots =
        capacity_ - std::min<std::uint64_t>(producer_.tail - producer_.head_seen, capacity_);
    if (free_slots < want) {
      producer_.head_seen = head_.load(std::memory_order_acquire);
      free_slots =
          capacity_ - std::min<std::uint64_t>(producer_.tail - producer_.head_seen, capacity_);
    }
    return static_cast<std::size_t>(std::min<std::uint64_t>(free_slots, want));
  }
  bool has_room(std::size_t n) noexcept { return room_for(n) == n; }
  void put(T&& value) {
    slot(producer_.tail).value = std::move(value);
    publish(1);
  }
  struct Slot;
  Slot& slot(std::uint64_t index) noexcept { return slots_[index & mask_]; }
  // Publishes the n (>= 1) elements already in the slots from producer_.tail on as one part:
  // its end in its first slot (a release store, after the elements), then the index. The
  // consumer reads a part's lines once they are all filled, never while the producer still
  // fills them (a line pulled back and forth between the two), and reads one mark per part.
  void publish(std::size_t n) noexcept {
    const std::uint64_t end = producer_.tail + n;
    slot(producer_.tail).end.store(end, std::memory_order_release);
    producer_.tail = end;
    tail_.store(end, std::memory_order_release);  // for sizes, drained(), has_entries()
    readable_->notify_light();
  }
  // false once closed or stopped; true when there may be room now.
  bool wait_for_room(const StopFlag* stop, const WaitSite* site) {
    const WaitMark mark(site);
    const std::uint64_t t = producer_.tail;
    not_full_.wait(
        [&] {
          producer_.head_seen = head_.load(std::memory_order_seq_cst);
          return t - producer_.head_seen < capacity_ || closed_.load(std::memory_order_seq_cst) ||
                 stopped(stop);
        },
        Spin::kBackoff, Fence::kAsymmetric);
    return !closed_.load(std::memory_order_acquire) && !stopped(stop);
  }

  struct alignas(tunables::kCacheLine) ProducerSide {
    std::uint64_t tail = 0;       // the next element's index
    std::uint64_t head_seen = 0;  // the consumer's index when last read
  };
  struct alignas(tunables::kCacheLine) ConsumerSide {
    std::uint64_t head = 0;
    std::uint64_t readable_end = 0;  // the end of the last part whose mark it read
  };
  // end: in the first slot of each published part, the index after the part's last element
  // (0 before any). Parts are contiguous, so the consumer looks for a mark only where a part
  // begins: at its head, once it has taken everything the last mark announced. A mark left
  // from an earlier lap is at most this slot's index now (a part holds at most the slot
  // count, and a slot is refilled only after the consumer moved past it), so `end > head`
  // is only ever true of a part published for this lap.
  struct Slot {
    std::atomic<std::uint64_t> end{0};
    T value{};
  };
  std::vector<Slot> slots_;
  const std::uint64_t capacity_;
  const std::uint64_t mask_;
  ProducerSide producer_;
  ConsumerSide consumer_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> head_{0};
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> tail_{0};
  alignas(tunables::kCacheLine) std::atomic<bool> busy_{false};  // the producer's; read by close()
  alignas(tunables::kCacheLine) std::atomic<bool> closed_{false};
  std::atomic<bool> sealed_{false};  // closed, and no push in progress any more
  WaitPoint not_empty_;
  WaitPoint not_full_;
  WaitPoint* const readable_;  // &not_empty_, or the consumer's WaitPoint shared by its lanes
};

}  // namespace bspflow::detail
