// feeds/: InfeedQueue (bspflow/feeds/infeed_queue.hpp): validation, round-robin and explicit
// routing, try_push and PushResult, end of data, one reader per lane, prefetch, backpressure,
// many producers on a shared lane and single-producer lanes, close() racing pushes, parked readers
// and producers woken, push_bulk.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/base/detail/wait.hpp>
#include <bspflow/base/tunables.hpp>
#include <bspflow/feeds/infeed_queue.hpp>
#include <bspflow/feeds/outfeed_queue.hpp>  // the replica-count check covers OutfeedConfig too
#include <bspflow/feeds/push_result.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("infeed_queue");

TEST_CASE("prefetch depth outside 1..255 is an error naming the option and the range") {
  for (std::uint32_t bad : {0u, 256u, 1000u}) {
    const std::string msg = error_of([&] { InfeedQueue<int> q(InfeedConfig{1, 1024, bad}); });
    CHECK(contains(msg, "prefetch_depth = " + std::to_string(bad)));
    CHECK(contains(msg, "1..255"));
  }
  CHECK(error_of([] { InfeedQueue<int> q(InfeedConfig{1, 300, 255}); }) == "<no error>");
  CHECK(error_of([] { InfeedQueue<int> q(InfeedConfig{1, 256, 1}); }) == "<no error>");
}

TEST_CASE("infeed capacity and replica count are validated") {
  const std::string small = error_of([] { InfeedQueue<int> q(InfeedConfig{1, 3, 4}); });
  CHECK(contains(small, "infeed capacity = 3"));
  CHECK(contains(small, "prefetch_depth (4)"));
  const std::string reps = error_of([] { InfeedQueue<int> q(InfeedConfig{0, 16, 1}); });
  CHECK(contains(reps, "replicas = 0"));
  CHECK(contains(reps, "1..1024"));
  CHECK(contains(error_of([] { OutfeedQueue<int> q(OutfeedConfig{0}); }), "replicas = 0"));
}

TEST_CASE("round-robin routing gives every replica different elements, in order") {
  constexpr std::uint32_t kReplicas = 3;
  InfeedQueue<int> q(InfeedConfig{kReplicas, 64, 2});
  auto p = q.make_producer();
  for (int i = 0; i < 30; ++i) REQUIRE(p.push(i));
  q.close();
  for (std::uint32_t r = 0; r < kReplicas; ++r) {
    auto reader = q.reader(r);
    std::vector<int> got;
    int v = 0;
    while (reader.pop(v)) got.push_back(v);
    CHECK(reader.end_of_data());
    REQUIRE(got.size() == 10);
    for (std::size_t k = 0; k < got.size(); ++k)
      CHECK(got[k] == static_cast<int>(k * kReplicas + r));
  }
}

TEST_CASE("try_push reports Full without consuming the value, and push_to routes explicitly") {
  InfeedQueue<std::vector<int>> q(InfeedConfig{2, 2, 1});
  auto p = q.make_producer();
  CHECK(p.push_to(1, {1}));
  CHECK(p.push_to(1, {2}));
  std::vector<int> v{42, 43};
  // Replica 0 has room: round-robin starts there.
  CHECK(p.try_push(std::vector<int>{7}) == PushResult::kOk);
  CHECK(p.try_push(std::move(v)) == PushResult::kFull);  // replica 1 is full
  CHECK(v == std::vector<int>{42, 43});
  CHECK(q.size_approx(1) == 2);
  auto r1 = q.reader(1);
  std::vector<int> out;
  REQUIRE(r1.pop(out));
  CHECK(out == std::vector<int>{1});
  CHECK(p.try_push(std::move(v)) == PushResult::kOk);  // retried at the same replica
  q.close();
  std::vector<std::vector<int>> rest;
  while (r1.pop(out)) rest.push_back(out);
  CHECK(rest == std::vector<std::vector<int>>{{2}, {42, 43}});
  CHECK(p.try_push(std::vector<int>{9}) == PushResult::kClosed);
  CHECK_FALSE(p.push(std::vector<int>{9}));
  CHECK(contains(error_of([&] { p.push_to(2, {}); }), "replica = 2"));
}

TEST_CASE("end of data: a closed infeed drains, then reports end of data") {
  InfeedQueue<int> q;
  auto p = q.make_producer();
  for (int i = 0; i < 5; ++i) p.push(i);
  q.close();
  CHECK_FALSE(p.push(99));
  auto reader = q.reader(0);
  int v = -1;
  for (int i = 0; i < 5; ++i) {
    REQUIRE(reader.pop(v));
    CHECK(v == i);
  }
  CHECK_FALSE(reader.pop(v));
  CHECK(reader.end_of_data());
  CHECK_FALSE(reader.pop(v));  // stays ended
}

TEST_CASE("a lane has one reader at a time") {
  InfeedQueue<int> q(InfeedConfig{2, 8, 1});
  {
    auto a = q.reader(0);
    CHECK(contains(error_of([&] { auto b = q.reader(0); }), "already has a reader"));
    auto c = q.reader(1);  // another lane is fine
  }
  auto again = q.reader(0);  // released when the first reader went away
  CHECK(contains(error_of([&] { auto d = q.reader(5); }), "replica = 5"));
}

TEST_CASE("prefetch moves up to prefetch_depth elements off the lane at once") {
  InfeedQueue<int> q(InfeedConfig{1, 64, 4});
  auto p = q.make_producer();
  for (int i = 0; i < 10; ++i) p.push(i);
  auto reader = q.reader(0);
  int v = 0;
  REQUIRE(reader.pop(v));
  CHECK(reader.prefetched() == 3);
  CHECK(q.size_approx(0) == 6);
}

TEST_CASE("backpressure: a fast producer never holds more than capacity in a lane") {
  constexpr std::size_t kCapacity = 8;
  const std::uint64_t n = test::scaled(3000, 200);
  InfeedQueue<std::uint64_t> q(InfeedConfig{1, kCapacity, 2});
  std::atomic<std::size_t> peak{0};
  auto note = [&] {
    const std::size_t s = q.size_approx(0);
    std::size_t prev = peak.load();
    while (s > prev && !peak.compare_exchange_weak(prev, s)) {
    }
  };
  std::thread producer([&] {
    auto p = q.make_producer();
    for (std::uint64_t i = 0; i < n; ++i) {
      CHECK(p.push(i));
      note();
    }
    q.close();
  });
  auto reader = q.reader(0);
  std::uint64_t v = 0;
  std::uint64_t expect = 0;
  while (reader.pop(v)) {
    CHECK(v == expect++);
    note();
    if (expect % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // slow
  }
  producer.join();
  CHECK(expect == n);
  CHECK(peak.load() <= kCapacity);
  CHECK(peak.load() >= 1);
}

TEST_CASE("many producers into one lane: nothing lost, per-producer order kept") {
  constexpr int kProducers = 4;
  const std::uint64_t per = test::scaled(50000, 500);
  InfeedQueue<std::pair<int, std::uint64_t>> q(InfeedConfig{1, 128, 16});
  std::vector<std::thread> producers;
  for (int id = 0; id < kProducers; ++id) {
    producers.emplace_back([&, id] {
      auto p = q.make_producer();
      for (std::uint64_t s = 0; s < per; ++s) CHECK(p.push({id, s}));
    });
  }
  std::thread closer([&] {
    for (auto& t : producers) t.join();
    q.close();
  });
  auto reader = q.reader(0);
  std::vector<std::uint64_t> next(kProducers, 0);
  std::pair<int, std::uint64_t> e;
  std::uint64_t count = 0;
  bool ordered = true;
  while (reader.pop(e)) {
    ordered = ordered && e.second == next[e.first];
    next[e.first] = e.second + 1;
    ++count;
  }
  closer.join();
  CHECK(ordered);
  CHECK(count == per * kProducers);
}

TEST_CASE("shared lane: a second producer joining mid-stream loses and reorders nothing") {
  // A second producer made while the first is pushing: every element must still arrive
  // once, in order per producer.
  const std::uint64_t per = test::scaled(200000, 2000);
  InfeedQueue<std::pair<int, std::uint64_t>> q(InfeedConfig{1, 64, 1});
  std::atomic<std::uint64_t> first_pushed{0};
  std::thread first([&] {
    auto p = q.make_producer();
    for (std::uint64_t s = 0; s < per; ++s) {
      CHECK(p.push({0, s}));
      first_pushed.store(s + 1, std::memory_order_relaxed);  // relaxed: a progress hint
    }
  });
  std::thread second([&] {
    while (first_pushed.load(std::memory_order_relaxed) < per / 4) std::this_thread::yield();
    auto p = q.make_producer();  // joins while the first producer is busy
    for (std::uint64_t s = 0; s < per; ++s) CHECK(p.push({1, s}));
  });
  std::thread closer([&] {
    first.join();
    second.join();
    q.close();
  });
  auto reader = q.reader(0);
  std::uint64_t next[2] = {0, 0};
  std::pair<int, std::uint64_t> e;
  bool ordered = true;
  while (reader.pop(e)) {
    ordered = ordered && e.second == next[e.first];
    next[e.first] = e.second + 1;
  }
  closer.join();
  CHECK(ordered);
  CHECK(next[0] == per);
  CHECK(next[1] == per);
  CHECK(reader.end_of_data());
}

TEST_CASE("close() while a producer pushes is exact: shared and single-producer lanes") {
  // Whatever push() reported as pushed is delivered, and nothing after close() slips in.
  for (ProducerType type : {ProducerType::kMulti, ProducerType::kSingle}) {
    CAPTURE(static_cast<int>(type));
    for (int round = 0; round < 20; ++round) {
      InfeedConfig config{1, 32, 1};
      config.producer_type = type;
      InfeedQueue<std::uint64_t> q(config);
      std::uint64_t accepted = 0;
      std::thread producer([&] {
        auto p = q.make_producer();
        for (std::uint64_t s = 0;; ++s) {
          if (!p.push(s)) break;
          accepted = s + 1;
        }
      });
      auto reader = q.reader(0);
      std::uint64_t v = 0;
      std::uint64_t got = 0;
      bool in_order = true;
      const std::uint64_t close_after =
          test::scaled(5000, 100) + static_cast<std::uint64_t>(round) * 37;
      while (reader.pop(v)) {
        in_order = in_order && v == got;
        if (++got == close_after) q.close();
      }
      producer.join();
      CHECK(in_order);
      CHECK(got == accepted);
      CHECK(reader.end_of_data());
    }
  }
}

namespace {
// An element whose move is slow when it carries kSlow: it keeps a push "in flight" long
// enough for close() to race with it.
struct SlowMove {
  static constexpr std::uint64_t kSlow = ~std::uint64_t{0};
  static std::atomic<bool>& entered() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  std::uint64_t v = 0;
  SlowMove() = default;
  explicit SlowMove(std::uint64_t x) : v(x) {}
  SlowMove(SlowMove&& o) noexcept : v(o.v) {
    if (v == kSlow && !entered().exchange(true)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  SlowMove& operator=(SlowMove&& o) noexcept {  // slow too: a ring moves into its slots
    v = o.v;
    if (v == kSlow && !entered().exchange(true)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return *this;
  }
};
}  // namespace

TEST_CASE("close() racing a push in flight: a push that succeeded is delivered") {
  InfeedQueue<SlowMove> q(InfeedConfig{1, 16, 1});
  SlowMove::entered() = false;
  bool accepted = false;
  std::thread producer([&] {
    auto p = q.make_producer();
    SlowMove slow(SlowMove::kSlow);
    // try_push takes an rvalue reference: the one move is into the queue, inside the push
    accepted = p.try_push(std::move(slow)) == PushResult::kOk;
  });
  while (!SlowMove::entered().load()) std::this_thread::yield();
  q.close();  // while the push is still moving its element in
  auto reader = q.reader(0);
  SlowMove v;
  std::uint64_t got = 0;
  while (reader.pop(v)) ++got;
  producer.join();
  CHECK(got == (accepted ? 1u : 0u));
  CHECK(reader.end_of_data());
}

TEST_CASE("shared lane: a later producer takes over after the first is gone") {
  InfeedQueue<int> q(InfeedConfig{1, 8, 1});
  auto reader = q.reader(0);
  int v = 0;
  for (int generation = 0; generation < 3; ++generation) {
    std::thread t([&] {
      auto p = q.make_producer();
      for (int i = 0; i < 100; ++i) CHECK(p.push(generation * 100 + i));
    });
    for (int i = 0; i < 100; ++i) {
      REQUIRE(reader.pop(v));
      CHECK(v == generation * 100 + i);
    }
    t.join();
  }
  q.close();
  CHECK_FALSE(reader.pop(v));
  CHECK(reader.end_of_data());
}

TEST_CASE("parked reader and parked producer are woken by plain-store publication") {
  // Slow partners make each side park between elements (longer than the spin budget);
  // a lost wake-up would hang this test.
  const int n = static_cast<int>(test::scaled(200, 20));
  InfeedQueue<int> q(InfeedConfig{1, 1, 1});
  std::thread producer([&] {
    auto p = q.make_producer();
    for (int i = 0; i < n; ++i) {
      if (i % 2 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));  // reader parks
      CHECK(p.push(i));  // on odd i the lane is often full: the producer parks
    }
    q.close();
  });
  auto reader = q.reader(0);
  int v = 0;
  int expect = 0;
  while (reader.pop(v)) {
    CHECK(v == expect++);
    if (expect % 2 == 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  producer.join();
  CHECK(expect == n);
}

TEST_CASE("push_bulk keeps order and respects the bound") {
  InfeedQueue<int> q(InfeedConfig{2, 16, 4});
  std::vector<int> values(100);
  for (int i = 0; i < 100; ++i) values[i] = i;
  std::thread producer([&] {
    auto p = q.make_producer();
    CHECK(p.push_bulk(1, values) == 100);
    q.close();
  });
  auto reader = q.reader(1);
  int v = 0;
  int expect = 0;
  while (reader.pop(v)) {
    CHECK(v == expect++);
    CHECK(q.size_approx(1) <= 16);
  }
  producer.join();
  CHECK(expect == 100);
}

namespace {
// An 8-byte element whose move into the queue can be held: moving element kHoldAt (by
// assignment into a single-producer lane's slot, by construction into moodycamel's) waits
// (at most 10 s) until the reader has taken element 0.
std::atomic<bool> g_first_taken{false};
std::atomic<bool> g_held_too_long{false};
struct Gated {
  std::uint64_t v = 0;
  static constexpr std::uint64_t kHoldAt = 600;
  static void hold(std::uint64_t x) {
    if (x != kHoldAt) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!g_first_taken.load()) {
      if (std::chrono::steady_clock::now() > until) {
        g_held_too_long.store(true);
        return;
      }
      std::this_thread::yield();
    }
  }
  Gated() = default;
  explicit Gated(std::uint64_t x) : v(x) {}
  Gated(const Gated&) = default;
  Gated(Gated&& o) noexcept : v(o.v) { hold(v); }
  Gated& operator=(Gated&& o) noexcept {
    hold(o.v);
    v = o.v;
    return *this;
  }
  Gated& operator=(const Gated&) = default;
};
}  // namespace

TEST_CASE("push_bulk publishes as it copies: the reader starts before the batch is in") {
  // tunables::kBulkPublishBytes (1 KiB: 128 of these): the first elements reach the reader
  // while the producer is still copying element 600. Publishing once at the end would keep
  // element 0 back until the hold gives up (and the test fails).
  static_assert(sizeof(Gated) == 8 && Gated::kHoldAt * sizeof(Gated) > tunables::kBulkPublishBytes);
  for (const ProducerType type : {ProducerType::kSingle, ProducerType::kMulti}) {
    const std::string kind = type == ProducerType::kSingle ? "single producer" : "multi producer";
    CAPTURE(kind);
    g_first_taken = false;
    g_held_too_long = false;
    InfeedConfig config{1, 1024, 1};
    config.producer_type = type;
    InfeedQueue<Gated> q(config);
    std::vector<Gated> values;
    values.reserve(1000);  // (no moves before the push)
    for (std::uint64_t i = 0; i < 1000; ++i) values.emplace_back(i);
    std::thread producer([&] {
      auto p = q.make_producer();
      CHECK(p.push_bulk(0, values) == 1000);
      q.close();
    });
    auto reader = q.reader(0);
    Gated g;
    std::uint64_t expect = 0;
    while (reader.pop(g)) {
      CHECK(g.v == expect++);
      g_first_taken = true;
    }
    producer.join();
    CHECK(expect == 1000);
    CHECK_FALSE(g_held_too_long.load());
  }
}

TEST_CASE("a stop request wakes a reader parked on an empty lane") {
  InfeedQueue<int> q;
  StopFlag stop;
  std::atomic<bool> returned{false};
  bool popped = true;
  bool eod = true;
  std::thread t([&] {
    auto reader = q.reader(0);
    int v = 0;
    popped = reader.pop(v, &stop);
    eod = reader.end_of_data();
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let it park
  CHECK_FALSE(returned.load());
  stop.set();
  q.wake_all();
  t.join();
  CHECK_FALSE(popped);
  CHECK_FALSE(eod);  // stopped, not end of data
}

TEST_CASE("close wakes a producer blocked on a full lane") {
  InfeedQueue<int> q(InfeedConfig{1, 1, 1});
  auto p = q.make_producer();
  REQUIRE(p.push(1));
  bool result = true;
  std::thread t([&] { result = p.push(2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  q.close();
  t.join();
  CHECK_FALSE(result);
}

// ---- ProducerType::kSingle: each lane a single-producer ring ----

namespace {
InfeedConfig single(std::uint32_t replicas, std::size_t capacity, std::uint32_t prefetch = 1) {
  InfeedConfig c{replicas, capacity, prefetch};
  c.producer_type = ProducerType::kSingle;
  return c;
}
}  // namespace

TEST_CASE("single producer: a second live producer is an error; after the first is gone, fine") {
  InfeedQueue<int> q(single(1, 8));
  {
    auto p = q.make_producer();
    const std::string msg = error_of([&] { auto again = q.make_producer(); });
    CHECK(contains(msg, "one producer at a time"));
    CHECK(contains(msg, "ProducerType::kMulti"));
    auto moved = std::move(p);  // a moved Producer is still the one
    CHECK(contains(error_of([&] { auto again = q.make_producer(); }), "already has one"));
    REQUIRE(moved.push(1));
  }
  auto next = q.make_producer();
  REQUIRE(next.push(2));
  q.close();
  auto reader = q.reader(0);
  int v = 0;
  REQUIRE(reader.pop(v));
  CHECK(v == 1);
  REQUIRE(reader.pop(v));
  CHECK(v == 2);
  CHECK_FALSE(reader.pop(v));
  CHECK(reader.end_of_data());
}

TEST_CASE("single producer: round-robin, the bound, try_push Full and Closed, drain on close") {
  InfeedQueue<int> q(single(2, 3));
  auto p = q.make_producer();
  for (int i = 0; i < 6; ++i) REQUIRE(p.try_push(int{i}) == PushResult::kOk);
  int seven = 7;
  CHECK(p.try_push(std::move(seven)) == PushResult::kFull);
  CHECK(seven == 7);  // untouched
  CHECK(q.size_approx(0) == 3);
  CHECK(q.total_pushed(1) == 3);
  q.close();
  CHECK(q.closed());
  CHECK(p.try_push(std::move(seven)) == PushResult::kClosed);
  CHECK_FALSE(p.push(8));
  for (std::uint32_t r = 0; r < 2; ++r) {
    auto reader = q.reader(r);
    int v = 0;
    for (int want = static_cast<int>(r); want < 6; want += 2) {
      REQUIRE(reader.pop(v));
      CHECK(v == want);
    }
    CHECK_FALSE(reader.pop(v));
    CHECK(reader.end_of_data());
  }
}

TEST_CASE("single producer: exactly once and in order through a small lane, bulk and single") {
  for (bool bulk : {false, true}) {
    CAPTURE(bulk);
    InfeedQueue<std::uint64_t> q(single(1, 7, 3));
    const std::uint64_t n = test::scaled(1'000'000, 10'000);
    std::thread producer([&] {
      auto p = q.make_producer();
      std::vector<std::uint64_t> chunk;
      for (std::uint64_t i = 0; i < n;) {
        if (!bulk) {
          REQUIRE(p.push(i++));
          continue;
        }
        chunk.clear();
        for (std::uint64_t k = 0; k < 5 && i < n; ++k) chunk.push_back(i++);
        REQUIRE(p.push_bulk(0, chunk) == chunk.size());
      }
      q.close();
    });
    auto reader = q.reader(0);
    std::uint64_t v = 0, got = 0;
    bool in_order = true;
    while (reader.pop(v)) in_order = in_order && v == got++;
    producer.join();
    CHECK(in_order);
    CHECK(got == n);
    CHECK(reader.end_of_data());
  }
}

TEST_CASE("single producer: marks left in the slots from earlier laps are not read as new ones") {
  // Each push, and each part of a push_bulk, is marked in its first slot with where it ends.
  // One lap later the reader's head is at those slots again with nothing new pushed: a whole
  // lap pushed as one part leaves a mark equal to the head, single pushes leave marks below
  // it. Both must read as "nothing yet", and what is pushed next must read once, in order.
  InfeedQueue<int> q(single(1, 8, 8));
  auto p = q.make_producer();
  auto reader = q.reader(0);
  int v = -1;
  int next = 0;
  for (int lap = 0; lap < 4; ++lap) {
    CAPTURE(lap);
    std::vector<int> all(8);
    std::iota(all.begin(), all.end(), next);
    REQUIRE(p.push_bulk(0, all) == 8);  // one part of 8: every slot
    for (int i = 0; i < 8; ++i) {
      REQUIRE(reader.try_pop(v));
      CHECK(v == next++);
    }
    CHECK_FALSE(reader.try_pop(v));
    for (int i = 0; i < 8; ++i) {  // eight parts of one
      REQUIRE(p.push(int{next}));
      REQUIRE(reader.try_pop(v));
      CHECK(v == next++);
    }
    CHECK_FALSE(reader.try_pop(v));
    CHECK(q.size_approx(0) == 0);
    REQUIRE(p.push(int{next}));  // the next lap's parts start one slot on
    REQUIRE(reader.try_pop(v));
    CHECK(v == next++);
    CHECK_FALSE(reader.try_pop(v));
  }
}

TEST_CASE("single producer: close() racing a push in flight delivers the push that succeeded") {
  InfeedQueue<SlowMove> q(single(1, 16));
  SlowMove::entered() = false;
  bool accepted = false;
  std::thread producer([&] {
    auto p = q.make_producer();
    SlowMove slow(SlowMove::kSlow);
    accepted = p.try_push(std::move(slow)) == PushResult::kOk;
  });
  while (!SlowMove::entered().load()) std::this_thread::yield();
  q.close();  // waits for the push in flight
  auto reader = q.reader(0);
  SlowMove v;
  std::uint64_t got = 0;
  while (reader.pop(v)) ++got;
  producer.join();
  CHECK(accepted);
  CHECK(got == 1);
  CHECK(reader.end_of_data());
}

TEST_CASE("single producer: stop wakes a parked reader; close wakes a blocked producer") {
  InfeedQueue<int> q(single(1, 1));
  StopFlag stop;
  bool popped = true;
  std::thread t([&] {
    auto reader = q.reader(0);
    int v = 0;
    popped = reader.pop(v, &stop);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop.set();
  q.wake_all();
  t.join();
  CHECK_FALSE(popped);
  auto p = q.make_producer();
  REQUIRE(p.push(1));
  bool result = true;
  std::thread blocked([&] { result = p.push(2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  q.close();
  blocked.join();
  CHECK_FALSE(result);
}

TEST_SUITE_END();
