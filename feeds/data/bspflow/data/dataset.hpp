/// @file
/// Datasets a DataLoader reads: what a random-access or a streaming dataset must provide,
/// and three ready-made ones: SyntheticDataset (seeded random data, generated on demand),
/// TensorDataset (samples held in memory) and mnist_dataset(). Guide: feeds/README.md.
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

/// One sample: its data and an integer label (class index; -1 marks padding in a batch).
struct Sample {
  Tensor data;             ///< the sample's values, of the dataset's spec()
  std::int32_t label = 0;  ///< its class index
};

/// A random-access dataset (PyTorch's map-style Dataset): size() samples, spec() (element
/// type and shape of every sample) and get(i). Loader workers call get() concurrently, so it
/// must be safe to call from several threads; it may throw on a bad sample.
template <class D>
concept RandomAccessDataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.spec() } -> std::convertible_to<SampleSpec>;
  { d.get(i) } -> std::convertible_to<Sample>;
};

/// A random-access dataset that also writes sample i straight into a batch, without a
/// temporary: `std::int32_t read(std::size_t i, std::span<std::byte> out) const` fills `out`
/// and returns the label. Called concurrently, as get() is.
template <class D>
concept ReadIntoDataset = RandomAccessDataset<D> &&
    requires(const D& d, std::size_t i, std::span<std::byte> out) {
  { d.read(i, out) } -> std::convertible_to<std::int32_t>;
};

/// A streaming dataset (an iterable): size(), spec(), `bool next(Sample& out)` (the next
/// sample; false when the stream ends) and rewind() (back to the first sample, for a new
/// epoch). Read by one thread at a time, in order.
template <class D>
concept StreamingDataset = requires(D& d, Sample& s) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.spec() } -> std::convertible_to<SampleSpec>;
  { d.next(s) } -> std::same_as<bool>;
  d.rewind();
};

/// Seeded random samples, generated on demand: sample i depends only on (seed, i), so any
/// worker, in any order, produces the same bytes. Labels are uniform in 0..classes-1.
/// Thread-safe: get()/read() are const and share nothing.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class SyntheticDataset {
 public:
  /// What the sample values are drawn from.
  enum class Distribution {
    kNormal,   ///< N(0, 1)
    kUniform,  ///< U[0, 1) plus the label (PopTorch's data-loading tutorial), fp types only
    kZeros,    ///< every value 0
  };
  /// What to generate: how many samples, of what type and shape, drawn how.
  struct Config {
    std::size_t size = 1000;                        ///< samples in the dataset
    SampleSpec spec{DType::kFloat32, {1, 28, 28}};  ///< element type and shape of every sample
    std::int32_t classes = 10;                      ///< >= 1
    /// What the values are drawn from.
    Distribution distribution = Distribution::kNormal;
    std::uint64_t seed = 0;  ///< with the index, fixes each sample's label and values
  };
  /// Throws bspflow::Error for an empty shape, classes below 1, or uint8/int32 with
  /// kUniform.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  explicit SyntheticDataset(Config config);

  /// How many samples the dataset holds (Config::size).
  std::size_t size() const noexcept { return config_.size; }
  /// Element type and shape of every sample.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  SampleSpec spec() const { return config_.spec; }
  /// Sample i. Throws bspflow::Error if i is not below size().
  /// Contract: any; non-blocking; allocates; throws Error.
  Sample get(std::size_t i) const;
  /// Writes sample i into `out` (exactly spec().bytes()) and returns its label. Throws
  /// bspflow::Error if i is not below size() or `out` has another size.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  std::int32_t read(std::size_t i, std::span<std::byte> out) const;
  /// The label of sample i without generating its data.
  std::int32_t label(std::size_t i) const noexcept;

 private:
  Config config_;
};

/// Samples held in memory, contiguously. Thread-safe for concurrent get()/read().
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class TensorDataset {
 public:
  /// `data` holds size x spec.bytes() bytes; labels one per sample. Throws bspflow::Error
  /// if the sizes disagree.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  TensorDataset(SampleSpec spec, std::vector<std::byte> data, std::vector<std::int32_t> labels);

  /// Reads every sample of `source` once (on the calling thread). Throws what `source`
  /// throws, or bspflow::Error for a sample that does not match its spec().
  /// Contract: any; non-blocking; allocates; throws Error.
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

  /// How many samples the dataset holds.
  std::size_t size() const noexcept { return labels_.size(); }
  /// Element type and shape of every sample.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  SampleSpec spec() const { return spec_; }
  /// Sample i (a copy). Throws bspflow::Error if i is not below size().
  /// Contract: any; non-blocking; allocates; throws Error.
  Sample get(std::size_t i) const;
  /// Copies sample i into `out` (exactly spec().bytes()) and returns its label. Throws
  /// bspflow::Error if i is not below size() or `out` has another size.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  std::int32_t read(std::size_t i, std::span<std::byte> out) const;
  /// Every sample's label, in order.
  std::span<const std::int32_t> labels() const noexcept { return labels_; }
  /// Every sample's data, contiguous: size() x spec().bytes() bytes.
  std::span<const std::byte> bytes() const noexcept { return data_; }

  /// Throws bspflow::Error unless `s` matches `spec` (what a loader checks for get()).
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static void check_sample(const SampleSpec& spec, const Sample& s, std::size_t index);

 private:
  SampleSpec spec_;
  std::vector<std::byte> data_;
  std::vector<std::int32_t> labels_;
};

/// One split ("train": 60000, "t10k": 10000) of Fashion-MNIST or MNIST from IDX files in
/// `dir`, as uint8 samples of shape 1x28x28 (8-bit I/O: convert where the data is used).
/// Throws bspflow::Error naming the file and the defect.
/// Contract: any; non-blocking; allocates; throws Error.
TensorDataset mnist_dataset(const std::filesystem::path& dir, std::string_view split);

}  // namespace bspflow
