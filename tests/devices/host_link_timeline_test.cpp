// devices/: HostLinkTimeline (bspflow/devices/host_link_timeline.hpp): stream copies timed by
// the link model, waited for without I/O tiles and overlapped with compute with them, the
// counters, the I/O tiles' room, a stop while waiting. Durations are asserted only as lower
// bounds (the machine may be slower, never faster, than the model) or, where the model says
// the device does not wait at all, as exactly no wait.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <string>
#include <thread>

#include <bspflow/base/detail/wait.hpp>
#include <bspflow/devices/host_link_timeline.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::contains;
using test::error_of;

namespace {

// A host link on which one copy of `bytes` takes `per_copy`, with `io_tiles` of 16 KiB.
HostLinkTimeline::Shape shape(std::chrono::nanoseconds per_copy, std::size_t bytes,
                              std::uint32_t io_tiles = 0, std::uint32_t prefetch = 1) {
  HostLinkTimeline::Shape s;
  s.host_io.host_link = LinkModel::taking(per_copy, bytes);
  s.host_io.io_tiles = io_tiles;
  s.host_io.prefetch_depth = prefetch;
  s.bytes_per_tile = 16 * 1024;
  return s;
}

// A link that takes about 10 s per copy: long enough that only a stop ends the wait.
HostLinkTimeline::Shape slow_shape(std::uint32_t io_tiles) {
  HostLinkTimeline::Shape s;
  s.host_io.host_link = LinkModel{1e3, 0ns};  // 1 kB/s
  s.host_io.io_tiles = io_tiles;
  s.bytes_per_tile = 16 * 1024;
  return s;
}

}  // namespace

TEST_SUITE_BEGIN("host_link_timeline");

TEST_CASE("without I/O tiles each copy in and out takes the link model's time, waited for") {
  HostLinkTimeline::Shape s;
  s.host_io.host_link = LinkModel{1e9, 200us};  // 800 kB: 200 us latency + 800 us
  const std::size_t bytes = 800'000;
  const std::chrono::nanoseconds per_copy = s.host_io.host_link.duration(bytes);
  REQUIRE(per_copy == 1ms);
  HostLinkTimeline link(s);
  const auto t0 = Clock::now();
  link.start(t0);
  for (int i = 0; i < 3; ++i) CHECK(link.copy_in(bytes, false, nullptr));
  CHECK(Clock::now() - t0 >= 3 * per_copy);  // one link: the copies follow one another
  CHECK(link.waited() >= 3 * per_copy);      // and the device waited for each
  for (int i = 0; i < 2; ++i) CHECK(link.copy_out(bytes / 2, nullptr));
  CHECK(Clock::now() - t0 >= 3 * per_copy + 2 * s.host_io.host_link.duration(bytes / 2));
  CHECK(link.waited() >= 3 * per_copy + 2 * 600us);
  // Nothing is left in flight: finish_out returns at once and waits for nothing.
  const std::chrono::nanoseconds before = link.waited();
  CHECK(link.finish_out(nullptr));
  CHECK(link.waited() == before);
  CHECK(link.copies_in() == 3);
  CHECK(link.bytes_in() == 3 * bytes);
  CHECK(link.copies_out() == 2);
  CHECK(link.bytes_out() == bytes);
}

TEST_CASE("with I/O tiles a copy in overlaps compute: after enough compute, no wait at all") {
  const std::chrono::nanoseconds per_copy = 2ms;
  HostLinkTimeline link(shape(per_copy, 4096, 2));
  link.start(Clock::now());
  for (int i = 0; i < 3; ++i) {
    // The device computes; meanwhile the I/O tiles copy the next element.
    std::this_thread::sleep_for(3 * per_copy);
    CHECK(link.copy_in(4096, false, nullptr));
  }
  CHECK(link.waited() == 0ns);
  CHECK(link.copies_in() == 3);
  CHECK(link.bytes_in() == 3 * 4096);
  // The same compute without I/O tiles: every copy is waited for.
  HostLinkTimeline plain(shape(per_copy, 4096, 0));
  plain.start(Clock::now());
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(3 * per_copy);
    CHECK(plain.copy_in(4096, false, nullptr));
  }
  CHECK(plain.waited() >= 3 * per_copy);
}

TEST_CASE("with I/O tiles prefetch_depth elements are copied ahead, the next when a buffer frees") {
  const std::chrono::nanoseconds per_copy = 2ms;
  SUBCASE("prefetch_depth 2: both elements were copied while the device computed") {
    HostLinkTimeline link(shape(per_copy, 4096, 2, 2));
    link.start(Clock::now());
    std::this_thread::sleep_for(3 * per_copy);  // longer than both copies, one after the other
    CHECK(link.copy_in(4096, false, nullptr));
    CHECK(link.copy_in(4096, false, nullptr));
    CHECK(link.waited() == 0ns);
  }
  SUBCASE("prefetch_depth 1: the second copy starts when the first element is consumed") {
    HostLinkTimeline link(shape(per_copy, 4096, 2, 1));
    link.start(Clock::now());
    std::this_thread::sleep_for(3 * per_copy);
    const auto consumed = Clock::now();
    CHECK(link.copy_in(4096, false, nullptr));  // copied during compute: no wait
    CHECK(link.waited() == 0ns);
    CHECK(link.copy_in(4096, false, nullptr));  // its one buffer was busy until then
    CHECK(Clock::now() - consumed >= per_copy);
  }
}

TEST_CASE("with I/O tiles an element that found its lane empty is copied from then on") {
  const std::chrono::nanoseconds per_copy = 2ms;
  HostLinkTimeline link(shape(per_copy, 4096, 2, 4));
  link.start(Clock::now());
  std::this_thread::sleep_for(3 * per_copy);  // compute, but the host had nothing to copy yet
  const auto t = Clock::now();
  CHECK(link.copy_in(4096, true, nullptr));
  CHECK(Clock::now() - t >= per_copy);
  CHECK(link.waited() >= per_copy);
}

TEST_CASE("with I/O tiles outputs are handed over without a wait until every buffer is in flight") {
  const std::chrono::nanoseconds per_copy = 5ms;
  HostLinkTimeline link(shape(per_copy, 4096, 2, 2));
  const auto t0 = Clock::now();
  link.start(t0);
  CHECK(link.copy_out(4096, nullptr));
  CHECK(link.copy_out(4096, nullptr));
  CHECK(link.waited() == 0ns);    // two buffers, two outputs: neither waited for
  CHECK(link.copies_out() == 2);  // counted when handed to the I/O tiles
  CHECK(link.bytes_out() == 2 * 4096);
  // The third waits for the first buffer: its copy ended one copy's time after the start.
  CHECK(link.copy_out(4096, nullptr));
  CHECK(Clock::now() - t0 >= per_copy);
  // finish_out waits for the copies still in flight: three, one after the other.
  CHECK(link.finish_out(nullptr));
  CHECK(Clock::now() - t0 >= 3 * per_copy);
  CHECK(link.copies_out() == 3);
}

TEST_CASE("a device that shares its core waits as long (it yields instead of spinning)") {
  HostLinkTimeline::Shape s = shape(1ms, 4096);
  s.shares_core = true;
  HostLinkTimeline link(s);
  const auto t0 = Clock::now();
  link.start(t0);
  CHECK(link.copy_in(4096, false, nullptr));
  CHECK(link.copy_out(4096, nullptr));
  CHECK(Clock::now() - t0 >= 2ms);
  CHECK(link.waited() >= 2ms);
}

TEST_CASE("a copy that costs nothing is counted without waiting") {
  HostLinkTimeline::Shape s;
  s.host_io.host_link = LinkModel{1e9, 0ns};  // no latency: zero bytes take no time
  HostLinkTimeline link(s);
  link.start(Clock::now());
  StopFlag stop;
  stop.set();  // nothing to wait for, so a stop changes nothing
  CHECK(link.copy_in(0, false, &stop));
  CHECK(link.copy_out(0, &stop));
  CHECK(link.copies_in() == 1);
  CHECK(link.copies_out() == 1);
  CHECK(link.bytes_in() == 0);
  CHECK(link.waited() == 0ns);
}

TEST_CASE(
    "copies shorter than the clock reads that would time them are not waited for one by one") {
  // 4 bytes at 1e15 B/s: 1 ns each, far less than this device takes to ask for the next, so
  // the link never backs up by kShortestRealWait and no copy is waited for (each wait would
  // have read the clock twice more: 20-40 ns each on a VM, for a 1 ns copy).
  for (const std::uint32_t io_tiles : {0u, 2u}) {
    CAPTURE(io_tiles);
    HostLinkTimeline::Shape s;
    s.host_io.host_link = LinkModel{1e15, 0ns};
    s.host_io.io_tiles = io_tiles;
    s.host_io.prefetch_depth = 2;
    s.bytes_per_tile = 1024;
    HostLinkTimeline link(s);
    link.start(Clock::now());
    for (int i = 0; i < 10'000; ++i) {
      CHECK(link.copy_in(4, false, nullptr));
      CHECK(link.copy_out(4, nullptr));
    }
    CHECK(link.copies_in() == 10'000);
    CHECK(link.copies_out() == 10'000);
    CHECK(link.bytes_out() == 40'000);
    CHECK(link.waited() == 0ns);
  }
}

TEST_CASE("start() zeroes the counters and empties the link and its I/O-tile buffers") {
  HostLinkTimeline link(shape(50ms, 1000, 2, 2));  // 500 bytes: 25 ms
  link.start(Clock::now());
  CHECK(link.copy_in(1000, true, nullptr));
  CHECK(link.copy_out(500, nullptr));
  CHECK(link.copy_out(500, nullptr));  // both output buffers busy, for 25 and 50 ms
  REQUIRE(link.waited() > 0ns);
  link.start(Clock::now());
  CHECK(link.bytes_in() == 0);
  CHECK(link.bytes_out() == 0);
  CHECK(link.copies_in() == 0);
  CHECK(link.copies_out() == 0);
  CHECK(link.waited() == 0ns);
  // The buffers are free again: the next output is handed over without waiting for one.
  CHECK(link.copy_out(500, nullptr));
  CHECK(link.waited() == 0ns);
  CHECK(link.shape().host_io.io_tiles == 2);
  CHECK(link.shape().bytes_per_tile == 16 * 1024);
}

TEST_CASE("I/O tiles that cannot hold prefetch_depth elements: an error naming device and sizes") {
  HostLinkTimeline::Shape s = shape(10us, 1024, 2, 3);  // 2 x 16 KiB = 32 KiB of I/O tiles
  s.device = 5;
  s.element = "a micro-batch";
  HostLinkTimeline link(s);
  link.start(Clock::now());
  const std::string err =
      error_of([&] { link.copy_in(12 * 1024, false, nullptr); });  // 3 x 12 KiB > 32 KiB
  CHECK(contains(err, "the I/O tiles of device 5 (2 x 16.0 KiB = 32.0 KiB)"));
  CHECK(contains(err, "cannot hold prefetch_depth 3 x a micro-batch of 12.0 KiB"));
  CHECK(contains(err, "raise io_tiles or lower prefetch_depth"));
  CHECK(link.copies_in() == 0);  // refused, not counted
  CHECK(link.bytes_in() == 0);
  // An element small enough that prefetch_depth of them fit the room is copied.
  const std::size_t fits = (32 * 1024) / 3;
  CHECK(link.copy_in(fits, false, nullptr));
  CHECK(link.bytes_in() == fits);
  // Without I/O tiles there is no such room to fill: any size is copied.
  HostLinkTimeline plain(shape(10us, 1024, 0, 3));
  plain.start(Clock::now());
  CHECK(plain.copy_in(64 * 1024, false, nullptr));
  CHECK(plain.bytes_in() == 64 * 1024);
}

TEST_CASE("a stop while waiting for the link: false at once, the copy not counted") {
  SUBCASE("copy in, no I/O tiles") {
    HostLinkTimeline link(slow_shape(0));
    link.start(Clock::now());
    StopFlag stop;
    auto copy = std::async(std::launch::async, [&] { return link.copy_in(10'000, false, &stop); });
    std::this_thread::sleep_for(20ms);
    stop.set();
    REQUIRE(copy.wait_for(5s) == std::future_status::ready);  // liveness: the copy models 10 s
    CHECK_FALSE(copy.get());
    CHECK(link.copies_in() == 0);
    CHECK(link.bytes_in() == 0);
    CHECK(link.waited() > 0ns);
  }
  SUBCASE("copy out, no I/O tiles") {
    HostLinkTimeline link(slow_shape(0));
    link.start(Clock::now());
    StopFlag stop;
    auto copy = std::async(std::launch::async, [&] { return link.copy_out(10'000, &stop); });
    std::this_thread::sleep_for(20ms);
    stop.set();
    REQUIRE(copy.wait_for(5s) == std::future_status::ready);
    CHECK_FALSE(copy.get());
    CHECK(link.copies_out() == 0);
    CHECK(link.bytes_out() == 0);
  }
  SUBCASE("finish_out with I/O tiles") {
    HostLinkTimeline link(slow_shape(2));
    link.start(Clock::now());
    StopFlag stop;
    CHECK(link.copy_out(10'000, &stop));  // handed to the I/O tiles: no wait
    auto finish = std::async(std::launch::async, [&] { return link.finish_out(&stop); });
    std::this_thread::sleep_for(20ms);
    stop.set();
    REQUIRE(finish.wait_for(5s) == std::future_status::ready);
    CHECK_FALSE(finish.get());
  }
  SUBCASE("a stop set before the call") {
    HostLinkTimeline link(slow_shape(0));
    link.start(Clock::now());
    StopFlag stop;
    stop.set();
    const auto t0 = Clock::now();
    CHECK_FALSE(link.copy_in(10'000, false, &stop));
    CHECK(Clock::now() - t0 < 5s);
    CHECK(link.copies_in() == 0);
  }
}

TEST_SUITE_END();
