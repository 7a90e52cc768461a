// feeds/: OutfeedQueue (bspflow/feeds/outfeed_queue.hpp): what each output mode lets the host
// see per replica, sum() needing a summable type, runs (one at a time, reading outside one),
// and a reader on another thread while the writers run; all of these also with one reader
// (ConsumerType::kSingle: a ring per replica), plus its bound and its one-reader check, and
// write-combining handing a slow writer's entries over at once.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/feeds/outfeed_queue.hpp>
#include <bspflow/feeds/output_mode.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("outfeed_queue");

// Writes iterations 0..n-1 (value = iteration + 1) through one writer per replica.
template <class T, class Make>
std::vector<OutfeedEntry<T>> run_writers(OutfeedQueue<T>& q, std::uint64_t n, Make make) {
  auto writers = q.begin_run();
  for (std::uint32_t r = 0; r < writers.size(); ++r) {
    for (std::uint64_t i = 0; i < n; ++i) writers[r].write(i, make(r, i));
    writers[r].finish(true);
  }
  std::vector<OutfeedEntry<T>> out;
  for (auto& e : q) out.push_back(e);
  return out;
}

TEST_CASE("write-combining hands a slow writer's entries over as they are written") {
  // Entries written slower than tunables::kOutfeedCombineBelow apart must not wait in the
  // writer's staging for kOutfeedCombine more: only the writer's clock (the tick clock,
  // bspflow/base/detail/tick_clock.hpp) tells it they are slow. One thread, no timing
  // bound: each wait is at least 3 ms, far above the threshold.
  OutfeedQueue<int> q;
  auto writers = q.begin_run();
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    CHECK(writers[0].write(static_cast<std::uint64_t>(i), int{i}));
    const std::optional<OutfeedEntry<int>> e = q.try_pop();
    REQUIRE_MESSAGE(e.has_value(), "entry " << i << " of a slow writer was held back");
    CHECK(e->value == i);
  }
  writers[0].finish(true);
  CHECK_FALSE(q.try_pop().has_value());
}

TEST_CASE("outfeed modes shape what the host sees, per replica") {
  auto value = [](std::uint32_t r, std::uint64_t i) { return static_cast<int>(100 * r + i + 1); };
  SUBCASE("all") {
    OutfeedQueue<int> q(OutfeedConfig{2, OutputMode::all()});
    auto got = run_writers(q, 10, value);
    CHECK(got.size() == 20);
  }
  SUBCASE("every_n(5) with 10 iterations: iterations 4 and 9") {
    OutfeedQueue<int> q(OutfeedConfig{2, OutputMode::every_n(5)});
    auto got = run_writers(q, 10, value);
    REQUIRE(got.size() == 4);
    for (auto& e : got) {
      CHECK((e.iteration == 4 || e.iteration == 9));
      CHECK(e.value == value(e.replica, e.iteration));
    }
  }
  SUBCASE("final: the last iteration's entry per replica") {
    OutfeedQueue<int> q(OutfeedConfig{2, OutputMode::final()});
    auto got = run_writers(q, 10, value);
    REQUIRE(got.size() == 2);
    for (auto& e : got) {
      CHECK(e.iteration == 9);
      CHECK(e.value == value(e.replica, 9));
    }
  }
  SUBCASE("sum: element-wise over iterations, per replica") {
    OutfeedQueue<std::array<double, 3>> q(OutfeedConfig{2, OutputMode::sum()});
    auto got = run_writers(q, 10, [](std::uint32_t r, std::uint64_t i) {
      return std::array<double, 3>{double(i), 1.0, double(r)};
    });
    REQUIRE(got.size() == 2);
    for (auto& e : got) {
      CHECK(e.value[0] == 45.0);
      CHECK(e.value[1] == 10.0);
      CHECK(e.value[2] == 10.0 * e.replica);
    }
  }
}

TEST_CASE("sum() needs a summable type") {
  struct Opaque {
    int x = 0;
  };
  const std::string msg = error_of([] {
    OutfeedQueue<Opaque> q(OutfeedConfig{1, OutputMode::sum()});
  });
  CHECK(contains(msg, "sum()"));
}

OutfeedConfig config_for(ConsumerType readers, std::uint32_t replicas = 1,
                         OutputMode mode = OutputMode::all(), std::size_t capacity = 0) {
  OutfeedConfig c{replicas, mode, capacity};
  c.consumer_type = readers;
  if (readers == ConsumerType::kSingle && capacity == 0) c.capacity = 64;
  return c;
}

TEST_CASE("outfeed runs: reading before a run ends at once; one run at a time") {
  for (ConsumerType readers : {ConsumerType::kMulti, ConsumerType::kSingle}) {
    CAPTURE(static_cast<int>(readers));
    OutfeedQueue<int> q(config_for(readers));
    int seen = 0;
    for (auto& e : q) seen += e.value;  // no run attached: must not hang
    CHECK(seen == 0);
    auto writers = q.begin_run();
    CHECK(q.running());
    CHECK(contains(error_of([&] { q.begin_run(); }), "already attached"));
    writers[0].write(0, 5);
    CHECK(q.try_pop()->value == 5);
    CHECK_FALSE(q.try_pop().has_value());
    writers.clear();  // a writer destroyed unfinished ends its part of the run
    CHECK_FALSE(q.running());
    CHECK_FALSE(q.pop().has_value());
    auto again = q.begin_run();  // a second run on the same outfeed
    again[0].write(0, 7);
    again[0].finish(true);
    auto all = q.drain();
    REQUIRE(all.size() == 1);
    CHECK(all[0].value == 7);
  }
}

TEST_CASE("a reader on another thread sees entries while writers run, then the end") {
  for (ConsumerType readers : {ConsumerType::kMulti, ConsumerType::kSingle}) {
    CAPTURE(static_cast<int>(readers));
    OutfeedQueue<int> q(config_for(readers, 1, OutputMode::all(), 4));  // bounded: writer waits
    auto writers = q.begin_run();
    const int n = static_cast<int>(test::scaled(10000, 100));
    std::thread device([&] {
      for (int i = 0; i < n; ++i) CHECK(writers[0].write(static_cast<std::uint64_t>(i), int(i)));
      writers[0].finish(true);
    });
    int expect = 0;
    bool ordered = true;
    for (auto& e : q) {
      ordered = ordered && e.value == expect;
      ++expect;
      CHECK(q.size_approx() <= 4);
    }
    device.join();
    CHECK(ordered);
    CHECK(expect == n);
  }
}

TEST_CASE("one reader: a ring per replica; every entry once, in order per replica, then the end") {
  constexpr std::uint32_t kReplicas = 3;
  for (OutputMode mode : {OutputMode::all(), OutputMode::every_n(3), OutputMode::final()}) {
    CAPTURE(mode.to_string());
    // Capacity 4 per replica: the writers keep filling their rings and waiting for the reader.
    OutfeedQueue<int> q(config_for(ConsumerType::kSingle, kReplicas, mode, 4));
    const int n = static_cast<int>(test::scaled(20000, 300));
    for (int run = 0; run < 2; ++run) {  // the same outfeed serves a second run
      auto writers = q.begin_run();
      std::vector<std::thread> devices;
      for (std::uint32_t r = 0; r < kReplicas; ++r) {
        devices.emplace_back([&, r] {
          for (int i = 0; i < n; ++i)
            writers[r].write(static_cast<std::uint64_t>(i), int(r) * n + i);
          writers[r].finish(true);
        });
      }
      std::vector<std::int64_t> last(kReplicas, -1);
      std::vector<int> count(kReplicas, 0);
      bool ordered = true, right = true;
      for (auto& e : q) {
        ordered = ordered && static_cast<std::int64_t>(e.iteration) > last[e.replica];
        right = right && e.value == static_cast<int>(e.replica) * n + static_cast<int>(e.iteration);
        last[e.replica] = static_cast<std::int64_t>(e.iteration);
        ++count[e.replica];
      }
      const bool running_after_end = q.running();  // the end comes after the last writer left
      for (auto& t : devices) t.join();
      CHECK_FALSE(running_after_end);
      CHECK(ordered);
      CHECK(right);
      const int expect = mode.kind() == OutputMode::Kind::kAll     ? n
                         : mode.kind() == OutputMode::Kind::kFinal ? 1
                                                                   : n / 3;
      for (std::uint32_t r = 0; r < kReplicas; ++r) {
        CHECK(count[r] == expect);
        CHECK(last[r] == n - 1 - (mode.kind() == OutputMode::Kind::kEveryN ? (n % 3) : 0));
      }
      CHECK_FALSE(q.try_pop().has_value());
      CHECK_FALSE(q.running());
    }
  }
}

TEST_CASE("one reader: many short runs in a row, each delivered whole and then ended") {
  // The last writer ends a run by closing every replica's ring without a process-wide fence
  // (SpscLane::close_quiescent): the other writers are done. Short runs back to back, with
  // writers finishing on their own threads while the host reads, check that no entry of a
  // run is lost or seen after its end, and that every run ends.
  constexpr std::uint32_t kReplicas = 2;
  OutfeedQueue<int> q(config_for(ConsumerType::kSingle, kReplicas, OutputMode::all(), 16));
  const int runs = static_cast<int>(test::scaled(300, 30));
  constexpr int kPerReplica = 40;
  for (int run = 0; run < runs; ++run) {
    auto writers = q.begin_run();
    std::vector<std::thread> devices;
    for (std::uint32_t r = 0; r < kReplicas; ++r) {
      devices.emplace_back([&, r] {
        for (int i = 0; i < kPerReplica; ++i)
          writers[r].write(static_cast<std::uint64_t>(i), run * 1000 + int(r) * 100 + i);
        writers[r].finish(true);
      });
    }
    int count = 0;
    bool right = true;
    for (auto& e : q) {
      right = right && e.value / 1000 == run &&
              e.value % 1000 == int(e.replica) * 100 + int(e.iteration);
      ++count;
    }
    for (auto& t : devices) t.join();
    REQUIRE(count == kPerReplica * int(kReplicas));
    REQUIRE(right);
    REQUIRE_FALSE(q.running());
  }
}

TEST_CASE("size_approx(replica): a replica's ring with one reader, the shared queue otherwise") {
  for (const ConsumerType consumer : {ConsumerType::kMulti, ConsumerType::kSingle}) {
    CAPTURE(consumer == ConsumerType::kSingle);
    OutfeedQueue<int> q(OutfeedConfig{2, OutputMode::all(), 8, consumer});
    auto writers = q.begin_run();
    for (std::uint64_t i = 0; i < 3; ++i) writers[0].write(i, 1);
    writers[1].write(0, 2);
    for (auto& w : writers) w.finish(true);
    CHECK(q.size_approx() == 4);
    CHECK(q.size_approx(0) == (consumer == ConsumerType::kSingle ? 3 : 4));
    CHECK(q.size_approx(1) == (consumer == ConsumerType::kSingle ? 1 : 4));
    (void)q.drain();
    CHECK(q.size_approx(0) == 0);
  }
}

TEST_CASE("keep_dropped: the entries a stopped writer drops, in the order written") {
  // A ring of 31 entries keeps 33 spare slots for a stopped run (64 in all): of 100 entries
  // written after a stop, 64 go in and 36 are dropped, into the caller's vector.
  OutfeedQueue<int> q(OutfeedConfig{1, OutputMode::all(), 31, ConsumerType::kSingle});
  std::vector<OutfeedEntry<int>> dropped;
  auto writers = q.begin_run();
  writers[0].keep_dropped(&dropped);
  StopFlag stop;
  stop.set();
  for (int i = 0; i < 100; ++i) writers[0].write(static_cast<std::uint64_t>(i), int{i}, &stop);
  writers[0].finish(true, &stop);
  CHECK(writers[0].dropped() == dropped.size());
  const auto kept = q.drain();
  CHECK(kept.size() + dropped.size() == 100);
  CHECK(dropped.size() == 36);
  std::vector<int> all;
  for (const auto& e : kept) all.push_back(e.value);
  for (const auto& e : dropped) all.push_back(e.value);
  for (int i = 0; i < 100; ++i) CHECK(all[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("one reader: a ring needs a bound, and two threads reading at once is an error") {
  OutfeedConfig unbounded;
  unbounded.consumer_type = ConsumerType::kSingle;
  const std::string why = error_of([&] { OutfeedQueue<int> q(unbounded); });
  CHECK(contains(why, "capacity"));
  CHECK(contains(why, "kMulti"));

  for (std::uint32_t replicas : {1u, 2u}) {
    CAPTURE(replicas);
    OutfeedQueue<int> q(config_for(ConsumerType::kSingle, replicas));
    auto writers = q.begin_run();
    std::optional<OutfeedEntry<int>> got;
    std::thread reader([&] { got = q.pop(); });  // parks: nothing written yet
    // The second reader is caught as soon as the first one is inside pop().
    std::string second = "<no error>";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (second == "<no error>" && std::chrono::steady_clock::now() < deadline) {
      second = error_of([&] { (void)q.try_pop(); });
      if (second == "<no error>") std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(contains(second, "one reader at a time"));
    writers[replicas - 1].write(0, 42);  // the parked reader gets it
    for (auto& w : writers) w.finish(true);
    reader.join();
    REQUIRE(got.has_value());
    CHECK(got->value == 42);
    CHECK(got->replica == replicas - 1);
    CHECK_FALSE(q.pop().has_value());  // one thread again: fine, and the run has ended
  }
}

TEST_SUITE_END();
