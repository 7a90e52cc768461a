// Helpers shared by the pipeline suite's files that train the Dense model
// (pipeline_schedule_test.cpp, pipeline_training_test.cpp, pipeline_mapping_test.cpp,
// pipeline_errors_test.cpp, pipeline_faults_test.cpp, pipeline_distributed_test.cpp): the
// model and its deterministic micro-batches, plain training without the runtime (the weights
// a pipeline must reach), and DenseRig, the devices, Pipeline and fed infeed of one run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <bspflow/bspflow.hpp>

#include "pipeline/dense_stage.hpp"

namespace test {

// Small devices (64 tiles x 64 KiB) for the Dense model's pipelines.
inline const bspflow::DeviceConfig kDenseDevice{64, 64 * 1024};
// The classes the Dense model's last stage tells apart.
inline constexpr std::uint32_t kDenseClasses = 3;

// Layer widths: 5 -> 6 -> 4 -> ... -> kDenseClasses.
inline std::vector<std::size_t> widths(std::uint32_t stages) {
  std::vector<std::size_t> w{5};
  for (std::uint32_t s = 0; s + 1 < stages; ++s) w.push_back(s % 2 == 0 ? 6 : 4);
  w.push_back(kDenseClasses);
  return w;
}

inline bspflow::StageList make_model(std::uint32_t stages) {
  const auto w = widths(stages);
  bspflow::StageList list;
  for (std::uint32_t s = 0; s < stages; ++s) {
    list.push_back(std::make_unique<Dense>(w[s], w[s + 1], s + 1 == stages, static_cast<float>(s)));
  }
  return list;
}

// Micro-batch m of the whole stream (deterministic).
inline bspflow::Batch make_batch(std::uint64_t m) {
  bspflow::Batch b;
  b.data = bspflow::Tensor(bspflow::DType::kFloat32, {kDenseBatch, 5});
  auto x = b.data.as<float>();
  for (std::size_t j = 0; j < x.size(); ++j)
    x[j] = std::cos(0.37f * static_cast<float>(m * 31 + j));
  for (std::size_t i = 0; i < kDenseBatch; ++i) {
    b.labels.push_back(static_cast<std::int32_t>((m + i) % kDenseClasses));
    b.indices.push_back(m * kDenseBatch + i);
  }
  b.valid = kDenseBatch;
  return b;
}

// Plain training without the runtime: micro-batches in order, gradients summed over the
// step (and over the replicas' micro-batches of the same position), averaged, one update.
inline std::vector<std::vector<float>> reference(std::uint32_t stages, std::uint32_t k,
                                                 std::uint32_t replicas, std::uint64_t steps) {
  bspflow::StageList model = make_model(stages);
  std::vector<std::vector<float>> sum(stages);
  for (std::uint32_t s = 0; s < stages; ++s) sum[s].assign(model[s]->gradient_elements(), 0.0f);
  std::uint64_t m = 0;
  for (std::uint64_t step = 0; step < steps; ++step) {
    for (auto& g : sum) std::fill(g.begin(), g.end(), 0.0f);
    for (std::uint32_t i = 0; i < k * replicas; ++i, ++m) {
      const bspflow::Batch batch = make_batch(m);
      std::vector<std::vector<float>> outs(stages), saved(stages);
      for (std::uint32_t s = 0; s < stages; ++s) {
        outs[s].assign(model[s]->output_elements(), 0.0f);
        bspflow::StageContext ctx{s, 0, 0, step, i};
        bspflow::ForwardArgs a{
            batch, s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]), outs[s],
            saved[s]};
        model[s]->forward(ctx, a);
      }
      std::vector<float> grad_out;
      for (std::uint32_t s = stages; s-- > 0;) {
        std::vector<float> g(model[s]->gradient_elements(), 0.0f);
        std::vector<float> grad_in(s == 0 ? 0 : outs[s - 1].size(), 0.0f);
        bspflow::StageContext ctx{s, 0, 0, step, i};
        bspflow::BackwardArgs a{
            batch,    s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]),
            saved[s], grad_out,
            grad_in,  g};
        model[s]->backward(ctx, a);
        for (std::size_t j = 0; j < g.size(); ++j) sum[s][j] += g[j];
        grad_out = grad_in;
      }
    }
    for (std::uint32_t s = 0; s < stages; ++s) {
      for (float& g : sum[s]) g /= static_cast<float>(k * replicas);
      model[s]->update(bspflow::StageContext{}, sum[s]);
    }
  }
  std::vector<std::vector<float>> w;
  for (auto& st : model) w.push_back(static_cast<Dense&>(*st).weight_vector());
  return w;
}

// Feeds `micro_batches` per replica: micro-batch m of the stream goes to replica m % R.
inline void feed(bspflow::InfeedQueue<bspflow::Batch>& infeed, std::uint64_t micro_batches,
                 std::uint32_t replicas) {
  auto p = infeed.make_producer();
  for (std::uint64_t m = 0; m < micro_batches * replicas; ++m) {
    REQUIRE(p.push_to(static_cast<std::uint32_t>(m % replicas), make_batch(m)));
  }
}

inline void check_close(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t j = 0; j < a.size(); ++j)
    worst = std::max(worst, std::fabs(double(a[j]) - double(b[j])));
  CHECK(worst < 1e-5);
}

inline Dense& dense(bspflow::Pipeline& p, std::uint32_t r, std::uint32_t s) {
  return static_cast<Dense&>(p.stage(r, s));
}

// One run's setup: the devices `cfg` needs for `stages` Dense stages (kDenseDevice), the
// Pipeline on them (make_model(stages) for each replica, or `model` if given), and an infeed
// of a lane per replica (capacity 64, `prefetch` deep) holding `micro_batches` per replica
// (feed()). Made in that order, destroyed in the reverse.
struct DenseRig {
  DenseRig(const bspflow::PipelineConfig& cfg, std::uint32_t stages, std::uint64_t micro_batches,
           std::uint32_t prefetch = 1, const bspflow::StageFactory& model = {})
      : devices(cfg.devices_needed(stages), kDenseDevice),
        pipe(devices, cfg, model_or_default(model, stages)),
        infeed(bspflow::InfeedConfig{cfg.replicas, 64, prefetch}) {
    feed(infeed, micro_batches, cfg.replicas);
  }
  bspflow::DeviceGroup devices;
  bspflow::Pipeline pipe;
  bspflow::InfeedQueue<bspflow::Batch> infeed;

 private:
  static bspflow::StageFactory model_or_default(const bspflow::StageFactory& model,
                                                std::uint32_t stages) {
    if (model) return model;
    return [stages](std::uint32_t) { return make_model(stages); };
  }
};

}  // namespace test
