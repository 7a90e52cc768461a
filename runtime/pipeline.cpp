// Pipelining, sharding and replication compiled to one program per device.
#include "bspflow/pipeline.hpp"

#include <algorithm>
#include <atomic>
#include <deque>

#include "bspflow/detail/wait.hpp"
#include "bspflow/program.hpp"

namespace bspflow {

const char* to_string(ExecutionStrategy v) noexcept {
  switch (v) {
    case ExecutionStrategy::kPipelined: return "pipelined";
    case ExecutionStrategy::kSharded: return "sharded";
    case ExecutionStrategy::kSingle: return "single";
  }
  return "?";
}
const char* to_string(PipelineSchedule v) noexcept {
  switch (v) {
    case PipelineSchedule::kGrouped: return "grouped";
    case PipelineSchedule::kInterleaved: return "interleaved";
    case PipelineSchedule::kSequential: return "sequential";
  }
  return "?";
}
const char* to_string(SyncMode v) noexcept { return v == SyncMode::kBsp ? "bsp" : "dataflow"; }

void Stage::backward(const StageContext&, BackwardArgs&) {
  throw Error("stage '" + name() + "' has no backward pass: training needs one (or set "
              "PipelineConfig::training = false for inference)");
}
void Stage::update(const StageContext&, std::span<const float>) {}

// ---- config and plan ----

std::uint32_t PipelineConfig::devices_needed(std::uint32_t stages) const {
  return strategy == ExecutionStrategy::kSingle ? replicas : stages * replicas;
}

PipelineSchedule PipelineConfig::effective_schedule() const {
  return strategy == ExecutionStrategy::kPipelined ? schedule : PipelineSchedule::kSequential;
}

std::uint32_t PipelineConfig::min_gradient_accumulation(std::uint32_t stages) const {
  if (!training) return 1;
  switch (effective_schedule()) {
    case PipelineSchedule::kGrouped: return 2 * stages - 1;
    case PipelineSchedule::kInterleaved: return stages;
    case PipelineSchedule::kSequential: return 1;
  }
  return 1;
}

void PipelineConfig::validate(std::uint32_t stages) const {
  if (stages == 0) throw Error("a pipeline needs at least one stage");
  if (replicas == 0) detail::throw_bad_value("replicas", replicas, "must be at least 1");
  if (gradient_accumulation == 0) {
    detail::throw_bad_value("gradient_accumulation", gradient_accumulation, "must be at least 1");
  }
  if (strategy == ExecutionStrategy::kSingle && schedule == PipelineSchedule::kInterleaved &&
      stages > 1) {
    throw Error("the Interleaved schedule needs each stage on a device of its own, but strategy "
                "single puts all " + std::to_string(stages) + " stages on one device: use the "
                "Grouped or Sequential schedule, or strategy pipelined");
  }
  if (sync == SyncMode::kDataflow && strategy != ExecutionStrategy::kPipelined) {
    throw Error(std::string("sync mode dataflow hands activations between concurrently running "
                            "stages; it applies to strategy pipelined, not ") +
                to_string(strategy) + " (use sync mode bsp)");
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
    case PipelineSchedule::kGrouped: return k + 2 * (n - 1);
    case PipelineSchedule::kInterleaved: return 2 * k + 2 * n - 2;
    case PipelineSchedule::kSequential: return 2 * n * k;
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
    case PipelineSchedule::kGrouped: return 2 * (stages - 1 - stage);
    case PipelineSchedule::kInterleaved: return stages - 1 - stage;
    case PipelineSchedule::kSequential: return 0;
  }
  return 0;
}

namespace {

using Clock = std::chrono::steady_clock;

// The input ended mid-run (thrown by stage 0, turned into RunStatus::kEndOfData).
struct EndOfInput {
  std::uint64_t step;
  std::uint64_t micro_batch;
};

// A bounded single-producer single-consumer queue of fixed-size float messages between two
// neighbouring stages (dataflow mode). Each side keeps its own copy of the other's index and
// re-reads the shared one only when its copy says the queue is full (producer) or empty
// (consumer), so a busy queue moves about one cache line per message, the message itself.
// Indices are published with release stores and a light fence (notify_light); a waiter
// spins briefly, then parks with the matching heavy fence. A stop request (then wake())
// ends any wait.
class Handoff {
 public:
  Handoff(std::size_t capacity, std::size_t elements, detail::Spin spin)
      : slots_(capacity, std::vector<float>(elements)), spin_(spin) {}

  // Producer. The next free slot (waits for room); nullptr if stopped first.
  float* acquire(const detail::StopFlag& stop) {
    const std::uint64_t t = producer_.tail;
    if (t - producer_.head_seen >= slots_.size()) {
      not_full_.wait(
          [&] {
            producer_.head_seen = head_.load(std::memory_order_seq_cst);
            return t - producer_.head_seen < slots_.size() || stop.requested();
          },
          spin_, detail::Fence::kAsymmetric);
      if (t - producer_.head_seen >= slots_.size()) return nullptr;
    }
    return slots_[t % slots_.size()].data();
  }
  void publish() {
    tail_.store(++producer_.tail, std::memory_order_release);  // the message, then its index
    not_empty_.notify_light();
  }
  // Consumer. The oldest message (waits for one); nullptr if stopped first.
  const float* front(const detail::StopFlag& stop) {
    const std::uint64_t h = consumer_.head;
    if (consumer_.tail_seen <= h) {
      not_empty_.wait(
          [&] {
            consumer_.tail_seen = tail_.load(std::memory_order_seq_cst);
            return consumer_.tail_seen > h || stop.requested();
          },
          spin_, detail::Fence::kAsymmetric);
      if (consumer_.tail_seen <= h) return nullptr;
    }
    return slots_[h % slots_.size()].data();
  }
  void release() {
    head_.store(++consumer_.head, std::memory_order_release);  // done reading the slot
    not_full_.notify_light();
  }
  // Between runs only: forgets messages a stopped run left behind.
  void reset() noexcept {
    producer_ = {};
    consumer_ = {};
    head_.store(0, std::memory_order_relaxed);  // relaxed: nobody is using the queue
    tail_.store(0, std::memory_order_relaxed);
  }
  void wake() noexcept {
    not_full_.notify();
    not_empty_.notify();
  }

 private:
  // Each side's own counters, on its own cache line: only that side's thread touches them.
  struct alignas(tunables::kCacheLine) Producer {
    std::uint64_t tail = 0;       // the next message's index
    std::uint64_t head_seen = 0;  // the consumer's index when last read
  };
  struct alignas(tunables::kCacheLine) Consumer {
    std::uint64_t head = 0;       // the next message to read
    std::uint64_t tail_seen = 0;  // the producer's index when last read
  };
  std::vector<std::vector<float>> slots_;
  detail::Spin spin_;
  Producer producer_;
  Consumer consumer_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> head_{0};
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> tail_{0};
  detail::WaitPoint not_empty_;
  detail::WaitPoint not_full_;
};

}  // namespace

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
    // single: the neighbour on the same device reads these directly.
    std::vector<float> local_out, local_grad;
    std::vector<float> scratch;  // recomputation's output
    std::deque<Stashed> fifo;
    std::vector<Stashed> spare;  // recycled FIFO entries (no allocation in steady state)
    std::vector<float> grads, accum, reduced;
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
    std::uint32_t accumulated = 0;
    std::uint64_t cycle = 0, next_cycle = 0, step = 0, micro_batch = 0;
    std::uint32_t max_fifo = 0;
    std::uint64_t forwards = 0;
    // stage 0 / last stage
    std::optional<InfeedQueue<Batch>::Reader> reader;
    OutfeedQueue<std::vector<float>>::Writer* writer = nullptr;
    std::vector<Batch>* batches = nullptr;  // the replica's ring, micro-batch i in slot i % size
  };

  PipelineConfig config;
  PipelinePlan plan;
  std::uint32_t stages = 0;
  std::vector<Device*> devices;               // the ones used, in order
  std::vector<StageList> stage_lists;         // per replica
  std::vector<std::vector<Batch>> batches;    // per replica: a ring of micro-batches in flight
  std::vector<std::unique_ptr<StageRun>> runs;  // replica-major: r * stages + s
  std::vector<std::unique_ptr<Handoff>> handoffs;
  std::unique_ptr<Engine> engine;

  StageRun& run_of(std::uint32_t r, std::uint32_t s) { return *runs[r * stages + s]; }
  std::uint32_t device_of(std::uint32_t r, std::uint32_t s) const {
    return config.strategy == ExecutionStrategy::kSingle ? r : r * stages + s;
  }
  std::uint64_t k() const noexcept { return config.gradient_accumulation; }

  StageContext context(const StageRun& sr, std::uint64_t micro_batch) const {
    return StageContext{sr.s, sr.device->id(), sr.r, sr.step, micro_batch};
  }

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

  // The forward pass of micro-batch i: input from the previous stage (empty for stage 0),
  // output into `output`. false: the run was stopped.
  bool forward(StageRun& sr, std::uint64_t i, std::span<const float> input, std::span<float> output,
               const detail::StopFlag* stop) {
    std::vector<Batch>& batches_of = *sr.batches;
    if (sr.s == 0) {
      if (!sr.reader->pop(batches_of[i % batches_of.size()], stop)) {
        if (sr.reader->end_of_data()) throw EndOfInput{sr.step, i};
        return false;
      }
    }
    Stashed entry;
    if (!sr.spare.empty()) {
      entry = std::move(sr.spare.back());
      sr.spare.pop_back();
    }
    entry.micro_batch = i;
    entry.saved.clear();
    ForwardArgs args{batches_of[i % batches_of.size()], input, output, entry.saved};
    const StageContext ctx = context(sr, i);
    guarded(sr, i, "forward", [&] { sr.stage->forward(ctx, args); });
    ++sr.forwards;
    if (config.training) {
      sr.max_fifo = std::max<std::uint32_t>(sr.max_fifo, static_cast<std::uint32_t>(sr.fifo.size()));
      entry.input.assign(input.begin(), input.end());
      if (config.recompute) entry.saved.clear();
      sr.fifo.push_back(std::move(entry));
    }
    if (sr.writer != nullptr) {
      return sr.writer->write(sr.step * k() + i, std::vector<float>(output.begin(), output.end()), stop);
    }
    return true;
  }

  // The backward pass of micro-batch i (the oldest in the FIFO).
  void backward(StageRun& sr, std::uint64_t i, std::span<const float> grad_output,
                std::span<float> grad_input) {
    if (sr.fifo.empty() || sr.fifo.front().micro_batch != i) {
      throw Error("pipeline: stage " + std::to_string(sr.s) + " has no stashed forward pass for "
                  "micro-batch " + std::to_string(i) + " (internal schedule error)");
    }
    Stashed& e = sr.fifo.front();
    const Batch& batch = (*sr.batches)[i % sr.batches->size()];
    const StageContext ctx = context(sr, i);
    if (config.recompute) {  // the forward pass again, from the stashed input
      ForwardArgs again{batch, e.input, sr.scratch, e.saved};
      guarded(sr, i, "recomputed forward", [&] { sr.stage->forward(ctx, again); });
    }
    std::fill(sr.grads.begin(), sr.grads.end(), 0.0f);
    std::fill(grad_input.begin(), grad_input.end(), 0.0f);
    BackwardArgs args{batch, e.input, e.saved, grad_output, grad_input, sr.grads};
    guarded(sr, i, "backward", [&] { sr.stage->backward(ctx, args); });
    ++sr.accumulated;
    if (config.reduction == ReductionType::kMean && config.mean == MeanStyle::kRunning) {
      const float w = 1.0f / static_cast<float>(sr.accumulated);
      for (std::size_t j = 0; j < sr.grads.size(); ++j) sr.accum[j] += (sr.grads[j] - sr.accum[j]) * w;
    } else {
      for (std::size_t j = 0; j < sr.grads.size(); ++j) sr.accum[j] += sr.grads[j];
    }
    sr.spare.push_back(std::move(e));
    sr.fifo.pop_front();
  }

  // After the step's micro-batches: the gradients summed over the replicas (in replica
  // order, so every replica gets the same bits) and scaled for the reduction type.
  void reduce(StageRun& sr) {
    const std::uint32_t replicas = config.replicas;
    if (replicas == 1) {
      sr.reduced = sr.accum;
    } else {
      std::fill(sr.reduced.begin(), sr.reduced.end(), 0.0f);
      for (std::uint32_t r = 0; r < replicas; ++r) {
        const std::vector<float>& peer = run_of(r, sr.s).accum;
        for (std::size_t j = 0; j < peer.size(); ++j) sr.reduced[j] += peer[j];
      }
    }
    if (config.reduction == ReductionType::kMean) {
      float scale = 1.0f / static_cast<float>(replicas);
      if (config.mean == MeanStyle::kPost) scale /= static_cast<float>(sr.accumulated == 0 ? 1 : sr.accumulated);
      if (scale != 1.0f) {
        for (float& g : sr.reduced) g *= scale;
      }
    }
  }

  void update(StageRun& sr) {
    const StageContext ctx = context(sr, k());
    guarded(sr, k(), "update", [&] { sr.stage->update(ctx, sr.reduced); });
    std::fill(sr.accum.begin(), sr.accum.end(), 0.0f);
    sr.accumulated = 0;
  }

  // Training: one trip per step (K micro-batches, one update). Inference has no updates to
  // wait for: one trip through all steps x K micro-batches, so the pipeline fills once.
  std::uint64_t outer_trips(std::uint64_t steps) const { return config.training ? steps : 1; }
  std::vector<Program> compile(std::uint64_t steps);
  Program compile_device_of_pipeline(StageRun& sr, std::uint64_t steps);
  Program compile_single(std::uint32_t replica, std::uint64_t steps);
  Program step_end(const std::vector<StageRun*>& on_device, const std::shared_ptr<SyncGroup>& group);
  // `limit` trips of `body` per step; the condition keeps the trip in st->*trip (and the
  // step, from the outermost Repeat, at trip 0).
  static Program counted(StageRun* st, std::uint64_t StageRun::*trip, std::uint64_t limit, Program body) {
    return program::RepeatWhile(
        [st, trip, limit](const ComputeContext& ctx) {
          st->*trip = st->next_cycle++;
          if (st->*trip == 0) st->step = ctx.iteration;
          if (st->*trip < limit) return true;
          st->next_cycle = 0;
          return false;
        },
        std::move(body));
  }
  std::vector<std::shared_ptr<SyncGroup>> replica_groups, reduce_groups;
};

namespace {
// Poplar's If: runs `then` when `condition` holds (a RepeatWhile of at most one trip).
Program when(std::function<bool(const ComputeContext&)> condition, Program then) {
  return program::RepeatWhile(std::move(condition), std::move(then), 1);
}
std::span<float> floats(const Buffer& b) { return b ? b->as<float>() : std::span<float>{}; }
}  // namespace

// The weight update at the end of a step: with replicas, sync, all-reduce, sync, so every
// replica reads the others' accumulated gradients before anyone resets them.
Program Pipeline::Impl::step_end(const std::vector<StageRun*>& on_device,
                                 const std::shared_ptr<SyncGroup>& group) {
  std::vector<Program> steps;
  if (!config.training) return program::Sequence(std::move(steps));
  const bool replicated = config.replicas > 1;
  if (replicated) steps.emplace_back(program::Sync(group));
  steps.emplace_back(program::Execute(replicated ? "all-reduce" : "reduce", [this, on_device](const ComputeContext&) {
    for (StageRun* sr : on_device) reduce(*sr);
  }));
  if (replicated) steps.emplace_back(program::Sync(group));
  // Offload: the optimiser state streams in before the update and out after it.
  auto stream_state = [on_device](bool to_host) {
    return program::RemoteCopy(to_host ? "optimiser state out" : "optimiser state in", to_host,
                               [on_device, to_host](const ComputeContext&) {
                                 std::size_t bytes = 0;
                                 for (StageRun* sr : on_device) {
                                   bytes += to_host ? sr->state_to_host() : sr->state_from_host();
                                 }
                                 return bytes;
                               });
  };
  if (config.offload_optimizer) steps.emplace_back(stream_state(false));
  steps.emplace_back(program::Execute("update", [this, on_device](const ComputeContext&) {
    for (StageRun* sr : on_device) update(*sr);
  }));
  if (config.offload_optimizer) steps.emplace_back(stream_state(true));
  return program::Sequence(std::move(steps));
}

Program Pipeline::Impl::compile_device_of_pipeline(StageRun& sr, std::uint64_t steps) {
  StageRun* st = &sr;
  const std::uint32_t n = stages;
  const bool first = sr.s == 0, last = sr.s + 1 == n;
  const bool bsp = config.sync == SyncMode::kBsp;
  const std::uint64_t cycles = plan.cycles();
  const PipelinePlan* p = &plan;
  const std::string name = sr.stage->name();
  std::vector<Program> body;

  // Forward pass of this cycle's micro-batch.
  body.push_back(when(
      [st, p](const ComputeContext&) { return p->at(st->s, st->cycle).forward >= 0; },
      program::Execute(name + " forward", [this, st, first, last, bsp](const ComputeContext& ctx) {
        const std::uint64_t i = static_cast<std::uint64_t>(plan.at(st->s, st->cycle).forward);
        if (bsp) {
          const std::span<const float> in = first ? std::span<const float>{} : floats(st->in_fwd);
          forward(*st, i, in, last ? std::span<float>(st->local_out) : floats(st->out_fwd[st->cycle % 2]), ctx.stop);
          return;
        }
        std::span<const float> in;
        if (!first) {
          const float* m = st->fwd_in->front(*ctx.stop);
          if (m == nullptr) return;
          in = {m, st->in_elements};
        }
        std::span<float> out(st->local_out);
        if (!last) {
          float* m = st->fwd_out->acquire(*ctx.stop);
          if (m == nullptr) return;
          out = {m, st->out_elements};
        }
        const bool ok = forward(*st, i, in, out, ctx.stop);
        if (!first) st->fwd_in->release();
        if (!last && ok) st->fwd_out->publish();
      })));

  if (config.training) {
    body.push_back(when(
        [st, p](const ComputeContext&) { return p->at(st->s, st->cycle).backward >= 0; },
        program::Execute(name + " backward", [this, st, first, last, bsp](const ComputeContext& ctx) {
          const std::uint64_t i = static_cast<std::uint64_t>(plan.at(st->s, st->cycle).backward);
          if (bsp) {
            backward(*st, i, last ? std::span<const float>{} : floats(st->in_bwd),
                     first ? std::span<float>{} : floats(st->out_bwd[st->cycle % 2]));
            return;
          }
          std::span<const float> grad_out;
          if (!last) {
            const float* m = st->bwd_in->front(*ctx.stop);
            if (m == nullptr) return;
            grad_out = {m, st->out_elements};
          }
          std::span<float> grad_in;
          if (!first) {
            float* m = st->bwd_out->acquire(*ctx.stop);
            if (m == nullptr) return;
            grad_in = {m, st->in_elements};
          }
          backward(*st, i, grad_out, grad_in);
          if (!last) st->bwd_in->release();
          if (!first) st->bwd_out->publish();
        })));
  }

  if (bsp && n > 1) {
    body.emplace_back(program::Sync(replica_groups[sr.r]));
    // Exchange: pull what the neighbours produced this cycle (by parity) into our inputs.
    if (!first) {
      const StageRun& prev = run_of(sr.r, sr.s - 1);
      for (std::uint64_t parity = 0; parity < 2; ++parity) {
        body.push_back(when(
            [st, p, parity](const ComputeContext&) {
              return st->cycle % 2 == parity && p->at(st->s - 1, st->cycle).forward >= 0;
            },
            program::Copy(prev.out_fwd[parity], sr.in_fwd)));
      }
    }
    if (!last && config.training) {
      const StageRun& next = run_of(sr.r, sr.s + 1);
      for (std::uint64_t parity = 0; parity < 2; ++parity) {
        body.push_back(when(
            [st, p, parity](const ComputeContext&) {
              return st->cycle % 2 == parity && p->at(st->s + 1, st->cycle).backward >= 0;
            },
            program::Copy(next.out_bwd[parity], sr.in_bwd)));
      }
    }
  }

  Program cycle_loop = counted(st, &StageRun::cycle, cycles, program::Sequence(std::move(body)));
  return program::Repeat(outer_trips(steps), program::Sequence{cycle_loop, step_end({st}, reduce_groups[sr.s])});
}

// All stages of a replica on one device: micro-batch by micro-batch, forward through the
// stages and backward through them again.
Program Pipeline::Impl::compile_single(std::uint32_t replica, std::uint64_t steps) {
  std::vector<StageRun*> on_device;
  for (std::uint32_t s = 0; s < stages; ++s) on_device.push_back(&run_of(replica, s));
  StageRun* head = on_device.front();
  std::vector<Program> body;
  for (std::uint32_t s = 0; s < stages; ++s) {
    StageRun* st = on_device[s];
    StageRun* prev = s > 0 ? on_device[s - 1] : nullptr;
    body.emplace_back(program::Execute(st->stage->name() + " forward", [this, st, prev, head](const ComputeContext& ctx) {
      st->step = head->step;
      forward(*st, head->micro_batch, prev ? std::span<const float>(prev->local_out) : std::span<const float>{},
              st->local_out, ctx.stop);
    }));
  }
  if (config.training) {
    for (std::uint32_t s = stages; s-- > 0;) {
      StageRun* st = on_device[s];
      StageRun* next = s + 1 < stages ? on_device[s + 1] : nullptr;
      body.emplace_back(program::Execute(st->stage->name() + " backward", [this, st, next, head](const ComputeContext&) {
        st->step = head->step;
        backward(*st, head->micro_batch, next ? std::span<const float>(next->local_grad) : std::span<const float>{},
                 st->local_grad);
      }));
    }
  }
  Program loop = counted(head, &StageRun::micro_batch, plan.micro_batches, program::Sequence(std::move(body)));
  return program::Repeat(outer_trips(steps), program::Sequence{loop, step_end(on_device, reduce_groups.front())});
}

std::vector<Program> Pipeline::Impl::compile(std::uint64_t steps) {
  std::vector<Program> programs(devices.size(), program::Sequence{});
  if (config.strategy == ExecutionStrategy::kSingle) {
    for (std::uint32_t r = 0; r < config.replicas; ++r) programs[r] = compile_single(r, steps);
  } else {
    for (auto& sr : runs) programs[device_of(sr->r, sr->s)] = compile_device_of_pipeline(*sr, steps);
  }
  return programs;
}

Pipeline::Pipeline(DeviceGroup& group, PipelineConfig config, const StageFactory& make_stages)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  if (!make_stages) throw Error("Pipeline: the stage factory is empty");
  if (config.replicas == 0) detail::throw_bad_value("replicas", config.replicas, "must be at least 1");
  for (std::uint32_t r = 0; r < config.replicas; ++r) {
    StageList list = make_stages(r);
    if (r > 0 && list.size() != im.stage_lists.front().size()) {
      throw Error("the stage factory made " + std::to_string(list.size()) + " stages for replica " +
                  std::to_string(r) + " but " + std::to_string(im.stage_lists.front().size()) +
                  " for replica 0: every replica runs the same stages");
    }
    for (std::size_t s = 0; s < list.size(); ++s) {
      if (!list[s]) throw Error("the stage factory returned a null stage " + std::to_string(s));
    }
    im.stage_lists.push_back(std::move(list));
  }
  im.stages = static_cast<std::uint32_t>(im.stage_lists.front().size());
  config.validate(im.stages);
  const std::uint32_t needed = config.devices_needed(im.stages);
  if (group.size() < needed) {
    throw Error("strategy " + std::string(to_string(config.strategy)) + " with " + std::to_string(im.stages) +
                " stages and " + std::to_string(config.replicas) + " replica(s) needs " + std::to_string(needed) +
                " devices; the group has " + std::to_string(group.size()) +
                " (make it with PipelineConfig::devices_needed)");
  }
  for (std::uint32_t d = 0; d < needed; ++d) im.devices.push_back(&group[d]);
  im.config = config;
  im.plan = PipelinePlan{config.effective_schedule(), im.stages, config.gradient_accumulation, config.training};
  // The replica's micro-batches in flight, by index: a step's K in training (stage 0 reads
  // the next step only after every stage is done with this one); in inference, as many as
  // the hand-offs and the stages can hold at once.
  const std::size_t capacity = std::max<std::size_t>(2, config.gradient_accumulation);
  const std::size_t ring = config.training ? config.gradient_accumulation
                                           : (im.stages - 1) * capacity + im.stages + 1;
  im.batches.assign(config.replicas, std::vector<Batch>(ring));

  // Stage runs and their buffers.
  const std::uint32_t n = im.stages;
  const bool bsp_exchange = config.strategy != ExecutionStrategy::kSingle && config.sync == SyncMode::kBsp;
  for (std::uint32_t r = 0; r < config.replicas; ++r) {
    for (std::uint32_t s = 0; s < n; ++s) {
      auto sr = std::make_unique<Impl::StageRun>();
      sr->stage = im.stage_lists[r][s].get();
      sr->s = s;
      sr->r = r;
      sr->device = im.devices[im.device_of(r, s)];
      sr->out_elements = sr->stage->output_elements();
      if (sr->out_elements == 0) {
        throw Error("stage " + std::to_string(s) + " '" + sr->stage->name() + "' has output_elements() = 0: "
                    "every stage must output something (the last one: what the outfeed receives)");
      }
      sr->in_elements = s > 0 ? im.runs.back()->out_elements : 0;
      const std::size_t g = config.training ? sr->stage->gradient_elements() : 0;
      sr->grads.assign(g, 0.0f);
      sr->accum.assign(g, 0.0f);
      sr->reduced.assign(g, 0.0f);
      sr->batches = &im.batches[r];
      sr->local_out.assign(sr->out_elements, 0.0f);
      sr->local_grad.assign(sr->in_elements, 0.0f);
      if (config.recompute) sr->scratch.assign(sr->out_elements, 0.0f);
      if (config.offload_optimizer && config.training) sr->state_to_host();  // starts in host memory
      const std::string tag = " (replica " + std::to_string(r) + ", stage " + std::to_string(s) + ")";
      if (bsp_exchange) {
        Device& dev = *sr->device;
        if (s + 1 < n) {
          for (int k = 0; k < 2; ++k) sr->out_fwd[k] = make_buffer(dev, "activations out" + tag, DType::kFloat32, sr->out_elements);
        }
        if (s > 0) {
          sr->in_fwd = make_buffer(dev, "activations in" + tag, DType::kFloat32, sr->in_elements);
          if (config.training) {
            for (int k = 0; k < 2; ++k) sr->out_bwd[k] = make_buffer(dev, "gradients out" + tag, DType::kFloat32, sr->in_elements);
          }
        }
        if (s + 1 < n && config.training) sr->in_bwd = make_buffer(dev, "gradients in" + tag, DType::kFloat32, sr->out_elements);
      }
      im.runs.push_back(std::move(sr));
    }
  }
  if (config.strategy == ExecutionStrategy::kPipelined && config.sync == SyncMode::kDataflow) {
    // Room for a whole step's messages: a stage never waits for room its schedule would
    // not also have waited for.
    for (std::uint32_t r = 0; r < config.replicas; ++r) {
      for (std::uint32_t s = 0; s + 1 < n; ++s) {
        Impl::StageRun& a = im.run_of(r, s);
        Impl::StageRun& b = im.run_of(r, s + 1);
        const detail::Spin spin_a = a.device->placement().sharing > 1 ? detail::Spin::kYield : detail::Spin::kTight;
        im.handoffs.push_back(std::make_unique<Handoff>(capacity, a.out_elements, spin_a));
        a.fwd_out = b.fwd_in = im.handoffs.back().get();
        if (config.training) {
          im.handoffs.push_back(std::make_unique<Handoff>(capacity, a.out_elements, spin_a));
          b.bwd_out = a.bwd_in = im.handoffs.back().get();
        }
      }
    }
  }
  // Sync groups: the stages of one replica (every cycle), and the copies of one stage
  // across replicas (the all-reduce).
  if (config.strategy != ExecutionStrategy::kSingle) {
    for (std::uint32_t r = 0; r < config.replicas; ++r) im.replica_groups.push_back(std::make_shared<SyncGroup>(n));
    for (std::uint32_t s = 0; s < n; ++s) im.reduce_groups.push_back(std::make_shared<SyncGroup>(config.replicas));
  } else {
    im.reduce_groups.push_back(std::make_shared<SyncGroup>(config.replicas));
  }
  EngineConfig ec;
  ec.device_link = config.device_link;
  ec.host_link = config.host_link;
  ec.trace = config.trace;
  im.engine = std::make_unique<Engine>(DeviceList(im.devices), ec);
}

Pipeline::~Pipeline() = default;

PipelineResult Pipeline::run(InfeedQueue<Batch>& infeed, std::uint64_t steps,
                             OutfeedQueue<std::vector<float>>* outfeed) {
  Impl& im = *impl_;
  const std::uint32_t replicas = im.config.replicas;
  if (infeed.replicas() != replicas) {
    throw Error("infeed has " + std::to_string(infeed.replicas()) + " replica lane(s) but the pipeline has " +
                std::to_string(replicas) + " replica(s) (InfeedConfig::replicas = " + std::to_string(replicas) + ")");
  }
  if (outfeed != nullptr && outfeed->replicas() != replicas) {
    throw Error("outfeed has " + std::to_string(outfeed->replicas()) + " replica(s) but the pipeline has " +
                std::to_string(replicas) + " (OutfeedConfig::replicas = " + std::to_string(replicas) + ")");
  }
  // Attach the feeds: stage 0 of each replica reads its lane, the last stage writes.
  std::vector<OutfeedQueue<std::vector<float>>::Writer> writers;
  for (std::uint32_t r = 0; r < replicas; ++r) im.run_of(r, 0).reader.emplace(infeed.reader(r));
  if (outfeed != nullptr) writers = outfeed->begin_run();
  for (std::uint32_t r = 0; r < replicas; ++r) {
    Impl::StageRun& last = im.run_of(r, im.stages - 1);
    last.writer = outfeed != nullptr ? &writers[r] : nullptr;
    for (std::uint32_t s = 0; s < im.stages; ++s) {
      Impl::StageRun& sr = im.run_of(r, s);
      sr.fifo.clear();
      sr.cycle = sr.next_cycle = sr.step = sr.micro_batch = 0;
      sr.max_fifo = 0;
      sr.forwards = 0;
      sr.accumulated = 0;
      std::fill(sr.accum.begin(), sr.accum.end(), 0.0f);
    }
  }
  for (auto& h : im.handoffs) h->reset();
  auto detach = [&](bool deliver) {
    for (std::uint32_t r = 0; r < replicas; ++r) {
      im.run_of(r, 0).reader.reset();  // prefetched micro-batches go back to the lane
      im.run_of(r, im.stages - 1).writer = nullptr;
    }
    for (auto& w : writers) w.finish(deliver, nullptr);
  };

  std::vector<Program> programs;
  EngineResult er;
  PipelineResult result;
  std::optional<EndOfInput> ended;
  try {
    im.plan.micro_batches = im.config.training ? im.k() : im.k() * steps;
    programs = im.compile(steps);
    auto wake = [&im, &infeed, outfeed] {
      for (auto& h : im.handoffs) h->wake();
      infeed.wake_all();
      if (outfeed != nullptr) outfeed->wake_all();
    };
    er = im.engine->run(programs, wake);
  } catch (const DeviceError& e) {
    detach(false);
    if (e.cause()) {
      try {
        std::rethrow_exception(e.cause());
      } catch (const StageError&) {
        throw;
      } catch (const EndOfInput& end) {
        ended = end;
      } catch (...) {
      }
    }
    if (!ended) throw;
  } catch (...) {
    detach(false);
    throw;
  }
  if (!ended) detach(er.completed());
  for (std::uint32_t s = 0; s < im.stages; ++s) result.fifo_depth.push_back(im.run_of(0, s).max_fifo);
  for (std::uint32_t r = 0; r < replicas; ++r) result.micro_batches += im.run_of(r, im.stages - 1).forwards;
  result.elapsed = er.elapsed;
  if (ended) {
    result.status = RunStatus::kEndOfData;
    result.steps = ended->step;
    result.message = "the infeed ended at step " + std::to_string(ended->step) + ", micro-batch " +
                     std::to_string(ended->micro_batch) + " of " + std::to_string(im.k()) + ": " +
                     std::to_string(ended->step) + " step(s) applied; the cut-short step (" +
                     std::to_string(ended->micro_batch) + " micro-batch(es) per replica) was not";
    return result;
  }
  result.status = er.status;
  result.steps = er.iterations.empty() ? 0 : *std::min_element(er.iterations.begin(), er.iterations.end());
  if (!im.config.training && er.completed()) result.steps = steps;
  result.message = er.message;
  return result;
}

void Pipeline::cancel() noexcept { impl_->engine->cancel(); }
const PipelineConfig& Pipeline::config() const noexcept { return impl_->config; }
std::uint32_t Pipeline::stages() const noexcept { return impl_->stages; }
Stage& Pipeline::stage(std::uint32_t replica, std::uint32_t s) {
  if (replica >= impl_->config.replicas || s >= impl_->stages) {
    throw Error("Pipeline::stage(" + std::to_string(replica) + ", " + std::to_string(s) + "): there are " +
                std::to_string(impl_->config.replicas) + " replica(s) of " + std::to_string(impl_->stages) + " stage(s)");
  }
  return *impl_->stage_lists[replica][s];
}
const PipelinePlan& Pipeline::plan() const noexcept { return impl_->plan; }
const Trace* Pipeline::trace() const noexcept { return impl_->engine->trace(); }
TraceSummary Pipeline::summary() const { return impl_->engine->summary(); }

}  // namespace bspflow
