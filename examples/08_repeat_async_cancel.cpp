// 08_repeat_async_cancel: an open-ended loop, stopped from the host.
//
// A host thread streams readings 0, 1, 2, ... into an infeed and never stops on its own.
// loops::repeat_async starts a loop on the device with no real iteration count (it would run
// until the infeed ends) and returns at once with a Run handle. Each iteration takes a
// reading, does about 100 us of "compute", adds it to the device's running total and
// writes (reading, total so far) to the outfeed. The host reads the outfeed while the loop
// runs and, after 50 entries, calls run.cancel(). The loop stops at its next iteration;
// the outfeed still hands over every entry the device wrote, then the host's range-for ends.
// The host checks: status cancelled, and one entry, in order and right, per iteration the
// device completed (nothing produced was lost).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string_view>
#include <thread>

#include <bspflow/bspflow.hpp>

namespace {

constexpr std::uint64_t kOpenEnded = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kCancelAfter = 50;  // entries the host reads before it cancels

struct Output {
  std::uint64_t reading = 0;
  std::uint64_t total = 0;  // the sum of the readings so far
};

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 08_repeat_async_cancel\n  no options: runs an open-ended loop, cancels it after "
          "50 outputs, checks none was lost, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "08_repeat_async_cancel: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  bspflow::InfeedQueue<std::uint64_t> infeed;
  bspflow::OutfeedQueue<Output> outfeed;  // unbounded, OutputMode::all()
  bspflow::Device device(0);

  std::thread producer([&] {  // until the infeed is closed: push() then returns false
    auto p = infeed.make_producer();
    std::uint64_t k = 0;
    while (p.push(k)) ++k;
  });

  auto body = [](std::uint64_t& total, std::uint64_t& reading) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));  // "compute"
    total += reading;
    return Output{reading, total};
  };
  auto run =
      bspflow::loops::repeat_async(device, kOpenEnded, body, std::uint64_t{0}, infeed, outfeed);

  std::uint64_t received = 0, wrong = 0, expected_total = 0;
  for (auto& e : outfeed) {      // ends once the loop has ended and every entry was read
    expected_total += received;  // one producer, one replica: the k-th reading is k
    const bool right =
        e.iteration == received && e.value.reading == received && e.value.total == expected_total;
    wrong += right ? 0 : 1;
    if (++received == kCancelAfter) {
      std::printf("read %llu entries while the loop runs: cancelling\n",
                  static_cast<unsigned long long>(received));
      run.cancel();  // any thread; the loop stops at its next iteration or wait
    }
  }
  const auto r = run.get();
  infeed.close();  // ends the producer (a closed infeed refuses pushes)
  producer.join();

  std::printf("loop: %s\n", r.message.c_str());
  std::printf("device: %llu iterations, total %llu; host: %llu entries, %llu wrong\n",
              static_cast<unsigned long long>(r.iterations[0]),
              static_cast<unsigned long long>(r.state()), static_cast<unsigned long long>(received),
              static_cast<unsigned long long>(wrong));
  if (!r.cancelled() || received < kCancelAfter || received != r.iterations[0] ||
      r.state() != expected_total || wrong != 0) {
    std::fprintf(stderr,
                 "FAILED: expected a cancelled loop and one right entry per completed iteration\n");
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
