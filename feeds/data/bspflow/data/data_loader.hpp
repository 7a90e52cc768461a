/// @file
/// DataLoader: turns a dataset into the micro-batches a run's infeeds consume (PopTorch's
/// poptorch.DataLoader and its AsynchronousDataAccessor, on threads); LoaderStep, one loaded
/// step; LoaderError, a sample that could not be loaded. Guide: feeds/README.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/data/batch.hpp"
#include "bspflow/data/dataset.hpp"
#include "bspflow/data/detail/data_loader_core.hpp"
#include "bspflow/data/load_plan.hpp"
#include "bspflow/data/loader_config.hpp"
#include "bspflow/data/tensor.hpp"
#include "bspflow/feeds/infeed_queue.hpp"

namespace bspflow {

/// A sample could not be loaded. The message names the sample, epoch, step and replica;
/// cause() is what the dataset threw (or the bspflow::Error the loader raised about the
/// sample: a wrong spec, a stream read out of order or ended early). next()/feed_next()/
/// begin() throw it on the consumer thread.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class LoaderError : public Error {
 public:
  /// The message, the dataset index of the sample, and what loading it threw.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  LoaderError(const std::string& message, std::uint64_t sample, std::exception_ptr cause)
      : Error(message), sample_(sample), cause_(std::move(cause)) {}
  /// The dataset index of the sample that failed.
  std::uint64_t sample_index() const noexcept { return sample_; }
  /// What loading the sample threw.
  const std::exception_ptr& cause() const noexcept { return cause_; }

 private:
  std::uint64_t sample_;
  std::exception_ptr cause_;
};

/// A loaded step (`DataLoader<D>::Step`), leased to the consumer until destroyed (then its
/// slot is refilled). Its destruction must come before the loader's. Its Batches belong to
/// the ring: move them out (feed_next() does) or copy them.
/// Contract of every member: consumer; non-blocking; no-alloc; noexcept, unless tagged.
class LoaderStep {
 public:
  /// Leaves the source empty.
  LoaderStep(LoaderStep&& o) noexcept
      : core_(std::exchange(o.core_, nullptr)), slot_(o.slot_), epoch_(o.epoch_), index_(o.index_) {
  }
  /// Releases the step this one held, then takes the source's.
  LoaderStep& operator=(LoaderStep&& o) noexcept {
    if (this != &o) {
      release();
      core_ = std::exchange(o.core_, nullptr);
      slot_ = o.slot_;
      epoch_ = o.epoch_;
      index_ = o.index_;
    }
    return *this;
  }
  /// Hands the slot back for refilling.
  ~LoaderStep() { release(); }

  /// The epoch this step belongs to.
  std::uint64_t epoch() const noexcept { return epoch_; }
  std::uint64_t index() const noexcept { return index_; }  ///< within the epoch
  /// Replica r's micro-batches, in the order its device iterations consume them. Throws
  /// bspflow::Error if r is not below the replica count. Not on a moved-from Step.
  /// Contract: consumer; non-blocking; no-alloc; throws Error.
  std::span<Batch> replica(std::uint32_t r);
  /// Every micro-batch of the step, replica by replica. Not on a moved-from Step.
  std::span<Batch> batches() noexcept;

 private:
  friend class detail::LoaderCore;
  LoaderStep(detail::LoaderCore* core, std::size_t slot, std::uint64_t epoch, std::uint64_t index)
      : core_(core), slot_(slot), epoch_(epoch), index_(index) {}
  void release() noexcept;
  detail::LoaderCore* core_;
  std::size_t slot_;
  std::uint64_t epoch_;
  std::uint64_t index_;
};

/// Loads a dataset into steps of micro-batches: kSync on the consumer thread (with helper
/// threads), kAsync ahead of it on worker threads. One consumer thread calls next(),
/// feed_next() or begin() and releases the Steps; workers are internal. The dataset must
/// outlive the loader; random-access datasets are read concurrently.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class D>
requires RandomAccessDataset<D> || StreamingDataset<D>
class DataLoader : private detail::LoaderCore {
 public:
  /// A loaded step, leased to the consumer until destroyed.
  using Step = LoaderStep;

  /// `shape`: bspflow::Options (or a StepShape). The dataset is read, not owned. Allocates
  /// the ring and the buffer pool; early_preload starts the workers. Logs the drop/pad
  /// notice, if any, once. Throws bspflow::Error for a bad config (naming the field, the
  /// value and what is allowed), an empty or too small dataset, a sample spec with no
  /// elements, or options a streaming dataset cannot honour (shuffle, num_workers other than
  /// 1 in kAsync or 0 in kSync).
  /// Contract: host; non-blocking; allocates; throws Error.
  template <class Shape>
  requires RunShape<Shape> || std::same_as<Shape, StepShape> DataLoader(const Shape& shape,
                                                                        D& dataset,
                                                                        LoaderConfig config)
      : LoaderCore(step_shape(shape), dataset.size(), dataset.spec(), config), dataset_(dataset),
        in_spec_(dataset.spec()) {
    if constexpr (!RandomAccessDataset<D>) require_in_order_reading();
    ready_to_load();
  }
  /// After every Step is released: stops the workers and waits until each has finished the
  /// micro-batch it is loading.
  /// Contract: consumer; blocks; no-alloc; noexcept.
  ~DataLoader() override { stop(); }

  /// Starts an epoch: the next next() returns its first step. Called by begin(); an epoch
  /// abandoned part-way is discarded (its loading stops) first, which waits (spin, then
  /// park) until the steps already being loaded are done. kAsync: starts the workers.
  /// Throws bspflow::Error if a Step is still held; after a failure, the LoaderError (or
  /// bspflow::Error) that failed the loader, again.
  /// Contract: consumer; blocks; allocates; throws Error.
  using LoaderCore::start_epoch;
  /// The next step of the current epoch (starting one if none is running); nullopt after
  /// its last step (the call after that starts the next epoch). Waits (spin, then park)
  /// while that step is loading; kSync loads it here, on the calling thread with the
  /// num_workers helpers. Throws LoaderError if a sample of it failed: the workers stop and
  /// the loader is unusable (every later call throws the same error). Throws bspflow::Error
  /// if as many Steps are held as the ring has slots (buffer_size; 1 in kSync).
  /// Contract: consumer; blocks; allocates; throws Error.
  using LoaderCore::next;

  /// Steps per epoch; samples per epoch dropped (drop_last) or padded; the whole arithmetic
  /// (LoadPlan); the config; the spec of the samples delivered (after output_dtype).
  using LoaderCore::config;
  using LoaderCore::dropped;
  using LoaderCore::padded;
  using LoaderCore::plan;
  using LoaderCore::sample_spec;
  using LoaderCore::steps;
  /// Epoch the consumer is in (or last finished).
  /// Contract: consumer; non-blocking; no-alloc; noexcept.
  using LoaderCore::epoch;
  /// Bytes of sample data in one step (what the host moves to the device per step).
  using LoaderCore::bytes_per_step;

  /// Range-for over one epoch's steps: `for (auto& step : loader)`.
  /// Contract of every member: consumer; non-blocking; no-alloc; noexcept, unless tagged.
  class Iterator {
   public:
    /// The current step.
    Step& operator*() noexcept { return *step_; }
    /// Releases the current step, then takes the next, as next() does.
    /// Contract: consumer; blocks; allocates; throws Error.
    Iterator& operator++() {
      step_.reset();
      step_ = loader_->next();
      return *this;
    }
    /// Whether the epoch has no step left (the iterator equals end()).
    bool operator==(std::default_sentinel_t) const noexcept { return !step_.has_value(); }

   private:
    friend class DataLoader;
    explicit Iterator(DataLoader* l) : loader_(l) { step_ = loader_->next(); }
    DataLoader* loader_;
    std::optional<Step> step_;
  };
  /// Starts an epoch (start_epoch()) and takes its first step (next()).
  /// Contract: consumer; blocks; allocates; throws Error.
  Iterator begin() {
    start_epoch();
    return Iterator(this);
  }
  /// The end of the epoch's steps.
  std::default_sentinel_t end() const noexcept { return {}; }

  /// Takes the next step and moves replica r's micro-batches into lane r of the producer's
  /// infeed (no copy of sample data), then releases the step. Waits (spin, then park) while
  /// the step is loading and while a lane is full. `producer` is the calling thread's
  /// handle on the infeed (InfeedQueue::make_producer(); keep one for the whole epoch:
  /// elements of one producer keep their order). Returns false at the end of the epoch
  /// (the call after that starts the next one). Throws LoaderError (a sample failed) or
  /// bspflow::Error (the infeed has a different replica count, checked first; or it was
  /// closed while feeding, after part of the step went in; or as next()).
  /// Contract: consumer; blocks; allocates; throws Error.
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
  /// Loads micro-batch `t` into `b` (a worker, or the consumer in kSync): its samples, or
  /// padding past the end of the data. Throws LoaderError for a sample that fails.
  void fill(Batch& b, const Task& t) override {
    const LoadPlan& p = plan();
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
        throw LoaderError(
            "DataLoader: sample " + std::to_string(index) + " (epoch " + std::to_string(t.epoch) +
                ", step " + std::to_string(t.step) + ", replica " + std::to_string(t.replica) +
                ") could not be loaded: " + detail::describe_exception(std::current_exception()),
            index, std::current_exception());
      }
      b.indices[k] = index;
      ++b.valid;
    }
  }

 private:
  /// Sample `index` into dst (sample_spec() bytes); returns its label.
  std::int32_t load(std::uint64_t index, std::uint64_t epoch, std::uint64_t pos,
                    std::span<std::byte> dst) {
    const bool same_type = in_spec_.dtype == sample_spec().dtype;
    if constexpr (ReadIntoDataset<D>) {
      if (same_type) return dataset_.read(index, dst);
      thread_local std::vector<std::byte> scratch;
      scratch.resize(in_spec_.bytes());
      const std::int32_t label = dataset_.read(index, scratch);
      convert(in_spec_.dtype, scratch.data(), sample_spec().dtype, dst.data(), in_spec_.elements());
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

  /// Streaming datasets are read by one thread, in order (require_in_order_reading()).
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

/// Deduces the dataset type: `bspflow::DataLoader loader(options, dataset, config);`.
template <class O, class D>
DataLoader(const O&, D&, LoaderConfig) -> DataLoader<D>;

}  // namespace bspflow
