// runtime/: traces (bspflow/run/trace.hpp) of Engine runs: valid Chrome JSON whose phases add
// up to the run, the summary, and nothing recorded by default.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace bspflow::program;
using namespace std::chrono_literals;
using test::contains;
using test::filled;
using test::kSmall;
using test::with_link;

TEST_SUITE_BEGIN("trace");

TEST_CASE("trace: valid Chrome JSON, per-device phases add up to the run, summary shares to 100%") {
  Device dev(0, kSmall);
  // How much of the run the device's phases cover is timing: a preemption of the device thread
  // between two phases (a loaded 2-core VM, a sanitizer build) falls outside every phase. The
  // run is made up to 3 times; the best coverage counts.
  double coverage = 0;
  for (int attempt = 0; attempt < 3 && coverage < 0.9; ++attempt) {
    EngineConfig c = with_link(200us, 4096, 0);
    c.trace = true;
    Engine engine(dev, c);
    InfeedQueue<Tensor> infeed(InfeedConfig{1, 64, 1});
    OutfeedQueue<Tensor> outfeed;
    Buffer x = make_buffer(dev, "x", DType::kFloat32, 1024);
    auto p = infeed.make_producer();
    const int n = 20;
    for (int i = 0; i < n; ++i) p.push(filled(1024, 1.0f));
    const auto spin = [](std::chrono::microseconds d) {
      const auto end = std::chrono::steady_clock::now() + d;
      while (std::chrono::steady_clock::now() < end) {
      }
    };
    const EngineResult r =
        engine.run(Repeat(n, Sequence{StreamCopy(infeed, x),
                                      Execute("work", [&](const ComputeContext&) { spin(300us); }),
                                      StreamCopy(x, outfeed)}));
    CHECK(r.completed());
    const Trace& trace = *engine.trace();
    const auto doc = nlohmann::json::parse(trace.chrome_json());
    REQUIRE(doc.contains("traceEvents"));
    double device_us = 0;
    int computes = 0, transfers = 0;
    for (const auto& e : doc["traceEvents"]) {
      if (e["ph"] != "X") continue;
      CHECK(e["dur"].get<double>() >= 0);
      if (e["tid"] == 1) device_us += e["dur"].get<double>();
      if (e["cat"] == "Compute") ++computes;
      if (e["cat"] == "Transfer") ++transfers;
    }
    CHECK(computes == n);
    CHECK(transfers == 2 * n);
    const double run_us = static_cast<double>(trace.run_ns()) / 1e3;
    // Every phase the device spends is recorded: what is left is the interpreter's own steps.
    CHECK(device_us <= run_us * 1.001);
    coverage = std::max(coverage, device_us / run_us);
    const TraceSummary s = engine.summary();
    REQUIRE(s.tracks.size() == 2);
    for (const TrackSummary& t : s.tracks) {
      double total = 0;
      for (double v : t.share) total += v;
      CHECK(total == doctest::Approx(1.0).epsilon(1e-9));
    }
    CHECK(s.tracks[0].iterations == n);
    CHECK(s.tracks[0].bytes_to_device == n * 4096u);
    CHECK(s.tracks[0].bytes_to_host == n * 4096u);
    CHECK(s.tracks[1].bytes_to_device == n * 4096u);
    CHECK(contains(s.to_string(), "device 0"));
    CHECK(contains(s.to_string(), "20 iterations"));
    // Modeled copies take at least their modeled time.
    for (const TraceEvent& e : trace.tracks()[1].events()) CHECK(e.end_ns - e.begin_ns >= 200'000);
  }
  CHECK(coverage >= 0.9);
}

TEST_CASE("trace: the modeled IPU timeline, a process of its own, adds up to the modeled run") {
  DeviceGroup devices(2, kSmall);
  EngineConfig c = with_link(20us, 4096, 0);
  c.trace = true;
  Engine engine(devices, c);
  InfeedQueue<Tensor> infeed(InfeedConfig{2, 64, 1});
  auto group = std::make_shared<SyncGroup>(2);
  std::vector<Program> programs;
  for (std::uint32_t d = 0; d < 2; ++d) {
    Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 1024);
    programs.push_back(Repeat(
        5, Sequence{StreamCopy(infeed, x),
                    Execute("matmul", [](const ComputeContext&) {}).declare(Work{1e9 * (d + 1)}),
                    Sync(group)}));
  }
  auto p = infeed.make_producer();
  for (int i = 0; i < 10; ++i) p.push(filled(1024, 1.0f));
  const EngineResult r = engine.run(programs);
  REQUIRE(r.completed());
  const auto doc = nlohmann::json::parse(engine.trace()->chrome_json());
  double modeled_us[3] = {0, 0, 0};
  int matmuls = 0;
  bool named = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e["pid"] != 2) continue;
    if (e["ph"] == "M" && e["name"] == "process_name")
      named = e["args"]["name"] == "modeled IPU time";
    if (e["ph"] != "X") continue;
    CHECK(std::string(e["cat"]).rfind("modeled ", 0) == 0);
    modeled_us[e["tid"].get<int>() - 1000] += e["dur"].get<double>();  // tids from 1001
    if (e["name"] == "matmul") ++matmuls;
  }
  CHECK(named);
  CHECK(matmuls == 10);
  // Each device's modeled spans cover its modeled time, and both end together (the Sync).
  const double total_us = static_cast<double>(r.modeled.total.count()) / 1e3;
  CHECK(modeled_us[1] == doctest::Approx(total_us).epsilon(0.001));
  CHECK(modeled_us[2] == doctest::Approx(total_us).epsilon(0.001));
  const TraceSummary s = engine.summary();
  CHECK(s.modeled_run_ns == doctest::Approx(static_cast<double>(r.modeled.total.count())));
  for (const TrackSummary& t : s.tracks) {
    if (t.kind != TraceTrack::Kind::kDevice) continue;
    double total = 0;
    for (double v : t.modeled_share) total += v;
    CHECK(total == doctest::Approx(1.0).epsilon(1e-6));
  }
  // The faster device (0: half the work) waited at the sync for the slower one.
  CHECK(s.tracks[1].modeled_share[static_cast<std::size_t>(Phase::kSync)] <
        s.tracks[0].modeled_share[static_cast<std::size_t>(Phase::kSync)]);
  CHECK(contains(s.to_string(), "modeled IPU time:"));
}

TEST_CASE("trace: off by default, records nothing") {
  Device dev(0, kSmall);
  Engine engine(dev);
  engine.run(Execute("x", [](const ComputeContext&) {}));
  CHECK(engine.trace() == nullptr);
  CHECK(engine.summary().tracks.empty());
}

TEST_SUITE_END();
