// Fuzz target: the weights file the inference example loads (examples/common/weights_file.hpp),
// for a small model of two sections (3 and 2 values) so the fuzzer reaches the data. Whatever
// the decoder accepts must encode back to exactly the input's bytes; whatever it refuses must
// be a std::runtime_error and leave the values untouched.
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "weights_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::array<float, 3> a{7, 7, 7};
  std::array<float, 2> b{7, 7};
  const std::array<kit::WeightsSection, 2> sections{kit::WeightsSection{"conv1", a},
                                                    kit::WeightsSection{"logits", b}};
  try {
    kit::decode_weights(bytes, "fuzz input", "tiny", sections);
    if (kit::encode_weights("tiny", sections) != bytes) {
      std::fprintf(stderr, "an accepted weights file does not encode back to its bytes\n");
      std::abort();
    }
  } catch (const std::runtime_error&) {
    for (const float v : a)
      if (v != 7) std::abort();  // an error leaves the values untouched
    for (const float v : b)
      if (v != 7) std::abort();
  }
  return 0;
}
