/// @file
/// Execution traces: every phase each device spends, and every transfer of the I/O engine,
/// recorded by the program interpreter and exported as Chrome trace-event JSON or summarised
/// as text. Recording is off unless asked for (EngineConfig::trace, or BSPFLOW_TRACE=FILE).
/// Guide: runtime/run/README.md.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/devices/modeled_clock.hpp"

namespace bspflow {

/// What a traced span of a track was spent on.
enum class Phase : std::uint8_t {
  kStreamCopyBegin,  ///< waiting for the host (data not there yet)
  kStreamCopyMid,    ///< the transfer itself
  kStreamCopyEnd,    ///< handing the data over (to the compute tiles, or to the outfeed)
  kCompute,          ///< an Execute: a compute set over the compute tiles
  kSync,             ///< a barrier across a group of devices
  kExchange,         ///< a Copy between buffers (between devices: over the modeled link)
  kIdle,             ///< waiting for anything else (a free I/O buffer, outbound transfers)
  kTransfer,         ///< I/O engine tracks: one modeled host-link transfer
};
/// How many Phase values there are.
inline constexpr std::size_t kPhaseCount = 8;
/// The phase's name: "StreamCopyBegin", "Compute", "Transfer"...
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(Phase p) noexcept;

/// One recorded span of a track.
struct TraceEvent {
  Phase phase;                ///< what the span was spent on
  bool to_host = false;       ///< kTransfer / stream copies: the direction
  std::uint32_t label = 0;    ///< index into the track's labels (0 = the phase's own name)
  std::int64_t begin_ns = 0;  ///< since the trace's origin
  std::int64_t end_ns = 0;    ///< since the trace's origin
  std::uint64_t bytes = 0;    ///< what the span moved (0: nothing)
};

/// One timeline: a device, or one channel of the I/O engine. Written by one thread at a time
/// (tagged device: the device's thread, or for an I/O track the I/O engine's thread); read
/// by the host after the run has ended. A device track also keeps the device's modeled IPU
/// timeline (its modeled clock's spans: ModeledSpans), in modeled nanoseconds since the run
/// began.
/// Contract of every member: host; non-blocking; no-alloc; noexcept, unless tagged.
class TraceTrack final : public ModeledSpans {
 public:
  /// The clock events are timed on.
  using Clock = std::chrono::steady_clock;
  /// A device's timeline, or one channel of the I/O engine.
  enum class Kind { kDevice, kIo };

  /// A track named `name`, its times counted from `origin` (Trace::add_track() makes them).
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  TraceTrack(std::string name, Kind kind, std::uint32_t id, Clock::time_point origin);

  /// Appends one event (allocates now and then, amortised).
  /// Contract: device; non-blocking; allocates; throws bad_alloc.
  void record(Phase phase, Clock::time_point begin, Clock::time_point end, std::uint64_t bytes = 0,
              std::uint32_t label = 0, bool to_host = false) {
    events_.push_back(TraceEvent{phase, to_host, label, ns(begin), ns(end), bytes});
  }
  /// Called by the device's modeled clock: one span of modeled time, as a TraceEvent
  /// (kCompute, kStreamCopyMid for the host link, kExchange, kSync, kIdle for the host call).
  /// A span that finds no memory is dropped.
  /// Contract: device; non-blocking; allocates; noexcept.
  void modeled_span(ModeledPhase phase, double begin_ns, double end_ns,
                    std::uint32_t label) noexcept override;
  /// The modeled spans, in modeled nanoseconds since the run began.
  const std::vector<TraceEvent>& modeled_events() const noexcept { return modeled_; }
  /// A label for compute sets ("matmul"): its index, for record(). The same label added twice
  /// has one index. Called at setup (the host may call it before the run).
  /// Contract: device; non-blocking; allocates; throws bad_alloc.
  std::uint32_t add_label(std::string label);
  /// One more completed iteration of the device's outermost Repeat.
  /// Contract: device; non-blocking; no-alloc; noexcept.
  void count_iteration() noexcept { ++iterations_; }

  /// The track's name ("device 0", "I/O engine: link 0").
  const std::string& name() const noexcept { return name_; }
  /// Whether it is a device's timeline or an I/O channel's.
  Kind kind() const noexcept { return kind_; }
  /// The number it was added with: its device's index in the run's device list.
  std::uint32_t id() const noexcept { return id_; }
  /// The recorded spans, in the order recorded.
  const std::vector<TraceEvent>& events() const noexcept { return events_; }
  /// The label of `e`; empty for label 0 (the phase's own name).
  const std::string& label(const TraceEvent& e) const noexcept;
  /// Every label added, by index (0: none, the phase's own name).
  const std::vector<std::string>& labels() const noexcept { return labels_; }
  /// Completed iterations of the device's outermost Repeat.
  std::uint64_t iterations() const noexcept { return iterations_; }

 private:
  std::int64_t ns(Clock::time_point t) const noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count();
  }
  std::string name_;
  Kind kind_;
  std::uint32_t id_;
  Clock::time_point origin_;
  std::vector<TraceEvent> events_;
  std::vector<TraceEvent> modeled_;
  std::vector<std::string> labels_;
  std::uint64_t iterations_ = 0;
};

/// One track of a TraceSummary.
struct TrackSummary {
  /// The track's name.
  std::string name;
  /// Whether it is a device's timeline or an I/O channel's.
  TraceTrack::Kind kind = TraceTrack::Kind::kDevice;
  std::int64_t total_ns = 0;                   ///< the run's wall time
  std::array<std::int64_t, kPhaseCount> ns{};  ///< per phase; kIdle includes unrecorded time
  std::array<double, kPhaseCount> share{};     ///< of total_ns, adding up to 1
  std::uint64_t bytes_to_device = 0;           ///< bytes moved to the device
  std::uint64_t bytes_to_host = 0;             ///< bytes moved to the host
  std::uint64_t iterations = 0;                ///< TraceTrack::iterations()
  std::uint64_t events = 0;                    ///< spans recorded
  Phase longest_phase = Phase::kIdle;          ///< the longest span's phase
  std::string longest_label;                   ///< the longest span's label (empty: none)
  std::int64_t longest_ns = 0;                 ///< the longest span's duration
  /// Time of labelled events by label, largest first ("optimiser state in", "all-reduce",
  /// "forward"...): say what share of the run remote-buffer copies or the reduction take.
  std::vector<std::pair<std::string, std::int64_t>> label_ns;
  /// The same device in modeled IPU time (device tracks; 0 when none was kept): its modeled
  /// time, and per phase (kIdle: the host call and waiting after it ended, until the slowest
  /// device's end) and shares of the slowest device's.
  std::int64_t modeled_ns = 0;
  std::array<std::int64_t, kPhaseCount> modeled_phase_ns{};  ///< modeled time per phase
  /// Per phase, the share of the slowest device's modeled time.
  std::array<double, kPhaseCount> modeled_share{};
};

/// What Trace::summary() returns: per track, where its time went.
struct TraceSummary {
  std::int64_t run_ns = 0;          ///< the run's wall time (Trace::run_ns())
  std::int64_t modeled_run_ns = 0;  ///< the slowest device's modeled time (0: none kept)
  /// One per track, in the order the tracks were added.
  std::vector<TrackSummary> tracks;
  /// A table: per track the share of each phase, bytes each way, iterations, longest phase.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  std::string to_string() const;
};

/// The tracks of one run. Not thread-safe itself: tracks are added before the run starts and
/// read after it ends; each track is written by its own thread in between.
/// Contract of every member: host; non-blocking; no-alloc; noexcept, unless tagged.
class Trace {
 public:
  /// The clock the trace's times are on.
  using Clock = std::chrono::steady_clock;
  /// A trace whose times count from `origin`.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  explicit Trace(Clock::time_point origin = Clock::now()) : origin_(origin) {}

  /// Adds a track, before the run starts. The reference stays valid as tracks are added.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  TraceTrack& add_track(std::string name, TraceTrack::Kind kind, std::uint32_t id);
  /// Sets the run's end (run_ns() counts to it).
  void set_end(Clock::time_point end) noexcept { end_ = end; }
  /// Sets the end to the latest event's end (for runs nobody timed from outside).
  void end_at_last_event() noexcept;

  /// Every track, in the order added.
  const std::deque<TraceTrack>& tracks() const noexcept { return tracks_; }
  /// The run's wall time, from the origin to the end; 0 while no end is set.
  std::int64_t run_ns() const noexcept;

  /// Chrome trace-event JSON: one process ("bspflow"), one thread per track, complete ("X")
  /// events in microseconds with bytes and labels in args; and a second process ("modeled IPU
  /// time") with each device's modeled timeline, on its own time axis (categories prefixed
  /// "modeled ").
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  std::string chrome_json() const;
  /// Writes chrome_json() to `path` (file I/O); throws bspflow::Error naming the file if it
  /// cannot be opened or written.
  /// Contract: host; non-blocking; allocates; throws Error.
  void write_chrome_json(const std::string& path) const;
  /// Per track: time per phase and its share, bytes each way, iterations, the longest phase
  /// and the time of each label; with modeled time where a track keeps it.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  TraceSummary summary() const;

 private:
  Clock::time_point origin_;
  Clock::time_point end_{};
  std::deque<TraceTrack> tracks_;  ///< deque: references stay valid as tracks are added
};

}  // namespace bspflow
