// Fuzz target: bspflow::OutputMode::parse, the text form of an output mode (a command-line
// flag or a config value). Whatever it accepts must print back to text that parses to the
// same mode; whatever it refuses must be a bspflow::Error.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include <bspflow/base/error.hpp>
#include <bspflow/feeds/output_mode.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const bspflow::OutputMode mode = bspflow::OutputMode::parse(text);
    const std::string printed = mode.to_string();
    const bspflow::OutputMode again = bspflow::OutputMode::parse(printed);
    if (again.kind() != mode.kind() || again.n() != mode.n() || again.to_string() != printed) {
      std::fprintf(stderr, "OutputMode '%s' does not read back\n", printed.c_str());
      std::abort();
    }
  } catch (const bspflow::Error&) {
  }
  return 0;
}
