// WaitPolicy (see bspflow/base/wait_policy.hpp).
#include "bspflow/base/wait_policy.hpp"

#include <algorithm>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {

const char* to_string(WaitStrategy s) noexcept {
  switch (s) {
    case WaitStrategy::kBusySpin:
      return "busy_spin";
    case WaitStrategy::kSpinThenPark:
      return "spin_then_park";
    case WaitStrategy::kPark:
      return "park";
  }
  return "?";
}

void WaitPolicy::validate() const {
  if (strategy != WaitStrategy::kBusySpin && strategy != WaitStrategy::kSpinThenPark &&
      strategy != WaitStrategy::kPark) {
    detail::throw_bad_value("wait strategy", static_cast<std::uint64_t>(strategy),
                            "use busy_spin, spin_then_park or park");
  }
  if (strategy == WaitStrategy::kSpinThenPark &&
      (spin.count() < 0 || spin > tunables::kMaxSpinBudget)) {
    detail::throw_bad_value(
        "spin_then_park budget", spin,
        "must be in 0 ns.." + detail::describe_duration(tunables::kMaxSpinBudget));
  }
}

WaitPolicy WaitPolicy::capped_for_sharing(CoreSharing with) const noexcept {
  WaitPolicy p = *this;
  if (with == CoreSharing::kDevices) {
    if (p.strategy == WaitStrategy::kBusySpin) {
      p.strategy = WaitStrategy::kSpinThenPark;
      p.spin = tunables::kDeviceSharedSpinBudget;
    } else if (p.strategy == WaitStrategy::kSpinThenPark) {
      p.spin = std::max(p.spin, tunables::kDeviceSharedSpinBudget);
    }
  } else if (p.strategy == WaitStrategy::kBusySpin) {
    p.strategy = WaitStrategy::kSpinThenPark;
    p.spin = tunables::kSharedCoreSpinBudget;
  } else if (p.strategy == WaitStrategy::kSpinThenPark) {
    p.spin = std::min(p.spin, tunables::kSharedCoreSpinBudget);
  }
  p.yields = true;
  return p;
}

}  // namespace bspflow
