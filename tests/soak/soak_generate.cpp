// The soak suite's generative trials: generate stages at volume (10^5 sequences from 4
// clients, tight memory, cancels and deadlines) and seeded trials over their settings
// (max_active, block size, pool, memory policy, replicas, classes, ordering, a stop mid-run).
// Every accepted request must be answered by exactly one final response, after its partial
// responses in order; a sequence answered with outputs only must have the right ones; no
// block may stay held.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/generate.hpp>
#include <bspflow/stream/stream.hpp>

#include "soak_common.hpp"
#include "soak_serve.hpp"

namespace soak {
namespace {

using bspflow::Generation;
using bspflow::StepOutput;

struct Prompt {
  U64 seed = 0;
  std::uint32_t length = 1;
};

U64 hash(U64 x) {
  x ^= x >> 31;
  x *= 0x9E3779B97F4A7C15ULL;
  x ^= x >> 29;
  return x;
}

// Output t of a sequence: a hash of its seed, t and its state's entries so far, so a state
// that did not come through a preemption whole gives a wrong output.
std::vector<StepOutput<U64>> step(std::span<Generation<Prompt, U64>> active) {
  std::vector<StepOutput<U64>> out;
  out.reserve(active.size());
  for (auto& g : active) {
    U64 h = hash(g.input().seed + g.step());
    for (std::size_t i = 0; i < g.state().size(); ++i) h = hash(h ^ g.state()[i]);
    g.state().push_back(h);
    out.push_back(g.step() + 1 >= g.input().length ? StepOutput<U64>::last(h)
                                                   : StepOutput<U64>::next(h));
  }
  return out;
}

std::vector<U64> reference(const Prompt& p) {
  std::vector<U64> state;
  for (std::uint32_t t = 0; t < p.length; ++t) {
    U64 h = hash(p.seed + t);
    for (U64 e : state) h = hash(h ^ e);
    state.push_back(h);
  }
  return state;
}

// What one client saw.
struct GenTally {
  U64 accepted = 0, finals = 0, ok = 0, disorder = 0, twice = 0, wrong = 0, missing = 0;
  std::array<U64, bspflow::kErrorKinds> errors{};
};

struct Knobs {
  U64 per_client = 0;
  std::uint32_t max_length = 64;  // the longest request
  std::uint32_t cap = 64;         // GenerateConfig::max_length
  int cancel_pct = 0, deadline_pct = 0;
  bspflow::Ordering ordering = bspflow::Ordering::kNone;
};

// One client: pushes its sequences (some with a deadline they may miss, some cancelled),
// reads every response, and checks each request's: indexes in order, one final, the right
// outputs when it ends with a value.
GenTally run_client(bspflow::StreamClient<Prompt, U64>& c, std::uint32_t k, const Knobs& knobs,
                    U64 seed) {
  Rng rng(seed);
  GenTally t;
  struct Req {
    Prompt p;
    std::vector<U64> got;
    bool final = false;
    bool failed = false;
  };
  std::vector<Req> reqs;
  const auto on = [&](const bspflow::Response<U64>& r) {
    if (r.id.sequence >= reqs.size()) {
      ++t.twice;
      return;
    }
    Req& q = reqs[r.id.sequence];
    if (q.final) {
      ++t.twice;
      return;
    }
    if (r.index != q.got.size() + (q.failed ? 1 : 0)) ++t.disorder;
    if (r.ok()) {
      q.got.push_back(*r.value);
    } else {
      q.failed = true;
      ++t.errors[static_cast<std::size_t>(r.kind())];
    }
    if (r.final) {
      q.final = true;
      ++t.finals;
      if (r.ok()) {
        ++t.ok;
        // GenerateConfig::max_length ends a longer sequence with its output there.
        if (q.got != reference({q.p.seed, std::min(q.p.length, knobs.cap)})) ++t.wrong;
      } else if (r.kind() == bspflow::ErrorKind::kStageFailed &&
                 r.error->message.find("state memory") == std::string::npos) {
        ++t.wrong;  // only the memory policy fails a sequence here
      }
    }
  };
  for (U64 i = 0; i < knobs.per_client; ++i) {
    const Prompt p{(U64{k} << 40) + i, static_cast<std::uint32_t>(rng.in(1, knobs.max_length))};
    const bool timed = static_cast<int>(rng.below(100)) < knobs.deadline_pct;
    const auto deadline =
        timed ? bspflow::StreamClock::now() + std::chrono::microseconds(rng.in(50, 2000))
              : bspflow::kNoDeadline;
    bspflow::Submission s;
    for (;;) {
      s = c.try_push(Prompt(p), deadline);
      if (s || (s.refusal != bspflow::Refusal::kQueueFull &&
                s.refusal != bspflow::Refusal::kClientFull)) {
        break;
      }
      if (auto r = c.try_pop()) {
        on(*r);
      } else {
        std::this_thread::yield();
      }
    }
    if (!s) continue;  // refused: its deadline passed, or the stream stopped
    ++t.accepted;
    if (reqs.size() <= s.id.sequence) reqs.resize(s.id.sequence + 1);
    reqs[s.id.sequence].p = p;
    if (static_cast<int>(rng.below(100)) < knobs.cancel_pct) c.cancel(s.id);
    while (auto r = c.try_pop()) on(*r);
  }
  while (auto r = c.pop()) on(*r);
  for (const Req& q : reqs) {
    if (!q.final) ++t.missing;
  }
  return t;
}

struct Setting {
  bspflow::GenerateConfig gen;
  bspflow::StreamConfig stream;
  std::uint32_t devices = 1;
  std::uint32_t clients = 4;
  Knobs knobs;
  bool cancel_mid_run = false;
  bool report = false;  // print the figures
};

// Runs one setting; checks every client's tally and the stream's blocks.
void run_setting(const Setting& s, bspflow::DeviceGroup& group, U64 seed) {
  auto stream = bspflow::StreamBuilder<Prompt>(group, s.stream)
                    .generate_stage<U64>("gen", step, s.gen, 0)
                    .build();
  std::vector<bspflow::StreamClient<Prompt, U64>> clients;
  for (std::uint32_t k = 0; k < s.clients; ++k) {
    clients.push_back(stream.client());
    clients.back().set_priority(k % s.stream.priority_classes);
  }
  stream.start();
  std::vector<GenTally> tallies(s.clients);
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < s.clients; ++k) {
    threads.emplace_back(
        [&, k] { tallies[k] = run_client(clients[k], k, s.knobs, seed * 31 + k); });
  }
  bspflow::StreamResult result;
  if (s.cancel_mid_run) {
    // A stop mid-run: wait() answers what the queues still hold, which the clients wait for.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    stream.cancel();
    result = stream.wait();
    for (auto& t : threads) t.join();
  } else {
    for (auto& t : threads) t.join();
    stream.close();
    result = stream.wait();
  }
  CHECK((result.drained() || s.cancel_mid_run));
  GenTally all;
  for (const GenTally& t : tallies) {
    all.accepted += t.accepted;
    all.finals += t.finals;
    all.ok += t.ok;
    all.disorder += t.disorder;
    all.twice += t.twice;
    all.wrong += t.wrong;
    all.missing += t.missing;
  }
  CHECK(all.finals == all.accepted);
  CHECK(all.missing == 0);
  CHECK(all.twice == 0);
  CHECK(all.disorder == 0);
  CHECK(all.wrong == 0);
  CHECK(result.answered == all.accepted);
  const bspflow::StreamStats st = stream.stats();
  REQUIRE(st.stages.at(0).generation.has_value());
  if (s.report)
    std::printf(
        "soak: %llu sequences accepted, %llu answered with every output, %llu outputs, "
        "%llu preemptions\n",
        static_cast<unsigned long long>(all.accepted), static_cast<unsigned long long>(all.ok),
        static_cast<unsigned long long>(st.stages.at(0).generation->tokens),
        static_cast<unsigned long long>(st.stages.at(0).generation->preemptions));
  CHECK(st.stages.at(0).generation->blocks_used == 0);
  CHECK(st.stages.at(0).generation->active == 0);
  CHECK(st.stages.at(0).generation->preempted == 0);
}

void generate_trial(Rng& rng, std::array<std::unique_ptr<bspflow::DeviceGroup>, 5>& groups) {
  Setting s;
  s.stream.replicas = rng.coin() ? 2 : 1;
  s.stream.priority_classes = static_cast<std::uint32_t>(rng.in(1, 2));
  s.stream.ordering = rng.coin() ? bspflow::Ordering::kNone : bspflow::Ordering::kPerClient;
  s.stream.admission.queue_capacity = rng.in(4, 256);
  s.stream.response_capacity = rng.in(16, 512);
  s.gen.max_active = static_cast<std::uint32_t>(rng.in(1, 24));
  s.gen.max_length = static_cast<std::uint32_t>(rng.in(4, 64));
  s.gen.block_entries = rng.in(1, 8);
  const int policy = static_cast<int>(rng.below(3));
  s.gen.memory_policy = policy == 0   ? bspflow::MemoryPolicy::kPreempt
                        : policy == 1 ? bspflow::MemoryPolicy::kFail
                                      : bspflow::MemoryPolicy::kReserve;
  // Tight: room for a few maximum-length sequences, at least what kReserve needs.
  const U64 blocks = std::max<U64>(s.gen.blocks_for(s.gen.max_length),
                                   rng.in(1, 4) * s.gen.blocks_for(s.gen.max_length) / 2);
  s.gen.memory = blocks * s.gen.block_entries * sizeof(U64);
  if (rng.below(4) == 0) s.gen.first_token_timeout = std::chrono::milliseconds(rng.in(1, 50));
  s.knobs.per_client = rng.in(20, 300);
  s.knobs.max_length = s.gen.max_length + 4;  // some reach max_length
  s.knobs.cap = s.gen.max_length;
  s.knobs.cancel_pct = static_cast<int>(rng.below(20));
  s.knobs.deadline_pct = static_cast<int>(rng.below(20));
  s.knobs.ordering = s.stream.ordering;
  s.cancel_mid_run = rng.below(8) == 0;
  CAPTURE(s.stream.replicas);
  CAPTURE(s.gen.max_active);
  CAPTURE(s.gen.block_entries);
  CAPTURE(blocks);
  CAPTURE(policy);
  run_setting(s, *groups[s.stream.replicas], rng.in(1, 1u << 30));
}

}  // namespace

void generate_trials() {
  run_trials("generate", "BSPFLOW_SOAK_GENERATE_TRIALS", 200, 3'000'000, generate_trial);
}

}  // namespace soak

TEST_SUITE_BEGIN("soak");

TEST_CASE("generation at volume: 10^5 sequences, 4 clients, tight memory, cancels, deadlines") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;
  soak::Setting s;
  s.stream.ordering = bspflow::Ordering::kNone;
  s.stream.priority_classes = 2;
  s.stream.admission.queue_capacity = 256;
  s.gen.max_active = 32;
  s.gen.max_length = 64;
  s.gen.block_entries = 4;
  s.gen.memory = 4 * 64 * sizeof(std::uint64_t);  // 4 maximum-length sequences
  s.knobs.per_client = soak::env_u64("BSPFLOW_SOAK_GENERATE_SEQUENCES", 100'000) / 4;
  s.knobs.max_length = 64;
  s.knobs.cancel_pct = 10;
  s.knobs.deadline_pct = 10;
  s.report = true;
  bspflow::DeviceGroup group(1, soak::kSmall);
  const auto t0 = soak::Clock::now();
  soak::run_setting(s, group, 42);
  std::printf("soak: %llu generated sequences in %.1f s\n",
              static_cast<unsigned long long>(4 * s.knobs.per_client), soak::seconds_since(t0));
}

TEST_CASE("seeded generate trials: policies, pools, replicas, classes, ordering, stops") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;
  soak::generate_trials();
}

TEST_SUITE_END();
