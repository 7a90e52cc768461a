// The tick clock's rate (see bspflow/base/detail/tick_clock.hpp).
#include "bspflow/base/detail/tick_clock.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace bspflow::detail {

namespace {

bool invariant_tsc() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0x80000000u, &eax, &ebx, &ecx, &edx) == 0 || eax < 0x80000007u) return false;
  return __get_cpuid(0x80000007u, &eax, &ebx, &ecx, &edx) != 0 && (edx & (1u << 8)) != 0;
#else
  return false;
#endif
}

TickRate measure() noexcept {
  TickRate rate;
  if (!invariant_tsc()) return rate;
  rate.cycles = true;
  // Both clocks over the same ~20 us (a preemption in between lengthens both alike).
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  const std::uint64_t c0 = ticks_now(rate);
  Clock::time_point t1 = t0;
  while (t1 - t0 < std::chrono::microseconds(20)) t1 = Clock::now();
  const std::uint64_t c1 = ticks_now(rate);
  const double ns = static_cast<double>((t1 - t0) / std::chrono::nanoseconds(1));
  if (c1 <= c0 || ns <= 0) return TickRate{};  // a counter that did not advance: not usable
  rate.per_ns = static_cast<double>(c1 - c0) / ns;
  return rate;
}

}  // namespace

const TickRate& tick_rate() noexcept {
  static const TickRate rate = measure();
  return rate;
}

}  // namespace bspflow::detail
