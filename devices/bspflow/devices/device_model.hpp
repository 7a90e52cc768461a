/// @file
/// DeviceModel and Work: what a real IPU would take for the work a device declares (the
/// modeled clock, see modeled_clock.hpp). A Work states a compute step's FLOPs, tile memory
/// bytes and cycles of its own; a DeviceModel turns them into cycles on the slowest tile with
/// the Mk2 IPU's figures ("The modeled IPU clock" in the guide gives their sources).
/// Guide: devices/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace bspflow {

/// The arithmetic of declared work: operands and accumulation.
enum class WorkPrecision : std::uint8_t {
  kFloat32,         ///< fp32 operands and partials
  kFloat16,         ///< fp16 operands and partials (fp16.16)
  kFloat16Float32,  ///< fp16 operands, fp32 partials (fp16.32)
};
/// "fp32", "fp16", "fp16.32".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(WorkPrecision p) noexcept;

/// The declared cost of a compute step (a compute set): spread evenly over the device's compute
/// tiles, or, on an Execute with work items, the cost of one item (each tile does its share).
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct Work {
  double flops = 0;  ///< floating-point operations (a multiply-add counts 2); >= 0
  double bytes = 0;  ///< tile memory traffic: bytes loaded and stored; >= 0
  /// The arithmetic the operations use, which sets the FLOPs a tile does per cycle.
  WorkPrecision precision = WorkPrecision::kFloat32;
  double cycles = 0;  ///< extra cycles on the slowest tile (a vertex's own estimate); >= 0

  /// Whether any cost is declared (if not, the step costs nothing in modeled time and is
  /// counted as undeclared).
  bool declared() const noexcept { return flops > 0 || bytes > 0 || cycles > 0; }
  /// The sum of two steps' work run as one (precision: this one's).
  Work& operator+=(const Work& o) noexcept {
    flops += o.flops;
    bytes += o.bytes;
    cycles += o.cycles;
    return *this;
  }
  /// This work done `k` times.
  Work times(double k) const noexcept { return Work{flops * k, bytes * k, precision, cycles * k}; }
};

/// A real IPU's rates and costs, for the modeled clock: the Mk2 (GC200) figures by default.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct DeviceModel {
  double clock_hz = 1.325e9;                           ///< cycles per second, > 0
  double fp32_flops_per_tile_cycle = 32;               ///< fp32 FLOPs per tile-cycle, > 0
  double fp16_flops_per_tile_cycle = 128;              ///< fp16.16 FLOPs per tile-cycle, > 0
  double fp16_fp32_flops_per_tile_cycle = 64;          ///< fp16.32 FLOPs per tile-cycle, > 0
  double memory_bytes_per_tile_cycle = 24;             ///< memory bytes per tile-cycle, > 0
  double exchange_bytes_per_tile_cycle = 4;            ///< exchange bytes per tile-cycle, > 0
  double sync_cycles_on_chip = 150;                    ///< paid by every compute set, >= 0
  std::chrono::nanoseconds sync_between_chips{1'000};  ///< a Sync across devices, >= 0
  std::chrono::nanoseconds host_call{120'000};         ///< once per run() of a device, >= 0
  double efficiency = 1.0;                             ///< (0, 1]: of the peak rates above

  /// The Mk2 (GC200) figures above.
  static DeviceModel mk2() noexcept { return {}; }

  /// FLOPs one tile does per cycle at `p`.
  double flops_per_tile_cycle(WorkPrecision p) const noexcept;
  /// Cycles of a compute set doing `w` spread over `tiles` compute tiles (the slowest
  /// tile's: the larger of its FLOPs and its bytes at the tile's rates, over the efficiency,
  /// plus w.cycles and the on-chip sync).
  double compute_cycles(const Work& w, std::uint32_t tiles) const noexcept;
  /// Cycles of an Execute of `items` work items, `per_item` each, split over `tiles` compute
  /// tiles as the interpreter splits them (ceil(items / tiles) on the busiest tile), plus the
  /// on-chip sync.
  double item_cycles(const Work& per_item, std::size_t items, std::uint32_t tiles) const noexcept;
  /// Cycles of an exchange of `bytes` within one device over `tiles` tiles, plus the on-chip
  /// sync that ends it.
  double exchange_cycles(double bytes, std::uint32_t tiles) const noexcept;
  /// Nanoseconds of `cycles` at clock_hz.
  double ns(double cycles) const noexcept { return cycles * 1e9 / clock_hz; }

  /// Checks every field; a bspflow::Error names it ("device model clock_hz", ...), the value
  /// and what is allowed.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
  /// "1.325 GHz, fp32 32 / fp16 128 / fp16.32 64 FLOPs per tile-cycle, ...".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;
};

}  // namespace bspflow
