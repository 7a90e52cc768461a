// Internal to streams (installed because the stream templates use it): where a run's answers
// go. Each client's own response slots (ResponseRing), written by the Responder: the one
// answer of a request wins its slot, any later one for it (a branch stopped at the same
// time) is dropped. ReplicaSink is a replica's output node's side: counts by class, outlier
// ejection, then the Responder.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/core.hpp"
#include "bspflow/stream/detail/ops.hpp"

namespace bspflow::detail {

// A StreamClient's responses, in slots indexed by its sequence numbers: any replica's last
// device writes a slot, the client reads them in its order (or in any order). A streaming
// ring (a stream with a generate stage) also holds each request's partial responses, in
// order, before its final one.
template <class Out>
class ResponseRing final : public ClientState {
 public:
  ResponseRing(std::size_t capacity, bool streaming)
      : ClientState(capacity), slots_(std::make_unique<Slot[]>(capacity)), streaming_(streaming) {}
  // Any thread: the answer to `sequence`, unless it was already answered (then r is dropped
  // and false). `notify` false: the caller calls notify_and_settle() soon (after a batch's
  // other responses), counting this one.
  bool deliver(std::uint64_t sequence, Response<Out>&& r, bool notify = true) {
    Slot& s = slots_[sequence & mask_];
    if (streaming_) {
      // Under the slot's lock: a partial response is either in before the final one is
      // claimed, or dropped (deliver_partial reads the claim under it).
      PartsLock lock(s);
      return claim(s, sequence, std::move(r), notify);
    }
    return claim(s, sequence, std::move(r), notify);
  }
  // The answering device: a partial response to `sequence`, before its final one. False
  // (dropped) once the final one was given. `notify` false: as deliver().
  bool deliver_partial(std::uint64_t sequence, Response<Out>&& r, bool notify = true) {
    Slot& s = slots_[sequence & mask_];
    {
      PartsLock lock(s);
      const std::uint64_t c = s.claimed.load(std::memory_order_acquire);
      if (c != kNone && c >= sequence) return false;
      if (!abandoned.load(std::memory_order_relaxed)) {
        s.parts.push_back(std::move(r));
        s.parts_in.store(static_cast<std::uint32_t>(s.parts.size()), std::memory_order_release);
      }
    }
    partials.fetch_add(1, std::memory_order_seq_cst);  // pairs with the client's wait
    if (notify) arrived.notify();
    return true;
  }
  // Client thread: whether a partial response to `sequence` waits (read after ready()).
  bool has_partial(std::uint64_t sequence) const noexcept {
    if (!streaming_) return false;
    const Slot& s = slots_[sequence & mask_];
    return s.parts_in.load(std::memory_order_acquire) > s.parts_out;
  }
  // Client thread: the next partial response to `sequence` (has_partial()).
  Response<Out> take_partial(std::uint64_t sequence) {
    Slot& s = slots_[sequence & mask_];
    PartsLock lock(s);
    return std::move(s.parts[s.parts_out++]);
  }

 private:
  struct Slot;
  // The slot's lock for its partial responses: a few instructions under it, one writer and
  // the client, so a spin.
  struct PartsLock {
    explicit PartsLock(Slot& s) noexcept : slot(s) {
      while (slot.parts_lock.test_and_set(std::memory_order_acquire)) {
        while (slot.parts_lock.test(std::memory_order_relaxed)) cpu_relax();
      }
    }
    ~PartsLock() { slot.parts_lock.clear(std::memory_order_release); }
    PartsLock(const PartsLock&) = delete;
    PartsLock& operator=(const PartsLock&) = delete;
    Slot& slot;
  };
  bool claim(Slot& s, std::uint64_t sequence, Response<Out>&& r, bool notify) {
    // The slot's claims only grow (each use is `capacity` after the last): an answer to a
    // sequence the slot already served, or one past, is a second answer and is dropped.
    std::uint64_t before = s.claimed.load(std::memory_order_acquire);
    do {
      if (before != kNone && before >= sequence) return false;
    } while (!s.claimed.compare_exchange_weak(before, sequence, std::memory_order_acq_rel));
    if (!abandoned.load(std::memory_order_relaxed)) {
      s.response.emplace(std::move(r));
      s.ready.store(sequence, std::memory_order_release);
    }
    delivered.fetch_add(1, std::memory_order_seq_cst);  // pairs with the client's wait
    if (notify) notify_and_settle(1);
    return true;
  }

 public:
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
    if (streaming_) {  // every partial response was taken before the final one
      PartsLock lock(s);
      s.parts.clear();
      s.parts_out = 0;
      s.parts_in.store(0, std::memory_order_relaxed);
    }
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
  // A cache line (or more) each: the deliverer of one answer and the client reading the one
  // before do not share a line.
  struct alignas(tunables::kCacheLine) Slot {
    std::atomic<std::uint64_t> ready{kNone};
    // The sequence whose answer took this slot: a second answer for it loses the exchange.
    std::atomic<std::uint64_t> claimed{kNone};
    std::optional<Response<Out>> response;
    // Partial responses (streaming): appended under parts_lock by the answering device,
    // taken in order by the client (parts_out, the client's own).
    std::atomic_flag parts_lock = ATOMIC_FLAG_INIT;
    std::atomic<std::uint32_t> parts_in{0};
    std::uint32_t parts_out = 0;
    std::vector<Response<Out>> parts;
  };
  std::unique_ptr<Slot[]> slots_;
  bool streaming_;
};

// Where every answer of a run goes: the client's own ring. Also answers requests directly
// (shed, cancelled, held on a stop) and keeps their figures, by class.
template <class Out>
class Responder final : public ResponderBase {
 public:
  explicit Responder(StreamCore& core) : core_(core) {
    for (std::uint32_t c = 0; c < core.config.priority_classes; ++c) {
      direct_.push_back(std::make_unique<ClassMeter>());
    }
  }

  // Host thread, at start.
  void begin() {
    std::lock_guard lock(stats_mutex_);
    run_delivered_ = run_errors_ = 0;
  }

  // Any thread (a replica's last device, or whoever answers directly): false if the request
  // was already answered. `notify` false: the caller calls m.client->notify_and_settle() soon
  // (after a batch's other responses).
  bool deliver(const RequestMeta& m, Response<Out>&& r, bool notify = true) {
    return static_cast<ResponseRing<Out>*>(m.client)->deliver(m.id.sequence, std::move(r), notify);
  }
  // The answering device: a partial response (a generate stage's), before the final one.
  bool deliver_partial(const RequestMeta& m, Response<Out>&& r, bool notify = true) {
    return static_cast<ResponseRing<Out>*>(m.client)->deliver_partial(m.id.sequence, std::move(r),
                                                                      notify);
  }

  void answer_error(const RequestMeta& m, std::shared_ptr<const RequestError> error,
                    bool in_replica) override {
    Response<Out> r;
    r.id = m.id;
    r.latency = StreamClock::now() - m.arrival;
    r.version = m.version;
    r.priority = m.priority;
    r.index = m.part;  // after the partial responses a generate stage gave it
    const std::size_t kind = static_cast<std::size_t>(error->kind);
    r.error = std::move(error);
    if (!deliver(m, std::move(r))) return;  // answered already (by another branch)
    if (in_replica) core_.replica_meters[m.replica]->left.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(stats_mutex_);
    ClassMeter& cm = *direct_[std::min<std::size_t>(m.priority, direct_.size() - 1)];
    cm.latency.record(static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.latency.count())));
    bump(cm.answered);
    bump(cm.errors[kind]);
    ++run_delivered_;
    ++run_errors_;
  }

  // Host thread, the run over: the direct answers of this run (the replicas count their
  // own), and the errors among them (all of them).
  std::uint64_t delivered() const noexcept { return run_delivered_; }
  std::uint64_t errors() const noexcept { return run_errors_; }

  // Any thread: the direct answers' figures, by class.
  void add_stats(StreamStats& s) const {
    std::lock_guard lock(stats_mutex_);
    for (std::size_t c = 0; c < direct_.size() && c < s.by_class.size(); ++c) {
      direct_[c]->add_to(s.by_class[c], s);
    }
  }

  // Setup: a new client's ring, kept until the stream and the client are both done with it.
  std::shared_ptr<ResponseRing<Out>> make_client() {
    std::lock_guard lock(clients_mutex_);
    std::erase_if(clients_, [](const std::shared_ptr<ResponseRing<Out>>& c) {
      // settled, not delivered: a deliverer may still be waking the client.
      return c->abandoned.load() && c->settled.load(std::memory_order_acquire) == c->sent.load();
    });
    auto ring = std::make_shared<ResponseRing<Out>>(std::bit_ceil(core_.config.response_capacity),
                                                    core_.streaming);
    clients_.push_back(ring);
    return ring;
  }

 private:
  StreamCore& core_;
  mutable std::mutex stats_mutex_;
  std::vector<std::unique_ptr<ClassMeter>> direct_;   // by class
  std::uint64_t run_delivered_ = 0, run_errors_ = 0;  // under stats_mutex_
  std::mutex clients_mutex_;
  std::vector<std::shared_ptr<ResponseRing<Out>>> clients_;
};

// A replica's output node's side: counts each answer by class (latency, kind, lateness),
// keeps the outlier ejection's count of consecutive stage failures, then hands the answer
// to its client.
template <class Out>
class ReplicaSink final : public ResponseSink<Out> {
 public:
  ReplicaSink(Responder<Out>& responder, ReplicaMeter& meter, StreamCore& core,
              std::uint32_t replica)
      : responder_(responder), meter_(meter), core_(core), replica_(replica) {
    to_notify_.reserve(16);
  }
  void begin(bool timing) {
    timing_ = timing;
    errors_ = delivered_ = 0;
  }
  std::uint64_t delivered() const noexcept { return delivered_; }
  std::uint64_t errors() const noexcept { return errors_; }

  void put(const RequestMeta& meta, Response<Out>&& r) override {
    const auto now = StreamClock::now();
    r.latency = now - meta.arrival;
    if (meta.partial && !r.error) {  // a generate stage's partial response
      ClientState* client = meta.client;
      if (!responder_.deliver_partial(meta, std::move(r), !in_batch_) || !in_batch_) return;
      auto it = std::find_if(to_notify_.begin(), to_notify_.end(),
                             [client](const auto& n) { return n.first == client; });
      if (it == to_notify_.end()) to_notify_.emplace_back(client, 0);  // wake it, settle none
      return;
    }
    const bool failed = r.error && r.error->kind == ErrorKind::kStageFailed;
    const std::size_t kind = r.error ? static_cast<std::size_t>(r.error->kind) : 0;
    const bool is_error = r.error != nullptr;
    ClientState* client = meta.client;
    const bool won = responder_.deliver(meta, std::move(r), !in_batch_);
    if (!won) return;  // answered already (a stop answered it first)
    meter_.left.fetch_add(1, std::memory_order_relaxed);
    ClassMeter& cm =
        *meter_.by_class[std::min<std::size_t>(meta.priority, meter_.by_class.size() - 1)];
    if (timing_) {
      const std::int64_t ns = (now - meta.arrival).count();
      cm.latency.record(static_cast<std::uint64_t>(ns > 0 ? ns : 0));
      if (meta.deadline != kNoDeadline) {
        bump(meter_.timed);
        if (now > meta.deadline) bump(meter_.late);
      }
    }
    if (is_error) {
      ++errors_;
      bump(cm.errors[kind]);
    } else {
      bump(cm.ok);
    }
    bump(cm.answered);
    ++delivered_;
    eject_or_rejoin(meta, failed);
    if (in_batch_) {
      auto it = std::find_if(to_notify_.begin(), to_notify_.end(),
                             [client](const auto& n) { return n.first == client; });
      if (it == to_notify_.end()) {
        to_notify_.emplace_back(client, 1);
      } else {
        ++it->second;
      }
    }
  }
  void begin_batch() override { in_batch_ = true; }
  void end_batch() override {
    in_batch_ = false;
    for (auto& [c, n] : to_notify_) c->notify_and_settle(n);
    to_notify_.clear();
  }

 private:
  // Outlier ejection (StreamConfig::ejection): consecutive stage failures take the replica
  // out of rotation (never the last one in it); its probe's answer brings it back or sends
  // it out again for twice as long.
  void eject_or_rejoin(const RequestMeta& meta, bool failed) {
    const Ejection& ej = core_.config.ejection;
    if (ej.consecutive_failures == 0) return;
    if (meta.probe) {
      meter_.probing.store(false, std::memory_order_release);
      if (!failed) {
        meter_.ejected.store(false, std::memory_order_release);
        meter_.ejection_level.store(0, std::memory_order_relaxed);
        meter_.consecutive_failures = 0;
        return;
      }
      eject();
      return;
    }
    meter_.consecutive_failures = failed ? meter_.consecutive_failures + 1 : 0;
    if (failed && meter_.consecutive_failures >= ej.consecutive_failures &&
        !meter_.ejected.load(std::memory_order_relaxed) && core_.rotation() > 1) {
      eject();
    }
  }
  void eject() {
    const Ejection& ej = core_.config.ejection;
    const std::uint32_t level = meter_.ejection_level.load(std::memory_order_relaxed);
    auto out = ej.base_time * (std::int64_t{1} << std::min<std::uint32_t>(level, 20));
    out = std::min(out, ej.max_time);
    meter_.ejected_until.store(stream_ns(StreamClock::now()) + out.count(),
                               std::memory_order_relaxed);
    meter_.ejection_level.store(level + 1, std::memory_order_relaxed);
    meter_.consecutive_failures = 0;
    meter_.ejected.store(true, std::memory_order_release);
    bump(meter_.ejections);
    core_.log_ejection(replica_, out);
  }

  Responder<Out>& responder_;
  ReplicaMeter& meter_;
  StreamCore& core_;
  std::uint32_t replica_;
  bool timing_ = false;
  std::uint64_t errors_ = 0;     // device thread only
  std::uint64_t delivered_ = 0;  // read by the host after the run
  bool in_batch_ = false;        // device thread: notify at end_batch()
  // Device thread: clients answered in the batch, and how many of their responses.
  std::vector<std::pair<ClientState*, std::uint64_t>> to_notify_;
};

}  // namespace bspflow::detail
