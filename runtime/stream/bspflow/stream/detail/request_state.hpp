// Internal to streams (installed because the stream templates use it): what travels with a
// request through a stream (RequestMeta), a request waiting in a queue or a hop (Queued), and
// the client's state the stream shares (ClientState: its cancel and abort words, what it was
// sent and has been answered).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/stream/request.hpp"

namespace bspflow::detail {

// Nanoseconds on the stream clock, for the meters' atomics.
inline std::int64_t stream_ns(StreamClock::time_point t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The untyped part of a StreamClient: its cancel and abort words and how many of its
// requests have been answered. Shared by the client and the stream (whichever lives longer
// frees it).
class ClientState {
 public:
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  // Setup path. `capacity`: a power of two.
  explicit ClientState(std::size_t capacity)
      : mask_(capacity - 1), cancel_(std::make_unique<std::atomic<std::uint64_t>[]>(capacity)),
        abort_(std::make_unique<std::atomic<std::uint64_t>[]>(capacity)) {
    for (std::size_t i = 0; i < capacity; ++i) {
      cancel_[i].store(kNone, std::memory_order_relaxed);
      abort_[i].store(kNone, std::memory_order_relaxed);
    }
  }
  virtual ~ClientState() = default;
  std::size_t capacity() const noexcept { return mask_ + 1; }
  // Any thread: whether request `sequence` of this client was cancelled. relaxed: a stage
  // sees a cancel at its next check; nothing else is published through the word.
  bool cancelled(std::uint64_t sequence) const noexcept {
    return cancel_[sequence & mask_].load(std::memory_order_relaxed) == sequence;
  }
  // Client thread.
  void cancel(std::uint64_t sequence) noexcept {
    cancel_[sequence & mask_].store(sequence, std::memory_order_relaxed);
  }
  // Any thread: request `sequence` failed on one branch of a graph; its other branches drop
  // it at their next boundary. relaxed: as cancelled().
  bool aborted(std::uint64_t sequence) const noexcept {
    return abort_[sequence & mask_].load(std::memory_order_relaxed) == sequence;
  }
  void abort(std::uint64_t sequence) noexcept {
    abort_[sequence & mask_].store(sequence, std::memory_order_relaxed);
  }
  // Any deliverer, after delivering `n` responses: wakes the client, then lets go.
  void notify_and_settle(std::uint64_t n) noexcept {
    arrived.notify();
    settled.fetch_add(n, std::memory_order_release);  // the last touch of *this
  }

  // Laid out by writer, a cache line each, so that the client's pushes and the devices'
  // answers do not take each other's lines: read-mostly first (the slots' mask, the cancel
  // words, `abandoned`), then what the client writes, then what deliverers write.
 protected:
  std::size_t mask_;

 private:
  std::unique_ptr<std::atomic<std::uint64_t>[]> cancel_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> abort_;

 public:
  std::atomic<bool> abandoned{false};  // the StreamClient is gone: drop its responses
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> sent{0};       // requests accepted
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> delivered{0};  // responses given
  std::atomic<std::uint64_t> partials{0};  // partial responses given (a generate stage's)
  // Responses whose deliverer is done with this object (delivered, then notified): the
  // stream frees an abandoned client's core only once settled == sent, so a deliverer never
  // touches freed memory between counting a response and waking the client.
  std::atomic<std::uint64_t> settled{0};
  WaitPoint arrived;  // a response arrived (a cache line of its own)
};

// What travels with a request from stage to stage.
struct RequestMeta {
  RequestId id{};
  Deadline deadline = kNoDeadline;
  StreamClock::time_point arrival{};   // the latency's origin: the push
  StreamClock::time_point enqueued{};  // arrival at the current device (queue wait's origin)
  ClientState* client = nullptr;       // the StreamClient that pushed it
  double modeled_ns = 0;      // modeled time it left its last device (StreamCore's modeled clocks)
  std::uint64_t order = 0;    // admission order (the admission queue's tie-break)
  std::uint32_t version = 0;  // the newest stage version that ran it (Response::version)
  std::uint8_t priority = 0;  // its priority class
  std::uint8_t replica = 0;   // the replica that took it
  bool probe = false;         // an ejected replica's probe (Ejection)
  // A generate stage's outputs travel on as occurrences of their request: `part` numbers
  // them (Response::index), and every one but the last is `partial`.
  bool partial = false;
  std::uint32_t part = 0;
};

// A request (or its error, or the mark that a route sent it elsewhere) between two devices.
template <class T>
struct Queued {
  RequestMeta meta{};
  std::optional<T> value{};
  std::shared_ptr<const RequestError> error{};
  bool skipped = false;  // a route chose another branch: nothing runs on it here
};

}  // namespace bspflow::detail
