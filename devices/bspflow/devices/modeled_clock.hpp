/// @file
/// The modeled IPU clock (see device_model.hpp and devices/README.md "The modeled IPU clock"):
/// beside the real time a run takes on the CPU, each device keeps the time a real IPU would
/// take for the same run. ModeledTime is what results report; ModeledClock is one device's
/// clock, advanced by its own thread as it runs; ModeledLink schedules one device's host
/// stream copies in modeled time (with I/O tiles they overlap compute there too).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bspflow {

/// A run's modeled IPU time: the slowest device's, and where that device's time went
/// (total = host_call + compute + host_link + exchange + sync + idle). A plain value: any
/// thread may read it once a run has returned it.
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct ModeledTime {
  std::chrono::nanoseconds total{0};      ///< from the host call to the last device's end
  std::chrono::nanoseconds compute{0};    ///< declared compute sets (and exchange on chip)
  std::chrono::nanoseconds host_link{0};  ///< waiting for stream copies (in and out)
  std::chrono::nanoseconds exchange{0};   ///< the device link: copies between devices, all-reduce
  std::chrono::nanoseconds sync{0};       ///< syncs across devices, waiting for the slowest
  std::chrono::nanoseconds host_call{0};  ///< the host launching the run (DeviceModel::host_call)
  std::chrono::nanoseconds idle{0};       ///< waiting for work from the host (a stream's requests)
  /// Compute steps that declared no cost (every device): they cost nothing here, so the
  /// modeled time misses them. 0: the modeled time is complete.
  std::uint64_t undeclared = 0;

  /// Whether every compute step declared its cost.
  bool complete() const noexcept { return undeclared == 0; }
  /// `items` per modeled second (0 if no time passed).
  double rate(double items) const noexcept {
    return total.count() > 0 ? items * 1e9 / static_cast<double>(total.count()) : 0.0;
  }
};

/// What a modeled span of a device's time was spent on.
enum class ModeledPhase : std::uint8_t { kHostCall, kCompute, kHostLink, kExchange, kSync };

/// Receives a clock's spans as it advances (a trace's device track).
class ModeledSpans {
 public:
  virtual ~ModeledSpans() = default;
  /// One span of `phase` from `begin_ns` to `end_ns` on the clock. `label`: what the compute
  /// was (a trace label; 0: none). Called on the clock's thread; an implementation may
  /// allocate (a trace appends the span) but must not throw.
  /// Contract: device; non-blocking; allocates; noexcept.
  virtual void modeled_span(ModeledPhase phase, double begin_ns, double end_ns,
                            std::uint32_t label) noexcept = 0;
};

/// One device's modeled clock, in nanoseconds since the run began (each Device owns one:
/// Device::clock()). The host reads it once the run has ended. Its members allocate nothing
/// themselves; the ModeledSpans they report to may.
/// Contract of every member: device; non-blocking; no-alloc; noexcept.
class ModeledClock {
 public:
  /// The start of a run: the host call first (host_call_ns), everything else zero.
  /// `spans`: where the clock's spans go (null: nowhere).
  void reset(double host_call_ns, ModeledSpans* spans = nullptr) noexcept {
    *this = ModeledClock{};
    spans_ = spans;
    now_ = host_call_ns;
    host_call_ = host_call_ns;
    span(ModeledPhase::kHostCall, 0, now_);
  }
  /// The modeled time now, in nanoseconds since the run began.
  double now() const noexcept { return now_; }
  /// When the run's program started: after the host call.
  double launched() const noexcept { return host_call_; }
  /// A compute set of `ns` (declared).
  void compute(double ns, std::uint32_t label = 0) noexcept {
    span(ModeledPhase::kCompute, now_, now_ + ns, label);
    now_ += ns;
    compute_ += ns;
  }
  /// A compute step that declared no cost.
  void undeclared() noexcept { ++undeclared_; }
  /// Waits for a host stream copy that ends at `t` (nothing if it already has), then spends
  /// `ns` on the device's side of it (the hand-over between I/O tiles and compute tiles).
  void link_until(double t, double ns = 0) noexcept {
    const double to = std::max(now_, t) + ns;
    span(ModeledPhase::kHostLink, now_, to);
    link_ += to - now_;
    now_ = to;
  }
  /// A transfer over the device link (a copy between devices, an all-reduce) of `ns`.
  void exchange(double ns) noexcept {
    span(ModeledPhase::kExchange, now_, now_ + ns);
    now_ += ns;
    exchange_ += ns;
  }
  /// Nothing to do until `t` (a request that arrives then).
  void idle_until(double t) noexcept {
    if (t <= now_) return;
    idle_ += t - now_;
    now_ = t;
  }
  /// A sync: the devices it joins go on together at the latest of their clocks (`latest`),
  /// plus the sync's own `cost_ns`.
  void sync_to(double latest, double cost_ns) noexcept {
    const double to = std::max(now_, latest) + cost_ns;
    span(ModeledPhase::kSync, now_, to);
    sync_ += to - now_;
    now_ = to;
  }
  /// What this device's clock says, as a ModeledTime of one device.
  ModeledTime time() const noexcept {
    auto ns = [](double v) { return std::chrono::nanoseconds(std::llround(v)); };
    ModeledTime t;
    t.total = ns(now_);
    t.compute = ns(compute_);
    t.host_link = ns(link_);
    t.exchange = ns(exchange_);
    t.sync = ns(sync_);
    t.host_call = ns(host_call_);
    t.idle = ns(idle_);
    t.undeclared = undeclared_;
    return t;
  }

 private:
  void span(ModeledPhase phase, double begin, double end, std::uint32_t label = 0) noexcept {
    if (spans_ != nullptr && end > begin) spans_->modeled_span(phase, begin, end, label);
  }

  double now_ = 0, compute_ = 0, link_ = 0, exchange_ = 0, sync_ = 0, host_call_ = 0, idle_ = 0;
  std::uint64_t undeclared_ = 0;
  ModeledSpans* spans_ = nullptr;
};

/// One device's host stream copies in modeled time: the same schedule as HostLinkTimeline's
/// (and the Engine's I/O engine) on the modeled clock. The host's data is taken as ready (the
/// host side is real and reported apart: see RunResult::host_wait). Without I/O tiles a copy
/// starts when the device asks (or the link is free) and the device waits for it. With I/O
/// tiles input k starts as soon as its buffer (k mod prefetch_depth) and the link are free,
/// and the device waits only for what is left of it, then takes it over from the I/O tiles
/// (`handover_ns`); an output is handed to a buffer (waiting only while that buffer's last copy
/// runs) and the device goes on. Not thread-safe: set up by the host, then used by one device
/// thread.
/// Contract of every member: device; non-blocking; no-alloc; noexcept, unless tagged.
class ModeledLink {
 public:
  /// Before a run: the link and every buffer are free from `now`. Allocates only when the
  /// buffer count (prefetch_depth) grows.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  void start(double now, std::uint32_t io_tiles, std::uint32_t prefetch_depth) {
    io_tiles_ = io_tiles;
    in_free_.assign(std::max<std::uint32_t>(prefetch_depth, 1), now);
    out_free_.assign(in_free_.size(), now);
    in_link_free_ = out_link_free_ = now;
    ins_ = outs_ = 0;
  }
  /// The device takes its next input, a copy of `duration_ns` on the link.
  void copy_in(ModeledClock& c, double duration_ns, double handover_ns) noexcept {
    if (io_tiles_ == 0) return serial_copy(c, in_link_free_, duration_ns);
    double& buffer = in_free_[ins_++ % in_free_.size()];
    const double done = std::max(buffer, in_link_free_) + duration_ns;
    in_link_free_ = done;
    c.link_until(done, handover_ns);
    buffer = c.now();  // taken over: the buffer takes input k + prefetch_depth
  }
  /// The device hands over an output, a copy of `duration_ns` on the link.
  void copy_out(ModeledClock& c, double duration_ns, double handover_ns) noexcept {
    if (io_tiles_ == 0) return serial_copy(c, out_link_free_, duration_ns);
    double& buffer = out_free_[outs_++ % out_free_.size()];
    c.link_until(buffer, handover_ns);  // the buffer's last copy must have left
    const double done = std::max(c.now(), out_link_free_) + duration_ns;
    out_link_free_ = done;
    buffer = done;
  }
  /// The end of a run: the outputs still on the link (with I/O tiles) arrive.
  void finish_out(ModeledClock& c) noexcept {
    if (io_tiles_ > 0 && outs_ > 0) c.link_until(out_link_free_);
  }

 private:
  /// Without I/O tiles: the device waits for its copy, one at a time on the link's direction.
  static void serial_copy(ModeledClock& c, double& link_free, double duration_ns) noexcept {
    link_free = std::max(c.now(), link_free) + duration_ns;
    c.link_until(link_free);
  }

  std::uint32_t io_tiles_ = 0;
  std::vector<double> in_free_, out_free_;
  double in_link_free_ = 0, out_link_free_ = 0;
  std::uint64_t ins_ = 0, outs_ = 0;
};

}  // namespace bspflow
