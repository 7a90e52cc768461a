// Internal to streams: the typed ends of a stream. Requests come in through the infeed or the
// StreamClients' admission queue (Intake) and are taken by each replica's first segment
// (FirstSource); answers leave through each replica's last segment (LastSink) to the
// outfeed, or through the Responder (stream_responder.hpp).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/stream/detail/stream_core.hpp"
#include "bspflow/stream/detail/stream_responder.hpp"

namespace bspflow::detail {

// The StreamClients' queue of admitted requests, and the admission policy.
template <class In>
class Intake final : public IntakeBase {
 public:
  explicit Intake(StreamCore& core)
      : core_(&core), capacity_(core.config.admission.max_queued), buf_(capacity_) {}

  // Client thread. Admits `value` (moved from only if accepted) or says why not.
  Submission push(ClientCore& client, std::uint32_t producer, std::uint64_t sequence,
                  std::uint64_t outstanding, In& value, Deadline deadline, bool blocking) {
    Submission s{RequestId{producer, sequence}, Refusal::kNone};
    const auto now = StreamClock::now();
    if (deadline != kNoDeadline && deadline <= now) return refuse(s, Refusal::kDeadlinePassed);
    if (outstanding >= client.capacity()) return refuse(s, Refusal::kClientFull);
    std::optional<RequestMeta> victim;
    {
      std::unique_lock lock(mutex_);
      for (;;) {
        if (!open_) return refuse(s, Refusal::kClosed, &lock);
        const Refusal r = admit(now, deadline, victim);
        if (r == Refusal::kNone) break;
        if (r != Refusal::kQueueFull || !blocking ||
            core_->config.admission.policy != AdmissionPolicy::kBlock) {
          return refuse(s, r, &lock);
        }
        lock.unlock();
        not_full_.wait([&] { return has_room() || !open_flag_.load(std::memory_order_seq_cst); });
        lock.lock();
      }
      Envelope<In>& e = buf_[(head_ + size_) % capacity_];
      e.meta = RequestMeta{s.id, deadline, now, now, &client, order_++};
      order_flag_.store(order_, std::memory_order_seq_cst);
      e.value.emplace(std::move(value));
      e.error.reset();
      ++size_;
      accepted_.store(accepted_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      total_.store(total_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      count_.store(size_, std::memory_order_seq_cst);
    }
    not_empty_.notify();
    if (victim) {
      core_->answerer->answer_error(
          *victim,
          make_request_error(ErrorKind::kRejected, *victim, 0, core_->stage_names.front(),
                             core_->devices[0].id(),
                             "was shed by admission control (AdmissionPolicy::kShed): the "
                             "queue was full and it had the least slack"),
          nullptr);
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
  // Host thread: the Stream is going away; pushes are refused from now on.
  void detach() noexcept {
    close();
    std::lock_guard lock(mutex_);
    core_ = nullptr;
  }
  void cancel_all(Answerer& answerer, const StopFlag& stop) override {
    for (;;) {
      Envelope<In> e;
      if (!try_take(e)) return;
      answerer.answer_error(
          e.meta,
          make_request_error(ErrorKind::kCancelled, e.meta, 0, core_->stage_names.front(),
                             core_->devices[0].id(), "was not run: the stream was cancelled"),
          &stop);
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
  // Host thread, before a run: the run's count starts at 0; where its responses go.
  // `front`/`window`: an in-order shared outfeed's reorder window (nullptr otherwise).
  void begin(bool to_outfeed, const std::atomic<std::uint64_t>* front, std::size_t window) {
    std::lock_guard lock(mutex_);
    front_ = front;
    window_ = window;
    order_ = 0;  // the Responder's window starts at 0 too
    order_flag_.store(0, std::memory_order_relaxed);
    accepted_.store(0, std::memory_order_relaxed);
    to_outfeed_.store(to_outfeed, std::memory_order_relaxed);
  }
  // Client thread: whether this run's responses go to a shared outfeed.
  bool routes_to_outfeed() const noexcept { return to_outfeed_.load(std::memory_order_relaxed); }

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
    if (!window_room()) return Refusal::kQueueFull;
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

  // Whether the reorder window (if any) has room for one more admission order.
  bool window_room() const noexcept {
    return front_ == nullptr ||
           order_flag_.load(std::memory_order_seq_cst) - front_->load(std::memory_order_seq_cst) <
               window_;
  }
  bool has_room() const noexcept {
    return count_.load(std::memory_order_seq_cst) < capacity_ && window_room();
  }

  Submission refuse(Submission s, Refusal r, std::unique_lock<std::mutex>* lock = nullptr) {
    if (lock != nullptr) lock->unlock();
    s.refusal = r;
    StreamCore* core = core_;  // set for the Stream's life; refusals after it are not counted
    if (core != nullptr) core->refusals[static_cast<std::size_t>(r)].fetch_add(1);
    return s;
  }

  StreamCore* core_;
  std::size_t capacity_;
  std::mutex mutex_;
  std::vector<Envelope<In>> buf_;  // a circular queue of capacity_
  std::size_t head_ = 0, size_ = 0;
  std::uint64_t order_ = 0;
  bool open_ = false;
  std::atomic<bool> open_flag_{false};
  std::atomic<bool> to_outfeed_{false};
  const std::atomic<std::uint64_t>* front_ = nullptr;  // set by begin(), under mutex_
  std::size_t window_ = 0;
  std::atomic<std::uint64_t> order_flag_{0};  // order_, for waiters
  std::atomic<std::size_t> count_{0};
  std::atomic<std::uint64_t> accepted_{0}, total_{0};  // written under mutex_
  LateFeedback late_feedback_;                         // under mutex_
  WaitPoint not_empty_, not_full_;
};

// A replica's first segment's source: the infeed (replica 0 of an infeed run), or the
// StreamClients' queue (every replica, skipped while the replica is stalled).
template <class In>
class FirstSource final : public Source {
 public:
  explicit FirstSource(Intake<In>& intake) : intake_(intake) {}
  void attach(typename InfeedQueue<Request<In>>::Reader reader) {
    reader_.emplace(std::move(reader));
  }
  void detach() { reader_.reset(); }
  // Host thread, at start.
  void begin(ServeMode mode, ReplicaMeter* meter, bool timing) {
    mode_ = mode;
    meter_ = meter;
    timing_ = timing;
    taken_ = 0;
  }
  std::uint64_t taken() const noexcept { return taken_; }

  bool try_next(Item& out) override {
    if (mode_ == ServeMode::kInfeed) {
      if (!reader_->try_pop(request_)) return false;
      take_request(out);
      return true;
    }
    if (meter_->stalled.load(std::memory_order_relaxed) || !intake_.try_take(env_)) return false;
    take_envelope(out);
    return true;
  }
  bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) override {
    if (mode_ == ServeMode::kInfeed) {
      if (!reader_->pop(request_, &stop, &policy)) return false;
      take_request(out);
      return true;
    }
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
  void take_request(Item& out) {
    const auto now = timing_ ? StreamClock::now() : StreamClock::time_point{};
    out.meta = RequestMeta{request_.id, request_.deadline, now, now, nullptr, 0};
    out.value = request_.value ? &*request_.value : nullptr;
    out.error.reset();
    counted();
  }
  void take_envelope(Item& out) {
    out.meta = env_.meta;
    out.value = &*env_.value;
    out.error.reset();
    counted();
  }
  void counted() {
    ++taken_;
    bump(meter_->taken);
    if (mode_ == ServeMode::kInfeed) bump(meter_->infeed_taken);
  }

  Intake<In>& intake_;
  ServeMode mode_ = ServeMode::kInfeed;
  ReplicaMeter* meter_ = nullptr;
  bool timing_ = false;
  std::optional<typename InfeedQueue<Request<In>>::Reader> reader_;
  Request<In> request_;
  Envelope<In> env_;
  std::uint64_t taken_ = 0;  // device thread only; read by the host after the run
};

// A replica's last segment's sink: the outfeed (an infeed run), or the Responder.
template <class Out>
class LastSink final : public Sink<Out> {
 public:
  explicit LastSink(Responder<Out>& responder) : responder_(responder) { to_notify_.reserve(16); }
  void attach(typename OutfeedQueue<Response<Out>>::Writer writer) {
    writer_.emplace(std::move(writer));
    dropped_.clear();
    writer_->keep_dropped(&dropped_);  // close() takes the errors among them off the count
  }
  // Host thread, at start.
  void begin(ServeMode mode, ReplicaMeter* meter, bool timing) {
    mode_ = mode;
    meter_ = meter;
    timing_ = timing;
    written_ = errors_ = delivered_ = 0;
  }
  // Host thread, when the run never started: detaches from the outfeed.
  void abandon() {
    if (writer_) writer_->finish(false);
    writer_.reset();
  }
  std::uint64_t delivered() const noexcept { return delivered_; }
  std::uint64_t errors() const noexcept { return errors_; }

  bool put(Envelope<Out>&& e, const WaitPolicy&, const StopFlag& stop) override {
    Response<Out> r;
    r.id = e.meta.id;
    r.value = std::move(e.value);
    r.error = std::move(e.error);
    const std::size_t kind = r.error ? static_cast<std::size_t>(r.error->kind) : 0;
    if (mode_ != ServeMode::kInfeed || timing_) {
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
    }
    if (r.error) {
      ++errors_;
      bump(meter_->errors[kind]);
    } else {
      bump(meter_->ok);
    }
    bump(meter_->answered);
    if (mode_ == ServeMode::kInfeed) return writer_->write(written_++, std::move(r), &stop);
    ClientCore* client = e.meta.client;
    const bool later = in_batch_ && client != nullptr;
    if (later) {
      auto it = std::find_if(to_notify_.begin(), to_notify_.end(),
                             [client](const auto& n) { return n.first == client; });
      if (it == to_notify_.end()) {
        to_notify_.emplace_back(client, 1);
      } else {
        ++it->second;
      }
    }
    // Handed over; what the shared outfeed then drops (a stop, and its spare room full) the
    // Responder takes off the run's counts.
    (void)responder_.deliver(e.meta, std::move(r), &stop, !later);
    ++delivered_;
    return true;
  }
  void begin_batch() override { in_batch_ = mode_ != ServeMode::kInfeed; }
  void end_batch() override {
    in_batch_ = false;
    for (auto& [c, n] : to_notify_) c->notify_and_settle(n);
    to_notify_.clear();
  }
  void flush(const StopFlag& stop) override {
    if (mode_ == ServeMode::kInfeed) {
      writer_->flush(&stop);
    } else {
      responder_.flush(&stop);
    }
  }
  void close(bool completed, const StopFlag& stop) override {
    if (mode_ != ServeMode::kInfeed) return;
    writer_->finish(completed, &stop);
    delivered_ = written_ - writer_->dropped();
    // Count the errors delivered: those among the dropped responses never reached the host.
    for (const auto& entry : dropped_) {
      if (entry.value.error) --errors_;
    }
    dropped_.clear();
    writer_.reset();
  }

 private:
  Responder<Out>& responder_;
  ServeMode mode_ = ServeMode::kInfeed;
  ReplicaMeter* meter_ = nullptr;
  bool timing_ = false;
  std::optional<typename OutfeedQueue<Response<Out>>::Writer> writer_;
  std::uint64_t written_ = 0, errors_ = 0;  // device thread only
  std::uint64_t delivered_ = 0;             // read by the host after the run
  // What the outfeed's writer dropped this run (kInfeed; device thread only).
  std::vector<OutfeedEntry<Response<Out>>> dropped_;
  bool in_batch_ = false;  // device thread: notify at end_batch()
  // Device thread: clients answered in the batch, and how many of their responses.
  std::vector<std::pair<ClientCore*, std::uint64_t>> to_notify_;
};

}  // namespace bspflow::detail
