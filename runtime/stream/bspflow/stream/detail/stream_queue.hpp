// Internal to streams (installed because the stream templates use it): the admission
// queue's parts (stream_hub.hpp's Intake): its lock, and one priority class's requests.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/stream/detail/stream_port.hpp"

namespace bspflow::detail {

// The admission queue's lock: held for a few hundred nanoseconds at most, by one client push
// or one device take, so a waiter spins briefly, then yields, and never sleeps on a futex (a
// std::mutex's wake-up is a system call on each side whenever a client and a device meet).
class QueueLock {
 public:
  void lock() noexcept {
    for (unsigned spins = 0; held_.exchange(true, std::memory_order_acquire);) {
      while (held_.load(std::memory_order_relaxed)) {
        if (++spins < 128) {
          cpu_relax();
        } else {
          std::this_thread::yield();  // the holder may share this core
        }
      }
    }
  }
  void unlock() noexcept { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// Heap order: the request served later compares less.
template <class In>
struct Later {
  bool operator()(const Envelope<In>& a, const Envelope<In>& b) const noexcept {
    if (a.meta.deadline != b.meta.deadline) return a.meta.deadline > b.meta.deadline;
    return a.meta.order > b.meta.order;
  }
};

// One class's requests. With earliest-deadline-first, those with a deadline in a heap
// (the earliest on top), served before the others; the others (all of them without
// earliest-deadline-first) in a ring, in push order: O(1) for requests without deadlines.
// Both hold `capacity` from the start, so the steady state allocates nothing.
template <class In>
class ClassQueue {
 public:
  void reserve(std::size_t capacity, bool edf) {
    if (edf) heap_.reserve(capacity);
    ring_.resize(capacity);
  }
  std::size_t size() const noexcept { return heap_.size() + count_; }
  bool empty() const noexcept { return size() == 0; }
  void push(Envelope<In>&& e, bool edf) {
    if (edf && e.meta.deadline != kNoDeadline) {
      heap_.push_back(std::move(e));
      std::push_heap(heap_.begin(), heap_.end(), Later<In>{});
    } else {
      ring_[(head_ + count_) % ring_.size()] = std::move(e);
      ++count_;
    }
  }
  // The next one served; the queue must not be empty.
  void pop(Envelope<In>& out) {
    if (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), Later<In>{});
      out = std::move(heap_.back());
      heap_.pop_back();
      return;
    }
    out = std::move(ring_[head_]);
    head_ = (head_ + 1) % ring_.size();
    --count_;
  }
  // Element i: the heap's (in heap order), then the ring's (in push order).
  const Envelope<In>& at(std::size_t i) const {
    return i < heap_.size() ? heap_[i] : ring_[(head_ + i - heap_.size()) % ring_.size()];
  }
  // The index of the request served last: the ring's newest, else the heap's latest.
  std::size_t latest() const {
    if (count_ > 0) return size() - 1;
    std::size_t last = 0;
    for (std::size_t i = 1; i < heap_.size(); ++i) {
      if (Later<In>{}(heap_[i], heap_[last])) last = i;
    }
    return last;
  }
  // Removes element i (shed).
  void remove(std::size_t i) {
    if (i < heap_.size()) {
      heap_[i] = std::move(heap_.back());
      heap_.pop_back();
      std::make_heap(heap_.begin(), heap_.end(), Later<In>{});
      return;
    }
    // Close the gap in the ring: the later ones move up one place.
    for (std::size_t k = i - heap_.size(); k + 1 < count_; ++k) {
      ring_[(head_ + k) % ring_.size()] = std::move(ring_[(head_ + k + 1) % ring_.size()]);
    }
    ring_[(head_ + count_ - 1) % ring_.size()] = Envelope<In>{};
    --count_;
  }

 private:
  std::vector<Envelope<In>> heap_;
  std::vector<Envelope<In>> ring_;
  std::size_t head_ = 0, count_ = 0;
};

}  // namespace bspflow::detail
