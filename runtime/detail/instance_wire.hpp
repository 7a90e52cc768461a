// Internal (not installed): what a distributed Pipeline sends between instances besides the
// public collectives (see bspflow/runtime/instance.hpp).
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "bspflow/runtime/instance.hpp"

namespace bspflow::detail {

struct InstanceWire {
  // Longest text broadcast_text sends (a failure's message): longer is cut.
  static constexpr std::size_t kMaxText = 64 * 1024;
  // Host thread. MPI_Allreduce (sum, in place) of `values`, without Instance::allreduce_sum's
  // length check: for a per-step exchange whose length every instance agreed on beforehand.
  // Identity without MPI. Throws bspflow::Error naming MPI's message on an MPI error.
  static void sum(Instance& instance, std::span<float> values);
  // Host thread. Every instance ends with `root`'s text (cut at kMaxText). Throws like sum.
  static void broadcast_text(Instance& instance, std::string& text, std::uint32_t root);
};

}  // namespace bspflow::detail
