// Deadlines on served requests (bspflow/stream/request.hpp's Deadline): a deadline already
// past refused at push, and a queued request whose deadline passes answered
// kDeadlineExceeded without running, the earliest deadline served first.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "serve_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::patience;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_deadline");

TEST_CASE("deadlines: an expired request is answered kDeadlineExceeded without running") {
  DeviceGroup group(1);
  std::atomic<int> calls{0};
  // predict off: the expiry must be the stage's, not admission's.
  auto stream = StreamBuilder<U64>(group, StreamConfig{.admission = {.predict = false}})
                    .stage("slow",
                           [&calls](U64 x) {
                             ++calls;
                             std::this_thread::sleep_for(x == 0 ? 30ms : 5ms);
                             return x + 1;
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  const auto t0 = StreamClock::now();
  // A deadline already past is refused at push; nothing is queued.
  const Submission past = c.push(99, t0 - 1ms);
  CHECK_FALSE(past.accepted());
  CHECK(past.refusal == Refusal::kDeadlinePassed);
  CHECK(c.outstanding() == 0);
  REQUIRE(c.push(0).accepted());  // no deadline: holds the stage 30 ms
  // Once the stage runs it: the queue serves the earliest deadline first, and a request with
  // no deadline after the others.
  while (calls.load() == 0) std::this_thread::yield();
  const auto t1 = StreamClock::now();
  // Due 10 ms after t1: the stage takes them 30 ms after t1 at the earliest.
  std::vector<Submission> near;
  for (U64 i = 1; i <= 5; ++i) near.push_back(c.push(i, t1 + 10ms));
  REQUIRE(c.push(6).accepted());  // no deadline: runs
  std::uint64_t near_accepted = 0, near_refused = 0;
  for (const Submission& s : near) {
    if (s.accepted()) {
      ++near_accepted;
    } else {
      ++near_refused;  // only if this thread was held 10 ms between t0 and the push
      CHECK(s.refusal == Refusal::kDeadlinePassed);
    }
  }
  CHECK(near_accepted >= 1);
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 2 + near_accepted);
  CHECK(got.front().ok());
  CHECK(*got.front().value == 1);
  CHECK(got.back().ok());
  CHECK(*got.back().value == 7);
  for (std::size_t i = 1; i + 1 < got.size(); ++i) {
    CAPTURE(i);
    REQUIRE_FALSE(got[i].ok());
    CHECK(got[i].kind() == ErrorKind::kDeadlineExceeded);
    CHECK(got[i].error->stage_name == "slow");
  }
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(calls.load() == 2);  // the expired ones never ran
  const StreamStats st = stream.stats();
  CHECK(st.errors_of(ErrorKind::kDeadlineExceeded) == near_accepted);
  CHECK(st.refused(Refusal::kDeadlinePassed) == 1 + near_refused);
  CHECK(r.refused == 1 + near_refused);
}

TEST_SUITE_END();
