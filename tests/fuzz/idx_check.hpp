// What an IDX array the reader accepted must satisfy (the fuzz targets' oracle).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <bspflow/data/idx.hpp>

namespace fuzz {

inline void check_array(const bspflow::idx::Array& a) {
  std::uint64_t elements = 1;
  for (const std::uint32_t d : a.dims) elements *= d;
  const bool ok = !a.dims.empty() && a.dims.size() <= 8 &&
                  a.data.size() == elements * bspflow::idx::element_size(a.type) &&
                  a.items() == a.dims[0] &&
                  (a.items() == 0 || a.item_bytes() * a.items() == a.data.size());
  if (!ok) {
    std::fprintf(stderr, "idx::read accepted an inconsistent array: %zu dims, %zu bytes of %s\n",
                 a.dims.size(), a.data.size(), bspflow::idx::to_string(a.type));
    std::abort();
  }
}

}  // namespace fuzz
