// Flagship benchmark: the t03_fashion_mnist_pipeline model and settings (4 stages, batch 40,
// gradient accumulation 10, 10 device iterations, AdamW) on synthetic images. Keys:
//
//   flagship_samples_per_s   training throughput pipelined over 4 emulated devices
//   flagship_vs_sequential   that over the same model trained in a plain single-threaded loop
//                            (the same stages' forward/backward/update called directly, same
//                            micro-batch order and accumulation; no runtime), same run;
//                            target >= 1.6 (issue 29)
//
// Prints `key: value`; --json FILE.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <random>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"
#include "model_kit.hpp"
#include "plain_training.hpp"

using namespace bspflow;

namespace {

constexpr std::size_t kBatch = 40;
constexpr std::uint32_t kAccumulation = 10;
constexpr std::uint64_t kIterations = 10;

std::vector<Batch> make_batches(std::size_t n) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pixel(0, 255), label(0, 9);
  std::vector<Batch> batches(n);
  for (Batch& b : batches) {
    b.data = Tensor(DType::kFloat32, {kBatch, 784});
    for (float& x : b.data.as<float>()) x = static_cast<float>(pixel(rng));
    for (std::size_t i = 0; i < kBatch; ++i) b.labels.push_back(label(rng));
    b.valid = kBatch;
  }
  return batches;
}

// The plain loop (bench::train_plainly): the same stages, micro-batches in the same order.
double sequential_rate(const std::vector<Batch>& batches, std::uint64_t steps) {
  StageList model = kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{});
  const double seconds = bench::train_plainly(
      model, steps, kAccumulation,
      [&](std::uint64_t m) -> const Batch& { return batches[m % batches.size()]; });
  return static_cast<double>(steps * kAccumulation * kBatch) / seconds;
}

double pipelined_rate(DeviceGroup& devices, const std::vector<Batch>& batches,
                      std::uint64_t calls) {
  PipelineConfig cfg;
  cfg.gradient_accumulation = kAccumulation;
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    return kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{});
  });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 2 * kIterations * kAccumulation, 2});
  std::uint64_t samples = 0;
  std::size_t m = 0;
  auto producer = infeed.make_producer();
  const auto t0 = bench::Clock::now();
  for (std::uint64_t c = 0; c < calls; ++c) {
    for (std::uint64_t i = 0; i < kIterations * kAccumulation; ++i, ++m)
      producer.push(Batch(batches[m % batches.size()]));
    const PipelineResult r = pipe.run(infeed, kIterations);
    if (!r.completed()) std::fprintf(stderr, "pipeline: %s\n", r.message.c_str());
    samples += kIterations * kAccumulation * kBatch;
  }
  return static_cast<double>(samples) / bench::seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flagship_bench: the flagship's training throughput against a plain loop"};
  bench::CommonArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  bench::Report report("flagship");
  const std::uint64_t calls = args.quick ? 2 : 15;  // 15 host calls = one Fashion-MNIST epoch
  const std::vector<Batch> batches = make_batches(200);
  DeviceGroup devices(4);
  const double seq = sequential_rate(batches, calls * kIterations);
  const double pip = pipelined_rate(devices, batches, calls);
  report.figure("sequential_samples_per_s", seq);
  report.figure("flagship_samples_per_s", pip);
  report.ratio("flagship_vs_sequential", pip / seq, ">= 1.6", pip / seq >= 1.6);
  return report.write(args.json_path) ? 0 : 1;
}
