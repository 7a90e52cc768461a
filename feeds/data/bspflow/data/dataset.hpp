// Datasets a DataLoader reads: what a dataset must provide, and three ready-made ones.
//
// A random-access dataset (PyTorch's map-style Dataset) provides
//   std::size_t size() const;           // samples
//   SampleSpec spec() const;            // element type and shape of every sample
//   Sample get(std::size_t i) const;    // sample i (0 <= i < size())
// and optionally, to let the loader write straight into a batch without a temporary,
//   std::int32_t read(std::size_t i, std::span<std::byte> out) const;  // bytes in, label out
// get()/read() are called from several loader workers at once: they must be safe to call
// concurrently (const, no shared mutable state), and may throw on a bad sample.
//
// A streaming dataset (an iterable) provides size() and spec() as above and
//   bool next(Sample& out);   // the next sample; false when the stream ends
//   void rewind();            // back to the first sample (a new epoch)
// It is read by one thread at a time, in order.
//
// Ready-made: SyntheticDataset (seeded random data, generated on demand), TensorDataset
// (samples held in memory), and mnist_dataset() (a split of Fashion-MNIST or MNIST read from
// its IDX files, as a TensorDataset).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "bspflow/data/tensor.hpp"

namespace bspflow {

// One sample: its data and an integer label (class index; -1 marks padding in a batch).
struct Sample {
  Tensor data;
  std::int32_t label = 0;
};

template <class D>
concept RandomAccessDataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.spec() } -> std::convertible_to<SampleSpec>;
  { d.get(i) } -> std::convertible_to<Sample>;
};

template <class D>
concept ReadIntoDataset = RandomAccessDataset<D> &&
    requires(const D& d, std::size_t i, std::span<std::byte> out) {
  { d.read(i, out) } -> std::convertible_to<std::int32_t>;
};

template <class D>
concept StreamingDataset = requires(D& d, Sample& s) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.spec() } -> std::convertible_to<SampleSpec>;
  { d.next(s) } -> std::same_as<bool>;
  d.rewind();
};

// Seeded random samples, generated on demand: sample i depends only on (seed, i), so any
// worker, in any order, produces the same bytes. Labels are uniform in 0..classes-1.
// Thread-safe: get()/read() are const and share nothing.
class SyntheticDataset {
 public:
  enum class Distribution {
    kNormal,   // N(0, 1)
    kUniform,  // U[0, 1) plus the label (PopTorch's data-loading tutorial), fp types only
    kZeros,
  };
  struct Config {
    std::size_t size = 1000;
    SampleSpec spec{DType::kFloat32, {1, 28, 28}};
    std::int32_t classes = 10;  // >= 1
    Distribution distribution = Distribution::kNormal;
    std::uint64_t seed = 0;
  };
  // Throws bspflow::Error for an empty shape, classes < 1, or uint8/int32 with kUniform.
  explicit SyntheticDataset(Config config);

  std::size_t size() const noexcept { return config_.size; }
  SampleSpec spec() const { return config_.spec; }
  Sample get(std::size_t i) const;
  std::int32_t read(std::size_t i, std::span<std::byte> out) const;
  // The label of sample i without generating its data.
  std::int32_t label(std::size_t i) const noexcept;

 private:
  Config config_;
};

// Samples held in memory, contiguously. Thread-safe for concurrent get()/read().
class TensorDataset {
 public:
  // `data` holds size x spec.bytes() bytes; labels one per sample. Throws bspflow::Error
  // if the sizes disagree.
  TensorDataset(SampleSpec spec, std::vector<std::byte> data, std::vector<std::int32_t> labels);

  // Reads every sample of `source` once (on the calling thread).
  template <RandomAccessDataset D>
  static TensorDataset materialize(const D& source) {
    const SampleSpec spec = source.spec();
    std::vector<std::byte> data(source.size() * spec.bytes());
    std::vector<std::int32_t> labels(source.size());
    for (std::size_t i = 0; i < source.size(); ++i) {
      const std::span<std::byte> out(data.data() + i * spec.bytes(), spec.bytes());
      if constexpr (ReadIntoDataset<D>) {
        labels[i] = source.read(i, out);
      } else {
        Sample s = source.get(i);
        check_sample(spec, s, i);
        std::copy(s.data.raw().begin(), s.data.raw().end(), out.begin());
        labels[i] = s.label;
      }
    }
    return TensorDataset(spec, std::move(data), std::move(labels));
  }

  std::size_t size() const noexcept { return labels_.size(); }
  SampleSpec spec() const { return spec_; }
  Sample get(std::size_t i) const;
  std::int32_t read(std::size_t i, std::span<std::byte> out) const;
  std::span<const std::int32_t> labels() const noexcept { return labels_; }
  std::span<const std::byte> bytes() const noexcept { return data_; }

  // Throws bspflow::Error unless `s` matches `spec` (what a loader checks for get()).
  static void check_sample(const SampleSpec& spec, const Sample& s, std::size_t index);

 private:
  SampleSpec spec_;
  std::vector<std::byte> data_;
  std::vector<std::int32_t> labels_;
};

// One split ("train": 60000, "t10k": 10000) of Fashion-MNIST or MNIST from IDX files in
// `dir`, as uint8 samples of shape 1x28x28 (8-bit I/O: convert where the data is used).
// Throws bspflow::Error naming the file and the defect.
TensorDataset mnist_dataset(const std::filesystem::path& dir, std::string_view split);

}  // namespace bspflow
