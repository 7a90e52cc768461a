#include "bspflow/devices/link_model.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

#include "bspflow/base/error.hpp"

namespace bspflow {

LinkModel LinkModel::taking(std::chrono::nanoseconds d, std::size_t bytes) {
  if (d.count() <= 0 || bytes == 0) {
    throw Error("LinkModel::taking: needs a positive duration and at least one byte (got " +
                std::to_string(d.count()) + " ns for " + std::to_string(bytes) + " bytes)");
  }
  return {static_cast<double>(bytes) * 1e9 / static_cast<double>(d.count()),
          std::chrono::nanoseconds{0}};
}

std::chrono::nanoseconds LinkModel::duration(std::size_t bytes) const noexcept {
  const double ns = std::ceil(static_cast<double>(bytes) * 1e9 / bytes_per_second);
  return latency + std::chrono::nanoseconds{static_cast<std::int64_t>(ns)};
}

std::chrono::nanoseconds LinkModel::ring_allreduce(std::size_t bytes,
                                                   std::uint32_t replicas) const noexcept {
  if (replicas <= 1 || bytes == 0) return std::chrono::nanoseconds{0};
  const std::size_t chunk = bytes / replicas + (bytes % replicas != 0 ? 1 : 0);
  return 2 * static_cast<std::int64_t>(replicas - 1) * duration(chunk);
}

void LinkModel::validate(const std::string& what) const {
  if (!(bytes_per_second > 0) || !std::isfinite(bytes_per_second)) {
    char given[32];
    std::snprintf(given, sizeof given, "%g", bytes_per_second);  // as written: 0, 1e+10, nan
    detail::throw_bad_value(
        what + " bytes_per_second", given,
        "must be a positive, finite number of bytes per second (10e9 is 10 GB/s)");
  }
  if (latency.count() < 0 || latency > std::chrono::seconds(1)) {
    detail::throw_bad_value(what + " latency", std::to_string(latency.count()) + " ns",
                            "must be in 0 ns..1 s");
  }
}

std::string LinkModel::describe() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f GB/s, %.1f us latency", bytes_per_second / 1e9,
                static_cast<double>(latency.count()) / 1e3);
  return buf;
}

}  // namespace bspflow
