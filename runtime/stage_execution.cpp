// Stage execution (see detail/pipeline_impl.hpp): what a device runs for one stage.
#include <algorithm>

#include "detail/pipeline_impl.hpp"

namespace bspflow {

void Pipeline::Impl::reduce(StageRun& sr) {
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

bool Pipeline::Impl::forward(StageRun& sr, std::uint64_t i, std::span<const float> input, std::span<float> output,
             const detail::StopFlag* stop) {
  std::vector<Batch>& batches_of = *sr.batches;
  if (sr.s == 0 && config.training) {  // inference: take() already put it in the ring
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

Pipeline::Impl::Take Pipeline::Impl::take(StageRun& sr, const detail::StopFlag* stop, bool block) {
  if (sr.taken >= plan.micro_batches) return Take::kEnd;
  Batch& slot = (*sr.batches)[sr.taken % sr.batches->size()];
  if (!sr.reader->try_pop(slot)) {
    if (sr.reader->at_end()) return Take::kEnd;
    if (!block) return Take::kNone;
    // About to wait for input: responses this device holds go to the host first (with
    // one stage per device, the last stage is elsewhere and hands over its own).
    StageRun& last = run_of(sr.r, stages - 1);
    if (last.device == sr.device && last.writer != nullptr) last.writer->flush(stop);
    if (!sr.reader->pop(slot, stop)) return sr.reader->end_of_data() ? Take::kEnd : Take::kStopped;
  }
  ++sr.taken;
  return Take::kGot;
}

void Pipeline::Impl::backward(StageRun& sr, std::uint64_t i, std::span<const float> grad_output,
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

}  // namespace bspflow
