// Pipelining, sharding, replication and gradient accumulation: the schedules' arithmetic,
// training equivalence with a plain sequential loop, replicas, FIFO depths, the order of
// passes in the trace, errors and failures.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <stop_token>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline/dense_stage.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;

namespace {

const DeviceConfig kSmall{64, 64 * 1024};
constexpr std::size_t kBatch = test::kDenseBatch;
constexpr std::uint32_t kClasses = 3;
using test::Dense;

// Layer widths: 5 -> 6 -> 4 -> ... -> kClasses.
std::vector<std::size_t> widths(std::uint32_t stages) {
  std::vector<std::size_t> w{5};
  for (std::uint32_t s = 0; s + 1 < stages; ++s) w.push_back(s % 2 == 0 ? 6 : 4);
  w.push_back(kClasses);
  return w;
}

StageList make_model(std::uint32_t stages) {
  const auto w = widths(stages);
  StageList list;
  for (std::uint32_t s = 0; s < stages; ++s) {
    list.push_back(std::make_unique<Dense>(w[s], w[s + 1], s + 1 == stages, static_cast<float>(s)));
  }
  return list;
}

// Micro-batch m of the whole stream (deterministic).
Batch make_batch(std::uint64_t m) {
  Batch b;
  b.data = Tensor(DType::kFloat32, {kBatch, 5});
  auto x = b.data.as<float>();
  for (std::size_t j = 0; j < x.size(); ++j)
    x[j] = std::cos(0.37f * static_cast<float>(m * 31 + j));
  for (std::size_t i = 0; i < kBatch; ++i) {
    b.labels.push_back(static_cast<std::int32_t>((m + i) % kClasses));
    b.indices.push_back(m * kBatch + i);
  }
  b.valid = kBatch;
  return b;
}

// Plain training without the runtime: micro-batches in order, gradients summed over the
// step (and over the replicas' micro-batches of the same position), averaged, one update.
std::vector<std::vector<float>> reference(std::uint32_t stages, std::uint32_t k,
                                          std::uint32_t replicas, std::uint64_t steps) {
  StageList model = make_model(stages);
  std::vector<std::vector<float>> sum(stages);
  for (std::uint32_t s = 0; s < stages; ++s) sum[s].assign(model[s]->gradient_elements(), 0.0f);
  std::uint64_t m = 0;
  for (std::uint64_t step = 0; step < steps; ++step) {
    for (auto& g : sum) std::fill(g.begin(), g.end(), 0.0f);
    for (std::uint32_t i = 0; i < k * replicas; ++i, ++m) {
      const Batch batch = make_batch(m);
      std::vector<std::vector<float>> outs(stages), saved(stages);
      for (std::uint32_t s = 0; s < stages; ++s) {
        outs[s].assign(model[s]->output_elements(), 0.0f);
        StageContext ctx{s, 0, 0, step, i};
        ForwardArgs a{batch,
                      s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]),
                      outs[s], saved[s]};
        model[s]->forward(ctx, a);
      }
      std::vector<float> grad_out;
      for (std::uint32_t s = stages; s-- > 0;) {
        std::vector<float> g(model[s]->gradient_elements(), 0.0f);
        std::vector<float> grad_in(s == 0 ? 0 : outs[s - 1].size(), 0.0f);
        StageContext ctx{s, 0, 0, step, i};
        BackwardArgs a{
            batch,    s == 0 ? std::span<const float>{} : std::span<const float>(outs[s - 1]),
            saved[s], grad_out,
            grad_in,  g};
        model[s]->backward(ctx, a);
        for (std::size_t j = 0; j < g.size(); ++j) sum[s][j] += g[j];
        grad_out = grad_in;
      }
    }
    for (std::uint32_t s = 0; s < stages; ++s) {
      for (float& g : sum[s]) g /= static_cast<float>(k * replicas);
      model[s]->update(StageContext{}, sum[s]);
    }
  }
  std::vector<std::vector<float>> w;
  for (auto& st : model) w.push_back(static_cast<Dense&>(*st).weight_vector());
  return w;
}

// Feeds `micro_batches` per replica: micro-batch m of the stream goes to replica m % R.
void feed(InfeedQueue<Batch>& infeed, std::uint64_t micro_batches, std::uint32_t replicas) {
  auto p = infeed.make_producer();
  for (std::uint64_t m = 0; m < micro_batches * replicas; ++m) {
    REQUIRE(p.push_to(static_cast<std::uint32_t>(m % replicas), make_batch(m)));
  }
}

void check_close(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t j = 0; j < a.size(); ++j)
    worst = std::max(worst, std::fabs(double(a[j]) - double(b[j])));
  CHECK(worst < 1e-5);
}

Dense& dense(Pipeline& p, std::uint32_t r, std::uint32_t s) {
  return static_cast<Dense&>(p.stage(r, s));
}

}  // namespace

TEST_SUITE_BEGIN("pipeline");

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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 2});
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
    feed(infeed, k * steps, 1);
    const PipelineResult r = pipe.run(infeed, steps, &outfeed);
    REQUIRE(r.completed());
    CHECK(r.iterations == steps);
    CHECK(r.micro_batches == k * steps);
    const auto entries = outfeed.drain();
    REQUIRE(entries.size() == k * steps);
    for (std::size_t e = 0; e < entries.size(); ++e) CHECK(entries[e].iteration == e);
    for (std::uint32_t s = 0; s < n; ++s) {
      check_close(dense(pipe, 0, s).weight_vector(), expected[s]);
      CHECK(dense(pipe, 0, s).updates.load() == static_cast<int>(steps));
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);  // 4 devices on 2 cores
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 1});
    feed(infeed, k * steps, replicas);
    const PipelineResult r = pipe.run(infeed, steps);
    REQUIRE(r.completed());
    CHECK(r.micro_batches == k * steps * replicas);
    for (std::uint32_t s = 0; s < n; ++s) {
      CHECK(dense(pipe, 0, s).weight_vector() ==
            dense(pipe, 1, s).weight_vector());  // bit-identical
      check_close(dense(pipe, 0, s).weight_vector(), expected[s]);
    }
    const auto& a = dense(pipe, 0, 0).seen;
    const auto& b = dense(pipe, 1, 0).seen;
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
  DeviceGroup devices(cfg.devices_needed(n), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
  InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 1});
  feed(infeed, k * steps, replicas);
  REQUIRE(pipe.run(infeed, steps).completed());
  REQUIRE(pipe.trace() != nullptr);
  std::uint32_t device_tracks = 0;
  for (const TraceTrack& t : pipe.trace()->tracks()) {
    if (t.kind() != TraceTrack::Kind::kDevice) continue;
    CAPTURE(t.name());
    const std::uint32_t s = device_tracks++ % n;  // device r*N+s holds replica r's stage s
    const std::size_t bytes = dense(pipe, 0, s).gradient_elements() * sizeof(float);
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    feed(infeed, k * steps, 1);
    REQUIRE(pipe.run(infeed, steps).completed());
    for (std::uint32_t s = 0; s < n; ++s) {
      check_close(dense(pipe, 0, s).weight_vector(),
                  expected[s]);  // the momentum made it back each time
      for (float v : dense(pipe, 0, s).optimizer_state()) CHECK(v == 0.0f);  // not resident
    }
    std::uint64_t in = 0, out = 0, bytes_in = 0;
    for (const TraceTrack& t : pipe.trace()->tracks()) {
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
      state_bytes += dense(pipe, 0, s).optimizer_state().size_bytes();
    CHECK(bytes_in == steps * state_bytes);
    // Labelled as what they are, so the trace tells offload from other stream copies.
    for (const TraceTrack& t : pipe.trace()->tracks()) {
      for (const TraceEvent& e : t.events()) {
        if (e.phase == Phase::kStreamCopyMid) {
          CHECK(t.label(e) == (e.to_host ? "optimiser state out" : "optimiser state in"));
        }
      }
    }
    // And the summary gives their share of the run, per device.
    const TraceSummary summary = pipe.trace()->summary();
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

TEST_CASE("FIFO depths observed match the schedules' formulas") {
  const std::uint32_t n = 4, k = 10;
  for (auto schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                        PipelineSchedule::kSequential}) {
    CAPTURE(to_string(schedule));
    PipelineConfig cfg;
    cfg.schedule = schedule;
    cfg.gradient_accumulation = k;
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    feed(infeed, k, 1);
    const PipelineResult r = pipe.run(infeed, 1);
    REQUIRE(r.completed());
    for (std::uint32_t s = 0; s < n; ++s) CHECK(r.fifo_depth[s] == pipe.plan().fifo_depth(s));
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
      DeviceGroup devices(cfg.devices_needed(n), kSmall);
      Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
      InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
      feed(infeed, k, 1);
      REQUIRE(pipe.run(infeed, 1).completed());
      REQUIRE(pipe.trace() != nullptr);
      for (std::uint32_t s = 0; s < n; ++s) {
        std::string expected, got;
        for (std::uint64_t c = 0; c < pipe.plan().cycles(); ++c) {
          const CycleWork w = pipe.plan().at(s, c);
          if (w.forward >= 0) expected += 'F';
          if (w.backward >= 0) expected += 'B';
        }
        const TraceTrack& t = pipe.trace()->tracks()[s];
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{c.replicas, 64, 2});
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{c.replicas, OutputMode::all(), 0});
    feed(infeed, k * steps, c.replicas);
    const PipelineResult r = pipe.run(infeed, steps, &outfeed);
    REQUIRE(r.completed());
    CHECK(r.iterations == steps);
    CHECK(outfeed.drain().size() == k * steps * c.replicas);
    for (std::uint32_t rep = 0; rep < c.replicas; ++rep) {
      for (std::uint32_t s = 0; s < n; ++s) {
        check_close(dense(pipe, rep, s).weight_vector(), expected[s]);
        CHECK(dense(pipe, rep, s).updates.load() == static_cast<int>(steps));
      }
    }
    // The memory plan puts each stage on its mapped device.
    REQUIRE(pipe.memory().devices.size() == per_replica * c.replicas);
    for (std::uint32_t s = 0; s < n; ++s) {
      const DeviceMemory& d = pipe.memory().devices[c.mapping[s]];
      bool found = false;
      for (const TensorMemory& t : d.tensors) found = found || (t.stage == s && t.replica == 0);
      CHECK(found);
    }
    // Device 0 runs the forward passes of every stage mapped to it: K per step each.
    std::uint64_t forwards = 0;
    for (const TraceTrack& track : pipe.trace()->tracks()) {
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
    feed(infeed, k * 2, 1);
    const PipelineResult r = pipe.run(infeed, 2, &outfeed);
    REQUIRE(r.completed());
    const auto entries = outfeed.drain();
    REQUIRE(entries.size() == k * 2);
    for (std::size_t e = 0; e < entries.size(); ++e) CHECK(entries[e].iteration == e);
  }
}

TEST_CASE("device mapping: a bad mapping is refused, saying what is allowed") {
  DeviceGroup devices(3, kSmall);
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

TEST_CASE("inference: forward passes only, every micro-batch's output reaches the outfeed") {
  const std::uint32_t n = 3, k = 4;
  PipelineConfig cfg;
  cfg.training = false;
  cfg.gradient_accumulation = k;
  DeviceGroup devices(cfg.devices_needed(n), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
  OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 0});
  feed(infeed, k * 2, 1);
  const PipelineResult r = pipe.run(infeed, 2, &outfeed);
  REQUIRE(r.completed());
  CHECK(outfeed.drain().size() == k * 2);
  CHECK(dense(pipe, 0, 0).updates.load() == 0);
  CHECK(dense(pipe, 0, 1).weight_vector() == reference(n, k, 1, 0)[1]);  // untouched
}

TEST_CASE("errors: the config is checked against the stages and devices, saying what is allowed") {
  DeviceGroup devices(4, kSmall);
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
  DeviceGroup devices(4, kSmall);
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
      DeviceGroup devices(cfg.devices_needed(n), kSmall);
      Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
      InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 2});
      feed(infeed, 2 * k, 1);
      std::stop_source stopped;
      stopped.request_stop();
      const PipelineResult r = pipe.run(infeed, 2, nullptr, stopped.get_token());
      CHECK(r.status == RunStatus::kCancelled);
      CHECK(r.iterations == 0);
      CHECK(r.micro_batches == 0);
      CHECK(dense(pipe, 0, 0).updates.load() == 0);
      CHECK(infeed.size_approx(0) == 2 * k);
      std::stop_source unused;
      const PipelineResult next = pipe.run(infeed, 2, nullptr, unused.get_token());
      CHECK(next.completed());
      CHECK(next.iterations == 2);
      check_close(dense(pipe, 0, 1).weight_vector(), reference(n, k, 1, 2)[1]);
    }
  }
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
      DeviceGroup devices(cfg.devices_needed(n), kSmall);
      Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
      InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 1});
      OutfeedQueue<std::vector<float>> out(OutfeedConfig{replicas, OutputMode::all(), 0});
      feed(infeed, k, replicas);
      if (lane_taken) {
        auto held = infeed.reader(replicas - 1);
        CHECK(test::contains(test::error_of([&] { pipe.run(infeed, 1, &out); }),
                             "already has a reader"));
      } else {
        auto held = out.begin_run();
        CHECK(
            test::contains(test::error_of([&] { pipe.run(infeed, 1, &out); }), "already attached"));
        for (auto& w : held) w.finish(false);
      }
      const PipelineResult r = pipe.run(infeed, 1, &out);
      CHECK(r.completed());
      CHECK(out.drain().size() == k * replicas);
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) {
      StageList l = make_model(n);
      static_cast<Dense&>(*l[1]).fail_at = 4;
      return l;
    });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    feed(infeed, k, 1);
    try {
      pipe.run(infeed, 1);
      FAIL("no StageError");
    } catch (const StageError& e) {
      CHECK(e.stage() == 1);
      CHECK(e.device() == devices[1].id());
      CHECK(e.micro_batch() == 4);
      CHECK(test::contains(e.what(), "injected failure"));
      CHECK(test::contains(e.what(), "micro-batch 4"));
    }
    // The devices are idle again: the next run works (fresh input, the failure disarmed).
    static_cast<Dense&>(pipe.stage(0, 1)).fail_at.reset();
    InfeedQueue<Batch> again(InfeedConfig{1, 64, 1});
    feed(again, k, 1);
    CHECK(pipe.run(again, 1).completed());
  }
}

TEST_CASE("an infeed that ends mid-run ends it with kEndOfData and says what was not applied") {
  const std::uint32_t n = 2, k = 4;
  PipelineConfig cfg;
  cfg.gradient_accumulation = k;
  DeviceGroup devices(cfg.devices_needed(n), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
  feed(infeed, k + 2, 1);  // one full step and half of the next
  infeed.close();
  const PipelineResult r = pipe.run(infeed, 3);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.iterations == 1);
  CHECK(test::contains(r.message, "step 1, micro-batch 2"));
  CHECK(dense(pipe, 0, 0).updates.load() == 1);
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
        DeviceGroup devices(cfg.devices_needed(n), kSmall);
        Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
        InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 2});
        feed(infeed, fed, replicas);
        infeed.close();
        const PipelineResult r = pipe.run(infeed, 5);
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
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(n); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    // One step and one micro-batch (or all but one of the second step's): then it waits.
    feed(infeed, fed, 1);
    std::jthread canceller([&] {
      std::this_thread::sleep_for(slow_link ? 3ms
                                            : 30ms);  // slow: mid-copy; else: waiting for input
      pipe.cancel();
    });
    const PipelineResult r = pipe.run(infeed, 3);
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.iterations <= 1);
    // The step cut short is not applied: updates and iterations agree, in every stage.
    CHECK(dense(pipe, 0, 0).updates.load() == static_cast<int>(r.iterations));
    CHECK(dense(pipe, 0, 1).updates.load() == static_cast<int>(r.iterations));
  }
}

TEST_SUITE_END();

TEST_SUITE_BEGIN("pipeline");

TEST_CASE(
    "distributed in one process: the exchange is the identity, the weights those of a plain run") {
  // The machinery of PipelineConfig::distributed (the mpi suite runs it over several
  // processes) in one instance, where ThreadSanitizer sees its threads.
  const std::uint32_t n = 2, k = 3;
  for (const auto strategy : {ExecutionStrategy::kPipelined, ExecutionStrategy::kSingle}) {
    for (const std::uint32_t replicas : {1u, 2u}) {
      CAPTURE(replicas);
      PipelineConfig cfg;
      cfg.strategy = strategy;
      cfg.gradient_accumulation = k;
      cfg.replicas = replicas;
      DeviceGroup devices(cfg.devices_needed(n), kSmall);
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
  DeviceGroup devices(cfg.devices_needed(n), kSmall);
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
