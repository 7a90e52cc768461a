// Spin-then-park waiting, shared by every queue and by run completion.
//
// A waiter spins for tunables::kSpinBudget with a CPU pause hint, then parks on a futex
// (std::atomic<uint32_t>::wait). A notifier pays one load when nobody is parked (after a
// seq_cst change, or a light fence for notify_light()), and a futex wake when somebody is. Spinning
// alone would livelock when threads outnumber cores (4 emulated devices on 2 cores); parking alone
// would add tens of microseconds to every hand-off.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "bspflow/base/detail/fence.hpp"
#include "bspflow/base/spin.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

using bspflow::Spin;      // (public, bspflow/base/spin.hpp; kept so older code compiles)
using bspflow::StopFlag;  // (public, bspflow/base/stop_flag.hpp; likewise)

// Spins while !ready() for at most `budget`. Returns true as soon as ready() holds.
template <class Ready>
bool spin_until(Ready&& ready, Spin mode = Spin::kTight,
                std::chrono::nanoseconds budget = tunables::kSpinBudget) {
  if (ready()) return true;
  const auto deadline = std::chrono::steady_clock::now() + budget;
  unsigned pauses = 1;
  for (unsigned i = 1;; ++i) {
    if (mode == Spin::kYield) {
      std::this_thread::yield();
      if (ready()) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      continue;
    }
    for (unsigned k = 0; k < pauses; ++k) cpu_relax();
    if (ready()) return true;
    if (mode == Spin::kBackoff && pauses < 64) pauses *= 2;
    // Reading the clock costs ~20 ns; once every 64 checks keeps it off the fast path.
    if ((i & 63u) == 0 && std::chrono::steady_clock::now() >= deadline) return false;
  }
}

// Which notifies a wait must pair with: notify() only, or notify_light() too.
enum class Fence { kSymmetric, kAsymmetric };

// One parking spot. Waiters call wait(ready); whoever changes what ready() reads calls
// notify() afterwards. Correct for any number of waiters and notifiers.
class alignas(tunables::kCacheLine) WaitPoint {
 public:
  // Any thread. Never blocks, never allocates. Call after changing what ready() reads, and
  // make that change a seq_cst atomic operation (an RMW such as fetch_add or a CAS, or a
  // seq_cst store): with the seq_cst load below and the waiter's seq_cst increment before it
  // re-reads the state, either the waiter sees the change or we see the waiter (a Dekker
  // pair; no lost wake-up) without a separate fence on this hot path.
  void notify() noexcept {
    if (waiters_.load(std::memory_order_seq_cst) != 0) wake();
  }

  // Like notify(), after a change made with a plain (relaxed or release) store, for hot
  // paths that cannot afford a locked instruction. Only for a WaitPoint whose waiters pass
  // Fence::kAsymmetric: their heavy fence pairs with the light one here.
  void notify_light() noexcept {
    light_fence();
    if (waiters_.load(std::memory_order_relaxed) != 0) wake();  // relaxed: ordered by the fences
  }

  // Any thread. Blocks (spin, then park) until ready() returns true. ready() must be
  // cheap, read the state with seq_cst loads, and that state's writers must call notify()
  // (or notify_light(), see Fence) after they change it.
  // Fence::kAsymmetric: some notifier uses notify_light(); parking then costs a heavy fence
  // (a process-wide barrier, microseconds) on top of the futex wait.
  // `budget`: how long to spin before parking.
  template <class Ready>
  void wait(Ready&& ready, Spin mode = Spin::kTight, Fence fence = Fence::kSymmetric,
            std::chrono::nanoseconds budget = tunables::kSpinBudget) {
    if (spin_until(ready, mode, budget)) return;
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    if (fence == Fence::kAsymmetric) heavy_fence();  // pairs with notify_light()
    for (;;) {
      const std::uint32_t seen = epoch_.load(std::memory_order_acquire);
      if (ready()) break;
      epoch_.wait(seen, std::memory_order_acquire);
    }
    // relaxed: only a hint for notifiers; a stale non-zero costs one spurious wake.
    waiters_.fetch_sub(1, std::memory_order_relaxed);
  }

  // Like wait(), but gives up at `deadline`. Returns ready().
  template <class Ready, class Clock, class Duration>
  bool wait_until(Ready&& ready, std::chrono::time_point<Clock, Duration> deadline) {
    if (spin_until(ready)) return true;
    // Parking with a timeout: libstdc++'s atomic wait has no timed form, so poll with a
    // short sleep that doubles up to 1 ms. Only used by host-side timed waits.
    auto nap = std::chrono::microseconds(50);
    while (!ready()) {
      if (Clock::now() >= deadline) return ready();
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::milliseconds(1)) nap *= 2;
    }
    return true;
  }

 private:
  // Wakes every parked waiter.
  void wake() noexcept {
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
  }

  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint32_t> waiters_{0};
};

}  // namespace bspflow::detail
