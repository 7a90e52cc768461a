// The soak suite's graph part (see soak_test.cpp): seeded graph trials through StreamClients
// (fan-out and routes, priority classes, swaps under load), with their own test case at the
// end of this file. What they share with the serving trials (soak_serving.cpp) is in
// soak_serve.hpp.
#include "soak_serve.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
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

  const End end = static_cast<End>(rng.in(0, 2));
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 4));
  const U64 per_client = rng.in(10, 400);
  const U64 due_every = rng.in(0, 4);
  const U64 due_us = rng.in(0, 3000);
  const U64 cancel_every = rng.in(0, 7);
  const std::size_t window = rng.in(1, 64);
  const ClientLoad load{.per_client = per_client,
                        .window = window,
                        .due_every = due_every,
                        .due_us = due_us,
                        .cancel_every = cancel_every};
  const auto end_after = micros(rng, 4000);
  const auto swap_after = micros(rng, 3000);
  std::vector<std::uint64_t> seeds(clients);
  for (auto& s : seeds) s = rng.in(0, ~U64{0});
  // kStageFailed only for a value the left branch fails on, and only through the left branch.
  const auto stage_fails = [poisoned, through_left](U64 x) {
    return poisoned(x + 1) && through_left(x);
  };

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
      trial_client(handles[k], k, seeds[k], load, cfg, end, expected, stage_fails, tallies[k]);
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

// The graph trials sit here rather than in soak_test.cpp: they need nothing of the other
// subsystems' files.
TEST_SUITE_BEGIN("soak");

TEST_CASE("seeded graph trials: fan-out, routes, priority classes, swaps under load") {
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;
  soak::graph_trials();
}

TEST_SUITE_END();
