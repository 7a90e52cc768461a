/// @file
/// Histogram: counts of non-negative integer values (nanoseconds, batch sizes) in log-linear
/// buckets, HdrHistogram-style, with less than 0.79% relative error. One writer thread records
/// in O(1) with no allocation and no read-modify-write atomics; any thread reads a
/// HistogramSnapshot at any time, and snapshots of several histograms (one per device thread)
/// merge into one. A snapshot answers percentiles and writes OpenMetrics text and .hgrm
/// percentile files.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bspflow/base/tunables.hpp"

namespace bspflow {

/// The labels of an OpenMetrics sample, written in this order: {{"stage", "model"}}.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

namespace detail {

/// The bucket layout. Values 0..255 have a bucket each; above that, every octave
/// [2^k, 2^(k+1)) is cut into 128 sub-buckets of width 2^(k-7). A bucket is never wider than
/// 1/128 of its lowest value, so any value of a bucket is within 0.79% of any other.
inline constexpr unsigned kHistogramSubBucketBits = 7;
inline constexpr unsigned kHistogramLinearBits = kHistogramSubBucketBits + 1;

/// The bucket of `value`: one bit_width, one compare-and-select, one shift, one add.
constexpr std::size_t histogram_bucket(std::uint64_t value) noexcept {
  const auto width = static_cast<unsigned>(std::bit_width(value));
  const unsigned shift = width > kHistogramLinearBits ? width - kHistogramLinearBits : 0;
  return (std::size_t{shift} << kHistogramSubBucketBits) + static_cast<std::size_t>(value >> shift);
}
/// log2 of the width of `bucket`.
constexpr unsigned histogram_bucket_shift(std::size_t bucket) noexcept {
  return bucket < (std::size_t{1} << kHistogramLinearBits)
             ? 0
             : static_cast<unsigned>(bucket >> kHistogramSubBucketBits) - 1;
}
/// The lowest and the highest value `bucket` holds.
constexpr std::uint64_t histogram_bucket_lowest(std::size_t bucket) noexcept {
  const unsigned shift = histogram_bucket_shift(bucket);
  return static_cast<std::uint64_t>(bucket - (std::size_t{shift} << kHistogramSubBucketBits))
         << shift;
}
constexpr std::uint64_t histogram_bucket_highest(std::size_t bucket) noexcept {
  return histogram_bucket_lowest(bucket) +
         ((std::uint64_t{1} << histogram_bucket_shift(bucket)) - 1);
}

}  // namespace detail

/// What a Histogram held at one moment (or several merged): a plain value, any thread may
/// copy, merge and read it. Values are in the unit recorded (e.g. nanoseconds); the writers
/// divide them by a unit ratio (1e9: nanoseconds -> seconds).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class HistogramSnapshot {
 public:
  /// An upper bound of the OpenMetrics output and the count of values at or below it.
  struct CumulativeBucket {
    std::uint64_t le;     ///< the upper bound (OpenMetrics' `le` label)
    std::uint64_t count;  ///< values at or below it
  };

  /// An empty snapshot with no layout: the first merge() gives it the other's.
  HistogramSnapshot() noexcept = default;
  /// An empty snapshot with the layout of Histogram(highest_trackable). Throws bspflow::Error
  /// if highest_trackable < 2.
  /// Contract: any; non-blocking; allocates; throws Error.
  explicit HistogramSnapshot(std::uint64_t highest_trackable);

  /// The number of values counted. An empty snapshot answers 0 to this, sum(), min(), max()
  /// and mean().
  std::uint64_t count() const noexcept { return count_; }
  std::uint64_t sum() const noexcept { return sum_; }  ///< wraps after 2^64 - 1
  /// The smallest value counted.
  std::uint64_t min() const noexcept { return min_; }
  /// The largest value counted.
  std::uint64_t max() const noexcept { return max_; }
  /// The mean: sum() / count(), kept within min()..max().
  double mean() const noexcept;
  /// From the buckets (each counted at its midpoint), around mean().
  double stddev() const noexcept;
  /// Values recorded above highest_trackable() (counted as highest_trackable()).
  std::uint64_t clamped() const noexcept { return clamped_; }
  /// 0 for a snapshot with no layout.
  std::uint64_t highest_trackable() const noexcept { return highest_; }
  /// Per-bucket counts; bucket i holds detail::histogram_bucket_lowest(i)..._highest(i).
  std::span<const std::uint64_t> bucket_counts() const noexcept { return counts_; }

  /// The nearest-rank percentile: the smallest recorded value that at least `percentile`% of
  /// the values are at or below, reported as the highest value of its bucket (never below the
  /// true one, at most 0.79% above it) and kept within min()..max(): p0 is min(), p100 is
  /// max(). 0 if empty. Throws bspflow::Error if `percentile` is outside 0..100 or NaN.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  std::uint64_t value_at_percentile(double percentile) const;

  /// Adds `other`'s counts to this one's. Throws bspflow::Error (and changes nothing) if both
  /// have a layout and their highest_trackable differ.
  /// Contract: any; non-blocking; allocates (if this snapshot has no layout yet); throws Error.
  void merge(const HistogramSnapshot& other);

  /// The bounds the OpenMetrics writer uses, derived from the layout alone (so they stay the
  /// same from scrape to scrape): the end of every octave, 2^k - 1 (1, 3, 7 ...), below the
  /// top bucket, then the end of the bucket below the top one. Every bound is the end of a
  /// bucket, so every count is exact. The top bucket (where clamped values go) is counted only
  /// by +Inf, which is count().
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::vector<CumulativeBucket> cumulative_buckets() const;

  /// Writes one OpenMetrics 1.0 text MetricFamily of type histogram: `# TYPE`, `# HELP` (left
  /// out if `help` is empty), one cumulative `<name>_bucket{...,le="..."}` line per
  /// cumulative_buckets() bound and `le="+Inf"` (= _count), `<name>_count`, `<name>_sum`.
  /// Bounds and the sum are divided by `unit_ratio`; `le` is rendered canonically (Go's `%g`
  /// with ".0" when it has no point or exponent: "1.0", "0.001", "1e+06"). Label values and
  /// help are escaped (`\\`, `\"`, `\n`). The caller ends the exposition with `# EOF\n` after
  /// its last family. Without the EOF line and with no `"` in help, the lines are also the
  /// Prometheus text format 0.0.4. Throws bspflow::Error (before writing) if `name` or a label
  /// name is not a valid metric / label name, a label is named "le", or `unit_ratio` is not a
  /// finite number > 0.
  /// Contract: any; non-blocking; allocates; throws Error.
  void write_openmetrics(std::ostream& out, std::string_view name, std::string_view help,
                         const MetricLabels& labels = {}, double unit_ratio = 1.0) const;

  /// Writes HdrHistogram's percentile distribution text (.hgrm): the
  /// `Value Percentile TotalCount 1/(1-Percentile)` table, with `ticks_per_half_distance` rows
  /// in each halving of the distance to 100% (0, 10 .. 50, 55 .. 75, 77.5 .. for 5), a last
  /// row at 100% (the max), and the `#[Mean/StdDeviation]`, `#[Max/Total count]` and
  /// `#[Buckets/SubBuckets]` footer. Values are divided by `unit_ratio` (1000: ns -> us).
  /// Throws bspflow::Error if `unit_ratio` is not a finite number > 0 or
  /// `ticks_per_half_distance` is outside 1..1000.
  /// Contract: any; non-blocking; allocates; throws Error.
  void write_hgrm(std::ostream& out, double unit_ratio = 1.0,
                  int ticks_per_half_distance = 5) const;

 private:
  friend class Histogram;

  std::uint64_t highest_ = 0;
  std::vector<std::uint64_t> counts_;
  std::uint64_t count_ = 0;
  std::uint64_t sum_ = 0;
  std::uint64_t min_ = 0;
  std::uint64_t max_ = 0;
  std::uint64_t clamped_ = 0;
};

/// Counts values 0..highest_trackable in detail::histogram_bucket's log-linear buckets.
///
/// One writer: record() is called by one thread at a time (hand the histogram to another
/// thread only through a synchronising step, e.g. a join). Any number of readers call
/// snapshot() concurrently with it. The writer's words are relaxed atomics that only it
/// stores (store(load + 1), no read-modify-write, no fence), so a record is a few plain
/// loads and stores on lines only the writer writes (about 2 ns). What a concurrent reader gets:
/// - every bucket count it reads is one the writer stored: never torn, and never lower
///   than the same reader read before (counts are monotone);
/// - count() is the sum of the buckets it read, so it may lag the writer by records in
///   flight but always agrees with the buckets and percentiles;
/// - sum, min, max and clamped may be a few records ahead of or behind the buckets; min and
///   max are clamped into the lowest and highest non-empty buckets read, so they always agree
///   with the buckets. A snapshot taken after the writer stopped (and was joined) is exact.
///
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class alignas(tunables::kCacheLine) Histogram {
 public:
  /// An empty histogram of values 0..highest_trackable: 8 bytes per bucket (4,562 buckets,
  /// 36 KiB, for an hour in nanoseconds). Throws bspflow::Error if highest_trackable < 2.
  /// Contract: any; non-blocking; allocates; throws Error.
  explicit Histogram(std::uint64_t highest_trackable);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  /// Counts `value`; a value above highest_trackable() is counted as highest_trackable() (in
  /// the top bucket, the sum, the max) and in clamped(). O(1). Called by the one writer thread
  /// (see the class comment).
  /// Contract: producer; non-blocking; no-alloc; noexcept.
  void record(std::uint64_t value) noexcept;

  /// What the histogram holds now; also while the writer records (see the class comment for
  /// what it sees), without blocking it.
  /// Contract: any; non-blocking; allocates (the snapshot's buckets); throws bad_alloc.
  HistogramSnapshot snapshot() const;

  /// The largest value counted as itself; larger ones count as it.
  std::uint64_t highest_trackable() const noexcept { return highest_; }
  /// How many buckets cover 0..highest_trackable().
  std::size_t bucket_count() const noexcept { return bucket_count_; }

  /// The lowest value that shares `value`'s bucket.
  static constexpr std::uint64_t lowest_equivalent(std::uint64_t value) noexcept {
    return detail::histogram_bucket_lowest(detail::histogram_bucket(value));
  }
  /// The highest value that shares `value`'s bucket.
  static constexpr std::uint64_t highest_equivalent(std::uint64_t value) noexcept {
    return detail::histogram_bucket_highest(detail::histogram_bucket(value));
  }

 private:
  /// Padding on each side of the counts, so that no other heap object shares their lines.
  static constexpr std::size_t kPad = tunables::kCacheLine / sizeof(std::uint64_t);

  const std::uint64_t highest_;
  const std::size_t bucket_count_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> storage_;  ///< kPad + buckets + kPad
  std::atomic<std::uint64_t>* const counts_;               ///< storage_ + kPad
  /// The writer's words, on the line it owns with the fields above.
  std::atomic<std::uint64_t> sum_{0};
  std::atomic<std::uint64_t> min_{std::numeric_limits<std::uint64_t>::max()};
  std::atomic<std::uint64_t> max_{0};
  std::atomic<std::uint64_t> clamped_{0};
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "Histogram's readers rely on untorn 64-bit loads");

inline void Histogram::record(std::uint64_t value) noexcept {
  constexpr auto kRelaxed = std::memory_order_relaxed;
  if (value > highest_) [[unlikely]] {
    // relaxed: only this thread stores it; readers want an untorn count, not an order.
    clamped_.store(clamped_.load(kRelaxed) + 1, kRelaxed);
    value = highest_;
  }
  std::atomic<std::uint64_t>& bucket = counts_[detail::histogram_bucket(value)];
  // relaxed: one writer, so load + store is an increment nobody interleaves; readers need
  // untorn monotone counts, which coherence of one atomic gives without ordering.
  bucket.store(bucket.load(kRelaxed) + 1, kRelaxed);
  // relaxed: writer-only word; snapshot() tolerates a sum a few records off the buckets.
  sum_.store(sum_.load(kRelaxed) + value, kRelaxed);
  // relaxed (min, max): writer-only words, clamped by snapshot() into the buckets it read.
  // Stored only when they change (rare once warm; measured cheaper than storing always).
  if (value < min_.load(kRelaxed)) [[unlikely]]
    min_.store(value, kRelaxed);
  if (value > max_.load(kRelaxed)) [[unlikely]]
    max_.store(value, kRelaxed);
}

}  // namespace bspflow
