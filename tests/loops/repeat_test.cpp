// runtime/: loops::repeat (bspflow/loops/repeat.hpp) end to end (feeds -> devices ->
// outfeeds): loop state, with and without feeds, end of data, body exceptions, output modes,
// BSPFLOW_TRACE, and the loop's copies of its body gone when get() returns. Its load, launch
// errors, outfeed handling and HostIO are in repeat_load_test.cpp, repeat_launch_test.cpp,
// repeat_outfeed_test.cpp and repeat_host_io_test.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::kSmall;

namespace {
// A loop body that is slow to destroy: a copy still being destroyed after the caller's get()
// returned would still hold its token.
struct SlowToDestroy {
  std::shared_ptr<int> token;
  void operator()(int& s) const { s += *token; }
  // NOLINTNEXTLINE(google-explicit-constructor): made from its token where a body is expected
  SlowToDestroy(std::shared_ptr<int> t) : token(std::move(t)) {}
  SlowToDestroy(const SlowToDestroy&) = default;
  SlowToDestroy(SlowToDestroy&&) noexcept = default;
  ~SlowToDestroy() {
    if (token) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
};
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
