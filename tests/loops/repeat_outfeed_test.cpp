// runtime/: loops::repeat's outfeed (bspflow/loops/repeat.hpp): a cancel while a bounded
// outfeed is full keeps every entry the device wrote, and outfeed write-combining never
// holds entries back while the device waits for input, and keeps every entry, in order,
// across batch boundaries.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::kSmall;

TEST_SUITE_BEGIN("repeat_outfeed");

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

TEST_SUITE_END();
