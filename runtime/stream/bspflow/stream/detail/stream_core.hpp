// Internal to streams: the untyped part of a Stream (devices, config, segments, meters, the
// run in progress, its stall monitor and its result).
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
#include <utility>
#include <vector>

#include "bspflow/devices/device.hpp"
#include "bspflow/run/detail/cancel_gate.hpp"
#include "bspflow/stream/detail/stream_segment.hpp"
#include "bspflow/stream/stream_config.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow::detail {

// Where a run's requests come from and where their responses go.
enum class ServeMode {
  kInfeed,         // an InfeedQueue of Requests to an OutfeedQueue (one replica)
  kClients,        // StreamClients, each popping its own responses
  kSharedOutfeed,  // StreamClients, responses to one OutfeedQueue
};

// The StreamClients' queue, untyped: what the core needs of it.
class IntakeBase {
 public:
  virtual ~IntakeBase() = default;
  // Host thread: takes pushes (start) / refuses them (close, the end of the run).
  virtual void open() = 0;
  virtual void close() noexcept = 0;
  // Host thread, after a stopped run: answers every queued request kCancelled.
  virtual void cancel_all(Answerer& answerer, const StopFlag& stop) = 0;
  virtual void wake() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual std::uint64_t accepted() const noexcept = 0;        // this run
  virtual std::uint64_t total_accepted() const noexcept = 0;  // since the stream was built
};

// The typed ends of a run, untyped for the core.
class RunEnds {
 public:
  virtual ~RunEnds() = default;
  // Host thread, the run over: answers of this run (delivered, errors among them).
  virtual std::uint64_t delivered() const noexcept = 0;
  virtual std::uint64_t errors() const noexcept = 0;
  // Host thread, the run over: hands over what is held and lets go of the outfeed.
  virtual void finish(bool completed, const StopFlag& stop) = 0;
};

class StreamCore {
 public:
  StreamCore(DeviceList devices, StreamConfig config);
  ~StreamCore();
  DeviceList devices;
  StreamConfig config;
  std::uint32_t replicas = 1;
  std::uint32_t per_replica = 1;  // devices per replica
  std::vector<std::string> stage_names;
  std::vector<std::uint32_t> stage_devices;  // within a replica
  std::vector<bool> stage_batched;
  std::size_t max_batch = 1;  // the largest BatchConfig::max_batch
  std::vector<std::unique_ptr<SegmentBase>> segments;
  std::vector<std::shared_ptr<void>> owned;  // rings, sources, sinks
  std::vector<std::function<void()>> ring_resets, ring_wakes;
  // After a stopped StreamClient run: answers what a ring still holds.
  std::vector<std::function<void(Answerer&, const StopFlag&)>> ring_cancels;
  std::vector<std::vector<std::function<std::size_t()>>> ring_depths;  // per replica
  std::vector<std::unique_ptr<StageMeter>> stage_meters;               // replica * stages + stage
  std::vector<StageMeter*> meter_ptrs;                                 // the same
  // Declared costs by stage (StreamBuilder::cost: per item, per call), and the modeled clock's
  // view of each stage of each replica (replica * stages + stage).
  std::vector<std::optional<std::pair<Work, Work>>> stage_costs;
  std::vector<StageModel> stage_models;
  std::vector<std::unique_ptr<ReplicaMeter>> replica_meters;
  IntakeBase* intake = nullptr;
  Answerer* answerer = nullptr;
  RunEnds* ends = nullptr;
  std::array<std::atomic<std::uint64_t>, 7> refusals{};  // by Refusal (any client thread)
  bool timing() const noexcept {
    return config.stats || config.stall_limit > std::chrono::nanoseconds::zero();
  }

  // Setup: the device (in `devices`) of replica r's stage device d.
  std::uint32_t device_of(std::uint32_t replica, std::uint32_t d) const noexcept {
    return replica * per_replica + d;
  }
  // Setup: whether replica r's devices a and b are pinned to one core.
  bool share_core(std::uint32_t replica, std::uint32_t a, std::uint32_t b) const;
  // Setup, at build: the meters, given to every segment; logs shared cores.
  void finish_build();

  // The wait policy device `index` of the list uses (capped when it shares its core).
  WaitPolicy policy_for(std::uint32_t index) const;
  // Host thread, first thing in every Stream::start (after the check that no run is in
  // progress): from here until wait_segments() returns, cancel() and `stop` stop this run,
  // whether its devices have started yet or not. A start that throws calls close_run().
  void open_run(std::stop_token stop);
  void close_run() noexcept;
  // Host thread, after open_run(): starts one job per segment; `wake` wakes the feeds on
  // cancel. A stop already requested cancels the run before any segment starts (each ends at
  // once, taking nothing).
  void start(ServeMode mode, std::function<void()> wake_feeds);
  // Host thread: blocks until the run ends; a stopped StreamClient run's requests answered.
  // Closes the run (see open_run).
  void wait_segments();
  // Any thread: stops the run opened by open_run() and not yet ended by wait_segments(), if
  // any. Never blocks for long, never throws.
  void cancel() noexcept;
  bool running() const noexcept { return running_; }
  ServeMode mode() const noexcept { return mode_; }
  // Host thread, the run over: its result from what the ends counted.
  StreamResult finish(std::uint64_t accepted, std::uint64_t answered, std::uint64_t errors,
                      std::uint64_t refused_before);
  std::uint64_t refused_total() const noexcept;
  StreamStats stats() const;

  // Estimates for admission, from the stages' measured calls (0 until measured): the
  // bottleneck stage's time per request while requests queue up, and a request's own path
  // once taken (one call of each stage, plus the rest of a call in progress).
  std::int64_t per_request_ns() const noexcept;
  std::int64_t path_ns() const noexcept;
  std::uint32_t live_replicas() const noexcept;

 private:
  void monitor_loop(std::chrono::nanoseconds limit);
  std::shared_ptr<StreamRunState> state_;
  std::chrono::steady_clock::time_point started_;
  bool running_ = false;
  ServeMode mode_ = ServeMode::kInfeed;
  std::thread monitor_;
  std::mutex monitor_mutex_;
  std::condition_variable monitor_cv_;
  bool monitor_stop_ = false;
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
