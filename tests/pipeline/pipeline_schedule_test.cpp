// Pipeline schedules (bspflow/pipeline/pipeline.hpp's PipelineSchedule, PipelinePlan): the
// plan's arithmetic (every micro-batch forward then backward once per stage, in dependency
// order; the FIFO depths), the FIFO depths a run observes, and the order of each device's
// forward and backward passes in the trace.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::DenseRig;

TEST_SUITE_BEGIN("pipeline_schedule");

TEST_CASE(
    "plan: every micro-batch runs forward then backward once per stage, in dependency order") {
  for (auto schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                        PipelineSchedule::kSequential}) {
    for (bool training : {true, false}) {
      const std::uint32_t n = 4, k = 9;
      const PipelinePlan plan{schedule, n, k, training};
      std::map<std::pair<std::uint32_t, std::int64_t>, std::uint64_t> fwd, bwd;
      std::vector<std::uint32_t> max_fifo(n, 0), held(n, 0);
      for (std::uint64_t c = 0; c < plan.cycles(); ++c) {
        for (std::uint32_t s = 0; s < n; ++s) {
          const CycleWork w = plan.at(s, c);
          if (w.forward >= 0) {
            CHECK(fwd.emplace(std::make_pair(s, w.forward), c).second);
            max_fifo[s] = std::max(max_fifo[s], held[s]);
            ++held[s];
          }
          if (w.backward >= 0) {
            CHECK(bwd.emplace(std::make_pair(s, w.backward), c).second);
            --held[s];
          }
          if (!training) held[s] = 0;  // nothing is kept for a backward pass
        }
      }
      CHECK(fwd.size() == n * k);
      CHECK(bwd.size() == (training ? n * k : 0u));
      for (auto [key, c] : fwd) {
        if (key.first > 0)
          CHECK(fwd.at({key.first - 1, key.second}) < c);  // after the previous stage's
      }
      for (auto [key, c] : bwd) {
        CHECK(fwd.at(key) <= c);
        if (key.first + 1 < n) CHECK(bwd.at({key.first + 1, key.second}) < c);
      }
      for (std::uint32_t s = 0; s < n; ++s) CHECK(max_fifo[s] == plan.fifo_depth(s));
    }
  }
  CHECK(PipelinePlan{PipelineSchedule::kGrouped, 4, 10, true}.fifo_depth(0) == 6);
  CHECK(PipelinePlan{PipelineSchedule::kInterleaved, 4, 10, true}.fifo_depth(1) == 2);
  CHECK(PipelinePlan{PipelineSchedule::kSequential, 4, 10, true}.fifo_depth(0) == 0);
}

TEST_CASE("FIFO depths observed match the schedules' formulas") {
  const std::uint32_t n = 4, k = 10;
  for (auto schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                        PipelineSchedule::kSequential}) {
    CAPTURE(to_string(schedule));
    PipelineConfig cfg;
    cfg.schedule = schedule;
    cfg.gradient_accumulation = k;
    DenseRig rig(cfg, n, k);
    const PipelineResult r = rig.pipe.run(rig.infeed, 1);
    REQUIRE(r.completed());
    for (std::uint32_t s = 0; s < n; ++s) CHECK(r.fifo_depth[s] == rig.pipe.plan().fifo_depth(s));
  }
}

TEST_CASE("trace: each device runs its forward and backward passes in the schedule's order") {
  const std::uint32_t n = 3, k = 5;
  for (auto schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                        PipelineSchedule::kSequential}) {
    for (auto sync : {SyncMode::kBsp, SyncMode::kDataflow}) {
      CAPTURE(to_string(schedule));
      CAPTURE(to_string(sync));
      PipelineConfig cfg;
      cfg.schedule = schedule;
      cfg.sync = sync;
      cfg.gradient_accumulation = k;
      cfg.trace = true;
      DenseRig rig(cfg, n, k);
      REQUIRE(rig.pipe.run(rig.infeed, 1).completed());
      REQUIRE(rig.pipe.trace() != nullptr);
      for (std::uint32_t s = 0; s < n; ++s) {
        std::string expected, got;
        for (std::uint64_t c = 0; c < rig.pipe.plan().cycles(); ++c) {
          const CycleWork w = rig.pipe.plan().at(s, c);
          if (w.forward >= 0) expected += 'F';
          if (w.backward >= 0) expected += 'B';
        }
        const TraceTrack& t = rig.pipe.trace()->tracks()[s];
        bool exchanged = false;
        for (const TraceEvent& e : t.events()) {
          if (e.phase == Phase::kExchange) exchanged = true;
          if (e.phase != Phase::kCompute) continue;
          const std::string& l = t.label(e);
          if (l.ends_with(" forward")) got += 'F';
          if (l.ends_with(" backward")) got += 'B';
        }
        CHECK(got == expected);
        CHECK(exchanged == (sync == SyncMode::kBsp));  // dataflow hands off without exchange phases
      }
    }
  }
}

TEST_SUITE_END();
