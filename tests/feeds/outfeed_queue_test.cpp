// feeds/: OutfeedQueue (bspflow/feeds/outfeed_queue.hpp): what each output mode lets the host
// see per replica, sum() needing a summable type, runs (one at a time, reading outside one),
// and a reader on another thread while the writers run.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/feeds/outfeed_queue.hpp>
#include <bspflow/feeds/output_mode.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE("outfeed_queue") {

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
  const std::string msg =
      error_of([] { OutfeedQueue<Opaque> q(OutfeedConfig{1, OutputMode::sum()}); });
  CHECK(contains(msg, "sum()"));
}

TEST_CASE("outfeed runs: reading before a run ends at once; one run at a time") {
  OutfeedQueue<int> q;
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

TEST_CASE("a reader on another thread sees entries while writers run, then the end") {
  OutfeedQueue<int> q(OutfeedConfig{1, OutputMode::all(), 4});  // bounded: writer waits
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

}  // TEST_SUITE
