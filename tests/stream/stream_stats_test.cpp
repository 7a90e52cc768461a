// A served Stream's stats (bspflow/stream/stream_serving.hpp's StreamStats): the counts, by
// error kind and refusal, per stage and per replica, equal to the responses the client saw;
// and the OpenMetrics and .hgrm writers.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_clean;
using test::contains;
using test::Drive;
using test::plus1;
using test::run_clients;
using test::Tally;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_stats");

TEST_CASE("stats equal the responses seen; OpenMetrics and .hgrm writers") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<U64>(group)
                    .stage("check",
                           [](U64 x) {
                             if (x % 10 == 3) throw std::invalid_argument("malformed");
                             return x;
                           })
                    .stage("model", plus1)
                    .build();
  stream.start();
  auto c = stream.client();
  constexpr U64 kPast = 3;
  for (U64 i = 0; i < kPast; ++i) {
    CHECK(c.push(i, StreamClock::now() - 1s).refusal == Refusal::kDeadlinePassed);
  }
  const U64 n = 1000;
  bool latencies = true;
  const auto tallies = run_clients(
      stream, 1, Drive{.requests = n, .window = 64}, [](int, U64 i) { return i; },
      [&](int, U64 i, const Response<U64>& r) {
        latencies = latencies && r.latency > std::chrono::nanoseconds(0);
        if (i % 10 == 3) return !r.ok() && r.kind() == ErrorKind::kStageFailed;
        return r.ok() && *r.value == i + 1;
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  check_clean(tallies);
  const Tally& t = tallies[0];
  CHECK(latencies);
  const StreamStats st = stream.stats();
  CHECK(st.accepted == n);
  CHECK(st.answered == t.answered);
  CHECK(st.ok == t.ok);
  CHECK(st.ok + std::accumulate(st.errors.begin(), st.errors.end(), U64{0}) == st.answered);
  for (const ErrorKind k : {ErrorKind::kStageFailed, ErrorKind::kDeadlineExceeded,
                            ErrorKind::kRejected, ErrorKind::kCancelled}) {
    CAPTURE(to_string(k));
    CHECK(st.errors_of(k) == t.errors_of(k));
  }
  CHECK(st.errors_of(ErrorKind::kStageFailed) == n / 10);
  CHECK(st.latency_ns.count() == st.answered);
  CHECK(st.refused(Refusal::kDeadlinePassed) == kPast);
  CHECK(st.refused() == kPast);
  CHECK(st.queued == 0);
  REQUIRE(st.stages.size() == 2);
  CHECK(st.stages[0].name == "check");
  CHECK(st.stages[1].name == "model");
  CHECK_FALSE(st.stages[0].batched);
  CHECK(st.stages[0].calls == n);
  CHECK(st.stages[1].calls == n - n / 10);  // failed requests skip later stages
  CHECK(st.stages[0].service_ns.count() == st.stages[0].calls);
  CHECK(st.stages[1].service_ns.count() == st.stages[1].calls);
  CHECK(st.stages[0].stalls == 0);
  REQUIRE(st.replicas.size() == 1);
  CHECK(st.replicas[0].taken == n);
  CHECK(st.replicas[0].answered == n);
  CHECK_FALSE(st.replicas[0].stalled);
  CHECK_FALSE(st.replicas[0].failed);
  CHECK(r.accepted == n);
  CHECK(r.answered == n);
  CHECK(r.errors == n / 10);
  CHECK(r.refused == kPast);

  std::ostringstream metrics;
  st.write_openmetrics(metrics);
  const std::string text = metrics.str();
  CHECK(contains(text, "# TYPE bspflow_stream_"));
  CHECK(contains(text, "_bucket{"));  // the histograms
  CHECK_FALSE(contains(text, "# EOF"));
  std::ostringstream labelled;
  st.write_openmetrics(labelled, "svc", MetricLabels{{"model", "m1"}});
  CHECK(contains(labelled.str(), "# TYPE svc_"));
  CHECK(contains(labelled.str(), "model=\"m1\""));
  CHECK_FALSE(contains(labelled.str(), "bspflow_stream_"));
  std::ostringstream bad;
  CHECK_THROWS_AS(st.write_openmetrics(bad, "9 bad"), Error);
  std::ostringstream hgrm;
  st.write_latency_hgrm(hgrm);
  CHECK(contains(hgrm.str(), "Percentile"));
}

TEST_SUITE_END();
