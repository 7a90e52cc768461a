// runtime/: loops::repeat (bspflow/loops/repeat.hpp) under load: exactly once with M
// producers x R replicas, counted and checksummed, for shared and per-replica outfeeds;
// backpressure from a slow device through a bounded lane; and 4 devices on 2 cores
// (oversubscribed) completing.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::kSmall;

namespace {
constexpr std::uint64_t kForever = std::numeric_limits<std::uint64_t>::max();
}  // namespace

TEST_SUITE_BEGIN("repeat_load");

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

TEST_SUITE_END();
