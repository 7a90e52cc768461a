// The run room's internal API (not for users, not installed): the wait sites the stall check
// names for a device outside its feeds' waits.
#pragma once

#include "bspflow/base/detail/wait_note.hpp"

namespace bspflow::detail {

// The sites a note points at outside any wait: before its device started the run, and
// after it ended. Any thread; never throws.
const WaitSite& not_started_site() noexcept;
const WaitSite& ended_site() noexcept;
// Where a device waits at the end of an Engine run for the I/O engine's last transfers.
const WaitSite& io_drain_site() noexcept;

}  // namespace bspflow::detail
