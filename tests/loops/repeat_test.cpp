// runtime/: loops::repeat (bspflow/loops/repeat.hpp) end to end (feeds -> devices ->
// outfeeds): loop state, with and without feeds, end of data, body exceptions, exactly once
// under load, output modes, backpressure, oversubscription, launch errors, prefetch buffers
// in device memory, outfeed write-combining, and BSPFLOW_TRACE.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using test::kSmall;

namespace {
constexpr std::uint64_t kForever = std::numeric_limits<std::uint64_t>::max();
}  // namespace

TEST_SUITE_BEGIN("repeat");

TEST_CASE("repeat runs n iterations on the device and returns the loop state") {
  Device device(0, kSmall);
  InfeedQueue<int> infeed;
  OutfeedQueue<int> outfeed;
  std::thread producer([&] {
    auto p = infeed.make_producer();
    for (int i = 0; i < 10; ++i) p.push(i);
  });
  std::atomic<bool> on_device{true};
  auto r = loops::repeat(
      device, 10,
      [&](int& counter, int& x, const Iteration& it) {
        on_device = on_device && device.on_device_thread();
        CHECK(it.index == static_cast<std::uint64_t>(x));
        ++counter;
        return x * x;
      },
      0, infeed, outfeed);
  producer.join();
  CHECK(r.completed());
  CHECK(r.state() == 10);
  CHECK(r.iterations == std::vector<std::uint64_t>{10});
  CHECK(on_device.load());
  auto entries = outfeed.drain();
  REQUIRE(entries.size() == 10);
  for (int i = 0; i < 10; ++i) CHECK(entries[i].value == i * i);
  // The lane and the outfeed are free again for the next host call.
  std::thread producer2([&] {
    auto p = infeed.make_producer();
    for (int i = 0; i < 5; ++i) p.push(i);
  });
  auto r2 = loops::repeat(
      device, 5,
      [](int& c, int& x) {
        c += x;
        return x;
      },
      0, infeed, outfeed);
  producer2.join();
  CHECK(r2.state() == 0 + 1 + 2 + 3 + 4);
  CHECK(outfeed.drain().size() == 5);
}

TEST_CASE("repeat without feeds, and with only an outfeed") {
  Device device(0, kSmall);
  CHECK(loops::repeat(
            device, 1000, [](std::uint64_t& s) { s += 2; }, std::uint64_t{0})
            .state() == 2000);
  OutfeedQueue<int> out(OutfeedConfig{1, OutputMode::final()});
  auto r = loops::repeat(
      device, 7,
      [](int& s, const Iteration& it) {
        s = int(it.index);
        return s * 10;
      },
      0, out);
  CHECK(r.state() == 6);
  auto e = out.drain();
  REQUIRE(e.size() == 1);
  CHECK(e[0].value == 60);
  CHECK(e[0].iteration == 6);
}

TEST_CASE("reading past a closed, drained infeed ends the loop with an end-of-data status") {
  Device device(0, kSmall);
  InfeedQueue<int> infeed;
  OutfeedQueue<int> outfeed(OutfeedConfig{1, OutputMode::sum()});
  auto p = infeed.make_producer();
  for (int i = 1; i <= 7; ++i) p.push(i);
  infeed.close();
  auto r = loops::repeat(
      device, 10,
      [](int& c, int& x) {
        ++c;
        return x;
      },
      0, infeed, outfeed);
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.end_of_data());
  CHECK(r.state() == 7);
  CHECK(r.iterations == std::vector<std::uint64_t>{7});
  CHECK(contains(r.message, "end of data"));
  CHECK(contains(r.message, "7 of 10 iterations"));
  auto sum = outfeed.drain();  // sum() of the iterations that ran
  REQUIRE(sum.size() == 1);
  CHECK(sum[0].value == 28);
}

TEST_CASE("a body exception reaches the host with device, replica and iteration") {
  DeviceGroup group(2, kSmall);
  InfeedQueue<int> infeed(InfeedConfig{2, 8, 1});
  OutfeedQueue<int> outfeed(OutfeedConfig{2});
  std::atomic<bool> producer_done{false};
  std::thread producer([&] {
    auto p = infeed.make_producer();
    // Far more than the loop takes: once the run fails, this producer blocks on a full
    // lane until the host closes the infeed.
    for (int i = 0; i < 100000 && p.push(i); ++i) {
    }
    producer_done = true;
  });
  auto body = [](int& c, int& x, const Iteration& it) {
    if (it.replica == 1 && it.index == 7)
      throw std::runtime_error("bad sample " + std::to_string(x));
    ++c;
    return x;
  };
  try {
    loops::repeat(group, 1000, body, 0, infeed, outfeed);
    FAIL("expected DeviceError");
  } catch (const DeviceError& e) {
    CHECK(e.device() == 1);
    CHECK(e.replica() == 1);
    CHECK(e.iteration() == 7);
    CHECK(contains(e.what(), "device 1 (replica 1) failed at iteration 7 of 1000: bad sample 15"));
    CHECK_THROWS_AS(e.rethrow_cause(), std::runtime_error);
  }
  infeed.close();  // releases the blocked producer
  producer.join();
  CHECK(producer_done.load());
  // Entries written before the failure are delivered: replica 1's iterations 0..6.
  std::vector<std::uint64_t> r1;
  for (auto& e : outfeed.drain()) {
    if (e.replica == 1) r1.push_back(e.iteration);
  }
  CHECK(r1 == std::vector<std::uint64_t>{0, 1, 2, 3, 4, 5, 6});
}

TEST_CASE("exactly once under load: M producers x R replicas, counted and checksummed") {
  constexpr int kProducers = 4;
  struct Shape {
    std::uint32_t replicas;
    ConsumerType readers;  // kSingle: the outfeed is a ring per replica
  };
  for (const Shape shape : {Shape{2, ConsumerType::kMulti}, Shape{3, ConsumerType::kMulti},
                            Shape{3, ConsumerType::kSingle}}) {
    const std::uint32_t replicas = shape.replicas;
    CAPTURE(replicas);
    CAPTURE(static_cast<int>(shape.readers));
    // Per producer a multiple of the replica count, so the round-robin split is exact.
    const std::uint64_t per = test::scaled(600000, 3000) / 6 * 6;
    const std::uint64_t total = per * kProducers;
    DeviceGroup group(replicas, kSmall);
    InfeedQueue<std::uint64_t> infeed(InfeedConfig{replicas, 512, 32});
    OutfeedConfig out_config{replicas, OutputMode::all(), 4096};
    out_config.consumer_type = shape.readers;
    OutfeedQueue<std::uint64_t> outfeed(out_config);
    auto run = loops::repeat_async(
        group, kForever,
        [](std::uint64_t& sum, std::uint64_t& x) {
          sum += x;
          return x;
        },
        std::uint64_t{0}, infeed, outfeed);
    std::vector<std::thread> producers;
    for (int id = 0; id < kProducers; ++id) {
      producers.emplace_back([&, id] {
        auto p = infeed.make_producer();
        for (std::uint64_t s = 0; s < per; ++s) CHECK(p.push((std::uint64_t(id) << 40) | s));
      });
    }
    std::thread closer([&] {
      for (auto& t : producers) t.join();
      infeed.close();
    });
    // Host reads the outfeed while the devices run.
    std::vector<std::vector<bool>> seen(kProducers, std::vector<bool>(per, false));
    std::vector<std::vector<std::uint64_t>> next(replicas,
                                                 std::vector<std::uint64_t>(kProducers, 0));
    std::uint64_t count = 0, dupes = 0, misrouted = 0, disordered = 0, checksum = 0;
    for (auto& e : outfeed) {
      const auto id = static_cast<int>(e.value >> 40);
      const std::uint64_t s = e.value & ((std::uint64_t{1} << 40) - 1);
      if (seen[id][s]) ++dupes;
      seen[id][s] = true;
      if (s % replicas != e.replica) ++misrouted;  // round-robin: element s -> replica s % R
      if (s < next[e.replica][id]) ++disordered;   // per producer, per replica order
      next[e.replica][id] = s + 1;
      checksum += e.value;
      ++count;
    }
    closer.join();
    auto r = run.get();
    std::uint64_t expect_sum = 0;
    for (std::uint64_t id = 0; id < kProducers; ++id)
      expect_sum += id * per * (std::uint64_t{1} << 40) + per * (per - 1) / 2;
    CHECK(r.status == RunStatus::kEndOfData);
    CHECK(count == total);
    CHECK(dupes == 0);
    CHECK(misrouted == 0);
    CHECK(disordered == 0);
    CHECK(checksum == expect_sum);
    std::uint64_t iters = 0, state_sum = 0;
    for (std::uint32_t k = 0; k < replicas; ++k) {
      CHECK(r.iterations[k] == total / replicas);
      iters += r.iterations[k];
      state_sum += r.state(k);
    }
    CHECK(iters == total);
    CHECK(state_sum == expect_sum);
  }
}

TEST_CASE("output modes through repeat on 2 replicas") {
  DeviceGroup group(2, kSmall);
  auto body = [](int& s, const Iteration& it) {
    s += 1;
    return int(it.replica * 100 + it.index);
  };
  SUBCASE("every_n(5), 10 iterations: iterations 4 and 9 of each replica") {
    OutfeedQueue<int> out(OutfeedConfig{2, OutputMode::every_n(5)});
    loops::repeat(group, 10, body, 0, out);
    auto e = out.drain();
    std::sort(e.begin(), e.end(), [](auto& a, auto& b) { return a.value < b.value; });
    REQUIRE(e.size() == 4);
    CHECK(e[0].value == 4);
    CHECK(e[1].value == 9);
    CHECK(e[2].value == 104);
    CHECK(e[3].value == 109);
  }
  SUBCASE("final") {
    OutfeedQueue<int> out(OutfeedConfig{2, OutputMode::final()});
    loops::repeat(group, 10, body, 0, out);
    auto e = out.drain();
    REQUIRE(e.size() == 2);
    CHECK(e[0].value % 100 == 9);
    CHECK(e[1].value % 100 == 9);
  }
  SUBCASE("sum") {
    OutfeedQueue<int> out(OutfeedConfig{2, OutputMode::sum()});
    loops::repeat(group, 10, body, 0, out);
    auto e = out.drain();
    REQUIRE(e.size() == 2);
    for (auto& x : e) CHECK(x.value == int(x.replica) * 1000 + 45);
  }
  SUBCASE("all") {
    OutfeedQueue<int> out(OutfeedConfig{2});
    loops::repeat(group, 10, body, 0, out);
    CHECK(out.drain().size() == 20);
  }
}

TEST_CASE("backpressure through a run: fast producer, slow device, bounded lane") {
  Device device(0, kSmall);
  constexpr std::size_t kCapacity = 16;
  const std::uint64_t n = test::scaled(2000, 200);
  InfeedQueue<std::vector<char>> infeed(InfeedConfig{1, kCapacity, 4});
  std::size_t peak = 0;
  std::thread producer([&] {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < n; ++i) {
      CHECK(p.push(std::vector<char>(1024, 'x')));
      peak = std::max(peak, infeed.size_approx(0));
    }
    infeed.close();
  });
  auto r = loops::repeat(
      device, kForever,
      [](std::uint64_t& bytes, std::vector<char>& v) {
        std::this_thread::sleep_for(20us);  // slow device
        bytes += v.size();
      },
      std::uint64_t{0}, infeed);
  producer.join();
  CHECK(r.end_of_data());
  CHECK(r.state() == n * 1024);
  CHECK(peak <= kCapacity);
}

TEST_CASE("4 devices on 2 cores (oversubscribed) complete") {
  constexpr std::uint32_t kDevices = 4;
  DeviceGroup group(kDevices, kSmall);
  const std::uint64_t per_replica = test::scaled(20000, 500);
  InfeedQueue<std::uint64_t> infeed(InfeedConfig{kDevices, 64, 4});
  OutfeedQueue<std::uint64_t> outfeed(OutfeedConfig{kDevices, OutputMode::sum()});
  auto run = loops::repeat_async(
      group, per_replica,
      [](std::uint64_t& c, std::uint64_t& x) {
        ++c;
        return x;
      },
      std::uint64_t{0}, infeed, outfeed);
  std::thread producer([&] {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < per_replica * kDevices; ++i) CHECK(p.push(i));
  });
  const bool finished = run.wait_for(120s);
  CHECK(finished);
  if (!finished) infeed.close();
  producer.join();
  auto r = run.get();
  CHECK(r.completed());
  std::uint64_t total = 0;
  for (auto& e : outfeed.drain()) total += e.value;
  const std::uint64_t n = per_replica * kDevices;
  CHECK(total == n * (n - 1) / 2);
}

TEST_CASE("bad launches are clear errors, before anything runs") {
  Device device(0, kSmall);
  InfeedQueue<int> two(InfeedConfig{2, 8, 1});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 1, [](int&, int&) {}, 0, two);
                 }),
                 "infeed has 2 replica lane(s) but the loop runs on 1 device(s)"));
  OutfeedQueue<int> out2(OutfeedConfig{2});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 1, [](int& s) { return s; }, 0, out2);
                 }),
                 "outfeed has 2 replica(s)"));
  OutfeedQueue<int> small(OutfeedConfig{1, OutputMode::all(), 5});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 10, [](int& s) { return s; }, 0, small);
                 }),
                 "outfeed capacity 5 < 10 entries"));
  {
    // One reader: each replica has a ring of `capacity` entries, so the bound is per replica.
    DeviceGroup pair(2, kSmall);
    OutfeedQueue<int> rings(OutfeedConfig{2, OutputMode::all(), 10, ConsumerType::kSingle});
    loops::repeat(
        pair, 10, [](int& s) { return s++; }, 0, rings);  // 2 x 10 entries: fits
    CHECK(rings.drain().size() == 20);
    const std::string e = error_of([&] {
      loops::repeat(
          pair, 11, [](int& s) { return s; }, 0, rings);
    });
    CHECK(contains(
        e, "outfeed capacity 10 per replica < 11 entries this run delivers to each replica"));
    CHECK(!contains(e, "0 = unbounded"));  // a ring has a bound
  }
  {
    // Guards: entries an earlier run left unread count against the bound. Counting this run's
    // entries only, the second call below would block on the full outfeed for ever (the
    // guard drains it after 10 s and the test fails).
    OutfeedQueue<int> shared(OutfeedConfig{1, OutputMode::all(), 10});
    loops::repeat(
        device, 6, [](int& s) { return s++; }, 0, shared);  // 6 of 10: fits, left unread
    test::Rescue guard(10s, [&] { (void)shared.drain(); });
    CHECK(error_of([&] {
            loops::repeat(
                device, 6, [](int& s) { return s; }, 0, shared);
          }) ==
          "outfeed capacity 10 < 6 entries already in it (unread, from an earlier run) + "
          "6 entries this run delivers, and loops::repeat reads nothing until the loop "
          "ends: read or drain() the outfeed first, use loops::repeat_async and read it "
          "while it runs, or raise the capacity (0 = unbounded)");
    CHECK_FALSE(guard.fired());
    guard.disarm();
    CHECK(shared.drain().size() == 6);  // what was there, untouched
    DeviceGroup pair(2, kSmall);
    OutfeedQueue<int> rings(OutfeedConfig{2, OutputMode::all(), 10, ConsumerType::kSingle});
    loops::repeat(
        pair, 6, [](int& s) { return s++; }, 0, rings);
    test::Rescue ring_guard(10s, [&] { (void)rings.drain(); });
    CHECK(contains(error_of([&] {
                     loops::repeat(
                         pair, 5, [](int& s) { return s; }, 0, rings);
                   }),
                   "outfeed capacity 10 per replica < 6 entries already in replica 0's ring "
                   "(unread, from an earlier run) + 5 entries this run delivers to each "
                   "replica"));
    CHECK_FALSE(ring_guard.fired());
    ring_guard.disarm();
    CHECK(rings.drain().size() == 12);
    loops::repeat(
        pair, 10, [](int& s) { return s; }, 0, rings);  // read: room for 10 again
    CHECK(rings.drain().size() == 20);
  }
  // A lane can feed one loop at a time.
  InfeedQueue<int> in;
  auto first = loops::repeat_async(
      device, 1, [](int&, int&) {}, 0, in);
  CHECK(contains(error_of([&] {
                   loops::repeat_async(
                       device, 1, [](int&, int&) {}, 0, in);
                 }),
                 "already has a reader"));
  first.cancel();
  CHECK(first.get().status == RunStatus::kCancelled);
  Run<int> empty;
  CHECK(contains(error_of([&] { empty.get(); }), "empty Run"));
}

TEST_CASE("a prefetch buffer that does not fit the device memory is an out-of-memory error") {
  Device device(0, DeviceConfig{4, 1024});                             // 4 KiB
  InfeedQueue<std::array<char, 512>> infeed(InfeedConfig{1, 64, 16});  // 8 KiB of prefetch
  try {
    loops::repeat(
        device, 1, [](int&, std::array<char, 512>&) {}, 0, infeed);
    FAIL("expected OutOfMemoryError");
  } catch (const OutOfMemoryError& e) {
    CHECK(contains(e.what(), "infeed prefetch buffer (replica 0)"));
    CHECK(contains(e.what(), "device 0"));
  }
  CHECK(device.arena().used() == 0);
  // ...and the lane was released: a loop that fits can use it.
  InfeedQueue<std::array<char, 512>> fits(InfeedConfig{1, 64, 2});
  fits.close();
  CHECK(loops::repeat(
            device, 3, [](int&, std::array<char, 512>&) {}, 0, fits)
            .end_of_data());
}

// Guards: a cancel that finds a bounded outfeed full (its reader has stopped) keeps the entries
// the device wrote, and the iterations count only what was kept.
TEST_CASE("a cancel while a bounded outfeed is full keeps every entry the device wrote") {
  for (const ConsumerType readers : {ConsumerType::kMulti, ConsumerType::kSingle}) {
    CAPTURE(readers == ConsumerType::kSingle);
    DeviceGroup group(2, kSmall);
    InfeedQueue<int> infeed(InfeedConfig{2, 64, 4});
    OutfeedConfig oc{2, OutputMode::all(), 3};
    oc.consumer_type = readers;
    OutfeedQueue<int> outfeed(oc);
    auto p = infeed.make_producer();
    for (int i = 0; i < 100; ++i) REQUIRE(p.push(i));
    infeed.close();
    Run<int> run = loops::repeat_async(
        group, 50,
        [](int& c, int& x) {
          ++c;
          return x;
        },
        0, infeed, outfeed);
    // Nobody reads: the devices fill the outfeed and wait for room.
    while (outfeed.size_approx() < 3) std::this_thread::yield();
    std::this_thread::sleep_for(5ms);
    run.cancel();
    const RepeatResult<int> r = run.get();
    CHECK(r.status == RunStatus::kCancelled);
    std::vector<std::uint64_t> per_replica(2, 0);
    for (const auto& e : outfeed.drain()) {
      CHECK(e.iteration == per_replica[e.replica]);  // in order, none missing
      ++per_replica[e.replica];
    }
    CHECK(per_replica[0] == r.iterations[0]);
    CHECK(per_replica[1] == r.iterations[1]);
    CHECK(r.state(0) == static_cast<int>(r.iterations[0]));
  }
}

TEST_CASE("outfeed write-combining never holds entries back while the device waits for input") {
  // Fast iterations stage their entries; the device must hand them over before it waits for
  // more input, or a host that reads before pushing more would wait forever.
  Device device(0, kSmall);
  InfeedQueue<int> infeed(InfeedConfig{1, 64, 4});
  OutfeedQueue<int> outfeed;
  auto run = loops::repeat_async(
      device, 20,
      [](int& s, int& x) {
        ++s;
        return x * 3;
      },
      0, infeed, outfeed);
  auto producer = infeed.make_producer();
  int expect = 0;
  for (int round = 0; round < 4; ++round) {
    for (int k = 0; k < 5; ++k) producer.push(round * 5 + k);
    for (int k = 0; k < 5; ++k) {  // readable now, with the device parked on the infeed
      std::optional<OutfeedEntry<int>> e;
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!(e = outfeed.try_pop()) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(100us);
      }
      if (!e) run.cancel();  // fail, do not hang
      REQUIRE_MESSAGE(e.has_value(), "entry " << expect << " was held back");
      CHECK(e->value == expect * 3);
      CHECK(e->iteration == static_cast<std::uint64_t>(expect));
      ++expect;
    }
  }
  const auto r = run.get();
  CHECK(r.completed());
  CHECK(r.state() == 20);
  CHECK_FALSE(outfeed.pop().has_value());
}

TEST_CASE("outfeed write-combining keeps every entry, in order, across batch boundaries") {
  Device device(0, kSmall);
  InfeedQueue<int> infeed(InfeedConfig{1, 1024, 32});
  OutfeedQueue<int> outfeed;
  constexpr int kN = 1000;  // not a multiple of the combining batch
  std::vector<int> values(kN);
  for (int i = 0; i < kN; ++i) values[i] = i;
  auto producer = infeed.make_producer();
  producer.push_bulk(0, values);
  const auto r = loops::repeat(
      device, kN, [](int&, int& x) { return x; }, 0, infeed, outfeed);
  CHECK(r.completed());
  int next = 0;
  for (auto& e : outfeed) {
    CHECK(e.value == next);
    CHECK(e.iteration == static_cast<std::uint64_t>(next));
    ++next;
  }
  CHECK(next == kN);
}

TEST_CASE("loops::repeat runs through the interpreter: BSPFLOW_TRACE traces it") {
  const std::string path = "bspflow_repeat_trace_test.json";
  ::setenv("BSPFLOW_TRACE", path.c_str(), 1);
  DeviceGroup devices(2, kSmall);
  InfeedQueue<int> infeed(InfeedConfig{2, 64, 2});
  OutfeedQueue<int> outfeed(OutfeedConfig{2});
  auto p = infeed.make_producer();
  const int n = 25;
  for (int i = 0; i < 2 * n; ++i) p.push(i);
  const auto r = loops::repeat(
      devices, n,
      [](int& s, int& x) {
        s += x;
        return x * 2;
      },
      0, infeed, outfeed);
  ::unsetenv("BSPFLOW_TRACE");
  CHECK(r.completed());
  REQUIRE(r.trace != nullptr);
  REQUIRE(r.trace->tracks().size() == 2);
  for (const TraceTrack& t : r.trace->tracks()) {
    int copies_in = 0, copies_out = 0, computes = 0;
    std::int64_t last_end = 0;
    for (const TraceEvent& e : t.events()) {
      CHECK(e.begin_ns >= last_end);  // phases follow each other on the device's timeline
      last_end = e.end_ns;
      if (e.phase == Phase::kStreamCopyMid) (e.to_host ? copies_out : copies_in)++;
      if (e.phase == Phase::kCompute) {
        ++computes;
        CHECK(t.label(e) == "loop body");
      }
    }
    CHECK(copies_in == n);
    CHECK(copies_out == n);
    CHECK(computes == n);
    CHECK(t.iterations() == static_cast<std::uint64_t>(n));
  }
  std::ifstream f(path);
  REQUIRE(f.good());
  CHECK(nlohmann::json::parse(f)["traceEvents"].size() > 4u * n);
  f.close();
  std::remove(path.c_str());
  // Without the variable nothing is recorded.
  for (int i = 0; i < 2; ++i) p.push(i);
  CHECK(loops::repeat(
            devices, 1,
            [](int& s, int& x) {
              s += x;
              return x;
            },
            0, infeed, outfeed)
            .trace == nullptr);
}

// ---- the device model on a loop's path: HostIO ----

namespace {
// n tensors of `elements` values of `dtype` per replica, then closed.
void feed_tensors(InfeedQueue<Tensor>& infeed, std::uint32_t replicas, std::uint64_t n, DType dtype,
                  std::size_t elements = 256) {
  auto p = infeed.make_producer();
  for (std::uint32_t r = 0; r < replicas; ++r) {
    for (std::uint64_t i = 0; i < n; ++i) p.push_to(r, Tensor(dtype, {elements}));
  }
  infeed.close();
}
}  // namespace

TEST_CASE(
    "HostIO: tensors cross the host link by their bytes; 8-bit I/O moves a quarter of fp32's") {
  for (std::uint32_t replicas : {1u, 2u}) {
    CAPTURE(replicas);
    auto run_with = [&](DType dtype) {
      DeviceGroup devices(replicas, kSmall);
      InfeedQueue<Tensor> infeed(InfeedConfig{replicas, 8, 2});
      feed_tensors(infeed, replicas, 6, dtype);
      OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{replicas, OutputMode::all(), 0});
      const auto r = loops::repeat(
          devices, 6,
          [](int& s, Tensor& t) {
            ++s;
            return std::vector<float>(t.elements() / 64, 1.0f);  // 4 floats out
          },
          0, infeed, outfeed, HostIO{});
      REQUIRE(r.completed());
      CHECK(outfeed.drain().size() == 6 * replicas);
      CHECK(r.host_bytes_out == 6 * replicas * 4 * sizeof(float));
      return r.host_bytes_in;
    };
    const std::uint64_t fp32 = run_with(DType::kFloat32);
    const std::uint64_t u8 = run_with(DType::kUint8);
    CHECK(fp32 == 6 * replicas * 256 * 4);
    CHECK(u8 * 4 == fp32);
    CHECK(run_with(DType::kFloat16) * 2 == fp32);
  }
}

TEST_CASE("HostIO: the outfeed's mode decides what crosses back; plain loops read no link") {
  auto out_bytes = [](OutputMode mode) {
    Device device(0, kSmall);
    OutfeedQueue<std::array<float, 8>> outfeed(OutfeedConfig{1, mode, 0});
    const auto r = loops::repeat(
        device, 10, [](int& s) { return std::array<float, 8>{float(++s)}; }, 0, outfeed, HostIO{});
    REQUIRE(r.completed());
    CHECK(r.host_bytes_in == 0);
    return r.host_bytes_out;
  };
  CHECK(out_bytes(OutputMode::all()) == 10 * 32);
  CHECK(out_bytes(OutputMode::every_n(5)) == 2 * 32);
  CHECK(out_bytes(OutputMode::final()) == 32);
  CHECK(out_bytes(OutputMode::sum()) == 32);
  // A loop cut short by the end of its data still sends final()'s and sum()'s one entry.
  for (OutputMode mode : {OutputMode::final(), OutputMode::sum()}) {
    CAPTURE(mode.to_string());
    Device device(0, kSmall);
    InfeedQueue<int> in(InfeedConfig{1, 4, 1});
    {
      auto p = in.make_producer();
      for (int i = 0; i < 3; ++i) p.push(i);
    }
    in.close();
    OutfeedQueue<std::array<float, 8>> outfeed(OutfeedConfig{1, mode, 0});
    const auto r = loops::repeat(
        device, 10,
        [](int& s, int& x) {
          s += x;
          return std::array<float, 8>{float(x)};
        },
        0, in, outfeed, HostIO{});
    CHECK(r.end_of_data());
    CHECK(r.host_bytes_in == 3 * sizeof(int));
    CHECK(r.host_bytes_out == 32);
    CHECK(outfeed.drain().size() == 1);
  }
  // Without a HostIO nothing is modeled.
  Device device(0, kSmall);
  InfeedQueue<Tensor> infeed(InfeedConfig{1, 4, 1});
  feed_tensors(infeed, 1, 3, DType::kFloat32);
  const auto plain = loops::repeat(
      device, 3, [](int& s, Tensor&) { ++s; }, 0, infeed);
  REQUIRE(plain.completed());
  CHECK(plain.host_bytes_in == 0);
  CHECK(plain.host_wait == 0ns);
}

TEST_CASE("HostIO: without I/O tiles each copy is waited for; with them copies overlap the body") {
  const auto d = 10ms;  // one tensor's copy, and the body
  constexpr std::uint64_t kTrips = 10;
  auto run_with = [&](std::uint32_t io_tiles) {
    Device device(0, kSmall);
    InfeedQueue<Tensor> infeed(InfeedConfig{1, kTrips, 2});
    feed_tensors(infeed, 1, kTrips, DType::kFloat32);
    HostIO config;
    config.host_link = LinkModel::taking(d, 1024);
    config.io_tiles = io_tiles;
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = loops::repeat(
        device, kTrips,
        [&](int& s, Tensor&) {
          ++s;
          std::this_thread::sleep_for(d);
        },
        0, infeed, config);
    const auto elapsed = std::chrono::steady_clock::now() - t0;
    REQUIRE(r.completed());
    CHECK(r.host_bytes_in == kTrips * 1024);
    return std::make_pair(r.host_wait, elapsed);
  };
  const auto [serial_wait, serial_elapsed] = run_with(0);
  CHECK(serial_wait >=
        kTrips * d);  // each copy waited out in full: a lower bound, not a timing guess
  CHECK(serial_elapsed >= 2 * kTrips * d);
  const auto [overlap_wait, overlap_elapsed] = run_with(2);
  // The first copy is waited for; the others ran while the body slept.
  CHECK(overlap_wait < kTrips * d / 2);
  (void)overlap_elapsed;
}

TEST_CASE("HostIO: synthetic data reads one element per replica, and nothing crosses the link") {
  DeviceGroup devices(2, kSmall);
  InfeedQueue<Tensor> infeed(InfeedConfig{2, 10, 1});
  feed_tensors(infeed, 2, 10, DType::kFloat32);
  OutfeedQueue<float> outfeed(OutfeedConfig{2, OutputMode::all(), 0});
  HostIO config;
  config.synthetic_data = true;
  config.host_link = LinkModel::taking(50ms, 1);  // would take minutes if copied
  const auto r = loops::repeat(
      devices, 30,
      [](int& s, Tensor& t) {
        // The same element every iteration, as the body left it.
        float& first = t.as<float>()[0];
        first += 1.0f;
        ++s;
        return first;
      },
      0, infeed, outfeed, config);
  REQUIRE(r.completed());
  CHECK(r.iterations == std::vector<std::uint64_t>{30, 30});
  CHECK(r.host_bytes_in == 0);
  CHECK(r.host_bytes_out == 0);
  CHECK(r.host_wait == 0ns);
  const auto entries = outfeed.drain();
  REQUIRE(entries.size() == 60);
  for (const auto& e : entries) CHECK(e.value == static_cast<float>(e.iteration + 1));
  // One element per lane was read; the other 9 are still there.
  for (std::uint32_t lane = 0; lane < 2; ++lane) {
    auto reader = infeed.reader(lane);
    std::uint64_t left = 0;
    for (Tensor t; reader.try_pop(t);) ++left;
    CHECK(left == 9);
  }
}

TEST_CASE("HostIO: from Options, and bad settings named with what is allowed") {
  Options o;
  o.host_link(LinkModel{2e9, 3us}).io_tiles(4).synthetic_data(true);
  const HostIO c = o.host_io();
  CHECK(c.host_link.bytes_per_second == 2e9);
  CHECK(c.host_link.latency == 3us);
  CHECK(c.io_tiles == 4);
  CHECK(c.synthetic_data);
  CHECK(EngineConfig::from(o).host_link.bytes_per_second == 2e9);
  CHECK(PipelineConfig::from(o).host_link.latency == 3us);
  CHECK(contains(o.describe(), "host_link = 2.0 GB/s, 3.0 us latency"));
  CHECK(contains(error_of([&] {
                   o.host_link(LinkModel{0.0, 1us});
                 }),
                 "host link bytes_per_second = 0 is not allowed"));
  CHECK(o.host_link().bytes_per_second == 2e9);  // not stored

  Device device(0, DeviceConfig{8, 1024});
  InfeedQueue<Tensor> infeed(InfeedConfig{1, 4, 4});
  feed_tensors(infeed, 1, 4, DType::kFloat32);  // 1 KiB each
  auto body = [](int& s, Tensor&) { ++s; };
  HostIO odd;
  odd.io_tiles = 3;
  CHECK(
      contains(error_of([&] { loops::repeat(device, 4, body, 0, infeed, odd); }), "io_tiles = 3"));
  HostIO all;
  all.io_tiles = 8;
  const std::string why = error_of([&] { loops::repeat(device, 4, body, 0, infeed, all); });
  CHECK(contains(why, "io_tiles = 8"));
  CHECK(contains(why, "below device 0's tiles (8)"));
  // 2 tiles x 1 KiB cannot hold prefetch_depth 4 x 1 KiB: the run ends with the device's error.
  HostIO small;
  small.io_tiles = 2;
  const std::string room = error_of([&] { loops::repeat(device, 4, body, 0, infeed, small); });
  CHECK(contains(room, "cannot hold prefetch_depth 4"));
  CHECK(contains(room, "raise io_tiles or lower prefetch_depth"));
  // The I/O tiles are taken from the arena for the run and given back.
  CHECK(device.arena().used() == 0);
}

namespace {
// A loop body that is slow to destroy: a copy still being destroyed after the caller's get()
// returned would still hold its token.
struct SlowToDestroy {
  std::shared_ptr<int> token;
  void operator()(int& s) const { s += *token; }
  SlowToDestroy(std::shared_ptr<int> t) : token(std::move(t)) {}  // NOLINT: implicit
  SlowToDestroy(const SlowToDestroy&) = default;
  SlowToDestroy(SlowToDestroy&&) noexcept = default;
  ~SlowToDestroy() {
    if (token) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
};
}  // namespace

TEST_CASE("a loop's copies of its body are gone when get() returns") {
  // The host thread frees them with the run's state in get() (the device threads freed them
  // after the run's end, so get() could return while a copy was still alive).
  DeviceGroup group(2, kSmall);
  auto token = std::make_shared<int>(1);
  for (int k = 0; k < 10; ++k) {
    auto run = loops::repeat_async(group, 10, SlowToDestroy(token), 0);
    const auto result = run.get();
    REQUIRE(result.status == RunStatus::kCompleted);
    CHECK(result.states == std::vector<int>{10, 10});
    CHECK(token.use_count() == 1);
  }
  {  // a handle dropped without get(): gone when its destructor returns
    InfeedQueue<int> infeed(InfeedConfig{2});
    auto run = loops::repeat_async(
        group, 10, [body = SlowToDestroy(token)](int& s, int&) { body(s); }, 0, infeed);
  }
  CHECK(token.use_count() == 1);
}

TEST_SUITE_END();
