// Internal to streams (installed because stream.hpp's templates use it): a stream's segments
// (one device's consecutive stages, or several devices' when they share a core), where they
// read and write, and how a stage is checked and timed.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/stream/detail/stream_meter.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_config.hpp"

namespace bspflow::detail {

// A stage did not answer a request with a value: which stage, why, and (kStageFailed) what
// it threw. Turned into a RequestError by its segment.
struct StageFailure {
  std::uint32_t stage;
  std::exception_ptr cause;
  ErrorKind kind = ErrorKind::kStageFailed;
};

// Any thread: a RequestError of `kind` for the request `meta`, answered by stage `stage`
// ('stage_name', on device `device`): "stage 'x' (k) on device d <why>".
std::shared_ptr<const RequestError> make_request_error(ErrorKind kind, const RequestMeta& meta,
                                                       std::uint32_t stage,
                                                       const std::string& stage_name,
                                                       std::uint32_t device, const std::string& why,
                                                       std::exception_ptr cause = nullptr);

// One run's shared state: held by the host and every device job.
class StreamRunState {
 public:
  explicit StreamRunState(std::uint32_t segments) : ending_(segments), remaining_(segments) {}
  StopFlag stop;
  // Any thread. Stops every device at its next wait or request. Never blocks.
  void cancel() noexcept;
  // Device thread. Keeps the first failure, then cancels.
  void fail(std::shared_ptr<const RequestError> error) noexcept;
  // Device thread: this segment's loop has ended. The last one to end runs the end action
  // (set_on_end), then wakes wait_done().
  void segment_done() noexcept;
  // Host thread, before the run: what the last segment to end runs (answers what a stopped
  // run still holds, so clients get their answers without waiting for the host's wait()).
  void set_on_end(std::function<void()> on_end) { on_end_ = std::move(on_end); }
  // Host thread: blocks until every segment has ended.
  void wait_done();
  bool done() const noexcept { return remaining_.load(std::memory_order_seq_cst) == 0; }
  std::shared_ptr<const RequestError> failure() const;
  // Host thread, before the run: what cancel() calls to wake the feeds and rings.
  void set_waker(std::function<void()> waker);
  // Host thread, once the run has ended: cancel() no longer touches the feeds.
  void disarm();

 private:
  std::mutex waker_mutex_;
  std::function<void()> waker_;
  mutable std::mutex mutex_;
  std::shared_ptr<const RequestError> failure_;
  std::atomic<std::uint32_t> ending_;     // segments whose loop has not ended
  std::atomic<std::uint32_t> remaining_;  // ... nor their end action (wait_done() waits for it)
  std::function<void()> on_end_;
  WaitPoint done_;
};

// What a segment takes next: the request's meta data, and its value (moved from by the first
// stage) or the error an earlier stage answered it with. `value` stays valid until the next
// call.
struct Item {
  RequestMeta meta;
  void* value = nullptr;  // the input type's object, nullptr if none
  std::shared_ptr<const RequestError> error;
};

// Where a segment reads its requests from: the stream's feed (first segment) or the ring
// from the previous device. Erased on the input type, so a segment is typed by its output.
class Source {
 public:
  virtual ~Source() = default;
  // Never blocks: true with the next request in `out`.
  virtual bool try_next(Item& out) = 0;
  // Blocks as `policy` says: true with the next request, false at the end or on stop.
  virtual bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) = 0;
  // Waits at most until `until` (spinning, yielding if `policy` does): true with the next
  // request. A batch stage's bounded wait for more.
  bool next_until(Item& out, StreamClock::time_point until, const WaitPolicy& policy,
                  const StopFlag& stop) {
    bool got = false;
    const auto left = until - StreamClock::now();
    if (left <= StreamClock::duration::zero()) return try_next(out);
    spin_until(
        [&] {
          got = try_next(out);
          return got || stop.requested();
        },
        policy.spin_mode(), std::chrono::duration_cast<std::chrono::nanoseconds>(left));
    return got;
  }
};

// Where a segment puts its results: the ring to the next device, or the stream's end.
template <class B>
class Sink {
 public:
  virtual ~Sink() = default;
  // Blocks while full (as `policy` says); false if stopped first (`r` untouched then).
  virtual bool put(Envelope<B>&& r, const WaitPolicy& policy, const StopFlag& stop) = 0;
  // Hands over anything held back (the device is about to wait).
  virtual void flush(const StopFlag& stop) = 0;
  // A batch's results follow, put() one by one, until end_batch(): a sink may hand them
  // over together (one wake-up per client per batch instead of one per response).
  virtual void begin_batch() {}
  virtual void end_batch() {}
  // No more results (the end of the run).
  virtual void close(bool completed, const StopFlag& stop) = 0;
};

// Answers a request straight to its client with an error: what a request gets when it is
// shed, or cut short by a cancel of the stream.
class Answerer {
 public:
  virtual ~Answerer() = default;
  // Any thread.
  virtual void answer_error(const RequestMeta& meta, std::shared_ptr<const RequestError> error) = 0;
};

template <class A>
class RingSource final : public Source {
 public:
  explicit RingSource(SpscRing<Envelope<A>>& ring) : ring_(ring) {}
  bool try_next(Item& out) override {
    Envelope<A>* f = ring_.try_front();
    if (f == nullptr) return false;
    take(*f, out);
    return true;
  }
  bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) override {
    Envelope<A>* f = ring_.front(policy, stop);
    if (f == nullptr) return false;
    take(*f, out);
    return true;
  }

 private:
  void take(Envelope<A>& f, Item& out) {
    current_ = std::move(f);
    ring_.pop();
    out.meta = current_.meta;
    out.error = std::move(current_.error);
    out.value = current_.value ? &*current_.value : nullptr;
  }
  SpscRing<Envelope<A>>& ring_;
  Envelope<A> current_;  // the request being served (its value is moved from in place)
};

template <class B>
class RingSink final : public Sink<B> {
 public:
  explicit RingSink(SpscRing<Envelope<B>>& ring) : ring_(ring) {}
  bool put(Envelope<B>&& r, const WaitPolicy& policy, const StopFlag& stop) override {
    return ring_.try_push(std::move(r)) || ring_.push(std::move(r), policy, stop);
  }
  void flush(const StopFlag&) override {}
  void close(bool, const StopFlag&) override { ring_.close(); }

 private:
  SpscRing<Envelope<B>>& ring_;
};

// How a stage runs for one request: the request, the replica's stage meters, and the time
// the previous stage ended (when timing).
struct StageCtx {
  const RequestMeta* meta = nullptr;
  StageMeter* const* meters = nullptr;  // by stage index
  bool timing = false;
  StreamClock::time_point t{};
  const StageModel* models = nullptr;  // by stage index (the modeled clock)
  double modeled = 0;                  // the request's modeled time so far
};

// Stage k has run on `items` requests: its device's modeled clock takes its declared cost,
// from when the request reached it (or counts an undeclared step).
inline void charge_stage(StageCtx& c, std::uint32_t k, std::size_t items) noexcept {
  if (c.models == nullptr) return;
  const StageModel& m = c.models[k];
  ModeledClock& clock = *m.clock;
  clock.idle_until(c.modeled);
  if (m.declared) {
    clock.compute(m.per_call_ns + m.per_item_ns * static_cast<double>(items));
  } else {
    clock.undeclared();
  }
  c.modeled = clock.now();
}

// Before stage k runs for a request: a cancelled or expired request is not run (thrown as a
// StageFailure of that kind). Reads the clock only for a request with a deadline.
inline void check_live(StageCtx& c, std::uint32_t k) {
  const RequestMeta& m = *c.meta;
  if (m.client->cancelled(m.id.sequence)) {
    throw StageFailure{k, nullptr, ErrorKind::kCancelled};
  }
  if (m.deadline != kNoDeadline) {
    const auto now = c.timing ? c.t : StreamClock::now();
    if (now > m.deadline) throw StageFailure{k, nullptr, ErrorKind::kDeadlineExceeded};
  }
}

// Stage k, checked and (when timing) timed: what the builder composes a segment from.
template <class F, class Cur, class Next>
Next run_stage(F& f, Cur&& x, StageCtx& c, std::uint32_t k) {
  check_live(c, k);
  if (!c.timing) {
    try {
      Next r = f(std::move(x));
      charge_stage(c, k, 1);
      return r;
    } catch (...) {
      throw StageFailure{k, std::current_exception()};
    }
  }
  StageMeter& m = *c.meters[k];
  const auto t0 = c.t;
  m.begin(t0, c.meta->id);
  try {
    Next r = f(std::move(x));
    c.t = StreamClock::now();
    m.end((c.t - t0).count(), 1);
    charge_stage(c, k, 1);
    return r;
  } catch (...) {
    c.t = StreamClock::now();
    m.end((c.t - t0).count(), 1);
    throw StageFailure{k, std::current_exception()};
  }
}

// A batch stage at the head of a segment: collects a batch from the segment's source, runs
// it, and hands out one result (or error) per request. Erased on its input and output types;
// entry i's output is an object of the batch stage's output type.
class BatchHeadBase {
 public:
  virtual ~BatchHeadBase() = default;
  // Device thread: collects the next batch (blocking for its first request; `before_wait`
  // runs before a blocking wait). False (nothing collected) at the end or on stop.
  virtual bool collect(Source& source, const WaitPolicy& policy, const StopFlag& stop,
                       const std::function<void()>& before_wait) = 0;
  // Device thread: runs the collected batch, then entries 0..size()-1 are ready.
  virtual void run(StageCtx& ctx) = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual RequestMeta& meta(std::size_t i) = 0;
  // The entry's error (an earlier stage's, a cancel, an expiry, or this stage's failure).
  virtual std::shared_ptr<const RequestError>& error(std::size_t i) = 0;
  virtual void* output(std::size_t i) = 0;     // valid when !error(i)
  virtual bool live(std::size_t i) const = 0;  // entry i is (or was) in the batch run
  virtual void clear() = 0;
  std::uint32_t stage = 0;  // the batch stage's index
  std::string name;
  std::uint32_t device_id = 0;          // Device::id() it was declared on
  StageMeter* const* meters = nullptr;  // the replica's, by stage index
  std::uint32_t stages = 0;             // in the chain
  bool timing = false;
  const StageModel* models = nullptr;  // the replica's, by stage index
  StreamClock::time_point origin{};    // the run's start (modeled time 0)
};

// One device's contiguous run of stages.
class SegmentBase {
 public:
  virtual ~SegmentBase() = default;
  // Device thread: serves requests until its source ends or the run stops.
  virtual void run(const WaitPolicy& policy, OnError on_error, StreamRunState& state) = 0;
  virtual BatchHeadBase* batch_head() noexcept { return nullptr; }
  std::uint32_t replica = 0;
  std::uint32_t device_index = 0;  // the device (in the stream's DeviceList) it runs on
  std::uint32_t first_stage = 0, last_stage = 0;
  std::vector<std::string> names;       // stages first..last
  std::vector<std::uint32_t> devices;   // Device::id() each stage was declared on
  StageMeter* const* meters = nullptr;  // the replica's, by stage index
  const StageModel* models = nullptr;   // the replica's, by stage index
  StreamClock::time_point origin{};     // the run's start (modeled time 0)
  ReplicaMeter* replica_meter = nullptr;
  bool timing = false;
  Answerer* answerer = nullptr;  // answers held requests on a stop

 protected:
  std::shared_ptr<const RequestError> describe(const StageFailure& f, const RequestId& id) const;
  std::shared_ptr<const RequestError> runtime_failure(const std::exception_ptr& e) const;
  // On a stop, a request held here is answered: with `error` if it has one (a fail-fast
  // failure), else kCancelled.
  void answer_held(const RequestMeta& meta, std::shared_ptr<const RequestError> error,
                   std::uint32_t stage);
};

template <class B>
class Segment final : public SegmentBase {
 public:
  // `fn` runs the segment's stages on the input object `Item::value` points to (moving from
  // it) and returns the last stage's output; a stage's failure arrives as StageFailure.
  // With `batch`, `fn` runs on each of the batch's outputs instead.
  Segment(Source& source, Sink<B>& sink, std::function<B(void*, StageCtx&)> fn,
          std::unique_ptr<BatchHeadBase> batch)
      : source_(source), sink_(sink), fn_(std::move(fn)), batch_(std::move(batch)) {}
  BatchHeadBase* batch_head() noexcept override { return batch_.get(); }

  void run(const WaitPolicy& policy, OnError on_error, StreamRunState& state) override {
    const StopFlag& stop = state.stop;
    bool ok = true;
    try {
      ok = batch_ ? serve_batches(policy, on_error, state) : serve(policy, on_error, state);
    } catch (...) {  // the runtime itself failed (not a stage): end the run, say why
      state.fail(runtime_failure(std::current_exception()));
      ok = false;
    }
    sink_.close(ok && !stop.requested(), stop);
  }

 private:
  // The loop: false when it stopped early (stop, fail-fast), true at the end of its input.
  bool serve(const WaitPolicy& policy, OnError on_error, StreamRunState& state) {
    const StopFlag& stop = state.stop;
    for (;;) {
      // A stop ends the loop here too: requests ready in the ring would otherwise keep it
      // going (put() keeps what it is given once stopped, past a bounded outfeed's capacity).
      if (stop.requested()) return false;
      if (!source_.try_next(in_)) {
        sink_.flush(stop);  // nothing is held back while this device waits
        if (!source_.next(in_, policy, stop)) return true;
      }
      out_.meta = in_.meta;
      out_.error = std::move(in_.error);
      out_.value.reset();
      if (out_.error == nullptr) {
        StageCtx ctx{&in_.meta, meters, timing, {}, models, entry_modeled(in_.meta)};
        if (timing) {
          ctx.t = StreamClock::now();
          meters[first_stage]->wait.record(queue_wait(ctx.t, in_.meta.enqueued));
        }
        if (!apply(in_.value, ctx, in_.meta.id, first_stage, on_error, state)) {
          answer_held(out_.meta, out_.error, first_stage);
          return false;
        }
        out_.meta.modeled_ns = ctx.modeled;
        if (timing) out_.meta.enqueued = ctx.t;
      }
      if (!put(stop, policy)) return false;
    }
  }

  bool serve_batches(const WaitPolicy& policy, OnError on_error, StreamRunState& state) {
    const StopFlag& stop = state.stop;
    const std::function<void()> before_wait = [&] { sink_.flush(stop); };
    for (;;) {
      if (stop.requested()) return false;
      if (!batch_->collect(source_, policy, stop, before_wait)) return !stop.requested();
      const std::size_t n = batch_->size();
      // Requests that will not run (expired, cancelled, would finish late, failed earlier)
      // are answered now, not after the batch: their clients learn at once.
      for (std::size_t i = 0; i < n; ++i) {
        if (batch_->error(i) != nullptr)
          answerer->answer_error(batch_->meta(i), std::move(batch_->error(i)));
      }
      StageCtx ctx{nullptr, meters, timing, {}, models, 0};
      batch_->run(ctx);
      // The results go out together, whichever way this loop ends.
      struct BatchOut {
        Sink<B>& sink;
        explicit BatchOut(Sink<B>& s) : sink(s) { sink.begin_batch(); }
        ~BatchOut() { sink.end_batch(); }
      } batch_out(sink_);
      for (std::size_t i = 0; i < n; ++i) {
        if (batch_->error(i) == nullptr && !batch_->live(i)) continue;  // answered above
        out_.meta = batch_->meta(i);
        out_.error = std::move(batch_->error(i));
        out_.value.reset();
        if (out_.error == nullptr) {
          ctx.meta = &out_.meta;
          ctx.modeled = out_.meta.modeled_ns;  // the batch's end (BatchHead::run)
          if (!apply(batch_->output(i), ctx, out_.meta.id, batch_->stage + 1, on_error, state)) {
            answer_held(out_.meta, out_.error, first_stage);
            for (std::size_t k = i + 1; k < n; ++k) {
              if (batch_->error(k) != nullptr || batch_->live(k)) {
                answer_held(batch_->meta(k), batch_->error(k), first_stage);
              }
            }
            batch_->clear();
            return false;
          }
          out_.meta.modeled_ns = ctx.modeled;
          if (timing) out_.meta.enqueued = ctx.t;
        }
        if (!put(stop, policy)) {
          for (std::size_t k = i + 1; k < n; ++k) {
            if (batch_->error(k) != nullptr || batch_->live(k)) {
              answer_held(batch_->meta(k), batch_->error(k), first_stage);
            }
          }
          batch_->clear();
          return false;
        }
      }
      batch_->clear();
    }
  }

  // Runs fn_ on `value` into out_ (or its error). False when fail-fast stops the run.
  bool apply(void* value, StageCtx& ctx, const RequestId& id, std::uint32_t stage, OnError on_error,
             StreamRunState& state) {
    try {
      out_.value.emplace(fn_(value, ctx));
    } catch (StageFailure& f) {
      out_.error = describe(f, id);
    } catch (...) {
      out_.error = describe(StageFailure{stage, std::current_exception()}, id);
    }
    if (out_.error != nullptr && out_.error->kind == ErrorKind::kStageFailed &&
        on_error == OnError::kFailFast) {
      state.fail(out_.error);
      return false;
    }
    return true;
  }

  bool put(const StopFlag& stop, const WaitPolicy& policy) {
    const RequestMeta meta = out_.meta;
    if (sink_.put(std::move(out_), policy, stop)) return true;
    answer_held(meta, out_.error, last_stage);
    return false;
  }

  // When a request reaches this segment in modeled time: the first segment takes it when it
  // arrived (real time since the run's start: the host side is real); later ones when the
  // previous device was done with it.
  double entry_modeled(const RequestMeta& meta) const noexcept {
    if (first_stage != 0) return meta.modeled_ns;
    return static_cast<double>(std::max<std::int64_t>(0, (meta.arrival - origin).count()));
  }

  static std::uint64_t queue_wait(StreamClock::time_point now, StreamClock::time_point since) {
    const auto ns = (now - since).count();
    return ns > 0 ? static_cast<std::uint64_t>(ns) : 0;
  }

  Source& source_;
  Sink<B>& sink_;
  std::function<B(void*, StageCtx&)> fn_;
  std::unique_ptr<BatchHeadBase> batch_;
  Item in_;  // reused: the loop allocates nothing of its own
  Envelope<B> out_;
};

}  // namespace bspflow::detail
