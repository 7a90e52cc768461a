// Spin-then-park waiting, shared by every queue and by run completion.
//
// A waiter spins for tunables::kSpinBudget with a CPU pause hint, then parks on a futex
// (on Linux the futex system call itself, so a park can also time out; elsewhere
// std::atomic<uint32_t>::wait, and a timed wait polls). A notifier pays one load when nobody
// is parked (after a
// seq_cst change, or a light fence for notify_light()), and a futex wake when somebody is. Spinning
// alone would livelock when threads outnumber cores (4 emulated devices on 2 cores); parking alone
// would add tens of microseconds to every hand-off.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ctime>

#include <climits>
#endif

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

// Asks for the cache line at `p` in a state this core may write to (x86 PREFETCHW where the
// processor has it; elsewhere the compiler's write prefetch). Before a read and then a write
// of a line that another core holds, this makes one transfer of the line instead of two (a
// shared copy for the read, then an upgrade that invalidates the other core's copy). A hint:
// never faults, never changes what the program computes.
// g_have_prefetchw: whether this x86 CPU has PREFETCHW (CPUID, read when the library loads;
// false before that, and elsewhere).
extern const bool g_have_prefetchw;
inline void prefetch_for_write(const void* p) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  if (g_have_prefetchw) asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

// Asks for the cache line at `p` to read it soon. A waiter that looks at an index calls it
// for the data the index guards, so when the index moves the data's line is already on its
// way (the two transfers overlap instead of following each other). A hint: never faults,
// never changes what the program computes.
inline void prefetch_for_read(const void* p) noexcept {
  __builtin_prefetch(p, 0, 3);
}

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

#if defined(__linux__)
// The futex word of a std::atomic<uint32_t> (same size and representation, lock-free).
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
              std::atomic<std::uint32_t>::is_always_lock_free);
// Parks while `word` holds `seen`, at most `rel` (nullptr: no limit). Returns early on a wake,
// a signal, or if the word changed first.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t seen,
                       const timespec* rel) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, rel,
          nullptr, 0);
}
inline void futex_wake_all(std::atomic<std::uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}
#endif

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
#if defined(__linux__)
      futex_wait(epoch_, seen, nullptr);
#else
      epoch_.wait(seen, std::memory_order_acquire);
#endif
    }
    // relaxed: only a hint for notifiers; a stale non-zero costs one spurious wake.
    waiters_.fetch_sub(1, std::memory_order_relaxed);
  }

  // Like wait(), but gives up at `deadline`. Returns ready(). Symmetric fences only.
  template <class Ready, class Clock, class Duration>
  bool wait_until(Ready&& ready, std::chrono::time_point<Clock, Duration> deadline,
                  Spin mode = Spin::kTight,
                  std::chrono::nanoseconds budget = tunables::kSpinBudget) {
    const auto left = [&] {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now());
    };
    if (spin_until(ready, mode, std::min(budget, std::max(left(), std::chrono::nanoseconds{0}))))
      return true;
#if defined(__linux__)
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    bool got = false;
    for (;;) {
      const std::uint32_t seen = epoch_.load(std::memory_order_acquire);
      if ((got = ready())) break;
      const auto ns = left().count();
      if (ns <= 0) break;
      timespec rel{};
      rel.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
      rel.tv_nsec = static_cast<long>(ns % 1'000'000'000);
      futex_wait(epoch_, seen, &rel);
    }
    waiters_.fetch_sub(1, std::memory_order_relaxed);  // relaxed: as in wait()
    return got;
#else
    // libstdc++'s atomic wait has no timed form: poll with a short sleep that doubles up to
    // 1 ms.
    auto nap = std::chrono::microseconds(50);
    while (!ready()) {
      if (Clock::now() >= deadline) return ready();
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::milliseconds(1)) nap *= 2;
    }
    return true;
#endif
  }

 private:
  // Wakes every parked waiter.
  void wake() noexcept {
    epoch_.fetch_add(1, std::memory_order_release);
#if defined(__linux__)
    futex_wake_all(epoch_);
#else
    epoch_.notify_all();
#endif
  }

  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint32_t> waiters_{0};
};

}  // namespace bspflow::detail
