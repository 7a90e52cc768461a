// Shared by the benchmarks: figures printed as `key: value` lines and, with --json FILE,
// written as one JSON object with the same keys, so runs can be compared across commits.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <bspflow/base/detail/wait.hpp>  // cpu_relax
#include <bspflow/devices/device.hpp>    // DeviceConfig
#include <bspflow/devices/topology.hpp>
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

// Devices that keep off core 0, where the benchmark's client thread runs (pin_host()).
inline bspflow::DeviceConfig devices_off_core0() {
  bspflow::DeviceConfig c;
  if (bspflow::Topology::get().cores() >= 2) c.host_cores = {0};
  return c;
}

// Pins the calling (client) thread to core 0 when hwloc can.
inline void pin_host() {
  if (bspflow::Topology::get().has_hwloc()) bspflow::Topology::get().pin_current_thread(0);
}

// Busy work: spins on the clock for `d` (the same work for every contender).
inline void spin_for(std::chrono::nanoseconds d) {
  const auto end = Clock::now() + d;
  while (Clock::now() < end) {
  }
}

// Runs f(0) .. f(threads - 1) on threads placed and pinned like that many devices
// (Topology::place). Returns the seconds from the last thread starting to the last ending.
template <class F>
double on_placed_threads(std::uint32_t threads, F&& f) {
  const auto places = bspflow::Topology::get().place(threads);
  std::atomic<std::uint32_t> started{0};
  Clock::time_point t0{};
  std::vector<std::thread> ts;
  for (std::uint32_t t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      if (places[t].core) bspflow::Topology::get().pin_current_thread(*places[t].core);
      if (started.fetch_add(1) + 1 == threads) t0 = Clock::now();
      while (started.load() < threads) std::this_thread::yield();  // threads may share cores
      f(t);
    });
  }
  for (auto& t : ts) t.join();
  return seconds_since(t0);
}

// Pins the calling thread to `core` (where hwloc can pin; a no-op elsewhere).
inline void pin(std::uint32_t core) {
  if (bspflow::Topology::get().has_hwloc()) bspflow::Topology::get().pin_current_thread(core);
}

// The floor of any hand-off between two cores: n atomic ping-pong round trips (ns each), the
// calling thread pinned to `host`, its peer to `peer`.
inline std::vector<double> pingpong(std::uint64_t n, std::uint32_t host, std::uint32_t peer) {
  alignas(64) std::atomic<std::uint64_t> ping{0};
  alignas(64) std::atomic<std::uint64_t> pong{0};
  std::thread peer_thread([&] {
    pin(peer);
    for (std::uint64_t i = 1; i <= n; ++i) {
      while (ping.load(std::memory_order_acquire) != i) bspflow::detail::cpu_relax();
      pong.store(i, std::memory_order_release);
    }
  });
  pin(host);
  std::vector<double> rtt;
  rtt.reserve(n);
  for (std::uint64_t i = 1; i <= n; ++i) {
    const auto t0 = Clock::now();
    ping.store(i, std::memory_order_release);
    while (pong.load(std::memory_order_acquire) != i) bspflow::detail::cpu_relax();
    rtt.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  peer_thread.join();
  return rtt;
}

// The floor of a hand-off that carries data, as every queue does: each way, a payload written
// to one cache line and then a flag to another (the queue's slot and its index), the reader
// spinning on the flag and asking for the payload's line as it does (as the queues' waits do),
// then reading the payload. n round trips (ns each), pinned as pingpong().
inline std::vector<double> pingpong_2line(std::uint64_t n, std::uint32_t host, std::uint32_t peer) {
  struct alignas(64) Line {
    std::atomic<std::uint64_t> flag{0};
  };
  struct alignas(64) Payload {
    std::atomic<std::uint64_t> value{0};  // relaxed: ordered by the flag's release/acquire
  };
  Line ping, pong;
  Payload there, back;
  bool wrong = false;
  std::thread peer_thread([&] {
    pin(peer);
    for (std::uint64_t i = 1; i <= n; ++i) {
      while (ping.flag.load(std::memory_order_acquire) != i) {
        __builtin_prefetch(&there, 0, 3);
        bspflow::detail::cpu_relax();
      }
      back.value.store(there.value.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      pong.flag.store(i, std::memory_order_release);
    }
  });
  pin(host);
  std::vector<double> rtt;
  rtt.reserve(n);
  for (std::uint64_t i = 1; i <= n; ++i) {
    const auto t0 = Clock::now();
    there.value.store(i, std::memory_order_relaxed);
    ping.flag.store(i, std::memory_order_release);
    while (pong.flag.load(std::memory_order_acquire) != i) {
      __builtin_prefetch(&back, 0, 3);
      bspflow::detail::cpu_relax();
    }
    wrong = wrong || back.value.load(std::memory_order_relaxed) != i + 1;
    rtt.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  peer_thread.join();
  if (wrong) std::fprintf(stderr, "pingpong_2line: a payload arrived wrong\n");
  return rtt;
}

// Value at quantile q (0..1) of `v` (sorted in place).
inline double quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

inline double median(std::vector<double> v) {
  return quantile(v, 0.5);
}

class Report {
 public:
  // The JSON also names the CPU (runs on this VM land on different hosts, and a figure from
  // one is not comparable with another's), and write() adds the hypervisor's steal over the
  // run (see steal_share).
  explicit Report(std::string name) : start_(cpu_times()) {
    json_["benchmark"] = std::move(name);
    json_["cpu"] = cpu_model();
  }
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
  // The spread of a ratio taken in rounds: key_min and key_max over the rounds' values
  // (the ratio itself is reported apart, usually as their median). Needs a value.
  void spread(const std::string& key, const std::vector<double>& rounds) {
    const auto [lo, hi] = std::minmax_element(rounds.begin(), rounds.end());
    figure(key + "_min", *lo);
    figure(key + "_max", *hi);
  }
  // The first "model name" of /proc/cpuinfo, or "unknown" where there is none.
  static std::string cpu_model() {
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);) {
      if (line.rfind("model name", 0) != 0) continue;
      const auto colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
    return "unknown";
  }
  // Ends the report: prints and records steal_share, then writes the JSON to `path` (none if
  // empty). steal_share is the share of the machine's CPU time, from the report's creation
  // to now, that the hypervisor ran something else while this VM wanted the CPU (the `steal`
  // column of /proc/stat's `cpu` line, over every column's total). On a VM whose speed drifts,
  // it tells a run the host squeezed from one where the code was slow; left out where
  // /proc/stat cannot be read.
  bool write(const std::string& path) {
    const CpuTimes end = cpu_times();
    if (start_.total != 0 && end.total > start_.total) {
      figure("steal_share", static_cast<double>(end.steal - start_.steal) /
                                static_cast<double>(end.total - start_.total));
    }
    if (path.empty()) return true;
    std::ofstream f(path);
    f << json_.dump(2) << '\n';
    return static_cast<bool>(f);
  }

 private:
  struct CpuTimes {
    std::uint64_t steal = 0;
    std::uint64_t total = 0;  // 0: not read
  };
  // /proc/stat's first line: "cpu" and the machine's time in each state since boot (user,
  // nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice; USER_HZ ticks).
  // guest and guest_nice are already counted in user and nice, so the total leaves them out.
  static CpuTimes cpu_times() {
    std::ifstream f("/proc/stat");
    std::string label;
    std::uint64_t v[8] = {};
    if (!(f >> label) || label != "cpu") return {};
    for (std::uint64_t& x : v) {
      if (!(f >> x)) return {};
    }
    CpuTimes t;
    t.steal = v[7];
    for (const std::uint64_t x : v) t.total += x;
    return t;
  }

  nlohmann::json json_;
  CpuTimes start_;
};

}  // namespace bench
