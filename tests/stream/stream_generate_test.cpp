// Generative serving (generate_stage): one response per iteration, then a final one, per
// request; sequences join and leave the active set at iteration boundaries; each keeps its
// state in blocks of its device's arena, preempted to host memory (or failed, or reserved
// for) when the pool runs out; cancel, close and a stream's cancel answer every sequence
// once; bad configurations and steps give clear errors.
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
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "runtime_test_util.hpp"
#include "serve_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::Gate;
using U64 = std::uint64_t;

namespace {

// A request: a seed and how many outputs it wants.
struct Prompt {
  U64 seed = 0;
  std::uint32_t length = 1;
};

U64 mix(U64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

// A toy model whose output depends on the sequence's own input and state only: each
// iteration adds one entry (a hash of the seed, the step and every earlier entry) and
// outputs it, so an output is right only if the state came through whole.
std::vector<StepOutput<U64>> toy_step(std::span<Generation<Prompt, U64>> active) {
  std::vector<StepOutput<U64>> out;
  out.reserve(active.size());
  for (Generation<Prompt, U64>& g : active) {
    U64 h = mix(g.input().seed + g.step());
    for (std::size_t i = 0; i < g.state().size(); ++i) h = mix(h ^ g.state()[i]);
    g.state().push_back(h);
    const bool last = g.step() + 1 >= g.input().length;
    out.push_back(last ? StepOutput<U64>::last(h) : StepOutput<U64>::next(h));
  }
  return out;
}

// What toy_step outputs for `p` alone.
std::vector<U64> reference(const Prompt& p) {
  std::vector<U64> state, out;
  for (std::uint32_t s = 0; s < p.length; ++s) {
    U64 h = mix(p.seed + s);
    for (U64 e : state) h = mix(h ^ e);
    state.push_back(h);
    out.push_back(h);
  }
  return out;
}

// Every response of one client, grouped by request, each request's in order, checked: the
// indexes count up from 0, only the last is final.
struct Collected {
  std::map<U64, std::vector<Response<U64>>> by_request;
  std::vector<U64> order;  // request sequence numbers, in the order their responses came
};
Collected collect(StreamClient<Prompt, U64>& c) {
  Collected out;
  while (auto r = c.pop()) {
    auto& v = out.by_request[r->id.sequence];
    CHECK(r->index == v.size());
    if (!v.empty()) CHECK_FALSE(v.back().final);
    if (out.order.empty() || out.order.back() != r->id.sequence) {
      out.order.push_back(r->id.sequence);
    }
    v.push_back(std::move(*r));
  }
  for (const auto& [seq, v] : out.by_request) {
    REQUIRE_FALSE(v.empty());
    CHECK(v.back().final);
  }
  return out;
}

std::vector<U64> values(const std::vector<Response<U64>>& v) {
  std::vector<U64> out;
  for (const auto& r : v) {
    if (r.ok()) out.push_back(*r.value);
  }
  return out;
}

const GenerateStats& gen_stats(const StreamStats& s, std::size_t stage = 0) {
  REQUIRE(s.stages.at(stage).generation.has_value());
  return *s.stages.at(stage).generation;
}

}  // namespace

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

TEST_CASE("generate: when the pool runs out the youngest of the lowest class is preempted") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto sets = std::make_shared<std::vector<std::vector<U64>>>();
  StreamConfig sc;
  sc.priority_classes = 2;
  GenerateConfig config;
  config.max_active = 4;
  config.block_entries = 2;
  config.memory = 12 * sizeof(U64);  // 6 blocks: the two high sequences' 6 entries each
  auto step = [&gate, sets](std::span<Generation<Prompt, U64>> active) {
    if (sets->empty()) gate.hold();
    std::vector<U64> ids;
    for (const auto& g : active) ids.push_back(g.id().sequence + 100 * g.priority());
    sets->push_back(ids);
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group, sc).generate_stage<U64>("gen", step, config).build();
  auto high = stream.client();
  auto low = stream.client();
  low.set_priority(1);
  stream.start();
  REQUIRE(high.push(Prompt{1, 6}).accepted());  // 0: runs first, alone
  REQUIRE(gate.wait_entered());
  REQUIRE(low.push(Prompt{2, 6}).accepted());   // 100
  REQUIRE(low.push(Prompt{3, 6}).accepted());   // 101
  REQUIRE(high.push(Prompt{4, 6}).accepted());  // 1
  gate.open = true;
  stream.close();
  const Collected h = collect(high);
  const Collected l = collect(low);
  REQUIRE(stream.wait().drained());
  CHECK(values(h.by_request.at(0)) == reference({1, 6}));
  CHECK(values(h.by_request.at(1)) == reference({4, 6}));
  CHECK(values(l.by_request.at(0)) == reference({2, 6}));
  CHECK(values(l.by_request.at(1)) == reference({3, 6}));
  const StreamStats st = stream.stats();
  const GenerateStats& gs = gen_stats(st);
  CHECK(gs.preemptions >= 1);
  CHECK(gs.blocks_used == 0);
  // A preempted sequence leaves the active set and comes back. The low ones go, the youngest
  // (101) first; the high ones keep their place.
  std::map<U64, std::vector<std::size_t>> seen;
  for (std::size_t k = 0; k < sets->size(); ++k) {
    for (U64 id : (*sets)[k]) seen[id].push_back(k);
  }
  const auto gap = [&](U64 id) {
    const auto& ks = seen.at(id);
    return ks.back() - ks.front() + 1 != ks.size();
  };
  CHECK_FALSE(gap(0));
  CHECK_FALSE(gap(1));
  CHECK(gap(101));
  const auto first_out = [&](U64 id) {
    const auto& ks = seen.at(id);
    std::size_t k = 0;
    while (k + 1 < ks.size() && ks[k + 1] == ks[k] + 1) ++k;
    return k + 1 < ks.size() ? ks[k] + 1 : sets->size();
  };
  CHECK(first_out(101) <= first_out(100));
  for (U64 id : {U64{0}, U64{1}, U64{100}, U64{101}}) CHECK(seen.at(id).size() == 6);
}

TEST_CASE("generate: MemoryPolicy::kFail ends the sequence that needs a block, saying why") {
  DeviceGroup group(1, test::kSmall);
  GenerateConfig config;
  config.max_active = 2;
  config.block_entries = 2;
  config.memory = 4 * sizeof(U64);  // 2 blocks
  config.memory_policy = MemoryPolicy::kFail;
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step, config).build();
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(Prompt{1, 5}).accepted());  // needs 3 blocks: more than the pool
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  const auto& v = got.by_request.at(0);
  REQUIRE_FALSE(v.back().ok());
  CHECK(v.back().kind() == ErrorKind::kStageFailed);
  CHECK(v.back().error->message.find("ran out of state memory") != std::string::npos);
  CHECK(v.back().error->stage_name == "gen");
  std::vector<U64> four = reference({1, 5});
  four.resize(4);  // the pool holds 4 entries: the fifth iteration finds no block
  CHECK(values(v) == four);
  CHECK(gen_stats(stream.stats()).blocks_used == 0);
}

TEST_CASE("generate: MemoryPolicy::kReserve admits only what max_length fits") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto most = std::make_shared<std::size_t>(0);
  GenerateConfig config;
  config.max_active = 8;
  config.max_length = 8;
  config.block_entries = 4;
  config.memory = 3 * 8 * sizeof(U64);  // room for 3 sequences of max_length
  config.memory_policy = MemoryPolicy::kReserve;
  auto step = [&gate, most](std::span<Generation<Prompt, U64>> active) {
    if (*most == 0) gate.hold();
    *most = std::max(*most, active.size());
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config).build();
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(Prompt{0, 2}).accepted());
  REQUIRE(gate.wait_entered());
  for (U64 i = 1; i < 10; ++i) REQUIRE(c.push(Prompt{i, 2}).accepted());
  gate.open = true;
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  CHECK(got.by_request.size() == 10);
  CHECK(*most == 3);
  CHECK(gen_stats(stream.stats()).preemptions == 0);
}

TEST_CASE("generate: a deadline bounds the whole sequence, first_token_timeout the first output") {
  SUBCASE("the request's deadline ends a long sequence after the outputs it made") {
    DeviceGroup group(1, test::kSmall);
    GenerateConfig config;
    config.max_length = 1'000'000;
    config.memory = 64 * 1024;
    auto step = [](std::span<Generation<Prompt, U64>> active) {
      std::this_thread::sleep_for(100us);
      return toy_step(active);
    };
    auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config).build();
    auto c = stream.client();
    stream.start();
    REQUIRE(c.push(Prompt{3, 1'000'000}, StreamClock::now() + 5ms).accepted());
    stream.close();
    const Collected got = collect(c);  // checks the order and the one final response
    REQUIRE(stream.wait().drained());
    const auto& v = got.by_request.at(0);
    REQUIRE_FALSE(v.back().ok());
    CHECK(v.back().kind() == ErrorKind::kDeadlineExceeded);
    CHECK(v.size() < 1'000'000);
    CHECK(gen_stats(stream.stats()).blocks_used == 0);
  }
  SUBCASE("a request still waiting past first_token_timeout is answered kDeadlineExceeded") {
    DeviceGroup group(1, test::kSmall);
    Gate gate;
    GenerateConfig config;
    config.max_active = 1;
    config.first_token_timeout = 10ms;
    auto step = [&gate](std::span<Generation<Prompt, U64>> active) {
      if (active[0].input().seed == 1 && active[0].step() == 0) gate.hold();
      return toy_step(active);
    };
    auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config).build();
    auto c = stream.client();
    stream.start();
    REQUIRE(c.push(Prompt{1, 2}).accepted());
    REQUIRE(gate.wait_entered());
    REQUIRE(c.push(Prompt{2, 2}).accepted());  // waits behind it (max_active 1)
    std::this_thread::sleep_for(30ms);
    gate.open = true;
    stream.close();
    const Collected got = collect(c);
    REQUIRE(stream.wait().drained());
    REQUIRE(got.by_request.size() == 2);
    const auto& late = got.by_request.at(1);
    REQUIRE(late.size() == 1);
    CHECK(late[0].kind() == ErrorKind::kDeadlineExceeded);
    CHECK(late[0].error->message.find("first_token_timeout") != std::string::npos);
  }
}

TEST_CASE("generate: a swap lets running sequences finish on the version they started on") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  GenerateConfig config;
  config.max_active = 4;
  auto v1 = [&gate](std::span<Generation<Prompt, U64>> active) {
    for (const auto& g : active) {
      if (g.input().seed == 1 && g.step() == 1) gate.hold();  // A's second iteration
    }
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", v1, config).build();
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(Prompt{1, 4}).accepted());  // A: started on version 1
  REQUIRE(gate.wait_entered());
  // Version 2 adds a mark to every output. The swap waits until A, on version 1, is done.
  auto v2 = [](std::span<Generation<Prompt, U64>> active) {
    auto out = toy_step(active);
    for (auto& o : out) o.value() += 1;
    return out;
  };
  SwapResult swapped;
  std::thread swapper([&] { swapped = stream.swap("gen", v2, std::vector<Prompt>{}); });
  REQUIRE(test::eventually([&] { return stream.stats().stages.at(0).versions.size() == 2; }));
  REQUIRE(c.push(Prompt{2, 3}).accepted());  // B: starts on version 2
  gate.open = true;
  swapper.join();
  CHECK(swapped.swapped);
  CHECK(swapped.version == 2);
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  const auto& a = got.by_request.at(0);
  const auto& b = got.by_request.at(1);
  CHECK(values(a) == reference({1, 4}));
  for (const auto& r : a) CHECK(r.version == 1);
  std::vector<U64> marked = reference({2, 3});
  for (U64& x : marked) x += 1;
  CHECK(values(b) == marked);
  for (const auto& r : b) CHECK(r.version == 2);
  // A step of another shape is refused, naming the stage.
  auto other = [](std::span<Generation<Prompt, std::uint32_t>> active) {
    std::vector<StepOutput<U64>> out;
    for (std::size_t i = 0; i < active.size(); ++i) out.push_back(StepOutput<U64>::last(0));
    return out;
  };
  CHECK_THROWS_WITH_AS(stream.swap("gen", other, std::vector<Prompt>{}),
                       doctest::Contains("not a generate stage with this state entry"), Error);
}

TEST_CASE("generate: a sequence cancelled mid-way ends at the next iteration, its blocks freed") {
  DeviceGroup group(1, test::kSmall);
  GenerateConfig config;
  config.max_length = 1'000'000;
  config.memory = 64 * 1024;
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step, config).build();
  auto c = stream.client();
  stream.start();
  const Submission s = c.push(Prompt{5, 1'000'000});
  REQUIRE(s.accepted());
  std::uint32_t partials = 0;
  std::optional<Response<U64>> last;
  while (auto r = c.pop()) {
    CHECK(r->index == partials);
    if (r->final) {
      last = std::move(r);
      break;
    }
    if (++partials == 3) CHECK(c.cancel(s.id));
  }
  REQUIRE(last.has_value());
  CHECK(last->kind() == ErrorKind::kCancelled);
  CHECK(partials >= 3);
  stream.close();
  REQUIRE(stream.wait().drained());
  CHECK(gen_stats(stream.stats()).blocks_used == 0);
}

TEST_CASE("generate: close() lets every active sequence finish") {
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", toy_step).build();
  auto c = stream.client();
  stream.start();
  for (U64 i = 0; i < 5; ++i) REQUIRE(c.push(Prompt{i, 40}).accepted());
  stream.close();
  const Collected got = collect(c);
  const StreamResult result = stream.wait();
  CHECK(result.drained());
  CHECK(result.answered == 5);
  for (U64 i = 0; i < 5; ++i) CHECK(values(got.by_request.at(i)) == reference({i, 40}));
}

TEST_CASE("generate: Stream::cancel() answers every sequence once") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  GenerateConfig config;
  config.max_active = 2;
  auto step = [&gate](std::span<Generation<Prompt, U64>> active) {
    gate.hold();
    return toy_step(active);
  };
  auto stream = StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config).build();
  auto c = stream.client();
  stream.start();
  for (U64 i = 0; i < 5; ++i) REQUIRE(c.push(Prompt{i, 100}).accepted());
  REQUIRE(gate.wait_entered());
  stream.cancel();
  gate.open = true;
  const StreamResult result = stream.wait();
  CHECK(result.status == RunStatus::kCancelled);
  const Collected got = collect(c);
  CHECK(got.by_request.size() == 5);
  for (const auto& [seq, v] : got.by_request) {
    CHECK_FALSE(v.back().ok());
    CHECK(v.back().kind() == ErrorKind::kCancelled);
  }
  CHECK(gen_stats(stream.stats()).blocks_used == 0);
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
