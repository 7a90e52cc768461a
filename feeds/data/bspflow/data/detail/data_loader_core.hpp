// detail::LoaderCore: the threads and the ring behind a DataLoader (machinery, not API; the
// implementation is data_loader.cpp). Included by bspflow/data/data_loader.hpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/data/batch.hpp"
#include "bspflow/data/load_plan.hpp"
#include "bspflow/data/loader_config.hpp"
#include "bspflow/data/tensor.hpp"

namespace bspflow {

class LoaderStep;  // bspflow/data/data_loader.hpp

namespace detail {

// The threads and the ring, independent of the dataset type. DataLoader<D> supplies
// fill(); everything about who loads what when lives here (data_loader.cpp). Its public
// members are DataLoader's, documented there.
class LoaderCore {
 public:
  struct Task {
    std::uint64_t global = 0;  // step number since the loader started
    std::uint64_t epoch = 0;
    std::uint64_t step = 0;  // within the epoch
    std::uint64_t m = 0;     // micro-batch within the step, iteration-major
    std::uint32_t replica = 0;
    std::uint64_t position = 0;  // the replica's micro-batch number
  };

  using Step = LoaderStep;

  LoaderCore(const LoaderCore&) = delete;
  LoaderCore& operator=(const LoaderCore&) = delete;

  // Consumer thread (DataLoader::start_epoch()).
  void start_epoch();
  // Consumer thread (DataLoader::next()).
  std::optional<Step> next();

  // Any thread (DataLoader's getters). Never blocks, never allocates, never throws.
  std::uint64_t steps() const noexcept { return plan_.steps_per_epoch(); }
  std::uint64_t dropped() const noexcept { return plan_.dropped_per_epoch(); }
  std::uint64_t padded() const noexcept { return plan_.padded_per_epoch(); }
  const LoadPlan& plan() const noexcept { return plan_; }
  const LoaderConfig& config() const noexcept { return config_; }
  const SampleSpec& sample_spec() const noexcept { return out_spec_; }
  std::uint64_t epoch() const noexcept { return consumer_epoch_; }
  std::uint64_t bytes_per_step() const noexcept {
    return plan_.samples_per_step() * out_spec_.bytes();
  }

 protected:
  LoaderCore(StepShape shape, std::uint64_t dataset_size, const SampleSpec& spec,
             LoaderConfig config);
  // The derived class calls stop() first thing in its destructor: workers call fill().
  virtual ~LoaderCore();
  // Worker (or consumer, in kSync). Loads one micro-batch; may throw (LoaderError).
  virtual void fill(Batch& batch, const Task& task) = 0;
  // Called by the derived constructor once it can fill (early_preload starts here).
  void ready_to_load();
  void stop() noexcept;
  // Setup check shared by the template: a streaming dataset's limits.
  void require_in_order_reading() const;

  // Any thread. Where micro-batch buffers come from, and go back to when a Batch dies.
  const std::shared_ptr<BufferPool>& buffer_pool() const noexcept { return pool_; }
  // Any thread. The shuffled order of `epoch` (computed once, kept while in flight).
  std::shared_ptr<const std::vector<std::uint64_t>> order_for(std::uint64_t epoch);

 private:
  friend class bspflow::LoaderStep;  // hands its slot back, reads its batches
  struct Slot;
  void spawn_workers();
  void join_workers() noexcept;
  void worker_main() noexcept;
  // The worker threads: num_workers, and in async mode at least one (num_workers = 0 there
  // loads on one background thread, like PopTorch's loader in its own process).
  std::uint32_t worker_count() const noexcept {
    return config_.mode == LoaderMode::kAsync ? std::max<std::uint32_t>(config_.num_workers, 1)
                                              : config_.num_workers;
  }
  bool claim(Task& task, bool wait);
  void run_task(const Task& task) noexcept;
  void open_tasks(std::uint64_t first_global, std::uint64_t epoch, std::uint64_t task_limit);
  void discard_in_flight();
  std::uint64_t async_limit(std::uint64_t first) const noexcept;
  void release_slot(std::size_t slot) noexcept;
  Slot& slot_of(std::uint64_t global) noexcept;
  [[noreturn]] void fail(const std::exception_ptr& error);

  const LoadPlan plan_;
  const LoaderConfig config_;
  const SampleSpec out_spec_;
  const std::uint32_t buffer_;
  const std::uint64_t tasks_per_step_;
  std::shared_ptr<BufferPool> pool_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::thread> workers_;

  // Task stream. Guarded by claim_mutex_; the atomics are also read lock-free by waits.
  std::mutex claim_mutex_;
  std::atomic<std::uint64_t> next_task_{0};
  std::atomic<std::uint64_t> task_limit_{0};
  std::uint64_t base_global_ = 0;  // global step where epoch base_epoch_ starts
  std::uint64_t base_epoch_ = 0;
  std::atomic<bool> stopping_{false};
  WaitPoint work_;       // workers: tasks opened, or stopping
  WaitPoint slot_free_;  // workers: a slot was released
  WaitPoint ready_;      // consumer: a step finished loading

  // Consumer state (consumer thread only).
  bool started_ = false;           // some epoch's tasks were opened
  bool in_epoch_ = false;          // consumer is inside an epoch
  bool loading_ahead_ = false;     // the next epoch's tasks are already open
  std::uint64_t next_global_ = 0;  // next step to hand out
  std::uint64_t epoch_end_ = 0;    // global step where the consumer's epoch ends
  std::uint64_t consumer_epoch_ = 0;
  std::uint32_t leased_ = 0;
  std::exception_ptr failure_;

  // Shuffled orders of the epochs in flight.
  std::mutex order_mutex_;
  std::vector<std::pair<std::uint64_t, std::shared_ptr<const std::vector<std::uint64_t>>>> orders_;
};

}  // namespace detail
}  // namespace bspflow
