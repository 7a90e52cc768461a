// Flagship benchmark: the t03_fashion_mnist_pipeline model and settings (4 stages, batch 40,
// gradient accumulation 10, 10 device iterations, AdamW) on synthetic images. Keys:
//
//   flagship_samples_per_s   training throughput pipelined over 4 emulated devices
//   flagship_vs_sequential   that over the same model trained in a plain single-threaded loop
//                            (the same stages' forward/backward/update called directly, same
//                            micro-batch order and accumulation; no runtime), same run;
//                            target >= 1.6
//   machine_2_vs_1_throughput    the machine's own floor for 2 cores: two plain loops at
//                                once (pinned like 2 devices) over one
//   flagship_vs_machine_2_threads  the pipeline over those two plain loops: the share of
//                                the machine's 2-core throughput the 4-stage pipeline gets
//                                (no target; its Grouped schedule idles stages while it
//                                fills and drains at every weight update)
//
// What the schedule allows, from each stage's forward, backward and update times measured in
// the plain loop's rounds (the keys' own runs: two clock reads per pass) and the devices'
// cores (figures, no targets):
//   flagship_schedule_bound      the speedup over the plain loop of a runtime that costs
//                                nothing: per cycle of the Grouped schedule (PipelinePlan,
//                                K = 10, N = 4) the busiest core's work (the stages of the
//                                devices on it, which share it), plus the updates; each
//                                core at one core's speed
//   flagship_attainable_vs_sequential  the same with a cycle that keeps both cores busy
//                                run at the 2-core speed of that round (machine_2_vs_1 / 2,
//                                at most 1): the most flagship_vs_sequential can be on
//                                this machine in that round; median over the rounds
//   flagship_vs_attainable       flagship_vs_sequential over it, per round; median
//   flagship_attainable_vs_sequential_k20, _k40  the attainable with gradient accumulation
//                                20 and 40 (same stage times): what a larger K would allow
//
// One epoch of each (15 host calls, 150 steps) in 5 rounds, each a third of an epoch of
// all three back to back, the order reversed every other round; ratios are taken within
// a round and the keys are the rounds' medians (_min, _max: the spread of
// flagship_vs_sequential). This VM's speed moves by 15-30% between runs and within them,
// so figures taken an epoch apart measured that drift as much as the runtime.
//
// Where the devices' time goes from a separate traced run of the same
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
// Each segment continues the same model and micro-batch count.
class Sequential {
 public:
  explicit Sequential(const std::vector<Batch>& batches)
      : batches_(batches), model_(kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{})) {}
  // Trains `steps` steps; returns samples per second. Adds each stage's time to stage_seconds().
  double rate(std::uint64_t steps) {
    const double seconds = bench::train_plainly(
        model_, steps, kAccumulation,
        [&](std::uint64_t m) -> const Batch& { return batches_[(first_ + m) % batches_.size()]; },
        &per_stage_);
    first_ += steps * kAccumulation;
    return static_cast<double>(steps * kAccumulation * kBatch) / seconds;
  }
  const bench::StageSeconds& stage_seconds() const { return per_stage_; }
  // Steps trained so far (by rate()).
  std::uint64_t steps() const { return first_ / kAccumulation; }

 private:
  const std::vector<Batch>& batches_;
  StageList model_;
  std::uint64_t first_ = 0;
  bench::StageSeconds per_stage_;
};

// The pipelined step's time if the runtime cost nothing, over the plain loop's step time:
// each stage's passes take what they took in the plain loop (`t`, over `steps` steps of
// kAccumulation micro-batches); per cycle of the Grouped schedule over `k` micro-batches,
// the devices on one core share it, so the cycle lasts as long as the busiest core's work;
// a cycle in which more than one core works runs at `two_core_speed` (1: one core's speed).
// The updates follow the last cycle, also per core. `core_of[s]`: the core of stage s's device.
double schedule_speedup(const bench::StageSeconds& t, std::uint64_t steps,
                        const std::vector<std::uint32_t>& core_of, std::uint64_t k,
                        double two_core_speed) {
  const auto n = static_cast<std::uint32_t>(t.forward.size());
  const double micro_batches = static_cast<double>(steps * kAccumulation);
  std::vector<double> fwd(n), bwd(n), upd(n);
  double plain_step = 0;
  for (std::uint32_t s = 0; s < n; ++s) {
    fwd[s] = t.forward[s] / micro_batches;
    bwd[s] = t.backward[s] / micro_batches;
    upd[s] = t.update[s] / static_cast<double>(steps);
    plain_step += static_cast<double>(k) * (fwd[s] + bwd[s]) + upd[s];
  }
  const std::uint32_t cores = *std::max_element(core_of.begin(), core_of.end()) + 1;
  auto busiest = [&](auto&& work_of) {  // the cycle's time: work_of(s) is stage s's work
    std::vector<double> load(cores, 0.0);
    for (std::uint32_t s = 0; s < n; ++s) load[core_of[s]] += work_of(s);
    const auto busy = std::count_if(load.begin(), load.end(), [](double w) { return w > 0; });
    const double most = *std::max_element(load.begin(), load.end());
    return busy > 1 ? most / two_core_speed : most;
  };
  const PipelinePlan plan{PipelineSchedule::kGrouped, n, k, true};
  double pipelined_step = busiest([&](std::uint32_t s) { return upd[s]; });
  for (std::uint64_t c = 0; c < plan.cycles(); ++c) {
    pipelined_step += busiest([&](std::uint32_t s) {
      const CycleWork w = plan.at(s, c);
      return (w.forward >= 0 ? fwd[s] : 0.0) + (w.backward >= 0 ? bwd[s] : 0.0);
    });
  }
  return plain_step / pipelined_step;
}

// Stage s runs on device s: the core it is pinned to (unpinned: a core of its own).
std::vector<std::uint32_t> stage_cores(const DeviceGroup& devices) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t d = 0; d < devices.size(); ++d)
    out.push_back(devices[d].placement().core.value_or(d));
  // Numbered 0.. in order of first use, so that the count of cores is the largest + 1.
  std::vector<std::uint32_t> seen;
  for (std::uint32_t& c : out) {
    auto it = std::find(seen.begin(), seen.end(), c);
    if (it == seen.end()) it = seen.insert(it, c);
    c = static_cast<std::uint32_t>(it - seen.begin());
  }
  return out;
}

// The machine's floor for 2 cores: two plain loops at once, pinned like 2 devices
// (bench::train_plainly_on_threads), `steps` steps each; samples per second of both together.
double two_plain_rate(const std::vector<Batch>& batches, std::uint64_t steps) {
  const double slowest = bench::train_plainly_on_threads(
      2, steps, kAccumulation,
      [] { return kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{}); },
      [&](std::uint32_t t, std::uint64_t m) -> const Batch& {
        return batches[(m + t * 100) % batches.size()];
      });
  return static_cast<double>(2 * steps * kAccumulation * kBatch) / slowest;
}

// The pipelined training: host calls of kIterations device iterations, each after pushing
// its micro-batches (traced with `trace`).
class Pipelined {
 public:
  Pipelined(DeviceGroup& devices, const std::vector<Batch>& batches, bool trace)
      : batches_(batches), pipe_(devices, config(trace), [](std::uint32_t) {
          return kit::make_model(kit::Model::kConv, 4, kBatch, kit::AdamW{});
        }) {}
  // `calls` host calls; after_call(pipe) runs after each. Returns the seconds they took.
  template <class AfterCall>
  double calls(std::uint64_t calls, AfterCall&& after_call) {
    const auto t0 = bench::Clock::now();
    for (std::uint64_t c = 0; c < calls; ++c) {
      for (std::uint64_t i = 0; i < kIterations * kAccumulation; ++i, ++m_)
        producer_.push(Batch(batches_[m_ % batches_.size()]));
      const PipelineResult r = pipe_.run(infeed_, kIterations);
      if (!r.completed()) std::fprintf(stderr, "pipeline: %s\n", r.message.c_str());
      after_call(pipe_);
    }
    return bench::seconds_since(t0);
  }
  // `calls` untraced host calls; returns samples per second.
  double rate(std::uint64_t calls) {
    const double seconds = this->calls(calls, [](const Pipeline&) {});
    return static_cast<double>(calls * kIterations * kAccumulation * kBatch) / seconds;
  }

 private:
  static PipelineConfig config(bool trace) {
    PipelineConfig cfg;
    cfg.gradient_accumulation = kAccumulation;
    cfg.trace = trace;
    return cfg;
  }
  const std::vector<Batch>& batches_;
  Pipeline pipe_;
  InfeedQueue<Batch> infeed_{InfeedConfig{1, 2 * kIterations* kAccumulation, 2}};
  InfeedQueue<Batch>::Producer producer_ = infeed_.make_producer();
  std::size_t m_ = 0;
};

// Per device, nanoseconds by phase over `calls` traced host calls of the pipelined training.
struct Shares {
  std::vector<std::array<std::int64_t, kPhaseCount>> ns;
  std::vector<std::int64_t> total;
};

Shares traced_shares(DeviceGroup& devices, const std::vector<Batch>& batches, std::uint64_t calls) {
  Shares out;
  Pipelined traced(devices, batches, true);
  traced.calls(calls, [&](const Pipeline& pipe) {
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
  // One epoch (15 host calls) of each in 5 rounds of 3 calls; --quick: 2 rounds of 1.
  const int rounds = args.quick ? 2 : 5;
  const std::uint64_t calls = args.quick ? 1 : 3;
  const std::vector<Batch> batches = make_batches(200);
  DeviceGroup devices(4);
  {  // the timed pipeline goes before the traced one is built on the same devices
    Sequential sequential(batches);
    Pipelined pipelined(devices, batches, false);
    std::vector<double> seq, pip, two, ratio, machine, vs_machine;
    for (int round = 0; round < rounds; ++round) {
      if (round % 2 == 0) {
        seq.push_back(sequential.rate(calls * kIterations));
        two.push_back(two_plain_rate(batches, calls * kIterations));
        pip.push_back(pipelined.rate(calls));
      } else {
        pip.push_back(pipelined.rate(calls));
        two.push_back(two_plain_rate(batches, calls * kIterations));
        seq.push_back(sequential.rate(calls * kIterations));
      }
      ratio.push_back(pip.back() / seq.back());
      machine.push_back(two.back() / seq.back());
      vs_machine.push_back(pip.back() / two.back());
      std::fprintf(stderr,
                   "round %d: samples/s plain 1 thread %.0f, plain 2 threads %.0f, pipelined "
                   "%.0f; pipelined vs 1 thread %.3f\n",
                   round, seq.back(), two.back(), pip.back(), ratio.back());
    }
    const double r = bench::median(ratio);
    // What the schedule allows, from the stage times of all the plain loop's rounds.
    const std::vector<std::uint32_t> cores = stage_cores(devices);
    const bench::StageSeconds& st = sequential.stage_seconds();
    auto attainable = [&](std::uint64_t k, double machine_2_vs_1) {
      return schedule_speedup(st, sequential.steps(), cores, k,
                              std::min(1.0, machine_2_vs_1 / 2.0));
    };
    std::vector<double> att, att20, att40, vs_att;
    for (std::size_t i = 0; i < ratio.size(); ++i) {
      att.push_back(attainable(kAccumulation, machine[i]));
      att20.push_back(attainable(20, machine[i]));
      att40.push_back(attainable(40, machine[i]));
      vs_att.push_back(ratio[i] / att.back());
    }
    report.figure("sequential_samples_per_s", bench::median(seq));
    report.figure("flagship_samples_per_s", bench::median(pip));
    report.ratio("flagship_vs_sequential", r, ">= 1.6", r >= 1.6);
    report.spread("flagship_vs_sequential", ratio);
    report.figure("machine_2_vs_1_throughput", bench::median(machine));
    report.figure("flagship_vs_machine_2_threads", bench::median(vs_machine));
    report.figure("flagship_schedule_bound",
                  schedule_speedup(st, sequential.steps(), cores, kAccumulation, 1.0));
    report.figure("flagship_attainable_vs_sequential", bench::median(att));
    report.figure("flagship_vs_attainable", bench::median(vs_att));
    report.figure("flagship_attainable_vs_sequential_k20", bench::median(att20));
    report.figure("flagship_attainable_vs_sequential_k40", bench::median(att40));
  }
  report_shares(report, traced_shares(devices, batches, args.quick ? 1 : 3));
  return report.write(args.json_path) ? 0 : 1;
}
