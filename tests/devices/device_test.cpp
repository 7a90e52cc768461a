// devices/: Device and DeviceGroup (bspflow/devices/device.hpp): config validation, jobs in
// order on the device's own pinned thread, cancel-and-join on destruction, more devices than
// cores.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <bspflow/base/detail/wait.hpp>
#include <bspflow/devices/device.hpp>
#include <bspflow/devices/topology.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("device");

TEST_CASE("device config is validated with the allowed range") {
  CHECK(contains(error_of([] { DeviceConfig{0}.validate(); }), "tiles = 0"));
  CHECK(contains(error_of([] { DeviceConfig{4, 8}.validate(); }), "bytes_per_tile = 8"));
  CHECK(DeviceConfig{}.memory_bytes() == std::size_t{1472} * 624 * 1024);
  CHECK(contains(error_of([] { DeviceGroup g(0); }), "device count = 0"));
}

TEST_CASE("a device runs jobs in order on its own, pinned thread") {
  Device device(5, DeviceConfig{16, 1024});
  CHECK(device.id() == 5);
  CHECK(device.arena().capacity() == 16 * 1024);
  if (Topology::get().has_hwloc()) {
    REQUIRE(device.placement().core.has_value());
    // Pinning can be refused by a restricted container; say so rather than fail.
    if (!device.pinned()) MESSAGE("hwloc present but the OS refused to pin the device thread");
    CHECK(device.pinned());
  } else {
    CHECK_FALSE(device.pinned());
  }
  std::vector<int> order;
  std::atomic<int> done{0};
  std::atomic<bool> on_thread{true};
  for (int i = 0; i < 50; ++i) {
    device.submit(DeviceJob{[&, i] {
                              order.push_back(i);
                              on_thread = on_thread && device.on_device_thread();
                              done.fetch_add(1);
                            },
                            {}});
  }
  while (done.load() < 50) std::this_thread::yield();
  CHECK(on_thread.load());
  std::vector<int> expect(50);
  for (int i = 0; i < 50; ++i) expect[i] = i;
  CHECK(order == expect);
}

TEST_CASE("destroying a device cancels its running and queued jobs, then joins") {
  StopFlag stop;
  detail::WaitPoint wp;
  std::atomic<int> ran{0};
  {
    Device device(0, DeviceConfig{8, 1024});
    auto job = DeviceJob{[&] {
                           wp.wait([&] { return stop.requested(); });
                           ran.fetch_add(1);
                         },
                         [&] {
                           stop.set();
                           wp.notify();
                         }};
    device.submit(job);
    device.submit(job);  // queued behind the first: runs and returns at once
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }  // must not hang
  CHECK(ran.load() == 2);
}

TEST_CASE("more devices than cores: they share cores and every one makes progress") {
  const std::uint32_t n = std::max<std::uint32_t>(4, 2 * Topology::get().cores());
  DeviceGroup group(n, DeviceConfig{8, 1024});
  CHECK(group.size() == n);
  CHECK(group.max_sharing() >= 2);
  // Each device waits for all the others (a spin-then-park rendezvous); with pure spinning
  // this would livelock on an oversubscribed machine.
  std::atomic<std::uint32_t> arrived{0};
  detail::WaitPoint wp;
  std::atomic<std::uint32_t> finished{0};
  std::atomic<bool> give_up{false};  // set by the group's destructor if the test fails
  for (auto& d : group) {
    d->submit(DeviceJob{[&] {
                          arrived.fetch_add(1);
                          wp.notify();
                          wp.wait([&] { return arrived.load() == n || give_up.load(); });
                          finished.fetch_add(1);
                        },
                        [&] {
                          give_up = true;
                          wp.notify();
                        }});
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (finished.load() < n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(finished.load() == n);
}

TEST_SUITE_END();
