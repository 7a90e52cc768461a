// The soak suite (opt-in: meson test -C build --suite soak; not part of the default run).
//
// 1. Exactly once at volume: BSPFLOW_SOAK_ELEMENTS (default 10^7) elements through each of
//    loops::repeat (4 producers x 2 replicas, and 3 x 3: 3 devices on 2 cores), Pipeline
//    inference (2 producers x 2 replicas of 2 stages: 4 devices) and a Stream (3 producers,
//    4 stages on 2 devices): every element arrives once, with the right value, in each
//    producer's order, and the checksums agree.
// 2. Seeded fault injection: BSPFLOW_SOAK_TRIALS (default 2000) trials, each one fault (a
//    body or stage throws at a random place, a cancel (in half of these trials a stop token
//    stopped before the run starts, which must take nothing; else one stop at a random time),
//    the infeed closed mid-run, an outfeed reader that stops early, then one stop) in one of
//    loops::repeat, Engine programs,
//    Pipeline inference, Pipeline training and Streams, over 1-4 devices (4 on 2 cores). Each
//    trial must end within a time limit (else the process aborts naming the trial) with the
//    status and context the fault calls for; what was produced before the fault is delivered
//    or still in the outfeed; every element pushed is processed exactly once over the trial's
//    run and a second run on the same devices (which also shows they are reusable), except
//    the one a stage threw on (named by the error) and, for Streams, the requests the result
//    counts as unanswered. Training trials check that every replica applied the same steps
//    and that the pipeline trains again afterwards.
//
// A failing trial prints its number and seed; BSPFLOW_SOAK_TRIAL=N runs trial N alone and
// BSPFLOW_SOAK_SEED changes every trial's seed (trial N uses seed + N). The suite prints the
// trials per API and fault, and how each ended.
//
// The files: soak_common.hpp/.cpp (what every part shares: the bookkeeping, the trial's
// helpers, the one outcome check of a trial), soak_loops.cpp, soak_engine.cpp,
// soak_pipeline.cpp and soak_stream.cpp (each subsystem's run at volume and trials), and this
// one (the test cases and the trial loop). Serving through StreamClients has test cases of its
// own: soak_serving.cpp (10^6 requests, the seeded serving trials) and soak_graph.cpp (the
// seeded graph trials), sharing soak_serve.hpp (the client loop and checks of both trials).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include <bspflow/bspflow.hpp>

#include "soak_common.hpp"

using namespace bspflow;
using namespace soak;

namespace {

void fault_injection() {
  const std::uint64_t trials = env_u64("BSPFLOW_SOAK_TRIALS", 2000);
  const std::uint64_t base_seed = env_u64("BSPFLOW_SOAK_SEED", 20261124);
  const char* only = std::getenv("BSPFLOW_SOAK_TRIAL");
  const std::uint64_t first =
      only != nullptr ? env_u64("BSPFLOW_SOAK_TRIAL", 0) : env_u64("BSPFLOW_SOAK_FROM", 0);
  const std::uint64_t last = only != nullptr ? first + 1 : trials;
  const std::chrono::seconds limit(env_u64("BSPFLOW_SOAK_TRIAL_SECONDS", 60));
  std::array<std::unique_ptr<DeviceGroup>, 5> groups;  // by device count, reused by every trial
  for (std::uint32_t d = 1; d <= 4; ++d) groups[d] = std::make_unique<DeviceGroup>(d, kSmall);
  std::map<std::string, std::map<std::string, std::uint64_t>>
      tally;  // "api, fault" -> outcome -> trials
  std::map<std::uint32_t, std::uint64_t> by_devices;
  Watchdog watchdog;
  const auto t0 = Clock::now();
  double slowest = 0;
  for (std::uint64_t i = first; i < last; ++i) {
    Trial t;
    t.number = i;
    t.api = static_cast<Api>(i % 5);
    t.fault = static_cast<Fault>((i / 5) % 4);
    t.devices = static_cast<std::uint32_t>(1 + (i / 20) % 4);
    const std::uint64_t seed = base_seed + i;
    Rng rng(seed);
    const std::string name = "trial " + std::to_string(i) + " (seed " + std::to_string(seed) +
                             ": " + kApiNames[static_cast<std::size_t>(t.api)] + ", " +
                             kFaultNames[static_cast<std::size_t>(t.fault)] + ", " +
                             std::to_string(t.devices) + " device" + (t.devices == 1 ? "" : "s") +
                             "; rerun alone with BSPFLOW_SOAK_TRIAL=" + std::to_string(i) + ")";
    INFO(name);
    watchdog.arm(name, limit);
    const auto started = Clock::now();
    DeviceGroup& group = *groups[t.devices];
    switch (t.api) {
      case Api::kLoops:
        loops_trial(rng, t, group);
        break;
      case Api::kEngine:
        engine_trial(rng, t, group);
        break;
      case Api::kPipelineInference:
        pipeline_inference_trial(rng, t, group);
        break;
      case Api::kPipelineTraining:
        pipeline_training_trial(rng, t, group);
        break;
      case Api::kStream:
        stream_trial(rng, t, group);
        break;
    }
    watchdog.disarm();
    slowest = std::max(slowest, seconds_since(started));
    tally[std::string(kApiNames[static_cast<std::size_t>(t.api)]) + ", " +
          kFaultNames[static_cast<std::size_t>(t.fault)]][t.outcome.empty() ? "?" : t.outcome]++;
    ++by_devices[t.devices];
  }
  std::printf("soak: %llu fault-injection trials in %.1f s (slowest %.2f s; limit %lld s each)\n",
              static_cast<unsigned long long>(last - first), seconds_since(t0), slowest,
              static_cast<long long>(limit.count()));
  for (const auto& [what, outcomes] : tally) {
    std::uint64_t n = 0;
    std::string how;
    for (const auto& [outcome, count] : outcomes) {
      n += count;
      how += (how.empty() ? "" : ", ") + std::to_string(count) + " " + outcome;
    }
    std::printf("  %-40s %4llu: %s\n", what.c_str(), static_cast<unsigned long long>(n),
                how.c_str());
  }
  std::string devices;
  for (const auto& [d, n] : by_devices) {
    devices += (devices.empty() ? "" : ", ") + std::to_string(n) + " on " + std::to_string(d);
  }
  std::printf("  by devices: %s (4 devices share 2 cores here)\n", devices.c_str());
}

}  // namespace

TEST_SUITE_BEGIN("soak");

TEST_CASE("exactly once at volume: loops::repeat, Pipeline inference, Stream") {
  const std::uint64_t elements = env_u64("BSPFLOW_SOAK_ELEMENTS", 10'000'000);
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;  // reproducing one fault trial
  soak_repeat(4, 2, elements);
  soak_repeat(3, 3, elements);
  soak_pipeline_inference(2, 2, elements);
  soak_stream(3, 2, elements);
}

TEST_CASE("seeded fault injection over loops, Engine programs, Pipelines and Streams") {
  fault_injection();
}

TEST_SUITE_END();
