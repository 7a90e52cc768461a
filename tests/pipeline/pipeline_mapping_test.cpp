// Device mapping (PipelineConfig::device_mapping): consecutive stages sharing a device reach
// the same weights as one stage per device, inference through shared devices answers every
// micro-batch in order, and a bad mapping is refused saying what is allowed.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_close;
using test::dense;
using test::DenseRig;
using test::kDenseDevice;
using test::make_model;
using test::reference;

TEST_SUITE_BEGIN("pipeline_mapping");

TEST_CASE(
    "device mapping: consecutive stages share a device and training reaches the same weights") {
  const std::uint32_t n = 3, k = 6;
  const std::uint64_t steps = 3;
  struct Case {
    ExecutionStrategy strategy;
    PipelineSchedule schedule;
    std::vector<std::uint32_t> mapping;
    std::uint32_t replicas;
    bool recompute;
  };
  const std::vector<Case> cases{
      {ExecutionStrategy::kPipelined, PipelineSchedule::kGrouped, {0, 0, 1}, 1, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kInterleaved, {0, 1, 1}, 1, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kSequential, {0, 0, 0}, 1, true},
      {ExecutionStrategy::kSharded, PipelineSchedule::kSequential, {0, 1, 1}, 1, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kGrouped, {0, 0, 1}, 2, false},
  };
  for (const Case& c : cases) {
    CAPTURE(to_string(c.strategy));
    CAPTURE(to_string(c.schedule));
    CAPTURE(c.replicas);
    CAPTURE(c.mapping[1]);
    CAPTURE(c.mapping[2]);
    const auto expected = reference(n, k, c.replicas, steps);
    PipelineConfig cfg;
    cfg.strategy = c.strategy;
    cfg.schedule = c.schedule;
    cfg.device_mapping = c.mapping;
    cfg.replicas = c.replicas;
    cfg.recompute = c.recompute;
    cfg.gradient_accumulation = k;
    cfg.trace = true;
    const std::uint32_t per_replica = c.mapping.back() + 1;
    CHECK(cfg.devices_per_replica(n) == per_replica);
    CHECK(cfg.devices_needed(n) == per_replica * c.replicas);
    DenseRig rig(cfg, n, k * steps, 2);
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{c.replicas, OutputMode::all(), 0});
    const PipelineResult r = rig.pipe.run(rig.infeed, steps, &outfeed);
    REQUIRE(r.completed());
    CHECK(r.iterations == steps);
    CHECK(outfeed.drain().size() == k * steps * c.replicas);
    for (std::uint32_t rep = 0; rep < c.replicas; ++rep) {
      for (std::uint32_t s = 0; s < n; ++s) {
        check_close(dense(rig.pipe, rep, s).weight_vector(), expected[s]);
        CHECK(dense(rig.pipe, rep, s).updates.load() == static_cast<int>(steps));
      }
    }
    // The memory plan puts each stage on its mapped device.
    REQUIRE(rig.pipe.memory().devices.size() == per_replica * c.replicas);
    for (std::uint32_t s = 0; s < n; ++s) {
      const DeviceMemory& d = rig.pipe.memory().devices[c.mapping[s]];
      bool found = false;
      for (const TensorMemory& t : d.tensors) found = found || (t.stage == s && t.replica == 0);
      CHECK(found);
    }
    // Device 0 runs the forward passes of every stage mapped to it: K per step each.
    std::uint64_t forwards = 0;
    for (const TraceTrack& track : rig.pipe.trace()->tracks()) {
      if (track.kind() != TraceTrack::Kind::kDevice) continue;
      for (const TraceEvent& e : track.events())
        forwards += track.label(e).find(" forward") != std::string::npos ? 1 : 0;
      break;  // device 0
    }
    const auto on_first =
        static_cast<std::uint64_t>(std::count(c.mapping.begin(), c.mapping.end(), 0u));
    CHECK(forwards == on_first * k * steps);
  }
}

TEST_CASE("device mapping: inference through shared devices answers every micro-batch in order") {
  const std::uint32_t n = 3, k = 5;
  for (const auto& mapping :
       {std::vector<std::uint32_t>{0, 0, 1}, std::vector<std::uint32_t>{0, 1, 1}}) {
    PipelineConfig cfg;
    cfg.training = false;
    cfg.gradient_accumulation = k;
    cfg.device_mapping = mapping;
    DenseRig rig(cfg, n, k * 2);
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
    const PipelineResult r = rig.pipe.run(rig.infeed, 2, &outfeed);
    REQUIRE(r.completed());
    const auto entries = outfeed.drain();
    REQUIRE(entries.size() == k * 2);
    for (std::size_t e = 0; e < entries.size(); ++e) CHECK(entries[e].iteration == e);
  }
}

TEST_CASE("device mapping: a bad mapping is refused, saying what is allowed") {
  DeviceGroup devices(3, kDenseDevice);
  auto error_of = [&](PipelineConfig cfg) {
    cfg.gradient_accumulation = 6;
    try {
      Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(3); });
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  PipelineConfig c;
  c.device_mapping = {0, 1};
  CHECK(error_of(c).find("device_mapping has 2 entries for 3 stages") != std::string::npos);
  c.device_mapping = {1, 1, 2};
  CHECK(error_of(c).find("device_mapping[0] = 1") != std::string::npos);
  c.device_mapping = {0, 2, 2};
  CHECK(error_of(c).find("device_mapping[1] = 2 is not allowed: must be 0 or 1") !=
        std::string::npos);
  c.device_mapping = {0, 1, 0};
  CHECK(error_of(c).find("device_mapping[2] = 0") != std::string::npos);
  c.device_mapping = {0, 0, 1};
  c.sync = SyncMode::kDataflow;
  CHECK(error_of(c).find("use sync mode bsp") != std::string::npos);
  c.sync = SyncMode::kBsp;
  c.strategy = ExecutionStrategy::kSingle;
  CHECK(error_of(c).find("strategy single") != std::string::npos);
}

TEST_SUITE_END();
