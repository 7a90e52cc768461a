// 11_serving: a Stream serving several clients: replicas, a batching model stage, deadlines,
// admission control, and the stream's own metrics.
//
// The "model" stands in for an accelerator call that costs 20 us + 2 us per request of the
// batch (it spins that long) and is compiled for batches of 1, 2, 4 or 8 requests. It is a
// batch stage (BatchConfig): it takes whatever is waiting, up to 8, padded up to the next
// allowed size; the first request of a batch waits at most 500 us for others, and a batch is
// flushed earlier when waiting longer would make its oldest request miss its deadline. Two
// replicas of the stream (StreamConfig::replicas = 2) run on two devices, one each; a request
// goes to the replica that can take it soonest. Admission control is AdmissionPolicy::kReject
// with at most 64 requests queued: a push the stream cannot take is refused at once, with a
// reason, and nothing is queued.
//
// Three client threads, each with its own StreamClient, each reading only its own responses
// (in the order it pushed them; no router thread):
// 1. Steady load: each client first pushes one request whose deadline has already passed (it
//    must be refused: Refusal::kDeadlinePassed), then 1500 requests with a 1 s deadline
//    (push_for), keeping up to 16 in flight. Every one must come back with its own value.
// 2. Overload: each client pushes 4000 requests as fast as it can, each with a 5 ms deadline
//    (try_push), and reads responses as they come. The stream cannot keep up: pushes are
//    refused (kQueueFull, or kDeadlineUnreachable when the predicted completion is past the
//    deadline), and every admitted request is answered, with its value or kDeadlineExceeded.
// Then the stream is closed and drains. The host prints the refusals by reason, checks the
// stream's own counts (Stream::stats) against what the clients saw, prints the metrics as
// OpenMetrics text and a latency summary (--hgrm PATH also writes the end-to-end latency as
// an HdrHistogram .hgrm percentile file). Exits 0 if every check holds, 1 otherwise.
#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>
#include <bspflow/stream/stream.hpp>

namespace {

using namespace std::chrono_literals;
using bspflow::ErrorKind;
using bspflow::Refusal;

constexpr std::uint32_t kReplicas = 2;
constexpr std::size_t kMaxBatch = 8;
constexpr std::array<std::size_t, 4> kAllowedSizes{1, 2, 4, 8};  // the model's compiled sizes
constexpr std::size_t kQueueCapacity = 64;
constexpr std::uint32_t kClients = 3;
constexpr std::uint64_t kSteadyRequests = 1500;  // per client
constexpr std::uint64_t kWindow = 16;            // a steady client's requests in flight
constexpr std::uint64_t kBurst = 4000;           // an overloading client's pushes
constexpr std::chrono::nanoseconds kSteadyDeadline = 1s;
constexpr std::chrono::nanoseconds kOverloadDeadline = 5ms;
constexpr std::chrono::nanoseconds kModelFixed = 20us;  // a model call: 20 us + 2 us a request
constexpr std::chrono::nanoseconds kModelPerRequest = 2us;
constexpr std::array<Refusal, 6> kReasons{Refusal::kQueueFull,      Refusal::kDeadlineUnreachable,
                                          Refusal::kDeadlinePassed, Refusal::kClientFull,
                                          Refusal::kShed,           Refusal::kClosed};

struct Query {
  std::uint64_t x = 0;  // clients send 1, 2, 3, ...; 0 is a padding item
};
using Answer = std::uint64_t;
constexpr Answer answer(std::uint64_t x) {
  return 3 * x + 1;
}

template <class E>
constexpr std::size_t idx(E e) {
  return static_cast<std::size_t>(e);
}
unsigned long long ull(std::uint64_t v) {
  return static_cast<unsigned long long>(v);
}
double us(std::uint64_t ns) {
  return static_cast<double>(ns) / 1e3;
}

// What the model's calls saw, over both replicas: each replica runs its own copy of the
// stage, and the copies share this.
struct ModelTally {
  std::atomic<std::uint64_t> calls{0}, padding{0}, bad_sizes{0};
};

// The batch stage: one answer per item of the (padded) batch, in order.
struct Model {
  std::shared_ptr<ModelTally> tally;

  std::vector<Answer> operator()(std::span<const Query> batch) const {
    const auto until = std::chrono::steady_clock::now() + kModelFixed +
                       kModelPerRequest * static_cast<long>(batch.size());
    while (std::chrono::steady_clock::now() < until) {  // the accelerator's time
    }
    std::vector<Answer> out;
    out.reserve(batch.size());
    std::uint64_t padding = 0;
    for (const Query& q : batch) {
      padding += q.x == 0 ? 1 : 0;
      out.push_back(answer(q.x));
    }
    // relaxed: plain counters, read after the stream has ended (wait() synchronises).
    tally->calls.fetch_add(1, std::memory_order_relaxed);
    tally->padding.fetch_add(padding, std::memory_order_relaxed);
    if (std::find(kAllowedSizes.begin(), kAllowedSizes.end(), batch.size()) == kAllowedSizes.end())
      tally->bad_sizes.fetch_add(1, std::memory_order_relaxed);
    return out;
  }
};

using Client = bspflow::StreamClient<Query, Answer>;

// What one client saw in one phase.
struct Seen {
  std::uint64_t accepted = 0, answered = 0, ok = 0, late = 0, wrong = 0;
  std::array<std::uint64_t, 4> errors{};    // by ErrorKind
  std::array<std::uint64_t, 7> refusals{};  // by Refusal
};

// A request accepted and not yet answered.
struct Pending {
  bspflow::RequestId id;
  std::uint64_t x = 0;
};

// Checks a response against the oldest request still unanswered: the same id (a client's
// responses come back in the order it pushed), then its own value, or an error this phase
// allows (kDeadlineExceeded when `may_expire`).
void check(const bspflow::Response<Answer>& r, std::deque<Pending>& pending, Seen& seen,
           bool may_expire, std::chrono::nanoseconds deadline) {
  ++seen.answered;
  if (pending.empty() || r.id != pending.front().id) {
    ++seen.wrong;  // not ours, or out of push order
    return;
  }
  const std::uint64_t x = pending.front().x;
  pending.pop_front();
  if (r.ok()) {
    ++seen.ok;
    seen.wrong += *r.value == answer(x) ? 0 : 1;
    seen.late += r.latency > deadline ? 1 : 0;  // answered, but after its deadline
    return;
  }
  ++seen.errors[idx(r.kind())];
  seen.wrong += may_expire && r.kind() == ErrorKind::kDeadlineExceeded ? 0 : 1;
}

// Phase 1: a request already past its deadline, then steady load with a window.
void steady(Client& client, Seen& seen) {
  std::deque<Pending> pending;
  const bspflow::Submission expired =
      client.push(Query{1}, bspflow::StreamClock::now() - 1ms);  // refused at push
  ++seen.refusals[idx(expired.refusal)];
  seen.wrong += expired.refusal == Refusal::kDeadlinePassed ? 0 : 1;
  for (std::uint64_t k = 1; k <= kSteadyRequests; ++k) {
    if (client.outstanding() >= kWindow) {
      if (auto r = client.pop()) check(*r, pending, seen, false, kSteadyDeadline);
    }
    const bspflow::Submission s = client.push_for(Query{k}, kSteadyDeadline);
    if (!s) {
      ++seen.refusals[idx(s.refusal)];
      ++seen.wrong;  // the steady load is well within the stream's capacity
      continue;
    }
    ++seen.accepted;
    pending.push_back({s.id, k});
  }
  while (auto r = client.pop()) check(*r, pending, seen, false, kSteadyDeadline);
  seen.wrong += pending.size();  // accepted, never answered
}

// Phase 2: pushes as fast as the client can, never blocking, reading responses as they come.
void overload(Client& client, Seen& seen) {
  std::deque<Pending> pending;
  for (std::uint64_t k = 1; k <= kBurst; ++k) {
    Query q{k};
    const bspflow::Submission s =
        client.try_push(std::move(q), bspflow::StreamClock::now() + kOverloadDeadline);
    if (s) {
      ++seen.accepted;
      pending.push_back({s.id, k});
    } else {
      ++seen.refusals[idx(s.refusal)];
      const bool expected = s.refusal == Refusal::kQueueFull ||
                            s.refusal == Refusal::kDeadlineUnreachable ||
                            s.refusal == Refusal::kClientFull;
      seen.wrong += expected ? 0 : 1;
    }
    while (auto r = client.try_pop()) check(*r, pending, seen, true, kOverloadDeadline);
  }
  while (auto r = client.pop()) check(*r, pending, seen, true, kOverloadDeadline);
  seen.wrong += pending.size();
}

Seen total(const std::array<Seen, kClients>& per_client) {
  Seen t;
  for (const Seen& s : per_client) {
    t.accepted += s.accepted;
    t.answered += s.answered;
    t.ok += s.ok;
    t.late += s.late;
    t.wrong += s.wrong;
    for (std::size_t k = 0; k < t.errors.size(); ++k) t.errors[k] += s.errors[k];
    for (std::size_t k = 0; k < t.refusals.size(); ++k) t.refusals[k] += s.refusals[k];
  }
  return t;
}

std::uint64_t sum(const std::array<std::uint64_t, 7>& a) {
  std::uint64_t n = 0;
  for (std::uint64_t v : a) n += v;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string hgrm;  // empty: no .hgrm file
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::puts(
          "usage: 11_serving [--hgrm PATH]\n"
          "  serves 3 client threads through 2 replicas of a batching stream, first at a steady\n"
          "  load, then overloaded (pushes refused with a reason); checks every answer and the\n"
          "  stream's own counts, prints the metrics as OpenMetrics text; exits 0 if right\n"
          "  --hgrm PATH  also write the end-to-end latency as an HdrHistogram .hgrm file "
          "(default: none)");
      return 0;
    }
    if (arg == "--hgrm") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "11_serving: --hgrm needs a PATH (try --help)\n");
        return 2;
      }
      hgrm = argv[++i];
      continue;
    }
    std::fprintf(stderr, "11_serving: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }

  bspflow::StreamConfig config;
  config.replicas = kReplicas;  // replica r runs on device r
  config.admission.policy = bspflow::AdmissionPolicy::kReject;
  config.admission.queue_capacity = kQueueCapacity;  // admission.predict stays on (the default)
  bspflow::BatchConfig batching;
  batching.max_batch = kMaxBatch;
  batching.max_delay = 500us;  // from the arrival of the batch's first request
  batching.allowed_sizes.assign(kAllowedSizes.begin(), kAllowedSizes.end());
  batching.deadline_aware = true;  // the default, said

  auto tally = std::make_shared<ModelTally>();
  bspflow::DeviceGroup devices(kReplicas);
  auto stream = bspflow::StreamBuilder<Query>(devices, config)
                    .batch_stage("model", Model{tally}, batching)
                    .build();  // a Stream<Query, Answer>
  stream.start();              // serve StreamClients; each reads its own responses

  std::array<Seen, kClients> steady_seen{}, overload_seen{};
  std::barrier<> phase_end(kClients);  // the overload starts when every client is done with phase 1
  std::vector<std::thread> threads;
  for (std::uint32_t c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c, client = stream.client()]() mutable {
      steady(client, steady_seen[c]);
      phase_end.arrive_and_wait();
      overload(client, overload_seen[c]);
    });
  }
  for (std::thread& t : threads) t.join();
  stream.close();  // no new requests: drains, then ends
  const bspflow::StreamResult result = stream.wait();
  const bspflow::StreamStats stats = stream.stats();

  const Seen s1 = total(steady_seen), s2 = total(overload_seen);
  std::printf("steady: %llu requests accepted, %llu answered with their own value, %llu refused\n",
              ull(s1.accepted), ull(s1.ok), ull(sum(s1.refusals)));
  std::printf(
      "overload: %llu pushes: %llu admitted (%llu answered, %llu of them after their deadline; "
      "%llu %s), %llu refused\n",
      ull(kClients * kBurst), ull(s2.accepted), ull(s2.ok), ull(s2.late),
      ull(s2.errors[idx(ErrorKind::kDeadlineExceeded)]),
      bspflow::to_string(ErrorKind::kDeadlineExceeded), ull(sum(s2.refusals)));
  std::printf("refused, by reason:\n");
  for (Refusal reason : kReasons) {
    std::printf("  %-22s %llu\n", bspflow::to_string(reason), ull(stats.refused(reason)));
  }
  std::printf("stream: %s\n", result.message.c_str());

  // The stream's own counts must agree with what the clients saw.
  std::vector<std::string> failures;
  const auto expect = [&](bool holds, std::string what) {
    if (!holds) failures.push_back(std::move(what));
  };
  const std::uint64_t accepted = s1.accepted + s2.accepted, answered = s1.answered + s2.answered;
  const std::uint64_t refused = sum(s1.refusals) + sum(s2.refusals);
  expect(s1.wrong == 0 && s2.wrong == 0,
         "every response the right one, in push order, with its own value or an allowed error");
  expect(s1.accepted == kClients * kSteadyRequests && s1.ok == s1.accepted,
         "every steady request accepted and answered with its value");
  expect(s1.refusals[idx(Refusal::kDeadlinePassed)] == kClients,
         "each client's past-deadline request refused (deadline_passed)");
  expect(sum(s2.refusals) > 0, "the overload refused pushes");
  expect(result.drained() && result.unanswered == 0, "the stream drained on close");
  expect(result.accepted == accepted && result.answered == answered && result.refused == refused,
         "StreamResult counts equal the clients'");
  expect(stats.accepted == accepted && stats.answered == answered && stats.ok == s1.ok + s2.ok,
         "Stream::stats counts equal the clients'");
  for (std::size_t k = 0; k < s1.errors.size(); ++k) {
    expect(stats.errors[k] == s1.errors[k] + s2.errors[k],
           std::string("stats errors ") + bspflow::to_string(static_cast<ErrorKind>(k)));
  }
  for (Refusal reason : kReasons) {
    expect(stats.refused(reason) == s1.refusals[idx(reason)] + s2.refusals[idx(reason)],
           std::string("stats refusals ") + bspflow::to_string(reason));
  }
  expect(stats.latency_ns.count() == answered, "one latency per response");
  expect(stats.replicas.size() == kReplicas, "two replicas in the stats");
  for (const bspflow::ReplicaStats& r : stats.replicas) {
    std::printf("replica %u: took %llu requests\n", r.replica, ull(r.taken));
    expect(r.taken > 0 && !r.failed, "replica " + std::to_string(r.replica) + " served");
  }
  if (stats.stages.size() == 1 && stats.stages[0].batched) {
    const bspflow::StageStats& model = stats.stages[0];
    std::printf("model: %llu batches, %.2f requests a batch (at most %llu), %llu padding items\n",
                ull(model.calls), model.batch_size.mean(), ull(model.batch_size.max()),
                ull(model.padded));
    expect(model.calls == tally->calls.load() && model.padded == tally->padding.load(),
           "stats batches and padding equal the model's own count");
    expect(model.batch_size.max() <= kMaxBatch && tally->bad_sizes.load() == 0,
           "every batch within max_batch, padded to an allowed size");
  } else {
    expect(false, "one batch stage in the stats");
  }

  std::printf("\nmetrics (OpenMetrics text):\n");
  stats.write_openmetrics(std::cout);
  std::cout << "# EOF\n";
  std::printf("\nlatency: p50 %.1f us, p90 %.1f us, p99 %.1f us, p99.9 %.1f us, max %.1f us\n",
              us(stats.latency_ns.value_at_percentile(50)),
              us(stats.latency_ns.value_at_percentile(90)),
              us(stats.latency_ns.value_at_percentile(99)),
              us(stats.latency_ns.value_at_percentile(99.9)), us(stats.latency_ns.max()));
  if (!hgrm.empty()) {
    std::ofstream out(hgrm);
    if (out) stats.write_latency_hgrm(out);
    out.close();
    if (!out) {
      std::fprintf(stderr, "11_serving: cannot write %s\n", hgrm.c_str());
      return 1;
    }
    std::printf("latency percentile distribution (.hgrm, us): %s\n", hgrm.c_str());
  }

  for (const std::string& f : failures) std::fprintf(stderr, "FAILED: %s\n", f.c_str());
  if (!failures.empty()) return 1;
  std::printf("ok\n");
  return 0;
}
