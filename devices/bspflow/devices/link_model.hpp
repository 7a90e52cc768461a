// LinkModel: how long moving bytes over a link takes, as latency + bytes / bandwidth.
//
// Two links are modeled. The host link carries stream copies between host memory and a
// device (an IPU-M2000 reaches its host over 100 Gb/s RDMA, about 12.5 GB/s; we take 10 GB/s
// of payload and 5 us per transfer). The device link carries exchange copies between two
// devices (an IPU-Link moves 32 GB/s per direction; we take 32 GB/s and 1 us). Both are
// figures of the order of the hardware's, not measurements of it: set your own to ask "what
// if the link were slower".
//
// A plain value type: any thread may create, copy or read one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace bspflow {

struct LinkModel {
  double bytes_per_second = 10e9;           // > 0 and finite
  std::chrono::nanoseconds latency{5'000};  // 0..1 s, paid once per transfer

  // Any thread. The host link (10 GB/s, 5 us) and the device link (32 GB/s, 1 us) above.
  // Never blocks, never allocates, never throws.
  static LinkModel host() noexcept { return {}; }
  static LinkModel device() noexcept { return {32e9, std::chrono::nanoseconds{1'000}}; }
  // A link on which moving `bytes` takes exactly `d` (no latency): for experiments that want
  // a given I/O time per micro-batch. Any thread. Never blocks, never allocates. Throws
  // bspflow::Error naming the values and what is allowed unless d > 0 and bytes >= 1.
  static LinkModel taking(std::chrono::nanoseconds d, std::size_t bytes);

  // Modeled time of one transfer of `bytes`: latency + bytes / bandwidth, rounded up to a
  // whole nanosecond. Any thread. Never blocks, never allocates, never throws. Meaningful
  // only for a model validate() accepts (an Engine validates its links before use).
  std::chrono::nanoseconds duration(std::size_t bytes) const noexcept;
  // Modeled time of a ring all-reduce of `bytes` (each replica's share) across `replicas`
  // devices: 2(R-1) steps (reduce-scatter, then all-gather), each moving ceil(bytes/R) over
  // this link, so 2(R-1) x duration(ceil(bytes/R)) = 2(R-1)/R x bytes / bandwidth plus a
  // latency per step. Zero for one replica or no bytes. Any thread. Never blocks, never
  // allocates, never throws.
  std::chrono::nanoseconds ring_allreduce(std::size_t bytes, std::uint32_t replicas) const noexcept;
  // Any thread. Never blocks, never allocates. Throws bspflow::Error naming the field
  // ("<what> bandwidth (bytes/s)", "<what> latency (ns)", `what` being say "host link"),
  // the value and what is allowed if a field is out of range.
  void validate(const std::string& what) const;
  // Any thread. "10.0 GB/s, 5.0 us latency". Never blocks; may allocate (the returned
  // string). Throws only std::bad_alloc.
  std::string describe() const;
};

}  // namespace bspflow
