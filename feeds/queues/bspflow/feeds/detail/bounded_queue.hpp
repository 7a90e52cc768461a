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
// Biased single producer. While a queue has had only one live producer token, that token
// counts its pushes in a word only it writes (no locked instruction per element). A second
// token, or close(), first revokes the bias: it sets the mode or the closed bit, runs a
// heavy fence, and waits until the owner is outside any push (the owner sets a busy flag,
// light fence, then checks mode and closed bit: an asymmetric Dekker pair, fence.hpp). After
// that every producer reserves with the shared compare-and-swap. The same idea lets a queue
// with a single consumer (an infeed lane's one reader) publish its pop count with a plain
// store. Elements pushed = reserved count + biased count.
//
// Ordering: FIFO per producer token (moodycamel's guarantee); no order across producers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "bspflow/base/detail/fence.hpp"
#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/feeds/detail/moodycamel.hpp"
#include "bspflow/feeds/push_result.hpp"

namespace bspflow {

namespace detail {

// A biased push's result: a PushResult, or kRevoked when the bias was revoked under it and
// the caller must reserve like a shared producer (never returned to callers).
enum class BiasedPush { kOk, kFull, kClosed, kRevoked };
static_assert(static_cast<int>(BiasedPush::kOk) == static_cast<int>(PushResult::kOk) &&
              static_cast<int>(BiasedPush::kFull) == static_cast<int>(PushResult::kFull) &&
              static_cast<int>(BiasedPush::kClosed) == static_cast<int>(PushResult::kClosed));

template <class T>
class BoundedQueue {
 public:
  // A producer's handle: its moodycamel sub-queue, and the last consumer count it saw (so
  // the bound is checked against the shared counter only when the lane looks full).
  class Token {
   public:
    Token(Token&& o) noexcept
        : token(std::move(o.token)), popped_seen(o.popped_seen),
          queue_(std::exchange(o.queue_, nullptr)), id_(o.id_) {}
    Token& operator=(Token&&) = delete;
    ~Token() {
      if (queue_ != nullptr) queue_->release_token();
    }
    moodycamel::ProducerToken token;
    std::uint64_t popped_seen = 0;

   private:
    friend class BoundedQueue;
    Token(BoundedQueue& q, std::uint64_t id) : token(q.queue_), queue_(&q), id_(id) {}
    BoundedQueue* queue_;
    std::uint64_t id_;
  };
  using ConsumerToken = moodycamel::ConsumerToken;

  // capacity 0 = unbounded. single_consumer: at most one thread pops at a time (an infeed
  // lane's reader), so the pop count is published with a plain store. biased: the first
  // producer token counts its pushes without a locked instruction (see the file comment);
  // waiters then pay a heavy fence when they park.
  explicit BoundedQueue(std::size_t capacity, bool single_consumer = false, bool biased = false)
      : queue_(initial_slots(capacity)), capacity_(capacity), single_consumer_(single_consumer),
        biased_(biased), mode_(biased ? Mode::kUnowned : Mode::kShared) {}

  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  // Any thread, setup path: allocates. The token must not outlive the queue. The first
  // token (or the next one after every token died) is the biased owner; a second live
  // token revokes the bias for good (see the file comment).
  Token make_token() {
    std::lock_guard lock(tokens_mutex_);
    Token t(*this, ++next_token_id_);
    const Mode mode = mode_.load(std::memory_order_relaxed);  // relaxed: under the lock
    if (!biased_) {
      // every producer reserves with the shared compare-and-swap
    } else if (mode == Mode::kUnowned || (mode == Mode::kBiased && live_tokens_ == 0)) {
      owner_id_ = t.id_;
      owner_id_atomic_.store(t.id_, std::memory_order_seq_cst);
      mode_.store(Mode::kBiased, std::memory_order_seq_cst);
    } else if (mode == Mode::kBiased) {
      revoke_bias(Mode::kShared);
    }
    ++live_tokens_;
    return t;
  }
  // Setup path: a consumer token (faster dequeues for a consumer that keeps one).
  ConsumerToken make_consumer_token() { return ConsumerToken(queue_); }

  std::size_t capacity() const noexcept { return capacity_; }

  // Producer (holder of `token`). Never blocks. Moves from `value` only on kOk.
  PushResult try_push(Token& token, T&& value) {
    if (is_owner(token)) {
      const BiasedPush r = biased_push(token, std::move(value));
      if (r != BiasedPush::kRevoked) return static_cast<PushResult>(r);
    }
    const PushResult r = try_reserve(token, 1);
    if (r != PushResult::kOk) return r;
    commit(token, std::move(value));
    return PushResult::kOk;
  }

  // Producer. Blocks while full. Returns false (value untouched) if the queue is closed,
  // or `stop` was set, before a slot was free.
  bool push(Token& token, T&& value, const StopFlag* stop = nullptr) {
    for (;;) {
      const PushResult r = try_push(token, std::move(value));
      if (r == PushResult::kOk) return true;
      if (r == PushResult::kClosed) return false;
      if (stop != nullptr && stop->requested()) return false;
      wait_for_room(stop);
    }
  }

  // Producer. Moves n elements from `first`, in order, reserving as many as fit at a time
  // (one moodycamel bulk enqueue per reservation). Blocks while full. Returns how many were
  // pushed: n, or fewer if the queue closed or `stop` was set first.
  template <class It>
  std::size_t push_bulk(Token& token, It first, std::size_t n, const StopFlag* stop = nullptr) {
    std::size_t done = 0;
    while (done < n) {
      std::size_t want = n - done;
      if (capacity_ != 0 && want > capacity_) want = capacity_;
      if (is_owner(token)) {
        std::size_t pushed = 0;
        const BiasedPush b = biased_push_bulk(token, first, want, pushed);
        if (b == BiasedPush::kOk) {
          std::advance(first, static_cast<std::ptrdiff_t>(pushed));
          done += pushed;
          continue;
        }
        if (b == BiasedPush::kClosed) return done;
        if (b == BiasedPush::kFull) {
          if (stop != nullptr && stop->requested()) return done;
          wait_for_room(stop);
          continue;
        }
        // kRevoked: reserve like everybody else from now on
      }
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
        wait_for_room(stop);
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
    spin_until([&] {
      n = try_pop_bulk(out, max, ctok);
      if (n != 0) return true;
      ended = (++tries & 63u) == 0 && (drained() || stopped(stop));
      return ended;
    }, mode, budget);
    for (;;) {
      if (n != 0) return n;
      if (ended || drained() || stopped(stop)) return 0;
      if (pending()) {
        // Still mid-enqueue after a whole spin budget: the producer was descheduled
        // (oversubscribed cores); give it the core.
        std::this_thread::yield();
      } else {
        not_empty_.wait([&] { return pending() || is_closed() || stopped(stop); }, mode,
                        biased_ ? Fence::kAsymmetric : Fence::kSymmetric,
                        policy != nullptr ? std::chrono::nanoseconds{0} : tunables::kSpinBudget);
      }
      n = try_pop_bulk(out, max, ctok);
    }
  }

  // Any thread. End of data: pushes fail from now on; consumers drain what is left, then
  // see end of data. Wakes everybody parked. Idempotent.
  void close() noexcept {
    reserved_.fetch_or(kClosedBit, std::memory_order_seq_cst);
    if (biased_) {
      // A biased owner may be inside a push that saw the queue open: let it finish, so the
      // count is final before anyone may conclude "drained".
      heavy_fence();
      wait_until_owner_idle();
    }
    close_done_.store(true, std::memory_order_seq_cst);
    not_empty_.notify();
    not_full_.notify();
  }

  // Any thread, when no producer is active: accept pushes again (outfeeds between runs).
  void reopen() noexcept {
    close_done_.store(false, std::memory_order_seq_cst);
    reserved_.fetch_and(~kClosedBit, std::memory_order_seq_cst);
  }

  // Any thread. Wakes parked producers and consumers so they re-check their stop flag.
  void wake_all() noexcept {
    not_empty_.notify();
    not_full_.notify();
  }

  bool is_closed() const noexcept {
    return (reserved_.load(std::memory_order_seq_cst) & kClosedBit) != 0;
  }
  // Closed (and its grace period over) and every pushed element popped.
  bool drained() const noexcept {
    return close_done_.load(std::memory_order_seq_cst) &&
           total_pushed() == popped_.load(std::memory_order_seq_cst);
  }
  // Elements reserved but not popped (approximate while producers run).
  std::size_t size_approx() const noexcept {
    const std::uint64_t r = total_pushed();
    const std::uint64_t p = popped_.load(std::memory_order_acquire);
    return r > p ? static_cast<std::size_t>(r - p) : 0;
  }
  // Elements pushed (reserved by shared producers plus counted by the biased owner).
  std::uint64_t total_pushed() const noexcept {
    return (reserved_.load(std::memory_order_seq_cst) & kCountMask) +
           biased_pushed_.load(std::memory_order_seq_cst);
  }
  std::uint64_t total_popped() const noexcept { return popped_.load(std::memory_order_acquire); }

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
  bool pending() const noexcept { return total_pushed() != popped_.load(std::memory_order_seq_cst); }

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
  void wait_for_room(const StopFlag* stop) {
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
    // Frozen once the bias is revoked (and a shared producer only gets here after that).
    const std::uint64_t biased = biased_pushed_.load(std::memory_order_acquire);
    for (;;) {
      if ((r & kClosedBit) != 0) return PushResult::kClosed;
      if (capacity_ != 0 && (r & kCountMask) + biased + n - token.popped_seen > capacity_) {
        token.popped_seen = popped_.load(std::memory_order_seq_cst);
        if ((r & kCountMask) + biased + n - token.popped_seen > capacity_) {
          return PushResult::kFull;
        }
      }
      if (reserved_.compare_exchange_weak(r, r + n, std::memory_order_seq_cst,
                                          std::memory_order_relaxed)) {
        return PushResult::kOk;
      }
    }
  }

  enum class Mode : std::uint32_t { kUnowned, kBiased, kShared };

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

  // relaxed loads: a stale kBiased is caught inside enter_biased (busy flag, fence,
  // re-check); the owner id is set before the owning token is handed out.
  bool is_owner(const Token& token) const noexcept {
    return mode_.load(std::memory_order_relaxed) == Mode::kBiased &&
           owner_id_atomic_.load(std::memory_order_relaxed) == token.id_;
  }

  // The owner's way in: busy flag, light fence, then check that the bias and the queue
  // still hold. Returns kRevoked when the caller must reserve like a shared producer.
  bool enter_biased() noexcept {
    owner_busy_.store(true, std::memory_order_relaxed);  // relaxed: ordered by the fence pair
    light_fence();
    if (mode_.load(std::memory_order_relaxed) == Mode::kBiased &&  // relaxed: fence pair
        (reserved_.load(std::memory_order_relaxed) & kClosedBit) == 0) {
      return true;
    }
    owner_busy_.store(false, std::memory_order_release);
    return false;
  }
  void leave_biased(std::uint64_t new_count) noexcept {
    biased_pushed_.store(new_count, std::memory_order_release);
    owner_busy_.store(false, std::memory_order_release);
    not_empty_.notify_light();
  }
  BiasedPush revoked_result() const noexcept {
    return (reserved_.load(std::memory_order_seq_cst) & kClosedBit) != 0 ? BiasedPush::kClosed
                                                                         : BiasedPush::kRevoked;
  }
  // Room for n more, checked against the owner's cached view of the consumer first.
  bool biased_room(Token& token, std::uint64_t count, std::size_t n) noexcept {
    if (capacity_ == 0) return true;
    const std::uint64_t base = reserved_.load(std::memory_order_relaxed) & kCountMask;  // relaxed: constant while biased
    if (base + count + n - token.popped_seen <= capacity_) return true;
    token.popped_seen = popped_.load(std::memory_order_acquire);
    return base + count + n - token.popped_seen <= capacity_;
  }

  BiasedPush biased_push(Token& token, T&& value) {
    if (!enter_biased()) return revoked_result();
    const std::uint64_t count = biased_pushed_.load(std::memory_order_relaxed);  // relaxed: our own word
    if (!biased_room(token, count, 1)) {
      owner_busy_.store(false, std::memory_order_release);
      return BiasedPush::kFull;
    }
    if (!queue_.enqueue(token.token, std::move(value))) {
      owner_busy_.store(false, std::memory_order_release);
      throw std::bad_alloc();
    }
    leave_biased(count + 1);
    return BiasedPush::kOk;
  }

  template <class It>
  BiasedPush biased_push_bulk(Token& token, It first, std::size_t want, std::size_t& pushed) {
    if (!enter_biased()) return revoked_result();
    const std::uint64_t count = biased_pushed_.load(std::memory_order_relaxed);  // relaxed: our own word
    std::size_t n = want;
    if (!biased_room(token, count, n)) {
      const std::uint64_t base = reserved_.load(std::memory_order_relaxed) & kCountMask;  // relaxed: constant while biased
      const std::uint64_t used = base + count - token.popped_seen;
      n = used >= capacity_ ? 0 : static_cast<std::size_t>(capacity_ - used);
      if (n > want) n = want;
      if (n == 0) {
        owner_busy_.store(false, std::memory_order_release);
        return BiasedPush::kFull;
      }
    }
    const bool enqueued = enqueue_bulk(token, first, n);
    if (!enqueued) {
      owner_busy_.store(false, std::memory_order_release);
      throw std::bad_alloc();
    }
    pushed = n;
    leave_biased(count + n);
    return BiasedPush::kOk;
  }

  // Revoking side (close, a second token): after publishing the change and a heavy fence,
  // wait for an owner that entered before it to leave.
  void wait_until_owner_idle() noexcept {
    while (owner_busy_.load(std::memory_order_acquire)) std::this_thread::yield();
  }
  void revoke_bias(Mode to) noexcept {  // under tokens_mutex_
    mode_.store(to, std::memory_order_seq_cst);
    heavy_fence();
    wait_until_owner_idle();
  }
  void release_token() noexcept {
    std::lock_guard lock(tokens_mutex_);
    --live_tokens_;
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
  const bool biased_;
  // Written by producers (CAS) and close(); read by consumers when they find nothing.
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> reserved_{0};
  // Written by consumers; read by producers only to check the bound.
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> popped_{0};
  // Written by the biased owner only (its count, and whether it is inside a push).
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> biased_pushed_{0};
  std::atomic<bool> owner_busy_{false};
  // Rarely written: producer mode, who owns the bias, close() finished.
  alignas(tunables::kCacheLine) std::atomic<Mode> mode_;
  std::atomic<std::uint64_t> owner_id_atomic_{0};
  std::atomic<bool> close_done_{false};
  std::mutex tokens_mutex_;  // token creation and release (setup paths)
  std::uint64_t next_token_id_ = 0;
  std::uint64_t owner_id_ = 0;
  std::uint32_t live_tokens_ = 0;
  WaitPoint not_empty_;
  WaitPoint not_full_;
};

}  // namespace detail
}  // namespace bspflow
