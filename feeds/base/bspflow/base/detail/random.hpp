// Small seeded generators shared by the datasets and the loader's shuffle. Deterministic on
// every platform and standard library (std::shuffle and the std distributions are not).
#pragma once

#include <cstdint>

namespace bspflow::detail {

// splitmix64 (Steele, Lea, Flood): advances `state` and returns a well-mixed 64-bit value.
// Used to seed other generators and for cheap keyed hashing.
inline std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace bspflow::detail
