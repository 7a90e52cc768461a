/// @file
/// Typed tensors for host data: an element type, a shape and contiguous row-major bytes;
/// the fp16 conversions; BufferPool, which recycles tensor buffers. Guide: feeds/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"

namespace bspflow {

/// The element types a host feeds an IPU with: uint8 (8-bit I/O), fp16 (storage only:
/// bspflow moves the bits and converts with to_half()/from_half()), fp32, and int32 (labels).
enum class DType : std::uint8_t { kUint8, kFloat16, kFloat32, kInt32 };

/// Bytes per element.
/// Contract: any; non-blocking; no-alloc; noexcept.
constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kUint8:
      return 1;
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
  }
  return 0;
}
/// "uint8", "fp16", "fp32", "int32".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(DType t) noexcept;

/// fp16 storage: IEEE binary16 bits. Round to nearest even; overflow gives infinity; NaN
/// stays NaN.
/// Contract: any; non-blocking; no-alloc; noexcept.
std::uint16_t to_half(float f) noexcept;
/// The float an fp16 value stands for (exact).
/// Contract: any; non-blocking; no-alloc; noexcept.
float from_half(std::uint16_t h) noexcept;
/// to_half() over arrays, converting min(in.size(), out.size()) values (F16C instructions
/// where the CPU has them, else the scalar function: the results are identical, except the
/// payload bits of a NaN).
/// Contract: any; non-blocking; no-alloc; noexcept.
void to_half(std::span<const float> in, std::span<std::uint16_t> out) noexcept;
/// from_half() over arrays, converting min(in.size(), out.size()) values (F16C instructions
/// where the CPU has them, as for to_half()).
/// Contract: any; non-blocking; no-alloc; noexcept.
void from_half(std::span<const std::uint16_t> in, std::span<float> out) noexcept;
/// Each value as half precision would store it: from_half(to_half(v)).
/// Contract: any; non-blocking; no-alloc; noexcept.
void round_to_half(std::span<float> values) noexcept;

/// Whether E is the storage type of a DType (fp16 is stored as its 16 bits).
template <class E>
constexpr bool kIsElement = std::is_same_v<E, std::uint8_t> || std::is_same_v<E, std::uint16_t> ||
                            std::is_same_v<E, float> || std::is_same_v<E, std::int32_t>;
/// The DType whose storage type is E.
/// Contract: any; non-blocking; no-alloc; noexcept.
template <class E>
constexpr DType dtype_of() noexcept {
  if constexpr (std::is_same_v<E, std::uint8_t>)
    return DType::kUint8;
  else if constexpr (std::is_same_v<E, std::uint16_t>)
    return DType::kFloat16;
  else if constexpr (std::is_same_v<E, float>)
    return DType::kFloat32;
  else
    return DType::kInt32;
}

/// What every sample of a dataset looks like: element type and shape (without a batch
/// dimension).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct SampleSpec {
  DType dtype = DType::kFloat32;   ///< the element type
  std::vector<std::size_t> shape;  ///< the dimensions, outermost first

  /// Elements per sample: the product of the dimensions.
  std::size_t elements() const noexcept;
  /// Bytes per sample: elements() times the element size.
  std::size_t bytes() const noexcept { return elements() * dtype_size(dtype); }
  /// "fp32[1x128x128]".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;
  /// Whether both specs have the same element type and shape.
  bool operator==(const SampleSpec&) const noexcept = default;
};

/// Recycles equal-sized tensor buffers (a DataLoader's micro-batches), so a steady stream of
/// batches does not map and fault in fresh memory for every step. Keeps at most `keep`
/// spare blocks; any thread may take or give. Tensors made from a pool (the Tensor
/// constructor that takes one) hold a shared_ptr to it, so the pool outlives every buffer
/// it handed out.
///
///   auto pool = std::make_shared<bspflow::BufferPool>(16 * 784, 8);
///   bspflow::Tensor t(bspflow::DType::kUint8, {16, 784}, pool);  // its buffer goes back to
///                                                                 // the pool when t dies
///
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class BufferPool {
 public:
  /// Blocks of `block_bytes`; at most `keep` spare ones are kept.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  BufferPool(std::size_t block_bytes, std::size_t keep) noexcept
      : block_(block_bytes), keep_(keep) {}
  /// Frees the spare blocks (blocks still taken are not its to free: do not destroy a pool
  /// while a block is out; a Tensor's shared_ptr sees to that).
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  /// The size of every block, in bytes.
  std::size_t block_bytes() const noexcept { return block_; }
  /// A block of block_bytes() (uninitialised): a spare one, else a new one.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::byte* take();
  /// Hands back a block taken from this pool: kept as a spare (the spare list may grow), or
  /// freed when `keep` are already kept (or the spare list cannot grow).
  /// Contract: any; non-blocking; allocates; noexcept.
  void give(std::byte* block) noexcept;

 private:
  const std::size_t block_;
  const std::size_t keep_;
  std::mutex mutex_;
  std::vector<std::byte*> spare_;
};

namespace detail {

/// Frees a tensor's buffer, or hands it back to the pool it came from.
struct TensorDeleter {
  std::shared_ptr<BufferPool> pool;
  void operator()(std::byte* p) const noexcept {
    if (pool) {
      pool->give(p);
    } else {
      delete[] p;
    }
  }
};

}  // namespace detail

/// An element type, a shape and contiguous row-major bytes:
///
///   bspflow::Tensor t(bspflow::DType::kUint8, {1, 28, 28});
///   std::span<std::uint8_t> px = t.as<std::uint8_t>();
///
/// A value: distinct Tensors may be used from distinct threads.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Tensor {
 public:
  /// How a new tensor's bytes start: zero-filled, or left for the caller to overwrite.
  enum class Init { kZero, kNone };

  Tensor() noexcept = default;
  /// Zero-filled, or (kNone) left for the caller to overwrite. Throws bspflow::Error if the
  /// shape is too large to address.
  /// Contract: any; non-blocking; allocates; throws Error.
  Tensor(DType dtype, std::vector<std::size_t> shape, Init init = Init::kZero);
  /// Zero-filled, as the constructor above.
  /// Contract: any; non-blocking; allocates; throws Error.
  Tensor(DType dtype, std::initializer_list<std::size_t> shape)
      : Tensor(dtype, std::vector<std::size_t>(shape)) {}
  /// Uninitialised, with its buffer from `pool` (whose block size must equal the tensor's
  /// bytes; throws bspflow::Error otherwise). The buffer goes back to the pool when the
  /// tensor (or the one it was moved to) dies.
  /// Contract: any; non-blocking; allocates; throws Error.
  Tensor(DType dtype, std::vector<std::size_t> shape, std::shared_ptr<BufferPool> pool);
  /// A copy of `other`'s bytes, in a buffer of its own (not from a pool).
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  Tensor(const Tensor& other);
  /// As the copy constructor, replacing this tensor's contents.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  Tensor& operator=(const Tensor& other);
  /// A moved-from tensor is empty (no elements), so it can be refilled safely.
  Tensor(Tensor&& other) noexcept
      : dtype_(other.dtype_), shape_(std::move(other.shape_)), size_(std::exchange(other.size_, 0)),
        bytes_(std::move(other.bytes_)) {
    other.shape_.clear();
  }
  /// Takes `other`'s contents; `other` is left empty.
  Tensor& operator=(Tensor&& other) noexcept {
    if (this != &other) {
      dtype_ = other.dtype_;
      shape_ = std::move(other.shape_);
      other.shape_.clear();
      size_ = std::exchange(other.size_, 0);
      bytes_ = std::move(other.bytes_);
    }
    return *this;
  }

  /// The element type.
  DType dtype() const noexcept { return dtype_; }
  /// The dimensions, outermost first.
  const std::vector<std::size_t>& shape() const noexcept { return shape_; }
  /// How many elements the tensor holds.
  std::size_t elements() const noexcept { return size_ / dtype_size(dtype_); }
  /// The size of its contents in bytes.
  std::size_t bytes() const noexcept { return size_; }
  /// Whether it holds no bytes (as a default-constructed or moved-from tensor).
  bool empty() const noexcept { return size_ == 0; }

  /// The contents as bytes.
  std::span<std::byte> raw() noexcept { return {bytes_.get(), size_}; }
  /// The contents as bytes, read-only.
  std::span<const std::byte> raw() const noexcept { return {bytes_.get(), size_}; }

  /// The elements as E. Throws bspflow::Error if E does not match dtype() (fp16 is read
  /// as std::uint16_t).
  /// Contract: any; non-blocking; no-alloc; throws Error.
  template <class E>
  std::span<E> as() {
    check<E>();
    return {reinterpret_cast<E*>(bytes_.get()), elements()};
  }
  /// The elements as const E, as the overload above.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  template <class E>
  std::span<const E> as() const {
    check<E>();
    return {reinterpret_cast<const E*>(bytes_.get()), elements()};
  }

 private:
  template <class E>
  void check() const {
    static_assert(kIsElement<std::remove_const_t<E>>,
                  "Tensor::as<E>: E must be uint8_t, uint16_t (fp16), float or int32_t");
    constexpr DType kAsked = dtype_of<std::remove_const_t<E>>();
    if (kAsked != dtype_) throw_mismatch(kAsked);
  }
  [[noreturn]] void throw_mismatch(DType asked) const;

  DType dtype_ = DType::kFloat32;
  std::vector<std::size_t> shape_;
  std::size_t size_ = 0;
  std::unique_ptr<std::byte[], detail::TensorDeleter> bytes_;
};

/// What a tensor moves over the host link: its bytes (a uint8 tensor a quarter of an fp32
/// one's). Found by argument-dependent lookup (loops::repeat).
/// Contract: any; non-blocking; no-alloc; noexcept.
inline std::size_t host_bytes(const Tensor& t) noexcept {
  return t.bytes();
}

/// Converts `count` elements from `from` to `to` (any pair of DTypes; uint8 to float maps
/// 0..255 to 0..255, not 0..1: normalise where the data is used).
/// Contract: any; non-blocking; no-alloc; noexcept.
void convert(DType from, const std::byte* src, DType to, std::byte* dst,
             std::size_t count) noexcept;

}  // namespace bspflow
