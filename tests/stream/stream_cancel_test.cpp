// Cancelling a served request (StreamClient::cancel): a queued request is answered
// kCancelled and never runs, one running in a stage is dropped at the boundary to the next,
// and a request never sent or already answered cannot be cancelled.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "runtime_test_util.hpp"
#include "serve_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::Gate;
using test::patience;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_cancel");

TEST_CASE("cancel: a queued request is answered kCancelled and never runs") {
  DeviceGroup group(2);
  Gate gate;
  auto ran_a = std::make_shared<std::vector<U64>>();  // device 0's; read after wait()
  auto ran_b = std::make_shared<std::vector<U64>>();  // device 1's
  auto stream = StreamBuilder<U64>(group)
                    .stage("a",
                           [&gate, ran_a](U64 x) {
                             ran_a->push_back(x);
                             if (x == 0) gate.hold();
                             return x;
                           })
                    .stage("b",
                           [ran_b](U64 x) {
                             ran_b->push_back(x);
                             return x + 100;
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  const Submission first = c.push(0);
  REQUIRE(first.accepted());
  REQUIRE(gate.wait_entered());  // request 0 is held in stage a
  std::vector<Submission> queued;
  for (U64 i = 1; i <= 6; ++i) {
    queued.push_back(c.push(i));
    REQUIRE(queued.back().accepted());
  }
  CHECK(c.cancel(queued[1].id));                   // 2
  CHECK(c.cancel(queued[3].id));                   // 4
  CHECK(c.cancel(queued[4].id));                   // 5
  CHECK(c.cancel(first.id));                       // running in a: dropped at the boundary to b
  CHECK_FALSE(c.cancel(RequestId{c.id(), 1000}));  // never sent
  gate.open = true;
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 7);
  const std::set<U64> cancelled{0, 2, 4, 5};
  for (U64 i = 0; i < 7; ++i) {
    CAPTURE(i);
    CHECK(got[i].id.sequence == (i == 0 ? first.id.sequence : queued[i - 1].id.sequence));
    if (cancelled.count(i) != 0) {
      REQUIRE_FALSE(got[i].ok());
      CHECK(got[i].kind() == ErrorKind::kCancelled);
    } else {
      REQUIRE(got[i].ok());
      CHECK(*got[i].value == i + 100);
    }
  }
  CHECK_FALSE(c.cancel(queued[0].id));  // answered already
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == 7);
  CHECK(*ran_a == std::vector<U64>{0, 1, 3, 6});  // the queued cancelled ones never ran
  CHECK(*ran_b == std::vector<U64>{1, 3, 6});     // nor did the held one after its cancel
  CHECK(stream.stats().errors_of(ErrorKind::kCancelled) == 4);
}

TEST_SUITE_END();
