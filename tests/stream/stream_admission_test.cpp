// Admission control of served requests (bspflow/stream/stream_config.hpp's Admission):
// kReject refuses pushes beyond queue_capacity and answers every accepted one, kShed sheds
// the request with the least slack, and under a burst every push is accepted and answered,
// or refused for the policy's reason.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
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
using test::Drive;
using test::Gate;
using test::kSpan;
using test::patience;
using test::run_clients;
using test::spin_for;
using test::sum;
using test::Tally;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_admission");

TEST_CASE(
    "admission kReject: pushes beyond queue_capacity are refused, every accepted one answered") {
  DeviceGroup group(1);
  Gate gate;
  auto stream = StreamBuilder<std::string>(
                    group, StreamConfig{.hop_capacity = 1,
                                        .admission = {.policy = AdmissionPolicy::kReject,
                                                      .queue_capacity = 4,
                                                      .predict = false}})
                    .stage("echo",
                           [&gate](std::string s) {
                             if (s == "hold") gate.hold();
                             return s + "!";
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  REQUIRE(c.push("hold").accepted());
  REQUIRE(gate.wait_entered());
  std::vector<std::string> accepted;
  std::uint64_t refused = 0;
  bool untouched = true, reasons = true;
  for (int i = 0; i < 30; ++i) {
    std::string s = "req-" + std::to_string(i);
    const Submission sub = c.try_push(std::move(s));
    if (sub.accepted()) {
      accepted.push_back("req-" + std::to_string(i));
    } else {
      ++refused;
      reasons = reasons && sub.refusal == Refusal::kQueueFull;
      // NOLINTNEXTLINE(bugprone-use-after-move): a refused push leaves the value untouched
      untouched = untouched && s == "req-" + std::to_string(i);
    }
  }
  // push() refuses at once too under kReject (it blocks only under kBlock).
  const Submission blocking = c.push("one more");
  CHECK(blocking.refusal == Refusal::kQueueFull);
  CHECK(accepted.size() >= 4);  // the queue's bound, give or take what a replica has taken
  CHECK(accepted.size() <= 4 + 8);
  CHECK(refused == 30 - accepted.size());
  CHECK(reasons);
  CHECK(untouched);
  gate.open = true;
  std::vector<std::string> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) {
    CHECK(r->ok());
    if (r->ok()) got.push_back(*r->value);
  }
  REQUIRE(got.size() == 1 + accepted.size());  // nothing lost
  CHECK(got[0] == "hold!");
  for (std::size_t i = 0; i < accepted.size(); ++i) CHECK(got[i + 1] == accepted[i] + "!");
  // With room again, pushes are accepted.
  REQUIRE(c.push("after").accepted());
  auto last = c.pop_until(StreamClock::now() + patience());
  REQUIRE(last.has_value());
  CHECK(*last->value == "after!");
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.accepted == accepted.size() + 2);
  CHECK(r.answered == r.accepted);
  CHECK(r.refused == refused + 1);
  CHECK(stream.stats().refused(Refusal::kQueueFull) == refused + 1);
}

TEST_CASE("admission kShed: the request with the least slack is shed") {
  DeviceGroup group(1);
  Gate gate;
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.hop_capacity = 1,
                                             .admission = {.policy = AdmissionPolicy::kShed,
                                                           .queue_capacity = 4,
                                                           .predict = false}})
          .stage("model",
                 [&gate](U64 x) {
                   if (x == 0) gate.hold();
                   return x;
                 })
          .build();
  stream.start();
  auto c = stream.client();
  REQUIRE(c.push(0).accepted());  // no deadline: holds the stage
  REQUIRE(gate.wait_entered());
  // Deadlines far off and later with each push: each newcomer has more slack than the queued,
  // so a queued one (the earliest due) is shed and the newcomer admitted.
  const auto base = StreamClock::now() + 60s;
  constexpr U64 kPushed = 20;
  std::vector<Submission> subs;
  for (U64 i = 1; i <= kPushed; ++i) {
    subs.push_back(c.push(i, base + std::chrono::seconds(i)));
    CHECK(subs.back().accepted());
  }
  // Due before every queued one: the newcomer has the least slack and is refused.
  const Submission urgent = c.push(999, base - 30s);
  CHECK(urgent.refusal == Refusal::kShed);
  gate.open = true;
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 1 + kPushed);  // every accepted one answered
  CHECK(got[0].ok());
  std::uint64_t rejected = 0;
  bool kinds = true;
  for (U64 i = 1; i <= kPushed; ++i) {
    if (got[i].ok()) {
      kinds = kinds && *got[i].value == i;
    } else {
      ++rejected;
      kinds = kinds && got[i].kind() == ErrorKind::kRejected;
    }
  }
  CHECK(kinds);
  CHECK(rejected >= kPushed - 4 - 8);  // all but the queue's 4 (give or take a replica's take)
  for (U64 i = kPushed - 3; i <= kPushed; ++i) {
    CAPTURE(i);
    CHECK(got[i].ok());  // the 4 with the most slack were never shed
  }
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == 1 + kPushed);
  const StreamStats st = stream.stats();
  CHECK(st.errors_of(ErrorKind::kRejected) == rejected);
  CHECK(st.refused(Refusal::kShed) == 1);
}

TEST_CASE("admission under a burst: every push is accepted and answered, or refused") {
  for (const AdmissionPolicy policy : {AdmissionPolicy::kReject, AdmissionPolicy::kShed}) {
    const bool shed = policy == AdmissionPolicy::kShed;
    CAPTURE(shed);
    DeviceGroup group(1);
    auto stream =
        StreamBuilder<U64>(
            group,
            StreamConfig{.admission = {.policy = policy, .queue_capacity = 8, .predict = false}})
            .stage("model",
                   [](U64 x) {
                     spin_for(20us);
                     return x + 1;
                   })
            .build();
    stream.start();
    constexpr int kClients = 3;
    const U64 per = test::scaled(1'500, 150);
    const auto tallies = run_clients(
        stream, kClients,
        Drive{.requests = per,
              .window = 32,
              .deadline =
                  [](U64 i) {
                    return StreamClock::now() + 1s +
                           std::chrono::milliseconds(10 * static_cast<std::int64_t>(i % 7));
                  }},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [&](int k, U64 i, const Response<U64>& r) {
          if (r.ok()) return *r.value == U64(k) * kSpan + i + 1;
          return shed && r.kind() == ErrorKind::kRejected;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    check_clean(tallies);
    const Tally all = sum(tallies);
    CHECK(all.accepted + all.refused_total() == per * kClients);  // accepted or refused
    const Refusal reason = shed ? Refusal::kShed : Refusal::kQueueFull;
    CHECK(all.refused_of(reason) == all.refused_total());  // and for the policy's reason
    CHECK(all.refused_total() + all.errors_of(ErrorKind::kRejected) > 0);  // overloaded
    CHECK(r.accepted == all.accepted);
    CHECK(r.answered == all.accepted);
    CHECK(r.refused == all.refused_total());
    const StreamStats st = stream.stats();
    CHECK(st.answered == all.answered);
    CHECK(st.refused() == all.refused_total());
    CHECK(st.refused(reason) == all.refused_total());
    CHECK(st.errors_of(ErrorKind::kRejected) == all.errors_of(ErrorKind::kRejected));
  }
}

TEST_SUITE_END();
