// Internal to streams (installed because stream.hpp's templates use it): a stream's segments
// (one device's consecutive stages), where they read and write, and one run's shared state.
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
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/runtime/request.hpp"
#include "bspflow/runtime/stream_config.hpp"

namespace bspflow::detail {

// A stage threw: which stage and what (turned into a RequestError by its device).
struct StageFailure {
  std::uint32_t stage;
  std::exception_ptr cause;
};

// One run's shared state: held by the host and every device job.
class StreamRunState {
 public:
  explicit StreamRunState(std::uint32_t segments) : remaining_(segments) {}
  StopFlag stop;
  // Any thread. Stops every device at its next wait or request. Never blocks.
  void cancel() noexcept;
  // Device thread. Keeps the first failure, then cancels.
  void fail(std::shared_ptr<const RequestError> error) noexcept;
  // Device thread: this segment's loop has ended.
  void segment_done() noexcept;
  // Host thread: blocks until every segment has ended.
  void wait_done();
  std::shared_ptr<const RequestError> failure() const;
  // Host thread, before the run: what cancel() calls to wake the feeds and rings.
  void set_waker(std::function<void()> waker);
  // Host thread, once the run has ended: cancel() no longer touches the feeds (they may be
  // gone by then).
  void disarm();

 private:
  std::mutex waker_mutex_;
  std::function<void()> waker_;
  mutable std::mutex mutex_;
  std::shared_ptr<const RequestError> failure_;
  std::atomic<std::uint32_t> remaining_;
  WaitPoint done_;
};

// What a segment takes next: the request's id, and its value (moved from by the first stage)
// or the error an earlier stage answered it with. `value` stays valid until the next call.
struct Item {
  RequestId id;
  void* value = nullptr;  // the input type's object, nullptr if none
  std::shared_ptr<const RequestError> error;
};

// Where a segment reads its requests from: the stream's infeed (first segment) or the ring
// from the previous device. Erased on the input type, so a segment is typed by its output.
class Source {
 public:
  virtual ~Source() = default;
  // Never blocks: true with the next request in `out`.
  virtual bool try_next(Item& out) = 0;
  // Blocks as `policy` says: true with the next request, false at the end or on stop.
  virtual bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) = 0;
};
// Where a segment puts its results: the ring to the next device, or the stream's outfeed.
template <class B>
class Sink {
 public:
  virtual ~Sink() = default;
  // Blocks while full (as `policy` says); false if stopped first.
  virtual bool put(Response<B>&& r, const WaitPolicy& policy, const StopFlag& stop) = 0;
  // Hands over anything held back (the device is about to wait).
  virtual void flush(const StopFlag& stop) = 0;
  // No more results (the end of the run).
  virtual void close(bool completed, const StopFlag& stop) = 0;
};

template <class A>
class RingSource final : public Source {
 public:
  explicit RingSource(SpscRing<Response<A>>& ring) : ring_(ring) {}
  bool try_next(Item& out) override {
    Response<A>* f = ring_.try_front();
    if (f == nullptr) return false;
    take(*f, out);
    return true;
  }
  bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) override {
    Response<A>* f = ring_.front(policy, stop);
    if (f == nullptr) return false;
    take(*f, out);
    return true;
  }

 private:
  void take(Response<A>& f, Item& out) {
    current_ = std::move(f);
    ring_.pop();
    out.id = current_.id;
    out.error = std::move(current_.error);
    out.value = current_.value ? &*current_.value : nullptr;
  }
  SpscRing<Response<A>>& ring_;
  Response<A> current_;  // the request being served (its value is moved from in place)
};

template <class B>
class RingSink final : public Sink<B> {
 public:
  explicit RingSink(SpscRing<Response<B>>& ring) : ring_(ring) {}
  bool put(Response<B>&& r, const WaitPolicy& policy, const StopFlag& stop) override {
    return ring_.try_push(std::move(r)) || ring_.push(std::move(r), policy, stop);
  }
  void flush(const StopFlag&) override {}
  void close(bool, const StopFlag&) override { ring_.close(); }

 private:
  SpscRing<Response<B>>& ring_;
};

// The first segment's source: the stream's infeed (one lane), counting what it accepts.
template <class In>
class InfeedSource final : public Source {
 public:
  void attach(typename InfeedQueue<Request<In>>::Reader reader) {
    reader_.emplace(std::move(reader));
    accepted_ = 0;
  }
  void detach() { reader_.reset(); }
  std::uint64_t accepted() const noexcept { return accepted_; }

  bool try_next(Item& out) override {
    if (!reader_->try_pop(request_)) return false;
    take(out);
    return true;
  }
  bool next(Item& out, const WaitPolicy& policy, const StopFlag& stop) override {
    if (!reader_->pop(request_, &stop, &policy)) return false;
    take(out);
    return true;
  }

 private:
  void take(Item& out) {
    out.id = request_.id;
    out.value = request_.value ? &*request_.value : nullptr;
    out.error.reset();
    ++accepted_;
  }
  std::optional<typename InfeedQueue<Request<In>>::Reader> reader_;
  Request<In> request_;
  std::uint64_t accepted_ = 0;  // device thread only; read by the host after the run
};

// The last segment's sink: the stream's outfeed, counting what it delivers.
template <class Out>
class OutfeedSink final : public Sink<Out> {
 public:
  void attach(typename OutfeedQueue<Response<Out>>::Writer writer) {
    writer_.emplace(std::move(writer));
    written_ = 0;
    errors_ = 0;
    delivered_ = 0;
  }
  std::uint64_t delivered() const noexcept { return delivered_; }
  std::uint64_t errors() const noexcept { return errors_; }
  // Host thread, when the run never started: detaches from the outfeed.
  void abandon() {
    if (writer_) writer_->finish(false);
    writer_.reset();
  }

  bool put(Response<Out>&& r, const WaitPolicy&, const StopFlag& stop) override {
    if (!r.ok()) ++errors_;
    return writer_->write(written_++, std::move(r), &stop);
  }
  void flush(const StopFlag& stop) override { writer_->flush(&stop); }
  void close(bool completed, const StopFlag& stop) override {
    writer_->finish(completed, &stop);
    delivered_ = written_ - writer_->dropped();
    writer_.reset();
  }

 private:
  std::optional<typename OutfeedQueue<Response<Out>>::Writer> writer_;
  std::uint64_t written_ = 0;    // device thread only
  std::uint64_t errors_ = 0;     // likewise
  std::uint64_t delivered_ = 0;  // set at close; read by the host after the run
};

// One device's contiguous run of stages.
class SegmentBase {
 public:
  virtual ~SegmentBase() = default;
  // Device thread: serves requests until its source ends or the run stops.
  virtual void run(Device& device, const WaitPolicy& policy, OnError on_error,
                   StreamRunState& state) = 0;
  std::uint32_t device_index = 0;  // in the stream's DeviceList
  std::uint32_t first_stage = 0, last_stage = 0;
};

template <class B>
class Segment final : public SegmentBase {
 public:
  // `fn` runs the segment's stages on the input object `Item::value` points to (moving from
  // it) and returns the last stage's output; a stage's exception arrives as StageFailure.
  Segment(Source& source, Sink<B>& sink, std::function<B(void*)> fn, std::vector<std::string> names)
      : source_(source), sink_(sink), fn_(std::move(fn)), names_(std::move(names)) {}

  void run(Device& device, const WaitPolicy& policy, OnError on_error,
           StreamRunState& state) override {
    const StopFlag& stop = state.stop;
    bool ok = true;
    try {
      ok = serve(device, policy, on_error, state);
    } catch (...) {  // the runtime itself failed (not a stage): end the run, say why
      state.fail(runtime_failure(device, std::current_exception()));
      ok = false;
    }
    sink_.close(ok && !stop.requested(), stop);
  }

 private:
  // The loop: false when it stopped early (stop, fail-fast), true at the end of its input.
  bool serve(Device& device, const WaitPolicy& policy, OnError on_error, StreamRunState& state) {
    const StopFlag& stop = state.stop;
    for (;;) {
      // A stop ends the loop here too: requests ready in the ring would otherwise keep it
      // going (put() keeps what it is given once stopped, past a bounded outfeed's capacity).
      if (stop.requested()) return false;
      if (!source_.try_next(in_)) {
        sink_.flush(stop);  // nothing is held back while this device waits
        if (!source_.next(in_, policy, stop)) return true;
      }
      out_.id = in_.id;
      out_.error = std::move(in_.error);
      out_.value.reset();
      if (out_.error == nullptr) {
        try {
          if (in_.value == nullptr) {
            throw Error("the request carries no value (send requests with RequestProducer)");
          }
          out_.value.emplace(fn_(in_.value));
        } catch (StageFailure& f) {
          out_.error = describe(f, device, in_.id);
        } catch (...) {
          out_.error =
              describe(StageFailure{first_stage, std::current_exception()}, device, in_.id);
        }
        if (out_.error != nullptr && on_error == OnError::kFailFast) {
          state.fail(out_.error);
          return false;
        }
      }
      if (!sink_.put(std::move(out_), policy, stop)) return false;
    }
  }

  std::shared_ptr<const RequestError> runtime_failure(const Device& device,
                                                      const std::exception_ptr& e) const {
    auto err = std::make_shared<RequestError>();
    err->stage = first_stage;
    err->stage_name = names_.front();
    err->device = device.id();
    err->cause = e;
    err->message = "stream runtime failed on device " + std::to_string(device.id()) + ": " +
                   describe_exception(e);
    return err;
  }

 private:
  std::shared_ptr<const RequestError> describe(const StageFailure& f, const Device& device,
                                               const RequestId& id) const {
    auto e = std::make_shared<RequestError>();
    e->stage = f.stage;
    e->stage_name = names_[f.stage - first_stage];
    e->device = device.id();
    e->id = id;
    e->cause = f.cause;
    e->message = "stage '" + e->stage_name + "' (" + std::to_string(f.stage) + ") on device " +
                 std::to_string(e->device) + " failed on request " + std::to_string(id.sequence) +
                 " of producer " + std::to_string(id.producer) + ": " + describe_exception(f.cause);
    return e;
  }

  Source& source_;
  Sink<B>& sink_;
  std::function<B(void*)> fn_;
  std::vector<std::string> names_;
  Item in_;  // reused: the loop allocates nothing of its own
  Response<B> out_;
};

// The untyped part of a stream: devices, config, segments, rings, and the run in progress.
class StreamCore {
 public:
  StreamCore(DeviceList devices, StreamConfig config);
  ~StreamCore();
  DeviceList devices;
  StreamConfig config;
  std::vector<std::string> stage_names;
  std::vector<std::uint32_t> stage_devices;
  std::vector<std::unique_ptr<SegmentBase>> segments;
  std::vector<std::shared_ptr<void>> owned;  // rings, sources, sinks
  std::vector<std::function<void()>> ring_resets, ring_wakes;

  // The wait policy device `index` of the list uses (capped when it shares its core).
  WaitPolicy policy_for(std::uint32_t index) const;
  // Host thread: starts one job per segment; `wake` wakes the feeds on cancel.
  void start(std::function<void()> wake_feeds);
  // Host thread: blocks until the run ends.
  void wait_segments();
  void cancel() noexcept;
  bool running() const noexcept { return running_; }
  std::shared_ptr<StreamRunState> state() const { return state_; }
  StreamResult finish(std::uint64_t accepted, std::uint64_t delivered, std::uint64_t errors);

 private:
  std::shared_ptr<StreamRunState> state_;
  std::chrono::steady_clock::time_point started_;
  bool running_ = false;
};

}  // namespace bspflow::detail
