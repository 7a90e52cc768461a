// Priority classes and outlier ejection (bspflow/stream/stream_config.hpp): the order of
// service at one queue, the minimum share of a lower class, shedding the lowest class first,
// stats by class, a replica that fails every request ejected and probed back, and the
// errors a user can make.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using U64 = std::uint64_t;
using test::eventually;
using test::Gate;
using test::LogCapture;

namespace {

// A stream of `classes` priority classes whose one stage holds request 0 at `gate`, with an
// admission queue of 4 that refuses (kReject) when full and predicts nothing.
Stream<U64, U64> held_at_zero(DeviceGroup& group, Gate& gate, std::uint32_t classes) {
  return StreamBuilder<U64>(group, StreamConfig{.admission = {.policy = AdmissionPolicy::kReject,
                                                              .queue_capacity = 4,
                                                              .predict = false},
                                                .priority_classes = classes})
      .stage("model",
             [&gate](U64 x) {
               if (x == 0) gate.hold();
               return x;
             })
      .build();
}

// A kBlock stream of two classes, an admission queue of 4, whose one stage logs each request
// and holds request 0 at `first` and request 1 at `second`: once 0 is let go, exactly one
// place frees in the full queue.
Stream<U64, U64> blocking_two_gates(DeviceGroup& group, Gate& first, Gate& second,
                                    std::shared_ptr<std::vector<U64>> order) {
  return StreamBuilder<U64>(group, StreamConfig{.admission = {.policy = AdmissionPolicy::kBlock,
                                                              .queue_capacity = 4,
                                                              .predict = false},
                                                .priority_classes = 2,
                                                .min_share = {0, 0, 0, 0}})
      .stage("model",
             [&first, &second, order](U64 x) {
               order->push_back(x);
               if (x == 0) first.hold();
               if (x == 1) second.hold();
               return x;
             })
      .build();
}

// The ejection test's request that the healthy replica holds.
constexpr U64 kPark = 1'000'000;

// Each replica's copy decides its role on its first call: the copy that takes kPark first is
// healthy and holds kPark at `gate`; the other fails every request until `healed`.
struct EjectModel {
  Gate* gate;
  std::shared_ptr<std::atomic<bool>> healed;
  enum class Role { kUnset, kHealthy, kBroken } role = Role::kUnset;
  U64 operator()(U64 x) {
    if (role == Role::kUnset) role = x == kPark ? Role::kHealthy : Role::kBroken;
    if (role == Role::kHealthy && x == kPark) gate->hold();
    if (role == Role::kBroken && !healed->load()) throw std::runtime_error("replica is broken");
    return x + 1;
  }
};

}  // namespace

TEST_SUITE_BEGIN("stream_priority");

// Regression: a blocked push of the lower class that had waited first took the place a
// blocked push of the higher class was owed.
TEST_CASE("kBlock: a freed place goes to the waiting push of the higher class") {
  DeviceGroup group(1, test::kSmall);
  Gate first, second;
  auto order = std::make_shared<std::vector<U64>>();  // device thread's; read after wait()
  auto stream = blocking_two_gates(group, first, second, order);
  auto low = stream.client(1), late_low = stream.client(1), high = stream.client(0);
  stream.start();
  REQUIRE(low.push(0));
  REQUIRE(first.wait_entered());
  for (U64 i = 1; i <= 4; ++i) REQUIRE(low.push(i));  // the queue is full: 1..4
  const auto blocked = [&](std::uint32_t c) { return stream.stats().by_class[c].blocked; };
  std::atomic<bool> low_in{false}, high_in{false};
  std::thread low_thread([&] { low_in = late_low.push(5).accepted(); });
  REQUIRE(eventually([&] { return blocked(1) == 1; }, 10s));  // the low push waits first
  std::thread high_thread([&] { high_in = high.push(100).accepted(); });
  REQUIRE(eventually([&] { return blocked(0) == 1; }, 10s));  // then the high one
  CHECK(stream.stats().blocked == 2);
  first.open = true;  // 0 ends; the stage takes 1 and holds it: exactly one place frees
  REQUIRE(eventually([&] { return low_in.load() || high_in.load(); }, 10s));
  CHECK(high_in.load());
  CHECK_FALSE(low_in.load());  // the queue is full again (2, 3, 4, 100) and 1 is held
  CHECK(blocked(0) == 0);
  CHECK(blocked(1) == 1);
  second.open = true;
  high_thread.join();
  low_thread.join();
  CHECK(low_in.load());
  CHECK(stream.stats().blocked == 0);
  while (low.pop()) {
  }
  while (late_low.pop()) {
  }
  while (high.pop()) {
  }
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(*order == std::vector<U64>{0, 1, 100, 2, 3, 4, 5});  // class 0 first, then push order
}

TEST_CASE("kBlock: blocked pushes of one class take freed places in the order they waited") {
  DeviceGroup group(1, test::kSmall);
  Gate first, second;
  auto order = std::make_shared<std::vector<U64>>();
  auto stream = blocking_two_gates(group, first, second, order);
  auto low = stream.client(1), a = stream.client(1), b = stream.client(1);
  stream.start();
  REQUIRE(low.push(0));
  REQUIRE(first.wait_entered());
  for (U64 i = 1; i <= 4; ++i) REQUIRE(low.push(i));
  const auto blocked = [&] { return stream.stats().by_class[1].blocked; };
  std::atomic<bool> a_in{false}, b_in{false};
  std::thread a_thread([&] { a_in = a.push(5).accepted(); });
  REQUIRE(eventually([&] { return blocked() == 1; }, 10s));
  std::thread b_thread([&] { b_in = b.push(6).accepted(); });
  REQUIRE(eventually([&] { return blocked() == 2; }, 10s));
  first.open = true;  // one place frees: it is the first waiter's
  REQUIRE(eventually([&] { return a_in.load() || b_in.load(); }, 10s));
  CHECK(a_in.load());
  CHECK_FALSE(b_in.load());
  second.open = true;
  a_thread.join();
  b_thread.join();
  CHECK(b_in.load());
  while (low.pop()) {
  }
  while (a.pop()) {
  }
  while (b.pop()) {
  }
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(*order == std::vector<U64>{0, 1, 2, 3, 4, 5, 6});
}

TEST_CASE(
    "kBlock: a push whose deadline passes while it waits is refused, and close ends the wait") {
  DeviceGroup group(1, test::kSmall);
  Gate first, second;
  auto order = std::make_shared<std::vector<U64>>();
  auto stream = blocking_two_gates(group, first, second, order);
  auto low = stream.client(1), timed = stream.client(1), other = stream.client(0);
  stream.start();
  REQUIRE(low.push(0));
  REQUIRE(first.wait_entered());
  for (U64 i = 1; i <= 4; ++i) REQUIRE(low.push(i));
  std::atomic<int> timed_refusal{-1}, other_refusal{-1};
  std::thread timed_thread(
      [&] { timed_refusal = static_cast<int>(timed.push_for(5, 50ms).refusal); });
  std::thread other_thread([&] { other_refusal = static_cast<int>(other.push(6).refusal); });
  // The timed push is refused once its deadline has passed (the queue stays full); the
  // other waits until close().
  REQUIRE(eventually([&] { return timed_refusal.load() >= 0; }, 10s));
  CHECK(timed_refusal.load() == static_cast<int>(Refusal::kDeadlinePassed));
  REQUIRE(eventually([&] { return stream.stats().blocked == 1; }, 10s));
  stream.close();
  other_thread.join();
  timed_thread.join();
  CHECK(other_refusal.load() == static_cast<int>(Refusal::kClosed));
  first.open = true;
  second.open = true;
  while (low.pop()) {
  }
  CHECK(stream.wait().drained());
  CHECK(stream.stats().blocked == 0);
}

TEST_CASE("one queue serves the higher class first, both classes' requests answered") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto order = std::make_shared<std::vector<U64>>();  // device thread's; read after wait()
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.priority_classes = 2, .min_share = {0, 0, 0, 0}})
          .stage("model",
                 [&gate, order](U64 x) {
                   order->push_back(x);
                   if (x == 0) gate.hold();
                   return x;
                 })
          .build();
  auto low = stream.client(1), high = stream.client(0);
  CHECK(low.priority() == 1);
  stream.start();
  REQUIRE(low.push(0));  // holds the stage
  REQUIRE(gate.wait_entered());
  for (U64 i = 1; i <= 5; ++i) REQUIRE(low.push(i));      // low: 1..5
  for (U64 i = 100; i < 103; ++i) REQUIRE(high.push(i));  // high, pushed later
  gate.open = true;
  U64 lows = 0, highs = 0;
  while (auto r = low.pop()) lows += r->ok() && r->priority == 1 ? 1 : 0;
  while (auto r = high.pop()) highs += r->ok() && r->priority == 0 ? 1 : 0;
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(lows == 6);
  CHECK(highs == 3);
  REQUIRE(order->size() == 9);
  CHECK((*order)[1] == 100);  // the high class first, then the low in push order
  CHECK((*order)[2] == 101);
  CHECK((*order)[3] == 102);
  CHECK((*order)[4] == 1);
  const StreamStats st = stream.stats();
  REQUIRE(st.by_class.size() == 2);
  CHECK(st.by_class[0].answered == 3);
  CHECK(st.by_class[1].answered == 6);
  CHECK(st.by_class[0].accepted == 3);
  CHECK(st.by_class[1].latency_ns.count() == 6);
  std::ostringstream text;
  st.write_openmetrics(text, "svc");
  CHECK(contains(text.str(), "svc_requests_total{class=\"0\"} 3\n"));
  CHECK(contains(text.str(), "svc_requests_total{class=\"1\"} 6\n"));
  CHECK(contains(text.str(), "svc_responses_total{class=\"1\",outcome=\"ok\"} 6\n"));
}

// Regression: this measured the share with two flooding threads for 300 ms, so the outcome
// depended on how the threads were scheduled. Now the queue is filled while the stage is held,
// and the order of service is the ClassPicker's alone.
TEST_CASE("a lower class keeps its minimum share while the higher one floods the queue") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto order = std::make_shared<std::vector<U64>>();  // device thread's; read after wait()
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.admission = {.policy = AdmissionPolicy::kReject,
                                                           .queue_capacity = 64,
                                                           .predict = false},
                                             .priority_classes = 2,
                                             .min_share = {0, 0.25, 0, 0}})
          .stage("model",
                 [&gate, order](U64 x) {
                   if (x == 0) gate.hold();
                   order->push_back(x);
                   return x;
                 })
          .build();
  auto high = stream.client(0), low = stream.client(1);
  stream.start();
  REQUIRE(high.push(0));  // held: everything below waits in the queue together
  REQUIRE(gate.wait_entered());
  for (U64 i = 1; i <= 40; ++i) REQUIRE(high.push(i));      // the high class floods
  for (U64 i = 1001; i <= 1020; ++i) REQUIRE(low.push(i));  // the low class: 20 requests
  gate.open = true;
  U64 highs = 0, lows = 0;
  while (auto r = high.pop()) highs += r->ok() ? 1 : 0;
  while (auto r = low.pop()) lows += r->ok() ? 1 : 0;
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(highs == 41);
  CHECK(lows == 20);
  REQUIRE(order->size() == 61);
  // While both classes wait, every fourth request served is the low class's (its minimum is a
  // quarter): never below a fifth, and the high class takes the rest.
  const auto low_in_first =
      std::count_if(order->begin() + 1, order->begin() + 41, [](U64 x) { return x > 1000; });
  CAPTURE(low_in_first);
  CHECK(low_in_first >= 8);
  CHECK(low_in_first <= 12);
}

TEST_CASE("a full queue sheds the lowest class first, and says so") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto stream = held_at_zero(group, gate, 3);
  auto low = stream.client(2), mid = stream.client(1), high = stream.client(0);
  stream.start();
  REQUIRE(low.push(0));
  REQUIRE(gate.wait_entered());
  for (U64 i = 1; i <= 4; ++i) REQUIRE(low.push(i));      // the queue is full of class 2
  CHECK(low.push(5).refusal == Refusal::kQueueFull);      // the same class: full
  for (U64 i = 0; i < 4; ++i) REQUIRE(mid.push(10 + i));  // each sheds a class 2 request
  CHECK(low.push(6).refusal == Refusal::kOutranked);      // full of a higher class now
  REQUIRE(high.push(20));                                 // sheds a class 1 request
  gate.open = true;
  U64 low_ok = 0, low_rejected = 0, mid_ok = 0, mid_rejected = 0;
  while (auto r = low.pop()) {
    if (r->ok()) {
      ++low_ok;
    } else {
      CHECK(r->kind() == ErrorKind::kRejected);
      CHECK(contains(r->error->message, "priority class 1 (higher than its 2)"));
      ++low_rejected;
    }
  }
  while (auto r = mid.pop()) {
    if (r->ok()) {
      ++mid_ok;
    } else {
      CHECK(r->id.sequence == 3);  // the class's request served last: its newest
      ++mid_rejected;
    }
  }
  auto h = high.pop();
  REQUIRE(h.has_value());
  CHECK(h->ok());
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(low_ok == 1);  // the one held in the stage
  CHECK(low_rejected == 4);
  CHECK(mid_ok == 3);
  CHECK(mid_rejected == 1);
  const StreamStats st = stream.stats();
  CHECK(st.by_class[2].refusals[static_cast<std::size_t>(Refusal::kOutranked)] == 1);
  CHECK(st.by_class[2].refusals[static_cast<std::size_t>(Refusal::kQueueFull)] == 1);
  CHECK(st.by_class[2].errors[static_cast<std::size_t>(ErrorKind::kRejected)] == 4);
}

TEST_CASE("the request shed for a higher class is the one its class would serve last") {
  DeviceGroup group(1, test::kSmall);
  Gate gate;
  auto stream = held_at_zero(group, gate, 2);
  auto low = stream.client(1), high = stream.client(0);
  stream.start();
  REQUIRE(low.push(0));
  REQUIRE(gate.wait_entered());
  // Earliest deadline first: of these, the 4 s one (sequence 3) is served last.
  const auto now = StreamClock::now();
  for (int s : {3, 1, 4, 2}) REQUIRE(low.push(U64(s), now + std::chrono::seconds(s)));
  REQUIRE(high.push(99));
  gate.open = true;
  std::vector<U64> served, shed;
  while (auto r = low.pop()) (r->ok() ? served : shed).push_back(r->id.sequence);
  CHECK(shed == std::vector<U64>{3});
  CHECK(high.pop()->ok());
  stream.close();
  CHECK(stream.wait().drained());
}

// Regression: which replica served which request was a race (the one that answered last kept
// winning the queue), so the broken one sometimes answered fewer than 3 requests. Now one
// replica holds a request at a gate, so the other takes every other request.
TEST_CASE("a replica that fails every request is ejected, then probed back once it recovers") {
  LogCapture log;  // first: outlives the stream's device threads
  DeviceGroup group(2, test::kSmall);
  Gate gate;
  auto healed = std::make_shared<std::atomic<bool>>(false);
  StreamConfig config;
  config.replicas = 2;
  config.ejection = {.consecutive_failures = 3, .base_time = 5ms, .max_time = 1s};
  config.call_stall_limit = 0ns;  // the held call is held on purpose
  auto stream = StreamBuilder<U64>(group, config).stage("model", EjectModel{&gate, healed}).build();
  auto holder = stream.client();  // its one request holds the healthy replica
  auto client = stream.client();  // the broken replica's requests, answered in its order
  stream.start();
  REQUIRE(holder.push(kPark));
  REQUIRE(gate.wait_entered());  // one replica holds kPark: the other is the only taker now
  StreamStats st = stream.stats();
  const std::uint32_t h = st.replicas[0].taken == 1 ? 0 : 1;  // healthy, held
  const std::uint32_t b = 1 - h;                              // broken
  REQUIRE(st.replicas[h].taken == 1);
  REQUIRE(st.replicas[b].taken == 0);

  // Three stage failures in a row: out of rotation for base_time.
  for (U64 i = 1; i <= 3; ++i) REQUIRE(client.push(i));
  for (U64 i = 1; i <= 3; ++i) {
    auto r = client.pop();
    REQUIRE(r.has_value());
    REQUIRE_FALSE(r->ok());
    CHECK(r->kind() == ErrorKind::kStageFailed);
  }
  // The replica's sink answers first, then ejects: wait for it.
  REQUIRE(eventually([&] { return stream.stats().replicas[b].ejected; }, 10s));
  st = stream.stats();
  CHECK(st.replicas[b].ejections == 1);
  CHECK(st.replicas[b].taken == 3);
  CHECK_FALSE(st.replicas[h].ejected);

  // Still broken: once its time out passes it takes the next request as a probe (the other
  // replica is held), fails it, and is out twice as long.
  REQUIRE(client.push(10));
  auto probe = client.pop();
  REQUIRE(probe.has_value());
  REQUIRE_FALSE(probe->ok());
  REQUIRE(eventually([&] { return stream.stats().replicas[b].ejections == 2; }, 10s));
  CHECK(stream.stats().replicas[b].ejected);

  // Healed: the next probe is answered, and the replica rejoins the rotation.
  healed->store(true);
  REQUIRE(client.push(20));
  auto healed_probe = client.pop();
  REQUIRE(healed_probe.has_value());
  REQUIRE(healed_probe->ok());
  CHECK(*healed_probe->value == 21);
  REQUIRE(eventually([&] { return !stream.stats().replicas[b].ejected; }, 10s));

  // Back in rotation: it takes a request at once.
  REQUIRE(client.push(30));
  auto again = client.pop();
  REQUIRE(again.has_value());
  REQUIRE(again->ok());
  CHECK(*again->value == 31);

  gate.open = true;  // the healthy replica answers its held request
  auto held = holder.pop();
  REQUIRE(held.has_value());
  REQUIRE(held->ok());
  CHECK(*held->value == kPark + 1);
  stream.close();
  CHECK(stream.wait().drained());

  st = stream.stats();
  CHECK(st.replicas[b].taken == 6);  // 3 failures, 2 probes, 1 in rotation again
  CHECK(st.replicas[h].taken == 1);
  CHECK(st.replicas[b].ejections == 2);
  CHECK(st.replicas[h].ejections == 0);
  CHECK_FALSE(st.replicas[b].ejected);
  std::ostringstream text;
  st.write_openmetrics(text, "svc");
  CHECK(contains(text.str(),
                 "svc_replica_ejections_total{replica=\"" + std::to_string(b) + "\"} 2\n"));
  // The back-off, from the log: base_time, then twice that after the failed probe.
  CHECK(log.has("replica " + std::to_string(b) + " answered 3 requests in a row"));
  CHECK(log.has("out of rotation for 5 ms"));
  CHECK(log.has("out of rotation for 10 ms"));
}

TEST_CASE("the last replica in rotation is never ejected") {
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<int>(group)
                    .stage("broken", [](int) -> int { throw std::runtime_error("always"); })
                    .build();
  auto client = stream.client();
  stream.start();
  for (int i = 0; i < 20; ++i) REQUIRE(client.push(i));
  int answered = 0;
  while (auto r = client.pop()) answered += r->ok() ? 0 : 1;
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(answered == 20);
  CHECK_FALSE(stream.stats().replicas[0].ejected);
}

TEST_CASE("priority and ejection settings are checked") {
  DeviceGroup group(1, test::kSmall);
  auto id = [](int x) { return x; };
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<int>(group, StreamConfig{.priority_classes = 5}).stage("a", id);
      }),
      "StreamConfig::priority_classes = 5 is not allowed: must be in 1..4"));
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(
                       group, StreamConfig{.priority_classes = 3, .min_share = {0, 0.6, 0.6, 0}})
                       .stage("a", id);
                 }),
                 "must be at most 1"));
  StreamConfig bad_time;
  bad_time.ejection.base_time = -5ms;
  CHECK(contains(error_of([&] { (void)StreamBuilder<int>(group, bad_time).stage("a", id); }),
                 "StreamConfig::ejection.base_time = -5 ms is not allowed"));
  auto stream = StreamBuilder<int>(group).stage("a", id).build();
  CHECK(contains(error_of([&] { (void)stream.client(1); }),
                 "StreamClient priority = 1 is not allowed: must be below "
                 "StreamConfig::priority_classes (1)"));
}

TEST_SUITE_END();
