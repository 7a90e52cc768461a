// A cheap clock for hot-path heuristics that only compare short intervals on one thread (the
// outfeed's write-combining: were the last few iterations fast?). Not for anything a user
// sees, and not for deadlines: use std::chrono::steady_clock for those.
//
// On x86 with an invariant TSC (it ticks at a constant rate in every power state, CPUID
// 0x80000007 EDX bit 8) the ticks are the CPU's time-stamp counter: rdtsc costs a third of
// steady_clock::now() on this project's 2-core VM (the vDSO reads the same counter, then
// scales it). Elsewhere the ticks are steady_clock's nanoseconds. The rate is measured once
// per process against steady_clock, so a duration converts to ticks without knowing the CPU's
// frequency.
//
// A thread that moves between cores whose counters disagree may see one odd interval: a
// heuristic built on these ticks must stay correct then (the outfeed hands its entries over
// sooner, or combines one more batch of at most tunables::kOutfeedCombine entries).
#pragma once

#include <chrono>
#include <cstdint>

namespace bspflow::detail {

struct TickRate {
  bool cycles = false;  // the ticks are the time-stamp counter (else steady_clock's ns)
  double per_ns = 1.0;  // ticks per nanosecond
};

// Once per process: the first call measures the counter against steady_clock (a few 100 us
// windows, each counter read bracketed by two clock reads, retried when a bracket shows the
// thread was held up); later calls return the same rate. Thread-safe.
const TickRate& tick_rate() noexcept;

// Now, in ticks of `rate` (from tick_rate()). Never blocks, never allocates, never throws.
inline std::uint64_t ticks_now([[maybe_unused]] const TickRate& rate) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  if (rate.cycles) return __builtin_ia32_rdtsc();
#endif
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch() /
                                    std::chrono::nanoseconds(1));
}

// A duration in ticks of `rate`, rounded down (at least 1 for a positive duration).
inline std::uint64_t ticks_in(const TickRate& rate, std::chrono::nanoseconds d) noexcept {
  if (d.count() <= 0) return 0;
  const auto t = static_cast<std::uint64_t>(static_cast<double>(d.count()) * rate.per_ns);
  return t == 0 ? 1 : t;
}

}  // namespace bspflow::detail
