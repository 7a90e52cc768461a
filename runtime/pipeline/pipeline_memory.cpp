// A Pipeline's memory plan (see detail/pipeline_impl.hpp): which tensors each device holds,
// how many bytes, and when they are live; and, when a device does not fit, what would.
#include <algorithm>
#include <sstream>

#include "bspflow/pipeline/detail/pipeline_impl.hpp"

namespace bspflow {

namespace {

std::string stage_label(const StageShape& st) {
  return "stage " + std::to_string(st.s) + " '" + st.name + "'";
}

}  // namespace

MemoryReport plan_memory(const MemoryInputs& in) {
  const PipelineConfig& c = in.config;
  const std::size_t store = dtype_size(c.precision.storage);
  const std::size_t partial = dtype_size(c.precision.partials);
  const std::size_t fp32 = sizeof(float);
  const bool training = c.training;
  const bool single = c.strategy == ExecutionStrategy::kSingle;
  const bool bsp_exchange = !single && c.sync == SyncMode::kBsp;
  const bool dataflow =
      c.strategy == ExecutionStrategy::kPipelined && c.sync == SyncMode::kDataflow;

  MemoryReport report;
  report.precision = c.precision;
  for (const auto& [id, available] : in.devices)
    report.devices.push_back(DeviceMemory{id, available, {}});
  auto add = [&](const StageShape& st, std::uint32_t device, const std::string& what,
                 MemoryCategory cat, Liveness live, std::size_t bytes, bool device_buffer = false) {
    if (bytes == 0) return;
    std::string name = stage_label(st) + " " + what;
    if (c.replicas > 1) name += " (replica " + std::to_string(st.r) + ")";
    report.devices[device].tensors.push_back(
        TensorMemory{std::move(name), cat, live, bytes, st.s, st.r, device_buffer});
  };

  for (std::size_t idx = 0; idx < in.shapes.size(); ++idx) {
    const StageShape& st = in.shapes[idx];
    const std::uint32_t dev = st.device;
    const bool first = st.s == 0, last = st.s + 1 == in.stages;
    const bool saved_declared = st.saved != StageMemory::kAuto;
    const std::size_t saved = saved_declared ? st.saved : 0;

    add(st, dev, "parameters", MemoryCategory::kParameters, Liveness::kAlways,
        st.parameters * store);
    if (training) {
      add(st, dev,
          c.offload_optimizer ? "optimiser state (streamed in for the update)" : "optimiser state",
          MemoryCategory::kOptimizerState,
          c.offload_optimizer ? Liveness::kUpdate : Liveness::kAlways, st.optimizer * fp32);
      add(st, dev, "gradient accumulator", MemoryCategory::kGradients, Liveness::kAlways,
          st.gradients * partial);
      add(st, dev, "micro-batch gradients", MemoryCategory::kGradients, Liveness::kPass,
          st.gradients * store);
      add(st, dev, "reduced gradients", MemoryCategory::kGradients, Liveness::kUpdate,
          st.gradients * partial);
      // One stash entry per micro-batch between its forward and its backward pass: the
      // schedule's FIFO depth plus the one in flight (never more than a step's K).
      const std::uint64_t slots = std::min<std::uint64_t>(
          std::uint64_t{in.plan.fifo_depth(st.s)} + 1, c.gradient_accumulation);
      const bool inputs = st.stash_input;
      const std::size_t entry = (inputs ? st.in : 0) + (c.recompute ? 0 : saved);
      if (entry > 0) {
        std::ostringstream what;
        what << "activation stash (" << slots << " x " << format_bytes(entry * store) << ": "
             << (c.recompute       ? "inputs only"
                 : !saved_declared ? "inputs; saved not declared"
                 : st.in == 0      ? "saved"
                 : inputs          ? "inputs and saved"
                                   : "saved only: backward reads no input")
             << ")";
        add(st, dev, what.str(), MemoryCategory::kActivationStash, Liveness::kCompute,
            slots * entry * store);
      }
      if (c.recompute) {
        add(st, dev, "recomputed activations", MemoryCategory::kActivationStash, Liveness::kPass,
            (saved + st.out) * store);
      }
    } else {
      add(st, dev, "saved activations (inference: dropped after the pass)",
          MemoryCategory::kWorking, Liveness::kPass, saved * store);
    }
    add(st, dev, "working memory", MemoryCategory::kWorking, Liveness::kPass, st.working * store);

    // Activations and gradients between stages (what the Pipeline constructor allocates).
    if (bsp_exchange) {
      const MemoryCategory x = MemoryCategory::kExchange;
      const Liveness always = Liveness::kAlways;
      if (!last)
        add(st, dev, "activations out (2 x by cycle parity)", x, always, 2 * st.out * store, true);
      if (!first) add(st, dev, "activations in", x, always, st.in * store, true);
      if (training && !first)
        add(st, dev, "gradients out (2 x by cycle parity)", x, always, 2 * st.in * store, true);
      if (training && !last) add(st, dev, "gradients in", x, always, st.out * store, true);
    }
    if (dataflow) {
      // Each hand-off's ring sits with the stage that reads it.
      if (!first) {
        add(st, dev,
            "activations in (hand-off ring of " + std::to_string(in.handoff_capacity) + ")",
            MemoryCategory::kExchange, Liveness::kAlways, in.handoff_capacity * st.in * store);
      }
      if (training && !last) {
        add(st, dev, "gradients in (hand-off ring of " + std::to_string(in.handoff_capacity) + ")",
            MemoryCategory::kExchange, Liveness::kAlways, in.handoff_capacity * st.out * store);
      }
    }
    if (single) {
      add(st, dev, "output to the next stage", MemoryCategory::kExchange, Liveness::kAlways,
          st.out * store);
      if (training && !first)
        add(st, dev, "gradient to the previous stage", MemoryCategory::kExchange, Liveness::kAlways,
            st.in * store);
    } else if (last) {
      add(st, dev, "output to the outfeed", MemoryCategory::kExchange, Liveness::kAlways,
          st.out * store);
    }
  }
  for (std::size_t d = 0; d < report.devices.size() && d < in.io_tile_bytes.size(); ++d) {
    if (in.io_tile_bytes[d] == 0) continue;
    report.devices[d].tensors.push_back(TensorMemory{
        "I/O tiles (" + std::to_string(c.io_tiles) + " tiles: up to " +
            std::to_string(c.prefetch_depth) + " micro-batch(es) in and outputs out)",
        MemoryCategory::kIoTiles, Liveness::kAlways, in.io_tile_bytes[d], 0, 0, false});
  }
  for (DeviceMemory& d : report.devices) {
    std::stable_sort(
        d.tensors.begin(), d.tensors.end(),
        [](const TensorMemory& a, const TensorMemory& b) { return a.bytes > b.bytes; });
  }
  return report;
}

MemoryReport plan_memory_with_advice(const MemoryInputs& in) {
  MemoryReport report = plan_memory(in);
  if (report.fits()) return report;
  // The worst device: the one over by the most.
  const DeviceMemory* worst = nullptr;
  for (const DeviceMemory& d : report.devices) {
    if (!d.fits() && (worst == nullptr || d.peak() - d.capacity > worst->peak() - worst->capacity))
      worst = &d;
  }
  auto outcome = [&](const MemoryReport& alt) {
    std::size_t over = 0;
    for (const DeviceMemory& d : alt.devices) over += d.fits() ? 0 : 1;
    return "largest device peak " + format_bytes(alt.peak()) +
           (over == 0 ? ": fits" : ": " + std::to_string(over) + " device(s) still do not fit");
  };
  auto try_with = [&](const std::string& what, auto change) {
    MemoryInputs alt = in;
    change(alt.config);
    report.suggestions.push_back(what + " -> " + outcome(plan_memory(alt)));
  };
  const PipelineConfig& c = in.config;
  const bool has_stash = worst->category(MemoryCategory::kActivationStash) > 0;
  const bool has_state = worst->category(MemoryCategory::kOptimizerState) > 0;
  int applicable = 0;
  if (c.precision.storage == DType::kFloat32) {
    ++applicable;
    try_with("half precision (PipelineConfig::precision = Precision::half())",
             [](PipelineConfig& a) { a.precision = Precision::half(a.precision.loss_scaling); });
  }
  if (c.training && !c.recompute && has_stash) {
    ++applicable;
    try_with("recomputation (PipelineConfig::recompute = true: the stash keeps stage inputs only)",
             [](PipelineConfig& a) { a.recompute = true; });
  }
  if (c.training && !c.offload_optimizer && has_state) {
    ++applicable;
    try_with("optimiser state offloaded to the host (PipelineConfig::offload_optimizer = true)",
             [](PipelineConfig& a) { a.offload_optimizer = true; });
  }
  if (applicable > 1) {
    try_with("all of these together", [&](PipelineConfig& a) {
      if (c.precision.storage == DType::kFloat32)
        a.precision = Precision::half(a.precision.loss_scaling);
      if (c.training && has_stash) a.recompute = true;
      if (c.training && has_state) a.offload_optimizer = true;
    });
  }
  report.suggestions.push_back(
      "more stages over more devices (ExecutionStrategy::kPipelined): device " +
      std::to_string(worst->device) + "'s largest holder is " +
      (worst->tensors.empty() ? std::string("nothing")
                              : "'" + worst->tensors.front().name + "' (" +
                                    format_bytes(worst->tensors.front().bytes) + ")"));
  const std::size_t per_sample = worst->category(MemoryCategory::kActivationStash) +
                                 worst->category(MemoryCategory::kExchange) +
                                 worst->category(MemoryCategory::kWorking);
  if (per_sample > 0) {
    report.suggestions.push_back(
        "a smaller micro-batch: activations, exchange and working memory (" +
        format_bytes(per_sample) + " on device " + std::to_string(worst->device) +
        ") grow with it");
  }
  report.suggestions.push_back("more memory per device (Options::tiles, bytes_per_tile): device " +
                               std::to_string(worst->device) + " needs " +
                               format_bytes(worst->peak()) + ", has " +
                               format_bytes(worst->capacity));
  return report;
}

}  // namespace bspflow
