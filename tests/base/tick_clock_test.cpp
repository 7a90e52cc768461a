// The base room's tick clock (bspflow/base/detail/tick_clock.hpp): its rate, measured once,
// agrees with steady_clock, and durations convert to ticks at that rate.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>

#include <bspflow/base/detail/tick_clock.hpp>

using namespace bspflow::detail;
using namespace std::chrono_literals;

TEST_SUITE_BEGIN("tick_clock");

TEST_CASE("the tick clock advances at its measured rate") {
  const TickRate& rate = tick_rate();
  REQUIRE(rate.per_ns > 0);
  // Both clocks over the same 50 ms: their ratio is the rate, whatever the sleep took (a tick
  // clock at the wrong rate would make the outfeed combine slow iterations' entries). Each
  // end's counter read sits between two clock reads; an end held up (preempted) is measured
  // again.
  auto mark = [&] {
    for (;;) {
      const auto before = std::chrono::steady_clock::now();
      const std::uint64_t ticks = ticks_now(rate);
      const auto after = std::chrono::steady_clock::now();
      if (after - before < 20us) return std::pair{before + (after - before) / 2, ticks};
    }
  };
  const auto [t0, c0] = mark();
  std::this_thread::sleep_for(50ms);
  const auto [t1, c1] = mark();
  REQUIRE(c1 > c0);
  const double ns = static_cast<double>((t1 - t0).count());
  CHECK(static_cast<double>(c1 - c0) / ns == doctest::Approx(rate.per_ns).epsilon(0.05));
}

TEST_CASE("durations convert to ticks at the rate") {
  const TickRate& rate = tick_rate();
  CHECK(ticks_in(rate, 0ns) == 0);
  CHECK(ticks_in(rate, -5ns) == 0);
  CHECK(ticks_in(rate, 1ns) >= 1);
  CHECK(static_cast<double>(ticks_in(rate, 2us)) ==
        doctest::Approx(2000 * rate.per_ns).epsilon(0.01));
  const TickRate ns_clock;  // steady_clock's nanoseconds
  CHECK(ticks_in(ns_clock, 2us) == 2000);
}

TEST_SUITE_END();
