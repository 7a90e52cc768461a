// WaitPolicy: how a thread that must wait for another one waits, chosen at run time (the
// LMAX Disruptor's wait strategies, in three kinds).
//
//   kBusySpin     spin until the condition holds. The lowest latency (the waiter sees a
//                 change within ~100 ns) and the highest cost: the core is busy all the
//                 time, even when nothing arrives. Only for a thread with a core of its own.
//   kSpinThenPark spin for `spin` (default tunables::kSpinBudget, 20 us), then park on a
//                 futex until woken. Costs a futex wake (a few us, 10-30 us on a VM) only
//                 after a gap longer than the budget. The default.
//   kPark         park at once. No CPU while idle; every wait that is not satisfied at once
//                 pays a futex wake.
//
// A waiter that shares its core yields between checks (see capped_for_sharing()). Beside a
// host thread the application reserved, which may spin without yielding, it never spins long
// there (at most tunables::kSharedCoreSpinBudget); on a core shared by devices only, which
// all yield, it spins at least tunables::kDeviceSharedSpinBudget before it parks.
#pragma once

#include <chrono>
#include <cstdint>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/spin.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

enum class WaitStrategy { kBusySpin, kSpinThenPark, kPark };

// Who else runs on a waiter's core.
enum class CoreSharing { kDevices, kHostThread };

// Any thread. "busy_spin", "spin_then_park", "park". Never blocks, never throws.
const char* to_string(WaitStrategy s) noexcept;

struct WaitPolicy {
  WaitStrategy strategy = WaitStrategy::kSpinThenPark;
  std::chrono::nanoseconds spin = tunables::kSpinBudget;  // kSpinThenPark: 0..kMaxSpinBudget

  static WaitPolicy busy_spin() noexcept { return {WaitStrategy::kBusySpin, {}}; }
  static WaitPolicy spin_then_park(
      std::chrono::nanoseconds budget = tunables::kSpinBudget) noexcept {
    return {WaitStrategy::kSpinThenPark, budget};
  }
  static WaitPolicy park() noexcept { return {WaitStrategy::kPark, {}}; }

  // Any thread. Throws bspflow::Error naming the field, the value and what is allowed.
  void validate() const;
  // Any thread. This policy as a waiter that shares its core should use it; waits yield
  // between checks. Beside a host thread (kHostThread): busy-spin and long spins become
  // spin-then-park with at most kSharedCoreSpinBudget. On a core of devices only (kDevices):
  // busy-spin and spin-then-park spin at least kDeviceSharedSpinBudget. park() stays park().
  // Never throws.
  WaitPolicy capped_for_sharing(CoreSharing with = CoreSharing::kHostThread) const noexcept;
  // Whether waits yield the core between checks (a capped policy does).
  bool yields = false;

  // How a wait under this policy spins before it parks, and for how long (busy-spin: for
  // as long as it takes; park: not at all). Never throws.
  Spin spin_mode() const noexcept { return yields ? Spin::kYield : Spin::kTight; }
  std::chrono::nanoseconds spin_budget() const noexcept {
    switch (strategy) {
      case WaitStrategy::kBusySpin:
        return std::chrono::hours(24 * 365);
      case WaitStrategy::kSpinThenPark:
        return spin;
      case WaitStrategy::kPark:
        return std::chrono::nanoseconds{0};
    }
    return spin;
  }
};

namespace detail {

// Waits on `point` until ready() holds, the way `policy` says. ready() must include any stop
// condition the caller has. `fence`: see WaitPoint::wait.
template <class Ready>
void wait_with(WaitPoint& point, const WaitPolicy& policy, Ready&& ready,
               Fence fence = Fence::kSymmetric) {
  point.wait(ready, policy.spin_mode(), fence, policy.spin_budget());
}

}  // namespace detail
}  // namespace bspflow
