// Helpers shared by the data suite's files.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include <bspflow/data/dataset.hpp>
#include <bspflow/data/tensor.hpp>

namespace test {

// A small dataset whose sample i is recognisable: every element equals i, label i % 7.
// Counts reads; throws on `bad` indices.
class CountingDataset {
 public:
  explicit CountingDataset(std::size_t n, std::set<std::size_t> bad = {})
      : n_(n), bad_(std::move(bad)) {}
  std::size_t size() const { return n_; }
  bspflow::SampleSpec spec() const { return {bspflow::DType::kInt32, {2, 3}}; }
  bspflow::Sample get(std::size_t i) const {
    reads_.fetch_add(1, std::memory_order_relaxed);  // relaxed: a statistic
    if (bad_.count(i) != 0) throw std::runtime_error("corrupt record " + std::to_string(i));
    bspflow::Sample s{bspflow::Tensor(bspflow::DType::kInt32, {2, 3}),
                      static_cast<std::int32_t>(i % 7)};
    for (auto& v : s.data.as<std::int32_t>()) v = static_cast<std::int32_t>(i);
    return s;
  }
  std::uint64_t reads() const { return reads_.load(std::memory_order_relaxed); }

 private:
  std::size_t n_;
  std::set<std::size_t> bad_;
  mutable std::atomic<std::uint64_t> reads_{0};
};

}  // namespace test
