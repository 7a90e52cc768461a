// The errors a user can make serving with a Stream, each naming the problem: a batch stage
// not first on its device, replicas that do not divide the devices, a stage's device outside
// its replica, bad batch configs, pushes to a stream that is not serving; and the names of
// the error kinds and refusals.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;
using test::patience;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_serve_errors");

TEST_CASE("serving errors name the problem") {
  DeviceGroup group(2);
  auto id = [](U64 x) { return x; };
  auto twice = [](std::span<U64> b) { return std::vector<U64>(b.begin(), b.end()); };
  // A batch stage must be the first stage on its device (it forms batches from its input).
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group)
                      .stage("pre", id, 0)
                      .batch_stage("model", twice, BatchConfig{}, 0)
                      .build(),
                  Error);
  CHECK_NOTHROW((void)StreamBuilder<U64>(group)
                    .stage("pre", id, 0)
                    .batch_stage("model", twice, BatchConfig{}, 1)
                    .build());
  // Replicas must divide the devices.
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<U64>(group, StreamConfig{.replicas = 3}).stage("a", id).build();
      }),
      "replicas"));
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<U64>(group, StreamConfig{.replicas = 0}).stage("a", id).build();
      }),
      "replicas"));
  // A stage's device counts within its replica: 2 replicas of 2 devices have device 0 only.
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group, StreamConfig{.replicas = 2})
                      .stage("a", id, 0)
                      .stage("b", id, 1)
                      .build(),
                  Error);
  // Batch configs.
  CHECK(contains(error_of([] { BatchConfig{.max_batch = 0}.validate(); }), "max_batch"));
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group)
                      .batch_stage("model", twice, BatchConfig{.max_batch = 0})
                      .build(),
                  Error);
  CHECK(contains(error_of([] {
                   BatchConfig{.max_batch = 4, .allowed_sizes = {4, 2}}.validate();
                 }),
                 "allowed_sizes"));
  CHECK_THROWS_AS((BatchConfig{.max_batch = 8, .allowed_sizes = {1, 2, 4}}.validate()), Error);
  CHECK_NOTHROW((BatchConfig{.max_batch = 8, .allowed_sizes = {1, 2, 4, 8}}.validate()));
  const BatchConfig sizes{.max_batch = 8, .allowed_sizes = {1, 2, 4, 8}};
  CHECK(sizes.padded(1) == 1);
  CHECK(sizes.padded(3) == 4);
  CHECK(sizes.padded(5) == 8);
  CHECK(BatchConfig{}.padded(3) == 3);
  auto two = StreamBuilder<U64>(group, StreamConfig{.replicas = 2}).stage("a", id).build();
  // A stream that is not serving refuses pushes: kClosed.
  auto c = two.client();
  CHECK(c.push(1).refusal == Refusal::kClosed);
  two.start();
  CHECK(c.push(2).accepted());
  auto r = c.pop_until(StreamClock::now() + patience());
  REQUIRE(r.has_value());
  CHECK(*r->value == 2);
  two.close();
  CHECK(c.push(3).refusal == Refusal::kClosed);
  CHECK(two.wait().drained());
}

TEST_CASE("error kinds and refusals have names") {
  CHECK(std::string(to_string(ErrorKind::kStageFailed)) == "stage_failed");
  CHECK(std::string(to_string(ErrorKind::kDeadlineExceeded)) == "deadline_exceeded");
  CHECK(std::string(to_string(ErrorKind::kRejected)) == "rejected");
  CHECK(std::string(to_string(ErrorKind::kCancelled)) == "cancelled");
  CHECK(std::string(to_string(Refusal::kNone)) == "accepted");
  CHECK(std::string(to_string(Refusal::kQueueFull)) == "queue_full");
  CHECK(Submission{}.accepted());
  CHECK_FALSE(Submission{.refusal = Refusal::kShed}.accepted());
}

TEST_SUITE_END();
