// The schedule arithmetic (see bspflow/pipeline/pipeline.hpp): what a config needs, and where
// each forward and backward pass falls in a Grouped, Interleaved or Sequential schedule.
#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/pipeline/detail/pipeline_impl.hpp"
#include "bspflow/pipeline/pipeline.hpp"

namespace bspflow {

const char* to_string(ExecutionStrategy v) noexcept {
  switch (v) {
    case ExecutionStrategy::kPipelined:
      return "pipelined";
    case ExecutionStrategy::kSharded:
      return "sharded";
    case ExecutionStrategy::kSingle:
      return "single";
  }
  return "?";
}
const char* to_string(PipelineSchedule v) noexcept {
  switch (v) {
    case PipelineSchedule::kGrouped:
      return "grouped";
    case PipelineSchedule::kInterleaved:
      return "interleaved";
    case PipelineSchedule::kSequential:
      return "sequential";
  }
  return "?";
}
const char* to_string(SyncMode v) noexcept {
  return v == SyncMode::kBsp ? "bsp" : "dataflow";
}

void Stage::backward(const StageContext&, BackwardArgs&) {
  throw Error("stage '" + name() +
              "' has no backward pass: training needs one (or set "
              "PipelineConfig::training = false for inference)");
}
void Stage::update(const StageContext&, std::span<const float>) {}

// ---- config and plan ----

PipelineConfig PipelineConfig::from(const Options& options) {
  PipelineConfig c;
  static_cast<HostIO&>(c) = options.host_io();
  c.replicas = options.replicas();
  c.gradient_accumulation = options.gradient_accumulation();
  c.precision = options.precision();
  c.device_link = options.device_link();
  c.stall = options.stall_check();
  return c;
}

std::uint32_t PipelineConfig::devices_per_replica(std::uint32_t stages) const noexcept {
  if (strategy == ExecutionStrategy::kSingle) return 1;
  return device_mapping.empty() ? stages : device_mapping.back() + 1;
}

std::uint32_t PipelineConfig::devices_needed(std::uint32_t stages) const noexcept {
  return devices_per_replica(stages) * replicas;
}

PipelineSchedule PipelineConfig::effective_schedule() const noexcept {
  if (schedule) return *schedule;
  return strategy == ExecutionStrategy::kPipelined ? PipelineSchedule::kGrouped
                                                   : PipelineSchedule::kSequential;
}

std::uint32_t PipelineConfig::min_gradient_accumulation(std::uint32_t stages) const noexcept {
  if (!training) return 1;
  switch (effective_schedule()) {
    case PipelineSchedule::kGrouped:
      return 2 * stages - 1;
    case PipelineSchedule::kInterleaved:
      return stages;
    case PipelineSchedule::kSequential:
      return 1;
  }
  return 1;
}

void PipelineConfig::validate(std::uint32_t stages) const {
  if (stages == 0) throw Error("a pipeline needs at least one stage");
  if (replicas == 0) detail::throw_bad_value("replicas", replicas, "must be at least 1");
  if (gradient_accumulation == 0) {
    detail::throw_bad_value("gradient_accumulation", gradient_accumulation, "must be at least 1");
  }
  precision.validate();
  // The Engine's own rules for what it is given (I/O tiles, prefetch depth, both links),
  // checked here so a bad config is refused before anything is built.
  engine_config_of(*this).validate();
  // Sharded and single run one stage at a time: the Sequential schedule, the only one they
  // can honour (with one stage every schedule is the same).
  if (strategy != ExecutionStrategy::kPipelined && schedule &&
      *schedule != PipelineSchedule::kSequential && stages > 1) {
    detail::throw_bad_value(
        "schedule", to_string(*schedule),
        std::string("must be unset or sequential with strategy ") + to_string(strategy) +
            (strategy == ExecutionStrategy::kSharded
                 ? ", which runs one stage at a time (the Sequential schedule)"
                 : ", which runs a replica's " + std::to_string(stages) +
                       " stages one after another on one device (the Sequential schedule)") +
            "; for another schedule use strategy pipelined");
  }
  if (sync == SyncMode::kDataflow && strategy != ExecutionStrategy::kPipelined) {
    throw Error(std::string("sync mode dataflow hands activations between concurrently running "
                            "stages; it applies to strategy pipelined, not ") +
                to_string(strategy) + " (use sync mode bsp)");
  }
  if (!device_mapping.empty()) {
    if (device_mapping.size() != stages) {
      throw Error("device_mapping has " + std::to_string(device_mapping.size()) + " entries for " +
                  std::to_string(stages) + " stages: it needs one per stage (the device of each)");
    }
    if (device_mapping.front() != 0) {
      detail::throw_bad_value("device_mapping[0]", device_mapping.front(),
                              "must be 0 (the replica's first device)");
    }
    for (std::size_t s = 1; s < device_mapping.size(); ++s) {
      const std::uint32_t prev = device_mapping[s - 1], here = device_mapping[s];
      if (here != prev && here != prev + 1) {
        detail::throw_bad_value("device_mapping[" + std::to_string(s) + "]", here,
                                "must be " + std::to_string(prev) + " or " +
                                    std::to_string(prev + 1) +
                                    ": consecutive stages share a device or move to the next one");
      }
    }
    if (strategy == ExecutionStrategy::kSingle) {
      throw Error(
          "device_mapping places stages on several devices, but strategy single puts all stages "
          "of a replica on one device: use strategy pipelined or sharded, or no mapping");
    }
    if (sync == SyncMode::kDataflow) {
      throw Error(
          "device_mapping with sync mode dataflow is not supported: a device running two stages "
          "would wait on a hand-off only its other stage can fill; use sync mode bsp");
    }
  }
  const std::uint32_t min = min_gradient_accumulation(stages);
  if (gradient_accumulation < min) {
    throw Error("gradient_accumulation = " + std::to_string(gradient_accumulation) +
                " is too small for the " + to_string(effective_schedule()) + " schedule over " +
                std::to_string(stages) + " stages: it must be at least " + std::to_string(min) +
                (effective_schedule() == PipelineSchedule::kGrouped ? " (2N-1)" : " (N)") +
                " so that every stage has work in the same cycle; or use a schedule that needs "
                "fewer (Interleaved: N, Sequential: 1)");
  }
}

std::uint64_t PipelinePlan::cycles() const noexcept {
  const std::uint64_t n = stages, k = micro_batches;
  if (!training) return schedule == PipelineSchedule::kSequential ? n * k : k + n - 1;
  switch (schedule) {
    case PipelineSchedule::kGrouped:
      return k + 2 * (n - 1);
    case PipelineSchedule::kInterleaved:
      return 2 * k + 2 * n - 2;
    case PipelineSchedule::kSequential:
      return 2 * n * k;
  }
  return 0;
}

CycleWork PipelinePlan::at(std::uint32_t stage, std::uint64_t cycle) const noexcept {
  const std::int64_t n = stages, k = micro_batches, s = stage, c = static_cast<std::int64_t>(cycle);
  auto valid = [k](std::int64_t i) { return i >= 0 && i < k ? i : -1; };
  CycleWork w;
  if (schedule == PipelineSchedule::kSequential) {
    const std::int64_t slots = training ? 2 * n : n;
    const std::int64_t i = c / slots, r = c % slots;
    if (r == s) w.forward = valid(i);
    if (training && r == 2 * n - 1 - s) w.backward = valid(i);
    return w;
  }
  if (!training) {
    w.forward = valid(c - s);
    return w;
  }
  if (schedule == PipelineSchedule::kGrouped) {
    w.forward = valid(c - s);
    w.backward = valid(c - 2 * (n - 1) + s);
    return w;
  }
  // Interleaved: forward cycles have the parity of s, backward cycles the other one.
  if (c >= s && (c - s) % 2 == 0) w.forward = valid((c - s) / 2);
  const std::int64_t t = c - (2 * n - 1 - s);
  if (t >= 0 && t % 2 == 0) w.backward = valid(t / 2);
  return w;
}

std::uint32_t PipelinePlan::fifo_depth(std::uint32_t stage) const noexcept {
  if (!training) return 0;
  switch (schedule) {
    case PipelineSchedule::kGrouped:
      return 2 * (stages - 1 - stage);
    case PipelineSchedule::kInterleaved:
      return stages - 1 - stage;
    case PipelineSchedule::kSequential:
      return 0;
  }
  return 0;
}

}  // namespace bspflow
