// Serving with replicas (bspflow/stream/stream_config.hpp's replicas): replicas answering
// exactly once and in each client's order (2 devices, and 2-stage chains on 4), a replica
// whose stage throws while the other serves, and a replica whose call is held reported as
// stalled while the other keeps answering.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "runtime_test_util.hpp"
#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_clean;
using test::contains;
using test::Drive;
using test::eventually;
using test::Gate;
using test::kSpan;
using test::patience;
using test::plus1;
using test::run_clients;
using test::sum;
using test::Tally;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_replicas");

TEST_CASE("replicas: exactly once and in each client's order, 3 clients (2 and 4 devices)") {
  // 10^5 requests here, seconds at most on 2 cores; the soak suite sends 10^6.
  constexpr int kClients = 3;
  const U64 per = test::scaled(100'000, 3'000) / kClients;
  for (const std::uint32_t devices : {2u, 4u}) {
    CAPTURE(devices);
    DeviceGroup group(devices);  // 4: two 2-stage replicas, 4 devices on 2 cores
    auto builder = StreamBuilder<U64>(group, StreamConfig{.replicas = 2});
    auto stream = devices == 2
                      ? std::move(builder).stage("a", plus1).build()
                      : std::move(builder).stage("a", plus1, 0).stage("b", plus1, 1).build();
    const U64 stages = devices == 2 ? 1 : 2;
    CHECK(stream.stages() == stages);
    stream.start();
    const auto tallies = run_clients(
        stream, kClients, Drive{.requests = per, .window = 256},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [&](int k, U64 i, const Response<U64>& r) {
          return r.ok() && *r.value == U64(k) * kSpan + i + stages;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    CHECK(r.accepted == per * kClients);
    CHECK(r.answered == per * kClients);
    CHECK(r.unanswered == 0);
    CHECK(r.errors == 0);
    CHECK(r.refused == 0);
    check_clean(tallies);
    for (const Tally& t : tallies) {
      CHECK(t.accepted == per);
      CHECK(t.ok == per);
    }
    const StreamStats st = stream.stats();
    REQUIRE(st.replicas.size() == 2);
    CHECK(st.replicas[0].taken + st.replicas[1].taken == per * kClients);
    CHECK(st.replicas[0].taken > 0);  // both serve
    CHECK(st.replicas[1].taken > 0);
    CHECK(st.replicas[0].answered + st.replicas[1].answered == per * kClients);
  }
}

TEST_CASE("replicas: a replica whose stage throws answers with errors while the other serves") {
  DeviceGroup group(2);
  // Each replica has its own copy of the stage; the first copy called throws on every request.
  auto claims = std::make_shared<std::atomic<int>>(0);
  auto flaky = [claims, me = -1](U64 x) mutable -> U64 {
    if (me < 0) me = claims->fetch_add(1);
    if (me == 0) throw std::runtime_error("replica broken");
    return x + 1;
  };
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.replicas = 2}).stage("flaky", flaky).build();
  stream.start();
  constexpr int kClients = 3;
  const U64 per = test::scaled(3'000, 300);
  std::atomic<U64> bad_errors{0};
  const auto tallies = run_clients(
      stream, kClients, Drive{.requests = per, .window = 32},
      [](int k, U64 i) { return U64(k) * kSpan + i; },
      [&](int k, U64 i, const Response<U64>& r) {
        if (r.ok()) return *r.value == U64(k) * kSpan + i + 1;
        const bool right = r.kind() == ErrorKind::kStageFailed && r.error->stage_name == "flaky" &&
                           contains(r.error->message, "replica broken");
        if (!right) ++bad_errors;
        return right;
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == per * kClients);
  check_clean(tallies);
  const Tally all = sum(tallies);
  CHECK(all.accepted == per * kClients);
  CHECK(all.ok + all.errors_of(ErrorKind::kStageFailed) == all.answered);
  CHECK(all.ok > 0);                                  // the good replica served
  CHECK(all.errors_of(ErrorKind::kStageFailed) > 0);  // and the broken one was used
  CHECK(bad_errors.load() == 0);
  CHECK(r.errors == all.errors_of(ErrorKind::kStageFailed));
  CHECK(claims->load() == 2);  // two copies ran
}

TEST_CASE("stall detection: a held call is reported; the other replica keeps answering") {
  DeviceGroup group(2);
  Gate gate;
  constexpr U64 kHold = 1'000'000;
  auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2, .call_stall_limit = 50ms})
                    .stage("model",
                           [&gate](U64 x) {
                             if (x == kHold) gate.hold();
                             return x + 1;
                           })
                    .build();
  stream.start();
  auto a = stream.client();
  auto b = stream.client();
  const auto held_at = StreamClock::now();
  REQUIRE(a.push(kHold).accepted());
  REQUIRE(gate.wait_entered());
  // The replica holding it is marked stalled once the call outlives the limit.
  std::optional<std::size_t> stalled;
  CHECK(eventually([&] {
    const StreamStats st = stream.stats();
    for (std::size_t i = 0; i < st.replicas.size(); ++i) {
      if (st.replicas[i].stalled) stalled = i;
    }
    return stalled.has_value();
  }));
  REQUIRE(stalled.has_value());
  const U64 taken_when_stalled = stream.stats().replicas.at(*stalled).taken;
  CHECK(taken_when_stalled == 1);
  // Meanwhile another client is answered by the other replica, closed loop.
  U64 answered = 0;
  for (U64 i = 0; i < 50; ++i) {
    if (!b.push(i).accepted()) break;
    auto r = b.pop_until(StreamClock::now() + 2s);
    if (!r || !r->ok() || *r->value != i + 1) break;
    ++answered;
  }
  CHECK(answered == 50);
  CHECK(stream.stats().replicas.at(*stalled).taken == taken_when_stalled);  // nothing new for it
  // Hold ~300 ms in all, then let it go: it is answered and the replica moves again.
  std::this_thread::sleep_until(held_at + 300ms);
  gate.open = true;
  auto held = a.pop_until(StreamClock::now() + patience());
  REQUIRE(held.has_value());
  CHECK(held->ok());
  CHECK(eventually([&] { return !stream.stats().replicas.at(*stalled).stalled; }));
  stream.close();
  CHECK(stream.wait().drained());
  const StreamStats st = stream.stats();
  REQUIRE(st.stages.size() == 1);
  CHECK(st.stages[0].stalls >= 1);
  CHECK(st.answered == 51);
}

TEST_SUITE_END();
