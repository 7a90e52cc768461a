/// @file
/// Batch: one micro-batch of samples as the DataLoader delivers it and a Pipeline consumes
/// it. A plain value type: any thread may create, move or read one; moving never allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "bspflow/data/tensor.hpp"

namespace bspflow {

/// One micro-batch: what one device iteration of one replica consumes.
struct Batch {
  /// The dataset index a padding sample has in `indices`.
  static constexpr std::uint64_t kPadding = ~std::uint64_t{0};
  Tensor data;                         ///< [batch_size, sample shape...]
  std::vector<std::int32_t> labels;    ///< per sample; -1 for padding
  std::vector<std::uint64_t> indices;  ///< dataset index per sample; kPadding for padding
  std::size_t valid = 0;               ///< samples [0, valid) are real, the rest padding
  std::uint64_t epoch = 0;             ///< the epoch the samples come from, counted from 0
  std::uint64_t step = 0;              ///< step within the epoch
  std::uint32_t replica = 0;           ///< the replica the micro-batch goes to
  std::uint64_t position = 0;          ///< this replica's micro-batch number within the step
};

/// What a micro-batch moves over the host link: its data and its labels (as int32). Found by
/// argument-dependent lookup (loops::repeat, a Pipeline's stage 0).
/// Contract: any; non-blocking; no-alloc; noexcept.
inline std::size_t host_bytes(const Batch& b) noexcept {
  return b.data.bytes() + b.labels.size() * sizeof(std::int32_t);
}

}  // namespace bspflow
