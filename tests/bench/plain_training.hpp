// Shared by the benchmarks that compare with training without the runtime: the stages'
// forward, backward and update called directly, micro-batch by micro-batch, gradients
// summed over the step, averaged, one update per stage.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

namespace bench {

// Seconds each stage's passes took, summed (train_plainly adds to it when given one): a
// stage's forward and backward passes (its gradients' summing included) over all
// micro-batches, and its updates.
struct StageSeconds {
  std::vector<double> forward, backward, update;
};

// Trains `model` for `steps` steps of `accumulation` micro-batches; batch_of(m) is
// micro-batch m of the run (m counts from 0). Returns the seconds the steps took (the
// buffers are set up before the clock starts). With `per_stage`, also adds each stage's
// share to it (two clock reads per pass: microseconds per step of milliseconds).
template <class BatchOf>
double train_plainly(bspflow::StageList& model, std::uint64_t steps, std::uint32_t accumulation,
                     BatchOf&& batch_of, StageSeconds* per_stage = nullptr) {
  using namespace bspflow;
  const auto n = static_cast<std::uint32_t>(model.size());
  std::vector<std::vector<float>> sum(n), outs(n), saved(n), grad_in(n);
  for (std::uint32_t s = 0; s < n; ++s) {
    sum[s].assign(model[s]->gradient_elements(), 0.0f);
    outs[s].assign(model[s]->output_elements(), 0.0f);
    grad_in[s].assign(s == 0 ? 0 : outs[s - 1].size(), 0.0f);
  }
  std::vector<float> g;
  if (per_stage != nullptr) {
    per_stage->forward.resize(n, 0.0);
    per_stage->backward.resize(n, 0.0);
    per_stage->update.resize(n, 0.0);
  }
  // With per_stage: adds the seconds since the last lap to (per_stage->*pass)[s].
  Clock::time_point last;
  auto lap = [&](std::vector<double> StageSeconds::*pass, std::uint32_t s) {
    if (per_stage == nullptr) return;
    const auto now = Clock::now();
    (per_stage->*pass)[s] += std::chrono::duration<double>(now - last).count();
    last = now;
  };
  const auto t0 = Clock::now();
  last = t0;
  std::uint64_t m = 0;
  for (std::uint64_t step = 0; step < steps; ++step) {
    for (auto& v : sum) std::fill(v.begin(), v.end(), 0.0f);
    for (std::uint32_t i = 0; i < accumulation; ++i, ++m) {
      const Batch& batch = batch_of(m);
      for (std::uint32_t s = 0; s < n; ++s) {
        ForwardArgs a{batch,
                      s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]),
                      outs[s], saved[s]};
        model[s]->forward(StageContext{s, 0, 0, step, i}, a);
        lap(&StageSeconds::forward, s);
      }
      for (std::uint32_t s = n; s-- > 0;) {
        g.assign(model[s]->gradient_elements(), 0.0f);
        std::fill(grad_in[s].begin(), grad_in[s].end(), 0.0f);
        BackwardArgs a{
            batch,
            s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]),
            saved[s],
            s + 1 == n ? std::span<const float>{} : std::span<const float>(grad_in[s + 1]),
            grad_in[s],
            g};
        model[s]->backward(StageContext{s, 0, 0, step, i}, a);
        for (std::size_t j = 0; j < g.size(); ++j) sum[s][j] += g[j];
        lap(&StageSeconds::backward, s);
      }
    }
    for (std::uint32_t s = 0; s < n; ++s) {
      for (float& x : sum[s]) x /= static_cast<float>(accumulation);
      model[s]->update(StageContext{}, sum[s]);
      lap(&StageSeconds::update, s);
    }
  }
  return seconds_since(t0);
}

// The machine's floor for `threads` cores: train_plainly on `threads` threads at once, placed
// and pinned like that many devices (on_placed_threads), each on a model of its own that
// make_model() builds on that thread; batch_of(t, m) is micro-batch m of thread t. Returns the
// slowest thread's seconds.
template <class MakeModel, class BatchOf>
double train_plainly_on_threads(std::uint32_t threads, std::uint64_t steps,
                                std::uint32_t accumulation, MakeModel&& make_model,
                                BatchOf&& batch_of) {
  std::vector<double> seconds(threads);
  on_placed_threads(threads, [&](std::uint32_t t) {
    bspflow::StageList model = make_model();
    seconds[t] =
        train_plainly(model, steps, accumulation,
                      [&](std::uint64_t m) -> const bspflow::Batch& { return batch_of(t, m); });
  });
  return *std::max_element(seconds.begin(), seconds.end());
}

}  // namespace bench
