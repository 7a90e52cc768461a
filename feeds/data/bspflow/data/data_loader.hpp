// DataLoader: turns a dataset into the micro-batches a run's infeeds consume (PopTorch's
// poptorch.DataLoader and its AsynchronousDataAccessor, on threads).
//
//   bspflow::Options opts;  opts.device_iterations(50).replicas(2);
//   bspflow::SyntheticDataset data(
//       {.size = 10000, .spec = {bspflow::DType::kFloat32, {1, 128, 128}}});
//   bspflow::DataLoader loader(opts, data, {.batch_size = 16, .shuffle = true,
//                                           .num_workers = 4,
//                                           .mode = bspflow::LoaderMode::kAsync});
//   bspflow::InfeedQueue<bspflow::Batch> infeed(opts.infeed_config());
//   auto producer = infeed.make_producer();
//   while (loader.feed_next(producer)) { ... run opts.device_iterations() iterations ... }
//
// One host step is a combined batch of batch_size x device iterations x gradient
// accumulation x replicas samples. Within a step, micro-batch m (0 ..) holds the epoch's
// samples [m x batch_size, (m + 1) x batch_size) and goes to replica m % replicas as that
// replica's micro-batch m / replicas: replicas receive different samples, and each replica
// receives its micro-batches in order.
//
// Epochs: steps() steps each; shuffle reorders the samples per epoch from (seed, epoch),
// so the same seed gives the same order on any machine. drop_last (default true, as in
// PopTorch) drops the samples that do not fill a last step and says how many, once, through
// bspflow::log; with drop_last false the last step is padded with zero samples whose label
// is -1 (Batch::valid counts the real ones), so the device program keeps its shape.
//
// Modes. kSync loads a step when it is asked for, on the calling thread plus num_workers
// helper threads. kAsync keeps num_workers threads filling a ring of buffer_size steps
// ahead of the consumer; early_preload starts them at construction, load_indefinitely lets
// them run on into the next epoch without a gap, persistent_workers keeps them alive
// between epochs. Waiting (consumer for a step, workers for room) spins briefly, then parks.
//
// Errors: a dataset that throws while loading sample i makes next()/feed_next() throw a
// LoaderError naming the sample, epoch and step (and keeping the original exception), when
// the consumer reaches that step; earlier steps are delivered first. The workers stop; the
// loader is unusable afterwards (next() throws the same error). Nothing hangs.
//
// Threads: one consumer thread calls next()/feed_next()/begin() and releases the Steps;
// workers are internal. The dataset must outlive the loader; random-access datasets are
// read concurrently.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/data/batch.hpp"
#include "bspflow/data/dataset.hpp"
#include "bspflow/data/tensor.hpp"
#include "bspflow/feeds/infeed_queue.hpp"

namespace bspflow {

enum class LoaderMode { kSync, kAsync };
// Any thread. "sync" or "async". Never blocks, never allocates, never throws.
const char* to_string(LoaderMode m) noexcept;

// A plain value type; the loader copies it. validate() states the rules.
struct LoaderConfig {
  std::size_t batch_size = 1;        // micro-batch, samples; >= 1
  bool shuffle = false;              // random-access datasets only (checked by DataLoader)
  std::uint64_t seed = 0;            // shuffle seed
  bool drop_last = true;             // false: pad the last step (label -1)
  // kAsync: 1..kMaxLoaderWorkers; kSync: helpers, 0..kMaxLoaderWorkers. A streaming
  // dataset needs exactly 1 (kAsync) or 0 (kSync).
  std::uint32_t num_workers = 0;
  LoaderMode mode = LoaderMode::kSync;
  // kAsync: steps loaded ahead, 1..kMaxLoaderBuffer (kSync ignores it: one step at a time).
  std::uint32_t buffer_size = tunables::kDefaultLoaderBuffer;
  bool early_preload = false;        // kAsync only: start loading at construction
  bool load_indefinitely = false;    // kAsync only: keep loading across epoch ends
                                     // (needs persistent_workers)
  bool persistent_workers = true;    // kAsync: keep workers between epochs
  std::optional<DType> output_dtype; // convert samples to this type (default: keep)
  // Several processes (Instance, bspflow/runtime/instance.hpp): this loader is instance
  // `instance` of `instances` and loads its part of every epoch. Every instance shuffles
  // the whole dataset with the same seed, then takes its own contiguous slice of that
  // order, so no sample is seen twice or by no one: with drop_last each instance takes
  // size / instances samples and steps() is the same everywhere (what is dropped, the
  // remainder included, is counted by dropped() and logged once, by instance 0); without
  // it the first size % instances instances take one sample more and every instance pads
  // to the same number of steps. The replicas of the run shape are this instance's local
  // replicas. instances 1..kMaxReplicas, instance below it.
  std::uint32_t instance = 0;
  std::uint32_t instances = 1;
  // Any thread. Never blocks, never allocates. Throws bspflow::Error naming the field, the
  // value and what is allowed (or the options that conflict).
  void validate() const;
};

// The run shape a loader fills: anything with device_iterations(), gradient_accumulation()
// and replicas() (bspflow::Options), or a StepShape. Checked by the loader: device
// iterations and gradient accumulation >= 1, replicas 1..kMaxReplicas.
struct StepShape {
  std::uint64_t device_iterations = 1;
  std::uint32_t gradient_accumulation = 1;
  std::uint32_t replicas = 1;
};
template <class O>
concept RunShape = requires(const O& o) {
  { o.device_iterations() } -> std::convertible_to<std::uint64_t>;
  { o.gradient_accumulation() } -> std::convertible_to<std::uint32_t>;
  { o.replicas() } -> std::convertible_to<std::uint32_t>;
};
// Any thread. The shape of `o`. Never blocks, never allocates; throws only what o's
// getters throw.
template <RunShape O>
StepShape step_shape(const O& o) {
  return StepShape{static_cast<std::uint64_t>(o.device_iterations()),
                   static_cast<std::uint32_t>(o.gradient_accumulation()),
                   static_cast<std::uint32_t>(o.replicas())};
}
inline StepShape step_shape(const StepShape& s) { return s; }

// A sample could not be loaded. The message names the sample, epoch, step and replica;
// cause() is what the dataset threw (or the bspflow::Error the loader raised about the
// sample: a wrong spec, a stream read out of order or ended early). next()/feed_next()/
// begin() throw it on the consumer thread. The accessors never block, never allocate,
// never throw.
class LoaderError : public Error {
 public:
  LoaderError(const std::string& message, std::uint64_t sample, std::exception_ptr cause)
      : Error(message), sample_(sample), cause_(std::move(cause)) {}
  std::uint64_t sample_index() const noexcept { return sample_; }
  const std::exception_ptr& cause() const noexcept { return cause_; }

 private:
  std::uint64_t sample_;
  std::exception_ptr cause_;
};

namespace detail {

// The arithmetic of a loader: step sizes, epoch length, what is dropped or padded, the
// per-epoch order. Immutable after construction; any thread. The getters and position()
// never block, never allocate, never throw.
class LoadPlan {
 public:
  // Setup path. Validates `config` and `shape`. Never blocks, never allocates. Throws
  // bspflow::Error naming the field, the value and what is allowed (a bad config, a zero
  // dimension, replicas above kMaxReplicas), or for an empty dataset (with drop_last: one
  // smaller than a combined batch), or an overflowing product.
  LoadPlan(StepShape shape, std::uint64_t dataset_size, const LoaderConfig& config);

  // This instance's samples per epoch (the whole dataset with one instance).
  std::uint64_t dataset_size() const noexcept { return size_; }
  std::uint64_t total_size() const noexcept { return total_; }
  std::size_t batch_size() const noexcept { return batch_; }
  std::uint32_t replicas() const noexcept { return shape_.replicas; }
  // Micro-batches per replica per step: device iterations x gradient accumulation.
  std::uint64_t per_replica() const noexcept { return per_replica_; }
  std::uint64_t micro_batches_per_step() const noexcept { return per_replica_ * shape_.replicas; }
  std::uint64_t samples_per_step() const noexcept { return per_step_; }
  std::uint64_t steps_per_epoch() const noexcept { return steps_; }
  // With several instances: dropped by all of them together (the remainder included).
  std::uint64_t dropped_per_epoch() const noexcept { return dropped_; }
  std::uint64_t padded_per_epoch() const noexcept { return padded_; }
  // "combined batch 16 batch x 50 device iterations x 1 gradient accumulation x 2 replicas
  // = 1600 samples; 10000 samples -> 6 steps per epoch, drop_last drops 400". Never
  // blocks. Allocates (the returned string); throws only std::bad_alloc.
  std::string describe() const;
  // The drop (or pad) notice the loader logs once; empty when nothing is dropped or padded.
  // Never blocks. Allocates (the returned string); throws only std::bad_alloc.
  std::string remainder_notice() const;

  // Position in the epoch order of sample k of micro-batch m (iteration-major) of a step.
  std::uint64_t position(std::uint64_t step, std::uint64_t m, std::size_t k) const noexcept {
    return step * per_step_ + m * batch_ + k;
  }
  // The epoch's order (position -> dataset index): a seeded Fisher-Yates shuffle of
  // 0..total_size()-1 from (seed, epoch), the same in every instance. Only called when
  // shuffling. Never blocks. Allocates (total_size() indices); throws only std::bad_alloc.
  std::vector<std::uint64_t> shuffled_order(std::uint64_t epoch) const;
  // The dataset index at this instance's position `pos` (< dataset_size()): through
  // `order` when shuffling (null: not). Never blocks, never allocates, never throws.
  std::uint64_t index_at(std::uint64_t pos, const std::vector<std::uint64_t>* order) const noexcept {
    return order != nullptr ? (*order)[offset_ + pos] : offset_ + pos;
  }
  // Whether this loader should log remainder_notice() (instance 0 speaks for all).
  bool reports() const noexcept { return instance_ == 0; }

 private:
  std::string describe_step() const;
  StepShape shape_;
  std::uint64_t size_;   // this instance's share
  std::uint64_t total_;  // the dataset
  std::uint64_t offset_ = 0;
  std::uint32_t instance_ = 0, instances_ = 1;
  std::size_t batch_;
  std::uint64_t seed_;
  bool drop_last_;
  std::uint64_t per_replica_ = 0;
  std::uint64_t per_step_ = 0;
  std::uint64_t steps_ = 0;
  std::uint64_t dropped_ = 0;
  std::uint64_t padded_ = 0;
};

// The threads and the ring, independent of the dataset type. DataLoader<D> supplies
// fill(); everything about who loads what when lives here (data_loader.cpp). Its public
// members are DataLoader's.
class LoaderCore {
 public:
  struct Task {
    std::uint64_t global = 0;   // step number since the loader started
    std::uint64_t epoch = 0;
    std::uint64_t step = 0;     // within the epoch
    std::uint64_t m = 0;        // micro-batch within the step, iteration-major
    std::uint32_t replica = 0;
    std::uint64_t position = 0;  // the replica's micro-batch number
  };

  class Step;

  LoaderCore(const LoaderCore&) = delete;
  LoaderCore& operator=(const LoaderCore&) = delete;

  // Consumer thread. Starts an epoch: the next next() returns its first step. Called by
  // begin(); an epoch abandoned part-way is discarded (its loading stops) first, which
  // blocks (spin, then park) until the steps already being loaded are done. May allocate
  // (kAsync: starts the workers). Throws bspflow::Error if a Step is still held; after a
  // failure, the LoaderError (or bspflow::Error) that failed the loader, again.
  void start_epoch();
  // Consumer thread. The next step of the current epoch (starting one if none is
  // running); nullopt after its last step (the call after that starts the next epoch).
  // Blocks (spin, then park) while that step is loading; kSync loads it here, on the
  // calling thread with the num_workers helpers. May allocate (kSync: sample buffers).
  // Throws LoaderError if a sample of it failed: the workers stop and the loader is
  // unusable (every later call throws the same error). Throws bspflow::Error if as many
  // Steps are held as the ring has slots (buffer_size; 1 in kSync).
  std::optional<Step> next();

  // Any thread. Never blocks, never allocates, never throws.
  std::uint64_t steps() const noexcept { return plan_.steps_per_epoch(); }
  std::uint64_t dropped() const noexcept { return plan_.dropped_per_epoch(); }
  std::uint64_t padded() const noexcept { return plan_.padded_per_epoch(); }
  const LoadPlan& plan() const noexcept { return plan_; }
  const LoaderConfig& config() const noexcept { return config_; }
  const SampleSpec& sample_spec() const noexcept { return out_spec_; }
  // Consumer thread. Epoch the consumer is in (or last finished). Never blocks, never
  // allocates, never throws.
  std::uint64_t epoch() const noexcept { return consumer_epoch_; }
  // Any thread. Bytes of sample data in one step (what the host moves to the device per
  // step). Never blocks, never allocates, never throws.
  std::uint64_t bytes_per_step() const noexcept {
    return plan_.samples_per_step() * out_spec_.bytes();
  }

  // A loaded step, leased to the consumer until destroyed (then its slot is refilled).
  // Consumer thread only, including its destruction, which must come before the loader's.
  // Its Batches belong to the ring: move them out (feed_next() does) or copy them.
  class Step {
   public:
    // Leaves the source empty. Never blocks, never allocates, never throws.
    Step(Step&& o) noexcept
        : core_(std::exchange(o.core_, nullptr)), slot_(o.slot_), epoch_(o.epoch_),
          index_(o.index_) {}
    // Releases the step this one held, then takes the source's. Never blocks for long,
    // never allocates, never throws.
    Step& operator=(Step&& o) noexcept {
      if (this != &o) {
        release();
        core_ = std::exchange(o.core_, nullptr);
        slot_ = o.slot_;
        epoch_ = o.epoch_;
        index_ = o.index_;
      }
      return *this;
    }
    // Hands the slot back for refilling. Never blocks for long, never allocates, never
    // throws.
    ~Step() { release(); }

    // Never blocks, never allocates, never throws.
    std::uint64_t epoch() const noexcept { return epoch_; }
    std::uint64_t index() const noexcept { return index_; }  // within the epoch
    // Replica r's micro-batches, in the order its device iterations consume them. Never
    // blocks, never allocates. Throws bspflow::Error naming the field, the value and what
    // is allowed if r >= replicas. Not on a moved-from Step.
    std::span<Batch> replica(std::uint32_t r);
    // Every micro-batch of the step, replica by replica. Never blocks, never allocates,
    // never throws. Not on a moved-from Step.
    std::span<Batch> batches();

   private:
    friend class LoaderCore;
    Step(LoaderCore* core, std::size_t slot, std::uint64_t epoch, std::uint64_t index)
        : core_(core), slot_(slot), epoch_(epoch), index_(index) {}
    void release() noexcept;
    LoaderCore* core_;
    std::size_t slot_;
    std::uint64_t epoch_;
    std::uint64_t index_;
  };

 protected:
  LoaderCore(StepShape shape, std::uint64_t dataset_size, SampleSpec spec, LoaderConfig config);
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
  struct Slot;
  void spawn_workers();
  void join_workers() noexcept;
  void worker_main() noexcept;
  bool claim(Task& task, bool wait);
  void run_task(const Task& task) noexcept;
  void open_tasks(std::uint64_t first_global, std::uint64_t epoch, std::uint64_t task_limit);
  void discard_in_flight();
  std::uint64_t async_limit(std::uint64_t first) const noexcept;
  void release_slot(std::size_t slot) noexcept;
  Slot& slot_of(std::uint64_t global) noexcept;
  [[noreturn]] void fail(std::exception_ptr error);

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
  std::uint64_t base_global_ = 0;   // global step where epoch base_epoch_ starts
  std::uint64_t base_epoch_ = 0;
  std::atomic<bool> stopping_{false};
  WaitPoint work_;       // workers: tasks opened, or stopping
  WaitPoint slot_free_;  // workers: a slot was released
  WaitPoint ready_;      // consumer: a step finished loading

  // Consumer state (consumer thread only).
  bool started_ = false;      // some epoch's tasks were opened
  bool in_epoch_ = false;     // consumer is inside an epoch
  bool loading_ahead_ = false;  // the next epoch's tasks are already open
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

template <class D>
  requires RandomAccessDataset<D> || StreamingDataset<D>
class DataLoader : public detail::LoaderCore {
 public:
  using Step = detail::LoaderCore::Step;

  // Setup path. `shape`: bspflow::Options (or a StepShape). The dataset is read, not
  // owned. Never blocks. Allocates (the ring, the buffer pool; early_preload starts the
  // workers). Logs the drop/pad notice, if any, once. Throws bspflow::Error for a bad
  // config (naming the field, the value and what is allowed), an empty or too small
  // dataset, a sample spec with no elements, or options a streaming dataset cannot
  // honour (shuffle, num_workers other than 1 in kAsync or 0 in kSync).
  template <class Shape>
    requires RunShape<Shape> || std::same_as<Shape, StepShape>
  DataLoader(const Shape& shape, D& dataset, LoaderConfig config)
      : LoaderCore(step_shape(shape), dataset.size(), dataset.spec(), config), dataset_(dataset),
        in_spec_(dataset.spec()) {
    if constexpr (!RandomAccessDataset<D>) require_in_order_reading();
    ready_to_load();
  }
  // Consumer thread, after every Step is released. Stops the workers and blocks until
  // each has finished the micro-batch it is loading. Never throws.
  ~DataLoader() override { stop(); }

  // Consumer thread. Range-for over one epoch's steps: `for (auto& step : loader)`.
  class Iterator {
   public:
    // The current step. Never blocks, never allocates, never throws.
    Step& operator*() { return *step_; }
    // Releases the current step, then takes the next (next(): blocks, may allocate, throws
    // what it throws).
    Iterator& operator++() {
      step_.reset();
      step_ = loader_->next();
      return *this;
    }
    bool operator==(std::default_sentinel_t) const noexcept { return !step_.has_value(); }

   private:
    friend class DataLoader;
    explicit Iterator(DataLoader* l) : loader_(l) { step_ = loader_->next(); }
    DataLoader* loader_;
    std::optional<Step> step_;
  };
  // Consumer thread. Starts an epoch (start_epoch()) and takes its first step (next()):
  // blocks, may allocate, throws what they throw.
  Iterator begin() {
    start_epoch();
    return Iterator(this);
  }
  // Never blocks, never allocates, never throws.
  std::default_sentinel_t end() const noexcept { return {}; }

  // Consumer thread. Takes the next step and moves replica r's micro-batches into lane r
  // of the producer's infeed (no copy of sample data), then releases the step. Blocks
  // (spin, then park) while the step is loading and while a lane is full. May allocate
  // (kSync: sample buffers; the infeed's queue blocks). `producer` is the calling thread's
  // handle on the infeed (InfeedQueue::make_producer(); keep one for the whole epoch:
  // elements of one producer keep their order). Returns false at the end of the epoch
  // (the call after that starts the next one). Throws LoaderError (a sample failed) or
  // bspflow::Error (the infeed has a different replica count, checked first; or it was
  // closed while feeding, after part of the step went in; or as next()).
  bool feed_next(typename InfeedQueue<Batch>::Producer& producer) {
    if (producer.replicas() != plan().replicas()) {
      throw Error("DataLoader::feed_next: the infeed has " + std::to_string(producer.replicas()) +
                  " replica lanes but the loader fills " + std::to_string(plan().replicas()) +
                  " replicas; build the infeed from the same options");
    }
    std::optional<Step> step = next();
    if (!step) return false;
    for (std::uint32_t r = 0; r < plan().replicas(); ++r) {
      const std::span<Batch> mine = step->replica(r);
      if (producer.push_bulk(r, mine) != mine.size()) {
        throw Error("DataLoader::feed_next: the infeed was closed while step " +
                    std::to_string(step->index()) + " was being fed to replica " +
                    std::to_string(r));
      }
    }
    return true;
  }

 protected:
  void fill(Batch& b, const Task& t) override {
    const detail::LoadPlan& p = plan();
    const SampleSpec& out = sample_spec();
    const std::size_t n = p.batch_size();
    const std::size_t sample_bytes = out.bytes();
    if (b.data.bytes() != n * sample_bytes) {  // new, or moved into an infeed
      std::vector<std::size_t> shape{n};
      shape.insert(shape.end(), out.shape.begin(), out.shape.end());
      b.data = Tensor(out.dtype, std::move(shape), buffer_pool());
    }
    b.labels.resize(n);
    b.indices.resize(n);
    b.epoch = t.epoch;
    b.step = t.step;
    b.replica = t.replica;
    b.position = t.position;
    b.valid = 0;
    std::shared_ptr<const std::vector<std::uint64_t>> order;
    if constexpr (RandomAccessDataset<D>) {
      if (config().shuffle) order = order_for(t.epoch);
    }
    std::byte* base = b.data.raw().data();
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint64_t pos = p.position(t.step, t.m, k);
      const std::span<std::byte> dst(base + k * sample_bytes, sample_bytes);
      if (pos >= p.dataset_size()) {  // padding of the last step (drop_last = false)
        std::fill(dst.begin(), dst.end(), std::byte{0});
        b.labels[k] = -1;
        b.indices[k] = Batch::kPadding;
        continue;
      }
      const std::uint64_t index = p.index_at(pos, order.get());
      try {
        b.labels[k] = load(index, t.epoch, pos, dst);
      } catch (...) {
        throw LoaderError("DataLoader: sample " + std::to_string(index) + " (epoch " +
                              std::to_string(t.epoch) + ", step " + std::to_string(t.step) +
                              ", replica " + std::to_string(t.replica) +
                              ") could not be loaded: " +
                              detail::describe_exception(std::current_exception()),
                          index, std::current_exception());
      }
      b.indices[k] = index;
      ++b.valid;
    }
  }

 private:
  // Sample `index` into dst (sample_spec() bytes); returns its label.
  std::int32_t load(std::uint64_t index, std::uint64_t epoch, std::uint64_t pos,
                    std::span<std::byte> dst) {
    const bool same_type = in_spec_.dtype == sample_spec().dtype;
    if constexpr (ReadIntoDataset<D>) {
      if (same_type) return dataset_.read(index, dst);
      thread_local std::vector<std::byte> scratch;
      scratch.resize(in_spec_.bytes());
      const std::int32_t label = dataset_.read(index, scratch);
      convert(in_spec_.dtype, scratch.data(), sample_spec().dtype, dst.data(),
              in_spec_.elements());
      return label;
    } else {
      Sample s;
      if constexpr (RandomAccessDataset<D>) {
        s = dataset_.get(index);
      } else {
        next_from_stream(epoch, pos, s);
      }
      TensorDataset::check_sample(in_spec_, s, index);
      convert(in_spec_.dtype, s.data.raw().data(), sample_spec().dtype, dst.data(),
              in_spec_.elements());
      return s.label;
    }
  }

  // Streaming datasets are read by one thread, in order (require_in_order_reading()).
  void next_from_stream(std::uint64_t epoch, std::uint64_t pos, Sample& s) {
    if constexpr (StreamingDataset<D>) {
      if (!stream_started_ || epoch != stream_epoch_) {
        if (stream_started_) dataset_.rewind();
        stream_started_ = true;
        stream_epoch_ = epoch;
        stream_pos_ = 0;
      }
      if (pos != stream_pos_) {
        throw Error("streaming dataset read out of order: position " + std::to_string(pos) +
                    " asked, the stream is at " + std::to_string(stream_pos_));
      }
      if (!dataset_.next(s)) {
        throw Error("the stream ended after " + std::to_string(stream_pos_) +
                    " samples but its size() says " + std::to_string(dataset_.size()));
      }
      ++stream_pos_;
    }
  }

  D& dataset_;
  const SampleSpec in_spec_;
  bool stream_started_ = false;
  std::uint64_t stream_epoch_ = 0;
  std::uint64_t stream_pos_ = 0;
};

template <class O, class D>
DataLoader(const O&, D&, LoaderConfig) -> DataLoader<D>;

}  // namespace bspflow
