/// @file
/// StreamGraph: a stream whose stages form a directed acyclic graph: fan-out (a node read by
/// several), join (a node that combines several, typed), route (a node that sends each
/// request down one of its branches) and merge (the branch a route chose). Include
/// `<bspflow/stream/stream.hpp>`, which defines the Stream it builds. Guide:
/// runtime/stream/README.md.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/stream/detail/graph_wiring.hpp"
#include "bspflow/stream/generate.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow {

template <class In, class Out>
class Stream;
template <class In>
class StreamGraph;

/// A node of a StreamGraph being built: the value type T it gives its readers. A handle: cheap
/// to copy; valid while its StreamGraph is. Each call adds a node on a device of each replica
/// (a device index within the replica) and returns it. Nodes only read nodes made before
/// them, so a graph has no cycle.
/// Contract of every member: host; non-blocking; allocates; throws Error (a bad device or
/// name, a graph already built, a callable that cannot be copied for each replica).
template <class T>
class Node {
 public:
  /// The value the node gives its readers.
  using value_type = T;
  /// A stage reading this node: `f(T&&)` returns its value. On this node's device (no
  /// hand-off), or on `device`.
  template <class F>
  auto stage(std::string name, F f) const {
    return stage(std::move(name), std::move(f), device());
  }
  /// The same stage on `device` of each replica (a hand-off when it is not this node's).
  template <class F>
  auto stage(std::string name, F f, std::uint32_t device) const {
    static_assert(std::is_move_constructible_v<F>, "a stream stage must be movable");
    static_assert(std::is_invocable_v<F&, T&&>,
                  "a stream stage must be callable with its input node's value (an rvalue)");
    using Y = std::decay_t<std::invoke_result_t<F&, T&&>>;
    static_assert(!std::is_void_v<Y>, "a stream stage must return its output");
    static_assert(std::is_move_constructible_v<Y> && std::is_move_assignable_v<Y>,
                  "a stream stage's output type must be movable");
    g_->check_node(g_, id_, "stage '" + name + "'");
    copyable_or_throw<F>(name);
    detail::NodeSpec spec = detail::NodeSpec::of(std::move(name), detail::NodeKind::kStage, device,
                                                 {id_}, &typeid(T), &typeid(Y));
    auto fp = std::make_shared<F>(std::move(f));
    const std::uint32_t id = static_cast<std::uint32_t>(g_->core->nodes.size());
    const std::uint32_t replicas = g_->core->replicas;
    detail::OpMaker make = [fp, id, replicas](const std::vector<detail::SlotBase*>& ins,
                                              const std::vector<detail::SlotBase*>& outs,
                                              const detail::NodeRun& node, std::uint32_t r,
                                              detail::ReplicaRun& run) {
      auto op = std::make_unique<detail::StageOp<T, Y>>(
          static_cast<detail::Slot<T>&>(*ins[0]), static_cast<detail::Slot<Y>&>(*outs[0]), node);
      auto v = std::make_unique<detail::StageFnOf<T, Y, F>>(
          detail::GraphBuild::copy_for(*fp, r, replicas));
      op->cell.current.store(v.get());
      run.cells[id] = &op->cell;
      run.versions.emplace_back(id, std::move(v));
      return op;
    };
    return Node<Y>(
        g_, g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<Y>>(), std::move(make)));
  }

  /// A batch stage reading this node, on `device` (where it must be the first stage, and
  /// this node's only reader on that device; readers on other devices get their own copy, and
  /// the stream's input takes a stage before any fan-out): `f(std::span<T>)` takes as many
  /// requests as are waiting, up to config.max_batch (padded to an allowed size), and returns
  /// a std::vector of one output (or ItemResult) per element, at least as many as requests.
  template <class F>
  auto batch_stage(std::string name, F f, BatchConfig config, std::uint32_t device) const {
    static_assert(std::is_move_constructible_v<F>, "a batch stage must be movable");
    static_assert(std::is_invocable_v<F&, std::span<T>>,
                  "a batch stage must be callable with a std::span of its input node's value");
    using Vec = std::decay_t<std::invoke_result_t<F&, std::span<T>>>;
    using Elem = typename Vec::value_type;
    static_assert(std::is_same_v<Vec, std::vector<Elem>>,
                  "a batch stage must return a std::vector (one output or ItemResult per request)");
    using Y = typename detail::BatchElement<Elem>::type;
    static_assert(std::is_move_constructible_v<Y> && std::is_move_assignable_v<Y>,
                  "a batch stage's output type must be movable");
    g_->check_node(g_, id_, "batch stage '" + name + "'");
    config.validate();
    if (!config.allowed_sizes.empty() && !std::is_default_constructible_v<T>) {
      throw Error("batch stage '" + name +
                  "': allowed_sizes pads batches with default-constructed inputs, and this "
                  "stage's input type is not default-constructible");
    }
    copyable_or_throw<F>(name);
    detail::NodeSpec spec = detail::NodeSpec::of(std::move(name), detail::NodeKind::kBatch, device,
                                                 {id_}, &typeid(T), &typeid(Elem));
    auto fp = std::make_shared<F>(std::move(f));
    const std::uint32_t id = static_cast<std::uint32_t>(g_->core->nodes.size());
    const std::uint32_t replicas = g_->core->replicas;
    detail::BatchMaker make = [fp, id, replicas, config](detail::SlotBase& out,
                                                         const detail::NodeRun&, std::uint32_t r,
                                                         detail::ReplicaRun& run) {
      auto head =
          std::make_unique<detail::BatchHead<T, Elem>>(config, static_cast<detail::Slot<Y>&>(out));
      auto v = std::make_unique<detail::BatchFnOf<T, Elem, F>>(
          detail::GraphBuild::copy_for(*fp, r, replicas));
      head->cell.current.store(v.get());
      run.versions.emplace_back(id, std::move(v));
      return head;
    };
    return Node<Y>(g_, g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<Y>>(), {},
                               std::move(make)));
  }

  /// A generate stage reading this node, on `device` (where it must be the first stage, and
  /// this node's only reader): it answers each request with one response per iteration
  /// (partial responses, then a final one). `f(std::span<Generation<T, E>>)` runs one
  /// iteration for the active set and returns a std::vector of one StepOutput per sequence,
  /// in order. E is the type of an entry of a sequence's paged state (trivially copyable;
  /// std::byte by default). Nodes after it run once per output; the stream's output must
  /// follow it. See GenerateConfig, and the guide's "Generative serving".
  template <class E = std::byte, class F>
  auto generate_stage(std::string name, F f, GenerateConfig config, std::uint32_t device) const {
    return generate_stage_with<E>(std::move(name), std::move(f), config, device, {});
  }
  /// The same, with `length(const T&)`, each request's own bound on its iterations (as an
  /// API's max_tokens; clamped to 1..GenerateConfig::max_length): its output at that
  /// iteration is final, MemoryPolicy::kReserve reserves that many iterations' blocks, and a
  /// request that needs more blocks than the stage's whole pool could never run. When this
  /// node is the stream's input, such a request is refused at push (Refusal::kTooLarge,
  /// Submission::reason); behind other nodes it ends ErrorKind::kStageFailed, saying so.
  /// `length` is copied for the push and for each replica, and called on the client's
  /// thread and the device's.
  template <class E = std::byte, class F, class L>
  requires std::is_invocable_r_v<std::uint32_t, L&, const T&>
  auto generate_stage(std::string name, F f, GenerateConfig config, std::uint32_t device,
                      L length) const {
    static_assert(std::is_copy_constructible_v<L>, "a length function must be copyable");
    return generate_stage_with<E>(std::move(name), std::move(f), config, device,
                                  std::function<std::uint32_t(const T&)>(std::move(length)));
  }

 private:
  template <class E, class F>
  auto generate_stage_with(std::string name, F f, GenerateConfig config, std::uint32_t device,
                           std::function<std::uint32_t(const T&)> length) const {
    static_assert(std::is_move_constructible_v<F>, "a generate stage must be movable");
    static_assert(std::is_invocable_v<F&, std::span<Generation<T, E>>>,
                  "a generate stage must be callable with a std::span<bspflow::Generation<In, E>> "
                  "(the active set); name the state entry type: generate_stage<E>(...)");
    using Vec = std::decay_t<std::invoke_result_t<F&, std::span<Generation<T, E>>>>;
    using Elem = typename Vec::value_type;
    using Y = typename Elem::value_type;
    static_assert(std::is_same_v<Vec, std::vector<StepOutput<Y>>>,
                  "a generate stage must return a std::vector<bspflow::StepOutput<Out>> (one "
                  "per active sequence)");
    static_assert(std::is_move_constructible_v<Y> && std::is_move_assignable_v<Y>,
                  "a generate stage's output type must be movable");
    g_->check_node(g_, id_, "generate stage '" + name + "'");
    config.validate(sizeof(E));
    if constexpr (!detail::JoinableOutput<Y>) {
      if (config.stream_every > 1) {
        throw Error("generate stage '" + name + "': GenerateConfig::stream_every is " +
                    std::to_string(config.stream_every) +
                    ", which joins that many outputs into one response, but the step's output "
                    "type cannot be appended to: return a container with insert(end(), first, "
                    "last) (std::string, std::vector), or set stream_every to 1");
      }
    }
    copyable_or_throw<F>(name);
    detail::NodeSpec spec = detail::NodeSpec::of(name, detail::NodeKind::kGenerate, device, {id_},
                                                 &typeid(T), &typeid(Elem));
    spec.state_type = &typeid(E);
    auto fp = std::make_shared<F>(std::move(f));
    const std::uint32_t id = static_cast<std::uint32_t>(g_->core->nodes.size());
    const std::uint32_t replicas = g_->core->replicas;
    if (length && g_->core->nodes[id_].kind == detail::NodeKind::kInput) {
      // Refused at push: the request's value is the stream's input.
      detail::StreamCore* core = g_->core.get();
      const std::size_t pool = config.pool_blocks(sizeof(E));
      g_->input_size.pool = pool;
      g_->input_size.need = [length, config](const void* v) {
        const std::uint32_t n = length(*static_cast<const T*>(v));
        return config.blocks_for(std::clamp<std::uint32_t>(n, 1, config.max_length));
      };
      g_->input_size.describe = [length, config, pool, core, device](const void* v, std::size_t) {
        const Arena& arena = core->devices[core->device_of(0, device)].arena();
        const std::uint32_t n =
            std::clamp<std::uint32_t>(length(*static_cast<const T*>(v)), 1, config.max_length);
        return detail::too_large(config, n, pool, arena.owner() + "'s arena: " + arena.report());
      };
    }
    detail::GenerateMaker make = [fp, id, replicas, config, name, length](
                                     detail::SlotBase& out, const detail::NodeRun&, std::uint32_t r,
                                     detail::ReplicaRun& run, Arena& arena) {
      auto head = std::make_unique<detail::GenerateHead<T, E, Y>>(
          config, static_cast<detail::Slot<Y>&>(out), arena,
          "generate stage '" + name + "' state blocks (replica " + std::to_string(r) + ")", length);
      auto v = std::make_unique<detail::GenerateFnOf<T, E, Y, F>>(
          detail::GraphBuild::copy_for(*fp, r, replicas));
      head->cell.current.store(v.get());
      run.versions.emplace_back(id, std::move(v));
      return head;
    };
    return Node<Y>(g_, g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<Y>>(), {}, {},
                               std::move(make)));
  }

 public:
  /// A route reading this node, on its device: `choose(const T&)` returns the branch
  /// (0..K-1) each request takes; the request goes on down that branch only. Returns the K
  /// branches (nodes of type T), each to be read by a stage; merge their ends again.
  template <std::size_t K, class C>
  std::array<Node<T>, K> route(std::string name, C choose) const {
    static_assert(K >= 2, "a route needs at least two branches");
    static_assert(std::is_invocable_v<C&, const T&>,
                  "a route's chooser must be callable with a const reference to the value");
    static_assert(std::is_convertible_v<std::invoke_result_t<C&, const T&>, std::size_t>,
                  "a route's chooser must return the branch's index");
    g_->check_node(g_, id_, "route '" + name + "'");
    copyable_or_throw<C>(name);
    detail::NodeSpec spec = detail::NodeSpec::of(name, detail::NodeKind::kRoute, device(), {id_});
    auto cp = std::make_shared<C>(std::move(choose));
    const std::uint32_t replicas = g_->core->replicas;
    detail::OpMaker make = [cp, replicas](const std::vector<detail::SlotBase*>& ins,
                                          const std::vector<detail::SlotBase*>& outs,
                                          const detail::NodeRun& node, std::uint32_t r,
                                          detail::ReplicaRun&) {
      std::vector<detail::Slot<T>*> branches;
      for (detail::SlotBase* o : outs) branches.push_back(static_cast<detail::Slot<T>*>(o));
      return std::make_unique<detail::RouteOp<T, C>>(detail::GraphBuild::copy_for(*cp, r, replicas),
                                                     static_cast<detail::Slot<T>&>(*ins[0]),
                                                     std::move(branches), node);
    };
    const std::uint32_t route =
        g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<T>>(), std::move(make));
    std::array<Node<T>, K> out;
    for (std::size_t i = 0; i < K; ++i) {
      detail::NodeSpec b = detail::NodeSpec::of(name + "[" + std::to_string(i) + "]",
                                                detail::NodeKind::kBranch, device(), {route});
      b.branch = static_cast<std::uint32_t>(i);
      out[i] = Node<T>(g_, g_->add(std::move(b), std::make_unique<detail::NodeTypeOf<T>>()));
    }
    return out;
  }

  /// Declares what a real IPU does for this node (a stage, batch stage or join), for the
  /// modeled clock: `per_item` for each request (a batch stage: each item of the padded
  /// batch), `per_call` once per call. Returns this node.
  Node cost(Work per_item, Work per_call = {}) const {
    g_->check_node(g_, id_, "cost");
    g_->core->nodes[id_].cost = std::pair{per_item, per_call};
    return *this;
  }
  /// Declares the bytes this node's callable holds on its device (a model's weights): taken
  /// from each replica's device arena at build (OutOfMemoryError if it does not fit), and
  /// counted when Stream::swap() brings a new version. Returns this node.
  Node memory(std::size_t bytes) const {
    g_->check_node(g_, id_, "memory");
    g_->core->nodes[id_].memory = bytes;
    return *this;
  }

  /// The node's name. Throws Error once the graph is built.
  const std::string& name() const { return spec().name; }
  /// The node's device within a replica. Throws Error once the graph is built.
  std::uint32_t device() const { return spec().device; }

  /// An empty handle (no node); only to be assigned.
  Node() = default;

 private:
  template <class>
  friend class Node;
  template <class>
  friend class StreamGraph;
  template <class, class>
  friend class StreamBuilder;
  Node(detail::GraphBuild* g, std::uint32_t id) : g_(g), id_(id) {}
  const detail::NodeSpec& spec() const {
    if (g_ == nullptr || !g_->core) throw Error("StreamGraph: the graph was built already");
    return g_->core->nodes.at(id_);
  }
  template <class F>
  void copyable_or_throw(const std::string& name) const {
    if (g_->core->replicas > 1 && !std::is_copy_constructible_v<F>) {
      throw Error("node '" + name + "' is move-only, and each of the " +
                  std::to_string(g_->core->replicas) +
                  " replicas needs its own copy: make it copyable (e.g. hold its state in a "
                  "std::shared_ptr) or use replicas = 1");
    }
  }
  detail::GraphBuild* g_ = nullptr;
  std::uint32_t id_ = 0;
};

/// Builds a stream graph. `devices`: the devices its nodes may be placed on (a Device, a
/// DeviceGroup or a DeviceList); with config.replicas = R, replica r uses devices
/// r*D/R .. (r+1)*D/R - 1, and a node's device counts within its replica. They must outlive
/// the Stream.
///   StreamGraph<Image> g(devices);
///   auto pre = g.input().stage("pre", preprocess);          // device 0
///   auto a = pre.stage("a", model_a, 1), b = pre.stage("b", model_b, 2);
///   auto out = g.join("vote", vote, 3, a, b);               // vote(A&&, B&&)
///   Stream<Image, Answer> stream = std::move(g).build(out);
/// Contract of every member: host; non-blocking; allocates; throws Error.
template <class In>
class StreamGraph {
 public:
  /// A graph holding its input node (on device 0), for a stream on `devices` shaped by
  /// `config`. Throws Error for a config StreamConfig::validate() refuses.
  explicit StreamGraph(DeviceList devices, StreamConfig config = {})
      : g_(std::make_unique<detail::GraphBuild>(devices, std::move(config))) {
    g_->add(detail::NodeSpec::of("input", detail::NodeKind::kInput, 0, {}),
            std::make_unique<detail::NodeTypeOf<In>>());
  }
  /// Takes over the graph being built; the source is left with none.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  StreamGraph(StreamGraph&&) noexcept = default;
  /// As the move constructor, dropping the graph this one was building.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  StreamGraph& operator=(StreamGraph&&) noexcept = default;

  /// The requests, as pushed by the StreamClients. Its device is its first reader's.
  Node<In> input() const { return Node<In>(g_.get(), 0); }

  /// A join on `device`: `f(Ts&&...)` combines the inputs' values for one request and returns
  /// its value. Its inputs must be reached by the same requests: a join may sit inside one
  /// branch of a route, or after the route's merge, but not take a branch beside a node that
  /// every request reaches (build() refuses it, naming the join).
  template <class F, class... Ts>
  // NOLINTNEXTLINE(performance-unnecessary-value-param): a sink, moved into the node
  auto join(std::string name, F f, std::uint32_t device, Node<Ts>... inputs) {
    static_assert(sizeof...(Ts) >= 2, "a join needs at least two inputs");
    static_assert(std::is_move_constructible_v<F>, "a join must be movable");
    static_assert(std::is_invocable_v<F&, Ts&&...>,
                  "a join must be callable with its inputs' values (rvalues), in order");
    using Y = std::decay_t<std::invoke_result_t<F&, Ts&&...>>;
    static_assert(!std::is_void_v<Y>, "a join must return its output");
    (g_->check_node(inputs.g_, inputs.id_, "join '" + name + "'"), ...);
    if (g_->core->replicas > 1 && !std::is_copy_constructible_v<F>) {
      throw Error("join '" + name + "' is move-only, and each replica needs its own copy");
    }
    detail::NodeSpec spec =
        detail::NodeSpec::of(std::move(name), detail::NodeKind::kJoin, device, {inputs.id_...});
    auto fp = std::make_shared<F>(std::move(f));
    const std::uint32_t replicas = g_->core->replicas;
    detail::OpMaker make = [fp, replicas](const std::vector<detail::SlotBase*>& ins,
                                          const std::vector<detail::SlotBase*>& outs,
                                          const detail::NodeRun& node, std::uint32_t r,
                                          detail::ReplicaRun&) {
      return make_join<Y, F, Ts...>(detail::GraphBuild::copy_for(*fp, r, replicas), ins, outs, node,
                                    std::index_sequence_for<Ts...>{});
    };
    return Node<Y>(g_.get(), g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<Y>>(),
                                     std::move(make)));
  }

  /// A merge on `device`: the value of whichever of `branches` ran for the request (the ends
  /// of one route's branches: each request ran exactly one of them).
  template <class T, class... Ts>
  // NOLINTNEXTLINE(performance-unnecessary-value-param): a sink, moved into the node
  Node<T> merge(std::string name, std::uint32_t device, Node<T> first, Node<Ts>... rest) {
    static_assert((std::is_same_v<T, Ts> && ...), "a merge's branches must have one type");
    static_assert(sizeof...(Ts) >= 1, "a merge needs at least two branches");
    g_->check_node(first.g_, first.id_, "merge '" + name + "'");
    (g_->check_node(rest.g_, rest.id_, "merge '" + name + "'"), ...);
    detail::NodeSpec spec = detail::NodeSpec::of(std::move(name), detail::NodeKind::kMerge, device,
                                                 {first.id_, rest.id_...});
    detail::OpMaker make = [](const std::vector<detail::SlotBase*>& ins,
                              const std::vector<detail::SlotBase*>& outs, const detail::NodeRun&,
                              std::uint32_t, detail::ReplicaRun&) {
      std::vector<detail::Slot<T>*> in;
      for (detail::SlotBase* s : ins) in.push_back(static_cast<detail::Slot<T>*>(s));
      return std::make_unique<detail::MergeOp<T>>(std::move(in),
                                                  static_cast<detail::Slot<T>&>(*outs[0]));
    };
    return Node<T>(g_.get(), g_->add(std::move(spec), std::make_unique<detail::NodeTypeOf<T>>(),
                                     std::move(make)));
  }

  /// The stream, answering each request with `output`'s value. Checks the graph: every node
  /// reaches `output`, a join's inputs and the output are reached by every request (routes
  /// merged), and each batch stage heads its device. Throws Error naming the node otherwise.
  template <class Out>
  Stream<In, Out> build(Node<Out> output) && {
    g_->check_node(output.g_, output.id_, "build");
    g_->check(output.id_);
    auto wired = detail::wire<In, Out>(*g_, output.id_);
    return Stream<In, Out>(std::move(g_->core), std::move(wired));
  }

 private:
  template <class Y, class F, class... Ts, std::size_t... I>
  static std::unique_ptr<detail::OpBase> make_join(F f, const std::vector<detail::SlotBase*>& ins,
                                                   const std::vector<detail::SlotBase*>& outs,
                                                   const detail::NodeRun& node,
                                                   std::index_sequence<I...>) {
    return std::make_unique<detail::JoinOp<Y, F, Ts...>>(
        std::move(f), static_cast<detail::Slot<Y>&>(*outs[0]), node,
        static_cast<detail::Slot<Ts>&>(*ins[I])...);
  }
  std::unique_ptr<detail::GraphBuild> g_;
};

}  // namespace bspflow
