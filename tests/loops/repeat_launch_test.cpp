// runtime/: launching loops::repeat (bspflow/loops/repeat.hpp): bad launches (feeds of the
// wrong replica count, an outfeed too small for what the run delivers, entries an earlier run
// left unread, a lane already read by a loop, an empty Run) are clear errors before anything
// runs, and a prefetch buffer that does not fit the device memory is an out-of-memory error
// that releases the lane.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <string>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using test::kSmall;

TEST_SUITE_BEGIN("repeat_launch");

TEST_CASE("bad launches are clear errors, before anything runs") {
  Device device(0, kSmall);
  InfeedQueue<int> two(InfeedConfig{2, 8, 1});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 1, [](int&, int&) {}, 0, two);
                 }),
                 "infeed has 2 replica lane(s) but the loop runs on 1 device(s)"));
  OutfeedQueue<int> out2(OutfeedConfig{2});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 1, [](int& s) { return s; }, 0, out2);
                 }),
                 "outfeed has 2 replica(s)"));
  OutfeedQueue<int> small(OutfeedConfig{1, OutputMode::all(), 5});
  CHECK(contains(error_of([&] {
                   loops::repeat(
                       device, 10, [](int& s) { return s; }, 0, small);
                 }),
                 "outfeed capacity 5 < 10 entries"));
  {
    // One reader: each replica has a ring of `capacity` entries, so the bound is per replica.
    DeviceGroup pair(2, kSmall);
    OutfeedQueue<int> rings(OutfeedConfig{2, OutputMode::all(), 10, ConsumerType::kSingle});
    loops::repeat(
        pair, 10, [](int& s) { return s++; }, 0, rings);  // 2 x 10 entries: fits
    CHECK(rings.drain().size() == 20);
    const std::string e = error_of([&] {
      loops::repeat(
          pair, 11, [](int& s) { return s; }, 0, rings);
    });
    CHECK(contains(
        e, "outfeed capacity 10 per replica < 11 entries this run delivers to each replica"));
    CHECK(!contains(e, "0 = unbounded"));  // a ring has a bound
  }
  {
    // Guards: entries an earlier run left unread count against the bound. Counting this run's
    // entries only, the second call below would block on the full outfeed for ever (the
    // guard drains it after 10 s and the test fails).
    OutfeedQueue<int> shared(OutfeedConfig{1, OutputMode::all(), 10});
    loops::repeat(
        device, 6, [](int& s) { return s++; }, 0, shared);  // 6 of 10: fits, left unread
    test::Rescue guard(10s, [&] { (void)shared.drain(); });
    CHECK(error_of([&] {
            loops::repeat(
                device, 6, [](int& s) { return s; }, 0, shared);
          }) ==
          "outfeed capacity 10 < 6 entries already in it (unread, from an earlier run) + "
          "6 entries this run delivers, and loops::repeat reads nothing until the loop "
          "ends: read or drain() the outfeed first, use loops::repeat_async and read it "
          "while it runs, or raise the capacity (0 = unbounded)");
    CHECK_FALSE(guard.fired());
    guard.disarm();
    CHECK(shared.drain().size() == 6);  // what was there, untouched
    DeviceGroup pair(2, kSmall);
    OutfeedQueue<int> rings(OutfeedConfig{2, OutputMode::all(), 10, ConsumerType::kSingle});
    loops::repeat(
        pair, 6, [](int& s) { return s++; }, 0, rings);
    test::Rescue ring_guard(10s, [&] { (void)rings.drain(); });
    CHECK(contains(error_of([&] {
                     loops::repeat(
                         pair, 5, [](int& s) { return s; }, 0, rings);
                   }),
                   "outfeed capacity 10 per replica < 6 entries already in replica 0's ring "
                   "(unread, from an earlier run) + 5 entries this run delivers to each "
                   "replica"));
    CHECK_FALSE(ring_guard.fired());
    ring_guard.disarm();
    CHECK(rings.drain().size() == 12);
    loops::repeat(
        pair, 10, [](int& s) { return s; }, 0, rings);  // read: room for 10 again
    CHECK(rings.drain().size() == 20);
  }
  // A lane can feed one loop at a time.
  InfeedQueue<int> in;
  auto first = loops::repeat_async(
      device, 1, [](int&, int&) {}, 0, in);
  CHECK(contains(error_of([&] {
                   loops::repeat_async(
                       device, 1, [](int&, int&) {}, 0, in);
                 }),
                 "already has a reader"));
  first.cancel();
  CHECK(first.get().status == RunStatus::kCancelled);
  Run<int> empty;
  CHECK(contains(error_of([&] { empty.get(); }), "empty Run"));
}

TEST_CASE("a prefetch buffer that does not fit the device memory is an out-of-memory error") {
  Device device(0, DeviceConfig{4, 1024});                             // 4 KiB
  InfeedQueue<std::array<char, 512>> infeed(InfeedConfig{1, 64, 16});  // 8 KiB of prefetch
  try {
    loops::repeat(
        device, 1, [](int&, std::array<char, 512>&) {}, 0, infeed);
    FAIL("expected OutOfMemoryError");
  } catch (const OutOfMemoryError& e) {
    CHECK(contains(e.what(), "infeed prefetch buffer (replica 0)"));
    CHECK(contains(e.what(), "device 0"));
  }
  CHECK(device.arena().used() == 0);
  // ...and the lane was released: a loop that fits can use it.
  InfeedQueue<std::array<char, 512>> fits(InfeedConfig{1, 64, 2});
  fits.close();
  CHECK(loops::repeat(
            device, 3, [](int&, std::array<char, 512>&) {}, 0, fits)
            .end_of_data());
}

TEST_SUITE_END();
