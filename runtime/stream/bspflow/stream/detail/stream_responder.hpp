// Internal to streams: where a StreamClient run's answers go: each client's own response
// slots (ClientRing), or, in admission order, one shared outfeed (Responder).
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

#include "bspflow/feeds/outfeed_queue.hpp"
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

// Where every answer of a StreamClient run goes: the client's own ring, or the shared outfeed
// (in admission order unless Ordering::kNone). Also answers requests directly (shed,
// cancelled) and keeps their figures.
template <class Out>
class Responder final : public Answerer, public RunEnds {
 public:
  explicit Responder(StreamCore& core) : core_(core), direct_latency_(kMeterHighestNs) {}

  // Host thread, at start.
  void begin(ServeMode mode, OutfeedQueue<Response<Out>>* outfeed, std::size_t window) {
    mode_ = mode;
    next_ = 0;
    written_ = 0;
    {
      std::lock_guard lock(stats_mutex_);
      run_delivered_ = run_errors_ = 0;
    }
    front_.store(0, std::memory_order_relaxed);
    dropped_.clear();
    dropped_errors_ = 0;
    if (mode == ServeMode::kSharedOutfeed) {
      window_.clear();
      window_.resize(std::bit_ceil(window));
      auto writers = outfeed->begin_run();
      writer_.emplace(std::move(writers.front()));
      writer_->keep_dropped(&dropped_);  // finish() takes them off the run's counts
    }
  }
  // The oldest admission order not yet written (shared outfeed, in order), and the room for
  // orders past it: admission keeps within it, so a replica held up (descheduled) cannot
  // let the others run past the reorder window.
  const std::atomic<std::uint64_t>* front() const noexcept { return &front_; }
  std::size_t window() const noexcept { return window_.size(); }

  // Host thread: a run that never started lets go of the outfeed.
  void abandon() {
    if (writer_) writer_->finish(false);
    writer_.reset();
  }

  // Any thread (a replica's last device, or whoever answers directly). `notify` false: the
  // caller calls m.client->notify_and_settle() soon (after a batch's other responses).
  bool deliver(const RequestMeta& m, Response<Out>&& r, const StopFlag* stop, bool notify = true) {
    if (mode_ == ServeMode::kClients) {
      static_cast<ClientRing<Out>*>(m.client)->deliver(m.id.sequence, std::move(r), notify);
      return true;
    }
    bool ok = true;
    bool advanced = false;
    {
      std::lock_guard lock(mutex_);
      if (core_.config.ordering == Ordering::kNone) {
        ok = write(std::move(r), stop);
      } else if (m.order != next_) {
        window_[m.order & (window_.size() - 1)].emplace(std::move(r));
      } else {
        ok = write(std::move(r), stop);
        ++next_;
        for (;;) {
          auto& w = window_[next_ & (window_.size() - 1)];
          if (!w) break;
          ok = write(std::move(*w), stop) && ok;
          w.reset();
          ++next_;
        }
        front_.store(next_, std::memory_order_seq_cst);
        advanced = true;
      }
    }
    if (advanced) core_.intake->wake();  // a push waiting for the window's room
    m.client->delivered.fetch_add(1, std::memory_order_seq_cst);
    if (notify) m.client->notify_and_settle(1);
    return ok;
  }

  bool answer_error(const RequestMeta& m, std::shared_ptr<const RequestError> error,
                    const StopFlag* stop) override {
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
    return deliver(m, std::move(r), stop);
  }

  void flush(const StopFlag* stop) {
    if (mode_ != ServeMode::kSharedOutfeed) return;
    std::lock_guard lock(mutex_);
    writer_->flush(stop);
  }

  // RunEnds: the direct answers of this run (the last sinks count their own).
  std::uint64_t delivered() const noexcept override { return run_delivered_; }
  std::uint64_t errors() const noexcept override { return run_errors_; }
  void finish(bool completed, const StopFlag& stop) override {
    if (mode_ != ServeMode::kSharedOutfeed || !writer_) return;
    std::lock_guard lock(mutex_);
    writer_->finish(completed, &stop);
    writer_.reset();
    for (const auto& entry : dropped_) {
      if (entry.value.error) ++dropped_errors_;
    }
  }
  // Host thread, the run over (shared outfeed): responses handed over, by a last device or
  // directly, that the outfeed then dropped (a stop found it full, spare room too), and the
  // errors among them. Stream::wait() takes them off what was handed over.
  std::uint64_t dropped() const noexcept { return dropped_.size(); }
  std::uint64_t dropped_errors() const noexcept { return dropped_errors_; }

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
    auto ring = std::make_shared<ClientRing<Out>>(std::bit_ceil(core_.config.client_capacity));
    clients_.push_back(ring);
    return ring;
  }

 private:
  // Under mutex_: the outfeed writer's next entry; false if it was dropped (stopped, full).
  bool write(Response<Out>&& r, const StopFlag* stop) {
    return writer_->write(written_++, std::move(r), stop);
  }

  StreamCore& core_;
  ServeMode mode_ = ServeMode::kClients;
  std::mutex mutex_;
  std::vector<std::optional<Response<Out>>> window_;
  std::uint64_t next_ = 0, written_ = 0;
  std::atomic<std::uint64_t> front_{0};  // next_, for admission
  std::optional<typename OutfeedQueue<Response<Out>>::Writer> writer_;
  std::vector<OutfeedEntry<Response<Out>>> dropped_;  // what writer_ dropped (under mutex_)
  std::uint64_t dropped_errors_ = 0;                  // of those, errors (set by finish())
  mutable std::mutex stats_mutex_;
  Histogram direct_latency_;
  std::atomic<std::uint64_t> direct_answered_{0};
  std::atomic<std::uint64_t> direct_errors_[4] = {};
  std::uint64_t run_delivered_ = 0, run_errors_ = 0;  // under stats_mutex_
  std::mutex clients_mutex_;
  std::vector<std::shared_ptr<ClientRing<Out>>> clients_;
};

}  // namespace bspflow::detail
