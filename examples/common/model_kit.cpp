#include "model_kit.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kit {

namespace {
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using RowMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowMap = Eigen::Map<const Eigen::RowVectorXf>;

Eigen::Index ix(std::size_t n) {
  return static_cast<Eigen::Index>(n);
}

// Softmax of one sample's logits, kept as its largest logit and the sum of exp(l - max):
// softmax(l)_c = exp(l_c - max) / sum, log-sum-exp = max + log(sum).
struct Softmax {
  float max = 0, sum = 0;
  Softmax(const float* l, std::size_t classes) : max(*std::max_element(l, l + classes)) {
    for (std::size_t c = 0; c < classes; ++c) sum += std::exp(l[c] - max);
  }
};

// PyTorch's Linear and Conv2d initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the
// weights and the biases.
void uniform_fan_in(std::span<float> params, std::size_t fan_in, std::mt19937_64& rng) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  std::uniform_real_distribution<float> u(-bound, bound);
  for (float& p : params) p = u(rng);
}
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

// ---- Dense ----

void Dense::init(std::span<float> params, std::mt19937_64& rng) const {
  uniform_fan_in(params, in_, rng);
}

void Dense::forward(std::span<const float> params, const float* x, float* y, std::size_t batch) {
  ConstMatMap xm(x, ix(batch), ix(in_));
  ConstMatMap w(params.data(), ix(out_), ix(in_));
  ConstRowMap bias(params.data() + in_ * out_, ix(out_));
  MatMap ym(y, ix(batch), ix(out_));
  ym.noalias() = xm * w.transpose();
  ym.rowwise() += bias;
}

void Dense::backward(std::span<const float> params, const float* x, const float*, const float* gy,
                     float* gx, std::span<float> grads, std::size_t batch) {
  ConstMatMap xm(x, ix(batch), ix(in_));
  ConstMatMap g(gy, ix(batch), ix(out_));
  MatMap gw(grads.data(), ix(out_), ix(in_));
  RowMap gb(grads.data() + in_ * out_, ix(out_));
  gw.noalias() += g.transpose() * xm;
  gb += g.colwise().sum();
  if (gx == nullptr) return;
  ConstMatMap w(params.data(), ix(out_), ix(in_));
  MatMap(gx, ix(batch), ix(in_)).noalias() = g * w;
}

// ---- Relu ----

void Relu::forward(std::span<const float>, const float* x, float* y, std::size_t batch) {
  for (std::size_t i = 0, n = batch * size_; i < n; ++i) y[i] = std::max(x[i], 0.0f);
}

void Relu::backward(std::span<const float>, const float*, const float* y, const float* gy,
                    float* gx, std::span<float>, std::size_t batch) {
  if (gx == nullptr) return;
  for (std::size_t i = 0, n = batch * size_; i < n; ++i) gx[i] = y[i] > 0.0f ? gy[i] : 0.0f;
}

// ---- Conv2d ----

Conv2d::Conv2d(Shape in, std::size_t out_channels, std::size_t kernel)
    : in_(in), out_{0, 0, out_channels}, k_(kernel) {
  if (kernel == 0 || kernel > in.height || kernel > in.width || in.channels == 0 ||
      out_channels == 0) {
    throw std::invalid_argument("Conv2d: a " + std::to_string(kernel) + "x" +
                                std::to_string(kernel) + " kernel does not fit a " +
                                std::to_string(in.height) + "x" + std::to_string(in.width) + "x" +
                                std::to_string(in.channels) + " input");
  }
  out_.height = in.height - kernel + 1;
  out_.width = in.width - kernel + 1;
}

void Conv2d::init(std::span<float> params, std::mt19937_64& rng) const {
  uniform_fan_in(params, patch(), rng);
}

void Conv2d::im2col(const float* x, std::size_t batch) {
  const std::size_t positions = out_.height * out_.width, row = k_ * in_.channels, p = patch();
  cols_.resize(batch * positions * p);
  float* dst = cols_.data();
  for (std::size_t n = 0; n < batch; ++n) {
    const float* image = x + n * in_.size();
    for (std::size_t oy = 0; oy < out_.height; ++oy) {
      for (std::size_t ox = 0; ox < out_.width; ++ox, dst += p) {
        for (std::size_t ky = 0; ky < k_; ++ky) {  // each kernel row is contiguous in the input
          const float* src = image + ((oy + ky) * in_.width + ox) * in_.channels;
          float* to = dst + ky * row;
          // A plain loop: rows are short (5 values for one channel), too short for memcpy.
          for (std::size_t i = 0; i < row; ++i) to[i] = src[i];
        }
      }
    }
  }
}

void Conv2d::forward(std::span<const float> params, const float* x, float* y, std::size_t batch) {
  im2col(x, batch);
  const std::size_t rows = batch * out_.height * out_.width, c = out_.channels;
  ConstMatMap cols(cols_.data(), ix(rows), ix(patch()));
  ConstMatMap w(params.data(), ix(c), ix(patch()));
  ConstRowMap bias(params.data() + c * patch(), ix(c));
  MatMap ym(y, ix(rows), ix(c));
  ym.noalias() = cols * w.transpose();
  ym.rowwise() += bias;
}

void Conv2d::backward(std::span<const float> params, const float* x, const float*, const float* gy,
                      float* gx, std::span<float> grads, std::size_t batch) {
  im2col(x, batch);
  const std::size_t rows = batch * out_.height * out_.width, c = out_.channels, p = patch();
  ConstMatMap g(gy, ix(rows), ix(c));
  {
    ConstMatMap cols(cols_.data(), ix(rows), ix(p));
    MatMap(grads.data(), ix(c), ix(p)).noalias() += g.transpose() * cols;
    RowMap(grads.data() + c * p, ix(c)) += g.colwise().sum();
  }
  if (gx == nullptr) return;
  // The patches' gradients (reusing the patch buffer), then added back where they came from.
  MatMap gcols(cols_.data(), ix(rows), ix(p));
  gcols.noalias() = g * ConstMatMap(params.data(), ix(c), ix(p));
  std::fill(gx, gx + batch * in_.size(), 0.0f);
  const std::size_t row = k_ * in_.channels;
  const float* src = cols_.data();
  for (std::size_t n = 0; n < batch; ++n) {
    float* image = gx + n * in_.size();
    for (std::size_t oy = 0; oy < out_.height; ++oy) {
      for (std::size_t ox = 0; ox < out_.width; ++ox, src += p) {
        for (std::size_t ky = 0; ky < k_; ++ky) {
          float* dst = image + ((oy + ky) * in_.width + ox) * in_.channels;
          const float* from = src + ky * row;
          for (std::size_t i = 0; i < row; ++i) dst[i] += from[i];
        }
      }
    }
  }
}

// ---- MaxPool2 ----

MaxPool2::MaxPool2(Shape in) : in_(in), out_{in.height / 2, in.width / 2, in.channels} {
  if (in.height % 2 != 0 || in.width % 2 != 0 || in.height == 0 || in.width == 0) {
    throw std::invalid_argument("MaxPool2: the input must have even height and width, not " +
                                std::to_string(in.height) + "x" + std::to_string(in.width));
  }
}

void MaxPool2::forward(std::span<const float>, const float* x, float* y, std::size_t batch) {
  const std::size_t c = in_.channels, row = in_.width * c;
  for (std::size_t n = 0; n < batch; ++n) {
    const float* image = x + n * in_.size();
    for (std::size_t oy = 0; oy < out_.height; ++oy) {
      for (std::size_t ox = 0; ox < out_.width; ++ox) {
        const float* top = image + (2 * oy * in_.width + 2 * ox) * c;
        for (std::size_t ch = 0; ch < c; ++ch, ++y) {
          *y = std::max(std::max(top[ch], top[c + ch]), std::max(top[row + ch], top[row + c + ch]));
        }
      }
    }
  }
}

void MaxPool2::backward(std::span<const float>, const float* x, const float* y, const float* gy,
                        float* gx, std::span<float>, std::size_t batch) {
  if (gx == nullptr) return;
  // The windows tile the input exactly, so every input gradient is written once: the
  // window's first maximum gets the output's gradient, the rest zero. No branches, so the
  // channel loop vectorises.
  const std::size_t c = in_.channels, row = in_.width * c;
  for (std::size_t n = 0; n < batch; ++n) {
    const std::size_t image = n * in_.size();
    for (std::size_t oy = 0; oy < out_.height; ++oy) {
      for (std::size_t ox = 0; ox < out_.width; ++ox, y += c, gy += c) {
        const std::size_t top = image + (2 * oy * in_.width + 2 * ox) * c;
        const float* a = x + top;
        const float* b = a + c;
        const float* d = a + row;
        float* ga = gx + top;
        float* gb = ga + c;
        float* gd = ga + row;
        float* ge = gd + c;
        for (std::size_t ch = 0; ch < c; ++ch) {
          const bool at_a = a[ch] == y[ch];
          const bool at_b = !at_a && b[ch] == y[ch];
          const bool at_d = !at_a && !at_b && d[ch] == y[ch];
          const bool at_e = !at_a && !at_b && !at_d;
          ga[ch] = at_a ? gy[ch] : 0.0f;
          gb[ch] = at_b ? gy[ch] : 0.0f;
          gd[ch] = at_d ? gy[ch] : 0.0f;
          ge[ch] = at_e ? gy[ch] : 0.0f;
        }
      }
    }
  }
}

// ---- LayerStage ----

LayerStage::LayerStage(std::string name, Layers layers, std::size_t batch, bool first, bool last,
                       AdamW optimizer, std::uint64_t seed)
    : name_(std::move(name)), layers_(std::move(layers)), batch_(batch), first_(first), last_(last),
      optimizer_(optimizer) {
  if (layers_.empty())
    throw std::invalid_argument("LayerStage '" + name_ + "' needs at least one layer");
  std::size_t params = 0, saved = 0;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (l > 0 && layers_[l]->in_size() != layers_[l - 1]->out_size()) {
      throw std::invalid_argument("LayerStage '" + name_ + "': layer " + std::to_string(l) +
                                  " takes " + std::to_string(layers_[l]->in_size()) +
                                  " values, the layer before gives " +
                                  std::to_string(layers_[l - 1]->out_size()));
    }
    param_at_.push_back(params);
    params += layers_[l]->param_count();
    saved_at_.push_back(saved);
    saved += batch_ * layers_[l]->in_size();
  }
  param_at_.push_back(params);
  saved_at_.push_back(saved);
  params_.resize(params);
  adam_state_.assign(2 * params, 0.0f);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    std::mt19937_64 rng(seed + l);
    layers_[l]->init(std::span<float>(params_).subspan(param_at_[l], layers_[l]->param_count()),
                     rng);
  }
}

std::span<const float> LayerStage::params_of(std::size_t l) const {
  return std::span<const float>(params_).subspan(param_at_[l], layers_[l]->param_count());
}

std::size_t LayerStage::output_elements() const {
  return last_ ? HeadOutput::kElements : batch_ * layers_.back()->out_size();
}

void LayerStage::set_parameters(const std::vector<float>& p) {
  if (p.size() != params_.size()) {
    throw std::invalid_argument("LayerStage::set_parameters: " + std::to_string(p.size()) +
                                " values, stage '" + name_ + "' has " +
                                std::to_string(params_.size()));
  }
  params_ = p;
  half_weights_ = false;
}

// ---- the modeled clock: each layer's work ----

bspflow::Work Dense::forward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double b = static_cast<double>(batch), in = static_cast<double>(in_),
               out = static_cast<double>(out_);
  return {2 * in * out * b, (in * b + in * out + out * b) * value_bytes(p), p};
}
bspflow::Work Dense::backward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  // d x = d y W and d W = d y^T x: twice the forward's multiply-adds, and the weights'
  // gradient written too.
  const double b = static_cast<double>(batch), in = static_cast<double>(in_),
               out = static_cast<double>(out_);
  return {4 * in * out * b, (2 * in * b + 2 * in * out + out * b) * value_bytes(p), p};
}
bspflow::Work Relu::forward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double n = static_cast<double>(size_ * batch);
  return {n, 2 * n * value_bytes(p), p};
}
bspflow::Work Relu::backward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double n = static_cast<double>(size_ * batch);
  return {n, 3 * n * value_bytes(p), p};
}
bspflow::Work Conv2d::forward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double b = static_cast<double>(batch);
  const double positions = static_cast<double>(out_.height * out_.width);
  const double macs = positions * static_cast<double>(patch() * out_.channels) * b;
  const double values = static_cast<double>(in_.size()) * b + static_cast<double>(param_count()) +
                        static_cast<double>(out_.size()) * b;
  return {2 * macs, values * value_bytes(p), p};
}
bspflow::Work Conv2d::backward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  bspflow::Work w = forward_work(batch, p);
  return w.times(2);  // the input's and the weights' gradients: a convolution each
}
bspflow::Work MaxPool2::forward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double in = static_cast<double>(in_.size() * batch);
  const double out = static_cast<double>(out_.size() * batch);
  return {in, (in + out) * value_bytes(p), p};
}
bspflow::Work MaxPool2::backward_work(std::size_t batch, bspflow::WorkPrecision p) const {
  const double in = static_cast<double>(in_.size() * batch);
  const double out = static_cast<double>(out_.size() * batch);
  return {in, (2 * in + out) * value_bytes(p), p};
}

bspflow::StageCost LayerStage::cost(bspflow::WorkPrecision precision) const {
  bspflow::Work forward{0, 0, precision, 0}, backward{0, 0, precision, 0};
  for (const auto& layer : layers_) {
    forward += layer->forward_work(batch_, precision);
    backward += layer->backward_work(batch_, precision);
  }
  const double b = static_cast<double>(batch_);
  if (first_) {  // normalising the images: a multiply-add per pixel
    const double pixels = static_cast<double>(layers_.front()->in_size()) * b;
    forward += bspflow::Work{2 * pixels, pixels * (1 + value_bytes(precision)), precision};
  }
  if (last_) {  // softmax cross-entropy: a few operations per logit
    const double logits = static_cast<double>(layers_.back()->out_size()) * b;
    forward += bspflow::Work{8 * logits, 2 * logits * 4, precision};
    backward += bspflow::Work{2 * logits, 2 * logits * 4, precision};
  }
  const double weights = static_cast<double>(params_.size());
  const bspflow::Work update{12 * weights, 28 * weights, bspflow::WorkPrecision::kFloat32};
  return {forward, backward, update};
}

bspflow::StageMemory LayerStage::memory() const {
  bspflow::StageMemory m;
  m.parameters = params_.size();
  m.optimizer_state = adam_state_.size();
  m.saved = saved_at_.back() + batch_ * layers_.back()->out_size();
  m.backward_reads_input = false;  // forward keeps its input in saved (every layer's input)
  std::size_t scratch = 0, widest = 0;
  for (const auto& layer : layers_) {
    scratch = std::max(scratch, layer->scratch_per_sample());
    widest = std::max({widest, layer->in_size(), layer->out_size()});
  }
  m.working = batch_ * (scratch + 2 * widest);
  return m;
}

void LayerStage::forward(const bspflow::StageContext& ctx, bspflow::ForwardArgs& a) {
  if (ctx.storage == bspflow::DType::kFloat16 && !half_weights_) {
    bspflow::round_to_half(params_);
    half_weights_ = true;
  }
  // saved: every layer's input, then the last layer's output.
  a.saved.resize(saved_at_.back() + batch_ * layers_.back()->out_size());
  float* x = a.saved.data();
  const std::size_t n = batch_ * layers_.front()->in_size();
  if (first_) {
    const bspflow::Tensor& data = a.batch.data;
    if (data.elements() != n) {
      throw std::runtime_error("batch holds " + std::to_string(data.elements()) +
                               " values, the model expects " + std::to_string(n) + " (batch x " +
                               std::to_string(layers_.front()->in_size()) + ")");
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
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    layers_[l]->forward(params_of(l), a.saved.data() + saved_at_[l],
                        a.saved.data() + saved_at_[l + 1], batch_);
  }
  const float* y = a.saved.data() + saved_at_.back();
  if (!last_) {
    std::copy(y, y + batch_ * layers_.back()->out_size(), a.output.begin());
    return;
  }
  // Softmax cross-entropy over the valid samples (padding has label -1).
  const std::size_t classes = layers_.back()->out_size();
  HeadOutput h;
  for (std::size_t i = 0; i < batch_; ++i) {
    const std::int32_t label = a.batch.labels[i];
    if (label < 0) continue;
    const float* l = y + i * classes;
    const Softmax sm(l, classes);
    h.loss_sum += std::log(sm.sum) - (l[label] - sm.max);
    h.correct += (std::max_element(l, l + classes) - l) == label ? 1.0f : 0.0f;
    h.valid += 1.0f;
  }
  a.output[0] = h.loss_sum;
  a.output[1] = h.correct;
  a.output[2] = h.valid;
}

void LayerStage::backward(const bspflow::StageContext&, bspflow::BackwardArgs& a) {
  const float* saved = a.saved.data();
  const std::size_t top = batch_ * layers_.back()->out_size();
  grad_a_.resize(top);
  if (last_) {  // d(mean loss)/d logits = (softmax - one-hot) / valid
    const std::size_t classes = layers_.back()->out_size();
    const float* y = saved + saved_at_.back();
    float valid = 0;
    for (std::int32_t label : a.batch.labels) valid += label >= 0 ? 1.0f : 0.0f;
    for (std::size_t i = 0; i < batch_; ++i) {
      const std::int32_t label = a.batch.labels[i];
      const float* l = y + i * classes;
      float* g = grad_a_.data() + i * classes;
      const Softmax sm(l, classes);
      for (std::size_t c = 0; c < classes; ++c) {
        g[c] = label < 0 ? 0.0f
                         : (std::exp(l[c] - sm.max) / sm.sum -
                            (static_cast<std::int32_t>(c) == label ? 1.0f : 0.0f)) /
                               valid;
      }
    }
  } else {
    std::copy(a.grad_output.begin(), a.grad_output.end(), grad_a_.begin());
  }
  for (std::size_t l = layers_.size(); l-- > 0;) {
    float* gx = nullptr;
    if (l > 0) {
      grad_b_.resize(batch_ * layers_[l]->in_size());
      gx = grad_b_.data();
    } else if (!first_) {
      gx = a.grad_input.data();
    }
    layers_[l]->backward(params_of(l), saved + saved_at_[l], saved + saved_at_[l + 1],
                         grad_a_.data(), gx,
                         a.gradients.subspan(param_at_[l], layers_[l]->param_count()), batch_);
    if (l > 0) grad_a_.swap(grad_b_);
  }
}

void LayerStage::update(const bspflow::StageContext& ctx, std::span<const float> grads) {
  optimizer_.step(params_, grads, adam_state_, ++steps_);
  if (ctx.storage == bspflow::DType::kFloat16) bspflow::round_to_half(params_);
}

// ---- the examples' models ----

const char* to_string(Model m) noexcept {
  return m == Model::kConv ? "conv" : "mlp";
}

namespace {

struct Block {
  std::string name;
  Layers layers;
};

std::vector<Block> conv_blocks() {
  std::vector<Block> blocks(4);
  auto conv1 = std::make_unique<Conv2d>(Shape{28, 28, 1}, 10, 5);  // 24x24x10
  const Shape c1 = conv1->output_shape();
  blocks[0].name = "conv1";
  blocks[0].layers.push_back(std::move(conv1));
  blocks[0].layers.push_back(std::make_unique<MaxPool2>(c1));  // 12x12x10
  blocks[0].layers.push_back(std::make_unique<Relu>(c1.size() / 4));
  auto conv2 = std::make_unique<Conv2d>(Shape{12, 12, 10}, 20, 5);  // 8x8x20
  const Shape c2 = conv2->output_shape();
  blocks[1].name = "conv2";
  blocks[1].layers.push_back(std::move(conv2));
  blocks[1].layers.push_back(std::make_unique<MaxPool2>(c2));  // 4x4x20 = 320
  blocks[1].layers.push_back(std::make_unique<Relu>(c2.size() / 4));
  blocks[2].name = "dense320";
  blocks[2].layers.push_back(std::make_unique<Dense>(320, 256));
  blocks[2].layers.push_back(std::make_unique<Relu>(256));
  blocks[3].name = "logits";
  blocks[3].layers.push_back(std::make_unique<Dense>(256, 10));
  return blocks;
}

std::vector<Block> mlp_blocks() {
  std::vector<Block> blocks(4);
  const std::size_t widths[] = {784, 256, 256, 128, 10};
  const char* names[] = {"dense784", "dense256", "dense128", "logits"};
  for (std::size_t b = 0; b < 4; ++b) {
    blocks[b].name = names[b];
    blocks[b].layers.push_back(std::make_unique<Dense>(widths[b], widths[b + 1]));
    if (b < 3) blocks[b].layers.push_back(std::make_unique<Relu>(widths[b + 1]));
  }
  return blocks;
}

}  // namespace

bspflow::StageList make_model(Model model, std::uint32_t stages, std::size_t batch,
                              AdamW optimizer) {
  if (stages != 1 && stages != 2 && stages != 4) {
    throw std::invalid_argument("the model splits into 1, 2 or 4 stages, not " +
                                std::to_string(stages));
  }
  std::vector<Block> blocks = model == Model::kConv ? conv_blocks() : mlp_blocks();
  const std::size_t per_stage =
      blocks.size() / stages;  // 2 stages: the conv blocks, the dense blocks
  bspflow::StageList list;
  std::uint64_t seed =
      1234;  // per layer of the whole model: every split starts from the same weights
  for (std::uint32_t s = 0; s < stages; ++s) {
    std::string name;
    Layers layers;
    for (std::size_t b = s * per_stage; b < (s + 1) * per_stage; ++b) {
      name += (name.empty() ? "" : "+") + blocks[b].name;
      for (auto& layer : blocks[b].layers) layers.push_back(std::move(layer));
    }
    if (stages == 1) name = to_string(model);
    const std::size_t count = layers.size();
    list.push_back(std::make_unique<LayerStage>(std::move(name), std::move(layers), batch, s == 0,
                                                s + 1 == stages, optimizer, seed));
    seed += count;
  }
  return list;
}

}  // namespace kit
