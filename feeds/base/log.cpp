// Logging (see bspflow/base/log.hpp).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "bspflow/base/log.hpp"

namespace bspflow {

namespace {

struct LogState {
  std::mutex mutex;
  LogHandler handler;
  std::set<std::pair<int, std::string>> said;  // log_once's messages so far
};

LogState& log_state() {
  static LogState state;
  return state;
}

LogLevel level_from_env() {
  // The library reads the environment and never writes it.
  const char* v = std::getenv("BSPFLOW_LOG_LEVEL");  // NOLINT(concurrency-mt-unsafe)
  if (v == nullptr) return LogLevel::kWarning;
  const std::string_view s(v);  // a view: reading the level never allocates
  if (s == "debug") return LogLevel::kDebug;
  if (s == "info") return LogLevel::kInfo;
  if (s == "warning") return LogLevel::kWarning;
  if (s == "error") return LogLevel::kError;
  if (s == "off") return LogLevel::kOff;
  std::fprintf(stderr,
               "bspflow: BSPFLOW_LOG_LEVEL=%s is not a level; use debug, info, warning, error "
               "or off (using warning)\n",
               v);
  return LogLevel::kWarning;
}

std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(level_from_env())};
  return level;
}

}  // namespace

std::string_view to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
    case LogLevel::kOff:
      return "off";
  }
  return "?";
}

void set_log_handler(LogHandler handler) noexcept {
  std::lock_guard lock(log_state().mutex);
  log_state().handler = std::move(handler);
}

void set_log_level(LogLevel level) noexcept {
  level_ref().store(static_cast<int>(level), std::memory_order_relaxed);  // relaxed: a hint
}

LogLevel log_level() noexcept {
  return static_cast<LogLevel>(level_ref().load(std::memory_order_relaxed));  // relaxed: a hint
}

void log(LogLevel level, std::string_view message) {
  if (level == LogLevel::kOff || static_cast<int>(level) < static_cast<int>(log_level())) return;
  std::lock_guard lock(log_state().mutex);
  if (log_state().handler) {
    log_state().handler(level, message);
    return;
  }
  std::fprintf(stderr, "bspflow %.*s: %.*s\n", static_cast<int>(to_string(level).size()),
               to_string(level).data(), static_cast<int>(message.size()), message.data());
}

bool log_once(LogLevel level, std::string_view message) {
  if (level == LogLevel::kOff || static_cast<int>(level) < static_cast<int>(log_level())) {
    return false;
  }
  {
    std::lock_guard lock(log_state().mutex);
    if (!log_state().said.emplace(static_cast<int>(level), std::string(message)).second) {
      return false;
    }
  }
  log(level, message);
  return true;
}

}  // namespace bspflow
