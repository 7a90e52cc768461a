// Shared by the benchmarks: figures printed as `key: value` lines and, with --json FILE,
// written as one JSON object with the same keys, so runs can be compared across commits.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace bench {

// The options every benchmark takes: --json FILE and --quick.
struct CommonArgs {
  std::string json_path;
  bool quick = false;
  void add_to(CLI::App& app) {
    app.add_option("--json", json_path, "also write the figures to this JSON file");
    app.add_flag("--quick", quick, "smaller runs (for a smoke test; figures are noisier)");
  }
};

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Value at quantile q (0..1) of `v` (sorted in place).
inline double quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

inline double median(std::vector<double> v) { return quantile(v, 0.5); }

class Report {
 public:
  explicit Report(std::string name) { json_["benchmark"] = std::move(name); }
  void note(const std::string& key, const std::string& text) {
    std::printf("%s: %s\n", key.c_str(), text.c_str());
    json_[key] = text;
  }
  void figure(const std::string& key, double value) {
    std::printf("%s: %.6g\n", key.c_str(), value);
    std::fflush(stdout);
    json_[key] = value;
  }
  // A ratio with its target; says whether it met it (the benchmark still exits 0: a missed
  // target is a finding to report, not a crash).
  void ratio(const std::string& key, double value, const std::string& target, bool met) {
    std::printf("%s: %.4g  (target %s: %s)\n", key.c_str(), value, target.c_str(),
                met ? "met" : "MISSED");
    std::fflush(stdout);
    json_[key] = value;
    json_[key + "_target"] = target;
    json_[key + "_met"] = met;
  }
  bool write(const std::string& path) const {
    if (path.empty()) return true;
    std::ofstream f(path);
    f << json_.dump(2) << '\n';
    return static_cast<bool>(f);
  }

 private:
  nlohmann::json json_;
};

}  // namespace bench
