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

// A device's memory budget (tiles x bytes per tile) cannot hold an allocation.
// The message says how much was asked, how much is free, and what holds the rest.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& message, std::size_t requested, std::size_t free_bytes)
      : Error(message), requested_(requested), free_(free_bytes) {}
  std::size_t requested() const noexcept { return requested_; }
  std::size_t free_bytes() const noexcept { return free_; }

 private:
  std::size_t requested_;
  std::size_t free_;
};

// A loop body (or stage) threw on a device. Carries where it happened and the original
// exception, which `rethrow_cause()` rethrows for callers that want its type.
class DeviceError : public Error {
 public:
  DeviceError(const std::string& message, std::uint32_t device, std::uint32_t replica,
              std::uint64_t iteration, std::exception_ptr cause)
      : Error(message), device_(device), replica_(replica), iteration_(iteration),
        cause_(std::move(cause)) {}
  std::uint32_t device() const noexcept { return device_; }
  std::uint32_t replica() const noexcept { return replica_; }
  std::uint64_t iteration() const noexcept { return iteration_; }
  const std::exception_ptr& cause() const noexcept { return cause_; }
  [[noreturn]] void rethrow_cause() const { std::rethrow_exception(cause_); }

 private:
  std::uint32_t device_;
  std::uint32_t replica_;
  std::uint64_t iteration_;
  std::exception_ptr cause_;
};

namespace detail {

// "prefetch_depth = 0 is not allowed: must be in 1..255" — the one shape every
// validation error takes, so they read the same everywhere.
[[noreturn]] void throw_bad_value(std::string_view name, std::string_view given,
                                  std::string_view allowed);
[[noreturn]] void throw_bad_value(std::string_view name, std::uint64_t given,
                                  std::string_view allowed);

// Human-readable byte count: "624.0 KiB", "897.0 MiB".
std::string format_bytes(std::uint64_t bytes);

// The message of an exception_ptr, or "unknown exception".
std::string describe_exception(const std::exception_ptr& e);

}  // namespace detail
}  // namespace bspflow
