// devices/: Topology, Arena, Device, DeviceGroup.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <bspflow/arena.hpp>
#include <bspflow/detail/wait.hpp>
#include <bspflow/device.hpp>
#include <bspflow/topology.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE("devices") {

TEST_CASE("topology is discovered once and describes the machine") {
  const Topology& a = Topology::get();
  const Topology& b = Topology::get();
  CHECK(&a == &b);
  CHECK(a.cores() >= 1);
  CHECK(a.pus() >= a.cores());
  CHECK(a.numa_nodes() >= 1);
  CHECK(contains(a.describe(), "core"));
}

TEST_CASE("placement: a core per device from the top, then sharing") {
  const Topology& topo = Topology::get();
  const std::uint32_t cores = topo.cores();
  auto one = topo.place(1);
  REQUIRE(one.size() == 1);
  CHECK(one[0].sharing == 1);
  if (topo.has_hwloc()) {
    REQUIRE(one[0].core.has_value());
    CHECK(*one[0].core == cores - 1);
  }
  auto many = topo.place(2 * cores);
  REQUIRE(many.size() == 2 * cores);
  for (const Placement& p : many) CHECK(p.sharing == 2);
  if (topo.has_hwloc()) {
    // Device i and device i + cores share a core.
    for (std::uint32_t i = 0; i < cores; ++i) CHECK(*many[i].core == *many[i + cores].core);
  }
  for (const Placement& p : topo.place(3, /*pin=*/false)) CHECK_FALSE(p.core.has_value());
}

TEST_CASE("arena: named allocations, release, coalescing") {
  Arena arena(64 * 1024, 0, "device 7");
  CHECK(arena.capacity() == 64 * 1024);
  void* a = arena.allocate(1000, "weights");
  void* b = arena.allocate(1, "bias");
  void* c = arena.allocate(4096, "activations");
  CHECK(a != b);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 64 == 0);
  CHECK(arena.used() == 1024 + 64 + 4096);
  auto allocs = arena.allocations();
  REQUIRE(allocs.size() == 3);
  CHECK(allocs[0].name == "activations");  // largest first
  // Memory is usable.
  std::memset(c, 0xab, 4096);
  arena.release(b);
  arena.release(a);
  arena.release(c);
  CHECK(arena.used() == 0);
  CHECK(arena.largest_free_block() == 64 * 1024);  // fully coalesced
  arena.release(nullptr);  // ignored
  int not_ours = 0;
  arena.release(&not_ours);  // ignored
}

TEST_CASE("arena out of memory says what was asked, what is free and who holds the rest") {
  Arena arena(16 * 1024, 0, "device 3");
  arena.allocate(8 * 1024, "weights");
  arena.allocate(4 * 1024, "optimiser state");
  try {
    arena.allocate(6 * 1024, "activations");
    FAIL("expected OutOfMemoryError");
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    CHECK(contains(msg, "device 3"));
    CHECK(contains(msg, "6.0 KiB for 'activations'"));
    CHECK(contains(msg, "4.0 KiB free of 16.0 KiB"));
    CHECK(contains(msg, "'weights' 8.0 KiB"));
    CHECK(contains(msg, "'optimiser state' 4.0 KiB"));
    CHECK(e.requested() == 6 * 1024);
    CHECK(e.free_bytes() == 4 * 1024);
  }
}

TEST_CASE("arena reports fragmentation when the free total would fit") {
  Arena arena(4 * 1024, 0, "device 0");
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(arena.allocate(1024, "block"));
  arena.release(blocks[0]);
  arena.release(blocks[2]);
  const std::string msg = error_of([&] { arena.allocate(2048, "big"); });
  CHECK(contains(msg, "fragmented"));
  CHECK(contains(msg, "'block' 2.0 KiB (2 allocations)"));
}

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
  detail::StopFlag stop;
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

}  // TEST_SUITE
