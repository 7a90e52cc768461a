// Internal to streams: where a run's answers go: each client's own response slots
// (ClientRing), written by the Responder.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/stream_core.hpp"

namespace bspflow::detail {

// A StreamClient's responses, in slots indexed by its sequence numbers: any replica's last
// device writes a slot, the client reads them in its order (or in any order).
template <class Out>
class ClientRing final : public ClientCore {
 public:
  explicit ClientRing(std::size_t capacity)
      : ClientCore(capacity), slots_(std::make_unique<Slot[]>(capacity)) {}
  // Any thread, once per request. `notify` false: the caller calls notify_and_settle() soon
  // (after a batch's other responses), counting this one.
  void deliver(std::uint64_t sequence, Response<Out>&& r, bool notify = true) {
    if (!abandoned.load(std::memory_order_relaxed)) {
      Slot& s = slots_[sequence & mask_];
      s.response.emplace(std::move(r));
      s.ready.store(sequence, std::memory_order_release);
    }
    delivered.fetch_add(1, std::memory_order_seq_cst);  // pairs with the client's wait
    if (notify) notify_and_settle(1);
  }
  // Client thread: the response to `sequence` if it is there.
  bool ready(std::uint64_t sequence) const noexcept {
    return slots_[sequence & mask_].ready.load(std::memory_order_acquire) == sequence;
  }
  // Client thread: moves the response out; the slot is marked taken (Ordering::kNone, until
  // the client's oldest passes it: clear()) or free.
  Response<Out> take(std::uint64_t sequence, bool mark_taken) {
    Slot& s = slots_[sequence & mask_];
    Response<Out> r = std::move(*s.response);
    s.response.reset();
    // relaxed: the client's own mark; a writer stores the slot's next sequence only after
    // the client pushed it, which happens after this.
    s.ready.store(mark_taken ? kTaken : kNone, std::memory_order_relaxed);
    return r;
  }
  bool taken(std::uint64_t sequence) const noexcept {
    return slots_[sequence & mask_].ready.load(std::memory_order_relaxed) == kTaken;
  }
  void clear(std::uint64_t sequence) noexcept {
    slots_[sequence & mask_].ready.store(kNone, std::memory_order_relaxed);
  }

  static constexpr std::uint64_t kTaken = kNone - 1;

 private:
  struct Slot {
    std::atomic<std::uint64_t> ready{kNone};
    std::optional<Response<Out>> response;
  };
  std::unique_ptr<Slot[]> slots_;
};

// Where every answer of a run goes: the client's own ring. Also answers requests directly
// (shed, cancelled) and keeps their figures.
template <class Out>
class Responder final : public Answerer {
 public:
  explicit Responder(StreamCore& core) : core_(core), direct_latency_(kMeterHighestNs) {}

  // Host thread, at start.
  void begin() {
    std::lock_guard lock(stats_mutex_);
    run_delivered_ = run_errors_ = 0;
  }

  // Any thread (a replica's last device, or whoever answers directly). `notify` false: the
  // caller calls m.client->notify_and_settle() soon (after a batch's other responses).
  void deliver(const RequestMeta& m, Response<Out>&& r, bool notify = true) {
    static_cast<ClientRing<Out>*>(m.client)->deliver(m.id.sequence, std::move(r), notify);
  }

  void answer_error(const RequestMeta& m, std::shared_ptr<const RequestError> error) override {
    Response<Out> r;
    r.id = m.id;
    r.latency = StreamClock::now() - m.arrival;
    const std::size_t kind = static_cast<std::size_t>(error->kind);
    r.error = std::move(error);
    {
      std::lock_guard lock(stats_mutex_);
      direct_latency_.record(
          static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.latency.count())));
      bump(direct_answered_);
      bump(direct_errors_[kind]);
      ++run_delivered_;
      ++run_errors_;
    }
    deliver(m, std::move(r));
  }

  // Host thread, the run over: the direct answers of this run (the last sinks count their
  // own), and the errors among them (all of them).
  std::uint64_t delivered() const noexcept { return run_delivered_; }
  std::uint64_t errors() const noexcept { return run_errors_; }

  // Any thread: the direct answers' figures.
  void add_stats(StreamStats& s) const {
    std::lock_guard lock(stats_mutex_);
    s.latency_ns.merge(direct_latency_.snapshot());
    s.answered += direct_answered_.load(std::memory_order_relaxed);
    for (std::size_t k = 0; k < 4; ++k)
      s.errors[k] += direct_errors_[k].load(std::memory_order_relaxed);
  }

  // Setup: a new client's ring, kept until the stream and the client are both done with it.
  std::shared_ptr<ClientRing<Out>> make_client() {
    std::lock_guard lock(clients_mutex_);
    std::erase_if(clients_, [](const std::shared_ptr<ClientRing<Out>>& c) {
      // settled, not delivered: a deliverer may still be waking the client.
      return c->abandoned.load() && c->settled.load(std::memory_order_acquire) == c->sent.load();
    });
    auto ring = std::make_shared<ClientRing<Out>>(std::bit_ceil(core_.config.response_capacity));
    clients_.push_back(ring);
    return ring;
  }

 private:
  StreamCore& core_;
  mutable std::mutex stats_mutex_;
  Histogram direct_latency_;
  std::atomic<std::uint64_t> direct_answered_{0};
  std::atomic<std::uint64_t> direct_errors_[4] = {};
  std::uint64_t run_delivered_ = 0, run_errors_ = 0;  // under stats_mutex_
  std::mutex clients_mutex_;
  std::vector<std::shared_ptr<ClientRing<Out>>> clients_;
};

}  // namespace bspflow::detail
