#include "bspflow/run/trace.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bspflow/base/error.hpp"

namespace bspflow {

const char* to_string(Phase p) noexcept {
  switch (p) {
    case Phase::kStreamCopyBegin:
      return "StreamCopyBegin";
    case Phase::kStreamCopyMid:
      return "StreamCopyMid";
    case Phase::kStreamCopyEnd:
      return "StreamCopyEnd";
    case Phase::kCompute:
      return "Compute";
    case Phase::kSync:
      return "Sync";
    case Phase::kExchange:
      return "Exchange";
    case Phase::kIdle:
      return "Idle";
    case Phase::kTransfer:
      return "Transfer";
  }
  return "?";
}

TraceTrack::TraceTrack(std::string name, Kind kind, std::uint32_t id, Clock::time_point origin)
    : name_(std::move(name)), kind_(kind), id_(id), origin_(origin) {
  labels_.emplace_back();  // 0: the phase's own name
  events_.reserve(1024);
}

void TraceTrack::modeled_span(ModeledPhase phase, double begin_ns, double end_ns,
                              std::uint32_t label) noexcept {
  Phase p = Phase::kCompute;
  switch (phase) {
    case ModeledPhase::kHostCall:
      p = Phase::kIdle;
      break;
    case ModeledPhase::kCompute:
      p = Phase::kCompute;
      break;
    case ModeledPhase::kHostLink:
      p = Phase::kStreamCopyMid;
      break;
    case ModeledPhase::kExchange:
      p = Phase::kExchange;
      break;
    case ModeledPhase::kSync:
      p = Phase::kSync;
      break;
  }
  try {
    modeled_.push_back(TraceEvent{p, false, label, static_cast<std::int64_t>(begin_ns),
                                  static_cast<std::int64_t>(end_ns), 0});
  } catch (...) {  // out of memory: the modeled timeline misses a span
  }
}

std::uint32_t TraceTrack::add_label(std::string label) {
  const auto it = std::find(labels_.begin(), labels_.end(), label);
  if (it != labels_.end()) return static_cast<std::uint32_t>(it - labels_.begin());
  labels_.push_back(std::move(label));
  return static_cast<std::uint32_t>(labels_.size() - 1);
}

const std::string& TraceTrack::label(const TraceEvent& e) const noexcept {
  static const std::string kNone;
  return e.label < labels_.size() ? labels_[e.label] : kNone;
}

TraceTrack& Trace::add_track(std::string name, TraceTrack::Kind kind, std::uint32_t id) {
  return tracks_.emplace_back(std::move(name), kind, id, origin_);
}

void Trace::end_at_last_event() noexcept {
  std::int64_t last = 0;
  for (const TraceTrack& t : tracks_) {
    for (const TraceEvent& e : t.events()) last = std::max(last, e.end_ns);
  }
  end_ = origin_ + std::chrono::nanoseconds(last);
}

std::int64_t Trace::run_ns() const noexcept {
  if (end_ == Clock::time_point{}) return 0;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(end_ - origin_).count();
}

namespace {
// Chrome trace-event JSON, written event by event instead of built as one nlohmann::json
// document first: such a document costs many times the trace's own memory, and nlohmann's
// destructor of a value with children allocates (it unrolls the tree onto a vector), so a
// document dropped while memory runs out ends the process. nlohmann still writes every
// string and number (escaping, round-trip doubles); keys here are plain literals.
class EventWriter {
 public:
  explicit EventWriter(std::string& out) : out_(out) {}
  EventWriter& event() {
    out_ += events_++ == 0 ? "\n{" : ",\n{";
    comma_ = false;
    return *this;
  }
  EventWriter& end() {
    out_ += '}';
    comma_ = true;
    return *this;
  }
  EventWriter& key(const char* k) {
    if (comma_) out_ += ',';
    comma_ = true;
    out_ += '"';
    out_ += k;
    out_ += "\":";
    return *this;
  }
  EventWriter& object(const char* k) {  // key("args"), then the object's fields, then end()
    key(k);
    out_ += '{';
    comma_ = false;
    return *this;
  }
  EventWriter& str(const char* k, const std::string& v) {
    key(k);
    out_ += nlohmann::json(v).dump();
    return *this;
  }
  EventWriter& str(const char* k, const char* v) { return str(k, std::string(v)); }
  EventWriter& num(const char* k, std::uint64_t v) {
    key(k);
    out_ += std::to_string(v);
    return *this;
  }
  EventWriter& num(const char* k, double v) {
    key(k);
    out_ += nlohmann::json(v).dump();
    return *this;
  }

 private:
  std::string& out_;
  std::size_t events_ = 0;
  bool comma_ = false;
};

double us(std::int64_t ns) {
  return static_cast<double>(ns) / 1e3;
}
}  // namespace

std::string Trace::chrome_json() const {
  std::string out = "{\"traceEvents\":[";
  EventWriter w(out);
  auto meta = [&](std::uint64_t pid, std::uint64_t tid, const char* name) -> EventWriter& {
    w.event().str("ph", "M").num("pid", pid);
    if (tid != 0) w.num("tid", tid);
    return w.str("name", name);
  };
  meta(1, 0, "process_name").object("args").str("name", "bspflow").end().end();
  std::uint32_t tid = 0;
  for (const TraceTrack& track : tracks_) {
    ++tid;
    meta(1, tid, "thread_name").object("args").str("name", track.name()).end().end();
    meta(1, tid, "thread_sort_index").object("args").num("sort_index", std::uint64_t{tid});
    w.end().end();
    for (const TraceEvent& e : track.events()) {
      const std::string& label = track.label(e);
      w.event().str("ph", "X").num("pid", std::uint64_t{1}).num("tid", std::uint64_t{tid});
      w.str("name", label.empty() ? std::string(to_string(e.phase)) : label);
      w.str("cat", to_string(e.phase))
          .num("ts", us(e.begin_ns))
          .num("dur", us(e.end_ns - e.begin_ns));
      w.object("args");
      if (e.bytes != 0) w.num("bytes", std::uint64_t{e.bytes});
      if (e.phase == Phase::kTransfer || e.phase == Phase::kStreamCopyMid) {
        w.str("direction", e.to_host ? "to host" : "to device");
      }
      w.end().end();
    }
  }
  // The modeled IPU timeline: a process of its own (its own time axis), its threads numbered
  // from kModeledTid so that no thread id repeats one of the first process's.
  constexpr std::uint32_t kModeledTid = 1000;
  bool modeled = false;
  tid = kModeledTid;
  for (const TraceTrack& track : tracks_) {
    ++tid;
    if (track.modeled_events().empty()) continue;
    if (!modeled) {
      meta(2, 0, "process_name").object("args").str("name", "modeled IPU time").end().end();
      modeled = true;
    }
    meta(2, tid, "thread_name").object("args").str("name", track.name() + " (modeled)");
    w.end().end();
    for (const TraceEvent& e : track.modeled_events()) {
      const std::string& label = track.label(e);
      const char* name = e.phase == Phase::kIdle ? "host call" : to_string(e.phase);
      w.event().str("ph", "X").num("pid", std::uint64_t{2}).num("tid", std::uint64_t{tid});
      w.str("name", label.empty() ? std::string(name) : label);
      w.str("cat", std::string("modeled ") + to_string(e.phase));
      w.num("ts", us(e.begin_ns)).num("dur", us(e.end_ns - e.begin_ns)).end();
    }
  }
  out += "\n],\"displayTimeUnit\":\"ns\",\"otherData\":{\"run_us\":";
  out += nlohmann::json(us(run_ns())).dump();
  out += "}}\n";
  return out;
}

void Trace::write_chrome_json(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error("cannot write the trace to '" + path + "' (cannot open it for writing)");
  out << chrome_json();
  out.close();
  if (!out) throw Error("writing the trace to '" + path + "' failed");
}

TraceSummary Trace::summary() const {
  TraceSummary s;
  s.run_ns = run_ns();
  for (const TraceTrack& track : tracks_) {
    TrackSummary t;
    t.name = track.name();
    t.kind = track.kind();
    t.total_ns = s.run_ns;
    t.iterations = track.iterations();
    t.events = track.events().size();
    std::int64_t recorded = 0;
    std::vector<std::int64_t> by_label;  // by label index
    for (const TraceEvent& e : track.events()) {
      const std::int64_t d = e.end_ns - e.begin_ns;
      t.ns[static_cast<std::size_t>(e.phase)] += d;
      recorded += d;
      // Bytes a stream copy moved: on the Mid phase without I/O tiles, on the End phase
      // (I/O tiles -> compute tiles) with them; never both.
      const bool moves_bytes = e.phase == Phase::kTransfer || e.phase == Phase::kStreamCopyMid ||
                               e.phase == Phase::kStreamCopyEnd;
      if (moves_bytes) (e.to_host ? t.bytes_to_host : t.bytes_to_device) += e.bytes;
      if (d > t.longest_ns) {
        t.longest_ns = d;
        t.longest_phase = e.phase;
        t.longest_label = track.label(e);
      }
      if (e.label != 0) {
        if (by_label.size() <= e.label) by_label.resize(e.label + 1, 0);
        by_label[e.label] += d;
      }
    }
    for (std::size_t l = 1; l < by_label.size(); ++l) {
      if (by_label[l] > 0) t.label_ns.emplace_back(track.labels()[l], by_label[l]);
    }
    std::stable_sort(t.label_ns.begin(), t.label_ns.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    // Time no phase accounts for is idle (on an I/O track: the link was free).
    t.ns[static_cast<std::size_t>(Phase::kIdle)] += std::max<std::int64_t>(0, s.run_ns - recorded);
    std::int64_t sum = 0;
    for (std::int64_t v : t.ns) sum += v;
    for (std::size_t p = 0; p < kPhaseCount; ++p) {
      t.share[p] = sum > 0 ? static_cast<double>(t.ns[p]) / static_cast<double>(sum) : 0.0;
    }
    for (const TraceEvent& e : track.modeled_events()) {
      t.modeled_phase_ns[static_cast<std::size_t>(e.phase)] += e.end_ns - e.begin_ns;
      t.modeled_ns = std::max(t.modeled_ns, e.end_ns);
    }
    s.modeled_run_ns = std::max(s.modeled_run_ns, t.modeled_ns);
    s.tracks.push_back(std::move(t));
  }
  for (TrackSummary& t : s.tracks) {  // shares of the slowest device's modeled time
    if (t.modeled_ns == 0 || s.modeled_run_ns == 0) continue;
    t.modeled_phase_ns[static_cast<std::size_t>(Phase::kIdle)] += s.modeled_run_ns - t.modeled_ns;
    for (std::size_t p = 0; p < kPhaseCount; ++p) {
      t.modeled_share[p] =
          static_cast<double>(t.modeled_phase_ns[p]) / static_cast<double>(s.modeled_run_ns);
    }
  }
  return s;
}

std::string TraceSummary::to_string() const {
  std::ostringstream os;
  char buf[256];
  std::snprintf(buf, sizeof buf, "run: %.3f ms\n", static_cast<double>(run_ns) / 1e6);
  os << buf;
  std::snprintf(buf, sizeof buf, "%-22s %7s %7s %7s %7s %7s %7s %7s %7s\n", "track", "SCBegin",
                "SCMid", "SCEnd", "Compute", "Sync", "Exchg", "Transfr", "Idle");
  os << buf;
  const Phase order[] = {Phase::kStreamCopyBegin, Phase::kStreamCopyMid, Phase::kStreamCopyEnd,
                         Phase::kCompute,         Phase::kSync,          Phase::kExchange,
                         Phase::kTransfer,        Phase::kIdle};
  for (const TrackSummary& t : tracks) {
    std::snprintf(buf, sizeof buf, "%-22s", t.name.c_str());
    os << buf;
    for (Phase p : order) {
      std::snprintf(buf, sizeof buf, " %6.1f%%", 100.0 * t.share[static_cast<std::size_t>(p)]);
      os << buf;
    }
    os << '\n';
  }
  for (const TrackSummary& t : tracks) {
    std::snprintf(buf, sizeof buf,
                  "%-22s %llu iterations, %s to device, %s to host, longest: %s%s%s %.1f us\n",
                  t.name.c_str(), static_cast<unsigned long long>(t.iterations),
                  format_bytes(t.bytes_to_device).c_str(), format_bytes(t.bytes_to_host).c_str(),
                  bspflow::to_string(t.longest_phase), t.longest_label.empty() ? "" : " ",
                  t.longest_label.c_str(), static_cast<double>(t.longest_ns) / 1e3);
    os << buf;
    if (!t.label_ns.empty() && run_ns > 0) {
      os << std::string(22, ' ') << " by label:";
      const char* sep = " ";
      for (const auto& [label, ns] : t.label_ns) {
        std::snprintf(buf, sizeof buf, "%s%s %.1f%%", sep, label.c_str(),
                      100.0 * static_cast<double>(ns) / static_cast<double>(run_ns));
        os << buf;
        sep = ", ";
      }
      os << '\n';
    }
  }
  if (modeled_run_ns > 0) {
    std::snprintf(buf, sizeof buf, "modeled IPU time: %.3f ms (CPU: %.3f ms, %.1fx)\n",
                  static_cast<double>(modeled_run_ns) / 1e6, static_cast<double>(run_ns) / 1e6,
                  static_cast<double>(run_ns) / static_cast<double>(modeled_run_ns));
    os << buf;
    std::snprintf(buf, sizeof buf, "%-22s %7s %7s %7s %7s %7s\n", "track (modeled)", "Compute",
                  "Link", "Exchg", "Sync", "Idle");
    os << buf;
    for (const TrackSummary& t : tracks) {
      if (t.modeled_ns == 0) continue;
      std::snprintf(buf, sizeof buf, "%-22s", t.name.c_str());
      os << buf;
      for (Phase p :
           {Phase::kCompute, Phase::kStreamCopyMid, Phase::kExchange, Phase::kSync, Phase::kIdle}) {
        std::snprintf(buf, sizeof buf, " %6.1f%%",
                      100.0 * t.modeled_share[static_cast<std::size_t>(p)]);
        os << buf;
      }
      os << '\n';
    }
  }
  return os.str();
}

}  // namespace bspflow
