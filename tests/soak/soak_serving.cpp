// The soak suite's serving part (see soak_test.cpp): 10^6 requests exactly once through 2
// replicas of a Stream (StreamClients) with batching, deadlines and cancels, and the seeded
// serving trials (replicas, batch stages, admission, deadlines, cancels, close and cancel
// mid-run), with their own test cases at the end of this file. What they share with the
// graph trials (soak_graph.cpp) is in soak_serve.hpp.
#include "soak_serve.hpp"

#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <stdexcept>
#include <thread>
#include <vector>

#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_serving.hpp>

using namespace bspflow;
using namespace std::chrono_literals;

namespace soak {

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
  const auto expected = [](U64 x, std::uint32_t) { return x * 2 + 1; };  // any version
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      StreamClient<U64, U64>& c = handles[k];
      ServeTally& t = tallies[k];
      PendingQueue q(true);
      for (U64 i = 0; i < per_client; ++i) {
        while (q.size() >= 512 && pop_one(c, q, t, expected)) {
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
        q.add(Pending{s.id.sequence, x, allowed});
      }
      while (q.size() > 0 && pop_one(c, q, t, expected)) {
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

  const End end = static_cast<End>(rng.in(0, 2));
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 3));
  const U64 per_client = rng.in(10, 400);
  const U64 due_every = rng.in(0, 4);  // 0: no deadlines; else every due_every-th
  const U64 due_us = rng.in(0, 3000);
  const U64 cancel_every = rng.in(0, 7);  // 0: no cancels
  const std::size_t window = rng.in(1, 64);
  const ClientLoad load{.per_client = per_client,
                        .window = window,
                        .due_every = due_every,
                        .due_us = due_us,
                        .cancel_every = cancel_every};
  const auto end_after = micros(rng, 4000);
  std::vector<std::uint64_t> seeds(clients);
  for (auto& s : seeds) s = rng.in(0, ~U64{0});
  // An ok answer: the model doubles x, "post" adds 1, whichever version answered.
  const auto expected = [post](U64 x, std::uint32_t) { return x * 2 + post; };
  // kStageFailed only for poisoned values (or the batch that threw).
  const auto stage_fails = [poisoned, batched, faults](U64 x) {
    return poisoned(x) || (batched && faults);
  };

  stream.start();
  std::vector<StreamClient<U64, U64>> handles;
  handles.reserve(clients);
  for (std::uint32_t k = 0; k < clients; ++k) handles.push_back(stream.client());
  std::vector<ServeTally> tallies(clients);
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      trial_client(handles[k], k, seeds[k], load, cfg, end, expected, stage_fails, tallies[k]);
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

void serving_trials() {
  run_trials("serving", "BSPFLOW_SOAK_SERVE_TRIALS", 300, 1'000'000, serving_trial);
}

}  // namespace soak

// The serving soak sits here rather than in soak_test.cpp: it needs nothing of the other
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

TEST_SUITE_END();
