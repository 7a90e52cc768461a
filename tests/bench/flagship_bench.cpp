// Flagship benchmark: the t03_fashion_mnist_pipeline model and settings (4 stages, batch 40,
// gradient accumulation 10, 10 device iterations, AdamW) on synthetic images. Keys:
//
//   flagship_samples_per_s   training throughput pipelined over 4 emulated devices
//   flagship_vs_sequential   that over the same model trained in a plain single-threaded loop
//                            (the same stages' forward/backward/update called directly, same
//                            micro-batch order and accumulation; no runtime), same run;
//                            target >= 1.6 (issue 29)
//
// Where the devices' time goes (issue 29, item 3), from a separate traced run of the same
// pipeline after the timed one (so tracing never touches the throughput keys), summed over
// its host calls, per device d (figures, no targets):
//   flagship_device<d>_compute_share    share of the device's time in compute sets
//                                       (its utilisation, as t03 prints it)
//   flagship_device<d>_sync_share       waiting at the syncs of the pipeline's cycles
//   flagship_device<d>_handoff_share    exchanges: activations and gradients to and from
//                                       the neighbouring stages, and the all-reduce
//   flagship_device<d>_host_link_share  stream copies: micro-batches in, losses out
//   flagship_device<d>_idle_share       everything else (between the host's calls)
//   flagship_compute_share_mean         the mean of the compute shares
//
// Prints `key: value`; --json FILE.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <random>
#include <string>
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

// `calls` host calls of the pipelined training (traced with `trace`), each after pushing its
// micro-batches; after_call(pipe) runs after each call. Returns the seconds the calls took.
template <class AfterCall>
double train_calls(DeviceGroup& devices, const std::vector<Batch>& batches, std::uint64_t calls,
                   bool trace, AfterCall&& after_call) {
  PipelineConfig cfg;
  cfg.gradient_accumulation = kAccumulation;
  cfg.trace = trace;
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    return kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{});
  });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 2 * kIterations * kAccumulation, 2});
  std::size_t m = 0;
  auto producer = infeed.make_producer();
  const auto t0 = bench::Clock::now();
  for (std::uint64_t c = 0; c < calls; ++c) {
    for (std::uint64_t i = 0; i < kIterations * kAccumulation; ++i, ++m)
      producer.push(Batch(batches[m % batches.size()]));
    const PipelineResult r = pipe.run(infeed, kIterations);
    if (!r.completed()) std::fprintf(stderr, "pipeline: %s\n", r.message.c_str());
    after_call(pipe);
  }
  return bench::seconds_since(t0);
}

double pipelined_rate(DeviceGroup& devices, const std::vector<Batch>& batches,
                      std::uint64_t calls) {
  const double seconds = train_calls(devices, batches, calls, false, [](const Pipeline&) {});
  return static_cast<double>(calls * kIterations * kAccumulation * kBatch) / seconds;
}

// Per device, nanoseconds by phase over `calls` traced host calls of the pipelined training.
struct Shares {
  std::vector<std::array<std::int64_t, kPhaseCount>> ns;
  std::vector<std::int64_t> total;
};

Shares traced_shares(DeviceGroup& devices, const std::vector<Batch>& batches, std::uint64_t calls) {
  Shares out;
  train_calls(devices, batches, calls, true, [&](const Pipeline& pipe) {
    if (pipe.trace() == nullptr) return;
    std::size_t d = 0;
    for (const TrackSummary& t : pipe.trace()->summary().tracks) {
      if (t.kind != TraceTrack::Kind::kDevice) continue;
      if (out.ns.size() <= d) {
        out.ns.emplace_back();
        out.total.push_back(0);
      }
      for (std::size_t p = 0; p < kPhaseCount; ++p) out.ns[d][p] += t.ns[p];
      out.total[d] += t.total_ns;
      ++d;
    }
  });
  return out;
}

void report_shares(bench::Report& report, const Shares& sh) {
  if (sh.ns.empty()) {
    std::fprintf(stderr, "traced pipeline: no device tracks\n");
    return;
  }
  auto at = [](const std::array<std::int64_t, kPhaseCount>& a, Phase p) {
    return static_cast<double>(a[static_cast<std::size_t>(p)]);
  };
  double compute_sum = 0;
  for (std::size_t d = 0; d < sh.ns.size(); ++d) {
    const auto& a = sh.ns[d];
    const double total = static_cast<double>(std::max<std::int64_t>(sh.total[d], 1));
    const double compute = at(a, Phase::kCompute) / total;
    const double sync = at(a, Phase::kSync) / total;
    const double handoff = at(a, Phase::kExchange) / total;
    const double link = (at(a, Phase::kStreamCopyBegin) + at(a, Phase::kStreamCopyMid) +
                         at(a, Phase::kStreamCopyEnd)) /
                        total;
    const std::string key = "flagship_device" + std::to_string(d) + "_";
    report.figure(key + "compute_share", compute);
    report.figure(key + "sync_share", sync);
    report.figure(key + "handoff_share", handoff);
    report.figure(key + "host_link_share", link);
    report.figure(key + "idle_share", std::max(0.0, 1.0 - compute - sync - handoff - link));
    compute_sum += compute;
  }
  report.figure("flagship_compute_share_mean", compute_sum / static_cast<double>(sh.ns.size()));
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
  report_shares(report, traced_shares(devices, batches, args.quick ? 1 : 3));
  return report.write(args.json_path) ? 0 : 1;
}
