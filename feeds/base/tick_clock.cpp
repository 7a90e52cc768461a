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

using Clock = std::chrono::steady_clock;

std::int64_t clock_ns() noexcept {
  return static_cast<std::int64_t>(Clock::now().time_since_epoch() / std::chrono::nanoseconds(1));
}

// One counter read between two clock reads: when the counter was read (the bracket's middle)
// and how wide the bracket was (a preemption or an interrupt widens it).
struct Stamp {
  std::int64_t ns;
  std::uint64_t ticks;
  std::int64_t spread;
};
Stamp stamp(const TickRate& rate) noexcept {
  const std::int64_t before = clock_ns();
  const std::uint64_t ticks = ticks_now(rate);
  const std::int64_t after = clock_ns();
  return {before + (after - before) / 2, ticks, after - before};
}

TickRate measure() noexcept {
  TickRate rate;
  if (!invariant_tsc()) return rate;
  rate.cycles = true;
  // Windows of 100 us; the error of one is its two brackets' spread over its length. Keep
  // the best of up to 5, and stop at the first whose brackets are both narrow (<= 1 us: an
  // error of 1% at most).
  constexpr std::int64_t kWindow = 100'000;
  constexpr std::int64_t kNarrow = 1'000;
  double best = 0;
  std::int64_t best_spread = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    const Stamp a = stamp(rate);
    while (clock_ns() - a.ns < kWindow) {
    }
    const Stamp b = stamp(rate);
    if (b.ticks <= a.ticks || b.ns <= a.ns) continue;  // a counter that went backwards
    const std::int64_t spread = a.spread + b.spread;
    if (best == 0 || spread < best_spread) {
      best = static_cast<double>(b.ticks - a.ticks) / static_cast<double>(b.ns - a.ns);
      best_spread = spread;
    }
    if (a.spread <= kNarrow && b.spread <= kNarrow) break;
  }
  if (best <= 0) return TickRate{};  // a counter that did not advance: not usable
  rate.per_ns = best;
  return rate;
}

}  // namespace

const TickRate& tick_rate() noexcept {
  static const TickRate rate = measure();
  return rate;
}

}  // namespace bspflow::detail
