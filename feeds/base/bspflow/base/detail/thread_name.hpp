// Names the calling thread, so that top -H, perf, gdb and /proc/<pid>/task/*/comm tell
// bspflow's threads apart ("bspflow-dev3", "bspflow-io", "bspflow-load1"...).
#pragma once

#include <cstdio>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace bspflow::detail {

// Linux keeps 15 characters of a thread's name; a longer one is cut there. Never allocates,
// never throws; does nothing where threads cannot be named.
inline void name_this_thread(const char* name) noexcept {
#if defined(__linux__)
  char cut[16];
  std::snprintf(cut, sizeof cut, "%s", name);
  pthread_setname_np(pthread_self(), cut);
#else
  (void)name;
#endif
}

// As above, with a number after the prefix ("bspflow-dev", 3 -> "bspflow-dev3").
inline void name_this_thread(const char* prefix, unsigned number) noexcept {
  char name[16];
  std::snprintf(name, sizeof name, "%s%u", prefix, number);
  name_this_thread(name);
}

}  // namespace bspflow::detail
