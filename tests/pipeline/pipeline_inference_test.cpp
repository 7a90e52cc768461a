// runtime/: Pipeline inference (bspflow/pipeline/pipeline.hpp with training = false): the end
// of data drains every micro-batch in flight, a closed-loop client is answered at every depth
// in both sync modes, no response is held while the pipeline idles, and a failure or a cancel
// gives the good micro-batches in flight back to the infeed, so nothing is lost.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;

namespace {

const DeviceConfig kSmall{64, 64 * 1024};

// Stage 0 reads the request's id (the batch's first index); each later stage adds 1000, so
// the last stage of N outputs id + 1000 (N - 1). A stage may throw on one id, or sleep.
class Tag final : public Stage {
 public:
  std::string name() const override { return "tag"; }
  std::size_t output_elements() const override { return 1; }
  std::size_t gradient_elements() const override { return 0; }
  void forward(const StageContext& ctx, ForwardArgs& a) override {
    const double id = ctx.stage == 0 ? static_cast<double>(a.batch.indices.front())
                                     : a.input[0] - 1000.0 * (ctx.stage - 1);
    if (fail_on && *fail_on == static_cast<std::uint64_t>(id))
      throw std::runtime_error("bad request");
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    a.output[0] = static_cast<float>(ctx.stage == 0 ? id : a.input[0] + 1000.0);
  }
  void backward(const StageContext&, BackwardArgs&) override {}
  std::optional<std::uint64_t> fail_on;
  std::chrono::microseconds delay{0};
};

StageList tags(std::uint32_t n) {
  StageList l;
  for (std::uint32_t s = 0; s < n; ++s) l.push_back(std::make_unique<Tag>());
  return l;
}

Batch request(std::uint64_t id) {
  Batch b;
  b.data = Tensor(DType::kFloat32, {1});
  b.labels = {0};
  b.indices = {id};
  b.valid = 1;
  return b;
}

// The id an answer carries, for a pipeline of n stages.
std::uint64_t id_of(const std::vector<float>& out, std::uint32_t n) {
  return static_cast<std::uint64_t>(out.at(0) - 1000.0f * static_cast<float>(n - 1));
}

struct Shape {
  ExecutionStrategy strategy;
  SyncMode sync;
  std::uint32_t stages;
};
std::string describe(const Shape& s) {
  return std::string(to_string(s.strategy)) + " " + to_string(s.sync);
}
std::vector<Shape> shapes() {
  std::vector<Shape> v;
  for (std::uint32_t n : {1u, 2u, 3u, 4u}) {
    v.push_back({ExecutionStrategy::kPipelined, SyncMode::kBsp, n});
    v.push_back({ExecutionStrategy::kPipelined, SyncMode::kDataflow, n});
  }
  v.push_back({ExecutionStrategy::kSharded, SyncMode::kBsp, 3});
  v.push_back({ExecutionStrategy::kSingle, SyncMode::kBsp, 3});
  return v;
}
PipelineConfig inference(const Shape& s, std::uint32_t k = 1) {
  PipelineConfig c;
  c.training = false;
  c.strategy = s.strategy;
  c.sync = s.sync;
  c.gradient_accumulation = k;
  return c;
}

// A stage whose name() (the host reads it while run() compiles the programs) calls
// `on_name` once when armed: a cancel() that comes while run() sets up.
class CancelsOnName final : public Stage {
 public:
  CancelsOnName(std::atomic<bool>& armed, std::function<void()> on_name)
      : armed_(armed), on_name_(std::move(on_name)) {}
  std::string name() const override {
    if (armed_.exchange(false)) on_name_();
    return "cancels on name";
  }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    a.output[0] = static_cast<float>(a.batch.indices.front());
  }

 private:
  std::atomic<bool>& armed_;
  std::function<void()> on_name_;
};

// Outputs the request's id; at micro-batch `at` of a run it calls `on_reach` (on its device).
class CallsAt final : public Stage {
 public:
  CallsAt(std::uint64_t at, std::function<void()> on_reach)
      : at_(at), on_reach_(std::move(on_reach)) {}
  std::string name() const override { return "calls at"; }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext& ctx, ForwardArgs& a) override {
    if (ctx.micro_batch == at_) on_reach_();
    a.output[0] = static_cast<float>(ctx.micro_batch);
  }

 private:
  std::uint64_t at_;
  std::function<void()> on_reach_;
};

}  // namespace

TEST_SUITE_BEGIN("pipeline_inference");

TEST_CASE("a stopped run with answers staged and a full outfeed nobody reads still returns") {
  // Guards: run() finishes its outfeed writers with the stop flag. A run stopped while its
  // last stage holds answers (write-combining) and the bounded outfeed is full, with nobody
  // reading, must not block there (the guard drains the outfeed after 10 s, and fails).
  // Synthetic data (no link time) keeps the iterations fast, so answers are staged; the
  // stage cancels the run at micro-batch 8, with up to 8 answers in an outfeed of 8.
  for (int trial = 0; trial < 5; ++trial) {
    CAPTURE(trial);
    PipelineConfig cfg = inference({ExecutionStrategy::kSingle, SyncMode::kBsp, 1});
    cfg.synthetic_data = true;
    DeviceGroup devices(1, kSmall);
    Pipeline* self = nullptr;
    Pipeline pipe(devices, cfg, [&](std::uint32_t) {
      StageList l;
      l.push_back(std::make_unique<CallsAt>(8, [&] { self->cancel(); }));
      return l;
    });
    self = &pipe;
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    REQUIRE(infeed.make_producer().push(request(0)));  // read once: the run's data
    OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 8});
    PipelineResult r;
    {
      test::Rescue guard(10s, [&] { (void)outfeed.drain(); });
      r = pipe.run(infeed, 1'000'000, &outfeed);
      CHECK_FALSE(guard.fired());
      if (guard.fired()) break;
    }
    CHECK(r.status == RunStatus::kCancelled);
    // A shared outfeed takes a stopped run's answers past its bound: none is lost.
    CHECK(outfeed.drain().size() == r.micro_batches);
    CHECK(r.micro_batches == 9);
  }
}

TEST_CASE(
    "a cancel() while run() sets up is not lost: nothing is taken, the next run answers all") {
  // Guards: Pipeline::cancel() made while run() attaches its feeds and compiles its programs
  // is not lost; otherwise this serving run (a count of 10^12 on an open infeed) would go on
  // for ever (the guard cancels it after 10 s).
  for (const auto strategy : {ExecutionStrategy::kPipelined, ExecutionStrategy::kSingle}) {
    CAPTURE(std::string(to_string(strategy)));
    PipelineConfig cfg = inference({strategy, SyncMode::kBsp, 2});
    DeviceGroup devices(cfg.devices_needed(2), kSmall);
    std::atomic<bool> armed{false};
    Pipeline* self = nullptr;
    Pipeline pipe(devices, cfg, [&](std::uint32_t) {
      StageList l;
      l.push_back(std::make_unique<CancelsOnName>(armed, [&] { self->cancel(); }));
      l.push_back(std::make_unique<Tag>());
      return l;
    });
    self = &pipe;
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    OutfeedQueue<std::vector<float>> outfeed;
    {
      auto p = infeed.make_producer();
      for (std::uint64_t i = 0; i < 3; ++i) REQUIRE(p.push(request(i)));  // not closed
    }
    armed = true;
    const std::uint64_t forever = 1'000'000'000'000;
    PipelineResult r;
    {
      test::Rescue guard(10s, [&] { pipe.cancel(); });
      r = pipe.run(infeed, forever, &outfeed);
      CHECK_FALSE(guard.fired());
    }
    CHECK_FALSE(armed.load());  // the cancel was made inside run()
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.micro_batches == 0);
    CHECK(infeed.size_approx(0) == 3);  // every request still in the lane
    CHECK(outfeed.drain().empty());
    infeed.close();
    const PipelineResult next = pipe.run(infeed, forever, &outfeed);
    CHECK(next.status == RunStatus::kEndOfData);
    CHECK(next.micro_batches == 3);
    CHECK(outfeed.drain().size() == 3);
  }
}

TEST_CASE("a std::stop_token stops a serving run: before the call it takes nothing") {
  for (const Shape& shape : shapes()) {
    if (shape.stages != 2 && shape.stages != 3) continue;
    CAPTURE(describe(shape));
    CAPTURE(shape.stages);
    const PipelineConfig cfg = inference(shape);
    DeviceGroup devices(cfg.devices_needed(shape.stages), kSmall);
    Pipeline pipe(devices, cfg, [&](std::uint32_t) { return tags(shape.stages); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 2});
    OutfeedQueue<std::vector<float>> outfeed;
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < 3; ++i) REQUIRE(p.push(request(i)));
    std::stop_source stopped;
    stopped.request_stop();
    const std::uint64_t forever = 1'000'000'000'000;
    const PipelineResult r = pipe.run(infeed, forever, &outfeed, stopped.get_token());
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.micro_batches == 0);
    CHECK(infeed.size_approx(0) == 3);
    // During: the run answers what there is, then waits; a std::jthread's destructor stops it.
    std::optional<PipelineResult> during;
    {
      test::Rescue guard(10s, [&] { infeed.close(); });  // a lost stop: kEndOfData below
      {
        std::jthread host(
            [&](std::stop_token stop) { during = pipe.run(infeed, forever, &outfeed, stop); });
        std::uint64_t answered = 0;
        while (answered < 3) answered += outfeed.drain().size();
      }
      CHECK_FALSE(guard.fired());
    }
    REQUIRE(during.has_value());
    CHECK(during->status == RunStatus::kCancelled);
    CHECK(during->micro_batches == 3);
    // A token never stopped changes nothing; a stop after the run's end reaches nothing.
    REQUIRE(p.push(request(3)));
    infeed.close();
    std::stop_source later;
    const PipelineResult last = pipe.run(infeed, forever, &outfeed, later.get_token());
    later.request_stop();
    CHECK(last.status == RunStatus::kEndOfData);
    CHECK(last.micro_batches == 1);
  }
}

TEST_CASE("the end of data drains: every micro-batch taken is answered, once and in order") {
  for (const Shape& shape : shapes()) {
    for (std::uint64_t m : {1u, 2u, 9u}) {
      const std::string where = describe(shape);
      CAPTURE(where);
      CAPTURE(shape.stages);
      CAPTURE(m);
      const PipelineConfig cfg = inference(shape, 1);
      DeviceGroup devices(cfg.devices_needed(shape.stages), kSmall);  // 4 devices: on 2 cores
      Pipeline pipe(devices, cfg, [&](std::uint32_t) { return tags(shape.stages); });
      InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 2});
      OutfeedQueue<std::vector<float>> outfeed;
      auto p = infeed.make_producer();
      for (std::uint64_t i = 0; i < m; ++i) REQUIRE(p.push(request(i)));
      infeed.close();
      const PipelineResult r = pipe.run(infeed, 1000, &outfeed);
      CHECK(r.status == RunStatus::kEndOfData);
      CHECK(r.micro_batches == m);
      CHECK(test::contains(r.message, "the infeed ended after " + std::to_string(m) + " of 1000"));
      CHECK(test::contains(r.message, "all " + std::to_string(m) + " were answered"));
      const auto got = outfeed.drain();
      REQUIRE(got.size() == m);
      for (std::uint64_t i = 0; i < m; ++i) {
        CHECK(id_of(got[i].value, shape.stages) == i);
        CHECK(got[i].iteration == i);
      }
    }
  }
}

TEST_CASE("a run of a fixed length completes, with K micro-batches per device iteration") {
  const Shape shape{ExecutionStrategy::kPipelined, SyncMode::kBsp, 3};
  DeviceGroup devices(3, kSmall);
  Pipeline pipe(devices, inference(shape, 4), [](std::uint32_t) { return tags(3); });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 2});
  OutfeedQueue<std::vector<float>> outfeed;
  auto p = infeed.make_producer();
  for (std::uint64_t i = 0; i < 12; ++i) REQUIRE(p.push(request(i)));
  const PipelineResult r = pipe.run(infeed, 2, &outfeed);  // 8 of the 12
  CHECK(r.completed());
  CHECK(r.iterations == 2);
  CHECK(r.micro_batches == 8);
  CHECK(outfeed.drain().size() == 8);
  infeed.close();
  const PipelineResult rest = pipe.run(infeed, 2, &outfeed);  // the other 4, then the end
  CHECK(rest.status == RunStatus::kEndOfData);
  CHECK(rest.iterations == 1);
  const auto got = outfeed.drain();
  REQUIRE(got.size() == 4);
  CHECK(id_of(got.front().value, 3) == 8);
}

TEST_CASE(
    "a closed-loop client is answered at every depth, in both sync modes, with nothing held") {
  for (const Shape& shape : shapes()) {
    const std::string where = describe(shape);
    CAPTURE(where);
    CAPTURE(shape.stages);
    const PipelineConfig cfg = inference(shape, 1);
    DeviceGroup devices(cfg.devices_needed(shape.stages), kSmall);
    Pipeline pipe(devices, cfg, [&](std::uint32_t) { return tags(shape.stages); });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    OutfeedQueue<std::vector<float>> outfeed;
    auto run =
        std::async(std::launch::async, [&] { return pipe.run(infeed, 1'000'000, &outfeed); });
    auto p = infeed.make_producer();
    auto answer = [&](std::uint64_t i) {
      std::optional<OutfeedEntry<std::vector<float>>> e;
      const auto deadline = std::chrono::steady_clock::now() + 5s;
      while (!(e = outfeed.try_pop()) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
      CHECK_MESSAGE(e.has_value(), "request " << i << " was not answered within 5 s");
      if (e) CHECK(id_of(e->value, shape.stages) == i);
      return e.has_value();
    };
    // A burst first: fast iterations make the last stage combine its writes, which it must
    // still hand over once the burst ends.
    const std::uint64_t burst = 40;
    for (std::uint64_t i = 0; i < burst; ++i) REQUIRE(p.push(request(i)));
    bool answered_all = true;
    for (std::uint64_t i = 0; i < burst && answered_all; ++i) answered_all = answer(i);
    for (std::uint64_t i = burst; i < burst + 20 && answered_all;
         ++i) {  // one request in flight at a time
      REQUIRE(p.push(request(i)));
      answered_all = answer(i);
    }
    if (!answered_all) pipe.cancel();
    infeed.close();
    const PipelineResult r = run.get();
    if (answered_all) {
      CHECK(r.status == RunStatus::kEndOfData);
      CHECK(r.micro_batches == burst + 20);
    }
  }
}

TEST_CASE("a stage failure loses no good micro-batch: those in flight go back to the infeed") {
  for (const Shape& shape : shapes()) {
    if (shape.stages < 2) continue;
    const std::string where = describe(shape);
    CAPTURE(where);
    CAPTURE(shape.stages);
    const PipelineConfig cfg = inference(shape, 1);
    DeviceGroup devices(cfg.devices_needed(shape.stages), kSmall);
    Pipeline pipe(devices, cfg, [&](std::uint32_t) { return tags(shape.stages); });
    auto& failing = static_cast<Tag&>(pipe.stage(0, shape.stages - 1));
    failing.fail_on = 4;
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 4});
    OutfeedQueue<std::vector<float>> outfeed;
    auto p = infeed.make_producer();
    const std::uint64_t m = 16;
    for (std::uint64_t i = 0; i < m; ++i) REQUIRE(p.push(request(i)));
    infeed.close();
    std::map<std::uint64_t, int> seen;
    try {
      pipe.run(infeed, 1000, &outfeed);
      FAIL("no StageError");
    } catch (const StageError& e) {
      CHECK(e.micro_batch() == 4);
      CHECK(e.stage() == shape.stages - 1);
      CHECK(test::contains(e.what(), "bad request"));
      CHECK(test::contains(e.what(), "went back to the infeed"));
    }
    for (const auto& e : outfeed.drain()) ++seen[id_of(e.value, shape.stages)];
    failing.fail_on.reset();
    const PipelineResult again = pipe.run(infeed, 1000, &outfeed);
    CHECK(again.status == RunStatus::kEndOfData);
    for (const auto& e : outfeed.drain()) ++seen[id_of(e.value, shape.stages)];
    // Every request but the failed one answered exactly once over the two runs.
    CHECK(seen.size() == m - 1);
    CHECK(seen.count(4) == 0);
    for (const auto& [id, times] : seen) {
      CAPTURE(id);
      CHECK(times == 1);
    }
  }
}

TEST_CASE("cancel ends the run at once and gives what was in flight back to the infeed") {
  for (SyncMode sync : {SyncMode::kBsp, SyncMode::kDataflow}) {
    const std::string where = to_string(sync);
    CAPTURE(where);
    const Shape shape{ExecutionStrategy::kPipelined, sync, 3};
    DeviceGroup devices(3, kSmall);
    Pipeline pipe(devices, inference(shape, 1), [](std::uint32_t) {
      StageList l = tags(3);
      static_cast<Tag&>(*l[1]).delay = 2ms;
      return l;
    });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 256, 4});
    OutfeedQueue<std::vector<float>> outfeed;
    auto p = infeed.make_producer();
    const std::uint64_t m = 200;
    for (std::uint64_t i = 0; i < m; ++i) REQUIRE(p.push(request(i)));
    infeed.close();
    auto run = std::async(std::launch::async, [&] { return pipe.run(infeed, 1000, &outfeed); });
    std::this_thread::sleep_for(30ms);
    pipe.cancel();
    const PipelineResult r = run.get();
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(test::contains(r.message, "went back to the infeed"));
    std::map<std::uint64_t, int> seen;
    for (const auto& e : outfeed.drain()) ++seen[id_of(e.value, 3)];
    CHECK(seen.size() == r.micro_batches);
    static_cast<Tag&>(pipe.stage(0, 1)).delay = 0ms;
    const PipelineResult rest = pipe.run(infeed, 1000, &outfeed);
    CHECK(rest.status == RunStatus::kEndOfData);
    std::uint64_t i = 0;
    for (const auto& e : outfeed.drain()) {
      ++seen[id_of(e.value, 3)];
      if (i++ == 0)
        CHECK(id_of(e.value, 3) == r.micro_batches);  // in order: the oldest came back first
    }
    CHECK(seen.size() == m);
    for (const auto& [id, times] : seen) {
      CAPTURE(id);
      CHECK(times == 1);
    }
  }
}

TEST_CASE("replicas: each lane drains on its own, nothing lost") {
  PipelineConfig cfg;
  cfg.training = false;
  cfg.replicas = 2;
  cfg.sync = SyncMode::kBsp;
  DeviceGroup devices(cfg.devices_needed(2), kSmall);  // 4 devices on 2 cores
  Pipeline pipe(devices, cfg, [](std::uint32_t) { return tags(2); });
  InfeedQueue<Batch> infeed(InfeedConfig{2, 64, 2});
  OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{2, OutputMode::all(), 0});
  auto p = infeed.make_producer();
  for (std::uint64_t i = 0; i < 7; ++i) REQUIRE(p.push_to(0, request(i)));
  for (std::uint64_t i = 100; i < 103; ++i) REQUIRE(p.push_to(1, request(i)));
  infeed.close();
  const PipelineResult r = pipe.run(infeed, 50, &outfeed);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.micro_batches == 10);
  std::map<std::uint32_t, std::vector<std::uint64_t>> by_replica;
  for (const auto& e : outfeed.drain()) by_replica[e.replica].push_back(id_of(e.value, 2));
  CHECK(by_replica[0] == std::vector<std::uint64_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(by_replica[1] == std::vector<std::uint64_t>{100, 101, 102});
}

TEST_SUITE_END();
