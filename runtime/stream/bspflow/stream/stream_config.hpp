// A stream's configuration and the result of a run (see stream.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/stream/request.hpp"

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

// Whether each producer's responses come back in the order it pushed them.
enum class Ordering {
  kPerProducer,  // yes (the default): a response waits for its producer's earlier ones
  kNone,         // no: each response as soon as it is ready (lowest latency with replicas)
};

// What a StreamClient's push does when the stream cannot take the request in time.
enum class AdmissionPolicy {
  kBlock,   // wait while the queue is at max_queued (the InfeedQueue path's behaviour)
  kReject,  // refuse at once: push returns Refusal::kQueueFull, nothing is queued
  kShed,    // queue full: answer the request with the least slack (queued or new) kRejected
};

// Admission control of a StreamClient's requests (the InfeedQueue path only blocks).
struct Admission {
  AdmissionPolicy policy = AdmissionPolicy::kBlock;
  std::size_t max_queued = 1024;  // requests admitted but not yet taken by a replica, 1..2^20
  // Refuse (Refusal::kDeadlineUnreachable) a request whose predicted completion, from the
  // queue ahead of it and the measured service time, is past its deadline. Needs `stats`.
  bool predict = true;
};

struct StreamConfig {
  std::size_t capacity =
      tunables::kDefaultStreamCapacity;  // ring slots between devices, 1..kMaxQueueCapacity
  OnError on_error = OnError::kRespond;
  WaitPolicy wait = {};                   // how every device waits for its next request
  std::vector<WaitPolicy> device_wait{};  // empty, or one per device of the stream (overrides wait)
  // Copies of the chain, each on its own devices: replica r uses devices r*D/R .. (r+1)*D/R-1
  // of the D given; a stage's device index counts within its replica. 1..64; D % R == 0.
  std::uint32_t replicas = 1;
  Ordering ordering = Ordering::kPerProducer;
  Admission admission{};
  // Responses a StreamClient may have outstanding (pushed, not popped), 1..2^20.
  std::size_t client_capacity = 1024;
  // Histograms and counts for Stream::stats(); off saves two clock reads per stage.
  bool stats = true;
  // A stage holding one request or batch longer than this is reported once (log and stats)
  // and its replica takes no new requests until it moves; 0 = off.
  std::chrono::nanoseconds stall_limit = std::chrono::seconds(1);
  // Consecutive stages whose devices are pinned to one core run on one thread (the first
  // one's): a hand-off between two threads of one core is pure cost.
  bool fuse_shared_cores = true;
  // Throws bspflow::Error naming the field, the value and what is allowed.
  void validate(std::uint32_t devices) const;
};

// How a Stream ended (RunResult: status, message, elapsed from start() to the end; a Stream
// models no host link, so the host fields stay zero), and what happened to its requests.
struct StreamResult : RunResult {
  std::uint64_t accepted = 0;    // requests the stream took (off the infeed, or admitted)
  std::uint64_t answered = 0;    // responses delivered (errors included)
  std::uint64_t errors = 0;      // of those, RequestErrors (every kind; none a stop dropped)
  std::uint64_t unanswered = 0;  // accepted - answered: cut short by cancel or fail-fast
  std::uint64_t refused = 0;     // StreamClient pushes refused (nothing queued; not accepted)
  std::shared_ptr<const RequestError> failure{};  // kFailed: the error that stopped it
  bool drained() const noexcept { return status == RunStatus::kCompleted; }
};

}  // namespace bspflow
