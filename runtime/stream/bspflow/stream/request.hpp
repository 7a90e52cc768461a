// A stream's requests and responses (see stream.hpp): who sent a request, what comes back,
// and the producer handle that stamps them.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/push_result.hpp"

namespace bspflow {

// Who sent a request and which of theirs it is.
struct RequestId {
  std::uint32_t producer = 0;  // RequestProducer::id(): unique in the process
  std::uint64_t sequence = 0;  // 0, 1, 2, ... per producer
  friend bool operator==(const RequestId&, const RequestId&) = default;
};

// The clock of deadlines and latencies.
using StreamClock = std::chrono::steady_clock;
// A request's deadline; kNoDeadline (the default) means none.
using Deadline = StreamClock::time_point;
inline constexpr Deadline kNoDeadline = Deadline::max();

// What travels through a stream's infeed. Made by RequestProducer::push.
template <class T>
struct Request {
  RequestId id{};
  std::optional<T> value{};
  Deadline deadline = kNoDeadline;  // a stage that takes it later answers kDeadlineExceeded
};

// Why a request was answered with an error, for callers that branch on it.
enum class ErrorKind : std::uint8_t {
  kStageFailed,       // a stage threw for it (or its batch), or the runtime failed
  kDeadlineExceeded,  // a stage took it after its deadline: not run
  kRejected,          // admitted, then shed for a request with more slack (AdmissionPolicy::kShed)
  kCancelled,         // its client cancelled it, or the stream was cancelled: not run further
};
// Any thread: "stage_failed", "deadline_exceeded", "rejected", "cancelled". Never throws.
const char* to_string(ErrorKind kind) noexcept;

// Why a request was answered with an error: its kind, the stage that answered it and why.
struct RequestError {
  ErrorKind kind = ErrorKind::kStageFailed;
  std::uint32_t stage = 0;  // index of the stage in the stream (0 = first)
  std::string stage_name{};
  std::uint32_t device = 0;  // Device::id() of the device it ran on
  RequestId id{};
  std::string message{};  // "stage 'conv' (1) on device 0 failed on request 3 of producer 1: ..."
  std::exception_ptr cause{};  // kStageFailed: what the stage threw
};

// One answer: the request's id and its value, or the error that replaced it.
template <class T>
struct Response {
  RequestId id{};
  std::optional<T> value{};                     // set when ok()
  std::shared_ptr<const RequestError> error{};  // set when it was not answered with a value
  // From the push to the answer (0 on the InfeedQueue path without StreamConfig::stats).
  std::chrono::nanoseconds latency{0};
  bool ok() const noexcept { return error == nullptr; }
  // The error's kind; only when !ok().
  ErrorKind kind() const noexcept { return error->kind; }
};

// Why a StreamClient's push was refused (nothing was queued then).
enum class Refusal : std::uint8_t {
  kNone,                 // accepted
  kQueueFull,            // AdmissionPolicy::kReject and the stream's queue is at max_queued
  kDeadlineUnreachable,  // the predicted completion (queue x measured service) is past it
  kDeadlinePassed,       // the deadline was already past at push
  kClientFull,           // this client has client_capacity requests unanswered: pop first
  kShed,                 // AdmissionPolicy::kShed: this request had the least slack
  kClosed,               // the stream is closed or not serving
};
// Any thread: "accepted", "queue_full", ... Never throws.
const char* to_string(Refusal r) noexcept;

// What a StreamClient's push returns: the request's id, or why it was refused.
struct Submission {
  RequestId id{};  // valid when accepted()
  Refusal refusal = Refusal::kNone;
  bool accepted() const noexcept { return refusal == Refusal::kNone; }
  explicit operator bool() const noexcept { return accepted(); }
};

namespace detail {
// Any thread: the next process-unique producer id. Never blocks.
std::uint32_t next_request_producer_id() noexcept;
}  // namespace detail

// A host thread's handle for sending requests into a stream's infeed: stamps each request
// with this producer's id and next sequence number. One per thread (not thread-safe); must
// not outlive the infeed.
template <class In>
class RequestProducer {
 public:
  // Setup path (allocates the infeed producer token).
  explicit RequestProducer(InfeedQueue<Request<In>>& infeed)
      : producer_(infeed.make_producer()), id_(detail::next_request_producer_id()) {}

  // Producer thread. Blocks while the infeed is full. Returns the request's id, or nullopt
  // (nothing sent, no sequence number used) once the infeed is closed. Never throws except
  // std::bad_alloc.
  // `deadline`: a stage that takes the request later answers it kDeadlineExceeded.
  std::optional<RequestId> push(In value, Deadline deadline = kNoDeadline) {
    const RequestId id{id_, next_};
    if (!producer_.push(Request<In>{id, std::optional<In>(std::move(value)), deadline})) {
      return std::nullopt;
    }
    ++next_;
    return id;
  }
  // Producer thread. Never blocks: the id, or nullopt if the infeed is full or closed
  // (`value` untouched then; full() tells which).
  std::optional<RequestId> try_push(In&& value, Deadline deadline = kNoDeadline) {
    const RequestId id{id_, next_};
    Request<In> r{id, std::nullopt, deadline};
    r.value.emplace(std::move(value));
    last_ = producer_.try_push(std::move(r));
    if (last_ != PushResult::kOk) {
      value = std::move(*r.value);
      return std::nullopt;
    }
    ++next_;
    return id;
  }
  // Whether the last try_push failed because the infeed was full (not closed).
  bool full() const noexcept { return last_ == PushResult::kFull; }

  std::uint32_t id() const noexcept { return id_; }
  std::uint64_t sent() const noexcept { return next_; }

 private:
  typename InfeedQueue<Request<In>>::Producer producer_;
  std::uint32_t id_;
  std::uint64_t next_ = 0;
  PushResult last_ = PushResult::kOk;
};

}  // namespace bspflow
