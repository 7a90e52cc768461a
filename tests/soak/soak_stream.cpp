// The soak suite's Stream part (see soak_test.cpp): requests exactly once at volume through
// a Stream (3 clients, 4 stages on 2 devices), and the fault-injection trial; and serving
// (StreamClients): 10^6 requests exactly once through 2 replicas with batching, deadlines and
// cancels, and seeded serving trials (replicas, batch stages, admission, deadlines, cancels,
// close and cancel mid-run), and seeded graph trials (fan-out and routes, priority classes,
// swaps under load), with their own test cases at the end of this file.
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_graph.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace soak {

void soak_stream(std::uint32_t producers, std::uint32_t devices, std::uint64_t elements) {
  constexpr std::uint64_t kStages = 4;
  const std::uint64_t per_client = (elements + producers - 1) / producers;  // at least `elements`
  const std::uint64_t total = per_client * producers;
  const auto t0 = Clock::now();
  DeviceGroup group(devices, kSmall);
  auto plus = [](std::uint64_t x) { return x + 1; };
  auto stream = StreamBuilder<std::uint64_t>(group, StreamConfig{.hop_capacity = 64})
                    .stage("s0", plus, 0)
                    .stage("s1", plus, 0)
                    .stage("s2", plus, devices > 1 ? 1 : 0)
                    .stage("s3", plus, devices > 1 ? 1 : 0)
                    .build();
  stream.start();
  std::vector<std::thread> threads;
  std::atomic<std::uint64_t> pushed_checksum{0}, checksum{0}, received{0}, disorder{0}, errors{0},
      short_clients{0};
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p, client = stream.client()]() mutable {
      std::uint64_t sum = 0, got = 0, next = 0, bad_order = 0, bad = 0, sum_back = 0;
      auto take = [&](const Response<std::uint64_t>& r) {
        if (r.id.sequence != next++ || r.id.client != client.id()) ++bad_order;
        if (!r.ok()) {
          ++bad;
        } else {
          sum_back += *r.value;
        }
        ++got;
      };
      for (std::uint64_t s = 0; s < per_client; ++s) {
        const std::uint64_t x = mix((std::uint64_t{p} << 40) | s) >> 8;
        sum += x + kStages;
        while (!client.push(x)) {
          if (auto r = client.pop()) take(*r);  // its response slots are full: pop first
        }
        while (auto r = client.try_pop()) take(*r);
      }
      while (auto r = client.pop()) take(*r);
      pushed_checksum += sum;
      checksum += sum_back;
      received += got;
      disorder += bad_order;
      errors += bad;
      if (got != per_client) ++short_clients;
    });
  }
  for (auto& t : threads) t.join();
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.accepted == total);
  CHECK(r.answered == total);
  CHECK(received.load() == total);
  CHECK(errors.load() == 0);
  CHECK(disorder.load() == 0);  // each client's sequence 0, 1, 2, ...: none missing, none twice
  CHECK(short_clients.load() == 0);
  CHECK(checksum.load() == pushed_checksum.load());
  const bool ok = r.drained() && r.accepted == total && r.answered == total &&
                  received.load() == total && errors.load() == 0 && disorder.load() == 0 &&
                  short_clients.load() == 0 && checksum.load() == pushed_checksum.load();
  std::printf("soak: Stream, %u clients, %llu stages on %u devices: %llu requests: %s (%.1f s)\n",
              producers, static_cast<unsigned long long>(kStages), devices,
              static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, values right" : "FAILED (see above)",
              seconds_since(t0));
}

// One seeded trial of a chain under a fault: a stage throws (kRespond or kFailFast), the
// stream is closed mid-run, cancelled (by cancel() or a stop token, before or during the
// run), or its clients stop reading and go away mid-run. Every accepted request is answered
// exactly once (to a client still there), and a second run on the same stream serves again.
void stream_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const std::uint32_t d = group.size();
  const auto stages = static_cast<std::uint32_t>(rng.in(d, 4));
  const bool throws = t.fault == Fault::kThrow;
  const OnError on_error = throws && rng.coin() ? OnError::kFailFast : OnError::kRespond;
  StreamConfig cfg;
  cfg.hop_capacity = rng.in(1, 16);
  cfg.on_error = on_error;
  cfg.wait = rng.coin() ? WaitPolicy{} : WaitPolicy::park();
  cfg.response_capacity = rng.in(1, 64);
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 3));
  const std::uint64_t per_client = rng.in(10, 300);
  const std::uint64_t total = per_client * clients;
  // A request's value is its index (client k's i-th: k * per_client + i); every stage adds 1.
  const std::uint64_t fail_value = rng.below(total);
  const auto fail_stage = static_cast<std::uint32_t>(rng.below(stages));
  auto builder = StreamBuilder<std::uint64_t>(group, cfg);
  for (std::uint32_t s = 0; s < stages; ++s) {
    builder = std::move(builder).stage(
        "s" + std::to_string(s),
        [s, throws, fail_value, fail_stage](std::uint64_t x) {
          if (throws && s == fail_stage && x - s == fail_value)
            throw std::runtime_error("injected fault");
          return x + 1;
        },
        s * d / stages);
  }
  auto stream = std::move(builder).build();
  Stopper stopper = stopper_for(rng, t);
  const bool by_token = stopper.before || rng.coin();
  const auto cancel = [&] { by_token ? (void)stopper.source.request_stop() : stream.cancel(); };
  stream.start(stopper.token());
  Seen answered(total);
  std::atomic<std::uint64_t> accepted{0}, delivered{0}, errors{0}, wrong{0};
  std::atomic<bool> leave{false};  // kReaderStops: the clients stop reading and go away
  const bool leaves = t.fault == Fault::kReaderStops;
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k, client = stream.client()]() mutable {
      std::map<std::uint64_t, std::uint64_t> value_of;  // sequence -> request value
      auto take = [&](const Response<std::uint64_t>& r) {
        const auto it = value_of.find(r.id.sequence);
        if (it == value_of.end()) {
          ++wrong;
          return;
        }
        const std::uint64_t value = it->second;
        value_of.erase(it);
        answered.add(value);
        ++delivered;
        if (r.ok()) {
          if (*r.value != value + stages) ++wrong;
        } else if (r.kind() == ErrorKind::kStageFailed) {
          ++errors;
          if (value != fail_value || r.error->stage != fail_stage) ++wrong;
        } else if (r.kind() != ErrorKind::kCancelled) {
          ++wrong;
        }
      };
      for (std::uint64_t i = 0; i < per_client; ++i) {
        if (leaves && leave.load()) return;  // destroyed with requests outstanding
        const std::uint64_t value = k * per_client + i;
        const Submission s = client.push(value);
        if (s.refusal == Refusal::kClientFull) {
          if (leaves) return;
          if (auto r = client.pop()) take(*r);
          --i;
          continue;
        }
        if (!s) break;  // closed, cancelled or failed: admission has ended
        ++accepted;
        value_of[s.id.sequence] = value;
        if (!leaves) {
          while (auto r = client.try_pop()) take(*r);
        }
      }
      if (leaves) {
        while (!leave.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
        return;
      }
      while (auto r = client.pop()) take(*r);
      if (!value_of.empty()) ++wrong;  // accepted, never answered
    });
  }
  if (t.fault == Fault::kClose) {
    std::this_thread::sleep_for(micros(rng, 3000));
    stream.close();
  } else if (t.fault == Fault::kCancel && !stopper.before) {
    std::this_thread::sleep_for(micros(rng, 3000));
    cancel();
  } else if (leaves) {
    std::this_thread::sleep_for(micros(rng, 2000));
    leave = true;
    for (auto& th : threads) th.join();
    threads.clear();
    cancel();
  }
  if (t.fault == Fault::kThrow) {
    for (auto& th : threads) th.join();  // every client pushed all it could and popped its answers
    threads.clear();
    stream.close();
  }
  std::thread closer;
  if (t.fault != Fault::kClose && t.fault != Fault::kThrow) {
    // Clients that still push end once admission ends: close, for a run not stopped.
    closer = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      stream.close();
    });
  }
  for (auto& th : threads) th.join();
  const StreamResult r = stream.wait();
  if (closer.joinable()) closer.join();
  CHECK(wrong.load() == 0);
  CHECK(r.accepted == accepted.load());
  CHECK(r.unanswered == 0);  // a StreamClient's request is always answered
  if (!leaves) {
    CHECK(delivered.load() == r.answered);  // every answer reached its client
    CHECK(answered.problems(total).find("twice") == std::string::npos);
  }
  // A stage that throws is answered with an error (kRespond) or stops the stream (kFailFast).
  const Endings endings{
      {on_error == OnError::kRespond
           ? Ending{RunStatus::kCompleted, "an error response, the stream went on (kRespond)"}
           : Ending{RunStatus::kFailed, "failed fast (kFailFast)"}},
      {{RunStatus::kCancelled, "cancelled"}, {RunStatus::kCompleted, "drained before the cancel"}},
      {{RunStatus::kCompleted, "drained after the close"}}};
  check_ending(t, r.status, r.message, endings);
  if (stopper.before) CHECK(r.status == RunStatus::kCancelled);
  if (t.fault == Fault::kThrow && on_error == OnError::kRespond) {
    CHECK(errors.load() == (fail_value < accepted.load() ? 1u : 0u));
  } else if (t.fault == Fault::kThrow && r.status == RunStatus::kFailed) {
    REQUIRE(r.failure != nullptr);
    CHECK(r.failure->stage == fail_stage);
    CHECK(contains(r.failure->message, "injected fault"));
  }
  // Same devices, a second run serves again, exactly once.
  auto again = stream.client();
  stream.start();
  std::uint64_t ok = 0;
  auto take = [&](const Response<std::uint64_t>& resp) {
    ok += resp.ok() && *resp.value == 1000 + resp.id.sequence + stages;
  };
  for (std::uint64_t i = 0; i < 20; ++i) {
    // At most response_capacity unpopped (it may be below 20): pop the oldest first.
    if (again.outstanding() >= cfg.response_capacity) take(*again.pop());
    const Submission sub = again.push(1000 + i);
    CAPTURE(std::string(to_string(sub.refusal)));
    REQUIRE(sub);
  }
  stream.close();
  while (auto resp = again.pop()) take(*resp);
  const StreamResult r2 = stream.wait();
  CHECK(r2.drained());
  CHECK(ok == 20);
}

}  // namespace soak

// ---------------------------------------------------------------------------------------
// Serving (StreamClients): replicas, batch stages, deadlines, cancels, admission control
// ---------------------------------------------------------------------------------------

namespace soak {
namespace {

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
  U64 wrong = 0;    // a wrong value, or an error of a kind the request does not allow
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
  U64 errors_of(ErrorKind k) const { return errors[static_cast<std::size_t>(k)]; }
  U64 refused_of(Refusal r) const { return refused[static_cast<std::size_t>(r)]; }
};

// One accepted request, waiting for its answer.
struct Pending {
  U64 sequence = 0;
  U64 expected = 0;          // the value an ok answer carries
  std::uint8_t allowed = 0;  // bit per ErrorKind this request may be answered with
};

constexpr std::uint8_t bit(ErrorKind k) {
  return std::uint8_t(1u << static_cast<unsigned>(k));
}

// A client's outstanding requests in push order. With Ordering::kPerClient every answer
// is the front's; with kNone any outstanding one's.
class PendingQueue {
 public:
  explicit PendingQueue(bool ordered) : ordered_(ordered) {}
  void add(const Pending& p) { q_.push_back(p); }
  std::size_t size() const { return q_.size() - answered_in_queue_; }
  // Checks `r` against the request it answers.
  void answer(const Response<U64>& r, std::uint32_t client, ServeTally& t) {
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
    const bool right = r.ok() ? *r.value == p.expected : (p.allowed & bit(r.kind())) != 0;
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
constexpr auto kPatience = 20s;

// Pops one answer into `q`; false if none came within kPatience (or none is outstanding).
bool pop_one(StreamClient<U64, U64>& c, PendingQueue& q, ServeTally& t) {
  auto r = c.pop_until(StreamClock::now() + kPatience);
  if (!r) return false;
  q.answer(*r, c.id(), t);
  return true;
}

void check_serve_tally(const ServeTally& t) {
  CHECK(t.answered == t.accepted);
  CHECK(t.missing == 0);
  CHECK(t.unknown == 0);
  CHECK(t.disorder == 0);
  CHECK(t.wrong == 0);
}

// Checks the stream's own counts against what the clients saw.
void check_serve_stats(const StreamStats& st, const StreamResult& r, const ServeTally& all) {
  CHECK(r.accepted == all.accepted);
  CHECK(r.answered == all.accepted);
  CHECK(r.unanswered == 0);
  CHECK(r.errors == all.errors_total());
  CHECK(st.answered == all.answered);
  CHECK(st.ok == all.ok);
  for (std::size_t k = 0; k < all.errors.size(); ++k) {
    CAPTURE(to_string(static_cast<ErrorKind>(k)));
    CHECK(st.errors[k] == all.errors[k]);
  }
  CHECK(st.latency_ns.count() == st.answered);
  for (std::size_t k = 0; k < all.refused.size(); ++k) {
    if (k == static_cast<std::size_t>(Refusal::kNone)) continue;
    CAPTURE(to_string(static_cast<Refusal>(k)));
    CHECK(st.refusals[k] == all.refused[k]);
  }
}

}  // namespace

// 10^6 requests (BSPFLOW_SOAK_SERVE_REQUESTS) from 3 client threads, 2 replicas of a batch
// stage and a plain stage on 4 devices (on 2 cores): every request answered once, in its
// client's order, with its value; every 64th carries a deadline (answered with its value or
// kDeadlineExceeded), every 97th is cancelled right after its push (its value or
// kCancelled); the stream's stats equal what the clients saw.
void soak_serving(std::uint32_t clients, std::uint64_t requests) {
  const U64 per_client = (requests + clients - 1) / clients;
  const auto t0 = Clock::now();
  DeviceGroup group(4, kSmall);
  auto model = [](std::span<U64> batch) {
    std::vector<U64> out(batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) out[i] = batch[i] * 2;
    return out;
  };
  auto stream = StreamBuilder<U64>(group, StreamConfig{.hop_capacity = 64, .replicas = 2})
                    .batch_stage("model", model,
                                 BatchConfig{.max_batch = 16,
                                             .max_delay = std::chrono::microseconds(200),
                                             .allowed_sizes = {1, 2, 4, 8, 16}},
                                 0)
                    .stage(
                        "post", [](U64 x) { return x + 1; }, 1)
                    .build();
  stream.start();
  std::vector<StreamClient<U64, U64>> handles;
  handles.reserve(clients);
  for (std::uint32_t k = 0; k < clients; ++k) handles.push_back(stream.client());
  std::vector<ServeTally> tallies(clients);
  std::vector<U64> cancels(clients, 0);
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      StreamClient<U64, U64>& c = handles[k];
      ServeTally& t = tallies[k];
      PendingQueue q(true);
      for (U64 i = 0; i < per_client; ++i) {
        while (q.size() >= 512 && pop_one(c, q, t)) {
        }
        const U64 x = mix((U64{k} << 40) | i) >> 8;
        const bool due = i % 64 == 0;
        const Submission s = c.push(x, due ? StreamClock::now() + 2s : kNoDeadline);
        if (!s.accepted()) {
          ++t.refused[static_cast<std::size_t>(s.refusal)];
          if (!due || s.refusal != Refusal::kDeadlineUnreachable) ++t.wrong;
          continue;
        }
        ++t.accepted;
        std::uint8_t allowed = due ? bit(ErrorKind::kDeadlineExceeded) : 0;
        if (i % 97 == 0) {
          allowed |= bit(ErrorKind::kCancelled);
          if (c.cancel(s.id)) ++cancels[k];
        }
        q.add(Pending{s.id.sequence, x * 2 + 1, allowed});
      }
      while (q.size() > 0 && pop_one(c, q, t)) {
      }
      t.missing = q.size();
    });
  }
  for (auto& th : threads) th.join();
  stream.close();
  const StreamResult r = stream.wait();
  ServeTally all;
  for (const ServeTally& t : tallies) {
    check_serve_tally(t);
    all += t;
  }
  CHECK(r.drained());
  CHECK(all.accepted + all.refused_total() == per_client * clients);
  check_serve_stats(stream.stats(), r, all);
  U64 cancelled = 0;
  for (U64 c : cancels) cancelled += c;
  CHECK(all.errors_of(ErrorKind::kCancelled) <= cancelled);
  const bool ok = r.drained() && all.answered == all.accepted && all.missing == 0 &&
                  all.unknown == 0 && all.disorder == 0 && all.wrong == 0;
  std::printf(
      "soak: Stream serving, %u clients, 2 replicas (batch stage + stage on 4 devices): %llu "
      "requests (%llu cancelled, %llu expired, %llu refused): %s (%.1f s)\n",
      clients, static_cast<unsigned long long>(all.accepted),
      static_cast<unsigned long long>(all.errors_of(ErrorKind::kCancelled)),
      static_cast<unsigned long long>(all.errors_of(ErrorKind::kDeadlineExceeded)),
      static_cast<unsigned long long>(all.refused_total()),
      ok ? "exactly once, in order, values right" : "FAILED (see above)", seconds_since(t0));
}

// One seeded serving trial: 1 or 2 replicas of 1 or 2 devices, a batch stage or a plain one
// first (padding, per-item failures and a batch that throws), random admission (block,
// reject, shed), ordering, client count, deadlines (some expire), cancels, and an end by
// close or cancel at a random moment (or after the clients finish). Every accepted request
// is answered once with its value or an error of a kind it allows; every refusal has a
// reason the trial allows; the stream's counts equal the clients'.
void serving_trial(Rng& rng, std::array<std::unique_ptr<DeviceGroup>, 5>& groups) {
  const auto replicas = static_cast<std::uint32_t>(rng.in(1, 2));
  const auto per_replica = static_cast<std::uint32_t>(rng.in(1, 2));
  DeviceGroup& group = *groups[replicas * per_replica];
  const bool batched = rng.coin();
  const bool two_stages = per_replica == 2 && rng.coin();
  const AdmissionPolicy policy = static_cast<AdmissionPolicy>(rng.in(0, 2));
  const Ordering ordering = rng.in(0, 3) == 0 ? Ordering::kNone : Ordering::kPerClient;
  StreamConfig cfg;
  cfg.hop_capacity = rng.in(1, 16);
  cfg.replicas = replicas;
  cfg.ordering = ordering;
  cfg.admission =
      Admission{.policy = policy, .queue_capacity = rng.in(1, 64), .predict = rng.coin()};
  cfg.wait = rng.coin() ? WaitPolicy{} : WaitPolicy::park();
  BatchConfig bc;
  bc.max_batch = rng.in(1, 16);
  if (rng.coin()) bc.max_delay = std::chrono::microseconds(rng.in(0, 500));
  if (rng.coin()) {
    for (std::size_t s = 1; s < bc.max_batch; s *= 2) bc.allowed_sizes.push_back(s);
    bc.allowed_sizes.push_back(bc.max_batch);
  }
  bc.deadline_aware = rng.coin();
  const bool faults = rng.coin();
  const U64 poison = rng.below(13);  // x % 13 == poison fails (per item), if faults
  const U64 spin_us = rng.in(0, 30);
  // x = k << 32 | i; the model doubles it; "post" adds 1.
  const auto poisoned = [faults, poison](U64 x) { return faults && x % 13 == poison; };
  const auto batch_bomb = [faults](U64 x) { return faults && x % 101 == 7; };
  auto model_one = [poisoned, spin_us](U64 x) -> U64 {
    spin_for(std::chrono::microseconds(spin_us));
    if (poisoned(x)) throw std::runtime_error("poisoned request");
    return x * 2;
  };
  auto model_batch = [poisoned, batch_bomb, spin_us](std::span<U64> batch) {
    spin_for(std::chrono::microseconds(spin_us + batch.size()));
    std::vector<ItemResult<U64>> out;
    out.reserve(batch.size());
    for (U64 x : batch) {
      if (batch_bomb(x)) throw std::runtime_error("poisoned batch");
      if (poisoned(x)) {
        out.push_back(ItemResult<U64>::failure("poisoned request"));
      } else {
        out.push_back(x * 2);
      }
    }
    return out;
  };
  auto b = StreamBuilder<U64>(group, cfg);
  auto b1 = batched ? std::move(b).batch_stage("model", model_batch, bc, 0)
                    : std::move(b).stage("model", model_one, 0);
  auto stream = two_stages ? std::move(b1)
                                 .stage(
                                     "post", [](U64 x) { return x + 1; }, 1)
                                 .build()
                           : std::move(b1).build();
  const U64 post = two_stages ? 1 : 0;

  enum class End { kAfter, kClose, kCancel };
  const End end = static_cast<End>(rng.in(0, 2));
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 3));
  const U64 per_client = rng.in(10, 400);
  const U64 due_every = rng.in(0, 4);  // 0: no deadlines; else every due_every-th
  const U64 due_us = rng.in(0, 3000);
  const U64 cancel_every = rng.in(0, 7);  // 0: no cancels
  const std::size_t window = rng.in(1, 64);
  const auto end_after = micros(rng, 4000);
  std::vector<std::uint64_t> seeds(clients);
  for (auto& s : seeds) s = rng.in(0, ~U64{0});

  stream.start();
  std::vector<StreamClient<U64, U64>> handles;
  handles.reserve(clients);
  for (std::uint32_t k = 0; k < clients; ++k) handles.push_back(stream.client());
  std::vector<ServeTally> tallies(clients);
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      Rng crng(seeds[k]);
      StreamClient<U64, U64>& c = handles[k];
      ServeTally& t = tallies[k];
      PendingQueue q(ordering == Ordering::kPerClient);
      for (U64 i = 0; i < per_client; ++i) {
        while (q.size() >= window && pop_one(c, q, t)) {
        }
        const U64 x = (U64{k} << 32) | i;
        const bool due = due_every != 0 && i % due_every == 0;
        const Deadline d =
            due ? StreamClock::now() + std::chrono::microseconds(crng.in(0, due_us)) : kNoDeadline;
        const Submission s = c.push(x, d);
        if (!s.accepted()) {
          ++t.refused[static_cast<std::size_t>(s.refusal)];
          const bool allowed =
              (s.refusal == Refusal::kClosed && end != End::kAfter) ||
              (due && (s.refusal == Refusal::kDeadlinePassed ||
                       s.refusal == Refusal::kDeadlineUnreachable)) ||
              (policy == AdmissionPolicy::kReject && s.refusal == Refusal::kQueueFull) ||
              (policy == AdmissionPolicy::kShed && s.refusal == Refusal::kShed);
          if (!allowed) ++t.wrong;
          if (s.refusal == Refusal::kClosed) break;  // closed or cancelled: nothing more
          continue;
        }
        ++t.accepted;
        // Every kind but what cannot happen: kStageFailed only for poisoned values (or the
        // batch that threw), kDeadlineExceeded only with a deadline, kRejected only under
        // kShed, kCancelled only for cancelled ones or a cancelled stream.
        std::uint8_t allowed = 0;
        if (poisoned(x) || (batched && faults)) allowed |= bit(ErrorKind::kStageFailed);
        if (due) allowed |= bit(ErrorKind::kDeadlineExceeded);
        if (policy == AdmissionPolicy::kShed) allowed |= bit(ErrorKind::kRejected);
        if (end == End::kCancel) allowed |= bit(ErrorKind::kCancelled);
        if (cancel_every != 0 && i % cancel_every == 0) {
          allowed |= bit(ErrorKind::kCancelled);
          c.cancel(s.id);
        }
        q.add(Pending{s.id.sequence, x * 2 + post, allowed});
      }
      while (q.size() > 0 && pop_one(c, q, t)) {
      }
      t.missing = q.size();
    });
  }
  StreamResult r;
  if (end == End::kAfter) {
    for (auto& th : threads) th.join();
    stream.close();
    r = stream.wait();
  } else {
    std::this_thread::sleep_for(end_after);
    if (end == End::kClose) {
      stream.close();
    } else {
      stream.cancel();
    }
    r = stream.wait();  // on cancel, what is still queued is answered here
    for (auto& th : threads) th.join();
  }
  ServeTally all;
  for (const ServeTally& t : tallies) {
    check_serve_tally(t);
    all += t;
  }
  CHECK(r.status == (end == End::kCancel ? RunStatus::kCancelled : RunStatus::kCompleted));
  check_serve_stats(stream.stats(), r, all);
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
  std::array<std::unique_ptr<DeviceGroup>, 5> groups;
  for (std::uint32_t d : {1u, 2u, 4u}) groups[d] = std::make_unique<DeviceGroup>(d, kSmall);
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

void serving_trials() {
  run_trials("serving", "BSPFLOW_SOAK_SERVE_TRIALS", 300, 1'000'000, serving_trial);
}

// ---------------------------------------------------------------------------------------
// Graphs, priority classes and swaps
// ---------------------------------------------------------------------------------------

// One seeded graph trial: a fan-out and join, or a route and merge, on 1 or 2 replicas of 1,
// 2 or 4 devices (on 2 cores); 1 to 3 priority classes with a minimum share, one per client;
// random admission, deadlines and cancels; a branch that fails on poisoned values; a swap of
// that branch while the clients push (in place, rolling, refused for memory, or with a
// failing warm-up); and an end by close or cancel at a random moment, or after the clients
// finish. Every accepted request is answered once, in its client's order, with the value of
// the version that answered it or an error its request allows; the stream's counts, overall
// and by class, equal the clients'.
void graph_trial(Rng& rng, std::array<std::unique_ptr<DeviceGroup>, 5>& groups) {
  const auto replicas = static_cast<std::uint32_t>(rng.in(1, 2));
  const auto per_replica =
      static_cast<std::uint32_t>(replicas == 1 ? (1u << rng.in(0, 2)) : rng.in(1, 2));
  DeviceGroup& group = *groups[replicas * per_replica];
  const bool fan_out = rng.coin();  // else a route
  const auto classes = static_cast<std::uint32_t>(rng.in(1, 3));
  const AdmissionPolicy policy = static_cast<AdmissionPolicy>(rng.in(0, 2));
  StreamConfig cfg;
  cfg.hop_capacity = rng.in(1, 16);
  cfg.replicas = replicas;
  cfg.priority_classes = classes;
  if (classes > 1) cfg.min_share[classes - 1] = 0.05 * static_cast<double>(rng.in(0, 4));
  cfg.admission =
      Admission{.policy = policy, .queue_capacity = rng.in(1, 64), .predict = rng.coin()};
  cfg.wait = rng.coin() ? WaitPolicy{} : WaitPolicy::park();
  const bool faults = rng.coin();
  const U64 poison = rng.below(13);
  const U64 spin_us = rng.in(0, 20);
  const auto poisoned = [faults, poison](U64 a) { return faults && a % 13 == poison; };
  // x = k << 32 | i; pre gives a = x + 1; "left" gives 2a (a later version 2a + kDelta),
  // "right" 3a; the join adds them, a route sends even x left and odd x right.
  constexpr U64 kDelta = 1000;
  auto left_version = [poisoned, spin_us](U64 delta) {
    return [poisoned, spin_us, delta](U64 a) -> U64 {
      spin_for(std::chrono::microseconds(spin_us));
      if (poisoned(a)) throw std::runtime_error("poisoned request");
      return 2 * a + delta;
    };
  };
  const auto dev = [per_replica](std::uint32_t d) { return d % per_replica; };
  enum class SwapKind { kNone, kInPlace, kRolling, kTooLarge, kBadWarmup };
  const SwapKind swap_kind = static_cast<SwapKind>(rng.in(0, 4));
  // Of the smallest free arena: a fifth fits twice, three fifths once, 3/2 not at all.
  std::size_t free = ~std::size_t{0};
  for (std::uint32_t d = 0; d < group.size(); ++d)
    free = std::min(free, group[d].arena().free_bytes());
  const std::size_t old_bytes = swap_kind == SwapKind::kRolling ? free / 5 * 3 : free / 5;
  const std::size_t new_bytes = swap_kind == SwapKind::kRolling    ? free / 5 * 3
                                : swap_kind == SwapKind::kTooLarge ? free / 2 * 3
                                                                   : free / 5;
  StreamGraph<U64> g(group, cfg);
  auto pre = g.input().stage(
      "pre", [](U64 x) { return x + 1; }, dev(0));
  Node<U64> out;
  if (fan_out) {
    auto left = pre.stage("left", left_version(0), dev(1)).memory(old_bytes);
    auto right = pre.stage(
        "right", [](U64 a) { return 3 * a; }, dev(2));
    out = g.join(
        "join", [](U64 l, U64 r) { return l + r; }, dev(3), left, right);
  } else {
    auto [even, odd] = pre.route<2>("route", [](U64 a) { return (a - 1) % 2 == 0 ? 0 : 1; });
    auto left = even.stage("left", left_version(0), dev(1)).memory(old_bytes);
    auto right = odd.stage(
        "right", [](U64 a) { return 3 * a; }, dev(2));
    out = g.merge("merge", dev(3), left, right);
  }
  auto stream = std::move(g).build(out);
  // The value an ok answer carries, given the version that answered.
  const auto expected = [fan_out](U64 x, std::uint32_t version) {
    const U64 a = x + 1, delta = version > 1 ? kDelta : 0;
    if (fan_out) return 2 * a + delta + 3 * a;
    return x % 2 == 0 ? 2 * a + delta : 3 * a;
  };
  const auto through_left = [fan_out](U64 x) { return fan_out || x % 2 == 0; };

  enum class End { kAfter, kClose, kCancel };
  const End end = static_cast<End>(rng.in(0, 2));
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 4));
  const U64 per_client = rng.in(10, 400);
  const U64 due_every = rng.in(0, 4);
  const U64 due_us = rng.in(0, 3000);
  const U64 cancel_every = rng.in(0, 7);
  const std::size_t window = rng.in(1, 64);
  const auto end_after = micros(rng, 4000);
  const auto swap_after = micros(rng, 3000);
  std::vector<std::uint64_t> seeds(clients);
  for (auto& s : seeds) s = rng.in(0, ~U64{0});

  stream.start();
  std::vector<StreamClient<U64, U64>> handles;
  handles.reserve(clients);
  for (std::uint32_t k = 0; k < clients; ++k) {
    handles.push_back(stream.client());
    handles.back().set_priority(k % classes);
  }
  std::vector<ServeTally> tallies(clients);
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      Rng crng(seeds[k]);
      StreamClient<U64, U64>& c = handles[k];
      ServeTally& t = tallies[k];
      struct Sent {
        U64 x, sequence;
        std::uint8_t allowed;  // bit per ErrorKind its answer may carry
      };
      std::deque<Sent> q;  // accepted, not yet answered, in push order
      auto take = [&](const Response<U64>& r) {
        ++t.answered;
        if (r.ok()) {
          ++t.ok;
        } else {
          ++t.errors[static_cast<std::size_t>(r.kind())];
        }
        if (q.empty() || r.id.client != c.id()) {
          ++t.unknown;
          return;
        }
        const Sent sent = q.front();
        q.pop_front();
        if (r.id.sequence != sent.sequence) ++t.disorder;
        const bool right =
            r.ok() ? *r.value == expected(sent.x, r.version) : (sent.allowed & bit(r.kind())) != 0;
        if (!right) ++t.wrong;
      };
      auto pop = [&] {
        auto r = c.pop_until(StreamClock::now() + kPatience);
        if (r) take(*r);
        return r.has_value();
      };
      for (U64 i = 0; i < per_client; ++i) {
        while (q.size() >= window && pop()) {
        }
        const U64 x = (U64{k} << 32) | i;
        const bool due = due_every != 0 && i % due_every == 0;
        const Deadline d =
            due ? StreamClock::now() + std::chrono::microseconds(crng.in(0, due_us)) : kNoDeadline;
        const Submission s = c.push(x, d);
        if (!s.accepted()) {
          ++t.refused[static_cast<std::size_t>(s.refusal)];
          const bool allowed =
              (s.refusal == Refusal::kClosed && end != End::kAfter) ||
              (due && (s.refusal == Refusal::kDeadlinePassed ||
                       s.refusal == Refusal::kDeadlineUnreachable)) ||
              (policy == AdmissionPolicy::kReject && s.refusal == Refusal::kQueueFull) ||
              (policy != AdmissionPolicy::kBlock && classes > 1 &&
               s.refusal == Refusal::kOutranked) ||
              (policy == AdmissionPolicy::kShed && s.refusal == Refusal::kShed);
          if (!allowed) ++t.wrong;
          if (s.refusal == Refusal::kClosed) break;
          continue;
        }
        ++t.accepted;
        std::uint8_t allowed = 0;
        if (poisoned(x + 1) && through_left(x)) allowed |= bit(ErrorKind::kStageFailed);
        if (due) allowed |= bit(ErrorKind::kDeadlineExceeded);
        // Shed from the queue: under kShed, or for a higher class's push under kReject.
        if (policy == AdmissionPolicy::kShed || (policy == AdmissionPolicy::kReject && classes > 1))
          allowed |= bit(ErrorKind::kRejected);
        if (end == End::kCancel) allowed |= bit(ErrorKind::kCancelled);
        if (cancel_every != 0 && i % cancel_every == 0) {
          allowed |= bit(ErrorKind::kCancelled);
          c.cancel(s.id);
        }
        q.push_back(Sent{x, s.id.sequence, allowed});
      }
      while (!q.empty() && pop()) {
      }
      t.missing = q.size();
    });
  }
  // The swap, from its own thread while the clients push.
  SwapResult swapped;
  std::thread swapper;
  if (swap_kind != SwapKind::kNone) {
    swapper = std::thread([&] {
      std::this_thread::sleep_for(swap_after);
      auto version = left_version(kDelta);
      std::vector<U64> warmup;  // three inputs the version does not fail on
      for (U64 a = 1; warmup.size() < 3; ++a) {
        if (!poisoned(a)) warmup.push_back(a);
      }
      if (swap_kind == SwapKind::kBadWarmup) {
        const U64 bad = warmup.back();
        swapped = stream.swap(
            "left",
            [version, bad](U64 a) -> U64 {
              if (a == bad) throw std::runtime_error("weights do not load");
              return version(a);
            },
            warmup);
      } else {
        swapped = stream.swap("left", version, warmup, SwapOptions{.memory = new_bytes});
      }
    });
  }
  StreamResult r;
  if (end == End::kAfter) {
    for (auto& th : threads) th.join();
    if (swapper.joinable()) swapper.join();
    stream.close();
    r = stream.wait();
  } else {
    std::this_thread::sleep_for(end_after);
    if (end == End::kClose) {
      stream.close();
    } else {
      stream.cancel();
    }
    r = stream.wait();
    for (auto& th : threads) th.join();
    if (swapper.joinable()) swapper.join();
  }
  ServeTally all;
  for (const ServeTally& t : tallies) {
    check_serve_tally(t);
    all += t;
  }
  CHECK(r.status == (end == End::kCancel ? RunStatus::kCancelled : RunStatus::kCompleted));
  const StreamStats st = stream.stats();
  check_serve_stats(st, r, all);
  // By class: what each class's clients saw.
  REQUIRE(st.by_class.size() == classes);
  for (std::uint32_t c = 0; c < classes; ++c) {
    ServeTally mine;
    for (std::uint32_t k = c; k < clients; k += classes) mine += tallies[k];
    CAPTURE(c);
    CHECK(st.by_class[c].accepted == mine.accepted);
    CHECK(st.by_class[c].answered == mine.answered);
    CHECK(st.by_class[c].ok == mine.ok);
  }
  INFO("swap: " << swapped.message);
  switch (swap_kind) {
    case SwapKind::kNone:
      break;
    case SwapKind::kInPlace:
      CHECK(swapped.swapped);
      CHECK_FALSE(swapped.rolling);
      break;
    case SwapKind::kRolling:
      CHECK(swapped.swapped);
      CHECK(swapped.rolling);
      CHECK(swapped.replicas_swapped == replicas);
      break;
    case SwapKind::kTooLarge:
      CHECK_FALSE(swapped.swapped);
      CHECK(swapped.replicas_swapped == 0);
      CHECK(swapped.error != nullptr);
      CHECK(contains(swapped.message, "refused"));
      break;
    case SwapKind::kBadWarmup:
      CHECK_FALSE(swapped.swapped);
      CHECK(swapped.replicas_swapped == 0);
      CHECK(contains(swapped.message, "weights do not load"));
      break;
  }
}

void graph_trials() {
  run_trials("graph", "BSPFLOW_SOAK_GRAPH_TRIALS", 1000, 2'000'000, graph_trial);
}

}  // namespace soak

// The serving trials sit here rather than in soak_test.cpp: they need nothing of the other
// subsystems' files.
TEST_SUITE_BEGIN("soak");

TEST_CASE("serving at volume: 10^6 requests, 3 clients, 2 replicas, batches, deadlines, cancels") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;  // reproducing one fault trial
  soak::soak_serving(3, soak::env_u64("BSPFLOW_SOAK_SERVE_REQUESTS", 1'000'000));
}

TEST_CASE("seeded serving trials: replicas, batch stages, admission, deadlines, cancels") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;
  soak::serving_trials();
}

TEST_CASE("seeded graph trials: fan-out, routes, priority classes, swaps under load") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;
  soak::graph_trials();
}

TEST_SUITE_END();
