// runtime/: the prometheus-cpp adapter (bspflow/stream/prometheus_stream.hpp; built only when
// prometheus-cpp is found): a served stream's families, counts and histograms as Collect()
// returns them, the same names and samples as StreamStats::write_openmetrics in prometheus-cpp's
// text, and the names it refuses.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/prometheus_stream.hpp>
#include <bspflow/stream/stream.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace {

using U64 = std::uint64_t;

const prometheus::MetricFamily& family(const std::vector<prometheus::MetricFamily>& all,
                                       const std::string& name) {
  for (const auto& f : all) {
    if (f.name == name) return f;
  }
  throw std::runtime_error("no family " + name);
}

std::string label_of(const prometheus::ClientMetric& m, const std::string& name) {
  for (const auto& l : m.label) {
    if (l.name == name) return l.value;
  }
  return "<none>";
}

}  // namespace

TEST_SUITE_BEGIN("prometheus_stream");

TEST_CASE("a served stream's stats as prometheus-cpp families, named as the OpenMetrics writer") {
  DeviceGroup group(2);
  auto stream =
      StreamBuilder<U64>(group)
          .stage("check",
                 [](U64 x) {
                   if (x % 10 == 3) throw std::invalid_argument("malformed");
                   return x;
                 })
          .batch_stage(
              "model",
              [](std::span<U64> batch) { return std::vector<U64>(batch.begin(), batch.end()); },
              BatchConfig{.max_batch = 4})
          .build();
  const auto metrics = collect_stream(stream, "svc", {{"model", "m1"}});
  CHECK(metrics->Collect().size() == 15);  // before the run: every family, zero counts
  stream.start();
  auto client = stream.client();
  CHECK(client.push(0, StreamClock::now() - 1s).refusal == Refusal::kDeadlinePassed);
  const U64 n = 200;
  U64 answered = 0;
  for (U64 i = 0; i < n; ++i) {
    REQUIRE(client.push(i).accepted());
    if (client.outstanding() >= 16 && client.pop()) ++answered;
  }
  while (client.pop()) ++answered;
  stream.close();
  REQUIRE(stream.wait().drained());
  const StreamStats st = stream.stats();
  REQUIRE(st.answered == n);
  REQUIRE(answered == n);

  const std::vector<prometheus::MetricFamily> families = metrics->Collect();
  std::set<std::string> names;
  for (const auto& f : families) names.insert(f.name);
  CHECK(names == std::set<std::string>{"svc_requests_total", "svc_responses_total",
                                       "svc_refusals_total", "svc_queued", "svc_replica_stalled",
                                       "svc_replica_ejected", "svc_replica_ejections_total",
                                       "svc_replica_draining", "svc_ring_depth",
                                       "svc_stage_stalls_total", "svc_stage_version_calls_total",
                                       "svc_latency_seconds", "svc_stage_service_seconds",
                                       "svc_stage_queue_wait_seconds", "svc_stage_batch_size"});
  const auto& requests = family(families, "svc_requests_total");
  CHECK(requests.type == prometheus::MetricType::Counter);
  REQUIRE(requests.metric.size() == 1);
  CHECK(requests.metric[0].counter.value == static_cast<double>(n));
  CHECK(label_of(requests.metric[0], "model") == "m1");
  CHECK(label_of(requests.metric[0], "class") == "0");
  const auto& responses = family(families, "svc_responses_total");
  double total = 0;
  std::map<std::string, double> by_outcome;
  for (const auto& m : responses.metric) {
    total += m.counter.value;
    by_outcome[label_of(m, "outcome")] = m.counter.value;
  }
  CHECK(total == static_cast<double>(st.answered));
  CHECK(by_outcome["ok"] == static_cast<double>(st.ok));
  CHECK(by_outcome["stage_failed"] == static_cast<double>(n / 10));
  std::map<std::string, double> by_reason;
  for (const auto& m : family(families, "svc_refusals_total").metric) {
    by_reason[label_of(m, "reason")] = m.counter.value;
  }
  CHECK(by_reason.size() == kRefusals - 1);  // every reason but kNone
  CHECK(by_reason[to_string(Refusal::kDeadlinePassed)] == 1.0);

  const auto& latency = family(families, "svc_latency_seconds");
  CHECK(latency.type == prometheus::MetricType::Histogram);
  REQUIRE(latency.metric.size() == 1);
  const auto& h = latency.metric[0].histogram;
  CHECK(h.sample_count == st.answered);
  CHECK(h.sample_sum == doctest::Approx(static_cast<double>(st.latency_ns.sum()) / 1e9));
  REQUIRE(!h.bucket.empty());
  bool ascending = true;
  for (std::size_t i = 1; i < h.bucket.size(); ++i) {
    ascending = ascending && h.bucket[i].upper_bound > h.bucket[i - 1].upper_bound &&
                h.bucket[i].cumulative_count >= h.bucket[i - 1].cumulative_count;
  }
  CHECK(ascending);
  CHECK(h.bucket.back().cumulative_count <= h.sample_count);
  CHECK(h.bucket.front().upper_bound == doctest::Approx(1e-9));  // 1 ns
  const auto& service = family(families, "svc_stage_service_seconds");
  REQUIRE(service.metric.size() == 2);
  CHECK(label_of(service.metric[1], "stage") == "model");
  CHECK(service.metric[0].histogram.sample_count == st.stages[0].service_ns.count());
  const auto& batches = family(families, "svc_stage_batch_size");
  REQUIRE(batches.metric.size() == 1);  // the batch stage only
  CHECK(batches.metric[0].histogram.sample_count == st.stages[1].batch_size.count());
  CHECK(batches.metric[0].histogram.sample_sum == static_cast<double>(n - n / 10));
  CHECK(batches.metric[0].histogram.bucket.front().upper_bound == 1.0);  // unit 1

  // prometheus-cpp's text: every counter, gauge and _count line is one the OpenMetrics writer
  // writes for the same stats (same names, labels and values).
  const std::string text = prometheus::TextSerializer().Serialize(families);
  CHECK(contains(text, "# TYPE svc_requests_total counter\n"));
  CHECK(contains(text, "svc_responses_total{model=\"m1\",class=\"0\",outcome=\"ok\"} "));
  CHECK(contains(text, "svc_latency_seconds_bucket{model=\"m1\",class=\"0\",le=\"+Inf\"} 200\n"));
  CHECK(contains(text, "svc_stage_batch_size_count{model=\"m1\",stage=\"model\"} "));
  std::ostringstream openmetrics;
  st.write_openmetrics(openmetrics, "svc", {{"model", "m1"}});
  std::istringstream lines(text);
  std::size_t compared = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("#") || contains(line, "_bucket{") || contains(line, "_sum{")) continue;
    CAPTURE(line);
    CHECK(contains(openmetrics.str(), line + "\n"));
    ++compared;
  }
  CHECK(compared > 20);
}

TEST_CASE("StreamCollectable refuses the names the OpenMetrics writer refuses, and its own") {
  // A label named like one a family sets itself would appear twice on a sample: every name
  // of kStreamMetricLabels is refused, by both writers.
  DeviceGroup group(1);
  auto stream = StreamBuilder<U64>(group).stage("inc", [](U64 x) { return x + 1; }).build();
  CHECK_THROWS_AS(collect_stream(stream, "9 bad"), Error);
  CHECK_THROWS_AS(collect_stream(stream, "svc", {{"le", "x"}}), Error);
  CHECK_THROWS_AS(collect_stream(stream, "svc", {{"bad-name", "x"}}), Error);
  for (const std::string_view reserved : kStreamMetricLabels) {
    CAPTURE(reserved);
    const MetricLabels labels{{std::string(reserved), "x"}};
    CHECK(contains(test::error_of([&] { collect_stream(stream, "svc", labels); }),
                   std::string(reserved)));
    std::ostringstream out;
    CHECK(contains(test::error_of([&] { stream.stats().write_openmetrics(out, "svc", labels); }),
                   std::string(reserved)));
    CHECK(out.str().empty());  // nothing written before the refusal
  }
  CHECK_THROWS_AS(StreamCollectable(nullptr), Error);
  CHECK(collect_stream(stream)->Collect().front().name == "bspflow_stream_requests_total");
}

TEST_SUITE_END();
