#include "weights_file.hpp"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

namespace kit {

namespace {

constexpr std::string_view kMagic = "bspflow-weights 1";
constexpr std::string_view kData = "data float32-le";
constexpr std::size_t kMaxLine = 200;

std::uint32_t to_little_endian(std::uint32_t v) {
  if constexpr (std::endian::native == std::endian::little) return v;
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

std::size_t value_count(std::span<const WeightsSection> sections) {
  std::size_t n = 0;
  for (const WeightsSection& s : sections) n += s.values.size();
  return n;
}

std::string section_line(const WeightsSection& s) {
  return "stage " + s.name + " " + std::to_string(s.values.size());
}

// A header line shown in an error: printable ASCII as is, anything else as \xNN.
std::string shown(std::string_view line) {
  std::string out;
  for (const char c : line) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && c != '\\') {
      out += c;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    }
  }
  return out;
}

}  // namespace

std::string encode_weights(std::string_view model, std::span<const WeightsSection> sections) {
  std::string out = std::string(kMagic) + "\nmodel " + std::string(model) + "\n";
  for (const WeightsSection& s : sections) out += section_line(s) + "\n";
  out += std::string(kData) + "\n";
  out.reserve(out.size() + 4 * value_count(sections));
  for (const WeightsSection& s : sections) {
    for (const float v : s.values) {
      const std::uint32_t u = to_little_endian(std::bit_cast<std::uint32_t>(v));
      char bytes[4];
      std::memcpy(bytes, &u, 4);
      out.append(bytes, 4);
    }
  }
  return out;
}

void decode_weights(std::string_view bytes, std::string_view source, std::string_view model,
                    std::span<const WeightsSection> sections) {
  const std::string where(source);
  const std::size_t expected_values = value_count(sections);
  std::size_t pos = 0;
  int line_no = 0;
  const auto next_line = [&](const std::string& what) {
    ++line_no;
    const std::size_t end = bytes.find('\n', pos);
    if (end == std::string_view::npos || end - pos > kMaxLine) {
      throw std::runtime_error(where + ": line " + std::to_string(line_no) + ": expected " + what +
                               (pos >= bytes.size() ? ", the file ends first"
                                                    : ", found no end of line within " +
                                                          std::to_string(kMaxLine) + " bytes"));
    }
    const std::string_view line = bytes.substr(pos, end - pos);
    pos = end + 1;
    return line;
  };
  const auto expect_line = [&](const std::string& want, const std::string& why) {
    const std::string_view line = next_line("'" + want + "'");
    if (line != want) {
      throw std::runtime_error(where + ": line " + std::to_string(line_no) + " is '" + shown(line) +
                               "', expected '" + want + "'" + why);
    }
  };
  if (bytes.substr(0, kMagic.size()) != kMagic) {
    throw std::runtime_error(where + ": not a bspflow weights file (it does not start with '" +
                             std::string(kMagic) + "')");
  }
  expect_line(std::string(kMagic), "");
  expect_line("model " + std::string(model),
              " (these weights are for the " + std::string(model) + " model)");
  for (const WeightsSection& s : sections) {
    expect_line(section_line(s), " (the model's stage " + s.name + " has " +
                                     std::to_string(s.values.size()) + " values)");
  }
  expect_line(std::string(kData),
              " (the model has " + std::to_string(sections.size()) + " stages)");
  const std::size_t data_bytes = bytes.size() - pos;
  if (data_bytes != 4 * expected_values) {
    throw std::runtime_error(where + ": " + std::to_string(data_bytes) +
                             " bytes of weights after the header, expected " +
                             std::to_string(4 * expected_values) + " (" +
                             std::to_string(expected_values) + " float32 values)" +
                             (data_bytes < 4 * expected_values ? ": the file is truncated" : ""));
  }
  // Check every value before filling any, so an error leaves the caller's values as they were.
  const auto value_at = [&](std::size_t at) {
    std::uint32_t u;
    std::memcpy(&u, bytes.data() + at, 4);
    return std::bit_cast<float>(to_little_endian(u));
  };
  std::size_t at = pos;
  for (const WeightsSection& s : sections) {
    for (std::size_t i = 0; i < s.values.size(); ++i, at += 4) {
      if (!std::isfinite(value_at(at))) {
        throw std::runtime_error(where + ": value " + std::to_string(i) + " of stage " + s.name +
                                 " is not finite");
      }
    }
  }
  at = pos;
  for (const WeightsSection& s : sections) {
    for (float& v : s.values) {
      v = value_at(at);
      at += 4;
    }
  }
}

void save_weights_file(const std::string& path, std::string_view model,
                       std::span<const WeightsSection> sections) {
  const std::string out = encode_weights(model, sections);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f || !f.write(out.data(), static_cast<std::streamsize>(out.size())) || !f.flush()) {
    throw std::runtime_error(path + ": cannot write the weights: " + std::strerror(errno));
  }
}

void load_weights_file(const std::string& path, std::string_view model,
                       std::span<const WeightsSection> sections) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error(path + ": cannot read the weights: " + ec.message());
  const std::size_t limit = 4 * value_count(sections) + (sections.size() + 3) * (kMaxLine + 1);
  if (size > limit) {
    throw std::runtime_error(
        path + ": " + std::to_string(size) + " bytes, more than a weights file of this model (" +
        std::to_string(4 * value_count(sections)) + " bytes of weights plus a short header)");
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open the weights: " + std::strerror(errno));
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw std::runtime_error(path + ": cannot read the weights");
  decode_weights(all, path, model, sections);
}

}  // namespace kit
