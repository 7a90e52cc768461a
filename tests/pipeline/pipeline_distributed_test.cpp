// The distributed machinery (PipelineConfig::distributed) in one process, where
// ThreadSanitizer sees its threads (the mpi suite runs it over several processes): the
// exchange is the identity and the weights those of a plain run; cancels at random times and
// an end of data leave every replica alike.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::dense;
using test::feed;
using test::kDenseDevice;
using test::make_model;

TEST_SUITE_BEGIN("pipeline_distributed");

TEST_CASE(
    "distributed in one process: the exchange is the identity, the weights those of a plain run") {
  // The machinery of PipelineConfig::distributed (the mpi suite runs it over several
  // processes) in one instance, where ThreadSanitizer sees its threads.
  // kMean scales the sum (in place, or into each replica's own buffer); kSum over one
  // instance's replicas has every replica's update read the shared sum where it lies.
  const std::uint32_t n = 2, k = 3;
  for (const auto strategy : {ExecutionStrategy::kPipelined, ExecutionStrategy::kSingle}) {
    for (const auto& [replicas, reduction] :
         {std::pair{1u, ReductionType::kMean}, std::pair{2u, ReductionType::kMean},
          std::pair{2u, ReductionType::kSum}}) {
      CAPTURE(replicas);
      CAPTURE(static_cast<int>(reduction));
      PipelineConfig cfg;
      cfg.strategy = strategy;
      cfg.gradient_accumulation = k;
      cfg.replicas = replicas;
      cfg.reduction = reduction;
      DeviceGroup devices(cfg.devices_needed(n), kDenseDevice);
      Pipeline plain(devices, cfg, [](std::uint32_t) { return make_model(n); });
      cfg.distributed = true;
      cfg.weight_check_interval = 1;
      Pipeline dist(devices, cfg, [](std::uint32_t) { return make_model(n); });
      for (Pipeline* p : {&plain, &dist}) {
        InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 1});
        feed(infeed, 4 * k, replicas);
        const PipelineResult r = p->run(infeed, 4);
        REQUIRE(r.completed());
        CHECK(r.iterations == 4);
      }
      for (std::uint32_t r = 0; r < replicas; ++r) {
        for (std::uint32_t s = 0; s < n; ++s)
          CHECK(dense(dist, r, s).weight_vector() == dense(plain, 0, s).weight_vector());
      }
    }
  }
}

TEST_CASE(
    "distributed in one process: cancels at random times and an end of data leave every replica "
    "alike") {
  const std::uint32_t n = 2, k = 2;
  PipelineConfig cfg;
  cfg.strategy = ExecutionStrategy::kSingle;
  cfg.gradient_accumulation = k;
  cfg.replicas = 2;
  cfg.distributed = true;
  DeviceGroup devices(cfg.devices_needed(n), kDenseDevice);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> delay_us(0, 3000);
  const int trials = static_cast<int>(test::scaled(20, 4));
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(trial);
    InfeedQueue<Batch> infeed(InfeedConfig{2, 128, 1});
    feed(infeed, 40 * k, 2);
    std::jthread canceller([&, wait = delay_us(rng)] {
      std::this_thread::sleep_for(std::chrono::microseconds(wait));
      pipe.cancel();
    });
    const PipelineResult r = pipe.run(infeed, 40);
    canceller = {};
    CHECK((r.completed() || r.status == RunStatus::kCancelled));
    CHECK(dense(pipe, 0, 0).updates.load() == dense(pipe, 1, 0).updates.load());
    for (std::uint32_t s = 0; s < n; ++s)
      CHECK(dense(pipe, 0, s).weight_vector() == dense(pipe, 1, s).weight_vector());
  }
  // End of data mid-step: the cut-short step is applied nowhere.
  const int before = dense(pipe, 0, 0).updates.load();
  InfeedQueue<Batch> infeed(InfeedConfig{2, 128, 1});
  feed(infeed, 2 * k + 1, 2);
  infeed.close();
  const PipelineResult r = pipe.run(infeed, 5);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.iterations == 2);
  CHECK(dense(pipe, 0, 0).updates.load() == before + 2);
  CHECK(dense(pipe, 1, 0).updates.load() == before + 2);
}

TEST_SUITE_END();
