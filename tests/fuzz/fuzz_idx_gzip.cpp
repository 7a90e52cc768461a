// Fuzz target: the IDX reader behind gzip. The harness gzip-compresses the input first, so
// the fuzzer explores the IDX structure inside a valid gzip stream (fuzz_idx covers broken
// gzip streams and plain files). Same rules as fuzz_idx.
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <bspflow/base/error.hpp>
#include <bspflow/data/idx.hpp>

#include "fuzz_input_file.hpp"
#include "idx_check.hpp"

namespace {

std::vector<std::uint8_t> gzip(const std::uint8_t* data, std::size_t size) {
  z_stream z{};
  // windowBits 15 + 16: a gzip wrapper, as the data sets ship.
  if (deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    std::abort();
  std::vector<std::uint8_t> out(deflateBound(&z, static_cast<uLong>(size)) + 32);
  z.next_in = const_cast<Bytef*>(data);
  z.avail_in = static_cast<uInt>(size);
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) std::abort();
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > (1u << 20)) return 0;  // the interesting part is the header; keep inputs small
  const std::vector<std::uint8_t> compressed = gzip(data, size);
  const std::filesystem::path& path = fuzz::input_path("fuzz_idx_gzip");
  fuzz::write_file(path, compressed.data(), compressed.size());
  try {
    fuzz::check_array(bspflow::idx::read(path));
  } catch (const bspflow::Error&) {
  }
  return 0;
}
