// 06_output_modes: what the host receives from one loop under each of the four output modes
// (TF-IPU IPUOutfeedMode, PopTorch OutputMode).
//
// The same loop runs four times: 10 device iterations of a body that counts up and writes
// its count (1, 2, ..., 10) to the outfeed. Only the outfeed's OutputMode changes:
//   all()        every iteration's value: 10 entries, 1..10;
//   sum()        one entry, the sum over the iterations: 55;
//   final()      one entry, the last iteration's value: 10;
//   every_n(5)   iterations 4 and 9 (every 5th, 0-based): 5 and 10.
// The host reads each outfeed and checks the entries (iteration and value) it was given.
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace {

constexpr std::uint64_t kIterations = 10;

struct Expected {
  bspflow::OutputMode mode;
  std::vector<std::pair<std::uint64_t, int>> entries;  // (iteration, value), in order
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 06_output_modes\n  no options: runs a 10-iteration loop under all, sum, final "
          "and every_n:5, checks the outfeeds, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "06_output_modes: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  const Expected cases[] = {
      {bspflow::OutputMode::all(),
       {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}, {7, 8}, {8, 9}, {9, 10}}},
      {bspflow::OutputMode::sum(), {{9, 55}}},  // a sum carries the last iteration summed
      {bspflow::OutputMode::final(), {{9, 10}}},
      {bspflow::OutputMode::every_n(5), {{4, 5}, {9, 10}}},
  };
  bspflow::Device device(0);
  auto body = [](int& count) { return ++count; };  // the iteration's output: its count

  int failures = 0;
  for (const Expected& c : cases) {
    bspflow::OutfeedQueue<int> outfeed(bspflow::OutfeedConfig{.mode = c.mode});
    const auto r = bspflow::loops::repeat(device, kIterations, body, 0, outfeed);
    std::vector<std::pair<std::uint64_t, int>> got;
    for (auto& e : outfeed) got.emplace_back(e.iteration, e.value);

    std::printf("%-10s %zu entr%s:", c.mode.to_string().c_str(), got.size(),
                got.size() == 1 ? "y" : "ies");
    for (const auto& [iteration, value] : got) {
      std::printf(" [iteration %llu: %d]", static_cast<unsigned long long>(iteration), value);
    }
    const bool ok = r.completed() && r.state() == static_cast<int>(kIterations) && got == c.entries;
    std::printf("%s\n", ok ? "" : "  WRONG");
    failures += ok ? 0 : 1;
  }
  if (failures != 0) {
    std::fprintf(stderr,
                 "FAILED: %d of 4 output modes gave the host something else than expected\n",
                 failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
