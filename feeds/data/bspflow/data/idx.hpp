/// @file
/// IDX files, the format of MNIST and Fashion-MNIST (gzip-compressed as shipped, or plain):
/// read(), write() and load_mnist(). A defective file is a bspflow::Error naming the file and
/// what was wrong; multi-byte elements are converted to host byte order.
/// Guide: feeds/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace bspflow::idx {

/// An IDX element type, by the type code in the file's magic number.
enum class Type : std::uint8_t {
  kUint8 = 0x08,
  kInt8 = 0x09,
  kInt16 = 0x0B,
  kInt32 = 0x0C,
  kFloat32 = 0x0D,
  kFloat64 = 0x0E,
};

/// Bytes per element of `t`.
/// Contract: any; non-blocking; no-alloc; noexcept.
std::size_t element_size(Type t) noexcept;
/// "uint8", "int8", "int16", "int32", "float32" or "float64".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(Type t) noexcept;

/// One IDX file: its element type, dimensions, and elements in host byte order.
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct Array {
  Type type = Type::kUint8;         ///< the element type
  std::vector<std::uint32_t> dims;  ///< the dimensions, outermost first
  std::vector<std::byte> data;      ///< the elements, in host byte order

  /// dims[0]: the number of items (images, labels).
  std::size_t items() const noexcept { return dims.empty() ? 0 : dims[0]; }
  /// Bytes of one item (the product of the other dimensions times the element size).
  std::size_t item_bytes() const noexcept;
  /// Elements of one item.
  std::size_t item_elements() const noexcept;
};

/// Reads one IDX file, gzip-compressed or plain. Throws bspflow::Error for a file that is
/// missing, not gzip or IDX, truncated, longer than its dimensions say, or with a type or
/// dimension count out of range.
/// Contract: any; non-blocking; allocates; throws Error.
Array read(const std::filesystem::path& file);

/// Writes `a` as a gzip-compressed IDX file (tests and tools). Throws bspflow::Error for
/// dimensions that do not match the data, or a file that cannot be written.
/// Contract: any; non-blocking; allocates; throws Error.
void write(const std::filesystem::path& file, const Array& a);

/// Images and labels of one split of an MNIST-style data set.
struct LabeledImages {
  Array images;  ///< N x rows x cols, uint8
  Array labels;  ///< N, uint8
};

/// Loads `<dir>/<split>-images-idx3-ubyte.gz` and `<dir>/<split>-labels-idx1-ubyte.gz` (or the
/// same names without .gz), split "train" or "t10k". Checks that the images are uint8 with 3
/// dimensions, the labels uint8 with 1, and that their counts agree.
/// Contract: any; non-blocking; allocates; throws Error.
LabeledImages load_mnist(const std::filesystem::path& dir, std::string_view split);

/// Where Debian's dataset-fashion-mnist package installs Fashion-MNIST.
inline constexpr const char* kDebianFashionMnistDir = "/usr/share/datasets/fashion-mnist";

}  // namespace bspflow::idx
