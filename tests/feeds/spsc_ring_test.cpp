// The queues room's SpscRing (bspflow/feeds/spsc_ring.hpp): FIFO, bound, close and drain,
// stop, reuse, and a producer and consumer thread moving many elements exactly once.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/feeds/spsc_ring.hpp>

#include "test_util.hpp"

using namespace bspflow;

TEST_SUITE_BEGIN("spsc_ring");

TEST_CASE("FIFO within the bound; full, then room again") {
  SpscRing<int> ring(3);
  StopFlag stop;
  CHECK(ring.try_front() == nullptr);
  CHECK(ring.try_push(1));
  CHECK(ring.try_push(2));
  CHECK(ring.try_push(3));
  int four = 4;
  CHECK_FALSE(ring.try_push(std::move(four)));
  REQUIRE(ring.try_front() != nullptr);
  CHECK(*ring.try_front() == 1);
  ring.pop();
  CHECK(ring.try_push(4));
  for (int want : {2, 3, 4}) {
    int* f = ring.front(WaitPolicy{}, stop);
    REQUIRE(f != nullptr);
    CHECK(*f == want);
    ring.pop();
  }
  CHECK(ring.try_front() == nullptr);
}

TEST_CASE("claim and publish fill slots in place: their buffers are reused, never reallocated") {
  SpscRing<std::vector<float>> ring(2, std::vector<float>(8, 0.0f));
  StopFlag stop;
  std::vector<const float*> buffers;
  for (int round = 0; round < 6; ++round) {
    std::vector<float>* slot = ring.claim(WaitPolicy{}, stop);
    REQUIRE(slot != nullptr);
    REQUIRE(slot->size() == 8);
    (*slot)[0] = static_cast<float>(round);
    buffers.push_back(slot->data());
    ring.publish();
    const std::vector<float>* got = ring.front(WaitPolicy{}, stop);
    REQUIRE(got != nullptr);
    CHECK((*got)[0] == static_cast<float>(round));
    CHECK(got->data() == buffers.back());
    ring.pop();
  }
  CHECK(buffers[0] == buffers[2]);  // two slots, used in turn
  CHECK(buffers[1] == buffers[3]);
  CHECK(buffers[0] != buffers[1]);
  // Full: a claim waits; a stop ends the wait with nullptr.
  REQUIRE(ring.claim(WaitPolicy{}, stop) != nullptr);
  ring.publish();
  REQUIRE(ring.claim(WaitPolicy{}, stop) != nullptr);
  ring.publish();
  stop.set();
  CHECK(ring.claim(WaitPolicy::park(), stop) == nullptr);
}

TEST_CASE("close: the consumer drains, then sees the end; reset opens it again") {
  SpscRing<std::string> ring(4);
  StopFlag stop;
  CHECK(ring.try_push("a"));
  ring.close();
  CHECK_FALSE(ring.closed_and_drained());
  std::string* f = ring.front(WaitPolicy::park(), stop);
  REQUIRE(f != nullptr);
  CHECK(*f == "a");
  ring.pop();
  CHECK(ring.front(WaitPolicy::park(), stop) == nullptr);
  CHECK(ring.closed_and_drained());
  ring.reset();
  CHECK_FALSE(ring.closed_and_drained());
  CHECK(ring.try_push("b"));
  CHECK(*ring.try_front() == "b");
}

TEST_CASE("a stop ends a parked wait on either side") {
  SpscRing<int> ring(1);
  StopFlag stop;
  std::thread consumer([&] { CHECK(ring.front(WaitPolicy::park(), stop) == nullptr); });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  stop.set();
  ring.wake();
  consumer.join();
  StopFlag stop2;
  CHECK(ring.try_push(1));
  std::thread producer([&] { CHECK_FALSE(ring.push(2, WaitPolicy::park(), stop2)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  stop2.set();
  ring.wake();
  producer.join();
}

TEST_CASE("ring capacity is validated") {
  CHECK(test::contains(test::error_of([] { SpscRing<int> r(0); }),
                       "ring capacity = 0 is not allowed: must be in 1.."));
}

TEST_CASE("two threads move every element once, in order, for each wait policy") {
  const std::uint64_t n = test::scaled(200'000, 1000);
  for (const WaitPolicy& policy :
       {WaitPolicy{}, WaitPolicy::park(), WaitPolicy::busy_spin().capped_for_sharing()}) {
    SpscRing<std::unique_ptr<std::uint64_t>> ring(8);
    StopFlag stop;
    bool all_pushed = true;
    std::thread producer([&] {
      for (std::uint64_t i = 0; i < n; ++i) {
        all_pushed = ring.push(std::make_unique<std::uint64_t>(i), policy, stop) && all_pushed;
      }
      ring.close();
    });
    std::uint64_t next = 0;
    bool in_order = true;
    while (auto* f = ring.front(policy, stop)) {
      in_order = in_order && *f && **f == next;
      ++next;
      ring.pop();
    }
    producer.join();
    CHECK(all_pushed);
    CHECK(in_order);
    CHECK(next == n);
  }
}

TEST_SUITE_END();
