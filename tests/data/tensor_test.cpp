// data/: Tensor (bspflow/data/tensor.hpp): element types, fp16 storage, conversion.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <bspflow/data/tensor.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("tensor");

TEST_CASE("tensors: element types, fp16 storage, conversion") {
  Tensor t(DType::kFloat32, {2, 3});
  CHECK(t.bytes() == 24);
  CHECK(t.elements() == 6);
  CHECK(t.as<float>()[5] == 0.0f);
  CHECK(contains(error_of([&] { (void)t.as<std::uint8_t>(); }),
                 "holds fp32 elements, read as uint8"));
  Tensor copy = t;
  copy.as<float>()[0] = 1.5f;
  CHECK(t.as<float>()[0] == 0.0f);  // deep copy

  CHECK(to_half(1.0f) == 0x3C00);
  CHECK(to_half(-2.0f) == 0xC000);
  CHECK(to_half(65504.0f) == 0x7BFF);
  CHECK(to_half(1e6f) == 0x7C00);           // overflow -> infinity
  CHECK(to_half(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(from_half(0x3555) == doctest::Approx(0.333251953f));
  for (float f : {0.0f, 0.5f, -3.25f, 1000.0f, 6.103515625e-05f}) CHECK(from_half(to_half(f)) == f);
  CHECK(std::isnan(from_half(to_half(std::nanf("")))));

  const std::uint8_t px[3] = {0, 128, 255};
  float out[3];
  convert(DType::kUint8, reinterpret_cast<const std::byte*>(px), DType::kFloat32,
          reinterpret_cast<std::byte*>(out), 3);
  CHECK(out[0] == 0.0f);
  CHECK(out[1] == 128.0f);
  CHECK(out[2] == 255.0f);
  std::uint8_t back[3];
  const float in[3] = {-4.0f, 12.4f, 300.0f};
  convert(DType::kFloat32, reinterpret_cast<const std::byte*>(in), DType::kUint8,
          reinterpret_cast<std::byte*>(back), 3);
  CHECK(back[0] == 0);
  CHECK(back[1] == 12);
  CHECK(back[2] == 255);  // saturates
}

TEST_SUITE_END();

TEST_CASE("fp16: the array conversions (F16C where the CPU has it) give the scalar ones' bits") {
  // Every fp16 value, and floats around each rounding boundary (halfway cases, subnormals,
  // overflow, infinities, NaN), in runs that are not multiples of 8 (the vector tails).
  std::vector<float> values;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = from_half(static_cast<std::uint16_t>(h));
    values.push_back(f);
    if (std::isfinite(f)) {
      values.push_back(std::nextafter(f, 1e30f));
      values.push_back(std::nextafter(f, -1e30f));
    }
  }
  for (float f :
       {65504.0f, 65519.0f, 65520.0f, 1e30f, -1e30f, 2.9802322e-8f, 2.98023259e-8f, 1e-8f})
    values.push_back(f);
  values.push_back(3.0f);  // 3 leftover values after the last full vector of 8
  std::vector<std::uint16_t> bulk(values.size());
  to_half(values, bulk);
  std::vector<float> rounded = values;
  round_to_half(rounded);
  std::vector<float> back(values.size());
  from_half(bulk, back);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t want = to_half(values[i]);
    if (std::isnan(values[i])) {
      mismatches +=
          (bulk[i] & 0x7C00u) == 0x7C00u && (bulk[i] & 0x3FFu) != 0 ? 0 : 1;  // a NaN either way
      mismatches += std::isnan(rounded[i]) && std::isnan(back[i]) ? 0 : 1;
      continue;
    }
    mismatches += bulk[i] == want ? 0 : 1;
    mismatches +=
        std::bit_cast<std::uint32_t>(rounded[i]) == std::bit_cast<std::uint32_t>(from_half(want))
            ? 0
            : 1;
    mismatches +=
        std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(from_half(want)) ? 0
                                                                                               : 1;
  }
  CHECK(values.size() > 190000);
  CHECK(mismatches == 0);
}
