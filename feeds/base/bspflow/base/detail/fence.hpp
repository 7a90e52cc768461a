// Asymmetric fences: a cheap side for hot paths and an expensive side for rare slow paths.
//
// Two threads that each store one flag and then load the other's (a Dekker pair: a waiter
// registering and re-checking, a producer publishing and checking for waiters) need a full
// fence between the store and the load on both sides. When one side is rare (parking,
// close(), a second producer appearing), Linux's membarrier() lets that side pay for both:
// heavy_fence() runs a full barrier on every thread of the process, so the hot side's
// light_fence() need only stop the compiler. Where membarrier is unavailable, light_fence()
// is a real fence and heavy_fence() one too: slower, equally correct.
#pragma once

#include <atomic>

namespace bspflow::detail {

// True once membarrier(PRIVATE_EXPEDITED) is registered for this process. Never goes back to
// false. Any combination of light and heavy sides is correct: heavy_fence() uses membarrier
// exactly when this is true, and then light_fence() may be a compiler barrier.
extern std::atomic<bool> g_asymmetric_fences;

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer does not model fences: under it both sides are seq_cst read-modify-writes
// of one shared word instead (also correct: those are totally ordered, and each one
// synchronises with the next).
extern std::atomic<unsigned> g_fence_word;
#endif

// Hot side: between a store and a load that pair with a heavy_fence() elsewhere.
inline void light_fence() noexcept {
#if defined(__SANITIZE_THREAD__)
  g_fence_word.fetch_add(1, std::memory_order_seq_cst);
  return;
#endif
  if (g_asymmetric_fences.load(std::memory_order_relaxed)) {  // relaxed: see the comment above
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

// Slow side: a full barrier on every thread of the process (a few microseconds).
void heavy_fence() noexcept;

}  // namespace bspflow::detail
