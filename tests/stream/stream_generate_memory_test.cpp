// Generative serving's memory and lifecycle: the pool running out (preemption by class and
// age, the fail and reserve policies), deadlines and the first-token timeout, a swap
// mid-sequence, cancel, close and a stream's cancel, every sequence answered once and no
// block left held.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
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

TEST_SUITE_BEGIN("stream_generate_memory");

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

// The length each Prompt asks for, as a stage's length function (an API's max_tokens).
std::uint32_t prompt_length(const Prompt& p) {
  return p.length;
}

TEST_CASE("generate: a request's own length bounds its sequence and what kReserve reserves") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto most = std::make_shared<std::size_t>(0);
  auto bounds = std::make_shared<std::map<U64, std::uint32_t>>();  // seed -> max_length()
  GenerateConfig config;
  config.max_active = 8;
  config.max_length = 64;
  config.block_entries = 4;
  config.memory = 16 * 4 * sizeof(U64);  // 16 blocks: one sequence of max_length
  config.memory_policy = MemoryPolicy::kReserve;
  // A step that never ends a sequence itself: only the bound does.
  auto step = [&gate, most, bounds](std::span<Generation<Prompt, U64>> active) {
    if (*most == 0) gate.hold();
    *most = std::max(*most, active.size());
    std::vector<StepOutput<U64>> out;
    for (auto& g : active) {
      (*bounds)[g.input().seed] = g.max_length();
      g.state().push_back(g.step());
      out.push_back(StepOutput<U64>::next(g.step()));
    }
    return out;
  };
  auto stream =
      StreamBuilder<Prompt>(group).generate_stage<U64>("gen", step, config, prompt_length).build();
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(Prompt{0, 4}).accepted());
  REQUIRE(gate.wait_entered());
  for (U64 i = 1; i < 10; ++i) REQUIRE(c.push(Prompt{i, 4}).accepted());
  REQUIRE(c.push(Prompt{10, 1000}).accepted());  // clamped to max_length
  gate.open = true;
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  REQUIRE(got.by_request.size() == 11);
  for (U64 i = 0; i < 10; ++i) {
    CHECK(got.by_request.at(i).size() == 4);
    CHECK(bounds->at(i) == 4);
  }
  CHECK(got.by_request.at(10).size() == 64);
  CHECK(bounds->at(10) == 64);
  // Each short request reserves its own 4 iterations (one block), not max_length's 16:
  // eight run at once where max_length's reservation would admit one.
  CHECK(*most == 8);
  CHECK(gen_stats(stream.stats()).blocks_used == 0);
}

TEST_CASE("generate: a request that could never fit the pool is refused at push, saying why") {
  DeviceGroup group(1, test::kSmall);
  GenerateConfig config;
  config.max_length = 1024;
  config.block_entries = 16;
  config.memory = 32 * 16 * sizeof(U64);  // 32 blocks: 512 iterations at most
  auto stream = StreamBuilder<Prompt>(group)
                    .generate_stage<U64>("gen", toy_step, config, prompt_length)
                    .build();
  auto c = stream.client();
  stream.start();
  const Submission too_large = c.push(Prompt{1, 600});
  CHECK(too_large.refusal == Refusal::kTooLarge);
  CHECK(std::string(to_string(too_large.refusal)) == "too_large");
  REQUIRE(too_large.reason != nullptr);
  const std::string& why = *too_large.reason;
  CHECK(why.find("up to 600 iteration(s)") != std::string::npos);
  CHECK(why.find("38 block(s) of 16 entries") != std::string::npos);
  CHECK(why.find("whole pool of 32 block(s)") != std::string::npos);
  CHECK(why.find("device 0's arena: ") != std::string::npos);
  CHECK(why.find("'generate stage 'gen' state blocks (replica 0)'") != std::string::npos);
  // What fits is accepted, with no reason; the largest that fits runs to its end.
  const Submission fits = c.push(Prompt{2, 512});
  CHECK(fits.accepted());
  CHECK(fits.reason == nullptr);
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  REQUIRE(got.by_request.size() == 1);
  CHECK(values(got.by_request.begin()->second) == reference({2, 512}));
  const StreamStats st = stream.stats();
  CHECK(st.refused(Refusal::kTooLarge) == 1);
  std::ostringstream om;
  st.write_openmetrics(om, "g");
  CHECK(om.str().find("g_refusals_total{class=\"0\",reason=\"too_large\"} 1\n") !=
        std::string::npos);
}

TEST_CASE("generate: behind other nodes, a request that could never fit ends saying why") {
  DeviceGroup group(2, test::kSmall);
  GenerateConfig config;
  config.max_length = 1024;
  config.memory = 8 * 16 * sizeof(U64);  // 8 blocks of 16: 128 iterations at most
  int calls = 0;
  auto length = [](const Prompt& p) -> std::uint32_t {
    if (p.seed == 13) throw std::runtime_error("no length for 13");
    return p.length;
  };
  auto stream = StreamBuilder<Prompt>(group)
                    .stage("tokenize",
                           [&calls](Prompt p) {
                             ++calls;
                             return p;
                           })
                    .generate_stage<U64>("gen", toy_step, config, length)
                    .build();
  auto c = stream.client();
  stream.start();
  REQUIRE(c.push(Prompt{1, 200}).accepted());  // its value is known only after "tokenize"
  REQUIRE(c.push(Prompt{13, 4}).accepted());
  REQUIRE(c.push(Prompt{2, 128}).accepted());
  stream.close();
  const Collected got = collect(c);
  REQUIRE(stream.wait().drained());
  CHECK(calls == 3);
  const auto& big = got.by_request.at(0);
  REQUIRE(big.size() == 1);
  CHECK(big[0].kind() == ErrorKind::kStageFailed);
  CHECK(big[0].error->message.find("it could never run") != std::string::npos);
  CHECK(big[0].error->message.find("up to 200 iteration(s)") != std::string::npos);
  const auto& thrown = got.by_request.at(1);
  REQUIRE(thrown.size() == 1);
  CHECK(thrown[0].kind() == ErrorKind::kStageFailed);
  CHECK(thrown[0].error->message.find("length function failed: no length for 13") !=
        std::string::npos);
  CHECK(values(got.by_request.at(2)) == reference({2, 128}));
  CHECK(gen_stats(stream.stats(), 1).blocks_used == 0);
}

TEST_SUITE_END();
