// runtime/: streams (bspflow/stream/stream.hpp): drain on close answers everything (1, 2
// and 4 devices, 4 on 2 cores), a lone request is answered at once, typed stages sharing a
// device, per-request errors, fail-fast, cancel, per-producer order and exactly-once under
// load with several producers, wait strategies, and the errors a user can make.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
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

// The next response, or nullopt if none arrives within `limit` (a held response fails the
// test instead of hanging it).
template <class T>
std::optional<OutfeedEntry<Response<T>>> next_within(OutfeedQueue<Response<T>>& out,
                                                     std::chrono::milliseconds limit = 5000ms) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto e = out.try_pop()) return e;
    std::this_thread::yield();
  }
  return std::nullopt;
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

TEST_CASE("closing the infeed drains: every accepted request is answered (1, 2, 4 devices)") {
  // The last round says one client thread each side: both feeds are rings, the outfeed a
  // small bounded one the last device keeps waiting on.
  for (const auto& [devices, one_each_side] :
       {std::pair{1u, false}, std::pair{2u, false}, std::pair{4u, false}, std::pair{2u, true}}) {
    CAPTURE(devices);
    CAPTURE(one_each_side);
    DeviceGroup group(devices);  // 4 devices on this machine's 2 cores share them
    auto stream = add_ones(group, devices == 1 ? 2 : 4);
    InfeedConfig in_config;
    OutfeedConfig out_config;
    if (one_each_side) {
      in_config.producer_type = ProducerType::kSingle;
      out_config.consumer_type = ConsumerType::kSingle;
      out_config.capacity = 8;
    }
    InfeedQueue<Request<std::uint64_t>> in(in_config);
    OutfeedQueue<Response<std::uint64_t>> out(out_config);
    stream.start(in, out);
    const std::uint64_t n = test::scaled(20'000, 100);
    std::thread client([&] {
      RequestProducer<std::uint64_t> p(in);
      for (std::uint64_t i = 0; i < n; ++i) p.push(i);
      in.close();  // right after the last push: most requests are still in flight
    });
    std::uint64_t got = 0, next = 0;
    bool in_order = true, right = true;
    for (auto& e : out) {
      in_order = in_order && e.value.id.sequence == next++;
      right =
          right && e.value.ok() && *e.value.value == e.value.id.sequence + (devices == 1 ? 2 : 4);
      ++got;
    }
    client.join();
    const StreamResult r = stream.wait();
    CHECK(r.status == StreamStatus::kDrained);
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
    InfeedQueue<Request<std::uint64_t>> in;
    OutfeedQueue<Response<std::uint64_t>> out;
    stream.start(in, out);
    RequestProducer<std::uint64_t> p(in);
    for (std::uint64_t i = 0; i < 20; ++i) {  // closed loop: one request in flight at a time
      const auto id = p.push(i * 10);
      REQUIRE(id.has_value());
      auto e = next_within(out);
      REQUIRE(e.has_value());
      CHECK(e->value.id == *id);
      CHECK(*e->value.value == i * 10 + 4);
    }
    in.close();
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
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<std::size_t>> out;
  stream.start(in, out);
  RequestProducer<int> p(in);
  p.push(7);
  p.push(1234);
  in.close();
  std::vector<std::size_t> sizes;
  for (auto& e : out) sizes.push_back(*e.value.value);
  CHECK(sizes == std::vector<std::size_t>{2, 8});
  CHECK(stream.wait().answered == 2);
}

TEST_CASE("a stage may be a move-only callable with state of its own") {
  DeviceGroup group(1);
  auto counter = std::make_unique<int>(0);
  auto stream = StreamBuilder<int>(group)
                    .stage("count", [c = std::move(counter)](int x) { return x + ++*c; })
                    .build();
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> out;
  RequestProducer<int> p(in);
  for (int i = 0; i < 3; ++i) p.push(100);
  in.close();
  CHECK(stream.run(in, out).answered == 3);
  std::vector<int> got;
  for (auto& e : out) got.push_back(*e.value.value);
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
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> out;
  stream.start(in, out);
  RequestProducer<int> p(in);
  for (int i = 1; i <= 8; ++i) p.push(i);
  in.close();
  std::map<std::uint64_t, Response<int>> by_seq;
  for (auto& e : out) by_seq[e.value.id.sequence] = e.value;
  const StreamResult r = stream.wait();
  CHECK(r.status == StreamStatus::kDrained);
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
      CHECK(resp.error->message ==
            "stage 'check' (0) on device 0 failed on request 3 of producer " +
                std::to_string(p.id()) + ": malformed request");
      CHECK_THROWS_AS(std::rethrow_exception(resp.error->cause), std::invalid_argument);
    } else {
      REQUIRE(resp.ok());
      CHECK(*resp.value == i * i);
    }
  }
}

TEST_CASE("fail-fast stops at the first exception and accounts for every request") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<int>(group, StreamConfig{.on_error = OnError::kFailFast})
                    .stage("a", [](int x) { return x; })
                    .stage("b",
                           [](int x) {
                             if (x == 50) throw std::runtime_error("boom");
                             return x;
                           })
                    .build();
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> out;
  stream.start(in, out);
  RequestProducer<int> p(in);
  for (int i = 0; i < 200; ++i) p.push(i);
  in.close();
  std::uint64_t got = 0;
  for (auto& e : out) {
    CHECK(e.value.ok());
    CHECK(*e.value.value < 50);
    ++got;
  }
  const StreamResult r = stream.wait();
  CHECK(r.status == StreamStatus::kFailed);
  REQUIRE(r.failure != nullptr);
  CHECK(r.failure->stage_name == "b");
  CHECK(r.failure->id.sequence == 50);
  CHECK(r.answered == got);
  CHECK(got <= 50);
  CHECK(r.accepted == r.answered + r.unanswered);
  CHECK(r.unanswered >= 1);  // at least the failing request itself
  CHECK(contains(r.message, "failed: "));
  CHECK(contains(r.message, "boom"));
}

TEST_CASE("cancel stops at once, says how many were left unanswered, and the stream runs again") {
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
  {
    InfeedQueue<Request<int>> in;
    OutfeedQueue<Response<int>> out;
    stream.start(in, out);
    RequestProducer<int> p(in);
    for (int i = 0; i < 100; ++i) p.push(i);
    while (!out.try_pop()) std::this_thread::yield();  // it is running
    stream.cancel();
    const StreamResult r = stream.wait();
    CHECK(r.status == StreamStatus::kCancelled);
    CHECK(r.accepted == r.answered + r.unanswered);
    CHECK(r.answered < 100);
    CHECK(contains(r.message, "cancelled: "));
  }
  slow = false;
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> out;
  RequestProducer<int> p(in);
  for (int i = 0; i < 10; ++i) p.push(i);
  in.close();
  const StreamResult r = stream.run(in, out);
  CHECK(r.drained());
  CHECK(r.answered == 10);
}

TEST_CASE("a std::stop_token stops a stream's run: before start() it takes nothing") {
  // Issue 30: a Stream took no stop token, and cancel() reached only a run whose start() had
  // got far enough (it read the run's state unlocked while start() assigned it).
  DeviceGroup group(2, test::kSmall);
  auto stream = StreamBuilder<int>(group)
                    .stage("inc", [](int x) { return x + 1; })
                    .stage("double", [](int x) { return 2 * x; })
                    .build();
  std::stop_source stopped;
  stopped.request_stop();
  {  // The infeed path: every request stays in the lane.
    InfeedQueue<Request<int>> in;
    OutfeedQueue<Response<int>> out;
    RequestProducer<int> p(in);
    for (int i = 0; i < 5; ++i) REQUIRE(p.push(i));
    const StreamResult r = stream.run(in, out, stopped.get_token());
    CHECK(r.status == StreamStatus::kCancelled);
    CHECK(r.accepted == 0);
    CHECK(r.answered == 0);
    CHECK(in.size_approx(0) == 5);
    CHECK(out.drain().empty());
    in.close();
    std::stop_source unused;
    const StreamResult next = stream.run(in, out, unused.get_token());
    CHECK(next.drained());
    CHECK(next.answered == 5);
  }
  {  // Clients: what they push is answered kCancelled, not run.
    stream.start(stopped.get_token());
    auto client = stream.client();
    std::uint64_t cancelled = 0;
    for (int i = 0; i < 3; ++i) {
      if (client.push(i)) ++cancelled;  // may be refused (kClosed) once the stop is seen
    }
    const StreamResult r = stream.wait();
    CHECK(r.status == StreamStatus::kCancelled);
    std::uint64_t seen = 0;
    while (auto resp = client.try_pop()) {
      REQUIRE_FALSE(resp->ok());
      CHECK(resp->kind() == ErrorKind::kCancelled);
      ++seen;
    }
    CHECK(seen == cancelled);
  }
  {  // During: a std::jthread's destructor stops a run that waits for requests.
    InfeedQueue<Request<int>> in;  // never closed
    OutfeedQueue<Response<int>> out;
    std::optional<StreamResult> during;
    test::Rescue guard(10s, [&] { in.close(); });  // a lost stop: drained below
    {
      std::jthread host([&](std::stop_token stop) { during = stream.run(in, out, stop); });
      RequestProducer<int> p(in);
      REQUIRE(p.push(1));
      while (!out.try_pop()) std::this_thread::yield();  // it is serving
    }
    CHECK_FALSE(guard.fired());
    REQUIRE(during.has_value());
    CHECK(during->status == StreamStatus::kCancelled);
  }
  // cancel() between runs does nothing; the stream serves again.
  stream.cancel();
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> out;
  RequestProducer<int> p(in);
  REQUIRE(p.push(1));
  in.close();
  CHECK(stream.run(in, out).drained());
}

TEST_CASE("a result counts the error responses delivered, not those a cancel dropped") {
  // Issue 30: StreamResult::errors counted an error response when it was written, so one that
  // a cancel then dropped (a one-reader outfeed full up to its spare room) still counted:
  // errors > answered. Every request here fails (an error response), nobody reads the
  // outfeed (a ring of 31 with 33 spare slots), and each run is cancelled once it is writing
  // a response: the ring fills over the runs, then a run's response is dropped.
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<int>(group)
                    .stage("fails", [](int) -> int { throw std::runtime_error("no"); })
                    .build();
  for (const bool clients : {false, true}) {
    CAPTURE(clients);
    InfeedQueue<Request<int>> in(InfeedConfig{1, 1024, 1});
    OutfeedQueue<Response<int>> out(OutfeedConfig{1, OutputMode::all(), 31, ConsumerType::kSingle});
    if (!clients) {
      RequestProducer<int> p(in);
      for (int i = 0; i < 1000; ++i) REQUIRE(p.push(i));
    }
    std::uint64_t written = 0, dropped = 0;
    for (int run = 0; run < 100 && dropped == 0; ++run) {
      CAPTURE(run);
      const std::uint64_t before = stream.stats().answered;
      std::optional<StreamClient<int, int>> client;
      if (clients) {
        stream.start(out);
        client.emplace(stream.client());
        for (int i = 0; i < 4; ++i) (void)client->push(i);
      } else {
        stream.start(in, out);
      }
      {
        test::Rescue guard(10s, [&] { stream.cancel(); });
        while (stream.stats().answered == before) std::this_thread::yield();  // it is writing
        CHECK_FALSE(guard.fired());
      }
      stream.cancel();
      const StreamResult r = stream.wait();
      // Every response is an error: those counted are those that reached the outfeed.
      CHECK(r.errors == r.answered);
      const std::uint64_t made = stream.stats().answered - before;
      written += made;
      if (r.answered < made) dropped += made - r.answered;
    }
    CHECK(dropped > 0);  // the ring's spare room filled up: the test reached the drop
    CHECK(out.drain().size() == written - dropped);
  }
}

TEST_CASE("several producers under load: exactly once, in each producer's order") {
  DeviceGroup group(4);  // 4 devices on 2 cores
  for (const WaitPolicy& wait : {WaitPolicy{}, WaitPolicy::park(), WaitPolicy::busy_spin()}) {
    CAPTURE(to_string(wait.strategy));
    auto stream = add_ones(group, 4, StreamConfig{.capacity = 8, .wait = wait});
    InfeedQueue<Request<std::uint64_t>> in(InfeedConfig{.capacity = 64});
    OutfeedQueue<Response<std::uint64_t>> out(OutfeedConfig{.capacity = 128});
    stream.start(in, out);
    const std::uint64_t per = test::scaled(20'000, 200);
    constexpr int kProducers = 3;
    std::vector<std::uint32_t> ids(kProducers);
    std::vector<std::thread> producers;
    std::atomic<int> done{0};
    for (int k = 0; k < kProducers; ++k) {
      producers.emplace_back([&, k] {
        RequestProducer<std::uint64_t> p(in);
        ids[static_cast<std::size_t>(k)] = p.id();
        for (std::uint64_t i = 0; i < per; ++i) p.push(std::uint64_t(k) * 1'000'000'000 + i);
        if (done.fetch_add(1) + 1 == kProducers) in.close();
      });
    }
    std::map<std::uint32_t, std::uint64_t> next;
    bool ordered = true, right = true;
    std::uint64_t got = 0;
    for (auto& e : out) {
      const RequestId id = e.value.id;
      ordered = ordered && id.sequence == next[id.producer]++;
      right = right && e.value.ok() && *e.value.value % 1'000'000'000 == id.sequence + 4;
      ++got;
    }
    for (auto& t : producers) t.join();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    CHECK(got == per * kProducers);
    CHECK(r.answered == got);
    CHECK(ordered);
    CHECK(right);
    for (std::uint32_t id : ids) CHECK(next[id] == per);
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
  InfeedQueue<Request<std::uint64_t>> in;
  OutfeedQueue<Response<std::uint64_t>> out;
  stream.start(in, out);
  RequestProducer<std::uint64_t> p(in);
  for (std::uint64_t i = 0; i < 100; ++i) {
    p.push(i);
    auto e = next_within(out);
    REQUIRE(e.has_value());
    CHECK(*e->value.value == i + 2);
  }
  in.close();
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
        (void)StreamBuilder<int>(group, StreamConfig{.capacity = 0}).stage("a", id).build();
      }),
      "StreamConfig::capacity = 0 is not allowed: must be in 1.."));
  CHECK(contains(error_of([&] {
                   (void)StreamBuilder<int>(group, StreamConfig{.device_wait = {WaitPolicy{}}})
                       .stage("a", id)
                       .build();
                 }),
                 "StreamConfig::device_wait size = 1 is not allowed"));
  auto stream = StreamBuilder<int>(group).stage("a", id).build();
  InfeedQueue<Request<int>> two_lanes(InfeedConfig{.replicas = 2});
  OutfeedQueue<Response<int>> out;
  CHECK(contains(error_of([&] { stream.start(two_lanes, out); }),
                 "stream infeed replicas = 2 is not allowed: a stream reads one lane"));
  InfeedQueue<Request<int>> in;
  OutfeedQueue<Response<int>> final_out(OutfeedConfig{.mode = OutputMode::final()});
  CHECK(contains(error_of([&] { stream.start(in, final_out); }),
                 "stream outfeed: needs one replica and OutputMode::all()"));
  // A failed start leaves the stream and the feeds usable.
  in.close();
  CHECK(stream.run(in, out).drained());
}

TEST_SUITE_END();
