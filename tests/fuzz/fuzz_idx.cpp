// Fuzz target: bspflow::idx::read on a file holding the input's bytes as they are, so a plain
// IDX file or a gzip stream (zlib decides by its magic number), whatever the fuzzer makes.
// A well-formed file must come back with its dimensions and data consistent; anything else
// must be a bspflow::Error. Any other exception, crash, leak or sanitizer report is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <bspflow/base/error.hpp>
#include <bspflow/data/idx.hpp>

#include "fuzz_input_file.hpp"
#include "idx_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::filesystem::path& path = fuzz::input_path("fuzz_idx");
  fuzz::write_file(path, data, size);
  try {
    fuzz::check_array(bspflow::idx::read(path));
  } catch (const bspflow::Error&) {
    // A refused file: what the reader is for.
  }
  return 0;
}
