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
//                     .build();                                               // Stream<Image,
//                     Logits>
//   InfeedQueue<Request<Image>> requests;              // any number of host threads
//   OutfeedQueue<Response<Logits>> responses;
//   stream.start(requests, responses);                 // returns at once
//   RequestProducer<Image> client(requests);           // one per client thread
//   RequestId id = *client.push(image);                // nullopt once the infeed is closed
//   for (auto& e : responses) { e.value.id; e.value.ok() ? *e.value.value : e.value.error->message;
//   } requests.close();                                  // the stream drains, then ends
//   StreamResult r = stream.wait();                    // r.status == kDrained, r.answered
//
// Stages. A stage is a callable (movable; copyable not needed) from its input type to its
// output type (any movable types; a stage takes its input by value or rvalue reference). A
// stage runs on one device thread only, so it may keep state of its own without locking.
// Consecutive stages may share a device: they run one after the other on its thread with no
// hand-off between them. Stages on different devices are joined by a bounded single-producer
// single-consumer ring (SpscRing, `StreamConfig::capacity` requests). Each device of the stream
// runs one contiguous run of stages as a job on its pinned thread, for as long as the stream runs.
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
// that shares its core yields between checks (Placement::wait_policy): beside a reserved host
// core's thread (DeviceConfig::host_cores) it spins at most 5 us, beside devices only at
// least 50 us, then parks.
//
// Memory: the steady state allocates nothing of its own (the rings and the infeed's
// prefetch buffer are allocated at start; an outfeed with one reader, ConsumerType::kSingle,
// is a ring allocated when it is made, and an unbounded kMulti outfeed allocates as
// moodycamel does); what the stages allocate is theirs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/runtime/detail/stream_segment.hpp"
#include "bspflow/runtime/request.hpp"
#include "bspflow/runtime/stream_config.hpp"

namespace bspflow {

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
      throw Error(
          "stream outfeed: needs one replica and OutputMode::all() (every request "
          "gets its response); this one has " +
          std::to_string(outfeed.replicas()) + " replica(s) and mode " +
          outfeed.mode().to_string());
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
  // How stage s's device waits: the configured policy, adjusted when the device shares its
  // core (Placement::wait_policy). Never blocks.
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
  explicit StreamBuilder(DeviceList devices,
                         StreamConfig config = {}) requires std::is_same_v<Cur, In>
      : core_(std::make_unique<detail::StreamCore>(devices, std::move(config))) {
    auto source = std::make_shared<detail::InfeedSource<In>>();
    infeed_source_ = source.get();
    segment_source_ = source.get();
    core_->owned.push_back(std::move(source));
  }

  // Adds a stage on the next device (the first stage: device 0).
  template <class F>
  auto stage(std::string name, F f) && {
    const std::uint32_t device = core_->stage_devices.empty() ? 0 : core_->stage_devices.back() + 1;
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
      detail::throw_bad_value(
          "stage '" + name + "' device", device,
          "must be below the stream's " + std::to_string(core_->devices.size()) + " device(s)");
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
