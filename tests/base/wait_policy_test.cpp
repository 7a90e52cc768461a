// The base room's wait policies (bspflow/base/wait_policy.hpp): validation, capping for a
// shared core, and that each strategy wakes a waiter.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <bspflow/base/wait_policy.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::error_of;

TEST_SUITE_BEGIN("wait_policy");

TEST_CASE("policies validate their budget") {
  CHECK(error_of([] { WaitPolicy::spin_then_park(-1ns).validate(); }) ==
        "spin_then_park budget = -1 ns is not allowed: must be in 0 ns..1 s");
  CHECK(error_of([] { WaitPolicy::spin_then_park(2s).validate(); }) ==
        "spin_then_park budget = 2 s is not allowed: must be in 0 ns..1 s");
  CHECK(error_of([] { WaitPolicy::busy_spin().validate(); }) == "<no error>");
  CHECK(error_of([] { WaitPolicy::park().validate(); }) == "<no error>");
  CHECK(std::string(to_string(WaitStrategy::kBusySpin)) == "busy_spin");
  CHECK(std::string(to_string(WaitStrategy::kSpinThenPark)) == "spin_then_park");
  CHECK(std::string(to_string(WaitStrategy::kPark)) == "park");
}

TEST_CASE("a shared core caps busy-spin and long spins, and yields") {
  const WaitPolicy busy = WaitPolicy::busy_spin().capped_for_sharing();
  CHECK(busy.strategy == WaitStrategy::kSpinThenPark);
  CHECK(busy.spin == tunables::kSharedCoreSpinBudget);
  CHECK(busy.yields);
  const WaitPolicy long_spin = WaitPolicy::spin_then_park(1ms).capped_for_sharing();
  CHECK(long_spin.spin == tunables::kSharedCoreSpinBudget);
  const WaitPolicy short_spin = WaitPolicy::spin_then_park(1us).capped_for_sharing();
  CHECK(short_spin.spin == 1us);
  CHECK(WaitPolicy::park().capped_for_sharing().strategy == WaitStrategy::kPark);
}

TEST_CASE("a core shared by devices only: waits yield and spin at least the device budget") {
  const WaitPolicy busy = WaitPolicy::busy_spin().capped_for_sharing(CoreSharing::kDevices);
  CHECK(busy.strategy == WaitStrategy::kSpinThenPark);
  CHECK(busy.spin == tunables::kDeviceSharedSpinBudget);
  CHECK(busy.yields);
  const WaitPolicy short_spin =
      WaitPolicy::spin_then_park(1us).capped_for_sharing(CoreSharing::kDevices);
  CHECK(short_spin.spin == tunables::kDeviceSharedSpinBudget);
  CHECK(short_spin.yields);
  const WaitPolicy long_spin =
      WaitPolicy::spin_then_park(1ms).capped_for_sharing(CoreSharing::kDevices);
  CHECK(long_spin.spin == 1ms);
  const WaitPolicy park = WaitPolicy::park().capped_for_sharing(CoreSharing::kDevices);
  CHECK(park.strategy == WaitStrategy::kPark);
  CHECK(park.spin_budget() == 0ns);
}

TEST_CASE("every strategy wakes its waiter") {
  for (const WaitPolicy& policy :
       {WaitPolicy::busy_spin(), WaitPolicy::spin_then_park(1us), WaitPolicy::park(),
        WaitPolicy::busy_spin().capped_for_sharing()}) {
    detail::WaitPoint point;
    std::atomic<int> state{0};
    std::thread waiter([&] {
      detail::wait_with(point, policy, [&] { return state.load(std::memory_order_seq_cst) == 1; });
      state.store(2, std::memory_order_seq_cst);
    });
    std::this_thread::sleep_for(2ms);
    state.store(1, std::memory_order_seq_cst);
    point.notify();
    waiter.join();
    CHECK(state.load() == 2);
  }
}

TEST_SUITE_END();
