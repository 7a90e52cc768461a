// LoaderConfig's checks and the load plan: sizes, epochs, what is dropped or padded, the
// per-epoch order (bspflow/data/loader_config.hpp, bspflow/data/load_plan.hpp).
#include "bspflow/data/load_plan.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "bspflow/base/detail/random.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/data/loader_config.hpp"

namespace bspflow {

const char* to_string(LoaderMode m) noexcept {
  return m == LoaderMode::kSync ? "sync" : "async";
}

void LoaderConfig::validate() const {
  if (batch_size < 1) detail::throw_bad_value("batch_size", batch_size, "must be at least 1");
  if (instances < 1 || instances > tunables::kMaxReplicas) {
    detail::throw_bad_value("instances", instances,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
  if (instance >= instances) {
    detail::throw_bad_value("instance", instance,
                            "must be below instances (" + std::to_string(instances) + ")");
  }
  if (num_workers > tunables::kMaxLoaderWorkers) {
    detail::throw_bad_value("num_workers", num_workers,
                            "must be at most " + std::to_string(tunables::kMaxLoaderWorkers));
  }
  if (mode == LoaderMode::kAsync) {
    // num_workers = 0 is accepted, as PopTorch's asynchronous loader (its own process) is:
    // one background thread loads (LoaderCore::worker_count()).
    if (buffer_size < 1 || buffer_size > tunables::kMaxLoaderBuffer) {
      detail::throw_bad_value("buffer_size", buffer_size,
                              "must be in 1.." + std::to_string(tunables::kMaxLoaderBuffer));
    }
    if (load_indefinitely && !persistent_workers) {
      throw Error(
          "load_indefinitely = true needs persistent_workers = true: workers that keep "
          "loading into the next epoch cannot stop at the end of this one");
    }
  } else {
    if (early_preload) {
      throw Error(
          "early_preload = true needs mode async (in sync mode nothing loads before "
          "the consumer asks for a step)");
    }
    if (load_indefinitely) {
      throw Error(
          "load_indefinitely = true needs mode async (in sync mode nothing loads "
          "before the consumer asks for a step)");
    }
  }
}

namespace {

std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const char* what) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
    throw Error(std::string("DataLoader: ") + what + " overflows 64 bits");
  }
  return a * b;
}

}  // namespace

LoadPlan::LoadPlan(StepShape shape, std::uint64_t dataset_size, const LoaderConfig& config)
    : shape_(shape), size_(dataset_size), total_(dataset_size), instance_(config.instance),
      instances_(config.instances), batch_(config.batch_size), seed_(config.seed),
      drop_last_(config.drop_last) {
  config.validate();
  if (shape_.device_iterations < 1) {
    detail::throw_bad_value("device_iterations", shape_.device_iterations, "must be at least 1");
  }
  if (shape_.gradient_accumulation < 1) {
    detail::throw_bad_value("gradient_accumulation", shape_.gradient_accumulation,
                            "must be at least 1");
  }
  if (shape_.replicas < 1 || shape_.replicas > tunables::kMaxReplicas) {
    detail::throw_bad_value("replicas", shape_.replicas,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
  per_replica_ = checked_mul(shape_.device_iterations, shape_.gradient_accumulation,
                             "device iterations x gradient accumulation");
  per_step_ = checked_mul(checked_mul(per_replica_, shape_.replicas, "micro-batches per step"),
                          batch_, "samples per step");
  if (total_ == 0) throw Error("DataLoader: the dataset is empty (size() is 0)");
  if (total_ < instances_) {
    throw Error("DataLoader: the dataset has " + std::to_string(total_) +
                " samples, fewer than the " + std::to_string(instances_) +
                " instances it is split between");
  }
  // This instance's slice of the epoch order (see LoaderConfig::instances).
  const std::uint64_t base = total_ / instances_, rem = total_ % instances_;
  if (drop_last_) {
    size_ = base;
    offset_ = instance_ * base;
    steps_ = size_ / per_step_;
    dropped_ = total_ - instances_ * steps_ * per_step_;  // every instance's, and the remainder
    if (steps_ == 0) {
      throw Error("DataLoader: the dataset has " + std::to_string(size_) + " samples" +
                  (instances_ > 1 ? " per instance (" + std::to_string(total_) + " over " +
                                        std::to_string(instances_) + " instances)"
                                  : std::string()) +
                  ", fewer than one step needs (" + describe_step() +
                  "), so drop_last would drop them all; use a smaller batch_size, fewer "
                  "device iterations, or drop_last = false");
    }
  } else {
    size_ = base + (instance_ < rem ? 1 : 0);
    offset_ = instance_ * base + std::min<std::uint64_t>(instance_, rem);
    const std::uint64_t largest = base + (rem != 0 ? 1 : 0);  // every instance runs as many steps
    steps_ = largest / per_step_ + (largest % per_step_ != 0 ? 1 : 0);
    padded_ = steps_ * per_step_ - size_;
  }
}

std::string LoadPlan::describe_step() const {
  return "combined batch " + std::to_string(batch_) + " batch x " +
         detail::count_of(shape_.device_iterations, "device iteration") + " x " +
         std::to_string(shape_.gradient_accumulation) + " gradient accumulation x " +
         detail::count_of(shape_.replicas, "replica") + " = " +
         detail::count_of(per_step_, "sample");
}

std::string LoadPlan::describe() const {
  std::string s = describe_step() + "; " + detail::count_of(size_, "sample") + " -> " +
                  detail::count_of(steps_, "step") + " per epoch";
  if (instances_ > 1) {
    s += " (instance " + std::to_string(instance_) + " of " + std::to_string(instances_) +
         ": positions " + std::to_string(offset_) + ".." + std::to_string(offset_ + size_ - 1) +
         " of " + std::to_string(total_) + ")";
  }
  if (dropped_ != 0) s += ", drop_last drops " + std::to_string(dropped_);
  if (padded_ != 0) s += ", last step padded with " + std::to_string(padded_);
  return s;
}

std::string LoadPlan::remainder_notice() const {
  if (dropped_ != 0) {
    return "DataLoader: drop_last drops " + std::to_string(dropped_) + " of " +
           std::to_string(total_) + " samples every epoch: " + std::to_string(total_) + " = " +
           (instances_ > 1 ? std::to_string(instances_) + " instances x " : std::string()) +
           detail::count_of(steps_, "step") + " x " + std::to_string(per_step_) + " + " +
           std::to_string(dropped_) + " (" + describe_step() +
           "). Set drop_last = false to keep them (the last step is then padded with label "
           "-1 samples), or choose sizes that divide the dataset.";
  }
  if (!drop_last_ && instances_ > 1 && steps_ * per_step_ * instances_ != total_) {
    const std::uint64_t padding = steps_ * per_step_ * instances_ - total_;
    return "DataLoader: the last step of every epoch is padded with " + std::to_string(padding) +
           " samples over the " + std::to_string(instances_) +
           " instances (zeros, label -1; Batch::valid counts the real ones; an instance's last "
           "step may "
           "hold padding only), because " +
           std::to_string(total_) + " is not a multiple of " + std::to_string(instances_) +
           " instances x the " + describe_step() + ".";
  }
  if (padded_ != 0) {
    return "DataLoader: the last step of every epoch holds " + std::to_string(per_step_ - padded_) +
           " real samples and " + std::to_string(padded_) +
           " padding samples (zeros, label -1; Batch::valid counts the real ones), because " +
           std::to_string(size_) + " is not a multiple of the " + describe_step() + ".";
  }
  return {};
}

std::vector<std::uint64_t> LoadPlan::shuffled_order(std::uint64_t epoch) const {
  std::vector<std::uint64_t> order(total_);
  for (std::uint64_t i = 0; i < total_; ++i) order[i] = i;
  std::uint64_t state = seed_ ^ detail::splitmix64(epoch);
  // Fisher-Yates with unbiased bounded draws (rejection), so the order is the same on
  // every platform and standard library.
  for (std::uint64_t i = total_; i > 1; --i) {
    const std::uint64_t threshold = (0 - i) % i;
    std::uint64_t r = detail::splitmix64(state);
    while (r < threshold) r = detail::splitmix64(state);
    std::swap(order[i - 1], order[r % i]);
  }
  return order;
}

}  // namespace bspflow
