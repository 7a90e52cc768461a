// 03_engine_program: a Poplar-style program run by the Engine on two emulated devices.
//
// Each device runs 100 trips of: take a tensor from the host (StreamCopy), double it on its
// compute tiles (Execute), wait for the other device (Sync), fetch the other device's
// result into its own buffer (Copy: an exchange over the modeled device link), sync again
// so nobody overwrites a buffer still being read, and send that to the host (StreamCopy).
// The host checks that device d returned twice what it fed device 1 - d, in order.
#include <cstdio>
#include <memory>
#include <string_view>
#include <vector>

#include <bspflow/bspflow.hpp>

using namespace bspflow::program;

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 03_engine_program\n  no options: runs the program, checks it, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "03_engine_program: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  constexpr std::size_t kElements = 1024;
  constexpr std::uint64_t kTrips = 100;

  bspflow::DeviceGroup devices(2);
  bspflow::EngineConfig config;
  config.io_tiles = 32;       // copies for upcoming trips overlap compute
  config.prefetch_depth = 2;  // up to 2 tensors moved ahead
  config.trace = true;        // for the summary below
  bspflow::Engine engine(devices, config);

  bspflow::InfeedQueue<bspflow::Tensor> infeed(bspflow::InfeedConfig{2});  // lane d -> device d
  bspflow::OutfeedQueue<bspflow::Tensor> outfeed(bspflow::OutfeedConfig{2});
  auto sync = std::make_shared<bspflow::SyncGroup>(2);
  std::vector<bspflow::Buffer> x, y;
  for (std::uint32_t d = 0; d < 2; ++d) {
    x.push_back(bspflow::make_buffer(devices[d], "x", bspflow::DType::kFloat32, kElements));
    y.push_back(bspflow::make_buffer(devices[d], "y", bspflow::DType::kFloat32, kElements));
  }
  std::vector<bspflow::Program> programs;
  for (std::uint32_t d = 0; d < 2; ++d) {
    bspflow::Buffer mine = x[d];
    programs.push_back(
        Repeat(kTrips,
               Sequence{StreamCopy(infeed, mine),  // host -> device
                        Execute("double", kElements,
                                [mine](const bspflow::ComputeContext&, const bspflow::TileWork& w) {
                                  for (std::size_t i = w.begin; i < w.end; ++i)
                                    mine->as<float>()[i] *= 2;  // this tile's share
                                }),
                        Sync(sync),                    // both have doubled
                        Copy(x[1 - d], y[d]),          // exchange
                        Sync(sync),                    // both have copied
                        StreamCopy(y[d], outfeed)}));  // device -> host
  }

  // The host feeds trip t of device d a tensor filled with 1000 d + t (capacity 256 >= 100).
  auto producer = infeed.make_producer();
  for (std::uint64_t t = 0; t < kTrips; ++t) {
    for (std::uint32_t d = 0; d < 2; ++d) {
      bspflow::Tensor v(bspflow::DType::kFloat32, {kElements});
      for (float& e : v.as<float>()) e = static_cast<float>(1000 * d + t);
      producer.push_to(d, std::move(v));
    }
  }
  const bspflow::EngineResult r = engine.run(programs);  // blocks until both programs end
  std::printf("%s: %llu + %llu trips\n%s", bspflow::to_string(r.status),
              static_cast<unsigned long long>(r.iterations[0]),
              static_cast<unsigned long long>(r.iterations[1]),
              engine.summary().to_string().c_str());

  int entries = 0, wrong = 0;
  for (auto& e : outfeed) {  // replica d = device d; per replica in trip order
    const float expected = 2.0f * static_cast<float>(1000 * (1 - e.replica) + e.iteration);
    for (float v : e.value.as<float>()) wrong += v != expected ? 1 : 0;
    ++entries;
  }
  std::printf("outfeed: %d tensors, %d wrong values\n", entries, wrong);
  if (!r.completed() || r.iterations != std::vector<std::uint64_t>{kTrips, kTrips} ||
      entries != 2 * kTrips || wrong != 0) {
    std::fprintf(stderr,
                 "FAILED: expected %llu trips per device and 2 x (the other device's input)\n",
                 static_cast<unsigned long long>(kTrips));
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
