// DataLoader benchmark. Every figure is a ratio against a reference measured in the same run,
// on the same in-memory dataset (fp32 1x128x128 samples, the data-loading tutorial's),
// micro-batch 16, 50 device iterations per step, 4 workers:
//  - loader_vs_memcpy: bytes/s the async loader delivers (consumer takes each step and
//    drops it) over a single-threaded memcpy of the same steps' bytes, sample by sample in
//    the same order, into a warm buffer. Above 1 means the workers together beat one copy.
//  - loader_async_vs_sync: steps/s of an async loader over a sync loader (4 helper workers
//    too, but it loads only when asked), with a consumer that spends, per step, as long as
//    the sync loader needs to load one (a device as fast as the loader, which on an IPU is
//    a separate processor: the consumer sleeps). Async overlaps the two, so 2 is the ideal;
//    it runs with load_indefinitely (steady state, no refill at each epoch start). Target
//    >= 1.5 with 4 workers (oversubscribed: 4 workers and the consumer on 2 cores), and
//    loader_async_vs_sync_2_workers the same with 2 workers, >= 1.8.
//
//   loader_bench [--json FILE] [--quick] [--workers N]
#include <CLI/CLI.hpp>

#include <cstring>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

namespace {

using bench::Clock;
using bench::seconds_since;

constexpr std::size_t kBatch = 16;
constexpr std::uint64_t kDeviceIterations = 50;
std::uint32_t g_workers = 4;  // --workers

bspflow::LoaderConfig config(bspflow::LoaderMode mode, std::uint32_t workers = g_workers) {
  bspflow::LoaderConfig c;
  c.batch_size = kBatch;
  c.mode = mode;
  c.num_workers = workers;
  c.shuffle = true;
  c.seed = 1;
  return c;
}

// One epoch; the consumer "computes" for `device` per step. Returns steps/s.
double epoch_rate(bspflow::DataLoader<const bspflow::TensorDataset>& loader,
                  std::chrono::nanoseconds device) {
  const auto t0 = Clock::now();
  std::uint64_t steps = 0;
  for (auto& step : loader) {
    (void)step;
    if (device.count() > 0) std::this_thread::sleep_for(device);
    ++steps;
  }
  return static_cast<double>(steps) / seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bspflow DataLoader benchmark"};
  bench::CommonArgs args;
  args.add_to(app);
  app.add_option("--workers", g_workers, "loader workers (the keys are defined for 4)")
      ->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);

  const std::size_t samples = args.quick ? 1600 : 4800;  // 6 steps / 6 steps of 800 samples
  const int epochs = args.quick ? 2 : 9;
  bspflow::SyntheticDataset::Config cfg;
  cfg.size = samples;
  cfg.spec = {bspflow::DType::kFloat32, {1, 128, 128}};
  cfg.classes = 2;
  cfg.distribution = bspflow::SyntheticDataset::Distribution::kUniform;
  const bspflow::TensorDataset data =
      bspflow::TensorDataset::materialize(bspflow::SyntheticDataset(cfg));
  const bspflow::StepShape shape{kDeviceIterations, 1, 1};

  bench::Report report("loader");
  report.note("workload", std::to_string(samples) + " samples of " + data.spec().describe() +
                              ", batch 16, 50 device iterations, " + std::to_string(g_workers) +
                              " workers, shuffled");

  // Reference: memcpy of one step's samples, in the loader's order, into a warm buffer.
  bspflow::DataLoader<const bspflow::TensorDataset> async(shape, data,
                                                          config(bspflow::LoaderMode::kAsync));
  const std::size_t sample_bytes = data.spec().bytes();
  const std::uint64_t step_samples = async.plan().samples_per_step();
  std::vector<std::byte> dst(step_samples * sample_bytes);
  const auto order = async.plan().shuffled_order(0);
  std::vector<double> copy_rates, loader_rates;
  for (int e = 0; e < epochs; ++e) {
    const auto t0 = Clock::now();
    for (std::uint64_t s = 0; s < async.steps(); ++s) {
      for (std::uint64_t k = 0; k < step_samples; ++k) {
        std::memcpy(dst.data() + k * sample_bytes,
                    data.bytes().data() + order[s * step_samples + k] * sample_bytes, sample_bytes);
      }
    }
    copy_rates.push_back(static_cast<double>(async.steps()) / seconds_since(t0));
    loader_rates.push_back(epoch_rate(async, {}));
  }
  const double step_bytes = static_cast<double>(async.bytes_per_step());
  const double copy_bps = bench::median(copy_rates) * step_bytes;
  const double loader_bps = bench::median(loader_rates) * step_bytes;
  report.figure("memcpy_bytes_per_s", copy_bps);
  report.figure("loader_async_bytes_per_s", loader_bps);
  report.figure("loader_async_items_per_s",
                bench::median(loader_rates) * static_cast<double>(step_samples));
  report.ratio("loader_vs_memcpy", loader_bps / copy_bps,
               "(no target; > 1: workers beat one memcpy)", true);

  // Async vs sync with a consumer as slow as the sync loader, with g_workers workers (the
  // key) and with 2 (one per core here: loader_async_vs_sync_2_workers).
  const auto async_vs_sync = [&](std::uint32_t workers, const std::string& suffix,
                                 const char* target, double target_value) {
    bspflow::DataLoader<const bspflow::TensorDataset> sync(
        shape, data, config(bspflow::LoaderMode::kSync, workers));
    epoch_rate(sync, {});  // warm the buffers
    std::vector<double> sync_alone;
    for (int e = 0; e < epochs; ++e) sync_alone.push_back(epoch_rate(sync, {}));
    const auto device =
        std::chrono::nanoseconds(static_cast<std::int64_t>(1e9 / bench::median(sync_alone)));
    report.figure("device_time_per_step_ms" + suffix, static_cast<double>(device.count()) / 1e6);
    // Steady state: the async loader keeps loading across epoch ends (load_indefinitely), so
    // short epochs do not each pay an empty ring at their start.
    bspflow::LoaderConfig steady = config(bspflow::LoaderMode::kAsync, workers);
    steady.load_indefinitely = true;
    steady.early_preload = true;
    bspflow::DataLoader<const bspflow::TensorDataset> ahead(shape, data, steady);
    epoch_rate(ahead, device);  // warm the buffers
    std::vector<double> sync_rates, async_rates;
    for (int e = 0; e < epochs; ++e) {
      sync_rates.push_back(epoch_rate(sync, device));
      async_rates.push_back(epoch_rate(ahead, device));
    }
    const double sync_rate = bench::median(sync_rates);
    const double async_rate = bench::median(async_rates);
    report.figure("sync_steps_per_s" + suffix, sync_rate);
    report.figure("async_steps_per_s" + suffix, async_rate);
    const double ratio = async_rate / sync_rate;
    report.ratio("loader_async_vs_sync" + suffix, ratio, target, ratio >= target_value);
  };
  async_vs_sync(g_workers, "", ">= 1.5 (ideal 2)", 1.5);
  if (g_workers != 2) async_vs_sync(2, "_2_workers", ">= 1.8 (ideal 2)", 1.8);

  if (!report.write(args.json_path)) {
    std::fprintf(stderr, "could not write %s\n", args.json_path.c_str());
    return 1;
  }
  return 0;
}
