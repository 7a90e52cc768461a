// The base room's waiting: spin_until's budget, a WaitPoint that parks and is woken, a
// timed wait that gives up, and one that is woken before its deadline
// (bspflow/base/detail/wait.hpp).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <bspflow/base/detail/wait.hpp>

using namespace bspflow::detail;
using bspflow::Spin;
using bspflow::StopFlag;
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

TEST_SUITE_END();
