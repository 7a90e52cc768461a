// BoundedQueue<T>: the one queue under every infeed lane and every outfeed.
//
// moodycamel::ConcurrentQueue stores the elements (lock-free, per-producer sub-queues, bulk
// operations). Around it this adds what a feed needs and moodycamel leaves out:
//  - a bound: producers reserve a slot before enqueueing, so at most `capacity` elements
//    are ever reserved-but-not-popped (0 = unbounded). moodycamel's explicit producers
//    reuse emptied blocks, so memory stays bounded by capacity plus one block per producer;
//  - close(): end of data. Reservations and the closed flag share one atomic word, so no
//    element can slip in after close() and be lost or half-counted;
//  - blocking push/pop that spin briefly and then park (WaitPoint), and can be stopped.
//
// A lane with one producer does not come here: it is a single-producer ring (SpscLane,
// InfeedConfig::producer_type = kSingle), which needs no shared reservation at all. A queue
// with a single consumer (an infeed lane's one reader) publishes its pop count with a plain
// store.
//
// Ordering: FIFO per producer token (moodycamel's guarantee); no order across producers.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <new>
#include <thread>
#include <utility>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/feeds/detail/moodycamel.hpp"
#include "bspflow/feeds/push_result.hpp"

namespace bspflow {

namespace detail {

template <class T>
class BoundedQueue {
 public:
  // A producer's handle: its moodycamel sub-queue, and the last consumer count it saw (so
  // the bound is checked against the shared counter only when the lane looks full).
  struct Token {
    explicit Token(BoundedQueue& q) : token(q.queue_) {}
    moodycamel::ProducerToken token;
    std::uint64_t popped_seen = 0;
  };
  using ConsumerToken = moodycamel::ConsumerToken;

  // capacity 0 = unbounded. single_consumer: at most one thread pops at a time (an infeed
  // lane's reader), so the pop count is published with a plain store.
  explicit BoundedQueue(std::size_t capacity, bool single_consumer = false)
      : queue_(initial_slots(capacity)), capacity_(capacity), single_consumer_(single_consumer) {}

  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  // Any thread, setup path: allocates. The token must not outlive the queue.
  Token make_token() { return Token(*this); }
  // Setup path: a consumer token (faster dequeues for a consumer that keeps one).
  ConsumerToken make_consumer_token() { return ConsumerToken(queue_); }

  std::size_t capacity() const noexcept { return capacity_; }

  // Producer (holder of `token`). Never blocks. Moves from `value` only on kOk.
  PushResult try_push(Token& token, T&& value) {
    const PushResult r = try_reserve(token, 1);
    if (r != PushResult::kOk) return r;
    commit(token, std::move(value));
    return PushResult::kOk;
  }

  // Producer. Blocks while full. Returns false (value untouched) if the queue is closed,
  // or `stop` was set, before a slot was free.
  // `site`: what a device waiting here waits for (its stall check's record; null: none).
  bool push(Token& token, T&& value, const StopFlag* stop = nullptr,
            const WaitSite* site = nullptr) {
    for (;;) {
      // try_push moves from `value` only when it takes it.
      const PushResult r = try_push(token, std::move(value));  // NOLINT(bugprone-use-after-move)
      if (r == PushResult::kOk) return true;
      if (r == PushResult::kClosed) return false;
      if (stop != nullptr && stop->requested()) return false;
      wait_for_room(stop, site);
    }
  }

  // Producer. Moves n elements from `first`, in order, reserving as many as fit at a time
  // (one moodycamel bulk enqueue per reservation). Blocks while full. Returns how many were
  // pushed: n, or fewer if the queue closed or `stop` was set first.
  template <class It>
  std::size_t push_bulk(Token& token, It first, std::size_t n, const StopFlag* stop = nullptr,
                        const WaitSite* site = nullptr) {
    // Published a part at a time (tunables::kBulkPublishBytes), so the reader starts early.
    constexpr std::size_t kPublishEvery = tunables::kBulkPublishElements<T>;
    std::size_t done = 0;
    while (done < n) {
      std::size_t want = std::min(n - done, kPublishEvery);
      if (capacity_ != 0 && want > capacity_) want = capacity_;
      PushResult r = try_reserve(token, want);
      if (r == PushResult::kFull) {
        const std::size_t room = free_slots();
        if (room > 0) {
          want = room < want ? room : want;
          r = try_reserve(token, want);
        }
      }
      if (r == PushResult::kClosed) return done;
      if (r == PushResult::kFull) {
        if (stop != nullptr && stop->requested()) return done;
        wait_for_room(stop, site);
        continue;
      }
      const bool enqueued = enqueue_bulk(token, first, want);
      if (!enqueued) {
        unreserve(want);
        throw std::bad_alloc();
      }
      std::advance(first, static_cast<std::ptrdiff_t>(want));
      done += want;
      not_empty_.notify();
    }
    return done;
  }

  // Producer. Never blocks. As push_bulk, but past the bound: for entries that must not be
  // dropped when nobody reads (a stopped outfeed writer's last ones). Returns n, or 0 once
  // closed. The queue then holds more than its capacity until the consumer catches up;
  // bounded pushes wait until it has.
  template <class It>
  std::size_t push_bulk_past_bound(Token& token, It first, std::size_t n) {
    std::uint64_t r = reserved_.load(std::memory_order_relaxed);
    do {
      if ((r & kClosedBit) != 0) return 0;
    } while (!reserved_.compare_exchange_weak(r, r + n, std::memory_order_seq_cst,
                                              std::memory_order_relaxed));
    if (!enqueue_bulk(token, first, n)) {
      unreserve(n);
      throw std::bad_alloc();
    }
    not_empty_.notify();
    return n;
  }

  // Consumer. Never blocks. Moves up to `max` elements into out[0..). Returns the count.
  // `ctok`, if given, is this consumer's own token (not shared with a concurrent consumer).
  std::size_t try_pop_bulk(T* out, std::size_t max, ConsumerToken* ctok = nullptr) {
    std::size_t n = 0;
    if (max == 1) {  // moodycamel's single dequeue is markedly cheaper than a bulk of one
      n = (ctok != nullptr ? queue_.try_dequeue(*ctok, *out) : queue_.try_dequeue(*out)) ? 1 : 0;
    } else {
      n = ctok != nullptr ? queue_.try_dequeue_bulk(*ctok, out, max)
                          : queue_.try_dequeue_bulk(out, max);
    }
    if (n != 0) {
      if (single_consumer_) {
        // The only writer: a plain store; parked producers pair with notify_light().
        popped_.store(popped_.load(std::memory_order_relaxed) + n, std::memory_order_release);
        not_full_.notify_light();
      } else {
        popped_.fetch_add(n, std::memory_order_seq_cst);  // seq_cst: pairs with not_full_ waiters
        not_full_.notify();
      }
    }
    return n;
  }

  // Consumer. Blocks until at least one element is available and returns how many it
  // moved (1..max); returns 0 when the queue is closed and drained (end of data) or `stop`
  // was set. Waits as `policy` says (null: spin tunables::kSpinBudget, then park).
  std::size_t pop_bulk(T* out, std::size_t max, const StopFlag* stop = nullptr,
                       ConsumerToken* ctok = nullptr, const WaitPolicy* policy = nullptr) {
    std::size_t n = try_pop_bulk(out, max, ctok);
    if (n != 0) return n;
    const Spin mode = policy != nullptr ? policy->spin_mode() : Spin::kTight;
    const std::chrono::nanoseconds budget =
        policy != nullptr ? policy->spin_budget() : tunables::kSpinBudget;
    // Spin on dequeue attempts first: a producer mid-enqueue (slot reserved, element not yet
    // visible) finishes within the spin, without a syscall.
    // End of data and stop are checked every 64th try only: reading reserved_ on every spin
    // would pull the producers' hot cache line away from them.
    bool ended = false;
    unsigned tries = 0;
    spin_until(
        [&] {
          n = try_pop_bulk(out, max, ctok);
          if (n != 0) return true;
          ended = (++tries & 63u) == 0 && (drained() || stopped(stop));
          return ended;
        },
        mode, budget);
    for (;;) {
      if (n != 0) return n;
      if (ended || drained() || stopped(stop)) return 0;
      if (pending()) {
        // Still mid-enqueue after a whole spin budget: the producer was descheduled
        // (oversubscribed cores); give it the core.
        std::this_thread::yield();
      } else {
        not_empty_.wait([&] { return pending() || is_closed() || stopped(stop); }, mode,
                        Fence::kSymmetric,
                        policy != nullptr ? std::chrono::nanoseconds{0} : tunables::kSpinBudget);
      }
      n = try_pop_bulk(out, max, ctok);
    }
  }

  // Any thread. End of data: pushes fail from now on; consumers drain what is left, then
  // see end of data. Wakes everybody parked. Idempotent.
  void close() noexcept {
    reserved_.fetch_or(kClosedBit, std::memory_order_seq_cst);
    not_empty_.notify();
    not_full_.notify();
  }

  // Any thread, when no producer is active: accept pushes again (outfeeds between runs).
  void reopen() noexcept { reserved_.fetch_and(~kClosedBit, std::memory_order_seq_cst); }

  // Any thread. Wakes parked producers and consumers so they re-check their stop flag.
  void wake_all() noexcept {
    not_empty_.notify();
    not_full_.notify();
  }

  bool is_closed() const noexcept {
    return (reserved_.load(std::memory_order_seq_cst) & kClosedBit) != 0;
  }
  // Closed, and every element pushed (or reserved before the close) popped.
  bool drained() const noexcept {
    return is_closed() && total_pushed() == popped_.load(std::memory_order_seq_cst);
  }
  // Elements reserved but not popped (approximate while producers run).
  std::size_t size_approx() const noexcept {
    const std::uint64_t r = total_pushed();
    const std::uint64_t p = popped_.load(std::memory_order_acquire);
    return r > p ? static_cast<std::size_t>(r - p) : 0;
  }
  // Elements pushed (reserved).
  std::uint64_t total_pushed() const noexcept {
    return reserved_.load(std::memory_order_seq_cst) & kCountMask;
  }

 private:
  static constexpr std::uint64_t kClosedBit = std::uint64_t{1} << 63;
  static constexpr std::uint64_t kCountMask = kClosedBit - 1;

  static std::size_t initial_slots(std::size_t capacity) {
    // Preallocate up to the bound (at most 64 blocks); beyond that moodycamel grows and
    // then reuses blocks.
    constexpr std::size_t kBlock = moodycamel::ConcurrentQueueDefaultTraits::BLOCK_SIZE;
    const std::size_t want = capacity == 0 ? 6 * kBlock : capacity;
    return want < 64 * kBlock ? want : 64 * kBlock;
  }

  static bool stopped(const StopFlag* stop) noexcept {
    return stop != nullptr && stop->requested();
  }

  // Pushed (or reserved) but not yet popped.
  bool pending() const noexcept {
    return total_pushed() != popped_.load(std::memory_order_seq_cst);
  }

  std::size_t free_slots() const noexcept {
    if (capacity_ == 0) return SIZE_MAX;
    const std::uint64_t r = total_pushed();
    const std::uint64_t p = popped_.load(std::memory_order_seq_cst);
    const std::uint64_t used = r > p ? r - p : 0;
    return used >= capacity_ ? 0 : static_cast<std::size_t>(capacity_ - used);
  }
  bool has_room(std::size_t n) const noexcept { return free_slots() >= n; }

  // A producer that found the queue full waits for a chunk of room (an eighth of the
  // capacity), not one slot, and polls with backoff: otherwise producer and consumer trade
  // the consumer's counter line on every element and both slow down several times over.
  void wait_for_room(const StopFlag* stop, const WaitSite* site) {
    const WaitMark mark(site);
    const std::size_t low_water = capacity_ / 8 > 1 ? capacity_ / 8 : 1;
    not_full_.wait([&] { return has_room(low_water) || is_closed() || stopped(stop); },
                   Spin::kBackoff, single_consumer_ ? Fence::kAsymmetric : Fence::kSymmetric);
  }

  // Claims n slots (seq_cst CAS: the ordering point WaitPoint::notify() relies on). Checks
  // the bound against the producer's cached consumer count first and reloads the shared
  // one only when that says full, so a producer that is not near the bound never reads the
  // consumer's cache line.
  PushResult try_reserve(Token& token, std::size_t n) noexcept {
    std::uint64_t r = reserved_.load(std::memory_order_relaxed);  // relaxed: the CAS re-checks
    for (;;) {
      if ((r & kClosedBit) != 0) return PushResult::kClosed;
      if (capacity_ != 0 && (r & kCountMask) + n - token.popped_seen > capacity_) {
        token.popped_seen = popped_.load(std::memory_order_seq_cst);
        if ((r & kCountMask) + n - token.popped_seen > capacity_) {
          return PushResult::kFull;
        }
      }
      if (reserved_.compare_exchange_weak(r, r + n, std::memory_order_seq_cst,
                                          std::memory_order_relaxed)) {
        return PushResult::kOk;
      }
    }
  }

  // Moves n elements from `first` into the producer's sub-queue. false: out of memory.
  template <class It>
  bool enqueue_bulk(Token& token, It first, std::size_t n) {
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports a bogus -Wstringop-overflow inside moodycamel's enqueue_bulk once it is
// inlined here (a load from a block it cannot prove non-null); the code path is sound.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
    return queue_.enqueue_bulk(token.token, std::make_move_iterator(first), n);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  }

  void unreserve(std::size_t n) noexcept {
    reserved_.fetch_sub(n, std::memory_order_seq_cst);
    not_full_.notify();
    not_empty_.notify();
  }

  void commit(Token& token, T&& value) {
    if (!queue_.enqueue(token.token, std::move(value))) {
      unreserve(1);
      throw std::bad_alloc();
    }
    not_empty_.notify();
  }

  moodycamel::ConcurrentQueue<T> queue_;
  const std::size_t capacity_;
  const bool single_consumer_;
  // Written by producers (CAS) and close(); read by consumers when they find nothing.
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> reserved_{0};
  // Written by consumers; read by producers only to check the bound.
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> popped_{0};
  WaitPoint not_empty_;
  WaitPoint not_full_;
};

}  // namespace detail
}  // namespace bspflow
