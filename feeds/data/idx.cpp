#include "bspflow/data/idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "bspflow/base/error.hpp"

namespace bspflow::idx {

namespace {

// Largest file we accept: far above MNIST's 47 MB, small enough that a corrupt header
// cannot ask for an absurd allocation.
constexpr std::uint64_t kMaxDataBytes = std::uint64_t{8} << 30;
constexpr int kMaxDims = 8;
// The elements are read this much at a time.
constexpr std::size_t kReadChunk = std::size_t{16} << 20;

[[noreturn]] void fail(const std::filesystem::path& file, const std::string& what) {
  throw Error("IDX file " + file.string() + ": " + what);
}

bool known_type(std::uint8_t code) {
  switch (static_cast<Type>(code)) {
    case Type::kUint8:
    case Type::kInt8:
    case Type::kInt16:
    case Type::kInt32:
    case Type::kFloat32:
    case Type::kFloat64:
      return true;
  }
  return false;
}

struct GzCloser {
  void operator()(gzFile_s* f) const noexcept { gzclose(f); }
};
using Gz = std::unique_ptr<gzFile_s, GzCloser>;

// Reads exactly n bytes; false if the stream ends first. Throws on a zlib error.
bool read_exact(gzFile f, const std::filesystem::path& file, void* out, std::size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    const unsigned chunk = static_cast<unsigned>(std::min<std::size_t>(n, 1u << 30));
    const int got = gzread(f, p, chunk);
    if (got < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      // zlib's message may start with the path, which fail() already names.
      std::string detail = msg != nullptr ? msg : "";
      const std::string prefix = file.string() + ": ";
      if (detail.rfind(prefix, 0) == 0) detail.erase(0, prefix.size());
      fail(file, "its gzip data is corrupt or cut short" +
                     (detail.empty() ? std::string() : " (zlib: " + detail + ")") +
                     "; fetch the file again");
    }
    if (got == 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

std::uint32_t big_endian_u32(const unsigned char* b) {
  return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) |
         std::uint32_t{b[3]};
}

void swap_to_host(Array& a) {
  const std::size_t size = element_size(a.type);
  if (size == 1 || std::endian::native == std::endian::big) return;
  for (std::size_t i = 0; i + size <= a.data.size(); i += size) {
    std::reverse(a.data.begin() + static_cast<std::ptrdiff_t>(i),
                 a.data.begin() + static_cast<std::ptrdiff_t>(i + size));
  }
}

}  // namespace

std::size_t element_size(Type t) noexcept {
  switch (t) {
    case Type::kUint8:
    case Type::kInt8:
      return 1;
    case Type::kInt16:
      return 2;
    case Type::kInt32:
    case Type::kFloat32:
      return 4;
    case Type::kFloat64:
      return 8;
  }
  return 1;
}

const char* to_string(Type t) noexcept {
  switch (t) {
    case Type::kUint8:
      return "uint8";
    case Type::kInt8:
      return "int8";
    case Type::kInt16:
      return "int16";
    case Type::kInt32:
      return "int32";
    case Type::kFloat32:
      return "float32";
    case Type::kFloat64:
      return "float64";
  }
  return "?";
}

std::size_t Array::item_elements() const noexcept {
  std::size_t n = 1;
  for (std::size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

std::size_t Array::item_bytes() const noexcept {
  return item_elements() * element_size(type);
}

Array read(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    fail(file, std::filesystem::exists(file, ec) ? "not a regular file" : "no such file");
  }
  Gz f(gzopen(file.c_str(), "rb"));
  if (!f) fail(file, "cannot open: " + std::generic_category().message(errno));
  gzbuffer(f.get(), 1u << 17);

  std::array<unsigned char, 4> magic{};
  if (!read_exact(f.get(), file, magic.data(), magic.size())) {
    fail(file, "truncated: shorter than the 4-byte IDX header");
  }
  if (magic[0] != 0 || magic[1] != 0) {
    char got[16];
    std::snprintf(got, sizeof got, "0x%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    fail(file,
         std::string("bad magic number: an IDX file starts with two zero bytes (got ") + got + ")");
  }
  if (!known_type(magic[2])) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", magic[2]);
    fail(file, std::string("unknown element type code ") + buf +
                   " (allowed: 0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, "
                   "0x0E float64)");
  }
  const int ndims = magic[3];
  if (ndims < 1 || ndims > kMaxDims) {
    fail(file, "dimension count " + std::to_string(ndims) + " is not allowed: must be 1.." +
                   std::to_string(kMaxDims));
  }

  Array a;
  a.type = static_cast<Type>(magic[2]);
  std::vector<unsigned char> raw_dims(static_cast<std::size_t>(ndims) * 4);
  if (!read_exact(f.get(), file, raw_dims.data(), raw_dims.size())) {
    fail(file, "truncated: the header says " + std::to_string(ndims) +
                   " dimensions but the file ends inside them");
  }
  // Count in bytes as we go, so a corrupt header can neither overflow nor ask for an
  // absurd allocation.
  std::uint64_t bytes = element_size(a.type);
  for (int d = 0; d < ndims; ++d) {
    const std::uint32_t n = big_endian_u32(raw_dims.data() + std::ptrdiff_t{4} * d);
    a.dims.push_back(n);
    if (n != 0 && bytes > kMaxDataBytes / n) {
      fail(file, "dimensions too large (over " + std::to_string(kMaxDataBytes >> 30) +
                     " GiB of data): the header is probably corrupt");
    }
    bytes *= n;
  }
  // The buffer grows as the data arrives, a chunk at a time: a short file whose header
  // promises gigabytes costs one chunk, not the promised size (a fuzzing regression input).
  for (std::size_t filled = 0; filled < bytes;) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(bytes - filled, kReadChunk));
    if (filled + n > a.data.capacity()) {  // doubling, but never past the promised size
      a.data.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(
          bytes, std::max<std::uint64_t>(2 * a.data.capacity(), filled + n))));
    }
    a.data.resize(filled + n);
    if (!read_exact(f.get(), file, a.data.data() + filled, n)) {
      std::string shape;
      for (std::size_t d = 0; d < a.dims.size(); ++d) {
        shape += (d ? " x " : "") + std::to_string(a.dims[d]);
      }
      fail(file, "truncated: the header says " + shape + " " + to_string(a.type) + " (" +
                     std::to_string(bytes) + " bytes of data) but the file ends before that");
    }
    filled += n;
  }
  unsigned char extra = 0;
  if (read_exact(f.get(), file, &extra, 1)) {
    fail(file, "longer than its header says: data continues after " + std::to_string(bytes) +
                   " bytes (wrong dimensions, or two files joined)");
  }
  swap_to_host(a);
  return a;
}

void write(const std::filesystem::path& file, const Array& a) {
  if (a.dims.empty() || a.dims.size() > static_cast<std::size_t>(kMaxDims)) {
    throw Error("idx::write: dimension count " + std::to_string(a.dims.size()) +
                " is not allowed: must be 1.." + std::to_string(kMaxDims));
  }
  std::uint64_t elements = 1;
  for (std::uint32_t d : a.dims) elements *= d;
  if (elements * element_size(a.type) != a.data.size()) {
    throw Error("idx::write: " + std::to_string(a.data.size()) +
                " bytes of data do not match the dimensions (" +
                std::to_string(elements * element_size(a.type)) + " bytes)");
  }
  Gz f(gzopen(file.c_str(), "wb"));
  if (!f) fail(file, "cannot create: " + std::generic_category().message(errno));
  std::vector<unsigned char> header{0, 0, static_cast<unsigned char>(a.type),
                                    static_cast<unsigned char>(a.dims.size())};
  for (std::uint32_t d : a.dims) {
    header.push_back(static_cast<unsigned char>(d >> 24));
    header.push_back(static_cast<unsigned char>(d >> 16));
    header.push_back(static_cast<unsigned char>(d >> 8));
    header.push_back(static_cast<unsigned char>(d));
  }
  // Elements go to the file big-endian; the byte swap that reads them converts back. Only
  // multi-byte elements on a little-endian host need the copy.
  const std::vector<std::byte>* bytes = &a.data;
  Array swapped;
  if (element_size(a.type) > 1 && std::endian::native == std::endian::little) {
    swapped = a;
    swap_to_host(swapped);
    bytes = &swapped.data;
  }
  const auto put = [&](const void* p, std::size_t n) {
    if (n != 0 && gzwrite(f.get(), p, static_cast<unsigned>(n)) != static_cast<int>(n)) {
      fail(file, "write failed");
    }
  };
  put(header.data(), header.size());
  put(bytes->data(), bytes->size());
  if (gzclose(f.release()) != Z_OK) fail(file, "write failed");
}

LabeledImages load_mnist(const std::filesystem::path& dir, std::string_view split) {
  if (split != "train" && split != "t10k") {
    throw Error("MNIST split \"" + std::string(split) + "\" is not allowed: use train or t10k");
  }
  const auto pick = [&](const std::string& stem) {
    auto gz = dir / (stem + ".gz");
    auto plain = dir / stem;
    std::error_code ec;
    if (std::filesystem::exists(gz, ec) || !std::filesystem::exists(plain, ec)) return gz;
    return plain;
  };
  LabeledImages out;
  const auto images_file = pick(std::string(split) + "-images-idx3-ubyte");
  const auto labels_file = pick(std::string(split) + "-labels-idx1-ubyte");
  out.images = read(images_file);
  out.labels = read(labels_file);
  if (out.images.type != Type::kUint8 || out.images.dims.size() != 3) {
    fail(images_file, std::string("expected uint8 images with 3 dimensions, got ") +
                          to_string(out.images.type) + " with " +
                          std::to_string(out.images.dims.size()));
  }
  if (out.labels.type != Type::kUint8 || out.labels.dims.size() != 1) {
    fail(labels_file, std::string("expected uint8 labels with 1 dimension, got ") +
                          to_string(out.labels.type) + " with " +
                          std::to_string(out.labels.dims.size()));
  }
  if (out.images.items() != out.labels.items()) {
    fail(labels_file, std::to_string(out.labels.items()) + " labels for " +
                          std::to_string(out.images.items()) + " images in " +
                          images_file.string());
  }
  return out;
}

}  // namespace bspflow::idx
