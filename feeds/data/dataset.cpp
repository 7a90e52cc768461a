// Ready-made datasets: synthetic (seeded, on demand), in-memory, and MNIST-style IDX files.
#include "bspflow/data/dataset.hpp"

#include <cmath>
#include <cstring>
#include <numbers>
#include <string>

#include "bspflow/base/detail/random.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/data/idx.hpp"

namespace bspflow {

namespace {

using detail::splitmix64;

// xoshiro256+ (Blackman and Vigna): fast, good enough for test data, tiny state.
class Rng {
 public:
  Rng(std::uint64_t seed, std::uint64_t stream) noexcept {
    std::uint64_t x = seed ^ (stream * 0xD1B54A32D192ED03ull);
    for (auto& w : s_) w = splitmix64(x);
  }
  std::uint64_t next() noexcept {
    const std::uint64_t result = s_[0] + s_[3];
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = (s_[3] << 45) | (s_[3] >> 19);
    return result;
  }
  // Uniform in [0, 1), 24 bits.
  float uniform() noexcept { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }

 private:
  std::uint64_t s_[4];
};

// Streams: 0 for labels, 1 for data, so a label never depends on the data's length.
constexpr std::uint64_t kLabelStream = 0;
constexpr std::uint64_t kDataStream = 1;

template <class Store>
void generate(SyntheticDataset::Distribution dist, Rng& rng, std::size_t n, float offset,
              Store&& store) {
  using D = SyntheticDataset::Distribution;
  switch (dist) {
    case D::kZeros:
      for (std::size_t i = 0; i < n; ++i) store(i, 0.0f);
      return;
    case D::kUniform:
      for (std::size_t i = 0; i < n; ++i) store(i, rng.uniform() + offset);
      return;
    case D::kNormal:
      // Box-Muller: two uniforms give two independent normals.
      for (std::size_t i = 0; i < n; i += 2) {
        const float u1 = 1.0f - rng.uniform();  // (0, 1]: log is finite
        const float u2 = rng.uniform();
        const float r = std::sqrt(-2.0f * std::log(u1));
        const float a = 2.0f * std::numbers::pi_v<float> * u2;
        store(i, r * std::cos(a));
        if (i + 1 < n) store(i + 1, r * std::sin(a));
      }
      return;
  }
}

}  // namespace

SyntheticDataset::SyntheticDataset(Config config) : config_(std::move(config)) {
  if (config_.spec.shape.empty() || config_.spec.elements() == 0) {
    detail::throw_bad_value("synthetic dataset shape", config_.spec.describe(),
                            "needs at least one dimension and no zero dimension");
  }
  if (config_.classes < 1) {
    detail::throw_bad_value("synthetic dataset classes", std::to_string(config_.classes),
                            "must be at least 1");
  }
  if (config_.distribution == Distribution::kUniform &&
      (config_.spec.dtype == DType::kUint8 || config_.spec.dtype == DType::kInt32)) {
    detail::throw_bad_value("synthetic dataset distribution", "uniform",
                            std::string("needs fp32 or fp16 samples, not ") +
                                to_string(config_.spec.dtype) + " (use normal or zeros)");
  }
}

std::int32_t SyntheticDataset::label(std::size_t i) const noexcept {
  Rng rng(config_.seed, i * 2 + kLabelStream);
  return static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(config_.classes));
}

std::int32_t SyntheticDataset::read(std::size_t i, std::span<std::byte> out) const {
  if (i >= config_.size) {
    detail::throw_bad_value("synthetic dataset index", i,
                            "must be below its size " + std::to_string(config_.size));
  }
  const std::size_t n = config_.spec.elements();
  if (out.size() != n * dtype_size(config_.spec.dtype)) {
    detail::throw_bad_value(
        "synthetic dataset read buffer", out.size(),
        "must be exactly one sample, " + std::to_string(config_.spec.bytes()) + " bytes");
  }
  const std::int32_t lbl = label(i);
  Rng rng(config_.seed, i * 2 + kDataStream);
  std::byte* dst = out.data();
  const float offset = static_cast<float>(lbl);
  switch (config_.spec.dtype) {
    case DType::kFloat32:
      generate(config_.distribution, rng, n, offset,
               [dst](std::size_t k, float v) { std::memcpy(dst + 4 * k, &v, 4); });
      break;
    case DType::kFloat16:
      generate(config_.distribution, rng, n, offset, [dst](std::size_t k, float v) {
        const std::uint16_t h = to_half(v);
        std::memcpy(dst + 2 * k, &h, 2);
      });
      break;
    case DType::kUint8:  // normal data as an 8-bit image: 128 + 32 * N(0,1), clamped
      generate(config_.distribution, rng, n, offset, [dst](std::size_t k, float v) {
        const float p = std::nearbyint(128.0f + 32.0f * v);
        dst[k] = static_cast<std::byte>(p < 0 ? 0 : p > 255 ? 255 : static_cast<int>(p));
      });
      break;
    case DType::kInt32:
      generate(config_.distribution, rng, n, offset, [dst](std::size_t k, float v) {
        const auto x = static_cast<std::int32_t>(std::nearbyint(v * 1000.0f));
        std::memcpy(dst + 4 * k, &x, 4);
      });
      break;
  }
  return lbl;
}

Sample SyntheticDataset::get(std::size_t i) const {
  Sample s{Tensor(config_.spec.dtype, config_.spec.shape, Tensor::Init::kNone), 0};
  s.label = read(i, s.data.raw());
  return s;
}

TensorDataset::TensorDataset(SampleSpec spec, std::vector<std::byte> data,
                             std::vector<std::int32_t> labels)
    : spec_(std::move(spec)), data_(std::move(data)), labels_(std::move(labels)) {
  if (spec_.bytes() == 0) {
    detail::throw_bad_value("tensor dataset sample shape", spec_.describe(),
                            "needs at least one element per sample");
  }
  if (data_.size() != labels_.size() * spec_.bytes()) {
    throw Error("tensor dataset: " + std::to_string(data_.size()) + " bytes of data for " +
                std::to_string(labels_.size()) + " labels of " + spec_.describe() +
                " samples; expected " + std::to_string(labels_.size() * spec_.bytes()) + " bytes");
  }
}

std::int32_t TensorDataset::read(std::size_t i, std::span<std::byte> out) const {
  if (i >= labels_.size()) {
    detail::throw_bad_value("tensor dataset index", i,
                            "must be below its size " + std::to_string(labels_.size()));
  }
  if (out.size() != spec_.bytes()) {
    detail::throw_bad_value(
        "tensor dataset read buffer", out.size(),
        "must be exactly one sample, " + std::to_string(spec_.bytes()) + " bytes");
  }
  std::memcpy(out.data(), data_.data() + i * spec_.bytes(), spec_.bytes());
  return labels_[i];
}

Sample TensorDataset::get(std::size_t i) const {
  Sample s{Tensor(spec_.dtype, spec_.shape, Tensor::Init::kNone), 0};
  s.label = read(i, s.data.raw());
  return s;
}

void TensorDataset::check_sample(const SampleSpec& spec, const Sample& s, std::size_t index) {
  if (s.data.dtype() != spec.dtype || s.data.bytes() != spec.bytes()) {
    throw Error("sample " + std::to_string(index) + " is " +
                SampleSpec{s.data.dtype(), s.data.shape()}.describe() +
                " but the dataset's spec() says " + spec.describe());
  }
}

TensorDataset mnist_dataset(const std::filesystem::path& dir, std::string_view split) {
  idx::LabeledImages raw = idx::load_mnist(dir, split);
  SampleSpec spec{DType::kUint8, {1, raw.images.dims[1], raw.images.dims[2]}};
  std::vector<std::int32_t> labels(raw.labels.items());
  for (std::size_t i = 0; i < labels.size(); ++i) {
    labels[i] = std::to_integer<std::int32_t>(raw.labels.data[i]);
  }
  return TensorDataset(std::move(spec), std::move(raw.images.data), std::move(labels));
}

}  // namespace bspflow
