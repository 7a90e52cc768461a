// Streams: a persistent pipeline of typed stages on pinned devices, for serving inference
// requests (the request path of an inference server; the inference counterpart of
// Pipeline). Users of oneTBB flow graph will recognise serial function nodes joined by
// edges, users of Taskflow a data pipeline of serial pipes, users of the LMAX Disruptor a
// chain of event handlers with a wait strategy, users of Triton model instances and its
// dynamic batcher.
//
//   DeviceGroup devices(2);
//   auto stream = StreamBuilder<Image>(devices)
//                     .stage("conv", [](Image x) { return conv(x); })        // device 0
//                     .stage("pool", [](Features f) { return pool(f); }, 0)  // also device 0
//                     .stage("head", [](Features f) { return head(f); })     // device 1
//                     .build();                                      // Stream<Image, Logits>
//
// Two ways to serve (runtime/README.md, "Streams" and "Serving"):
// - StreamClients (start()): each client thread pushes with an optional deadline, may
//   cancel, and pops its own responses in the order it pushed them; admission control
//   refuses what cannot be served in time; replicas, batch stages, stats. Or start(outfeed):
//   the same clients, every response in one OutfeedQueue for a one-reader server.
//   auto client = stream.client();  stream.start();
//   client.push(image, StreamClock::now() + 5ms);  Response<Logits> r = *client.pop();
//   stream.close(); stream.wait();
// - An InfeedQueue<Request<In>> to an OutfeedQueue<Response<Out>> (start(infeed, outfeed)),
//   with RequestProducers: one replica, FIFO end to end, the infeed blocks when full.
//
// Stages. A stage is a callable (movable; copyable when replicas > 1: each replica owns its
// copy) from its input type to its output type (movable types; by value or rvalue
// reference). A stage runs on one device thread only, so it may keep state of its own
// without locking. Consecutive stages may share a device: they run one after the other on
// its thread with no hand-off. Stages on devices pinned to one core run on one thread too
// (StreamConfig::fuse_shared_cores): a hand-off between two threads of one core is pure cost.
// Otherwise stages on different devices are joined by a bounded SPSC ring
// (StreamConfig::capacity requests). A batch stage takes a std::span of requests (see
// BatchConfig) and starts its device's run of stages.
//
// Every stage boundary checks the request: a cancelled one is answered kCancelled, one past
// its deadline kDeadlineExceeded, neither is run. A stage that throws (OnError::kRespond,
// the default) answers that request kStageFailed and the stream goes on; OnError::kFailFast
// stops the stream at the first exception (kFailed).
//
// End. close() (or closing the infeed) drains: every accepted request is answered, then
// wait() returns kCompleted ("drained"). cancel() stops at once: a StreamClient request in
// flight is answered kCancelled; on the infeed path it is not answered (the result says how
// many). Waiting: StreamConfig::wait or one WaitPolicy per device (see wait_policy.hpp); a
// device that shares its core yields between checks.
//
// Memory: the steady state allocates nothing of its own (rings, the admission queue and
// the clients' response slots are allocated at build or start); what stages allocate and
// a RequestError are the exceptions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/stream/detail/stream_batch.hpp"
#include "bspflow/stream/detail/stream_hub.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_builder.hpp"
#include "bspflow/stream/stream_client.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow {

// A built stream from In to Out. Host thread for start/wait/run; close, cancel, stats and
// client from any thread. One run at a time; a Stream can run again after wait().
template <class In, class Out>
class Stream {
 public:
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) = delete;
  // Cancels a run still in progress (answering StreamClient requests kCancelled) and waits.
  ~Stream() {
    if (!core_) return;
    if (core_->running()) {
      core_->cancel();
      wait();
    }
    intake_->detach();
  }

  // Every start takes an optional std::stop_token: it is watched from the start() call until
  // wait() returns, and a stop requested before start(), or any time until then, cancels the
  // run as cancel() does (stopped before the devices start: nothing is taken from the infeed
  // and no request runs; StreamClient requests are answered kCancelled).

  // Host thread. Serves StreamClients: each pops its own responses. Returns at once.
  // Throws bspflow::Error if a run is in progress.
  void start(std::stop_token stop = {}) {
    start_clients(detail::ServeMode::kClients, nullptr, std::move(stop));
  }
  // Host thread. Serves StreamClients; every response goes to `outfeed` (one replica,
  // OutputMode::all()), each client's in its push order unless Ordering::kNone.
  void start(OutfeedQueue<Response<Out>>& outfeed, std::stop_token stop = {}) {
    check_outfeed(outfeed);
    start_clients(detail::ServeMode::kSharedOutfeed, &outfeed, std::move(stop));
  }
  // Host thread. Serves an InfeedQueue of Requests (RequestProducers): one replica only.
  // Throws bspflow::Error if a run is in progress, the stream has replicas, the infeed does
  // not have exactly one lane or already has a reader, or the outfeed is not OutputMode::all()
  // with one replica or is attached to another run. Allocates (prefetch buffer).
  void start(InfeedQueue<Request<In>>& infeed, OutfeedQueue<Response<Out>>& outfeed,
             std::stop_token stop = {}) {
    if (core_->running()) throw Error("Stream::start: a run is in progress; wait() for it first");
    core_->open_run(std::move(stop));
    try {
      start_infeed(infeed, outfeed);
    } catch (...) {
      core_->close_run();
      throw;
    }
  }

  // Any thread. A new client (one per client thread); pushes are refused (kClosed) unless a
  // StreamClient run is in progress and open. Allocates its response slots.
  StreamClient<In, Out> client() {
    std::vector<std::uint32_t> cores;
    for (std::uint32_t d = 0; d < core_->devices.size(); ++d) {
      if (const auto& c = core_->devices[d].placement().core) cores.push_back(*c);
    }
    return StreamClient<In, Out>(intake_, responder_->make_client(),
                                 detail::next_request_producer_id(), core_->config.ordering,
                                 std::move(cores));
  }

  // Any thread. No new StreamClient requests (pushes say kClosed); the stream answers what
  // it accepted, then the run ends (wait() returns kCompleted). Never blocks.
  void close() noexcept { intake_->close(); }

  // Host thread. Blocks until the run ends (closed and drained, cancel(), or a fail-fast
  // failure) and every device has let go; returns what happened. Never throws except
  // std::bad_alloc.
  StreamResult wait() {
    core_->wait_segments();
    std::uint64_t accepted = 0;
    if (core_->mode() == detail::ServeMode::kInfeed) {
      sources_[0]->detach();
      accepted = sources_[0]->taken();
    } else {
      accepted = intake_->accepted();
    }
    std::uint64_t answered = responder_->delivered(), errors = responder_->errors();
    for (const auto* sink : sinks_) {
      answered += sink->delivered();
      errors += sink->errors();
    }
    // Handed to a shared outfeed that then dropped them (a stop found it full): not answered.
    answered -= responder_->dropped();
    errors -= responder_->dropped_errors();
    return core_->finish(accepted, answered, errors, refused_at_start_);
  }

  // Host thread: start(infeed, outfeed, stop) then wait().
  StreamResult run(InfeedQueue<Request<In>>& infeed, OutfeedQueue<Response<Out>>& outfeed,
                   std::stop_token stop = {}) {
    start(infeed, outfeed, std::move(stop));
    return wait();
  }

  // Any thread. Stops the run of the start() call made last, from that call until wait()
  // returns, at once (StreamClient requests are answered kCancelled; infeed requests in
  // flight are not answered). Between runs (before start(), after wait()) it does nothing:
  // to stop a run that may not have started yet, give start() a std::stop_token. Never
  // blocks for long, never throws.
  void cancel() noexcept { core_->cancel(); }

  // Any thread, any time. Histograms, counts and depths since the Stream was built.
  StreamStats stats() const {
    StreamStats s = core_->stats();
    responder_->add_stats(s);
    return s;
  }

  std::uint32_t stages() const noexcept {
    return static_cast<std::uint32_t>(core_->stage_names.size());
  }
  std::uint32_t replicas() const noexcept { return core_->replicas; }
  // How stage s's device (of replica 0) waits: the configured policy, adjusted when the
  // device shares its core (Placement::wait_policy). Never blocks.
  WaitPolicy wait_policy_of(std::uint32_t s) const { return core_->policy_for(device_of(s)); }
  // The device (index in the DeviceList) stage s of replica `replica` runs on.
  std::uint32_t device_of(std::uint32_t s, std::uint32_t replica = 0) const {
    return core_->device_of(replica, core_->stage_devices.at(s));
  }
  const std::string& stage_name(std::uint32_t s) const { return core_->stage_names.at(s); }

 private:
  template <class, class>
  friend class StreamBuilder;
  Stream(std::unique_ptr<detail::StreamCore> core, std::shared_ptr<detail::Intake<In>> intake,
         std::unique_ptr<detail::Responder<Out>> responder,
         std::vector<detail::FirstSource<In>*> sources, std::vector<detail::LastSink<Out>*> sinks)
      : core_(std::move(core)), intake_(std::move(intake)), responder_(std::move(responder)),
        sources_(std::move(sources)), sinks_(std::move(sinks)) {
    core_->answerer = responder_.get();
    core_->ends = responder_.get();
  }

  static void check_outfeed(OutfeedQueue<Response<Out>>& outfeed) {
    if (outfeed.replicas() != 1 || outfeed.mode().kind() != OutputMode::Kind::kAll) {
      throw Error(
          "stream outfeed: needs one replica and OutputMode::all() (every request "
          "gets its response); this one has " +
          std::to_string(outfeed.replicas()) + " replica(s) and mode " +
          outfeed.mode().to_string());
    }
  }

  // start(infeed, outfeed)'s work once the run is open.
  void start_infeed(InfeedQueue<Request<In>>& infeed, OutfeedQueue<Response<Out>>& outfeed) {
    if (core_->replicas != 1) {
      detail::throw_bad_value("Stream::start(infeed, outfeed) with replicas", core_->replicas,
                              "1: a replicated stream serves StreamClients (stream.client(), "
                              "then start() or start(outfeed))");
    }
    if (infeed.replicas() != 1) {
      detail::throw_bad_value("stream infeed replicas", infeed.replicas(),
                              "a stream reads one lane: use InfeedConfig{.replicas = 1}");
    }
    check_outfeed(outfeed);
    sources_[0]->attach(infeed.reader(0));
    try {
      auto writers = outfeed.begin_run();
      sinks_[0]->attach(std::move(writers.front()));
    } catch (...) {
      sources_[0]->detach();
      throw;
    }
    begin_ends(detail::ServeMode::kInfeed);
    responder_->begin(detail::ServeMode::kInfeed, nullptr, 0);
    try {
      core_->start(detail::ServeMode::kInfeed, [in = &infeed, out = &outfeed] {
        in->wake_all();
        out->wake_all();
      });
    } catch (...) {  // a device refused its job: let go of the feeds
      sources_[0]->detach();
      sinks_[0]->abandon();
      throw;
    }
  }

  void begin_ends(detail::ServeMode mode) {
    refused_at_start_ = core_->refused_total();
    const bool timing = core_->timing();
    for (std::uint32_t r = 0; r < core_->replicas; ++r) {
      sources_[r]->begin(mode, core_->replica_meters[r].get(), timing);
      sinks_[r]->begin(mode, core_->replica_meters[r].get(), timing);
    }
  }

  void start_clients(detail::ServeMode mode, OutfeedQueue<Response<Out>>* outfeed,
                     std::stop_token stop) {
    if (core_->running()) throw Error("Stream::start: a run is in progress; wait() for it first");
    core_->open_run(std::move(stop));
    try {
      open_clients(mode, outfeed);
    } catch (...) {
      core_->close_run();
      throw;
    }
  }
  void open_clients(detail::ServeMode mode, OutfeedQueue<Response<Out>>* outfeed) {
    // Everything a request can be in between admission and delivery bounds the reorder window.
    const std::size_t window = core_->config.admission.max_queued +
                               (core_->segments.size() + core_->replicas) *
                                   (core_->config.capacity + 2 * core_->max_batch + 2);
    responder_->begin(mode, outfeed, window);
    begin_ends(mode);
    const bool reorder = mode == detail::ServeMode::kSharedOutfeed &&
                         core_->config.ordering == Ordering::kPerProducer;
    intake_->begin(mode == detail::ServeMode::kSharedOutfeed,
                   reorder ? responder_->front() : nullptr, responder_->window());
    intake_->open();
    try {
      core_->start(mode, [in = intake_.get(), out = outfeed] {
        in->wake();
        if (out != nullptr) out->wake_all();
      });
    } catch (...) {
      intake_->close();
      responder_->abandon();
      throw;
    }
  }

  std::unique_ptr<detail::StreamCore> core_;
  std::shared_ptr<detail::Intake<In>> intake_;
  std::unique_ptr<detail::Responder<Out>> responder_;
  std::vector<detail::FirstSource<In>*> sources_;  // one per replica
  std::vector<detail::LastSink<Out>*> sinks_;      // likewise
  std::uint64_t refused_at_start_ = 0;
};

}  // namespace bspflow
