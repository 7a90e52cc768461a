// runtime/: Histogram (bspflow/stream/histogram.hpp): relative error within 1% from 1 ns to
// 1 h, percentiles of known distributions, merge equal to recording everything in one,
// clamping, clear errors, a reader that snapshots while a writer records 10^6 values, and
// the OpenMetrics and .hgrm writers' output read back line by line.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/stream/histogram.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

namespace {

constexpr std::uint64_t kHourNs = 3'600'000'000'000;

// |reported - exact| / exact.
double relative_error(std::uint64_t reported, std::uint64_t exact) {
  const double e = static_cast<double>(exact);
  return std::abs(static_cast<double>(reported) - e) / e;
}

// The nearest-rank percentile of sorted values: the smallest with p% at or below it.
std::uint64_t exact_percentile(const std::vector<std::uint64_t>& sorted, double p) {
  const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * sorted.size()));
  return sorted[std::max<std::size_t>(rank, 1) - 1];
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

TEST_SUITE_BEGIN("histogram");
TEST_CASE("histogram: every value from 1 ns to 1 h is within 1% of its bucket's bounds") {
  std::vector<std::uint64_t> values;
  for (std::uint64_t v = 1; v <= 200'000; ++v) values.push_back(v);
  for (double v = 200'000; v <= static_cast<double>(kHourNs); v *= 1.0007) {
    values.push_back(static_cast<std::uint64_t>(v));
  }
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::uint64_t> any(1, kHourNs);
  for (int i = 0; i < 100'000; ++i) values.push_back(any(rng));
  double worst = 0;
  for (const std::uint64_t v : values) {
    const std::uint64_t lo = Histogram::lowest_equivalent(v);
    const std::uint64_t hi = Histogram::highest_equivalent(v);
    REQUIRE(lo <= v);
    REQUIRE(v <= hi);
    worst = std::max({worst, relative_error(lo, v), relative_error(hi, v)});
  }
  CHECK(worst < 1.0 / 128);
  CHECK(worst > 0.5 / 128);  // the bound is tight: the layout is not finer than it says

  // The buckets tile 0..highest with no gap or overlap, each within 1/128 of its lowest value.
  const Histogram h(kHourNs);
  CHECK(h.bucket_count() == 4562);
  CHECK(detail::histogram_bucket_lowest(0) == 0);
  for (std::size_t i = 0; i + 1 < h.bucket_count(); ++i) {
    const std::uint64_t lo = detail::histogram_bucket_lowest(i);
    const std::uint64_t hi = detail::histogram_bucket_highest(i);
    REQUIRE(detail::histogram_bucket(lo) == i);
    REQUIRE(detail::histogram_bucket(hi) == i);
    REQUIRE(detail::histogram_bucket_lowest(i + 1) == hi + 1);
    REQUIRE(static_cast<double>(hi - lo) <
            static_cast<double>(std::max<std::uint64_t>(lo, 1)) / 128);
  }
  CHECK(Histogram::highest_equivalent(std::numeric_limits<std::uint64_t>::max()) ==
        std::numeric_limits<std::uint64_t>::max());
}

TEST_CASE("histogram: a recorded value reads back within 1% across 1 ns .. 1 h") {
  for (double v = 1; v <= static_cast<double>(kHourNs) / 4; v *= 1.37) {
    const auto value = static_cast<std::uint64_t>(v);
    Histogram h(kHourNs);
    h.record(value);
    h.record(value * 4);  // so that p50 is not simply min()
    const HistogramSnapshot s = h.snapshot();
    CAPTURE(value);
    CHECK(s.value_at_percentile(50) >= value);
    CHECK(relative_error(s.value_at_percentile(50), value) < 0.01);
    CHECK(s.min() == value);
    CHECK(s.max() == value * 4);
  }
}

TEST_CASE("histogram: percentiles of uniform 1..10000 and of an exponential sample") {
  Histogram h(kHourNs);
  for (std::uint64_t v = 1; v <= 10'000; ++v) h.record(v);
  const HistogramSnapshot s = h.snapshot();
  CHECK(s.count() == 10'000);
  CHECK(s.sum() == 50'005'000);
  CHECK(s.mean() == doctest::Approx(5000.5));
  CHECK(s.stddev() == doctest::Approx(2886.75).epsilon(0.01));
  CHECK(s.min() == 1);
  CHECK(s.max() == 10'000);
  CHECK(s.clamped() == 0);
  CHECK(relative_error(s.value_at_percentile(50), 5000) <= 0.01);
  CHECK(relative_error(s.value_at_percentile(99), 9900) <= 0.01);
  CHECK(relative_error(s.value_at_percentile(99.9), 9990) <= 0.01);
  CHECK(s.value_at_percentile(0) == 1);
  CHECK(s.value_at_percentile(100) == 10'000);
  CHECK(s.value_at_percentile(0.01) == 1);  // rank 1
  CHECK(s.value_at_percentile(1) == 100);   // rank 100, exact below 256

  // Latencies with a long tail (exponential, mean 50 us, plus a 1 us floor), in ns.
  std::mt19937_64 rng(42);
  std::exponential_distribution<double> tail(1.0 / 50'000);
  Histogram e(kHourNs);
  std::vector<std::uint64_t> sample;
  for (int i = 0; i < 200'000; ++i) {
    const auto v = static_cast<std::uint64_t>(1'000 + tail(rng));
    sample.push_back(v);
    e.record(v);
  }
  std::sort(sample.begin(), sample.end());
  const HistogramSnapshot es = e.snapshot();
  for (const double p : {0.0, 1.0, 10.0, 25.0, 50.0, 75.0, 90.0, 99.0, 99.9, 99.99, 100.0}) {
    CAPTURE(p);
    const std::uint64_t exact = exact_percentile(sample, p);
    CHECK(es.value_at_percentile(p) >= exact);
    CHECK(relative_error(es.value_at_percentile(p), exact) < 0.01);
  }
}

TEST_CASE("histogram: merging per-thread snapshots equals recording everything in one") {
  constexpr std::uint64_t kHighest = 10'000'000;
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> latency(10.0, 2.0);
  Histogram all(kHighest);
  std::vector<std::unique_ptr<Histogram>> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(std::make_unique<Histogram>(kHighest));
  for (int i = 0; i < 100'000; ++i) {
    const auto v = static_cast<std::uint64_t>(latency(rng));  // ~0.1% above kHighest
    all.record(v);
    parts[static_cast<std::size_t>(i) % (1 + static_cast<std::size_t>(i) % 4)]->record(v);
  }
  HistogramSnapshot merged;  // no layout until the first merge
  for (const auto& p : parts) merged.merge(p->snapshot());
  merged.merge(HistogramSnapshot());          // no layout, nothing recorded: no change
  merged.merge(HistogramSnapshot(kHighest));  // empty: no change
  const HistogramSnapshot one = all.snapshot();
  CHECK(merged.highest_trackable() == kHighest);
  CHECK(one.clamped() > 0);
  CHECK(merged.count() == one.count());
  CHECK(merged.sum() == one.sum());
  CHECK(merged.min() == one.min());
  CHECK(merged.max() == one.max());
  CHECK(merged.clamped() == one.clamped());
  CHECK(std::equal(merged.bucket_counts().begin(), merged.bucket_counts().end(),
                   one.bucket_counts().begin(), one.bucket_counts().end()));
  for (const double p : {0.0, 50.0, 90.0, 99.0, 99.9, 100.0}) {
    CHECK(merged.value_at_percentile(p) == one.value_at_percentile(p));
  }
  std::ostringstream a;
  std::ostringstream b;
  merged.write_hgrm(a);
  one.write_hgrm(b);
  CHECK(a.str() == b.str());

  HistogramSnapshot other(1'000'000);
  const std::string msg = error_of([&] { merged.merge(other); });
  CHECK(contains(msg, "highest_trackable = 1000000 is not allowed"));
  CHECK(contains(msg, "must equal this one's, 10000000"));
  CHECK(merged.count() == one.count());  // unchanged by the refused merge
}

TEST_CASE("histogram: values above highest_trackable are counted in the top bucket, as clamped") {
  Histogram h(1000);
  CHECK(h.bucket_count() == detail::histogram_bucket(1000) + 1);
  h.record(10);
  h.record(1000);
  h.record(5000);
  h.record(std::numeric_limits<std::uint64_t>::max());
  const HistogramSnapshot s = h.snapshot();
  CHECK(s.count() == 4);
  CHECK(s.clamped() == 2);
  CHECK(s.max() == 1000);
  CHECK(s.sum() == 10 + 3 * 1000);
  CHECK(s.bucket_counts().back() == 3);
  CHECK(s.value_at_percentile(100) == 1000);
  CHECK(s.value_at_percentile(25) == 10);
  const auto buckets = s.cumulative_buckets();
  REQUIRE(!buckets.empty());
  CHECK(buckets.back().le == detail::histogram_bucket_lowest(h.bucket_count() - 1) - 1);
  CHECK(buckets.back().count == 1);  // only +Inf counts the top bucket
}

TEST_CASE("histogram: bad input is a clear error naming the value and what is allowed") {
  CHECK(contains(error_of([] { Histogram h(1); }),
                 "highest_trackable = 1 is not allowed: must be at least 2"));
  CHECK(contains(error_of([] { HistogramSnapshot s(0); }), "highest_trackable = 0"));
  Histogram h(100);
  h.record(5);
  const HistogramSnapshot s = h.snapshot();
  CHECK(contains(error_of([&] { (void)s.value_at_percentile(100.5); }),
                 "percentile = 100.5 is not allowed: must be in 0..100"));
  CHECK(contains(error_of([&] { (void)s.value_at_percentile(-1); }), "percentile = -1"));
  CHECK(contains(error_of([&] { (void)s.value_at_percentile(std::nan("")); }), "percentile = nan"));
  CHECK(HistogramSnapshot().value_at_percentile(50) == 0);
  std::ostringstream out;
  CHECK(contains(error_of([&] { s.write_openmetrics(out, "1bad", ""); }),
                 "metric name = \"1bad\" is not allowed"));
  CHECK(contains(error_of([&] {
                   s.write_openmetrics(out, "ok", "", {{"a-b", "x"}});
                 }),
                 "label name = \"a-b\""));
  CHECK(contains(error_of([&] {
                   s.write_openmetrics(out, "ok", "", {{"le", "x"}});
                 }),
                 "label name = \"le\""));
  CHECK(contains(error_of([&] { s.write_openmetrics(out, "ok", "", {}, 0.0); }),
                 "unit_ratio = 0 is not allowed: must be a finite number > 0"));
  CHECK(contains(error_of([&] { s.write_hgrm(out, 1.0, 0); }),
                 "ticks_per_half_distance = 0 is not allowed: must be in 1..1000"));
  CHECK(out.str().empty());  // nothing written by a refused call
}

TEST_CASE("histogram: a reader snapshots while one writer records 10^6 values") {
  const std::uint64_t n = test::scaled(1'000'000, 10'000);
  constexpr std::uint64_t kChunk = 1 << 14;
  Histogram h(1'000'000);
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> snapshots{0};
  std::uint64_t partial = 0;  // snapshots taken while the writer was midway
  bool monotone = true;
  bool consistent = true;
  std::thread reader([&] {
    HistogramSnapshot last = h.snapshot();
    while (true) {
      const bool writer_done = done.load(std::memory_order_acquire);
      const HistogramSnapshot s = h.snapshot();
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < s.bucket_counts().size(); ++i) {
        total += s.bucket_counts()[i];
        if (s.bucket_counts()[i] < last.bucket_counts()[i]) monotone = false;
      }
      if (s.count() < last.count() || s.count() > n || total != s.count()) consistent = false;
      if (s.count() > 0 && (s.min() > s.max() || s.value_at_percentile(50) > s.max() ||
                            s.value_at_percentile(50) < s.min() || s.mean() > s.max())) {
        consistent = false;
      }
      if (s.count() > 0 && s.count() < n) ++partial;
      last = s;
      snapshots.fetch_add(1, std::memory_order_release);
      if (writer_done) break;
    }
  });
  std::uint64_t expected_sum = 0;
  std::uint64_t expected_max = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t v = (i * 7919) % 1'000'000;
    expected_sum += v;
    expected_max = std::max(expected_max, v);
    h.record(v);
    // Every kChunk records, let the reader finish a snapshot (so that some surely overlap
    // the writer on a loaded machine), then go on recording while it takes the next.
    if (i % kChunk == kChunk - 1) {
      const std::uint64_t seen = snapshots.load(std::memory_order_acquire);
      while (snapshots.load(std::memory_order_acquire) == seen) std::this_thread::yield();
    }
  }
  done.store(true, std::memory_order_release);
  reader.join();
  CHECK(partial >= n / kChunk - 1);
  CHECK(monotone);
  CHECK(consistent);
  const HistogramSnapshot s = h.snapshot();  // after the join: exact
  CHECK(s.count() == n);
  CHECK(s.sum() == expected_sum);
  CHECK(s.min() == 0);
  CHECK(s.max() == expected_max);
}

TEST_CASE(
    "histogram: OpenMetrics text is cumulative, sorted, canonical, and ends at +Inf = _count") {
  Histogram h(kHourNs);
  for (std::uint64_t v = 1; v <= 10'000; ++v) h.record(v);
  const HistogramSnapshot s = h.snapshot();
  std::ostringstream out;
  s.write_openmetrics(out, "bspflow_request_latency", "End-to-end \"latency\"\\ of a request\n",
                      {{"stage", "model"}, {"replica", "a\"b\\c\nd"}});
  const std::vector<std::string> lines = lines_of(out.str());
  REQUIRE(lines.size() > 4);
  CHECK(lines[0] == "# TYPE bspflow_request_latency histogram");
  CHECK(lines[1] ==
        "# HELP bspflow_request_latency End-to-end \\\"latency\\\"\\\\ of a request\\n");
  const std::string prefix =
      "bspflow_request_latency_bucket{stage=\"model\",replica=\"a\\\"b\\\\c\\nd\",le=\"";
  double last_le = -1;
  std::uint64_t last_count = 0;
  std::size_t i = 2;
  for (; i < lines.size() && starts_with(lines[i], prefix); ++i) {
    const std::string rest = lines[i].substr(prefix.size());
    const std::string le = rest.substr(0, rest.find('"'));
    const std::uint64_t count = std::stoull(rest.substr(rest.find("} ") + 2));
    if (le == "+Inf") {
      CHECK(count == 10'000);
      ++i;
      break;
    }
    CAPTURE(le);
    const double bound = std::stod(le);
    CHECK(bound > last_le);                              // sorted, unique
    CHECK(count >= last_count);                          // cumulative
    CHECK(le.find_first_of(".e") != std::string::npos);  // a float, canonical
    // exact: the count of recorded values (1..10000) at or below the bound
    CHECK(count == std::min<std::uint64_t>(static_cast<std::uint64_t>(bound), 10'000));
    last_le = bound;
    last_count = count;
  }
  CHECK(last_le > 0);
  REQUIRE(i + 2 == lines.size());
  CHECK(lines[i] ==
        "bspflow_request_latency_count{stage=\"model\",replica=\"a\\\"b\\\\c\\nd\"} 10000");
  CHECK(lines[i + 1] ==
        "bspflow_request_latency_sum{stage=\"model\",replica=\"a\\\"b\\\\c\\nd\"} 50005000");
  CHECK(contains(out.str(), "le=\"1.0\"} 1\n"));
  CHECK(contains(out.str(), "le=\"1023.0\"} 1023\n"));
  CHECK(contains(out.str(), "le=\"1.048575e+06\"} 10000\n"));

  // Seconds from nanoseconds, no labels, no help.
  std::ostringstream sec;
  s.write_openmetrics(sec, "latency_seconds", "", {}, 1e9);
  const std::string t = sec.str();
  CHECK(
      starts_with(t, "# TYPE latency_seconds histogram\nlatency_seconds_bucket{le=\"1e-09\"} 1\n"));
  CHECK(contains(t, "latency_seconds_bucket{le=\"1.023e-06\"} 1023\n"));
  CHECK(contains(t, "latency_seconds_bucket{le=\"+Inf\"} 10000\nlatency_seconds_count 10000\n"));
  CHECK(contains(t, "latency_seconds_sum 0.050005\n"));

  // Empty, and with no layout: still one +Inf bucket equal to _count.
  std::ostringstream empty;
  HistogramSnapshot().write_openmetrics(empty, "x", "");
  CHECK(empty.str() == "# TYPE x histogram\nx_bucket{le=\"+Inf\"} 0\nx_count 0\nx_sum 0\n");
}

TEST_CASE("histogram: the .hgrm table is monotone, ends at the max, and its footer adds up") {
  Histogram h(kHourNs);
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> latency(11.0, 1.0);
  std::uint64_t max = 0;
  for (int i = 0; i < 50'000; ++i) {
    const auto v = static_cast<std::uint64_t>(latency(rng));
    max = std::max(max, v);
    h.record(v);
  }
  const HistogramSnapshot s = h.snapshot();
  std::ostringstream out;
  s.write_hgrm(out, 1000.0);  // ns -> us
  const std::vector<std::string> lines = lines_of(out.str());
  REQUIRE(lines.size() > 6);
  CHECK(lines[0] == "       Value     Percentile TotalCount 1/(1-Percentile)");
  CHECK(lines[1].empty());
  double last_value = -1;
  double last_percentile = -1;
  unsigned long long last_total = 0;
  std::size_t rows = 0;
  std::size_t i = 2;
  for (; i < lines.size() && !starts_with(lines[i], "#["); ++i, ++rows) {
    double value = 0;
    double percentile = 0;
    unsigned long long total = 0;
    double inverse = 0;
    const int fields =
        std::sscanf(lines[i].c_str(), "%lf %lf %llu %lf", &value, &percentile, &total, &inverse);
    CAPTURE(lines[i]);
    REQUIRE(fields >= 3);
    CHECK(value >= last_value);
    CHECK(percentile > last_percentile);
    CHECK(total >= last_total);
    if (fields == 4) CHECK(inverse == doctest::Approx(1.0 / (1.0 - percentile)).epsilon(0.01));
    last_value = value;
    last_percentile = percentile;
    last_total = total;
  }
  CHECK(rows > 40);  // 5 ticks per halving down to the tail
  CHECK(last_percentile == 1.0);
  CHECK(last_total == 50'000);
  CHECK(std::abs(last_value - static_cast<double>(max) / 1000.0) <= 0.0005 + 1e-9);  // %.3f
  CHECK(starts_with(lines[2], "       "));                                           // %12.3f
  REQUIRE(i + 3 == lines.size());
  char mean_line[128];
  std::snprintf(mean_line, sizeof mean_line, "#[Mean    = %12.3f, StdDeviation   = %12.3f]",
                s.mean() / 1000.0, s.stddev() / 1000.0);
  CHECK(lines[i] == mean_line);
  char max_line[128];
  std::snprintf(max_line, sizeof max_line, "#[Max     = %12.3f, Total count    = %12d]",
                static_cast<double>(max) / 1000.0, 50'000);
  CHECK(lines[i + 1] == max_line);
  CHECK(lines[i + 2] == "#[Buckets =           35, SubBuckets     =          256]");

  // The first rows are the 0, 10, 20 .. percentile ticks.
  CHECK(contains(lines[2], " 0.000000000000 "));
  CHECK(contains(lines[3], " 0.100000000000 "));
  CHECK(contains(out.str(), " 0.550000000000 "));
  CHECK(contains(out.str(), " 0.775000000000 "));

  std::ostringstream empty;
  HistogramSnapshot(100).write_hgrm(empty);
  CHECK(lines_of(empty.str()).size() == 5);  // header, blank, three footer lines
}

TEST_SUITE_END();
