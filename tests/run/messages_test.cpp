// The messages a user reads when something is wrong, as a table: a bad input from each room
// and the exact text it gets, so a change to any of them is a visible diff here. Where a
// message holds something of this machine (its memory), the table holds the fixed parts.
// Every message names what was wrong, the value given and what is allowed.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "data/data_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::error_of;

namespace {

struct Row {
  const char* what;            // the bad input, in words
  std::function<void()> make;  // throws the message
  std::string message;         // exactly (or, with `ends`, the start)
  std::string ends = {};       // the end, when the middle is this machine's
};

void check(const Row& row) {
  const std::string what = row.what;
  CAPTURE(what);
  const std::string got = error_of(row.make);
  if (row.ends.empty()) {
    CHECK(got == row.message);
  } else {
    CHECK(got.rfind(row.message, 0) == 0);
    CHECK(got.size() >= row.ends.size());
    CHECK(got.compare(got.size() - row.ends.size(), row.ends.size(), row.ends) == 0);
    MESSAGE(got);
  }
  // No quote inside quotes ("for 'buffer 'x''").
  CHECK(got.find("''") == std::string::npos);
}

// The first message a DeviceError's run reports (the loop's own).
std::string loop_failure(std::uint64_t count) {
  Device device(0, DeviceConfig{});
  InfeedQueue<int> infeed;
  auto p = infeed.make_producer();
  for (int i = 0; i < 4; ++i) p.push(i);
  infeed.close();
  try {
    loops::repeat(
        device, count,
        [](int&, int& x, const Iteration& it) {
          if (it.index == 2) throw std::runtime_error("boom");
          (void)x;
        },
        0, infeed);
  } catch (const DeviceError& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_SUITE_BEGIN("messages");

TEST_CASE("the table of messages: each names what was wrong, the value given and what is allowed") {
  const std::vector<Row> rows = {
      {"a host link of 0 bytes per second",
       [] {
         LinkModel{0, 0ns}.validate("host link");
       },
       "host link bytes_per_second = 0 is not allowed: must be a positive, finite number of bytes "
       "per second "
       "(10e9 is 10 GB/s)"},
      {"a negative link latency",
       [] {
         LinkModel{1e9, -5ns}.validate("device link");
       },
       "device link latency = -5 ns is not allowed: must be in 0 ns..1 s"},
      {"a prefetch depth of 0", [] { Options().prefetch_depth(0); },
       "prefetch_depth = 0 is not allowed: must be in 1..255"},
      // Named as the configs name them (tiles, consumer_type, HostIO::io_tiles).
      {"0 tiles", [] { Options().tiles(0); },
       "tiles = 0 is not allowed: must be in 1.." + std::to_string(tunables::kMaxTiles)},
      {"every tile for I/O", [] { Options().tiles(32).io_tiles(32).validate(); },
       "io_tiles = 32 is not allowed: must be below tiles (32), leaving tiles for compute"},
      {"an unbounded outfeed with one reader",
       [] { Options().consumer_type(ConsumerType::kSingle).outfeed_capacity(0).validate(); },
       "outfeed_capacity = 0 is not allowed: must be at least 1 with "
       "consumer_type(ConsumerType::kSingle): each replica writes into a ring, which needs a "
       "bound (0 = unbounded needs ConsumerType::kMulti)"},
      {"an odd I/O tile count in a HostIO",
       [] {
         HostIO io;
         io.io_tiles = 3;
         io.validate();
       },
       "io_tiles = 3 is not allowed: must be 0 or an even number"},
      {"replicas not dividing by the instances", [] { (void)InstanceLayout::of(0, 2, 3); },
       "replicas = 3 is not allowed: must be a multiple of the instance count (2): each instance "
       "runs replicas / "
       "instances of them"},
      {"get() on a default-constructed Run", [] { (void)Run<int>().get(); },
       "Run::get() on an empty Run: it was default-constructed, moved from, or get() was already "
       "called"},
      {"a buffer larger than its device",
       [] {
         Device device(0, DeviceConfig{1, 64 * 1024});
         (void)make_buffer(device, "activations", DType::kFloat32, 64 * 1024);
       },
       "device 0: out of memory allocating 256.0 KiB for 'activations': 64.0 KiB free of 64.0 KiB. "
       "0 B used of "
       "64.0 KiB, nothing allocated. Raise tiles or bytes_per_tile, or shrink what holds the "
       "memory."},
      {"a device of 64 TiB",
       [] {
         Device device(0, DeviceConfig{1u << 20, std::size_t{64} << 20});
       },
       "device 0 asks for 64.0 TiB (tiles 1048576 x bytes_per_tile 64.0 MiB), more than this "
       "machine has (",
       "): lower tiles or bytes_per_tile"},
      {"a loop failing at an iteration", [] { throw Error(loop_failure(10)); },
       "device 0 (replica 0) failed at iteration 2 of 10: boom"},
      {"an open-ended loop (a service: 2^62 iterations) failing",
       [] { throw Error(loop_failure(std::uint64_t{1} << 62)); },
       "device 0 (replica 0) failed at iteration 2: boom"},
      // The entries an earlier run left count against the bound.
      {"loops::repeat into a bounded outfeed an earlier run left 6 of 10 entries in",
       [] {
         Device device(0, DeviceConfig{64, 16 * 1024});
         OutfeedQueue<int> out(OutfeedConfig{1, OutputMode::all(), 10});
         for (int run = 0; run < 2; ++run) {
           loops::repeat(
               device, 6, [](int& s) { return s; }, 0, out);
         }
       },
       "outfeed capacity 10 < 6 entries already in it (unread, from an earlier run) + 6 entries "
       "this run delivers, and loops::repeat reads nothing until the loop ends: read or drain() "
       "the outfeed first, use loops::repeat_async and read it while it runs, or raise the "
       "capacity (0 = unbounded)"},
      {"the same with one reader (a ring of 10 per replica)",
       [] {
         DeviceGroup pair(2, DeviceConfig{64, 16 * 1024});
         OutfeedQueue<int> out(OutfeedConfig{2, OutputMode::all(), 10, ConsumerType::kSingle});
         for (int run = 0; run < 2; ++run) {
           loops::repeat(
               pair, 6, [](int& s) { return s; }, 0, out);
         }
       },
       "outfeed capacity 10 per replica < 6 entries already in replica 0's ring (unread, from "
       "an earlier run) + 6 entries this run delivers to each replica, and loops::repeat reads "
       "nothing until the loop ends: read or drain() the outfeed first, use loops::repeat_async "
       "and read it while it runs, or raise the capacity"},
      {"loops::repeat of 10 entries into an outfeed of 5",
       [] {
         Device device(0, DeviceConfig{64, 16 * 1024});
         OutfeedQueue<int> out(OutfeedConfig{1, OutputMode::all(), 5});
         loops::repeat(
             device, 10, [](int& s) { return s; }, 0, out);
       },
       "outfeed capacity 5 < 10 entries this run delivers, and loops::repeat reads nothing until "
       "the loop ends: use loops::repeat_async and read the outfeed while it runs, or raise the "
       "capacity (0 = unbounded)"},
      // A schedule a strategy cannot run is refused with one wording for every strategy.
      {"a Grouped schedule for a sharded pipeline",
       [] {
         PipelineConfig cfg;
         cfg.strategy = ExecutionStrategy::kSharded;
         cfg.schedule = PipelineSchedule::kGrouped;
         cfg.gradient_accumulation = 8;
         cfg.validate(4);
       },
       "schedule = grouped is not allowed: must be unset or sequential with strategy sharded, "
       "which runs one stage at a time (the Sequential schedule); for another schedule use "
       "strategy pipelined"},
      {"an Interleaved schedule with every stage on one device",
       [] {
         PipelineConfig cfg;
         cfg.strategy = ExecutionStrategy::kSingle;
         cfg.schedule = PipelineSchedule::kInterleaved;
         cfg.gradient_accumulation = 8;
         cfg.validate(4);
       },
       "schedule = interleaved is not allowed: must be unset or sequential with strategy single, "
       "which runs a replica's 4 stages one after another on one device (the Sequential "
       "schedule); for another schedule use strategy pipelined"},
      {"an AllReduce of 3 replicas between the Syncs of a group of 2",
       [] {
         DeviceGroup pair(2, DeviceConfig{64, 16 * 1024});
         Engine engine(pair);
         auto group = std::make_shared<SyncGroup>(2);
         const Program p = program::Sequence{
             program::Sync(group),
             program::AllReduce("grads", 3, [](const ComputeContext&) { return std::size_t{64}; }),
             program::Sync(group)};
         engine.run({p, p});
       },
       "AllReduce 'grads' replicas = 3 is not allowed: must be 2 on device 0, the participants "
       "of the sync group it runs between (the devices that all-reduce together)"},
      // When a run cannot make progress.
      {"a negative stall limit", [] { StallCheck{-1ns}.validate(); },
       "StallCheck::limit = -1 ns is not allowed: must be 0 (no check) or in 1 ms..24 h"},
      {"a loop stalled on an empty infeed nobody closes, with OnStall::kFail",
       [] {
         const LogLevel level = log_level();
         set_log_level(LogLevel::kError);  // (the same report is logged as a warning)
         Device device(0, DeviceConfig{64, 16 * 1024});
         InfeedQueue<int> in;
         try {
           loops::repeat(
               device, 10, [](int&, int&) {}, 0, in, StallCheck{20ms, OnStall::kFail});
         } catch (...) {
           set_log_level(level);
           throw;
         }
         set_log_level(level);
       },
       "loops::repeat: no device has made progress for 20 ms (StallCheck::limit): device 0 "
       "(replica 0) waits for an element of the infeed's lane 0 (empty, not closed). Push to the "
       "infeed or close it, or cancel the run (OnStall::kFail: the run ends with StallError)"},
      {"an output mode that does not parse", [] { (void)OutputMode::parse("every_n:0"); },
       "OutputMode every_n(n): n = 0 is not allowed: must be at least 1"},
  };
  for (const Row& row : rows) check(row);
}

TEST_CASE("counts read as words: 1 step, 2 steps") {
  CHECK(detail::count_of(1, "step") == "1 step");
  CHECK(detail::count_of(0, "step") == "0 steps");
  CHECK(detail::count_of(2, "replica") == "2 replicas");
  test::CountingDataset data(10);
  LoaderConfig c;
  c.batch_size = 10;
  DataLoader loader(StepShape{1, 1, 1}, data, c);
  CHECK(loader.plan().describe() ==
        "combined batch 10 batch x 1 device iteration x 1 gradient accumulation x 1 replica = 10 "
        "samples; 10 samples "
        "-> 1 step per epoch");
}

TEST_SUITE_END();
