// The consumer every packaging route builds (.ci/run: pkg-config, CMake, a meson subproject):
// a program that only includes <bspflow/bspflow.hpp>, sums four elements on one device
// through loops::repeat and exits 0 if the sum is right.
#include <bspflow/bspflow.hpp>

int main() {
  bspflow::InfeedQueue<int> in;
  bspflow::OutfeedQueue<int> out;
  bspflow::Device device(0, bspflow::DeviceConfig{});
  auto producer = in.make_producer();
  for (int i = 0; i < 4; ++i) producer.push(i);
  auto run = bspflow::loops::repeat(
      device, 4,
      [](int& sum, int& x) {
        sum += x;
        return x;
      },
      0, in, out);
  return run.state(0) == 6 ? 0 : 1;
}
