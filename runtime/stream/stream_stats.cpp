// Streams: batch configuration checks, a run's result, and Stream::stats() with its
// OpenMetrics and .hgrm writers (see bspflow/stream/stream_serving.hpp).
#include <algorithm>
#include <ostream>
#include <sstream>
#include <string>

#include "bspflow/base/log.hpp"
#include "bspflow/stream/stream.hpp"

namespace bspflow {

void BatchConfig::validate() const {
  if (max_batch < 1 || max_batch > detail::kMeterHighestBatch) {
    detail::throw_bad_value("BatchConfig::max_batch", max_batch, "must be in 1..4096 requests");
  }
  if (max_delay && (*max_delay < std::chrono::nanoseconds::zero() ||
                    *max_delay > std::chrono::nanoseconds(std::chrono::hours(1)))) {
    detail::throw_bad_value("BatchConfig::max_delay", *max_delay,
                            "must be in 0 ns..1 h, or nullopt for no fixed bound");
  }
  for (std::size_t i = 0; i < allowed_sizes.size(); ++i) {
    const std::size_t s = allowed_sizes[i];
    if (s < 1 || s > detail::kMeterHighestBatch) {
      detail::throw_bad_value("BatchConfig::allowed_sizes[" + std::to_string(i) + "]", s,
                              "must be in 1..4096");
    }
    if (i > 0 && s <= allowed_sizes[i - 1]) {
      detail::throw_bad_value("BatchConfig::allowed_sizes[" + std::to_string(i) + "]", s,
                              "must be ascending: above allowed_sizes[" + std::to_string(i - 1) +
                                  "] = " + std::to_string(allowed_sizes[i - 1]));
    }
  }
  if (!allowed_sizes.empty() && max_batch > allowed_sizes.back()) {
    detail::throw_bad_value(
        "BatchConfig::max_batch", max_batch,
        "must be at most the largest allowed size, " + std::to_string(allowed_sizes.back()));
  }
}

std::size_t BatchConfig::padded(std::size_t n) const noexcept {
  for (const std::size_t s : allowed_sizes) {
    if (s >= n) return s;
  }
  return n;
}

std::uint64_t StreamStats::refused() const noexcept {
  std::uint64_t n = 0;
  for (std::size_t i = 1; i < refusals.size(); ++i) n += refusals[i];
  return n;
}

namespace {

void write_counter(std::ostream& out, const std::string& name, const std::string& help,
                   const std::string& labels, const std::string& extra, std::uint64_t value,
                   bool header) {
  if (header) {
    out << "# TYPE " << name << " counter\n# HELP " << name << ' ' << help << '\n';
  }
  std::string l = labels;
  if (!extra.empty()) l += (l.empty() ? "" : ",") + extra;
  out << name << "_total";
  if (!l.empty()) out << '{' << l << '}';
  out << ' ' << value << '\n';
}

void write_gauge(std::ostream& out, const std::string& name, const std::string& help,
                 const std::string& labels, const std::string& extra, std::uint64_t value,
                 bool header) {
  if (header) out << "# TYPE " << name << " gauge\n# HELP " << name << ' ' << help << '\n';
  std::string l = labels;
  if (!extra.empty()) l += (l.empty() ? "" : ",") + extra;
  out << name;
  if (!l.empty()) out << '{' << l << '}';
  out << ' ' << value << '\n';
}

std::string escape(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

// Writes one histogram family with one sample set per stage (HistogramSnapshot writes a
// family per call, so stages after the first are written without the family's header).
void write_stage_histograms(std::ostream& out, const std::string& name, const std::string& help,
                            const MetricLabels& labels, const std::vector<StageStats>& stages,
                            HistogramSnapshot StageStats::*which, double unit, bool batched_only) {
  bool first = true;
  for (const StageStats& s : stages) {
    if (batched_only && !s.batched) continue;
    MetricLabels l = labels;
    l.emplace_back("stage", s.name);
    HistogramSnapshot h = s.*which;
    if (h.highest_trackable() == 0) h.merge(HistogramSnapshot(detail::kMeterHighestNs));
    std::ostringstream family;
    h.write_openmetrics(family, name, help, l, unit);
    std::string text = family.str();
    if (!first) {  // drop the "# TYPE" and "# HELP" lines of later stages
      std::size_t pos = 0;
      while (text.compare(pos, 2, "# ") == 0) pos = text.find('\n', pos) + 1;
      text = text.substr(pos);
    }
    out << text;
    first = false;
  }
}

}  // namespace

void StreamStats::write_openmetrics(std::ostream& out, std::string_view prefix,
                                    const MetricLabels& labels) const {
  const std::string p(prefix);
  // The histogram writer checks the names and labels; do it first, before writing anything.
  {
    std::ostringstream probe;
    HistogramSnapshot(2).write_openmetrics(probe, p + "_latency_seconds", "", labels);
  }
  std::string l;
  for (const auto& [k, v] : labels) l += (l.empty() ? "" : ",") + k + "=\"" + escape(v) + '"';
  write_counter(out, p + "_requests", "requests admitted", l, "", accepted, true);
  write_counter(out, p + "_responses", "responses delivered, by outcome", l, "outcome=\"ok\"", ok,
                true);
  for (std::size_t k = 0; k < errors.size(); ++k) {
    write_counter(out, p + "_responses", "", l,
                  std::string("outcome=\"") + to_string(static_cast<ErrorKind>(k)) + '"', errors[k],
                  false);
  }
  bool header = true;
  for (std::size_t r = 1; r < refusals.size(); ++r) {
    write_counter(out, p + "_refusals", "StreamClient pushes refused, by reason", l,
                  std::string("reason=\"") + to_string(static_cast<Refusal>(r)) + '"', refusals[r],
                  header);
    header = false;
  }
  write_gauge(out, p + "_queued", "requests admitted, not yet taken by a replica", l, "", queued,
              true);
  header = true;
  for (const ReplicaStats& r : replicas) {
    write_gauge(out, p + "_replica_stalled", "1 while a stage of the replica is stalled", l,
                "replica=\"" + std::to_string(r.replica) + '"', r.stalled ? 1 : 0, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    for (std::size_t hop = 0; hop < r.ring_depths.size(); ++hop) {
      write_gauge(
          out, p + "_ring_depth", "requests waiting between two devices of a replica", l,
          "replica=\"" + std::to_string(r.replica) + "\",hop=\"" + std::to_string(hop) + '"',
          r.ring_depths[hop], header);
      header = false;
    }
  }
  header = true;
  for (const StageStats& s : stages) {
    write_counter(out, p + "_stage_stalls", "calls that outlived the stall limit", l,
                  "stage=\"" + escape(s.name) + '"', s.stalls, header);
    header = false;
  }
  HistogramSnapshot lat = latency_ns;
  if (lat.highest_trackable() == 0) lat.merge(HistogramSnapshot(detail::kMeterHighestNs));
  lat.write_openmetrics(out, p + "_latency_seconds", "push to answer", labels, 1e9);
  write_stage_histograms(out, p + "_stage_service_seconds",
                         "time of one call (a request or a batch)", labels, stages,
                         &StageStats::service_ns, 1e9, false);
  write_stage_histograms(out, p + "_stage_queue_wait_seconds",
                         "arrival at the stage's device to its call", labels, stages,
                         &StageStats::queue_wait_ns, 1e9, false);
  write_stage_histograms(out, p + "_stage_batch_size", "requests per batch (before padding)",
                         labels, stages, &StageStats::batch_size, 1.0, true);
}

void StreamStats::write_latency_hgrm(std::ostream& out) const {
  HistogramSnapshot lat = latency_ns;
  if (lat.highest_trackable() == 0) lat.merge(HistogramSnapshot(detail::kMeterHighestNs));
  lat.write_hgrm(out, 1000.0);
}

namespace detail {

std::uint64_t StreamCore::refused_total() const noexcept {
  std::uint64_t n = 0;
  for (std::size_t i = 1; i < 7; ++i) n += intake->refused(static_cast<Refusal>(i));
  return n;
}

StreamResult StreamCore::finish(std::uint64_t accepted, std::uint64_t delivered,
                                std::uint64_t errors, std::uint64_t refused_before) {
  StreamResult r;
  r.elapsed = std::chrono::steady_clock::now() - started_;
  // The modeled clock: the slowest device's, every device's undeclared stage calls.
  std::uint64_t undeclared = 0;
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    const ModeledTime t = devices[d].clock().time();
    if (t.total > r.modeled.total) r.modeled = t;
    undeclared += t.undeclared;
  }
  r.modeled.undeclared = undeclared;
  r.accepted = accepted;
  r.answered = delivered;
  r.errors = errors;
  r.unanswered = accepted >= delivered ? accepted - delivered : 0;
  r.refused = refused_total() - refused_before;
  r.failure = state_ ? state_->failure() : nullptr;
  if (r.failure) {
    r.status = RunStatus::kFailed;
  } else if (state_ && state_->stop.requested()) {
    r.status = RunStatus::kCancelled;
  } else {
    r.status = RunStatus::kCompleted;
  }
  // A Stream's normal end reads "drained": closed, and everything answered.
  r.message = std::string(r.status == RunStatus::kCompleted ? "drained" : to_string(r.status)) +
              ": " + std::to_string(accepted) + " request(s) accepted, " +
              std::to_string(delivered) + " answered (" + std::to_string(errors) +
              " with an error), " + std::to_string(r.unanswered) + " unanswered";
  if (r.refused != 0) r.message += ", " + std::to_string(r.refused) + " refused at push";
  if (r.failure) r.message += "; " + r.failure->message;
  if (r.status == RunStatus::kCompleted && r.unanswered != 0) {
    // Cannot happen by design: say so loudly rather than hide a lost request.
    log(LogLevel::kError, "stream drained with unanswered requests: " + r.message);
  }
  return r;
}

StreamStats StreamCore::stats() const {
  StreamStats s;
  const auto stages = static_cast<std::uint32_t>(stage_names.size());
  s.latency_ns = HistogramSnapshot(kMeterHighestNs);
  for (std::uint32_t k = 0; k < stages; ++k) {
    StageStats st;
    st.name = stage_names[k];
    st.stage = k;
    st.device = stage_devices[k];
    st.batched = stage_batched[k];
    st.service_ns = HistogramSnapshot(kMeterHighestNs);
    st.queue_wait_ns = HistogramSnapshot(kMeterHighestNs);
    st.batch_size = HistogramSnapshot(kMeterHighestBatch);
    for (std::uint32_t r = 0; r < replicas && !meter_ptrs.empty(); ++r) {
      const StageMeter& m = *meter_ptrs[static_cast<std::size_t>(r) * stages + k];
      st.service_ns.merge(m.service.snapshot());
      st.queue_wait_ns.merge(m.wait.snapshot());
      st.batch_size.merge(m.batch.snapshot());
      st.calls += m.calls.load(std::memory_order_relaxed);
      st.padded += m.padded.load(std::memory_order_relaxed);
      st.stalls += m.stalls.load(std::memory_order_relaxed);
    }
    s.stages.push_back(std::move(st));
  }
  for (std::uint32_t r = 0; r < replica_meters.size(); ++r) {
    const ReplicaMeter& m = *replica_meters[r];
    ReplicaStats rs;
    rs.replica = r;
    rs.taken = m.taken.load(std::memory_order_relaxed);
    rs.answered = m.answered.load(std::memory_order_relaxed);
    rs.stalled = m.stalled.load(std::memory_order_relaxed);
    rs.failed = m.failed.load(std::memory_order_relaxed);
    for (const auto& depth : ring_depths[r]) rs.ring_depths.push_back(depth());
    s.latency_ns.merge(m.latency.snapshot());
    s.answered += rs.answered;
    s.ok += m.ok.load(std::memory_order_relaxed);
    for (std::size_t k = 0; k < 4; ++k) s.errors[k] += m.errors[k].load(std::memory_order_relaxed);
    s.replicas.push_back(std::move(rs));
  }
  for (std::size_t i = 0; i < s.refusals.size(); ++i) {
    s.refusals[i] = intake->refused(static_cast<Refusal>(i));
  }
  s.accepted = intake->total_accepted();
  s.queued = intake->size();
  return s;
}

}  // namespace detail
}  // namespace bspflow
