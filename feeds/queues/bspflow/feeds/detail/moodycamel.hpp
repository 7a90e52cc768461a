// Includes moodycamel::ConcurrentQueue from wherever it is installed: Debian's
// libconcurrentqueue-dev puts it under concurrentqueue/, the upstream tree (the meson wrap
// fallback) at its root.
#pragma once

#if __has_include(<concurrentqueue/concurrentqueue.h>)
#include <concurrentqueue/concurrentqueue.h>
#elif __has_include(<concurrentqueue.h>)
#include <concurrentqueue.h>
#else
#error "moodycamel ConcurrentQueue not found: install libconcurrentqueue-dev"
#endif
