// Pipeline benchmark. Keys:
//
//   pipeline_bsp_1us_vs_ideal, pipeline_bsp_10us_vs_ideal
//                       2 balanced stages (1 us / 10 us of work per micro-batch each) on 2
//                       pinned devices, bsp sync: micro-batches per second x stage time
//                       (the ideal is one micro-batch per stage time)  targets >= 0.8 / 0.97
//   pipeline_dataflow_1us_vs_ideal  the same with dataflow sync                target >= 0.9
//   pipeline_dataflow_1us_vs_tbb    dataflow throughput over oneTBB parallel_pipeline with the
//                       same two serial stages on 2 threads, same run      target >= 1.2
//   bubble_vs_model     one forward-only step of K = 16 micro-batches over 2 stages of 100 us:
//                       step time over (K + N - 1) x stage time            target 0.95..1.05
//
// The stages are inference stages (forward passes only), the device link costs nothing
// (LinkModel with no latency), and the infeed is filled before the clock starts, so the
// figures measure the runtime's scheduling, not the link model or the host.
// Every ratio's reference is measured in the same run. Prints `key: value`; --json FILE.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#if BSPFLOW_HAVE_TBB
#include <tbb/global_control.h>
#include <tbb/parallel_pipeline.h>
#endif

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

using namespace bspflow;
using bench::Clock;

namespace {

// Burns `ns` of CPU (the same work for every contender).
void work_for(std::chrono::nanoseconds ns) {
  const auto until = Clock::now() + ns;
  while (Clock::now() < until) {
  }
}

class BusyStage final : public Stage {
 public:
  explicit BusyStage(std::chrono::nanoseconds work) : work_(work) {}
  std::string name() const override { return "busy"; }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    work_for(work_);
    a.output[0] = a.input.empty() ? 1.0f : a.input[0] + 1.0f;
  }

 private:
  std::chrono::nanoseconds work_;
};

LinkModel free_link() { return LinkModel{1e15, std::chrono::nanoseconds{0}}; }

// Micro-batches per second through 2 balanced stages, `micro_batches` in one run.
double pipeline_rate(DeviceGroup& devices, SyncMode sync, std::chrono::nanoseconds work,
                     std::uint64_t micro_batches, std::uint32_t k = 64) {
  PipelineConfig cfg;
  cfg.training = false;
  cfg.sync = sync;
  cfg.gradient_accumulation = k;
  cfg.device_link = free_link();
  Pipeline pipe(devices, cfg, [work](std::uint32_t) {
    StageList l;
    l.push_back(std::make_unique<BusyStage>(work));
    l.push_back(std::make_unique<BusyStage>(work));
    return l;
  });
  const std::uint64_t steps = micro_batches / k;
  InfeedQueue<Batch> infeed(InfeedConfig{1, steps * k, 4});
  {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < steps * k; ++i) p.push(Batch{});
  }
  const PipelineResult r = pipe.run(infeed, steps);
  if (!r.completed()) std::fprintf(stderr, "pipeline run: %s\n", r.message.c_str());
  return static_cast<double>(steps * k) / std::chrono::duration<double>(r.elapsed).count();
}

#if BSPFLOW_HAVE_TBB
double tbb_rate(std::chrono::nanoseconds work, std::uint64_t micro_batches) {
  tbb::global_control threads(tbb::global_control::max_allowed_parallelism, 2);
  std::uint64_t produced = 0;
  float sink = 0;
  const auto t0 = Clock::now();
  tbb::parallel_pipeline(
      4,
      tbb::make_filter<void, float>(tbb::filter_mode::serial_in_order,
                                    [&](tbb::flow_control& fc) -> float {
                                      if (produced == micro_batches) {
                                        fc.stop();
                                        return 0.0f;
                                      }
                                      ++produced;
                                      work_for(work);
                                      return 1.0f;
                                    }) &
          tbb::make_filter<float, void>(tbb::filter_mode::serial_in_order, [&](float x) {
            work_for(work);
            sink += x + 1.0f;
          }));
  const double s = bench::seconds_since(t0);
  if (sink != 2.0f * static_cast<float>(micro_batches)) std::fprintf(stderr, "tbb pipeline lost items\n");
  return static_cast<double>(micro_batches) / s;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipeline_bench: pipelined stages against the ideal and oneTBB"};
  bench::CommonArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  bench::Report report("pipeline");
  const std::uint64_t scale = args.quick ? 10 : 1;
  DeviceGroup devices(2);
  using namespace std::chrono_literals;

  auto best_of = [](int n, auto&& f) {
    double best = 0;
    for (int i = 0; i < n; ++i) best = std::max(best, f());
    return best;
  };
  const int reps = args.quick ? 1 : 3;
  {
    const double r1 = best_of(reps, [&] { return pipeline_rate(devices, SyncMode::kBsp, 1us, 200'000 / scale); });
    const double v1 = r1 * 1e-6;
    report.figure("pipeline_bsp_1us_per_s", r1);
    report.ratio("pipeline_bsp_1us_vs_ideal", v1, ">= 0.8", v1 >= 0.8);
    const double r10 = best_of(reps, [&] { return pipeline_rate(devices, SyncMode::kBsp, 10us, 40'000 / scale); });
    const double v10 = r10 * 1e-5;
    report.figure("pipeline_bsp_10us_per_s", r10);
    report.ratio("pipeline_bsp_10us_vs_ideal", v10, ">= 0.97", v10 >= 0.97);
  }
  {
    const double rd = best_of(reps, [&] { return pipeline_rate(devices, SyncMode::kDataflow, 1us, 200'000 / scale); });
    const double vd = rd * 1e-6;
    report.figure("pipeline_dataflow_1us_per_s", rd);
    report.ratio("pipeline_dataflow_1us_vs_ideal", vd, ">= 0.9", vd >= 0.9);
#if BSPFLOW_HAVE_TBB
    const double rt = best_of(reps, [&] { return tbb_rate(1us, 200'000 / scale); });
    report.figure("tbb_parallel_pipeline_1us_per_s", rt);
    report.ratio("pipeline_dataflow_1us_vs_tbb", rd / rt, ">= 1.2", rd / rt >= 1.2);
#else
    report.note("pipeline_dataflow_1us_vs_tbb", "skipped (built without oneTBB: apt-get install libtbb-dev)");
#endif
  }
  {
    // One step of K micro-batches, forward only: (K + N - 1) cycles of the stage time.
    const std::uint32_t k = 16, n = 2;
    const auto stage = 100us;
    std::vector<double> ratios;
    for (int i = 0; i < (args.quick ? 2 : 7); ++i) {
      const double rate = pipeline_rate(devices, SyncMode::kBsp, stage, k, k);
      const double step = static_cast<double>(k) / rate;
      ratios.push_back(step / ((k + n - 1) * std::chrono::duration<double>(stage).count()));
    }
    const double b = bench::median(ratios);
    report.ratio("bubble_vs_model", b, "0.95..1.05", b >= 0.95 && b <= 1.05);
  }
  return report.write(args.json_path) ? 0 : 1;
}
