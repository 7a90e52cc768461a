// Generative serving (generate_stage): one response per iteration, then a final one, per
// request; sequences join and leave the active set at iteration boundaries; outputs do not
// depend on the batch; four clients read their own partial responses exactly once; a failed
// sequence or step, bad configurations, and nodes after the stage.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <sstream>
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
using test::Gate;

TEST_SUITE_BEGIN("stream_generate");

TEST_CASE("generate: one response per iteration, then a final one, in push order") {
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step).build();
  auto c = stream.client();
  stream.start();
  const std::vector<Prompt> prompts{{1, 3}, {2, 5}, {3, 1}, {4, 7}};
  for (const Prompt& p : prompts) REQUIRE(c.push(p).accepted());
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  REQUIRE(got.by_request.size() == prompts.size());
  // kPerClient: each request's responses come whole, in push order.
  CHECK(got.order == std::vector<U64>{0, 1, 2, 3});
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CHECK(values(got.by_request.at(i)) == reference(prompts[i]));
  }
  const StreamStats st = stream.stats();
  CHECK(st.answered == prompts.size());
  CHECK(gen_stats(st).tokens == 3 + 5 + 1 + 7);
  CHECK(gen_stats(st).sequences == prompts.size());
  CHECK(gen_stats(st).blocks_used == 0);
  // Time to first output once per sequence, between outputs for the others, by class; and
  // the metrics' families.
  const GenerateStats& gs = gen_stats(st);
  REQUIRE(gs.by_class.size() == 1);
  CHECK(gs.by_class[0].tokens == 16);
  CHECK(gs.ttft_ns.count() == 4);
  CHECK(gs.itl_ns.count() == 12);
  std::ostringstream om;
  st.write_openmetrics(om, "g");
  CHECK(om.str().find("g_generate_tokens_total{stage=\"gen\",class=\"0\"} 16\n") !=
        std::string::npos);
  CHECK(om.str().find("g_generate_ttft_seconds_count{stage=\"gen\",class=\"0\"} 4\n") !=
        std::string::npos);
  CHECK(om.str().find("g_generate_blocks_free{stage=\"gen\"} 128\n") != std::string::npos);
}

TEST_CASE("generate: a sequence's outputs do not depend on what else is in the batch") {
  std::vector<Prompt> prompts;
  for (U64 i = 0; i < 24; ++i) prompts.push_back({1000 + i, static_cast<std::uint32_t>(1 + i % 9)});
  for (std::uint32_t max_active : {1u, 3u, 8u}) {
    CAPTURE(max_active);
    DeviceGroup group(1, test::kSmall);
    GenerateConfig config;
    config.max_active = max_active;
    config.block_entries = 4;
    auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step, config).build();
    auto c = stream.client();
    stream.start();
    for (const Prompt& p : prompts) REQUIRE(c.push(p).accepted());
    stream.close();
    const Collected got = collect(c);
    REQUIRE(stream.wait().drained());
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      CHECK(values(got.by_request.at(i)) == reference(prompts[i]));
    }
  }
}

TEST_CASE("generate: sequences join and leave the active set at iteration boundaries") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  // The active set of every iteration, by request sequence number (the device's; read after
  // wait()).
  auto sets = std::make_shared<std::vector<std::vector<U64>>>();
  GenerateConfig config;
  config.max_active = 3;
  auto step = [&gate, sets](std::span<Generation<Prompt, U64>> active) {
    if (sets->empty()) gate.hold();  // until every request is queued
    std::vector<U64> ids;
    for (const auto& g : active) ids.push_back(g.id().sequence);
    sets->push_back(ids);
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config).build();
  auto c = stream.client();
  stream.start();
  const std::vector<std::uint32_t> lengths{4, 1, 2, 5, 1, 3, 2};
  REQUIRE(c.push(Prompt{0, lengths[0]}).accepted());
  REQUIRE(gate.wait_entered());
  for (std::size_t i = 1; i < lengths.size(); ++i) {
    REQUIRE(c.push(Prompt{i, lengths[i]}).accepted());
  }
  gate.open = true;
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  REQUIRE(got.by_request.size() == lengths.size());
  // The first iteration ran request 0 alone (the others came while it ran); from then on,
  // each sequence runs in exactly `length` consecutive iterations, a finished one's place
  // goes to the next waiting request at the next iteration, and the set is as full as it
  // can be.
  CHECK(sets->front() == std::vector<U64>{0});
  std::map<U64, std::vector<std::size_t>> seen;  // request -> iterations it ran in
  for (std::size_t k = 0; k < sets->size(); ++k) {
    CHECK((*sets)[k].size() <= config.max_active);
    for (U64 id : (*sets)[k]) seen[id].push_back(k);
  }
  std::size_t started = 1;
  for (std::size_t k = 1; k < sets->size(); ++k) {
    const std::size_t waiting = lengths.size() - started;
    std::size_t carried = 0;
    for (U64 id : (*sets)[k]) {
      if (seen[id].front() < k) ++carried;
    }
    const std::size_t joined = (*sets)[k].size() - carried;
    CHECK(joined == std::min<std::size_t>(waiting, config.max_active - carried));
    started += joined;
  }
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const auto& ks = seen.at(i);
    CHECK(ks.size() == lengths[i]);
    CHECK(ks.back() - ks.front() + 1 == ks.size());  // consecutive
  }
}

TEST_CASE("generate: four clients each read their own partial responses exactly once, in order") {
  for (Ordering ordering : {Ordering::kPerClient, Ordering::kNone}) {
    CAPTURE(static_cast<int>(ordering));
    DeviceGroup group(2, test::kSmall);
    StreamConfig sc;
    sc.replicas = 2;
    sc.ordering = ordering;
    GenerateConfig config;
    config.max_active = 6;
    config.block_entries = 2;
    config.memory = 24 * sizeof(U64);  // 12 blocks: sequences are preempted now and then
    auto stream =
        StreamBuilder<Prompt>(group, sc).generate_stage<U64>("gen", toy_step, config).build();
    constexpr std::size_t kClients = 4;
    constexpr std::uint64_t kEach = 300;
    std::vector<StreamClient<Prompt, U64>> clients;
    for (std::size_t k = 0; k < kClients; ++k) clients.push_back(stream.client());
    stream.start();
    std::vector<std::thread> threads;
    std::vector<std::string> problems(kClients);
    for (std::size_t k = 0; k < kClients; ++k) {
      threads.emplace_back([&, k] {
        auto& c = clients[k];
        std::map<U64, Prompt> sent;
        std::map<U64, std::vector<U64>> got;
        std::set<U64> finished;
        auto take = [&](const Response<U64>& r) {
          const U64 s = r.id.sequence;
          if (finished.count(s) != 0) problems[k] += "response after the final one; ";
          if (r.index != got[s].size()) problems[k] += "index out of order; ";
          if (!r.ok()) problems[k] += "error: " + r.error->message + "; ";
          if (r.ok()) got[s].push_back(*r.value);
          if (r.final) finished.insert(s);
        };
        for (U64 i = 0; i < kEach; ++i) {
          const Prompt p{k * 1'000'000 + i, static_cast<std::uint32_t>(1 + (i * 7 + k) % 13)};
          const Submission sub = c.push(p);
          if (!sub) {
            problems[k] += std::string("refused: ") + to_string(sub.refusal) + "; ";
            continue;
          }
          sent[sub.id.sequence] = p;
          while (auto r = c.try_pop()) take(*r);
        }
        while (auto r = c.pop()) take(*r);
        if (finished.size() != sent.size()) problems[k] += "a request was never finished; ";
        for (const auto& [s, p] : sent) {
          if (got[s] != reference(p)) {
            problems[k] += "request " + std::to_string(s) + " has wrong outputs; ";
            break;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    stream.close();
    const StreamResult result = stream.wait();
    CHECK(result.drained());
    for (const std::string& p : problems) CHECK(p.empty());
    const StreamStats st = stream.stats();
    CHECK(result.answered == kClients * kEach);
    CHECK(gen_stats(st).sequences == kClients * kEach);
    CHECK(gen_stats(st).blocks_used == 0);
    CHECK(gen_stats(st).active == 0);
  }
}

TEST_CASE("generate: a failed sequence ends alone; a step's wrong output count fails the set") {
  SUBCASE("StepOutput::failure") {
    DeviceGroup group(1, test::kSmall);
    auto step = [](std::span<Generation<Prompt, U64>> active) {
      auto out = toy_step(active);
      for (std::size_t i = 0; i < active.size(); ++i) {
        if (active[i].input().seed == 7 && active[i].step() == 1) {
          out[i] = StepOutput<U64>::failure("seed 7 breaks");
        }
      }
      return out;
    };
    auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step).build();
    auto c = stream.client();
    stream.start();
    REQUIRE(c.push(Prompt{7, 4}).accepted());
    REQUIRE(c.push(Prompt{8, 4}).accepted());
    stream.close();
    const Collected got = collect(c);
    REQUIRE(stream.wait().drained());
    const auto& bad = got.by_request.at(0);
    CHECK(bad.size() == 2);  // one partial, then the error
    CHECK(bad.back().kind() == ErrorKind::kStageFailed);
    CHECK(bad.back().error->message.find("seed 7 breaks") != std::string::npos);
    CHECK(values(got.by_request.at(1)) == reference({8, 4}));
  }
  SUBCASE("one output too few") {
    DeviceGroup group(1, test::kSmall);
    Gate gate;
    auto step = [&gate](std::span<Generation<Prompt, U64>> active) {
      gate.hold();
      auto out = toy_step(active);
      out.pop_back();
      return out;
    };
    auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step).build();
    auto c = stream.client();
    stream.start();
    REQUIRE(c.push(Prompt{1, 4}).accepted());
    REQUIRE(gate.wait_entered());
    REQUIRE(c.push(Prompt{2, 4}).accepted());
    gate.open = true;
    stream.close();
    const Collected got = collect(c);
    REQUIRE(stream.wait().drained());
    for (const auto& [seq, v] : got.by_request) {
      CHECK(v.back().kind() == ErrorKind::kStageFailed);
    }
    const std::string& m = got.by_request.at(0).back().error->message;
    CHECK(m.find("returned 0 output(s) for 1 active sequence(s)") != std::string::npos);
  }
}

TEST_CASE("generate: bad configurations are refused, naming the field") {
  DeviceGroup group(2, test::kSmall);
  const auto refused = [&](GenerateConfig config, const std::string& field) {
    std::string message;
    try {
      (void)StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step, config).build();
    } catch (const Error& e) {
      message = e.what();
    }
    CAPTURE(message);
    CHECK(message.find(field) != std::string::npos);
  };
  GenerateConfig c;
  c.max_active = 0;
  refused(c, "GenerateConfig::max_active");
  c = {};
  c.block_entries = 0;
  refused(c, "GenerateConfig::block_entries");
  c = {};
  c.memory = 8;  // less than one block of 16 entries of 8 bytes
  refused(c, "GenerateConfig::memory");
  c = {};
  c.memory_policy = MemoryPolicy::kReserve;
  c.memory = 16 * sizeof(U64);  // one block: max_length 256 needs 16
  refused(c, "MemoryPolicy::kReserve");
  c = {};
  c.memory = 1 << 30;  // more than the device's arena
  refused(c, "state blocks");

  // A generate stage heads its device, reads its input alone, and one per request's path.
  CHECK_THROWS_WITH_AS(StreamBuilder<Prompt>(group)
                           .stage("pre", [](Prompt p) { return p; })
                           .generate_stage<U64>("gen", toy_step, {}, 0)
                           .build(),
                       doctest::Contains("must be the first stage on its device"), Error);
  StreamGraph<Prompt> g(group);
  auto pre = g.input().stage(
      "pre", [](Prompt p) { return p; }, 0);
  auto gen = pre.generate_stage<U64>("gen", toy_step, {}, 1);
  auto side = pre.stage(
      "side", [](Prompt p) { return p.seed; }, 0);
  auto both = g.join(
      "both", [](U64 a, U64 b) { return a + b; }, 1, gen, side);
  CHECK_THROWS_WITH_AS(std::move(g).build(both), doctest::Contains("which follows generate stage"),
                       Error);
}

TEST_CASE("generate: a graph runs the nodes after it once per output") {
  DeviceGroup group(3, test::kSmall);
  StreamGraph<std::string> g(group);
  auto tokenize = g.input().stage(
      "tokenize",
      [](std::string s) {
        return Prompt{s.size(), static_cast<std::uint32_t>(s.size())};
      },
      0);
  auto gen = tokenize.generate_stage<U64>("gen", toy_step, {}, 1);
  auto detok = gen.stage(
      "detokenize", [](U64 x) { return std::to_string(x % 1000); }, 2);
  auto stream = std::move(g).build(detok);
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(std::string("abcd")).accepted());
  REQUIRE(c.push(std::string("xy")).accepted());
  stream.close();
  std::map<U64, std::vector<std::string>> got;
  std::uint32_t finals = 0;
  while (auto r = c.pop()) {
    REQUIRE(r->ok());
    CHECK(r->index == got[r->id.sequence].size());
    got[r->id.sequence].push_back(*r->value);
    finals += r->final ? 1 : 0;
  }
  REQUIRE(stream.wait().drained());
  CHECK(finals == 2);
  const auto expect = [](const Prompt& p) {
    std::vector<std::string> out;
    for (U64 x : reference(p)) out.push_back(std::to_string(x % 1000));
    return out;
  };
  CHECK(got.at(0) == expect({4, 4}));
  CHECK(got.at(1) == expect({2, 2}));
  const StreamStats st = stream.stats();
  CHECK(st.stages.at(2).calls == 6);  // detokenize ran once per output
}

TEST_SUITE_END();
