// runtime/: DeviceBuffer (bspflow/engine/device_buffer.hpp): typed, zero-filled memory in a
// device's arena, counted against its budget and given back when the last Buffer goes; the
// element type checked on access; sizes that do not fit or overflow are errors naming the
// buffer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;
using test::kSmall;

TEST_SUITE_BEGIN("device_buffer");

TEST_CASE("a buffer: typed memory of its device, zero-filled, elements x element size bytes") {
  Device dev(3, kSmall);
  Buffer x = make_buffer(dev, "x", DType::kFloat32, 100);
  CHECK(&x->device() == &dev);
  CHECK(x->name() == "x");
  CHECK(x->dtype() == DType::kFloat32);
  CHECK(x->elements() == 100);
  CHECK(x->bytes() == 400);
  CHECK(x->raw().size() == 400);
  CHECK(
      std::all_of(x->raw().begin(), x->raw().end(), [](std::byte b) { return b == std::byte{0}; }));
  // as<E>() and raw() are views of the same memory.
  x->as<float>()[99] = 1.0f;
  CHECK(x->as<float>().size() == 100);
  CHECK(x->raw()[99 * 4 + 3] != std::byte{0});
  const DeviceBuffer& cx = *x;
  CHECK(cx.raw().data() == x->raw().data());
  // Every element type, at its size.
  CHECK(make_buffer(dev, "h", DType::kFloat16, 10)->as<std::uint16_t>().size() == 10);
  CHECK(make_buffer(dev, "h", DType::kFloat16, 10)->bytes() == 20);
  CHECK(make_buffer(dev, "u", DType::kUint8, 10)->bytes() == 10);
  CHECK(make_buffer(dev, "i", DType::kInt32, 10)->as<std::int32_t>().size() == 10);
}

TEST_CASE("as<E>() with an element type other than the buffer's is an error naming both") {
  Device dev(0, kSmall);
  Buffer x = make_buffer(dev, "weights", DType::kFloat32, 4);
  CHECK(
      contains(error_of([&] { x->as<std::int32_t>(); }), "buffer 'weights' holds fp32, not int32"));
  CHECK(contains(error_of([&] { x->as<std::uint16_t>(); }), "holds fp32, not fp16"));
  Buffer b = make_buffer(dev, "pixels", DType::kUint8, 4);
  CHECK(contains(error_of([&] { b->as<float>(); }), "buffer 'pixels' holds uint8, not fp32"));
}

TEST_CASE("a buffer is a named allocation in its device's arena, freed with the last Buffer") {
  Device dev(0, kSmall);
  Arena& arena = dev.arena();
  const std::size_t before = arena.used();
  Buffer x =
      make_buffer(dev, "activations", DType::kFloat32, 1000);  // 4000 bytes: 4032 in the arena
  CHECK(arena.used() == before + 4032);
  bool named = false;
  for (const Arena::Allocation& a : arena.allocations()) named = named || a.name == "activations";
  CHECK(named);
  Buffer shared = x;  // one buffer, two handles
  x.reset();
  CHECK(arena.used() == before + 4032);
  shared.reset();
  CHECK(arena.used() == before);
}

TEST_CASE("memory given back and taken again is zero-filled again") {
  Device dev(0, kSmall);
  const std::byte* where = nullptr;
  {
    Buffer a = make_buffer(dev, "a", DType::kUint8, 4096);
    std::fill(a->raw().begin(), a->raw().end(), std::byte{0xab});
    where = a->raw().data();
  }
  Buffer b = make_buffer(dev, "b", DType::kUint8, 4096);
  CHECK(b->raw().data() == where);  // the arena hands out the first free block: the same memory
  CHECK(
      std::all_of(b->raw().begin(), b->raw().end(), [](std::byte v) { return v == std::byte{0}; }));
}

TEST_CASE("zero elements: an empty buffer") {
  Device dev(0, kSmall);
  Buffer e = make_buffer(dev, "empty", DType::kFloat32, 0);
  CHECK(e->bytes() == 0);
  CHECK(e->raw().empty());
  CHECK(e->as<float>().empty());
}

TEST_CASE("a buffer larger than the device's free memory is an OutOfMemoryError naming it") {
  Device dev(4, kSmall);  // 64 tiles x 16 KiB = 1 MiB
  Buffer held = make_buffer(dev, "weights", DType::kFloat32, 64 * 1024);  // 256 KiB
  const std::size_t used = dev.arena().used();
  try {
    make_buffer(dev, "huge", DType::kFloat32, 256 * 1024);  // 1 MiB
    FAIL("no OutOfMemoryError");
  } catch (const OutOfMemoryError& e) {
    CHECK(contains(e.what(), "device 4"));
    CHECK(contains(e.what(), "1.0 MiB for 'huge'"));
    CHECK(contains(e.what(), "'weights' 256.0 KiB"));  // who holds the rest
    CHECK(e.requested() == 1024 * 1024);
  }
  CHECK(dev.arena().used() == used);  // nothing taken by the refused buffer
}

TEST_CASE("an element count whose byte size overflows is an error naming the buffer") {
  Device dev(0, kSmall);
  const std::size_t before = dev.arena().used();
  const std::size_t too_many = std::numeric_limits<std::size_t>::max() / 4 + 1;  // x 4 bytes wraps
  const std::string err = error_of([&] { make_buffer(dev, "big", DType::kFloat32, too_many); });
  CHECK(contains(err, "buffer 'big': " + std::to_string(too_many) + " elements overflow"));
  CHECK(dev.arena().used() == before);
}

TEST_SUITE_END();
