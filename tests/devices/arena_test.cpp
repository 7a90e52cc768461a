// devices/: Arena (bspflow/devices/arena.hpp): named allocations, release and coalescing, and
// out-of-memory errors (OutOfMemoryError) that say who holds the memory.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <bspflow/devices/arena.hpp>
#include <bspflow/devices/device_error.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("arena");

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
  arena.release(nullptr);                          // ignored
  int not_ours = 0;
  arena.release(&not_ours);  // ignored
}

TEST_CASE("arena: released bookkeeping is used again, with the right names and blocks") {
  // release() keeps the map nodes it takes out and allocate() uses them again (a buffer made
  // and freed with every run costs no heap allocation): names of any length, sizes and
  // coalescing must come out as with fresh nodes, through more cycles than nodes kept.
  Arena arena(64 * 1024, 0, "device 1");
  const std::string long_name(100, 'x');  // longer than the room any earlier name left
  for (int round = 0; round < 12; ++round) {
    const std::string name = round % 3 == 2 ? long_name : "buffer " + std::to_string(round);
    std::vector<void*> held;
    for (int i = 0; i < 1 + round % 6; ++i) {
      held.push_back(arena.allocate(64 * static_cast<std::size_t>(1 + i), name));
    }
    const auto allocs = arena.allocations();
    REQUIRE(allocs.size() == held.size());
    for (const auto& a : allocs) CHECK(a.name == name);
    CHECK(arena.used() == 64 * held.size() * (held.size() + 1) / 2);
    // Released out of order: the free blocks must coalesce back into one.
    for (std::size_t i = 0; i < held.size(); i += 2) arena.release(held[i]);
    for (std::size_t i = 1; i < held.size(); i += 2) arena.release(held[i]);
    CHECK(arena.used() == 0);
    CHECK(arena.largest_free_block() == arena.capacity());
    CHECK(arena.allocations().empty());
  }
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

TEST_SUITE_END();
