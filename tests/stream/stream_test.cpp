// Streams (bspflow/stream/stream.hpp): close drains and answers everything (1, 2 and 4
// devices, 4 on 2 cores), a lone request is answered at once, typed stages sharing a device,
// per-request errors, fail-fast, cancel and stop tokens, per-client order and exactly-once
// under load with several clients, wait strategies, and the errors a user can make.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <stop_token>
#include <string>
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

namespace {

// The client's next response, or nullopt if none arrives within `limit` (a held response
// fails the test instead of hanging it).
template <class In, class Out>
std::optional<Response<Out>> pop_within(StreamClient<In, Out>& client,
                                        std::chrono::milliseconds limit = 5000ms) {
  return client.pop_until(StreamClock::now() + limit);
}

// A stream of `stages` stages each adding 1, stage s on device s % devices.
Stream<std::uint64_t, std::uint64_t> add_ones(DeviceList devices, std::uint32_t stages,
                                              StreamConfig config = {}) {
  auto b = StreamBuilder<std::uint64_t>(devices, std::move(config));
  auto plus = [](std::uint64_t x) { return x + 1; };
  if (stages == 1) return std::move(b).stage("s0", plus, 0).build();
  const std::uint32_t n = devices.size();
  auto b2 =
      std::move(b).stage("s0", plus, 0).stage("s1", plus, 1 % n == 0 ? 0 : std::min(1u, n - 1));
  if (stages == 2) return std::move(b2).build();
  return std::move(b2)
      .stage("s2", plus, std::min(2u, n - 1))
      .stage("s3", plus, std::min(3u, n - 1))
      .build();
}

}  // namespace

TEST_SUITE_BEGIN("stream");

TEST_CASE("close drains: every accepted request is answered (1, 2, 4 devices)") {
  for (const std::uint32_t devices : {1u, 2u, 4u}) {
    CAPTURE(devices);
    DeviceGroup group(devices);  // 4 devices on this machine's 2 cores share them
    const std::uint64_t add = devices == 1 ? 2 : 4;
    auto stream = add_ones(group, devices == 1 ? 2 : 4);
    auto client = stream.client();
    stream.start();
    const std::uint64_t n = test::scaled(20'000, 100);
    std::uint64_t got = 0, next = 0;
    bool in_order = true, right = true;
    auto take = [&](const Response<std::uint64_t>& r) {
      in_order = in_order && r.id.sequence == next++;
      right = right && r.ok() && *r.value == r.id.sequence + add;
      ++got;
    };
    for (std::uint64_t i = 0; i < n; ++i) {
      for (Submission s = client.push(i); !s; s = client.push(i)) {
        REQUIRE(s.refusal == Refusal::kClientFull);  // its response slots are full: pop first
        if (auto r = client.pop()) take(*r);
      }
      while (auto r = client.try_pop()) take(*r);
    }
    stream.close();  // right after the last push: most requests are still in flight
    while (auto r = client.pop()) take(*r);
    const StreamResult r = stream.wait();
    CHECK(r.status == RunStatus::kCompleted);
    CHECK(r.accepted == n);
    CHECK(r.answered == n);
    CHECK(r.unanswered == 0);
    CHECK(r.errors == 0);
    CHECK(got == n);
    CHECK(in_order);
    CHECK(right);
    CHECK(contains(r.message, "drained: " + std::to_string(n) + " request(s) accepted"));
  }
}

TEST_CASE("a lone request is answered at once, with no later traffic") {
  DeviceGroup group(2);
  for (const WaitPolicy& wait : {WaitPolicy{}, WaitPolicy::park()}) {
    auto stream = add_ones(group, 4, StreamConfig{.wait = wait});
    auto client = stream.client();
    stream.start();
    for (std::uint64_t i = 0; i < 20; ++i) {  // closed loop: one request in flight at a time
      const Submission s = client.push(i * 10);
      REQUIRE(s.accepted());
      auto r = pop_within(client);
      REQUIRE(r.has_value());
      CHECK(r->id == s.id);
      CHECK(*r->value == i * 10 + 4);
    }
    stream.close();
    CHECK(stream.wait().drained());
  }
}

TEST_CASE("typed stages change the type; consecutive stages share a device") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<int>(group)
                    .stage("to_string", [](int x) { return std::to_string(x); })
                    .stage(
                        "twice", [](std::string s) { return s + s; }, 0)
                    .stage("length", [](const std::string& s) { return s.size(); })
                    .build();
  CHECK(stream.stages() == 3);
  CHECK(stream.device_of(0) == 0);
  CHECK(stream.device_of(1) == 0);
  CHECK(stream.device_of(2) == 1);
  CHECK(stream.stage_name(2) == "length");
  CHECK(stream.wait_policy_of(0).strategy == WaitStrategy::kSpinThenPark);
  auto client = stream.client();
  stream.start();
  client.push(7);
  client.push(1234);
  stream.close();
  std::vector<std::size_t> sizes;
  while (auto r = client.pop()) sizes.push_back(*r->value);
  CHECK(sizes == std::vector<std::size_t>{2, 8});
  CHECK(stream.wait().answered == 2);
}

TEST_CASE("a stage may be a move-only callable with state of its own") {
  DeviceGroup group(1);
  auto counter = std::make_unique<int>(0);
  auto stream = StreamBuilder<int>(group)
                    .stage("count", [c = std::move(counter)](int x) { return x + ++*c; })
                    .build();
  auto client = stream.client();
  stream.start();
  for (int i = 0; i < 3; ++i) REQUIRE(client.push(100));
  stream.close();
  std::vector<int> got;
  while (auto r = client.pop()) got.push_back(*r->value);
  CHECK(stream.wait().answered == 3);
  CHECK(got == std::vector<int>{101, 102, 103});
}

TEST_CASE("a failing request gets an error response and the stream goes on") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<int>(group)
                    .stage("check",
                           [](int x) {
                             if (x == 4) throw std::invalid_argument("malformed request");
                             return x;
                           })
                    .stage("square", [](int x) { return x * x; })
                    .build();
  auto client = stream.client();
  stream.start();
  for (int i = 1; i <= 8; ++i) REQUIRE(client.push(i));
  stream.close();
  std::map<std::uint64_t, Response<int>> by_seq;
  while (auto r = client.pop()) by_seq[r->id.sequence] = *r;
  const StreamResult r = stream.wait();
  CHECK(r.status == RunStatus::kCompleted);
  CHECK(r.answered == 8);
  CHECK(r.errors == 1);
  REQUIRE(by_seq.size() == 8);
  for (int i = 1; i <= 8; ++i) {
    const Response<int>& resp = by_seq[static_cast<std::uint64_t>(i - 1)];
    if (i == 4) {
      REQUIRE_FALSE(resp.ok());
      CHECK(resp.error->stage == 0);
      CHECK(resp.error->stage_name == "check");
      CHECK(resp.error->device == group[0].id());
      CHECK(resp.error->id.sequence == 3);
      CHECK(resp.error->message == "stage 'check' (0) on device 0 failed on request 3 of client " +
                                       std::to_string(client.id()) + ": malformed request");
      CHECK_THROWS_AS(std::rethrow_exception(resp.error->cause), std::invalid_argument);
    } else {
      REQUIRE(resp.ok());
      CHECK(*resp.value == i * i);
    }
  }
}

TEST_CASE("fail-fast stops at the first exception and answers every request") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<int>(group, StreamConfig{.on_error = OnError::kFailFast})
                    .stage("a", [](int x) { return x; })
                    .stage("b",
                           [](int x) {
                             if (x == 50) throw std::runtime_error("boom");
                             return x;
                           })
                    .build();
  auto client = stream.client();
  stream.start();
  std::uint64_t accepted = 0;
  for (int i = 0; i < 200; ++i) accepted += client.push(i).accepted() ? 1 : 0;
  std::uint64_t ok = 0, failed = 0, cancelled = 0;
  while (auto r = client.pop()) {
    if (r->ok()) {
      CHECK(*r->value < 50);
      ++ok;
    } else if (r->kind() == ErrorKind::kStageFailed) {
      CHECK(r->error->stage_name == "b");
      ++failed;
    } else {
      CHECK(r->kind() == ErrorKind::kCancelled);
      ++cancelled;
    }
  }
  const StreamResult r = stream.wait();
  CHECK(r.status == RunStatus::kFailed);
  REQUIRE(r.failure != nullptr);
  CHECK(r.failure->stage_name == "b");
  CHECK(r.failure->id.sequence == 50);
  CHECK(failed == 1);
  CHECK(ok <= 50);
  CHECK(ok + failed + cancelled == accepted);  // every accepted request is answered once
  CHECK(r.accepted == accepted);
  CHECK(r.answered == accepted);
  CHECK(r.unanswered == 0);
  CHECK(contains(r.message, "failed: "));
  CHECK(contains(r.message, "boom"));
  // A failed run ends admission.
  CHECK(client.push(1).refusal == Refusal::kClosed);
}

TEST_CASE("cancel stops at once, answers the rest kCancelled, and the stream runs again") {
  DeviceGroup group(2);
  std::atomic<bool> slow{true};
  auto stream = StreamBuilder<int>(group)
                    .stage("a", [](int x) { return x; })
                    .stage("slow",
                           [&](int x) {
                             if (slow.load()) std::this_thread::sleep_for(1ms);
                             return x;
                           })
                    .build();
  auto client = stream.client();
  {
    stream.start();
    for (int i = 0; i < 100; ++i) REQUIRE(client.push(i));
    auto first = pop_within(client);  // it is running
    REQUIRE(first.has_value());
    stream.cancel();
    // Pushes after cancel() are refused: admission has ended.
    CHECK(client.push(1000).refusal == Refusal::kClosed);
    const StreamResult r = stream.wait();
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.accepted == 100);
    CHECK(r.answered == 100);
    CHECK(r.unanswered == 0);
    CHECK(contains(r.message, "cancelled: "));
    std::uint64_t values = 1, cancelled = 0;
    while (auto resp = client.try_pop()) {
      if (resp->ok()) {
        ++values;
      } else {
        CHECK(resp->kind() == ErrorKind::kCancelled);
        ++cancelled;
      }
    }
    CHECK(values + cancelled == 100);
    CHECK(cancelled > 0);
  }
  slow = false;
  stream.start();
  for (int i = 0; i < 10; ++i) REQUIRE(client.push(i));
  stream.close();
  std::uint64_t got = 0;
  while (auto resp = client.pop()) got += resp->ok() ? 1 : 0;
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == 10);
  CHECK(got == 10);
}

TEST_CASE("a std::stop_token stops a stream's run, before start() or during it") {
  DeviceGroup group(2, test::kSmall);
  auto stream = StreamBuilder<int>(group)
                    .stage("inc", [](int x) { return x + 1; })
                    .stage("double", [](int x) { return 2 * x; })
                    .build();
  auto client = stream.client();
  {  // Stopped before start(): what is pushed is answered kCancelled, never run.
    std::stop_source stopped;
    stopped.request_stop();
    stream.start(stopped.get_token());
    std::uint64_t accepted = 0;
    for (int i = 0; i < 3; ++i) {
      if (client.push(i)) ++accepted;  // refused (kClosed) once the stop is seen
    }
    const StreamResult r = stream.wait();
    CHECK(r.status == RunStatus::kCancelled);
    std::uint64_t seen = 0;
    while (auto resp = client.try_pop()) {
      REQUIRE_FALSE(resp->ok());
      CHECK(resp->kind() == ErrorKind::kCancelled);
      ++seen;
    }
    CHECK(seen == accepted);
  }
  {  // During: a std::jthread's destructor stops a run that waits for requests.
    std::optional<StreamResult> during;
    test::Rescue guard(10s, [&] { stream.close(); });  // a lost stop: drained instead
    {
      std::jthread host([&](std::stop_token stop) {
        stream.start(stop);
        during = stream.wait();
      });
      while (!client.push(1)) std::this_thread::yield();  // refused until it has started
      REQUIRE(pop_within(client).has_value());            // it is serving
    }
    CHECK_FALSE(guard.fired());
    REQUIRE(during.has_value());
    CHECK(during->status == RunStatus::kCancelled);
  }
  // cancel() between runs does nothing; the stream serves again.
  stream.cancel();
  stream.start();
  REQUIRE(client.push(1));
  stream.close();
  REQUIRE(client.pop().has_value());
  CHECK(stream.wait().drained());
}

TEST_CASE("several clients under load: exactly once, in each client's order") {
  DeviceGroup group(4);  // 4 devices on 2 cores
  for (const WaitPolicy& wait : {WaitPolicy{}, WaitPolicy::park(), WaitPolicy::busy_spin()}) {
    CAPTURE(to_string(wait.strategy));
    auto stream = add_ones(group, 4, StreamConfig{.hop_capacity = 8, .wait = wait});
    stream.start();
    const std::uint64_t per = test::scaled(20'000, 200);
    constexpr int kClients = 3;
    std::vector<std::thread> clients;
    std::atomic<std::uint64_t> got{0}, bad{0};
    for (int k = 0; k < kClients; ++k) {
      clients.emplace_back([&, k, client = stream.client()]() mutable {
        std::uint64_t next = 0, mine = 0, wrong = 0;
        auto take = [&](const Response<std::uint64_t>& r) {
          if (r.id.sequence != next++ || r.id.client != client.id() || !r.ok() ||
              *r.value % 1'000'000'000 != r.id.sequence + 4) {
            ++wrong;
          }
          ++mine;
        };
        for (std::uint64_t i = 0; i < per; ++i) {
          while (!client.push(std::uint64_t(k) * 1'000'000'000 + i)) {
            if (auto r = client.pop()) take(*r);  // the client's slots are full: pop first
          }
          while (auto r = client.try_pop()) take(*r);
        }
        while (auto r = client.pop()) take(*r);
        got += mine;
        bad += wrong + (mine == per ? 0 : 1);
      });
    }
    for (auto& t : clients) t.join();
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    CHECK(got.load() == per * kClients);
    CHECK(r.answered == got.load());
    CHECK(bad.load() == 0);
  }
}

TEST_CASE("devices keep off reserved host cores and still serve") {
  DeviceConfig config;
  config.host_cores = {0};
  DeviceGroup group(2, config);
  if (Topology::get().cores() >= 2 && Topology::get().has_hwloc()) {
    for (auto& d : group) CHECK(*d->placement().core != 0);
    CHECK(group[0].placement().shares_core());  // on 2 cores both devices share core 1
  }
  auto stream = add_ones(group, 2, StreamConfig{.wait = WaitPolicy::busy_spin()});
  if (group[0].placement().shares_core()) {  // busy-spin is capped beside another thread
    CHECK(stream.wait_policy_of(0).strategy == WaitStrategy::kSpinThenPark);
    // ... which yields, unless the other device's stages were fused onto this one's thread
    // (then nothing else of the stream runs on the core, and waits spin tight, bounded).
    const bool fused = stream.device_of(1) != 0 && group[0].placement().core &&
                       group[1].placement().core &&
                       *group[0].placement().core == *group[1].placement().core &&
                       !group[0].placement().shares_host && group[0].placement().sharing == 2;
    CHECK(stream.wait_policy_of(0).yields == !fused);
  }
  auto client = stream.client();
  stream.start();
  for (std::uint64_t i = 0; i < 100; ++i) {
    REQUIRE(client.push(i));
    auto r = pop_within(client);
    REQUIRE(r.has_value());
    CHECK(*r->value == i + 2);
  }
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("stream errors name the problem") {
  DeviceGroup group(2);
  auto id = [](int x) { return x; };
  CHECK(error_of([&] { (void)StreamBuilder<int>(group).build(); }) ==
        "StreamBuilder::build: a stream needs at least one stage");
  CHECK(contains(error_of([&] { (void)StreamBuilder<int>(group).stage("a", id, 2); }),
                 "stage 'a' device = 2 is not allowed: must be below the stream's 2 device(s)"));
  CHECK(contains(
      error_of([&] { (void)StreamBuilder<int>(group).stage("a", id, 1).stage("b", id, 0); }),
      "stage 'b' on device 0 comes after stage 'a' on device 1"));
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<int>(group, StreamConfig{.hop_capacity = 0}).stage("a", id).build();
      }),
      "StreamConfig::hop_capacity = 0 is not allowed: must be in 1.."));
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(group, StreamConfig{.device_wait = {WaitPolicy{}}})
                       .stage("a", id)
                       .build();
                 }),
                 "StreamConfig::device_wait size = 1 is not allowed"));
  // Durations and counts are printed as given, with their sign and unit.
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(group, StreamConfig{.call_stall_limit = -1us})
                       .stage("a", id)
                       .build();
                 }),
                 "StreamConfig::call_stall_limit = -1 us is not allowed: must be in 0 ns..24 h"));
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(group).batch_stage(
                       "b",
                       [](std::span<int> xs) { return std::vector<int>(xs.begin(), xs.end()); },
                       BatchConfig{.max_delay = -1us});
                 }),
                 "BatchConfig::max_delay = -1 us is not allowed"));
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(group, StreamConfig{.replicas = 3}).stage("a", id);
                 }),
                 "StreamConfig::replicas = 3 is not allowed: must divide the stream's 2"));
  // A second start while running is refused; the run goes on.
  auto stream = StreamBuilder<int>(group).stage("a", id).build();
  auto client = stream.client();
  CHECK(client.push(1).refusal == Refusal::kClosed);  // not started: nothing is queued
  stream.start();
  CHECK(contains(error_of([&] { stream.start(); }), "Stream::start: a run is in progress"));
  REQUIRE(client.push(2));
  stream.close();
  REQUIRE(client.pop().has_value());
  CHECK(stream.wait().drained());
}

TEST_CASE("destroying a Stream while 4 clients push in a tight loop (50 rounds)") {
  // Clients may outlive their Stream: a push racing the destructor is either accepted (then
  // answered kCancelled) or refused, and never touches the Stream once it is gone.
  for (int round = 0; round < 50; ++round) {
    CAPTURE(round);
    DeviceGroup group(1, test::kSmall);
    std::vector<StreamClient<int, int>> clients;
    std::atomic<bool> go{false}, stop{false};
    std::vector<std::thread> threads;
    std::atomic<std::uint64_t> refused_closed{0}, accepted{0};
    {
      auto stream = StreamBuilder<int>(group).stage("inc", [](int x) { return x + 1; }).build();
      for (int k = 0; k < 4; ++k) clients.push_back(stream.client());
      stream.start();
      for (int k = 0; k < 4; ++k) {
        threads.emplace_back([&, k] {
          while (!go.load()) std::this_thread::yield();
          auto& c = clients[static_cast<std::size_t>(k)];
          while (!stop.load()) {
            const Submission s = c.try_push(int(k));
            if (s.accepted()) {
              ++accepted;
            } else if (s.refusal == Refusal::kClosed) {
              ++refused_closed;
            }
            while (c.try_pop()) {
            }
          }
        });
      }
      go = true;
      std::this_thread::sleep_for(std::chrono::microseconds(200 + 50 * round));
    }  // ~Stream() while the clients push
    std::this_thread::sleep_for(1ms);
    stop = true;
    for (auto& th : threads) th.join();
    CHECK(refused_closed.load() > 0);  // pushes after the Stream went away are refused
  }
}

TEST_CASE("a batch stage's first estimates err towards lateness") {
  // One size measured (batches of 2 costing 4 ms each): a lone request is estimated at the
  // whole 4 ms (the cost could all be fixed), a larger batch proportionally more.
  detail::BatchCostModel fixed(8);
  for (int i = 0; i < 4; ++i) fixed.add(2, 4e6);
  CHECK(fixed.estimate(2) == doctest::Approx(4e6));
  CHECK(fixed.estimate(1) >= 4e6);
  CHECK(fixed.estimate(4) >= 8e6);
  // Two sizes measured on a + b*n (1 ms + 0.5 ms per item): the line is learnt.
  detail::BatchCostModel line(8);
  for (int i = 0; i < 20; ++i) {
    line.add(2, 1e6 + 2 * 0.5e6);
    line.add(6, 1e6 + 6 * 0.5e6);
  }
  CHECK(line.estimate(1) == doctest::Approx(1.5e6).epsilon(0.05));
  CHECK(line.estimate(4) == doctest::Approx(3e6).epsilon(0.05));
  CHECK(line.estimate(8) == doctest::Approx(5e6).epsilon(0.05));
}

TEST_CASE("a request that cannot make its deadline is not run, from the first estimates") {
  // A stage whose every call takes 4 ms, measured only on batches of 2: a lone request with
  // 2.9 ms left is answered kDeadlineExceeded without running.
  DeviceGroup group(1, test::kSmall);
  std::atomic<int> lone_ran{0};
  auto stream = StreamBuilder<int>(group, StreamConfig{.admission = {.predict = false}})
                    .batch_stage(
                        "model",
                        [&](std::span<int> xs) {
                          if (xs.size() == 1 && xs[0] == -1) ++lone_ran;
                          std::this_thread::sleep_for(4ms);
                          return std::vector<int>(xs.begin(), xs.end());
                        },
                        BatchConfig{.max_batch = 2, .max_delay = 50ms})
                    .build();
  auto client = stream.client();
  stream.start();
  for (int i = 0; i < 6; ++i) REQUIRE(client.push(i));  // batches of 2: the measured size
  for (int i = 0; i < 6; ++i) REQUIRE(client.pop().has_value());
  const Submission lone = client.push(-1, StreamClock::now() + 2900us);
  REQUIRE(lone.accepted());
  auto r = client.pop();
  REQUIRE(r.has_value());
  REQUIRE_FALSE(r->ok());
  CHECK(r->kind() == ErrorKind::kDeadlineExceeded);
  CHECK(lone_ran.load() == 0);
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("StreamConfig::from takes the replicas of a run's Options") {
  CHECK(StreamConfig::from(Options().replicas(2)).replicas == 2);
  CHECK(StreamConfig::from(Options()).hop_capacity == StreamConfig{}.hop_capacity);
}

TEST_SUITE_END();
