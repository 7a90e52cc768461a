// StreamClient: one client thread's handle on a serving Stream (see stream.hpp): pushes
// requests with deadlines through admission control, cancels them, and pops its own
// responses, in the order it pushed them (or as they come, Ordering::kNone), with no router
// thread between the stream and the client.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "bspflow/base/wait_policy.hpp"
#include "bspflow/devices/topology.hpp"

#include "bspflow/stream/detail/stream_hub.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_config.hpp"

namespace bspflow {

template <class In, class Out>
class Stream;

// One per client thread (not thread-safe; movable). Made by Stream::client(); may outlive
// the Stream (pushes then say kClosed). Every accepted request is answered exactly once:
// with its value, or an error of its kind (also on close, cancel and failure).
template <class In, class Out>
class StreamClient {
 public:
  StreamClient(StreamClient&&) noexcept = default;
  StreamClient& operator=(StreamClient&&) = delete;
  // Responses still on their way are dropped; requests still queued or in flight are
  // cancelled (answered kCancelled to nobody).
  ~StreamClient() {
    if (!ring_) return;
    for (std::uint64_t s = head_; s < next_; ++s) ring_->cancel(s);
    ring_->abandoned.store(true, std::memory_order_seq_cst);
  }

  // Client thread. Sends `value` (moved from only if accepted). Blocks only under
  // AdmissionPolicy::kBlock while the stream's queue is full. The Submission has the
  // request's id, or why it was refused (nothing queued then): kClosed when the stream is
  // not serving, kClientFull when response_capacity responses are unpopped, kDeadlinePassed,
  // kDeadlineUnreachable, kQueueFull (kReject), kShed. Never throws except std::bad_alloc.
  Submission push(In value, Deadline deadline = kNoDeadline) {
    return submit(value, deadline, true);
  }
  // Client thread. push() with a deadline `timeout` from now.
  Submission push_for(In value, std::chrono::nanoseconds timeout) {
    return submit(value, StreamClock::now() + timeout, true);
  }
  // Client thread. Never blocks: under kBlock a full queue refuses with kQueueFull. `value`
  // is untouched when refused.
  Submission try_push(In&& value, Deadline deadline = kNoDeadline) {
    return submit(value, deadline, false);
  }

  // Client thread. Cancels request `id` of this client: it is answered kCancelled at its
  // next stage boundary (a stage already running it finishes first; a response already made
  // stays). False if `id` is not an unanswered request of this client.
  bool cancel(const RequestId& id) noexcept {
    if (id.client != id_ || id.sequence >= next_ || id.sequence < head_) return false;
    if (ring_->ready(id.sequence)) return false;  // answered, not yet popped
    if (ordering_ == Ordering::kNone && ring_->taken(id.sequence)) return false;
    ring_->cancel(id.sequence);
    return true;
  }

  // Client thread. The next response (in push order, unless Ordering::kNone): blocks until
  // it arrives; nullopt at once if no request is outstanding.
  std::optional<Response<Out>> pop() { return pop_until(Deadline::max()); }
  // Client thread. Never blocks.
  std::optional<Response<Out>> try_pop() {
    if (head_ == next_) return std::nullopt;
    return take_ready();
  }
  // Client thread. Blocks until a response arrives or `until`.
  std::optional<Response<Out>> pop_until(Deadline until) {
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

  // Client thread. How pop() and pop_until() wait for a response (see wait_policy.hpp).
  // Default: spin-then-park; on a thread pinned to a core one of the stream's devices is
  // pinned to as well, capped as for sharing (it yields, spins at most
  // tunables::kSharedCoreSpinBudget, then parks), so a waiting client never takes the core
  // from the device it waits for. Setting a policy turns the automatic choice off. Throws
  // bspflow::Error on an invalid policy.
  void set_wait(WaitPolicy policy) {
    policy.validate();
    wait_ = policy;
    wait_chosen_ = true;
  }

  // Client thread. The policy pop() and pop_until() wait with: set_wait()'s, or the
  // automatic choice, made on the first call from where the calling thread is pinned.
  // Never blocks.
  const WaitPolicy& wait_policy() {
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

  // Requests sent and not yet popped.
  std::uint64_t outstanding() const noexcept { return next_ - popped_; }
  std::uint32_t id() const noexcept { return id_; }
  std::uint64_t sent() const noexcept { return next_; }

 private:
  template <class, class>
  friend class Stream;
  StreamClient(std::shared_ptr<detail::Intake<In>> intake,
               std::shared_ptr<detail::ClientRing<Out>> ring, std::uint32_t id, Ordering ordering,
               std::vector<std::uint32_t> device_cores)
      : intake_(std::move(intake)), ring_(std::move(ring)), id_(id), ordering_(ordering),
        device_cores_(std::move(device_cores)) {}

  Submission submit(In& value, Deadline deadline, bool blocking) {
    Submission s = intake_->push(*ring_, id_, next_, next_ - head_, value, deadline, blocking);
    if (s.accepted()) {
      ++next_;
      ring_->sent.store(next_, std::memory_order_relaxed);
    }
    return s;
  }

  bool any_ready() const noexcept {
    if (ordering_ == Ordering::kPerClient) return ring_->ready(head_);
    return ring_->delivered.load(std::memory_order_seq_cst) > popped_;
  }

  std::optional<Response<Out>> take_ready() {
    if (ordering_ == Ordering::kPerClient) {
      if (!ring_->ready(head_)) return std::nullopt;
      Response<Out> r = ring_->take(head_, false);
      ++head_;
      ++popped_;
      return r;
    }
    for (std::uint64_t s = head_; s < next_; ++s) {
      if (!ring_->ready(s)) continue;
      Response<Out> r = ring_->take(s, true);
      ++popped_;
      while (head_ < next_ && ring_->taken(head_)) ring_->clear(head_++);
      return r;
    }
    return std::nullopt;
  }

  std::shared_ptr<detail::Intake<In>> intake_;
  std::shared_ptr<detail::ClientRing<Out>> ring_;
  std::uint32_t id_;
  Ordering ordering_;
  std::uint64_t next_ = 0;                   // the next request's sequence number
  std::uint64_t head_ = 0;                   // the oldest sequence not popped
  std::uint64_t popped_ = 0;                 // responses popped
  std::vector<std::uint32_t> device_cores_;  // cores the stream's devices are pinned to
  WaitPolicy wait_{};
  bool wait_chosen_ = false;  // set_wait() was called, or the first wait chose
};

}  // namespace bspflow
