// Helpers shared by the runtime suite's files.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include <bspflow/bspflow.hpp>

namespace test {

// Small devices (64 tiles x 16 KiB): tests do not need 897 MiB of address space each.
inline const bspflow::DeviceConfig kSmall{64, 16 * 1024};

inline bspflow::Tensor filled(std::size_t n, float v) {
  bspflow::Tensor t(bspflow::DType::kFloat32, {n});
  for (float& x : t.as<float>()) x = v;
  return t;
}

// A host link on which `bytes` take `d`.
inline bspflow::EngineConfig with_link(std::chrono::nanoseconds d, std::size_t bytes,
                                       std::uint32_t io_tiles = 0, std::uint32_t prefetch = 1) {
  bspflow::EngineConfig c;
  c.host_link = bspflow::LinkModel::taking(d, bytes);
  c.io_tiles = io_tiles;
  c.prefetch_depth = prefetch;
  return c;
}

}  // namespace test
