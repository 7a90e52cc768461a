/// @file
/// A stream's requests and responses (see stream.hpp): who sent a request, what comes back,
/// and why a request was answered with an error or refused.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace bspflow {

/// Who sent a request and which of theirs it is.
struct RequestId {
  std::uint32_t client = 0;    ///< StreamClient::id(): unique in the process
  std::uint64_t sequence = 0;  ///< 0, 1, 2, ... per client
  /// Whether both name the same request: the same client and sequence number.
  friend bool operator==(const RequestId&, const RequestId&) = default;
};

/// The clock of deadlines and latencies.
using StreamClock = std::chrono::steady_clock;
/// A request's deadline; kNoDeadline (the default) means none.
using Deadline = StreamClock::time_point;
/// No deadline: the latest time point there is.
inline constexpr Deadline kNoDeadline = Deadline::max();

/// How many priority classes a stream can have (StreamConfig::priority_classes). Class 0 is
/// served first at every queue, then 1, and so on, each keeping its minimum share.
inline constexpr std::uint32_t kPriorityClasses = 4;

/// Why a request was answered with an error, for callers that branch on it.
enum class ErrorKind : std::uint8_t {
  kStageFailed,       ///< a stage threw for it (or its batch), or the runtime failed
  kDeadlineExceeded,  ///< a stage took it after its deadline: not run
  kRejected,          ///< admitted, then shed: for one with more slack, or of a higher class
  kCancelled,         ///< its client cancelled it, or the stream was cancelled: not run further
};
/// How many ErrorKinds there are: the size of every count kept by kind.
inline constexpr std::size_t kErrorKinds = static_cast<std::size_t>(ErrorKind::kCancelled) + 1;
/// The kind's name: "stage_failed", "deadline_exceeded", "rejected" or "cancelled".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(ErrorKind kind) noexcept;

/// Why a request was answered with an error: its kind, the stage (graph node) that answered it
/// and why.
struct RequestError {
  /// What went wrong, for callers that branch on it.
  ErrorKind kind = ErrorKind::kStageFailed;
  std::uint32_t stage = 0;  ///< index of the stage (node) in the stream (0 = first)
  /// The name of that stage.
  std::string stage_name{};
  std::uint32_t device = 0;  ///< Device::id() of the device it ran on
  /// The request the error answers.
  RequestId id{};
  std::string message{};  ///< "stage 'conv' (1) on device 0 failed on request 3 of client 1: ..."
  std::exception_ptr cause{};  ///< kStageFailed: what the stage threw
};

/// One answer: the request's id and its value, or the error that replaced it.
template <class T>
struct Response {
  RequestId id{};                               ///< the request it answers
  std::optional<T> value{};                     ///< set when ok()
  std::shared_ptr<const RequestError> error{};  ///< set when it was not answered with a value
  /// From the push to the answer being made (before it waits for the client's earlier ones).
  std::chrono::nanoseconds latency{0};
  /// The version that answered it: the newest stage version it ran through (versions are
  /// numbered per stream: 1 at build, each Stream::swap() the next). 0 if it ran no stage.
  std::uint32_t version = 0;
  std::uint32_t priority = 0;  ///< its priority class
  /// Its place among its request's responses: 0, 1, 2, ... A generate stage answers a request
  /// with one response per output (partial responses, then the final one); any other stream
  /// with one response, index 0.
  std::uint32_t index = 0;
  /// Whether it is its request's last response (always, but for a generate stage's partial
  /// ones). An error is always final.
  bool final = true;
  /// Whether it was answered with a value (no error).
  bool ok() const noexcept { return error == nullptr; }
  /// The error's kind; only when !ok().
  ErrorKind kind() const noexcept { return error->kind; }
};

/// Why a StreamClient's push was refused (nothing was queued then).
enum class Refusal : std::uint8_t {
  kNone,       ///< accepted
  kQueueFull,  ///< the admission queue is at Admission::queue_capacity (kReject, or try_push)
  kDeadlineUnreachable,  ///< the predicted completion (queue x measured service) is past it
  kDeadlinePassed,       ///< the deadline was already past at push
  kClientFull,           ///< this client has response_capacity requests unpopped: pop first
  kShed,                 ///< AdmissionPolicy::kShed: this request had the least slack
  kClosed,               ///< the stream is closed or not serving
  kOutranked,            ///< the admission queue is full of requests of a higher priority class
  /// It could never run: the iterations it asks a generate stage for need more state blocks
  /// than the stage's whole pool (Submission::reason says how many, and what the device's
  /// memory holds).
  kTooLarge,
};
/// How many Refusals there are (kNone included): the size of every count kept by refusal.
inline constexpr std::size_t kRefusals = static_cast<std::size_t>(Refusal::kTooLarge) + 1;
/// The refusal's name: "accepted", "queue_full", ...
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(Refusal r) noexcept;

/// What a StreamClient's push returns: the request's id, or why it was refused.
struct Submission {
  RequestId id{};  ///< valid when accepted()
  /// Why the push was refused; kNone when it was accepted.
  Refusal refusal = Refusal::kNone;
  /// What a refusal has to say beyond its kind, or null: for kTooLarge, what the request
  /// needs, what the pool holds and the device arena's report.
  std::shared_ptr<const std::string> reason{};
  /// Whether the request was queued.
  bool accepted() const noexcept { return refusal == Refusal::kNone; }
  /// accepted().
  explicit operator bool() const noexcept { return accepted(); }
};

namespace detail {
/// The next process-unique StreamClient id.
/// Contract: any; non-blocking; no-alloc; noexcept.
std::uint32_t next_client_id() noexcept;
}  // namespace detail

}  // namespace bspflow
