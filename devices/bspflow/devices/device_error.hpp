/// @file
/// The errors a device raises: out of device memory, and a failure in code a device ran.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>

#include "bspflow/base/error.hpp"

namespace bspflow {

/// A device's memory budget (tiles x bytes per tile) cannot hold an allocation.
/// The message says how much was asked, how much is free, and what holds the rest.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class OutOfMemoryError : public Error {
 public:
  /// `message`, the bytes `requested` and the bytes that were free (`free_bytes`).
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  OutOfMemoryError(const std::string& message, std::size_t requested, std::size_t free_bytes)
      : Error(message), requested_(requested), free_(free_bytes) {}
  /// The bytes the failed allocation asked for.
  std::size_t requested() const noexcept { return requested_; }
  /// The bytes that were free when it failed.
  std::size_t free_bytes() const noexcept { return free_; }

 private:
  std::size_t requested_;
  std::size_t free_;
};

/// A loop body (or stage) threw on a device. Carries where it happened and the original
/// exception, which `rethrow_cause()` rethrows for callers that want its type.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class DeviceError : public Error {
 public:
  /// `message`, where it happened (`device`, `replica`, `iteration`) and the original `cause`.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  DeviceError(const std::string& message, std::uint32_t device, std::uint32_t replica,
              std::uint64_t iteration, std::exception_ptr cause)
      : Error(message), device_(device), replica_(replica), iteration_(iteration),
        cause_(std::move(cause)) {}
  /// The id of the device the code threw on.
  std::uint32_t device() const noexcept { return device_; }
  /// The replica that device ran.
  std::uint32_t replica() const noexcept { return replica_; }
  /// The iteration the replica was running when the code threw.
  std::uint64_t iteration() const noexcept { return iteration_; }
  /// The exception the code threw.
  const std::exception_ptr& cause() const noexcept { return cause_; }
  /// Throws the original exception, whatever its type.
  /// Contract: any; non-blocking; no-alloc; throws the cause.
  [[noreturn]] void rethrow_cause() const { std::rethrow_exception(cause_); }

 private:
  std::uint32_t device_;
  std::uint32_t replica_;
  std::uint64_t iteration_;
  std::exception_ptr cause_;
};

}  // namespace bspflow
