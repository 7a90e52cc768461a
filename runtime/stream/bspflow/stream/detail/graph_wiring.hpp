// Internal to streams (installed because the stream templates use it): a graph while it is
// built (GraphBuild: the core's node table, and for each node the typed makers of its slots,
// hops and op), and the wiring that turns it into each replica's segments.
#pragma once

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/stream/detail/admission.hpp"
#include "bspflow/stream/detail/core.hpp"
#include "bspflow/stream/detail/responses.hpp"
#include "bspflow/stream/detail/sources.hpp"

namespace bspflow::detail {

// What the wiring needs of a node's value type.
class NodeType {
 public:
  virtual ~NodeType() = default;
  virtual std::unique_ptr<SlotBase> make_slot() const = 0;
  virtual std::unique_ptr<HopBase> make_hop(std::size_t capacity, std::uint32_t lanes) const = 0;
  virtual std::unique_ptr<OpBase> make_take(Incoming& incoming, SlotBase& slot) const = 0;
  virtual std::unique_ptr<OpBase> make_import(HopBase& hop, SlotBase& slot,
                                              std::string what) const = 0;
  virtual std::unique_ptr<OpBase> make_export(SlotBase& slot, HopBase& hop) const = 0;
  virtual std::unique_ptr<Source> make_source(
      HopBase& hop, const std::array<double, kPriorityClasses>& min_share) const = 0;
  // After a stopped run: answers kCancelled every request `hop` still holds.
  virtual std::function<void(ResponderBase&)> make_sweep(HopBase& hop, const NodeRun& at) const = 0;
  virtual bool copyable() const noexcept = 0;
};

template <class T>
class NodeTypeOf final : public NodeType {
 public:
  std::unique_ptr<SlotBase> make_slot() const override { return std::make_unique<Slot<T>>(); }
  std::unique_ptr<HopBase> make_hop(std::size_t capacity, std::uint32_t lanes) const override {
    return std::make_unique<Hop<T>>(capacity, lanes);
  }
  std::unique_ptr<OpBase> make_take(Incoming& incoming, SlotBase& slot) const override {
    return std::make_unique<TakeOp<T>>(incoming, static_cast<Slot<T>&>(slot));
  }
  std::unique_ptr<OpBase> make_import(HopBase& hop, SlotBase& slot,
                                      std::string what) const override {
    return std::make_unique<ImportOp<T>>(static_cast<Hop<T>&>(hop), static_cast<Slot<T>&>(slot),
                                         std::move(what));
  }
  std::unique_ptr<OpBase> make_export(SlotBase& slot, HopBase& hop) const override {
    return std::make_unique<ExportOp<T>>(static_cast<Slot<T>&>(slot), static_cast<Hop<T>&>(hop));
  }
  std::unique_ptr<Source> make_source(
      HopBase& hop, const std::array<double, kPriorityClasses>& min_share) const override {
    return std::make_unique<HopSource<T>>(static_cast<Hop<T>&>(hop), min_share);
  }
  std::function<void(ResponderBase&)> make_sweep(HopBase& hop, const NodeRun& at) const override {
    return [p = static_cast<Hop<T>*>(&hop), &at](ResponderBase& a) {
      p->sweep([&](Queued<T>& e) {
        auto error = e.error;
        if (!error) {
          error = make_request_error(ErrorKind::kCancelled, e.meta, at.index, at.name, at.device_id,
                                     "was not run: the stream was cancelled");
        }
        a.answer_error(e.meta, std::move(error));
      });
    };
  }
  bool copyable() const noexcept override { return std::is_copy_constructible_v<T>; }
};

// A node's op for one replica: from its input slots, its output slots (several for a route:
// its branches'), its NodeRun and the replica's runtime (where a versioned op's versions go).
using OpMaker = std::function<std::unique_ptr<OpBase>(
    const std::vector<SlotBase*>& ins, const std::vector<SlotBase*>& outs, const NodeRun& node,
    std::uint32_t replica, ReplicaRun& run)>;
// A batch stage's head for one replica, from its output slot.
using BatchMaker = std::function<std::unique_ptr<BatchHeadBase>(
    SlotBase& out, const NodeRun& node, std::uint32_t replica, ReplicaRun& run)>;
// A generate stage's head for one replica, from its output slot and its device's arena
// (where its block pool is taken).
using GenerateMaker = std::function<std::unique_ptr<GenerateHeadBase>(
    SlotBase& out, const NodeRun& node, std::uint32_t replica, ReplicaRun& run, Arena& arena)>;

// A graph being built.
class GraphBuild {
 public:
  GraphBuild(const DeviceList& devices, StreamConfig config)
      : core(std::make_unique<StreamCore>(devices, std::move(config))) {}
  std::unique_ptr<StreamCore> core;
  std::vector<std::unique_ptr<NodeType>> types;  // by node id
  std::vector<OpMaker> makers;                   // by node id (none: input, branches)
  std::vector<BatchMaker> batch_makers;          // by node id (batch stages)
  std::vector<BatchConfig> batch_configs;        // by node id (batch stages)
  std::vector<GenerateMaker> generate_makers;    // by node id (generate stages)
  InputSizeCheck input_size;  // a generate stage reading the input declares lengths
  bool built = false;

  // Adds a node; checks its name and device. Returns its id.
  std::uint32_t add(NodeSpec spec, std::unique_ptr<NodeType> type, OpMaker maker = {},
                    BatchMaker batch = {}, GenerateMaker generate = {});
  // Checks that node `id` may be used here (this graph's, and not built yet).
  void check_node(const GraphBuild* owner, std::uint32_t id, const std::string& where) const;
  // Checks the graph (every node reaches the output, joins and the output unconditional,
  // placement), then wires every replica's segments. `sink` makes replica r's answer sink.
  void check(std::uint32_t output);

  // Replica r's copy of a callable (the last replica takes the original).
  template <class F>
  static F copy_for(F& f, std::uint32_t r, std::uint32_t replicas) {
    if (r + 1 == replicas) return std::move(f);
    if constexpr (std::is_copy_constructible_v<F>) {
      return f;
    } else {
      throw Error("a move-only callable cannot be copied for each replica");  // checked at add
    }
  }
};

// The typed ends the wiring gives the Stream.
template <class In, class Out>
struct Wired {
  std::shared_ptr<AdmissionQueue<In>> admission;
  std::unique_ptr<Responder<Out>> responder;
  std::vector<AdmissionSource<In>*> sources;  // one per replica
  std::vector<ReplicaSink<Out>*> sinks;       // one per replica
};

// Where each node of a replica runs: the segment of each node (by device, a device fused
// into the segment that feeds it when they share a core), and each segment's device.
struct SegmentPlacement {
  std::vector<std::uint32_t> segment_of;  // by node id
  std::vector<std::uint32_t> device_of;   // by segment: the device within the replica
};
SegmentPlacement place_nodes(const StreamCore& core, std::uint32_t replica);
// The nodes whose segment would wait, mid-request, for a value computed from what that
// segment handed on for the same request (a round trip): one warning each. Such a segment
// serves one request at a time, and so does every device on the round trip. Allocates.
std::vector<std::string> round_trips(const StreamCore& core, const SegmentPlacement& pl);
// The order segment `s` runs its nodes in, whatever order they were built in: its first node
// (the lowest id) first, then, of the nodes ready to run, those that lead to another device
// (so a request leaves for it before a local branch runs), then the other local ones, then
// those that wait for another segment (as late as they can); ties in build order. Allocates.
std::vector<std::uint32_t> segment_order(const StreamCore& core, const SegmentPlacement& pl,
                                         std::uint32_t s);

// Builds every replica's segments for a checked graph whose output is node `output`.
template <class In, class Out>
Wired<In, Out> wire(GraphBuild& g, std::uint32_t output) {
  StreamCore& core = *g.core;
  Wired<In, Out> w;
  w.admission = std::make_shared<AdmissionQueue<In>>(core);
  core.admission = w.admission.get();
  if (g.input_size.need) w.admission->size_check(g.input_size);
  w.responder = std::make_unique<Responder<Out>>(core);
  core.responder_base = w.responder.get();
  const bool joins = std::any_of(core.nodes.begin(), core.nodes.end(), [](const NodeSpec& n) {
    return n.kind == NodeKind::kJoin || n.kind == NodeKind::kMerge;
  });
  const auto n_nodes = static_cast<std::uint32_t>(core.nodes.size());
  bool mid_imports = false;  // a segment waits for another in the middle of its ops
  for (std::uint32_t r = 0; r < core.replicas; ++r) {
    ReplicaRun& run = core.runs[r];
    const SegmentPlacement pl = place_nodes(core, r);
    if (r == 0) {
      for (const std::string& warning : round_trips(core, pl)) log(LogLevel::kWarning, warning);
    }
    const auto n_segs = static_cast<std::uint32_t>(pl.device_of.size());
    // The NodeRuns: names, devices, meters, models.
    run.nodes.resize(n_nodes);
    run.meters.resize(n_nodes);
    run.models.resize(n_nodes);
    run.cells.assign(n_nodes, nullptr);
    run.generation.assign(n_nodes, nullptr);
    run.memory.assign(n_nodes, nullptr);
    run.memory_bytes.assign(n_nodes, 0);
    for (std::uint32_t n = 0; n < n_nodes; ++n) {
      const NodeSpec& spec = core.nodes[n];
      NodeRun& nr = run.nodes[n];
      nr.index = spec.index;
      nr.name = spec.name;
      Device& dev = core.devices[core.device_of(r, spec.device)];
      nr.device_id = dev.id();
      if (spec.index != kNoIndex) {
        run.meters[n] = std::make_unique<StageMeter>();
        nr.meter = run.meters[n].get();
        StageModel& m = run.models[n];
        m.clock = &dev.clock();
        if (spec.cost) {
          const DeviceModel& dm = dev.config().model;
          const std::uint32_t tiles = dev.config().tiles;
          m.per_call_ns = dm.ns(dm.compute_cycles(spec.cost->second, tiles));
          m.per_item_ns =
              dm.ns(dm.compute_cycles(spec.cost->first, tiles) - dm.sync_cycles_on_chip);
          m.declared = true;
        }
        nr.model = &m;
      }
      if (spec.memory > 0) {
        run.memory_bytes[n] = spec.memory;
        run.memory[n] = dev.arena().allocate(
            spec.memory,
            "stream stage '" + spec.name + "' version 1 (replica " + std::to_string(r) + ")");
      }
    }
    // Hops between segments: one per (producer node, consumer segment).
    std::map<std::pair<std::uint32_t, std::uint32_t>, HopBase*> hop_of;
    for (std::uint32_t n = 0; n < n_nodes; ++n) {
      for (std::uint32_t c : core.nodes[n].consumers) {
        const auto key = std::pair{n, pl.segment_of[c]};
        if (pl.segment_of[c] == pl.segment_of[n] || hop_of.count(key) != 0) continue;
        run.hops.push_back(
            g.types[n]->make_hop(core.config.hop_capacity, core.config.priority_classes));
        hop_of[key] = run.hops.back().get();
        // A request swept out of this hop is answered as held at its reader.
        const std::uint32_t at = core.nodes[c].index != kNoIndex ? c : core.named.front();
        run.sweeps.push_back(g.types[n]->make_sweep(*run.hops.back(), run.nodes[at]));
      }
    }
    auto sink = std::make_shared<ReplicaSink<Out>>(*w.responder, *core.replica_meters[r], core, r);
    w.sinks.push_back(sink.get());
    core.owned.push_back(sink);
    for (std::uint32_t s = 0; s < n_segs; ++s) {
      auto seg = std::make_unique<Segment>();
      seg->replica = r;
      seg->device_index = core.device_of(r, pl.device_of[s]);
      seg->replica_meter = core.replica_meters[r].get();
      seg->responder_base = core.responder_base;
      seg->timing = core.timing();
      seg->abort_on_failure = joins;
      std::map<std::uint32_t, SlotBase*> slot;  // node id -> its slot in this segment
      std::map<std::uint32_t, std::uint32_t> readers;
      auto slot_of = [&](std::uint32_t n) -> SlotBase* {
        auto it = slot.find(n);
        if (it != slot.end()) return it->second;
        auto made = g.types[n]->make_slot();
        SlotBase* p = made.get();
        core.owned.push_back(std::shared_ptr<SlotBase>(std::move(made)));
        slot[n] = p;
        return p;
      };
      bool started = false;  // the source is chosen
      const std::vector<std::uint32_t> here = segment_order(core, pl, s);
      // The node whose queue wait the source records: the first named one in build order.
      for (std::uint32_t n = 0; n < n_nodes && seg->first == nullptr; ++n) {
        if (pl.segment_of[n] == s && core.nodes[n].index != kNoIndex) seg->first = &run.nodes[n];
      }
      for (std::uint32_t n : here) {
        const NodeSpec& spec = core.nodes[n];
        // Inputs from other segments: the first is the source, the others imports.
        for (std::uint32_t p : spec.inputs) {
          if (pl.segment_of[p] == s || slot.count(p) != 0) continue;
          HopBase& hop = *hop_of.at({p, s});
          if (!started) {
            seg->source = g.types[p]->make_source(hop, core.config.min_share);
            if (spec.kind != NodeKind::kBatch && spec.kind != NodeKind::kGenerate) {
              seg->ops.push_back(g.types[p]->make_take(seg->incoming, *slot_of(p)));
            }
            started = true;
          } else {
            mid_imports = true;
            seg->ops.push_back(g.types[p]->make_import(
                hop, *slot_of(p),
                "stage '" + spec.name + "' (input '" + core.nodes[p].name + "')"));
          }
          slot_of(p);
        }
        if (spec.kind == NodeKind::kInput) {
          auto source =
              std::make_unique<AdmissionSource<In>>(*w.admission, *core.replica_meters[r], r,
                                                    core.config.ejection.consecutive_failures > 0);
          w.sources.push_back(source.get());
          seg->source = std::move(source);
          seg->from_input = true;
          started = true;
          const NodeKind next_kind =
              spec.consumers.size() == 1 ? core.nodes[spec.consumers[0]].kind : NodeKind::kStage;
          const bool batch_next =
              (next_kind == NodeKind::kBatch || next_kind == NodeKind::kGenerate) &&
              pl.segment_of[spec.consumers[0]] == s;
          if (!batch_next) seg->ops.push_back(g.types[n]->make_take(seg->incoming, *slot_of(n)));
          slot_of(n);
        } else if (spec.kind == NodeKind::kBatch) {
          const std::uint32_t p = spec.inputs.front();
          if (!seg->ops.empty() || seg->batch) {
            throw Error("batch stage '" + spec.name + "' on device " + std::to_string(spec.device) +
                        ": a batch stage must be the first stage "
                        "on its device (it forms batches from what reaches the device); put it "
                        "on a device of its own");
          }
          for (std::uint32_t c : core.nodes[p].consumers) {
            if (c != n && (p == 0 || pl.segment_of[c] == s)) {
              throw Error("batch stage '" + spec.name + "' takes the requests of '" +
                          core.nodes[p].name + "', and so does '" + core.nodes[c].name +
                          "' on the same device: a batch stage must be the only reader of its "
                          "input there; put a stage before the fan-out");
            }
          }
          seg->batch = g.batch_makers[n](*slot_of(n), run.nodes[n], r, run);
          seg->batch->node = &run.nodes[n];
          seg->batch->origin = {};
          seg->batch->first_node = spec.inputs.front() == 0;
          run.cells[n] = &seg->batch->cell;
        } else if (spec.kind == NodeKind::kGenerate) {
          const std::uint32_t p = spec.inputs.front();
          if (!seg->ops.empty() || seg->batch || seg->generate) {
            throw Error("generate stage '" + spec.name + "' on device " +
                        std::to_string(spec.device) +
                        ": a generate stage must be the first stage on its device (it runs its "
                        "iterations there); put it on a device of its own");
          }
          for (std::uint32_t c : core.nodes[p].consumers) {
            if (c != n) {
              throw Error("generate stage '" + spec.name + "' takes the requests of '" +
                          core.nodes[p].name + "', and so does '" + core.nodes[c].name +
                          "': a generate stage must be the only reader of its input");
            }
          }
          seg->generate = g.generate_makers[n](*slot_of(n), run.nodes[n], r, run,
                                               core.devices[seg->device_index].arena());
          seg->generate->node = &run.nodes[n];
          run.cells[n] = &seg->generate->cell;
          run.generation[n] = &seg->generate->meter;
        } else if (spec.kind != NodeKind::kBranch) {
          std::vector<SlotBase*> ins, outs;
          for (std::uint32_t p : spec.inputs) {
            ins.push_back(slot_of(p));
            ++readers[p];
          }
          if (spec.kind == NodeKind::kRoute) {
            for (std::uint32_t c : spec.consumers) outs.push_back(slot_of(c));
          } else {
            outs.push_back(slot_of(n));
          }
          seg->ops.push_back(g.makers[n](ins, outs, run.nodes[n], r, run));
        }
        // Exports to the segments that read it.
        std::vector<std::uint32_t> to;
        for (std::uint32_t c : spec.consumers) {
          const std::uint32_t cs = pl.segment_of[c];
          if (cs == s || std::find(to.begin(), to.end(), cs) != to.end()) continue;
          to.push_back(cs);
          HopBase& hop = *hop_of.at({n, cs});
          seg->ops.push_back(g.types[n]->make_export(*slot_of(n), hop));
          seg->exports.push_back(&hop);
          ++readers[n];
        }
        if (n == output) {
          seg->ops.push_back(std::make_unique<OutputOp<Out>>(static_cast<Slot<Out>&>(*slot_of(n)),
                                                             *sink, run.nodes[n]));
          ++readers[n];
          seg->begin_batch = [p = sink.get()] { p->begin_batch(); };
          seg->end_batch = [p = sink.get()] { p->end_batch(); };
        }
      }
      for (auto& [n, sl] : slot) {
        const std::uint32_t k = readers.count(n) != 0 ? readers[n] : 1;
        if (k > 1 && !g.types[n]->copyable()) {
          throw Error("node '" + core.nodes[n].name + "' feeds " + std::to_string(k) +
                      " readers on one device and its value type is move-only: make it "
                      "copyable (e.g. hold it in a std::shared_ptr)");
        }
        sl->readers = std::max<std::uint32_t>(1, k);
      }
      seg->held_at = seg->first != nullptr ? seg->first : &run.nodes[core.named.front()];
      if (seg->first == nullptr) seg->first = seg->held_at;
      core.segments.push_back(std::move(seg));
    }
  }
  // Replicas that each run a generate stage place new sequences by load (GenerateBalance).
  for (std::uint32_t n = 0; n < n_nodes && core.replicas > 1; ++n) {
    if (core.nodes[n].kind != NodeKind::kGenerate) continue;
    auto balance = std::make_shared<GenerateBalance>();
    for (std::uint32_t r = 0; r < core.replicas; ++r) {
      balance->members.push_back({core.replica_meters[r].get(), core.runs[r].generation[n]});
    }
    for (AdmissionSource<In>* source : w.sources) source->balance(balance);
    break;  // a request passes through one generate stage at most: the first decides
  }
  // A chain answers a batch stage's early errors at once; a graph forwards them (every path
  // must see every request: its joins and imports take them in order).
  for (auto& seg : core.segments) seg->answer_early = !joins && !mid_imports;
  core.finish_build();
  g.built = true;
  return w;
}

}  // namespace bspflow::detail
