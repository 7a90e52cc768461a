/// @file
/// Minimal logging: warnings (e.g. devices sharing cores) go to a handler the application
/// may replace. Default: stderr, level from BSPFLOW_LOG_LEVEL (debug|info|warning|error|off),
/// default warning.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace bspflow {

/// How severe a log message is; kOff, as a level, drops every message.
enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

/// Receives each message that passes the level, with its level.
using LogHandler = std::function<void(LogLevel, std::string_view)>;

/// Replaces the handler; an empty handler restores the default (stderr). Takes the lock
/// log() handles messages under: waits until a message another thread is logging has been
/// handled.
/// Contract: any; blocks; no-alloc; noexcept.
void set_log_handler(LogHandler handler) noexcept;
/// Messages below this level are dropped before formatting reaches the handler.
/// Contract: any; non-blocking; no-alloc; noexcept.
void set_log_level(LogLevel level) noexcept;
/// The level set last (at first, the one BSPFLOW_LOG_LEVEL gives).
/// Contract: any; non-blocking; no-alloc; noexcept.
LogLevel log_level() noexcept;
/// Hands `message` to the handler (or writes it to stderr) unless `level` is below
/// log_level(). Messages are handled one at a time, under a lock: a call waits until the
/// message another thread is logging has been handled. For setup paths, never the hot path.
/// A handler set with set_log_handler() may allocate or throw on its own account: what it
/// throws leaves log().
/// Contract: any; blocks; no-alloc; throws what the handler throws.
void log(LogLevel level, std::string_view message);

/// log(), the first time this process is given this exact message at this level; later
/// calls with it do nothing and return false. For a notice that would repeat once per object
/// built (a loader's drop_last warning, built again for each measurement): said once per
/// distinct cause. Remembers each distinct message (allocates the first time). Waits for the
/// log lock as log() does.
/// Contract: any; blocks; allocates; throws bad_alloc (and what the handler throws).
bool log_once(LogLevel level, std::string_view message);

/// "debug", "info", "warning", "error" or "off".
/// Contract: any; non-blocking; no-alloc; noexcept.
std::string_view to_string(LogLevel level) noexcept;

}  // namespace bspflow
