// bspflow/instance/internal/instance_reduction.hpp (internal): the per-step exchange across
// instances in buckets, one per device slot, called last slot first as each is posted. In one
// process (one instance) every call is the identity, so these cases see the order and the turns:
// the last slot's bucket is exchanged while slot 0 still computes, a slot posted out of
// order waits for its turn, and a stop makes the host finish the step, as stopped.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <bspflow/bspflow.hpp>

#include "bspflow/instance/internal/instance_reduction.hpp"

using namespace bspflow;
using namespace std::chrono_literals;

namespace {

// Polls `done` for up to 10 s (a hang shows as a failed check, not a stuck test).
template <typename F>
bool eventually(F done) {
  for (int i = 0; i < 10000 && !done(); ++i) std::this_thread::sleep_for(1ms);
  return done();
}

// Slot `slot` posts `step` on a thread of its own (as a device does); the future says whether
// the step was applied.
std::future<bool> post(detail::InstanceReduction& x, std::uint32_t slot, std::uint64_t step) {
  return std::async(std::launch::async,
                    [&x, slot, step] { return x.exchange(slot, step, 0, Spin::kYield); });
}

// Whether `f` ends within 10 s and says applied (a lost wake-up fails here, not by hanging).
bool applied_in_time(std::future<bool>& f) {
  return f.wait_for(10s) == std::future_status::ready && f.get();
}
bool not_applied_in_time(std::future<bool>& f) {
  return f.wait_for(10s) == std::future_status::ready && !f.get();
}

void fill(detail::InstanceReduction& x, std::uint32_t slot, float v) {
  for (float& g : x.segment(slot)) g = v;
}

bool holds(detail::InstanceReduction& x, std::uint32_t slot, float v) {
  for (float g : x.segment(slot))
    if (g != v) return false;
  return true;
}

}  // namespace

TEST_SUITE_BEGIN("instance_reduction");

TEST_CASE("the last slot's bucket is exchanged as soon as it is posted, before slot 0 posts") {
  detail::InstanceReduction x(Instance::current(), {3, 4, 5}, 0, 0);
  x.begin_run(2, {});
  for (std::uint64_t step = 0; step < 2; ++step) {
    CAPTURE(step);
    fill(x, 2, 2.0f);
    auto slot2 = post(x, 2, step);
    // Slot 2's call is made by its own thread, which then waits for the step's end.
    CHECK(eventually([&] { return x.buckets_done() == step * 3 + 1; }));
    CHECK(slot2.wait_for(20ms) == std::future_status::timeout);
    fill(x, 1, 1.0f);
    auto slot1 = post(x, 1, step);
    CHECK(eventually([&] { return x.buckets_done() == step * 3 + 2; }));
    CHECK(slot1.wait_for(20ms) == std::future_status::timeout);
    CHECK_FALSE(x.applied(step));
    fill(x, 0, 7.0f);
    auto last = post(x, 0, step);
    CHECK(applied_in_time(last));
    CHECK(applied_in_time(slot2));
    CHECK(applied_in_time(slot1));
    CHECK(x.buckets_done() == step * 3 + 3);
    CHECK(x.applied(step));
    // One instance: every sum is the identity.
    CHECK(holds(x, 0, 7.0f));
    CHECK(holds(x, 1, 1.0f));
    CHECK(holds(x, 2, 2.0f));
  }
  CHECK(x.applied_steps() == 2);
}

TEST_CASE("a slot posted before its turn waits; the bucket before it makes both calls") {
  detail::InstanceReduction x(Instance::current(), {3, 4}, 0, 0);
  x.begin_run(1, {});
  auto slot0 = post(x, 0, 0);
  std::this_thread::sleep_for(20ms);
  CHECK(x.buckets_done() == 0);  // slot 1's bucket goes first
  CHECK(slot0.wait_for(0ms) == std::future_status::timeout);
  auto last = post(x, 1, 0);
  CHECK(applied_in_time(last));
  CHECK(applied_in_time(slot0));
  CHECK(x.buckets_done() == 2);
  CHECK(x.applied_steps() == 1);
}

TEST_CASE("an empty bucket (a slot without gradients) still takes its turn") {
  detail::InstanceReduction x(Instance::current(), {2, 0, 3}, 0, 0);
  CHECK(x.buckets() == 3);
  x.begin_run(1, {});
  auto slot2 = post(x, 2, 0);
  auto slot1 = post(x, 1, 0);
  CHECK(eventually([&] { return x.buckets_done() == 2; }));
  auto last = post(x, 0, 0);
  CHECK(applied_in_time(last));
  CHECK(applied_in_time(slot2));
  CHECK(applied_in_time(slot1));
  CHECK(x.applied_steps() == 1);
}

TEST_CASE("a stop after slot 1 posted: the host makes slot 0's bucket, as stopped") {
  detail::InstanceReduction x(Instance::current(), {3, 4}, 0, 0);
  std::atomic<int> cancels{0};
  x.begin_run(3, [&] { cancels.fetch_add(1); });
  // Step 0 completes.
  auto first = post(x, 1, 0);
  auto last = post(x, 0, 0);
  CHECK(applied_in_time(last));
  CHECK(applied_in_time(first));
  // Step 1: slot 1 posts, then this instance stops before slot 0 does.
  fill(x, 0, 5.0f);
  auto slot1 = post(x, 1, 1);
  CHECK(eventually([&] { return x.buckets_done() == 3; }));
  StopFlag stop;
  stop.set();
  x.serve(stop);  // the host: slot 0's bucket as zeros, the tail as stopped
  CHECK(not_applied_in_time(slot1));
  CHECK(x.applied_steps() == 1);
  CHECK_FALSE(x.applied(1));
  CHECK(cancels.load() == 1);
  CHECK_FALSE(x.stopped_by_peer());  // this instance stopped
  CHECK(x.stopped_instance() == 0);  // ... and says so
  CHECK(holds(x, 0, 5.0f));          // the zeros went from a buffer of their own
  // A slot that posts after the step was given up on returns at once, not applied.
  CHECK_FALSE(x.exchange(0, 1, 0, Spin::kYield));
  CHECK(x.mismatch().empty());
}

TEST_CASE("a stop after a step ended: the host makes the whole next step, as stopped") {
  detail::InstanceReduction x(Instance::current(), {3, 4}, 0, 0);
  x.begin_run(3, {});
  auto slot1 = post(x, 1, 0);
  auto last = post(x, 0, 0);
  CHECK(applied_in_time(slot1));
  CHECK(applied_in_time(last));
  StopFlag stop;
  stop.set();
  x.serve(stop);
  CHECK(x.applied_steps() == 1);  // step 0 stays applied; step 1 is applied nowhere
  CHECK(x.buckets_done() == 4);   // both steps' buckets
  CHECK(x.stopped_instance() == 0);
  CHECK_FALSE(x.stopped_by_peer());
}

TEST_CASE("a stop before any slot posted: the host makes the whole step, as stopped") {
  detail::InstanceReduction x(Instance::current(), {3, 4}, 0, 0);
  x.begin_run(2, {});
  StopFlag stop;
  stop.set();
  x.serve(stop);
  CHECK(x.buckets_done() == 2);
  CHECK(x.applied_steps() == 0);
  CHECK(x.stopped_instance() == 0);
  CHECK(x.served());
}

TEST_CASE("slots share a bucket until it holds bucket_bytes; the bucket with slot 0 is last") {
  // 5 floats (20 bytes) close a bucket: slot 2 alone, then slots 1 and 0 together.
  detail::InstanceReduction x(Instance::current(), {3, 4, 5}, 0, 20);
  CHECK(x.buckets() == 2);
  x.begin_run(1, {});
  auto slot1 = post(x, 1, 0);
  std::this_thread::sleep_for(20ms);
  CHECK(x.buckets_done() == 0);  // slot 2's bucket goes first
  auto slot2 = post(x, 2, 0);
  CHECK(eventually([&] { return x.buckets_done() == 1; }));
  std::this_thread::sleep_for(20ms);
  CHECK(x.buckets_done() == 1);  // slot 1 shares its bucket with slot 0, not posted yet
  auto last = post(x, 0, 0);
  CHECK(applied_in_time(last));
  CHECK(applied_in_time(slot1));
  CHECK(applied_in_time(slot2));
  CHECK(x.buckets_done() == 2);
  CHECK(x.applied_steps() == 1);
}

TEST_CASE("gradients smaller than bucket_bytes make one call per step, made by the last slot") {
  detail::InstanceReduction x(Instance::current(), {3, 4, 5}, 0, std::size_t{25} << 20);
  CHECK(x.buckets() == 1);
  x.begin_run(1, {});
  auto slot2 = post(x, 2, 0);
  auto slot1 = post(x, 1, 0);
  std::this_thread::sleep_for(20ms);
  CHECK(x.buckets_done() == 0);
  auto last = post(x, 0, 0);
  CHECK(applied_in_time(last));
  CHECK(applied_in_time(slot2));
  CHECK(applied_in_time(slot1));
  CHECK(x.buckets_done() == 1);
}

TEST_CASE("runs reuse the exchange: the turns start again at step 0") {
  detail::InstanceReduction x(Instance::current(), {1, 1}, 0, 0);
  for (int run = 0; run < 3; ++run) {
    CAPTURE(run);
    x.begin_run(2, {});
    for (std::uint64_t step = 0; step < 2; ++step) {
      auto slot1 = post(x, 1, step);
      auto last = post(x, 0, step);
      CHECK(applied_in_time(last));
      CHECK(applied_in_time(slot1));
    }
    StopFlag never;
    x.serve(never);  // every step done: returns without a call
    CHECK(x.applied_steps() == 2);
    CHECK(x.buckets_done() == 4);
  }
}

TEST_CASE("a slot posting a step that is not the one being exchanged is an internal error") {
  detail::InstanceReduction x(Instance::current(), {1, 1}, 0, 0);
  x.begin_run(3, {});
  CHECK_THROWS_WITH_AS(x.exchange(0, 1, 0, Spin::kYield),
                       doctest::Contains("posted step 1 while step 0 is exchanged"), Error);
}
