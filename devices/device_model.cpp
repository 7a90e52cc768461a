#include "bspflow/devices/device_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "bspflow/base/error.hpp"

namespace bspflow {

const char* to_string(WorkPrecision p) noexcept {
  switch (p) {
    case WorkPrecision::kFloat32:
      return "fp32";
    case WorkPrecision::kFloat16:
      return "fp16";
    case WorkPrecision::kFloat16Float32:
      return "fp16.32";
  }
  return "?";
}

double DeviceModel::flops_per_tile_cycle(WorkPrecision p) const noexcept {
  switch (p) {
    case WorkPrecision::kFloat16:
      return fp16_flops_per_tile_cycle;
    case WorkPrecision::kFloat16Float32:
      return fp16_fp32_flops_per_tile_cycle;
    case WorkPrecision::kFloat32:
      break;
  }
  return fp32_flops_per_tile_cycle;
}

double DeviceModel::compute_cycles(const Work& w, std::uint32_t tiles) const noexcept {
  const double t = std::max<std::uint32_t>(tiles, 1);
  const double arithmetic = w.flops / (flops_per_tile_cycle(w.precision) * t);
  const double memory = w.bytes / (memory_bytes_per_tile_cycle * t);
  return std::max(arithmetic, memory) / efficiency + w.cycles + sync_cycles_on_chip;
}

double DeviceModel::item_cycles(const Work& per_item, std::size_t items,
                                std::uint32_t tiles) const noexcept {
  const std::size_t t = std::max<std::uint32_t>(tiles, 1);
  const std::size_t per_tile = (items + t - 1) / t;  // the busiest tile's items, rounded up
  const double busiest = static_cast<double>(per_tile);
  const double arithmetic = per_item.flops / flops_per_tile_cycle(per_item.precision);
  const double memory = per_item.bytes / memory_bytes_per_tile_cycle;
  return busiest * (std::max(arithmetic, memory) / efficiency + per_item.cycles) +
         sync_cycles_on_chip;
}

double DeviceModel::exchange_cycles(double bytes, std::uint32_t tiles) const noexcept {
  const double t = std::max<std::uint32_t>(tiles, 1);
  return bytes / (exchange_bytes_per_tile_cycle * t) + sync_cycles_on_chip;
}

void DeviceModel::validate() const {
  auto positive = [](const char* field, double v, const char* unit) {
    if (v > 0 && std::isfinite(v)) return;
    char given[32];
    std::snprintf(given, sizeof given, "%g", v);
    detail::throw_bad_value(std::string("device model ") + field, given,
                            std::string("must be a positive, finite number of ") + unit);
  };
  positive("clock_hz", clock_hz, "cycles per second (1.325e9 is the Mk2's)");
  positive("fp32_flops_per_tile_cycle", fp32_flops_per_tile_cycle, "FLOPs per tile per cycle");
  positive("fp16_flops_per_tile_cycle", fp16_flops_per_tile_cycle, "FLOPs per tile per cycle");
  positive("fp16_fp32_flops_per_tile_cycle", fp16_fp32_flops_per_tile_cycle,
           "FLOPs per tile per cycle");
  positive("memory_bytes_per_tile_cycle", memory_bytes_per_tile_cycle, "bytes per tile per cycle");
  positive("exchange_bytes_per_tile_cycle", exchange_bytes_per_tile_cycle,
           "bytes per tile per cycle");
  if (!(sync_cycles_on_chip >= 0) || !std::isfinite(sync_cycles_on_chip)) {
    char given[32];
    std::snprintf(given, sizeof given, "%g", sync_cycles_on_chip);
    detail::throw_bad_value("device model sync_cycles_on_chip", given,
                            "must be a finite number of cycles, 0 or more");
  }
  auto duration = [](const char* field, std::chrono::nanoseconds d) {
    if (d.count() >= 0 && d <= std::chrono::seconds(1)) return;
    detail::throw_bad_value(std::string("device model ") + field, std::to_string(d.count()) + " ns",
                            "must be in 0 ns..1 s");
  };
  duration("sync_between_chips", sync_between_chips);
  duration("host_call", host_call);
  if (!(efficiency > 0 && efficiency <= 1)) {
    char given[32];
    std::snprintf(given, sizeof given, "%g", efficiency);
    detail::throw_bad_value("device model efficiency", given,
                            "must be in (0, 1]: the share of the peak rates a kernel reaches");
  }
}

std::string DeviceModel::describe() const {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%.3f GHz, fp32 %g / fp16 %g / fp16.32 %g FLOPs per tile-cycle, memory %g and "
                "exchange %g bytes per tile-cycle, sync %g cycles on chip and %.2f us between "
                "chips, host call %.1f us, efficiency %g",
                clock_hz / 1e9, fp32_flops_per_tile_cycle, fp16_flops_per_tile_cycle,
                fp16_fp32_flops_per_tile_cycle, memory_bytes_per_tile_cycle,
                exchange_bytes_per_tile_cycle, sync_cycles_on_chip,
                static_cast<double>(sync_between_chips.count()) / 1e3,
                static_cast<double>(host_call.count()) / 1e3, efficiency);
  return buf;
}

}  // namespace bspflow
