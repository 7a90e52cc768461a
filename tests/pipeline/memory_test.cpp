// A Pipeline's device memory: the report's sums, the stash by schedule, what recomputation
// and half precision save, out of memory, the arena holding the plan, and half-precision
// values with loss scaling.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"

using namespace bspflow;

namespace {

const DeviceConfig kRoomy{64, 64 * 1024};  // 4 MiB

// A stage with declared sizes. forward writes `value` to every output and saves `saved`
// values; backward writes `grad` to every parameter gradient and passes grad_output's
// first value back (1 from the last stage).
struct Probe final : Stage {
  std::size_t out = 8, params = 16, state = 32, saved = 24, working = 10;
  bool declare = true;
  bool reads_input = true;  // StageMemory::backward_reads_input
  float value = 1.0f, grad = 0.5f;
  std::vector<float> seen_input, seen_gradients;
  std::vector<std::vector<float>> backward_inputs;  // BackwardArgs::input of each backward
  std::vector<float> state_values;
  std::size_t save_extra = 0;

  std::string name() const override { return "probe"; }
  std::size_t output_elements() const override { return out; }
  std::size_t gradient_elements() const override { return params; }
  StageMemory memory() const override {
    if (!declare) return {};
    StageMemory m;
    m.parameters = params;
    m.optimizer_state = state;
    m.saved = saved;
    m.working = working;
    m.backward_reads_input = reads_input;
    return m;
  }
  std::span<float> optimizer_state() override {
    state_values.resize(state);
    return state_values;
  }
  void forward(const StageContext&, ForwardArgs& a) override {
    seen_input.assign(a.input.begin(), a.input.end());
    for (float& v : a.output) v = value;
    a.saved.assign(saved + save_extra, 1.0f);
  }
  void backward(const StageContext&, BackwardArgs& a) override {
    backward_inputs.emplace_back(a.input.begin(), a.input.end());
    const float g = a.grad_output.empty() ? 1.0f : a.grad_output[0];
    for (float& v : a.grad_input) v = g;
    for (float& v : a.gradients) v = grad * g;
  }
  void update(const StageContext&, std::span<const float> g) override {
    seen_gradients.assign(g.begin(), g.end());
  }
};

StageFactory probes(std::uint32_t n, std::function<void(Probe&)> tweak = {}) {
  return [n, tweak](std::uint32_t) {
    StageList list;
    for (std::uint32_t s = 0; s < n; ++s) {
      auto p = std::make_unique<Probe>();
      if (tweak) tweak(*p);
      list.push_back(std::move(p));
    }
    return list;
  };
}

std::size_t sum_of(const DeviceMemory& d, MemoryCategory c) {
  std::size_t sum = 0;
  for (const TensorMemory& t : d.tensors) sum += t.category == c ? t.bytes : 0;
  return sum;
}

const TensorMemory* find(const DeviceMemory& d, const std::string& part) {
  for (const TensorMemory& t : d.tensors) {
    if (t.name.find(part) != std::string::npos) return &t;
  }
  return nullptr;
}

// `micro_batches` micro-batches of 4 samples (data: a copy of `data`; labels 0), then closed.
void feed(InfeedQueue<Batch>& infeed, std::uint64_t micro_batches,
          const Tensor& data = test::filled(4, 1.0f)) {
  auto producer = infeed.make_producer();
  for (std::uint64_t i = 0; i < micro_batches; ++i) {
    Batch b;
    b.data = data;
    b.labels.assign(4, 0);
    b.indices.assign(4, i);
    b.valid = 4;
    producer.push(std::move(b));
  }
  infeed.close();
}

}  // namespace

TEST_SUITE_BEGIN("memory");

TEST_CASE(
    "memory report: categories sum their tensors exactly, and the peak is always live plus the "
    "larger phase") {
  DeviceGroup devices(3, kRoomy);
  PipelineConfig cfg;
  cfg.gradient_accumulation = 5;
  Pipeline pipe(devices, cfg, probes(3));
  const MemoryReport& rep = pipe.memory();
  REQUIRE(rep.devices.size() == 3);
  CHECK(rep.fits());
  for (const DeviceMemory& d : rep.devices) {
    std::size_t total = 0, always = 0, compute = 0, pass = 0, update = 0;
    for (const TensorMemory& t : d.tensors) {
      total += t.bytes;
      (t.liveness == Liveness::kAlways    ? always
       : t.liveness == Liveness::kCompute ? compute
       : t.liveness == Liveness::kPass    ? pass
                                          : update) += t.bytes;
    }
    std::size_t by_category = 0;
    for (std::size_t c = 0; c < kMemoryCategories; ++c) {
      const auto cat = static_cast<MemoryCategory>(c);
      CHECK(d.category(cat) == sum_of(d, cat));
      by_category += d.category(cat);
    }
    CHECK(by_category == total);
    CHECK(d.always_live() == always);
    CHECK(d.phase(Liveness::kCompute) == compute);
    CHECK(d.phase(Liveness::kPass) == pass);
    CHECK(d.phase(Liveness::kUpdate) == update);
    CHECK(d.compute_peak() == compute + pass);  // one stage per device
    CHECK(d.peak() == always + std::max(compute + pass, update));
    for (std::size_t i = 1; i < d.tensors.size(); ++i)
      CHECK(d.tensors[i - 1].bytes >= d.tensors[i].bytes);
  }
  // Stage 1 (middle), fp32: exact bytes of each declared tensor.
  const DeviceMemory& mid = rep.devices[1];
  CHECK(mid.category(MemoryCategory::kParameters) == 16 * 4);
  CHECK(mid.category(MemoryCategory::kOptimizerState) == 32 * 4);
  CHECK(mid.category(MemoryCategory::kGradients) ==
        3 * 16 * 4);  // accumulator, micro-batch, reduced
  CHECK(mid.category(MemoryCategory::kWorking) == 10 * 4);
  // bsp exchange: activations out x2 (8), in (8); gradients out x2 (8), in (8).
  CHECK(mid.category(MemoryCategory::kExchange) == (2 * 8 + 8 + 2 * 8 + 8) * 4);
  // The text names every device and category it holds.
  const std::string text = rep.to_string();
  CHECK(text.find("device 2") != std::string::npos);
  CHECK(text.find("activation stash") != std::string::npos);
}

TEST_CASE(
    "memory report: the activation stash follows the schedule's FIFO depth, and a run reaches it") {
  for (PipelineSchedule schedule : {PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved}) {
    CAPTURE(to_string(schedule));
    DeviceGroup devices(3, kRoomy);
    PipelineConfig cfg;
    cfg.schedule = schedule;
    cfg.gradient_accumulation = 6;
    Pipeline pipe(devices, cfg, probes(3));
    const PipelineResult r = [&] {
      InfeedQueue<Batch> infeed(InfeedConfig{1, 6, 1});
      feed(infeed, 6);
      return pipe.run(infeed, 1);
    }();
    REQUIRE(r.completed());
    for (std::uint32_t s = 0; s < 3; ++s) {
      CAPTURE(s);
      const std::size_t slots = pipe.plan().fifo_depth(s) + 1;
      const std::size_t in = s == 0 ? 0 : 8;
      CHECK(pipe.memory().devices[s].category(MemoryCategory::kActivationStash) ==
            slots * (in + 24) * 4);
      CHECK(r.fifo_depth[s] == pipe.plan().fifo_depth(s));
    }
  }
}

TEST_CASE(
    "a stage whose backward reads no input: the stash keeps no input, backward gets none, and "
    "recomputation still keeps them") {
  for (const bool recompute : {false, true}) {
    CAPTURE(recompute);
    DeviceGroup devices(3, kRoomy);
    PipelineConfig cfg;
    cfg.gradient_accumulation = 6;
    cfg.recompute = recompute;
    Pipeline pipe(devices, cfg, probes(3, [](Probe& p) { p.reads_input = false; }));
    // Stage s > 0 gets the previous stage's 8 outputs (value 1): without recomputation the
    // stash holds the 24 saved values only; with it, the inputs only (as for any stage).
    for (std::uint32_t s = 0; s < 3; ++s) {
      CAPTURE(s);
      const std::size_t slots = pipe.plan().fifo_depth(s) + 1;
      const std::size_t in = s == 0 ? 0 : 8;
      const DeviceMemory& d = pipe.memory().devices[s];
      CHECK(d.category(MemoryCategory::kActivationStash) ==
            (recompute ? slots * in * 4 + (24 + 8) * 4 : slots * 24 * 4));
      if (!recompute && s > 0) {
        const TensorMemory* stash = find(d, "activation stash");
        REQUIRE(stash != nullptr);
        CHECK(stash->name.find("saved only") != std::string::npos);
      }
    }
    InfeedQueue<Batch> infeed(InfeedConfig{1, 6, 1});
    feed(infeed, 6);
    const PipelineResult r = pipe.run(infeed, 1);
    REQUIRE(r.completed());
    for (std::uint32_t s = 0; s < 3; ++s) {
      CAPTURE(s);
      const auto& stage = static_cast<const Probe&>(pipe.stage(0, s));
      REQUIRE(stage.backward_inputs.size() == 6);
      for (const std::vector<float>& in : stage.backward_inputs) {
        if (s == 0 || !recompute) {
          CHECK(in.empty());
        } else {
          CHECK(in == std::vector<float>(8, 1.0f));
        }
      }
    }
  }
  // The default (backward reads its input): every stage after the first gets what its
  // forward pass saw.
  DeviceGroup devices(2, kRoomy);
  PipelineConfig cfg;
  cfg.gradient_accumulation = 4;
  Pipeline pipe(devices, cfg, probes(2));
  InfeedQueue<Batch> infeed(InfeedConfig{1, 4, 1});
  feed(infeed, 4);
  REQUIRE(pipe.run(infeed, 1).completed());
  const auto& second = static_cast<const Probe&>(pipe.stage(0, 1));
  REQUIRE(second.backward_inputs.size() == 4);
  for (const std::vector<float>& in : second.backward_inputs)
    CHECK(in == std::vector<float>(8, 1.0f));
}

TEST_CASE("memory report: recomputation and half precision lower the peak by what they save") {
  auto report_of = [](PipelineConfig cfg) {
    DeviceGroup devices(2, kRoomy);
    cfg.gradient_accumulation = 4;
    Pipeline pipe(devices, cfg, probes(2));
    return pipe.memory();
  };
  PipelineConfig base;
  const MemoryReport fp32 = report_of(base);
  PipelineConfig rc = base;
  rc.recompute = true;
  const MemoryReport recomputed = report_of(rc);
  // Stage 0 (Grouped, 2 stages): 3 stash entries of 24 saved values become the inputs
  // only (none for stage 0) plus one recomputed set (24 saved + 8 outputs).
  CHECK(fp32.devices[0].category(MemoryCategory::kActivationStash) == 3 * 24 * 4);
  CHECK(recomputed.devices[0].category(MemoryCategory::kActivationStash) == (24 + 8) * 4);
  CHECK(fp32.devices[0].peak() - recomputed.devices[0].peak() == (3 * 24 - (24 + 8)) * 4);

  PipelineConfig hp = base;
  hp.precision = Precision::half();
  const MemoryReport half = report_of(hp);
  for (std::size_t d = 0; d < 2; ++d) {
    const DeviceMemory& a = fp32.devices[d];
    const DeviceMemory& b = half.devices[d];
    CHECK(b.category(MemoryCategory::kParameters) * 2 == a.category(MemoryCategory::kParameters));
    CHECK(b.category(MemoryCategory::kActivationStash) * 2 ==
          a.category(MemoryCategory::kActivationStash));
    CHECK(b.category(MemoryCategory::kExchange) * 2 == a.category(MemoryCategory::kExchange));
    CHECK(b.category(MemoryCategory::kOptimizerState) ==
          a.category(MemoryCategory::kOptimizerState));  // fp32
    // Gradients: the micro-batch gradients halve; accumulator and reduced stay fp32 partials.
    CHECK(b.category(MemoryCategory::kGradients) ==
          a.category(MemoryCategory::kGradients) - 16 * 2);
  }
  // Offloaded optimiser state leaves the always-live memory for the update phase.
  PipelineConfig off = base;
  off.offload_optimizer = true;
  const MemoryReport offloaded = report_of(off);
  CHECK(offloaded.devices[0].always_live() == fp32.devices[0].always_live() - 32 * 4);
  const TensorMemory* t = find(offloaded.devices[0], "optimiser state");
  REQUIRE(t != nullptr);
  CHECK(t->liveness == Liveness::kUpdate);
}

TEST_CASE("memory report: stages sharing a device need their largest pass memory, not the sum") {
  DeviceGroup devices(1, kRoomy);
  PipelineConfig cfg;
  cfg.strategy = ExecutionStrategy::kSingle;
  cfg.gradient_accumulation = 2;
  Pipeline pipe(devices, cfg, probes(3, [](Probe& p) { p.working = 100; }));
  const DeviceMemory& d = pipe.memory().devices.at(0);
  // Each stage's passes: 100 working values and 16 micro-batch gradients, fp32.
  CHECK(d.phase(Liveness::kPass) == 3 * (100 + 16) * 4);
  CHECK(d.compute_peak() == d.phase(Liveness::kCompute) + (100 + 16) * 4);
  // The stash is live across passes: every stage's entry counts.
  CHECK(d.category(MemoryCategory::kActivationStash) ==
        (24 + (8 + 24) + (8 + 24)) * 4);  // one entry each
}

TEST_CASE("memory: the arena holds the plan while the pipeline lives, and gives it back") {
  DeviceGroup devices(2, kRoomy);
  const std::size_t before = devices[0].arena().used();
  {
    PipelineConfig cfg;
    cfg.gradient_accumulation = 3;
    Pipeline pipe(devices, cfg, probes(2));
    for (std::uint32_t d = 0; d < 2; ++d) {
      CHECK(devices[d].arena().used() >= pipe.memory().devices[d].peak());
      CHECK(devices[d].arena().used() <=
            pipe.memory().devices[d].peak() + 64 * 32);  // alignment only
    }
  }
  CHECK(devices[0].arena().used() == before);
}

TEST_CASE("memory: out of memory names the device, its largest holders and what would help") {
  DeviceGroup devices(2, DeviceConfig{1, 4096});  // 4 KiB per device
  PipelineConfig cfg;
  cfg.gradient_accumulation = 3;
  auto big = [](Probe& p) {
    p.params = 100;
    p.saved = 400;  // 3 stash entries of 1.6 KB on stage 0
  };
  try {
    Pipeline pipe(devices, cfg, probes(2, big));
    FAIL("a 4 KiB device held the stages");
  } catch (const PipelineOutOfMemoryError& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("device 0 needs") != std::string::npos);
    CHECK(what.find("activation stash") != std::string::npos);
    CHECK(what.find("half precision") != std::string::npos);
    CHECK(what.find("recomputation") != std::string::npos);
    CHECK_FALSE(e.report().fits());
    CHECK_FALSE(e.report().devices[0].fits());
    CHECK(e.report().devices[0].capacity == 4096);
    CHECK(e.requested() == e.report().devices[0].peak());
    CHECK(e.report().suggestions.size() >= 3);
  }
  // Nothing stays held after the failure.
  CHECK(devices[0].arena().used() == 0);
  CHECK(devices[1].arena().used() == 0);
}

TEST_CASE("memory: a stage that saves more than it declared is an error naming it") {
  DeviceGroup devices(2, kRoomy);
  PipelineConfig cfg;
  cfg.gradient_accumulation = 3;
  Pipeline pipe(devices, cfg, probes(2, [](Probe& p) { p.save_extra = 1; }));
  InfeedQueue<Batch> infeed(InfeedConfig{1, 3, 1});
  feed(infeed, 3);
  try {
    pipe.run(infeed, 1);
    FAIL("no error");
  } catch (const StageError& e) {
    CHECK(std::string(e.what()).find("declared 24") != std::string::npos);
    CHECK(std::string(e.what()).find("saved 25") != std::string::npos);
  }
}

TEST_CASE("precision: bad settings are refused with the field and what is allowed") {
  DeviceGroup devices(1, kRoomy);
  PipelineConfig cfg;
  cfg.strategy = ExecutionStrategy::kSingle;
  cfg.precision.loss_scaling = 0.0f;
  CHECK_THROWS_WITH_AS(Pipeline(devices, cfg, probes(1)),
                       doctest::Contains("precision.loss_scaling"), Error);
  cfg.precision = Precision{DType::kUint8, DType::kFloat32, 1.0f};
  CHECK_THROWS_WITH_AS(Pipeline(devices, cfg, probes(1)), doctest::Contains("must be fp32 or fp16"),
                       Error);
  cfg.precision = Precision{DType::kFloat32, DType::kInt32, 1.0f};
  CHECK_THROWS_WITH_AS(Pipeline(devices, cfg, probes(1)), doctest::Contains("precision.partials"),
                       Error);
}

TEST_CASE(
    "precision: fp16 storage rounds what crosses between stages; loss scaling keeps small "
    "gradients") {
  const float fine = 1.0f + 1.0f / 4096;  // not representable in fp16: rounds to 1
  const float tiny = 1e-8f;               // below fp16's smallest subnormal (6e-8): flushes to 0
  struct Outcome {
    float input_seen, gradient_seen;
  };
  auto run_with = [&](Precision precision, SyncMode sync) {
    DeviceGroup devices(2, kRoomy);
    PipelineConfig cfg;
    cfg.sync = sync;
    cfg.gradient_accumulation = 3;
    cfg.precision = precision;
    Pipeline pipe(devices, cfg, probes(2, [&](Probe& p) {
                    p.value = fine;
                    p.grad = tiny;
                  }));
    InfeedQueue<Batch> infeed(InfeedConfig{1, 3, 1});
    feed(infeed, 3);
    REQUIRE(pipe.run(infeed, 1).completed());
    auto& s1 = static_cast<Probe&>(pipe.stage(0, 1));
    auto& s0 = static_cast<Probe&>(pipe.stage(0, 0));
    REQUIRE(!s1.seen_input.empty());
    REQUIRE(!s0.seen_gradients.empty());
    return Outcome{s1.seen_input[0], s0.seen_gradients[0]};
  };
  for (SyncMode sync : {SyncMode::kBsp, SyncMode::kDataflow}) {
    CAPTURE(to_string(sync));
    const Outcome fp32 = run_with(Precision{}, sync);
    CHECK(fp32.input_seen == fine);
    CHECK(fp32.gradient_seen == tiny);
    const Outcome half = run_with(Precision::half(), sync);
    CHECK(half.input_seen == 1.0f);
    CHECK(half.gradient_seen == 0.0f);  // lost in fp16 without loss scaling
    const Outcome scaled = run_with(Precision::half(8192.0f), sync);
    CHECK(scaled.gradient_seen == doctest::Approx(tiny).epsilon(1e-3));  // scaled, stored, unscaled
  }
}

TEST_CASE("precision: the all-reduce moves the partials' bytes (fp16 partials: half of fp32's)") {
  auto all_reduce_bytes = [](DType partials) {
    PipelineConfig cfg;
    cfg.gradient_accumulation = 3;
    cfg.replicas = 2;
    cfg.trace = true;
    cfg.precision = Precision{DType::kFloat16, partials, 1.0f};
    DeviceGroup devices(cfg.devices_needed(2), kRoomy);
    Pipeline pipe(devices, cfg, probes(2));
    InfeedQueue<Batch> infeed(InfeedConfig{2, 8, 1});
    feed(infeed, 6);
    REQUIRE(pipe.run(infeed, 1).completed());
    REQUIRE(pipe.trace() != nullptr);
    std::vector<std::uint64_t> bytes;
    for (const TraceTrack& t : pipe.trace()->tracks()) {
      for (const TraceEvent& e : t.events()) {
        if (t.label(e) == "all-reduce") bytes.push_back(e.bytes);
      }
    }
    CHECK(bytes.size() == 4);  // one per device per step
    return bytes;
  };
  const std::vector<std::uint64_t> fp32 = all_reduce_bytes(DType::kFloat32);
  const std::vector<std::uint64_t> fp16 = all_reduce_bytes(DType::kFloat16);
  for (std::uint64_t b : fp32) CHECK(b == 16 * sizeof(float));  // each Probe has 16 parameters
  for (std::uint64_t b : fp16) CHECK(b == 16 * 2);
}

namespace {

// A stage that spins for `work` in its forward pass (stands for compute).
struct Busy final : Stage {
  std::chrono::microseconds work{0};
  std::string name() const override { return "busy"; }
  std::size_t output_elements() const override { return 2; }
  void forward(const StageContext&, ForwardArgs& a) override {
    const auto until = std::chrono::steady_clock::now() + work;
    while (std::chrono::steady_clock::now() < until) {
    }
    a.output[0] = static_cast<float>(a.batch.indices.front());
    a.output[1] = 0;
  }
};

StageFactory busy(std::uint32_t n, std::chrono::microseconds work) {
  return [n, work](std::uint32_t) {
    StageList list;
    for (std::uint32_t s = 0; s < n; ++s) {
      auto b = std::make_unique<Busy>();
      b->work = work;
      list.push_back(std::move(b));
    }
    return list;
  };
}

// `n` micro-batches of 64 values of `dtype` and 4 labels, then closed.
void feed_typed(InfeedQueue<Batch>& infeed, std::uint64_t n, DType dtype) {
  feed(infeed, n, Tensor(dtype, {4, 16}));
}

}  // namespace

TEST_CASE(
    "host link: micro-batches in and outputs out cross it, by their bytes; 8-bit I/O moves a "
    "quarter of the data") {
  for (bool training : {true, false}) {
    CAPTURE(training);
    auto bytes_of = [&](DType dtype) {
      DeviceGroup devices(2, kRoomy);
      PipelineConfig cfg;
      cfg.training = training;
      cfg.gradient_accumulation = 3;
      Pipeline pipe(devices, cfg, training ? probes(2) : busy(2, std::chrono::microseconds{0}));
      InfeedQueue<Batch> infeed(InfeedConfig{1, 6, 1});
      feed_typed(infeed, 6, dtype);
      OutfeedQueue<std::vector<float>> out(OutfeedConfig{1, OutputMode::all(), 0});
      const PipelineResult r = pipe.run(infeed, 2, &out);
      REQUIRE(r.completed());
      CHECK(out.drain().size() == 6);
      CHECK(r.host_bytes_out == 6 * pipe.stage(0, 1).output_elements() * 4);
      return r.host_bytes_in;
    };
    const std::uint64_t labels = 6 * 4 * sizeof(std::int32_t);
    const std::uint64_t fp32 = bytes_of(DType::kFloat32);
    const std::uint64_t u8 = bytes_of(DType::kUint8);
    CHECK(fp32 == 6 * 64 * 4 + labels);
    CHECK(u8 == 6 * 64 * 1 + labels);
    CHECK((u8 - labels) * 4 == fp32 - labels);
  }
}

TEST_CASE(
    "host link: without I/O tiles stage 0 waits for every copy; with them the copies overlap "
    "compute") {
  const auto d = std::chrono::milliseconds(4);  // the copy of one micro-batch, and the compute
  const std::size_t batch_bytes = 64 * 4 + 4 * sizeof(std::int32_t);
  constexpr std::uint64_t kMicroBatches = 10;
  auto run_with = [&](std::uint32_t io_tiles) {
    DeviceGroup devices(2, kRoomy);
    PipelineConfig cfg;
    cfg.training = false;
    cfg.gradient_accumulation = kMicroBatches;
    cfg.host_link = LinkModel::taking(d, batch_bytes);
    cfg.io_tiles = io_tiles;
    cfg.prefetch_depth = 2;
    Pipeline pipe(devices, cfg, busy(2, d));
    InfeedQueue<Batch> infeed(InfeedConfig{1, kMicroBatches, 1});
    feed_typed(infeed, kMicroBatches, DType::kFloat32);
    const PipelineResult r = pipe.run(infeed, 1);
    REQUIRE(r.completed());
    CHECK(r.host_bytes_in == kMicroBatches * batch_bytes);
    return r;
  };
  const PipelineResult serial = run_with(0);
  CHECK(serial.host_wait >= kMicroBatches * d * 0.95);  // each copy waited out in full
  CHECK(serial.elapsed >= kMicroBatches * 2 * d * 0.95);
  const PipelineResult overlapped = run_with(2);
  // The first copy is waited for; the others ran while the device computed.
  CHECK(overlapped.host_wait < kMicroBatches * d / 2);
  // The I/O tiles' memory is in the plan: 2 tiles x 64 KiB on each device.
  DeviceGroup devices(2, kRoomy);
  PipelineConfig cfg;
  cfg.io_tiles = 2;
  cfg.gradient_accumulation = 3;
  Pipeline pipe(devices, cfg, probes(2));
  for (const DeviceMemory& dm : pipe.memory().devices)
    CHECK(dm.category(MemoryCategory::kIoTiles) == 2 * 64 * 1024);
}

TEST_CASE("host link: synthetic data makes no host copies and reads one micro-batch per replica") {
  DeviceGroup devices(2, kRoomy);
  PipelineConfig cfg;
  cfg.gradient_accumulation = 3;
  cfg.synthetic_data = true;
  cfg.host_link = LinkModel::taking(std::chrono::milliseconds(50), 1);  // would take seconds
  Pipeline pipe(devices, cfg, probes(2));
  InfeedQueue<Batch> infeed(InfeedConfig{1, 10, 1});
  feed_typed(infeed, 10, DType::kFloat32);
  OutfeedQueue<std::vector<float>> out(OutfeedConfig{1, OutputMode::all(), 0});
  const PipelineResult r = pipe.run(infeed, 3, &out);
  REQUIRE(r.completed());
  CHECK(r.iterations == 3);
  CHECK(r.host_bytes_in == 0);
  CHECK(r.host_bytes_out == 0);
  CHECK(r.elapsed < std::chrono::milliseconds(500));  // 9 micro-batches x 50 ms each if copied
  CHECK(out.drain().size() == 9);
  // One micro-batch was read; the other 9 are still in the lane.
  auto reader = infeed.reader(0);
  std::uint64_t left = 0;
  for (Batch b; reader.try_pop(b);) ++left;
  CHECK(left == 9);
}

TEST_CASE(
    "host link: I/O tiles that cannot hold prefetch_depth micro-batches, and bad settings, are "
    "errors") {
  DeviceGroup devices(2, DeviceConfig{64, 1024});
  PipelineConfig cfg;
  cfg.gradient_accumulation = 3;
  cfg.io_tiles = 2;  // 2 KiB
  cfg.prefetch_depth = 8;
  Pipeline pipe(devices, cfg, probes(2, [](Probe& p) { p.saved = 4; }));
  InfeedQueue<Batch> infeed(InfeedConfig{1, 3, 1});
  feed_typed(infeed, 3, DType::kFloat32);  // 272 bytes x 8 > 2 KiB
  try {
    pipe.run(infeed, 1);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("cannot hold prefetch_depth 8") != std::string::npos);
    CHECK(what.find("raise io_tiles") != std::string::npos);
  }
  PipelineConfig odd;
  odd.io_tiles = 3;
  CHECK_THROWS_WITH_AS(Pipeline(devices, odd, probes(1)), doctest::Contains("io_tiles = 3"), Error);
  PipelineConfig all;
  all.io_tiles = 64;
  CHECK_THROWS_WITH_AS(
      Pipeline(devices, all, probes(1)),
      doctest::Contains("io_tiles = 64 is not allowed: must be below the device's 64 tiles"),
      Error);
  PipelineConfig deep;
  deep.prefetch_depth = 0;
  CHECK_THROWS_WITH_AS(Pipeline(devices, deep, probes(1)), doctest::Contains("prefetch_depth = 0"),
                       Error);
}

TEST_SUITE_END();
