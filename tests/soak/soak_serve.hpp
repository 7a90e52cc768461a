// What the soak suite's serving parts share (soak_serving.cpp: the serving run at volume and
// the seeded serving trials; soak_graph.cpp: the seeded graph trials): what a client saw
// (ServeTally) and the check of each answer against its request (PendingQueue); the checks of
// the tallies and of the stream's own counts; what a trial's configuration lets its clients
// see (refusal_allowed, errors_allowed); the one client loop of both trials (trial_client);
// and the loop that runs seeded trials (run_trials).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "soak_common.hpp"

namespace soak {

using U64 = std::uint64_t;

// What one client saw of its own requests: every accepted request must be answered once,
// in push order (Ordering::kPerClient), with its value or an error of a kind its request
// allows.
struct ServeTally {
  U64 accepted = 0, answered = 0, ok = 0;
  std::array<U64, 4> errors{};   // by ErrorKind
  std::array<U64, 8> refused{};  // by Refusal
  U64 disorder = 0;              // a response out of push order
  U64 unknown = 0;  // a response to no outstanding request (twice, or another client's)
  U64 wrong = 0;    // a wrong value, an error of a kind the request does not allow, or a
                    // refusal the trial's configuration cannot produce
  U64 missing = 0;  // accepted, never answered
  ServeTally& operator+=(const ServeTally& o) {
    accepted += o.accepted;
    answered += o.answered;
    ok += o.ok;
    for (std::size_t i = 0; i < errors.size(); ++i) errors[i] += o.errors[i];
    for (std::size_t i = 0; i < refused.size(); ++i) refused[i] += o.refused[i];
    disorder += o.disorder;
    unknown += o.unknown;
    wrong += o.wrong;
    missing += o.missing;
    return *this;
  }
  U64 refused_total() const {
    U64 n = 0;
    for (U64 r : refused) n += r;
    return n;
  }
  U64 errors_total() const {
    U64 n = 0;
    for (U64 e : errors) n += e;
    return n;
  }
  U64 errors_of(bspflow::ErrorKind k) const { return errors[static_cast<std::size_t>(k)]; }
  U64 refused_of(bspflow::Refusal r) const { return refused[static_cast<std::size_t>(r)]; }
};

// One accepted request, waiting for its answer.
struct Pending {
  U64 sequence = 0;
  U64 x = 0;                 // the request's value: an ok answer carries expected(x, version)
  std::uint8_t allowed = 0;  // bit per ErrorKind this request may be answered with
};

constexpr std::uint8_t bit(bspflow::ErrorKind k) {
  return std::uint8_t(1u << static_cast<unsigned>(k));
}

// A client's outstanding requests in push order. With Ordering::kPerClient every answer
// is the front's; with kNone any outstanding one's.
class PendingQueue {
 public:
  explicit PendingQueue(bool ordered) : ordered_(ordered) {}
  void add(const Pending& p) { q_.push_back(p); }
  std::size_t size() const { return q_.size() - answered_in_queue_; }
  // Checks `r` against the request it answers: an ok answer must carry expected(x, version)
  // (U64 (U64 x, std::uint32_t version): the value the version that answered gives).
  template <class Expected>
  void answer(const bspflow::Response<U64>& r, std::uint32_t client, ServeTally& t,
              const Expected& expected) {
    ++t.answered;
    if (r.ok()) {
      ++t.ok;
    } else {
      ++t.errors[static_cast<std::size_t>(r.kind())];
    }
    if (r.id.client != client) {
      ++t.unknown;
      return;
    }
    std::size_t i = 0;
    if (ordered_) {
      if (q_.empty() || q_.front().sequence != r.id.sequence) {
        ++t.disorder;
        i = find(r.id.sequence);
      }
    } else {
      i = find(r.id.sequence);
    }
    if (i == q_.size() || done_.count(r.id.sequence) != 0) {
      ++t.unknown;
      return;
    }
    const Pending& p = q_[i];
    const bool right =
        r.ok() ? *r.value == expected(p.x, r.version) : (p.allowed & bit(r.kind())) != 0;
    if (!right) ++t.wrong;
    if (i == 0) {
      q_.pop_front();
      while (!q_.empty() && done_.erase(q_.front().sequence) != 0) {
        q_.pop_front();
        --answered_in_queue_;
      }
    } else {
      done_.insert(r.id.sequence);
      ++answered_in_queue_;
    }
  }

 private:
  std::size_t find(U64 sequence) const {
    for (std::size_t i = 0; i < q_.size(); ++i) {
      if (q_[i].sequence == sequence) return i;
    }
    return q_.size();
  }
  bool ordered_;
  std::deque<Pending> q_;
  std::set<U64> done_;  // answered, not yet at the front (kNone)
  std::size_t answered_in_queue_ = 0;
};

// How long a client waits for an answer before it counts the request as lost.
inline constexpr std::chrono::seconds kPatience{20};

// Pops one answer into `q`; false if none came within kPatience (or none is outstanding).
template <class Expected>
bool pop_one(bspflow::StreamClient<U64, U64>& c, PendingQueue& q, ServeTally& t,
             const Expected& expected) {
  auto r = c.pop_until(bspflow::StreamClock::now() + kPatience);
  if (!r) return false;
  q.answer(*r, c.id(), t, expected);
  return true;
}

inline void check_serve_tally(const ServeTally& t) {
  CHECK(t.answered == t.accepted);
  CHECK(t.missing == 0);
  CHECK(t.unknown == 0);
  CHECK(t.disorder == 0);
  CHECK(t.wrong == 0);
}

// Checks the stream's own counts against what the clients saw.
inline void check_serve_stats(const bspflow::StreamStats& st, const bspflow::StreamResult& r,
                              const ServeTally& all) {
  CHECK(r.accepted == all.accepted);
  CHECK(r.answered == all.accepted);
  CHECK(r.unanswered == 0);
  CHECK(r.errors == all.errors_total());
  CHECK(st.answered == all.answered);
  CHECK(st.ok == all.ok);
  for (std::size_t k = 0; k < all.errors.size(); ++k) {
    CAPTURE(to_string(static_cast<bspflow::ErrorKind>(k)));
    CHECK(st.errors[k] == all.errors[k]);
  }
  CHECK(st.latency_ns.count() == st.answered);
  for (std::size_t k = 0; k < all.refused.size(); ++k) {
    if (k == static_cast<std::size_t>(bspflow::Refusal::kNone)) continue;
    CAPTURE(to_string(static_cast<bspflow::Refusal>(k)));
    CHECK(st.refusals[k] == all.refused[k]);
  }
}

// ---------------------------------------------------------------------------------------
// The seeded trials (serving and graph): what a trial's configuration allows, and the one
// client loop both run
// ---------------------------------------------------------------------------------------

// How a trial ends: after its clients finish (then closed), or by a close or a cancel at a
// random moment while they push.
enum class End { kAfter, kClose, kCancel };

// Whether a trial's configuration (`cfg`; `end`, how the trial ends) can produce refusal `r`
// of a push (`due`: the push carries a deadline). What the admission queue
// (bspflow/stream/detail/admission.hpp) refuses, and when:
// - kClosed: once the stream is closed or cancelled, which a trial that ends after its
//   clients finish never is while they push;
// - kDeadlinePassed: a deadline past at the push, or passed while a kBlock push waited;
// - kDeadlineUnreachable: a deadline the prediction says cannot be met (admission.predict);
// - kQueueFull: a full queue under kReject (a blocking push waits under kBlock; kShed sheds);
// - kShed: under kShed, the newcomer with the least slack;
// - kOutranked: a full queue holding only higher priority classes than the push's, under
//   kReject or kShed (under kBlock the push waits): more than one class;
// - kClientFull: never: a trial client pops at its window (64 at most), far below
//   response_capacity (1024; the trials keep the default);
// - kTooLarge: never: no trial declares its requests' lengths to a generate stage.
inline bool refusal_allowed(bspflow::Refusal r, const bspflow::StreamConfig& cfg, End end,
                            bool due) {
  using bspflow::AdmissionPolicy;
  using bspflow::Refusal;
  const AdmissionPolicy policy = cfg.admission.policy;
  switch (r) {
    case Refusal::kClosed:
      return end != End::kAfter;
    case Refusal::kDeadlinePassed:
      return due;
    case Refusal::kDeadlineUnreachable:
      return due && cfg.admission.predict;
    case Refusal::kQueueFull:
      return policy == AdmissionPolicy::kReject;
    case Refusal::kShed:
      return policy == AdmissionPolicy::kShed;
    case Refusal::kOutranked:
      return policy != AdmissionPolicy::kBlock && cfg.priority_classes > 1;
    case Refusal::kNone:
    case Refusal::kClientFull:
    case Refusal::kTooLarge:
      return false;
  }
  return false;
}

// The error kinds (bits, bit()) an accepted request of a trial may be answered with, whatever
// its stages do, from the trial's configuration (`cfg`; `end`) and whether the request
// carries a deadline (`due`): kDeadlineExceeded only with a deadline; kRejected (shed from
// the queue) under kShed, or for a higher class's push under kReject; kCancelled when the
// trial ends by a cancel. A cancelled request, and one a stage may fail, add their own kinds.
inline std::uint8_t errors_allowed(const bspflow::StreamConfig& cfg, End end, bool due) {
  using bspflow::AdmissionPolicy;
  using bspflow::ErrorKind;
  const AdmissionPolicy policy = cfg.admission.policy;
  std::uint8_t allowed = 0;
  if (due) allowed |= bit(ErrorKind::kDeadlineExceeded);
  if (policy == AdmissionPolicy::kShed ||
      (policy == AdmissionPolicy::kReject && cfg.priority_classes > 1))
    allowed |= bit(ErrorKind::kRejected);
  if (end == End::kCancel) allowed |= bit(ErrorKind::kCancelled);
  return allowed;
}

// What each client of a trial pushes.
struct ClientLoad {
  U64 per_client = 0;      // pushes offered
  std::size_t window = 1;  // unanswered requests at most before the client pops
  U64 due_every = 0;       // 0: no deadlines; else every due_every-th push has one
  U64 due_us = 0;          // a deadline is up to this many microseconds after its push
  U64 cancel_every = 0;    // 0: no cancels; else every cancel_every-th request is cancelled
};

// One trial client's work, in both trials: pushes x = k << 32 | i for i < load.per_client,
// popping its oldest answers while it has load.window unanswered, then pops the rest. Every
// due_every-th push carries a deadline up to due_us away (drawn from its own Rng, `seed`);
// every cancel_every-th accepted request is cancelled right after its push. A refusal the
// trial's configuration cannot produce (refusal_allowed) counts as wrong; a closed stream
// ends the pushing. Each answer is checked (PendingQueue, in push order under
// Ordering::kPerClient): an ok one must carry expected(x, version), an error must be of a
// kind errors_allowed gives, kStageFailed where stage_fails(x), or kCancelled for a cancelled
// request.
template <class Expected, class StageFails>
void trial_client(bspflow::StreamClient<U64, U64>& c, std::uint32_t k, std::uint64_t seed,
                  const ClientLoad& load, const bspflow::StreamConfig& cfg, End end,
                  const Expected& expected, const StageFails& stage_fails, ServeTally& t) {
  using bspflow::ErrorKind;
  using bspflow::Refusal;
  Rng crng(seed);
  PendingQueue q(cfg.ordering == bspflow::Ordering::kPerClient);
  for (U64 i = 0; i < load.per_client; ++i) {
    while (q.size() >= load.window && pop_one(c, q, t, expected)) {
    }
    const U64 x = (U64{k} << 32) | i;
    const bool due = load.due_every != 0 && i % load.due_every == 0;
    const bspflow::Deadline d =
        due ? bspflow::StreamClock::now() + std::chrono::microseconds(crng.in(0, load.due_us))
            : bspflow::kNoDeadline;
    const bspflow::Submission s = c.push(x, d);
    if (!s.accepted()) {
      ++t.refused[static_cast<std::size_t>(s.refusal)];
      if (!refusal_allowed(s.refusal, cfg, end, due)) ++t.wrong;
      if (s.refusal == Refusal::kClosed) break;  // closed or cancelled: nothing more
      continue;
    }
    ++t.accepted;
    std::uint8_t allowed = errors_allowed(cfg, end, due);
    if (stage_fails(x)) allowed |= bit(ErrorKind::kStageFailed);
    if (load.cancel_every != 0 && i % load.cancel_every == 0) {
      allowed |= bit(ErrorKind::kCancelled);
      c.cancel(s.id);
    }
    q.add(Pending{s.id.sequence, x, allowed});
  }
  while (q.size() > 0 && pop_one(c, q, t, expected)) {
  }
  t.missing = q.size();
}

// Runs `trial` `env_name` times (default `fallback`), each with its own seed (`seed_offset`
// past BSPFLOW_SOAK_SEED) and a watchdog, on groups of 1, 2 and 4 devices, then says how long
// they took.
template <class Trial>
void run_trials(const char* what, const char* env_name, std::uint64_t fallback,
                std::uint64_t seed_offset, Trial&& trial) {
  const std::uint64_t trials = env_u64(env_name, fallback);
  const std::uint64_t base_seed = env_u64("BSPFLOW_SOAK_SEED", 20261124);
  const std::chrono::seconds limit(env_u64("BSPFLOW_SOAK_TRIAL_SECONDS", 60));
  std::array<std::unique_ptr<bspflow::DeviceGroup>, 5> groups;
  for (std::uint32_t d : {1u, 2u, 4u})
    groups[d] = std::make_unique<bspflow::DeviceGroup>(d, kSmall);
  Watchdog watchdog;
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < trials; ++i) {
    const std::uint64_t seed = base_seed + seed_offset + i;
    const std::string name =
        std::string(what) + " trial " + std::to_string(i) + " (seed " + std::to_string(seed) + ")";
    INFO(name);
    watchdog.arm(name, limit);
    Rng rng(seed);
    trial(rng, groups);
    watchdog.disarm();
  }
  std::printf("soak: %llu Stream %s trials in %.1f s\n", static_cast<unsigned long long>(trials),
              what, seconds_since(t0));
}

}  // namespace soak
