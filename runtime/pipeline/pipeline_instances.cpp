// A distributed Pipeline (PipelineConfig::distributed over several instances): joining the
// other instances at construction, and making one run's end the same in every instance.
// The per-step exchange is bspflow/instance/internal/instance_reduction.hpp; the device side
// of it is the step end in pipeline_compiler.cpp (step_end) and stage_execution.cpp
// (local_sum, weights_checksum, finish_reduce).
#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "bspflow/base/log.hpp"
#include "bspflow/instance/internal/instance_wire.hpp"
#include "bspflow/pipeline/detail/pipeline_impl.hpp"

namespace bspflow {

namespace {

#ifdef NDEBUG
constexpr std::uint32_t kDefaultWeightCheck = 100;
#else
constexpr std::uint32_t kDefaultWeightCheck = 1;
#endif

// What every instance must have built the same: named values, compared with instance 0's.
struct Shape {
  std::vector<std::string> names;
  std::vector<std::uint64_t> values;
  void add(std::string name, std::uint64_t v) {
    names.push_back(std::move(name));
    values.push_back(v);
  }
  // As floats (InstanceWire::put64: a broadcast carries them unchanged).
  std::vector<float> encoded() const {
    std::vector<float> out(values.size() * detail::InstanceWire::kWords);
    for (std::size_t i = 0; i < values.size(); ++i)
      detail::InstanceWire::put64(&out[i * detail::InstanceWire::kWords], values[i]);
    return out;
  }
};

// Ends (codes) of one instance's run, exchanged after it.
enum End : std::uint32_t {
  kCompletedEnd = 0,
  kEndedEnd = 1,
  kCancelledEnd = 2,
  kFailedEnd = 3,
  kPeerEnd = 4
};
constexpr std::size_t kEndFields = 5;  // code, global replica, step (3)
constexpr std::uint32_t kNoReplica = (1u << 22) - 1;

}  // namespace

void Pipeline::Impl::join_instances(Instance& inst) {
  // 0. Every instance built its pipeline (one that failed said so with all_agree(false)).
  if (!inst.all_agree(true)) {
    throw Error(
        "distributed Pipeline: another instance failed to build its pipeline (its error says why), "
        "so "
        "instance " +
        std::to_string(inst.index()) + " of " + std::to_string(inst.count()) + " stops too");
  }
  // 1. The same pipeline everywhere: what the per-step exchange's length and meaning
  // depend on. Instance 0's shape is broadcast and each instance compares its own.
  Shape shape;
  shape.add("training", config.training ? 1 : 0);
  shape.add("stages", stages);
  shape.add("local replicas (PipelineConfig::replicas)", config.replicas);
  shape.add("gradient_accumulation", config.gradient_accumulation);
  shape.add("strategy", static_cast<std::uint64_t>(config.strategy));
  shape.add("devices per replica", config.devices_per_replica(stages));
  shape.add("reduction", static_cast<std::uint64_t>(config.reduction));
  shape.add("mean style", static_cast<std::uint64_t>(config.mean));
  shape.add("precision.partials", static_cast<std::uint64_t>(config.precision.partials));
  shape.add("precision.loss_scaling (bits)",
            std::bit_cast<std::uint32_t>(config.precision.loss_scaling));
  shape.add("offload_optimizer", config.offload_optimizer ? 1 : 0);
  shape.add("exchange_bucket_bytes", config.exchange_bucket_bytes);
  for (std::uint32_t s = 0; s < stages; ++s) {
    StageRun& sr = run_of(0, s);
    const std::string of = " of stage " + std::to_string(s);
    shape.add("gradient_elements()" + of, sr.grads.size());
    shape.add("weights() size" + of, sr.stage->weights().size());
    shape.add("optimizer_state() size" + of, sr.stage->optimizer_state().size());
    shape.add("device slot" + of, slot_of(sr));
  }
  std::vector<float> mine = shape.encoded(), theirs = mine;
  inst.broadcast(theirs, 0);
  std::string differs;
  for (std::size_t i = 0; i < shape.values.size() && differs.empty(); ++i) {
    const std::uint64_t zero =
        detail::InstanceWire::get64(theirs.data() + detail::InstanceWire::kWords * i);
    if (zero != shape.values[i]) {
      differs = shape.names[i] + " is " + std::to_string(shape.values[i]) + " here, " +
                std::to_string(zero) + " in instance 0";
    }
  }
  if (!inst.all_agree(differs.empty())) {
    throw Error(
        "distributed Pipeline: instance " + std::to_string(inst.index()) + " of " +
        std::to_string(inst.count()) +
        (differs.empty()
             ? std::string(": another instance built a different pipeline than instance 0 (its "
                           "error says what differs)")
             : ": the pipeline differs from instance 0's: " + differs) +
        "; every instance must build the same stages with the same config (replicas = its local "
        "replicas)");
  }
  // 2. Every instance starts from instance 0's weights and optimiser state; the local
  // replicas from their instance's replica 0.
  for (std::uint32_t s = 0; s < stages; ++s) {
    StageRun& head = run_of(0, s);
    const std::span<float> w = head.stage->weights();
    const std::span<float> state = config.offload_optimizer ? std::span<float>(head.host_state)
                                                            : head.stage->optimizer_state();
    if (!w.empty()) inst.broadcast(w, 0);
    if (!state.empty()) inst.broadcast(state, 0);
    for (std::uint32_t r = 1; r < config.replicas; ++r) {
      StageRun& peer = run_of(r, s);
      const std::span<float> pw = peer.stage->weights();
      if (pw.size() == w.size()) std::copy(w.begin(), w.end(), pw.begin());
      if (config.offload_optimizer) {
        peer.host_state = head.host_state;
      } else if (const std::span<float> ps = peer.stage->optimizer_state();
                 ps.size() == state.size()) {
        std::copy(state.begin(), state.end(), ps.begin());
      }
    }
  }
  if (!config.training) return;  // inference: each instance answers its own requests
  // 3. The per-step exchange: one segment per device slot of a replica (its stages'
  // gradients in stage order).
  const std::uint32_t slots =
      config.strategy == ExecutionStrategy::kSingle ? 1 : config.devices_per_replica(stages);
  std::vector<std::size_t> sizes(slots, 0);
  for (std::uint32_t s = 0; s < stages; ++s) {
    const std::uint32_t slot = slot_of(run_of(0, s));
    for (std::uint32_t r = 0; r < config.replicas; ++r) run_of(r, s).wire_at = sizes[slot];
    sizes[slot] += run_of(0, s).grads.size();
  }
  instance = &inst;
  across = std::make_unique<detail::InstanceReduction>(
      inst, std::move(sizes), config.weight_check_interval.value_or(kDefaultWeightCheck),
      config.exchange_bucket_bytes);
}

PipelineResult Pipeline::Impl::settle_across(PipelineResult local,
                                             const std::exception_ptr& failure,
                                             std::uint64_t steps) {
  Instance& inst = *instance;
  const std::uint32_t me = inst.index(), count = inst.count();
  const InstanceLayout layout = inst.layout(config.replicas * count);
  // An MPI error here may be this instance's alone; the others would wait for ever.
  auto collective = [&inst](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      log(LogLevel::kError, std::string("distributed Pipeline: the exchange after a run failed (") +
                                e.what() + "): ending every instance");
      inst.abort(1);
    }
  };
  // This instance's end.
  std::uint32_t code = kCompletedEnd, replica = kNoReplica;
  std::uint64_t step = across->applied_steps();
  std::string text;
  if (failure) {
    code = kFailedEnd;
    try {
      std::rethrow_exception(failure);
    } catch (const StageError& e) {
      replica = layout.global_replica(e.replica());
      step = e.step();
      text = e.what();
    } catch (...) {
      text = detail::describe_exception(std::current_exception());
    }
  } else if (local.status == RunStatus::kEndOfData) {
    code = kEndedEnd;
    replica = layout.global_replica(ended_replica);
  } else if (local.status == RunStatus::kCancelled) {
    code = across->stopped_by_peer() ? kPeerEnd : kCancelledEnd;
  }
  std::vector<float> ends(std::size_t{count} * kEndFields, 0.0f);
  float* at = ends.data() + std::size_t{me} * kEndFields;
  at[0] = static_cast<float>(code);
  at[1] = static_cast<float>(replica);
  detail::InstanceWire::put64(at + 2, step);
  collective([&] { inst.allreduce_sum(ends); });
  // The first instance (by index) with the weightiest end speaks for the run.
  std::uint32_t who = count, worst = kCompletedEnd;
  for (const End kind : {kFailedEnd, kEndedEnd, kCancelledEnd}) {
    for (std::uint32_t i = 0; i < count && who == count; ++i) {
      if (static_cast<std::uint32_t>(ends[i * kEndFields]) == kind) {
        who = i;
        worst = kind;
      }
    }
  }
  const std::uint64_t applied = across->applied_steps();
  const std::string everywhere = std::to_string(applied) + " step(s) applied in every instance";
  if (worst == kFailedEnd) {
    collective([&] { detail::InstanceWire::broadcast_text(inst, text, who); });
    const float* w = ends.data() + std::size_t{who} * kEndFields;
    const auto their_replica = static_cast<std::uint32_t>(w[1]);
    const std::uint64_t their_step = detail::InstanceWire::get64(w + 2);
    const std::string where = "instance " + std::to_string(who) + " of " + std::to_string(count);
    if (who == me || code == kFailedEnd) {
      if (count == 1) std::rethrow_exception(failure);
      try {
        std::rethrow_exception(failure);
      } catch (const StageError& e) {
        throw StageError("instance " + std::to_string(me) + " of " + std::to_string(count) +
                             " (global replica " +
                             std::to_string(layout.global_replica(e.replica())) + "): " + e.what() +
                             "; " + everywhere,
                         e.stage(), e.device(), e.replica(), e.step(), e.micro_batch(), e.cause());
      }
    }
    throw InstanceError(where + " failed at step " + std::to_string(their_step) +
                            (their_replica == kNoReplica
                                 ? std::string()
                                 : " (global replica " + std::to_string(their_replica) + ")") +
                            ": " + text + "; this instance stopped with it: " + everywhere,
                        who, their_replica, their_step);
  }
  if (!across->mismatch().empty()) {
    throw InstanceError("distributed Pipeline: " + across->mismatch() + "; " + everywhere,
                        across->mismatch_instance(), kNoReplica, applied);
  }
  local.iterations = applied;
  if (count == 1 && worst != kCompletedEnd) return local;  // its own words say it all
  if (worst == kCompletedEnd && applied < steps) {
    // Every device ran to its end, but an instance stopped before one step's exchange (a
    // cancel after its devices' last look at the stop flag): that step was applied nowhere.
    const std::uint32_t who_stopped = across->stopped_instance();
    local.status = RunStatus::kCancelled;
    local.message =
        count == 1
            ? "cancelled at step " + std::to_string(applied) + ": " + std::to_string(applied) +
                  " step(s) applied"
            : (who_stopped == me
                   ? "this instance (" + std::to_string(me) + " of " + std::to_string(count) + ")"
                   : "instance " + std::to_string(who_stopped) + " of " + std::to_string(count)) +
                  " stopped at step " + std::to_string(applied) + ": " + everywhere;
    return local;
  }
  if (worst == kCompletedEnd) return local;
  const float* w = ends.data() + std::size_t{who} * kEndFields;
  const auto their_replica = static_cast<std::uint32_t>(w[1]);
  const std::string where =
      who == me ? "this instance (" + std::to_string(me) + " of " + std::to_string(count) + ")"
                : "instance " + std::to_string(who) + " of " + std::to_string(count);
  if (worst == kEndedEnd) {
    local.status = RunStatus::kEndOfData;
    local.message = "the infeed of " + where + " (global replica " + std::to_string(their_replica) +
                    ") ended at step " + std::to_string(applied) + ": " + everywhere +
                    ", the cut-short step in none" +
                    (who == me ? " (" + local.message + ")" : std::string());
  } else {
    local.status = RunStatus::kCancelled;
    local.message = where + " was cancelled at step " + std::to_string(applied) + ": " + everywhere;
  }
  return local;
}

}  // namespace bspflow
