/// @file
/// WaitPolicy: how a thread that must wait for another one waits, chosen at run time (the
/// LMAX Disruptor's wait strategies, in three kinds), and how a waiter that shares its core
/// adjusts it (WaitPolicy::capped_for_sharing()). Guide: feeds/README.md.
#pragma once

#include <chrono>
#include <cstdint>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/spin.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

/// kBusySpin: spin until the condition holds (the lowest latency; the core is busy all the
/// time, so only for a thread with a core of its own). kSpinThenPark (the default): spin for
/// WaitPolicy::spin, then park on a futex until woken. kPark: park at once.
enum class WaitStrategy { kBusySpin, kSpinThenPark, kPark };

/// Who else runs on a waiter's core.
enum class CoreSharing { kDevices, kHostThread };

/// "busy_spin", "spin_then_park", "park".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(WaitStrategy s) noexcept;

/// A strategy and, for kSpinThenPark, its spin budget. A plain value.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct WaitPolicy {
  /// How a wait proceeds: busy-spin, spin then park, or park at once.
  WaitStrategy strategy = WaitStrategy::kSpinThenPark;
  std::chrono::nanoseconds spin = tunables::kSpinBudget;  ///< kSpinThenPark: 0..kMaxSpinBudget

  /// A policy that spins until the condition holds.
  static WaitPolicy busy_spin() noexcept { return {WaitStrategy::kBusySpin, {}}; }
  /// A policy that spins for `budget`, then parks until woken.
  static WaitPolicy spin_then_park(
      std::chrono::nanoseconds budget = tunables::kSpinBudget) noexcept {
    return {WaitStrategy::kSpinThenPark, budget};
  }
  /// A policy that parks at once.
  static WaitPolicy park() noexcept { return {WaitStrategy::kPark, {}}; }

  /// Checks every field.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
  /// This policy as a waiter that shares its core should use it; waits yield between checks.
  /// Beside a host thread (kHostThread): busy-spin and long spins become spin-then-park with
  /// at most kSharedCoreSpinBudget. On a core of devices only (kDevices): busy-spin and
  /// spin-then-park spin at least kDeviceSharedSpinBudget. park() stays park().
  WaitPolicy capped_for_sharing(CoreSharing with = CoreSharing::kHostThread) const noexcept;
  /// Whether waits yield the core between checks (a capped policy does).
  bool yields = false;

  /// How a wait under this policy spins before it parks: yielding the core or not.
  Spin spin_mode() const noexcept { return yields ? Spin::kYield : Spin::kTight; }
  /// How long a wait under this policy spins before it parks (busy-spin: for as long as it
  /// takes; park: not at all).
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

/// Waits on `point` until ready() holds, the way `policy` says. ready() must include any stop
/// condition the caller has. `fence`: see WaitPoint::wait.
template <class Ready>
void wait_with(WaitPoint& point, const WaitPolicy& policy, Ready&& ready,
               Fence fence = Fence::kSymmetric) {
  point.wait(ready, policy.spin_mode(), fence, policy.spin_budget());
}

}  // namespace detail
}  // namespace bspflow
