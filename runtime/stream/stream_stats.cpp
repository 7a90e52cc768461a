// Streams: batch configuration checks, a run's result, and Stream::stats() with its
// OpenMetrics and .hgrm writers (see bspflow/stream/stream_serving.hpp).
#include <algorithm>
#include <map>
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

// Writes one sample set of a histogram family: `h` with `labels`. HistogramSnapshot writes a
// whole family per call, so every set after the first (`first` false) is written without the
// family's "# TYPE" and "# HELP" lines. An empty snapshot gets the meters' layout.
void write_sample_set(std::ostream& out, const std::string& name, const std::string& help,
                      const MetricLabels& labels, HistogramSnapshot h, double unit, bool& first) {
  if (h.highest_trackable() == 0) h.merge(HistogramSnapshot(detail::kMeterHighestNs));
  std::ostringstream family;
  h.write_openmetrics(family, name, help, labels, unit);
  std::string text = family.str();
  if (!first) {
    std::size_t pos = 0;
    while (text.compare(pos, 2, "# ") == 0) pos = text.find('\n', pos) + 1;
    text = text.substr(pos);
  }
  out << text;
  first = false;
}

// One histogram family with one sample set per stage.
void write_stage_histograms(std::ostream& out, const std::string& name, const std::string& help,
                            const MetricLabels& labels, const std::vector<StageStats>& stages,
                            HistogramSnapshot StageStats::*which, double unit, bool batched_only) {
  bool first = true;
  for (const StageStats& s : stages) {
    if (batched_only && !s.batched) continue;
    MetricLabels l = labels;
    l.emplace_back("stage", s.name);
    write_sample_set(out, name, help, l, s.*which, unit, first);
  }
}

// The same for one sample set per priority class.
void write_class_latency(std::ostream& out, const std::string& name, const MetricLabels& labels,
                         const std::vector<ClassStats>& classes) {
  bool first = true;
  for (const ClassStats& c : classes) {
    MetricLabels l = labels;
    l.emplace_back("class", std::to_string(c.priority));
    write_sample_set(out, name, "push to answer, by priority class", l, c.latency_ns, 1e9, first);
  }
}

// The same for one sample set per (generate stage, class).
void write_generate_histograms(std::ostream& out, const std::string& name, const std::string& help,
                               const MetricLabels& labels, const std::vector<StageStats>& stages,
                               HistogramSnapshot GenerateClassStats::*which) {
  bool first = true;
  for (const StageStats& s : stages) {
    if (!s.generation) continue;
    for (const GenerateClassStats& c : s.generation->by_class) {
      MetricLabels l = labels;
      l.emplace_back("stage", s.name);
      l.emplace_back("class", std::to_string(c.priority));
      write_sample_set(out, name, help, l, c.*which, 1e9, first);
    }
  }
}

// The generate stages' families: outputs and preemptions by class, the active set and the
// blocks, time to first output and between outputs by class.
void write_generation(std::ostream& out, const std::string& p, const std::string& l,
                      const MetricLabels& labels, const std::vector<StageStats>& stages) {
  const auto stage = [](const StageStats& s) { return "stage=\"" + escape(s.name) + '"'; };
  bool header = true;
  for (const StageStats& s : stages) {
    if (!s.generation) continue;
    for (const GenerateClassStats& c : s.generation->by_class) {
      write_counter(out, p + "_generate_tokens", "outputs a generate stage made, by class", l,
                    stage(s) + ",class=\"" + std::to_string(c.priority) + '"', c.tokens, header);
      header = false;
    }
  }
  header = true;
  for (const StageStats& s : stages) {
    if (!s.generation) continue;
    for (const GenerateClassStats& c : s.generation->by_class) {
      write_counter(out, p + "_generate_preemptions",
                    "sequences a generate stage moved to host memory, by class", l,
                    stage(s) + ",class=\"" + std::to_string(c.priority) + '"', c.preemptions,
                    header);
      header = false;
    }
  }
  const auto gauge = [&](const std::string& name, const std::string& help, auto field) {
    bool head = true;
    for (const StageStats& s : stages) {
      if (!s.generation) continue;
      write_gauge(out, p + name, help, l, stage(s), field(*s.generation), head);
      head = false;
    }
  };
  gauge("_generate_active", "sequences in a generate stage's active sets",
        [](const GenerateStats& g) { return g.active; });
  gauge("_generate_preempted", "sequences of a generate stage waiting in host memory",
        [](const GenerateStats& g) { return g.preempted; });
  gauge("_generate_blocks_used", "state blocks held by sequences",
        [](const GenerateStats& g) { return g.blocks_used; });
  gauge("_generate_blocks_free", "state blocks free",
        [](const GenerateStats& g) { return g.blocks - g.blocks_used; });
  write_generate_histograms(out, p + "_generate_ttft_seconds",
                            "push to a sequence's first output, by class", labels, stages,
                            &GenerateClassStats::ttft_ns);
  write_generate_histograms(out, p + "_generate_itl_seconds",
                            "between two outputs of a sequence, by class", labels, stages,
                            &GenerateClassStats::itl_ns);
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
  for (const auto& [k, v] : labels) {
    if (std::find(kStreamMetricLabels.begin(), kStreamMetricLabels.end(), k) !=
        kStreamMetricLabels.end()) {
      detail::throw_bad_value("label name", "\"" + k + "\"",
                              "the stream's families set a label of that name themselves "
                              "(stage, replica, outcome, reason, hop, class, version, le): "
                              "name it otherwise");
    }
  }
  std::string l;
  for (const auto& [k, v] : labels) l += (l.empty() ? "" : ",") + k + "=\"" + escape(v) + '"';
  const auto cls = [](const ClassStats& c) {
    return "class=\"" + std::to_string(c.priority) + '"';
  };
  bool header = true;
  for (const ClassStats& c : by_class) {
    write_counter(out, p + "_requests", "requests admitted, by priority class", l, cls(c),
                  c.accepted, header);
    header = false;
  }
  header = true;
  for (const ClassStats& c : by_class) {
    write_counter(out, p + "_responses", "responses delivered, by class and outcome", l,
                  cls(c) + ",outcome=\"ok\"", c.ok, header);
    header = false;
    for (std::size_t k = 0; k < c.errors.size(); ++k) {
      write_counter(out, p + "_responses", "", l,
                    cls(c) + ",outcome=\"" + to_string(static_cast<ErrorKind>(k)) + '"',
                    c.errors[k], false);
    }
  }
  header = true;
  for (const ClassStats& c : by_class) {
    for (std::size_t r = 1; r < c.refusals.size(); ++r) {
      write_counter(out, p + "_refusals", "StreamClient pushes refused, by class and reason", l,
                    cls(c) + ",reason=\"" + to_string(static_cast<Refusal>(r)) + '"', c.refusals[r],
                    header);
      header = false;
    }
  }
  header = true;
  for (const ClassStats& c : by_class) {
    write_gauge(out, p + "_queued", "requests admitted, not yet taken by a replica, by class", l,
                cls(c), c.queued, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    write_gauge(out, p + "_replica_stalled", "1 while a stage of the replica is stalled", l,
                "replica=\"" + std::to_string(r.replica) + '"', r.stalled ? 1 : 0, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    write_gauge(out, p + "_replica_ejected",
                "1 while the replica is out of rotation after consecutive stage failures", l,
                "replica=\"" + std::to_string(r.replica) + '"', r.ejected ? 1 : 0, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    write_counter(out, p + "_replica_ejections", "times the replica was ejected", l,
                  "replica=\"" + std::to_string(r.replica) + '"', r.ejections, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    write_gauge(out, p + "_replica_draining", "1 while a rolling swap drains the replica", l,
                "replica=\"" + std::to_string(r.replica) + '"', r.draining ? 1 : 0, header);
    header = false;
  }
  header = true;
  for (const ReplicaStats& r : replicas) {
    for (std::size_t hop = 0; hop < r.ring_depths.size(); ++hop) {
      write_gauge(
          out, p + "_ring_depth",
          "requests waiting in a hop between two devices of a replica (hop: in build order)", l,
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
  header = true;
  for (const StageStats& s : stages) {
    for (const VersionStats& v : s.versions) {
      write_counter(out, p + "_stage_version_calls", "calls made, by stage and version", l,
                    "stage=\"" + escape(s.name) + "\",version=\"" + std::to_string(v.version) + '"',
                    v.calls, header);
      header = false;
    }
  }
  write_generation(out, p, l, labels, stages);
  write_class_latency(out, p + "_latency_seconds", labels, by_class);
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
  for (std::uint32_t c = 0; c < config.priority_classes; ++c) {
    for (std::size_t i = 1; i < 8; ++i) n += admission->refused(c, static_cast<Refusal>(i));
  }
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
  s.latency_ns = HistogramSnapshot(kMeterHighestNs);
  const std::uint32_t classes = config.priority_classes;
  for (std::uint32_t c = 0; c < classes; ++c) {
    ClassStats cs;
    cs.priority = c;
    cs.latency_ns = HistogramSnapshot(kMeterHighestNs);
    cs.accepted = admission->accepted_of(c);
    cs.queued = admission->size_of(c);
    cs.blocked = admission->blocked_of(c);
    s.blocked += cs.blocked;
    for (std::size_t i = 0; i < cs.refusals.size(); ++i) {
      cs.refusals[i] = admission->refused(c, static_cast<Refusal>(i));
      s.refusals[i] += cs.refusals[i];
    }
    s.accepted += cs.accepted;
    s.by_class.push_back(std::move(cs));
  }
  std::lock_guard versions(versions_mutex_);
  for (const std::uint32_t n : named) {
    const NodeSpec& spec = nodes[n];
    StageStats st;
    st.name = spec.name;
    st.stage = spec.index;
    st.device = spec.device;
    st.batched = spec.kind == NodeKind::kBatch || spec.kind == NodeKind::kGenerate;
    st.service_ns = HistogramSnapshot(kMeterHighestNs);
    st.queue_wait_ns = HistogramSnapshot(kMeterHighestNs);
    st.batch_size = HistogramSnapshot(kMeterHighestBatch);
    std::map<std::uint32_t, VersionStats> by_version;
    for (std::uint32_t r = 0; r < replicas && n < runs[r].meters.size(); ++r) {
      const StageMeter& m = *runs[r].meters[n];
      st.service_ns.merge(m.service.snapshot());
      st.queue_wait_ns.merge(m.wait.snapshot());
      st.batch_size.merge(m.batch.snapshot());
      st.calls += m.calls.load(std::memory_order_relaxed);
      st.padded += m.padded.load(std::memory_order_relaxed);
      st.stalls += m.stalls.load(std::memory_order_relaxed);
      if (const GenerateMeter* g = runs[r].generation[n]) {
        if (!st.generation) st.generation.emplace();
        GenerateStats& gs = *st.generation;
        const auto read = [](const std::atomic<std::uint64_t>& a) {
          return a.load(std::memory_order_relaxed);
        };
        gs.iterations += read(g->iterations);
        gs.tokens += read(g->tokens);
        gs.sequences += read(g->sequences);
        gs.preemptions += read(g->preemptions);
        gs.blocks += read(g->blocks);
        gs.blocks_used += read(g->blocks_used);
        gs.active += read(g->active);
        gs.preempted += read(g->waiting);
        if (gs.by_class.empty()) {
          for (std::uint32_t c = 0; c < config.priority_classes; ++c) {
            GenerateClassStats cs;
            cs.priority = c;
            cs.ttft_ns = HistogramSnapshot(kMeterHighestNs);
            cs.itl_ns = HistogramSnapshot(kMeterHighestNs);
            gs.by_class.push_back(std::move(cs));
          }
          gs.ttft_ns = HistogramSnapshot(kMeterHighestNs);
          gs.itl_ns = HistogramSnapshot(kMeterHighestNs);
        }
        for (std::uint32_t c = 0; c < config.priority_classes; ++c) {
          GenerateClassStats& cs = gs.by_class[c];
          const GenerateMeter::ByClass& mc = g->by_class[c];
          const HistogramSnapshot ttft = mc.ttft.snapshot();
          const HistogramSnapshot itl = mc.itl.snapshot();
          cs.ttft_ns.merge(ttft);
          cs.itl_ns.merge(itl);
          gs.ttft_ns.merge(ttft);
          gs.itl_ns.merge(itl);
          cs.tokens += read(mc.tokens);
          cs.preemptions += read(mc.preemptions);
        }
      }
      const VersionCell* cell = runs[r].cells[n];
      for (const auto& [node, v] : runs[r].versions) {
        if (node != n) continue;
        VersionStats& vs = by_version[v->version];
        vs.version = v->version;
        vs.calls += v->calls.load(std::memory_order_relaxed);
        if (cell != nullptr &&
            (cell->current.load() == v.get() || cell->in_use.load() == v.get())) {
          ++vs.replicas;
        }
      }
    }
    for (auto& [v, vs] : by_version) st.versions.push_back(vs);
    s.stages.push_back(std::move(st));
  }
  for (std::uint32_t r = 0; r < replica_meters.size(); ++r) {
    const ReplicaMeter& m = *replica_meters[r];
    ReplicaStats rs;
    rs.replica = r;
    rs.taken = m.taken.load(std::memory_order_relaxed);
    rs.stalled = m.stalled.load(std::memory_order_relaxed);
    rs.failed = m.failed.load(std::memory_order_relaxed);
    rs.ejected = m.ejected.load(std::memory_order_relaxed);
    rs.ejections = m.ejections.load(std::memory_order_relaxed);
    rs.draining = m.draining.load(std::memory_order_relaxed);
    for (const auto& hop : runs[r].hops) rs.ring_depths.push_back(hop->size());
    for (std::uint32_t c = 0; c < classes; ++c) {
      const ClassMeter& cm = *m.by_class[c];
      ClassStats& cs = s.by_class[c];
      rs.answered += cm.add_to(cs, s);
      const auto ok = cm.ok.load(std::memory_order_relaxed);
      cs.ok += ok;
      s.ok += ok;
    }
    s.replicas.push_back(std::move(rs));
  }
  s.queued = admission->size();
  return s;
}

}  // namespace detail
}  // namespace bspflow
