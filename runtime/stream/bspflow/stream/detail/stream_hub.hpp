// Internal to streams: the typed ends of a stream. Requests come in through the StreamClients'
// admission queue (Intake) and are taken by each replica's first segment (FirstSource);
// answers leave through each replica's last segment (LastSink) to the Responder
// (stream_responder.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/stream_core.hpp"
#include "bspflow/stream/detail/stream_responder.hpp"

namespace bspflow::detail {

// The admission queue of the StreamClients' requests, and the admission policy. Shared by
// the Stream and its clients (a client may outlive the Stream): once detach()ed it refuses
// every push without touching the Stream, and detach() waits for the pushes already inside.
template <class In>
class Intake final : public IntakeBase {
 public:
  explicit Intake(StreamCore& core)
      : core_(&core), capacity_(core.config.admission.queue_capacity), buf_(capacity_) {}

  // Client thread. Admits `value` (moved from only if accepted) or says why not.
  Submission push(ClientCore& client, std::uint32_t id, std::uint64_t sequence,
                  std::uint64_t outstanding, In& value, Deadline deadline, bool blocking) {
    Submission s{RequestId{id, sequence}, Refusal::kNone};
    const auto now = StreamClock::now();
    if (deadline != kNoDeadline && deadline <= now) return refuse(s, Refusal::kDeadlinePassed);
    if (outstanding >= client.capacity()) return refuse(s, Refusal::kClientFull);
    std::optional<RequestMeta> victim;
    std::unique_lock lock(mutex_);
    if (!open_) return refuse(s, Refusal::kClosed);
    // From here until the end of this call the Stream is in use: detach() waits for it.
    ++inside_;
    struct Leave {
      Intake& in;
      std::unique_lock<std::mutex>& lock;
      ~Leave() {
        if (!lock.owns_lock()) lock.lock();
        if (--in.inside_ == 0) in.left_.notify_all();
      }
    } leave{*this, lock};
    for (;;) {
      if (!open_) return refuse(s, Refusal::kClosed);
      const Refusal r = admit(now, deadline, victim);
      if (r == Refusal::kNone) break;
      if (r != Refusal::kQueueFull || !blocking ||
          core_->config.admission.policy != AdmissionPolicy::kBlock) {
        return refuse(s, r);
      }
      lock.unlock();
      not_full_.wait([&] {
        return count_.load(std::memory_order_seq_cst) < capacity_ ||
               !open_flag_.load(std::memory_order_seq_cst);
      });
      lock.lock();
    }
    Envelope<In>& e = buf_[(head_ + size_) % capacity_];
    e.meta = RequestMeta{s.id, deadline, now, now, &client};
    e.value.emplace(std::move(value));
    e.error.reset();
    ++size_;
    accepted_.store(accepted_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    total_.store(total_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    count_.store(size_, std::memory_order_seq_cst);
    StreamCore* core = core_;
    lock.unlock();
    not_empty_.notify();
    if (victim) {
      core->answerer->answer_error(
          *victim, make_request_error(ErrorKind::kRejected, *victim, 0, core->stage_names.front(),
                                      core->devices[0].id(),
                                      "was shed by admission control (AdmissionPolicy::kShed): "
                                      "the queue was full and it had the least slack"));
    }
    return s;
  }

  // Device thread. Never blocks long (the queue's mutex).
  bool try_take(Envelope<In>& out) {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    {
      std::lock_guard lock(mutex_);
      if (size_ == 0) return false;
      Envelope<In>& e = buf_[head_];
      out.meta = e.meta;
      out.value = std::move(e.value);
      e.value.reset();
      head_ = (head_ + 1) % capacity_;
      --size_;
      count_.store(size_, std::memory_order_seq_cst);
    }
    not_full_.notify();
    return true;
  }
  // Device thread: blocks until something is queued, the queue is closed, or `stop`.
  void wait(const WaitPolicy& policy, const StopFlag& stop) {
    wait_with(not_empty_, policy, [&] {
      return count_.load(std::memory_order_seq_cst) != 0 ||
             !open_flag_.load(std::memory_order_seq_cst) || stop.requested();
    });
  }
  // Device thread: closed and nothing left.
  bool ended() const noexcept {
    return !open_flag_.load(std::memory_order_seq_cst) &&
           count_.load(std::memory_order_seq_cst) == 0;
  }

  void open() override {
    std::lock_guard lock(mutex_);
    if (core_ == nullptr) return;
    accepted_.store(0, std::memory_order_relaxed);
    open_ = true;
    open_flag_.store(true, std::memory_order_seq_cst);
  }
  void close() noexcept override {
    {
      std::lock_guard lock(mutex_);
      open_ = false;
      open_flag_.store(false, std::memory_order_seq_cst);
    }
    wake();
  }
  // Host thread: the Stream is going away. Pushes are refused from now on; returns once no
  // push is still inside (using the Stream).
  void detach() noexcept {
    close();
    std::unique_lock lock(mutex_);
    core_ = nullptr;
    left_.wait(lock, [&] { return inside_ == 0; });
  }
  void cancel_all(Answerer& answerer) override {
    for (;;) {
      Envelope<In> e;
      if (!try_take(e)) return;
      answerer.answer_error(
          e.meta,
          make_request_error(ErrorKind::kCancelled, e.meta, 0, core_->stage_names.front(),
                             core_->devices[0].id(), "was not run: the stream was cancelled"));
    }
  }
  void wake() noexcept override {
    not_empty_.notify();
    not_full_.notify();
  }
  std::size_t size() const noexcept override { return count_.load(std::memory_order_relaxed); }
  std::uint64_t accepted() const noexcept override {
    return accepted_.load(std::memory_order_relaxed);
  }
  std::uint64_t total_accepted() const noexcept override {
    return total_.load(std::memory_order_relaxed);
  }
  std::uint64_t refused(Refusal r) const noexcept override {
    return refusals_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
  }

 private:
  // Under the lock: whether a request with `deadline` can be queued now; kShed may pick a
  // victim (removed from the queue; answered by the caller once unlocked).
  Refusal admit(StreamClock::time_point now, Deadline deadline,
                std::optional<RequestMeta>& victim) {
    const Admission& a = core_->config.admission;
    const std::int64_t per = core_->per_request_ns();
    // Only with a queue ahead: an empty queue admits, so the stages keep measuring (a
    // prediction that refused everything would never learn that the stream got faster).
    if (a.predict && deadline != kNoDeadline && per > 0 && size_ > 0) {
      learn_from_late();
      const std::int64_t ahead = static_cast<std::int64_t>(size_) / core_->live_replicas();
      const auto wait =
          static_cast<double>(ahead * per + core_->path_ns()) * (1.0 + late_feedback_.slack());
      const auto done = now + std::chrono::nanoseconds(static_cast<std::int64_t>(wait));
      if (done > deadline) return Refusal::kDeadlineUnreachable;
    }
    if (size_ < capacity_) return Refusal::kNone;
    if (a.policy != AdmissionPolicy::kShed) return Refusal::kQueueFull;
    // The least slack: the earliest deadline less the work ahead of it.
    const auto slack = [&](Deadline d, std::size_t pos) {
      if (d == kNoDeadline) return std::chrono::nanoseconds::max();
      return std::chrono::duration_cast<std::chrono::nanoseconds>(d - now) -
             std::chrono::nanoseconds(static_cast<std::int64_t>(pos + 1) * per);
    };
    std::size_t worst = size_;
    auto least = slack(deadline, size_);
    for (std::size_t i = 0; i < size_; ++i) {
      const auto sl = slack(buf_[(head_ + i) % capacity_].meta.deadline, i);
      if (sl < least) {
        least = sl;
        worst = i;
      }
    }
    if (worst == size_) return Refusal::kShed;  // the newcomer has the least slack
    victim = buf_[(head_ + worst) % capacity_].meta;
    for (std::size_t i = worst; i + 1 < size_; ++i) {
      buf_[(head_ + i) % capacity_] = std::move(buf_[(head_ + i + 1) % capacity_]);
    }
    buf_[(head_ + size_ - 1) % capacity_].value.reset();
    --size_;
    return Refusal::kNone;
  }

  // Under the lock: admission's feedback from the answers so far (LateFeedback).
  void learn_from_late() noexcept {
    std::uint64_t timed = 0, late = 0;
    for (const auto& m : core_->replica_meters) {
      timed += m->timed.load(std::memory_order_relaxed);
      late += m->late.load(std::memory_order_relaxed);
    }
    late_feedback_.update(timed, late);
  }

  // Counts the refusal in the intake itself (never in the Stream, which may be gone).
  Submission refuse(Submission s, Refusal r) noexcept {
    s.refusal = r;
    // relaxed: a count read by stats(); any client thread adds to it.
    refusals_[static_cast<std::size_t>(r)].fetch_add(1, std::memory_order_relaxed);
    return s;
  }

  StreamCore* core_;  // under mutex_; nullptr once detached
  std::size_t capacity_;
  std::mutex mutex_;
  std::condition_variable left_;   // inside_ fell to 0
  std::size_t inside_ = 0;         // pushes using the Stream now (under mutex_)
  std::vector<Envelope<In>> buf_;  // a circular queue of capacity_
  std::size_t head_ = 0, size_ = 0;
  bool open_ = false;
  std::atomic<bool> open_flag_{false};
  std::atomic<std::size_t> count_{0};
  std::atomic<std::uint64_t> accepted_{0}, total_{0};  // written under mutex_
  std::array<std::atomic<std::uint64_t>, 7> refusals_{};
  LateFeedback late_feedback_;  // under mutex_
  WaitPoint not_empty_, not_full_;
};

// A replica's first segment's source: the admission queue (skipped while the replica is
// stalled).
template <class In>
class FirstSource final : public Source {
 public:
  explicit FirstSource(Intake<In>& intake) : intake_(intake) {}
  // Host thread, at start.
  void begin(ReplicaMeter* meter) {
    meter_ = meter;
    taken_ = 0;
  }
  std::uint64_t taken() const noexcept { return taken_; }

  bool try_next(Item& out) override {
    if (meter_->stalled.load(std::memory_order_relaxed) || !intake_.try_take(env_)) return false;
    out.meta = env_.meta;
    out.value = &*env_.value;
    out.error.reset();
    ++taken_;
    bump(meter_->taken);
    return true;
  }
  bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) override {
    for (;;) {
      if (stop.requested()) return false;
      if (try_next(out)) return true;
      if (intake_.ended()) return false;
      if (meter_->stalled.load(std::memory_order_relaxed)) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // until it moves again
        continue;
      }
      intake_.wait(policy, stop);
    }
  }

 private:
  Intake<In>& intake_;
  ReplicaMeter* meter_ = nullptr;
  Envelope<In> env_;
  std::uint64_t taken_ = 0;  // device thread only; read by the host after the run
};

// A replica's last segment's sink: hands each answer to its client (the Responder).
template <class Out>
class LastSink final : public Sink<Out> {
 public:
  explicit LastSink(Responder<Out>& responder) : responder_(responder) { to_notify_.reserve(16); }
  // Host thread, at start.
  void begin(ReplicaMeter* meter, bool timing) {
    meter_ = meter;
    timing_ = timing;
    errors_ = delivered_ = 0;
  }
  std::uint64_t delivered() const noexcept { return delivered_; }
  std::uint64_t errors() const noexcept { return errors_; }

  bool put(Envelope<Out>&& e, const WaitPolicy&, const StopFlag&) override {
    Response<Out> r;
    r.id = e.meta.id;
    r.value = std::move(e.value);
    r.error = std::move(e.error);
    const std::size_t kind = r.error ? static_cast<std::size_t>(r.error->kind) : 0;
    const auto now = StreamClock::now();
    r.latency = now - e.meta.arrival;
    if (timing_) {
      const std::int64_t ns = r.latency.count();
      meter_->latency.record(static_cast<std::uint64_t>(ns > 0 ? ns : 0));
      if (e.meta.deadline != kNoDeadline) {
        bump(meter_->timed);
        if (now > e.meta.deadline) bump(meter_->late);
      }
    }
    if (r.error) {
      ++errors_;
      bump(meter_->errors[kind]);
    } else {
      bump(meter_->ok);
    }
    bump(meter_->answered);
    ClientCore* client = e.meta.client;
    if (in_batch_) {
      auto it = std::find_if(to_notify_.begin(), to_notify_.end(),
                             [client](const auto& n) { return n.first == client; });
      if (it == to_notify_.end()) {
        to_notify_.emplace_back(client, 1);
      } else {
        ++it->second;
      }
    }
    responder_.deliver(e.meta, std::move(r), !in_batch_);
    ++delivered_;
    return true;
  }
  void begin_batch() override { in_batch_ = true; }
  void end_batch() override {
    in_batch_ = false;
    for (auto& [c, n] : to_notify_) c->notify_and_settle(n);
    to_notify_.clear();
  }
  void flush(const StopFlag&) override {}
  void close(bool, const StopFlag&) override {}

 private:
  Responder<Out>& responder_;
  ReplicaMeter* meter_ = nullptr;
  bool timing_ = false;
  std::uint64_t errors_ = 0;     // device thread only
  std::uint64_t delivered_ = 0;  // read by the host after the run
  bool in_batch_ = false;        // device thread: notify at end_batch()
  // Device thread: clients answered in the batch, and how many of their responses.
  std::vector<std::pair<ClientCore*, std::uint64_t>> to_notify_;
};

}  // namespace bspflow::detail
