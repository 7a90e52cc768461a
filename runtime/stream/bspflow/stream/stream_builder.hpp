/// @file
/// StreamBuilder: builds a chain of stages, each on the next device (or one given), as a
/// StreamGraph whose nodes each read the one before. Include `<bspflow/stream/stream.hpp>`,
/// which includes this one and defines the Stream it builds. Guide: runtime/stream/README.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "bspflow/base/error.hpp"
#include "bspflow/stream/stream_graph.hpp"

namespace bspflow {

/// Builds a chain stage by stage. Use as one expression (each call consumes the builder):
/// `auto s = StreamBuilder<In>(devices, config).stage("a", fa).stage("b", fb, 0).build();`
/// Contract of every member: host; non-blocking; allocates; throws Error.
template <class In, class Cur = In>
class StreamBuilder {
 public:
  /// `devices`: the devices stages may be placed on (a Device, a DeviceGroup or a DeviceList);
  /// with config.replicas = R, replica r uses devices r*D/R .. (r+1)*D/R - 1. They must
  /// outlive the Stream. Throws Error if the config is invalid.
  explicit StreamBuilder(DeviceList devices,
                         StreamConfig config = {}) requires std::is_same_v<Cur, In>
      : graph_(std::make_shared<StreamGraph<In>>(devices, std::move(config))),
        node_(graph_->input()) {}

  /// Adds a stage on the next device (the first stage: device 0).
  template <class F>
  auto stage(std::string name, F f) && {
    const std::uint32_t device = next_device();
    return std::move(*this).stage(std::move(name), std::move(f), device);
  }
  /// Adds a stage on device `device` (within a replica): the current device (no hand-off) or
  /// a later one.
  template <class F>
  auto stage(std::string name, F f, std::uint32_t device) && {
    check_order(name, device);
    auto next = node_.stage(name, std::move(f), device);
    using Y = typename decltype(next)::value_type;
    return StreamBuilder<In, Y>(graph_, next, name, device);
  }

  /// Adds a batch stage on the next device: `f` takes a std::span<Cur> (as many requests as
  /// waiting, up to config.max_batch, padded to an allowed size) and returns a std::vector of
  /// one output (or ItemResult) per element, at least as many as requests.
  template <class F>
  auto batch_stage(std::string name, F f, BatchConfig config = {}) && {
    const std::uint32_t device = next_device();
    return std::move(*this).batch_stage(std::move(name), std::move(f), std::move(config), device);
  }
  /// Adds a batch stage on device `device` (within a replica), a device no earlier stage
  /// uses: a batch stage starts its device's run of stages.
  template <class F>
  auto batch_stage(std::string name, F f, BatchConfig config, std::uint32_t device) && {
    check_order(name, device);
    if (last_ && device == last_->second) {
      throw Error("batch stage '" + name + "' on device " + std::to_string(device) +
                  ": a batch stage must be the first stage on its device, and stage '" +
                  last_->first + "' is already there; put it on a later device");
    }
    auto next = node_.batch_stage(name, std::move(f), std::move(config), device);
    using Y = typename decltype(next)::value_type;
    return StreamBuilder<In, Y>(graph_, next, name, device);
  }

  /// Adds a generate stage on the next device: it answers each request with one response per
  /// iteration (partial responses, then a final one). `f(std::span<Generation<Cur, E>>)` runs
  /// one iteration for the active set and returns a std::vector of one StepOutput per
  /// sequence. See Node::generate_stage.
  template <class E = std::byte, class F>
  auto generate_stage(std::string name, F f, GenerateConfig config = {}) && {
    const std::uint32_t device = next_device();
    return std::move(*this).template generate_stage<E>(std::move(name), std::move(f), config,
                                                       device);
  }
  /// Adds a generate stage on device `device` (within a replica), a device no earlier stage
  /// uses: a generate stage starts its device's run of stages.
  template <class E = std::byte, class F>
  auto generate_stage(std::string name, F f, GenerateConfig config, std::uint32_t device) && {
    check_generate(name, device);
    auto next = node_.template generate_stage<E>(name, std::move(f), config, device);
    using Y = typename decltype(next)::value_type;
    return StreamBuilder<In, Y>(graph_, next, name, device);
  }
  /// Adds a generate stage on the next device whose requests bound their own length:
  /// `length(const Cur&)` (as an API's max_tokens). First in the stream, a request that
  /// could never fit its pool is refused at push (Refusal::kTooLarge). See
  /// Node::generate_stage.
  template <class E = std::byte, class F, class L>
  requires std::is_invocable_r_v<std::uint32_t, L&, const Cur&>
  auto generate_stage(std::string name, F f, GenerateConfig config, L length) && {
    const std::uint32_t device = next_device();
    return std::move(*this).template generate_stage<E>(std::move(name), std::move(f), config,
                                                       device, std::move(length));
  }
  /// The same, on device `device`.
  template <class E = std::byte, class F, class L>
  requires std::is_invocable_r_v<std::uint32_t, L&, const Cur&>
  auto generate_stage(std::string name, F f, GenerateConfig config, std::uint32_t device,
                      L length) && {
    check_generate(name, device);
    auto next =
        node_.template generate_stage<E>(name, std::move(f), config, device, std::move(length));
    using Y = typename decltype(next)::value_type;
    return StreamBuilder<In, Y>(graph_, next, name, device);
  }

  /// Declares what a real IPU does for the stage added last, for the modeled clock
  /// (StreamResult::modeled): `per_item` for each request it runs on (a batch stage: each
  /// item of the padded batch), `per_call` once per call. A stage left undeclared costs
  /// nothing in modeled time and is counted in ModeledTime::undeclared.
  StreamBuilder cost(Work per_item, Work per_call = {}) && {
    if (!last_) throw Error("StreamBuilder::cost: add a stage first");
    node_.cost(per_item, per_call);
    return std::move(*this);
  }
  /// Declares the bytes the stage added last holds on its device (Node::memory()).
  StreamBuilder memory(std::size_t bytes) && {
    if (!last_) throw Error("StreamBuilder::memory: add a stage first");
    node_.memory(bytes);
    return std::move(*this);
  }

  /// The stream. Throws Error without stages.
  Stream<In, Cur> build() && {
    if (!last_) throw Error("StreamBuilder::build: a stream needs at least one stage");
    return std::move(*graph_).build(node_);
  }

 private:
  // A generate stage goes on a device no earlier stage uses.
  void check_generate(const std::string& name, std::uint32_t device) const {
    check_order(name, device);
    if (last_ && device == last_->second) {
      throw Error("generate stage '" + name + "' on device " + std::to_string(device) +
                  ": a generate stage must be the first stage on its device, and stage '" +
                  last_->first + "' is already there; put it on a later device");
    }
  }
  template <class, class>
  friend class StreamBuilder;
  StreamBuilder(std::shared_ptr<StreamGraph<In>> graph, Node<Cur> node, const std::string& name,
                std::uint32_t device)
      : graph_(std::move(graph)), node_(node), last_(std::pair{name, device}) {}

  std::uint32_t next_device() const { return last_ ? last_->second + 1 : 0; }
  void check_order(const std::string& name, std::uint32_t device) const {
    if (last_ && device < last_->second) {
      throw Error("stage '" + name + "' on device " + std::to_string(device) +
                  " comes after stage '" + last_->first + "' on device " +
                  std::to_string(last_->second) +
                  ": stages go on the same device as the previous one or a later one");
    }
  }

  std::shared_ptr<StreamGraph<In>> graph_;
  Node<Cur> node_;
  std::optional<std::pair<std::string, std::uint32_t>> last_;  // the last stage, its device
};

}  // namespace bspflow
