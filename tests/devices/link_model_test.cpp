// devices/: LinkModel (bspflow/devices/link_model.hpp): latency + bytes / bandwidth, validated.
#include <doctest/doctest.h>

#include <chrono>

#include <bspflow/devices/link_model.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("link_model");

TEST_CASE("link model: latency + bytes / bandwidth, validated") {
  const LinkModel l{1e9, 2us};
  CHECK(l.duration(1000) == 3us);
  CHECK(LinkModel::taking(100us, 4096).duration(4096) == 100us);
  CHECK(LinkModel::taking(100us, 4096).duration(2048) == 50us);
  CHECK(contains(error_of([] {
                   LinkModel{0, 0ns}.validate("host link");
                 }),
                 "host link bytes_per_second = 0 is not allowed"));
  CHECK(contains(error_of([] {
                   LinkModel{1e9, -1ns}.validate("host link");
                 }),
                 "host link latency"));
  CHECK(contains(LinkModel::host().describe(), "GB/s"));
}

TEST_CASE(
    "ring all-reduce: 2(R-1) steps of ceil(bytes/R) each; nothing for one replica or no bytes") {
  const LinkModel l{1e9, 1us};
  // 2 replicas, 4000 bytes: 2 steps of 2000 bytes = 2 x (1 us + 2 us).
  CHECK(l.ring_allreduce(4000, 2) == 6us);
  // 4 replicas, 4000 bytes: 6 steps of 1000 bytes = 6 x (1 us + 1 us).
  CHECK(l.ring_allreduce(4000, 4) == 12us);
  // 3 replicas, 10 bytes: 4 steps of 4 bytes (rounded up) = 4 x (1 us + 4 ns).
  CHECK(l.ring_allreduce(10, 3) == 4 * (1us + 4ns));
  // The bandwidth term is 2(R-1)/R x bytes / bandwidth: 8 replicas, 8 MB at 1 GB/s, no latency.
  CHECK(LinkModel{1e9, 0ns}.ring_allreduce(8'000'000, 8) == 14ms);
  CHECK(l.ring_allreduce(4000, 1) == 0ns);
  CHECK(l.ring_allreduce(0, 4) == 0ns);
}

TEST_SUITE_END();
