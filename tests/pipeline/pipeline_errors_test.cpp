// The Pipeline refusing what it cannot run, saying what is allowed: a config checked against
// the stages and devices, a schedule the strategy cannot honour (and each strategy's own
// when left unset), and a run refused while it attaches its feeds leaving nothing claimed.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::DenseRig;
using test::kDenseDevice;
using test::make_model;

TEST_SUITE_BEGIN("pipeline_errors");

TEST_CASE("errors: the config is checked against the stages and devices, saying what is allowed") {
  DeviceGroup devices(4, kDenseDevice);
  auto model = [](std::uint32_t) { return make_model(4); };
  PipelineConfig cfg;
  cfg.gradient_accumulation = 3;
  CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                       "must be at least 7 (2N-1)"));
  cfg.schedule = PipelineSchedule::kInterleaved;
  CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                       "must be at least 4 (N)"));
  cfg.gradient_accumulation = 8;
  cfg.strategy = ExecutionStrategy::kSingle;
  CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                       "schedule = interleaved is not allowed"));
  cfg.strategy = ExecutionStrategy::kSharded;
  cfg.schedule.reset();
  cfg.sync = SyncMode::kDataflow;
  CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                       "applies to strategy pipelined"));
  cfg = PipelineConfig{};
  cfg.gradient_accumulation = 8;
  cfg.replicas = 2;
  CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                       "needs 8 devices; the group has 4"));
  cfg.replicas = 1;
  Pipeline ok(devices, cfg, model);
  InfeedQueue<Batch> two_lanes(InfeedConfig{2, 8, 1});
  CHECK(test::contains(test::error_of([&] { ok.run(two_lanes, 1); }),
                       "infeed has 2 replica lane(s)"));
}

TEST_CASE("a schedule the strategy cannot honour is refused; left unset, each strategy its own") {
  // Guards: sharded and single run one stage at a time (the Sequential schedule), and a
  // Grouped or Interleaved schedule asked of them is refused, not ignored.
  DeviceGroup devices(4, kDenseDevice);
  auto model = [](std::uint32_t) { return make_model(4); };
  for (const auto strategy : {ExecutionStrategy::kSharded, ExecutionStrategy::kSingle}) {
    CAPTURE(std::string(to_string(strategy)));
    for (const auto schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved}) {
      CAPTURE(std::string(to_string(schedule)));
      PipelineConfig cfg;
      cfg.strategy = strategy;
      cfg.schedule = schedule;
      cfg.gradient_accumulation = 8;
      CHECK(test::contains(test::error_of([&] { Pipeline p(devices, cfg, model); }),
                           "schedule = " + std::string(to_string(schedule)) +
                               " is not allowed: must be unset or sequential with strategy " +
                               to_string(strategy)));
    }
    PipelineConfig cfg;
    cfg.strategy = strategy;
    cfg.gradient_accumulation = 1;  // Sequential needs no more
    Pipeline unset(devices, cfg, model);
    CHECK(unset.plan().schedule == PipelineSchedule::kSequential);
    cfg.schedule = PipelineSchedule::kSequential;
    Pipeline sequential(devices, cfg, model);
    CHECK(sequential.plan().schedule == PipelineSchedule::kSequential);
  }
  // Left unset, pipelined runs Grouped (the default); one stage is the same under any schedule.
  PipelineConfig cfg;
  cfg.gradient_accumulation = 7;
  Pipeline pipelined(devices, cfg, model);
  CHECK(pipelined.plan().schedule == PipelineSchedule::kGrouped);
  cfg.strategy = ExecutionStrategy::kSingle;
  cfg.schedule = PipelineSchedule::kInterleaved;
  Pipeline one(devices, cfg, [](std::uint32_t) { return make_model(1); });
}

TEST_CASE("a run refused while it attaches its feeds leaves nothing claimed") {
  // Guards: a run refused while it attaches its feeds gives back the infeed readers it had
  // claimed, so the next run is not refused with "infeed lane of replica 0 already has a
  // reader".
  const std::uint32_t n = 2, k = 3;
  for (const std::uint32_t replicas : {1u, 2u}) {
    // How the run is refused: the outfeed is another run's, or (2 replicas) the last lane is.
    for (const bool lane_taken : {false, true}) {
      if (lane_taken && replicas == 1) continue;
      CAPTURE(replicas);
      CAPTURE(lane_taken);
      PipelineConfig cfg;
      cfg.gradient_accumulation = k;
      cfg.replicas = replicas;
      DenseRig rig(cfg, n, k);
      OutfeedQueue<std::vector<float>> out(OutfeedConfig{replicas, OutputMode::all(), 0});
      if (lane_taken) {
        auto held = rig.infeed.reader(replicas - 1);
        CHECK(test::contains(test::error_of([&] { rig.pipe.run(rig.infeed, 1, &out); }),
                             "already has a reader"));
      } else {
        auto held = out.begin_run();
        CHECK(test::contains(test::error_of([&] { rig.pipe.run(rig.infeed, 1, &out); }),
                             "already attached"));
        for (auto& w : held) w.finish(false);
      }
      const PipelineResult r = rig.pipe.run(rig.infeed, 1, &out);
      CHECK(r.completed());
      CHECK(out.drain().size() == k * replicas);
    }
  }
}

TEST_SUITE_END();
