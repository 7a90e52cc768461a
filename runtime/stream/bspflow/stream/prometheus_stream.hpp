// Optional adapter: a Stream's stats (Stream::stats(), see stream_serving.hpp) as a
// prometheus-cpp Collectable, for an application that already exposes metrics with
// prometheus-cpp (1.0, Debian prometheus-cpp-dev). Not part of <bspflow/bspflow.hpp>: include it
// by name and link prometheus-cpp-core (pkg-config prometheus-cpp-core). Installed when the
// build found prometheus-cpp.
//
//   auto metrics = bspflow::collect_stream(stream);  // a shared_ptr: keep it
//   exposer.RegisterCollectable(metrics);             // prometheus::Exposer (or a Gateway)
//
// The families and samples are those of StreamStats::write_openmetrics, under the same names:
// counters <prefix>_requests_total, _responses_total{outcome}, _refusals_total{reason},
// _stage_stalls_total{stage}; gauges _queued, _replica_stalled{replica}; histograms
// _latency_seconds, _stage_service_seconds{stage}, _stage_queue_wait_seconds{stage} (seconds)
// and _stage_batch_size{stage} (batch stages only), with the same bucket bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/client_metric.h>
#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/metric_type.h>

#include "bspflow/base/error.hpp"
#include "bspflow/stream/detail/stream_meter.hpp"
#include "bspflow/stream/histogram.hpp"
#include "bspflow/stream/request.hpp"
#include "bspflow/stream/stream.hpp"
#include "bspflow/stream/stream_serving.hpp"

namespace bspflow {

namespace detail {

inline prometheus::ClientMetric prometheus_sample(const MetricLabels& labels, const char* name = "",
                                                  const std::string& value = {}) {
  prometheus::ClientMetric m;
  for (const auto& [k, v] : labels) m.label.push_back({k, v});
  if (*name != '\0') m.label.push_back({name, value});
  return m;
}

inline prometheus::MetricFamily prometheus_family(std::string name, std::string help,
                                                  prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

// A histogram's buckets with their bounds and sum divided by `unit` (1e9: ns -> seconds). A
// snapshot with no layout is read as an empty one of Histogram(highest): the bounds stay the
// same from scrape to scrape. The serializer adds le="+Inf" (= sample_count).
inline prometheus::ClientMetric::Histogram prometheus_histogram(const HistogramSnapshot& h,
                                                                std::uint64_t highest,
                                                                double unit) {
  if (h.highest_trackable() == 0) return prometheus_histogram(HistogramSnapshot(highest), 0, unit);
  prometheus::ClientMetric::Histogram out;
  out.sample_count = h.count();
  out.sample_sum = static_cast<double>(h.sum()) / unit;
  for (const HistogramSnapshot::CumulativeBucket& b : h.cumulative_buckets()) {
    out.bucket.push_back(
        {.cumulative_count = b.count, .upper_bound = static_cast<double>(b.le) / unit});
  }
  return out;
}

}  // namespace detail

// Any thread. `stats` as prometheus-cpp MetricFamilies named `prefix`_... (see the file
// comment), `labels` on every sample before the family's own. Allocates. Does not check the
// names (StreamCollectable's constructor does).
inline std::vector<prometheus::MetricFamily> to_metric_families(
    const StreamStats& stats, const std::string& prefix = "bspflow_stream",
    const MetricLabels& labels = {}) {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  auto counter = [&](prometheus::MetricFamily& f, const char* label, const std::string& value,
                     std::uint64_t n) {
    f.metric.push_back(detail::prometheus_sample(labels, label, value));
    f.metric.back().counter.value = static_cast<double>(n);
  };
  auto requests = detail::prometheus_family(prefix + "_requests_total", "requests admitted",
                                            MetricType::Counter);
  counter(requests, "", "", stats.accepted);
  out.push_back(std::move(requests));
  auto responses = detail::prometheus_family(
      prefix + "_responses_total", "responses delivered, by outcome", MetricType::Counter);
  counter(responses, "outcome", "ok", stats.ok);
  for (std::size_t k = 0; k < stats.errors.size(); ++k) {
    counter(responses, "outcome", to_string(static_cast<ErrorKind>(k)), stats.errors[k]);
  }
  out.push_back(std::move(responses));
  auto refusals = detail::prometheus_family(
      prefix + "_refusals_total", "StreamClient pushes refused, by reason", MetricType::Counter);
  for (std::size_t r = 1; r < stats.refusals.size(); ++r) {  // 0 is kNone: accepted
    counter(refusals, "reason", to_string(static_cast<Refusal>(r)), stats.refusals[r]);
  }
  out.push_back(std::move(refusals));
  auto queued = detail::prometheus_family(
      prefix + "_queued", "requests admitted, not yet taken by a replica", MetricType::Gauge);
  queued.metric.push_back(detail::prometheus_sample(labels));
  queued.metric.back().gauge.value = static_cast<double>(stats.queued);
  out.push_back(std::move(queued));
  auto stalled = detail::prometheus_family(
      prefix + "_replica_stalled", "1 while a stage of the replica is stalled", MetricType::Gauge);
  for (const ReplicaStats& r : stats.replicas) {
    stalled.metric.push_back(
        detail::prometheus_sample(labels, "replica", std::to_string(r.replica)));
    stalled.metric.back().gauge.value = r.stalled ? 1.0 : 0.0;
  }
  out.push_back(std::move(stalled));
  auto stalls = detail::prometheus_family(
      prefix + "_stage_stalls_total", "calls that outlived the stall limit", MetricType::Counter);
  for (const StageStats& s : stats.stages) counter(stalls, "stage", s.name, s.stalls);
  out.push_back(std::move(stalls));

  auto latency = detail::prometheus_family(prefix + "_latency_seconds", "push to answer",
                                           MetricType::Histogram);
  latency.metric.push_back(detail::prometheus_sample(labels));
  latency.metric.back().histogram =
      detail::prometheus_histogram(stats.latency_ns, detail::kMeterHighestNs, 1e9);
  out.push_back(std::move(latency));
  auto per_stage = [&](const char* suffix, const char* help, HistogramSnapshot StageStats::*which,
                       std::uint64_t highest, double unit, bool batched_only) {
    auto f = detail::prometheus_family(prefix + suffix, help, MetricType::Histogram);
    for (const StageStats& s : stats.stages) {
      if (batched_only && !s.batched) continue;
      f.metric.push_back(detail::prometheus_sample(labels, "stage", s.name));
      f.metric.back().histogram = detail::prometheus_histogram(s.*which, highest, unit);
    }
    if (!f.metric.empty()) out.push_back(std::move(f));  // no batch stage: no batch sizes
  };
  per_stage("_stage_service_seconds", "time of one call (a request or a batch)",
            &StageStats::service_ns, detail::kMeterHighestNs, 1e9, false);
  per_stage("_stage_queue_wait_seconds", "arrival at the stage's device to its call",
            &StageStats::queue_wait_ns, detail::kMeterHighestNs, 1e9, false);
  per_stage("_stage_batch_size", "requests per batch (before padding)", &StageStats::batch_size,
            detail::kMeterHighestBatch, 1.0, true);
  return out;
}

// A prometheus-cpp Collectable that reads `stats` on every scrape (Collect(), on the
// exposer's thread) and returns to_metric_families(stats(), prefix, labels).
class StreamCollectable : public prometheus::Collectable {
 public:
  // Setup path. Throws bspflow::Error (as StreamStats::write_openmetrics) on an invalid prefix
  // or label name, a label named "le", or a label named like a family's own (outcome, reason,
  // replica, stage).
  explicit StreamCollectable(std::function<StreamStats()> stats,
                             std::string prefix = "bspflow_stream", MetricLabels labels = {})
      : stats_(std::move(stats)), prefix_(std::move(prefix)), labels_(std::move(labels)) {
    if (!stats_) throw Error("StreamCollectable: no stats function");
    std::ostringstream probe;  // the OpenMetrics writer's checks: prefix and label names
    StreamStats{}.write_openmetrics(probe, prefix_, labels_);
    for (const auto& [name, value] : labels_) {
      if (name == "outcome" || name == "reason" || name == "replica" || name == "stage") {
        detail::throw_bad_value("StreamCollectable label", name,
                                "a name other than outcome, reason, replica and stage (the "
                                "families' own labels)");
      }
    }
  }

  // The exposer's thread (any thread). Allocates.
  std::vector<prometheus::MetricFamily> Collect() const override {
    return to_metric_families(stats_(), prefix_, labels_);
  }

 private:
  std::function<StreamStats()> stats_;
  std::string prefix_;
  MetricLabels labels_;
};

// Setup path. A collectable of `stream`'s stats. `stream` must outlive every scrape: before
// the Stream goes, call exposer.RemoveCollectable(metrics) (it waits out a scrape in
// progress; dropping the shared_ptr alone does not, a scrape holds its own).
template <class In, class Out>
std::shared_ptr<StreamCollectable> collect_stream(const Stream<In, Out>& stream,
                                                  std::string prefix = "bspflow_stream",
                                                  MetricLabels labels = {}) {
  return std::make_shared<StreamCollectable>([s = &stream] { return s->stats(); },
                                             std::move(prefix), std::move(labels));
}

}  // namespace bspflow
