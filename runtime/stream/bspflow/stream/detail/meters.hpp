// Internal to streams (installed because the stream templates use it): the per-stage,
// per-class and per-replica meters the device threads write (one writer each) and
// Stream::stats() reads, and the modeled cost of a stage.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/devices/modeled_clock.hpp"
#include "bspflow/stream/detail/request_state.hpp"
#include "bspflow/stream/histogram.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow::detail {

// One stage of one replica in modeled time: its device's clock and its declared cost
// (StreamBuilder::cost), in ns.
struct StageModel {
  ModeledClock* clock = nullptr;
  double per_item_ns = 0, per_call_ns = 0;
  bool declared = false;
};

// One writer's relaxed counter: store(load + 1), no read-modify-write.
inline void bump(std::atomic<std::uint64_t>& c, std::uint64_t by = 1) noexcept {
  c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

// Exponentially weighted moving average (1/16 per sample) kept in an atomic for readers,
// robust to outliers: a sample above twice the average counts as twice the average. A call
// stretched by a preemption (milliseconds on a VM) would otherwise lift the average for
// dozens of calls and admission would refuse what it could serve; a real slowdown still
// moves it (doubling within about a dozen calls).
inline void ewma(std::atomic<std::int64_t>& avg, std::int64_t sample) noexcept {
  const std::int64_t a = avg.load(std::memory_order_relaxed);
  if (a == 0) {
    avg.store(sample, std::memory_order_relaxed);
    return;
  }
  const std::int64_t s = std::min(sample, 2 * a);
  avg.store(a + (s - a) / 16, std::memory_order_relaxed);
}

// Admission's feedback (see AdmissionQueue::admit): the widening of its predicted wait, learnt from
// how many answers came after their deadline. The prediction is the measured service times;
// what they leave out (a descheduled device, a slower stretch, a burst) shows as late answers.
// Over each kWindow answers with a deadline, more than kTarget of them late widens the wait by
// an eighth (up to kMaxSlack more); under a quarter of kTarget narrows it by a thirty-second
// (down to the measured figure). Not thread-safe (the admission queue's lock guards it).
class LateFeedback {
 public:
  static constexpr std::uint64_t kWindow = 512;
  static constexpr double kTarget = 0.0025;
  static constexpr double kMaxSlack = 4.0;
  // `timed`, `late`: answers with a deadline, and of those the late ones, so far (counts
  // that only grow; a smaller `timed` than last time starts over).
  void update(std::uint64_t timed, std::uint64_t late) noexcept {
    if (timed < timed_seen_) {
      timed_seen_ = timed;
      late_seen_ = late;
    }
    if (timed - timed_seen_ < kWindow) return;
    const double fraction =
        static_cast<double>(late - late_seen_) / static_cast<double>(timed - timed_seen_);
    if (fraction > kTarget) {
      slack_ = std::min(kMaxSlack, slack_ + 0.125);
    } else if (fraction < kTarget / 4) {
      slack_ = std::max(0.0, slack_ - 0.03125);
    }
    timed_seen_ = timed;
    late_seen_ = late;
  }
  // The predicted wait is multiplied by 1 + slack().
  double slack() const noexcept { return slack_; }

 private:
  double slack_ = 0.0;
  std::uint64_t timed_seen_ = 0, late_seen_ = 0;
};

inline constexpr std::uint64_t kMeterHighestNs = 3'600'000'000'000ull;  // an hour
inline constexpr std::uint64_t kMeterHighestBatch = 4096;

// One stage of one replica. Written by the stage's device thread (stalls by the monitor).
struct StageMeter {
  StageMeter() : service(kMeterHighestNs), wait(kMeterHighestNs), batch(kMeterHighestBatch) {}
  Histogram service;
  Histogram wait;
  Histogram batch;
  std::atomic<std::uint64_t> calls{0}, padded{0};
  std::atomic<std::uint64_t> stalls{0};       // the stall monitor's
  std::atomic<std::int64_t> busy_since{0};    // stream_ns() at the call's start, 0 idle
  std::atomic<std::uint32_t> busy_client{0};  // the request (first of a batch) in the call
  std::atomic<std::uint64_t> busy_sequence{0};
  std::atomic<std::int64_t> per_item_ns{0};  // EWMA of a call's time per request
  std::atomic<std::int64_t> call_ns{0};      // EWMA of a call's time
  // Time per request while requests queue up (a batch stage: a full batch's per request;
  // 0: as per_item_ns). What admission control predicts a queue's wait from.
  std::atomic<std::int64_t> drain_ns{0};

  // Device thread: a call on `id` starts at `t`.
  void begin(StreamClock::time_point t, const RequestId& id) noexcept {
    busy_client.store(id.client, std::memory_order_relaxed);
    busy_sequence.store(id.sequence, std::memory_order_relaxed);
    busy_since.store(stream_ns(t), std::memory_order_relaxed);
  }
  // Device thread: the call took `ns` for `items` requests.
  void end(std::int64_t ns, std::uint64_t items) noexcept {
    busy_since.store(0, std::memory_order_relaxed);
    const auto v = static_cast<std::uint64_t>(ns < 0 ? 0 : ns);
    service.record(v);
    bump(calls);
    ewma(call_ns, static_cast<std::int64_t>(v));
    ewma(per_item_ns, static_cast<std::int64_t>(v / (items == 0 ? 1 : items)));
  }
};

// One priority class's answers in one replica: written by the replica's last segment.
struct ClassMeter {
  ClassMeter() : latency(kMeterHighestNs) {}
  Histogram latency;
  std::atomic<std::uint64_t> answered{0}, ok{0};
  std::array<std::atomic<std::uint64_t>, kErrorKinds> errors{};
  // Any thread: adds its answers, latencies and errors to its class's and the stream's stats;
  // returns the answers it added.
  std::uint64_t add_to(ClassStats& cs, StreamStats& s) const {
    const auto lat = latency.snapshot();
    cs.latency_ns.merge(lat);
    s.latency_ns.merge(lat);
    const auto n = answered.load(std::memory_order_relaxed);
    cs.answered += n;
    s.answered += n;
    for (std::size_t k = 0; k < kErrorKinds; ++k) {
      const auto e = errors[k].load(std::memory_order_relaxed);
      cs.errors[k] += e;
      s.errors[k] += e;
    }
    return n;
  }
};

// One replica: written by its first segment's device (taken), its last (the answers, by
// class), and whichever device answers a request of it (left).
struct ReplicaMeter {
  explicit ReplicaMeter(std::uint32_t classes) {
    for (std::uint32_t c = 0; c < classes; ++c) by_class.push_back(std::make_unique<ClassMeter>());
  }
  std::vector<std::unique_ptr<ClassMeter>> by_class;
  std::atomic<std::uint64_t> taken{0};
  // Requests of this replica answered (by its last device or directly): taken - left are
  // in the replica now. Several writers.
  std::atomic<std::uint64_t> left{0};
  // Answers of requests with a deadline, and of those the ones made after it (admission's
  // feedback: how often its predictions were wrong).
  std::atomic<std::uint64_t> timed{0}, late{0};
  std::atomic<bool> stalled{false};   // the monitor's
  std::atomic<bool> failed{false};    // its runtime failed
  std::atomic<bool> draining{false};  // a rolling swap: takes nothing new until swapped
  // Outlier ejection (StreamConfig::ejection), written by the last segment: consecutive stage
  // failures, whether it is out of rotation and until when (stream_ns), how many times, and
  // whether a probe request is on its way (taken while ejected, not yet answered).
  std::uint32_t consecutive_failures = 0;  // last segment only
  std::atomic<bool> ejected{false};
  std::atomic<std::int64_t> ejected_until{0};
  std::atomic<std::uint64_t> ejections{0};
  std::atomic<std::uint32_t> ejection_level{0};  // doubles the time out per repeat
  std::atomic<bool> probing{false};
  // Takes no new request now (stalled, failed, draining, or ejected and not due a probe).
  bool closed_to_new() const noexcept {
    return stalled.load(std::memory_order_relaxed) || failed.load(std::memory_order_relaxed) ||
           draining.load(std::memory_order_relaxed);
  }
};

// What a generate stage counts (one writer: its device thread; read by stats()).
struct GenerateMeter {
  // Time to first output and between outputs, outputs and preemptions, by priority class.
  struct ByClass {
    ByClass() : ttft(kMeterHighestNs), itl(kMeterHighestNs) {}
    Histogram ttft, itl;
    std::atomic<std::uint64_t> tokens{0}, preemptions{0};
  };
  std::array<ByClass, kPriorityClasses> by_class;
  std::atomic<std::uint64_t> iterations{0};
  std::atomic<std::uint64_t> tokens{0};       // outputs made (partial and final)
  std::atomic<std::uint64_t> sequences{0};    // sequences ended (by any means)
  std::atomic<std::uint64_t> preemptions{0};  // sequences moved to host memory
  std::atomic<std::uint64_t> blocks_used{0};  // now
  std::atomic<std::uint64_t> blocks{0};       // the pool's size
  std::atomic<std::uint64_t> active{0};       // now
  std::atomic<std::uint64_t> waiting{0};      // preempted, now
  // Set when the stage is built: its active set's bound and the blocks a new sequence takes.
  std::uint64_t max_active = 0;
  std::uint64_t first_blocks = 0;
};

// Where a new sequence goes when each replica of a stream runs a generate stage: a replica
// leaves a new request to a sibling that beats it on both counts, requests in the replica
// (taken, not yet answered) and free blocks, strictly on one, and could start it now (open
// to new requests, a place in its active set, its first blocks free, none preempted). When
// neither of two beats the other, whichever comes first takes it. A sibling only beats
// this replica while it has room, so the request never waits for one that cannot take it.
struct GenerateBalance {
  struct Member {
    const ReplicaMeter* replica = nullptr;
    const GenerateMeter* generate = nullptr;
  };
  std::vector<Member> members;  // by replica

  // Device thread of replica `r`, before it takes a new request. Relaxed loads: a stale
  // figure places one request less well, it loses none.
  bool defer(std::uint32_t r) const noexcept {
    const Load mine = load(members[r]);
    for (std::size_t s = 0; s < members.size(); ++s) {
      if (s == r) continue;
      const Member& m = members[s];
      if (m.replica->closed_to_new() || m.replica->ejected.load(std::memory_order_relaxed) ||
          m.generate->waiting.load(std::memory_order_relaxed) != 0) {
        continue;
      }
      const Load o = load(m);
      if (o.in_replica >= m.generate->max_active || o.free < m.generate->first_blocks) continue;
      if (o.in_replica <= mine.in_replica && o.free >= mine.free &&
          (o.in_replica < mine.in_replica || o.free > mine.free)) {
        return true;
      }
    }
    return false;
  }

 private:
  struct Load {
    std::uint64_t in_replica, free;
  };
  static Load load(const Member& m) noexcept {
    const std::uint64_t left = m.replica->left.load(std::memory_order_relaxed);
    const std::uint64_t taken = m.replica->taken.load(std::memory_order_relaxed);
    const std::uint64_t blocks = m.generate->blocks.load(std::memory_order_relaxed);
    const std::uint64_t used = m.generate->blocks_used.load(std::memory_order_relaxed);
    return {taken > left ? taken - left : 0, blocks > used ? blocks - used : 0};
  }
};

}  // namespace bspflow::detail
