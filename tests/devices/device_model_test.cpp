// devices/: the modeled IPU clock's arithmetic (bspflow/devices/device_model.hpp and
// modeled_clock.hpp): cycles of declared work on the Mk2's figures, fp16 against fp32, the
// slowest tile of an Execute's items, the clock's split by phase, and a device's host stream
// copies in modeled time with and without I/O tiles; and the errors a user can make.
#include <doctest/doctest.h>

#include <chrono>
#include <string>

#include <bspflow/base/error.hpp>
#include <bspflow/devices/device.hpp>
#include <bspflow/devices/device_model.hpp>
#include <bspflow/devices/modeled_clock.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("device_model");

TEST_CASE("the Mk2's figures: 62.4 TFLOPS fp32 and 249.65 TFLOPS fp16 over 1472 tiles") {
  const DeviceModel m = DeviceModel::mk2();
  CHECK(1472 * m.fp32_flops_per_tile_cycle * m.clock_hz == doctest::Approx(62.41e12).epsilon(1e-3));
  CHECK(1472 * m.fp16_flops_per_tile_cycle * m.clock_hz ==
        doctest::Approx(249.65e12).epsilon(1e-3));
  CHECK(m.ns(1.325e9) == doctest::Approx(1e9));
  CHECK(std::string(to_string(WorkPrecision::kFloat16Float32)) == "fp16.32");
  CHECK(contains(m.describe(), "1.325 GHz"));
}

TEST_CASE(
    "declared work: the slower of arithmetic and memory, over the compute tiles, plus a sync") {
  DeviceModel m;
  m.sync_cycles_on_chip = 100;
  // 1472 tiles x 32 FLOPs = 47104 FLOPs per cycle: 4710400 FLOPs take 100 cycles.
  const Work arithmetic{4'710'400, 0, WorkPrecision::kFloat32};
  CHECK(m.compute_cycles(arithmetic, 1472) == doctest::Approx(100 + 100));
  // fp16 (fp16 partials): a quarter of the cycles for the same FLOPs; fp16.32: half.
  Work half = arithmetic;
  half.precision = WorkPrecision::kFloat16;
  CHECK(m.compute_cycles(half, 1472) == doctest::Approx(25 + 100));
  half.precision = WorkPrecision::kFloat16Float32;
  CHECK(m.compute_cycles(half, 1472) == doctest::Approx(50 + 100));
  // Memory-bound: 24 bytes per tile-cycle.
  const Work memory{1, 1472.0 * 24 * 1000, WorkPrecision::kFloat32};
  CHECK(m.compute_cycles(memory, 1472) == doctest::Approx(1000 + 100));
  // Fewer compute tiles (I/O tiles taken out): longer.
  CHECK(m.compute_cycles(arithmetic, 1472 - 64) > m.compute_cycles(arithmetic, 1472));
  // A vertex's own cycles are added as they are; efficiency divides the rates.
  CHECK(m.compute_cycles(Work{0, 0, WorkPrecision::kFloat32, 7}, 1472) == doctest::Approx(107));
  m.efficiency = 0.5;
  CHECK(m.compute_cycles(arithmetic, 1472) == doctest::Approx(200 + 100));
}

TEST_CASE("an Execute's items: the busiest tile sets the time") {
  DeviceModel m;
  m.sync_cycles_on_chip = 0;
  const Work item{64, 0, WorkPrecision::kFloat32};  // 2 cycles per item at 32 FLOPs per cycle
  CHECK(m.item_cycles(item, 10, 4) == doctest::Approx(3 * 2));  // ceil(10 / 4) = 3 items
  CHECK(m.item_cycles(item, 8, 4) == doctest::Approx(2 * 2));
  CHECK(m.item_cycles(item, 1, 1472) == doctest::Approx(2));
  CHECK(m.exchange_cycles(1472.0 * 4 * 10, 1472) == doctest::Approx(10));
}

TEST_CASE("the clock: a run's phases add up to its time") {
  ModeledClock c;
  c.reset(1000);  // the host call
  c.compute(500);
  c.link_until(1200);  // already past: no wait
  c.link_until(2000, 10);
  c.exchange(300);
  c.sync_to(2500, 50);  // waits for a slower device, then the sync's own cost
  c.undeclared();
  const ModeledTime t = c.time();
  CHECK(t.total.count() == 2550);
  CHECK(t.host_call.count() == 1000);
  CHECK(t.compute.count() == 500);
  CHECK(t.host_link.count() == 510);
  CHECK(t.exchange.count() == 300);
  CHECK(t.sync.count() == 240);
  CHECK(t.host_call + t.compute + t.host_link + t.exchange + t.sync == t.total);
  CHECK(t.undeclared == 1);
  CHECK_FALSE(t.complete());
  CHECK(t.rate(2550) == doctest::Approx(1e9));
  CHECK(c.launched() == 1000);
}

TEST_CASE("stream copies in modeled time: serial without I/O tiles, overlapped with them") {
  // Copies of 100 ns each, compute steps of 100 ns between them.
  ModeledLink serial;
  ModeledClock a;
  a.reset(0);
  serial.start(0, 0, 2);
  for (int k = 0; k < 10; ++k) {
    serial.copy_in(a, 100, 0);
    a.compute(100);
  }
  CHECK(a.now() == doctest::Approx(2000));  // io + compute, every step

  ModeledLink overlapped;
  ModeledClock b;
  b.reset(0);
  overlapped.start(0, 32, 2);
  for (int k = 0; k < 10; ++k) {
    overlapped.copy_in(b, 100, 5);
    b.compute(100);
  }
  // The first copy is waited for; then each is done while the previous step computes:
  // max(io, compute) per step, plus the hand-over from the I/O tiles.
  CHECK(b.now() == doctest::Approx(100 + 10 * 105));
  CHECK(b.time().host_link.count() == 100 + 10 * 5);

  // A slow link with I/O tiles: the link sets the pace (prefetch cannot run ahead of it).
  ModeledLink slow;
  ModeledClock c;
  c.reset(0);
  slow.start(0, 32, 2);
  for (int k = 0; k < 10; ++k) {
    slow.copy_in(c, 300, 0);
    c.compute(100);
  }
  CHECK(c.now() == doctest::Approx(10 * 300 + 100));

  // Outputs: without I/O tiles the device waits for each; with them it goes on, and the
  // last ones arrive by the end.
  ModeledLink out;
  ModeledClock d;
  d.reset(0);
  out.start(0, 32, 2);
  for (int k = 0; k < 4; ++k) {
    d.compute(100);
    out.copy_out(d, 50, 0);
  }
  CHECK(d.now() == doctest::Approx(400));
  out.finish_out(d);
  CHECK(d.now() == doctest::Approx(450));
}

TEST_CASE("device model errors name the field, the value and what is allowed") {
  auto with = [](auto change) {
    DeviceModel m;
    change(m);
    return error_of([&] { m.validate(); });
  };
  CHECK(contains(with([](DeviceModel& m) { m.clock_hz = 0; }), "device model clock_hz = 0"));
  CHECK(contains(with([](DeviceModel& m) { m.fp16_flops_per_tile_cycle = -1; }),
                 "fp16_flops_per_tile_cycle = -1"));
  CHECK(contains(with([](DeviceModel& m) { m.efficiency = 1.5; }), "must be in (0, 1]"));
  CHECK(contains(with([](DeviceModel& m) { m.host_call = std::chrono::seconds(2); }),
                 "device model host_call"));
  CHECK(contains(with([](DeviceModel& m) { m.sync_cycles_on_chip = -2; }),
                 "sync_cycles_on_chip = -2"));
  DeviceConfig c;
  c.model.memory_bytes_per_tile_cycle = 0;
  CHECK(contains(error_of([&] { c.validate(); }), "memory_bytes_per_tile_cycle = 0"));
}

TEST_SUITE_END();
