// data/: the IDX reader and writer (bspflow/data/idx.hpp; MNIST / Fashion-MNIST files), on files
// written here.
#include <doctest/doctest.h>

#include <sys/resource.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <bspflow/data/idx.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test case, removed afterwards.
struct TempDir {
  TempDir() {
    path = fs::temp_directory_path() /
           ("bspflow-idx-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
  fs::path path;
};

std::vector<unsigned char> header(unsigned char type, std::vector<std::uint32_t> dims) {
  std::vector<unsigned char> h{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims) {
    h.push_back(static_cast<unsigned char>(d >> 24));
    h.push_back(static_cast<unsigned char>(d >> 16));
    h.push_back(static_cast<unsigned char>(d >> 8));
    h.push_back(static_cast<unsigned char>(d));
  }
  return h;
}

void write_gz(const fs::path& file, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(file.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) > 0);
  REQUIRE(gzclose(f) == Z_OK);
}

void write_plain(const fs::path& file, const std::vector<unsigned char>& bytes) {
  std::ofstream(file, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

idx::Array images(std::uint32_t n, std::uint32_t rows, std::uint32_t cols) {
  idx::Array a;
  a.type = idx::Type::kUint8;
  a.dims = {n, rows, cols};
  a.data.resize(std::size_t{n} * rows * cols);
  for (std::size_t i = 0; i < a.data.size(); ++i) a.data[i] = static_cast<std::byte>(i * 7 % 251);
  return a;
}

idx::Array labels(std::uint32_t n) {
  idx::Array a;
  a.type = idx::Type::kUint8;
  a.dims = {n};
  for (std::uint32_t i = 0; i < n; ++i) a.data.push_back(static_cast<std::byte>(i % 10));
  return a;
}

}  // namespace

TEST_SUITE_BEGIN("idx");

TEST_CASE("idx: write then read gives the same array, gzip or plain") {
  TempDir dir;
  const idx::Array a = images(5, 3, 4);
  idx::write(dir.path / "a.gz", a);
  const idx::Array b = idx::read(dir.path / "a.gz");
  CHECK(b.type == idx::Type::kUint8);
  CHECK(b.dims == std::vector<std::uint32_t>{5, 3, 4});
  CHECK(b.items() == 5);
  CHECK(b.item_bytes() == 12);
  CHECK(b.data == a.data);

  // The same bytes uncompressed read the same.
  auto bytes = header(0x08, {5, 3, 4});
  for (std::byte x : a.data) bytes.push_back(static_cast<unsigned char>(x));
  write_plain(dir.path / "a.idx", bytes);
  CHECK(idx::read(dir.path / "a.idx").data == a.data);
}

TEST_CASE("idx: multi-byte elements are big-endian in the file, host order in memory") {
  TempDir dir;
  auto bytes = header(0x0C, {2});
  for (unsigned char c : {0x00, 0x00, 0x01, 0x02, 0xFF, 0xFF, 0xFF, 0xFE}) bytes.push_back(c);
  write_gz(dir.path / "i.gz", bytes);
  const idx::Array a = idx::read(dir.path / "i.gz");
  REQUIRE(a.data.size() == 8);
  std::int32_t v[2];
  std::memcpy(v, a.data.data(), sizeof v);
  CHECK(v[0] == 0x0102);
  CHECK(v[1] == -2);

  auto fb = header(0x0D, {1});
  for (unsigned char c : {0x3F, 0xC0, 0x00, 0x00}) fb.push_back(c);  // 1.5f
  write_gz(dir.path / "f.gz", fb);
  const idx::Array f = idx::read(dir.path / "f.gz");
  float x = 0;
  std::memcpy(&x, f.data.data(), sizeof x);
  CHECK(x == 1.5f);
  // And write() produces the same big-endian bytes back.
  idx::write(dir.path / "f2.gz", f);
  CHECK(idx::read(dir.path / "f2.gz").data == f.data);
}

TEST_CASE("idx: bad files are clear errors naming the file and what is wrong") {
  TempDir dir;
  const auto file = [&](const char* name) { return (dir.path / name).string(); };

  CHECK(contains(error_of([&] { idx::read(dir.path / "missing.gz"); }), "no such file"));
  CHECK(contains(error_of([&] { idx::read(dir.path / "missing.gz"); }), file("missing.gz")));
  CHECK(contains(error_of([&] { idx::read(dir.path); }), "not a regular file"));

  write_gz(dir.path / "empty.gz", {});
  CHECK(contains(error_of([&] { idx::read(dir.path / "empty.gz"); }), "shorter than the 4-byte"));

  write_gz(dir.path / "magic.gz", {0x1f, 0x00, 0x08, 0x01, 0, 0, 0, 1, 7});
  const std::string magic = error_of([&] { idx::read(dir.path / "magic.gz"); });
  CHECK(contains(magic, file("magic.gz")));
  CHECK(contains(magic, "bad magic number"));
  CHECK(contains(magic, "0x1f000801"));

  write_gz(dir.path / "type.gz", {0, 0, 0x07, 0x01, 0, 0, 0, 1, 7});
  CHECK(contains(error_of([&] { idx::read(dir.path / "type.gz"); }),
                 "unknown element type code 0x07"));

  write_gz(dir.path / "ndims.gz", {0, 0, 0x08, 0x00});
  CHECK(contains(error_of([&] { idx::read(dir.path / "ndims.gz"); }),
                 "dimension count 0 is not allowed: must be 1..8"));

  write_gz(dir.path / "dims.gz", {0, 0, 0x08, 0x03, 0, 0, 0, 2});
  CHECK(contains(error_of([&] { idx::read(dir.path / "dims.gz"); }), "ends inside them"));

  auto trunc = header(0x08, {10, 28, 28});
  trunc.resize(trunc.size() + 100);
  write_gz(dir.path / "trunc.gz", trunc);
  const std::string t = error_of([&] { idx::read(dir.path / "trunc.gz"); });
  CHECK(contains(t, "truncated"));
  CHECK(contains(t, "10 x 28 x 28 uint8 (7840 bytes"));

  auto longer = header(0x08, {2});
  longer.insert(longer.end(), {1, 2, 3});
  write_gz(dir.path / "long.gz", longer);
  CHECK(
      contains(error_of([&] { idx::read(dir.path / "long.gz"); }), "longer than its header says"));

  auto huge = header(0x0E, {0xFFFFFFFF, 0xFFFFFFFF});
  write_gz(dir.path / "huge.gz", huge);
  CHECK(contains(error_of([&] { idx::read(dir.path / "huge.gz"); }), "dimensions too large"));

  // A gzip stream cut in the middle: zlib reports it, we name the file.
  idx::write(dir.path / "whole.gz", images(50, 28, 28));
  std::ifstream in(dir.path / "whole.gz", std::ios::binary);
  std::vector<unsigned char> gz((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  gz.resize(gz.size() / 2);
  write_plain(dir.path / "cut.gz", gz);
  const std::string cut = error_of([&] { idx::read(dir.path / "cut.gz"); });
  CHECK(contains(cut, file("cut.gz")));
  CHECK((contains(cut, "truncated") || contains(cut, "gzip data is corrupt or cut short")));
  // Corrupt in the middle: zlib's complaint, the path named once.
  std::vector<unsigned char> bad(
      (std::istreambuf_iterator<char>(
          std::ifstream(dir.path / "whole.gz", std::ios::binary).rdbuf())),
      std::istreambuf_iterator<char>());
  for (std::size_t i = bad.size() / 2; i < bad.size() / 2 + 64; ++i) bad[i] ^= 0xA5;
  write_plain(dir.path / "bad.gz", bad);
  const std::string corrupt = error_of([&] { idx::read(dir.path / "bad.gz"); });
  CHECK(contains(corrupt, "its gzip data is corrupt or cut short (zlib: "));
  const std::string path = file("bad.gz");
  CHECK(corrupt.find(path) != std::string::npos);
  CHECK(corrupt.find(path, corrupt.find(path) + path.size()) == std::string::npos);  // once
}

// Guards (regression input tests/fuzz/regressions/idx/oom_found_by_fuzz_idx): a short file
// promising 4 GiB is refused without allocating (and zeroing) the 4 GiB first. The buffer
// grows with the data read: the peak memory of the process stays near where it was.
TEST_CASE("idx: a short file whose header promises gigabytes is refused without allocating them") {
  TempDir dir;
  const auto peak_bytes = [] {
    rusage u{};
    REQUIRE(getrusage(RUSAGE_SELF, &u) == 0);
    return static_cast<std::uint64_t>(u.ru_maxrss) * 1024;  // ru_maxrss is in KiB
  };
  for (const bool gz : {false, true}) {
    CAPTURE(gz);
    const auto promise = header(0x08, {65536, 65536});  // 4 GiB of uint8, then nothing
    const fs::path f = dir.path / (gz ? "promise.gz" : "promise");
    if (gz) {
      write_gz(f, promise);
    } else {
      write_plain(f, promise);
    }
    const std::uint64_t before = peak_bytes();
    const std::string e = error_of([&] { idx::read(f); });
    CHECK(contains(e, "truncated: the header says 65536 x 65536 uint8 (4294967296 bytes of data)"));
    CHECK(peak_bytes() - before < (std::uint64_t{1} << 30));
  }
}

TEST_CASE("idx: load_mnist checks types, shapes and that images and labels agree") {
  TempDir dir;
  idx::write(dir.path / "train-images-idx3-ubyte.gz", images(20, 28, 28));
  idx::write(dir.path / "train-labels-idx1-ubyte.gz", labels(20));
  const auto train = idx::load_mnist(dir.path, "train");
  CHECK(train.images.items() == 20);
  CHECK(train.images.item_bytes() == 784);
  CHECK(train.labels.items() == 20);

  CHECK(contains(error_of([&] { idx::load_mnist(dir.path, "test"); }),
                 "split \"test\" is not allowed: use train or t10k"));
  CHECK(contains(error_of([&] { idx::load_mnist(dir.path, "t10k"); }), "no such file"));

  idx::write(dir.path / "t10k-images-idx3-ubyte.gz", images(20, 28, 28));
  idx::write(dir.path / "t10k-labels-idx1-ubyte.gz", labels(19));
  CHECK(contains(error_of([&] { idx::load_mnist(dir.path, "t10k"); }), "19 labels for 20 images"));

  idx::write(dir.path / "t10k-labels-idx1-ubyte.gz", images(20, 2, 2));
  CHECK(contains(error_of([&] { idx::load_mnist(dir.path, "t10k"); }),
                 "expected uint8 labels with 1 dimension"));
}

TEST_SUITE_END();
