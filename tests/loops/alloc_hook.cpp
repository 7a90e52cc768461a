// The allocation hook of the alloc_failure executable: replaces the global operator new (and
// its delete) so that one chosen allocation of one chosen thread (by id, or by name for a
// thread the library starts) throws std::bad_alloc. alloc_hook.hpp arms it.
#include "alloc_hook.hpp"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include <pthread.h>

namespace {
// Armed: allocations left on the target thread before the one that fails; < 0: disarmed.
std::atomic<long> g_countdown{-1};
std::atomic<std::thread::id> g_target{};
// Set: the target is the thread of this name instead ("bspflow-io"), whatever g_target says.
std::atomic<const char*> g_target_name{nullptr};
std::atomic<bool> g_injected{false};

bool on_target() noexcept {
  if (const char* name = g_target_name.load(std::memory_order_relaxed)) {
    char mine[16] = {};
    pthread_getname_np(pthread_self(), mine, sizeof mine);  // the calling thread: no allocation
    return std::strcmp(mine, name) == 0;
  }
  return std::this_thread::get_id() == g_target.load(std::memory_order_relaxed);
}

bool fail_this_one() noexcept {
  // acquire: pairs with arm(), which stores the countdown after the target.
  if (g_countdown.load(std::memory_order_acquire) < 0) return false;
  if (!on_target()) return false;
  if (g_countdown.fetch_sub(1, std::memory_order_relaxed) != 0) return false;
  g_injected.store(true, std::memory_order_relaxed);
  return true;
}

std::size_t rounded(std::size_t n, std::size_t align) {
  return (n == 0 ? align : n + align - 1) / align * align;
}
}  // namespace

namespace alloc_hook {

void arm(std::thread::id thread, long allocations_before) {
  g_injected = false;
  g_target = thread;
  g_countdown = allocations_before;
}
bool disarm() {
  g_countdown = -1;
  return g_injected.load();
}

void target_name(const char* name) {
  g_target_name = name;
}
long countdown() {
  return g_countdown.load();
}

}  // namespace alloc_hook

void* operator new(std::size_t n) {
  if (fail_this_one()) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  if (fail_this_one()) throw std::bad_alloc();
  const auto align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, rounded(n, align))) return p;
  throw std::bad_alloc();
}
// (GCC sees free() after the operator new above and warns; that new is malloc's.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
// The other forms, so that every allocation and every release goes through the ones above
// (a sanitizer's own forms would otherwise pair with ours and report a mismatch).
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n, a);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n) {
  return ::operator new(n);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return ::operator new(n, a);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return ::operator new(n, t);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  return ::operator new(n, a, t);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
