/// @file
/// Swapping a stage's callable while the stream serves (Stream::swap()): what a swap is told
/// and what it says happened. Guide: runtime/stream/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

namespace bspflow {

/// How a swap goes.
struct SwapOptions {
  /// Bytes the new version holds on each replica's device (its weights): nullopt, as much as
  /// the version it replaces (StreamBuilder's memory(), or the last swap's). When every
  /// device can hold both versions at once the swap is in place; when only one at a time, it
  /// rolls one replica at a time; when not even that, it is refused.
  std::optional<std::size_t> memory{};
};

/// What a swap did.
struct SwapResult {
  bool swapped = false;       ///< every replica runs the new version now
  std::uint32_t version = 0;  ///< the new version's number (Response::version of its answers)
  bool rolling = false;       ///< one replica at a time: drained, swapped and put back in turn
  std::uint32_t replicas_swapped = 0;  ///< replicas that run the new version
  bool cancelled = false;  ///< the stop token stopped it; the replicas not yet swapped keep
                           ///< the old version
  /// What happened, for a person: "swapped in place", "warm-up failed: ...", "refused: ...".
  std::string message;
  /// Why it did not swap: the warm-up's exception, or the OutOfMemoryError of a version that
  /// does not fit. Null when swapped or cancelled.
  std::exception_ptr error{};
};

}  // namespace bspflow
