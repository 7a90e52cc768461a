/// @file
/// Optional adapter: a Stream's stats (Stream::stats()) as a prometheus-cpp 1.0 Collectable,
/// with the families of StreamStats::write_openmetrics under the same names and bucket bounds.
/// Not in `<bspflow/bspflow.hpp>`: include it by name and link prometheus-cpp-core; installed
/// when the build found prometheus-cpp. Guide: runtime/stream/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
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
#include "bspflow/stream/detail/meters.hpp"
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

/// A histogram's buckets with their bounds and sum divided by `unit` (1e9: ns -> seconds). A
/// snapshot with no layout is read as an empty one of Histogram(highest): the bounds stay the
/// same from scrape to scrape. The serializer adds le="+Inf" (= sample_count).
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

/// `stats` as prometheus-cpp MetricFamilies named `prefix`_... (the families of
/// StreamStats::write_openmetrics), `labels` on every sample before the family's own. Does not
/// check the names (StreamCollectable's constructor does).
/// Contract: any; non-blocking; allocates; throws bad_alloc.
inline std::vector<prometheus::MetricFamily> to_metric_families(
    const StreamStats& stats, const std::string& prefix = "bspflow_stream",
    const MetricLabels& labels = {}) {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  // A sample with `labels`, then the family's own labels (name, value) in order.
  auto sample = [&](std::initializer_list<std::pair<const char*, std::string>> own) {
    prometheus::ClientMetric m = detail::prometheus_sample(labels);
    for (const auto& [k, v] : own) m.label.push_back({k, v});
    return m;
  };
  auto add = [&](prometheus::MetricFamily& f, prometheus::ClientMetric m, double v, bool gauge) {
    (gauge ? m.gauge.value : m.counter.value) = v;
    f.metric.push_back(std::move(m));
  };
  auto requests = detail::prometheus_family(
      prefix + "_requests_total", "requests admitted, by priority class", MetricType::Counter);
  auto responses =
      detail::prometheus_family(prefix + "_responses_total",
                                "responses delivered, by class and outcome", MetricType::Counter);
  auto refusals = detail::prometheus_family(prefix + "_refusals_total",
                                            "StreamClient pushes refused, by class and reason",
                                            MetricType::Counter);
  auto queued = detail::prometheus_family(prefix + "_queued",
                                          "requests admitted, not yet taken by a replica, by class",
                                          MetricType::Gauge);
  auto latency = detail::prometheus_family(
      prefix + "_latency_seconds", "push to answer, by priority class", MetricType::Histogram);
  for (const ClassStats& c : stats.by_class) {
    const std::string cls = std::to_string(c.priority);
    add(requests, sample({{"class", cls}}), static_cast<double>(c.accepted), false);
    add(responses, sample({{"class", cls}, {"outcome", "ok"}}), static_cast<double>(c.ok), false);
    for (std::size_t k = 0; k < c.errors.size(); ++k) {
      add(responses, sample({{"class", cls}, {"outcome", to_string(static_cast<ErrorKind>(k))}}),
          static_cast<double>(c.errors[k]), false);
    }
    for (std::size_t r = 1; r < c.refusals.size(); ++r) {  // 0 is kNone: accepted
      add(refusals, sample({{"class", cls}, {"reason", to_string(static_cast<Refusal>(r))}}),
          static_cast<double>(c.refusals[r]), false);
    }
    add(queued, sample({{"class", cls}}), static_cast<double>(c.queued), true);
    latency.metric.push_back(sample({{"class", cls}}));
    latency.metric.back().histogram =
        detail::prometheus_histogram(c.latency_ns, detail::kMeterHighestNs, 1e9);
  }
  out.push_back(std::move(requests));
  out.push_back(std::move(responses));
  out.push_back(std::move(refusals));
  out.push_back(std::move(queued));
  auto stalled = detail::prometheus_family(
      prefix + "_replica_stalled", "1 while a stage of the replica is stalled", MetricType::Gauge);
  auto ejected = detail::prometheus_family(
      prefix + "_replica_ejected",
      "1 while the replica is out of rotation after consecutive stage failures", MetricType::Gauge);
  auto ejections = detail::prometheus_family(prefix + "_replica_ejections_total",
                                             "times the replica was ejected", MetricType::Counter);
  auto draining = detail::prometheus_family(
      prefix + "_replica_draining", "1 while a rolling swap drains the replica", MetricType::Gauge);
  auto depth = detail::prometheus_family(
      prefix + "_ring_depth",
      "requests waiting in a hop between two devices of a replica (hop: in build order)",
      MetricType::Gauge);
  for (const ReplicaStats& r : stats.replicas) {
    const std::string rep = std::to_string(r.replica);
    add(stalled, sample({{"replica", rep}}), r.stalled ? 1.0 : 0.0, true);
    add(ejected, sample({{"replica", rep}}), r.ejected ? 1.0 : 0.0, true);
    add(ejections, sample({{"replica", rep}}), static_cast<double>(r.ejections), false);
    add(draining, sample({{"replica", rep}}), r.draining ? 1.0 : 0.0, true);
    for (std::size_t hop = 0; hop < r.ring_depths.size(); ++hop) {
      add(depth, sample({{"replica", rep}, {"hop", std::to_string(hop)}}),
          static_cast<double>(r.ring_depths[hop]), true);
    }
  }
  out.push_back(std::move(stalled));
  out.push_back(std::move(ejected));
  out.push_back(std::move(ejections));
  out.push_back(std::move(draining));
  if (!depth.metric.empty()) out.push_back(std::move(depth));
  auto stalls = detail::prometheus_family(
      prefix + "_stage_stalls_total", "calls that outlived the stall limit", MetricType::Counter);
  auto versions =
      detail::prometheus_family(prefix + "_stage_version_calls_total",
                                "calls made, by stage and version", MetricType::Counter);
  for (const StageStats& s : stats.stages) {
    add(stalls, sample({{"stage", s.name}}), static_cast<double>(s.stalls), false);
    for (const VersionStats& v : s.versions) {
      add(versions, sample({{"stage", s.name}, {"version", std::to_string(v.version)}}),
          static_cast<double>(v.calls), false);
    }
  }
  out.push_back(std::move(stalls));
  if (!versions.metric.empty()) out.push_back(std::move(versions));
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
  // Generate stages: outputs and preemptions by class, the active sets and the blocks, time
  // to first output and between outputs by class.
  auto tokens =
      detail::prometheus_family(prefix + "_generate_tokens_total",
                                "outputs a generate stage made, by class", MetricType::Counter);
  auto preemptions = detail::prometheus_family(
      prefix + "_generate_preemptions_total",
      "sequences a generate stage moved to host memory, by class", MetricType::Counter);
  auto active =
      detail::prometheus_family(prefix + "_generate_active",
                                "sequences in a generate stage's active sets", MetricType::Gauge);
  auto waiting = detail::prometheus_family(prefix + "_generate_preempted",
                                           "sequences of a generate stage waiting in host memory",
                                           MetricType::Gauge);
  auto used = detail::prometheus_family(prefix + "_generate_blocks_used",
                                        "state blocks held by sequences", MetricType::Gauge);
  auto spare = detail::prometheus_family(prefix + "_generate_blocks_free", "state blocks free",
                                         MetricType::Gauge);
  auto ttft = detail::prometheus_family(prefix + "_generate_ttft_seconds",
                                        "push to a sequence's first output, by class",
                                        MetricType::Histogram);
  auto itl = detail::prometheus_family(prefix + "_generate_itl_seconds",
                                       "between two outputs of a sequence, by class",
                                       MetricType::Histogram);
  for (const StageStats& s : stats.stages) {
    if (!s.generation) continue;
    const GenerateStats& g = *s.generation;
    add(active, sample({{"stage", s.name}}), static_cast<double>(g.active), true);
    add(waiting, sample({{"stage", s.name}}), static_cast<double>(g.preempted), true);
    add(used, sample({{"stage", s.name}}), static_cast<double>(g.blocks_used), true);
    add(spare, sample({{"stage", s.name}}), static_cast<double>(g.blocks - g.blocks_used), true);
    for (const GenerateClassStats& c : g.by_class) {
      const std::string cls = std::to_string(c.priority);
      add(tokens, sample({{"stage", s.name}, {"class", cls}}), static_cast<double>(c.tokens),
          false);
      add(preemptions, sample({{"stage", s.name}, {"class", cls}}),
          static_cast<double>(c.preemptions), false);
      ttft.metric.push_back(sample({{"stage", s.name}, {"class", cls}}));
      ttft.metric.back().histogram =
          detail::prometheus_histogram(c.ttft_ns, detail::kMeterHighestNs, 1e9);
      itl.metric.push_back(sample({{"stage", s.name}, {"class", cls}}));
      itl.metric.back().histogram =
          detail::prometheus_histogram(c.itl_ns, detail::kMeterHighestNs, 1e9);
    }
  }
  for (auto* f : {&tokens, &preemptions, &active, &waiting, &used, &spare, &ttft, &itl}) {
    if (!f->metric.empty()) out.push_back(std::move(*f));
  }
  return out;
}

/// A prometheus-cpp Collectable that reads `stats` on every scrape (Collect(), on the
/// exposer's thread) and returns to_metric_families(stats(), prefix, labels).
class StreamCollectable : public prometheus::Collectable {
 public:
  /// Checks `prefix` and `labels` now: throws bspflow::Error (as
  /// StreamStats::write_openmetrics) on an invalid prefix or label name, or a label named like
  /// one the families set themselves (kStreamMetricLabels); also without `stats`.
  /// Contract: any; non-blocking; allocates; throws Error.
  explicit StreamCollectable(std::function<StreamStats()> stats,
                             std::string prefix = "bspflow_stream", MetricLabels labels = {})
      : stats_(std::move(stats)), prefix_(std::move(prefix)), labels_(std::move(labels)) {
    if (!stats_) throw Error("StreamCollectable: no stats function");
    // The OpenMetrics writer's checks: the prefix, the label names, and no label named like
    // one the families set themselves (kStreamMetricLabels).
    std::ostringstream probe;
    StreamStats{}.write_openmetrics(probe, prefix_, labels_);
  }

  /// One scrape, on the exposer's thread: to_metric_families(stats(), prefix, labels).
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::vector<prometheus::MetricFamily> Collect() const override {
    return to_metric_families(stats_(), prefix_, labels_);
  }

 private:
  std::function<StreamStats()> stats_;
  std::string prefix_;
  MetricLabels labels_;
};

/// A collectable of `stream`'s stats. `stream` must outlive every scrape: before the Stream
/// goes, call exposer.RemoveCollectable(metrics) (it waits out a scrape in progress; dropping
/// the shared_ptr alone does not, a scrape holds its own).
/// Contract: any; non-blocking; allocates; throws Error.
template <class In, class Out>
std::shared_ptr<StreamCollectable> collect_stream(const Stream<In, Out>& stream,
                                                  std::string prefix = "bspflow_stream",
                                                  MetricLabels labels = {}) {
  return std::make_shared<StreamCollectable>([s = &stream] { return s->stats(); },
                                             std::move(prefix), std::move(labels));
}

}  // namespace bspflow
