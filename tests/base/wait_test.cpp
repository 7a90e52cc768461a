// The base room's waiting: spin_until's budget, a WaitPoint that parks and is woken, a
// timed wait that gives up, and one that is woken before its deadline
// (bspflow/base/detail/wait.hpp), and the tick clock that times the outfeed's write-combining
// (bspflow/base/detail/tick_clock.hpp).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include <bspflow/base/detail/tick_clock.hpp>
#include <bspflow/base/detail/wait.hpp>

using namespace bspflow::detail;
using namespace std::chrono_literals;

TEST_SUITE_BEGIN("wait");

TEST_CASE("spin_until returns true at once when ready, false after its budget") {
  CHECK(spin_until([] { return true; }));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(spin_until([] { return false; }, Spin::kBackoff, 200us));
  CHECK(std::chrono::steady_clock::now() - t0 >= 200us);
  CHECK_FALSE(spin_until([] { return false; }, Spin::kYield, 100us));
}

TEST_CASE("a parked waiter is woken by notify, for every spin mode") {
  for (Spin mode : {Spin::kTight, Spin::kBackoff, Spin::kYield}) {
    WaitPoint point;
    std::atomic<int> state{0};
    std::thread waiter([&] {
      point.wait([&] { return state.load(std::memory_order_seq_cst) == 1; }, mode,
                 Fence::kSymmetric, 1us);  // a tiny budget: it parks
      state.store(2, std::memory_order_seq_cst);
    });
    std::this_thread::sleep_for(5ms);
    CHECK(state.load() == 0);
    state.store(1, std::memory_order_seq_cst);
    point.notify();
    waiter.join();
    CHECK(state.load() == 2);
  }
}

TEST_CASE("wait_until gives up at the deadline and reports readiness") {
  WaitPoint point;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(point.wait_until([] { return false; }, t0 + 3ms));
  CHECK(std::chrono::steady_clock::now() - t0 >= 3ms);
  CHECK(point.wait_until([] { return true; }, t0));
}

TEST_CASE("a timed wait parks and is woken by notify before its deadline") {
  for (Spin mode : {Spin::kTight, Spin::kYield}) {
    WaitPoint point;
    std::atomic<int> state{0};
    bool got = false;
    std::thread waiter([&] {
      // A deadline far away: it returns because it was woken, not because time ran out.
      got = point.wait_until([&] { return state.load(std::memory_order_seq_cst) == 1; },
                             std::chrono::steady_clock::now() + 60s, mode, 1us);
      state.store(2, std::memory_order_seq_cst);
    });
    std::this_thread::sleep_for(5ms);
    CHECK(state.load() == 0);  // parked (or spinning), not returned
    state.store(1, std::memory_order_seq_cst);
    point.notify();
    waiter.join();
    CHECK(got);
    CHECK(state.load() == 2);
  }
}

TEST_CASE("a stop flag is seen once set") {
  StopFlag stop;
  CHECK_FALSE(stop.requested());
  stop.set();
  CHECK(stop.requested());
}

TEST_CASE("the tick clock advances at its measured rate") {
  const TickRate& rate = tick_rate();
  CHECK(&rate == &tick_rate());  // measured once
  REQUIRE(rate.per_ns > 0);
  // Both clocks over the same interval: their ratio is the rate, whatever the sleep took
  // (a tick clock at the wrong rate would make the outfeed combine slow iterations' entries).
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t c0 = ticks_now(rate);
  std::this_thread::sleep_for(20ms);
  const std::uint64_t c1 = ticks_now(rate);
  const auto ns = static_cast<double>((std::chrono::steady_clock::now() - t0).count());
  REQUIRE(c1 > c0);
  const double measured = static_cast<double>(c1 - c0) / ns;
  CHECK(measured == doctest::Approx(rate.per_ns).epsilon(0.1));
  CHECK(ticks_in(rate, 0ns) == 0);
  CHECK(ticks_in(rate, 1ns) >= 1);
  CHECK(static_cast<double>(ticks_in(rate, 2us)) ==
        doctest::Approx(2000 * rate.per_ns).epsilon(0.01));
}

TEST_SUITE_END();
