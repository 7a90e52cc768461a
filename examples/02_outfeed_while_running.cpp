// 02_outfeed_while_running: reading the outfeed while the device still runs (TF-IPU's
// "accessing outfeed queue results during execution").
//
// The device runs 100 iterations of a body that adds 1 to its state and writes it to the
// outfeed; each iteration also takes about 1 ms (a stand-in for real compute). A host
// thread prints each result as it arrives, while the loop is still running, instead of
// waiting for the end.
#include <chrono>
#include <cstdio>
#include <string_view>
#include <thread>

#include <bspflow/bspflow.hpp>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 02_outfeed_while_running\n  no options: runs the loop, prints entries as they "
          "arrive, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "02_outfeed_while_running: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  constexpr int kIterations = 100;
  bspflow::OutfeedQueue<int> outfeed;
  bspflow::Device device(0);

  auto body = [](int& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // "compute"
    x += 1;
    return x;
  };
  auto run = bspflow::loops::repeat_async(device, kIterations, body, 0, outfeed);

  int received = 0;
  int received_while_running = 0;
  int out_of_order = 0;
  std::thread dequeue_thread([&] {
    for (auto& e : outfeed) {  // blocks for each entry; ends when the run ends
      const bool running = !run.ready();
      std::printf("iteration %3llu -> %3d%s\n", static_cast<unsigned long long>(e.iteration),
                  e.value, running ? "  (device still running)" : "");
      if (e.value != static_cast<int>(e.iteration) + 1 || e.value != received + 1) ++out_of_order;
      ++received;
      received_while_running += running ? 1 : 0;
    }
  });
  dequeue_thread.join();
  const auto result = run.get();

  std::printf("loop: %s; final value %d\n", result.message.c_str(), result.state());
  std::printf("host read %d entries, %d of them while the device was still running\n", received,
              received_while_running);
  if (!result.completed() || result.state() != kIterations || received != kIterations ||
      out_of_order != 0 || received_while_running == 0) {
    std::fprintf(stderr, "FAILED: expected %d in-order entries, some read during the run\n",
                 kIterations);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
