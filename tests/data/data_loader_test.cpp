// data/: DataLoader (bspflow/data/data_loader.hpp): plan arithmetic, config validation,
// exactly-once delivery, routing to replicas, shuffling, sync and async modes, early stop,
// errors, drop_last, 8-bit I/O, streaming datasets, and the loader feeding a replicated
// loops::repeat loop.
#include <doctest/doctest.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

// The umbrella: the loader takes bspflow::Options, and the last test feeds a loops::repeat loop.
#include <bspflow/bspflow.hpp>

#include "data_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::CountingDataset;
using test::error_of;

namespace {

// A stream of n samples 0..n-1 (element = position), rewindable; `stop_at` ends it early.
class CountingStream {
 public:
  CountingStream(std::size_t n, std::size_t stop_at) : n_(n), stop_at_(stop_at) {}
  std::size_t size() const { return n_; }
  SampleSpec spec() const { return {DType::kInt32, {1}}; }
  bool next(Sample& s) {
    if (pos_ >= stop_at_) return false;
    s = Sample{Tensor(DType::kInt32, {1}), static_cast<std::int32_t>(pos_ % 3)};
    s.data.as<std::int32_t>()[0] = static_cast<std::int32_t>(pos_);
    ++pos_;
    return true;
  }
  void rewind() {
    pos_ = 0;
    ++rewinds;
  }
  int rewinds = 0;

 private:
  std::size_t n_;
  std::size_t stop_at_;
  std::size_t pos_ = 0;
};

struct Delivered {
  std::multiset<std::uint64_t> indices;
  std::size_t padding = 0;
  std::size_t steps = 0;
  std::vector<std::uint64_t> sequence;  // in delivery order (replica-major per step)
};

// Runs one epoch, checking every batch against the dataset as it goes.
template <class Loader>
Delivered drain_epoch(Loader& loader) {
  Delivered d;
  for (auto& step : loader) {
    ++d.steps;
    for (std::uint32_t r = 0; r < loader.plan().replicas(); ++r) {
      for (const Batch& b : step.replica(r)) {
        CHECK(b.replica == r);
        CHECK(b.step == step.index());
        const auto values = b.data.template as<std::int32_t>();
        const std::size_t per_sample = values.size() / b.labels.size();
        for (std::size_t k = 0; k < b.labels.size(); ++k) {
          if (b.indices[k] == Batch::kPadding) {
            ++d.padding;
            CHECK(b.labels[k] == -1);
            CHECK(k >= b.valid);
            continue;
          }
          CHECK(k < b.valid);
          d.indices.insert(b.indices[k]);
          d.sequence.push_back(b.indices[k]);
          CHECK(b.labels[k] == static_cast<std::int32_t>(b.indices[k] % 7));
          CHECK(values[k * per_sample] == static_cast<std::int32_t>(b.indices[k]));
          CHECK(values[k * per_sample + per_sample - 1] == static_cast<std::int32_t>(b.indices[k]));
        }
      }
    }
  }
  return d;
}

template <class Loader>
std::uint64_t drain_epoch_count(Loader& loader) {
  std::uint64_t steps = 0;
  for (auto& step : loader) {
    (void)step;
    ++steps;
  }
  return steps;
}

void check_exactly_once(const Delivered& d, std::uint64_t n, std::uint64_t dropped) {
  CHECK(d.indices.size() == n - dropped);
  std::set<std::uint64_t> unique(d.indices.begin(), d.indices.end());
  CHECK(unique.size() == d.indices.size());  // nothing twice
  if (!unique.empty()) CHECK(*unique.rbegin() < n);
}

LoaderConfig async_config(std::size_t batch, std::uint32_t workers) {
  LoaderConfig c;
  c.batch_size = batch;
  c.mode = LoaderMode::kAsync;
  c.num_workers = workers;
  return c;
}

}  // namespace

TEST_SUITE_BEGIN("data_loader");

TEST_CASE("plan: steps per epoch, drop and pad counts, the combined batch") {
  struct Case {
    std::uint64_t size, di;
    std::uint32_t ga, replicas;
    std::size_t batch;
    bool drop_last;
    std::uint64_t steps, dropped, padded;
  };
  const Case cases[] = {
      {60000, 10, 10, 1, 40, true, 15, 0, 0},  // the pipelining tutorial: 4000 per step
      {60000, 1, 1, 1, 16, true, 3750, 0, 0},
      {10000, 50, 1, 2, 16, true, 6, 400, 0},  // the data-loading tutorial, 2 replicas
      {10000, 50, 1, 2, 16, false, 7, 0, 1200},
      {100, 3, 2, 2, 4, true, 2, 4, 0},
      {100, 3, 2, 2, 4, false, 3, 0, 44},
      {7, 1, 1, 1, 7, true, 1, 0, 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.size);
    CAPTURE(c.batch);
    LoaderConfig cfg;
    cfg.batch_size = c.batch;
    cfg.drop_last = c.drop_last;
    const LoadPlan plan(StepShape{c.di, c.ga, c.replicas}, c.size, cfg);
    CHECK(plan.samples_per_step() == c.batch * c.di * c.ga * c.replicas);
    CHECK(plan.steps_per_epoch() == c.steps);
    CHECK(plan.dropped_per_epoch() == c.dropped);
    CHECK(plan.padded_per_epoch() == c.padded);
    // steps x combined batch = size - dropped + padded
    CHECK(plan.steps_per_epoch() * plan.samples_per_step() == c.size - c.dropped + c.padded);
  }
  LoaderConfig cfg;
  cfg.batch_size = 16;
  CHECK(contains(error_of([&] {
                   LoadPlan(StepShape{50, 1, 2}, 1000, cfg);
                 }),
                 "fewer than one step needs (combined batch 16 batch x 50 device iterations x "
                 "1 gradient accumulation x 2 replicas = 1600 samples)"));
  CHECK(contains(error_of([&] { LoadPlan(StepShape{1, 1, 1}, 0, cfg); }), "empty"));
  // The loader takes bspflow::Options directly.
  Options opts;
  opts.device_iterations(50).replicas(2);
  CountingDataset data(10000);
  DataLoader loader(opts, data, cfg);
  CHECK(loader.steps() == 6);
  CHECK(loader.dropped() == 400);
  CHECK(loader.bytes_per_step() == 1600 * 24);
}

TEST_CASE("config validation names the option and what is allowed") {
  CountingDataset data(100);
  const StepShape one{};
  const auto err = [&](LoaderConfig c) {
    return error_of([&] { DataLoader loader(one, data, c); });
  };
  LoaderConfig c;
  c.batch_size = 0;
  CHECK(contains(err(c), "batch_size = 0 is not allowed: must be at least 1"));
  c = LoaderConfig{};
  c.mode = LoaderMode::kAsync;
  c.num_workers = 2;
  c.buffer_size = 0;
  CHECK(contains(err(c), "buffer_size = 0 is not allowed: must be in 1..1024"));
  c.buffer_size = 3;
  c.load_indefinitely = true;
  c.persistent_workers = false;
  CHECK(contains(err(c), "load_indefinitely = true needs persistent_workers = true"));
  c = LoaderConfig{};
  c.early_preload = true;
  CHECK(contains(err(c), "early_preload = true needs mode async"));
  c = LoaderConfig{};
  c.num_workers = 100000;
  CHECK(contains(err(c), "num_workers = 100000 is not allowed: must be at most 256"));
}

TEST_CASE(
    "every sample exactly once per epoch, in every mode, replicas disjoint (async with 0 workers "
    "too)") {
  const std::uint64_t n = 203;
  CountingDataset data(n);
  for (LoaderMode mode : {LoaderMode::kSync, LoaderMode::kAsync}) {
    for (std::uint32_t workers : {0u, 1u, 4u}) {
      // kAsync with no workers: one background thread loads (PopTorch's loader process).
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {true, false}) {
          for (std::uint32_t replicas : {1u, 2u}) {
            CAPTURE(to_string(mode));
            CAPTURE(workers);
            CAPTURE(shuffle);
            CAPTURE(drop_last);
            CAPTURE(replicas);
            LoaderConfig c;
            c.batch_size = 5;
            c.mode = mode;
            c.num_workers = workers;
            c.shuffle = shuffle;
            c.seed = 11;
            c.drop_last = drop_last;
            DataLoader loader(StepShape{3, 2, replicas}, data, c);
            for (int epoch = 0; epoch < 2; ++epoch) {
              const Delivered d = drain_epoch(loader);
              CHECK(d.steps == loader.steps());
              CHECK(loader.epoch() == static_cast<std::uint64_t>(epoch));
              check_exactly_once(d, n, loader.dropped());
              CHECK(d.padding == loader.padded());
            }
          }
        }
      }
    }
  }
}

TEST_CASE("micro-batch m of a step goes to replica m % replicas, in order") {
  CountingDataset data(48);
  LoaderConfig c;
  c.batch_size = 2;
  DataLoader loader(StepShape{3, 1, 2}, data, c);  // 12 samples per step
  for (auto& step : loader) {
    for (std::uint32_t r = 0; r < 2; ++r) {
      const auto mine = step.replica(r);
      REQUIRE(mine.size() == 3);
      for (std::uint64_t j = 0; j < 3; ++j) {
        const std::uint64_t first = step.index() * 12 + (j * 2 + r) * 2;
        CHECK(mine[j].indices[0] == first);
        CHECK(mine[j].indices[1] == first + 1);
        CHECK(mine[j].position == j);
      }
    }
  }
  CHECK(contains(error_of([&] {
                   for (auto& step : loader) (void)step.replica(2);
                 }),
                 "replica = 2 is not allowed"));
}

TEST_CASE("shuffle: same seed same order, reshuffled every epoch, other seed differs") {
  CountingDataset data(120);
  const auto orders = [&](std::uint64_t seed, LoaderMode mode) {
    LoaderConfig c;
    c.batch_size = 4;
    c.shuffle = true;
    c.seed = seed;
    c.mode = mode;
    c.num_workers = mode == LoaderMode::kAsync ? 3 : 0;
    DataLoader loader(StepShape{5, 1, 1}, data, c);
    std::vector<std::vector<std::uint64_t>> epochs;
    for (int e = 0; e < 3; ++e) epochs.push_back(drain_epoch(loader).sequence);
    return epochs;
  };
  const auto a = orders(5, LoaderMode::kSync);
  const auto b = orders(5, LoaderMode::kAsync);  // workers do not change the order
  const auto c = orders(6, LoaderMode::kSync);
  CHECK(a == b);
  CHECK(a[0] != a[1]);
  CHECK(a[1] != a[2]);
  CHECK(a[0] != c[0]);
  std::vector<std::uint64_t> identity(120);
  for (std::uint64_t i = 0; i < 120; ++i) identity[i] = i;
  CHECK(a[0] != identity);
}

TEST_CASE("early stop: abandoning an epoch, then destroying mid-epoch, joins cleanly") {
  CountingDataset data(400);
  for (bool indefinitely : {false, true}) {
    CAPTURE(indefinitely);
    LoaderConfig c = async_config(4, 4);
    c.load_indefinitely = indefinitely;
    c.shuffle = true;
    DataLoader loader(StepShape{5, 1, 1}, data, c);  // 20 per step, 20 steps
    int taken = 0;
    for (auto& step : loader) {
      (void)step;
      if (++taken == 3) break;  // early stop
    }
    CHECK(loader.epoch() == 0);
    // The next epoch starts clean: every sample once, nothing left over from epoch 0.
    const Delivered d = drain_epoch(loader);
    CHECK(loader.epoch() == 1);
    CHECK(d.steps == 20);
    check_exactly_once(d, 400, 0);
    // Destroy while workers are mid-epoch (a step held, others loading).
    auto it = loader.begin();
    ++it;
  }
  SUBCASE("destroy right after construction with early preload") {
    LoaderConfig c = async_config(4, 4);
    c.early_preload = true;
    DataLoader loader(StepShape{5, 1, 1}, data, c);
  }
}

TEST_CASE("async: early_preload loads before the first step is asked for") {
  CountingDataset data(100);
  LoaderConfig c = async_config(5, 2);
  c.early_preload = true;
  c.buffer_size = 2;
  DataLoader loader(StepShape{2, 1, 1}, data, c);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (data.reads() < 20 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(data.reads() == 20);  // exactly the 2 buffered steps, and no more: the ring bounds it
  check_exactly_once(drain_epoch(loader), 100, 0);
}

TEST_CASE("load_indefinitely: consecutive epochs, each exactly once; non-persistent workers") {
  CountingDataset data(90);
  LoaderConfig c = async_config(3, 3);
  c.load_indefinitely = true;
  c.shuffle = true;
  DataLoader loader(StepShape{2, 1, 2}, data, c);  // 12 per step, 7 steps, 6 dropped
  for (int e = 0; e < 4; ++e) check_exactly_once(drain_epoch(loader), 90, 6);
  CHECK(loader.epoch() == 3);

  LoaderConfig p = async_config(3, 2);
  p.persistent_workers = false;
  DataLoader restarting(StepShape{2, 1, 2}, data, p);
  for (int e = 0; e < 3; ++e) check_exactly_once(drain_epoch(restarting), 90, 6);
}

TEST_CASE("a worker's exception reaches the consumer with the sample index; nothing hangs") {
  CountingDataset data(100, {37});
  for (LoaderMode mode : {LoaderMode::kSync, LoaderMode::kAsync}) {
    CAPTURE(to_string(mode));
    LoaderConfig c;
    c.batch_size = 5;
    c.mode = mode;
    c.num_workers = mode == LoaderMode::kAsync ? 4 : 2;
    DataLoader loader(StepShape{2, 1, 1}, data, c);  // 10 per step: 37 is in step 3
    std::uint64_t steps_before = 0;
    std::string message;
    std::uint64_t index = 0;
    try {
      for (auto& step : loader) {
        (void)step;
        ++steps_before;
      }
    } catch (const LoaderError& e) {
      message = e.what();
      index = e.sample_index();
      CHECK_THROWS_WITH_AS(std::rethrow_exception(e.cause()), "corrupt record 37",
                           std::runtime_error);
    }
    CHECK(steps_before == 3);
    CHECK(index == 37);
    CHECK(contains(message,
                   "sample 37 (epoch 0, step 3, replica 0) could not be loaded: "
                   "corrupt record 37"));
    // The loader stays failed, and says so again.
    CHECK_THROWS_AS((void)loader.next(), LoaderError);
  }
}

TEST_CASE("holding more steps than the ring is an error, not a deadlock") {
  CountingDataset data(100);
  LoaderConfig c = async_config(5, 2);
  c.buffer_size = 2;
  DataLoader loader(StepShape{2, 1, 1}, data, c);
  loader.start_epoch();
  auto a = loader.next();
  auto b = loader.next();
  CHECK(contains(error_of([&] { (void)loader.next(); }), "2 step(s) are still held"));
  a.reset();
  CHECK(loader.next().has_value());
}

TEST_CASE("drop_last says once how many samples it drops and why") {
  std::vector<std::string> messages;
  set_log_handler([&](LogLevel, std::string_view m) { messages.emplace_back(m); });
  CountingDataset data(100);
  LoaderConfig c;
  c.batch_size = 8;
  {
    DataLoader loader(StepShape{1, 1, 2}, data, c);  // 16 per step: 6 steps, 4 dropped
    for (int e = 0; e < 2; ++e) drain_epoch(loader);
  }
  {  // A second loader of the same shape (one built per measurement): said once per process.
    DataLoader again(StepShape{1, 1, 2}, data, c);
    drain_epoch(again);
  }
  set_log_handler(nullptr);
  REQUIRE(messages.size() == 1);
  CHECK(contains(messages[0],
                 "drop_last drops 4 of 100 samples every epoch: 100 = 6 steps x 16 + 4"));
  CHECK(contains(messages[0], "drop_last = false"));
}

TEST_CASE("8-bit I/O: uint8 kept (4x fewer bytes than fp32) or widened on the host") {
  SyntheticDataset::Config cfg;
  cfg.size = 64;
  cfg.spec = {DType::kUint8, {1, 28, 28}};
  SyntheticDataset images(cfg);
  LoaderConfig c;
  c.batch_size = 8;
  DataLoader eight(StepShape{2, 1, 1}, images, c);
  c.output_dtype = DType::kFloat32;
  DataLoader wide(StepShape{2, 1, 1}, images, c);
  CHECK(wide.bytes_per_step() == 4 * eight.bytes_per_step());
  auto s8 = eight.next();
  auto s32 = wide.next();
  REQUIRE(s8);
  REQUIRE(s32);
  const Batch& a = s8->replica(0)[1];
  const Batch& b = s32->replica(0)[1];
  CHECK(a.data.dtype() == DType::kUint8);
  CHECK(b.data.dtype() == DType::kFloat32);
  CHECK(a.data.shape() == std::vector<std::size_t>{8, 1, 28, 28});
  const auto px = a.data.as<std::uint8_t>();
  const auto fl = b.data.as<float>();
  bool same = true;
  for (std::size_t i = 0; i < px.size(); ++i) same = same && fl[i] == static_cast<float>(px[i]);
  CHECK(same);
}

TEST_CASE("streaming dataset: read in order, rewound per epoch, short streams are errors") {
  CountingStream stream(50, 50);
  LoaderConfig c;
  c.batch_size = 5;
  DataLoader loader(StepShape{2, 1, 1}, stream, c);
  for (int e = 0; e < 2; ++e) {
    std::vector<std::int32_t> seen;
    for (auto& step : loader) {
      for (const Batch& b : step.batches()) {
        for (std::int32_t v : b.data.as<std::int32_t>()) seen.push_back(v);
      }
    }
    REQUIRE(seen.size() == 50);
    for (std::size_t i = 0; i < 50; ++i) CHECK(seen[i] == static_cast<std::int32_t>(i));
  }
  CHECK(stream.rewinds == 1);

  LoaderConfig async = async_config(5, 1);
  CountingStream s2(50, 50);
  DataLoader one_worker(StepShape{2, 1, 1}, s2, async);
  CHECK(drain_epoch_count(one_worker) == 5);

  c.shuffle = true;
  CHECK(contains(error_of([&] { DataLoader l(StepShape{}, stream, c); }),
                 "shuffle = true needs a random-access dataset"));
  CHECK(contains(error_of([&] { DataLoader l(StepShape{}, stream, async_config(5, 2)); }),
                 "num_workers = 2 is not allowed: must be 1 with a streaming dataset"));
  CountingStream short_stream(50, 23);
  c.shuffle = false;
  DataLoader bad(StepShape{2, 1, 1}, short_stream, c);
  CHECK_THROWS_WITH_AS(drain_epoch_count(bad),
                       doctest::Contains("the stream ended after 23 samples"), LoaderError);
}

TEST_CASE("the loader feeds a replicated loop: each replica its own samples, all once") {
  Options opts;
  opts.device_iterations(4).gradient_accumulation(2).replicas(2).infeed_capacity(64);
  const std::uint64_t n = 8 * 4 * 2 * 2 * 5 + 3;  // 5 steps, 3 dropped
  CountingDataset data(n);
  LoaderConfig c = async_config(8, 2);
  c.shuffle = true;
  DataLoader loader(opts, data, c);
  REQUIRE(loader.steps() == 5);
  InfeedQueue<Batch> infeed(opts.infeed_config());
  auto producer = infeed.make_producer();
  OutfeedQueue<std::vector<std::uint64_t>> outfeed(opts.outfeed_config());
  DeviceGroup devices(2, opts.device_config());
  std::multiset<std::uint64_t> seen;
  std::set<std::uint64_t> per_replica[2];
  const std::uint64_t iterations = opts.device_iterations() * opts.gradient_accumulation();
  while (loader.feed_next(producer)) {
    auto r = loops::repeat(
        devices, iterations,
        [](int&, Batch& b, const Iteration& it) {
          if (b.replica != it.replica) throw std::runtime_error("wrong lane");
          return std::vector<std::uint64_t>(
              b.indices.begin(), b.indices.begin() + static_cast<std::ptrdiff_t>(b.valid));
        },
        0, infeed, outfeed);
    CHECK(r.completed());
    for (auto& e : outfeed) {
      for (std::uint64_t i : e.value) {
        seen.insert(i);
        per_replica[e.replica].insert(i);
      }
    }
  }
  CHECK(seen.size() == n - 3);
  CHECK(std::set<std::uint64_t>(seen.begin(), seen.end()).size() == n - 3);
  CHECK(per_replica[0].size() == (n - 3) / 2);
  for (std::uint64_t i : per_replica[0]) CHECK(per_replica[1].count(i) == 0);
  CHECK(contains(error_of([&] {
                   InfeedQueue<Batch> wrong(InfeedConfig{3, 16, 1});
                   auto p = wrong.make_producer();
                   loader.feed_next(p);
                 }),
                 "the infeed has 3 replica lanes but the loader fills 2 replicas"));
}

TEST_CASE(
    "the loader's batches cross a loop's modeled host link as data plus labels (8-bit data: 1 byte "
    "a value)") {
  Options opts;
  opts.device_iterations(4).infeed_capacity(8).io_tiles(2).prefetch_depth(2);
  SyntheticDataset::Config dc;
  dc.size = 64;
  dc.spec = SampleSpec{DType::kUint8, {2, 8}};
  SyntheticDataset data(dc);
  LoaderConfig c;
  c.batch_size = 4;
  DataLoader loader(opts, data, c);
  InfeedQueue<Batch> infeed(opts.infeed_config());
  auto producer = infeed.make_producer();
  Device device(0, opts.device_config());
  std::uint64_t bytes = 0, samples = 0, steps = 0;
  while (loader.feed_next(producer)) {
    const auto r = loops::repeat(
        device, opts.device_iterations(), [](std::size_t& seen, Batch& b) { seen += b.valid; },
        std::size_t{0}, infeed, opts.host_io());
    REQUIRE(r.completed());
    bytes += r.host_bytes_in;
    samples += r.state();
    ++steps;
  }
  CHECK(steps == loader.steps());
  CHECK(samples == 64);
  CHECK(bytes == samples * 16 + samples * sizeof(std::int32_t));
}

TEST_CASE(
    "instances: each loads a disjoint part of every epoch; together every sample once, the same "
    "number of steps") {
  const std::uint64_t n = 1003;  // not a multiple of anything below
  CountingDataset data(n);
  for (std::uint32_t instances : {1u, 2u, 3u}) {
    for (bool drop_last : {true, false}) {
      for (bool shuffle : {false, true}) {
        CAPTURE(instances);
        CAPTURE(drop_last);
        CAPTURE(shuffle);
        std::multiset<std::uint64_t> all;
        std::size_t padding = 0;
        std::uint64_t steps = 0, dropped = 0;
        for (std::uint32_t i = 0; i < instances; ++i) {
          LoaderConfig c;
          c.batch_size = 4;
          c.drop_last = drop_last;
          c.shuffle = shuffle;
          c.seed = 7;
          c.instance = i;
          c.instances = instances;
          DataLoader loader(StepShape{5, 1, 2}, data, c);  // 40 samples a step, 2 local replicas
          if (i == 0) {
            steps = loader.steps();
            dropped = loader.dropped();
          }
          CHECK(loader.steps() == steps);      // every instance runs as many steps
          CHECK(loader.dropped() == dropped);  // the global count, the same everywhere
          for (int epoch = 0; epoch < 2; ++epoch) {
            const Delivered d = drain_epoch(loader);
            CHECK(d.steps == steps);
            if (epoch == 0) {
              all.insert(d.indices.begin(), d.indices.end());
              padding += d.padding;
            }
          }
        }
        // No sample twice; without drop_last none missing; with it, exactly dropped() missing.
        CHECK(std::set<std::uint64_t>(all.begin(), all.end()).size() == all.size());
        CHECK(all.size() + dropped == n);
        if (!drop_last) CHECK(dropped == 0);
        CHECK(padding == (drop_last ? 0 : instances * steps * 40 - n));
      }
    }
  }
}

TEST_CASE("instances: bad settings and a stream are refused with what is allowed") {
  CountingDataset data(100);
  LoaderConfig c;
  c.instances = 2;
  c.instance = 2;
  CHECK(contains(error_of([&] { DataLoader loader(StepShape{}, data, c); }), "instance = 2"));
  c.instance = 0;
  c.instances = 0;
  CHECK(contains(error_of([&] { DataLoader loader(StepShape{}, data, c); }), "instances = 0"));
  CountingDataset tiny(3);
  c.instances = 4;
  CHECK(contains(error_of([&] { DataLoader loader(StepShape{}, tiny, c); }),
                 "fewer than the 4 instances"));
  c.instances = 2;
  CountingStream stream(50, 50);
  const std::string why = error_of([&] { DataLoader loader(StepShape{}, stream, c); });
  CHECK(contains(why, "instances = 2"));
  CHECK(contains(why, "cannot be split between instances"));
  // drop_last too few per instance names the split.
  c.batch_size = 40;
  CountingDataset sixty(60);
  CHECK(contains(error_of([&] { DataLoader loader(StepShape{}, sixty, c); }),
                 "30 samples per instance"));
}

#if defined(__linux__)
// A stream that records the scheduling policy of the thread reading each sample.
class PolicyStream : public CountingStream {
 public:
  using CountingStream::CountingStream;
  bool next(Sample& s) {
    policies.insert(sched_getscheduler(0));
    return CountingStream::next(s);
  }
  std::set<int> policies;
};

TEST_CASE("async workers load at background priority unless told not to; sync loads do not") {
  for (bool background : {true, false}) {
    PolicyStream stream(40, 40);
    LoaderConfig c = async_config(4, 1);
    c.background_workers = background;
    DataLoader loader(StepShape{2, 1, 1}, stream, c);
    CHECK(drain_epoch_count(loader) == 5);
    CHECK(stream.policies == std::set<int>{background ? SCHED_IDLE : SCHED_OTHER});
  }
  PolicyStream stream(40, 40);
  LoaderConfig c;
  c.batch_size = 4;
  DataLoader sync(StepShape{2, 1, 1}, stream, c);  // loads on this thread
  CHECK(drain_epoch_count(sync) == 5);
  CHECK(stream.policies == std::set<int>{sched_getscheduler(0)});
}
#endif

TEST_SUITE_END();
