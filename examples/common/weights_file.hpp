// The examples' weights file: a short text header, then the raw values.
//
//   bspflow-weights 1
//   model conv
//   stage conv1 260                  one line per section: its name and its float32 count
//   stage conv2 5020
//   data float32-le
//   <the values: little-endian IEEE-754 float32, the sections in the order listed>
//
// Lines end in '\n' and are at most 200 bytes. Decoding checks every header line, each
// section's name and size against what the caller expects, that exactly as many bytes as
// promised follow, and that every value is finite; an error (std::runtime_error) names the
// source and what is wrong, and leaves the caller's values untouched. The decoder reads
// bytes from outside, so it is a fuzz target (tests/fuzz/fuzz_weights_file.cpp).
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace kit {

// One section of a weights file: a stage's name and its values (read or filled).
struct WeightsSection {
  std::string name;
  std::span<float> values;
};

// The file's bytes for `model` and its sections.
std::string encode_weights(std::string_view model, std::span<const WeightsSection> sections);

// Fills the sections' values from `bytes`, which must describe exactly `model` and these
// sections (names and sizes) in this order. `source` names the bytes in errors (a path).
void decode_weights(std::string_view bytes, std::string_view source, std::string_view model,
                    std::span<const WeightsSection> sections);

// encode_weights into the file at `path` / decode_weights from it (a file far larger than
// the sections could need is refused before it is read).
void save_weights_file(const std::string& path, std::string_view model,
                       std::span<const WeightsSection> sections);
void load_weights_file(const std::string& path, std::string_view model,
                       std::span<const WeightsSection> sections);

}  // namespace kit
