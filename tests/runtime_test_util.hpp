// Helpers shared by the runtime suite's files.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace test {

// Polls `f` until it is true or `limit` has passed; returns its last value. The limit only
// keeps a failing test from hanging: the outcome never depends on it.
inline bool eventually(const std::function<bool()>& f,
                       std::chrono::milliseconds limit = std::chrono::milliseconds(2000)) {
  const auto until = bspflow::StreamClock::now() + limit;
  while (!f()) {
    if (bspflow::StreamClock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Captures the log (warnings and above) while it lives; restores the handler and the level.
class LogCapture {
 public:
  LogCapture() : before_(bspflow::log_level()) {
    bspflow::set_log_level(bspflow::LogLevel::kWarning);
    bspflow::set_log_handler([this](bspflow::LogLevel, std::string_view m) {
      std::lock_guard lock(mutex_);
      lines_.emplace_back(m);
    });
  }
  ~LogCapture() {
    bspflow::set_log_handler(nullptr);
    bspflow::set_log_level(before_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  // Whether a line logged so far contains `needle`.
  bool has(const std::string& needle) {
    std::lock_guard lock(mutex_);
    for (const std::string& l : lines_) {
      if (l.find(needle) != std::string::npos) return true;
    }
    return false;
  }

 private:
  bspflow::LogLevel before_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

// Holds a stage's call until opened (at most 10 s, so a failing test cannot hang).
struct Gate {
  std::atomic<bool> entered{false};
  std::atomic<bool> open{false};
  void hold() {
    entered = true;
    const auto until = bspflow::StreamClock::now() + std::chrono::seconds(10);
    while (!open.load() && bspflow::StreamClock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  // Whether a call reached hold() within 5 s.
  bool wait_entered() const {
    const auto until = bspflow::StreamClock::now() + std::chrono::seconds(5);
    while (!entered.load() && bspflow::StreamClock::now() < until) std::this_thread::yield();
    return entered.load();
  }
};

// Small devices (64 tiles x 16 KiB): tests do not need 897 MiB of address space each.
inline const bspflow::DeviceConfig kSmall{64, 16 * 1024};

inline bspflow::Tensor filled(std::size_t n, float v) {
  bspflow::Tensor t(bspflow::DType::kFloat32, {n});
  for (float& x : t.as<float>()) x = v;
  return t;
}

// A host link on which `bytes` take `d`.
inline bspflow::EngineConfig with_link(std::chrono::nanoseconds d, std::size_t bytes,
                                       std::uint32_t io_tiles = 0, std::uint32_t prefetch = 1) {
  bspflow::EngineConfig c;
  c.host_link = bspflow::LinkModel::taking(d, bytes);
  c.io_tiles = io_tiles;
  c.prefetch_depth = prefetch;
  return c;
}

// A hang guard, never a timing check: if it is still alive `limit` after it was made, a
// thread of its own calls `rescue` once (cancel the run, drain the outfeed: whatever lets the
// code under test return), and fired() says so; the test then FAILs instead of hanging. A
// correct run ends long before the limit, so nothing is timed.
//
//   test::Rescue guard(10s, [&] { pipe.cancel(); });
//   auto r = pipe.run(...);
//   CHECK_FALSE(guard.fired());
class Rescue {
 public:
  Rescue(std::chrono::seconds limit, std::function<void()> rescue)
      : thread_([this, limit, rescue = std::move(rescue)](std::stop_token stop) {
          std::unique_lock lock(m_);
          // Wakes early only when the guard is stopped (the predicate never holds).
          (void)cv_.wait_for(lock, stop, limit, [] { return false; });
          if (stop.stop_requested()) return;
          fired_ = true;
          lock.unlock();
          rescue();
        }) {}
  // Stops the guard (and waits for a rescue in progress).
  ~Rescue() { thread_ = {}; }
  Rescue(const Rescue&) = delete;
  Rescue& operator=(const Rescue&) = delete;
  // Whether the rescue was called (the code under test hung). Any thread.
  bool fired() const {
    std::lock_guard lock(m_);
    return fired_;
  }
  // Stops the guard now (the code under test returned). Waits for a rescue in progress.
  void disarm() { thread_ = {}; }

 private:
  mutable std::mutex m_;
  std::condition_variable_any cv_;
  bool fired_ = false;
  std::jthread thread_;  // last: made after the members it uses
};

}  // namespace test
