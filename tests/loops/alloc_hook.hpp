// The alloc_failure executable's allocation hook (alloc_hook.cpp replaces the global operator
// new): one chosen allocation of one chosen thread throws std::bad_alloc.
#pragma once

#include <thread>

namespace alloc_hook {

// Arms: `thread`'s allocation after the next `allocations_before` throws std::bad_alloc once.
void arm(std::thread::id thread, long allocations_before);
// Disarms; says whether the failure was injected (the call made more than k allocations).
bool disarm();
// The target is the thread of this name instead ("bspflow-io"); nullptr: by id again.
void target_name(const char* name);
// The armed countdown: allocations left on the target before the one that fails.
long countdown();

}  // namespace alloc_hook
