/// @file
/// Precision: how a run stores and accumulates values (Options::precision; a Pipeline's
/// PipelineConfig::precision). See runtime/run/README.md.
#pragma once

#include "bspflow/data/tensor.hpp"

namespace bspflow {

/// How a run stores values on its devices. A plain value type.
///   storage   weights, activations (exchanged and stashed) and this micro-batch's
///             gradients: kFloat32 or kFloat16 (half the bytes in memory and on the links;
///             values are rounded to half precision where they are stored)
///   partials  gradient accumulation over micro-batches and replicas: kFloat32 or kFloat16
///   loss_scaling  the last stage's gradients are multiplied by this before they are stored
///             (so small gradients survive fp16) and the reduced gradients divided by it
///             before update() (static loss scaling); > 0 and finite; 1 = none
/// The optimiser state stays fp32 (as mixed-precision training keeps it).
struct Precision {
  DType storage = DType::kFloat32;   ///< how values are stored: kFloat32 or kFloat16
  DType partials = DType::kFloat32;  ///< how gradients accumulate: kFloat32 or kFloat16
  float loss_scaling = 1.0f;         ///< the static loss scale; 1 = none

  /// fp16 storage with fp32 partials (the common mixed-precision choice).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  static Precision half(float loss_scaling = 1.0f) noexcept {
    return Precision{DType::kFloat16, DType::kFloat32, loss_scaling};
  }
  /// Checks that storage and partials are kFloat32 or kFloat16 and that loss_scaling is
  /// finite and above 0.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
  /// Whether both are the same in every field.
  bool operator==(const Precision&) const = default;
};

}  // namespace bspflow
