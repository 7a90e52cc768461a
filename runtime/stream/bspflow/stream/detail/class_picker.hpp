// Internal to streams (installed because the stream templates use it): which priority class a
// queue serves next, keeping each class's minimum share. The admission queue, each hop's
// consumer and each batch stage have one.
#pragma once

#include <array>
#include <bit>
#include <cstdint>

#include "bspflow/stream/request.hpp"

namespace bspflow::detail {

// Which priority class a queue serves next. Class 0 first, then 1, ...; but a class with
// work waiting whose share of what this queue served lately is below its minimum share is
// served first (the most short of its share). Shares are counted over a sliding window: the
// counts halve every kWindow services. Not thread-safe: one per consumer (or under a lock).
class ClassPicker {
 public:
  static constexpr std::uint32_t kWindow = 1024;
  explicit ClassPicker(const std::array<double, kPriorityClasses>& min_share = {})
      : min_share_(min_share) {}
  // The class to serve among those whose bit is set in `ready` (not 0).
  std::uint32_t pick(std::uint32_t ready) const noexcept {
    const std::uint32_t first = static_cast<std::uint32_t>(std::countr_zero(ready));
    if ((ready & (ready - 1)) == 0) return first;  // one class waits: it is served
    std::uint32_t best = first;
    double most_short = 0;
    for (std::uint32_t c = first + 1; c < kPriorityClasses; ++c) {
      if ((ready & (1u << c)) == 0 || min_share_[c] <= 0) continue;
      // Owed a whole request or more: its share of what was served is below its minimum.
      const double owed = min_share_[c] * static_cast<double>(total_) - count_[c];
      if (owed >= 1.0 && owed > most_short) {
        most_short = owed;
        best = c;
      }
    }
    return best;
  }
  // Class c was served once.
  void served(std::uint32_t c) noexcept {
    ++count_[c];
    if (++total_ >= kWindow) {
      total_ /= 2;
      for (auto& n : count_) n /= 2;
    }
  }

 private:
  std::array<double, kPriorityClasses> min_share_;
  std::array<double, kPriorityClasses> count_{};
  std::uint32_t total_ = 0;
};

}  // namespace bspflow::detail
