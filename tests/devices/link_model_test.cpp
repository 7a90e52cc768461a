// devices/: LinkModel (bspflow/devices/link_model.hpp): latency + bytes / bandwidth, validated.
#include <doctest/doctest.h>

#include <chrono>

#include <bspflow/devices/link_model.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;

TEST_SUITE("link_model") {

TEST_CASE("link model: latency + bytes / bandwidth, validated") {
  const LinkModel l{1e9, 2us};
  CHECK(l.duration(1000) == 3us);
  CHECK(LinkModel::taking(100us, 4096).duration(4096) == 100us);
  CHECK(LinkModel::taking(100us, 4096).duration(2048) == 50us);
  CHECK(contains(error_of([] { LinkModel{0, 0ns}.validate("host link"); }), "host link bandwidth"));
  CHECK(contains(error_of([] { LinkModel{1e9, -1ns}.validate("host link"); }), "host link latency"));
  CHECK(contains(LinkModel::host().describe(), "GB/s"));
}

}  // TEST_SUITE
