// Streams: a persistent pipeline of typed stages on pinned devices, for serving inference
// requests (the request path of an inference server; the inference counterpart of
// Pipeline). Users of oneTBB flow graph will recognise serial function nodes joined by
// edges, users of Taskflow a data pipeline of serial pipes, users of the LMAX Disruptor a
// chain of event handlers with a wait strategy.
//
//   DeviceGroup devices(2);
//   auto stream = StreamBuilder<Image>(devices)
//                     .stage("conv", [](Image x) { return conv(x); })        // device 0
//                     .stage("pool", [](Features f) { return pool(f); }, 0)  // also device 0
//                     .stage("head", [](Features f) { return head(f); })     // device 1
//                     .build();                                               // Stream<Image, Logits>
//   InfeedQueue<Request<Image>> requests;              // any number of host threads
//   OutfeedQueue<Response<Logits>> responses;
//   stream.start(requests, responses);                 // returns at once
//   RequestProducer<Image> client(requests);           // one per client thread
//   RequestId id = *client.push(image);                // nullopt once the infeed is closed
//   for (auto& e : responses) { e.value.id; e.value.ok() ? *e.value.value : e.value.error->message; }
//   requests.close();                                  // the stream drains, then ends
//   StreamResult r = stream.wait();                    // r.status == kDrained, r.answered
//
// Stages. A stage is a callable (movable; copyable not needed) from its input type to its
// output type (any movable types; a stage takes its input by value or rvalue reference). A
// stage runs on one device thread only, so it may keep state of its own without locking. Consecutive stages may share a
// device: they run one after the other on its thread with no hand-off between them. Stages
// on different devices are joined by a bounded single-producer single-consumer ring
// (SpscRing, `StreamConfig::capacity` requests). Each device of the stream runs one
// contiguous run of stages as a job on its pinned thread, for as long as the stream runs.
//
// Requests and responses. Requests enter through an InfeedQueue<Request<In>> with one lane
// (any number of RequestProducers, one per host thread); each carries a RequestId: the
// producer's process-unique id and its own sequence number (0, 1, 2, ... per producer).
// Responses leave through an OutfeedQueue<Response<Out>> (OutputMode::all(), one replica),
// one per request, carrying the request's id and either the value or a RequestError.
//
// Ordering guarantee: FIFO end to end. Responses leave in the order the first stage took the
// requests off the infeed; so every producer's responses arrive in the order it pushed its
// requests (nothing is promised across producers, as for any InfeedQueue).
//
// End. The stream runs until its infeed is closed and drained; then every stage finishes
// the requests already in flight, and wait() returns StreamStatus::kDrained with every
// accepted request answered (answered == accepted). cancel() stops at once: requests in
// flight are not answered, and the result says how many (unanswered).
//
// Failures. A stage that throws for a request (OnError::kRespond, the default) answers that
// request with a RequestError (stage, device, request id, the exception) and the stream goes
// on; later stages skip it. OnError::kFailFast stops the stream at the first exception
// (kFailed; the result carries the error and the unanswered count).
//
// Waiting. StreamConfig::wait (or one WaitPolicy per device) says how a device waits for its
// next request: busy-spin, spin-then-park (default) or park (see wait_policy.hpp). A device
// that shares its core with another device or with a reserved host core
// (DeviceConfig::host_cores) never spins long: its policy is capped (capped_for_sharing).
//
// Memory: the steady state allocates nothing of its own (the rings and the infeed's
// prefetch buffer are allocated at start; the outfeed allocates as an unbounded
// OutfeedQueue does); what the stages allocate is theirs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/feeds/spsc_ring.hpp"

namespace bspflow {

// Who sent a request and which of theirs it is.
struct RequestId {
  std::uint32_t producer = 0;  // RequestProducer::id(): unique in the process
  std::uint64_t sequence = 0;  // 0, 1, 2, ... per producer
  friend bool operator==(const RequestId&, const RequestId&) = default;
};

// What travels through a stream's infeed. Made by RequestProducer::push.
template <class T>
struct Request {
  RequestId id{};
  std::optional<T> value{};
};

// Why a request was answered with an error: the stage that threw and what it threw.
struct RequestError {
  std::uint32_t stage = 0;   // index of the stage in the stream (0 = first)
  std::string stage_name{};
  std::uint32_t device = 0;  // Device::id() of the device it ran on
  RequestId id{};
  std::string message{};       // "stage 'conv' (1) on device 0 failed on request 3 of producer 1: ..."
  std::exception_ptr cause{};  // what the stage threw
};

// One answer: the request's id and its value, or the error that replaced it.
template <class T>
struct Response {
  RequestId id{};
  std::optional<T> value{};                    // set when ok()
  std::shared_ptr<const RequestError> error{};  // set when a stage threw for this request
  bool ok() const noexcept { return error == nullptr; }
};

namespace detail {
// Any thread: the next process-unique producer id. Never blocks.
std::uint32_t next_request_producer_id() noexcept;
}  // namespace detail

// A host thread's handle for sending requests into a stream's infeed: stamps each request
// with this producer's id and next sequence number. One per thread (not thread-safe); must
// not outlive the infeed.
template <class In>
class RequestProducer {
 public:
  // Setup path (allocates the infeed producer token).
  explicit RequestProducer(InfeedQueue<Request<In>>& infeed)
      : producer_(infeed.make_producer()), id_(detail::next_request_producer_id()) {}

  // Producer thread. Blocks while the infeed is full. Returns the request's id, or nullopt
  // (nothing sent, no sequence number used) once the infeed is closed. Never throws except
  // std::bad_alloc.
  std::optional<RequestId> push(In value) {
    const RequestId id{id_, next_};
    if (!producer_.push(Request<In>{id, std::optional<In>(std::move(value))})) return std::nullopt;
    ++next_;
    return id;
  }
  // Producer thread. Never blocks: the id, or nullopt if the infeed is full or closed
  // (`value` untouched then; full() tells which).
  std::optional<RequestId> try_push(In&& value) {
    const RequestId id{id_, next_};
    Request<In> r{id, std::nullopt};
    r.value.emplace(std::move(value));
    last_ = producer_.try_push(std::move(r));
    if (last_ != PushResult::kOk) {
      value = std::move(*r.value);
      return std::nullopt;
    }
    ++next_;
    return id;
  }
  // Whether the last try_push failed because the infeed was full (not closed).
  bool full() const noexcept { return last_ == PushResult::kFull; }

  std::uint32_t id() const noexcept { return id_; }
  std::uint64_t sent() const noexcept { return next_; }

 private:
  typename InfeedQueue<Request<In>>::Producer producer_;
  std::uint32_t id_;
  std::uint64_t next_ = 0;
  PushResult last_ = PushResult::kOk;
};

enum class OnError {
  kRespond,   // answer the failing request with a RequestError and go on (default)
  kFailFast,  // stop the stream at the first exception (kFailed)
};

enum class StreamStatus {
  kDrained,    // the infeed was closed; every accepted request was answered
  kCancelled,  // cancel() (or the Stream destroyed mid-run)
  kFailed,     // OnError::kFailFast and a stage threw, or the runtime failed
};
// Any thread. "drained", "cancelled", "failed". Never blocks, never throws.
const char* to_string(StreamStatus s) noexcept;

struct StreamConfig {
  std::size_t capacity = tunables::kDefaultStreamCapacity;  // ring slots between devices, 1..kMaxQueueCapacity
  OnError on_error = OnError::kRespond;
  WaitPolicy wait = {};                 // how every device waits for its next request
  std::vector<WaitPolicy> device_wait{};  // empty, or one per device of the stream (overrides wait)
  // Throws bspflow::Error naming the field, the value and what is allowed.
  void validate(std::uint32_t devices) const;
};

struct StreamResult {
  StreamStatus status = StreamStatus::kDrained;
  std::uint64_t accepted = 0;    // requests the first stage took off the infeed
  std::uint64_t answered = 0;    // responses delivered to the outfeed (errors included)
  std::uint64_t errors = 0;      // of those, RequestErrors
  std::uint64_t unanswered = 0;  // accepted - answered: cut short by cancel or fail-fast
  std::string message{};         // one line saying the above
  std::shared_ptr<const RequestError> failure{};  // kFailed: the error that stopped it
  std::chrono::nanoseconds elapsed{0};          // start() to the end
  bool drained() const noexcept { return status == StreamStatus::kDrained; }
};

namespace detail {

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
  Segment(Source& source, Sink<B>& sink, std::function<B(void*)> fn,
          std::vector<std::string> names)
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
          out_.error = describe(StageFailure{first_stage, std::current_exception()}, device, in_.id);
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
                 " of producer " + std::to_string(id.producer) + ": " +
                 describe_exception(f.cause);
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
  std::vector<std::shared_ptr<void>> owned;    // rings, sources, sinks
  std::vector<std::function<void()>> ring_resets, ring_wakes;

  // Setup path: checks the stage placement against the devices (throws bspflow::Error).
  void check_placement() const;
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

}  // namespace detail

template <class In, class Cur = In>
class StreamBuilder;

// A built stream from In to Out. Host thread for start/wait/run; cancel from any thread.
// One run at a time; a Stream can run again after wait() (with the same or other feeds).
template <class In, class Out>
class Stream {
 public:
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) = delete;
  // Cancels a run still in progress and waits for its devices.
  ~Stream() {
    if (core_ && core_->running()) {
      core_->cancel();
      wait();
    }
  }

  // Host thread. Starts serving: every device takes up its stages and waits for requests.
  // Returns at once. Throws bspflow::Error if a run is in progress, the infeed does not have
  // exactly one replica lane or already has a reader, or the outfeed is not OutputMode::all()
  // with one replica or is attached to another run. Allocates (rings, prefetch buffer).
  void start(InfeedQueue<Request<In>>& infeed, OutfeedQueue<Response<Out>>& outfeed) {
    if (core_->running()) throw Error("Stream::start: a run is in progress; wait() for it first");
    if (infeed.replicas() != 1) {
      detail::throw_bad_value("stream infeed replicas", infeed.replicas(),
                              "a stream reads one lane: use InfeedConfig{.replicas = 1}");
    }
    if (outfeed.replicas() != 1 || outfeed.mode().kind() != OutputMode::Kind::kAll) {
      throw Error("stream outfeed: needs one replica and OutputMode::all() (every request "
                  "gets its response); this one has " + std::to_string(outfeed.replicas()) +
                  " replica(s) and mode " + outfeed.mode().to_string());
    }
    source_->attach(infeed.reader(0));
    try {
      auto writers = outfeed.begin_run();
      sink_->attach(std::move(writers.front()));
    } catch (...) {
      source_->detach();
      throw;
    }
    try {
      core_->start([in = &infeed, out = &outfeed] {
        in->wake_all();
        out->wake_all();
      });
    } catch (...) {  // a device refused its job: let go of the feeds
      source_->detach();
      sink_->abandon();
      throw;
    }
  }

  // Host thread. Blocks until the run ends (the infeed closed and drained, cancel(), or a
  // fail-fast failure) and every device has let go; returns what happened. Never throws
  // except std::bad_alloc; a stage's exception arrives as StreamResult::failure or in the
  // responses.
  StreamResult wait() {
    core_->wait_segments();
    source_->detach();
    return core_->finish(source_->accepted(), sink_->delivered(), sink_->errors());
  }

  // Host thread: start() then wait().
  StreamResult run(InfeedQueue<Request<In>>& infeed, OutfeedQueue<Response<Out>>& outfeed) {
    start(infeed, outfeed);
    return wait();
  }

  // Any thread. Stops the run in progress at once (requests in flight are not answered;
  // wait() says how many). Never blocks, never throws.
  void cancel() noexcept { core_->cancel(); }

  std::uint32_t stages() const noexcept {
    return static_cast<std::uint32_t>(core_->stage_names.size());
  }
  // How stage s's device waits: the configured policy, capped when the device shares its
  // core (WaitPolicy::capped_for_sharing). Never blocks.
  WaitPolicy wait_policy_of(std::uint32_t s) const { return core_->policy_for(device_of(s)); }
  // The device (index in the DeviceList) stage s runs on.
  std::uint32_t device_of(std::uint32_t s) const { return core_->stage_devices.at(s); }
  const std::string& stage_name(std::uint32_t s) const { return core_->stage_names.at(s); }

 private:
  template <class, class>
  friend class StreamBuilder;
  Stream(std::unique_ptr<detail::StreamCore> core, detail::InfeedSource<In>* source,
         detail::OutfeedSink<Out>* sink)
      : core_(std::move(core)), source_(source), sink_(sink) {}

  std::unique_ptr<detail::StreamCore> core_;
  detail::InfeedSource<In>* source_;
  detail::OutfeedSink<Out>* sink_;
};

// Builds a Stream stage by stage. Setup path: every call may allocate and throws
// bspflow::Error on bad input. Use as one expression (each call consumes the builder):
//   auto s = StreamBuilder<In>(devices, config).stage("a", fa).stage("b", fb, 0).build();
template <class In, class Cur>
class StreamBuilder {
 public:
  // `devices`: the devices stages may be placed on (a Device, a DeviceGroup or a DeviceList);
  // they must outlive the Stream.
  explicit StreamBuilder(DeviceList devices, StreamConfig config = {})
    requires std::is_same_v<Cur, In>
      : core_(std::make_unique<detail::StreamCore>(devices, std::move(config))) {
    auto source = std::make_shared<detail::InfeedSource<In>>();
    infeed_source_ = source.get();
    segment_source_ = source.get();
    core_->owned.push_back(std::move(source));
  }

  // Adds a stage on the next device (the first stage: device 0).
  template <class F>
  auto stage(std::string name, F f) && {
    const std::uint32_t device =
        core_->stage_devices.empty() ? 0 : core_->stage_devices.back() + 1;
    return std::move(*this).stage(std::move(name), std::move(f), device);
  }

  // Adds a stage on device `device` of the list: the current device (same segment, no
  // hand-off) or a later one.
  template <class F>
  auto stage(std::string name, F f, std::uint32_t device) && {
    static_assert(std::is_move_constructible_v<F>, "a stream stage must be movable");
    static_assert(std::is_invocable_v<F&, Cur&&>,
                  "a stream stage must be callable with the previous stage's output (rvalue)");
    using Next = std::decay_t<std::invoke_result_t<F&, Cur&&>>;
    static_assert(!std::is_void_v<Next>, "a stream stage must return its output");
    static_assert(std::is_move_constructible_v<Next> && std::is_move_assignable_v<Next>,
                  "a stream stage's output type must be movable");
    if (device >= core_->devices.size()) {
      detail::throw_bad_value("stage '" + name + "' device", device,
                              "must be below the stream's " +
                                  std::to_string(core_->devices.size()) + " device(s)");
    }
    if (!core_->stage_devices.empty() && device < core_->stage_devices.back()) {
      throw Error("stage '" + name + "' on device " + std::to_string(device) +
                  " comes after stage '" + core_->stage_names.back() + "' on device " +
                  std::to_string(core_->stage_devices.back()) +
                  ": stages go on the same device as the previous one or a later one");
    }
    const auto k = static_cast<std::uint32_t>(core_->stage_names.size());
    // Held through a shared_ptr so that move-only callables (owning their state) work too.
    auto tagged = [fp = std::make_shared<F>(std::move(f)), k](Cur&& x) -> Next {
      try {
        return (*fp)(std::move(x));
      } catch (...) {
        throw detail::StageFailure{k, std::current_exception()};
      }
    };
    const bool same_device = !core_->stage_devices.empty() && device == core_->stage_devices.back();
    core_->stage_names.push_back(std::move(name));
    core_->stage_devices.push_back(device);
    std::function<Next(void*)> fn;
    std::uint32_t first = segment_first_;
    detail::Source* source = segment_source_;
    if (same_device) {  // the same device: run after the previous stage, no hand-off
      fn = [prev = std::move(fn_), g = std::move(tagged)](void* x) mutable -> Next {
        return g(prev(x));
      };
    } else {
      if (fn_) {  // a new device: close this segment with a ring to the next one
        auto ring = std::make_shared<SpscRing<Response<Cur>>>(core_->config.capacity);
        auto sink = std::make_shared<detail::RingSink<Cur>>(*ring);
        auto next_source = std::make_shared<detail::RingSource<Cur>>(*ring);
        close_segment(*sink, k - 1);
        source = next_source.get();
        core_->ring_wakes.push_back([r = ring.get()] { r->wake(); });
        core_->ring_resets.push_back([r = ring.get()] { r->reset(); });
        core_->owned.push_back(std::move(ring));
        core_->owned.push_back(std::move(sink));
        core_->owned.push_back(std::move(next_source));
      }
      // The segment's first stage takes its input from the source's object.
      fn = [g = std::move(tagged)](void* x) mutable -> Next {
        return g(std::move(*static_cast<Cur*>(x)));
      };
      first = k;
    }
    return StreamBuilder<In, Next>(std::move(core_), infeed_source_, source, std::move(fn), first);
  }

  // The stream. Throws bspflow::Error without stages, or when the config is invalid.
  Stream<In, Cur> build() && {
    if (!fn_) throw Error("StreamBuilder::build: a stream needs at least one stage");
    core_->config.validate(core_->devices.size());
    auto sink = std::make_shared<detail::OutfeedSink<Cur>>();
    detail::OutfeedSink<Cur>* out = sink.get();
    close_segment(*sink, static_cast<std::uint32_t>(core_->stage_names.size() - 1));
    core_->owned.push_back(std::move(sink));
    core_->check_placement();
    return Stream<In, Cur>(std::move(core_), infeed_source_, out);
  }

 private:
  template <class, class>
  friend class StreamBuilder;
  StreamBuilder(std::unique_ptr<detail::StreamCore> core, detail::InfeedSource<In>* infeed_source,
                detail::Source* source, std::function<Cur(void*)> fn, std::uint32_t first)
      : core_(std::move(core)), infeed_source_(infeed_source), segment_source_(source),
        fn_(std::move(fn)), segment_first_(first) {}

  // The current segment (stages segment_first_..end, on one device) ends in `sink`.
  void close_segment(detail::Sink<Cur>& sink, std::uint32_t end) {
    std::vector<std::string> names(core_->stage_names.begin() + segment_first_,
                                   core_->stage_names.begin() + end + 1);
    auto seg = std::make_unique<detail::Segment<Cur>>(*segment_source_, sink, std::move(fn_),
                                                      std::move(names));
    seg->device_index = core_->stage_devices[segment_first_];
    seg->first_stage = segment_first_;
    seg->last_stage = end;
    core_->segments.push_back(std::move(seg));
  }

  std::unique_ptr<detail::StreamCore> core_;
  detail::InfeedSource<In>* infeed_source_ = nullptr;
  detail::Source* segment_source_ = nullptr;  // where the current segment reads
  std::function<Cur(void*)> fn_;              // the current segment's stages so far
  std::uint32_t segment_first_ = 0;
};

}  // namespace bspflow
