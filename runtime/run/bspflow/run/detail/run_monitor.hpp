// Internal (not installed): the stall check's monitor. One thread for the process, started
// by the first watched run, looks at every watched run now and then (see
// bspflow/run/stall.hpp for what a stall is).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/run/internal/run_control.hpp"
#include "bspflow/run/internal/wait_sites.hpp"
#include "bspflow/run/stall.hpp"

namespace bspflow::detail {

// One watched run: what the monitor needs of it, and what it remembers between looks.
struct StallWatch {
  RunControl* control = nullptr;
  std::uint32_t replicas = 0;
  std::string name;                    // opens the report: "loops::repeat"
  std::vector<WatchedDevice> devices;  // per replica
  StallCheck check;
  // The monitor thread's own, under the monitor's mutex:
  std::vector<std::uint64_t> moves;             // each note's moves at the last look
  std::chrono::steady_clock::time_point since;  // when a device last moved or computed
  bool reported = false;
  // OnStall::kFail: the report and waits the run ends with, once the report is logged.
  bool fail_pending = false;
  std::string fail_report;
  std::vector<StallError::Wait> fail_waits;
};

// Host thread: the monitor starts looking at `watch` (the thread starts with the first one).
// Allocates; throws std::system_error if the thread cannot start, std::bad_alloc.
void watch_run(StallWatch* watch);
// Any thread: the monitor stops looking at `watch`, after a look at it in progress (its
// sites' state() may read the run's feeds: they stay alive until this returns). Never throws.
void unwatch_run(StallWatch* watch) noexcept;

}  // namespace bspflow::detail
