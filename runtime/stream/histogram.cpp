// Histogram and HistogramSnapshot (see bspflow/stream/histogram.hpp).
#include "bspflow/stream/histogram.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

void check_highest(std::uint64_t highest_trackable) {
  if (highest_trackable < 2) {
    detail::throw_bad_value("highest_trackable", highest_trackable,
                            "must be at least 2 (the largest value the histogram tells apart)");
  }
}

std::size_t bucket_count_for(std::uint64_t highest_trackable) {
  return detail::histogram_bucket(highest_trackable) + 1;
}

// "%g" of a double for error messages.
std::string show(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void check_unit_ratio(double unit_ratio) {
  if (!(unit_ratio > 0.0) || !std::isfinite(unit_ratio)) {
    detail::throw_bad_value("unit_ratio", show(unit_ratio),
                            "must be a finite number > 0 (values are divided by it: 1e9 for "
                            "nanoseconds -> seconds)");
  }
}

// OpenMetrics' canonical rendering of an "le" value: Go's shortest %g (exponent form below
// 1e-4 and from 1e6 on, at least two exponent digits) with ".0" added to a plain integer.
std::string canonical_number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char sci[64];
  const auto s = std::to_chars(sci, sci + sizeof sci - 1, v, std::chars_format::scientific);
  *s.ptr = '\0';
  const char* e = std::char_traits<char>::find(sci, static_cast<std::size_t>(s.ptr - sci), 'e');
  const int exponent = e != nullptr ? std::atoi(e + 1) : 0;
  if (exponent < -4 || exponent >= 6) return std::string(sci, s.ptr);
  char fixed[64];
  const auto f = std::to_chars(fixed, fixed + sizeof fixed, v, std::chars_format::fixed);
  std::string out(fixed, f.ptr);
  if (out.find('.') == std::string::npos) out += ".0";
  return out;
}

// A sample value: an integer as it is, anything else in the shortest form that reads back.
std::string sample_number(std::uint64_t v, double unit_ratio) {
  if (unit_ratio == 1.0) return std::to_string(v);
  return canonical_number(static_cast<double>(v) / unit_ratio);
}

// OpenMetrics escaping of label values and help text: backslash, double quote, line feed.
std::string escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

bool is_alpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// metricname = [a-zA-Z_:][a-zA-Z0-9_:]*, label-name = [a-zA-Z_][a-zA-Z0-9_]*.
bool valid_name(std::string_view s, bool colon) {
  if (s.empty()) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = is_alpha(c) || (colon && c == ':') || (i > 0 && is_digit(c));
    if (!ok) return false;
  }
  return true;
}

}  // namespace

Histogram::Histogram(std::uint64_t highest_trackable)
    : highest_((check_highest(highest_trackable), highest_trackable)),
      bucket_count_(bucket_count_for(highest_trackable)),
      // value-initialised: every count starts at 0
      storage_(new std::atomic<std::uint64_t>[bucket_count_ + 2 * kPad]()),
      counts_(storage_.get() + kPad) {}

HistogramSnapshot Histogram::snapshot() const {
  HistogramSnapshot s;
  s.highest_ = highest_;
  s.counts_.resize(bucket_count_);
  std::size_t first = bucket_count_;
  std::size_t last = 0;
  for (std::size_t i = 0; i < bucket_count_; ++i) {
    // relaxed: an untorn count the writer stored is all a reader needs (class comment).
    const std::uint64_t c = counts_[i].load(kRelaxed);
    s.counts_[i] = c;
    s.count_ += c;
    if (c != 0) {
      first = std::min(first, i);
      last = i;
    }
  }
  if (s.count_ == 0) return s;
  // relaxed (sum, min, max, clamped): writer-only words, allowed to be a few records off the
  // buckets; min and max are clamped into the buckets read so percentiles agree with them.
  s.sum_ = sum_.load(kRelaxed);
  s.min_ = std::clamp(min_.load(kRelaxed), detail::histogram_bucket_lowest(first),
                      detail::histogram_bucket_highest(first));
  s.max_ = std::clamp(max_.load(kRelaxed), detail::histogram_bucket_lowest(last),
                      std::min(detail::histogram_bucket_highest(last), highest_));
  s.clamped_ = std::min(clamped_.load(kRelaxed), s.counts_[bucket_count_ - 1]);
  return s;
}

HistogramSnapshot::HistogramSnapshot(std::uint64_t highest_trackable)
    : highest_((check_highest(highest_trackable), highest_trackable)),
      counts_(bucket_count_for(highest_trackable), 0) {}

double HistogramSnapshot::mean() const noexcept {
  if (count_ == 0) return 0.0;
  const double m = static_cast<double>(sum_) / static_cast<double>(count_);
  // A snapshot taken while the writer records may pair a sum and a count a few records apart.
  return std::clamp(m, static_cast<double>(min_), static_cast<double>(max_));
}

double HistogramSnapshot::stddev() const noexcept {
  if (count_ == 0) return 0.0;
  const double m = mean();
  double squares = 0.0;
  for (std::size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] == 0) continue;
    const double lo = static_cast<double>(detail::histogram_bucket_lowest(i));
    const double hi = static_cast<double>(detail::histogram_bucket_highest(i));
    const double mid =
        std::clamp((lo + hi) / 2.0, static_cast<double>(min_), static_cast<double>(max_));
    squares += static_cast<double>(counts_[i]) * (mid - m) * (mid - m);
  }
  return std::sqrt(squares / static_cast<double>(count_));
}

std::uint64_t HistogramSnapshot::value_at_percentile(double percentile) const {
  if (!(percentile >= 0.0 && percentile <= 100.0)) {
    detail::throw_bad_value("percentile", show(percentile),
                            "must be in 0..100 (a percentage: 99.9 for p99.9)");
  }
  if (count_ == 0) return 0;
  // The rank: ceil(p% of count), at least 1. Products within 1e-9 of an integer count as it,
  // so that 99.9% of 10000 is rank 9990, not 9991 through rounding.
  double rank = percentile / 100.0 * static_cast<double>(count_);
  const double whole = std::nearbyint(rank);
  if (std::abs(rank - whole) <= 1e-9 * std::max(1.0, rank)) rank = whole;
  const auto target = std::clamp<std::uint64_t>(static_cast<std::uint64_t>(std::ceil(rank)),
                                                std::uint64_t{1}, count_);
  std::uint64_t seen = 0;
  for (std::size_t i = 0; i < counts_.size(); ++i) {
    seen += counts_[i];
    if (seen >= target) return std::clamp(detail::histogram_bucket_highest(i), min_, max_);
  }
  return max_;  // not reached: the buckets add up to count_
}

void HistogramSnapshot::merge(const HistogramSnapshot& other) {
  if (other.highest_ == 0) return;  // no layout: nothing recorded
  if (highest_ == 0) {
    *this = other;
    return;
  }
  if (other.highest_ != highest_) {
    detail::throw_bad_value(
        "merge: the other histogram's highest_trackable", other.highest_,
        "must equal this one's, " + std::to_string(highest_) +
            " (snapshots merge bucket by bucket, so both need the same layout)");
  }
  if (other.count_ == 0) return;
  for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  min_ = count_ == 0 ? other.min_ : std::min(min_, other.min_);
  max_ = count_ == 0 ? other.max_ : std::max(max_, other.max_);
  count_ += other.count_;
  sum_ += other.sum_;
  clamped_ += other.clamped_;
}

std::vector<HistogramSnapshot::CumulativeBucket> HistogramSnapshot::cumulative_buckets() const {
  std::vector<CumulativeBucket> out;
  if (highest_ == 0) return out;
  const std::size_t top = counts_.size() - 1;
  const std::uint64_t below_top = detail::histogram_bucket_lowest(top) - 1;
  std::vector<std::uint64_t> bounds;
  for (unsigned k = 1; k < 64; ++k) {
    const std::uint64_t b = (std::uint64_t{1} << k) - 1;
    if (b >= below_top) break;
    bounds.push_back(b);
  }
  bounds.push_back(below_top);
  std::uint64_t seen = 0;
  std::size_t i = 0;
  for (const std::uint64_t b : bounds) {
    for (; i < top && detail::histogram_bucket_highest(i) <= b; ++i) seen += counts_[i];
    out.push_back({b, seen});
  }
  return out;
}

void HistogramSnapshot::write_openmetrics(std::ostream& out, std::string_view name,
                                          std::string_view help, const MetricLabels& labels,
                                          double unit_ratio) const {
  if (!valid_name(name, true)) {
    detail::throw_bad_value("metric name", "\"" + std::string(name) + "\"",
                            "must match [a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  for (const auto& [label, value] : labels) {
    if (!valid_name(label, false)) {
      detail::throw_bad_value("label name", "\"" + label + "\"",
                              "must match [a-zA-Z_][a-zA-Z0-9_]*");
    }
    if (label == "le") {
      detail::throw_bad_value("label name", "\"le\"",
                              "a histogram writes its own \"le\"; name the label otherwise");
    }
  }
  check_unit_ratio(unit_ratio);

  std::string own;  // the metric's own labels, rendered once: a="x",b="y"
  for (const auto& [label, value] : labels) {
    if (!own.empty()) own += ',';
    own.append(label).append("=\"").append(escaped(value)).append("\"");
  }
  const std::string n(name);
  const std::string bucket_prefix = n + "_bucket{" + own + (own.empty() ? "" : ",") + "le=\"";
  const std::string braces = own.empty() ? std::string() : "{" + own + "}";

  std::string text = "# TYPE " + n + " histogram\n";
  if (!help.empty()) text += "# HELP " + n + " " + escaped(help) + "\n";
  for (const CumulativeBucket& b : cumulative_buckets()) {
    text += bucket_prefix + canonical_number(static_cast<double>(b.le) / unit_ratio) + "\"} " +
            std::to_string(b.count) + "\n";
  }
  text += bucket_prefix + "+Inf\"} " + std::to_string(count_) + "\n";
  text += n + "_count" + braces + " " + std::to_string(count_) + "\n";
  text += n + "_sum" + braces + " " + sample_number(sum_, unit_ratio) + "\n";
  out << text;
}

void HistogramSnapshot::write_hgrm(std::ostream& out, double unit_ratio,
                                   int ticks_per_half_distance) const {
  check_unit_ratio(unit_ratio);
  if (ticks_per_half_distance < 1 || ticks_per_half_distance > 1000) {
    detail::throw_bad_value("ticks_per_half_distance", std::to_string(ticks_per_half_distance),
                            "must be in 1..1000 (HdrHistogram's default is 5)");
  }
  std::string text;
  char line[160];
  const auto add = [&](int n) { text.append(line, static_cast<std::size_t>(std::max(n, 0))); };
  const auto scaled = [&](std::uint64_t v) { return static_cast<double>(v) / unit_ratio; };
  add(std::snprintf(line, sizeof line, "%12s %14s %10s %14s\n\n", "Value", "Percentile",
                    "TotalCount", "1/(1-Percentile)"));
  const auto row = [&](std::uint64_t value, double percent, std::uint64_t total) {
    const double fraction = percent / 100.0;
    add(std::snprintf(line, sizeof line, "%12.3f %2.12f %10llu %14.2f\n", scaled(value), fraction,
                      static_cast<unsigned long long>(total), 1.0 / (1.0 - fraction)));
  };
  if (count_ != 0) {
    // Tick j of level L (the L-th halving of the distance to 100%):
    // 100 (1 - 2^-L) + j * 100 * 2^-(L+1) / ticks.
    int level = 0;
    int tick = 0;
    const auto percent_at = [&] {
      const double half = std::ldexp(100.0, -level);
      return 100.0 - half + tick * (half / 2.0) / ticks_per_half_distance;
    };
    const auto advance = [&] {
      if (++tick == ticks_per_half_distance) {
        tick = 0;
        ++level;
      }
    };
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] == 0) continue;
      seen += counts_[i];
      const std::uint64_t value = std::clamp(detail::histogram_bucket_highest(i), min_, max_);
      if (seen == count_) {  // the last bucket: the next tick, then the 100% row below
        row(value, percent_at(), seen);
        break;
      }
      const double reached = 100.0 * static_cast<double>(seen) / static_cast<double>(count_);
      while (percent_at() <= reached && percent_at() < 100.0) {
        row(value, percent_at(), seen);
        advance();
      }
    }
    add(std::snprintf(line, sizeof line, "%12.3f %2.12f %10llu\n", scaled(max_), 1.0,
                      static_cast<unsigned long long>(count_)));
  }
  add(std::snprintf(line, sizeof line, "#[Mean    = %12.3f, StdDeviation   = %12.3f]\n",
                    mean() / unit_ratio, stddev() / unit_ratio));
  add(std::snprintf(line, sizeof line, "#[Max     = %12.3f, Total count    = %12llu]\n",
                    scaled(max_), static_cast<unsigned long long>(count_)));
  // HdrHistogram's terms: a bucket is an octave (the first holds 0..255), a bucket has 256
  // sub-buckets of which the upper 128 are used above the first.
  const unsigned buckets =
      highest_ == 0 ? 0 : detail::histogram_bucket_shift(counts_.size() - 1) + 1;
  add(std::snprintf(line, sizeof line, "#[Buckets = %12u, SubBuckets     = %12u]\n", buckets,
                    1u << detail::kHistogramLinearBits));
  out << text;
}

}  // namespace bspflow
