// Internal to streams (installed because the stream templates use it): the untyped part of a
// Stream. Its graph (nodes and where each runs), each replica's runtime (meters, models,
// version cells, hops), the segments, the run in progress with its stall monitor, stats,
// and the untyped half of a swap.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "bspflow/devices/device.hpp"
#include "bspflow/run/internal/cancel_gate.hpp"
#include "bspflow/stream/detail/stage_loop.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"
#include "bspflow/stream/stream_swap.hpp"

namespace bspflow::detail {

enum class NodeKind : std::uint8_t {
  kInput,
  kStage,
  kBatch,
  kJoin,
  kRoute,
  kBranch,
  kMerge,
  kGenerate,
};
inline constexpr std::uint32_t kNoIndex = ~std::uint32_t{0};

// One node of the graph, as the builder declared it.
struct NodeSpec {
  std::string name;
  NodeKind kind = NodeKind::kStage;
  std::uint32_t device = 0;              // within a replica
  std::vector<std::uint32_t> inputs;     // node ids, in the callable's order
  std::vector<std::uint32_t> consumers;  // node ids reading it (once each)
  std::uint32_t index = kNoIndex;        // its stage index (stats, errors); none: input, branch
  std::optional<std::pair<Work, Work>> cost;  // declared work (per item, per call)
  std::size_t memory = 0;  // bytes each version holds on its device (swaps count it)
  const std::type_info* in_type = nullptr;     // a stage's input, a batch stage's element
  const std::type_info* out_type = nullptr;    // a stage's output, a batch stage's Elem
  const std::type_info* state_type = nullptr;  // a generate stage's state entry
  std::uint32_t branch = 0;                    // kBranch: which branch of its route
  bool routed = false;  // reached through a route's branch (only some requests run it)

  // A node as a builder verb declares it: what it is, where it runs, what it reads, and the
  // types a stage or batch stage takes and gives (null: not a stage). Allocates.
  static NodeSpec of(std::string name, NodeKind kind, std::uint32_t device,
                     std::vector<std::uint32_t> inputs, const std::type_info* in_type = nullptr,
                     const std::type_info* out_type = nullptr) {
    NodeSpec s;
    s.name = std::move(name);
    s.kind = kind;
    s.device = device;
    s.inputs = std::move(inputs);
    s.in_type = in_type;
    s.out_type = out_type;
    return s;
  }
};

// The admission queue, untyped: what the core needs of it.
class AdmissionQueueBase {
 public:
  virtual ~AdmissionQueueBase() = default;
  // Host thread: takes pushes (start) / refuses them (close, the end of the run).
  virtual void open() = 0;
  virtual void close() noexcept = 0;
  // After a stopped run: answers every queued request kCancelled.
  virtual void cancel_all(ResponderBase& responder_base) = 0;
  virtual void wake() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual std::size_t size_of(std::uint32_t priority) const = 0;
  virtual std::uint32_t blocked_of(std::uint32_t priority) const noexcept = 0;   // kBlock pushes
  virtual std::uint64_t accepted() const noexcept = 0;                           // this run
  virtual std::uint64_t accepted_of(std::uint32_t priority) const noexcept = 0;  // since built
  virtual std::uint64_t refused(std::uint32_t priority, Refusal r) const noexcept = 0;
};

// One replica's runtime, by node id.
struct ReplicaRun {
  std::vector<NodeRun> nodes;
  std::vector<std::unique_ptr<StageMeter>> meters;  // null where none (input, branches)
  std::vector<StageModel> models;
  std::vector<VersionCell*> cells;               // stages and batch stages, else null
  std::vector<const GenerateMeter*> generation;  // generate stages' meters, else null
  std::vector<void*> memory;              // the current version's allocation on its device, or null
  std::vector<std::size_t> memory_bytes;  // its size
  std::vector<std::unique_ptr<HopBase>> hops;               // the hops between its segments
  std::vector<std::function<void(ResponderBase&)>> sweeps;  // a stopped run: answer what hops hold
  // Every version alive, with its node id: the current ones, and during a swap the old.
  std::vector<std::pair<std::uint32_t, std::unique_ptr<Versioned>>> versions;
};

class StreamCore {
 public:
  StreamCore(DeviceList devices, StreamConfig config);
  ~StreamCore();
  DeviceList devices;
  StreamConfig config;
  std::uint32_t replicas = 1;
  std::uint32_t per_replica = 1;     // devices per replica
  std::vector<NodeSpec> nodes;       // the graph; 0 is the input
  std::uint32_t output = 0;          // the output node
  std::vector<std::uint32_t> named;  // node ids by stage index
  std::vector<std::unique_ptr<ReplicaMeter>> replica_meters;
  std::vector<ReplicaRun> runs;  // by replica
  std::vector<std::unique_ptr<Segment>> segments;
  std::vector<std::shared_ptr<void>> owned;  // typed objects the segments use
  AdmissionQueueBase* admission = nullptr;
  ResponderBase* responder_base = nullptr;
  bool streaming = false;  // a generate stage answers with partial responses
  bool timing() const noexcept {
    return config.stats || config.call_stall_limit > std::chrono::nanoseconds::zero();
  }

  // The device (in `devices`) of replica r's device d.
  std::uint32_t device_of(std::uint32_t replica, std::uint32_t d) const noexcept {
    return replica * per_replica + d;
  }
  // Whether replica r's devices a and b are pinned to one core.
  bool share_core(std::uint32_t replica, std::uint32_t a, std::uint32_t b) const;
  const std::string& node_name(std::uint32_t index) const { return nodes[named.at(index)].name; }
  // Setup, once the segments are built: logs replicas sharing cores.
  void finish_build();
  // The wait policy device `index` of the list uses (capped when it shares its core).
  WaitPolicy policy_for(std::uint32_t index) const;

  // Host thread, first thing in every Stream::start: from here until wait_segments()
  // returns, cancel() and `stop` stop this run, whether its devices have started or not. A
  // start that throws calls close_run().
  void open_run(std::stop_token stop);
  void close_run() noexcept;
  // Host thread, after open_run(): starts one job per segment; `wake_admission` ends admission
  // on a stop. A stop already requested cancels the run before any segment starts.
  void start(std::function<void()> wake_admission);
  // Host thread: blocks until the run ends; a stopped run's requests answered. Closes the
  // run (see open_run).
  void wait_segments();
  // Any thread: stops the run in progress, if any. Never blocks for long, never throws.
  void cancel() noexcept;
  bool running() const noexcept { return running_; }
  // Host thread, the run over: its result from what the ends counted.
  StreamResult finish(std::uint64_t accepted, std::uint64_t answered, std::uint64_t errors,
                      std::uint64_t refused_before);
  std::uint64_t refused_total() const noexcept;
  StreamStats stats() const;

  // Estimates for admission, from the nodes' measured calls (0 until measured): the
  // bottleneck's time per request while requests queue up, and a request's own path once
  // taken (one call of each node, plus the rest of a call in progress).
  std::int64_t per_request_ns() const noexcept;
  std::int64_t path_ns() const noexcept;
  std::uint32_t live_replicas() const noexcept;
  // Replicas in rotation: not failed, not ejected (outlier ejection keeps at least one).
  std::uint32_t rotation() const noexcept;
  void log_ejection(std::uint32_t replica, std::chrono::nanoseconds out) const;

  // The untyped half of Stream::swap(): `fresh` holds the new version for each replica,
  // warmed; `memory` the bytes it holds on its device. Blocks until every replica runs it,
  // the swap is refused (memory) or `stop` cancels it.
  SwapResult swap(std::uint32_t node, std::vector<std::unique_ptr<Versioned>> fresh,
                  std::size_t memory, const std::stop_token& stop);
  std::uint32_t next_version() noexcept { return next_version_.fetch_add(1); }
  // The node a swap names, checked (a stage or a batch stage); throws Error otherwise.
  std::uint32_t swappable(std::string_view name) const;

 private:
  void monitor_loop(std::chrono::nanoseconds limit);
  // Closes admission; after a stop, answers kCancelled what is still queued or between
  // devices. Run by the last segment to end (and again by the host's wait_segments()).
  void answer_leftovers();
  std::shared_ptr<StreamRunState> state_;
  std::chrono::steady_clock::time_point started_;
  bool running_ = false;
  std::thread monitor_;
  std::mutex monitor_mutex_;
  std::condition_variable monitor_cv_;
  bool monitor_stop_ = false;
  std::atomic<std::uint32_t> next_version_{2};  // versions at build are 1
  std::mutex swap_mutex_;                       // one swap at a time
  mutable std::mutex versions_mutex_;           // runs[].versions (stats read them)
  // cancel() and the caller's std::stop_token, from open_run() to the end of wait_segments().
  struct CancelStream {
    std::shared_ptr<StreamRunState> state;
    void operator()() const noexcept { state->cancel(); }
  };
  CancelGate gate_;
  std::optional<CancelGate::Scope> scope_;
  std::optional<std::stop_callback<CancelStream>> on_stop_;  // watches scope_'s token
};

}  // namespace bspflow::detail
