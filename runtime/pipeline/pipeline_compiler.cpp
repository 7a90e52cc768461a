// The compiler from a pipeline config to one Program per device (see
// detail/pipeline_impl.hpp): the schedule's cycles, syncs and exchanges (bsp) or hand-offs
// (dataflow), and the weight update at the end of each step.
#include <functional>
#include <string>
#include <utility>

#include "bspflow/pipeline/detail/pipeline_impl.hpp"

namespace bspflow {

namespace {
// A compute set the compiler makes. Its codelet charges the device's modeled clock with what
// it does (the stage's declared costs, stage_execution.cpp), so the Execute declares nothing
// of its own.
program::Execute codelet(std::string name, std::function<void(const ComputeContext&)> f) {
  return program::Execute(std::move(name), std::move(f)).declare(Work{});
}

// Poplar's If: runs `then` when `condition` holds (a RepeatWhile of at most one trip).
Program when(std::function<bool(const ComputeContext&)> condition, Program then) {
  return program::RepeatWhile(std::move(condition), std::move(then), 1);
}
}  // namespace

// The weight update at the end of a step: with replicas, sync, all-reduce, sync, so every
// replica reads the others' accumulated gradients before anyone resets them.
Program Pipeline::Impl::step_end(const std::vector<StageRun*>& on_device,
                                 const std::shared_ptr<SyncGroup>& group) {
  std::vector<Program> steps;
  if (!config.training) return program::Sequence(std::move(steps));
  const bool replicated = config.replicas > 1;
  if (replicated) steps.emplace_back(program::Sync(group));
  if (across && on_device.front()->r != 0) {
    // Distributed, local replica r > 0: waits for replica 0's exchange (below).
    steps.emplace_back(
        codelet("wait for the all-reduce across instances", [this](const ComputeContext& ctx) {
          (void)across->wait_done(ctx.iteration, Spin::kYield);
        }));
  } else if (across) {
    // Distributed, replica 0's device of each slot: sums the local replicas' gradients into
    // its segment and exchanges it across the instances (one MPI call per bucket of slots,
    // last slot first, each made as soon as its slots have posted and its turn has come, so
    // it overlaps the earlier slots' backward pass; at the default bucket size small
    // gradients make one call per step); the other local replicas wait for the result. A
    // step is applied in every instance or in none (a stop the host sees before the last
    // bucket's call makes it none), and every local replica does the same. Each part is its
    // own codelet, so a trace shows what each costs. A stop skips the rest: the host then
    // makes the step's calls, as stopped.
    const std::uint32_t slot = slot_of(*on_device.front());
    steps.emplace_back(codelet("reduce", [this, on_device](const ComputeContext& ctx) {
      if (ctx.stop->requested()) return;
      for (StageRun* sr : on_device) local_sum(*sr);
    }));
    steps.emplace_back(
        when([this](const ComputeContext& ctx) { return across->check_due(ctx.iteration); },
             codelet("weight checksum", [on_device](const ComputeContext& ctx) {
               if (ctx.stop->requested()) return;
               on_device.front()->weight_checksum = weights_checksum(on_device);
             })));
    steps.emplace_back(codelet("all-reduce across instances", [this, on_device,
                                                               slot](const ComputeContext& ctx) {
      if (ctx.stop->requested()) return;
      // Yield while waiting: the wait is for another thread's MPI call, which may need
      // this core.
      (void)across->exchange(slot, ctx.iteration, on_device.front()->weight_checksum, Spin::kYield);
    }));
  } else {
    steps.emplace_back(codelet("reduce", [this, on_device](const ComputeContext&) {
      for (StageRun* sr : on_device) local_sum(*sr);
    }));
  }
  // The gradients' trip around the replicas' ring over the device link (modeled time).
  if (replicated) {
    program::AllReduce ring("all-reduce", config.replicas,
                            [this, on_device](const ComputeContext&) {
                              std::size_t bytes = 0;
                              for (const StageRun* sr : on_device)
                                bytes += sr->accum.size() * dtype_size(config.precision.partials);
                              return bytes;
                            });
    ring.finish_on_stop = across != nullptr;
    steps.emplace_back(std::move(ring));
    // Without distribution: no replica zeroes its gradients (update) while a peer still
    // sums them. Distributed, the others waited for replica 0's exchange, after its sum.
    if (!across) steps.emplace_back(program::Sync(group));
  }
  steps.emplace_back(codelet("scale", [this, on_device](const ComputeContext& ctx) {
    for (StageRun* sr : on_device) finish_reduce(*sr, ctx.iteration);
  }));
  // Offload: the optimiser state streams in before the update and out after it.
  auto stream_state = [this, on_device](bool to_host) {
    program::RemoteCopy copy(to_host ? "optimiser state out" : "optimiser state in", to_host,
                             [on_device, to_host](const ComputeContext&) {
                               std::size_t bytes = 0;
                               for (StageRun* sr : on_device) {
                                 bytes += to_host ? sr->state_to_host() : sr->state_from_host();
                               }
                               return bytes;
                             });
    copy.finish_on_stop = across != nullptr;
    return copy;
  };
  if (config.offload_optimizer) steps.emplace_back(stream_state(false));
  steps.emplace_back(codelet("update", [this, on_device](const ComputeContext&) {
    for (StageRun* sr : on_device) update(*sr);
  }));
  if (config.offload_optimizer) steps.emplace_back(stream_state(true));
  return program::Sequence(std::move(steps));
}

void Pipeline::Impl::forward_handed_off(StageRun& sr, std::uint64_t i, std::span<const float> input,
                                        const StopFlag* stop) {
  const bool first = sr.s == 0, last = sr.s + 1 == stages;
  std::span<float> out(sr.local_out);
  if (!last) {
    std::vector<float>* m = sr.fwd_out->claim(sr.wait, *stop);
    if (m == nullptr) return;  // stopped: the input stays unread
    out = *m;
  }
  const bool ok = forward(sr, i, input, out, stop);
  if (!first) sr.fwd_in->pop();
  if (!last && ok) sr.fwd_out->publish();
}

std::vector<Program> Pipeline::Impl::stage_passes(StageRun& sr) {
  StageRun* st = &sr;
  const std::uint32_t n = stages;
  const bool first = sr.s == 0, last = sr.s + 1 == n;
  const bool bsp = config.sync == SyncMode::kBsp;
  const PipelinePlan* p = &plan;
  const std::string name = sr.stage->name();
  std::vector<Program> body;

  // Forward pass of this cycle's micro-batch.
  body.push_back(
      when([st, p](const ComputeContext&) { return p->at(st->s, st->cycle).forward >= 0; },
           codelet(name + " forward", [this, st, first, bsp](const ComputeContext& ctx) {
             const std::uint64_t i = static_cast<std::uint64_t>(plan.at(st->s, st->cycle).forward);
             if (bsp) {
               forward_exchanged(*st, i, st->cycle, ctx.stop);
               return;
             }
             std::span<const float> in;
             if (!first) {
               const std::vector<float>* m = st->fwd_in->front(st->wait, *ctx.stop);
               if (m == nullptr) return;
               in = *m;
             }
             forward_handed_off(*st, i, in, ctx.stop);
           })));

  if (config.training) {
    body.push_back(when(
        [st, p](const ComputeContext&) { return p->at(st->s, st->cycle).backward >= 0; },
        codelet(name + " backward", [this, st, first, last, bsp](const ComputeContext& ctx) {
          const std::uint64_t i = static_cast<std::uint64_t>(plan.at(st->s, st->cycle).backward);
          if (bsp) {
            backward_exchanged(*st, i, st->cycle);
            return;
          }
          std::span<const float> grad_out;
          if (!last) {
            const std::vector<float>* m = st->bwd_in->front(st->wait, *ctx.stop);
            if (m == nullptr) return;
            grad_out = *m;
          }
          std::span<float> grad_in;
          if (!first) {
            std::vector<float>* m = st->bwd_out->claim(st->wait, *ctx.stop);
            if (m == nullptr) return;
            grad_in = *m;
          }
          backward(*st, i, grad_out, grad_in);
          if (!last) st->bwd_in->pop();
          if (!first) st->bwd_out->publish();
        })));
  }

  return body;
}

// bsp: one stage's exchange after the cycle's sync — pull what its neighbours produced
// this cycle (by parity) into its inputs (a local copy when they share its device).
std::vector<Program> Pipeline::Impl::stage_exchange(StageRun& sr) {
  StageRun* st = &sr;
  const std::uint32_t n = stages;
  const bool first = sr.s == 0, last = sr.s + 1 == n;
  const PipelinePlan* p = &plan;
  std::vector<Program> body;
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
  return body;
}

Program Pipeline::Impl::compile_device_of_pipeline(const std::vector<StageRun*>& on_device,
                                                   std::uint64_t steps) {
  StageRun* head = on_device.front();
  const std::uint32_t n = stages;
  std::vector<Program> body;
  for (StageRun* st : on_device) {
    for (Program& pass : stage_passes(*st)) body.push_back(std::move(pass));
  }
  if (config.sync == SyncMode::kBsp && n > 1) {
    if (config.devices_per_replica(n) > 1)
      body.emplace_back(program::Sync(replica_groups[head->r]));
    for (StageRun* st : on_device) {
      for (Program& copy : stage_exchange(*st)) body.push_back(std::move(copy));
    }
  }
  Program cycle_loop =
      counted(on_device, &StageRun::cycle, plan.cycles(), program::Sequence(std::move(body)));
  return program::Repeat(
      outer_trips(steps),
      program::Sequence{cycle_loop, step_end(on_device, reduce_groups[slot_of(*head)])});
}

// Inference over one device per stage. bsp: a cycle is forward, sync, exchange, as in
// training, but stage 0 takes a micro-batch only when one is ready and runs a bubble
// cycle (no forward) while others are in flight, so the micro-batches ahead keep moving
// one stage per cycle without waiting for more input; it waits for input only once the
// pipeline is empty. A micro-batch taken in cycle t leaves the last stage in cycle
// t+N-1; when stage 0 finds the end in cycle e, every stage runs through cycle e+N-2 and
// stops, so each one passes the same number of syncs. dataflow: stage 0 closes its
// hand-off at the end and each stage passes the close on once it has drained its input.
Program Pipeline::Impl::compile_dataflow_inference(StageRun& sr) {
  StageRun* st = &sr;
  const std::uint32_t n = stages;
  const bool first = sr.s == 0, last = sr.s + 1 == n;
  const std::string name = sr.stage->name();
  Program pass = codelet(name + " forward", [this, st, first, last](const ComputeContext& ctx) {
    std::uint64_t i = 0;
    std::span<const float> in;
    if (first) {
      const Take t = take(*st, ctx.stop, /*block=*/true);
      if (t == Take::kStopped) return;
      if (t == Take::kEnd) {
        st->ended = st->done = true;
        if (!last) st->fwd_out->close();
        return;
      }
      i = st->taken - 1;
    } else {
      // About to wait for input: hand over the responses held here first.
      if (last && st->writer != nullptr && st->fwd_in->try_front() == nullptr)
        st->writer->flush(ctx.stop);
      const std::vector<float>* m = st->fwd_in->front(st->wait, *ctx.stop);
      if (m == nullptr) {
        if (st->fwd_in->closed_and_drained()) {
          st->done = true;
          if (!last) st->fwd_out->close();
        }
        return;
      }
      in = *m;
      i = st->micro_batch++;  // messages arrive in the order stage 0 took them
    }
    forward_handed_off(*st, i, in, ctx.stop);
  });
  return program::RepeatWhile([st](const ComputeContext&) { return !st->done; }, std::move(pass));
}

Program Pipeline::Impl::compile_inference(const std::vector<StageRun*>& on_device) {
  if (config.sync == SyncMode::kDataflow) return compile_dataflow_inference(*on_device.front());
  StageRun* head = &run_of(on_device.front()->r, 0);
  const std::uint32_t n = stages;
  std::vector<Program> body;
  for (StageRun* st : on_device) {
    const bool first = st->s == 0;
    body.emplace_back(
        codelet(st->stage->name() + " forward", [this, st, first, n](const ComputeContext& ctx) {
          const std::uint64_t c = st->cycle;
          std::int64_t id = -1;
          if (first) {
            if (!st->ended) {
              // Block only when nothing taken still needs a sync to move on: the latest take
              // left the last stage at cycle last_take+N-1 and its response was handed over
              // after that cycle's exchange.
              const bool in_flight = st->taken > 0 && c - st->last_take < n;
              const Take t = take(*st, ctx.stop, !in_flight);
              if (t == Take::kStopped) return;
              if (t == Take::kGot) {
                id = static_cast<std::int64_t>(st->taken - 1);
                st->last_take = c;
              } else if (t == Take::kEnd) {
                st->ended = true;
                st->end_cycle.store(c, std::memory_order_relaxed);  // see StageRun::end_cycle
              }
            }
          } else {
            id = st->in_id;
          }
          st->out_id[c % 2].id = id;
          if (id < 0) return;  // a bubble
          const auto i = static_cast<std::uint64_t>(id);
          forward_exchanged(*st, i, c, ctx.stop);
        }));
  }
  if (n > 1) {
    if (config.devices_per_replica(n) > 1)
      body.emplace_back(program::Sync(replica_groups[head->r]));
    for (StageRun* st : on_device) {
      const bool first = st->s == 0, last = st->s + 1 == n;
      const std::string name = st->stage->name();
      if (!first) {
        StageRun* prev = &run_of(st->r, st->s - 1);
        for (std::uint64_t parity = 0; parity < 2; ++parity) {
          body.push_back(when(
              [st, prev, parity, src = prev->out_fwd[parity]](const ComputeContext&) {
                if (st->cycle % 2 != parity) return false;
                // The id and the activations both come from the previous device's core:
                // ask for the activations' line first, so the two misses overlap instead of
                // following each other (the copy would read it next).
                detail::prefetch_for_read(src->raw().data());
                st->in_id = prev->out_id[parity].id;
                return st->in_id >= 0;
              },
              program::Copy(prev->out_fwd[parity], st->in_fwd)));
        }
      }
      if (last && st->writer != nullptr) {
        // Nothing arrives for the next cycle: this device would idle at the sync, so the
        // responses it holds go to the host now.
        body.push_back(when([st](const ComputeContext&) { return st->in_id < 0; },
                            codelet(name + " hand over", [st](const ComputeContext& ctx) {
                              st->writer->flush(ctx.stop);
                            })));
      }
    }
  }
  return program::RepeatWhile(
      [on_device, head, n](const ComputeContext&) {
        StageRun* st = on_device.front();
        st->cycle = st->next_cycle++;
        for (StageRun* other : on_device) other->cycle = st->cycle;
        const std::uint64_t e = head->end_cycle.load(std::memory_order_relaxed);
        return e == StageRun::kNever || st->cycle + 1 < e + n;
      },
      program::Sequence(std::move(body)));
}

// Inference with every stage of a replica on one device: take a micro-batch, run it
// through the stages, until the infeed ends or the run's count is taken.
Program Pipeline::Impl::compile_single_inference(std::uint32_t replica) {
  StageRun* head = &run_of(replica, 0);
  std::vector<Program> body;
  body.emplace_back(codelet("take", [this, head](const ComputeContext& ctx) {
    head->got = false;
    const Take t = take(*head, ctx.stop, /*block=*/true);
    if (t == Take::kEnd) head->ended = head->done = true;
    if (t != Take::kGot) return;
    head->got = true;
    head->micro_batch = head->taken - 1;
  }));
  for (std::uint32_t s = 0; s < stages; ++s) {
    StageRun* st = &run_of(replica, s);
    StageRun* prev = s > 0 ? &run_of(replica, s - 1) : nullptr;
    body.push_back(when(
        [head](const ComputeContext&) { return head->got; },
        codelet(st->stage->name() + " forward", [this, st, prev, head](const ComputeContext& ctx) {
          forward(*st, head->micro_batch,
                  prev ? std::span<const float>(prev->local_out) : std::span<const float>{},
                  st->local_out, ctx.stop);
        })));
  }
  return program::RepeatWhile([head](const ComputeContext&) { return !head->done; },
                              program::Sequence(std::move(body)));
}

// All stages of a replica on one device: micro-batch by micro-batch, forward through the
// stages and backward through them again.
Program Pipeline::Impl::compile_single(std::uint32_t replica, std::uint64_t steps) {
  std::vector<StageRun*> on_device;
  for (std::uint32_t s = 0; s < stages; ++s) on_device.push_back(&run_of(replica, s));
  StageRun* head = on_device.front();
  std::vector<Program> body;
  // head->got: this trip's micro-batch went forward through every stage. A forward pass
  // stopped on the way (waiting for its input or its host copy) voids
  // the trip: no later pass runs, and the step, now short of a micro-batch, is not applied
  // (finish_reduce); the loop ends the run at its next look at the stop flag.
  for (std::uint32_t s = 0; s < stages; ++s) {
    StageRun* st = on_device[s];
    StageRun* prev = s > 0 ? on_device[s - 1] : nullptr;
    Program pass = codelet(
        st->stage->name() + " forward", [this, st, prev, head, s](const ComputeContext& ctx) {
          st->step = head->step;
          if (s == 0) head->got = true;
          if (!forward(*st, head->micro_batch,
                       prev ? std::span<const float>(prev->local_out) : std::span<const float>{},
                       st->local_out, ctx.stop)) {
            head->got = false;
          }
        });
    body.emplace_back(
        s == 0 ? std::move(pass)
               : when([head](const ComputeContext&) { return head->got; }, std::move(pass)));
  }
  if (config.training) {
    for (std::uint32_t s = stages; s-- > 0;) {
      StageRun* st = on_device[s];
      StageRun* next = s + 1 < stages ? on_device[s + 1] : nullptr;
      body.emplace_back(when(
          [head](const ComputeContext&) { return head->got; },
          codelet(st->stage->name() + " backward", [this, st, next, head](const ComputeContext&) {
            st->step = head->step;
            backward(*st, head->micro_batch,
                     next ? std::span<const float>(next->local_grad) : std::span<const float>{},
                     st->local_grad);
          })));
    }
  }
  Program loop =
      counted(head, &StageRun::micro_batch, plan.micro_batches, program::Sequence(std::move(body)));
  return program::Repeat(outer_trips(steps),
                         program::Sequence{loop, step_end(on_device, reduce_groups.front())});
}

std::vector<Program> Pipeline::Impl::compile(std::uint64_t steps) {
  std::vector<Program> programs(devices.size(), program::Sequence{});
  if (!config.training) {
    if (config.strategy == ExecutionStrategy::kSingle) {
      for (std::uint32_t r = 0; r < config.replicas; ++r) programs[r] = compile_single_inference(r);
    } else {
      for (std::uint32_t r = 0; r < config.replicas; ++r) {
        for (std::uint32_t slot = 0; slot < config.devices_per_replica(stages); ++slot) {
          programs[device_of(r, 0) + slot] = compile_inference(on_device(r, slot));
        }
      }
    }
  } else if (config.strategy == ExecutionStrategy::kSingle) {
    for (std::uint32_t r = 0; r < config.replicas; ++r) programs[r] = compile_single(r, steps);
  } else {
    for (std::uint32_t r = 0; r < config.replicas; ++r) {
      for (std::uint32_t slot = 0; slot < config.devices_per_replica(stages); ++slot) {
        programs[device_of(r, 0) + slot] = compile_device_of_pipeline(on_device(r, slot), steps);
      }
    }
  }
  return programs;
}

}  // namespace bspflow
