/// @file
/// LinkModel: how long moving bytes over a link takes, as latency + bytes / bandwidth, for the
/// host link (stream copies between host memory and a device) and the device link (exchange
/// copies between two devices).
/// Guide: devices/README.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace bspflow {

/// A link's bandwidth and latency. The defaults are figures of the order of the hardware's,
/// not measurements of it: set your own to ask "what if the link were slower". A plain value
/// type.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct LinkModel {
  double bytes_per_second = 10e9;           ///< bytes per second, > 0 and finite
  std::chrono::nanoseconds latency{5'000};  ///< 0..1 s, paid once per transfer

  /// The host link: 10 GB/s of payload and 5 us per transfer (an IPU-M2000 reaches its host
  /// over 100 Gb/s RDMA, about 12.5 GB/s).
  static LinkModel host() noexcept { return {}; }
  /// The device link: 32 GB/s and 1 us per transfer (an IPU-Link moves 32 GB/s per
  /// direction).
  static LinkModel device() noexcept { return {32e9, std::chrono::nanoseconds{1'000}}; }
  /// A link on which moving `bytes` takes exactly `d` (no latency): for experiments that want
  /// a given I/O time per micro-batch. Throws bspflow::Error naming the values and what is
  /// allowed unless d > 0 and bytes >= 1.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static LinkModel taking(std::chrono::nanoseconds d, std::size_t bytes);

  /// Modeled time of one transfer of `bytes`: latency + bytes / bandwidth, rounded up to a
  /// whole nanosecond. Meaningful only for a model validate() accepts (an Engine validates its
  /// links before use).
  std::chrono::nanoseconds duration(std::size_t bytes) const noexcept;
  /// Modeled time of a ring all-reduce of `bytes` (each replica's share) across `replicas`
  /// devices: 2(R-1) steps (reduce-scatter, then all-gather), each moving ceil(bytes/R) over
  /// this link, so 2(R-1) x duration(ceil(bytes/R)) = 2(R-1)/R x bytes / bandwidth plus a
  /// latency per step. Zero for one replica or no bytes.
  std::chrono::nanoseconds ring_allreduce(std::size_t bytes, std::uint32_t replicas) const noexcept;
  /// Checks both fields: throws bspflow::Error naming the field ("host link bytes_per_second"
  /// or "host link latency" for `what` = "host link"), the value and what is allowed.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate(const std::string& what) const;
  /// "10.0 GB/s, 5.0 us latency".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;
};

}  // namespace bspflow
