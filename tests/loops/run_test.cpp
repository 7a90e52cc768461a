// runtime/: the Run handle (bspflow/loops/run.hpp): cancelling it, dropping it, or destroying
// the device under it never hangs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <stop_token>
#include <thread>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::kSmall;

TEST_SUITE_BEGIN("run");

TEST_CASE("cancel, dropping the Run handle, or destroying the device never hangs") {
  InfeedQueue<int> in;  // never fed: the loop waits on it
  SUBCASE("cancel") {
    Device device(0, kSmall);
    auto run = loops::repeat_async(
        device, 10, [](int&, int&) {}, 0, in);
    CHECK_FALSE(run.wait_for(5ms));
    run.cancel();
    auto r = run.get();
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(contains(r.message, "cancelled"));
  }
  SUBCASE("dropping the handle cancels and waits") {
    Device device(0, kSmall);
    {
      auto run = loops::repeat_async(
          device, 10, [](int&, int&) {}, 0, in);
    }
    CHECK(device.arena().used() == 0);
  }
  SUBCASE("destroying the device cancels its run") {
    Run<int> run;
    {
      Device device(0, kSmall);
      run = loops::repeat_async(
          device, 10, [](int&, int&) {}, 0, in);
    }
    CHECK(run.get().status == RunStatus::kCancelled);
  }
}

TEST_CASE("a std::stop_token feed stops a loop: before the call it takes nothing") {
  // Guards: loops::repeat stops on its stop token, and a Run is stopped whether or not its
  // handle exists yet.
  Device device(0, kSmall);
  const std::uint64_t forever = std::uint64_t{1} << 40;
  auto body = [](int& sum, int& x) { sum += x; };
  for (const bool async : {false, true}) {
    CAPTURE(async);
    InfeedQueue<int> in;
    {
      auto p = in.make_producer();
      for (int i = 1; i <= 5; ++i) REQUIRE(p.push(i));
    }
    std::stop_source stop;
    stop.request_stop();
    const RepeatResult<int> r =
        async ? loops::repeat_async(device, forever, body, 0, in, stop.get_token()).get()
              : loops::repeat(device, forever, body, 0, stop.get_token(), in);
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(r.iterations.at(0) == 0);
    CHECK(r.state() == 0);
    CHECK(in.size_approx(0) == 5);  // every element still in its lane
    in.close();
    const RepeatResult<int> next = loops::repeat(device, forever, body, 0, in);  // untouched
    CHECK(next.status == RunStatus::kEndOfData);
    CHECK(next.state() == 15);
  }
}

TEST_CASE("a std::jthread running a loop stops it when it is destroyed (its stop token)") {
  Device device(0, kSmall);
  InfeedQueue<int> in;  // never fed: the loop waits on it until stopped
  std::optional<RepeatResult<int>> r;
  {
    // Closing the infeed would end a loop that ignored the token (kEndOfData, a failure below).
    test::Rescue guard(10s, [&] { in.close(); });
    {
      std::jthread worker([&](std::stop_token stop) {
        r = loops::repeat(
            device, std::uint64_t{1} << 40, [](int&, int&) {}, 0, in, stop);
      });
      while (device.arena().used() == 0) std::this_thread::yield();  // the loop has started
    }  // ~jthread: request_stop(), join()
    CHECK_FALSE(guard.fired());
  }
  REQUIRE(r.has_value());
  CHECK(r->status == RunStatus::kCancelled);
  // A stop requested after the end changes nothing, and the next loop is not affected.
  std::stop_source late;
  auto run = loops::repeat_async(
      device, 3, [](int& s) { ++s; }, 0, late.get_token());
  REQUIRE(run.wait_for(10s));
  late.request_stop();
  const RepeatResult<int> done = run.get();
  CHECK(done.completed());
  CHECK(done.state() == 3);
}

TEST_CASE("a run's shared state sits on whole cache lines, without aligned operator new") {
  // detail::CacheLineAllocator: what loops::repeat and Engine::run allocate their run state
  // with (glibc's aligned path is slow; this one aligns a plain block by hand).
  struct alignas(64) Padded {
    std::uint64_t word[3];
  };
  detail::CacheLineAllocator<Padded> alloc;
  for (std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{100}}) {
    Padded* p = alloc.allocate(n);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
    for (std::size_t i = 0; i < n; ++i) p[i].word[0] = p[i].word[2] = i;  // all of it is ours
    CHECK(p[n - 1].word[2] == n - 1);
    alloc.deallocate(p, n);
  }
  CHECK_THROWS_AS(alloc.allocate(std::numeric_limits<std::size_t>::max() / 32), std::bad_alloc);
  // allocate_shared rebinds it to its control block, over-aligned with the object inside.
  auto shared = std::allocate_shared<Padded>(detail::CacheLineAllocator<Padded>{});
  CHECK(reinterpret_cast<std::uintptr_t>(shared.get()) % 64 == 0);
  // A loop of one replica and one of three still record their ends and wait notes apart.
  for (std::uint32_t replicas : {1u, 3u}) {
    DeviceGroup group(replicas, kSmall);
    const RepeatResult<int> r = loops::repeat(
        group, 5, [](int& s) { ++s; }, 0);
    CHECK(r.completed());
    CHECK(r.states.size() == replicas);
    for (int s : r.states) CHECK(s == 5);
  }
}

TEST_CASE("the prefetch buffer's name is built for any replica number") {
  using Side = loops::detail::InfeedSide<InfeedQueue<int>>;
  CHECK(Side::buffer_name(0).view() == "infeed prefetch buffer (replica 0)");
  CHECK(Side::buffer_name(12).view() == "infeed prefetch buffer (replica 12)");
  CHECK(Side::buffer_name(4294967295u).view() == "infeed prefetch buffer (replica 4294967295)");
}

TEST_SUITE_END();
