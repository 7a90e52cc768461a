// devices/: Topology (bspflow/devices/topology.hpp): discovery, and placing devices on cores.
#include <doctest/doctest.h>

#include <sched.h>

#include <cstdlib>

#include <cstdint>
#include <string>
#include <vector>

#include <bspflow/devices/topology.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;

TEST_SUITE_BEGIN("topology");

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

TEST_CASE("placement keeps devices off the host's reserved cores") {
  const Topology& topo = Topology::get();
  const std::uint32_t cores = topo.cores();
  // Reserve core 0: devices take the others (sharing them when they outnumber them).
  if (cores >= 2) {
    auto ps = topo.place(cores, true, {0});
    for (const Placement& p : ps) {
      CHECK_FALSE(p.shares_host);
      if (p.core) CHECK(*p.core != 0);
    }
    CHECK(ps.back().sharing == 2);  // cores devices on cores - 1 cores: two share one
    CHECK(ps.back().shares_core());
  }
  // Every core reserved: devices must sit beside host threads, and know it.
  std::vector<std::uint32_t> all;
  for (std::uint32_t c = 0; c < cores; ++c) all.push_back(c);
  for (const Placement& p : topo.place(2, true, all)) {
    CHECK(p.shares_host);
    CHECK(p.shares_core());
  }
  // No reservation: nothing shares a host core.
  for (const Placement& p : topo.place(1)) CHECK_FALSE(p.shares_host);
  CHECK(contains(test::error_of([&] { (void)topo.place(1, true, {cores}); }),
                 "host core = " + std::to_string(cores) + " is not allowed: must be below"));
}

TEST_CASE("instances sharing a host take disjoint slices of its cores") {
  using V = std::vector<std::uint32_t>;
  CHECK(Topology::slice_for_instance(8, 0, 1) == V{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(Topology::slice_for_instance(8, 0, 2) == V{0, 1, 2, 3});
  CHECK(Topology::slice_for_instance(8, 1, 2) == V{4, 5, 6, 7});
  CHECK(Topology::slice_for_instance(8, 2, 3) == V{5, 6, 7});
  CHECK(Topology::slice_for_instance(2, 1, 2) == V{1});
  // More instances than cores: they share, round robin.
  CHECK(Topology::slice_for_instance(2, 2, 4) == V{0});
  CHECK(Topology::slice_for_instance(2, 3, 4) == V{1});
  for (std::uint32_t cores : {1u, 2u, 3u, 7u, 64u}) {
    for (std::uint32_t n = 1; n <= cores; ++n) {
      std::vector<int> owners(cores, 0);
      for (std::uint32_t i = 0; i < n; ++i) {
        const V mine = Topology::slice_for_instance(cores, i, n);
        CHECK_FALSE(mine.empty());
        for (std::uint32_t c : mine) ++owners[c];
      }
      for (int o : owners) CHECK(o == 1);  // every core, once
    }
  }
  CHECK_THROWS_WITH_AS(Topology::slice_for_instance(2, 2, 2),
                       doctest::Contains("local instance index = 2"), Error);
  // A plain process, unbound and not under mpirun: every core.
  const Topology& t = Topology::get();
  cpu_set_t mask;
  CPU_ZERO(&mask);
  const bool unbound = sched_getaffinity(0, sizeof mask, &mask) == 0 &&
                       static_cast<std::uint32_t>(CPU_COUNT(&mask)) >= t.pus();
  if (unbound && std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE") == nullptr) {
    CHECK(t.instance_cores().size() == t.cores());
    CHECK(t.instance_cores_reason().find("every core") != std::string::npos);
  }
  CHECK(t.instance_cores().size() <= t.cores());
  CHECK_FALSE(t.instance_cores_reason().empty());
  CHECK(t.describe().find("devices of this process") != std::string::npos);
}

TEST_SUITE_END();
