// A small model kit for the examples (not part of the runtime: the runtime schedules, it
// does not do deep learning): dense layers with ReLU, softmax cross-entropy, AdamW, and
// MlpStage, a bspflow::Stage made of dense layers. Eigen does the matrix arithmetic.
//
// A stage's parameters are one flat vector (per layer: weights out x in, row-major, then
// biases), its gradients the same layout, so the runtime can accumulate and all-reduce
// them as one span.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <bspflow/pipeline.hpp>

namespace kit {

// PyTorch's AdamW (decoupled weight decay), defaults as in torch.optim.AdamW.
struct AdamW {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  // One step over `params` with `grads`; `state` holds m then v (2 x params.size()).
  void step(std::span<float> params, std::span<const float> grads, std::span<float> state,
            std::uint64_t t) const;
};

// What the last stage outputs per micro-batch: loss summed over the valid samples, how many
// of them it classified correctly, and how many were valid.
struct HeadOutput {
  static constexpr std::size_t kElements = 3;
  float loss_sum = 0, correct = 0, valid = 0;
  static HeadOutput from(std::span<const float> v) { return {v[0], v[1], v[2]}; }
};

// Dense layers widths[0] -> widths[1] -> ... with ReLU after each, except after the last
// layer of the model's last stage, which is followed by softmax cross-entropy against the
// batch labels (output: HeadOutput). The first stage reads the batch's images (uint8 or
// fp32 values 0..255) and normalises them to [-1, 1], like the tutorial's
// ToTensor + Normalize((0.5,), (0.5,)).
class MlpStage final : public bspflow::Stage {
 public:
  MlpStage(std::string name, std::vector<std::size_t> widths, std::size_t batch, bool first,
           bool last, AdamW optimizer, std::uint64_t seed);

  std::string name() const override { return name_; }
  std::size_t output_elements() const override;
  std::size_t gradient_elements() const override { return params_.size(); }
  void forward(const bspflow::StageContext& ctx, bspflow::ForwardArgs& a) override;
  void backward(const bspflow::StageContext& ctx, bspflow::BackwardArgs& a) override;
  void update(const bspflow::StageContext& ctx, std::span<const float> grads) override;
  std::span<float> optimizer_state() override { return adam_state_; }  // AdamW's m and v

  const std::vector<float>& parameters() const noexcept { return params_; }
  void set_parameters(const std::vector<float>& p);  // same size, else throws

 private:
  std::size_t layers() const noexcept { return widths_.size() - 1; }
  std::size_t weight_offset(std::size_t l) const noexcept { return offsets_[l]; }
  std::size_t bias_offset(std::size_t l) const noexcept {
    return offsets_[l] + widths_[l] * widths_[l + 1];
  }

  std::string name_;
  std::vector<std::size_t> widths_;
  std::size_t batch_;
  bool first_, last_;
  AdamW optimizer_;
  std::vector<std::size_t> offsets_;
  std::vector<float> params_;
  std::vector<float> adam_state_;
  std::uint64_t steps_ = 0;
};

// The flagship's model split into `stages` stages (1, 2 or 4): 784 -> 256 -> 256 -> 128 -> 10.
bspflow::StageList make_mlp(std::uint32_t stages, std::size_t batch, AdamW optimizer);

}  // namespace kit
