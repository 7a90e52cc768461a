/// @file
/// `SpscRing<T>`: a bounded single-producer single-consumer ring with close, the hand-off
/// between two neighbouring stages of a stream that run on different devices. Slots are made
/// once, at construction, so pushing and popping never allocate. Guide: feeds/README.md.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"

namespace bspflow {

/// A bounded ring with close. One producer thread (try_push, push, claim, publish, close) and
/// one consumer thread (try_front, front, pop, closed_and_drained) at a time; wake() from any
/// thread. FIFO: after close() the consumer drains what was pushed before, then front()
/// reports the end (nullptr with closed_and_drained() true). Each side re-reads the other's
/// index only when its own copy says the ring is full or empty.
template <class T>
class SpscRing {
 public:
  /// `capacity` slots (1..tunables::kMaxQueueCapacity), default-constructed. Throws
  /// bspflow::Error outside that range.
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit SpscRing(std::size_t capacity) {
    if (capacity < 1 || capacity > tunables::kMaxQueueCapacity) {
      detail::throw_bad_value("ring capacity", capacity,
                              "must be in 1.." + std::to_string(tunables::kMaxQueueCapacity));
    }
    capacity_ = capacity;
    slots_.resize(std::bit_ceil(capacity));  // a power of two: a slot is an index & mask
    mask_ = slots_.size() - 1;
  }
  /// `capacity` slots, each a copy of `prototype` (a buffer the producer fills in place with
  /// claim()/publish(), so the steady state never allocates).
  /// Contract: host; non-blocking; allocates; throws Error.
  SpscRing(std::size_t capacity, const T& prototype) : SpscRing(capacity) {
    std::fill(slots_.begin(), slots_.end(), prototype);
  }
  SpscRing(const SpscRing&) = delete;
  SpscRing& operator=(const SpscRing&) = delete;

  /// The capacity given at construction.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t capacity() const noexcept { return capacity_; }
  /// How many elements the ring holds now (a moment's view, for metrics).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t size() const noexcept {
    const std::uint64_t h = head_.load(std::memory_order_relaxed);  // relaxed: a metric only
    const std::uint64_t t = tail_.load(std::memory_order_relaxed);
    return t > h ? static_cast<std::size_t>(t - h) : 0;
  }

  // ---- producer ----

  /// Moves `value` in and returns true if there is room; false (value untouched) if the
  /// ring is full. Throws only what T's move assignment throws: noexcept when it is.
  /// Contract: producer; non-blocking; no-alloc; noexcept.
  bool try_push(T&& value) noexcept(noexcept(std::declval<T&>() = std::declval<T&&>())) {
    const std::uint64_t t = producer_.tail;
    if (t - producer_.head_seen >= capacity_) {
      producer_.head_seen = head_.load(std::memory_order_acquire);
      if (t - producer_.head_seen >= capacity_) return false;
    }
    slots_[t & mask_] = std::move(value);
    publish();
    return true;
  }

  /// Moves `value` in, waiting while the ring is full as `policy` says. Returns false (value
  /// untouched) if `stop` was set first. Throws only what T's move assignment throws:
  /// noexcept when it is.
  /// Contract: producer; blocks; no-alloc; noexcept.
  bool push(T&& value, const WaitPolicy& policy,
            const StopFlag& stop) noexcept(noexcept(std::declval<T&>() = std::declval<T&&>())) {
    T* slot = claim(policy, stop);
    if (slot == nullptr) return false;
    *slot = std::move(value);
    publish();
    return true;
  }

  /// In place (the Disruptor's claim, then publish): the next free slot, to fill and then
  /// publish(); waits while the ring is full, as `policy` says; nullptr if `stop` was set
  /// first. The slot holds whatever it held before (its buffers are reused).
  /// Contract: producer; blocks; no-alloc; noexcept.
  T* claim(const WaitPolicy& policy, const StopFlag& stop) noexcept {
    const std::uint64_t t = producer_.tail;
    if (t - producer_.head_seen >= capacity_) {
      const detail::WaitMark mark(&room_site_);  // the stall check's record, while waiting
      detail::wait_with(
          not_full_, policy,
          [&] {
            producer_.head_seen = head_.load(std::memory_order_seq_cst);
            return t - producer_.head_seen < capacity_ || stop.requested();
          },
          detail::Fence::kAsymmetric);
      if (t - producer_.head_seen >= capacity_) return nullptr;
    }
    return &slots_[t & mask_];
  }
  /// Hands the slot claim() returned to the consumer.
  /// Contract: producer; non-blocking; no-alloc; noexcept.
  void publish() noexcept {
    tail_.store(++producer_.tail, std::memory_order_release);  // the element, then its index
    not_empty_.notify_light();
  }

  /// No more pushes: the consumer drains what is there, then sees the end.
  /// Contract: producer; non-blocking; no-alloc; noexcept.
  void close() noexcept {
    closed_.store(true, std::memory_order_seq_cst);
    not_empty_.notify();
  }

  // ---- consumer ----

  /// The oldest element, or nullptr if the ring is empty now.
  /// Contract: consumer; non-blocking; no-alloc; noexcept.
  T* try_front() noexcept {
    const std::uint64_t h = consumer_.head;
    if (consumer_.tail_seen <= h) {
      consumer_.tail_seen = tail_.load(std::memory_order_acquire);
      if (consumer_.tail_seen <= h) return nullptr;
    }
    return &slots_[h & mask_];
  }

  /// Waits until an element is there (returns it, in place: read or move from it, then
  /// pop()), the ring is closed and drained, or `stop` is set (both: nullptr). Waits as
  /// `policy` says.
  /// Contract: consumer; blocks; no-alloc; noexcept.
  T* front(const WaitPolicy& policy, const StopFlag& stop) noexcept {
    if (T* f = try_front()) return f;
    const std::uint64_t h = consumer_.head;
    const detail::WaitMark mark(&next_site_);  // the stall check's record, while waiting
    detail::wait_with(
        not_empty_, policy,
        [&] {
          // The element, with each look at the index (see prefetch_for_read).
          detail::prefetch_for_read(&slots_[h & mask_]);
          consumer_.tail_seen = tail_.load(std::memory_order_seq_cst);
          return consumer_.tail_seen > h || closed_.load(std::memory_order_seq_cst) ||
                 stop.requested();
        },
        detail::Fence::kAsymmetric);
    if (consumer_.tail_seen <= h) {
      // Closed (or stopped): the producer published its last index before closing.
      consumer_.tail_seen = tail_.load(std::memory_order_seq_cst);
      if (consumer_.tail_seen <= h) return nullptr;
    }
    return &slots_[h & mask_];
  }

  /// Releases the element front() returned.
  /// Contract: consumer; non-blocking; no-alloc; noexcept.
  void pop() noexcept {
    head_.store(++consumer_.head, std::memory_order_release);  // done with the slot
    not_full_.notify_light();
  }

  /// True once the ring is closed and everything pushed was popped.
  /// Contract: consumer; non-blocking; no-alloc; noexcept.
  bool closed_and_drained() const noexcept {
    return closed_.load(std::memory_order_seq_cst) &&
           tail_.load(std::memory_order_seq_cst) == consumer_.head;
  }

  /// Between runs only (neither side in use): empty and open again.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  void reset() noexcept {
    producer_ = {};
    consumer_ = {};
    head_.store(0, std::memory_order_relaxed);        // relaxed: nobody is using the ring
    tail_.store(0, std::memory_order_relaxed);        // relaxed: likewise
    closed_.store(false, std::memory_order_relaxed);  // relaxed: likewise
  }

  /// Wakes a parked side so it re-checks its stop flag.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  void wake() noexcept {
    not_full_.notify();
    not_empty_.notify();
  }

 private:
  /// Each side's own counters, on its own cache line: only that side's thread touches them.
  struct alignas(tunables::kCacheLine) ProducerSide {
    std::uint64_t tail = 0;       ///< the next element's index
    std::uint64_t head_seen = 0;  ///< the consumer's index when last read
  };
  struct alignas(tunables::kCacheLine) ConsumerSide {
    std::uint64_t head = 0;       ///< the next element to read
    std::uint64_t tail_seen = 0;  ///< the producer's index when last read
  };
  std::vector<T> slots_;  ///< bit_ceil(capacity) of them; at most capacity_ hold elements
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  ProducerSide producer_;
  ConsumerSide consumer_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> head_{0};
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> tail_{0};
  alignas(tunables::kCacheLine) std::atomic<bool> closed_{false};
  detail::WaitPoint not_empty_;
  detail::WaitPoint not_full_;
  /// What a device waiting on either side waits for (its stall check's record).
  detail::WaitSite next_site_{detail::WaitKind::kHandoff,
                              "the next message of a hand-off ring (from the device before it)",
                              [this] { return held(); }};
  detail::WaitSite room_site_{detail::WaitKind::kHandoff,
                              "room in a hand-off ring (to the device after it)",
                              [this] { return held(); }};
  std::string held() const {
    return std::to_string(size()) + " of " + std::to_string(capacity_) + " held" +
           (closed_.load(std::memory_order_relaxed) ? ", closed" : "");  // relaxed: a report
  }
};

}  // namespace bspflow
