/// @file
/// bspflow::Error and the exceptions derived from it.
///
/// Setup paths (constructors, option setters, loop launch) throw these with a message a user
/// can act on: what was wrong, the value given, and what is allowed. Hot paths never throw;
/// they return bool / optional / a status instead.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace bspflow {

/// Base of every exception bspflow throws on purpose.
class Error : public std::runtime_error {
 public:
  /// Takes the message, as std::runtime_error does.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  using std::runtime_error::runtime_error;
};

/// A byte count as people read it: "624.0 KiB", "897.0 MiB" (binary units, one decimal).
/// Contract: any; non-blocking; allocates; throws bad_alloc.
std::string format_bytes(std::uint64_t bytes);

namespace detail {

/// "prefetch_depth = 0 is not allowed: must be in 1..255" — the one shape every
/// validation error takes, so they read the same everywhere.
[[noreturn]] void throw_bad_value(std::string_view name, std::string_view given,
                                  std::string_view allowed);
/// A count, printed with its sign: -1 is "-1", never a wrapped unsigned number.
template <class T>
[[noreturn]] void throw_bad_value(std::string_view name, T given,
                                  std::string_view allowed) requires(std::is_integral_v<T> &&
                                                                     !std::is_same_v<T, bool>) {
  throw_bad_value(name, std::string_view(std::to_string(given)), allowed);
}
/// A duration, printed as describe_duration() does: "-1 us", "250 ms".
[[noreturn]] void throw_bad_value(std::string_view name, std::chrono::nanoseconds given,
                                  std::string_view allowed);

/// A duration as people read it, with its sign: "-1 us", "1.5 ms", "30 s", "0 ns".
std::string describe_duration(std::chrono::nanoseconds d);

/// "1 step", "2 steps": a count and its noun (plural with an s unless n is 1).
std::string count_of(std::uint64_t n, std::string_view noun);

/// The message of an exception_ptr, or "unknown exception".
std::string describe_exception(const std::exception_ptr& e);

}  // namespace detail
}  // namespace bspflow
