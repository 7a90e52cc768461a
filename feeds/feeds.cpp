// Out-of-line parts of the feeds room: error helpers, logging, output modes and feed
// config validation.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>

#include "bspflow/error.hpp"
#include "bspflow/infeed_queue.hpp"
#include "bspflow/log.hpp"
#include "bspflow/outfeed_queue.hpp"
#include "bspflow/output_mode.hpp"
#include "bspflow/tunables.hpp"

namespace bspflow {
namespace detail {

void throw_bad_value(std::string_view name, std::string_view given, std::string_view allowed) {
  std::string msg;
  msg.append(name).append(" = ").append(given).append(" is not allowed: ").append(allowed);
  throw Error(msg);
}

void throw_bad_value(std::string_view name, std::uint64_t given, std::string_view allowed) {
  throw_bad_value(name, std::to_string(given), allowed);
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit]);
  }
  return buf;
}

std::string describe_exception(const std::exception_ptr& e) {
  if (!e) return "no exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

}  // namespace detail

// ---- logging ----

namespace {

struct LogState {
  std::mutex mutex;
  LogHandler handler;
};

LogState& log_state() {
  static LogState state;
  return state;
}

LogLevel level_from_env() {
  const char* v = std::getenv("BSPFLOW_LOG_LEVEL");
  if (v == nullptr) return LogLevel::kWarning;
  const std::string s(v);
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

std::string_view to_string(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

void set_log_handler(LogHandler handler) {
  std::lock_guard lock(log_state().mutex);
  log_state().handler = std::move(handler);
}

void set_log_level(LogLevel level) {
  level_ref().store(static_cast<int>(level), std::memory_order_relaxed);  // relaxed: a hint
}

LogLevel log_level() {
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

// ---- output modes ----

OutputMode OutputMode::every_n(std::uint64_t n) {
  if (n == 0) detail::throw_bad_value("OutputMode every_n(n): n", n, "must be at least 1");
  return OutputMode(Kind::kEveryN, n);
}

OutputMode OutputMode::parse(std::string_view text) {
  if (text == "all") return all();
  if (text == "final") return final();
  if (text == "sum") return sum();
  constexpr std::string_view kEvery = "every_n:";
  if (text.substr(0, kEvery.size()) == kEvery) {
    const std::string digits(text.substr(kEvery.size()));
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos &&
        digits.size() < 19) {
      return every_n(std::stoull(digits));
    }
  }
  detail::throw_bad_value("output mode", "'" + std::string(text) + "'",
                          "use all, final, sum or every_n:N with N >= 1");
}

std::string OutputMode::to_string() const {
  switch (kind_) {
    case Kind::kAll: return "all";
    case Kind::kFinal: return "final";
    case Kind::kSum: return "sum";
    case Kind::kEveryN: return "every_n:" + std::to_string(n_);
  }
  return "?";
}

// ---- feed configs ----

namespace {

void check_replicas(std::uint32_t replicas) {
  if (replicas < 1 || replicas > tunables::kMaxReplicas) {
    detail::throw_bad_value("replicas", replicas,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
}

}  // namespace

void InfeedConfig::validate() const {
  check_replicas(replicas);
  if (prefetch_depth < tunables::kMinPrefetchDepth ||
      prefetch_depth > tunables::kMaxPrefetchDepth) {
    detail::throw_bad_value("prefetch_depth", prefetch_depth,
                            "must be in " + std::to_string(tunables::kMinPrefetchDepth) + ".." +
                                std::to_string(tunables::kMaxPrefetchDepth));
  }
  if (capacity < prefetch_depth || capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("infeed capacity", capacity,
                            "must be in prefetch_depth (" + std::to_string(prefetch_depth) +
                                ").." + std::to_string(tunables::kMaxQueueCapacity) +
                                " elements per replica");
  }
}

void OutfeedConfig::validate() const {
  check_replicas(replicas);
  if (capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("outfeed capacity", capacity,
                            "must be 0 (unbounded) or at most " +
                                std::to_string(tunables::kMaxQueueCapacity) + " entries");
  }
}

}  // namespace bspflow
