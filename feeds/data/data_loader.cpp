// DataLoader internals: the worker ring (detail::LoaderCore) and the steps it leases
// (LoaderStep). The load plan (sizes, epochs, order) is load_plan.cpp.
//
// The ring: buffer slots, slot g % buffer holds global step g. A step is
// micro_batches_per_step tasks (one micro-batch each); workers claim tasks in order from a
// counter bounded by task_limit_ (the end of the epoch, or of the one step a kSync consumer
// asked for), wait until their step's slot is free, fill their micro-batch and count it
// done; the task that completes a step marks its slot ready. The consumer takes steps in
// order and releases each slot to step g + buffer.
#include "bspflow/data/data_loader.hpp"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <limits>
#include <string>

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

namespace detail {

struct LoaderCore::Slot {
  explicit Slot(std::size_t micro_batches, std::uint64_t first)
      : batches(micro_batches), assigned(first) {}
  std::vector<Batch> batches;           // replica-major: replica x per_replica + position
  std::atomic<std::uint64_t> assigned;  // the global step this slot holds (or waits for)
  std::atomic<std::uint64_t> ready{0};  // assigned + 1 once every micro-batch is loaded
  std::atomic<std::uint64_t> done{0};   // micro-batches loaded (or failed)
  std::mutex error_mutex;
  std::exception_ptr error;  // the step's first failure
};

LoaderCore::LoaderCore(StepShape shape, std::uint64_t dataset_size, const SampleSpec& spec,
                       LoaderConfig config)
    : plan_(shape, dataset_size, config),
      config_(config), out_spec_{config_.output_dtype.value_or(spec.dtype), spec.shape},
      buffer_(config_.mode == LoaderMode::kAsync ? config_.buffer_size : 1),
      tasks_per_step_(plan_.micro_batches_per_step()),
      // Spare buffers: what the ring holds plus as much again in flight to the devices.
      pool_(std::make_shared<BufferPool>(plan_.batch_size() * out_spec_.bytes(),
                                         std::size_t{2} * buffer_ * tasks_per_step_)) {
  if (spec.bytes() == 0) {
    throw_bad_value("dataset sample shape", spec.describe(), "needs at least one element");
  }
  slots_.reserve(buffer_);
  for (std::uint32_t i = 0; i < buffer_; ++i) {
    slots_.push_back(std::make_unique<Slot>(tasks_per_step_, i));
  }
}

LoaderCore::~LoaderCore() {
  stop();
}

void LoaderCore::ready_to_load() {
  const std::string notice = plan_.reports() ? plan_.remainder_notice() : std::string();
  // Once per distinct cause in the process: a program that builds a loader per measurement
  // says it once, not once per loader.
  if (!notice.empty())
    log_once(plan_.dropped_per_epoch() != 0 ? LogLevel::kWarning : LogLevel::kInfo, notice);
  if (config_.mode == LoaderMode::kSync) {
    if (config_.num_workers > 0) spawn_workers();  // helpers: idle until a step is asked for
    return;
  }
  if (config_.early_preload) {
    spawn_workers();
    open_tasks(0, 0, async_limit(0));
    loading_ahead_ = true;
  }
}

void LoaderCore::require_in_order_reading() const {
  if (config_.instances > 1) {
    throw_bad_value(
        "instances", config_.instances,
        "must be 1 with a streaming dataset: a stream read in order cannot be split between "
        "instances (use a random-access dataset: size(), spec(), get(i))");
  }
  if (config_.shuffle) {
    throw Error(
        "shuffle = true needs a random-access dataset (size(), spec(), get(i)); a "
        "streaming dataset is read in order");
  }
  const std::uint32_t allowed = config_.mode == LoaderMode::kAsync ? 1 : 0;
  if (worker_count() != allowed) {
    throw_bad_value("num_workers", config_.num_workers,
                    std::string("must be ") + std::to_string(allowed) +
                        " with a streaming "
                        "dataset in " +
                        to_string(config_.mode) +
                        " mode: a stream is read by one thread, in order");
  }
}

void LoaderCore::spawn_workers() {
  if (!workers_.empty()) return;
  workers_.reserve(worker_count());
  for (std::uint32_t i = 0; i < worker_count(); ++i) {
    workers_.emplace_back([this] { worker_main(); });
  }
}

void LoaderCore::join_workers() noexcept {
  stopping_.store(true, std::memory_order_seq_cst);
  work_.notify();
  slot_free_.notify();
  ready_.notify();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void LoaderCore::stop() noexcept {
  join_workers();
}

// Global step `first` is step 0 of `epoch`; tasks below `task_limit` may be claimed.
void LoaderCore::open_tasks(std::uint64_t first, std::uint64_t epoch, std::uint64_t task_limit) {
  {
    std::lock_guard lock(claim_mutex_);
    base_global_ = first;
    base_epoch_ = epoch;
    next_task_.store(first * tasks_per_step_, std::memory_order_seq_cst);
    task_limit_.store(task_limit, std::memory_order_seq_cst);
  }
  work_.notify();
}

std::uint64_t LoaderCore::async_limit(std::uint64_t first) const noexcept {
  return config_.load_indefinitely ? std::numeric_limits<std::uint64_t>::max()
                                   : (first + plan_.steps_per_epoch()) * tasks_per_step_;
}

bool LoaderCore::claim(Task& task, bool wait) {
  for (;;) {
    {
      std::lock_guard lock(claim_mutex_);
      if (stopping_.load(std::memory_order_seq_cst)) return false;
      const std::uint64_t n =
          next_task_.load(std::memory_order_relaxed);         // relaxed: under the lock
      if (n < task_limit_.load(std::memory_order_relaxed)) {  // relaxed: under the lock
        next_task_.store(n + 1, std::memory_order_seq_cst);
        task.global = n / tasks_per_step_;
        task.m = n % tasks_per_step_;
        const std::uint64_t rel = task.global - base_global_;
        task.epoch = base_epoch_ + rel / plan_.steps_per_epoch();
        task.step = rel % plan_.steps_per_epoch();
        task.replica = static_cast<std::uint32_t>(task.m % plan_.replicas());
        task.position = task.m / plan_.replicas();
        return true;
      }
    }
    if (!wait) return false;
    work_.wait([&] {
      return next_task_.load(std::memory_order_seq_cst) <
                 task_limit_.load(std::memory_order_seq_cst) ||
             stopping_.load(std::memory_order_seq_cst);
    });
  }
}

LoaderCore::Slot& LoaderCore::slot_of(std::uint64_t global) noexcept {
  return *slots_[global % buffer_];
}

void LoaderCore::run_task(const Task& task) noexcept {
  Slot& s = slot_of(task.global);
  // Wait (spin, then park) until the consumer has released this slot to our step.
  slot_free_.wait(
      [&] {
        return s.assigned.load(std::memory_order_seq_cst) == task.global ||
               stopping_.load(std::memory_order_seq_cst);
      },
      Spin::kBackoff);
  if (s.assigned.load(std::memory_order_seq_cst) != task.global) return;  // stopping
  Batch& b = s.batches[task.replica * plan_.per_replica() + task.position];
  try {
    fill(b, task);
  } catch (...) {
    std::lock_guard lock(s.error_mutex);
    if (!s.error) s.error = std::current_exception();
  }
  // acq_rel: the last task to finish sees every other task's batch (release sequence).
  if (s.done.fetch_add(1, std::memory_order_acq_rel) + 1 == tasks_per_step_) {
    s.ready.store(task.global + 1, std::memory_order_seq_cst);
    ready_.notify();
  }
}

namespace {

// The calling thread runs only when a core would otherwise idle (Linux SCHED_IDLE; any
// thread may lower its own policy): a consumer or device that wakes takes a core from the
// workers at once, instead of waiting out a worker's time slice (about a millisecond with 4
// workers on 2 cores). Elsewhere, or if refused, the thread keeps its priority.
void to_background() noexcept {
#if defined(__linux__)
  sched_param p{};
  (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &p);
#endif
}

}  // namespace

void LoaderCore::worker_main() noexcept {
  detail::name_this_thread("bspflow-load");
  if (config_.mode == LoaderMode::kAsync && config_.background_workers) to_background();
  Task task;
  while (claim(task, true)) run_task(task);
}

void LoaderCore::release_slot(std::size_t slot) noexcept {
  Slot& s = *slots_[slot];
  s.ready.store(0, std::memory_order_relaxed);  // relaxed: published by the assigned store
  s.done.store(0, std::memory_order_relaxed);   // relaxed: published by the assigned store
  {
    std::lock_guard lock(s.error_mutex);
    s.error = nullptr;
  }
  s.assigned.store(s.assigned.load(std::memory_order_relaxed) + buffer_, std::memory_order_seq_cst);
  slot_free_.notify();
  --leased_;
}

// Abandoning an epoch part-way: stop opening tasks at the end of the step being claimed,
// let the steps already started finish, and drop them.
void LoaderCore::discard_in_flight() {
  std::uint64_t end_global;
  {
    std::lock_guard lock(claim_mutex_);
    const std::uint64_t n = next_task_.load(std::memory_order_relaxed);  // relaxed: under the lock
    const std::uint64_t limit = (n + tasks_per_step_ - 1) / tasks_per_step_ * tasks_per_step_;
    if (limit < task_limit_.load(std::memory_order_relaxed)) {  // relaxed: stored under this lock
      task_limit_.store(limit, std::memory_order_seq_cst);
    }
    end_global =
        task_limit_.load(std::memory_order_relaxed) / tasks_per_step_;  // relaxed: likewise
  }
  for (; next_global_ < end_global; ++next_global_) {
    Slot& s = slot_of(next_global_);
    const std::uint64_t g = next_global_;
    ready_.wait([&] {
      return s.ready.load(std::memory_order_seq_cst) == g + 1 ||
             stopping_.load(std::memory_order_seq_cst);
    });
    ++leased_;
    release_slot(g % buffer_);
  }
}

void LoaderCore::start_epoch() {
  if (failure_) std::rethrow_exception(failure_);
  if (leased_ != 0) {
    throw Error("DataLoader: " + std::to_string(leased_) +
                " step(s) of the current epoch are still held; release every Step before "
                "starting the next epoch");
  }
  if (in_epoch_ && next_global_ != epoch_end_) {  // abandoned part-way: drop what is loading
    discard_in_flight();
    loading_ahead_ = false;
  }
  const std::uint64_t epoch = started_ ? consumer_epoch_ + 1 : 0;
  if (!loading_ahead_) {
    if (config_.mode == LoaderMode::kAsync) {
      stopping_.store(false, std::memory_order_seq_cst);
      spawn_workers();
      open_tasks(next_global_, epoch, async_limit(next_global_));
    } else {
      open_tasks(next_global_, epoch, next_global_ * tasks_per_step_);  // opened per next()
    }
  }
  loading_ahead_ = config_.mode == LoaderMode::kAsync && config_.load_indefinitely;
  started_ = true;
  in_epoch_ = true;
  consumer_epoch_ = epoch;
  epoch_end_ = next_global_ + plan_.steps_per_epoch();
}

std::optional<LoaderCore::Step> LoaderCore::next() {
  if (failure_) std::rethrow_exception(failure_);
  if (!in_epoch_) start_epoch();
  if (next_global_ == epoch_end_) {
    in_epoch_ = false;
    if (config_.mode == LoaderMode::kAsync && !config_.persistent_workers) join_workers();
    return std::nullopt;
  }
  if (leased_ >= buffer_) {
    throw Error("DataLoader::next: " + std::to_string(leased_) +
                " step(s) are still held and the ring holds " + std::to_string(buffer_) +
                " (buffer_size in async mode, 1 in sync mode); release a Step first");
  }
  const std::uint64_t g = next_global_;
  Slot& s = slot_of(g);
  if (config_.mode == LoaderMode::kSync) {
    {
      std::lock_guard lock(claim_mutex_);
      task_limit_.store((g + 1) * tasks_per_step_, std::memory_order_seq_cst);
    }
    work_.notify();
    Task task;
    while (claim(task, false)) run_task(task);  // the caller loads too
  }
  ready_.wait([&] {
    return s.ready.load(std::memory_order_seq_cst) == g + 1 ||
           stopping_.load(std::memory_order_seq_cst);
  });
  std::exception_ptr error;
  {
    std::lock_guard lock(s.error_mutex);
    error = s.error;
  }
  if (error) fail(error);
  if (s.ready.load(std::memory_order_seq_cst) != g + 1) {
    fail(std::make_exception_ptr(Error("DataLoader: stopped while waiting for a step")));
  }
  ++next_global_;
  ++leased_;
  const std::uint64_t rel = g - base_global_;
  return Step(this, g % buffer_, base_epoch_ + rel / plan_.steps_per_epoch(),
              rel % plan_.steps_per_epoch());
}

void LoaderCore::fail(const std::exception_ptr& error) {
  failure_ = error;
  join_workers();
  std::rethrow_exception(error);
}

std::shared_ptr<const std::vector<std::uint64_t>> LoaderCore::order_for(std::uint64_t epoch) {
  std::lock_guard lock(order_mutex_);
  for (const auto& [e, order] : orders_) {
    if (e == epoch) return order;
  }
  auto order = std::make_shared<const std::vector<std::uint64_t>>(plan_.shuffled_order(epoch));
  constexpr std::size_t kKeep = 3;  // epochs in flight: this one, the next (load_indefinitely)
  if (orders_.size() >= kKeep) {
    orders_.erase(std::min_element(orders_.begin(), orders_.end(),
                                   [](const auto& a, const auto& b) { return a.first < b.first; }));
  }
  orders_.emplace_back(epoch, order);
  return order;
}

}  // namespace detail

void LoaderStep::release() noexcept {
  if (core_ != nullptr) std::exchange(core_, nullptr)->release_slot(slot_);
}

std::span<Batch> LoaderStep::replica(std::uint32_t r) {
  if (r >= core_->plan_.replicas()) {
    detail::throw_bad_value(
        "replica", r,
        "must be below the loader's replica count " + std::to_string(core_->plan_.replicas()));
  }
  const std::uint64_t n = core_->plan_.per_replica();
  return std::span<Batch>(core_->slots_[slot_]->batches).subspan(r * n, n);
}

std::span<Batch> LoaderStep::batches() noexcept {
  return core_->slots_[slot_]->batches;
}

}  // namespace bspflow
