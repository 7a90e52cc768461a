/// @file
/// RunStatus and RunResult: how a run ended, for every entry point (status, message, wall
/// time, what crossed the host link). Each entry point's result extends RunResult with what
/// it has more to say: `RepeatResult<State>` (loops::repeat, bspflow/loops/run.hpp),
/// EngineResult, PipelineResult, StreamResult.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "bspflow/devices/modeled_clock.hpp"

namespace bspflow {

/// How a run ended. A loop, an Engine or a Pipeline that fails throws (DeviceError,
/// StageError) instead of returning kFailed; a Stream with OnError::kFailFast returns kFailed.
enum class RunStatus {
  kCompleted,  ///< every replica ran all requested iterations; a Stream: it was closed
               ///< and every accepted request answered
  kEndOfData,  ///< an infeed was closed and drained before the requested iterations
  kCancelled,  ///< cancel() (Run, Engine, Pipeline, Stream), or the Run handle, the Stream or
               ///< a device was destroyed mid-run
  kFailed,     ///< a Stream stopped at its first stage failure (OnError::kFailFast)
};
/// Returns "completed", "end of data", "cancelled" or "failed".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(RunStatus s) noexcept;

/// What every run returns, extended by each entry point. A plain value: any thread may read
/// it once the run has returned it.
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct RunResult {
  /// How the run ended.
  RunStatus status = RunStatus::kCompleted;
  std::string message;                  ///< one line saying how the run ended
  std::chrono::nanoseconds elapsed{0};  ///< wall time of the run
  /// The modeled host link, all devices: bytes of elements in and of outputs out (none with
  /// synthetic data, none for a loop without a HostIO or a Stream), and how long devices
  /// waited for its copies. A device waiting for the host to push an element is not link
  /// time, except where the device cannot tell them apart: an Engine with I/O tiles counts
  /// the whole wait for an I/O-tile buffer (its element may be late, or a full outfeed may
  /// hold the buffer), so a starved Engine feed shows there too.
  std::uint64_t host_bytes_in = 0, host_bytes_out = 0;  ///< bytes of outputs out
  std::chrono::nanoseconds host_wait{0};  ///< how long devices waited for the link's copies
  /// The same run in modeled IPU time (the modeled clock: what a real IPU would take for the
  /// work the devices declared, with the devices' DeviceModel): the slowest device's time and
  /// where it went. `elapsed` is the CPU's. modeled.undeclared counts compute steps that
  /// declared no cost (then modeled.complete() is false and the modeled time misses them).
  ModeledTime modeled{};

  /// Whether status is kCompleted; end_of_data(), cancelled() and failed() test the others.
  bool completed() const noexcept { return status == RunStatus::kCompleted; }
  /// Whether status is kEndOfData.
  bool end_of_data() const noexcept { return status == RunStatus::kEndOfData; }
  /// Whether status is kCancelled.
  bool cancelled() const noexcept { return status == RunStatus::kCancelled; }
  /// Whether status is kFailed.
  bool failed() const noexcept { return status == RunStatus::kFailed; }
};

}  // namespace bspflow
