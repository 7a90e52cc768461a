// data/: datasets (bspflow/data/dataset.hpp): the seeded synthetic dataset, TensorDataset, and
// IDX files (mnist_dataset) loading as a uint8 dataset.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <bspflow/data/dataset.hpp>
#include <bspflow/data/idx.hpp>
#include <bspflow/data/tensor.hpp>

#include "data_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::CountingDataset;
using test::error_of;

TEST_SUITE_BEGIN("dataset");

TEST_CASE("synthetic dataset: seeded, order-independent, normal") {
  SyntheticDataset::Config cfg;
  cfg.size = 100;
  cfg.spec = {DType::kFloat32, {4, 64}};
  cfg.seed = 7;
  SyntheticDataset a(cfg), b(cfg);
  const Sample s1 = a.get(42);
  (void)a.get(3);
  const Sample s2 = b.get(42);
  CHECK(std::memcmp(s1.data.raw().data(), s2.data.raw().data(), s1.data.bytes()) == 0);
  CHECK(s1.label == s2.label);
  CHECK(s1.label == a.label(42));
  cfg.seed = 8;
  SyntheticDataset c(cfg);
  CHECK(std::memcmp(s1.data.raw().data(), c.get(42).data.raw().data(), s1.data.bytes()) != 0);

  // Mean ~0, variance ~1 over 100 x 256 values.
  double sum = 0, sq = 0;
  std::set<std::int32_t> labels;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Sample s = a.get(i);
    labels.insert(s.label);
    for (float v : s.data.as<float>()) {
      sum += v;
      sq += static_cast<double>(v) * v;
    }
  }
  const double n = 100.0 * 256.0;
  CHECK(std::abs(sum / n) < 0.05);
  CHECK(std::abs(sq / n - 1.0) < 0.05);
  CHECK(labels.size() == 10);
  CHECK(*labels.begin() >= 0);
  CHECK(*labels.rbegin() <= 9);

  cfg.spec = {DType::kUint8, {1, 28, 28}};
  cfg.distribution = SyntheticDataset::Distribution::kUniform;
  CHECK(contains(error_of([&] { SyntheticDataset bad(cfg); }), "needs fp32 or fp16"));
  cfg.spec = {DType::kFloat32, {}};
  CHECK(contains(error_of([&] { SyntheticDataset bad(cfg); }), "shape"));
}

TEST_CASE("tensor dataset: materialize, read, size checks") {
  CountingDataset src(10);
  const TensorDataset mem = TensorDataset::materialize(src);
  CHECK(mem.size() == 10);
  CHECK(mem.get(6).data.as<std::int32_t>()[3] == 6);
  CHECK(mem.get(6).label == 6);
  CHECK(contains(error_of([&] { (void)mem.get(10); }), "must be below its size 10"));
  CHECK(contains(
      error_of([&] {
        TensorDataset bad(SampleSpec{DType::kUint8, {4}}, std::vector<std::byte>(7), {1, 2});
      }),
      "7 bytes of data for 2 labels"));
}

TEST_CASE("IDX files load as a uint8 dataset") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("bspflow-loader-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  idx::Array images{idx::Type::kUint8, {3, 28, 28}, std::vector<std::byte>(3 * 28 * 28)};
  for (std::size_t i = 0; i < images.data.size(); ++i) images.data[i] = std::byte(i % 251);
  idx::Array labels{idx::Type::kUint8, {3}, {std::byte{4}, std::byte{0}, std::byte{9}}};
  idx::write(dir / "train-images-idx3-ubyte.gz", images);
  idx::write(dir / "train-labels-idx1-ubyte.gz", labels);
  const TensorDataset ds = mnist_dataset(dir, "train");
  std::filesystem::remove_all(dir);
  CHECK(ds.size() == 3);
  CHECK(ds.spec() == SampleSpec{DType::kUint8, {1, 28, 28}});
  CHECK(ds.get(2).label == 9);
  CHECK(ds.get(1).data.as<std::uint8_t>()[0] == (784 % 251));
}

TEST_SUITE_END();
