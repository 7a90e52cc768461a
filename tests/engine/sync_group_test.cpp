// runtime/: SyncGroup (bspflow/engine/sync_group.hpp) on plain threads: nobody leaves a round
// before everyone has arrived (2 threads, and 3 and 4 on 2 cores), each round hands out its
// latest modeled clock, a stop or an abort releases the
// waiters with false, wake() alone does not, reset() forgets a stopped run's arrivals and
// the abort.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <thread>
#include <vector>

#include <bspflow/base/detail/wait.hpp>
#include <bspflow/engine/sync_group.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;

namespace {

// Arrives on `group` from another thread; the future holds what arrive_and_wait returned.
std::future<bool> arrive_later(SyncGroup& group, const StopFlag& stop, Spin spin = Spin::kTight) {
  return std::async(std::launch::async,
                    [&group, &stop, spin] { return group.arrive_and_wait(stop, spin); });
}

// Whether `f` has its value within `d`.
bool ready_within(std::future<bool>& f, std::chrono::milliseconds d) {
  return f.wait_for(d) == std::future_status::ready;
}

// Whether the waiter `f` returns within 10 s (liveness, not speed). If not, it is stopped, so
// that the test can fail instead of hanging.
bool returns(std::future<bool>& f, SyncGroup& group, StopFlag& stop) {
  if (ready_within(f, 10000ms)) return true;
  stop.set();
  group.wake();
  return false;
}

}  // namespace

TEST_SUITE_BEGIN("sync_group");

TEST_CASE("participants: 1..kMaxReplicas, else an error with the range") {
  CHECK(SyncGroup(1).participants() == 1);
  CHECK(SyncGroup(tunables::kMaxReplicas).participants() == tunables::kMaxReplicas);
  CHECK(contains(error_of([] { SyncGroup g(0); }),
                 "sync group participants = 0 is not allowed: must be in 1..1024"));
  CHECK(contains(error_of([] { SyncGroup g(1025); }), "sync group participants = 1025"));
}

TEST_CASE("one participant passes every round at once") {
  SyncGroup group(1);
  StopFlag stop;
  for (int i = 0; i < 1000; ++i) REQUIRE(group.arrive_and_wait(stop));
  CHECK_FALSE(group.aborted());
}

TEST_CASE("nobody leaves a round before all have arrived (2 threads, and 4 on 2 cores)") {
  struct Case {
    std::uint32_t threads;
    Spin spin;
  };
  for (const Case c : {Case{2, Spin::kTight}, Case{3, Spin::kYield}, Case{4, Spin::kYield}}) {
    CAPTURE(c.threads);
    SyncGroup group(c.threads);
    StopFlag stop;
    const std::uint64_t rounds = test::scaled(2000, 100);
    std::atomic<std::uint64_t> arrivals{0};
    std::atomic<std::uint64_t> early{0}, refused{0};
    std::vector<std::thread> threads;
    for (std::uint32_t t = 0; t < c.threads; ++t) {
      threads.emplace_back([&] {
        for (std::uint64_t r = 0; r < rounds; ++r) {
          arrivals.fetch_add(1, std::memory_order_seq_cst);
          if (!group.arrive_and_wait(stop, c.spin)) refused.fetch_add(1);
          // Every participant's arrival for round r came before anyone left it.
          if (arrivals.load(std::memory_order_seq_cst) < (r + 1) * c.threads) early.fetch_add(1);
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(early.load() == 0);
    CHECK(refused.load() == 0);
    CHECK(arrivals.load() == rounds * c.threads);
  }
}

TEST_CASE("each round hands every participant the latest modeled clock of that round") {
  // Participant t brings (what the last round handed it) + t + 1, so round r hands out
  // (r + 1) x participants: a clock of another round (too early, or a participant already in
  // the next one) would show. 3 participants: a count that is no power of two.
  for (const std::uint32_t n : {2u, 3u}) {
    CAPTURE(n);
    SyncGroup group(n);
    StopFlag stop;
    const std::uint64_t rounds = test::scaled(2000, 100);
    std::atomic<std::uint64_t> wrong{0};
    std::vector<std::thread> threads;
    for (std::uint32_t t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        double clock = 0;
        for (std::uint64_t r = 0; r < rounds; ++r) {
          clock += t + 1;
          if (!group.arrive_and_wait(stop, n > 2 ? Spin::kYield : Spin::kTight, &clock) ||
              clock != static_cast<double>((r + 1) * n)) {
            wrong.fetch_add(1);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(wrong.load() == 0);
    CHECK(group.arrived() == 0);
  }
}

TEST_CASE("a stop releases a waiter with false; wake() alone does not") {
  SyncGroup group(2);
  StopFlag stop;
  std::future<bool> waiter = arrive_later(group, stop);
  for (int i = 0; i < 5; ++i) {
    group.wake();  // re-checks its stop flag, finds it unset, waits on
    std::this_thread::sleep_for(2ms);
  }
  CHECK_FALSE(ready_within(waiter, 20ms));
  stop.set();
  group.wake();
  REQUIRE(returns(waiter, group, stop));  // liveness, not speed
  CHECK_FALSE(waiter.get());
  CHECK_FALSE(group.aborted());  // a stop is not an abort
}

TEST_CASE("abort() releases the waiters with false and refuses later arrivals until reset()") {
  SyncGroup group(3);
  StopFlag stop;
  std::future<bool> a = arrive_later(group, stop);
  std::future<bool> b = arrive_later(group, stop, Spin::kYield);
  CHECK_FALSE(ready_within(a, 20ms));  // two of three: the round is not complete
  group.abort();                       // the third participant will not come (its infeed ended)
  CHECK(group.aborted());
  REQUIRE(returns(a, group, stop));
  REQUIRE(returns(b, group, stop));
  CHECK_FALSE(a.get());
  CHECK_FALSE(b.get());
  // Later arrivals return false at once, without waiting, even as many as the group needs.
  for (int i = 0; i < 3; ++i) CHECK_FALSE(group.arrive_and_wait(stop));
  // reset(): a new run, with every participant; the rounds complete again.
  group.reset();
  CHECK_FALSE(group.aborted());
  std::future<bool> x = arrive_later(group, stop);
  std::future<bool> y = arrive_later(group, stop);
  CHECK(group.arrive_and_wait(stop));
  REQUIRE(returns(x, group, stop));
  REQUIRE(returns(y, group, stop));
  CHECK(x.get());
  CHECK(y.get());
}

TEST_CASE("reset() forgets the arrivals of a run stopped midway") {
  SyncGroup group(3);
  {
    StopFlag stop;
    std::future<bool> stopped = arrive_later(group, stop);  // its arrival is counted
    std::this_thread::sleep_for(5ms);
    stop.set();
    group.wake();
    REQUIRE(returns(stopped, group, stop));
    CHECK_FALSE(stopped.get());
  }
  group.reset();
  // The next run: two arrivals are not a round of three, whatever the stopped run left.
  StopFlag stop;
  std::future<bool> a = arrive_later(group, stop);
  std::future<bool> b = arrive_later(group, stop);
  CHECK_FALSE(ready_within(a, 50ms));
  CHECK_FALSE(ready_within(b, 1ms));
  CHECK(group.arrive_and_wait(stop));  // the third completes it
  REQUIRE(returns(a, group, stop));
  REQUIRE(returns(b, group, stop));
  CHECK(a.get());
  CHECK(b.get());
}

TEST_SUITE_END();
