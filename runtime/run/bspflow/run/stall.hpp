/// @file
/// When a run cannot make progress: StallCheck (how long a run may go without any device
/// moving before it says so, and whether it then ends) and StallError (what such a run
/// throws when asked to end).
/// Guide: runtime/run/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"

namespace bspflow {

/// What a stalled run does besides logging once: go on waiting (kLog, the default: a run
/// waiting for a producer that is merely slow may still go on) or end with StallError (kFail).
enum class OnStall { kLog, kFail };

/// A plain value type; EngineConfig::stall, PipelineConfig::stall, a loops::repeat feed
/// (const StallCheck&), Options::run_stall_limit() and on_stall() set it.
struct StallCheck {
  /// How long no device may move while every running device waits; 0: no check.
  /// 0, or tunables::kMinRunStallLimit..kMaxRunStallLimit (default kDefaultRunStallLimit).
  std::chrono::nanoseconds limit = tunables::kDefaultRunStallLimit;
  OnStall on_stall = OnStall::kLog;  ///< what a stalled run does besides logging once

  /// Checks that limit is 0 or in kMinRunStallLimit..kMaxRunStallLimit.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

/// A run with OnStall::kFail that stalled: thrown on the host thread by loops::repeat and
/// Run::get(), Engine::run and Pipeline::run, once every device has stopped (as after a
/// cancel(): what a loop or pipeline takes back after a cancel, it takes back here too). The
/// message is the logged report: the limit, then per device what it waited for and its state,
/// then what would let the run go on. A failure in a device (DeviceError, StageError) that
/// came first is thrown instead.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class StallError : public Error {
 public:
  /// One device of the stalled run.
  struct Wait {
    std::uint32_t device = 0;   ///< Device::id()
    std::uint32_t replica = 0;  ///< its replica (an Engine run: its index in the device list)
    std::string waits_for;      ///< "an element of the infeed's lane 0 (empty, not closed)"
  };
  /// The message (the logged report) and each device's wait.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  StallError(const std::string& message, std::vector<Wait> waits)
      : Error(message), waits_(std::move(waits)) {}
  /// Every device of the stalled run, with what it waited for.
  const std::vector<Wait>& waits() const noexcept { return waits_; }

 private:
  std::vector<Wait> waits_;
};

}  // namespace bspflow
