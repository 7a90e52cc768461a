// t05_memory_journey: the IPU hands-on tutorial's journey, in its order, on one emulated IPU
// (1472 tiles with a small memory each, --bytes-per-tile): the tutorial's conv net on
// Fashion-MNIST-shaped images (28 x 28, 8-bit on disk), micro-batch 16. Each step changes one
// thing and prints a row:
//
//   1. fp32                         runs out of memory (its modeled speed is still computed,
//                                   as Poplar's IPU Model runs an over-full program)
//   2. fp16 storage                 fits; the AMP units run fp16 at a multiple of fp32's rate
//   3. gradient accumulation 1 -> K fewer weight updates, and more work per host call
//   4. device iterations 1 -> D     fewer host calls: one launches D steps
//   5. 8-bit input                  the host sends uint8 pixels, normalised on the device:
//                                   a quarter of the host-link bytes
//   6. asynchronous loader          the host loads the next steps while the device computes
//
// Each row: peak memory of the device, whether it fits, modeled samples/s (the modeled IPU
// for the device, the real host for the loading: a synchronous loader and the device take
// turns, 1/(1/host + 1/device); an asynchronous one overlaps them, min(host, device)), the
// device alone in modeled time, the host's loading rate (real, measured once for fp32 and
// once for 8-bit pixels), CPU samples/s (what this machine took for the row's training, loader
// included), and host bytes per step. The verdict uses the modeled figure.
//
//   t05_memory_journey [--micro-batch 16] [--gradient-accumulation 16]
//       [--device-iterations 16] [--bytes-per-tile 2304] [--samples 16384]
//       [--loader-workers 2] [--quiet]
//
// Exit status: 0 when the journey goes as the seed says (fp32 does not fit, fp16 does, and
// every step is at least as fast in modeled time as the one before), 1 otherwise, 2 for bad
// arguments.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "model_kit.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::size_t batch = 16;
  std::uint32_t gradient_accumulation = 16;
  std::uint64_t device_iterations = 16;
  std::size_t bytes_per_tile = 2304;  // 1472 x 2.25 KiB = 3.2 MiB per device
  std::uint64_t samples = 16384;      // trained per row
  std::uint32_t workers = 2;
  bool quiet = false;
};

struct Step {
  const char* what;
  bool half = false;
  std::uint32_t k = 1;
  std::uint64_t d = 1;
  bool eight_bit = false;
  bool async = false;
};

struct Row {
  std::string what;
  bool fits = false;
  std::size_t peak = 0, capacity = 0;
  double device_sps = 0;   // modeled IPU alone
  double host_sps = 0;     // the real loader alone
  double modeled_sps = 0;  // the two combined as the loader mode says
  double cpu_sps = 0;      // this machine, loader and device together
  std::uint64_t host_bytes_per_step = 0;
  bool complete = true;  // every compute step declared its cost
};

bspflow::PipelineConfig config_of(const Step& s) {
  bspflow::PipelineConfig cfg;
  cfg.strategy = bspflow::ExecutionStrategy::kSingle;
  cfg.schedule = bspflow::PipelineSchedule::kSequential;
  cfg.gradient_accumulation = s.k;
  if (s.half) cfg.precision = bspflow::Precision::half();
  return cfg;
}

bspflow::DataLoader<bspflow::TensorDataset> make_loader(const Settings& st, const Step& s,
                                                        const bspflow::Options& opts,
                                                        bspflow::TensorDataset& data) {
  bspflow::LoaderConfig lc;
  lc.batch_size = st.batch;
  lc.num_workers = st.workers;
  lc.mode = s.async ? bspflow::LoaderMode::kAsync : bspflow::LoaderMode::kSync;
  // Without 8-bit I/O the host turns the pixels into fp32 before they cross the link.
  if (!s.eight_bit) lc.output_dtype = bspflow::DType::kFloat32;
  if (s.async) lc.persistent_workers = true;
  return bspflow::DataLoader<bspflow::TensorDataset>(opts, data, lc);
}

// The host's loading rate (real samples/s) for micro-batches of fp32 pixels or of 8-bit ones:
// the DataLoader alone, its workers loading steps of the journey's largest shape. Measured
// for both, alternately, three times each (the median): how fast the host loads does not
// depend on whether the device waits for it, which is the loader mode's whole effect.
struct HostRates {
  double fp32 = 0, eight_bit = 0;
};
HostRates measure_host(const Settings& st, bspflow::TensorDataset& data) {
  bspflow::Options opts;
  opts.device_iterations(st.device_iterations).gradient_accumulation(st.gradient_accumulation);
  const std::uint64_t per_step = st.batch * st.gradient_accumulation * st.device_iterations;
  const std::uint64_t steps = std::max<std::uint64_t>(2, st.samples / per_step);
  std::vector<double> fp32, eight_bit;
  for (int round = 0; round < 3; ++round) {
    for (bool eight : {false, true}) {
      Step shape{"", true, st.gradient_accumulation, st.device_iterations, eight, true};
      auto loader = make_loader(st, shape, opts, data);
      (void)loader.next();  // workers started, buffers allocated
      std::uint64_t loaded = 0;
      const auto t0 = Clock::now();
      for (std::uint64_t c = 0; c < steps;) {
        auto step = loader.next();  // nullopt at the end of an epoch: the next call starts one
        if (!step) continue;
        loaded += step->batches().size() * st.batch;
        ++c;
      }
      (eight ? eight_bit : fp32)
          .push_back(static_cast<double>(loaded) /
                     std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  std::sort(fp32.begin(), fp32.end());
  std::sort(eight_bit.begin(), eight_bit.end());
  return {fp32[1], eight_bit[1]};
}

Row run_step(const Settings& st, const Step& s, bspflow::TensorDataset& data, double host_sps) {
  Row row;
  row.what = s.what;
  const bspflow::PipelineConfig cfg = config_of(s);
  kit::AdamW adamw;
  auto make = [&](std::uint32_t) { return kit::make_model(kit::Model::kConv, 1, st.batch, adamw); };
  std::printf(
      "\n== %s: fp%s, gradient accumulation %u, device iterations %llu, %s input, %s "
      "loader ==\n",
      s.what, s.half ? "16" : "32", s.k, static_cast<unsigned long long>(s.d),
      s.eight_bit ? "8-bit" : "fp32", s.async ? "asynchronous" : "synchronous");

  // Memory: the small device the journey is about.
  bspflow::DeviceConfig small;
  small.bytes_per_tile = st.bytes_per_tile;
  row.capacity = small.memory_bytes();
  std::unique_ptr<bspflow::DeviceGroup> devices;
  std::unique_ptr<bspflow::Pipeline> pipe;
  try {
    devices = std::make_unique<bspflow::DeviceGroup>(1, small);
    pipe = std::make_unique<bspflow::Pipeline>(*devices, cfg, make);
    row.fits = true;
    row.peak = pipe->memory().devices.front().peak();
    std::printf("fits:\n%s", pipe->memory().to_string(st.quiet ? 2 : 4).c_str());
  } catch (const bspflow::PipelineOutOfMemoryError& e) {
    row.peak = e.report().devices.front().peak();
    std::printf("out of memory:\n%s", e.report().to_string(st.quiet ? 2 : 4).c_str());
    // Like Poplar's IPU Model, run it anyway (on a device with room) for its modeled speed.
    pipe.reset();
    devices = std::make_unique<bspflow::DeviceGroup>(1, bspflow::DeviceConfig{});
    pipe = std::make_unique<bspflow::Pipeline>(*devices, cfg, make);
  }

  bspflow::Options opts;
  opts.device_iterations(s.d).gradient_accumulation(s.k);
  const std::uint64_t per_step = st.batch * s.k * s.d;  // samples per host call
  const std::uint64_t calls = std::max<std::uint64_t>(1, st.samples / per_step);

  row.host_sps = host_sps;

  // The training run: the loader feeds each host call's steps, the device runs them.
  auto loader = make_loader(st, s, opts, data);
  bspflow::InfeedQueue<bspflow::Batch> infeed(
      bspflow::InfeedConfig{1, static_cast<std::size_t>(s.k * s.d) + 1, 1});
  auto producer = infeed.make_producer();
  double modeled_ns = 0;
  std::uint64_t host_bytes = 0;
  const auto t0 = Clock::now();
  for (std::uint64_t c = 0; c < calls; ++c) {
    while (!loader.feed_next(producer)) {
    }  // false at the end of an epoch: the next call starts one
    const bspflow::PipelineResult r = pipe->run(infeed, s.d);
    if (!r.completed()) throw bspflow::Error("training stopped: " + r.message);
    modeled_ns += static_cast<double>(r.modeled.total.count());
    host_bytes += r.host_bytes_in;
    row.complete = row.complete && r.modeled.complete();
  }
  const double cpu_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double samples = static_cast<double>(calls * per_step);
  row.cpu_sps = samples / cpu_s;
  row.device_sps = samples * 1e9 / modeled_ns;
  row.modeled_sps = s.async ? std::min(row.host_sps, row.device_sps)
                            : 1.0 / (1.0 / row.host_sps + 1.0 / row.device_sps);
  row.host_bytes_per_step = host_bytes / (calls * s.d);
  std::printf(
      "modeled IPU %.0f samples/s alone, real loader %.0f samples/s alone: %.0f "
      "samples/s modeled together (CPU: %.0f)\n",
      row.device_sps, row.host_sps, row.modeled_sps, row.cpu_sps);
  return row;
}

int run(const Settings& st) {
  const std::vector<Step> journey = {
      {"1. fp32", false, 1, 1, false, false},
      {"2. fp16 storage", true, 1, 1, false, false},
      {"3. gradient accumulation", true, st.gradient_accumulation, 1, false, false},
      {"4. device iterations", true, st.gradient_accumulation, st.device_iterations, false, false},
      {"5. 8-bit input", true, st.gradient_accumulation, st.device_iterations, true, false},
      {"6. asynchronous loader", true, st.gradient_accumulation, st.device_iterations, true, true},
  };
  // Fashion-MNIST-shaped images held in memory as 8-bit pixels, as a loaded dataset is.
  bspflow::TensorDataset data = bspflow::TensorDataset::materialize(bspflow::SyntheticDataset(
      {.size = 65536, .spec = {bspflow::DType::kUint8, {28, 28}}, .seed = 7}));
  const HostRates host = measure_host(st, data);
  std::printf("the host loads %.0f samples/s as fp32, %.0f as 8-bit (real, %u loader workers)\n",
              host.fp32, host.eight_bit, st.workers);
  std::vector<Row> rows;
  for (const Step& s : journey) {
    rows.push_back(run_step(st, s, data, s.eight_bit ? host.eight_bit : host.fp32));
  }

  std::printf("\n%-28s %-4s %-22s %12s %12s %12s %12s %10s\n", "step", "fits", "peak memory (of)",
              "modeled/s", "IPU alone/s", "loader/s", "CPU/s", "host B/step");
  for (const Row& r : rows) {
    const std::string peak =
        bspflow::format_bytes(r.peak) + " (" + bspflow::format_bytes(r.capacity) + ")";
    std::printf("%-28s %-4s %-22s %12.0f %12.0f %12.0f %12.0f %10llu%s\n", r.what.c_str(),
                r.fits ? "yes" : "no", peak.c_str(), r.modeled_sps, r.device_sps, r.host_sps,
                r.cpu_sps, static_cast<unsigned long long>(r.host_bytes_per_step),
                r.complete ? "" : " (modeled time incomplete)");
  }
  std::printf("(verdicts use the modeled samples/s: the modeled IPU with the real loader)\n");
  const char* keys[] = {"journey_fp16_speedup", "journey_gradient_accumulation_speedup",
                        "journey_device_iterations_speedup", "journey_eight_bit_io_speedup",
                        "journey_async_loader_speedup"};
  bool in_order = true;
  for (std::size_t i = 1; i < rows.size(); ++i) {
    const double speedup = rows[i].modeled_sps / rows[i - 1].modeled_sps;
    std::printf("%s: %.3f\n", keys[i - 1], speedup);
    in_order = in_order && speedup >= 1.0;
  }
  std::printf("modeled_fp16_vs_fp32_speedup: %.3f (the IPU alone)\n",
              rows[1].device_sps / rows[0].device_sps);
  const bool ok = !rows[0].fits && rows[1].fits && rows.back().fits && in_order;
  std::printf("the journey %s: fp32 %s, fp16 %s, each step %s\n",
              ok ? "goes as the seed says" : "does NOT go as the seed says",
              rows[0].fits ? "fits (it should not)" : "runs out of memory",
              rows[1].fits ? "fits" : "does not fit",
              in_order ? "at least as fast as the one before" : "NOT always faster");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Settings st;
  CLI::App app{
      "The IPU hands-on journey in its order: fp32 runs out of memory; fp16, gradient "
      "accumulation, device iterations, 8-bit input and an asynchronous loader, each with its "
      "modeled and CPU samples/s"};
  app.add_option("--micro-batch", st.batch, "samples per micro-batch")->check(CLI::Range(1, 1024));
  app.add_option("--gradient-accumulation", st.gradient_accumulation,
                 "micro-batches per weight update from step 3")
      ->check(CLI::Range(1, 1024));
  app.add_option("--device-iterations", st.device_iterations, "steps per host call from step 4")
      ->check(CLI::Range(1, 1024));
  app.add_option("--bytes-per-tile", st.bytes_per_tile,
                 "memory per tile of the 1472-tile device (small: fp32 must not fit)")
      ->check(CLI::Range(std::size_t{bspflow::tunables::kArenaAlignment},
                         bspflow::tunables::kMaxBytesPerTile));
  app.add_option("--samples", st.samples, "samples trained per step of the journey")
      ->check(CLI::Range(1, 100'000'000));
  app.add_option("--loader-workers", st.workers, "the DataLoader's worker threads")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxLoaderWorkers));
  app.add_flag("--quiet", st.quiet, "shorter memory reports");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; an unknown or bad argument: 2
  }
  try {
    return run(st);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "t05_memory_journey: %s\n", e.what());
    return 1;
  }
}
