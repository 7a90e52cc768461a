// Tensors, element types and fp16 storage conversion.
#include "bspflow/data/tensor.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace bspflow {

const char* to_string(DType t) noexcept {
  switch (t) {
    case DType::kUint8:
      return "uint8";
    case DType::kFloat16:
      return "fp16";
    case DType::kFloat32:
      return "fp32";
    case DType::kInt32:
      return "int32";
  }
  return "?";
}

std::uint16_t to_half(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t exp = (x >> 23) & 0xFFu;
  std::uint32_t mant = x & 0x7FFFFFu;
  if (exp == 0xFF) {  // infinity or NaN (keep NaN quiet and non-zero)
    return static_cast<std::uint16_t>(sign | 0x7C00u | (mant != 0 ? 0x200u | (mant >> 13) : 0));
  }
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<std::uint16_t>(sign | 0x7C00u);  // overflow: infinity
  if (e <= 0) {
    // Subnormal half (or zero): shift the mantissa, with its implicit bit, into place.
    if (e < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - e;
    const std::uint32_t half = mant >> shift;
    const std::uint32_t rest = mant & ((1u << shift) - 1);
    const std::uint32_t halfway = 1u << (shift - 1);
    const std::uint32_t rounded =
        half + ((rest > halfway || (rest == halfway && (half & 1u))) ? 1 : 0);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  std::uint32_t h = (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  const std::uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent
  return static_cast<std::uint16_t>(sign | h);
}

float from_half(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign != 0 ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BSPFLOW_F16C 1
// F16C converts eight values per instruction, rounding to nearest even like to_half().
__attribute__((target("avx,f16c"))) void to_half_f16c(const float* in, std::uint16_t* out,
                                                      std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = to_half(in[i]);
}
__attribute__((target("avx,f16c"))) void from_half_f16c(const std::uint16_t* in, float* out,
                                                        std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = from_half(in[i]);
}
__attribute__((target("avx,f16c"))) void round_f16c(float* v, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(
        v + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT)));
  }
  for (; i < n; ++i) v[i] = from_half(to_half(v[i]));
}
bool has_f16c() noexcept {
  // CPUID leaf 1: F16C, AVX and OSXSAVE (the OS saves the AVX registers; XGETBV confirms).
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    if ((c & bit_F16C) == 0 || (c & bit_AVX) == 0 || (c & bit_OSXSAVE) == 0) return false;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0x6u) == 0x6u;  // XMM and YMM state enabled
  }();
  return yes;
}
#endif

}  // namespace

void to_half(std::span<const float> in, std::span<std::uint16_t> out) noexcept {
  const std::size_t n = std::min(in.size(), out.size());
#ifdef BSPFLOW_F16C
  if (has_f16c()) return to_half_f16c(in.data(), out.data(), n);
#endif
  for (std::size_t i = 0; i < n; ++i) out[i] = to_half(in[i]);
}

void from_half(std::span<const std::uint16_t> in, std::span<float> out) noexcept {
  const std::size_t n = std::min(in.size(), out.size());
#ifdef BSPFLOW_F16C
  if (has_f16c()) return from_half_f16c(in.data(), out.data(), n);
#endif
  for (std::size_t i = 0; i < n; ++i) out[i] = from_half(in[i]);
}

void round_to_half(std::span<float> values) noexcept {
#ifdef BSPFLOW_F16C
  if (has_f16c()) return round_f16c(values.data(), values.size());
#endif
  for (float& v : values) v = from_half(to_half(v));
}

namespace {

float load(DType t, const std::byte* p, std::size_t i) noexcept {
  switch (t) {
    case DType::kUint8:
      return static_cast<float>(std::to_integer<std::uint8_t>(p[i]));
    case DType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return from_half(h);
    }
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::kInt32: {
      std::int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return static_cast<float>(v);
    }
  }
  return 0.0f;
}

template <class I>
I saturate(float v) noexcept {
  if (std::isnan(v)) return 0;
  const float r = std::nearbyint(v);
  if (r <= static_cast<float>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  if (r >= static_cast<float>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(r);
}

void store(DType t, std::byte* p, std::size_t i, float v) noexcept {
  switch (t) {
    case DType::kUint8:
      p[i] = static_cast<std::byte>(saturate<std::uint8_t>(v));
      return;
    case DType::kFloat16: {
      const std::uint16_t h = to_half(v);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::kFloat32:
      std::memcpy(p + 4 * i, &v, 4);
      return;
    case DType::kInt32: {
      const std::int32_t x = saturate<std::int32_t>(v);
      std::memcpy(p + 4 * i, &x, 4);
      return;
    }
  }
}

}  // namespace

void convert(DType from, const std::byte* src, DType to, std::byte* dst,
             std::size_t count) noexcept {
  if (from == to) {
    std::memcpy(dst, src, count * dtype_size(from));
    return;
  }
  if (from == DType::kUint8 && to == DType::kFloat32) {  // the common 8-bit widening, fast
    for (std::size_t i = 0; i < count; ++i) {
      const float f = static_cast<float>(std::to_integer<std::uint8_t>(src[i]));
      std::memcpy(dst + 4 * i, &f, 4);
    }
    return;
  }
  for (std::size_t i = 0; i < count; ++i) store(to, dst, i, load(from, src, i));
}

std::size_t SampleSpec::elements() const noexcept {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

std::string SampleSpec::describe() const {
  std::string s = to_string(dtype);
  s += '[';
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += 'x';
    s += std::to_string(shape[i]);
  }
  s += ']';
  return s;
}

BufferPool::~BufferPool() {
  for (std::byte* b : spare_) delete[] b;
}

std::byte* BufferPool::take() {
  {
    std::lock_guard lock(mutex_);
    if (!spare_.empty()) {
      std::byte* b = spare_.back();
      spare_.pop_back();
      return b;
    }
  }
  return new std::byte[block_];
}

void BufferPool::give(std::byte* block) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (spare_.size() < keep_) {
      try {
        spare_.push_back(block);
        return;
      } catch (...) {  // could not grow the list: free the block instead
      }
    }
  }
  delete[] block;
}

namespace {

std::size_t checked_bytes(DType dtype, const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) {
    if (d != 0 && n > std::numeric_limits<std::size_t>::max() / 8 / d) {
      throw Error("tensor shape " + SampleSpec{dtype, shape}.describe() +
                  " is too large to address");
    }
    n *= d;
  }
  return n * dtype_size(dtype);
}

}  // namespace

Tensor::Tensor(DType dtype, std::vector<std::size_t> shape, std::shared_ptr<BufferPool> pool)
    : dtype_(dtype), shape_(std::move(shape)), size_(checked_bytes(dtype_, shape_)) {
  if (!pool || pool->block_bytes() != size_) {
    throw Error("tensor of " + std::to_string(size_) + " bytes cannot use a buffer pool of " +
                std::to_string(pool ? pool->block_bytes() : 0) + "-byte blocks");
  }
  std::byte* block = pool->take();
  bytes_ = std::unique_ptr<std::byte[], detail::TensorDeleter>(
      block, detail::TensorDeleter{std::move(pool)});
}

Tensor::Tensor(DType dtype, std::vector<std::size_t> shape, Init init)
    : dtype_(dtype), shape_(std::move(shape)) {
  size_ = checked_bytes(dtype_, shape_);
  if (size_ == 0) return;
  bytes_.reset(init == Init::kZero ? new std::byte[size_]() : new std::byte[size_]);
}

Tensor::Tensor(const Tensor& other)
    : dtype_(other.dtype_), shape_(other.shape_), size_(other.size_),
      bytes_(other.size_ != 0 ? new std::byte[other.size_] : nullptr) {
  if (size_ != 0) std::memcpy(bytes_.get(), other.bytes_.get(), size_);
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) *this = Tensor(other);
  return *this;
}

void Tensor::throw_mismatch(DType asked) const {
  throw Error(std::string("tensor holds ") + to_string(dtype_) + " elements, read as " +
              to_string(asked) + "; use as<" +
              (dtype_ == DType::kUint8     ? "std::uint8_t"
               : dtype_ == DType::kFloat16 ? "std::uint16_t"
               : dtype_ == DType::kFloat32 ? "float"
                                           : "std::int32_t") +
              ">()");
}

}  // namespace bspflow
