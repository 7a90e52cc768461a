// DeviceModel and Work: what a real IPU would take for the work a device declares (the
// modeled clock; see modeled_clock.hpp and devices/README.md "The modeled IPU clock").
//
// A device's compute costs whatever the CPU takes in real time; in modeled time it costs what
// it declares. A Work says how much arithmetic (FLOPs, at a precision) and how much tile
// memory traffic (bytes) a compute step does, plus any cycles of its own (Poplar-style
// per-vertex estimates). The DeviceModel turns that into cycles on the slowest tile with the
// Mk2 IPU's figures: the work is spread over the compute tiles (tiles - io_tiles), each tile
// does FLOPs at its AMP rate for the precision and moves bytes at its memory rate (the
// slower of the two bounds the step), and every compute set ends with an on-chip sync.
// Exchanges on one device move bytes at the exchange rate of the tiles; syncs across devices
// cost the between-chips figure; a host call (one run()) costs host_call before its first
// step. The host link and the device link keep their own LinkModels.
//
// The figures and their sources (devices/README.md lists them with the arithmetic):
//   clock_hz 1.325 GHz                the GC200 clock the IPU-POD64/POD128 datasheets' FLOPS
//                                     imply (249.65 TFLOPS fp16 = 1472 x 128 x 1.325e9); the
//                                     Poplar IPUModel runs at 1.330 GHz (tut6's profile)
//   fp32 32 FLOPs/tile/cycle          62.4 TFLOPS fp32 / (1472 x 1.325 GHz); poplibs' planner:
//                                     8 conv units x 2 floats = 16 MACs per cycle
//   fp16 128 FLOPs/tile/cycle         249.65 TFLOPS fp16.16 / (1472 x 1.325 GHz); poplibs: 16
//                                     conv units x 4 halves = 64 MACs per cycle
//   fp16 with fp32 partials 64        assumed: half the fp16.16 rate (poplibs' planner runs
//                                     half + float partials with 8 units); no datasheet figure
//   memory 24 bytes/tile/cycle        47.5 TB/s In-Processor-Memory bandwidth / (1472 x f)
//   exchange 4 bytes/tile/cycle       the IPUModel's exchangeBytesPerCycle in the published
//                                     tut6 profile; 8 TB/s IPU-Exchange / (1472 x f) = 4.1
//   sync 150 cycles on chip,          assumed: no published figure found (PopVision reports
//   1 us between chips                sync cycles per step; measure yours and set them)
//   host_call 120 us                  a host round trip measured on a Mk2 in Graphcore's
//                                     lightweight-profiling tutorial: about 160k cycles
//   efficiency 1.0                    of those peaks (the datasheet's); real kernels reach a
//                                     fraction: set yours from a profile
//
// Plain value types: any thread may create, copy or read them.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace bspflow {

// The arithmetic of declared work: operands and accumulation.
enum class WorkPrecision : std::uint8_t {
  kFloat32,         // fp32 operands and partials
  kFloat16,         // fp16 operands and partials (fp16.16)
  kFloat16Float32,  // fp16 operands, fp32 partials (fp16.32)
};
// Any thread. "fp32", "fp16", "fp16.32". Never blocks, never allocates, never throws.
const char* to_string(WorkPrecision p) noexcept;

// The declared cost of a compute step (a compute set): spread evenly over the device's compute
// tiles, or, on an Execute with work items, the cost of one item (each tile does its share).
struct Work {
  double flops = 0;  // floating-point operations (a multiply-add counts 2); >= 0
  double bytes = 0;  // tile memory traffic: bytes loaded and stored; >= 0
  WorkPrecision precision = WorkPrecision::kFloat32;
  double cycles = 0;  // extra cycles on the slowest tile (a vertex's own estimate); >= 0

  // Any thread. Whether nothing is declared (then the step costs nothing in modeled time and
  // is counted as undeclared). Never throws.
  bool declared() const noexcept { return flops > 0 || bytes > 0 || cycles > 0; }
  // Any thread. The sum of two steps' work run as one (precision: this one's). Never throws.
  Work& operator+=(const Work& o) noexcept {
    flops += o.flops;
    bytes += o.bytes;
    cycles += o.cycles;
    return *this;
  }
  // Any thread. This work done `k` times. Never throws.
  Work times(double k) const noexcept { return Work{flops * k, bytes * k, precision, cycles * k}; }
};

struct DeviceModel {
  double clock_hz = 1.325e9;                           // > 0
  double fp32_flops_per_tile_cycle = 32;               // > 0
  double fp16_flops_per_tile_cycle = 128;              // > 0 (fp16.16)
  double fp16_fp32_flops_per_tile_cycle = 64;          // > 0 (fp16.32)
  double memory_bytes_per_tile_cycle = 24;             // > 0
  double exchange_bytes_per_tile_cycle = 4;            // > 0
  double sync_cycles_on_chip = 150;                    // >= 0, paid by every compute set
  std::chrono::nanoseconds sync_between_chips{1'000};  // >= 0, a Sync across devices
  std::chrono::nanoseconds host_call{120'000};         // >= 0, once per run() of a device
  double efficiency = 1.0;                             // (0, 1]: of the peak rates above

  // Any thread. The Mk2 (GC200) figures above. Never throws.
  static DeviceModel mk2() noexcept { return {}; }

  // Any thread. FLOPs one tile does per cycle at `p`. Never throws.
  double flops_per_tile_cycle(WorkPrecision p) const noexcept;
  // Any thread. Cycles of a compute set doing `w` spread over `tiles` compute tiles (the
  // slowest tile's: the larger of its FLOPs and its bytes at the tile's rates, over the
  // efficiency, plus w.cycles and the on-chip sync). Never throws.
  double compute_cycles(const Work& w, std::uint32_t tiles) const noexcept;
  // Any thread. Cycles of an Execute of `items` work items, `per_item` each, split over
  // `tiles` compute tiles as the interpreter splits them (ceil(items / tiles) on the busiest
  // tile), plus the on-chip sync. Never throws.
  double item_cycles(const Work& per_item, std::size_t items, std::uint32_t tiles) const noexcept;
  // Any thread. Cycles of an exchange of `bytes` within one device over `tiles` tiles, plus
  // the on-chip sync that ends it. Never throws.
  double exchange_cycles(double bytes, std::uint32_t tiles) const noexcept;
  // Any thread. Nanoseconds of `cycles` at clock_hz. Never throws.
  double ns(double cycles) const noexcept { return cycles * 1e9 / clock_hz; }

  // Any thread. Throws bspflow::Error naming the field ("device model clock_hz", ...), the
  // value and what is allowed. Never blocks.
  void validate() const;
  // Any thread. "1.325 GHz, fp32 32 / fp16 128 / fp16.32 64 FLOPs per tile-cycle, ...".
  // Allocates; throws only std::bad_alloc.
  std::string describe() const;
};

}  // namespace bspflow
