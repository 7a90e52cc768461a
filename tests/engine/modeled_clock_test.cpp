// runtime/: the modeled IPU clock as runs keep it (RunResult::modeled, EngineResult's per
// device): an Engine's declared compute sets per node kind (a codelet, work items on the
// busiest tile, undeclared steps counted), syncs aligning the devices they join, copies
// between devices on the device link, stream copies without I/O tiles (in series) and with
// them (overlapped with compute), fp16 against fp32 for the same FLOPs, fewer compute tiles
// with I/O tiles; a loop's declared Work per trip; a Pipeline's declared stage costs.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace bspflow::program;
using namespace std::chrono_literals;
using test::filled;
using test::with_link;

namespace {

// A small device with round figures: 64 tiles, 1 GHz, 10 FLOPs per tile-cycle in fp32 and 40
// in fp16, no sync cost on chip, a 1 us host call.
DeviceConfig round_device() {
  DeviceConfig c{64, 16 * 1024};
  c.model.clock_hz = 1e9;
  c.model.fp32_flops_per_tile_cycle = 10;
  c.model.fp16_flops_per_tile_cycle = 40;
  c.model.sync_cycles_on_chip = 0;
  c.model.host_call = 1us;
  c.model.sync_between_chips = 100ns;
  return c;
}

// Nanoseconds of `t`, as a double.
double ns(std::chrono::nanoseconds t) {
  return static_cast<double>(t.count());
}

Execute nothing(const std::string& name) {
  return Execute(name, [](const ComputeContext&) {});
}

}  // namespace

TEST_SUITE_BEGIN("modeled_clock");

TEST_CASE("an Engine's compute sets: declared work in cycles, undeclared ones counted") {
  Device dev(0, round_device());
  Engine engine(dev);
  // 64 tiles x 10 FLOPs = 640 FLOPs per cycle: 64000 FLOPs take 100 cycles = 100 ns.
  const EngineResult r =
      engine.run(Repeat(10, Sequence{nothing("a").declare(Work{64'000}), nothing("b")}));
  CHECK(r.completed());
  CHECK(ns(r.modeled.total) == doctest::Approx(1000 + 10 * 100));
  CHECK(ns(r.modeled.compute) == doctest::Approx(10 * 100));
  CHECK(ns(r.modeled.host_call) == doctest::Approx(1000));
  CHECK(r.modeled.undeclared == 10);  // "b"
  CHECK_FALSE(r.modeled.complete());
  REQUIRE(r.modeled_by_device.size() == 1);
  CHECK(r.modeled_by_device[0].total == r.modeled.total);

  // Work items: the busiest tile's share. 130 items over 64 tiles: 3 on the busiest; 20 FLOPs
  // each at 10 per cycle.
  const EngineResult items = engine.run(
      Execute("items", 130, [](const ComputeContext&, const TileWork&) {}).declare(Work{20}));
  CHECK(ns(items.modeled.total) == doctest::Approx(1000 + 3 * 2));
  CHECK(items.modeled.complete());

  // Work{} declares a step that costs nothing.
  const EngineResult free = engine.run(Repeat(5, nothing("free").declare(Work{})));
  CHECK(ns(free.modeled.total) == doctest::Approx(1000));
  CHECK(free.modeled.complete());
}

TEST_CASE("fp16 takes fewer cycles than fp32 for the same FLOPs (the figures' 4x)") {
  Device dev(0, round_device());
  Engine engine(dev);
  const Work fp32{640'000, 0, WorkPrecision::kFloat32};
  Work fp16 = fp32;
  fp16.precision = WorkPrecision::kFloat16;
  const auto run = [&](const Work& w) {
    return ns(engine.run(Repeat(4, nothing("w").declare(w))).modeled.compute);
  };
  CHECK(run(fp32) == doctest::Approx(4 * 1000));
  CHECK(run(fp16) == doctest::Approx(4 * 250));
}

TEST_CASE("a Sync aligns the clocks of the devices it joins") {
  DeviceGroup devices(2, round_device());
  Engine engine(devices);
  auto group = std::make_shared<SyncGroup>(2);
  // Device 0 computes 1000 ns per trip, device 1 100 ns; they meet at a Sync every trip.
  Program p0 = Repeat(5, Sequence{nothing("slow").declare(Work{640'000}), Sync(group)});
  Program p1 = Repeat(5, Sequence{nothing("fast").declare(Work{64'000}), Sync(group)});
  const EngineResult r = engine.run({p0, p1});
  CHECK(r.completed());
  REQUIRE(r.modeled_by_device.size() == 2);
  const ModeledTime& slow = r.modeled_by_device[0];
  const ModeledTime& fast = r.modeled_by_device[1];
  // Both end together: host call, then 5 x (the slower compute + the sync between chips).
  CHECK(ns(slow.total) == doctest::Approx(1000 + 5 * (1000 + 100)));
  CHECK(ns(fast.total) == doctest::Approx(ns(slow.total)));
  // The fast device spent the difference waiting at the sync.
  CHECK(ns(fast.sync) == doctest::Approx(5 * (900 + 100)));
  CHECK(ns(slow.sync) == doctest::Approx(5 * 100));
}

TEST_CASE("a Copy between devices takes the device link's time; on one device, the exchange's") {
  DeviceGroup devices(2, round_device());
  EngineConfig config;
  config.device_link = LinkModel::taking(2us, 4096);
  Engine engine(devices, config);
  Buffer a = make_buffer(devices[0], "a", DType::kFloat32, 1024);
  Buffer b = make_buffer(devices[1], "b", DType::kFloat32, 1024);
  Buffer c = make_buffer(devices[0], "c", DType::kFloat32, 1024);
  // A Copy pulls into the device that runs it: device 1 from device 0, device 0 locally.
  const EngineResult r = engine.run({Repeat(2, Copy(a, c)), Repeat(3, Copy(a, b))});
  CHECK(r.completed());
  CHECK(ns(r.modeled_by_device[1].exchange) == doctest::Approx(3 * 2000));
  // 4096 bytes over 64 tiles at 4 bytes per tile-cycle: 16 cycles each at 1 GHz.
  CHECK(ns(r.modeled_by_device[0].exchange) == doctest::Approx(2 * 16));
}

TEST_CASE("Copies of many sizes, alternating, each take their own size's modeled time") {
  // More sizes than a device's run keeps worked out (4), some copied again soon after (found
  // kept) and some after others pushed them out, and a copy on the device itself of the same
  // size as the one before it (the exchange's time, not the link's), every trip in this order.
  DeviceGroup devices(2, round_device());
  EngineConfig config;
  config.device_link = LinkModel::taking(2us, 4096);  // 2 us per 4096 bytes
  Engine engine(devices, config);
  std::map<std::size_t, Program> from_device0;  // by elements: a copy from device 0
  for (const std::size_t elements : {1024, 512, 256, 2048, 128, 768}) {
    from_device0.emplace(elements, Copy(make_buffer(devices[0], "src", DType::kFloat32, elements),
                                        make_buffer(devices[1], "dst", DType::kFloat32, elements)));
  }
  Buffer here = make_buffer(devices[1], "here", DType::kFloat32, 1024);
  Buffer there = make_buffer(devices[1], "there", DType::kFloat32, 1024);
  std::vector<Program> steps;
  double per_trip_ns = 0;
  for (const std::size_t elements : {1024, 0, 512, 1024, 256, 2048, 128, 768, 1024, 768, 512}) {
    if (elements == 0) {  // 4096 bytes on device 1: 64 tiles at 4 bytes per tile-cycle, 1 GHz
      steps.emplace_back(Copy(here, there));
      per_trip_ns += 16;
    } else {
      steps.push_back(from_device0.at(elements));
      per_trip_ns += 2000.0 * static_cast<double>(elements) / 1024.0;
    }
  }
  const EngineResult r = engine.run({Sequence{}, Repeat(3, Sequence(std::move(steps)))});
  CHECK(r.completed());
  CHECK(ns(r.modeled_by_device[1].exchange) == doctest::Approx(3 * per_trip_ns));
}

TEST_CASE(
    "a Copy between devices counts in full in modeled time, short or long; a long one "
    "is also waited out in real time") {
  DeviceGroup devices(2, round_device());
  Buffer a = make_buffer(devices[0], "a", DType::kFloat32, 1024);
  Buffer b = make_buffer(devices[1], "b", DType::kFloat32, 1024);
  auto run = [&](std::chrono::nanoseconds per_copy, std::uint64_t copies) {
    EngineConfig config;
    config.device_link = LinkModel::taking(per_copy, 4096);
    Engine engine(devices, config);
    const EngineResult r = engine.run({Sequence{}, Repeat(copies, Copy(a, b))});
    CHECK(r.completed());
    CHECK(ns(r.modeled_by_device[1].exchange) ==
          doctest::Approx(static_cast<double>(copies * per_copy.count())));
    return r;
  };
  // Shorter than the clock reads that would time it: not waited out, still modeled.
  static_assert(10ns < tunables::kShortestRealWait);
  run(10ns, 1000);
  // 4 x 50 us: the device waits each one out, so the run takes at least that long.
  const EngineResult slow = run(50us, 4);
  CHECK(slow.elapsed >= 4 * 50us);
}

TEST_CASE("stream copies: in series without I/O tiles, overlapped with compute with them") {
  DeviceConfig dc = round_device();
  Device dev(0, dc);
  const std::size_t bytes = 1024 * sizeof(float);
  const int n = 8;
  // The link takes 2000 ns per micro-batch; compute 1000 ns (64 tiles: 640000 FLOPs).
  auto run = [&](std::uint32_t io_tiles) {
    Engine engine(dev, with_link(2us, bytes, io_tiles, 2));
    InfeedQueue<Tensor> infeed;
    OutfeedQueue<Tensor> outfeed;
    Buffer x = make_buffer(dev, "x", DType::kFloat32, 1024);
    auto p = infeed.make_producer();
    for (int i = 0; i < n; ++i) p.push(filled(1024, 1.0f));
    const EngineResult r =
        engine.run(Repeat(n, Sequence{StreamCopy(infeed, x), nothing("w").declare(Work{640'000})}));
    CHECK(r.completed());
    CHECK(r.modeled.complete());
    return r;
  };
  const EngineResult serial = run(0);
  CHECK(ns(serial.modeled.total) == doctest::Approx(1000 + n * (2000 + 1000)));
  CHECK(ns(serial.modeled.host_link) == doctest::Approx(n * 2000));
  const EngineResult overlapped = run(32);
  // The link sets the pace (2000 > 1000 + the hand-over): the first copy waited for, then one
  // copy per step, and the last step's compute. Compute: 32 fewer tiles, so 1000 * 64 / 32.
  const double compute = 1000.0 * 64 / 32;
  CHECK(ns(overlapped.modeled.compute) == doctest::Approx(n * compute));
  CHECK(ns(overlapped.modeled.total) < ns(serial.modeled.total));
  CHECK(ns(overlapped.modeled.total) >= 1000 + n * 2000);
  CHECK(ns(overlapped.modeled.total) <= 1000 + n * 2000 + compute + n * 200);
}

TEST_CASE("a loop's declared Work per trip; a loop without one is counted undeclared") {
  DeviceGroup devices(2, round_device());
  const auto body = [](std::uint64_t& s, const Iteration&) { ++s; };
  const Work work{64'000};  // 100 ns
  auto r = loops::repeat(devices, 50, body, std::uint64_t{0}, work);
  CHECK(r.completed());
  CHECK(ns(r.modeled.total) == doctest::Approx(1000 + 50 * 100));
  CHECK(r.modeled.complete());
  auto undeclared = loops::repeat(devices, 50, body, std::uint64_t{0});
  CHECK(undeclared.modeled.undeclared == 2 * 50);
  CHECK(ns(undeclared.modeled.total) == doctest::Approx(1000));
  // With a HostIO and I/O tiles, the body runs on the tiles left for compute.
  HostIO io;
  io.io_tiles = 32;
  io.host_link = LinkModel::taking(1ns, 1 << 30);  // practically free
  auto fewer = loops::repeat(devices, 50, body, std::uint64_t{0}, io, work);
  CHECK(ns(fewer.modeled.compute) == doctest::Approx(50 * 200));
}

namespace {
// A one-value stage that declares its passes' cost.
class CostedStage final : public Stage {
 public:
  CostedStage(std::string name, bool last) : name_(std::move(name)), last_(last) {}
  std::string name() const override { return name_; }
  std::size_t output_elements() const override { return last_ ? 3 : 1; }
  std::size_t gradient_elements() const override { return 4; }
  void forward(const StageContext&, ForwardArgs& a) override {
    for (float& v : a.output) v = 1.0f;
  }
  void backward(const StageContext&, BackwardArgs&) override {}
  StageCost cost(WorkPrecision p) const override {
    // forward 100 ns, backward 200 ns, update 50 ns in fp32 on the round device.
    return {Work{64'000, 0, p}, Work{128'000, 0, p}, Work{32'000, 0, p}};
  }

 private:
  std::string name_;
  bool last_;
};
}  // namespace

TEST_CASE("a Pipeline charges its stages' declared costs; fp16 runs them faster") {
  auto run = [](DType storage) {
    DeviceGroup devices(1, round_device());
    PipelineConfig cfg;
    cfg.strategy = ExecutionStrategy::kSingle;
    cfg.schedule = PipelineSchedule::kSequential;
    cfg.gradient_accumulation = 4;
    cfg.precision.storage = storage;
    cfg.precision.partials = storage;
    Pipeline pipe(devices, cfg, [](std::uint32_t) {
      StageList s;
      s.push_back(std::make_unique<CostedStage>("a", false));
      s.push_back(std::make_unique<CostedStage>("b", true));
      return s;
    });
    InfeedQueue<Batch> in;
    auto p = in.make_producer();
    for (int i = 0; i < 4 * 3; ++i) {
      Batch b;
      b.data = filled(4, 1.0f);
      b.labels = std::vector<std::int32_t>(1, 0);
      p.push(std::move(b));
    }
    const PipelineResult r = pipe.run(in, 3);
    CHECK(r.completed());
    return r.modeled;
  };
  const ModeledTime fp32 = run(DType::kFloat32);
  CHECK(fp32.complete());
  // 3 steps x (4 micro-batches x 2 stages x (100 + 200) ns + 2 updates x 50 ns), plus the
  // reduction's and scaling's memory traffic (small) and the host call.
  const double passes = 3 * (4 * 2 * 300 + 2 * 50);
  CHECK(ns(fp32.compute) >= passes);
  CHECK(ns(fp32.compute) <= passes * 1.05);
  const ModeledTime fp16 = run(DType::kFloat16);
  CHECK(ns(fp16.compute) < ns(fp32.compute) * 0.5);
}

TEST_CASE("a Stream's declared stage costs: each device's clock, from each request's arrival") {
  DeviceGroup devices(2, round_device());
  // Stage a: 100 ns per request on device 0; stage b: undeclared, on device 1.
  auto stream = StreamBuilder<int>(devices)
                    .stage("a", [](int v) { return v + 1; })
                    .cost(Work{64'000})
                    .stage("b", [](int v) { return v * 2; })
                    .build();
  stream.start();
  auto client = stream.client();
  for (int i = 0; i < 20; ++i) REQUIRE(client.push(i));
  for (int i = 0; i < 20; ++i) {
    auto r = client.pop();
    REQUIRE(r.has_value());
    CHECK(*r->value == (i + 1) * 2);
  }
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(ns(r.modeled.compute) == doctest::Approx(20 * 100));
  CHECK(r.modeled.undeclared == 20);
  // The requests arrive in real time: the modeled devices wait for them (idle), so the
  // modeled time covers at least the declared work.
  CHECK(ns(r.modeled.total) >= 1000 + 20 * 100);
  CHECK(r.modeled.total == r.modeled.host_call + r.modeled.compute + r.modeled.idle);

  // A batch stage: per call + per item of the padded batch.
  DeviceGroup one(1, round_device());
  BatchConfig batching;
  batching.max_batch = 4;
  batching.allowed_sizes = {4};
  auto batched =
      StreamBuilder<int>(one)
          .batch_stage(
              "m", [](std::span<int> xs) { return std::vector<int>(xs.begin(), xs.end()); },
              batching)
          .cost(Work{6'400}, Work{64'000})  // 10 ns per item, 100 ns per call
          .build();
  batched.start();
  auto c = batched.client();
  REQUIRE(c.push(1));
  REQUIRE(c.pop().has_value());
  batched.close();
  const StreamResult b = batched.wait();
  CHECK(ns(b.modeled.compute) == doctest::Approx(100 + 4 * 10));
  CHECK(b.modeled.complete());
  CHECK_THROWS_AS((void)StreamBuilder<int>(one).cost(Work{1}), Error);
}

TEST_SUITE_END();
