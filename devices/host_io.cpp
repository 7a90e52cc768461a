#include "bspflow/devices/host_io.hpp"

#include "bspflow/base/error.hpp"

namespace bspflow {

void HostIO::validate() const {
  if (prefetch_depth < tunables::kMinPrefetchDepth ||
      prefetch_depth > tunables::kMaxPrefetchDepth) {
    detail::throw_bad_value("prefetch_depth", prefetch_depth, "must be in 1..255");
  }
  if (io_tiles % 2 != 0)
    detail::throw_bad_value("io_tiles", io_tiles, "must be 0 or an even number");
  host_link.validate("host link");
}

}  // namespace bspflow
