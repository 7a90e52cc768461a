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
//                       step time on the devices (first pass begins to last pass ends, from
//                       the trace) over (K + N - 1) x stage time           target 0.95..1.05
//   bubble_host_call_vs_model  the same step timed as the host call (waking the devices and
//                       being woken at the end included)
//   pipeline_io_overlap_vs_max  2 inference stages of 200 us, K = 64, the host link taking
//                       200 us per micro-batch, 2 I/O tiles, prefetch 2: the run's time over
//                       the larger of compute only (the same run with synthetic data) and
//                       I/O only (K x 200 us)                                target <= 1.1
//   pipeline_io_serial_vs_sum  the same without I/O tiles, over compute only + I/O only
//                       (stage 0 waits for each copy)                        target 0.95..1.05
//   allreduce_model_error_p50  2 replicas of a 1-stage training pipeline (2 devices), 1 MB
//                       of gradients each, the default device link (32 GB/s, 1 us): every
//                       step's all-reduce exchange from the trace against its modeled ring
//                       time (LinkModel::ring_allreduce), |measured - modeled| / modeled,
//                       median over the steps                             target <= 0.05
//
// The machine's floor, measured in the same run, interleaved with the pipeline runs (this
// VM's speed drifts by 20-30% over minutes, so a reference from another time misleads):
//   bsp_floor_1us_vs_ideal, bsp_floor_10us_vs_ideal  two threads placed like the devices, each
//                       doing the same busy work then meeting at the cheapest barrier there is
//                       (one atomic word, pure spinning): no runtime at all
//   dataflow_floor_1us_vs_ideal  the same two threads joined by a bare 64-slot SPSC ring
//   pipeline_bsp_1us_vs_floor, pipeline_bsp_10us_vs_floor, pipeline_dataflow_1us_vs_floor
//                       the pipeline over its floor: the share of the attainable it gets
//                       (targets >= 0.95 bsp 1 us, >= 0.98 dataflow 1 us; 10 us: none)
//   bsp_exchange_floor_1us_vs_floor  the bsp floor that also moves one activation (one
//                       cache line, thread 0 to thread 1) per cycle, over the bare floor:
//                       what the least exchange a pipeline has costs on this machine
//   pipeline_bsp_1us_vs_exchange_floor  the pipeline over that floor (figures, no targets)
//   bsp_take_floor_1us_vs_floor, dataflow_take_floor_1us_vs_floor  the exchange floor (bsp)
//                       and the SPSC floor (dataflow) where thread 0 also takes each cycle's
//                       micro-batch off an infeed built and filled as the pipeline's is
//                       (Reader::try_pop into a ring of 64 Batches): what reading the input
//                       and moving one activation cost together, with no runtime around
//                       them, over the bare floor. A pipeline's stage 0 must do both, so this
//                       is the most any runtime on this infeed can get of the bare floor
//   pipeline_bsp_1us_vs_take_floor, pipeline_dataflow_1us_vs_take_floor  the pipeline over
//                       that floor (figures, no targets)
//
// The stages are inference stages (forward passes only), the device and host links cost
// nothing (LinkModel with no latency) except in the pipeline_io keys, and the infeed is
// filled before the clock starts, so the figures measure the runtime's scheduling, not the
// link model or the host.
// Every ratio's reference is measured in the same run. Prints `key: value`; --json FILE.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
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

using bench::spin_for;

class BusyStage final : public Stage {
 public:
  explicit BusyStage(std::chrono::nanoseconds work) : work_(work) {}
  std::string name() const override { return "busy"; }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    spin_for(work_);
    a.output[0] = a.input.empty() ? 1.0f : a.input[0] + 1.0f;
  }

 private:
  std::chrono::nanoseconds work_;
};

LinkModel free_link() {
  return LinkModel{1e15, std::chrono::nanoseconds{0}};
}

// Two balanced stages of `work` each.
StageFactory two_busy_stages(std::chrono::nanoseconds work) {
  return [work](std::uint32_t) {
    StageList l;
    l.push_back(std::make_unique<BusyStage>(work));
    l.push_back(std::make_unique<BusyStage>(work));
    return l;
  };
}

// A trainable stage with `gradients` parameters whose passes do nearly nothing: what the
// all-reduce benchmark moves.
class GradientStage final : public Stage {
 public:
  explicit GradientStage(std::size_t gradients) : gradients_(gradients) {}
  std::string name() const override { return "grads"; }
  std::size_t output_elements() const override { return 1; }
  std::size_t gradient_elements() const override { return gradients_; }
  void forward(const StageContext&, ForwardArgs& a) override { a.output[0] = 1.0f; }
  void backward(const StageContext&, BackwardArgs& a) override { a.gradients[0] = 1.0f; }

 private:
  std::size_t gradients_;
};

constexpr std::size_t kGradients = 256 * 1024;  // 1 MB of fp32 per replica

// Each traced all-reduce's |measured - modeled| / modeled, over `steps` steps.
std::vector<double> allreduce_errors(DeviceGroup& devices, std::uint64_t steps) {
  PipelineConfig cfg;
  cfg.replicas = 2;
  cfg.gradient_accumulation = 1;
  cfg.trace = true;
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    StageList l;
    l.push_back(std::make_unique<GradientStage>(kGradients));
    return l;
  });
  InfeedQueue<Batch> infeed(InfeedConfig{2, steps, 1});
  {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < steps; ++i) {
      p.push_to(0, Batch{});
      p.push_to(1, Batch{});
    }
  }
  const PipelineResult r = pipe.run(infeed, steps);
  if (!r.completed()) std::fprintf(stderr, "all-reduce run: %s\n", r.message.c_str());
  const double modeled = static_cast<double>(
      cfg.device_link.ring_allreduce(kGradients * sizeof(float), cfg.replicas).count());
  std::vector<double> errors;
  for (const TraceTrack& t : pipe.trace()->tracks()) {
    for (const TraceEvent& e : t.events()) {
      if (e.phase != Phase::kExchange || t.label(e) != "all-reduce") continue;
      errors.push_back(std::abs(static_cast<double>(e.end_ns - e.begin_ns) - modeled) / modeled);
    }
  }
  if (errors.size() != steps * cfg.replicas) {
    std::fprintf(stderr, "all-reduce: %zu traced, expected %llu\n", errors.size(),
                 static_cast<unsigned long long>(steps * cfg.replicas));
  }
  return errors;
}

// The take a pipeline's stage 0 makes, alone: an infeed built and filled as pipeline_time's
// is (one lane, prefetch depth 4, every micro-batch pushed before the clock starts), read
// with Reader::try_pop into a ring of 64 Batches (the micro-batch ring of K = 64). The floors
// without a take build none (see bsp_floor_rate).
class TakeFloor {
 public:
  explicit TakeFloor(std::uint64_t n)
      : infeed_(InfeedConfig{1, std::max<std::uint64_t>(n, 4), 4}), reader_(infeed_.reader(0)),
        ring_(64) {
    auto p = infeed_.make_producer();
    for (std::uint64_t i = 0; i < n; ++i) p.push(Batch{});
  }
  void take(std::uint64_t i) {
    if (!reader_.try_pop(ring_[i % ring_.size()])) ++missed_;
  }
  void check(const char* floor) const {
    if (missed_ != 0)
      std::fprintf(stderr, "%s: %llu takes found the infeed empty\n", floor,
                   static_cast<unsigned long long>(missed_));
  }

 private:
  InfeedQueue<Batch> infeed_;
  InfeedQueue<Batch>::Reader reader_;
  std::vector<Batch> ring_;
  std::uint64_t missed_ = 0;
};

// Cycles per second of the bsp floor: busy work, then a barrier of one atomic word. With
// kExchange, each cycle thread 0 also writes one activation (a float, in a cache line of its
// own, by cycle parity as the pipeline's exchange buffers are) before the barrier, which
// thread 1 reads after it: the least any bsp runtime moves between two stages, one line from
// one core to the other per cycle on top of the barrier's own. (A template parameter, so the
// bare floor's loop stays bare.)
template <bool kExchange = false, bool kTake = false>
double bsp_floor_rate(std::chrono::nanoseconds work, std::uint64_t cycles) {
  struct alignas(64) Activation {
    float value = 0;
  };
  alignas(64) std::atomic<std::uint64_t> arrivals{0};
  Activation out[2];
  std::uint64_t wrong = 0;        // activations thread 1 read from the wrong cycle
  std::optional<TakeFloor> take;  // only with kTake: the bare floors build no infeed
  if constexpr (kTake) take.emplace(cycles);
  const double s = bench::on_placed_threads(2, [&](std::uint32_t side) {
    for (std::uint64_t c = 0; c < cycles; ++c) {
      if constexpr (kTake) {
        if (side == 0) take->take(c);
      }
      spin_for(work);
      if constexpr (kExchange) {
        if (side == 0) out[c % 2].value = static_cast<float>(c);
      }
      const std::uint64_t round_end = 2 * (c + 1);
      arrivals.fetch_add(1);
      while (arrivals.load(std::memory_order_acquire) < round_end) detail::cpu_relax();
      if constexpr (kExchange) {
        if (side == 1 && out[c % 2].value != static_cast<float>(c)) ++wrong;  // exact < 2^24
      }
    }
  });
  if (wrong != 0)
    std::fprintf(stderr, "bsp exchange floor: %llu wrong activations\n",
                 static_cast<unsigned long long>(wrong));
  if (take) take->check("bsp take floor");
  return static_cast<double>(cycles) / s;
}

// Items per second of the dataflow floor: busy work on both sides of a bare SPSC ring.
// kTake: thread 0 first takes each item's micro-batch off an infeed (see TakeFloor).
template <bool kTake = false>
double dataflow_floor_rate(std::chrono::nanoseconds work, std::uint64_t items) {
  constexpr std::uint64_t kSlots = 64;
  alignas(64) std::atomic<std::uint64_t> head{0};
  alignas(64) std::atomic<std::uint64_t> tail{0};
  std::vector<float> ring(kSlots);
  float sink = 0;
  std::optional<TakeFloor> take;  // only with kTake
  if constexpr (kTake) take.emplace(items);
  const double s = bench::on_placed_threads(2, [&](std::uint32_t side) {
    for (std::uint64_t i = 0; i < items; ++i) {
      if (side == 0) {
        if constexpr (kTake) take->take(i);
        spin_for(work);
        while (i - head.load(std::memory_order_acquire) >= kSlots) detail::cpu_relax();
        ring[i % kSlots] = 1.0f;
        tail.store(i + 1, std::memory_order_release);
      } else {
        while (tail.load(std::memory_order_acquire) <= i) detail::cpu_relax();
        sink += ring[i % kSlots];
        head.store(i + 1, std::memory_order_release);
        spin_for(work);
      }
    }
  });
  if (sink != static_cast<float>(items)) std::fprintf(stderr, "dataflow floor lost items\n");
  if (take) take->check("dataflow take floor");
  return static_cast<double>(items) / s;
}

struct Timing {
  std::uint64_t micro_batches = 0;  // through the last stage
  double host_call = 0;             // seconds: the host call
  double on_devices = 0;  // seconds: first pass begins to last pass ends (traced runs only)
};

// One run of `micro_batches` through 2 balanced stages.
Timing pipeline_time(DeviceGroup& devices, SyncMode sync, std::chrono::nanoseconds work,
                     std::uint64_t micro_batches, std::uint32_t k = 64, bool trace = false) {
  PipelineConfig cfg;
  cfg.training = false;
  cfg.sync = sync;
  cfg.gradient_accumulation = k;
  cfg.device_link = free_link();
  cfg.host_link = free_link();  // these figures measure scheduling, not the link model
  cfg.trace = trace;
  Pipeline pipe(devices, cfg, two_busy_stages(work));
  const std::uint64_t steps = micro_batches / k;
  InfeedQueue<Batch> infeed(InfeedConfig{1, steps * k, 4});
  {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < steps * k; ++i) p.push(Batch{});
  }
  const PipelineResult r = pipe.run(infeed, steps);
  if (!r.completed()) std::fprintf(stderr, "pipeline run: %s\n", r.message.c_str());
  Timing t;
  t.micro_batches = r.micro_batches;
  t.host_call = std::chrono::duration<double>(r.elapsed).count();
  if (trace && pipe.trace() != nullptr) {
    std::int64_t first = INT64_MAX, last = 0;
    for (const TraceTrack& track : pipe.trace()->tracks()) {
      if (track.kind() != TraceTrack::Kind::kDevice || track.events().empty()) continue;
      first = std::min(first, track.events().front().begin_ns);
      last = std::max(last, track.events().back().end_ns);
    }
    t.on_devices = static_cast<double>(last - first) * 1e-9;
  }
  return t;
}

// Micro-batches per second through 2 balanced stages, `micro_batches` in one run.
double pipeline_rate(DeviceGroup& devices, SyncMode sync, std::chrono::nanoseconds work,
                     std::uint64_t micro_batches, std::uint32_t k = 64) {
  const Timing t = pipeline_time(devices, sync, work, micro_batches, k);
  return static_cast<double>(t.micro_batches) / t.host_call;
}

// Seconds for `k` micro-batches of `bytes` (data) through 2 inference stages of `work`
// each, the host link taking `work` per micro-batch: with `io_tiles` (overlapped), without
// (serial), or with synthetic data (no copies: the compute-only reference).
double io_time(DeviceGroup& devices, std::chrono::nanoseconds work, std::uint32_t k,
               std::uint32_t io_tiles, bool synthetic) {
  constexpr std::size_t kValues = 1024;
  const std::size_t bytes = kValues * sizeof(float) + sizeof(std::int32_t);  // data and one label
  PipelineConfig cfg;
  cfg.training = false;
  cfg.gradient_accumulation = k;
  cfg.device_link = free_link();
  cfg.host_link = LinkModel::taking(work, bytes);
  cfg.io_tiles = io_tiles;
  cfg.prefetch_depth = 2;
  cfg.synthetic_data = synthetic;
  Pipeline pipe(devices, cfg, two_busy_stages(work));
  InfeedQueue<Batch> infeed(InfeedConfig{1, k, 4});
  {
    auto p = infeed.make_producer();
    for (std::uint32_t i = 0; i < k; ++i) {
      Batch b;
      b.data = Tensor(DType::kFloat32, {kValues});
      b.labels.assign(1, 0);
      b.indices.assign(1, i);
      b.valid = 1;
      p.push(std::move(b));
    }
  }
  const PipelineResult r = pipe.run(infeed, 1);
  if (!r.completed()) std::fprintf(stderr, "pipeline run: %s\n", r.message.c_str());
  return std::chrono::duration<double>(r.elapsed).count();
}

#if BSPFLOW_HAVE_TBB
double tbb_rate(std::chrono::nanoseconds work, std::uint64_t micro_batches) {
  tbb::global_control threads(tbb::global_control::max_allowed_parallelism, 2);
  std::uint64_t produced = 0;
  float sink = 0;
  const auto t0 = Clock::now();
  tbb::parallel_pipeline(
      4, tbb::make_filter<void, float>(tbb::filter_mode::serial_in_order,
                                       [&](tbb::flow_control& fc) -> float {
                                         if (produced == micro_batches) {
                                           fc.stop();
                                           return 0.0f;
                                         }
                                         ++produced;
                                         spin_for(work);
                                         return 1.0f;
                                       }) &
             tbb::make_filter<float, void>(tbb::filter_mode::serial_in_order, [&](float x) {
               spin_for(work);
               sink += x + 1.0f;
             }));
  const double s = bench::seconds_since(t0);
  if (sink != 2.0f * static_cast<float>(micro_batches))
    std::fprintf(stderr, "tbb pipeline lost items\n");
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

  const int reps = args.quick ? 1 : 3;
  // Best of `reps` for the pipeline and its floor, alternating so both see the same machine.
  auto paired = [&](auto&& pipeline, auto&& floor) {
    double best_p = 0, best_f = 0;
    for (int i = 0; i < reps; ++i) {
      best_f = std::max(best_f, floor());
      best_p = std::max(best_p, pipeline());
    }
    return std::pair{best_p, best_f};
  };
  // The floor targets (>= 0.95 bsp 1 us, >= 0.98 dataflow 1 us); none without
  // floor_target.
  auto report_against = [&](const char* name, double per_s, double floor_per_s, double stage_s,
                            const char* target, double target_value, const char* floor_key,
                            const char* floor_target = nullptr, double floor_target_value = 0.0) {
    const double v = per_s * stage_s, f = floor_per_s * stage_s;
    report.figure(std::string(name) + "_per_s", per_s);
    report.ratio(std::string(name) + "_vs_ideal", v, target, v >= target_value);
    report.figure(floor_key, f);
    if (floor_target != nullptr) {
      report.ratio(std::string(name) + "_vs_floor", v / f, floor_target,
                   v / f >= floor_target_value);
    } else {
      report.figure(std::string(name) + "_vs_floor", v / f);
    }
  };
  {
    double p1 = 0, f1 = 0, x1 = 0, t1 = 0;  // best of reps each, alternating (see paired)
    for (int i = 0; i < reps; ++i) {
      f1 = std::max(f1, bsp_floor_rate(1us, 200'000 / scale));
      x1 = std::max(x1, bsp_floor_rate<true>(1us, 200'000 / scale));
      t1 = std::max(t1, bsp_floor_rate<true, true>(1us, 200'000 / scale));
      p1 = std::max(p1, pipeline_rate(devices, SyncMode::kBsp, 1us, 200'000 / scale));
    }
    report_against("pipeline_bsp_1us", p1, f1, 1e-6, ">= 0.8", 0.8, "bsp_floor_1us_vs_ideal",
                   ">= 0.95", 0.95);
    report.figure("bsp_exchange_floor_1us_vs_floor", x1 / f1);
    report.figure("pipeline_bsp_1us_vs_exchange_floor", p1 / x1);
    report.figure("bsp_take_floor_1us_vs_floor", t1 / f1);
    report.figure("pipeline_bsp_1us_vs_take_floor", p1 / t1);
    const auto [p10, f10] =
        paired([&] { return pipeline_rate(devices, SyncMode::kBsp, 10us, 40'000 / scale); },
               [&] { return bsp_floor_rate(10us, 40'000 / scale); });
    report_against("pipeline_bsp_10us", p10, f10, 1e-5, ">= 0.97", 0.97, "bsp_floor_10us_vs_ideal");
  }
  {
    double pd = 0, fd = 0, td = 0;  // best of reps each, alternating (see paired)
    for (int i = 0; i < reps; ++i) {
      fd = std::max(fd, dataflow_floor_rate(1us, 200'000 / scale));
      td = std::max(td, dataflow_floor_rate<true>(1us, 200'000 / scale));
      pd = std::max(pd, pipeline_rate(devices, SyncMode::kDataflow, 1us, 200'000 / scale));
    }
    report_against("pipeline_dataflow_1us", pd, fd, 1e-6, ">= 0.9", 0.9,
                   "dataflow_floor_1us_vs_ideal", ">= 0.98", 0.98);
    report.figure("dataflow_take_floor_1us_vs_floor", td / fd);
    report.figure("pipeline_dataflow_1us_vs_take_floor", pd / td);
#if BSPFLOW_HAVE_TBB
    double rt = 0;
    for (int i = 0; i < reps; ++i) rt = std::max(rt, tbb_rate(1us, 200'000 / scale));
    report.figure("tbb_parallel_pipeline_1us_per_s", rt);
    report.ratio("pipeline_dataflow_1us_vs_tbb", pd / rt, ">= 1.2", pd / rt >= 1.2);
#else
    report.note("pipeline_dataflow_1us_vs_tbb",
                "skipped (built without oneTBB: apt-get install libtbb-dev)");
#endif
  }
  {
    // One step of K micro-batches, forward only: (K + N - 1) cycles of the stage time.
    const std::uint32_t k = 16, n = 2;
    const auto stage = 100us;
    const double model = (k + n - 1) * std::chrono::duration<double>(stage).count();
    std::vector<double> on_devices, host_call;
    for (int i = 0; i < (args.quick ? 2 : 7); ++i) {
      const Timing t = pipeline_time(devices, SyncMode::kBsp, stage, k, k, /*trace=*/true);
      on_devices.push_back(t.on_devices / model);
      host_call.push_back(t.host_call / model);
    }
    const double b = bench::median(on_devices);
    report.ratio("bubble_vs_model", b, "0.95..1.05", b >= 0.95 && b <= 1.05);
    report.figure("bubble_host_call_vs_model", bench::median(host_call));
  }
  {
    // The host link against compute: 2 stages of 200 us, K = 64, each micro-batch's copy
    // modeled at 200 us. Medians of paired runs (synthetic, overlapped, serial).
    const auto work = 200us;
    const std::uint32_t k = 64;
    const double io_only = k * std::chrono::duration<double>(work).count();
    std::vector<double> overlap, serial;
    for (int i = 0; i < (args.quick ? 1 : 5); ++i) {
      const double compute_only = io_time(devices, work, k, 0, /*synthetic=*/true);
      overlap.push_back(io_time(devices, work, k, 2, false) / std::max(compute_only, io_only));
      serial.push_back(io_time(devices, work, k, 0, false) / (compute_only + io_only));
    }
    const double o = bench::median(overlap), se = bench::median(serial);
    report.ratio("pipeline_io_overlap_vs_max", o, "<= 1.1", o <= 1.1);
    report.ratio("pipeline_io_serial_vs_sum", se, "0.95..1.05", se >= 0.95 && se <= 1.05);
  }
  {
    std::vector<double> errors = allreduce_errors(devices, args.quick ? 20 : 200);
    const double e = errors.empty() ? 1.0 : bench::median(errors);
    report.ratio("allreduce_model_error_p50", e, "<= 0.05", e <= 0.05);
  }
  return report.write(args.json_path) ? 0 : 1;
}
