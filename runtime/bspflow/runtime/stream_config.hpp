// A stream's configuration and the result of a run (see stream.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/runtime/request.hpp"
#include "bspflow/runtime/run_result.hpp"

namespace bspflow {

enum class OnError {
  kRespond,   // answer the failing request with a RequestError and go on (default)
  kFailFast,  // stop the stream at the first exception (kFailed)
};

// How a Stream ended is a RunStatus: kCompleted (the infeed was closed and every accepted
// request answered: "drained"), kCancelled (cancel(), or the Stream destroyed mid-run),
// kFailed (OnError::kFailFast and a stage threw, or the runtime failed). StreamStatus is the
// old name, kept so older code compiles; kDrained is a Stream's name for kCompleted.
using StreamStatus = RunStatus;

struct StreamConfig {
  std::size_t capacity =
      tunables::kDefaultStreamCapacity;  // ring slots between devices, 1..kMaxQueueCapacity
  OnError on_error = OnError::kRespond;
  WaitPolicy wait = {};                   // how every device waits for its next request
  std::vector<WaitPolicy> device_wait{};  // empty, or one per device of the stream (overrides wait)
  // Throws bspflow::Error naming the field, the value and what is allowed.
  void validate(std::uint32_t devices) const;
};

// How a Stream ended (RunResult: status, message, elapsed from start() to the end; a Stream
// models no host link, so the host fields stay zero), and what happened to its requests.
struct StreamResult : RunResult {
  std::uint64_t accepted = 0;    // requests the first stage took off the infeed
  std::uint64_t answered = 0;    // responses delivered to the outfeed (errors included)
  std::uint64_t errors = 0;      // of those, RequestErrors
  std::uint64_t unanswered = 0;  // accepted - answered: cut short by cancel or fail-fast
  std::shared_ptr<const RequestError> failure{};  // kFailed: the error that stopped it
  bool drained() const noexcept { return status == RunStatus::kCompleted; }
};

}  // namespace bspflow
