// The Dense pipeline stage the runtime suite's Pipeline tests and the mpi suite train: a
// dense layer over micro-batches of kDenseBatch rows (tanh; the last stage adds softmax
// cross-entropy and outputs {loss sum, correct count}), trained with SGD with momentum (the
// momentum is its optimiser state). Its initial weights are a fixed function of `seed`, so
// replicas made alike start alike and instances seeded differently start the same only once
// a distributed Pipeline has broadcast instance 0's weights (weights() is what it
// broadcasts and checks). Faults can be injected: a forward pass that throws, an update that
// drifts.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace test {

// Rows (samples) in one micro-batch of a Dense pipeline.
inline constexpr std::size_t kDenseBatch = 4;

class Dense final : public bspflow::Stage {
 public:
  // `in` inputs and `out` outputs per row; `last`: the loss stage, `out` is then the class
  // count. `lr`: the SGD learning rate.
  Dense(std::size_t in, std::size_t out, bool last, float seed, float lr = 0.05f)
      : in_(in), out_(out), last_(last), lr_(lr), w_(in * out + out), v_(w_.size(), 0.0f) {
    for (std::size_t j = 0; j < w_.size(); ++j)
      w_[j] = 0.3f * std::sin(0.7f * static_cast<float>(j + 1) + seed);
  }
  std::string name() const override { return last_ ? "head" : "dense"; }
  std::size_t output_elements() const override { return last_ ? 2 : kDenseBatch * out_; }
  std::size_t gradient_elements() const override { return w_.size(); }
  std::span<float> weights() override { return w_; }
  std::span<float> optimizer_state() override { return v_; }

  void forward(const bspflow::StageContext& ctx, bspflow::ForwardArgs& a) override {
    if (fail_at && *fail_at == ctx.micro_batch) throw std::runtime_error("injected failure");
    if (fail_at_step && *fail_at_step == ctx.step && ctx.micro_batch == 1)
      throw std::runtime_error("injected failure");
    if (ctx.stage == 0 && !a.batch.indices.empty()) seen.insert(a.batch.indices.front());
    const float* x = ctx.stage == 0 ? a.batch.data.as<float>().data() : a.input.data();
    std::vector<float>& z = a.saved;  // pre-activations (last: logits), kept for backward
    z.assign(kDenseBatch * out_, 0.0f);
    for (std::size_t b = 0; b < kDenseBatch; ++b) {
      for (std::size_t o = 0; o < out_; ++o) {
        float acc = w_[in_ * out_ + o];
        for (std::size_t i = 0; i < in_; ++i) acc += w_[o * in_ + i] * x[b * in_ + i];
        z[b * out_ + o] = acc;
      }
    }
    if (!last_) {
      for (std::size_t j = 0; j < z.size(); ++j) a.output[j] = std::tanh(z[j]);
      return;
    }
    float loss = 0, correct = 0;
    for (std::size_t b = 0; b < kDenseBatch; ++b) {
      const float* l = &z[b * out_];
      const float mx = *std::max_element(l, l + out_);
      float sum = 0;
      for (std::size_t o = 0; o < out_; ++o) sum += std::exp(l[o] - mx);
      const auto label = static_cast<std::size_t>(a.batch.labels[b]);
      loss += std::log(sum) - (l[label] - mx);
      correct += static_cast<float>(std::max_element(l, l + out_) - l ==
                                    static_cast<std::ptrdiff_t>(label));
    }
    a.output[0] = loss;
    a.output[1] = correct;
  }

  void backward(const bspflow::StageContext& ctx, bspflow::BackwardArgs& a) override {
    const float* x = ctx.stage == 0 ? a.batch.data.as<float>().data() : a.input.data();
    std::vector<float> dz(kDenseBatch * out_);
    for (std::size_t b = 0; b < kDenseBatch; ++b) {
      if (last_) {
        const float* l = &a.saved[b * out_];
        const float mx = *std::max_element(l, l + out_);
        float sum = 0;
        for (std::size_t o = 0; o < out_; ++o) sum += std::exp(l[o] - mx);
        for (std::size_t o = 0; o < out_; ++o) {
          const float p = std::exp(l[o] - mx) / sum;
          dz[b * out_ + o] =
              (p - (static_cast<std::size_t>(a.batch.labels[b]) == o ? 1.0f : 0.0f)) / kDenseBatch;
        }
      } else {
        for (std::size_t o = 0; o < out_; ++o) {
          const float t = std::tanh(a.saved[b * out_ + o]);
          dz[b * out_ + o] = a.grad_output[b * out_ + o] * (1 - t * t);
        }
      }
    }
    for (std::size_t b = 0; b < kDenseBatch; ++b) {
      for (std::size_t o = 0; o < out_; ++o) {
        const float d = dz[b * out_ + o];
        a.gradients[in_ * out_ + o] += d;
        for (std::size_t i = 0; i < in_; ++i) {
          a.gradients[o * in_ + i] += d * x[b * in_ + i];
          if (!a.grad_input.empty()) a.grad_input[b * in_ + i] += d * w_[o * in_ + i];
        }
      }
    }
  }

  void update(const bspflow::StageContext& ctx, std::span<const float> g) override {
    updates.fetch_add(1);
    for (std::size_t j = 0; j < w_.size(); ++j) {
      v_[j] = 0.9f * v_[j] + g[j];
      w_[j] -= lr_ * v_[j];
    }
    if (drift_at_step && *drift_at_step == ctx.step) w_[0] += 1e-3f;  // this stage only
  }

  // The weights as a vector, to compare (weights() is the span a Pipeline reads).
  const std::vector<float>& weight_vector() const noexcept { return w_; }

  // Host thread, between runs (the device thread reads them).
  std::optional<std::uint64_t> fail_at;        // forward throws at this micro-batch of every step
  std::optional<std::uint64_t> fail_at_step;   // forward throws at micro-batch 1 of this step
  std::optional<std::uint64_t> drift_at_step;  // update() adds 1e-3 to one weight at this step
  // Written on the device thread; read by the host after a run (seen) or while it runs (updates).
  std::set<std::uint64_t> seen;  // stage 0: the first sample index of each micro-batch
  std::atomic<int> updates{0};   // update() calls

 private:
  std::size_t in_, out_;
  bool last_;
  float lr_;
  std::vector<float> w_, v_;
};

}  // namespace test
