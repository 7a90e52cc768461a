/// @file
/// Stream: a persistent graph of typed stages on pinned devices serving requests from
/// StreamClients, one response per accepted request (the request path of an inference
/// server). Built by StreamBuilder (a chain) or StreamGraph. Guide: runtime/stream/README.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/stream/detail/graph_wiring.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_builder.hpp"
#include "bspflow/stream/stream_client.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_graph.hpp"
#include "bspflow/stream/stream_serving.hpp"
#include "bspflow/stream/stream_swap.hpp"

namespace bspflow {

/// A built stream from In to Out. One run at a time; a Stream can run again after wait().
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class In, class Out>
class Stream {
 public:
  /// Contract: host; non-blocking; no-alloc; noexcept.
  Stream(Stream&&) noexcept = default;
  Stream& operator=(Stream&&) = delete;
  /// Cancels a run still in progress (answering its requests kCancelled) and waits for it.
  /// Clients may outlive the Stream: their pushes are then refused (Refusal::kClosed).
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Stream() {
    if (!core_) return;
    if (core_->running()) {
      core_->cancel();
      wait();
    }
    admission_->detach();
  }

  /// Starts serving the clients: returns at once, the devices then take requests. `stop`
  /// is watched from this call until wait() returns: a stop requested before start(), or
  /// any time until then, cancels the run as cancel() does (stopped before the devices
  /// start, no request runs and every accepted one is answered kCancelled). Throws Error if a
  /// run is in progress or a device refuses the job.
  /// Contract: host; non-blocking; allocates; throws Error.
  void start(std::stop_token stop = {}) {
    if (core_->running()) throw Error("Stream::start: a run is in progress; wait() for it first");
    core_->open_run(std::move(stop));
    try {
      responder_->begin();
      for (auto* e : members_) e->begin();
      for (auto* s : sinks_) s->begin(core_->timing());
      refused_at_start_ = core_->refused_total();
      admission_->open();
      try {
        // A stop (cancel(), the token, a fail-fast failure) also ends admission.
        core_->start([in = admission_.get()] { in->close(); });
      } catch (...) {
        admission_->close();
        throw;
      }
    } catch (...) {
      core_->close_run();
      throw;
    }
  }

  /// A new client, for one client thread; its requests are of priority class `priority`
  /// (see StreamClient::set_priority). Its pushes are refused (Refusal::kClosed) unless a
  /// run is in progress and open. Throws Error if `priority` is not below
  /// StreamConfig::priority_classes.
  /// Contract: any; non-blocking; allocates (its response slots); throws Error.
  StreamClient<In, Out> client(std::uint32_t priority = 0) {
    std::vector<std::uint32_t> cores;
    for (std::uint32_t d = 0; d < core_->devices.size(); ++d) {
      if (const auto& c = core_->devices[d].placement().core) cores.push_back(*c);
    }
    StreamClient<In, Out> c(admission_, responder_->make_client(), detail::next_client_id(),
                            core_->config.ordering, std::move(cores),
                            core_->config.priority_classes);
    c.set_priority(priority);
    return c;
  }

  /// Ends admission: later pushes are refused (kClosed); the stream answers every request it
  /// accepted, then the run ends and wait() returns kCompleted. A push racing with close() is
  /// either accepted (and answered) or refused.
  void close() noexcept { admission_->close(); }

  /// Waits until the run ends (closed and drained, cancel(), or a fail-fast failure) and
  /// every device has let go; returns what happened. Without a run in progress it returns at
  /// once.
  /// Contract: host; blocks; allocates (the result's message); throws bad_alloc.
  StreamResult wait() {
    core_->wait_segments();
    const std::uint64_t accepted = admission_->accepted();
    std::uint64_t answered = responder_->delivered(), errors = responder_->errors();
    for (const auto* sink : sinks_) {
      answered += sink->delivered();
      errors += sink->errors();
    }
    return core_->finish(accepted, answered, errors, refused_at_start_);
  }

  /// Stops the run of the last start() at once, from that call until wait() returns:
  /// admission ends (later pushes are refused kClosed) and every request not yet answered is
  /// answered kCancelled (a stage already running one finishes its call first, and its
  /// answer is kCancelled too unless it was the output node's). Between runs it does
  /// nothing: to stop a run that may not have started yet, give start() a std::stop_token.
  void cancel() noexcept { core_->cancel(); }

  /// Replaces the callable of the stage (or batch stage) named `stage` with `version`, while
  /// the stream serves or between runs. The new version is copied for each replica and each
  /// copy warmed, on the calling thread, with every input of `warmup` (off the request path);
  /// a warm-up that throws leaves the old version serving and the result says why. Then each
  /// replica moves to it at a request (or batch) boundary: requests already inside the old
  /// version finish on it, and each response says which version answered it
  /// (Response::version). When each replica's device can hold both versions
  /// (SwapOptions::memory beside the old one's) the swap is in place; when it can hold only
  /// one, the swap rolls one replica at a time (it takes no new requests, drains, swaps and
  /// rejoins); when it cannot hold even the new one alone, the swap is refused with the
  /// OutOfMemoryError's report. `stop` cancels it: the replicas not yet swapped keep the old
  /// version. Blocks until done; one swap at a time. A generate stage's step (a non-generic
  /// callable on the same std::span<Generation<X, E>>, with no warm-up inputs) serves new
  /// sequences at once, and the swap returns once every sequence started on the old version
  /// has ended on it. Throws Error for a name that is not a stage's, or a version of another
  /// type than the stage's.
  /// Contract: host; blocks; allocates; throws Error.
  template <class F, class X>
  SwapResult swap(std::string_view stage, F version,  // NOLINT(bugprone-exception-escape): a
                  std::vector<X> warmup,              // model swap, which throws as tagged
                  SwapOptions options = {}, const std::stop_token& stop = {}) {
    const std::uint32_t node = core_->swappable(stage);
    const detail::NodeSpec& spec = core_->nodes[node];
    if (*spec.in_type != typeid(X)) {
      throw Error("Stream::swap: stage '" + spec.name +
                  "' takes another type than the warm-up "
                  "inputs given (" +
                  std::string(typeid(X).name()) + ")");
    }
    std::vector<std::unique_ptr<detail::Versioned>> fresh;
    SwapResult refused;
    const std::uint32_t number = core_->next_version();
    try {
      for (std::uint32_t r = 0; r < core_->replicas; ++r) {
        F copy = r + 1 == core_->replicas ? std::move(version) : copy_of(version);
        if constexpr (detail::GenerateStep<F, X>::value) {
          using G = detail::GenerateStep<F, X>;
          using Elem = typename std::decay_t<
              std::invoke_result_t<F&, std::span<Generation<X, typename G::Entry>>>>::value_type;
          if (spec.kind != detail::NodeKind::kGenerate || *spec.out_type != typeid(Elem) ||
              *spec.state_type != typeid(typename G::Entry)) {
            throw Error("Stream::swap: stage '" + spec.name +
                        "' is not a generate stage with this state entry and output type");
          }
          if (!warmup.empty()) {
            throw Error("Stream::swap: generate stage '" + spec.name +
                        "' takes no warm-up inputs (its step needs sequences with state); pass "
                        "an empty vector");
          }
          auto v = std::make_unique<
              detail::GenerateFnOf<X, typename G::Entry, typename Elem::value_type, F>>(
              std::move(copy));
          v->version = number;
          fresh.push_back(std::move(v));
        } else if constexpr (std::is_invocable_v<F&, std::span<X>>) {
          using Vec = std::decay_t<std::invoke_result_t<F&, std::span<X>>>;
          using Elem = typename Vec::value_type;
          if (spec.kind != detail::NodeKind::kBatch || *spec.out_type != typeid(Elem)) {
            throw Error("Stream::swap: stage '" + spec.name +
                        "' is not a batch stage with this output type");
          }
          std::vector<X> batch = warmup;
          if (!batch.empty()) (void)copy(std::span<X>(batch.data(), batch.size()));
          auto v = std::make_unique<detail::BatchFnOf<X, Elem, F>>(std::move(copy));
          v->version = number;
          fresh.push_back(std::move(v));
        } else {
          static_assert(std::is_invocable_v<F&, X&&>,
                        "Stream::swap: the version must be callable with the warm-up inputs' "
                        "type (a stage) or a std::span of it (a batch stage)");
          using Y = std::decay_t<std::invoke_result_t<F&, X&&>>;
          if (spec.kind != detail::NodeKind::kStage || *spec.out_type != typeid(Y)) {
            throw Error("Stream::swap: stage '" + spec.name +
                        "' is not a stage with this output type");
          }
          for (const X& x : warmup) (void)copy(X(x));
          auto v = std::make_unique<detail::StageFnOf<X, Y, F>>(std::move(copy));
          v->version = number;
          fresh.push_back(std::move(v));
        }
      }
    } catch (const Error& e) {
      if (std::string_view(e.what()).starts_with("Stream::swap:")) throw;
      refused.version = number;
      refused.error = std::current_exception();
      refused.message = "warm-up failed, the old version keeps serving: " + std::string(e.what());
      return refused;
    } catch (...) {
      refused.version = number;
      refused.error = std::current_exception();
      refused.message = "warm-up failed, the old version keeps serving: " +
                        detail::describe_exception(refused.error);
      return refused;
    }
    return core_->swap(node, std::move(fresh), options.memory.value_or(spec.memory), stop);
  }

  /// Histograms, counts and depths since the Stream was built.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  StreamStats stats() const {
    StreamStats s = core_->stats();
    responder_->add_stats(s);
    return s;
  }

  /// How many stages (graph nodes with a callable) the stream has.
  std::uint32_t stages() const noexcept { return static_cast<std::uint32_t>(core_->named.size()); }
  /// How many replicas the stream has.
  std::uint32_t replicas() const noexcept { return core_->replicas; }
  /// How stage s's device (of replica 0) waits: the configured policy, adjusted when the
  /// device shares its core (Placement::wait_policy).
  /// Contract: any; non-blocking; no-alloc; throws std::out_of_range for a bad s.
  WaitPolicy wait_policy_of(std::uint32_t s) const { return core_->policy_for(device_of(s)); }
  /// The device (index in the DeviceList) stage s of replica `replica` runs on.
  /// Contract: any; non-blocking; no-alloc; throws std::out_of_range for a bad s.
  std::uint32_t device_of(std::uint32_t s, std::uint32_t replica = 0) const {
    return core_->device_of(replica, core_->nodes[core_->named.at(s)].device);
  }
  /// Stage s's name.
  /// Contract: any; non-blocking; no-alloc; throws std::out_of_range for a bad s.
  const std::string& stage_name(std::uint32_t s) const { return core_->node_name(s); }

 private:
  template <class>
  friend class StreamGraph;
  Stream(std::unique_ptr<detail::StreamCore> core, detail::Wired<In, Out> wired)
      : core_(std::move(core)), admission_(std::move(wired.admission)),
        responder_(std::move(wired.responder)), members_(std::move(wired.sources)),
        sinks_(std::move(wired.sinks)) {}

  template <class F>
  static F copy_of(F& f) {
    if constexpr (std::is_copy_constructible_v<F>) {
      return f;
    } else {
      throw Error("Stream::swap: the version is move-only, and each replica needs its own copy");
    }
  }

  std::unique_ptr<detail::StreamCore> core_;
  std::shared_ptr<detail::AdmissionQueue<In>> admission_;
  std::unique_ptr<detail::Responder<Out>> responder_;
  std::vector<detail::AdmissionSource<In>*> members_;  // one per replica
  std::vector<detail::ReplicaSink<Out>*> sinks_;       // likewise
  std::uint64_t refused_at_start_ = 0;
};

}  // namespace bspflow
