// Internal (not installed): a Pipeline's state, and stage execution (a stage's forward and
// backward passes, the gradient reduction and the update, as its device runs them). The
// compiler from a config to device programs is pipeline_compiler.cpp; the host call is
// pipeline.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "bspflow/devices/host_link_timeline.hpp"
#include "bspflow/engine/engine.hpp"
#include "bspflow/feeds/spsc_ring.hpp"
#include "bspflow/instance/instance.hpp"
#include "bspflow/instance/internal/instance_reduction.hpp"
#include "bspflow/pipeline/pipeline.hpp"
#include "bspflow/run/internal/cancel_gate.hpp"

namespace bspflow {

using Clock = std::chrono::steady_clock;
// The input ended mid-run in training (thrown by stage 0, turned into kEndOfData).
struct EndOfInput {
  std::uint64_t step;
  std::uint64_t micro_batch;
  std::uint32_t replica;
};
// dataflow: the hand-off between neighbouring stages, a ring of activation (or gradient)
// buffers the producer fills in place (claim, publish) and the consumer reads in place.
using Handoff = SpscRing<std::vector<float>>;

// What a Pipeline's Engine runs with: the links, the I/O tiles and prefetch depth, tracing.
EngineConfig engine_config_of(const PipelineConfig& config);

// The memory plan's input: one stage of one replica as declared, and where it runs.
struct StageShape {
  std::uint32_t s = 0, r = 0;
  std::uint32_t device = 0;  // index into MemoryInputs::devices
  std::string name;
  std::size_t in = 0, out = 0, gradients = 0, parameters = 0, optimizer = 0, working = 0;
  std::size_t saved = StageMemory::kAuto;
  bool stash_input = true;  // StageRun::stash_input
};
struct MemoryInputs {
  PipelineConfig config;
  PipelinePlan plan;  // training: one step's schedule (the stash depths)
  std::uint32_t stages = 0;
  std::vector<StageShape> shapes;                              // replica-major
  std::vector<std::pair<std::uint32_t, std::size_t>> devices;  // device id, bytes available
  std::vector<std::size_t> io_tile_bytes;  // per device: io_tiles x its bytes per tile
  std::size_t handoff_capacity = 0;        // dataflow: messages per hand-off
};
// Every tensor of every device (largest first), without suggestions. Allocates; throws only
// std::bad_alloc.
MemoryReport plan_memory(const MemoryInputs& in);
// plan_memory plus, when a device does not fit, what would help (each alternative planned).
MemoryReport plan_memory_with_advice(const MemoryInputs& in);

struct Pipeline::Impl {
  struct Stashed {
    std::uint64_t micro_batch = 0;
    std::vector<float> input;
    std::vector<float> saved;
  };

  // One stage of one replica, and everything its device keeps for it.
  struct StageRun {
    Stage* stage = nullptr;
    std::uint32_t s = 0, r = 0;
    Device* device = nullptr;
    std::size_t in_elements = 0, out_elements = 0;
    // bsp: outputs by cycle parity (neighbours pull the one written this cycle), inputs
    // filled by this device's own exchange.
    Buffer out_fwd[2], out_bwd[2], in_fwd, in_bwd;
    // dataflow: hand-offs with the neighbours.
    Handoff* fwd_in = nullptr;
    Handoff* fwd_out = nullptr;
    Handoff* bwd_in = nullptr;
    Handoff* bwd_out = nullptr;
    WaitPolicy wait;  // how this stage waits on its hand-offs (capped when sharing a core)
    // single: the neighbour on the same device reads these directly.
    std::vector<float> local_out, local_grad;
    std::vector<float> scratch;  // recomputation's output
    // bsp in half precision: the fp32 values a pass reads from (writes to) an fp16
    // exchange buffer.
    std::vector<float> wide_in, wide_out;
    std::size_t saved_limit = StageMemory::kAuto;  // what memory() declared forward saves
    // Training: each forward pass's input goes into its stash entry (backward reads it, or
    // recomputation runs the pass again from it).
    bool stash_input = true;
    // The host link (stage 0: micro-batches in; the last stage: outputs out).
    HostLinkTimeline link;
    bool synthetic_ready = false;  // synthetic data: the ring holds the run's micro-batch
    bool polled_empty =
        false;  // inference, stage 0: the lane was empty at a take since the last one
    std::deque<Stashed> fifo;
    std::vector<Stashed> spare;  // recycled FIFO entries (no allocation in steady state)
    // Inference: what a forward pass saves (nothing is stashed), its room kept from one
    // micro-batch to the next.
    std::vector<float> unstashed;
    std::vector<float> grads, accum, reduced;
    // What this step's update reads (finish_reduce): sr.reduced, or its slot's segment of
    // the exchange across instances.
    std::span<const float> update_from;
    std::vector<float> host_state;  // offloaded optimiser state, between updates

    // Offload: the optimiser state to host memory (zeroed on the device: not resident)
    // and back. Each returns the bytes moved.
    std::size_t state_to_host() {
      const std::span<float> state = stage->optimizer_state();
      host_state.assign(state.begin(), state.end());
      std::fill(state.begin(), state.end(), 0.0f);
      return state.size_bytes();
    }
    std::size_t state_from_host() {
      const std::span<float> state = stage->optimizer_state();
      std::copy(host_state.begin(), host_state.end(), state.begin());
      return state.size_bytes();
    }
    // This run's modeled costs in ns (stage_execution.cpp charges them to the device's
    // clock as the passes run; < 0: the stage declared none): a forward pass, a backward
    // pass, an optimiser step; and the tiles its device computes on.
    double forward_ns = -1, backward_ns = -1, update_ns = -1;
    std::uint32_t compute_tiles = 1;
    std::uint32_t accumulated = 0;
    bool apply = true;          // this step's update is applied (complete; distributed: everywhere)
    std::uint64_t updates = 0;  // updates applied this run
    std::size_t wire_at = 0;    // distributed: where its gradients sit in its slot's segment
    // Distributed, the first stage of replica 0's device: its weights' checksum for this
    // step's exchange (when one is due).
    std::uint64_t weight_checksum = 0;
    std::uint64_t cycle = 0, next_cycle = 0, step = 0, micro_batch = 0;
    std::uint32_t max_fifo = 0;
    std::uint64_t forwards = 0;
    // Inference (see compile_inference): stage 0 takes micro-batches as they come and the
    // others follow what reaches them, until the infeed ends or the run's count is taken.
    std::uint64_t taken = 0;      // stage 0: micro-batches taken off the lane this run
    std::uint64_t last_take = 0;  // stage 0, bsp: the cycle of the latest take
    bool ended = false;           // stage 0: the lane closed and drained (end of data)
    bool done = false;            // dataflow: the end has passed through this stage
    bool got = false;             // single: this trip took a micro-batch
    // bsp: the micro-batch this stage forwarded in the last cycle of each parity (-1: a
    // bubble), read by the next stage's exchange after the cycle's sync; and the one its
    // own exchange brought for the next cycle. The sync orders the writes and the reads.
    // Each on a cache line of its own: neighbours read them every cycle, and the stage's
    // other fields change every cycle. The two parities too: a stage writes the next
    // cycle's id as soon as the sync opens, while its neighbour reads this cycle's; on one
    // line the write took the line away from under the read.
    std::int64_t in_id = -1;
    struct alignas(tunables::kCacheLine) OutId {
      std::int64_t id = -1;
    };
    OutId out_id[2];
    // bsp, stage 0: the first cycle in which it took nothing and will take nothing more.
    // Written before that cycle's sync and read by every stage's loop condition; relaxed:
    // the sync orders it for the cycles whose exit depends on it (see compile_inference).
    alignas(tunables::kCacheLine) std::atomic<std::uint64_t> end_cycle{kNever};
    static constexpr std::uint64_t kNever = ~std::uint64_t{0};
    // stage 0 / last stage (the reader on a line of its own: it changes with every take)
    alignas(tunables::kCacheLine) std::optional<InfeedQueue<Batch>::Reader> reader;
    OutfeedQueue<std::vector<float>>::Writer* writer = nullptr;
    // The replica's ring, micro-batch i in slot i % size. Its pointer and size are held here,
    // on the stage's own line: read through the ring's vector (a header in a separate small
    // heap block), that read stalled stage 0 with every micro-batch (measured with rdtscp).
    std::span<Batch> batches;
  };

  PipelineConfig config;
  PipelinePlan plan;
  std::uint32_t stages = 0;
  std::vector<Device*> devices;                 // the ones used, in order
  std::vector<StageList> stage_lists;           // per replica
  std::vector<std::vector<Batch>> batches;      // per replica: a ring of micro-batches in flight
  std::vector<std::unique_ptr<StageRun>> runs;  // replica-major: r * stages + s
  std::vector<std::unique_ptr<Handoff>> handoffs;
  MemoryReport memory;
  // The plan's tensors other than the exchange buffers, held in the device arenas.
  struct Held {
    Arena* arena = nullptr;
    void* ptr = nullptr;
    Held(Arena& a, std::size_t bytes, const std::string& what)
        : arena(&a), ptr(a.allocate(bytes, what)) {}
    ~Held() { arena->release(ptr); }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
  };
  std::vector<std::unique_ptr<Held>> held;
  std::unique_ptr<Engine> engine;

  StageRun& run_of(std::uint32_t r, std::uint32_t s) { return *runs[r * stages + s]; }
  std::uint32_t device_of(std::uint32_t r, std::uint32_t s) const {
    if (config.strategy == ExecutionStrategy::kSingle) return r;
    return r * config.devices_per_replica(stages) +
           (config.device_mapping.empty() ? s : config.device_mapping[s]);
  }
  // A replica's stages on its device `slot` (0 .. devices_per_replica - 1), in order.
  std::vector<StageRun*> on_device(std::uint32_t r, std::uint32_t slot) {
    std::vector<StageRun*> out;
    for (std::uint32_t s = 0; s < stages; ++s) {
      if (device_of(r, s) == device_of(r, 0) + slot) out.push_back(&run_of(r, s));
    }
    return out;
  }
  std::uint64_t k() const noexcept { return config.gradient_accumulation; }

  StageContext context(const StageRun& sr, std::uint64_t micro_batch) const {
    return StageContext{sr.s,    sr.device->id(), sr.r,
                        sr.step, micro_batch,     config.precision.storage};
  }
  bool half_storage() const noexcept { return config.precision.storage == DType::kFloat16; }
  // Throws StageError if a forward pass saved more than the stage's memory() declared.
  void check_saved(const StageRun& sr, std::uint64_t i, const std::vector<float>& saved) const {
    if (saved.size() > sr.saved_limit) throw_saved_over(sr, i, saved.size());
  }
  [[noreturn]] void throw_saved_over(const StageRun& sr, std::uint64_t i, std::size_t saved) const;

  // bsp: one cycle's forward (backward) pass of `sr`, reading and writing its exchange
  // buffers by parity; in half precision through fp32 copies.
  void forward_exchanged(StageRun& sr, std::uint64_t i, std::uint64_t cycle, const StopFlag* stop);
  void backward_exchanged(StageRun& sr, std::uint64_t i, std::uint64_t cycle);

  // Runs `f` (a stage's pass); anything it throws becomes a StageError saying where.
  template <class F>
  void guarded(const StageRun& sr, std::uint64_t micro_batch, const char* pass, F&& f) {
    try {
      f();
    } catch (const StageError&) {
      throw;
    } catch (...) {
      const std::string what = detail::describe_exception(std::current_exception());
      throw StageError("stage " + std::to_string(sr.s) + " '" + sr.stage->name() + "' (device " +
                           std::to_string(sr.device->id()) + ", replica " + std::to_string(sr.r) +
                           ") failed in its " + pass + " pass at step " + std::to_string(sr.step) +
                           ", micro-batch " + std::to_string(micro_batch) + ": " + what,
                       sr.s, sr.device->id(), sr.r, sr.step, micro_batch, std::current_exception());
    }
  }

  // Host link, stage 0: micro-batch `b` was just taken from the lane (`waited`: the lane
  // was empty): waits for its modeled copy (sr.link). false: stopped.
  bool host_in(StageRun& sr, const Batch& b, bool waited, const StopFlag* stop);
  // Stage 0: the next micro-batch into ring slot `slot` (`block`: wait for one; `waited`:
  // set when it had to). With synthetic data the first of the run is read from the lane
  // and copied into every slot; the rest are already there. false: none (stopped, or the
  // lane ended, or none ready and not `block`).
  bool pop_input(StageRun& sr, Batch& slot, bool block, const StopFlag* stop, bool& waited);

  // The forward pass of micro-batch i: input from the previous stage (empty for stage 0),
  // output into `output`. false: the run was stopped.
  bool forward(StageRun& sr, std::uint64_t i, std::span<const float> input, std::span<float> output,
               const StopFlag* stop);

  // dataflow: forward pass i from `input` (the front of fwd_in; empty for stage 0) into a
  // claimed slot of fwd_out (the last stage: local_out), then the input is released and the
  // output published. Returns early, reading nothing, if stopped while waiting for room.
  void forward_handed_off(StageRun& sr, std::uint64_t i, std::span<const float> input,
                          const StopFlag* stop);

  // Inference, stage 0: the next micro-batch into the replica's ring. `block`: wait for one
  // (after handing over responses this device holds); else take one only if it is ready.
  enum class Take { kGot, kNone, kEnd, kStopped };
  Take take(StageRun& sr, const StopFlag* stop, bool block);

  // The backward pass of micro-batch i (the oldest in the FIFO).
  void backward(StageRun& sr, std::uint64_t i, std::span<const float> grad_output,
                std::span<float> grad_input);

  // After the step's micro-batches: the gradients summed over the local replicas (in
  // replica order, so every replica gets the same bits) into sr.reduced (distributed,
  // replica 0: into its slot's segment of the exchange across instances).
  void local_sum(StageRun& sr);
  // Distributed, replica 0's device of a slot, when a check is due: a checksum of its
  // stages' weights, which the step's exchange compares across the instances (see
  // bspflow/instance/internal/instance_reduction.hpp).
  static std::uint64_t weights_checksum(const std::vector<StageRun*>& on_device);
  // Then the sum (distributed: from the segment, if the step is applied everywhere, else
  // sr.apply = false) scaled for the reduction type over every replica, where
  // sr.update_from says.
  void finish_reduce(StageRun& sr, std::uint64_t step);
  // Replicas across every instance (config.replicas without distribution).
  std::uint32_t total_replicas() const noexcept {
    return config.replicas * (across ? instance->count() : 1);
  }

  // Host thread, before a run: each stage's declared costs at the run's precision, in ns.
  void cost_passes();
  // Device thread: a pass of `ns` (< 0: undeclared) on sr's device's modeled clock.
  static void charge(const StageRun& sr, double ns) noexcept {
    if (ns >= 0) {
      sr.device->clock().compute(ns);
    } else {
      sr.device->clock().undeclared();
    }
  }
  // Device thread: memory-bound work of `bytes` over sr's device's compute tiles.
  static void charge_bytes(const StageRun& sr, double bytes, double flops) noexcept {
    const DeviceModel& m = sr.device->config().model;
    sr.device->clock().compute(m.ns(m.compute_cycles(Work{flops, bytes}, sr.compute_tiles)));
  }

  void update(StageRun& sr) {
    if (!sr.apply) return;  // cut short, or (distributed) not applied in every instance
    ++sr.updates;
    const StageContext ctx = context(sr, k());
    guarded(sr, k(), "update", [&] { sr.stage->update(ctx, sr.update_from); });
    charge(sr, sr.update_ns);
    std::fill(sr.accum.begin(), sr.accum.end(), 0.0f);
    sr.accumulated = 0;
  }

  // Training: one trip per step (K micro-batches, one update). Inference has no updates to
  // wait for: one trip through all steps x K micro-batches, so the pipeline fills once.
  std::uint64_t outer_trips(std::uint64_t steps) const { return config.training ? steps : 1; }
  std::vector<Program> compile(std::uint64_t steps);
  // Training, pipelined or sharded: one device's program for the stages it runs (one, or
  // several consecutive ones with a device mapping), every cycle each stage's passes, then
  // one sync and each stage's exchange.
  Program compile_device_of_pipeline(const std::vector<StageRun*>& on_device, std::uint64_t steps);
  // One stage's passes in a cycle (forward, then backward in training; bsp through its
  // exchange buffers, dataflow through its hand-offs).
  std::vector<Program> stage_passes(StageRun& sr);
  // bsp: one stage's exchange after the cycle's sync.
  std::vector<Program> stage_exchange(StageRun& sr);
  // The device slot (0 .. devices_per_replica - 1) of a stage within its replica.
  std::uint32_t slot_of(const StageRun& sr) const {
    return device_of(sr.r, sr.s) - device_of(sr.r, 0);
  }
  Program compile_single(std::uint32_t replica, std::uint64_t steps);
  // Inference: stage 0 takes micro-batches as they arrive (up to plan.micro_batches) and the
  // run ends when the infeed ends, after everything taken has been answered. bsp runs
  // bubble cycles while micro-batches are in flight and waits for input only when the
  // pipeline is empty; the last stage hands its responses over before it would idle.
  Program compile_inference(const std::vector<StageRun*>& on_device);
  // dataflow inference: one stage per device.
  Program compile_dataflow_inference(StageRun& sr);
  Program compile_single_inference(std::uint32_t replica);
  Program step_end(const std::vector<StageRun*>& on_device,
                   const std::shared_ptr<SyncGroup>& group);
  // `limit` trips of `body` per step; the condition keeps the trip in st->*trip (and the
  // step, from the outermost Repeat, at trip 0).
  // With several stages on the device, the first counts and the others follow.
  static Program counted(const std::vector<StageRun*>& sts, std::uint64_t StageRun::*trip,
                         std::uint64_t limit, Program body) {
    return program::RepeatWhile(
        [sts, trip, limit](const ComputeContext& ctx) {
          StageRun* st = sts.front();
          st->*trip = st->next_cycle++;
          for (StageRun* other : sts) {
            other->*trip = st->*trip;
            if (st->*trip == 0) other->step = ctx.iteration;
          }
          if (st->*trip < limit) return true;
          st->next_cycle = 0;
          return false;
        },
        std::move(body));
  }
  static Program counted(StageRun* st, std::uint64_t StageRun::*trip, std::uint64_t limit,
                         Program body) {
    return counted(std::vector<StageRun*>{st}, trip, limit, std::move(body));
  }
  std::vector<std::shared_ptr<SyncGroup>> replica_groups, reduce_groups;
  // The constructor's work before any other instance is involved.
  void build(const DeviceList& group, const PipelineConfig& config,
             const StageFactory& make_stages);
  // The host call in this process (Pipeline::run without the agreement across instances).
  // `stop`: the run() call's (its CancelGate scope's token).
  PipelineResult run_local(InfeedQueue<Batch>& infeed, std::uint64_t steps,
                           OutfeedQueue<std::vector<float>>* outfeed, const std::stop_token& stop);
  detail::CancelGate gate;          // cancel(): the run() call in progress
  std::uint32_t ended_replica = 0;  // the last run's kEndOfData: the replica whose lane ended
  // Distributed: at construction, checks every instance built its pipeline, and the same
  // one, and broadcasts instance 0's weights and optimiser state (collectives); then, for
  // training, makes `across`.
  void join_instances(Instance& inst);
  // Distributed, after run_local: every instance's end exchanged, and the run's result
  // (or exception) made the same everywhere. `failure`: what run_local threw.
  PipelineResult settle_across(PipelineResult local, const std::exception_ptr& failure,
                               std::uint64_t steps);
  // Distributed training over several instances (else null): the exchange across them.
  Instance* instance = nullptr;
  std::unique_ptr<detail::InstanceReduction> across;
};

}  // namespace bspflow
