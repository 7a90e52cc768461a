// A generate stage among the stream's serving features: outputs joined into fewer responses
// (stream_every), new sequences placed on the replica with the least work and the most free
// blocks, a replica whose step keeps failing ejected, and priority classes choosing who joins
// the active set.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/generate.hpp>
#include <bspflow/stream/stream.hpp>

#include "generate_test_util.hpp"
#include "runtime_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using namespace test::gen;
using test::eventually;
using test::Gate;

TEST_SUITE_BEGIN("stream_generate_serving");

namespace {

using Tokens = std::vector<U64>;

// toy_step with each output a one-token vector, so that outputs can be joined; sequence
// `fail_seed` fails at its iteration `fail_at`.
auto joined_step(U64 fail_seed = ~U64{0}, std::uint32_t fail_at = 0) {
  return [fail_seed, fail_at](std::span<Generation<Prompt, U64>> active) {
    std::vector<StepOutput<Tokens>> out;
    for (StepOutput<U64>& o : toy_step(active)) {
      const Tokens t{o.value()};
      out.push_back(o.done() ? StepOutput<Tokens>::last(t) : StepOutput<Tokens>::next(t));
    }
    for (std::size_t i = 0; i < active.size(); ++i) {
      if (active[i].input().seed == fail_seed && active[i].step() == fail_at) {
        out[i] = StepOutput<Tokens>::failure("seed " + std::to_string(fail_seed) + " breaks");
      }
    }
    return out;
  };
}

// Every response of one client, by request, each request's checked for order.
std::map<U64, std::vector<Response<Tokens>>> collect_joined(StreamClient<Prompt, Tokens>& c) {
  std::map<U64, std::vector<Response<Tokens>>> out;
  while (auto r = c.pop()) {
    auto& v = out[r->id.sequence];
    CHECK(r->index == v.size());
    if (!v.empty()) CHECK_FALSE(v.back().final);
    v.push_back(std::move(*r));
  }
  return out;
}

// A step whose sequences run until `release` is set (then they end at once), adding no
// state: each holds its first block only, so a replica's free blocks count its sequences.
// Its iterations run back to back, so a busy replica reaches a boundary (where it could take
// a new request) far more often than an idle one wakes.
auto held_step(std::shared_ptr<std::atomic<bool>> release) {
  return [release](std::span<Generation<Prompt, U64>> active) {
    std::vector<StepOutput<Tokens>> out;
    for (auto& g : active) {
      const Tokens t{g.input().seed};
      out.push_back(release->load() ? StepOutput<Tokens>::last(t) : StepOutput<Tokens>::next(t));
    }
    return out;
  };
}

}  // namespace

TEST_CASE("generate: stream_every joins k outputs into one response, the last what is left") {
  DeviceGroup group(1, test::kSmall);
  GenerateConfig config;
  config.stream_every = 3;
  StreamConfig sc;
  sc.ordering = Ordering::kNone;
  auto stream = StreamBuilder<Prompt>(group, sc)
                    .generate_stage<U64>("gen", joined_step(9, 4), config)
                    .build();
  auto c = stream.client();
  stream.start();
  const std::vector<Prompt> prompts{{1, 1}, {2, 3}, {3, 4}, {4, 7}, {9, 8}};
  for (const Prompt& p : prompts) REQUIRE(c.push(p).accepted());
  stream.close();
  const auto got = collect_joined(c);
  REQUIRE(stream.wait().drained());
  REQUIRE(got.size() == prompts.size());
  for (std::size_t i = 0; i + 1 < prompts.size(); ++i) {
    CAPTURE(i);
    const auto& v = got.at(i);
    const std::vector<U64> want = reference(prompts[i]);
    CHECK(v.size() == (want.size() + 2) / 3);  // ceil(length / 3) responses
    Tokens all;
    for (const auto& r : v) {
      REQUIRE(r.ok());
      CHECK(r.value->size() == (r.final ? want.size() - 3 * (v.size() - 1) : 3));
      all.insert(all.end(), r.value->begin(), r.value->end());
    }
    CHECK(all == want);
    CHECK(v.back().final);
  }
  // Seed 9 fails at its fifth iteration: its first three outputs came as one response, the
  // fourth (held) comes before the error, which is final.
  const auto& bad = got.at(4);
  REQUIRE(bad.size() == 3);
  const std::vector<U64> want = reference({9, 8});
  CHECK(*bad[0].value == Tokens(want.begin(), want.begin() + 3));
  CHECK(*bad[1].value == Tokens{want[3]});
  CHECK_FALSE(bad[1].final);
  CHECK(bad[2].kind() == ErrorKind::kStageFailed);
  CHECK(bad[2].error->message.find("seed 9 breaks") != std::string::npos);
  // Outputs count each iteration; first and later response times count responses.
  const StreamStats st = stream.stats();
  const GenerateStats& gs = gen_stats(st);
  CHECK(gs.tokens == 1 + 3 + 4 + 7 + 4);
  CHECK(gs.ttft_ns.count() == 5);
  CHECK(gs.itl_ns.count() == (0 + 0 + 1 + 2) + 1);
}

TEST_CASE(
    "generate: stream_every outside 1..max_length, or over outputs it cannot join, is refused") {
  DeviceGroup group(1, test::kSmall);
  GenerateConfig config;
  config.max_length = 16;
  for (std::uint32_t bad : {0u, 17u}) {
    config.stream_every = bad;
    try {
      (void)StreamBuilder<Prompt>(group).generate_stage<U64>("gen", joined_step(), config).build();
      FAIL("accepted stream_every " << bad);
    } catch (const Error& e) {
      const std::string m = e.what();
      CHECK(m.find("GenerateConfig::stream_every") != std::string::npos);
      CHECK(m.find(std::to_string(bad)) != std::string::npos);
      CHECK(m.find("1..max_length (16)") != std::string::npos);
    }
  }
  config.stream_every = 2;
  try {
    (void)StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step, config).build();
    FAIL("joined U64 outputs");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK(m.find("generate stage 'gen'") != std::string::npos);
    CHECK(m.find("stream_every is 2") != std::string::npos);
    CHECK(m.find("cannot be appended to") != std::string::npos);
  }
}

TEST_CASE("generate: a new sequence goes to the replica with less work and more free blocks") {
  DeviceGroup group(2, test::kSmall);
  StreamConfig sc;
  sc.replicas = 2;
  sc.ordering = Ordering::kNone;
  GenerateConfig config;
  config.max_active = 8;
  config.max_length = 1u << 24;
  config.stream_every = config.max_length;  // one response each, at the end
  config.block_entries = 64;
  config.memory = 16 * 64 * sizeof(U64);
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto stream = StreamBuilder<Prompt>(group, sc)
                    .generate_stage<U64>("gen", held_step(release), config)
                    .build();
  auto c = stream.client();
  stream.start();
  // One at a time, each once the last has joined an active set: a replica busy with k
  // sequences leaves the next to one with fewer, whose iterations are no slower to reach it.
  const std::size_t n = 6;
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(c.push(Prompt{i, 1'000'000}).accepted());
    REQUIRE(eventually([&] { return gen_stats(stream.stats()).active == i + 1; }, 10s));
    const StreamStats st = stream.stats();
    const U64 a = st.replicas.at(0).taken, b = st.replicas.at(1).taken;
    CAPTURE(i);
    CHECK(a + b == i + 1);
    CHECK((a > b ? a - b : b - a) <= 1);  // the two never differ by more than one
  }
  release->store(true);
  stream.close();
  std::size_t answers = 0;
  while (auto r = c.pop()) answers += r->final ? 1 : 0;
  REQUIRE(stream.wait().drained());
  CHECK(answers == n);
  const StreamStats st = stream.stats();
  CHECK(st.replicas.at(0).taken == n / 2);
  CHECK(st.replicas.at(1).taken == n / 2);
}

TEST_CASE("generate: a replica whose step keeps failing is ejected, the other serves") {
  DeviceGroup group(2, test::kSmall);
  StreamConfig sc;
  sc.replicas = 2;
  sc.ordering = Ordering::kNone;
  sc.ejection.consecutive_failures = 2;
  sc.ejection.base_time = 1h;  // no probe while the test runs
  sc.ejection.max_time = 1h;
  // Each replica's copy of the step: the one that ever ran the long sequence (seed 0) works,
  // the other fails every sequence it runs.
  struct Step {
    std::shared_ptr<std::atomic<bool>> release;
    bool good = false;
    std::vector<StepOutput<U64>> operator()(std::span<Generation<Prompt, U64>> active) {
      std::vector<StepOutput<U64>> out;
      for (auto& g : active) {
        if (g.input().seed == 0) good = true;
      }
      if (good) std::this_thread::sleep_for(200us);  // fewer partial responses to hold
      for (auto& g : active) {
        if (!good) {
          out.push_back(StepOutput<U64>::failure("a broken replica"));
        } else if (g.input().seed == 0) {
          out.push_back(release->load() ? StepOutput<U64>::last(0) : StepOutput<U64>::next(0));
        } else {
          out.push_back(g.step() + 1 >= g.input().length ? StepOutput<U64>::last(g.input().seed)
                                                         : StepOutput<U64>::next(g.input().seed));
        }
      }
      return out;
    }
  };
  GenerateConfig config;
  config.max_length = 1u << 20;
  config.memory = 64 * 16 * sizeof(U64);
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto stream =
      StreamBuilder<Prompt>(group, sc).generate_stage<U64>("gen", Step{release}, config).build();
  auto c = stream.client();
  stream.start();
  // The long sequence holds one replica ("good"); the other, with less work, takes each new
  // request until it is ejected.
  REQUIRE(c.push(Prompt{0, 1'000'000}).accepted());
  REQUIRE(eventually([&] { return gen_stats(stream.stats()).active == 1; }, 10s));
  const StreamStats first = stream.stats();
  const std::uint32_t good = first.replicas.at(0).taken == 1 ? 0 : 1, bad = 1 - good;
  std::map<U64, std::vector<Response<U64>>> got;
  auto until_final = [&](U64 seq) {
    while (got[seq].empty() || !got[seq].back().final) {
      auto r = c.pop();
      REQUIRE(r.has_value());
      got[r->id.sequence].push_back(std::move(*r));
    }
  };
  for (U64 seq = 1; seq <= 2; ++seq) {
    REQUIRE(c.push(Prompt{seq, 3}).accepted());
    until_final(seq);
    CHECK(got.at(seq).back().kind() == ErrorKind::kStageFailed);
    // Settled before the next push: the bad replica's blocks and count given back.
    REQUIRE(eventually(
        [&] {
          const StreamStats st = stream.stats();
          return st.replicas.at(bad).answered == seq && gen_stats(st).blocks_used == 1;
        },
        10s));
  }
  REQUIRE(eventually([&] { return stream.stats().replicas.at(bad).ejected; }, 10s));
  for (U64 seq = 3; seq <= 5; ++seq) {
    REQUIRE(c.push(Prompt{seq, 3}).accepted());
    until_final(seq);
    CHECK(values(got.at(seq)) == std::vector<U64>{seq, seq, seq});
  }
  release->store(true);
  stream.close();
  while (auto r = c.pop()) got[r->id.sequence].push_back(std::move(*r));
  REQUIRE(stream.wait().drained());
  CHECK(got.at(0).back().final);
  CHECK(got.at(0).back().ok());
  const StreamStats st = stream.stats();
  CHECK(st.replicas.at(bad).taken == 2);
  CHECK(st.replicas.at(bad).ejections == 1);
  CHECK(st.replicas.at(good).taken == 4);
}

TEST_CASE("generate: priority classes choose which waiting request joins the active set") {
  DeviceGroup group(1, test::kSmall);
  StreamConfig sc;
  sc.priority_classes = 2;
  sc.min_share = {0.0, 0.0, 0.0, 0.0};
  sc.ordering = Ordering::kNone;
  GenerateConfig config;
  config.max_active = 1;
  Gate gate;
  auto joined = std::make_shared<std::vector<U64>>();  // seeds, in the order they joined
  auto step = [&gate, joined](std::span<Generation<Prompt, U64>> active) {
    if (joined->empty()) gate.hold();  // until every request is queued
    for (const auto& g : active) {
      if (g.step() == 0) joined->push_back(g.input().seed);
    }
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group, sc).generate_stage<U64>("gen", step, config).build();
  auto low = stream.client();
  auto high = stream.client();
  low.set_priority(1);
  high.set_priority(0);
  stream.start();
  REQUIRE(low.push(Prompt{10, 2}).accepted());
  REQUIRE(gate.wait_entered());
  REQUIRE(low.push(Prompt{11, 2}).accepted());
  REQUIRE(low.push(Prompt{12, 2}).accepted());
  REQUIRE(high.push(Prompt{20, 2}).accepted());
  REQUIRE(high.push(Prompt{21, 2}).accepted());
  gate.open = true;
  stream.close();
  std::size_t answers = 0;
  for (auto* c : {&low, &high}) {
    while (auto r = c->pop()) answers += r->final ? 1 : 0;
  }
  REQUIRE(stream.wait().drained());
  CHECK(answers == 5);
  // The first joined alone; then the high class's requests, in push order, before the low.
  CHECK(*joined == std::vector<U64>{10, 20, 21, 11, 12});
}

TEST_SUITE_END();
