// A training run ended early (bspflow/pipeline/pipeline.hpp): a std::stop_token stopped
// before the call, a failing stage reaching the host with its stage, device and micro-batch,
// an infeed that ends mid-run (kEndOfData naming the step, whatever the strategy, sync and
// mapping), and a cancel while stage 0 waits for its input; the step cut short never
// applied, and the pipeline runs again afterwards.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_close;
using test::Dense;
using test::dense;
using test::DenseRig;
using test::feed;
using test::make_model;
using test::reference;

TEST_SUITE_BEGIN("pipeline_faults");

TEST_CASE("a std::stop_token stops a training run: before the call nothing is taken or applied") {
  // Guards: Pipeline::run stops on its stop token.
  const std::uint32_t n = 2, k = 3;
  for (const auto strategy : {ExecutionStrategy::kPipelined, ExecutionStrategy::kSingle}) {
    for (const bool distributed : {false, true}) {
      CAPTURE(std::string(to_string(strategy)));
      CAPTURE(distributed);
      PipelineConfig cfg;
      cfg.strategy = strategy;
      cfg.gradient_accumulation = k;
      cfg.distributed = distributed;
      DenseRig rig(cfg, n, 2 * k, 2);
      std::stop_source stopped;
      stopped.request_stop();
      const PipelineResult r = rig.pipe.run(rig.infeed, 2, nullptr, stopped.get_token());
      CHECK(r.status == RunStatus::kCancelled);
      CHECK(r.iterations == 0);
      CHECK(r.micro_batches == 0);
      CHECK(dense(rig.pipe, 0, 0).updates.load() == 0);
      CHECK(rig.infeed.size_approx(0) == 2 * k);
      std::stop_source unused;
      const PipelineResult next = rig.pipe.run(rig.infeed, 2, nullptr, unused.get_token());
      CHECK(next.completed());
      CHECK(next.iterations == 2);
      check_close(dense(rig.pipe, 0, 1).weight_vector(), reference(n, k, 1, 2)[1]);
    }
  }
}

TEST_CASE(
    "a failing stage reaches the host with stage, device and micro-batch; every thread joins") {
  const std::uint32_t n = 3, k = 6;
  for (auto sync : {SyncMode::kBsp, SyncMode::kDataflow}) {
    CAPTURE(to_string(sync));
    PipelineConfig cfg;
    cfg.sync = sync;
    cfg.gradient_accumulation = k;
    DenseRig rig(cfg, n, k, 1, [](std::uint32_t) {
      StageList l = make_model(n);
      static_cast<Dense&>(*l[1]).fail_at = 4;
      return l;
    });
    try {
      rig.pipe.run(rig.infeed, 1);
      FAIL("no StageError");
    } catch (const StageError& e) {
      CHECK(e.stage() == 1);
      CHECK(e.device() == rig.devices[1].id());
      CHECK(e.micro_batch() == 4);
      CHECK(test::contains(e.what(), "injected failure"));
      CHECK(test::contains(e.what(), "micro-batch 4"));
    }
    // The devices are idle again: the next run works (fresh input, the failure disarmed).
    static_cast<Dense&>(rig.pipe.stage(0, 1)).fail_at.reset();
    InfeedQueue<Batch> again(InfeedConfig{1, 64, 1});
    feed(again, k, 1);
    CHECK(rig.pipe.run(again, 1).completed());
  }
}

TEST_CASE("an infeed that ends mid-run ends it with kEndOfData and says what was not applied") {
  const std::uint32_t n = 2, k = 4;
  PipelineConfig cfg;
  cfg.gradient_accumulation = k;
  DenseRig rig(cfg, n, k + 2);  // one full step and half of the next
  rig.infeed.close();
  const PipelineResult r = rig.pipe.run(rig.infeed, 3);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.iterations == 1);
  CHECK(test::contains(r.message, "step 1, micro-batch 2"));
  CHECK(dense(rig.pipe, 0, 0).updates.load() == 1);
}

TEST_CASE("an end of data names the step it ended at, whatever the strategy, sync and mapping") {
  // Guards: the message names the step and micro-batch the data ended at, early in the first
  // step, at a step boundary and in a later step (never "step 0" for all of them).
  struct Case {
    const char* what;
    void (*set)(PipelineConfig&);
  };
  const std::vector<Case> cases = {
      {"pipelined, bsp", [](PipelineConfig&) {}},
      {"pipelined, dataflow", [](PipelineConfig& c) { c.sync = SyncMode::kDataflow; }},
      {"a device mapping",
       [](PipelineConfig& c) {
         c.device_mapping = {0, 1, 1};
       }},
      {"I/O tiles", [](PipelineConfig& c) { c.io_tiles = 2; }},
      {"sharded", [](PipelineConfig& c) { c.strategy = ExecutionStrategy::kSharded; }},
      {"single", [](PipelineConfig& c) { c.strategy = ExecutionStrategy::kSingle; }},
      {"distributed (one instance)", [](PipelineConfig& c) { c.distributed = true; }},
  };
  const std::uint32_t n = 3, k = 5;
  for (const Case& c : cases) {
    for (const std::uint64_t fed :
         {std::uint64_t{2}, std::uint64_t{2 * k}, std::uint64_t{3 * k + 1}}) {
      for (const std::uint32_t replicas : {1u, 2u}) {
        CAPTURE(c.what);
        CAPTURE(fed);
        CAPTURE(replicas);
        PipelineConfig cfg;
        cfg.gradient_accumulation = k;
        cfg.replicas = replicas;
        c.set(cfg);
        DenseRig rig(cfg, n, fed, 2);
        rig.infeed.close();
        const PipelineResult r = rig.pipe.run(rig.infeed, 5);
        CHECK(r.status == RunStatus::kEndOfData);
        CHECK(r.iterations == fed / k);
        const std::string step = std::to_string(fed / k), at = std::to_string(fed % k);
        CHECK(r.message == "the infeed ended at step " + step + ", micro-batch " + at +
                               " of 5: " + step + " step(s) applied; the cut-short step (" + at +
                               " micro-batch(es) per replica) was not");
      }
    }
  }
}

TEST_CASE(
    "a cancel while stage 0 waits for its input ends a single-device training run as cancelled, "
    "not failed") {
  // Regression: with all stages on one device, the backward passes follow the forward
  // passes in the same trip; a forward pass stopped while waiting for its input (or its
  // host copy) stashed nothing, and its backward pass used to report a schedule error.
  const std::uint32_t n = 2, k = 4;
  for (const auto& [slow_link, fed] :
       {std::pair{false, k + 1}, std::pair{true, k + 1}, std::pair{false, 2 * k - 1}}) {
    CAPTURE(slow_link);
    CAPTURE(fed);
    PipelineConfig cfg;
    cfg.strategy = ExecutionStrategy::kSingle;
    cfg.gradient_accumulation = k;
    if (slow_link) cfg.host_link = LinkModel{1e5, 1ms};  // each micro-batch's copy takes ~1 ms
    // One step and one micro-batch (or all but one of the second step's): then it waits.
    DenseRig rig(cfg, n, fed);
    std::jthread canceller([&] {
      std::this_thread::sleep_for(slow_link ? 3ms
                                            : 30ms);  // slow: mid-copy; else: waiting for input
      rig.pipe.cancel();
    });
    const PipelineResult r = rig.pipe.run(rig.infeed, 3);
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.iterations <= 1);
    // The step cut short is not applied: updates and iterations agree, in every stage.
    CHECK(dense(rig.pipe, 0, 0).updates.load() == static_cast<int>(r.iterations));
    CHECK(dense(rig.pipe, 0, 1).updates.load() == static_cast<int>(r.iterations));
  }
}

TEST_SUITE_END();
