// runtime/: Engine programs (bspflow/engine/engine.hpp running program.hpp's nodes on
// sync_group.hpp's groups and device_buffer.hpp's buffers): Sequence, Repeat, RepeatWhile,
// Execute over the compute tiles, Sync, Copy, StreamCopy with and without I/O tiles, end of
// data, prefetch kept between runs, I/O tile sizing, checks before a run, errors reaching the
// host, cancel(), synthetic data, FusedRepeat.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <future>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace bspflow::program;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using test::filled;
using test::kSmall;
using test::with_link;

TEST_SUITE_BEGIN("engine");

TEST_CASE("Sequence runs in order, Repeat counts trips, the outermost trip is the iteration") {
  Device dev(0, kSmall);
  Engine engine(dev);
  std::vector<std::string> log;
  auto note = [&](std::string what) {
    return Execute(what, [&log, what](const ComputeContext& c) {
      log.push_back(what + std::to_string(c.iteration));
    });
  };
  const EngineResult r =
      engine.run(Repeat(3, Sequence{note("a"), Repeat(2, note("b")), note("c")}));
  CHECK(r.completed());
  CHECK(r.iterations == std::vector<std::uint64_t>{3});
  const std::vector<std::string> want{"a0", "b0", "b0", "c0", "a1", "b1",
                                      "b1", "c1", "a2", "b2", "b2", "c2"};
  CHECK(log == want);
}

TEST_CASE("RepeatWhile checks its condition before each trip, bounded by max_trips") {
  Device dev(0, kSmall);
  Engine engine(dev);
  int count = 0;
  engine.run(RepeatWhile([&](const ComputeContext&) { return count < 5; },
                         Execute("inc", [&](const ComputeContext&) { ++count; })));
  CHECK(count == 5);
  count = 0;
  engine.run(RepeatWhile([](const ComputeContext&) { return true; },
                         Execute("inc", [&](const ComputeContext&) { ++count; }), 7));
  CHECK(count == 7);
}

TEST_CASE("Execute partitions its work items over the compute tiles, each item exactly once") {
  Device dev(0, kSmall);
  EngineConfig c;
  c.io_tiles = 16;
  Engine engine(dev, c);
  CHECK(engine.compute_tiles() == 48);
  std::vector<int> hits(1000, 0);
  std::set<std::uint32_t> tiles;
  engine.run(Execute("cover", hits.size(), [&](const ComputeContext& ctx, const TileWork& w) {
    CHECK(ctx.compute_tiles == 48);
    tiles.insert(w.tile);
    for (std::size_t i = w.begin; i < w.end; ++i) ++hits[i];
  }));
  CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  CHECK(tiles.size() == 48);
  CHECK(*tiles.rbegin() == 47);
}

TEST_CASE("Sync is a barrier across devices (also 4 devices on 2 cores)") {
  for (std::uint32_t n : {2u, 4u}) {
    DeviceGroup devices(n, kSmall);
    Engine engine(devices);
    auto group = std::make_shared<SyncGroup>(n);
    std::vector<std::atomic<std::uint64_t>> round(n);
    std::atomic<int> violations{0};
    const std::uint64_t rounds = test::scaled(300, 20);
    std::vector<Program> programs;
    for (std::uint32_t d = 0; d < n; ++d) {
      programs.push_back(Repeat(rounds, Sequence{Execute("write",
                                                         [&, d](const ComputeContext& c) {
                                                           round[d].store(c.iteration + 1);
                                                         }),
                                                 Sync(group),
                                                 Execute("read",
                                                         [&](const ComputeContext& c) {
                                                           for (auto& r : round) {
                                                             if (r.load() != c.iteration + 1)
                                                               violations.fetch_add(1);
                                                           }
                                                         }),
                                                 Sync(group)}));
    }
    const EngineResult r = engine.run(programs);
    CHECK(r.completed());
    CHECK(violations.load() == 0);
    for (auto& x : round) CHECK(x.load() == rounds);
  }
}

TEST_CASE("Copy exchanges buffer contents between devices and takes the device link's time") {
  DeviceGroup devices(2, kSmall);
  EngineConfig c;
  c.device_link = LinkModel::taking(500us, 4096);
  c.trace = true;
  Engine engine(devices, c);
  Buffer x0 = make_buffer(devices[0], "x0", DType::kFloat32, 1024);
  Buffer y1 = make_buffer(devices[1], "y1", DType::kFloat32, 1024);
  auto group = std::make_shared<SyncGroup>(2);
  const Program p0 =
      Sequence{Execute("fill",
                       [&](const ComputeContext&) {
                         std::iota(x0->as<float>().begin(), x0->as<float>().end(), 1.0f);
                       }),
               Sync(group), Sync(group)};
  const Program p1 = Sequence{Sync(group), Copy(x0, y1), Sync(group)};
  CHECK(engine.run({p0, p1}).completed());
  for (std::size_t i = 0; i < 1024; ++i) REQUIRE(y1->as<float>()[i] == static_cast<float>(i + 1));
  bool saw = false;
  for (const TraceEvent& e : engine.trace()->tracks()[1].events()) {
    if (e.phase == Phase::kExchange) {
      saw = true;
      CHECK(e.bytes == 4096);
      CHECK(e.end_ns - e.begin_ns >= 500'000);
    }
  }
  CHECK(saw);
  CHECK(contains(error_of([&] { Copy(x0, make_buffer(devices[1], "small", DType::kFloat32, 3)); }),
                 "same element type and count"));
}

TEST_CASE("StreamCopy: host -> device -> host in order, with and without I/O tiles, any prefetch") {
  struct Case {
    std::uint32_t io_tiles, prefetch;
  };
  for (const Case k : {Case{0, 1}, Case{4, 1}, Case{4, 3}}) {
    CAPTURE(k.io_tiles);
    CAPTURE(k.prefetch);
    DeviceGroup devices(2, kSmall);
    Engine engine(devices, with_link(20us, 256, k.io_tiles, k.prefetch));
    InfeedQueue<Tensor> infeed(InfeedConfig{2, 64, k.prefetch});
    OutfeedQueue<Tensor> outfeed(OutfeedConfig{2});
    const int n = 40;
    std::vector<Program> programs;
    std::vector<Buffer> xs;
    for (std::uint32_t d = 0; d < 2; ++d) {
      Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 64);
      xs.push_back(x);
      programs.push_back(Repeat(n, Sequence{StreamCopy(infeed, x),
                                            Execute("double", 64,
                                                    [x](const ComputeContext&, const TileWork& w) {
                                                      for (std::size_t i = w.begin; i < w.end; ++i)
                                                        x->as<float>()[i] *= 2;
                                                    }),
                                            StreamCopy(x, outfeed)}));
    }
    std::thread host([&] {
      auto p = infeed.make_producer();
      for (int i = 0; i < n; ++i) {
        p.push_to(0, filled(64, static_cast<float>(i)));
        p.push_to(1, filled(64, static_cast<float>(1000 + i)));
      }
    });
    const EngineResult r = engine.run(programs);
    host.join();
    CHECK(r.completed());
    CHECK(r.iterations == std::vector<std::uint64_t>{n, n});
    std::vector<int> next(2, 0);
    int entries = 0;
    for (auto& e : outfeed.drain()) {
      ++entries;
      const float want = 2.0f * static_cast<float>((e.replica == 0 ? 0 : 1000) + next[e.replica]);
      REQUIRE(e.iteration == static_cast<std::uint64_t>(next[e.replica]));
      REQUIRE(e.value.as<float>()[0] == want);
      REQUIRE(e.value.as<float>()[63] == want);
      ++next[e.replica];
    }
    CHECK(entries == 2 * n);
    // The result counts what crossed the host link: n elements of 256 bytes each way per
    // device. Without I/O tiles each device waited for every copy (20 us modeled each).
    CHECK(r.host_bytes_in == 2u * n * 256u);
    CHECK(r.host_bytes_out == 2u * n * 256u);
    if (k.io_tiles == 0) CHECK(r.host_wait >= 2 * 2 * n * 20us);
  }
}

TEST_CASE(
    "4 devices on 2 cores with I/O tiles, sync and both directions: completes, exactly once") {
  DeviceGroup devices(4, kSmall);
  Engine engine(devices, with_link(30us, 256, 4, 2));
  InfeedQueue<Tensor> infeed(InfeedConfig{4, 8, 2});
  OutfeedQueue<Tensor> outfeed(OutfeedConfig{4, OutputMode::all(), 16});  // bounded: backpressure
  auto group = std::make_shared<SyncGroup>(4);
  const int n = static_cast<int>(test::scaled(60, 10));
  std::vector<Program> programs;
  for (std::uint32_t d = 0; d < 4; ++d) {
    Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 64);
    programs.push_back(
        Repeat(n, Sequence{StreamCopy(infeed, x), Sync(group), StreamCopy(x, outfeed)}));
  }
  std::thread host([&] {
    auto p = infeed.make_producer();
    for (int i = 0; i < n; ++i) {
      for (std::uint32_t d = 0; d < 4; ++d)
        p.push_to(d, filled(64, static_cast<float>(d * 1000 + i)));
    }
  });
  std::vector<double> sums(4, 0);
  int entries = 0;
  std::thread reader([&] {
    while (entries < 4 * n) {
      if (auto e = outfeed.try_pop()) {
        sums[e->replica] += e->value.as<float>()[0];
        ++entries;
      } else {
        std::this_thread::sleep_for(50us);
      }
    }
  });
  const EngineResult r = engine.run(programs);
  host.join();
  reader.join();
  CHECK(r.completed());
  CHECK(entries == 4 * n);
  for (std::uint32_t d = 0; d < 4; ++d)
    CHECK(sums[d] == doctest::Approx(d * 1000.0 * n + n * (n - 1) / 2.0));
}

TEST_CASE("StreamCopy: end of data ends the program with kEndOfData, with and without I/O tiles") {
  for (std::uint32_t io : {0u, 4u}) {
    Device dev(0, kSmall);
    Engine engine(dev, with_link(10us, 256, io, 2));
    InfeedQueue<Tensor> infeed(InfeedConfig{1, 16, 2});
    Buffer x = make_buffer(dev, "x", DType::kFloat32, 64);
    auto p = infeed.make_producer();
    for (int i = 0; i < 5; ++i) p.push(filled(64, 1.0f));
    infeed.close();
    int computed = 0;
    const EngineResult r = engine.run(
        Repeat(10, Sequence{StreamCopy(infeed, x),
                            Execute("count", [&](const ComputeContext&) { ++computed; })}));
    CHECK(r.status == RunStatus::kEndOfData);
    CHECK(r.iterations == std::vector<std::uint64_t>{5});
    CHECK(computed == 5);
  }
}

// Guards: a device whose infeed ends does not leave the devices it syncs with waiting for it
// at their next Sync; the run returns.
TEST_CASE(
    "StreamCopy: end of data on one device ends a run whose devices sync (no one waits forever)") {
  for (std::uint32_t io : {0u, 4u}) {
    CAPTURE(io);
    DeviceGroup devices(2, kSmall);
    Engine engine(devices, with_link(1us, 256, io, 2));
    InfeedQueue<Tensor> infeed(InfeedConfig{2, 16, 2});
    auto p = infeed.make_producer();
    for (int i = 0; i < 3; ++i) p.push_to(0, filled(64, 1.0f));
    for (int i = 0; i < 2; ++i) p.push_to(1, filled(64, 1.0f));  // device 1 runs dry a trip earlier
    infeed.close();
    auto sync = std::make_shared<SyncGroup>(2);
    std::vector<Program> programs;
    for (std::uint32_t d = 0; d < 2; ++d) {
      Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 64);
      programs.push_back(Repeat(10, Sequence{StreamCopy(infeed, x), Sync(sync)}));
    }
    auto run = std::async(std::launch::async, [&] { return engine.run(programs); });
    if (run.wait_for(10s) != std::future_status::ready) {
      engine.cancel();  // so the test can end
      FAIL("the run did not end: a device waits at its Sync for one whose infeed ended");
    }
    const EngineResult r = run.get();
    CHECK(r.status == RunStatus::kEndOfData);
    CHECK(r.iterations == std::vector<std::uint64_t>{2, 2});
    CHECK(contains(r.message, "end of data"));
  }
}

TEST_CASE("nothing prefetched is lost between runs: the next run gets it, in order") {
  SUBCASE("Engine with I/O tiles and prefetch 4") {
    Device dev(0, kSmall);
    Engine engine(dev, with_link(5us, 256, 4, 4));
    InfeedQueue<Tensor> infeed(InfeedConfig{1, 16, 4});
    Buffer x = make_buffer(dev, "x", DType::kFloat32, 64);
    auto p = infeed.make_producer();
    for (int i = 0; i < 10; ++i) p.push(filled(64, static_cast<float>(i)));
    std::vector<float> seen;
    const Program prog =
        Sequence{StreamCopy(infeed, x),
                 Execute("see", [&](const ComputeContext&) { seen.push_back(x->as<float>()[0]); })};
    CHECK(engine.run(Repeat(3, prog)).completed());
    CHECK(engine.run(Repeat(7, prog)).completed());
    CHECK(seen == std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  }
  SUBCASE("loops::repeat with prefetch 4") {
    Device dev(0, kSmall);
    InfeedQueue<int> infeed(InfeedConfig{1, 16, 4});
    auto p = infeed.make_producer();
    for (int i = 0; i < 10; ++i) p.push(i);
    std::vector<int> seen;
    auto body = [&](int& s, int& x) {
      seen.push_back(x);
      ++s;
    };
    CHECK(loops::repeat(dev, 3, body, 0, infeed).completed());
    CHECK(loops::repeat(dev, 7, body, 0, infeed).completed());
    std::vector<int> want(10);
    std::iota(want.begin(), want.end(), 0);
    CHECK(seen == want);
  }
}

TEST_CASE("I/O tiles: even, below the tile count, enough for one micro-batch (with a suggestion)") {
  Device dev(0, kSmall);  // 64 tiles x 16 KiB
  EngineConfig c;
  c.io_tiles = 3;
  CHECK(contains(error_of([&] { Engine e(dev, c); }),
                 "io_tiles = 3 is not allowed: must be 0 or an even number"));
  c.io_tiles = 64;
  CHECK(contains(error_of([&] { Engine e(dev, c); }), "must be below the device's 64 tiles"));
  c.io_tiles = 2;  // 32 KiB: too little for 100 KiB
  Engine engine(dev, c);
  InfeedQueue<Tensor> infeed;
  Buffer big = make_buffer(dev, "big", DType::kUint8, 100 * 1024);
  const std::string err = error_of([&] { engine.run(StreamCopy(infeed, big)); });
  CHECK(contains(err, "io_tiles = 2 hold 32.0 KiB, too little for one micro-batch of 100.0 KiB"));
  CHECK(contains(err, "use io_tiles = 8 (leaving 56 compute tiles)"));
  CHECK(Engine::suggest_io_tiles(100 * 1024, kSmall) == 8u);
  CHECK(Engine::suggest_io_tiles(16 * 1024, kSmall) == 2u);
  CHECK_FALSE(Engine::suggest_io_tiles(2 * 1024 * 1024, kSmall).has_value());
  EngineConfig p;
  p.prefetch_depth = 0;
  CHECK(contains(error_of([&] { Engine e(dev, p); }), "prefetch_depth = 0"));
}

TEST_CASE("programs are checked before they run") {
  DeviceGroup devices(2, kSmall);
  Engine engine(devices);
  Buffer on1 = make_buffer(devices[1], "on1", DType::kFloat32, 4);
  InfeedQueue<Tensor> two(InfeedConfig{2});
  InfeedQueue<Tensor> one;
  auto group = std::make_shared<SyncGroup>(2);
  const Program idle = Execute("idle", [](const ComputeContext&) {});
  CHECK(contains(error_of([&] {
                   engine.run({StreamCopy(two, on1), idle});
                 }),
                 "uses buffer 'on1' of device 1"));
  CHECK(contains(error_of([&] {
                   engine.run({Sync(group), idle});
                 }),
                 "sync group of 2 participants is used by 1"));
  CHECK(contains(error_of([&] {
                   engine.run({idle, StreamCopy(one, on1)});
                 }),
                 "1 replica lane(s) but the engine runs 2"));
  CHECK(contains(error_of([&] { engine.run(std::vector<Program>{idle}); }),
                 "1 programs for 2 devices"));
  const auto bytes = [](const ComputeContext&) { return std::size_t{64}; };
  CHECK(contains(error_of([&] { AllReduce("grads", 0, bytes); }), "AllReduce 'grads' replicas"));
  CHECK(contains(error_of([&] { AllReduce("grads", 0, bytes); }), "must be in 1.."));
  CHECK(contains(error_of([&] { AllReduce("grads", 2, nullptr); }), "the bytes function is empty"));
  // Guards: an AllReduce's replica count must be its sync group's size; a ring of 3 between
  // the Syncs of a group of 2 would model the wrong time without a word.
  for (const std::uint32_t replicas : {1u, 3u}) {
    CAPTURE(replicas);
    const Program odd = Sequence{Sync(group), AllReduce("grads", replicas, bytes), Sync(group)};
    CHECK(error_of([&] {
            engine.run({odd, odd});
          }) == "AllReduce 'grads' replicas = " + std::to_string(replicas) +
                    " is not allowed: must be 2 on device 0, the participants of the sync group it "
                    "runs between (the devices that all-reduce together)");
  }
  // The Sync after it counts when none comes before (a Repeat's next trip starts with it).
  const Program after = Repeat(2, Sequence{AllReduce("grads", 3, bytes), Sync(group)});
  CHECK(contains(error_of([&] { engine.run({after, after}); }), "must be 2 on device 0"));
  const Program right = Sequence{Sync(group), AllReduce("grads", 2, bytes), Sync(group)};
  CHECK(engine.run({right, right}).completed());
  // Without a Sync it is modelled time alone, for any count.
  CHECK(engine.run({AllReduce("grads", 3, bytes), idle}).completed());
}

TEST_CASE(
    "AllReduce: each replica's device takes the ring's modeled time, as a labelled exchange") {
  DeviceGroup devices(2, kSmall);
  EngineConfig config;
  config.device_link = LinkModel{1e8, 10us};
  config.trace = true;
  Engine engine(devices, config);
  auto group = std::make_shared<SyncGroup>(2);
  const std::size_t bytes = 8000;  // 2 steps of 4000 bytes: 2 x (10 us + 40 us) = 100 us
  const Program p = Repeat(
      3, Sequence{Sync(group), AllReduce("grads", 2, [&](const ComputeContext&) { return bytes; }),
                  Sync(group)});
  REQUIRE(engine.run({p, p}).completed());
  const std::chrono::nanoseconds ring = config.device_link.ring_allreduce(bytes, 2);
  CHECK(ring == 100us);
  REQUIRE(engine.trace() != nullptr);
  for (std::uint32_t d = 0; d < 2; ++d) {
    const TraceTrack& t = engine.trace()->tracks()[d];
    std::uint32_t seen = 0;
    for (const TraceEvent& e : t.events()) {
      if (e.phase != Phase::kExchange) continue;
      ++seen;
      CHECK(t.label(e) == "grads");
      CHECK(e.bytes == bytes);
      CHECK(e.end_ns - e.begin_ns >= ring.count());
    }
    CHECK(seen == 3);
  }
}

TEST_CASE("a host tensor of the wrong size is an error naming the buffer") {
  for (std::uint32_t io : {0u, 4u}) {
    Device dev(0, kSmall);
    Engine engine(dev, with_link(5us, 256, io));
    InfeedQueue<Tensor> infeed;
    Buffer x = make_buffer(dev, "x", DType::kFloat32, 64);
    infeed.make_producer().push(filled(63, 0));
    try {
      engine.run(StreamCopy(infeed, x));
      FAIL("no error");
    } catch (const DeviceError& e) {
      CHECK(contains(
          e.what(),
          "infeed element for buffer 'x' is 63 fp32 (252 bytes); the buffer takes 64 fp32"));
    }
  }
}

TEST_CASE("a vertex exception reaches the host with device and iteration; devices in Sync wake") {
  DeviceGroup devices(2, kSmall);
  Engine engine(devices);
  auto group = std::make_shared<SyncGroup>(2);
  const Program bad = Repeat(10, Sequence{Execute("boom",
                                                  [](const ComputeContext& c) {
                                                    if (c.iteration == 4)
                                                      throw std::runtime_error("bad sample");
                                                  }),
                                          Sync(group)});
  const Program good =
      Repeat(10, Sequence{Sync(group), Sync(group)});  // waits on a sync that never completes
  try {
    engine.run({good, bad});
    FAIL("no error");
  } catch (const DeviceError& e) {
    CHECK(e.device() == 1);
    CHECK(e.iteration() == 4);
    CHECK(contains(e.what(), "bad sample"));
  }
  // The devices are idle again: another run works.
  CHECK(engine.run(Execute("ok", [](const ComputeContext&) {})).completed());
}

TEST_CASE("cancel() stops a run that would not end by itself; waits for data wake up") {
  DeviceGroup devices(2, kSmall);
  Engine engine(devices, with_link(5us, 256, 4));
  InfeedQueue<Tensor> infeed(InfeedConfig{2});  // nothing is ever pushed
  Buffer x = make_buffer(devices[1], "x", DType::kFloat32, 64);
  const Program spin = RepeatWhile([](const ComputeContext&) { return true; },
                                   Execute("forever", [](const ComputeContext&) {}));
  std::thread canceller([&] {
    std::this_thread::sleep_for(20ms);
    engine.cancel();
  });
  const EngineResult r = engine.run({spin, Repeat(10, StreamCopy(infeed, x))});
  canceller.join();
  CHECK(r.status == RunStatus::kCancelled);
  CHECK(r.iterations[1] == 0);
  engine.cancel();  // no run: nothing happens
  CHECK(engine.run(Execute("ok", [](const ComputeContext&) {})).completed());
}

TEST_CASE("a run refused while it sets up gives back what it took: lanes and I/O-tile memory") {
  // Guards: when device 1's lane is refused after device 0's prefetch slots (I/O tiles) were
  // taken from its arena, the slots are given back; a refused run leaks no I/O-tile memory.
  DeviceGroup devices(2, kSmall);
  Engine engine(devices, with_link(1us, 256, 4, 2));
  InfeedQueue<Tensor> infeed(InfeedConfig{2, 16, 2});
  std::vector<Program> programs;
  for (std::uint32_t d = 0; d < 2; ++d) {
    Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 64);
    programs.push_back(Repeat(1, StreamCopy(infeed, x)));
  }
  const std::size_t before = devices[0].arena().used();
  {
    auto held = infeed.reader(1);  // lane 1 is someone else's
    CHECK(contains(error_of([&] { engine.run(programs); }), "already has a reader"));
  }
  CHECK(devices[0].arena().used() == before);
  // Lane 0 is free again, and the next run takes both lanes.
  auto p = infeed.make_producer();
  for (std::uint32_t d = 0; d < 2; ++d) REQUIRE(p.push_to(d, filled(64, 1.0f)));
  CHECK(engine.run(programs).completed());
  CHECK(devices[0].arena().used() == before);
}

TEST_CASE(
    "a std::stop_token stops a run: before the call nothing is taken, during it as cancel()") {
  // Guards: a stop token given to run() and cancel() both stop a run, however far its setup
  // has got.
  DeviceGroup devices(2, kSmall);
  for (const std::uint32_t io_tiles : {0u, 4u}) {
    CAPTURE(io_tiles);
    Engine engine(devices, with_link(1us, 256, io_tiles, 2));
    InfeedQueue<Tensor> infeed(InfeedConfig{2, 16, 2});
    std::vector<Program> programs;
    for (std::uint32_t d = 0; d < 2; ++d) {
      Buffer x = make_buffer(devices[d], "x", DType::kFloat32, 64);
      programs.push_back(Repeat(std::uint64_t{1} << 40, StreamCopy(infeed, x)));
    }
    {
      auto p = infeed.make_producer();
      for (std::uint32_t d = 0; d < 2; ++d) {
        for (int i = 0; i < 3; ++i) REQUIRE(p.push_to(d, filled(64, float(i))));
      }
    }
    std::stop_source stopped;
    stopped.request_stop();
    const EngineResult before = engine.run(programs, stopped.get_token());
    CHECK(before.status == RunStatus::kCancelled);
    CHECK(before.iterations == std::vector<std::uint64_t>{0, 0});
    CHECK(infeed.size_approx(0) == 3);  // nothing taken, not even by the I/O tiles
    CHECK(infeed.size_approx(1) == 3);
    // During: a std::jthread's destructor requests the stop (the run waits for more input).
    std::optional<EngineResult> during;
    {
      test::Rescue guard(10s, [&] { infeed.close(); });  // a lost stop: kEndOfData below
      {
        std::jthread host([&](std::stop_token stop) { during = engine.run(programs, stop); });
        while (infeed.size_approx(0) != 0 || infeed.size_approx(1) != 0) {
          std::this_thread::yield();  // it has taken all 6
        }
      }
      CHECK_FALSE(guard.fired());
    }
    REQUIRE(during.has_value());
    CHECK(during->status == RunStatus::kCancelled);
    // The engine runs again; a stop source that was never stopped changes nothing.
    std::stop_source unused;
    CHECK(engine.run(Execute("ok", [](const ComputeContext&) {}), unused.get_token()).completed());
  }
}

TEST_CASE("cancel() reaches a device inside a long modeled transfer (AllReduce, RemoteCopy)") {
  DeviceGroup devices(2, kSmall);
  EngineConfig config;
  config.device_link = LinkModel{1e3, 0ns};  // 1 kB/s: each transfer below models 20 s
  config.host_link = LinkModel{1e3, 0ns};
  Engine engine(devices, config);
  const auto twenty_kb = [](const ComputeContext&) { return std::size_t{20'000}; };
  std::thread canceller([&] {
    std::this_thread::sleep_for(20ms);
    engine.cancel();
  });
  const auto t0 = std::chrono::steady_clock::now();
  const EngineResult r =
      engine.run({AllReduce("grads", 2, twenty_kb), RemoteCopy("state in", false, twenty_kb)});
  const auto took = std::chrono::steady_clock::now() - t0;
  canceller.join();
  CHECK(r.status == RunStatus::kCancelled);
  CHECK(took < 5s);  // liveness, not speed: the modeled transfers take 20 s each
}

TEST_CASE("synthetic data: no host copies, seeded differently per device") {
  DeviceGroup devices(2, kSmall);
  EngineConfig c;
  c.synthetic_data = true;
  c.synthetic_fill = SyntheticFill::kRandomNormal;
  c.seed = 7;
  Engine engine(devices, c);
  InfeedQueue<Tensor> infeed(InfeedConfig{2});
  std::vector<Buffer> xs{make_buffer(devices[0], "x", DType::kFloat32, 256),
                         make_buffer(devices[1], "x", DType::kFloat32, 256)};
  std::vector<Program> ps;
  for (auto& x : xs) ps.push_back(Repeat(5, StreamCopy(infeed, x)));
  const EngineResult r = engine.run(ps);
  CHECK(r.completed());         // nothing was pushed: no host data needed
  CHECK(r.host_bytes_in == 0);  // and nothing crossed the link
  CHECK(r.host_wait == 0ns);
  const auto a = xs[0]->as<float>(), b = xs[1]->as<float>();
  CHECK_FALSE(std::equal(a.begin(), a.end(), b.begin()));
  double mean = 0, var = 0;
  for (float v : a) mean += v / 256.0;
  for (float v : a) var += (v - mean) * (v - mean) / 256.0;
  CHECK(std::abs(mean) < 0.3);
  CHECK(var > 0.6);
  CHECK(var < 1.5);
  // Same seed, same device: same data.
  std::vector<float> first(a.begin(), a.end());
  Engine again(devices, c);
  again.run(ps);
  CHECK(std::equal(first.begin(), first.end(), xs[0]->as<float>().begin()));
  CHECK(infeed.total_pushed(0) == 0);
}

TEST_CASE("FusedRepeat: runs as a whole program on an Engine, refused inside another node") {
  Device dev(0, kSmall);
  Engine engine(dev);
  int trips = 0;
  bool finished = false, delivered = false;
  const program::FusedRepeat fused(
      "counter", 7,
      [&](const program::LoopFrame& f) {
        for (std::uint64_t i = 0; i < 7; ++i) {
          f.ctx->iteration = i;
          ++trips;
          ++*f.trips_done;
        }
        return RunStatus::kCompleted;
      },
      [&](bool deliver) {
        finished = true;
        delivered = deliver;
      });
  const EngineResult r = engine.run(fused);
  CHECK(r.completed());
  CHECK(trips == 7);
  CHECK(r.iterations == std::vector<std::uint64_t>{7});
  CHECK(finished);
  CHECK(delivered);
  CHECK_THROWS_WITH_AS(engine.run(program::Sequence{fused}),
                       doctest::Contains("must be a device's whole program"), Error);
  CHECK_THROWS_WITH_AS(program::FusedRepeat("x", 1, nullptr, [](bool) {}),
                       doctest::Contains("the loop is empty"), Error);
}

TEST_SUITE_END();
