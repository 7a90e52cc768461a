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

namespace bspflow {

enum class OnError {
  kRespond,   // answer the failing request with a RequestError and go on (default)
  kFailFast,  // stop the stream at the first exception (kFailed)
};

enum class StreamStatus {
  kDrained,    // the infeed was closed; every accepted request was answered
  kCancelled,  // cancel() (or the Stream destroyed mid-run)
  kFailed,     // OnError::kFailFast and a stage threw, or the runtime failed
};
// Any thread. "drained", "cancelled", "failed". Never blocks, never throws.
const char* to_string(StreamStatus s) noexcept;

struct StreamConfig {
  std::size_t capacity = tunables::kDefaultStreamCapacity;  // ring slots between devices, 1..kMaxQueueCapacity
  OnError on_error = OnError::kRespond;
  WaitPolicy wait = {};                 // how every device waits for its next request
  std::vector<WaitPolicy> device_wait{};  // empty, or one per device of the stream (overrides wait)
  // Throws bspflow::Error naming the field, the value and what is allowed.
  void validate(std::uint32_t devices) const;
};

struct StreamResult {
  StreamStatus status = StreamStatus::kDrained;
  std::uint64_t accepted = 0;    // requests the first stage took off the infeed
  std::uint64_t answered = 0;    // responses delivered to the outfeed (errors included)
  std::uint64_t errors = 0;      // of those, RequestErrors
  std::uint64_t unanswered = 0;  // accepted - answered: cut short by cancel or fail-fast
  std::string message{};         // one line saying the above
  std::shared_ptr<const RequestError> failure{};  // kFailed: the error that stopped it
  std::chrono::nanoseconds elapsed{0};          // start() to the end
  bool drained() const noexcept { return status == StreamStatus::kDrained; }
};

}  // namespace bspflow
