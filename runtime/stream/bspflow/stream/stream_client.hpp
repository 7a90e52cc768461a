/// @file
/// StreamClient: one client thread's handle on a serving Stream (see stream.hpp): pushes
/// requests with deadlines through admission control, cancels them, and pops its own
/// responses, in the order it pushed them (or as they come, Ordering::kNone), with no router
/// thread between the stream and the client.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/wait_policy.hpp"
#include "bspflow/devices/topology.hpp"

#include "bspflow/stream/detail/admission.hpp"
#include "bspflow/stream/detail/responses.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_config.hpp"

namespace bspflow {

template <class In, class Out>
class Stream;

/// One per client thread (movable). Made by Stream::client(); may outlive the Stream (pushes
/// then say kClosed). Every accepted request is answered exactly once: with its value, or an
/// error of its kind (also on close, cancel and failure).
/// Contract of every member: client; non-blocking; no-alloc; noexcept, unless tagged.
template <class In, class Out>
class StreamClient {
 public:
  /// Takes over the other client's requests and responses; the other is left empty, only to be
  /// destroyed.
  StreamClient(StreamClient&&) noexcept = default;
  StreamClient& operator=(StreamClient&&) = delete;
  /// Responses still on their way are dropped; requests still queued or in flight are
  /// cancelled (answered kCancelled to nobody).
  ~StreamClient() {
    if (!ring_) return;
    for (std::uint64_t s = head_; s < next_; ++s) ring_->cancel(s);
    ring_->abandoned.store(true, std::memory_order_seq_cst);
  }

  /// Sends `value` (moved from only if accepted). Blocks only under AdmissionPolicy::kBlock
  /// while the stream's queue is full, until there is room or the stream closes. The
  /// Submission has the request's id, or why it was refused (nothing queued then): kClosed
  /// when the stream is not serving, kClientFull when response_capacity responses are
  /// unpopped, kDeadlinePassed, kDeadlineUnreachable, kQueueFull (kReject), kShed, kOutranked,
  /// kTooLarge (a generate stage's length function says it could never fit; the
  /// Submission's reason says why). What that length function throws reaches the caller.
  /// Contract: client; blocks; allocates (kShed: the shed request's error, kTooLarge: its
  /// reason); throws bad_alloc.
  Submission push(In value, Deadline deadline = kNoDeadline) {
    return submit(value, deadline, true);
  }
  /// push() with a deadline `timeout` from now.
  /// Contract: client; blocks; allocates (kShed: the shed request's error, kTooLarge: its
  /// reason); throws bad_alloc.
  Submission push_for(In value, std::chrono::nanoseconds timeout) {
    return submit(value, StreamClock::now() + timeout, true);
  }
  /// push() without waiting: under kBlock a full queue refuses with kQueueFull. `value` is
  /// untouched when refused.
  /// Contract: client; non-blocking; allocates (kShed: the shed request's error, kTooLarge:
  /// its reason); throws bad_alloc.
  Submission try_push(In&& value, Deadline deadline = kNoDeadline) {
    return submit(value, deadline, false);
  }

  /// Cancels request `id` of this client: it is answered kCancelled at its next stage boundary
  /// (a stage already running it finishes first; a response already made stays). False if `id`
  /// is not an unanswered request of this client.
  bool cancel(const RequestId& id) noexcept {
    if (id.client != id_ || id.sequence >= next_ || id.sequence < head_) return false;
    if (ring_->ready(id.sequence)) return false;  // answered, not yet popped
    if (ordering_ == Ordering::kNone && ring_->taken(id.sequence)) return false;
    ring_->cancel(id.sequence);
    return true;
  }

  /// The next response (in push order, unless Ordering::kNone): blocks until it arrives;
  /// nullopt at once if no request is outstanding. Throws only what Out's move constructor
  /// throws: noexcept when it is (as try_pop() and pop_until()).
  /// Contract: client; blocks; no-alloc; noexcept.
  std::optional<Response<Out>> pop() noexcept(noexcept(Out(std::declval<Out&&>()))) {
    return pop_until(Deadline::max());
  }
  /// The next response if one is ready; else nullopt.
  std::optional<Response<Out>> try_pop() noexcept(noexcept(Out(std::declval<Out&&>()))) {
    if (head_ == next_) return std::nullopt;
    return take_ready();
  }
  /// The next response: blocks until one arrives, or until `until` (then nullopt).
  /// Contract: client; blocks; no-alloc; noexcept.
  std::optional<Response<Out>> pop_until(Deadline until) noexcept(
      noexcept(Out(std::declval<Out&&>()))) {
    if (head_ == next_) return std::nullopt;
    if (auto r = take_ready()) return r;
    const auto ready = [&] { return any_ready(); };
    const WaitPolicy& policy = wait_policy();
    if (until == Deadline::max()) {
      ring_->arrived.wait(ready, policy.spin_mode(), detail::Fence::kSymmetric,
                          policy.spin_budget());
    } else if (!ring_->arrived.wait_until(ready, until, policy.spin_mode(), policy.spin_budget())) {
      return std::nullopt;
    }
    return take_ready();
  }

  /// How pop() and pop_until() wait for a response (see wait_policy.hpp).
  /// Default: spin-then-park; on a thread pinned to a core one of the stream's devices is
  /// pinned to as well, capped as for sharing (it yields, spins at most
  /// tunables::kSharedCoreSpinBudget, then parks), so a waiting client never takes the core
  /// from the device it waits for. Setting a policy turns the automatic choice off. Throws
  /// bspflow::Error on an invalid policy.
  /// Contract: client; non-blocking; no-alloc; throws Error.
  void set_wait(WaitPolicy policy) {
    policy.validate();
    wait_ = policy;
    wait_chosen_ = true;
  }

  /// The policy pop() and pop_until() wait with: set_wait()'s, or the automatic choice, made
  /// on the first call from where the calling thread is pinned (the topology it reads was
  /// discovered when the stream's devices were made).
  const WaitPolicy& wait_policy() noexcept {
    if (!wait_chosen_) {
      wait_chosen_ = true;
      const auto core = Topology::get().current_thread_core();
      if (core &&
          std::find(device_cores_.begin(), device_cores_.end(), *core) != device_cores_.end()) {
        wait_ = wait_.capped_for_sharing(CoreSharing::kHostThread);
      }
    }
    return wait_;
  }

  /// The priority class of this client's later pushes: 0 (served first at every queue) up
  /// to StreamConfig::priority_classes - 1. Throws Error outside that range.
  /// Contract: client; non-blocking; no-alloc; throws Error.
  void set_priority(std::uint32_t priority) {
    if (priority >= classes_) {
      detail::throw_bad_value(
          "StreamClient priority", priority,
          "must be below StreamConfig::priority_classes (" + std::to_string(classes_) + ")");
    }
    priority_ = priority;
  }
  /// The priority class of this client's pushes.
  std::uint32_t priority() const noexcept { return priority_; }

  /// Requests sent and not yet popped.
  std::uint64_t outstanding() const noexcept { return next_ - popped_; }
  /// This client's id (RequestId::client).
  std::uint32_t id() const noexcept { return id_; }
  /// Requests sent (pushes accepted).
  std::uint64_t sent() const noexcept { return next_; }

 private:
  template <class, class>
  friend class Stream;
  StreamClient(std::shared_ptr<detail::AdmissionQueue<In>> admission,
               std::shared_ptr<detail::ResponseRing<Out>> ring, std::uint32_t id, Ordering ordering,
               std::vector<std::uint32_t> device_cores, std::uint32_t classes)
      : admission_(std::move(admission)), ring_(std::move(ring)), id_(id), ordering_(ordering),
        classes_(classes), device_cores_(std::move(device_cores)) {}

  Submission submit(In& value, Deadline deadline, bool blocking) {
    Submission s =
        admission_->push(*ring_, id_, next_, next_ - head_, priority_, value, deadline, blocking);
    if (s.accepted()) {
      ++next_;
      ring_->sent.store(next_, std::memory_order_relaxed);
    }
    return s;
  }

  bool any_ready() const noexcept {
    if (ordering_ == Ordering::kPerClient) {
      return ring_->ready(head_) || ring_->has_partial(head_);
    }
    return ring_->delivered.load(std::memory_order_seq_cst) > popped_ ||
           ring_->partials.load(std::memory_order_seq_cst) > partials_popped_;
  }

  // A request's partial responses come before its final one: ready() is read first, and
  // every partial response was in before the final one was given.
  std::optional<Response<Out>> take_ready() {
    if (ordering_ == Ordering::kPerClient) {
      const bool final = ring_->ready(head_);
      if (ring_->has_partial(head_)) {
        ++partials_popped_;
        return ring_->take_partial(head_);
      }
      if (!final) return std::nullopt;
      Response<Out> r = ring_->take(head_, false);
      ++head_;
      ++popped_;
      return r;
    }
    for (std::uint64_t s = head_; s < next_; ++s) {
      const bool final = ring_->ready(s);
      if (ring_->has_partial(s)) {
        ++partials_popped_;
        return ring_->take_partial(s);
      }
      if (!final) continue;
      Response<Out> r = ring_->take(s, true);
      ++popped_;
      while (head_ < next_ && ring_->taken(head_)) ring_->clear(head_++);
      return r;
    }
    return std::nullopt;
  }

  std::shared_ptr<detail::AdmissionQueue<In>> admission_;
  std::shared_ptr<detail::ResponseRing<Out>> ring_;
  std::uint32_t id_;
  Ordering ordering_;
  std::uint32_t classes_;
  std::uint32_t priority_ = 0;
  std::uint64_t next_ = 0;                   ///< the next request's sequence number
  std::uint64_t head_ = 0;                   ///< the oldest sequence not popped
  std::uint64_t popped_ = 0;                 ///< responses popped
  std::uint64_t partials_popped_ = 0;        ///< partial responses popped
  std::vector<std::uint32_t> device_cores_;  ///< cores the stream's devices are pinned to
  WaitPolicy wait_{};
  bool wait_chosen_ = false;  ///< set_wait() was called, or the first wait chose
};

}  // namespace bspflow
