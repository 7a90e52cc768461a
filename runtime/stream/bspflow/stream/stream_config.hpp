/// @file
/// A stream's configuration and the result of a run (see stream.hpp).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bspflow/base/tunables.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/run/options.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/stream/request.hpp"

namespace bspflow {

/// What a stream does when a stage throws.
enum class OnError {
  kRespond,   ///< answer the failing request with a RequestError and go on (default)
  kFailFast,  ///< stop the stream at the first exception (kFailed)
};

// How a Stream ended is a RunStatus: kCompleted (closed, and every accepted request
// answered), kCancelled (cancel(), or the Stream destroyed mid-run), kFailed
// (OnError::kFailFast and a stage threw, or the runtime failed).

/// Whether each client's responses come back in the order it pushed them.
enum class Ordering {
  kPerClient,  ///< yes (the default): a response waits for its client's earlier ones
  kNone,       ///< no: each response as soon as it is ready (lowest latency with replicas)
};

/// What a StreamClient's push does when the admission queue is full. Whatever the policy, a
/// higher priority class goes first: under kReject and kShed a push of a higher class than
/// some queued request sheds the lowest-class one (answered kRejected) to take its place, and
/// a push that finds only higher classes queued is refused Refusal::kOutranked; under kBlock
/// a waiting push of a higher class takes the next free place.
enum class AdmissionPolicy {
  kBlock,   ///< push waits while the admission queue is at queue_capacity
  kReject,  ///< refuse at once: push returns Refusal::kQueueFull, nothing is queued
  kShed,    ///< queue full: answer the request with the least slack (queued or new) kRejected
};

/// Admission control of a StreamClient's requests.
struct Admission {
  AdmissionPolicy policy = AdmissionPolicy::kBlock;  ///< what a push does when the queue is full
  /// The admission queue: requests admitted and not yet taken by a replica, 1..2^20.
  std::size_t queue_capacity = 1024;
  /// Refuse (Refusal::kDeadlineUnreachable) a request whose predicted completion, from the
  /// queue ahead of it (its class and higher) and the measured service time, is past its
  /// deadline. Needs `stats`.
  bool predict = true;
  /// Within a priority class, the queue serves the earliest deadline first (requests without
  /// one after them, in push order); false: in push order.
  bool earliest_deadline_first = true;
};

/// Outlier ejection: a replica whose answers are stage failures `consecutive_failures` times
/// in a row leaves the rotation for `base_time`, twice as long each time it is ejected again
/// (at most `max_time`); then it takes one request (a probe): answered without a stage
/// failure it rejoins, else it is ejected again. The last replica in rotation is never
/// ejected. consecutive_failures 0 turns it off.
struct Ejection {
  std::uint32_t consecutive_failures = 5;                               ///< 0 (off) or 1..1000000
  std::chrono::nanoseconds base_time = std::chrono::milliseconds(100);  ///< 1 us..1 h
  std::chrono::nanoseconds max_time = std::chrono::seconds(10);         ///< base_time..1 h
};

/// The most replicas a stream takes (StreamConfig::replicas).
inline constexpr std::uint32_t kMaxStreamReplicas = 64;

/// A Stream's shape: its hops, error handling, waiting, replicas, ordering, admission,
/// priority classes, outlier ejection and statistics. validate() states the rules.
struct StreamConfig {
  /// The ring between two devices of a replica (a hop), requests: 1..kMaxQueueCapacity.
  std::size_t hop_capacity = tunables::kDefaultStreamCapacity;
  OnError on_error = OnError::kRespond;   ///< what the stream does when a stage throws
  WaitPolicy wait = {};                   ///< how every device waits for its next request
  std::vector<WaitPolicy> device_wait{};  ///< empty, or one per stream device (overrides wait)
  /// Copies of the chain, each on its own devices: replica r uses devices r*D/R .. (r+1)*D/R-1
  /// of the D given; a stage's device index counts within its replica.
  /// 1..kMaxStreamReplicas, and D % R == 0.
  std::uint32_t replicas = 1;
  Ordering ordering = Ordering::kPerClient;  ///< whether responses keep their client's order
  Admission admission{};                     ///< admission control of the clients' requests
  /// Priority classes (1..kPriorityClasses): a request's class is its client's
  /// (StreamClient::set_priority), 0 by default. Every queue serves class 0 first.
  std::uint32_t priority_classes = 1;
  /// Each class's minimum share of what every queue serves while it has requests waiting, so
  /// a lower class is never starved: 0..1 each, summing to at most 1. Class 0, served first,
  /// needs none.
  std::array<double, kPriorityClasses> min_share{0.0, 0.1, 0.1, 0.1};
  Ejection ejection{};  ///< outlier ejection of replicas whose stages keep failing
  /// A StreamClient's response slots: requests it may have pushed and not yet popped, 1..2^20.
  std::size_t response_capacity = 1024;
  /// Histograms and counts for Stream::stats(); off saves two clock reads per stage.
  bool stats = true;
  /// A stage holding one call (a request or a batch) longer than this is reported once (a
  /// warning in the log, StageStats::stalls) and its replica takes no new requests until it
  /// moves; 0 = off, else at most 24 h.
  std::chrono::nanoseconds call_stall_limit = std::chrono::seconds(1);
  /// Devices of a replica pinned to one core run on one thread (the first one's) when the
  /// later one takes its requests from the earlier one only: a hand-off between two threads
  /// of one core is pure cost.
  bool fuse_shared_cores = true;
  /// A stream's config from a run's Options: Options::replicas(); every other field keeps its
  /// default.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  static StreamConfig from(const Options& options) noexcept;
  /// Checks every field, for a stream on `devices` devices.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate(std::uint32_t devices) const;
};

/// How a Stream ended (RunResult: status, message, elapsed from start() to the end; a Stream
/// models no host link, so the host fields stay zero), and what happened to its requests.
struct StreamResult : RunResult {
  std::uint64_t accepted = 0;    ///< requests admitted in this run
  std::uint64_t answered = 0;    ///< responses delivered (errors included)
  std::uint64_t errors = 0;      ///< of those, RequestErrors (every kind; none a stop dropped)
  std::uint64_t unanswered = 0;  ///< accepted - answered: cut short by cancel or fail-fast
  std::uint64_t refused = 0;     ///< pushes refused in this run (stats().refused(): since built)
  std::shared_ptr<const RequestError> failure{};  ///< kFailed: the error that stopped it
  /// Whether the stream was closed and every accepted request answered (kCompleted).
  bool drained() const noexcept { return status == RunStatus::kCompleted; }
};

}  // namespace bspflow
