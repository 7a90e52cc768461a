// The fuzz targets whose parser reads a file (idx::read) write each input to a file of their
// own first, in TMPDIR (default /tmp): one path per process, overwritten by every input.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace fuzz {

inline const std::filesystem::path& input_path(const char* target) {
  static const std::filesystem::path path = [&] {
    const char* dir = std::getenv("TMPDIR");
    return std::filesystem::path(dir != nullptr && *dir != '\0' ? dir : "/tmp") /
           (std::string("bspflow-") + target + "-" + std::to_string(::getpid()));
  }();
  return path;
}

// Writes `size` bytes to `path`; aborts if it cannot (the harness is broken, not the parser).
inline void write_file(const std::filesystem::path& path, const std::uint8_t* data,
                       std::size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size)) ||
      !f.flush()) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

}  // namespace fuzz
