// Internal (not installed): the dataflow hand-off between neighbouring pipeline stages.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow::detail {

using Clock = std::chrono::steady_clock;

// The input ended mid-run (thrown by stage 0, turned into RunStatus::kEndOfData).
struct EndOfInput {
  std::uint64_t step;
  std::uint64_t micro_batch;
};

// A bounded single-producer single-consumer queue of fixed-size float messages between two
// neighbouring stages (dataflow mode). Each side keeps its own copy of the other's index and
// re-reads the shared one only when its copy says the queue is full (producer) or empty
// (consumer), so a busy queue moves about one cache line per message, the message itself.
// Indices are published with release stores and a light fence (notify_light); a waiter
// spins briefly, then parks with the matching heavy fence. A stop request (then wake())
// ends any wait.
class Handoff {
 public:
  Handoff(std::size_t capacity, std::size_t elements, detail::Spin spin)
      : slots_(capacity, std::vector<float>(elements)), spin_(spin) {}

  // Producer. The next free slot (waits for room); nullptr if stopped first.
  float* acquire(const detail::StopFlag& stop) {
    const std::uint64_t t = producer_.tail;
    if (t - producer_.head_seen >= slots_.size()) {
      not_full_.wait(
          [&] {
            producer_.head_seen = head_.load(std::memory_order_seq_cst);
            return t - producer_.head_seen < slots_.size() || stop.requested();
          },
          spin_, detail::Fence::kAsymmetric);
      if (t - producer_.head_seen >= slots_.size()) return nullptr;
    }
    return slots_[t % slots_.size()].data();
  }
  void publish() {
    tail_.store(++producer_.tail, std::memory_order_release);  // the message, then its index
    not_empty_.notify_light();
  }
  // Producer. No message follows: the consumer's front() returns nullptr once it has
  // read every message published before this, and ended() is then true.
  void close() {
    closed_.store(true, std::memory_order_seq_cst);  // after every publish(); see front()
    not_empty_.notify();
  }
  // Consumer. Never blocks: a message is ready, or the queue is closed and drained (so
  // front() would return at once).
  bool ready() {
    const std::uint64_t h = consumer_.head;
    if (consumer_.tail_seen > h) return true;
    consumer_.tail_seen = tail_.load(std::memory_order_acquire);
    return consumer_.tail_seen > h || closed_.load(std::memory_order_acquire);
  }
  // Consumer. The oldest message (waits for one); nullptr if stopped first or if the
  // producer closed the queue and every message has been read (ended()).
  const float* front(const detail::StopFlag& stop) {
    const std::uint64_t h = consumer_.head;
    if (consumer_.tail_seen <= h) {
      not_empty_.wait(
          [&] {
            consumer_.tail_seen = tail_.load(std::memory_order_seq_cst);
            return consumer_.tail_seen > h || stop.requested() || closed_.load(std::memory_order_seq_cst);
          },
          spin_, detail::Fence::kAsymmetric);
      if (consumer_.tail_seen <= h) {
        // Closed: everything published before close() is visible now; read the index once
        // more, since the load above may predate the last publish().
        consumer_.tail_seen = tail_.load(std::memory_order_acquire);
        if (consumer_.tail_seen <= h) return nullptr;
      }
    }
    return slots_[h % slots_.size()].data();
  }
  // Consumer: closed, and every message read.
  bool ended() const noexcept {
    return closed_.load(std::memory_order_acquire) && tail_.load(std::memory_order_acquire) <= consumer_.head;
  }
  void release() {
    head_.store(++consumer_.head, std::memory_order_release);  // done reading the slot
    not_full_.notify_light();
  }
  // Between runs only: forgets messages a stopped run left behind.
  void reset() noexcept {
    producer_ = {};
    consumer_ = {};
    head_.store(0, std::memory_order_relaxed);  // relaxed: nobody is using the queue
    tail_.store(0, std::memory_order_relaxed);  // relaxed: likewise, between runs
    closed_.store(false, std::memory_order_relaxed);  // relaxed: likewise
  }
  void wake() noexcept {
    not_full_.notify();
    not_empty_.notify();
  }

 private:
  // Each side's own counters, on its own cache line: only that side's thread touches them.
  struct alignas(tunables::kCacheLine) Producer {
    std::uint64_t tail = 0;       // the next message's index
    std::uint64_t head_seen = 0;  // the consumer's index when last read
  };
  struct alignas(tunables::kCacheLine) Consumer {
    std::uint64_t head = 0;       // the next message to read
    std::uint64_t tail_seen = 0;  // the producer's index when last read
  };
  std::vector<std::vector<float>> slots_;
  detail::Spin spin_;
  Producer producer_;
  Consumer consumer_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> head_{0};
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> tail_{0};
  std::atomic<bool> closed_{false};  // written once per run, after the last message
  detail::WaitPoint not_empty_;
  detail::WaitPoint not_full_;
};

}  // namespace bspflow::detail
