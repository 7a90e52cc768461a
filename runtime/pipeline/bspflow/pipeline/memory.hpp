/// @file
/// Device memory of a Pipeline: what each device holds (TensorMemory, DeviceMemory), the
/// memory report (MemoryReport, in the spirit of PopVision's) with what would help when a model
/// does not fit, and PipelineOutOfMemoryError.
/// Guide: runtime/pipeline/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bspflow/data/tensor.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/run/precision.hpp"

namespace bspflow {

/// What a tensor holds, in the memory report.
enum class MemoryCategory : std::uint8_t {
  kParameters,       ///< weights
  kOptimizerState,   ///< the optimiser's state (offloaded: a transient buffer in the update)
  kGradients,        ///< accumulators (always live), per micro-batch and reduced (not)
  kActivationStash,  ///< what each stage keeps between a forward and its backward pass
  kExchange,         ///< activation and gradient buffers between devices
  kWorking,          ///< what a stage needs while a pass runs (declared by the stage)
  kIoTiles,          ///< the I/O tiles' memory (PipelineConfig::io_tiles x bytes per tile)
};
/// "parameters", "optimiser state", "gradients", "activation stash", "exchange", "working",
/// "I/O tiles".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(MemoryCategory c) noexcept;
/// How many MemoryCategory values there are.
inline constexpr std::size_t kMemoryCategories = 7;

/// When a tensor is live: the whole run; the compute phase of a step (across passes: the
/// activation stash); only while its own stage's pass runs (working memory, this
/// micro-batch's gradients: stages sharing a device need the largest, not the sum); the
/// update phase.
enum class Liveness : std::uint8_t { kAlways, kCompute, kPass, kUpdate };
/// "always live", "compute phase", "during its stage's passes", "update phase".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(Liveness l) noexcept;

/// One tensor a device holds. A plain value type.
struct TensorMemory {
  std::string name;  ///< "stage 1 'conv2' activation stash (3 x 12.5 KiB)"
  /// What the tensor holds.
  MemoryCategory category = MemoryCategory::kParameters;
  /// When it is live.
  Liveness liveness = Liveness::kAlways;
  std::size_t bytes = 0;      ///< its size
  std::uint32_t stage = 0;    ///< the stage it belongs to (0 for the I/O tiles)
  std::uint32_t replica = 0;  ///< the replica of that stage (0 for the I/O tiles)
  /// A device buffer the programs copy between (bsp exchange), held as itself rather than
  /// as a named block.
  bool device_buffer = false;
};

/// One device's tensors. A plain value type. A device's peak is its always-live bytes plus
/// the larger phase.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct DeviceMemory {
  std::uint32_t device = 0;  ///< the device's id (Device::id())
  /// What the device's arena had free when the pipeline was built: its whole memory (tiles
  /// x bytes per tile) unless something else already held some.
  std::size_t capacity = 0;
  std::vector<TensorMemory> tensors;  ///< largest first

  /// Bytes of the tensors live the whole run (Liveness::kAlways).
  std::size_t always_live() const noexcept;
  std::size_t phase(Liveness l) const noexcept;  ///< the bytes of the tensors with that liveness
  /// The compute phase's peak: phase(kCompute) plus the largest one stage's kPass bytes.
  std::size_t compute_peak() const noexcept;
  /// Not always live: the larger of compute_peak() and the update phase (what the peak adds
  /// to always_live()).
  std::size_t not_always_live() const noexcept;
  /// The most bytes the device holds at once: always_live() plus not_always_live().
  std::size_t peak() const noexcept { return always_live() + not_always_live(); }
  /// Bytes of one category, all phases.
  std::size_t category(MemoryCategory c) const noexcept;
  /// Whether the peak fits in the capacity.
  bool fits() const noexcept { return peak() <= capacity; }
};

/// Every device a Pipeline uses. A plain value type.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
struct MemoryReport {
  std::vector<DeviceMemory> devices;  ///< one per device, in the Pipeline's device order
  Precision precision;                ///< the precision the tensors are sized for
  /// What would make a device that does not fit fit (empty when everything fits).
  std::vector<std::string> suggestions;

  /// Whether every device fits.
  bool fits() const noexcept;
  std::size_t peak() const noexcept;  ///< the largest device peak
  /// A table per device: capacity, peak, always live and not, bytes per category, the
  /// largest tensors (up to `largest` of them), then the suggestions.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string to_string(std::size_t largest = 5) const;
};

/// A Pipeline's tensors do not fit its devices. report() has every device (the ones that do
/// not fit say so) and what would help; what() says which device, by how much, its largest
/// holders and the suggestions.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class PipelineOutOfMemoryError : public OutOfMemoryError {
 public:
  /// The message, the bytes asked for and free (as OutOfMemoryError), and the report.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  PipelineOutOfMemoryError(const std::string& message, std::size_t requested,
                           std::size_t free_bytes, MemoryReport report)
      : OutOfMemoryError(message, requested, free_bytes), report_(std::move(report)) {}
  /// Every device's tensors and what would help.
  const MemoryReport& report() const noexcept { return report_; }

 private:
  MemoryReport report_;
};

}  // namespace bspflow
