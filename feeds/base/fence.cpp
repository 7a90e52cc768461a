// membarrier-based heavy fence (see bspflow/base/detail/fence.hpp), and whether the CPU has
// the write prefetch detail::prefetch_for_write uses (bspflow/base/detail/wait.hpp).
#include "bspflow/base/detail/fence.hpp"

#include "bspflow/base/detail/wait.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace bspflow::detail {

namespace {

bool register_membarrier() noexcept {
#if defined(__linux__) && defined(__NR_membarrier)
  const long supported = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  return syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
  return false;
#endif
}

bool cpu_has_prefetchw() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  // CPUID leaf 0x80000001, ECX bit 8: PRFCHW (AMD's name: 3DNowPrefetch). Read here, not
  // with __builtin_cpu_supports in the header: older clang does not know that feature name.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(0x80000001u, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 8)) != 0;
#else
  return false;
#endif
}

}  // namespace

const bool g_have_prefetchw = cpu_has_prefetchw();

// Registered when the library loads (before any queue exists, in practice); a thread that
// runs before that uses the symmetric fences, which is also correct.
std::atomic<bool> g_asymmetric_fences{register_membarrier()};

#if defined(__SANITIZE_THREAD__)
std::atomic<unsigned> g_fence_word{0};
#endif

void heavy_fence() noexcept {
#if defined(__SANITIZE_THREAD__)
  g_fence_word.fetch_add(1, std::memory_order_seq_cst);
  return;
#endif
#if defined(__linux__) && defined(__NR_membarrier)
  if (g_asymmetric_fences.load(std::memory_order_relaxed) &&  // relaxed: never reverts
      syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0) {
    return;
  }
#endif
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace bspflow::detail
