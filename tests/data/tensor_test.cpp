// data/: Tensor (bspflow/data/tensor.hpp): element types, fp16 storage, conversion.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <bspflow/data/tensor.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE("tensor") {

TEST_CASE("tensors: element types, fp16 storage, conversion") {
  Tensor t(DType::kFloat32, {2, 3});
  CHECK(t.bytes() == 24);
  CHECK(t.elements() == 6);
  CHECK(t.as<float>()[5] == 0.0f);
  CHECK(contains(error_of([&] { (void)t.as<std::uint8_t>(); }), "holds fp32 elements, read as uint8"));
  Tensor copy = t;
  copy.as<float>()[0] = 1.5f;
  CHECK(t.as<float>()[0] == 0.0f);  // deep copy

  CHECK(to_half(1.0f) == 0x3C00);
  CHECK(to_half(-2.0f) == 0xC000);
  CHECK(to_half(65504.0f) == 0x7BFF);
  CHECK(to_half(1e6f) == 0x7C00);              // overflow -> infinity
  CHECK(to_half(5.9604645e-8f) == 0x0001);     // smallest subnormal
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

}  // TEST_SUITE
