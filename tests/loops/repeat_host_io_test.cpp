// runtime/: the device model on a loop's path (loops::repeat with HostIO): tensors cross the
// host link by their bytes, the outfeed's mode decides what crosses back, copies waited out
// without I/O tiles and overlapping the body with them, synthetic data, and HostIO from
// Options with its bad settings named.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using test::kSmall;

namespace {
// n tensors of `elements` values of `dtype` per replica, then closed.
void feed_tensors(InfeedQueue<Tensor>& infeed, std::uint32_t replicas, std::uint64_t n, DType dtype,
                  std::size_t elements = 256) {
  auto p = infeed.make_producer();
  for (std::uint32_t r = 0; r < replicas; ++r) {
    for (std::uint64_t i = 0; i < n; ++i) p.push_to(r, Tensor(dtype, {elements}));
  }
  infeed.close();
}
}  // namespace

TEST_SUITE_BEGIN("repeat_host_io");

TEST_CASE(
    "HostIO: tensors cross the host link by their bytes; 8-bit I/O moves a quarter of fp32's") {
  for (std::uint32_t replicas : {1u, 2u}) {
    CAPTURE(replicas);
    auto run_with = [&](DType dtype) {
      DeviceGroup devices(replicas, kSmall);
      InfeedQueue<Tensor> infeed(InfeedConfig{replicas, 8, 2});
      feed_tensors(infeed, replicas, 6, dtype);
      OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{replicas, OutputMode::all(), 0});
      const auto r = loops::repeat(
          devices, 6,
          [](int& s, Tensor& t) {
            ++s;
            return std::vector<float>(t.elements() / 64, 1.0f);  // 4 floats out
          },
          0, infeed, outfeed, HostIO{});
      REQUIRE(r.completed());
      CHECK(outfeed.drain().size() == 6 * replicas);
      CHECK(r.host_bytes_out == 6 * replicas * 4 * sizeof(float));
      return r.host_bytes_in;
    };
    const std::uint64_t fp32 = run_with(DType::kFloat32);
    const std::uint64_t u8 = run_with(DType::kUint8);
    CHECK(fp32 == 6 * replicas * 256 * 4);
    CHECK(u8 * 4 == fp32);
    CHECK(run_with(DType::kFloat16) * 2 == fp32);
  }
}

TEST_CASE("HostIO: the outfeed's mode decides what crosses back; plain loops read no link") {
  auto out_bytes = [](OutputMode mode) {
    Device device(0, kSmall);
    OutfeedQueue<std::array<float, 8>> outfeed(OutfeedConfig{1, mode, 0});
    const auto r = loops::repeat(
        device, 10, [](int& s) { return std::array<float, 8>{float(++s)}; }, 0, outfeed, HostIO{});
    REQUIRE(r.completed());
    CHECK(r.host_bytes_in == 0);
    return r.host_bytes_out;
  };
  CHECK(out_bytes(OutputMode::all()) == 10 * 32);
  CHECK(out_bytes(OutputMode::every_n(5)) == 2 * 32);
  CHECK(out_bytes(OutputMode::final()) == 32);
  CHECK(out_bytes(OutputMode::sum()) == 32);
  // A loop cut short by the end of its data still sends final()'s and sum()'s one entry.
  for (OutputMode mode : {OutputMode::final(), OutputMode::sum()}) {
    CAPTURE(mode.to_string());
    Device device(0, kSmall);
    InfeedQueue<int> in(InfeedConfig{1, 4, 1});
    {
      auto p = in.make_producer();
      for (int i = 0; i < 3; ++i) p.push(i);
    }
    in.close();
    OutfeedQueue<std::array<float, 8>> outfeed(OutfeedConfig{1, mode, 0});
    const auto r = loops::repeat(
        device, 10,
        [](int& s, int& x) {
          s += x;
          return std::array<float, 8>{float(x)};
        },
        0, in, outfeed, HostIO{});
    CHECK(r.end_of_data());
    CHECK(r.host_bytes_in == 3 * sizeof(int));
    CHECK(r.host_bytes_out == 32);
    CHECK(outfeed.drain().size() == 1);
  }
  // Without a HostIO nothing is modeled.
  Device device(0, kSmall);
  InfeedQueue<Tensor> infeed(InfeedConfig{1, 4, 1});
  feed_tensors(infeed, 1, 3, DType::kFloat32);
  const auto plain = loops::repeat(
      device, 3, [](int& s, Tensor&) { ++s; }, 0, infeed);
  REQUIRE(plain.completed());
  CHECK(plain.host_bytes_in == 0);
  CHECK(plain.host_wait == 0ns);
}

TEST_CASE("HostIO: without I/O tiles each copy is waited for; with them copies overlap the body") {
  const auto d = 10ms;  // one tensor's copy, and the body
  constexpr std::uint64_t kTrips = 10;
  auto run_with = [&](std::uint32_t io_tiles) {
    Device device(0, kSmall);
    InfeedQueue<Tensor> infeed(InfeedConfig{1, kTrips, 2});
    feed_tensors(infeed, 1, kTrips, DType::kFloat32);
    HostIO config;
    config.host_link = LinkModel::taking(d, 1024);
    config.io_tiles = io_tiles;
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = loops::repeat(
        device, kTrips,
        [&](int& s, Tensor&) {
          ++s;
          std::this_thread::sleep_for(d);
        },
        0, infeed, config);
    const auto elapsed = std::chrono::steady_clock::now() - t0;
    REQUIRE(r.completed());
    CHECK(r.host_bytes_in == kTrips * 1024);
    return std::make_pair(r.host_wait, elapsed);
  };
  const auto [serial_wait, serial_elapsed] = run_with(0);
  CHECK(serial_wait >=
        kTrips * d);  // each copy waited out in full: a lower bound, not a timing guess
  CHECK(serial_elapsed >= 2 * kTrips * d);
  const auto [overlap_wait, overlap_elapsed] = run_with(2);
  // The first copy is waited for; the others ran while the body slept.
  CHECK(overlap_wait < kTrips * d / 2);
  (void)overlap_elapsed;
}

TEST_CASE("HostIO: synthetic data reads one element per replica, and nothing crosses the link") {
  DeviceGroup devices(2, kSmall);
  InfeedQueue<Tensor> infeed(InfeedConfig{2, 10, 1});
  feed_tensors(infeed, 2, 10, DType::kFloat32);
  OutfeedQueue<float> outfeed(OutfeedConfig{2, OutputMode::all(), 0});
  HostIO config;
  config.synthetic_data = true;
  config.host_link = LinkModel::taking(50ms, 1);  // would take minutes if copied
  const auto r = loops::repeat(
      devices, 30,
      [](int& s, Tensor& t) {
        // The same element every iteration, as the body left it.
        float& first = t.as<float>()[0];
        first += 1.0f;
        ++s;
        return first;
      },
      0, infeed, outfeed, config);
  REQUIRE(r.completed());
  CHECK(r.iterations == std::vector<std::uint64_t>{30, 30});
  CHECK(r.host_bytes_in == 0);
  CHECK(r.host_bytes_out == 0);
  CHECK(r.host_wait == 0ns);
  const auto entries = outfeed.drain();
  REQUIRE(entries.size() == 60);
  for (const auto& e : entries) CHECK(e.value == static_cast<float>(e.iteration + 1));
  // One element per lane was read; the other 9 are still there.
  for (std::uint32_t lane = 0; lane < 2; ++lane) {
    auto reader = infeed.reader(lane);
    std::uint64_t left = 0;
    for (Tensor t; reader.try_pop(t);) ++left;
    CHECK(left == 9);
  }
}

TEST_CASE("HostIO: from Options, and bad settings named with what is allowed") {
  Options o;
  o.host_link(LinkModel{2e9, 3us}).io_tiles(4).synthetic_data(true);
  const HostIO c = o.host_io();
  CHECK(c.host_link.bytes_per_second == 2e9);
  CHECK(c.host_link.latency == 3us);
  CHECK(c.io_tiles == 4);
  CHECK(c.synthetic_data);
  CHECK(EngineConfig::from(o).host_link.bytes_per_second == 2e9);
  CHECK(PipelineConfig::from(o).host_link.latency == 3us);
  CHECK(contains(o.describe(), "host_link = 2.0 GB/s, 3.0 us latency"));
  CHECK(contains(error_of([&] {
                   o.host_link(LinkModel{0.0, 1us});
                 }),
                 "host link bytes_per_second = 0 is not allowed"));
  CHECK(o.host_link().bytes_per_second == 2e9);  // not stored

  Device device(0, DeviceConfig{8, 1024});
  InfeedQueue<Tensor> infeed(InfeedConfig{1, 4, 4});
  feed_tensors(infeed, 1, 4, DType::kFloat32);  // 1 KiB each
  auto body = [](int& s, Tensor&) { ++s; };
  HostIO odd;
  odd.io_tiles = 3;
  CHECK(
      contains(error_of([&] { loops::repeat(device, 4, body, 0, infeed, odd); }), "io_tiles = 3"));
  HostIO all;
  all.io_tiles = 8;
  const std::string why = error_of([&] { loops::repeat(device, 4, body, 0, infeed, all); });
  CHECK(contains(why, "io_tiles = 8"));
  CHECK(contains(why, "below device 0's tiles (8)"));
  // 2 tiles x 1 KiB cannot hold prefetch_depth 4 x 1 KiB: the run ends with the device's error.
  HostIO small;
  small.io_tiles = 2;
  const std::string room = error_of([&] { loops::repeat(device, 4, body, 0, infeed, small); });
  CHECK(contains(room, "cannot hold prefetch_depth 4"));
  CHECK(contains(room, "raise io_tiles or lower prefetch_depth"));
  // The I/O tiles are taken from the arena for the run and given back.
  CHECK(device.arena().used() == 0);
}

TEST_SUITE_END();
