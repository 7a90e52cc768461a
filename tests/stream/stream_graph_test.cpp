// Stream graphs (bspflow/stream/stream_graph.hpp): exactly once and in each client's order
// through a fan-out and a join, a branch that throws, routing, a cancel and a deadline that
// reach every branch, close with work in every branch, a join's own service time, and the
// errors the builder refuses.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
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
using U64 = std::uint64_t;

namespace {

struct Pair {
  U64 a = 0, b = 0;
};

// pre (+1) on device 0, fanning out to a (x2) on device 1 and b (x3) on device 2, joined on
// device 3 as a + b: x -> 2(x+1) + 3(x+1) = 5(x+1).
Stream<U64, U64> diamond(DeviceList devices, StreamConfig config = {},
                         std::function<void(U64)> in_a = {}, std::function<void(U64)> in_b = {}) {
  StreamGraph<U64> g(devices, std::move(config));
  auto pre = g.input().stage(
      "pre", [](U64 x) { return x + 1; }, 0);
  auto a = pre.stage(
      "a",
      [in_a](U64 x) {
        if (in_a) in_a(x);
        return 2 * x;
      },
      1);
  auto b = pre.stage(
      "b",
      [in_b](U64 x) {
        if (in_b) in_b(x);
        return 3 * x;
      },
      2);
  auto sum = g.join(
      "sum", [](U64 x, U64 y) { return x + y; }, 3, a, b);
  return std::move(g).build(sum);
}

}  // namespace

TEST_SUITE_BEGIN("stream_graph");

TEST_CASE("a fan-out and a join: exactly once, in each client's order, 3 clients") {
  DeviceGroup group(4, test::kSmall);  // 4 devices on this machine's 2 cores
  auto stream = diamond(group);
  CHECK(stream.stages() == 4);
  stream.start();
  const U64 per = test::scaled(1'000'000 / 3, 300);
  std::atomic<U64> answered{0}, bad{0};
  std::vector<std::thread> clients;
  for (int k = 0; k < 3; ++k) {
    clients.emplace_back([&, k, client = stream.client()]() mutable {
      U64 next = 0, mine = 0, wrong = 0;
      auto take = [&](const Response<U64>& r) {
        const U64 x = U64(k) * 1'000'000'000 + r.id.sequence;
        if (r.id.sequence != next++ || !r.ok() || *r.value != 5 * (x + 1)) ++wrong;
        ++mine;
      };
      for (U64 i = 0; i < per; ++i) {
        while (!client.push(U64(k) * 1'000'000'000 + i)) {
          if (auto r = client.pop()) take(*r);
        }
        while (auto r = client.try_pop()) take(*r);
      }
      while (auto r = client.pop()) take(*r);
      answered += mine;
      bad += wrong + (mine == per ? 0 : 1);
    });
  }
  for (auto& t : clients) t.join();
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(bad.load() == 0);
  CHECK(answered.load() == 3 * per);
  CHECK(r.answered == 3 * per);
  CHECK(r.unanswered == 0);
  const StreamStats st = stream.stats();
  REQUIRE(st.stages.size() == 4);
  for (const StageStats& s : st.stages) CHECK(s.calls == 3 * per);  // every node ran each
}

TEST_CASE("a branch that throws: the request is answered with its error, naming the branch") {
  DeviceGroup group(4, test::kSmall);
  std::atomic<U64> b_ran_on_7{0};
  auto stream = diamond(
      group, {},
      [](U64 x) {
        if (x == 8) throw std::runtime_error("branch a refuses 7");  // pre made it 8
      },
      [&](U64 x) {
        if (x == 8) ++b_ran_on_7;
      });
  auto client = stream.client();
  stream.start();
  for (U64 i = 0; i < 20; ++i) REQUIRE(client.push(i));
  stream.close();
  U64 ok = 0;
  while (auto r = client.pop()) {
    if (r->id.sequence == 7) {
      REQUIRE_FALSE(r->ok());
      CHECK(r->kind() == ErrorKind::kStageFailed);
      CHECK(r->error->stage_name == "a");
      CHECK(contains(r->error->message, "branch a refuses 7"));
    } else {
      CHECK(r->ok());
      ++ok;
    }
  }
  CHECK(ok == 19);
  const StreamResult res = stream.wait();
  CHECK(res.drained());
  CHECK(res.errors == 1);
  CHECK(b_ran_on_7.load() <= 1);  // b ran it at most once (it may have started before a failed)
}

TEST_CASE("routing: a cascade answers the easy requests early and the rest on the large model") {
  DeviceGroup group(3, test::kSmall);
  std::atomic<U64> large_calls{0};
  StreamGraph<U64> g(group);
  auto small = g.input().stage(
      "small", [](U64 x) { return x; }, 0);
  auto [easy, hard] = small.route<2>("confident", [](const U64& x) { return x % 3 == 0 ? 0 : 1; });
  auto accept = easy.stage("accept", [](U64 x) { return std::to_string(x) + " small"; });
  auto large = hard.stage(
      "large",
      [&](U64 x) {
        ++large_calls;
        return std::to_string(x) + " large";
      },
      1);
  auto answer = g.merge("answer", 2, accept, large);
  auto stream = std::move(g).build(answer);
  auto client = stream.client();
  stream.start();
  const U64 n = 300;
  for (U64 i = 0; i < n; ++i) REQUIRE(client.push(i));
  stream.close();
  U64 easy_n = 0, hard_n = 0, next = 0;
  while (auto r = client.pop()) {
    REQUIRE(r->ok());
    CHECK(r->id.sequence == next++);
    const U64 x = r->id.sequence;
    if (x % 3 == 0) {
      CHECK(*r->value == std::to_string(x) + " small");
      ++easy_n;
    } else {
      CHECK(*r->value == std::to_string(x) + " large");
      ++hard_n;
    }
  }
  CHECK(easy_n == n / 3);
  CHECK(hard_n == n - n / 3);
  CHECK(large_calls.load() == hard_n);  // the large model never ran an easy request
  CHECK(stream.wait().drained());
}

TEST_CASE("a route's chooser that throws or picks no branch answers that request with an error") {
  DeviceGroup group(1, test::kSmall);
  StreamGraph<int> g(group);
  auto [a, b] = g.input().route<2>("pick", [](const int& x) -> std::size_t {
    if (x == 1) throw std::invalid_argument("no branch for 1");
    return x == 2 ? 7 : static_cast<std::size_t>(x % 2);
  });
  auto out = g.merge("out", 0, a.stage("even", [](int x) { return x; }),
                     b.stage("odd", [](int x) { return -x; }));
  auto stream = std::move(g).build(out);
  auto client = stream.client();
  stream.start();
  for (int i = 0; i < 4; ++i) REQUIRE(client.push(i));
  stream.close();
  std::vector<Response<int>> got;
  while (auto r = client.pop()) got.push_back(std::move(*r));
  REQUIRE(got.size() == 4);
  CHECK(*got[0].value == 0);
  CHECK(contains(got[1].error->message, "no branch for 1"));
  CHECK(contains(got[2].error->message, "route 'pick' chose branch 7 of 2"));
  CHECK(*got[3].value == -3);
  CHECK(stream.wait().drained());
}

TEST_CASE("a cancel and a deadline reach every branch (20 rounds)") {
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    DeviceGroup group(4, test::kSmall);
    std::atomic<U64> slow_runs{0};
    auto stream = diamond(
        group, {}, [&](U64) { std::this_thread::sleep_for(200us); },
        [&](U64) {
          ++slow_runs;
          std::this_thread::sleep_for(200us);
        });
    auto client = stream.client();
    stream.start();
    // A deadline too near for the branches: expired at a stage boundary on each branch.
    const Submission expired = client.push(1, StreamClock::now() + 50us);
    const U64 n = 30;
    std::vector<Submission> sent;
    for (U64 i = 0; i < n; ++i) sent.push_back(client.push(i));
    REQUIRE(client.cancel(sent[n / 2].id));  // one cancelled by its client
    stream.cancel();                         // the rest by the stream
    U64 answered = 0;
    bool all_known = true;
    while (auto r = client.pop()) {
      ++answered;
      if (r->id == sent[n / 2].id) all_known = all_known && !r->ok();
      if (expired.accepted() && r->id == expired.id && !r->ok()) {
        all_known = all_known && (r->kind() == ErrorKind::kDeadlineExceeded ||
                                  r->kind() == ErrorKind::kCancelled);
      }
    }
    const StreamResult res = stream.wait();
    CHECK(all_known);
    CHECK(res.status == RunStatus::kCancelled);
    CHECK(answered == res.accepted);  // every accepted request answered exactly once
    CHECK(res.unanswered == 0);
    CHECK(slow_runs.load() <= res.accepted);
  }
}

TEST_CASE("close drains every branch with work in each (20 rounds)") {
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    DeviceGroup group(4, test::kSmall);
    auto stream = diamond(
        group, StreamConfig{.hop_capacity = 4}, [](U64) { std::this_thread::sleep_for(20us); },
        [](U64) { std::this_thread::sleep_for(50us); });
    auto client = stream.client();
    stream.start();
    const U64 n = 64;
    for (U64 i = 0; i < n; ++i) REQUIRE(client.push(i));
    stream.close();  // work queued, between devices and in every branch
    U64 ok = 0;
    while (auto r = client.pop()) ok += r->ok() && *r->value == 5 * (r->id.sequence + 1) ? 1 : 0;
    const StreamResult res = stream.wait();
    CHECK(res.drained());
    CHECK(ok == n);
    CHECK(res.answered == n);
  }
}

TEST_CASE("nodes on one core run on one thread; a graph on one device runs without hand-offs") {
  DeviceGroup one(1, test::kSmall);
  StreamGraph<int> g(one);
  auto x = g.input().stage("x", [](int v) { return v + 1; });
  auto y = x.stage("y", [](int v) { return v * 10; });
  auto z = x.stage("z", [](int v) { return v * 100; });
  auto out = g.join(
      "out", [](int a, int b) { return a + b; }, 0, y, z);
  auto stream = std::move(g).build(out);
  auto client = stream.client();
  stream.start();
  for (int i = 0; i < 10; ++i) REQUIRE(client.push(i));
  stream.close();
  int next = 0;
  while (auto r = client.pop()) {
    CHECK(*r->value == (next + 1) * 110);
    ++next;
  }
  CHECK(next == 10);
  const StreamStats st = stream.stats();
  for (const auto& rep : st.replicas) CHECK(rep.ring_depths.empty());  // no hop at all
  CHECK(stream.wait().drained());
}

TEST_CASE("a join's service time is its own call, not the wait for its slowest branch") {
  DeviceGroup group(4, test::kSmall);
  // b holds each request 2 ms; the join on a's device waits for it, then adds.
  auto stream = diamond(group, {}, {}, [](U64) { std::this_thread::sleep_for(2ms); });
  auto client = stream.client();
  stream.start();
  for (U64 i = 0; i < 20; ++i) REQUIRE(client.push(i));
  stream.close();
  while (auto r = client.pop()) REQUIRE(r->ok());
  CHECK(stream.wait().drained());
  const StreamStats st = stream.stats();
  REQUIRE(st.stages.size() == 4);
  CHECK(st.stages[2].name == "b");
  CHECK(st.stages[2].service_ns.value_at_percentile(50) >= 2'000'000);
  CHECK(st.stages[3].name == "sum");
  CHECK(st.stages[3].service_ns.value_at_percentile(50) < 1'000'000);  // an addition
}

TEST_CASE("the builder refuses a bad graph, naming the node") {
  DeviceGroup group(2, test::kSmall);
  auto id = [](int v) { return v; };
  {  // A branch that reaches no output.
    StreamGraph<int> g(group);
    auto a = g.input().stage("a", id);
    (void)a.stage("dangling", id, 1);
    auto out = a.stage("out", id);
    CHECK(contains(error_of([&] { (void)std::move(g).build(out); }),
                   "stage 'dangling' reaches no output"));
  }
  {  // A join of two branches of one route: a request reaches only one of them.
    StreamGraph<int> g(group);
    auto [p, q] = g.input().route<2>("r", [](const int& v) { return v % 2; });
    auto pa = p.stage("pa", id), qa = q.stage("qa", id);
    auto j = g.join(
        "j", [](int a, int b) { return a + b; }, 1, pa, qa);
    CHECK(contains(error_of([&] { (void)std::move(g).build(j); }),
                   "join 'j' takes inputs reached through different branches of route 'r'"));
  }
  {  // Regression: a join of a route's branch and a node every request reaches was not
     // refused; the error named a later join that merged the branches correctly.
    StreamGraph<int> g(group);
    auto side = g.input().stage("side", id, 0);
    auto [left, right] = side.route<2>("r", [](const int& v) { return v % 2; });
    auto l = left.stage("left", id, 1);
    auto rr = right.stage("right", id, 1);
    auto halfjoin = g.join(
        "halfjoin", [](int a, int b) { return a + b; }, 0, l, side);
    auto j2 = g.join(
        "j2", [](int a, int b) { return a + b; }, 0, halfjoin, g.merge("m", 1, l, rr));
    const std::string e = error_of([&] { (void)std::move(g).build(j2); });
    CHECK(contains(e,
                   "join 'halfjoin' takes input 'left', reached only through branch 0 of "
                   "route 'r', and input 'side', reached whichever branch route 'r' takes"));
    CHECK(contains(e, "merge the branches of route 'r' before the join"));
    CHECK_FALSE(contains(e, "j2"));
  }
  {  // A join inside one branch of a route is fine: every input is reached by the same
     // requests, and the route's other branch skips it.
    // Each join and merge sits where an input ends, so nothing waits for a round trip.
    test::LogCapture log;
    StreamGraph<int> g(group);
    auto [even, odd] = g.input().route<2>("parity", [](const int& v) { return v % 2; });
    auto a = odd.stage("a", id, 0), b = odd.stage("b", id, 1);
    auto both = g.join(
        "both", [](int x, int y) { return x + y; }, 1, a, b);
    auto e = even.stage("e", id, 1);
    auto out = g.merge("out", 1, both, e);
    auto stream = std::move(g).build(out);
    CHECK_FALSE(log.has("waits for"));
    auto client = stream.client();
    stream.start();
    for (int v = 0; v < 6; ++v) REQUIRE(client.push(v));
    int sum = 0, answers = 0;
    for (int k = 0; k < 6; ++k) {
      auto r = client.pop();
      REQUIRE(r);
      REQUIRE(r->ok());
      sum += *r->value;
      ++answers;
    }
    stream.close();
    CHECK(stream.wait().drained());
    CHECK(answers == 6);
    CHECK(sum == (1 + 3 + 5) * 2 + (0 + 2 + 4));
  }
  {  // An output reached through one branch only.
    StreamGraph<int> g(group);
    auto [p, q] = g.input().route<2>("r", [](const int& v) { return v % 2; });
    auto pa = p.stage("pa", id);
    (void)q;
    CHECK(contains(error_of([&] { (void)std::move(g).build(pa); }), "reaches no output"));
  }
  {  // A node on no device of the replica.
    StreamGraph<int> g(group);
    CHECK(contains(error_of([&] { (void)g.input().stage("far", id, 5); }),
                   "stage 'far' device = 5 is not allowed: must be below the stream's 2"));
  }
  {  // A node of another graph.
    StreamGraph<int> g(group), other(group);
    auto mine = g.input().stage("mine", id);
    auto theirs = other.input().stage("theirs", id);
    CHECK(contains(error_of([&] {
                     (void)g.join(
                         "j", [](int a, int b) { return a + b; }, 1, mine, theirs);
                   }),
                   "join 'j': a node of another StreamGraph"));
  }
  {  // Two nodes of one name.
    StreamGraph<int> g(group);
    auto a = g.input().stage("same", id);
    CHECK(
        contains(error_of([&] { (void)a.stage("same", id); }), "stage 'same': the name is taken"));
  }
  {  // A batch stage that is not the only reader of its input on its device.
    StreamGraph<int> g(group);
    auto a = g.input().stage("a", id, 0);
    auto batched = a.batch_stage(
        "batched", [](std::span<int> xs) { return std::vector<int>(xs.begin(), xs.end()); },
        BatchConfig{}, 1);
    auto plain = a.stage("plain", id, 1);
    auto j = g.join(
        "j", [](int x, int y) { return x + y; }, 1, batched, plain);
    CHECK(contains(error_of([&] { (void)std::move(g).build(j); }),
                   "batch stage 'batched' takes the requests of 'a', and so does 'plain'"));
  }
  {  // A graph is built once.
    StreamGraph<int> g(group);
    auto a = g.input().stage("a", id);
    auto s = std::move(g).build(a);
    CHECK(contains(error_of([&] { (void)a.stage("b", id); }), "was built already"));
  }
}

// Regression: a device ran its nodes in build order, so a remote branch that starts with a local
// step built after a local branch left only once that branch had run.
TEST_CASE("a branch for another device leaves before a local branch runs, in any build order") {
  // a (device 0) is built before c, the local first step of the remote branch c -> b (device
  // 1). a waits (at most 2 s) for b to have started on the same request: it can only if c,
  // and its hand-off to device 1, ran before a on device 0.
  test::LogCapture log;  // the join on device 0 waits for a round trip: the build warns
  DeviceGroup group(2, test::kSmall);
  auto b_saw = std::make_shared<std::atomic<U64>>(~U64{0});
  StreamGraph<U64> g(group);
  auto pre = g.input().stage(
      "pre", [](U64 x) { return x; }, 0);
  auto a = pre.stage(
      "a",
      [b_saw](U64 x) -> U64 {
        const auto until = StreamClock::now() + 2s;
        while (b_saw->load() != x && StreamClock::now() < until) std::this_thread::sleep_for(50us);
        return b_saw->load() == x ? x : x + 1000;  // +1000: b had not started beside a
      },
      0);
  auto c = pre.stage(
      "c", [](U64 x) { return x; }, 0);
  auto b = c.stage(
      "b",
      [b_saw](U64 x) {
        b_saw->store(x);
        return x;
      },
      1);
  auto out = g.join(
      "join", [](U64 x, U64) { return x; }, 0, a, b);
  auto stream = std::move(g).build(out);
  auto client = stream.client();
  stream.start();
  for (U64 i = 0; i < 3; ++i) {
    REQUIRE(client.push(i));
    auto r = client.pop();
    REQUIRE(r.has_value());
    REQUIRE(r->ok());
    CHECK(*r->value == i);
  }
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("the builder warns of a node that holds its device for a round trip") {
  DeviceGroup group(2, test::kSmall);
  auto id = [](int v) { return v; };
  auto add = [](int a, int b) { return a + b; };
  {  // The join on the fan-out's device waits for the branch that device handed on.
    test::LogCapture log;
    StreamGraph<int> g(group);
    auto pre = g.input().stage("pre", id, 0);
    auto left = pre.stage("left", id, 0);
    auto right = pre.stage("right", id, 1);
    auto s = std::move(g).build(g.join("join", add, 0, left, right));
    CHECK(
        log.has("'join' on device 0 waits for 'right' from device 1, which device 0 handed "
                "the same request to"));
    CHECK(log.has("Put 'join' on device 1"));
  }
  {  // The join where its slower branch ends: no round trip, no warning.
    test::LogCapture log;
    StreamGraph<int> g(group);
    auto pre = g.input().stage("pre", id, 0);
    auto left = pre.stage("left", id, 0);
    auto right = pre.stage("right", id, 1);
    auto s = std::move(g).build(g.join("join", add, 1, left, right));
    CHECK_FALSE(log.has("waits for"));
  }
  {  // A path that comes back to its first device is the same round trip.
    test::LogCapture log;
    StreamGraph<int> g(group);
    auto a = g.input().stage("a", id, 0);
    auto b = a.stage("b", id, 1);
    auto s = std::move(g).build(b.stage("c", id, 0));
    CHECK(log.has("'c' on device 0 waits for 'b' from device 1"));
  }
}

TEST_SUITE_END();
