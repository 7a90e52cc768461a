// 01_infeed_outfeed: the TF-IPU training-loop example in C++.
//
// A host thread feeds pairs of 800-float tensors into an infeed. On the device,
// loops::repeat runs the body 10 times without returning to the host: each iteration takes
// one pair (x1, x2), computes d1 = x1 + x2 and d2 = x1 - x2 into the outfeed, and counts.
// The host gets the counter back (10) and reads 10 entries of d1 and d2 from the outfeed.
#include <array>
#include <cmath>
#include <cstdio>
#include <string_view>
#include <thread>

#include <bspflow/bspflow.hpp>

namespace {

constexpr std::size_t kWidth = 800;
constexpr int kIterations = 10;

struct Pair {
  std::array<float, kWidth> x1{};
  std::array<float, kWidth> x2{};
};
struct Result {
  std::array<float, kWidth> d1{};
  std::array<float, kWidth> d2{};
};

// Element k of the "dataset": x1 = k + 1 everywhere, x2 = (k + 1) / 2 everywhere.
Pair make_pair(int k) {
  Pair p;
  p.x1.fill(static_cast<float>(k + 1));
  p.x2.fill(static_cast<float>(k + 1) / 2.0f);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 01_infeed_outfeed\n  no options: runs the loop, checks the outfeed, exits 0 if "
          "right");
      return 0;
    }
    std::fprintf(stderr, "01_infeed_outfeed: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  bspflow::InfeedQueue<Pair> infeed;
  bspflow::OutfeedQueue<Result> outfeed;  // OutputMode::all(): one entry per iteration
  bspflow::Device device(0);

  // The host side of the infeed: a producer thread, as tf.data would be.
  std::thread producer([&] {
    auto p = infeed.make_producer();
    for (int k = 0; k < kIterations; ++k) p.push(make_pair(k));
  });

  auto body = [](int& counter, Pair& x) {
    Result r;
    for (std::size_t i = 0; i < kWidth; ++i) {
      r.d1[i] = x.x1[i] + x.x2[i];
      r.d2[i] = x.x1[i] - x.x2[i];
    }
    ++counter;
    return r;
  };
  const auto result = bspflow::loops::repeat(device, kIterations, body, 0, infeed, outfeed);
  producer.join();

  std::printf("loop: %s\n", result.message.c_str());
  std::printf("counter = %d\n", result.state());

  int bad = 0;
  int entries = 0;
  for (auto& e : outfeed) {  // ends when the run has ended and every entry was read
    const float k1 = static_cast<float>(e.iteration + 1);
    const bool ok = e.value.d1.front() == 1.5f * k1 && e.value.d2.back() == 0.5f * k1 &&
                    e.value.d1.back() == 1.5f * k1 && e.value.d2.front() == 0.5f * k1;
    std::printf("iteration %llu: d1 = [%g ... %g] (800 values), d2 = [%g ... %g]%s\n",
                static_cast<unsigned long long>(e.iteration), e.value.d1.front(), e.value.d1.back(),
                e.value.d2.front(), e.value.d2.back(), ok ? "" : "  WRONG");
    if (!ok || e.iteration != static_cast<std::uint64_t>(entries)) ++bad;
    ++entries;
  }
  std::printf("outfeed: %d entries of d1 and d2\n", entries);

  if (!result.completed() || result.state() != kIterations || entries != kIterations || bad != 0) {
    std::fprintf(stderr, "FAILED: expected counter %d and %d correct entries in order\n",
                 kIterations, kIterations);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
