#include "model_kit.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

namespace kit {

namespace {
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using RowMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowMap = Eigen::Map<const Eigen::RowVectorXf>;
}  // namespace

void AdamW::step(std::span<float> params, std::span<const float> grads, std::span<float> state,
                 std::uint64_t t) const {
  const std::size_t n = params.size();
  float* m = state.data();
  float* v = state.data() + n;
  const float c1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float c2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  for (std::size_t i = 0; i < n; ++i) {
    params[i] -= lr * weight_decay * params[i];
    m[i] = beta1 * m[i] + (1 - beta1) * grads[i];
    v[i] = beta2 * v[i] + (1 - beta2) * grads[i] * grads[i];
    params[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + eps);
  }
}

MlpStage::MlpStage(std::string name, std::vector<std::size_t> widths, std::size_t batch, bool first,
                   bool last, AdamW optimizer, std::uint64_t seed)
    : name_(std::move(name)), widths_(std::move(widths)), batch_(batch), first_(first), last_(last),
      optimizer_(optimizer) {
  if (widths_.size() < 2) throw std::invalid_argument("MlpStage needs at least one layer");
  std::size_t total = 0;
  for (std::size_t l = 0; l < layers(); ++l) {
    offsets_.push_back(total);
    total += widths_[l] * widths_[l + 1] + widths_[l + 1];
  }
  params_.resize(total);
  adam_state_.assign(2 * total, 0.0f);
  // PyTorch's nn.Linear initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weights and biases.
  std::mt19937_64 rng(seed);
  for (std::size_t l = 0; l < layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(widths_[l]));
    std::uniform_real_distribution<float> u(-bound, bound);
    const std::size_t end = bias_offset(l) + widths_[l + 1];
    for (std::size_t i = weight_offset(l); i < end; ++i) params_[i] = u(rng);
  }
}

std::size_t MlpStage::output_elements() const {
  return last_ ? HeadOutput::kElements : batch_ * widths_.back();
}

void MlpStage::set_parameters(const std::vector<float>& p) {
  if (p.size() != params_.size()) throw std::invalid_argument("MlpStage::set_parameters: wrong size");
  params_ = p;
}

void MlpStage::forward(const bspflow::StageContext&, bspflow::ForwardArgs& a) {
  const std::size_t b = batch_;
  // saved: every layer's input, then the last layer's output (ReLU'd, or the logits).
  std::size_t saved_size = 0;
  for (std::size_t w : widths_) saved_size += b * w;
  a.saved.resize(saved_size);
  float* x = a.saved.data();
  if (first_) {
    const bspflow::Tensor& data = a.batch.data;
    const std::size_t n = b * widths_[0];
    if (data.elements() != n) {
      throw std::runtime_error("batch holds " + std::to_string(data.elements()) + " values, the model expects " +
                               std::to_string(n) + " (batch x " + std::to_string(widths_[0]) + ")");
    }
    if (data.dtype() == bspflow::DType::kUint8) {  // 8-bit I/O: normalised on the device
      const auto px = data.as<std::uint8_t>();
      for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(px[i]) * (2.0f / 255.0f) - 1.0f;
    } else {
      const auto px = data.as<float>();
      for (std::size_t i = 0; i < n; ++i) x[i] = px[i] * (2.0f / 255.0f) - 1.0f;
    }
  } else {
    std::copy(a.input.begin(), a.input.end(), x);
  }
  for (std::size_t l = 0; l < layers(); ++l) {
    const std::size_t in = widths_[l], out = widths_[l + 1];
    ConstMatMap xl(x, static_cast<Eigen::Index>(b), static_cast<Eigen::Index>(in));
    ConstMatMap w(params_.data() + weight_offset(l), static_cast<Eigen::Index>(out), static_cast<Eigen::Index>(in));
    ConstRowMap bias(params_.data() + bias_offset(l), static_cast<Eigen::Index>(out));
    float* y = x + b * in;
    MatMap z(y, static_cast<Eigen::Index>(b), static_cast<Eigen::Index>(out));
    z.noalias() = xl * w.transpose();
    z.rowwise() += bias;
    if (!(last_ && l + 1 == layers())) z = z.cwiseMax(0.0f);
    x = y;
  }
  if (!last_) {
    std::copy(x, x + b * widths_.back(), a.output.begin());
    return;
  }
  // Softmax cross-entropy over the valid samples (padding has label -1).
  const std::size_t classes = widths_.back();
  HeadOutput h;
  for (std::size_t i = 0; i < b; ++i) {
    const std::int32_t label = a.batch.labels[i];
    if (label < 0) continue;
    const float* l = x + i * classes;
    const float mx = *std::max_element(l, l + classes);
    float sum = 0;
    for (std::size_t c = 0; c < classes; ++c) sum += std::exp(l[c] - mx);
    h.loss_sum += std::log(sum) - (l[label] - mx);
    h.correct += (std::max_element(l, l + classes) - l) == label ? 1.0f : 0.0f;
    h.valid += 1.0f;
  }
  a.output[0] = h.loss_sum;
  a.output[1] = h.correct;
  a.output[2] = h.valid;
}

void MlpStage::backward(const bspflow::StageContext&, bspflow::BackwardArgs& a) {
  const auto b = static_cast<Eigen::Index>(batch_);
  std::vector<std::size_t> at(widths_.size());  // where each layer's input sits in saved
  for (std::size_t l = 1; l < widths_.size(); ++l) at[l] = at[l - 1] + batch_ * widths_[l - 1];
  const auto last_width = static_cast<Eigen::Index>(widths_.back());
  Mat g(b, last_width);
  const float* y = a.saved.data() + at.back();
  if (last_) {  // d(mean loss)/d logits = (softmax - one-hot) / valid
    float valid = 0;
    for (std::int32_t label : a.batch.labels) valid += label >= 0 ? 1.0f : 0.0f;
    for (Eigen::Index i = 0; i < b; ++i) {
      const std::int32_t label = a.batch.labels[static_cast<std::size_t>(i)];
      const float* l = y + i * last_width;
      const float mx = *std::max_element(l, l + last_width);
      float sum = 0;
      for (Eigen::Index c = 0; c < last_width; ++c) sum += std::exp(l[c] - mx);
      for (Eigen::Index c = 0; c < last_width; ++c) {
        g(i, c) = label < 0 ? 0.0f : (std::exp(l[c] - mx) / sum - (c == label ? 1.0f : 0.0f)) / valid;
      }
    }
  } else {  // through this stage's last ReLU
    ConstMatMap go(a.grad_output.data(), b, last_width);
    ConstMatMap out(y, b, last_width);
    g = go.array() * (out.array() > 0.0f).cast<float>();
  }
  for (std::size_t l = layers(); l-- > 0;) {
    const auto in = static_cast<Eigen::Index>(widths_[l]);
    const auto out = static_cast<Eigen::Index>(widths_[l + 1]);
    ConstMatMap xl(a.saved.data() + at[l], b, in);
    ConstMatMap w(params_.data() + weight_offset(l), out, in);
    MatMap gw(a.gradients.data() + weight_offset(l), out, in);
    RowMap gb(a.gradients.data() + bias_offset(l), out);
    gw.noalias() += g.transpose() * xl;
    gb += g.colwise().sum();
    if (l == 0 && first_) break;  // no gradient for the images
    Mat prev = g * w;
    if (l > 0) {
      g = prev.array() * (xl.array() > 0.0f).cast<float>();  // through the previous layer's ReLU
    } else {
      std::copy(prev.data(), prev.data() + prev.size(), a.grad_input.begin());
    }
  }
}

void MlpStage::update(const bspflow::StageContext&, std::span<const float> grads) {
  optimizer_.step(params_, grads, adam_state_, ++steps_);
}

bspflow::StageList make_mlp(std::uint32_t stages, std::size_t batch, AdamW optimizer) {
  const std::vector<std::size_t> widths{784, 256, 256, 128, 10};
  std::vector<std::vector<std::size_t>> split;
  switch (stages) {
    case 1: split = {widths}; break;
    case 2: split = {{784, 256}, {256, 256, 128, 10}}; break;
    case 4: split = {{784, 256}, {256, 256}, {256, 128}, {128, 10}}; break;
    default: throw std::invalid_argument("the model splits into 1, 2 or 4 stages, not " + std::to_string(stages));
  }
  const char* names[] = {"dense784", "dense256", "dense128", "logits"};
  bspflow::StageList list;
  for (std::uint32_t s = 0; s < stages; ++s) {
    const std::string name = stages == 1 ? "mlp" : names[stages == 2 ? s * 3 : s];
    list.push_back(std::make_unique<MlpStage>(name, split[s], batch, s == 0, s + 1 == stages, optimizer,
                                              /*seed=*/1234 + s));
  }
  return list;
}

}  // namespace kit
