// Stage execution (see detail/pipeline_impl.hpp): what a device runs for one stage.
#include <algorithm>
#include <bit>
#include <cstring>

#include "bspflow/devices/io_engine.hpp"
#include "bspflow/pipeline/detail/pipeline_impl.hpp"

namespace bspflow {

namespace {
// Element-wise passes over a step's gradients, in blocks of kLanes floats: GCC vectorises
// these at -O2, where its cheap cost model leaves a plain loop of unknown length scalar.
constexpr std::size_t kLanes = 8;
// out[j] += in[j]
void add_into(float* __restrict out, const float* __restrict in, std::size_t n) noexcept {
  std::size_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) out[j + l] += in[j + l];
  }
  for (; j < n; ++j) out[j] += in[j];
}
// out[j] = in[j] * scale
void scale_into(float* __restrict out, const float* __restrict in, std::size_t n,
                float scale) noexcept {
  std::size_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) out[j + l] = in[j + l] * scale;
  }
  for (; j < n; ++j) out[j] = in[j] * scale;
}
// v[j] *= scale
void scale_in_place(float* __restrict v, std::size_t n, float scale) noexcept {
  std::size_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::size_t l = 0; l < kLanes; ++l) v[j + l] *= scale;
  }
  for (; j < n; ++j) v[j] *= scale;
}
std::span<float> floats(const Buffer& b) {
  return b ? b->as<float>() : std::span<float>{};
}
// An exchange buffer's values as fp32: the buffer itself, or (fp16) a copy in `wide`.
std::span<float> widened(const Buffer& b, std::vector<float>& wide) {
  if (!b) return {};
  if (b->dtype() == DType::kFloat32) return floats(b);
  const std::span<const std::uint16_t> h = b->as<std::uint16_t>();
  wide.resize(h.size());
  from_half(h, wide);
  return wide;
}
// Where a pass writes a buffer's values: the buffer itself, or (fp16) `wide`, stored by
// narrow() after the pass.
std::span<float> writable(const Buffer& b, std::vector<float>& wide) {
  if (!b) return {};
  if (b->dtype() == DType::kFloat32) return floats(b);
  wide.resize(b->elements());
  return wide;
}
void narrow(const Buffer& b, std::span<const float> wide) {
  if (!b || b->dtype() == DType::kFloat32) return;
  to_half(wide, b->as<std::uint16_t>());
}
}  // namespace

void Pipeline::Impl::throw_saved_over(const StageRun& sr, std::uint64_t i,
                                      std::size_t saved) const {
  const std::string message =
      "stage " + std::to_string(sr.s) + " '" + sr.stage->name() + "' (device " +
      std::to_string(sr.device->id()) + ", replica " + std::to_string(sr.r) + ") saved " +
      std::to_string(saved) + " values in its forward pass at step " + std::to_string(sr.step) +
      ", micro-batch " + std::to_string(i) + " but memory() declared " +
      std::to_string(sr.saved_limit) + " (StageMemory::saved): the memory plan would be wrong";
  throw StageError(message, sr.s, sr.device->id(), sr.r, sr.step, i,
                   std::make_exception_ptr(Error(message)));
}

bool Pipeline::Impl::pop_input(StageRun& sr, Batch& slot, bool block, const StopFlag* stop,
                               bool& waited) {
  waited = false;
  if (config.synthetic_data && sr.synthetic_ready) return true;  // already in every slot
  Batch& into = config.synthetic_data ? sr.batches[0] : slot;
  if (!sr.reader->try_pop(into)) {
    if (!block || !sr.reader->pop(into, stop)) return false;
    waited = true;
  }
  if (config.synthetic_data) {
    // Synthetic data: this one micro-batch stands for every micro-batch of the run.
    for (Batch& b : sr.batches) {
      if (&b != &into) b = into;
    }
    sr.synthetic_ready = true;
  }
  return true;
}

bool Pipeline::Impl::host_in(StageRun& sr, const Batch& b, bool waited, const StopFlag* stop) {
  if (config.synthetic_data) return true;  // no host copies
  return sr.link.copy_in(host_bytes(b), waited, stop);
}

void Pipeline::Impl::forward_exchanged(StageRun& sr, std::uint64_t i, std::uint64_t cycle,
                                       const StopFlag* stop) {
  const bool first = sr.s == 0, last = sr.s + 1 == stages;
  const std::span<const float> in =
      first ? std::span<const float>{} : widened(sr.in_fwd, sr.wide_in);
  const Buffer& out_buf = sr.out_fwd[cycle % 2];
  const std::span<float> out =
      last ? std::span<float>(sr.local_out) : writable(out_buf, sr.wide_out);
  forward(sr, i, in, out, stop);
  if (!last) narrow(out_buf, out);
}

void Pipeline::Impl::backward_exchanged(StageRun& sr, std::uint64_t i, std::uint64_t cycle) {
  const bool first = sr.s == 0, last = sr.s + 1 == stages;
  const std::span<const float> grad_out =
      last ? std::span<const float>{} : widened(sr.in_bwd, sr.wide_in);
  const Buffer& out_buf = sr.out_bwd[cycle % 2];
  const std::span<float> grad_in = first ? std::span<float>{} : writable(out_buf, sr.wide_out);
  backward(sr, i, grad_out, grad_in);
  if (!first) narrow(out_buf, grad_in);
}

void Pipeline::Impl::cost_passes() {
  const WorkPrecision precision =
      config.precision.storage != DType::kFloat16    ? WorkPrecision::kFloat32
      : config.precision.partials == DType::kFloat16 ? WorkPrecision::kFloat16
                                                     : WorkPrecision::kFloat16Float32;
  for (auto& srp : runs) {
    StageRun& sr = *srp;
    const DeviceModel& m = sr.device->config().model;
    const std::uint32_t io = config.io_tiles;
    const std::uint32_t tiles = sr.device->config().tiles;
    sr.compute_tiles = tiles > io ? tiles - io : 1;
    const StageCost c = sr.stage->cost(precision);
    auto ns = [&](const std::optional<Work>& w) {
      if (!w) return -1.0;
      return w->declared() ? m.ns(m.compute_cycles(*w, sr.compute_tiles)) : 0.0;
    };
    sr.forward_ns = ns(c.forward);
    sr.backward_ns = ns(c.backward);
    sr.update_ns = ns(c.update);
  }
}

void Pipeline::Impl::local_sum(StageRun& sr) {
  // Distributed, replica 0: straight into its slot's segment of the exchange across
  // instances (no copy on the way there).
  const std::span<float> out =
      across && sr.r == 0 ? across->segment(slot_of(sr)).subspan(sr.wire_at, sr.reduced.size())
                          : std::span<float>(sr.reduced);
  const std::uint32_t replicas = config.replicas;
  // Modeled: read each replica's accumulators, write the sum (fp32 partials: 4 bytes).
  const double values = static_cast<double>(sr.accum.size());
  charge_bytes(sr, values * 4.0 * (replicas + 1), values * (replicas - 1));
  if (replicas == 1) {
    std::copy(sr.accum.begin(), sr.accum.end(), out.begin());
    return;
  }
  std::fill(out.begin(), out.end(), 0.0f);
  for (std::uint32_t r = 0; r < replicas; ++r) {
    const std::vector<float>& peer = run_of(r, sr.s).accum;
    add_into(out.data(), peer.data(), peer.size());
  }
}

std::uint64_t Pipeline::Impl::weights_checksum(const std::vector<StageRun*>& on_device) {
  // Per stage, running sums of its weights' bits in 8 lanes of 32 bits (Fletcher's: `a` sums
  // the words, so any one changed word changes it; `b` sums the a's, so moved words change
  // it), in vectors of 4 (GCC's and Clang's vector extensions: SSE2 at any -O, a fraction
  // of a multiply chain's time per word); then the lanes, the few words left and the stage's
  // size (where its weights end) folded together with FNV-1a.
  using Lanes = std::uint32_t __attribute__((vector_size(16)));
  constexpr std::uint64_t kPrime = 0x100000001b3ull;
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](std::uint64_t v) { h = (h ^ v) * kPrime; };
  for (const StageRun* sr : on_device) {
    const std::span<const float> w = sr->stage->weights();
    Lanes a0{}, a1{}, b0{}, b1{};
    std::size_t j = 0;
    for (; j + 8 <= w.size(); j += 8) {
      Lanes x0, x1;
      std::memcpy(&x0, w.data() + j, sizeof x0);
      std::memcpy(&x1, w.data() + j + 4, sizeof x1);
      a0 += x0;
      a1 += x1;
      b0 += a0;
      b1 += a1;
    }
    for (int l = 0; l < 4; ++l) {
      mix(a0[l]);
      mix(a1[l]);
      mix(b0[l]);
      mix(b1[l]);
    }
    for (; j < w.size(); ++j) mix(std::bit_cast<std::uint32_t>(w[j]));
    mix(w.size());
  }
  return h;
}

void Pipeline::Impl::finish_reduce(StageRun& sr, std::uint64_t step) {
  // Distributed: replica 0 brought the sum over the instances into its slot's segment (the
  // step applied in every instance, else no update anywhere); every local replica takes it
  // from there.
  std::span<float> sum = sr.reduced;
  if (across) {
    sr.apply = across->applied(step);
    if (!sr.apply) return;
    sum = across->segment(slot_of(sr)).subspan(sr.wire_at, sr.reduced.size());
  } else {
    // A step short of micro-batches (a stop cut it: only single-device trips reach here
    // then) is not applied.
    sr.apply = sr.accumulated == k();
    if (!sr.apply) return;
  }
  const std::uint32_t replicas = total_replicas();
  charge_bytes(sr, static_cast<double>(sr.reduced.size()) * 8.0,
               static_cast<double>(sr.reduced.size()));
  // The update sees unscaled gradients: loss scaling is undone here, with the mean.
  float scale = 1.0f / config.precision.loss_scaling;
  if (config.reduction == ReductionType::kMean) {
    scale /= static_cast<float>(replicas);
    if (config.mean == MeanStyle::kPost)
      scale /= static_cast<float>(sr.accumulated == 0 ? 1 : sr.accumulated);
  }
  if (replicas > 1 && config.precision.partials == DType::kFloat16) {
    if (sum.data() != sr.reduced.data()) std::copy(sum.begin(), sum.end(), sr.reduced.begin());
    round_to_half(sr.reduced);
    sum = sr.reduced;
  }
  // The update reads the sum where it is when it needs no scaling (the other local
  // replicas only read a shared segment too), and scales it in place when no other replica
  // reads it (its own sr.reduced, or the segment of an instance with one local replica):
  // one pass at most, and no copy.
  sr.update_from = sum;
  if (scale == 1.0f) return;
  if (sum.data() == sr.reduced.data() || config.replicas == 1) {
    scale_in_place(sum.data(), sum.size(), scale);
  } else {
    scale_into(sr.reduced.data(), sum.data(), sum.size(), scale);
    sr.update_from = sr.reduced;
  }
}

bool Pipeline::Impl::forward(StageRun& sr, std::uint64_t i, std::span<const float> input,
                             std::span<float> output, const StopFlag* stop) {
  const std::span<Batch> batches_of = sr.batches;
  if (sr.s == 0 && config.training) {  // inference: take() already put it in the ring
    Batch& slot = batches_of[i % batches_of.size()];
    bool waited = false;
    if (!pop_input(sr, slot, /*block=*/true, stop, waited)) {
      if (sr.reader->end_of_data()) throw EndOfInput{sr.step, i, sr.r};
      return false;
    }
    if (!host_in(sr, slot, waited, stop)) return false;
  }
  // Training stashes what the pass saves with its input (a recycled entry); inference keeps
  // nothing, so the pass saves into a vector the stage keeps (no allocation per micro-batch).
  Stashed entry;
  if (config.training && !sr.spare.empty()) {
    entry = std::move(sr.spare.back());
    sr.spare.pop_back();
  }
  entry.micro_batch = i;
  std::vector<float>& saved = config.training ? entry.saved : sr.unstashed;
  saved.clear();
  ForwardArgs args{batches_of[i % batches_of.size()], input, output, saved};
  const StageContext ctx = context(sr, i);
  guarded(sr, i, "forward", [&] { sr.stage->forward(ctx, args); });
  charge(sr, sr.forward_ns);
  check_saved(sr, i, saved);
  if (half_storage()) {
    round_to_half(output);
    round_to_half(saved);
  }
  ++sr.forwards;
  if (config.training) {
    sr.max_fifo = std::max<std::uint32_t>(sr.max_fifo, static_cast<std::uint32_t>(sr.fifo.size()));
    if (sr.stash_input) entry.input.assign(input.begin(), input.end());
    if (config.recompute) entry.saved.clear();
    sr.fifo.push_back(std::move(entry));
  }
  if (sr.writer != nullptr) {
    if (!sr.writer->write(sr.step * k() + i, std::vector<float>(output.begin(), output.end()),
                          stop))
      return false;
    return config.synthetic_data ||
           sr.link.copy_out(output.size() * dtype_size(config.precision.storage), stop);
  }
  return true;
}

Pipeline::Impl::Take Pipeline::Impl::take(StageRun& sr, const StopFlag* stop, bool block) {
  if (sr.taken >= plan.micro_batches) return Take::kEnd;
  Batch& slot = sr.batches[sr.taken % sr.batches.size()];
  // Whether the lane was found empty since the last take: then this micro-batch arrived
  // after that, and its copy cannot have started earlier (host_in's `waited`).
  bool waited = sr.polled_empty;
  bool blocked = false;
  if (!pop_input(sr, slot, /*block=*/false, stop, blocked)) {
    if (sr.reader->at_end()) return Take::kEnd;
    sr.polled_empty = true;
    if (!block) return Take::kNone;
    // About to wait for input: responses this device holds go to the host first (with
    // one stage per device, the last stage is elsewhere and hands over its own).
    StageRun& last = run_of(sr.r, stages - 1);
    if (last.device == sr.device && last.writer != nullptr) last.writer->flush(stop);
    if (!pop_input(sr, slot, /*block=*/true, stop, blocked)) {
      return sr.reader->end_of_data() ? Take::kEnd : Take::kStopped;
    }
    waited = true;
  }
  sr.polled_empty = false;
  ++sr.taken;  // taken: a stop while its copy runs gives it back with the others
  if (!host_in(sr, slot, waited, stop)) return Take::kStopped;
  return Take::kGot;
}

void Pipeline::Impl::backward(StageRun& sr, std::uint64_t i, std::span<const float> grad_output,
                              std::span<float> grad_input) {
  if (sr.fifo.empty() || sr.fifo.front().micro_batch != i) {
    throw Error("pipeline: stage " + std::to_string(sr.s) +
                " has no stashed forward pass for "
                "micro-batch " +
                std::to_string(i) + " (internal schedule error)");
  }
  Stashed& e = sr.fifo.front();
  const Batch& batch = sr.batches[i % sr.batches.size()];
  const StageContext ctx = context(sr, i);
  if (config.recompute) {  // the forward pass again, from the stashed input
    ForwardArgs again{batch, e.input, sr.scratch, e.saved};
    guarded(sr, i, "recomputed forward", [&] { sr.stage->forward(ctx, again); });
    charge(sr, sr.forward_ns);
    check_saved(sr, i, e.saved);
    if (half_storage()) {
      round_to_half(sr.scratch);
      round_to_half(e.saved);
    }
  }
  std::fill(sr.grads.begin(), sr.grads.end(), 0.0f);
  std::fill(grad_input.begin(), grad_input.end(), 0.0f);
  BackwardArgs args{batch, e.input, e.saved, grad_output, grad_input, sr.grads};
  guarded(sr, i, "backward", [&] { sr.stage->backward(ctx, args); });
  charge(sr, sr.backward_ns);
  // Static loss scaling: the last stage's gradients are scaled (the earlier stages' follow
  // from its grad_input); reduce() divides the scale out before the update.
  const float loss_scaling = config.precision.loss_scaling;
  if (loss_scaling != 1.0f && sr.s + 1 == stages) {
    for (float& g : grad_input) g *= loss_scaling;
    for (float& g : sr.grads) g *= loss_scaling;
  }
  if (half_storage()) {
    round_to_half(grad_input);
    round_to_half(sr.grads);
  }
  ++sr.accumulated;
  if (config.reduction == ReductionType::kMean && config.mean == MeanStyle::kRunning) {
    const float w = 1.0f / static_cast<float>(sr.accumulated);
    for (std::size_t j = 0; j < sr.grads.size(); ++j)
      sr.accum[j] += (sr.grads[j] - sr.accum[j]) * w;
  } else {
    for (std::size_t j = 0; j < sr.grads.size(); ++j) sr.accum[j] += sr.grads[j];
  }
  if (config.precision.partials == DType::kFloat16) round_to_half(sr.accum);
  sr.spare.push_back(std::move(e));
  sr.fifo.pop_front();
}

}  // namespace bspflow
