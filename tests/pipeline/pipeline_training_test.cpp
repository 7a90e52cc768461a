// Pipelined training (bspflow/pipeline/pipeline.hpp): reaching the weights of plain
// sequential training under every schedule, both sync modes, sharding and a single device;
// replicas seeing different samples and staying bit-identical, their all-reduce taking the
// device link's ring time; optimiser state offload; and inference leaving the weights alone.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_close;
using test::dense;
using test::DenseRig;
using test::reference;

TEST_SUITE_BEGIN("pipeline_training");

TEST_CASE(
    "pipelined training reaches the weights of plain sequential training: every schedule, both "
    "sync modes") {
  const std::uint32_t n = 3, k = 6;
  const std::uint64_t steps = 3;
  const auto expected = reference(n, k, 1, steps);
  struct Case {
    ExecutionStrategy strategy;
    PipelineSchedule schedule;
    SyncMode sync;
    MeanStyle mean;
    bool recompute;
  };
  const std::vector<Case> cases{
      {ExecutionStrategy::kPipelined, PipelineSchedule::kGrouped, SyncMode::kBsp, MeanStyle::kPost,
       false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kInterleaved, SyncMode::kBsp,
       MeanStyle::kPost, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kSequential, SyncMode::kBsp,
       MeanStyle::kPost, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kGrouped, SyncMode::kDataflow,
       MeanStyle::kPost, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kInterleaved, SyncMode::kDataflow,
       MeanStyle::kRunning, false},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kSequential, SyncMode::kDataflow,
       MeanStyle::kPost, true},
      {ExecutionStrategy::kPipelined, PipelineSchedule::kGrouped, SyncMode::kBsp,
       MeanStyle::kRunning, true},
      {ExecutionStrategy::kSharded, PipelineSchedule::kSequential, SyncMode::kBsp, MeanStyle::kPost,
       false},
      {ExecutionStrategy::kSingle, PipelineSchedule::kSequential, SyncMode::kBsp, MeanStyle::kPost,
       false},
  };
  for (const Case& c : cases) {
    CAPTURE(to_string(c.strategy));
    CAPTURE(to_string(c.schedule));
    CAPTURE(to_string(c.sync));
    CAPTURE(c.recompute);
    PipelineConfig cfg;
    cfg.strategy = c.strategy;
    cfg.schedule = c.schedule;
    cfg.sync = c.sync;
    cfg.mean = c.mean;
    cfg.recompute = c.recompute;
    cfg.gradient_accumulation = k;
    DenseRig rig(cfg, n, k * steps, 2);
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
    const PipelineResult r = rig.pipe.run(rig.infeed, steps, &outfeed);
    REQUIRE(r.completed());
    CHECK(r.iterations == steps);
    CHECK(r.micro_batches == k * steps);
    const auto entries = outfeed.drain();
    REQUIRE(entries.size() == k * steps);
    for (std::size_t e = 0; e < entries.size(); ++e) CHECK(entries[e].iteration == e);
    for (std::uint32_t s = 0; s < n; ++s) {
      check_close(dense(rig.pipe, 0, s).weight_vector(), expected[s]);
      CHECK(dense(rig.pipe, 0, s).updates.load() == static_cast<int>(steps));
    }
  }
}

TEST_CASE("replication: replicas see different samples, reduce gradients, stay bit-identical") {
  const std::uint32_t n = 2, k = 3, replicas = 2;
  const std::uint64_t steps = 2;
  const auto expected = reference(n, k, replicas, steps);
  for (auto sync : {SyncMode::kBsp, SyncMode::kDataflow}) {
    CAPTURE(to_string(sync));
    PipelineConfig cfg;
    cfg.gradient_accumulation = k;
    cfg.replicas = replicas;
    cfg.sync = sync;
    DenseRig rig(cfg, n, k * steps);  // 4 devices on 2 cores
    const PipelineResult r = rig.pipe.run(rig.infeed, steps);
    REQUIRE(r.completed());
    CHECK(r.micro_batches == k * steps * replicas);
    for (std::uint32_t s = 0; s < n; ++s) {
      CHECK(dense(rig.pipe, 0, s).weight_vector() ==
            dense(rig.pipe, 1, s).weight_vector());  // bit-identical
      check_close(dense(rig.pipe, 0, s).weight_vector(), expected[s]);
    }
    const auto& a = dense(rig.pipe, 0, 0).seen;
    const auto& b = dense(rig.pipe, 1, 0).seen;
    CHECK(a.size() == k * steps);
    CHECK(b.size() == k * steps);
    for (auto i : a) CHECK(b.count(i) == 0);
  }
}

TEST_CASE(
    "replication: the all-reduce takes the device link's ring time, once per step, labelled") {
  const std::uint32_t n = 2, k = 3, replicas = 2;
  const std::uint64_t steps = 3;
  PipelineConfig cfg;
  cfg.gradient_accumulation = k;
  cfg.replicas = replicas;
  cfg.trace = true;
  cfg.device_link = LinkModel{1e8, 20us};  // slow enough that the ring time is well above noise
  DenseRig rig(cfg, n, k * steps);
  REQUIRE(rig.pipe.run(rig.infeed, steps).completed());
  REQUIRE(rig.pipe.trace() != nullptr);
  std::uint32_t device_tracks = 0;
  for (const TraceTrack& t : rig.pipe.trace()->tracks()) {
    if (t.kind() != TraceTrack::Kind::kDevice) continue;
    CAPTURE(t.name());
    const std::uint32_t s = device_tracks++ % n;  // device r*N+s holds replica r's stage s
    const std::size_t bytes = dense(rig.pipe, 0, s).gradient_elements() * sizeof(float);
    REQUIRE(bytes > 0);
    const std::chrono::nanoseconds ring = cfg.device_link.ring_allreduce(bytes, replicas);
    CHECK(ring == 2 * (replicas - 1) * cfg.device_link.duration((bytes + replicas - 1) / replicas));
    std::uint64_t all_reduces = 0;
    for (const TraceEvent& e : t.events()) {
      if (t.label(e) != "all-reduce") continue;
      ++all_reduces;
      CHECK(e.phase == Phase::kExchange);
      CHECK(e.bytes == bytes);
      CHECK(e.end_ns - e.begin_ns >= ring.count());  // it waited at least the modeled time
    }
    CHECK(all_reduces == steps);
  }
  CHECK(device_tracks == replicas * n);
}

TEST_CASE("optimiser state offload: streamed in and out around each update, same weights") {
  const std::uint32_t n = 2, k = 3;
  const std::uint64_t steps = 3;
  const auto expected = reference(n, k, 1, steps);
  for (auto strategy : {ExecutionStrategy::kPipelined, ExecutionStrategy::kSingle}) {
    CAPTURE(to_string(strategy));
    PipelineConfig cfg;
    cfg.strategy = strategy;
    cfg.gradient_accumulation = k;
    cfg.offload_optimizer = true;
    cfg.trace = true;
    DenseRig rig(cfg, n, k * steps);
    REQUIRE(rig.pipe.run(rig.infeed, steps).completed());
    for (std::uint32_t s = 0; s < n; ++s) {
      check_close(dense(rig.pipe, 0, s).weight_vector(),
                  expected[s]);  // the momentum made it back each time
      for (float v : dense(rig.pipe, 0, s).optimizer_state()) CHECK(v == 0.0f);  // not resident
    }
    std::uint64_t in = 0, out = 0, bytes_in = 0;
    for (const TraceTrack& t : rig.pipe.trace()->tracks()) {
      for (const TraceEvent& e : t.events()) {
        if (e.phase != Phase::kStreamCopyMid) continue;
        (e.to_host ? out : in) += 1;
        if (!e.to_host) bytes_in += e.bytes;
      }
    }
    CHECK(in == steps * (strategy == ExecutionStrategy::kSingle ? 1 : n));
    CHECK(out == in);
    std::uint64_t state_bytes = 0;
    for (std::uint32_t s = 0; s < n; ++s)
      state_bytes += dense(rig.pipe, 0, s).optimizer_state().size_bytes();
    CHECK(bytes_in == steps * state_bytes);
    // Labelled as what they are, so the trace tells offload from other stream copies.
    for (const TraceTrack& t : rig.pipe.trace()->tracks()) {
      for (const TraceEvent& e : t.events()) {
        if (e.phase == Phase::kStreamCopyMid) {
          CHECK(t.label(e) == (e.to_host ? "optimiser state out" : "optimiser state in"));
        }
      }
    }
    // And the summary gives their share of the run, per device.
    const TraceSummary summary = rig.pipe.trace()->summary();
    for (const TrackSummary& t : summary.tracks) {
      if (t.kind != TraceTrack::Kind::kDevice) continue;
      CAPTURE(t.name);
      std::int64_t in_ns = -1, out_ns = -1;
      for (const auto& [label, ns] : t.label_ns) {
        if (label == "optimiser state in") in_ns = ns;
        if (label == "optimiser state out") out_ns = ns;
      }
      CHECK(in_ns > 0);
      CHECK(out_ns > 0);
      CHECK(std::is_sorted(t.label_ns.begin(), t.label_ns.end(),
                           [](const auto& a, const auto& b) { return a.second > b.second; }));
    }
    CHECK(summary.to_string().find("optimiser state in") != std::string::npos);
  }
}

TEST_CASE("inference: forward passes only, every micro-batch's output reaches the outfeed") {
  const std::uint32_t n = 3, k = 4;
  PipelineConfig cfg;
  cfg.training = false;
  cfg.gradient_accumulation = k;
  DenseRig rig(cfg, n, k * 2);
  OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
  const PipelineResult r = rig.pipe.run(rig.infeed, 2, &outfeed);
  REQUIRE(r.completed());
  CHECK(outfeed.drain().size() == k * 2);
  CHECK(dense(rig.pipe, 0, 0).updates.load() == 0);
  CHECK(dense(rig.pipe, 0, 1).weight_vector() == reference(n, k, 1, 0)[1]);  // untouched
}

TEST_SUITE_END();
