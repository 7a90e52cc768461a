// devices/: Topology (bspflow/devices/topology.hpp): discovery, and placing devices on cores.
#include <doctest/doctest.h>

#include <cstdint>

#include <bspflow/devices/topology.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;

TEST_SUITE("topology") {

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

}  // TEST_SUITE
