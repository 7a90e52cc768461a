// Minimal logging: warnings (e.g. devices sharing cores) go to a handler the application
// may replace. Default: stderr, level from BSPFLOW_LOG_LEVEL (debug|info|warning|error|off),
// default warning.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace bspflow {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

using LogHandler = std::function<void(LogLevel, std::string_view)>;

// Any thread. Replaces the handler; an empty handler restores the default (stderr).
void set_log_handler(LogHandler handler);
// Any thread. Messages below this level are dropped before formatting reaches the handler.
void set_log_level(LogLevel level);
LogLevel log_level();
// Any thread. Thread-safe; takes a lock (setup paths only, never the hot path).
void log(LogLevel level, std::string_view message);

std::string_view to_string(LogLevel level);

}  // namespace bspflow
