// Helpers shared by the generate stage's tests (stream_generate_test.cpp,
// stream_generate_memory_test.cpp): a toy model whose outputs depend on each sequence's own
// input and state only (toy_step, reference), and a client's responses grouped by request and
// checked for order (collect).
#pragma once

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

namespace test::gen {

using namespace bspflow;
using U64 = std::uint64_t;

// A request: a seed and how many outputs it wants.
struct Prompt {
  U64 seed = 0;
  std::uint32_t length = 1;
};

inline U64 mix(U64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

// A toy model whose output depends on the sequence's own input and state only: each
// iteration adds one entry (a hash of the seed, the step and every earlier entry) and
// outputs it, so an output is right only if the state came through whole.
inline std::vector<StepOutput<U64>> toy_step(std::span<Generation<Prompt, U64>> active) {
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
inline std::vector<U64> reference(const Prompt& p) {
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
inline Collected collect(StreamClient<Prompt, U64>& c) {
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

inline std::vector<U64> values(const std::vector<Response<U64>>& v) {
  std::vector<U64> out;
  for (const auto& r : v) {
    if (r.ok()) out.push_back(*r.value);
  }
  return out;
}

inline const GenerateStats& gen_stats(const StreamStats& s, std::size_t stage = 0) {
  REQUIRE(s.stages.at(stage).generation.has_value());
  return *s.stages.at(stage).generation;
}

}  // namespace test::gen
