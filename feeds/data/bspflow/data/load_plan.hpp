/// @file
/// LoadPlan: what a LoaderConfig over a run shape comes to: steps per epoch, samples per
/// step, what is dropped or padded, the per-epoch order (DataLoader::plan(),
/// `<bspflow/data/data_loader.hpp>`).
///
///   bspflow::LoadPlan plan(bspflow::step_shape(opts), data.size(), {.batch_size = 16});
///   plan.steps_per_epoch();  // the steps one epoch of `data` makes with these options
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bspflow/data/loader_config.hpp"

namespace bspflow {

/// The arithmetic of a loader: step sizes, epoch length, what is dropped or padded, the
/// per-epoch order. DataLoader::plan() returns its loader's; a plan can also be made on its
/// own, to size a run before loading anything. Immutable after construction.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class LoadPlan {
 public:
  /// Validates `config` and `shape`. Throws bspflow::Error naming the field, the value and
  /// what is allowed (a bad config, a zero dimension, replicas above kMaxReplicas), or for
  /// an empty dataset (with drop_last: one smaller than a combined batch), or an overflowing
  /// product.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  LoadPlan(StepShape shape, std::uint64_t dataset_size, const LoaderConfig& config);

  /// This instance's samples per epoch (the whole dataset with one instance).
  std::uint64_t dataset_size() const noexcept { return size_; }
  /// The whole dataset's samples, over every instance.
  std::uint64_t total_size() const noexcept { return total_; }
  /// Samples per micro-batch.
  std::size_t batch_size() const noexcept { return batch_; }
  /// Replicas per step (this instance's).
  std::uint32_t replicas() const noexcept { return shape_.replicas; }
  /// Micro-batches per replica per step: device iterations x gradient accumulation.
  std::uint64_t per_replica() const noexcept { return per_replica_; }
  /// Micro-batches per step over every replica: per_replica() x replicas().
  std::uint64_t micro_batches_per_step() const noexcept { return per_replica_ * shape_.replicas; }
  /// Samples per step: micro_batches_per_step() x batch_size().
  std::uint64_t samples_per_step() const noexcept { return per_step_; }
  /// Steps one epoch makes (the same in every instance).
  std::uint64_t steps_per_epoch() const noexcept { return steps_; }
  /// With several instances: dropped by all of them together (the remainder included).
  std::uint64_t dropped_per_epoch() const noexcept { return dropped_; }
  /// Padding samples this instance adds to its last step each epoch (0 with drop_last).
  std::uint64_t padded_per_epoch() const noexcept { return padded_; }
  /// "combined batch 16 batch x 50 device iterations x 1 gradient accumulation x 2 replicas
  /// = 1600 samples; 10000 samples -> 6 steps per epoch, drop_last drops 400".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;
  /// The drop (or pad) notice the loader logs once; empty when nothing is dropped or padded.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string remainder_notice() const;

  /// Position in the epoch order of sample k of micro-batch m (iteration-major) of a step.
  std::uint64_t position(std::uint64_t step, std::uint64_t m, std::size_t k) const noexcept {
    return step * per_step_ + m * batch_ + k;
  }
  /// The epoch's order (position -> dataset index): a seeded Fisher-Yates shuffle of
  /// 0..total_size()-1 from (seed, epoch), the same in every instance. Only called when
  /// shuffling. Allocates total_size() indices.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::vector<std::uint64_t> shuffled_order(std::uint64_t epoch) const;
  /// The dataset index at this instance's position `pos` (< dataset_size()): through
  /// `order` when shuffling (null: not).
  std::uint64_t index_at(std::uint64_t pos,
                         const std::vector<std::uint64_t>* order) const noexcept {
    return order != nullptr ? (*order)[offset_ + pos] : offset_ + pos;
  }
  /// Whether this loader should log remainder_notice() (instance 0 speaks for all).
  bool reports() const noexcept { return instance_ == 0; }

 private:
  std::string describe_step() const;
  StepShape shape_;
  std::uint64_t size_;   ///< this instance's share
  std::uint64_t total_;  ///< the dataset
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

}  // namespace bspflow
