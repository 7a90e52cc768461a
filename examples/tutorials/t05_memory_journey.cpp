// t05_memory_journey: the IPU hands-on session's out-of-memory journey in C++. The
// tutorial's conv net on Fashion-MNIST-shaped data, micro-batch 64, gradient accumulation
// 3, on devices with a small memory budget (--tiles x --bytes-per-tile). It starts on one
// device in fp32 and runs out of memory; each step then changes one thing — half
// precision, recomputation, optimiser state offloaded to the host, pipelining over more
// devices — prints the memory report, and (when the model fits) trains a few steps on
// synthetic data to measure samples per second. The run ends with a table: configuration,
// fits or not, peak memory per device, samples/s.
//
//   t05_memory_journey [--micro-batch 64] [--gradient-accumulation 3]
//       [--pipeline-accumulation 24] [--tiles 10] [--bytes-per-tile 614400] [--steps 6]
//       [--quiet]
//
// Exit status: 0 when the journey goes as it should (the first configuration does not fit
// and the last one does), 1 otherwise, 2 for bad arguments.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "model_kit.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::size_t batch = 64;
  std::uint32_t gradient_accumulation = 3;
  std::uint32_t pipeline_accumulation = 24;
  std::uint32_t tiles = 10;
  std::size_t bytes_per_tile = 600 * 1024;  // 5.9 MiB per device
  std::uint64_t steps = 6;
  bool quiet = false;
};

struct Step {
  std::string what;
  std::uint32_t stages = 1;
  bspflow::Precision precision;
  bool recompute = false;
  bool offload = false;
  std::uint32_t k = 0;  // gradient accumulation; 0: --gradient-accumulation
};

struct Row {
  std::string what;
  std::uint32_t devices = 1;
  std::uint32_t k = 1;
  bool fits = false;
  std::vector<std::size_t> peaks;
  std::size_t capacity = 0;
  double samples_per_s = 0;
};

// Synthetic micro-batches: random 28 x 28 uint8 images and labels, made once and reused.
std::vector<bspflow::Batch> synthetic_batches(std::size_t batch, std::size_t count) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> pixel(0, 255), label(0, 9);
  std::vector<bspflow::Batch> out(count);
  for (auto& b : out) {
    b.data = bspflow::Tensor(bspflow::DType::kUint8, {batch, 28, 28});
    for (auto& p : b.data.as<std::uint8_t>()) p = static_cast<std::uint8_t>(pixel(rng));
    b.labels.resize(batch);
    for (auto& l : b.labels) l = label(rng);
    b.indices.assign(batch, 0);
    b.valid = batch;
  }
  return out;
}

Row try_step(const Settings& st, const Step& step, const std::vector<bspflow::Batch>& data) {
  bspflow::PipelineConfig cfg;
  cfg.strategy = step.stages == 1 ? bspflow::ExecutionStrategy::kSingle
                                  : bspflow::ExecutionStrategy::kPipelined;
  cfg.precision = step.precision;
  cfg.recompute = step.recompute;
  cfg.offload_optimizer = step.offload;
  // Grouped pipelining needs 2N-1 micro-batches per step to fill; never fewer than asked.
  cfg.gradient_accumulation = std::max(step.k != 0 ? step.k : st.gradient_accumulation,
                                       cfg.min_gradient_accumulation(step.stages));
  Row row{step.what, cfg.devices_needed(step.stages), cfg.gradient_accumulation, false, {}, 0, 0};

  bspflow::DeviceConfig dc;
  dc.tiles = st.tiles;
  dc.bytes_per_tile = st.bytes_per_tile;
  bspflow::DeviceGroup devices(row.devices, dc);
  row.capacity = dc.memory_bytes();
  std::printf("\n== %s: %u device(s), micro-batch %zu, gradient accumulation %u ==\n",
              step.what.c_str(), row.devices, st.batch, row.k);
  kit::AdamW adamw;
  auto make = [&](std::uint32_t) {
    return kit::make_model(kit::Model::kConv, step.stages, st.batch, adamw);
  };
  std::unique_ptr<bspflow::Pipeline> pipe;
  try {
    pipe = std::make_unique<bspflow::Pipeline>(devices, cfg, make);
  } catch (const bspflow::PipelineOutOfMemoryError& e) {
    std::printf("out of memory:\n%s", e.report().to_string(st.quiet ? 3 : 6).c_str());
    for (const auto& d : e.report().devices) row.peaks.push_back(d.peak());
    return row;
  }
  row.fits = true;
  for (const auto& d : pipe->memory().devices) row.peaks.push_back(d.peak());
  std::printf("fits:\n%s", pipe->memory().to_string(st.quiet ? 3 : 6).c_str());

  // Train: one step to warm up, then `steps` timed steps in one host call.
  const std::uint64_t per_step = row.k;
  bspflow::InfeedQueue<bspflow::Batch> infeed(
      bspflow::InfeedConfig{1, (st.steps + 1) * per_step, 2});
  {
    auto producer = infeed.make_producer();
    for (std::uint64_t m = 0; m < (st.steps + 1) * per_step; ++m)
      producer.push(data[m % data.size()]);
  }
  infeed.close();
  const bspflow::PipelineResult warm = pipe->run(infeed, 1);
  const auto t0 = Clock::now();
  const bspflow::PipelineResult r = pipe->run(infeed, st.steps);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!warm.completed() || !r.completed()) {
    std::printf("training stopped: %s\n", (warm.completed() ? r : warm).message.c_str());
    row.fits = false;
    return row;
  }
  row.samples_per_s = static_cast<double>(st.steps * per_step * st.batch) / seconds;
  std::printf("trained %llu steps: %.0f samples/s\n", static_cast<unsigned long long>(st.steps),
              row.samples_per_s);
  return row;
}

int run(const Settings& st) {
  // Each step changes one thing. Pipelining also raises the gradient accumulation to
  // --pipeline-accumulation: Grouped fills and drains over 2(N-1) cycles per step, so a
  // step of 24 micro-batches over 4 stages idles a fifth of the time, and one of 3 could
  // not run at all (it needs 2N-1 = 7).
  const bspflow::Precision half = bspflow::Precision::half();
  const std::vector<Step> journey = {
      {"fp32 on one device", 1, {}, false, false, 0},
      {"fp16 storage", 1, half, false, false, 0},
      {"fp16 + optimiser state offloaded", 1, half, false, true, 0},
      {"fp16, pipelined over 4 devices", 4, half, false, false, st.pipeline_accumulation},
      {"fp16 + recomputation, pipelined over 4 devices", 4, half, true, false,
       st.pipeline_accumulation},
  };
  const std::vector<bspflow::Batch> data = synthetic_batches(st.batch, 16);
  std::vector<Row> rows;
  for (const Step& step : journey) rows.push_back(try_step(st, step, data));

  std::printf("\n%-50s %4s %3s %-5s %-36s %10s\n", "configuration", "devs", "K", "fits",
              "peak per device (of capacity)", "samples/s");
  double best = 0;
  for (const Row& r : rows) best = std::max(best, r.samples_per_s);
  for (const Row& r : rows) {
    std::string peaks;
    for (std::size_t d = 0; d < r.peaks.size(); ++d)
      peaks += (d ? " " : "") + bspflow::format_bytes(r.peaks[d]);
    peaks += " (" + bspflow::format_bytes(r.capacity) + ")";
    char rate[32] = "-";
    if (r.fits) std::snprintf(rate, sizeof rate, "%.0f", r.samples_per_s);
    std::printf("%-50s %4u %3u %-5s %-36s %10s\n", r.what.c_str(), r.devices, r.k,
                r.fits ? "yes" : "no", peaks.c_str(), rate);
  }
  const bool last_fastest = rows.back().fits && rows.back().samples_per_s >= best;
  std::printf("the last configuration %s and is %sthe fastest\n",
              rows.back().fits ? "fits" : "does NOT fit", last_fastest ? "" : "not ");
  return !rows.front().fits && rows.back().fits ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Settings st;
  CLI::App app{
      "The hands-on out-of-memory journey: fp32 does not fit; half precision, recomputation, "
      "offloading "
      "and pipelining until it fits and runs fast"};
  app.add_option("--micro-batch", st.batch, "samples per micro-batch")->check(CLI::Range(1, 4096));
  app.add_option("--gradient-accumulation", st.gradient_accumulation,
                 "micro-batches per weight update (at least)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--pipeline-accumulation", st.pipeline_accumulation,
                 "micro-batches per weight update once pipelined")
      ->check(CLI::Range(1, 1024));
  app.add_option("--tiles", st.tiles, "tiles per device")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxTiles));
  app.add_option("--bytes-per-tile", st.bytes_per_tile, "bytes of memory per tile")
      ->check(CLI::Range(std::size_t{bspflow::tunables::kArenaAlignment},
                         bspflow::tunables::kMaxBytesPerTile));
  app.add_option("--steps", st.steps, "timed training steps per configuration")
      ->check(CLI::Range(1, 100000));
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
