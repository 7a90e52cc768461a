// The stall check (see bspflow/run/stall.hpp and detail/run_monitor.hpp): StallCheck's
// rules, the monitor thread, and the report a stalled run logs (and, with OnStall::kFail,
// throws as StallError).
#include "bspflow/run/detail/run_monitor.hpp"

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <set>
#include <thread>

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/log.hpp"

namespace bspflow {

void StallCheck::validate() const {
  if (limit.count() != 0 &&
      (limit < tunables::kMinRunStallLimit || limit > tunables::kMaxRunStallLimit)) {
    detail::throw_bad_value("StallCheck::limit", detail::describe_duration(limit),
                            "must be 0 (no check) or in 1 ms..24 h");
  }
}

namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

// How often the monitor looks at a run with this limit.
std::chrono::nanoseconds period_of(std::chrono::nanoseconds limit) {
  return std::clamp<std::chrono::nanoseconds>(limit / 4, std::chrono::milliseconds(1),
                                              std::chrono::seconds(1));
}

// What would let a run waiting on these kinds of things go on.
std::string advice(const std::set<WaitKind>& kinds) {
  std::string out;
  auto add = [&](const char* what) { out += (out.empty() ? "" : ", ") + std::string(what); };
  if (kinds.count(WaitKind::kInfeed)) add("push to the infeed or close it");
  if (kinds.count(WaitKind::kOutfeed)) add("read the outfeed");
  // (A device at a Sync behind one that waits for a feed needs only the feed.)
  if (kinds.count(WaitKind::kSync) && !kinds.count(WaitKind::kInfeed) &&
      !kinds.count(WaitKind::kOutfeed)) {
    add("let every device of a sync group reach its Sync (one that has ended never will)");
  }
  if (kinds.count(WaitKind::kTurn)) add("let the device's earlier job end");
  out += out.empty() ? "cancel the run" : ", or cancel the run";
  out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

// A look at one run. Returns the report when it has just stalled (once per run).
std::string look(StallWatch& w, Clock::time_point now) {
  bool all_waiting = true, moved = false;
  for (std::uint32_t r = 0; r < w.replicas; ++r) {
    const WaitNote& note = *w.control->note(r);
    // relaxed: see WaitNote.
    if (note.site.load(std::memory_order_relaxed) == nullptr) all_waiting = false;
    const std::uint64_t moves = note.moves.load(std::memory_order_relaxed);
    if (moves != w.moves[r]) {
      w.moves[r] = moves;
      moved = true;
    }
  }
  if (!all_waiting || moved) w.since = now;
  if (w.reported || now - w.since < w.check.limit) return {};
  std::string lines;
  std::set<WaitKind> kinds;
  std::vector<StallError::Wait> waits;
  for (std::uint32_t r = 0; r < w.replicas; ++r) {
    const WaitSite* site = w.control->note(r)->site.load(std::memory_order_relaxed);
    if (site == nullptr) return {};  // it moved after all: no stall (the next look decides)
    std::string what = site->what;
    if (site->state) what += " (" + site->state() + ")";
    kinds.insert(site->kind);
    const WatchedDevice& d = w.devices[r];
    const bool ended = site->kind == WaitKind::kEnded;
    lines += (r == 0 ? "" : "; ") + std::string("device ") + std::to_string(d.device) + " (" +
             (d.role.empty() ? "replica " + std::to_string(d.replica) : d.role) + ") " +
             (ended ? "has ended" : "waits for " + what);
    waits.push_back({d.device, d.replica, ended ? "nothing: it has ended" : std::move(what)});
  }
  w.reported = true;
  std::string report = w.name + ": no device has made progress for " +
                       describe_duration(w.check.limit) + " (StallCheck::limit): " + lines + ". " +
                       advice(kinds);
  if (w.check.on_stall == OnStall::kFail) {
    report += " (OnStall::kFail: the run ends with StallError)";
    // Ended once the report is logged (see Monitor::loop), so a caller that catches the
    // StallError finds the report in its log.
    w.fail_report = report;
    w.fail_waits = std::move(waits);
    w.fail_pending = true;
  }
  return report;
}

class Monitor {
 public:
  ~Monitor() {
    {
      std::lock_guard lock(mutex_);
      quit_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void add(StallWatch* w) {
    std::lock_guard lock(mutex_);
    w->moves.assign(w->replicas, ~std::uint64_t{0});  // the first look counts as a move
    w->since = Clock::now();
    if (!thread_.joinable())
      thread_ = std::thread([this] {
        name_this_thread("bspflow-stall");
        loop();
      });
    // Last: if anything above threw (out of memory), the monitor holds nothing of the watch,
    // which its owner then frees.
    watches_.push_back(w);
    // Wake the thread only if it sleeps for longer than this run needs (a syscall per run
    // otherwise).
    if (idle_ || period_of(w->check.limit) < period_) cv_.notify_one();
  }
  void remove(StallWatch* w) noexcept {
    std::lock_guard lock(mutex_);  // waits for a look in progress
    std::erase(watches_, w);
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    bool lingered = false;
    while (!quit_) {
      if (watches_.empty()) {
        // Linger one period before sleeping untimed: back-to-back short runs (a loop called
        // in a loop, 1000 elements a call) then add their watches without waking this thread,
        // a system call and a wake-up of another core per run (the feed benchmark lost 10-15%
        // to it).
        if (!lingered) {
          lingered = true;
          cv_.wait_for(lock, period_);
          continue;
        }
        idle_ = true;
        cv_.wait(lock, [&] { return quit_ || !watches_.empty(); });
        idle_ = false;
        continue;
      }
      lingered = false;
      period_ = std::chrono::seconds(1);
      for (const StallWatch* w : watches_) period_ = std::min(period_, period_of(w->check.limit));
      cv_.wait_for(lock, period_);
      std::vector<std::string> reports;
      const Clock::time_point now = Clock::now();
      try {
        for (StallWatch* w : watches_) {
          if (std::string r = look(*w, now); !r.empty()) reports.push_back(std::move(r));
        }
      } catch (...) {
        // Out of memory while making a report: this thread goes on (an exception leaving it
        // would end the process). look() marks a watch reported only once its report is
        // made, so the rest are looked at again next period.
      }
      if (reports.empty()) continue;
      lock.unlock();  // the log handler is the application's: not under the monitor's lock
      for (const std::string& r : reports) {
        try {
          log(LogLevel::kWarning, r);
        } catch (...) {  // a handler that throws (or runs out of memory) loses only its line
        }
      }
      lock.lock();
      // Then the OnStall::kFail runs among them end. Only those still watched: one that
      // ended meanwhile was removed (its control may be gone), and one that moved since the
      // look is ended all the same (it was stalled for the whole limit).
      for (StallWatch* w : watches_) {
        if (!w->fail_pending) continue;
        w->fail_pending = false;
        w->control->stall(w->fail_report, std::move(w->fail_waits));
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<StallWatch*> watches_;
  std::chrono::nanoseconds period_{std::chrono::seconds(1)};
  bool idle_ = false;
  bool quit_ = false;
  std::thread thread_;  // last: made after the members it uses
};

Monitor& monitor() {
  static Monitor m;
  return m;
}

}  // namespace

void watch_run(StallWatch* watch) {
  monitor().add(watch);
}

void unwatch_run(StallWatch* watch) noexcept {
  monitor().remove(watch);
}

// Made when the library loads, not at first use: these are handed out by noexcept functions
// on a run's setup path, and a first use could fail to allocate their text.
namespace {
const WaitSite g_not_started_site{
    WaitKind::kTurn, "its turn on the device (an earlier job still runs there)", {}};
const WaitSite g_ended_site{WaitKind::kEnded, "has ended", {}};
const WaitSite g_io_drain_site{
    WaitKind::kOutfeed,
    "the I/O engine's last transfers (its outputs wait for room in the outfeed)",
    {}};
}  // namespace

const WaitSite& not_started_site() noexcept {
  return g_not_started_site;
}

const WaitSite& ended_site() noexcept {
  return g_ended_site;
}

const WaitSite& io_drain_site() noexcept {
  return g_io_drain_site;
}

}  // namespace detail
}  // namespace bspflow
