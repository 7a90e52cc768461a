// Internal to streams (installed because the stream templates use it): what one device's
// segment works with. A segment runs a replica's nodes placed on one device (or on devices
// sharing a core) for one request at a time: it takes the request from its source (the
// admission queue, or a Hop from another segment), then runs its ops in the graph's order.
// Each node's value for the request in flight lives in a Slot.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/wait_policy.hpp"
#include "bspflow/stream/detail/hop.hpp"
#include "bspflow/stream/detail/meters.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_config.hpp"

namespace bspflow::detail {

// Any thread: a RequestError of `kind` for the request `meta`, answered by node `stage`
// ('stage_name', on device `device`): "stage 'x' (k) on device d: request s of client c <why>".
std::shared_ptr<const RequestError> make_request_error(ErrorKind kind, const RequestMeta& meta,
                                                       std::uint32_t stage,
                                                       const std::string& stage_name,
                                                       std::uint32_t device, const std::string& why,
                                                       std::exception_ptr cause = nullptr);

// One run's shared state: held by the host and every device job.
class StreamRunState {
 public:
  explicit StreamRunState(std::uint32_t segments) : ending_(segments), remaining_(segments) {}
  StopFlag stop;
  // Any thread. Stops every device at its next wait or request. Never blocks.
  void cancel() noexcept;
  // Device thread. Keeps the first failure, then cancels.
  void fail(std::shared_ptr<const RequestError> error) noexcept;
  // Device thread: this segment's loop has ended. The last one to end runs the end action
  // (set_on_end), then wakes wait_done().
  void segment_done() noexcept;
  // Host thread, before the run: what the last segment to end runs (answers what a stopped
  // run still holds, so clients get their answers without waiting for the host's wait()).
  void set_on_end(std::function<void()> on_end) { on_end_ = std::move(on_end); }
  // Host thread: blocks until every segment has ended.
  void wait_done();
  bool done() const noexcept { return remaining_.load(std::memory_order_seq_cst) == 0; }
  std::shared_ptr<const RequestError> failure() const;
  // Host thread, before the run: what cancel() calls to wake the queues.
  void set_waker(std::function<void()> waker);
  // Host thread, once the run has ended: cancel() no longer touches the queues.
  void disarm();

 private:
  std::mutex waker_mutex_;
  std::function<void()> waker_;
  mutable std::mutex mutex_;
  std::shared_ptr<const RequestError> failure_;
  std::atomic<std::uint32_t> ending_;     // segments whose loop has not ended
  std::atomic<std::uint32_t> remaining_;  // ... nor their end action (wait_done() waits for it)
  std::function<void()> on_end_;
  WaitPoint done_;
};

// Answers a request straight to its client with an error: a request shed by admission, held
// by a device when the run stopped, or (in a chain) one a batch stage will not run.
class ResponderBase {
 public:
  virtual ~ResponderBase() = default;
  // Any thread. The request's replica (meta.replica, if `in_replica`) counts it as left.
  virtual void answer_error(const RequestMeta& meta, std::shared_ptr<const RequestError> error,
                            bool in_replica = true) = 0;
};

// One node of one replica as its segment sees it: its name and index (for errors and
// meters), the device it was declared on, its meter and its modeled cost.
struct NodeRun {
  std::uint32_t index = 0;  // RequestError::stage, StageStats::stage
  std::string name;
  std::uint32_t device_id = 0;  // Device::id()
  StageMeter* meter = nullptr;  // null: not timed (the input node, route branches)
  const StageModel* model = nullptr;
};

// What a segment's ops share while they run one request.
struct InFlight {
  RequestMeta meta;
  bool timing = false;
  StreamClock::time_point t{};  // timing: when the previous op ended
  double modeled = 0;           // the request's modeled time so far
  StreamClock::time_point origin{};
  // The first stage failure met (for fail-fast), or null.
  std::shared_ptr<const RequestError> failure;
};

// A node's value for the request in flight: a value, an error, or skipped (a route chose
// another branch). `readers` ops read it; the last of them moves the value out, the others
// copy it.
class SlotBase {
 public:
  virtual ~SlotBase() = default;
  std::shared_ptr<const RequestError> error;
  bool skipped = false;
  std::uint32_t readers = 1;
  std::uint32_t taken = 0;
  virtual bool has_value() const noexcept = 0;
  virtual void clear() noexcept = 0;
  void set_error(std::shared_ptr<const RequestError> e) {
    clear();
    error = std::move(e);
    skipped = false;
    taken = 0;
  }
  void set_skipped() {
    clear();
    error.reset();
    skipped = true;
    taken = 0;
  }
};

template <class T>
class Slot final : public SlotBase {
 public:
  std::optional<T> value;
  bool has_value() const noexcept override { return value.has_value(); }
  void clear() noexcept override { value.reset(); }
  void set(T&& v) {
    value.emplace(std::move(v));
    error.reset();
    skipped = false;
    taken = 0;
  }
  // A reader's copy of the value, or the value itself for the last reader.
  T take() {
    if (++taken >= readers) return std::move(*value);
    if constexpr (std::is_copy_constructible_v<T>) {
      return *value;
    } else {
      return std::move(*value);  // the builder refuses a move-only value read twice
    }
  }
  // The same as a queued request's fields (for an export or the output).
  void copy_state_to(Queued<T>& e) {
    e.error = error;
    e.skipped = skipped;
    if (value) {
      e.value.emplace(take());
    } else {
      e.value.reset();
    }
  }
};

// A segment's context for its ops.
struct SegmentCtx {
  const WaitPolicy* policy = nullptr;
  StreamRunState* state = nullptr;
  OnError on_error = OnError::kRespond;
  bool abort_on_failure = false;  // the graph has branches: a failure drops the others' work
};

// One op of a segment: an import from another segment, a node, an export, or the output.
class OpBase {
 public:
  virtual ~OpBase() = default;
  // Device thread: runs for the request in flight. False: the run must stop here (stopped while
  // waiting, or a fail-fast failure, kept in in_flight.failure).
  virtual bool run(InFlight& f, SegmentCtx& ctx) = 0;
};

// What a segment takes next: the request's meta data, and its value or the error or skip
// mark it carries. `value` stays valid until the next call.
struct Incoming {
  RequestMeta meta;
  void* value = nullptr;  // the first node's value type, nullptr if none
  std::shared_ptr<const RequestError> error;
  bool skipped = false;
};

// Where a segment takes its requests from: the admission queue, or a Hop.
class Source {
 public:
  virtual ~Source() = default;
  // Never blocks: true with the next request in `out`.
  virtual bool try_next(Incoming& out) = 0;
  // Blocks as `policy` says: true with the next request, false at the end or on stop.
  virtual bool next(Incoming& out, const WaitPolicy& policy, const StopFlag& stop) = 0;
  // Waits at most until `until` (spinning, yielding if `policy` does): true with the next
  // request. A batch stage's bounded wait for more.
  bool next_until(Incoming& out, StreamClock::time_point until, const WaitPolicy& policy,
                  const StopFlag& stop) {
    bool got = false;
    const auto left = until - StreamClock::now();
    if (left <= StreamClock::duration::zero()) return try_next(out);
    spin_until(
        [&] {
          got = try_next(out);
          return got || stop.requested();
        },
        policy.spin_mode(), std::chrono::duration_cast<std::chrono::nanoseconds>(left));
    return got;
  }
};

// Before node `n` runs for the request in flight: a cancelled, aborted or expired request is
// not run. Returns the error to answer it with, or null. Reads the clock only for a request
// with a deadline.
std::shared_ptr<const RequestError> check_live(const InFlight& f, const NodeRun& n);

// Node `n` has run on `items` requests: its device's modeled clock takes its declared cost.
inline void charge(InFlight& f, const NodeRun& n, std::size_t items) noexcept {
  if (n.model == nullptr || n.model->clock == nullptr) return;
  ModeledClock& clock = *n.model->clock;
  clock.idle_until(f.modeled);
  if (n.model->declared) {
    clock.compute(n.model->per_call_ns + n.model->per_item_ns * static_cast<double>(items));
  } else {
    clock.undeclared();
  }
  f.modeled = clock.now();
}

}  // namespace bspflow::detail
