// runtime/: program nodes (bspflow/engine/program.hpp) on their own: what each constructor
// checks (an error naming the node), what a Program holds, and, run through an Engine, the
// parts of their contract engine_test.cpp leaves out: how Execute splits its work items,
// Repeat(0), a Copy on one device, the labels and directions in the trace, RemoteCopy's
// modeled time and finish_on_stop, a StreamCopy pair of mismatched sizes.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace bspflow::program;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::contains;
using test::error_of;
using test::kSmall;

namespace {

const Execute::Vertex kNoVertex;
const std::function<void(const ComputeContext&)> kNoCodelet;
const auto kIdle = [](const ComputeContext&) {};
const auto kSixtyFourBytes = [](const ComputeContext&) { return std::size_t{64}; };

}  // namespace

TEST_SUITE_BEGIN("program");

TEST_CASE("each node checks what it is given; the error names the node") {
  Device dev(0, kSmall);
  Buffer a = make_buffer(dev, "a", DType::kFloat32, 4);
  Buffer b = make_buffer(dev, "b", DType::kInt32, 4);
  Buffer c = make_buffer(dev, "c", DType::kFloat32, 5);
  InfeedQueue<Tensor> infeed;
  OutfeedQueue<Tensor> outfeed;
  CHECK(contains(error_of([] { Execute("scale", 16, kNoVertex); }),
                 "Execute 'scale': the vertex is empty"));
  CHECK(contains(error_of([] { Execute("step", kNoCodelet); }),
                 "Execute 'step': the codelet is empty"));
  CHECK(contains(error_of([] { Sync(nullptr); }), "Sync: the sync group is null"));
  CHECK(contains(error_of([&] { Copy(nullptr, a); }), "Copy: a buffer is null"));
  CHECK(contains(error_of([&] { Copy(a, nullptr); }), "Copy: a buffer is null"));
  CHECK(contains(error_of([&] { Copy(a, b); }), "Copy from 'a' (4 fp32) to 'b' (4 int32)"));
  CHECK(contains(error_of([&] { Copy(a, c); }), "Copy from 'a' (4 fp32) to 'c' (5 fp32)"));
  CHECK(contains(error_of([&] { StreamCopy(infeed, nullptr); }),
                 "StreamCopy: the destination buffer is null"));
  CHECK(contains(error_of([&] { StreamCopy(nullptr, outfeed); }),
                 "StreamCopy: the source buffer is null"));
  CHECK(contains(error_of([] { RepeatWhile(nullptr, Execute("x", kIdle)); }),
                 "RepeatWhile: the condition is empty"));
  CHECK(contains(error_of([] { RemoteCopy("state", true, nullptr); }),
                 "RemoteCopy 'state': the copy function is empty"));
  CHECK(contains(error_of([] { AllReduce("grads", tunables::kMaxReplicas + 1, kSixtyFourBytes); }),
                 "AllReduce 'grads' replicas = 1025 is not allowed: must be in 1..1024"));
  CHECK(contains(error_of([] {
                   FusedRepeat(
                       "loop", 1, [](const LoopFrame&) { return RunStatus::kCompleted; }, nullptr);
                 }),
                 "FusedRepeat 'loop': the finish step is empty"));
  // What they accept.
  CHECK(error_of([&] { Copy(a, make_buffer(dev, "a2", DType::kFloat32, 4)); }) == "<no error>");
  CHECK(error_of([] { AllReduce("grads", 1, kSixtyFourBytes); }) == "<no error>");
  CHECK(error_of([] { Repeat(0, Execute("x", kIdle)); }) == "<no error>");
}

TEST_CASE("a Program holds one node; copies share it; nodes keep what they were given") {
  Device dev(0, kSmall);
  Buffer x = make_buffer(dev, "x", DType::kFloat32, 4);
  InfeedQueue<Tensor> infeed;
  OutfeedQueue<Tensor> outfeed;
  auto group = std::make_shared<SyncGroup>(1);
  const Program in = StreamCopy(infeed, x);
  const Program out = StreamCopy(x, outfeed);
  const Program p =
      Repeat(7, Sequence{in, Execute("work", 64, [](const ComputeContext&, const TileWork&) {}),
                         Sync(group), out});
  const Program copy = p;
  CHECK(&copy.node() == &p.node());  // a Program is a cheap handle on an immutable node
  REQUIRE(std::holds_alternative<Repeat>(p.node()));
  const Repeat& r = std::get<Repeat>(p.node());
  CHECK(r.count == 7);
  REQUIRE(r.body.size() == 1);
  REQUIRE(std::holds_alternative<Sequence>(r.body.front().node()));
  const std::vector<Program>& steps = std::get<Sequence>(r.body.front().node()).steps;
  REQUIRE(steps.size() == 4);
  CHECK(&steps[0].node() == &in.node());  // in the order given
  CHECK(std::holds_alternative<Execute>(steps[1].node()));
  CHECK(std::holds_alternative<Sync>(steps[2].node()));
  CHECK(&steps[3].node() == &out.node());
  // StreamCopy: the constructor says the direction.
  const StreamCopy& s_in = std::get<StreamCopy>(in.node());
  CHECK(s_in.infeed == &infeed);
  CHECK(s_in.outfeed == nullptr);
  CHECK(s_in.buffer == x);
  const StreamCopy& s_out = std::get<StreamCopy>(out.node());
  CHECK(s_out.infeed == nullptr);
  CHECK(s_out.outfeed == &outfeed);
  // Execute: a vertex over work items, or a codelet for the whole device; never both.
  const Execute& e = std::get<Execute>(steps[1].node());
  CHECK(e.name == "work");
  CHECK(e.work_items == 64);
  CHECK(static_cast<bool>(e.vertex));
  CHECK_FALSE(static_cast<bool>(e.codelet));
  const Execute whole("whole", kIdle);
  CHECK(whole.work_items == 0);
  CHECK_FALSE(static_cast<bool>(whole.vertex));
  CHECK(static_cast<bool>(whole.codelet));
  CHECK(std::get<Sync>(steps[2].node()).group == group);
  // A Sequence from a vector, and the defaults of the other nodes.
  const Sequence from_vector(std::vector<Program>{in, out});
  CHECK(from_vector.steps.size() == 2);
  const RepeatWhile w([](const ComputeContext&) { return false; }, in);
  CHECK(w.max_trips == UINT64_MAX);
  const RemoteCopy rc("state", true, kSixtyFourBytes);
  CHECK(rc.to_host);
  CHECK_FALSE(rc.finish_on_stop);
  CHECK_FALSE(AllReduce("grads", 2, kSixtyFourBytes).finish_on_stop);
}

TEST_CASE("Execute: blocks of ceil(items / compute tiles), one call per tile that gets some") {
  Device dev(5, kSmall);  // 64 tiles
  EngineConfig config;
  config.io_tiles = 4;  // 60 compute tiles
  Engine engine(dev, config);
  struct Call {
    std::uint32_t tile;
    std::size_t begin, end;
  };
  for (const std::size_t items :
       {std::size_t{0}, std::size_t{10}, std::size_t{60}, std::size_t{100}, std::size_t{1000}}) {
    CAPTURE(items);
    std::vector<Call> calls;
    std::vector<ComputeContext> contexts;
    REQUIRE(engine
                .run(Execute("split", items,
                             [&](const ComputeContext& c, const TileWork& w) {
                               calls.push_back({w.tile, w.begin, w.end});
                               contexts.push_back(c);
                             }))
                .completed());
    if (items == 0) {  // no work items: one call for the whole device
      REQUIRE(calls.size() == 1);
      CHECK(calls[0].tile == 0);
      CHECK(calls[0].begin == 0);
      CHECK(calls[0].end == 0);
      continue;
    }
    const std::size_t per = (items + 59) / 60;
    CHECK(calls.size() == (items + per - 1) / per);
    std::size_t next = 0;
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CHECK(calls[i].tile == i);
      CHECK(calls[i].begin == next);  // contiguous, in order, each item once
      CHECK(calls[i].end - calls[i].begin == std::min(per, items - next));
      next = calls[i].end;
    }
    CHECK(next == items);
    for (const ComputeContext& c : contexts) {
      CHECK(c.device == 5);
      CHECK(c.replica == 0);
      CHECK(c.compute_tiles == 60);
      CHECK(c.iteration == 0);  // outside any Repeat
      CHECK(c.stop != nullptr);
    }
  }
}

TEST_CASE("Repeat(0), RepeatWhile with max_trips 0: the body runs no time, the run completes") {
  Device dev(0, kSmall);
  Engine engine(dev);
  int runs = 0;
  const Program count = Execute("count", [&](const ComputeContext&) { ++runs; });
  EngineResult r = engine.run(Repeat(0, count));
  CHECK(r.completed());
  CHECK(r.iterations == std::vector<std::uint64_t>{0});
  r = engine.run(RepeatWhile([](const ComputeContext&) { return true; }, count, 0));
  CHECK(r.completed());
  CHECK(runs == 0);
  // RepeatWhile as the outermost loop: its trip is the iteration.
  std::vector<std::uint64_t> seen;
  r = engine.run(
      RepeatWhile([&](const ComputeContext&) { return seen.size() < 3; },
                  Execute("see", [&](const ComputeContext& c) { seen.push_back(c.iteration); })));
  CHECK(seen == std::vector<std::uint64_t>{0, 1, 2});
  CHECK(r.iterations == std::vector<std::uint64_t>{3});
}

TEST_CASE("Copy on one device copies the contents and takes no device-link time") {
  Device dev(0, kSmall);
  EngineConfig config;
  config.device_link = LinkModel{1e3, 0ns};  // 1 kB/s: 40 KB between devices would model 40 s
  Engine engine(dev, config);
  Buffer x = make_buffer(dev, "x", DType::kFloat32, 10'000);
  Buffer y = make_buffer(dev, "y", DType::kFloat32, 10'000);
  std::iota(x->as<float>().begin(), x->as<float>().end(), 0.5f);
  const auto t0 = Clock::now();
  CHECK(engine.run(Copy(x, y)).completed());
  CHECK(Clock::now() - t0 < 20s);  // liveness, not speed: a modeled transfer would take 40 s
  for (std::size_t i = 0; i < 10'000; ++i)
    REQUIRE(y->as<float>()[i] == static_cast<float>(i) + 0.5f);
}

TEST_CASE("a Copy's destination must be on the device that runs it, checked before the run") {
  DeviceGroup devices(2, kSmall);
  Engine engine(devices);
  Buffer x0 = make_buffer(devices[0], "x0", DType::kFloat32, 4);
  Buffer y1 = make_buffer(devices[1], "y1", DType::kFloat32, 4);
  bool ran = false;
  const Program idle = Execute("idle", [&](const ComputeContext&) { ran = true; });
  const std::string err = error_of([&] { engine.run({Copy(x0, y1), idle}); });
  CHECK(contains(err, "the program of device " + std::to_string(devices[0].id()) +
                          " uses buffer 'y1' of device " + std::to_string(devices[1].id())));
  CHECK_FALSE(ran);  // checked before any device started
}

TEST_CASE("StreamCopy from one infeed into buffers of two sizes: refused before the run") {
  Device dev(0, kSmall);
  Engine engine(dev);
  InfeedQueue<Tensor> infeed;
  Buffer a = make_buffer(dev, "a", DType::kFloat32, 4);
  Buffer b = make_buffer(dev, "b", DType::kFloat32, 8);
  const std::string err = error_of([&] {
    engine.run(Sequence{StreamCopy(infeed, a), StreamCopy(infeed, b)});
  });
  CHECK(contains(err,
                 "two StreamCopy from one infeed into buffers of different sizes ('a' and 'b')"));
}

TEST_CASE("the trace names each Execute and RemoteCopy, with a RemoteCopy's bytes, direction") {
  Device dev(0, kSmall);
  EngineConfig config;
  config.trace = true;
  config.host_link = LinkModel::taking(2ms, 1000);
  Engine engine(dev, config);
  std::vector<std::uint64_t> trips;
  const RemoteCopy state_in("state in", false, [&](const ComputeContext& c) {
    trips.push_back(c.iteration);
    return std::size_t{1000};
  });
  const RemoteCopy state_out("state out", true,
                             [](const ComputeContext&) { return std::size_t{500}; });
  const Program p = Repeat(3, Sequence{state_in, Execute("update", kIdle), state_out});
  const auto t0 = Clock::now();
  REQUIRE(engine.run(p).completed());
  // The device took the host link's modeled time for each: 3 x (2 ms + 1 ms), at least.
  CHECK(Clock::now() - t0 >= 9ms);
  CHECK(trips == std::vector<std::uint64_t>{0, 1, 2});
  REQUIRE(engine.trace() != nullptr);
  const TraceTrack& track = engine.trace()->tracks()[0];
  int in = 0, out = 0, update = 0;
  for (const TraceEvent& e : track.events()) {
    if (e.phase == Phase::kCompute && track.label(e) == "update") ++update;
    if (e.phase != Phase::kStreamCopyMid) continue;
    if (track.label(e) == "state in") {
      ++in;
      CHECK_FALSE(e.to_host);
      CHECK(e.bytes == 1000);
      CHECK(e.end_ns - e.begin_ns >= 2'000'000);
    } else if (track.label(e) == "state out") {
      ++out;
      CHECK(e.to_host);
      CHECK(e.bytes == 500);
      CHECK(e.end_ns - e.begin_ns >= 1'000'000);
    }
  }
  CHECK(in == 3);
  CHECK(out == 3);
  CHECK(update == 3);
}

TEST_CASE("RemoteCopy finish_on_stop: a cancel lets it take its whole time, its Sequence goes on") {
  Device dev(0, kSmall);
  EngineConfig config;
  config.host_link = LinkModel::taking(100ms, 1000);
  Engine engine(dev, config);
  std::atomic<int> copies{0}, steps{0};
  RemoteCopy tail("tail", true, [&](const ComputeContext&) {
    copies.fetch_add(1);
    return std::size_t{1000};
  });
  tail.finish_on_stop = true;
  const Program p = Repeat(
      1000, Sequence{tail, Execute("after", [&](const ComputeContext&) { steps.fetch_add(1); })});
  const auto t0 = Clock::now();
  auto running = std::async(std::launch::async, [&] { return engine.run(p); });
  // The first copy has started (or the run ended early, a failure the checks below report).
  while (copies.load() == 0 && running.wait_for(1ms) != std::future_status::ready) {
  }
  std::this_thread::sleep_for(10ms);  // well inside the first copy's 100 ms
  // A cancel before the run has started finds none: repeat it until the run has ended.
  while (running.wait_for(1ms) != std::future_status::ready) engine.cancel();
  const EngineResult r = running.get();
  const auto took = Clock::now() - t0;
  CHECK(r.status == RunStatus::kCancelled);
  CHECK(copies.load() >= 1);
  // Every copy that started took its whole time, and the step after it ran.
  CHECK(steps.load() == copies.load());
  CHECK(r.iterations == std::vector<std::uint64_t>{static_cast<std::uint64_t>(copies.load())});
  CHECK(took >= copies.load() * 100ms);
}

TEST_SUITE_END();
