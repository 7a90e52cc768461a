// mpi/: distributed training under mpirun (PipelineConfig::distributed): the two-level
// reduction reaches the weights one process with every replica reaches, a stop in one
// instance (failure, end of data, cancel) ends every instance at the same step with a
// status naming it, and what must match across instances is checked. Every process runs
// every case: the Pipeline's constructor and run() are collectives.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline/dense_stage.hpp"

using namespace bspflow;
using namespace std::chrono_literals;

namespace {

const DeviceConfig kSmall{64, 64 * 1024};
constexpr std::size_t kBatch = test::kDenseBatch, kIn = 5, kClasses = 3;
using test::Dense;

// Two stages: 5 -> 6 (tanh) -> 3 classes. Instances seeded differently start the same once
// the constructor has broadcast instance 0's weights.
StageList make_model(float seed) {
  StageList list;
  list.push_back(std::make_unique<Dense>(kIn, 6, false, seed));
  list.push_back(std::make_unique<Dense>(6, kClasses, true, seed + 1));
  return list;
}

// Micro-batch m of global replica g (deterministic).
Batch make_batch(std::uint32_t g, std::uint64_t m) {
  Batch b;
  b.data = Tensor(DType::kFloat32, {kBatch, kIn});
  auto x = b.data.as<float>();
  for (std::size_t j = 0; j < x.size(); ++j)
    x[j] = std::cos(0.37f * static_cast<float>(m * 31 + j) + 1.3f * static_cast<float>(g));
  for (std::size_t i = 0; i < kBatch; ++i)
    b.labels.push_back(static_cast<std::int32_t>((m + i + g) % kClasses));
  b.valid = kBatch;
  return b;
}

// `count` micro-batches for each local replica r (global replica offset + r), then closes
// the infeed when `close`.
void feed(InfeedQueue<Batch>& infeed, std::uint32_t local, std::uint32_t offset,
          std::uint64_t count, bool close = true) {
  auto p = infeed.make_producer();
  for (std::uint64_t m = 0; m < count; ++m) {
    for (std::uint32_t r = 0; r < local; ++r) REQUIRE(p.push_to(r, make_batch(offset + r, m)));
  }
  if (close) infeed.close();
}

InfeedConfig lanes(std::uint32_t replicas) {
  InfeedConfig c;
  c.replicas = replicas;
  c.capacity = 256;
  return c;
}

std::vector<std::vector<float>> weights_of(Pipeline& p, std::uint32_t replica) {
  std::vector<std::vector<float>> w;
  for (std::uint32_t s = 0; s < p.stages(); ++s) {
    const std::span<float> ws = p.stage(replica, s).weights();
    w.emplace_back(ws.begin(), ws.end());
  }
  return w;
}

// Every instance holds instance 0's weights (compared after a broadcast).
bool same_as_instance_zero(Pipeline& p) {
  Instance& me = Instance::current();
  bool same = true;
  for (auto& w : weights_of(p, 0)) {
    std::vector<float> zero = w;
    me.broadcast(zero, 0);
    same = same && zero == w;
  }
  return me.all_agree(same);
}

PipelineConfig training(std::uint32_t local_replicas, ExecutionStrategy strategy) {
  PipelineConfig cfg;
  cfg.strategy = strategy;
  cfg.gradient_accumulation = 3;  // Grouped over 2 stages needs 3
  cfg.replicas = local_replicas;
  cfg.distributed = true;
  cfg.weight_check_interval = 1;
  // A bucket per device slot: the most calls per step, each made as soon as its slot posts
  // (the default's 25 MiB would put these small models in one bucket).
  cfg.exchange_bucket_bytes = 0;
  return cfg;
}

}  // namespace

TEST_SUITE_BEGIN("pipeline_mpi");

TEST_CASE(
    "n processes x R replicas reach the weights of 1 process x nR replicas on the same data") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  constexpr std::uint64_t kSteps = 4;
  struct Case {
    std::uint32_t local;
    ExecutionStrategy strategy;
    std::size_t bucket_bytes;
  };
  for (const Case& c :
       {Case{1, ExecutionStrategy::kPipelined, 0},
        Case{1, ExecutionStrategy::kPipelined, PipelineConfig{}.exchange_bucket_bytes},
        Case{2, ExecutionStrategy::kSingle, 0}}) {
    const std::uint32_t local = c.local;
    CAPTURE(local);
    CAPTURE(c.bucket_bytes);
    const InstanceLayout layout = me.layout(local * n);
    PipelineConfig cfg = training(local, c.strategy);
    cfg.exchange_bucket_bytes = c.bucket_bytes;
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    // Seeded by instance: the constructor must broadcast instance 0's weights.
    Pipeline pipe(devices, cfg,
                  [&](std::uint32_t) { return make_model(static_cast<float>(me.index())); });
    CHECK(same_as_instance_zero(pipe));
    InfeedQueue<Batch> infeed(lanes(local));
    feed(infeed, local, layout.replica_offset, kSteps * cfg.gradient_accumulation);
    const PipelineResult r = pipe.run(infeed, kSteps);
    REQUIRE(r.completed());
    CHECK(r.iterations == kSteps);
    CHECK(r.micro_batches == kSteps * cfg.gradient_accumulation * local);

    // The same data in one process: every global replica here, not distributed.
    PipelineConfig one = cfg;
    one.distributed = false;
    one.replicas = local * n;
    DeviceGroup all_devices(one.devices_needed(2), kSmall);
    Pipeline reference(all_devices, one, [](std::uint32_t) { return make_model(0.0f); });
    InfeedQueue<Batch> all_in(lanes(local * n));
    feed(all_in, local * n, 0, kSteps * cfg.gradient_accumulation);
    REQUIRE(reference.run(all_in, kSteps).completed());

    const auto want = weights_of(reference, 0);
    for (std::uint32_t r2 = 0; r2 < local; ++r2) {
      const auto got = weights_of(pipe, r2);
      for (std::size_t s = 0; s < got.size(); ++s) {
        REQUIRE(got[s].size() == want[s].size());
        double worst = 0;
        for (std::size_t j = 0; j < got[s].size(); ++j)
          worst = std::max(worst, std::fabs(double(got[s][j]) - double(want[s][j])));
        // Two summands add the same way in any order: exact. More may round differently.
        if (local * n <= 2) {
          CHECK(got[s] == want[s]);
        } else {
          CHECK(worst <= 1e-6);
        }
      }
    }
    CHECK(same_as_instance_zero(pipe));
  }
}

TEST_CASE("a stage failure in one instance ends every instance at the same step, naming it") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  if (n < 2) return;
  const std::uint32_t culprit = n - 1;
  PipelineConfig cfg = training(1, ExecutionStrategy::kPipelined);
  DeviceGroup devices(cfg.devices_needed(2), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(0.0f); });
  if (me.index() == culprit) static_cast<Dense&>(pipe.stage(0, 1)).fail_at_step = 2;
  InfeedQueue<Batch> infeed(lanes(1));
  feed(infeed, 1, me.index(), 5 * cfg.gradient_accumulation, /*close=*/false);
  const auto t0 = std::chrono::steady_clock::now();
  if (me.index() == culprit) {
    try {
      (void)pipe.run(infeed, 5);
      FAIL("the failing instance's run returned");
    } catch (const StageError& e) {
      const std::string what = e.what();
      CHECK(what.find("instance " + std::to_string(culprit) + " of " + std::to_string(n)) == 0);
      CHECK(what.find("injected failure") != std::string::npos);
      CHECK(what.find("2 step(s) applied in every instance") != std::string::npos);
      CHECK(e.step() == 2);
    }
  } else {
    try {
      (void)pipe.run(infeed, 5);
      FAIL("a healthy instance's run returned");
    } catch (const InstanceError& e) {
      const std::string what = e.what();
      CHECK(e.instance() == culprit);
      CHECK(e.replica() == culprit);  // one replica per instance: global replica = index
      CHECK(e.step() == 2);
      CHECK(what.find("instance " + std::to_string(culprit) + " of " + std::to_string(n) +
                      " failed at step 2") == 0);
      CHECK(what.find("injected failure") != std::string::npos);
    }
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
  CHECK(same_as_instance_zero(pipe));  // step 2 applied nowhere
  // The pipeline is usable again: the rest of the data, one step per instance.
  static_cast<Dense&>(pipe.stage(0, 1)).fail_at_step.reset();
  InfeedQueue<Batch> more(lanes(1));
  feed(more, 1, me.index(), cfg.gradient_accumulation);
  const PipelineResult again = pipe.run(more, 1);
  CHECK(again.completed());
  CHECK(same_as_instance_zero(pipe));
}

TEST_CASE("end of data in one instance ends every instance with kEndOfData at the same step") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  PipelineConfig cfg = training(1, ExecutionStrategy::kPipelined);
  DeviceGroup devices(cfg.devices_needed(2), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(0.0f); });
  InfeedQueue<Batch> infeed(lanes(1));
  // Instance 0 has 2 steps and one micro-batch; the others have everything.
  const std::uint64_t mine =
      me.index() == 0 ? 2 * cfg.gradient_accumulation + 1 : 6 * cfg.gradient_accumulation;
  feed(infeed, 1, me.index(), mine);
  const PipelineResult r = pipe.run(infeed, 6);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.iterations == 2);
  if (n > 1) {
    CHECK(r.message.find(me.index() == 0 ? "the infeed of this instance (0 of "
                                         : "the infeed of instance 0 of") == 0);
    CHECK(r.message.find("2 step(s) applied in every instance") != std::string::npos);
  }
  CHECK(same_as_instance_zero(pipe));
}

TEST_CASE("a cancel in one instance ends every instance with kCancelled at the same step") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  PipelineConfig cfg = training(1, ExecutionStrategy::kPipelined);
  DeviceGroup devices(cfg.devices_needed(2), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(0.0f); });
  InfeedQueue<Batch> infeed(lanes(1));
  // Instance 0 gets one step's data and waits for more (the lane stays open) until it
  // cancels; the others have everything.
  const std::uint64_t mine =
      me.index() == 0 ? cfg.gradient_accumulation : 4 * cfg.gradient_accumulation;
  feed(infeed, 1, me.index(), mine, /*close=*/me.index() != 0);
  std::jthread canceller;
  if (me.index() == 0) {
    // After its one step is applied (the run then waits for data that will not come).
    canceller = std::jthread([&] {
      while (static_cast<Dense&>(pipe.stage(0, 0)).updates.load() < 1)
        std::this_thread::sleep_for(5ms);
      std::this_thread::sleep_for(50ms);
      pipe.cancel();
    });
  }
  const PipelineResult r = pipe.run(infeed, 4);
  CHECK(r.status == RunStatus::kCancelled);
  CHECK(r.iterations == 1);
  if (n > 1) {
    CHECK(r.message.find(me.index() == 0 ? "this instance (0 of " : "instance 0 of") == 0);
    CHECK(r.message.find("1 step(s) applied in every instance") != std::string::npos);
  }
  CHECK(same_as_instance_zero(pipe));
}

TEST_CASE(
    "cancels at random times: every instance stops at the same step, every replica holds the same "
    "weights") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  // Two local replicas on one device each, then one replica over two devices whose buckets
  // are called as each device posts (a cancel may land between them).
  for (const bool pipelined : {false, true}) {
    CAPTURE(pipelined);
    const std::uint32_t local = pipelined ? 1 : 2;
    PipelineConfig cfg =
        training(local, pipelined ? ExecutionStrategy::kPipelined : ExecutionStrategy::kSingle);
    cfg.gradient_accumulation = pipelined ? 3 : 2;
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(0.0f); });
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> delay_us(0, 4000);
    int cancelled = 0;
    for (int trial = 0; trial < 20; ++trial) {
      CAPTURE(trial);
      const int wait = delay_us(rng);  // the same sequence everywhere; only instance 0 uses it
      InfeedQueue<Batch> infeed(lanes(local));
      feed(infeed, local, local * me.index(), 40 * cfg.gradient_accumulation);
      std::jthread canceller;
      if (me.index() == 0) {
        canceller = std::jthread([&] {
          std::this_thread::sleep_for(std::chrono::microseconds(wait));
          pipe.cancel();
        });
      }
      const PipelineResult r = pipe.run(infeed, 40);
      canceller = {};
      cancelled += r.status == RunStatus::kCancelled;
      CHECK((r.status == RunStatus::kCancelled || r.completed()));
      // The same status and step count everywhere.
      std::vector<double> mine{static_cast<double>(r.iterations), r.completed() ? 1.0 : 0.0};
      std::vector<double> all = mine;
      me.allreduce_sum(all);
      CHECK(all[0] == n * mine[0]);
      CHECK(all[1] == n * mine[1]);
      if (local == 2) {
        CHECK(weights_of(pipe, 0) ==
              weights_of(pipe, 1));  // both local replicas applied the same steps
      }
      CHECK(same_as_instance_zero(pipe));
    }
    MESSAGE("cancelled in " << cancelled << " of 20 trials");
  }
}

TEST_CASE("what must match across instances: the pipeline, the step count, the weights") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  if (n < 2) return;
  PipelineConfig cfg = training(1, ExecutionStrategy::kPipelined);
  {
    // A different model in the last instance: refused at construction, in every instance.
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    auto differ = [&](std::uint32_t) {
      StageList list;
      list.push_back(std::make_unique<Dense>(kIn, me.index() + 1 == n ? 7 : 6, false, 0.0f));
      list.push_back(std::make_unique<Dense>(me.index() + 1 == n ? 7 : 6, kClasses, true, 1.0f));
      return list;
    };
    try {
      Pipeline pipe(devices, cfg, differ);
      FAIL("a different pipeline was accepted");
    } catch (const Error& e) {
      const std::string what = e.what();
      CHECK(what.find("every instance must build the same stages") != std::string::npos);
      if (me.index() + 1 == n)
        CHECK(what.find("gradient_elements() of stage 0 is 42 here, 36 in instance 0") !=
              std::string::npos);
    }
  }
  {
    // A different bucket size in the last instance: the calls would not match; refused.
    PipelineConfig other = cfg;
    if (me.index() + 1 == n) other.exchange_bucket_bytes = 1 << 20;
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    try {
      Pipeline pipe(devices, other, [](std::uint32_t) { return make_model(0.0f); });
      FAIL("a different bucket size was accepted");
    } catch (const Error& e) {
      if (me.index() + 1 == n)
        CHECK(std::string(e.what()).find(
                  "exchange_bucket_bytes is 1048576 here, 0 in instance 0") != std::string::npos);
    }
  }
  {
    // The last instance's factory throws: it throws that, the others say it failed.
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    try {
      Pipeline pipe(devices, cfg, [&](std::uint32_t) {
        if (me.index() + 1 == n) throw std::runtime_error("no stages here");
        return make_model(0.0f);
      });
      FAIL("a pipeline was built while another instance failed");
    } catch (const std::exception& e) {
      const std::string what = e.what();
      CHECK(what.find(me.index() + 1 == n
                          ? "no stages here"
                          : "another instance failed to build its pipeline") != std::string::npos);
    }
  }
  DeviceGroup devices(cfg.devices_needed(2), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return make_model(0.0f); });
  {
    // 0 steps in one instance, 1 in the others: refused everywhere, nothing applied.
    InfeedQueue<Batch> infeed(lanes(1));
    feed(infeed, 1, me.index(), cfg.gradient_accumulation);
    CHECK_THROWS_WITH_AS((void)pipe.run(infeed, me.index() == 0 ? 0 : 1),
                         doctest::Contains("different step counts"), InstanceError);
    CHECK(same_as_instance_zero(pipe));
  }
  {
    // Different step counts: every instance refuses at step 0 (nothing applied).
    InfeedQueue<Batch> infeed(lanes(1));
    feed(infeed, 1, me.index(), 4 * cfg.gradient_accumulation);
    CHECK_THROWS_WITH_AS((void)pipe.run(infeed, me.index() == 0 ? 3 : 4),
                         doctest::Contains("different step counts"), InstanceError);
    CHECK(same_as_instance_zero(pipe));
  }
  {
    // The last instance's update drifts at step 1: the checksum at step 2 says so everywhere.
    if (me.index() + 1 == n) static_cast<Dense&>(pipe.stage(0, 0)).drift_at_step = 1;
    InfeedQueue<Batch> infeed(lanes(1));
    feed(infeed, 1, me.index(), 4 * cfg.gradient_accumulation);
    try {
      (void)pipe.run(infeed, 4);
      FAIL("diverged weights went unnoticed");
    } catch (const InstanceError& e) {
      const std::string what = e.what();
      CHECK(what.find("the weights differ across instances at step 2") != std::string::npos);
      CHECK(what.find("2 step(s) applied in every instance") != std::string::npos);
    }
  }
}

TEST_SUITE_END();
