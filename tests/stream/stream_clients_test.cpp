// A Stream's clients (bspflow/stream/stream_client.hpp): per-client responses with 4 client
// threads, in push order or in any order, each exactly once; a client's waits (set_wait(),
// and no spinning on a device's core); and short-lived clients coming and going while their
// answers are being delivered.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/devices/topology.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_clean;
using test::Drive;
using test::kSpan;
using test::patience;
using test::run_clients;
using test::Tally;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_clients");

TEST_CASE("per-client responses: 4 client threads, each its own, exactly once") {
  DeviceGroup group(2);
  for (const Ordering ordering : {Ordering::kPerClient, Ordering::kNone}) {
    const bool ordered = ordering == Ordering::kPerClient;
    CAPTURE(ordered);
    auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2, .ordering = ordering})
                      .stage("model", [](U64 x) { return x * 3 + 1; })
                      .build();
    stream.start();
    constexpr int kClients = 4;
    const U64 per = test::scaled(5'000, 500);
    // kNone: any order (unknown == 0 still says exactly once).
    const auto tallies = run_clients(
        stream, kClients, Drive{.requests = per, .ordered = ordered, .window = 64},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [](int k, U64 i, const Response<U64>& r) {
          return r.ok() && *r.value == (U64(k) * kSpan + i) * 3 + 1;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    check_clean(tallies);
    U64 accepted = 0;
    for (const Tally& t : tallies) {
      // The only refusal allowed: kClientFull, when a request held up on one replica (its
      // device descheduled on a loaded machine) keeps response_capacity sequence numbers
      // unanswered while the other replica answers the rest.
      CHECK(t.refused_total() == t.refused_of(Refusal::kClientFull));
      CHECK(t.ok == t.accepted);
      CHECK(t.accepted + t.refused_total() == per);
      accepted += t.accepted;
    }
    CHECK(r.answered == accepted);
  }
}

TEST_CASE("a client's waits: set_wait(), and no spinning on a device's core") {
  DeviceGroup devices(1);
  Stream<U64, U64> s = StreamBuilder<U64>(devices).stage("id", [](U64 v) { return v; }).build();
  s.start();
  {
    auto c = s.client();
    CHECK_THROWS_AS(c.set_wait(WaitPolicy{WaitStrategy::kSpinThenPark, -1ns}), Error);
    c.set_wait(WaitPolicy::park());
    CHECK(c.wait_policy().strategy == WaitStrategy::kPark);
    REQUIRE(c.push(7));
    auto r = c.pop_until(StreamClock::now() + patience());
    REQUIRE(r.has_value());
    CHECK(*r->value == 7);
  }
  const auto& core = devices[0].placement().core;
  if (core && Topology::get().has_hwloc()) {
    // A client thread pinned to the device's core yields and parks soon; one on another core
    // (or unpinned) keeps the default.
    std::thread([&] {
      REQUIRE(Topology::get().pin_current_thread(*core));
      CHECK(Topology::get().current_thread_core() == *core);
      auto c = s.client();
      const WaitPolicy w = c.wait_policy();
      CHECK(w.yields);
      CHECK(w.spin_budget() <= tunables::kSharedCoreSpinBudget);
      REQUIRE(c.push(8));
      auto r = c.pop();
      REQUIRE(r.has_value());
      CHECK(*r->value == 8);
    }).join();
  }
  {
    auto c = s.client();
    if (!Topology::get().current_thread_core() || Topology::get().current_thread_core() != core) {
      CHECK_FALSE(c.wait_policy().yields);
    }
  }
  s.close();
  CHECK(s.wait().drained());
}

TEST_CASE("clients come and go while their answers are being delivered") {
  // Each short-lived client's ring is freed by the stream once its last deliverer has let go
  // (regression: it was freed when the last response was counted, before the deliverer woke
  // the client, so a new client() could free memory a device thread was still touching; the
  // sanitizer builds see it). One stream answers singly, the other in batches.
  for (const bool batched : {false, true}) {
    CAPTURE(batched);
    DeviceGroup devices(1);
    Stream<U64, U64> s =
        batched ? StreamBuilder<U64>(devices)
                      .batch_stage(
                          "model",
                          [](std::span<U64> xs) {
                            std::vector<ItemResult<U64>> out;
                            for (U64 x : xs) out.push_back(x + 1);
                            return out;
                          },
                          BatchConfig{.max_batch = 4, .max_delay = 100us})
                      .build()
                : StreamBuilder<U64>(devices).stage("model", [](U64 x) { return x + 1; }).build();
    s.start();
    std::atomic<int> answered{0};
    constexpr int kThreads = 2, kClients = 60, kEach = 3;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int k = 0; k < kClients; ++k) {
          auto c = s.client();
          for (int i = 0; i < kEach; ++i) REQUIRE(c.push(static_cast<U64>(t * 1000 + i)));
          for (int i = 0; i < kEach; ++i) {
            auto r = c.pop_until(StreamClock::now() + patience());
            if (r && r->ok() && *r->value == static_cast<U64>(t * 1000 + i + 1)) ++answered;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    s.close();
    const StreamResult r = s.wait();
    CHECK(r.drained());
    CHECK(answered.load() == kThreads * kClients * kEach);
  }
}

TEST_SUITE_END();
