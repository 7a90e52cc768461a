// Pipeline (see bspflow/pipeline/pipeline.hpp): building the stages and their buffers, and
// the host call (the local run, one Engine run of the compiled programs, is in
// pipeline_run.cpp).
#include "bspflow/pipeline/pipeline.hpp"

#include <algorithm>

#include "bspflow/pipeline/detail/pipeline_impl.hpp"

namespace bspflow {

Pipeline::Pipeline(const DeviceList& group, const PipelineConfig& config,
                   const StageFactory& make_stages)
    : impl_(std::make_unique<Impl>()) {
  // Distributed: with one instance (a plain process) the same machinery runs, its
  // exchanges the identity.
  Instance* inst = config.distributed ? &Instance::current() : nullptr;
  try {
    impl_->build(group, config, make_stages);
  } catch (...) {
    // The other instances wait in the constructor's first collective: tell them.
    if (inst != nullptr) (void)inst->all_agree(false);
    throw;
  }
  if (inst != nullptr) impl_->join_instances(*inst);
}

void Pipeline::Impl::build(const DeviceList& group, const PipelineConfig& config,
                           const StageFactory& make_stages) {
  Impl& im = *this;
  if (!make_stages) throw Error("Pipeline: the stage factory is empty");
  if (config.replicas == 0)
    detail::throw_bad_value("replicas", config.replicas, "must be at least 1");
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
    throw Error("strategy " + std::string(to_string(config.strategy)) + " with " +
                std::to_string(im.stages) + " stages and " + std::to_string(config.replicas) +
                " replica(s) needs " + std::to_string(needed) + " devices; the group has " +
                std::to_string(group.size()) + " (make it with PipelineConfig::devices_needed)");
  }
  for (std::uint32_t d = 0; d < needed; ++d) im.devices.push_back(&group[d]);
  // The Engine first: it checks the I/O tiles against each device before memory is planned
  // around them.
  im.engine = std::make_unique<Engine>(DeviceList(im.devices), engine_config_of(config));
  im.config = config;
  im.plan = PipelinePlan{config.effective_schedule(), im.stages, config.gradient_accumulation,
                         config.training};
  // The replica's micro-batches in flight, by index: a step's K in training (stage 0 reads
  // the next step only after every stage is done with this one); in inference, as many as
  // the hand-offs and the stages can hold at once.
  const std::size_t capacity = std::max<std::size_t>(2, config.gradient_accumulation);
  const std::size_t ring =
      config.training ? config.gradient_accumulation : (im.stages - 1) * capacity + im.stages + 1;
  im.batches.assign(config.replicas, std::vector<Batch>(ring));

  // Stage runs and their buffers.
  const std::uint32_t n = im.stages;
  const bool bsp_exchange =
      config.strategy != ExecutionStrategy::kSingle && config.sync == SyncMode::kBsp;
  for (std::uint32_t r = 0; r < config.replicas; ++r) {
    for (std::uint32_t s = 0; s < n; ++s) {
      auto sr = std::make_unique<Impl::StageRun>();
      sr->stage = im.stage_lists[r][s].get();
      sr->s = s;
      sr->r = r;
      sr->device = im.devices[im.device_of(r, s)];
      sr->out_elements = sr->stage->output_elements();
      if (sr->out_elements == 0) {
        throw Error("stage " + std::to_string(s) + " '" + sr->stage->name() +
                    "' has output_elements() = 0: "
                    "every stage must output something (the last one: what the outfeed receives)");
      }
      sr->in_elements = s > 0 ? im.runs.back()->out_elements : 0;
      const std::size_t g = config.training ? sr->stage->gradient_elements() : 0;
      sr->grads.assign(g, 0.0f);
      sr->accum.assign(g, 0.0f);
      sr->reduced.assign(g, 0.0f);
      sr->batches = im.batches[r];
      sr->wait = sr->device->placement().wait_policy(sr->wait);
      sr->link = HostLinkTimeline(HostLinkTimeline::Shape{
          config, sr->device->config().bytes_per_tile, sr->device->id(),
          sr->device->placement().shares_core(), "a micro-batch (data and labels)"});
      sr->link.attach(&sr->device->clock(), sr->device->config().model);
      sr->local_out.assign(sr->out_elements, 0.0f);
      sr->local_grad.assign(sr->in_elements, 0.0f);
      if (config.recompute) sr->scratch.assign(sr->out_elements, 0.0f);
      if (config.offload_optimizer && config.training)
        sr->state_to_host();  // starts in host memory
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
        im.handoffs.push_back(
            std::make_unique<Handoff>(capacity, std::vector<float>(a.out_elements)));
        a.fwd_out = b.fwd_in = im.handoffs.back().get();
        if (config.training) {
          im.handoffs.push_back(
              std::make_unique<Handoff>(capacity, std::vector<float>(a.out_elements)));
          b.bwd_out = a.bwd_in = im.handoffs.back().get();
        }
      }
    }
  }
  // The memory plan: every tensor each device holds, checked against what its arena has
  // free before anything is allocated, so a model that does not fit gets the whole report.
  {
    MemoryInputs mi;
    mi.config = config;
    mi.plan = im.plan;
    mi.stages = n;
    mi.handoff_capacity =
        config.strategy == ExecutionStrategy::kPipelined && config.sync == SyncMode::kDataflow
            ? capacity
            : 0;
    for (Device* d : im.devices) {
      mi.devices.emplace_back(d->id(), d->arena().free_bytes());
      mi.io_tile_bytes.push_back(std::size_t{config.io_tiles} * d->config().bytes_per_tile);
    }
    for (const auto& sr : im.runs) {
      StageMemory declared = sr->stage->memory();
      StageShape shape;
      shape.s = sr->s;
      shape.r = sr->r;
      shape.device = im.device_of(sr->r, sr->s);
      shape.name = sr->stage->name();
      shape.in = sr->in_elements;
      shape.out = sr->out_elements;
      shape.gradients = sr->grads.size();
      shape.parameters = declared.parameters == StageMemory::kAuto ? sr->stage->gradient_elements()
                                                                   : declared.parameters;
      shape.optimizer = !config.training ? 0
                        : declared.optimizer_state == StageMemory::kAuto
                            ? sr->stage->optimizer_state().size()
                            : declared.optimizer_state;
      shape.saved = declared.saved;
      shape.working = declared.working;
      sr->saved_limit = declared.saved;
      sr->stash_input = declared.backward_reads_input || config.recompute;
      shape.stash_input = sr->stash_input;
      mi.shapes.push_back(std::move(shape));
    }
    im.memory = plan_memory_with_advice(mi);
  }
  auto out_of_memory = [&] {
    std::size_t asked = 0, available = 0;
    std::string lines;
    for (const DeviceMemory& d : im.memory.devices) {
      if (d.fits()) continue;
      if (asked == 0) {
        asked = d.peak();
        available = d.capacity;
      }
      lines += "device " + std::to_string(d.device) + " needs " + format_bytes(d.peak()) +
               " at its peak, has " + format_bytes(d.capacity) + " (largest: ";
      for (std::size_t i = 0; i < d.tensors.size() && i < 3; ++i) {
        lines += (i ? ", '" : "'") + d.tensors[i].name + "' " + format_bytes(d.tensors[i].bytes);
      }
      lines += "); ";
    }
    std::string help;
    for (const std::string& h : im.memory.suggestions) help += "\n  - " + h;
    throw PipelineOutOfMemoryError(
        "Pipeline: out of device memory: " + lines + "what would help:" + help, asked, available,
        im.memory);
  };
  if (!im.memory.fits()) out_of_memory();
  // Hold it: the exchange buffers are the device buffers the programs copy between; the
  // rest is held in the arena by name (the stages keep their values in host memory).
  try {
    const DType store = config.precision.storage;
    for (auto& srp : im.runs) {
      Impl::StageRun* sr = srp.get();
      const std::uint32_t s = sr->s;
      const std::string tag =
          " (replica " + std::to_string(sr->r) + ", stage " + std::to_string(s) + ")";
      if (bsp_exchange) {
        Device& dev = *sr->device;
        if (s + 1 < n) {
          for (int k = 0; k < 2; ++k)
            sr->out_fwd[k] = make_buffer(dev, "activations out" + tag, store, sr->out_elements);
        }
        if (s > 0) {
          sr->in_fwd = make_buffer(dev, "activations in" + tag, store, sr->in_elements);
          if (config.training) {
            for (int k = 0; k < 2; ++k)
              sr->out_bwd[k] = make_buffer(dev, "gradients out" + tag, store, sr->in_elements);
          }
        }
        if (s + 1 < n && config.training)
          sr->in_bwd = make_buffer(dev, "gradients in" + tag, store, sr->out_elements);
      }
    }
    for (std::size_t d = 0; d < im.devices.size(); ++d) {
      const DeviceMemory& dm = im.memory.devices[d];
      for (const TensorMemory& t : dm.tensors) {
        if (t.liveness == Liveness::kAlways && !t.device_buffer) {
          im.held.push_back(std::make_unique<Impl::Held>(im.devices[d]->arena(), t.bytes, t.name));
        }
      }
      if (dm.not_always_live() > 0) {
        im.held.push_back(std::make_unique<Impl::Held>(
            im.devices[d]->arena(), dm.not_always_live(),
            "not always live (compute phase " + format_bytes(dm.compute_peak()) +
                ", update phase " + format_bytes(dm.phase(Liveness::kUpdate)) + ")"));
      }
    }
  } catch (const OutOfMemoryError& e) {
    // The plan fitted (each device's peak within what its arena had free), but the arena
    // could not place it: allocations are rounded up to 64 bytes and each needs one
    // contiguous block, which a plan within a few hundred bytes of the limit, or an arena
    // fragmented by other holders, may not find.
    throw PipelineOutOfMemoryError(
        "Pipeline: out of device memory: every device's plan is within what its arena had free, "
        "but the "
        "arena could not place it (allocations are rounded up to 64 bytes and each needs a "
        "contiguous "
        "block): " +
            std::string(e.what()),
        e.requested(), e.free_bytes(), im.memory);
  }

  // Sync groups: the stages of one replica (every cycle), and the copies of one stage
  // across replicas (the all-reduce).
  if (config.strategy != ExecutionStrategy::kSingle) {
    // With a device mapping the devices of a replica, not its stages, sync.
    const std::uint32_t per_replica = config.devices_per_replica(n);
    for (std::uint32_t r = 0; r < config.replicas; ++r) {
      im.replica_groups.push_back(std::make_shared<SyncGroup>(per_replica));
    }
    for (std::uint32_t d = 0; d < per_replica; ++d) {
      im.reduce_groups.push_back(std::make_shared<SyncGroup>(config.replicas));
    }
  } else {
    im.reduce_groups.push_back(std::make_shared<SyncGroup>(config.replicas));
  }
  // How a stall report names the Engine's devices: by the stages each runs.
  std::vector<detail::WatchedDevice> watched(im.devices.size());
  for (std::size_t d = 0; d < im.devices.size(); ++d) watched[d].device = im.devices[d]->id();
  for (const auto& sr : im.runs) {
    detail::WatchedDevice& w = watched[im.device_of(sr->r, sr->s)];
    w.replica = sr->r;
    w.role += (w.role.empty() ? "stage " : ", ") + std::to_string(sr->s);
  }
  for (detail::WatchedDevice& w : watched) {
    if (w.role.find(',') != std::string::npos) w.role.insert(5, "s");  // "stages 0, 1"
    w.role += " of replica " + std::to_string(w.replica);
  }
  detail::name_runs(*im.engine, "Pipeline::run", std::move(watched));
}

EngineConfig engine_config_of(const PipelineConfig& config) {
  EngineConfig ec;
  static_cast<HostIO&>(ec) = config;  // the host side as the pipeline states it
  ec.synthetic_data = false;          // the stages make synthetic data themselves (stage_execution)
  ec.device_link = config.device_link;
  ec.trace = config.trace;
  ec.stall = config.stall;
  return ec;
}

Pipeline::~Pipeline() = default;

PipelineResult Pipeline::run(InfeedQueue<Batch>& infeed, std::uint64_t device_iterations,
                             OutfeedQueue<std::vector<float>>* outfeed) {
  return run(infeed, device_iterations, outfeed, std::stop_token());
}

PipelineResult Pipeline::run(InfeedQueue<Batch>& infeed, std::uint64_t device_iterations,
                             OutfeedQueue<std::vector<float>>* outfeed, std::stop_token stop) {
  Impl& im = *impl_;
  // From here to the return a cancel() is never lost, and `stop` is watched too.
  detail::CancelGate::Scope scope(im.gate, std::move(stop));
  if (!im.across) return im.run_local(infeed, device_iterations, outfeed, scope.token());
  im.across->begin_run(device_iterations, [&im] { im.gate.cancel(); });
  PipelineResult local;
  std::exception_ptr failure;
  try {
    local = im.run_local(infeed, device_iterations, outfeed, scope.token());
  } catch (...) {
    failure = std::current_exception();
  }
  if (device_iterations == 0) {
    im.across->exchange_nothing();  // meets the others' step 0 if they asked for more
  } else if (!im.across->served()) {
    // Refused before its devices started: still this instance's part of step 0 (as
    // stopped), so the others do not wait for it.
    StopFlag stopped;
    stopped.set();
    im.across->serve(stopped);
  }
  return im.settle_across(std::move(local), failure, device_iterations);
}

void Pipeline::cancel() noexcept {
  impl_->gate.cancel();
}
const PipelineConfig& Pipeline::config() const noexcept {
  return impl_->config;
}
std::uint32_t Pipeline::stages() const noexcept {
  return impl_->stages;
}
Stage& Pipeline::stage(std::uint32_t replica, std::uint32_t s) {
  if (replica >= impl_->config.replicas || s >= impl_->stages) {
    throw Error("Pipeline::stage(" + std::to_string(replica) + ", " + std::to_string(s) +
                "): there are " + std::to_string(impl_->config.replicas) + " replica(s) of " +
                std::to_string(impl_->stages) + " stage(s)");
  }
  return *impl_->stage_lists[replica][s];
}
const PipelinePlan& Pipeline::plan() const noexcept {
  return impl_->plan;
}
const MemoryReport& Pipeline::memory() const noexcept {
  return impl_->memory;
}
const Trace* Pipeline::trace() const noexcept {
  return impl_->engine->trace();
}
TraceSummary Pipeline::summary() const {
  return impl_->engine->summary();
}

}  // namespace bspflow
