// Internal to streams (installed because the stream templates use it): a batch stage at the
// head of its segment (batch_stage): forms batches from whatever is waiting (the higher
// priority class first), bounded by max_batch and max_delay from the first request's
// arrival, flushes early when waiting would make the tightest deadline waiting miss it (from
// its own service time per batch size, measured online), runs no request that can no longer
// make its deadline, pads to the allowed sizes, and answers each request on its own.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/ops.hpp"
#include "bspflow/stream/detail/segment.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow::detail {

// A batch stage's element type: Out, or ItemResult<Out> (items may fail on their own).
template <class E>
struct BatchElement {
  using type = E;
  static constexpr bool fallible = false;
};
template <class T>
struct BatchElement<ItemResult<T>> {
  using type = T;
  static constexpr bool fallible = true;
};

// The stage's service time per (padded) batch size: an EWMA per size seen, and a straight
// line a + b*n fitted to all of them (exponentially forgotten) for sizes not seen lately.
// While a single size has been measured the line is unknown, and the estimate errs towards
// lateness: the whole measured cost is taken as fixed for smaller sizes.
// Robust to outliers: a sample above twice the current estimate for its size counts as twice
// the estimate (a preempted call on a VM takes milliseconds; taken at face value it would
// make the stage drop and refuse what it can serve). A size not measured in the last
// kFresh batches is estimated from the line: its own figure may be from another regime, and
// while admission keeps batches small a large size would never be measured again.
class BatchCostModel {
 public:
  static constexpr std::uint64_t kFresh = 64;
  explicit BatchCostModel(std::size_t max_size) : per_size_(max_size + 1) {}
  void add(std::size_t n, double ns) {
    const double ref = estimate(n);
    if (ref > 0.0) ns = std::min(ns, 2.0 * ref);
    ++batches_;
    Size& e = per_size_[n];
    e.ns = e.ns == 0.0 || batches_ - e.at > kFresh ? ns : e.ns + (ns - e.ns) / 8.0;
    e.at = batches_;
    constexpr double kKeep = 0.98;
    w_ = w_ * kKeep + 1.0;
    sn_ = sn_ * kKeep + static_cast<double>(n);
    st_ = st_ * kKeep + ns;
    snn_ = snn_ * kKeep + static_cast<double>(n) * static_cast<double>(n);
    snt_ = snt_ * kKeep + static_cast<double>(n) * ns;
  }
  // Nanoseconds for a batch of n (0 until anything was measured).
  double estimate(std::size_t n) const {
    if (n < per_size_.size()) {
      const Size& e = per_size_[n];
      if (e.ns > 0.0 && batches_ - e.at <= kFresh) return e.ns;
    }
    if (w_ == 0.0) return 0.0;
    const double den = w_ * snn_ - sn_ * sn_;
    if (den <= 1e-9 * w_ * snn_) {
      // One size measured so far: nothing tells a call's fixed cost from its cost per incoming.
      // Err towards lateness: a smaller batch costs as much as the one measured (all fixed),
      // a larger one proportionally more (all per item).
      const double size = sn_ / w_, cost = st_ / w_;
      return cost * std::max(1.0, static_cast<double>(n) / size);
    }
    const double b = std::max(0.0, (w_ * snt_ - sn_ * st_) / den);
    const double a = std::max(0.0, (st_ - b * sn_) / w_);
    return a + b * static_cast<double>(n);
  }

 private:
  struct Size {
    double ns = 0.0;       // EWMA of this size's calls (0: none yet)
    std::uint64_t at = 0;  // batches_ when last measured
  };
  std::vector<Size> per_size_;
  std::uint64_t batches_ = 0;
  double w_ = 0, sn_ = 0, st_ = 0, snn_ = 0, snt_ = 0;
};

// One version of a batch stage's callable.
template <class X, class Elem>
class BatchFn : public Versioned {
 public:
  virtual std::vector<Elem> call(std::span<X> batch) = 0;
};
template <class X, class Elem, class F>
class BatchFnOf final : public BatchFn<X, Elem> {
 public:
  explicit BatchFnOf(F f) : f_(std::move(f)) {}
  std::vector<Elem> call(std::span<X> batch) override { return f_(batch); }

 private:
  F f_;
};

// A batch stage at the head of its segment, untyped for the segment's loop.
class BatchHeadBase {
 public:
  virtual ~BatchHeadBase() = default;
  // Device thread: collects the next batch from `source` (blocking for its first request;
  // `before_wait` runs before a blocking wait). False (nothing collected) at the end or on
  // stop.
  virtual bool collect(Source& source, const WaitPolicy& policy, const StopFlag& stop,
                       const std::function<void()>& before_wait) = 0;
  // Device thread: runs the collected batch; then sources 0..size()-1 are ready. `f` is the
  // in-flight record of the batch (its time and modeled time).
  virtual void run(InFlight& f) = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual const RequestMeta& meta(std::size_t i) const = 0;
  // Source i's error before the run (taken with one, cancelled, expired, or would end late):
  // answered or forwarded without the batch.
  virtual const std::shared_ptr<const RequestError>& early_error(std::size_t i) const = 0;
  virtual bool skipped(std::size_t i) const = 0;
  // Source i into the batch node's slot (its output, its error or its skip mark).
  virtual void fill(std::size_t i) = 0;
  virtual void clear() = 0;
  VersionCell cell;
  const NodeRun* node = nullptr;
  double downstream_ns = 0;          // the measured time of the stages after it (set per batch)
  std::vector<StageMeter*> after;    // the meters of the stages after it, for downstream_ns
  StreamClock::time_point origin{};  // the run's start (modeled time 0)
  bool first_node = false;           // its input is the stream's input (modeled arrival = the push)
};

template <class Cur, class Elem>
class BatchHead final : public BatchHeadBase {
  using Mid = typename BatchElement<Elem>::type;
  static constexpr bool kFallible = BatchElement<Elem>::fallible;

 public:
  BatchHead(BatchConfig config, Slot<Mid>& out)
      : config_(std::move(config)), cost_(config_.padded(config_.max_batch)), out_(out) {
    inputs_.reserve(config_.padded(config_.max_batch));
    members_.reserve(4 * config_.max_batch);
  }

  bool collect(Source& source, const WaitPolicy& policy, const StopFlag& stop,
               const std::function<void()>& before_wait) override {
    Incoming incoming;
    if (!source.try_next(incoming)) {
      before_wait();
      if (!source.next(incoming, policy, stop)) return false;
    }
    add(incoming);
    downstream_ns = downstream();
    const std::size_t max = config_.max_batch;
    for (;;) {
      while (live_ < max && members_.size() < 2 * max && source.try_next(incoming)) add(incoming);
      if (live_ == 0 || live_ >= max || members_.size() >= 2 * max) break;
      const auto now = StreamClock::now();
      const auto flush_by = flush_time(now);
      if (now >= flush_by) break;
      if (config_.deadline_aware && !config_.max_delay && !worth_waiting(now, flush_by)) break;
      if (!source.next_until(incoming, flush_by, policy, stop)) break;
      add(incoming);
    }
    // Requests that would finish late are answered now; their places go to others waiting.
    while (config_.deadline_aware && drop_late(StreamClock::now())) {
      bool added = false;
      while (live_ < max && members_.size() < 4 * max && source.try_next(incoming)) {
        add(incoming);
        added = true;
      }
      if (!added) break;
    }
    return true;
  }

  void run(InFlight& f) override {
    if (live_ == 0) return;
    const auto t0 = StreamClock::now();
    const std::size_t n = live_;
    const std::size_t padded = config_.padded(n);
    if constexpr (std::is_default_constructible_v<Cur>) {
      while (inputs_.size() < padded) inputs_.emplace_back();
    }
    StageMeter* meter = f.timing ? node->meter : nullptr;
    if (meter != nullptr) {
      for (const BatchMember& e : members_) {
        if (e.input >= 0) {
          const auto w = (t0 - e.meta.enqueued).count();
          meter->wait.record(static_cast<std::uint64_t>(w > 0 ? w : 0));
        }
      }
      meter->begin(t0, first_live_id());
    }
    std::exception_ptr failed;
    results_.clear();
    // The version is read and its count bumped before it is let go: a swap frees it after.
    auto* fn = static_cast<BatchFn<Cur, Elem>*>(cell.acquire());
    version_ = fn->version;
    try {
      results_ = fn->call(std::span<Cur>(inputs_.data(), inputs_.size()));
    } catch (...) {
      failed = std::current_exception();
    }
    bump(fn->calls);
    cell.release();
    const auto t1 = StreamClock::now();
    cost_.add(inputs_.size(), static_cast<double>((t1 - t0).count()));
    if (node->model != nullptr) {
      // Modeled: the batch starts once its last request has arrived (real time since the
      // run's start for the stream's first node, else when the previous device was done).
      double ready = 0;
      for (const BatchMember& e : members_) {
        if (e.input < 0) continue;
        ready = std::max(ready, first_node ? static_cast<double>(std::max<std::int64_t>(
                                                 0, (e.meta.arrival - origin).count()))
                                           : e.meta.modeled_ns);
      }
      f.modeled = ready;
      charge(f, *node, inputs_.size());
      for (BatchMember& e : members_) e.meta.modeled_ns = f.modeled;
    }
    if (meter != nullptr) {
      const std::size_t full = config_.padded(config_.max_batch);
      meter->drain_ns.store(
          static_cast<std::int64_t>(cost_.estimate(full) / static_cast<double>(config_.max_batch)),
          std::memory_order_relaxed);
      meter->end((t1 - t0).count(), n);
      meter->batch.record(n);
      bump(meter->padded, inputs_.size() - n);
    }
    f.t = t1;
    if (!failed && results_.size() < n) {
      failed = std::make_exception_ptr(
          Error("batch stage '" + node->name + "' returned " + std::to_string(results_.size()) +
                " result(s) for a batch of " + std::to_string(n) + " request(s)"));
    }
    for (BatchMember& e : members_) {
      if (e.input < 0) continue;
      e.meta.version = std::max(e.meta.version, version_);
      if (failed) {
        e.late_error = make_request_error(
            ErrorKind::kStageFailed, e.meta, node->index, node->name, node->device_id,
            "failed in its batch of " + std::to_string(n) + ": " + describe_exception(failed),
            failed);
      } else if constexpr (kFallible) {
        auto& r = results_[static_cast<std::size_t>(e.input)];
        if (!r.ok()) {
          e.late_error = make_request_error(ErrorKind::kStageFailed, e.meta, node->index,
                                            node->name, node->device_id, "failed: " + r.error());
        }
      }
    }
  }

  std::size_t size() const noexcept override { return members_.size(); }
  const RequestMeta& meta(std::size_t i) const override { return members_[i].meta; }
  const std::shared_ptr<const RequestError>& early_error(std::size_t i) const override {
    return members_[i].early_error;
  }
  bool skipped(std::size_t i) const override { return members_[i].skipped; }
  void fill(std::size_t i) override {
    BatchMember& e = members_[i];
    if (e.early_error) {
      out_.set_error(e.early_error);
    } else if (e.skipped) {
      out_.set_skipped();
    } else if (e.late_error) {
      out_.set_error(e.late_error);
    } else {
      auto& r = results_[static_cast<std::size_t>(e.input)];
      if constexpr (kFallible) {
        out_.set(std::move(r.value()));
      } else {
        out_.set(std::move(r));
      }
    }
  }
  void clear() override {
    members_.clear();
    inputs_.clear();
    live_ = 0;
  }

 private:
  struct BatchMember {
    RequestMeta meta;
    std::shared_ptr<const RequestError> early_error;  // not run: answered without the batch
    std::shared_ptr<const RequestError> late_error;   // run, and failed
    bool skipped = false;
    std::ptrdiff_t input = -1;  // index in inputs_, -1 if not run
  };

  void add(Incoming& incoming) {
    BatchMember e{incoming.meta, std::move(incoming.error), nullptr, incoming.skipped, -1};
    if (e.early_error == nullptr && !e.skipped) {
      const auto now = StreamClock::now();
      InFlight probe;
      probe.meta = e.meta;
      if (auto dead = check_live(probe, *node)) {
        e.early_error = std::move(dead);
      } else if (incoming.value != nullptr) {
        e.input = static_cast<std::ptrdiff_t>(inputs_.size());
        inputs_.emplace_back(std::move(*static_cast<Cur*>(incoming.value)));
        const auto arrived = e.meta.enqueued == StreamClock::time_point{} ? now : e.meta.enqueued;
        if (live_ == 0) {
          first_arrival_ = arrived;
          oldest_deadline_ = e.meta.deadline;
        } else {
          oldest_deadline_ = std::min(oldest_deadline_, e.meta.deadline);
        }
        const auto gap = (arrived - last_arrival_).count();
        if (last_arrival_ != StreamClock::time_point{} && gap >= 0) {
          gap_ns_ = gap_ns_ == 0 ? gap : gap_ns_ + (gap - gap_ns_) / 8;
        }
        last_arrival_ = std::max(last_arrival_, arrived);
        ++live_;
      } else {
        e.skipped = true;
      }
    }
    members_.push_back(std::move(e));
  }

  // Deadline-aware: a request this batch would answer after its deadline (by the measured
  // service time of the batch and of the later stages) is not run: it is answered
  // kDeadlineExceeded now, which frees its place for a request that can still make it. The
  // estimate is a typical call's, with no margin: a request dropped on a pessimistic guess
  // is a sure loss, one run on an optimistic one may still make it, and the answers that do
  // come late tell admission control to queue less (AdmissionQueue::learn_from_late). Returns
  // whether any was dropped (then inputs_ holds the others only).
  bool drop_late(StreamClock::time_point now) {
    const double service = cost_.estimate(config_.padded(live_));
    if (service <= 0.0) return false;  // nothing measured yet
    const auto done =
        now + std::chrono::nanoseconds(static_cast<std::int64_t>(service + downstream_ns));
    bool dropped = false;
    for (BatchMember& e : members_) {
      if (e.input < 0 || e.meta.deadline == kNoDeadline || e.meta.deadline >= done) continue;
      e.early_error = make_request_error(ErrorKind::kDeadlineExceeded, e.meta, node->index,
                                         node->name, node->device_id,
                                         "was not run: its batch would have finished after its "
                                         "deadline");
      e.input = -2;
      dropped = true;
    }
    if (!dropped) return false;
    std::vector<Cur> kept;
    kept.reserve(inputs_.capacity());
    oldest_deadline_ = kNoDeadline;
    for (BatchMember& e : members_) {
      if (e.input == -2) {
        e.input = -1;
      } else if (e.input >= 0) {
        kept.push_back(std::move(inputs_[static_cast<std::size_t>(e.input)]));
        e.input = static_cast<std::ptrdiff_t>(kept.size() - 1);
        oldest_deadline_ = std::min(oldest_deadline_, e.meta.deadline);
      }
    }
    inputs_ = std::move(kept);
    live_ = inputs_.size();
    return true;
  }

  double downstream() const {
    double d = 0;
    for (const StageMeter* m : after) {
      d += static_cast<double>(m->per_item_ns.load(std::memory_order_relaxed));
    }
    return d;
  }
  // Slack kept for the clock, a wake-up and the hand-over to the client.
  static double guard_ns(double service) { return 20'000.0 + service / 4.0; }

  // Deadline-aware, without a fixed delay: whether waiting for one more request pays. It
  // does while the batch is too small to keep up with the arrivals with some headroom
  // (served back to back, batches of this size would keep the device busier than kBusy:
  // kBusy * live * gap < service(live)), and only if the next request is expected before
  // the batch must go. Otherwise waiting adds latency and no throughput, so the batch goes now.
  bool worth_waiting(StreamClock::time_point now, StreamClock::time_point flush_by) const {
    if (gap_ns_ <= 0) return false;  // no arrival rate measured yet: greedy
    const double service = cost_.estimate(config_.padded(live_));
    constexpr double kBusy = 0.75;
    if (kBusy * static_cast<double>(live_) * static_cast<double>(gap_ns_) >= service) return false;
    return now + std::chrono::nanoseconds(gap_ns_) <= flush_by;
  }

  // When the batch being formed must go: its max_delay, or (deadline-aware) the last moment
  // the tightest deadline waiting can still be made.
  StreamClock::time_point flush_time(StreamClock::time_point now) const {
    auto t = StreamClock::time_point::max();
    if (config_.max_delay) t = first_arrival_ + *config_.max_delay;
    if (config_.deadline_aware && oldest_deadline_ != kNoDeadline) {
      const double next = cost_.estimate(config_.padded(std::min(live_ + 1, config_.max_batch)));
      const auto by = oldest_deadline_ - std::chrono::nanoseconds(static_cast<std::int64_t>(
                                             next + downstream_ns + guard_ns(next)));
      t = std::min(t, by);
    }
    return t == StreamClock::time_point::max() ? now : t;
  }

  RequestId first_live_id() const {
    for (const BatchMember& e : members_) {
      if (e.input >= 0) return e.meta.id;
    }
    return {};
  }

  BatchConfig config_;
  BatchCostModel cost_;
  Slot<Mid>& out_;
  std::vector<Cur> inputs_;
  std::vector<Elem> results_;
  std::vector<BatchMember> members_;
  std::size_t live_ = 0;
  std::uint32_t version_ = 0;
  StreamClock::time_point first_arrival_{}, last_arrival_{};
  Deadline oldest_deadline_ = kNoDeadline;
  std::int64_t gap_ns_ = 0;  // EWMA of the gap between arrivals
};

}  // namespace bspflow::detail
