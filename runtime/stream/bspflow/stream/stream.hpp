// Stream: a persistent chain of typed stages on pinned devices serving requests from
// StreamClients, one response per accepted request (the request path of an inference
// server). Guide: runtime/stream/README.md.
//
//   DeviceGroup devices(2);
//   auto stream = StreamBuilder<Image>(devices)
//                     .stage("conv", [](Image x) { return conv(x); })  // device 0
//                     .stage("head", [](Features f) { return head(f); })  // device 1
//                     .build();                                // Stream<Image, Logits>
//   auto client = stream.client();
//   stream.start();
//   client.push(image, StreamClock::now() + 5ms);
//   Response<Logits> r = *client.pop();
//   stream.close();
//   StreamResult result = stream.wait();
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
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/stream/detail/stream_batch.hpp"
#include "bspflow/stream/detail/stream_hub.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_builder.hpp"
#include "bspflow/stream/stream_client.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow {

// A built stream from In to Out. One run at a time; a Stream can run again after wait().
template <class In, class Out>
class Stream {
 public:
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) = delete;
  // Cancels a run still in progress (answering its requests kCancelled) and waits for it.
  // Clients may outlive the Stream: their pushes are then refused (Refusal::kClosed).
  // Contract: host; blocks; no-alloc; noexcept.
  ~Stream() {
    if (!core_) return;
    if (core_->running()) {
      core_->cancel();
      wait();
    }
    intake_->detach();
  }

  // Starts serving the clients: returns at once, the devices then take requests. `stop`
  // is watched from this call until wait() returns: a stop requested before start(), or
  // any time until then, cancels the run as cancel() does (stopped before the devices
  // start, no request runs and every accepted one is answered kCancelled).
  // Contract: host; non-blocking; allocates; throws Error if a run is in progress or a
  // device refuses the job.
  void start(std::stop_token stop = {}) {
    if (core_->running()) throw Error("Stream::start: a run is in progress; wait() for it first");
    core_->open_run(std::move(stop));
    try {
      responder_->begin();
      for (std::uint32_t r = 0; r < core_->replicas; ++r) {
        sources_[r]->begin(core_->replica_meters[r].get());
        sinks_[r]->begin(core_->replica_meters[r].get(), core_->timing());
      }
      refused_at_start_ = core_->refused_total();
      intake_->open();
      try {
        // A stop (cancel(), the token, a fail-fast failure) also ends admission.
        core_->start([in = intake_.get()] { in->close(); });
      } catch (...) {
        intake_->close();
        throw;
      }
    } catch (...) {
      core_->close_run();
      throw;
    }
  }

  // A new client, for one client thread. Its pushes are refused (Refusal::kClosed) unless a
  // run is in progress and open.
  // Contract: any; non-blocking; allocates (its response slots); throws bad_alloc.
  StreamClient<In, Out> client() {
    std::vector<std::uint32_t> cores;
    for (std::uint32_t d = 0; d < core_->devices.size(); ++d) {
      if (const auto& c = core_->devices[d].placement().core) cores.push_back(*c);
    }
    return StreamClient<In, Out>(intake_, responder_->make_client(), detail::next_client_id(),
                                 core_->config.ordering, std::move(cores));
  }

  // Ends admission: later pushes are refused (kClosed); the stream answers every request it
  // accepted, then the run ends and wait() returns kCompleted. Pushes racing with close()
  // are either accepted (and answered) or refused.
  // Contract: any; non-blocking; no-alloc; noexcept.
  void close() noexcept { intake_->close(); }

  // Waits until the run ends (closed and drained, cancel(), or a fail-fast failure) and
  // every device has let go; returns what happened. Does nothing for long without a run.
  // Contract: host; blocks; allocates (the result's message); throws bad_alloc.
  StreamResult wait() {
    core_->wait_segments();
    const std::uint64_t accepted = intake_->accepted();
    std::uint64_t answered = responder_->delivered(), errors = responder_->errors();
    for (const auto* sink : sinks_) {
      answered += sink->delivered();
      errors += sink->errors();
    }
    return core_->finish(accepted, answered, errors, refused_at_start_);
  }

  // Stops the run of the last start() at once, from that call until wait() returns:
  // admission ends (later pushes are refused kClosed) and every request not yet answered is
  // answered kCancelled (a stage already running one finishes its call first, and its
  // answer is kCancelled too unless it was the last stage's). Between runs it does nothing:
  // to stop a run that may not have started yet, give start() a std::stop_token.
  // Contract: any; non-blocking; no-alloc; noexcept.
  void cancel() noexcept { core_->cancel(); }

  // Histograms, counts and depths since the Stream was built.
  // Contract: any; non-blocking; allocates; throws bad_alloc.
  StreamStats stats() const {
    StreamStats s = core_->stats();
    responder_->add_stats(s);
    return s;
  }

  // Contract of the members below: any; non-blocking; no-alloc; noexcept unless said.
  std::uint32_t stages() const noexcept {
    return static_cast<std::uint32_t>(core_->stage_names.size());
  }
  std::uint32_t replicas() const noexcept { return core_->replicas; }
  // How stage s's device (of replica 0) waits: the configured policy, adjusted when the
  // device shares its core (Placement::wait_policy). Throws std::out_of_range for a bad s.
  WaitPolicy wait_policy_of(std::uint32_t s) const { return core_->policy_for(device_of(s)); }
  // The device (index in the DeviceList) stage s of replica `replica` runs on. Throws
  // std::out_of_range for a bad s.
  std::uint32_t device_of(std::uint32_t s, std::uint32_t replica = 0) const {
    return core_->device_of(replica, core_->stage_devices.at(s));
  }
  // Throws std::out_of_range for a bad s.
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
  }

  std::unique_ptr<detail::StreamCore> core_;
  std::shared_ptr<detail::Intake<In>> intake_;
  std::unique_ptr<detail::Responder<Out>> responder_;
  std::vector<detail::FirstSource<In>*> sources_;  // one per replica
  std::vector<detail::LastSink<Out>*> sinks_;      // likewise
  std::uint64_t refused_at_start_ = 0;
};

}  // namespace bspflow
