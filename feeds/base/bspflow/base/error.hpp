// bspflow::Error and the exceptions derived from it.
//
// Setup paths (constructors, option setters, loop launch) throw these with a message a user
// can act on: what was wrong, the value given, and what is allowed. Hot paths never throw;
// they return bool / optional / a status instead.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

namespace bspflow {

// Base of every exception bspflow throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Any thread. A byte count as people read it: "624.0 KiB", "897.0 MiB" (binary units, one
// decimal). Never blocks; allocates (the string). Throws only std::bad_alloc.
std::string format_bytes(std::uint64_t bytes);

namespace detail {

using bspflow::format_bytes;  // (its old home; kept so older code compiles)

// "prefetch_depth = 0 is not allowed: must be in 1..255" — the one shape every
// validation error takes, so they read the same everywhere.
[[noreturn]] void throw_bad_value(std::string_view name, std::string_view given,
                                  std::string_view allowed);
[[noreturn]] void throw_bad_value(std::string_view name, std::uint64_t given,
                                  std::string_view allowed);

// "1 step", "2 steps": a count and its noun (plural with an s unless n is 1).
std::string count_of(std::uint64_t n, std::string_view noun);

// The message of an exception_ptr, or "unknown exception".
std::string describe_exception(const std::exception_ptr& e);

}  // namespace detail
}  // namespace bspflow
