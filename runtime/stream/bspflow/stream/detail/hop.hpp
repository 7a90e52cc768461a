// Internal to streams (installed because the stream templates use it): a hop, the queue that
// joins one device's segment to another's: one single-producer single-consumer lane per
// priority class, so its consumer serves the higher class first.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/stream/detail/request_state.hpp"

namespace bspflow::detail {

// The untyped part of a Hop: what the stream's core needs (reset, wake, depth, close).
class HopBase {
 public:
  virtual ~HopBase() = default;
  virtual void reset() noexcept = 0;
  virtual void wake() noexcept = 0;
  virtual void close() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
};

// One producer segment to one consumer segment, `lanes` priority classes of `capacity`
// requests each. Producer: push, close. Consumer: ready, try_front, front, wait_any, pop.
template <class T>
class Hop final : public HopBase {
 public:
  Hop(std::size_t capacity, std::uint32_t lanes) : lanes_(lanes) {
    if (capacity < 1 || capacity > tunables::kMaxQueueCapacity) {
      throw_bad_value("StreamConfig::hop_capacity", capacity,
                      "must be in 1.." + std::to_string(tunables::kMaxQueueCapacity));
    }
    lane_ = std::make_unique<Lane[]>(lanes);
    for (std::uint32_t c = 0; c < lanes; ++c) {
      lane_[c].slots.resize(std::bit_ceil(capacity));
      lane_[c].mask = lane_[c].slots.size() - 1;
      lane_[c].capacity = capacity;
    }
  }

  // ---- producer ----

  // Moves `e` into lane `c`, waiting while it is full as `policy` says; false (e untouched)
  // if `stop` was set first.
  bool push(std::uint32_t c, Queued<T>&& e, const WaitPolicy& policy, const StopFlag& stop) {
    Lane& l = lane_[c];
    const std::uint64_t t = l.tail;
    if (t - l.head_seen >= l.capacity) {
      l.head_seen = l.head.load(std::memory_order_acquire);
      if (t - l.head_seen >= l.capacity) {
        wait_with(
            l.not_full, policy,
            [&] {
              l.head_seen = l.head.load(std::memory_order_seq_cst);
              return t - l.head_seen < l.capacity || stop.requested();
            },
            Fence::kAsymmetric);
        if (t - l.head_seen >= l.capacity) return false;
      }
    }
    l.slots[t & l.mask] = std::move(e);
    l.tail_pub.store(++l.tail, std::memory_order_release);
    not_empty_.notify_light();
    return true;
  }
  void close() noexcept override {
    closed_.store(true, std::memory_order_seq_cst);
    not_empty_.notify();
  }

  // ---- consumer ----

  // The lanes holding a request now, as a bit mask.
  std::uint32_t ready() noexcept {
    std::uint32_t mask = 0;
    for (std::uint32_t c = 0; c < lanes_; ++c) {
      if (try_front(c) != nullptr) mask |= 1u << c;
    }
    return mask;
  }
  // The oldest request of lane c, or nullptr.
  Queued<T>* try_front(std::uint32_t c) noexcept {
    Lane& l = lane_[c];
    if (l.tail_seen <= l.head_local) {
      l.tail_seen = l.tail_pub.load(std::memory_order_acquire);
      if (l.tail_seen <= l.head_local) return nullptr;
    }
    return &l.slots[l.head_local & l.mask];
  }
  // Waits for the oldest request of lane c: nullptr if the hop is closed and lane c drained,
  // or on stop.
  Queued<T>* front(std::uint32_t c, const WaitPolicy& policy, const StopFlag& stop) {
    if (Queued<T>* e = try_front(c)) return e;
    wait_with(
        not_empty_, policy,
        [&] {
          return try_front_seq(c) || closed_.load(std::memory_order_seq_cst) || stop.requested();
        },
        Fence::kAsymmetric);
    return try_front(c);
  }
  // Waits until some lane holds a request (true), or the hop is closed and drained, or
  // stop (false).
  bool wait_any(const WaitPolicy& policy, const StopFlag& stop) {
    if (ready() != 0) return true;
    wait_with(
        not_empty_, policy,
        [&] {
          for (std::uint32_t c = 0; c < lanes_; ++c) {
            if (try_front_seq(c)) return true;
          }
          return closed_.load(std::memory_order_seq_cst) || stop.requested();
        },
        Fence::kAsymmetric);
    return ready() != 0;
  }
  void pop(std::uint32_t c) noexcept {
    Lane& l = lane_[c];
    l.head.store(++l.head_local, std::memory_order_release);
    l.not_full.notify_light();
  }
  bool closed() const noexcept { return closed_.load(std::memory_order_seq_cst); }

  // ---- any thread, or between runs ----

  std::size_t size() const noexcept override {
    std::size_t n = 0;
    for (std::uint32_t c = 0; c < lanes_; ++c) {
      // relaxed: a metric only
      const auto h = lane_[c].head.load(std::memory_order_relaxed);
      const auto t = lane_[c].tail_pub.load(std::memory_order_relaxed);
      n += t > h ? static_cast<std::size_t>(t - h) : 0;
    }
    return n;
  }
  void wake() noexcept override {
    not_empty_.notify();
    for (std::uint32_t c = 0; c < lanes_; ++c) lane_[c].not_full.notify();
  }
  // Between runs (neither side running): empty and open.
  void reset() noexcept override {
    for (std::uint32_t c = 0; c < lanes_; ++c) {
      Lane& l = lane_[c];
      for (auto& s : l.slots) s = Queued<T>{};
      l.tail = l.head_seen = l.head_local = l.tail_seen = 0;
      l.head.store(0, std::memory_order_relaxed);      // relaxed: nobody uses the hop
      l.tail_pub.store(0, std::memory_order_relaxed);  // relaxed: likewise
    }
    closed_.store(false, std::memory_order_relaxed);  // relaxed: likewise
  }
  // After a stopped run (neither side running): calls f(queued request) for every request still
  // held, then empties the hop.
  template <class F>
  void sweep(F&& f) {
    for (std::uint32_t c = 0; c < lanes_; ++c) {
      while (Queued<T>* e = try_front(c)) {
        f(*e);
        pop(c);
      }
    }
  }

 private:
  bool try_front_seq(std::uint32_t c) noexcept {
    Lane& l = lane_[c];
    l.tail_seen = l.tail_pub.load(std::memory_order_seq_cst);
    return l.tail_seen > l.head_local;
  }

  struct Lane {
    std::vector<Queued<T>> slots;
    std::size_t mask = 0, capacity = 0;
    alignas(tunables::kCacheLine) std::uint64_t tail = 0;  // producer's
    std::uint64_t head_seen = 0;
    alignas(tunables::kCacheLine) std::uint64_t head_local = 0;  // consumer's
    std::uint64_t tail_seen = 0;
    alignas(tunables::kCacheLine) std::atomic<std::uint64_t> tail_pub{0};
    alignas(tunables::kCacheLine) std::atomic<std::uint64_t> head{0};
    WaitPoint not_full;
  };
  std::uint32_t lanes_;
  std::unique_ptr<Lane[]> lane_;
  WaitPoint not_empty_;
  alignas(tunables::kCacheLine) std::atomic<bool> closed_{false};
};

}  // namespace bspflow::detail
