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

// The admission queue of the StreamClients' requests, untyped: what the core needs of it.
class IntakeBase {
 public:
  virtual ~IntakeBase() = default;
  // Host thread: takes pushes (start) / refuses them (close, the end of the run).
  virtual void open() = 0;
  virtual void close() noexcept = 0;
  // Host thread, after a stopped run: answers every queued request kCancelled.
  virtual void cancel_all(Answerer& answerer) = 0;
  virtual void wake() noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual std::uint64_t accepted() const noexcept = 0;          // this run
  virtual std::uint64_t total_accepted() const noexcept = 0;    // since the stream was built
  virtual std::uint64_t refused(Refusal r) const noexcept = 0;  // since the stream was built
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
  // After a stopped run: answers what a ring still holds.
  std::vector<std::function<void(Answerer&)>> ring_cancels;
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
  bool timing() const noexcept {
    return config.stats || config.call_stall_limit > std::chrono::nanoseconds::zero();
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
  // Host thread, after open_run(): starts one job per segment; `wake_intake` wakes the
  // admission queue's waiters on cancel. A stop already requested cancels the run before any
  // segment starts (each ends at once, taking nothing).
  void start(std::function<void()> wake_intake);
  // Host thread: blocks until the run ends; a stopped run's requests answered.
  // Closes the run (see open_run).
  void wait_segments();
  // Any thread: stops the run opened by open_run() and not yet ended by wait_segments(), if
  // any. Never blocks for long, never throws.
  void cancel() noexcept;
  bool running() const noexcept { return running_; }
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
