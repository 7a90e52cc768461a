// StreamBuilder: builds a Stream stage by stage. Include <bspflow/stream/stream.hpp>, which
// includes this one and defines the Stream it builds. Guide: runtime/stream/README.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/stream/detail/stream_batch.hpp"
#include "bspflow/stream/detail/stream_hub.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow {

template <class In, class Out>
class Stream;
template <class In, class Cur = In>
class StreamBuilder;

// Builds a Stream stage by stage. Setup path: every call may allocate and throws
// bspflow::Error on bad input. Use as one expression (each call consumes the builder):
//   auto s = StreamBuilder<In>(devices, config).stage("a", fa).stage("b", fb, 0).build();
template <class In, class Cur>
class StreamBuilder {
  // One replica's chain so far: where its current segment reads, its stages composed.
  struct Lane {
    detail::Source* source = nullptr;
    std::function<Cur(void*, detail::StageCtx&)> fn;
    std::unique_ptr<detail::BatchHeadBase> batch;
    std::uint32_t first = 0;  // the current segment's first stage
  };

 public:
  // `devices`: the devices stages may be placed on (a Device, a DeviceGroup or a
  // DeviceList); with config.replicas = R, replica r uses devices r*D/R .. (r+1)*D/R - 1.
  // They must outlive the Stream. Throws bspflow::Error if the config is invalid.
  explicit StreamBuilder(DeviceList devices,
                         StreamConfig config = {}) requires std::is_same_v<Cur, In>
      : core_(std::make_unique<detail::StreamCore>(devices, std::move(config))) {
    intake_ = std::make_shared<detail::Intake<In>>(*core_);
    core_->intake = intake_.get();
    for (std::uint32_t r = 0; r < core_->replicas; ++r) {
      auto source = std::make_shared<detail::FirstSource<In>>(*intake_);
      sources_.push_back(source.get());
      lanes_.emplace_back();
      lanes_.back().source = source.get();
      core_->owned.push_back(std::move(source));
    }
  }

  // Adds a stage on the next device (the first stage: device 0).
  template <class F>
  auto stage(std::string name, F f) && {
    const std::uint32_t device = next_device();
    return std::move(*this).stage(std::move(name), std::move(f), device);
  }

  // Adds a stage on device `device` (within a replica): the current device (same segment,
  // no hand-off) or a later one.
  template <class F>
  auto stage(std::string name, F f, std::uint32_t device) && {
    static_assert(std::is_move_constructible_v<F>, "a stream stage must be movable");
    static_assert(std::is_invocable_v<F&, Cur&&>,
                  "a stream stage must be callable with the previous stage's output (rvalue)");
    using Next = std::decay_t<std::invoke_result_t<F&, Cur&&>>;
    static_assert(!std::is_void_v<Next>, "a stream stage must return its output");
    static_assert(std::is_move_constructible_v<Next> && std::is_move_assignable_v<Next>,
                  "a stream stage's output type must be movable");
    const std::uint32_t k = add_stage(name, device, false);
    std::vector<typename StreamBuilder<In, Next>::Lane> next(lanes_.size());
    for (std::uint32_t r = 0; r < lanes_.size(); ++r) {
      auto step = [fp = std::make_shared<F>(copy_for(f, r, name)), k](Cur&& x,
                                                                      detail::StageCtx& c) -> Next {
        return detail::run_stage<F, Cur, Next>(*fp, std::move(x), c, k);
      };
      Lane& lane = lanes_[r];
      auto& out = next[r];
      const std::uint32_t prev = k == 0 ? device : core_->stage_devices[k - 1];
      const bool same = lane.fn && (device == prev || (core_->config.fuse_shared_cores &&
                                                       core_->share_core(r, prev, device)));
      if (same) {
        out.fn = [prev_fn = std::move(lane.fn), step = std::move(step)](
                     void* x, detail::StageCtx& c) mutable -> Next {
          return step(prev_fn(x, c), c);
        };
        out.source = lane.source;
        out.batch = std::move(lane.batch);
        out.first = lane.first;
      } else {
        out.source = begin_segment(lane, r, k);
        out.fn = [step = std::move(step)](void* x, detail::StageCtx& c) mutable -> Next {
          return step(std::move(*static_cast<Cur*>(x)), c);
        };
        out.first = k;
      }
    }
    return StreamBuilder<In, Next>(std::move(core_), std::move(intake_), std::move(sources_),
                                   std::move(next));
  }

  // Declares what a real IPU does for the stage added last, for the modeled clock
  // (StreamResult::modeled; see bspflow/devices/device_model.hpp): `per_item` for each
  // request it runs on (a batch stage: each item of the padded batch), `per_call` once per
  // call. A stage left undeclared costs nothing in modeled time and is counted in
  // ModeledTime::undeclared. Throws bspflow::Error if no stage was added yet.
  StreamBuilder cost(Work per_item, Work per_call = {}) && {
    if (core_->stage_names.empty()) throw Error("StreamBuilder::cost: add a stage first");
    core_->stage_costs.resize(core_->stage_names.size());
    core_->stage_costs.back() = std::pair{per_item, per_call};
    return std::move(*this);
  }

  // Adds a batch stage on the next device: `f` takes a std::span<Cur> (as many requests as
  // waiting, up to config.max_batch, padded to an allowed size) and returns a std::vector of
  // one output (or ItemResult) per element, at least as many as requests.
  template <class F>
  auto batch_stage(std::string name, F f, BatchConfig config = {}) && {
    const std::uint32_t device = next_device();
    return std::move(*this).batch_stage(std::move(name), std::move(f), std::move(config), device);
  }
  // Adds a batch stage on device `device` (within a replica), which must be a device no
  // earlier stage uses: a batch stage starts its device's run of stages.
  template <class F>
  auto batch_stage(std::string name, F f, BatchConfig config, std::uint32_t device) && {
    static_assert(std::is_move_constructible_v<F>, "a batch stage must be movable");
    static_assert(std::is_invocable_v<F&, std::span<Cur>>,
                  "a batch stage must be callable with a std::span of the previous stage's output");
    using Vec = std::decay_t<std::invoke_result_t<F&, std::span<Cur>>>;
    using Elem = typename Vec::value_type;
    static_assert(std::is_same_v<Vec, std::vector<Elem>>,
                  "a batch stage must return a std::vector (one output or ItemResult per request)");
    using Next = typename detail::BatchElement<Elem>::type;
    static_assert(std::is_move_constructible_v<Next> && std::is_move_assignable_v<Next>,
                  "a batch stage's output type must be movable");
    config.validate();
    if (!config.allowed_sizes.empty() && !std::is_default_constructible_v<Cur>) {
      throw Error("batch stage '" + name +
                  "': allowed_sizes pads batches with default-constructed inputs, and this "
                  "stage's input type is not default-constructible");
    }
    if (!core_->stage_devices.empty() && device == core_->stage_devices.back()) {
      throw Error("batch stage '" + name + "' on device " + std::to_string(device) +
                  ": a batch stage must be the first stage on its device, and stage '" +
                  core_->stage_names.back() + "' is already there; put it on a later device");
    }
    const std::uint32_t k = add_stage(name, device, true);
    core_->max_batch = std::max(core_->max_batch, config.max_batch);
    std::vector<typename StreamBuilder<In, Next>::Lane> next(lanes_.size());
    for (std::uint32_t r = 0; r < lanes_.size(); ++r) {
      auto head = std::make_unique<detail::BatchHead<Cur, Elem, F>>(copy_for(f, r, name), config);
      head->stage = k;
      head->name = core_->stage_names[k];
      head->device_id = core_->devices[core_->device_of(r, device)].id();
      next[r].source = begin_segment(lanes_[r], r, k);
      next[r].batch = std::move(head);
      next[r].fn = [](void* x, detail::StageCtx&) -> Next {
        return std::move(*static_cast<Next*>(x));
      };
      next[r].first = k;
    }
    return StreamBuilder<In, Next>(std::move(core_), std::move(intake_), std::move(sources_),
                                   std::move(next));
  }

  // The stream. Throws bspflow::Error without stages.
  Stream<In, Cur> build() && {
    if (lanes_.empty() || !lanes_.front().fn) {
      throw Error("StreamBuilder::build: a stream needs at least one stage");
    }
    auto responder = std::make_unique<detail::Responder<Cur>>(*core_);
    std::vector<detail::LastSink<Cur>*> sinks;
    const auto last = static_cast<std::uint32_t>(core_->stage_names.size() - 1);
    for (std::uint32_t r = 0; r < lanes_.size(); ++r) {
      auto sink = std::make_shared<detail::LastSink<Cur>>(*responder);
      sinks.push_back(sink.get());
      close_segment(lanes_[r], *sink, r, last);
      core_->owned.push_back(std::move(sink));
    }
    core_->finish_build();
    return Stream<In, Cur>(std::move(core_), std::move(intake_), std::move(responder),
                           std::move(sources_), std::move(sinks));
  }

 private:
  template <class, class>
  friend class StreamBuilder;
  StreamBuilder(std::unique_ptr<detail::StreamCore> core,
                std::shared_ptr<detail::Intake<In>> intake,
                std::vector<detail::FirstSource<In>*> sources, std::vector<Lane> lanes)
      : core_(std::move(core)), intake_(std::move(intake)), sources_(std::move(sources)),
        lanes_(std::move(lanes)) {}

  std::uint32_t next_device() const {
    return core_->stage_devices.empty() ? 0 : core_->stage_devices.back() + 1;
  }

  // Checks stage k's placement and records it; returns k.
  std::uint32_t add_stage(const std::string& name, std::uint32_t device, bool batched) {
    if (device >= core_->per_replica) {
      detail::throw_bad_value(
          "stage '" + name + "' device", device,
          core_->replicas > 1
              ? "must be below the " + std::to_string(core_->per_replica) +
                    " device(s) of each replica"
              : "must be below the stream's " + std::to_string(core_->per_replica) + " device(s)");
    }
    if (!core_->stage_devices.empty() && device < core_->stage_devices.back()) {
      throw Error("stage '" + name + "' on device " + std::to_string(device) +
                  " comes after stage '" + core_->stage_names.back() + "' on device " +
                  std::to_string(core_->stage_devices.back()) +
                  ": stages go on the same device as the previous one or a later one");
    }
    core_->stage_names.push_back(name);
    core_->stage_devices.push_back(device);
    core_->stage_batched.push_back(batched);
    return static_cast<std::uint32_t>(core_->stage_names.size() - 1);
  }

  // Replica r's copy of a stage (the last replica takes the original).
  template <class F>
  F copy_for(F& f, std::uint32_t r, const std::string& name) const {
    if (r + 1 == lanes_.size()) return std::move(f);
    if constexpr (std::is_copy_constructible_v<F>) {
      return f;
    } else {
      throw Error("stage '" + name + "' is move-only, and each of the " +
                  std::to_string(lanes_.size()) +
                  " replicas needs its own copy: make it copyable (e.g. hold its state in a "
                  "std::shared_ptr) or use replicas = 1");
    }
  }

  // Replica r's chain gets a new segment at stage k: the one so far (if any) ends in a ring
  // to it. Returns where the new segment reads.
  detail::Source* begin_segment(Lane& lane, std::uint32_t r, std::uint32_t k) {
    if (!lane.fn) return lane.source;  // the first stage reads the stream's feed
    auto ring = std::make_shared<SpscRing<detail::Envelope<Cur>>>(core_->config.hop_capacity);
    auto sink = std::make_shared<detail::RingSink<Cur>>(*ring);
    auto source = std::make_shared<detail::RingSource<Cur>>(*ring);
    close_segment(lane, *sink, r, k - 1);
    core_->ring_wakes.push_back([q = ring.get()] { q->wake(); });
    core_->ring_resets.push_back([q = ring.get()] { q->reset(); });
    core_->ring_depths[r].push_back([q = ring.get()] { return q->size(); });
    core_->ring_cancels.push_back([q = ring.get(), core = core_.get(), k, r](detail::Answerer& a) {
      while (detail::Envelope<Cur>* e = q->try_front()) {
        auto error = e->error;
        if (!error) {
          error = detail::make_request_error(
              ErrorKind::kCancelled, e->meta, k, core->stage_names[k],
              core->devices[core->device_of(r, core->stage_devices[k])].id(),
              "was not run: the stream was cancelled");
        }
        a.answer_error(e->meta, std::move(error));
        q->pop();
      }
    });
    detail::Source* where = source.get();
    core_->owned.push_back(std::move(ring));
    core_->owned.push_back(std::move(sink));
    core_->owned.push_back(std::move(source));
    return where;
  }

  // Replica r's current segment (stages lane.first..end) ends in `sink`.
  void close_segment(Lane& lane, detail::Sink<Cur>& sink, std::uint32_t r, std::uint32_t end) {
    auto seg = std::make_unique<detail::Segment<Cur>>(*lane.source, sink, std::move(lane.fn),
                                                      std::move(lane.batch));
    seg->replica = r;
    seg->device_index = core_->device_of(r, core_->stage_devices[lane.first]);
    seg->first_stage = lane.first;
    seg->last_stage = end;
    for (std::uint32_t s = lane.first; s <= end; ++s) {
      seg->names.push_back(core_->stage_names[s]);
      seg->devices.push_back(core_->devices[core_->device_of(r, core_->stage_devices[s])].id());
    }
    core_->segments.push_back(std::move(seg));
  }

  std::unique_ptr<detail::StreamCore> core_;
  std::shared_ptr<detail::Intake<In>> intake_;
  std::vector<detail::FirstSource<In>*> sources_;
  std::vector<Lane> lanes_;
};

}  // namespace bspflow
