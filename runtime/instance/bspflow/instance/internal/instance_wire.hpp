// The instance room's internal API for the pipeline room (not for users, not installed): what a
// distributed Pipeline sends between instances besides the public collectives (see
// bspflow/instance/instance.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "bspflow/instance/instance.hpp"

namespace bspflow::detail {

struct InstanceWire {
  // A 64-bit value as three floats of 22 bits each (kWords floats): exact in fp32, and
  // exact after a sum with zeros, so a broadcast or an all-reduce in which only one
  // instance writes a slot carries it unchanged.
  static constexpr std::size_t kWords = 3;
  static void put64(float* at, std::uint64_t v) noexcept {
    for (std::size_t i = 0; i < kWords; ++i)
      at[i] = static_cast<float>((v >> (22 * i)) & ((std::uint64_t{1} << 22) - 1));
  }
  static std::uint64_t get64(const float* at) noexcept {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < kWords; ++i) v |= static_cast<std::uint64_t>(at[i]) << (22 * i);
    return v;
  }

  // Longest text broadcast_text sends (a failure's message): longer is cut.
  static constexpr std::size_t kMaxText = std::size_t{64} * 1024;
  // Host thread. MPI_Allreduce (sum, in place) of `values`, without Instance::allreduce_sum's
  // length check: for a per-step exchange whose length every instance agreed on beforehand.
  // Identity without MPI. Throws bspflow::Error naming MPI's message on an MPI error.
  static void sum(Instance& instance, std::span<float> values);
  // Host thread. Every instance ends with `root`'s text (cut at kMaxText). Throws like sum.
  static void broadcast_text(Instance& instance, std::string& text, std::uint32_t root);
};

}  // namespace bspflow::detail
