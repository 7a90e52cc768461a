// A small model kit for the examples (not part of the runtime: the runtime schedules, it
// does not do deep learning): layers (2-D convolution, max-pooling, ReLU, dense), softmax
// cross-entropy, AdamW, and LayerStage, a bspflow::Stage made of a sequence of layers.
// Eigen does the matrix arithmetic; convolutions are lowered to one matrix product per
// micro-batch (im2col).
//
// Activations are laid out per sample, channels last (height x width x channels). A
// stage's parameters are one flat vector (each layer's in turn), its gradients the same
// layout, so the runtime can accumulate and all-reduce them as one span.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <bspflow/pipeline/pipeline.hpp>

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

// One layer: maps `batch` samples of in_size() values to out_size() values each.
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::size_t in_size() const = 0;
  virtual std::size_t out_size() const = 0;
  virtual std::size_t param_count() const { return 0; }
  // Scratch values per sample a pass needs while it runs (a convolution's im2col columns).
  virtual std::size_t scratch_per_sample() const { return 0; }
  // PyTorch's default initialisation for the layer type.
  virtual void init(std::span<float> /*params*/, std::mt19937_64& /*rng*/) const {}
  virtual void forward(std::span<const float> params, const float* x, float* y,
                       std::size_t batch) = 0;
  // Adds this micro-batch's parameter gradients to `grads` and writes d loss / d x to `gx`
  // (null: not needed, the layer reads the images).
  virtual void backward(std::span<const float> params, const float* x, const float* y,
                        const float* gy, float* gx, std::span<float> grads, std::size_t batch) = 0;
  // What a real IPU does for the forward and the backward pass of `batch` samples at `p`
  // (FLOPs from the shapes; bytes: what the pass reads and writes, 2 bytes per value in half
  // precision), for the modeled clock.
  virtual bspflow::Work forward_work(std::size_t batch, bspflow::WorkPrecision p) const = 0;
  virtual bspflow::Work backward_work(std::size_t batch, bspflow::WorkPrecision p) const = 0;
};

// Bytes per value of activations and weights at `p`.
inline double value_bytes(bspflow::WorkPrecision p) noexcept {
  return p == bspflow::WorkPrecision::kFloat32 ? 4.0 : 2.0;
}

// y = x W^T + b; W is out x in.
class Dense final : public Layer {
 public:
  Dense(std::size_t in, std::size_t out) : in_(in), out_(out) {}
  std::size_t in_size() const override { return in_; }
  std::size_t out_size() const override { return out_; }
  std::size_t param_count() const override { return in_ * out_ + out_; }
  void init(std::span<float> params, std::mt19937_64& rng) const override;
  void forward(std::span<const float> params, const float* x, float* y, std::size_t batch) override;
  void backward(std::span<const float> params, const float* x, const float* y, const float* gy,
                float* gx, std::span<float> grads, std::size_t batch) override;
  bspflow::Work forward_work(std::size_t batch, bspflow::WorkPrecision p) const override;
  bspflow::Work backward_work(std::size_t batch, bspflow::WorkPrecision p) const override;

 private:
  std::size_t in_, out_;
};

class Relu final : public Layer {
 public:
  explicit Relu(std::size_t size) : size_(size) {}
  std::size_t in_size() const override { return size_; }
  std::size_t out_size() const override { return size_; }
  void forward(std::span<const float> params, const float* x, float* y, std::size_t batch) override;
  void backward(std::span<const float> params, const float* x, const float* y, const float* gy,
                float* gx, std::span<float> grads, std::size_t batch) override;
  bspflow::Work forward_work(std::size_t batch, bspflow::WorkPrecision p) const override;
  bspflow::Work backward_work(std::size_t batch, bspflow::WorkPrecision p) const override;

 private:
  std::size_t size_;
};

// Image shape, channels last.
struct Shape {
  std::size_t height, width, channels;
  std::size_t size() const noexcept { return height * width * channels; }
};

// A square k x k convolution, stride 1, no padding (PyTorch's Conv2d(in, out, k)).
// Weights are out x (k * k * in), ordered (row, column, channel) like the input patch.
class Conv2d final : public Layer {
 public:
  Conv2d(Shape in, std::size_t out_channels, std::size_t kernel);
  std::size_t in_size() const override { return in_.size(); }
  std::size_t out_size() const override { return out_.size(); }
  std::size_t param_count() const override { return out_.channels * patch() + out_.channels; }
  std::size_t scratch_per_sample() const override { return out_.height * out_.width * patch(); }
  void init(std::span<float> params, std::mt19937_64& rng) const override;
  void forward(std::span<const float> params, const float* x, float* y, std::size_t batch) override;
  void backward(std::span<const float> params, const float* x, const float* y, const float* gy,
                float* gx, std::span<float> grads, std::size_t batch) override;
  Shape output_shape() const noexcept { return out_; }
  bspflow::Work forward_work(std::size_t batch, bspflow::WorkPrecision p) const override;
  bspflow::Work backward_work(std::size_t batch, bspflow::WorkPrecision p) const override;

 private:
  std::size_t patch() const noexcept { return k_ * k_ * in_.channels; }
  void im2col(const float* x, std::size_t batch);  // fills cols_: (batch * positions) x patch

  Shape in_, out_;
  std::size_t k_;
  std::vector<float> cols_;  // scratch, reused (a stage runs on one device thread)
};

// 2 x 2 max-pooling, stride 2 (PyTorch's MaxPool2d(2)); the gradient goes to the first
// maximum of each window.
class MaxPool2 final : public Layer {
 public:
  explicit MaxPool2(Shape in);
  std::size_t in_size() const override { return in_.size(); }
  std::size_t out_size() const override { return out_.size(); }
  void forward(std::span<const float> params, const float* x, float* y, std::size_t batch) override;
  void backward(std::span<const float> params, const float* x, const float* y, const float* gy,
                float* gx, std::span<float> grads, std::size_t batch) override;
  Shape output_shape() const noexcept { return out_; }
  bspflow::Work forward_work(std::size_t batch, bspflow::WorkPrecision p) const override;
  bspflow::Work backward_work(std::size_t batch, bspflow::WorkPrecision p) const override;

 private:
  Shape in_, out_;
};

using Layers = std::vector<std::unique_ptr<Layer>>;

// A pipeline stage made of layers. The first stage of a model reads the batch's images
// (uint8 or fp32 values 0..255) and normalises them to [-1, 1], like the tutorial's
// ToTensor + Normalize((0.5,), (0.5,)); the last stage ends in softmax cross-entropy
// against the batch labels (padding has label -1) and outputs a HeadOutput.
// Layer l's parameters are initialised from seed + l.
class LayerStage final : public bspflow::Stage {
 public:
  LayerStage(std::string name, Layers layers, std::size_t batch, bool first, bool last,
             AdamW optimizer, std::uint64_t seed);

  std::string name() const override { return name_; }
  std::size_t output_elements() const override;
  std::size_t gradient_elements() const override { return params_.size(); }
  void forward(const bspflow::StageContext& ctx, bspflow::ForwardArgs& a) override;
  void backward(const bspflow::StageContext& ctx, bspflow::BackwardArgs& a) override;
  void update(const bspflow::StageContext& ctx, std::span<const float> grads) override;
  std::span<float> optimizer_state() override { return adam_state_; }  // AdamW's m and v
  std::span<float> weights() override { return params_; }  // broadcast and checked across instances
  // Weights, AdamW's two moments, every layer's input and the last output per micro-batch
  // (what forward saves), and the im2col columns plus two gradient buffers as working
  // memory. With fp16 storage (StageContext::storage) the weights are rounded to half
  // precision before the first pass and after every update.
  bspflow::StageMemory memory() const override;
  // The layers' work (and, first, normalising the images; last, the loss), per micro-batch;
  // the update: AdamW over the weights in fp32 (about 12 FLOPs and 28 bytes per weight).
  bspflow::StageCost cost(bspflow::WorkPrecision precision) const override;

  const std::vector<float>& parameters() const noexcept { return params_; }
  void set_parameters(const std::vector<float>& p);  // same size, else throws

 private:
  std::span<const float> params_of(std::size_t l) const;

  std::string name_;
  Layers layers_;
  std::size_t batch_;
  bool first_, last_;
  AdamW optimizer_;
  std::vector<std::size_t> param_at_;  // where each layer's parameters start
  std::vector<std::size_t> saved_at_;  // where each layer's input sits in `saved` (+ the output)
  std::vector<float> params_;
  std::vector<float> adam_state_;
  std::vector<float> grad_a_, grad_b_;  // scratch for gradients between layers
  std::uint64_t steps_ = 0;
  bool half_weights_ = false;  // params_ already rounded to fp16
};

// The models the examples train on 28 x 28 grey images, 10 classes.
enum class Model {
  kConv,  // the PopTorch tutorial's network: conv 5x5 1->10, max-pool, ReLU, conv 5x5 10->20,
          // max-pool, ReLU, dense 320->256, ReLU, dense 256->10
  kMlp,   // dense 784->256->256->128->10 with ReLUs (much faster to train)
};
const char* to_string(Model m) noexcept;

// The model split into `stages` stages (1, 2 or 4). Four stages follow the tutorial's
// split: first conv block, second conv block, first dense layer, last dense layer (the MLP:
// one dense layer each).
bspflow::StageList make_model(Model model, std::uint32_t stages, std::size_t batch,
                              AdamW optimizer);

}  // namespace kit
