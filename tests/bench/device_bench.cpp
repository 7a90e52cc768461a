// Device-model benchmark: does the emulated IPU's timing behave as modeled?
//
//   overlap_vs_max      step time with I/O tiles (prefetch 2), modeled I/O = compute = 100 us,
//                       over max(io, compute)                                  target <= 1.1
//   serial_vs_sum       step time without I/O tiles over io + compute          target 0.95..1.05
//   prefetch_sweep_dN_us  step time with I/O tiles at prefetch depth 1..4 (the curve's shape)
//   sync_vs_std_barrier  BSP sync of 2 pinned devices over std::barrier with 2 pinned threads
//                                                                              target <= 1.2
//   sync_oversubscribed_vs_std_barrier  the same with 4 devices / threads on 2 cores <= 1.5
//   streamcopy_error_p50 / _p99  relative error of modeled 50 us and 500 us copies, as the
//                       I/O engine times them                                target p50 <= 0.02
//   spin_wait_error_p99  the machine's floor: the same durations waited out back to back by a
//                       bare spin loop on the engine's core (ticks and preemption show up here
//                       too), in rounds alternating with the copies'; _idle_between_ the same
//                       with a 5 us sleep between spins (not the reference; see below)
//   streamcopy_error_p99_vs_floor  streamcopy_error_p99 over spin_wait_error_p99 (over 0.083
//                       when the floor is lower: then the target is 0.10)     target <= 1.2
//   streamcopy_late_share_50us, spin_wait_late_share_50us  the share of 50 us waits more than
//                       10% late, the engine's and the floor's (where each p99 sits)
//   streamcopy_device_error_p50 / _p99  the same as the device sees them (StreamCopyMid:
//                       hand-offs to and from the engine thread included; no target)
//   trace_on_vs_off     step time of a 10 us body with tracing on over off (the cost of tracing)
//   interpreter_overhead_ns  per iteration of Repeat(Execute) over a plain loop calling the
//                       same function (what the interpreter, trace-off checks included, costs)
//   modeled_clock_error_p50  the modeled time of synthetic Engine programs (compute sets, syncs
//                       across devices, exchange, stream copies without and with I/O tiles,
//                       link- and compute-bound) against the analytic formula, relative error;
//                       each case as modeled_clock_error_<case>                target <= 0.02
//
// Every ratio's reference is measured in the same run. Prints `key: value`; --json FILE.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

using namespace bspflow;
using namespace bspflow::program;
using namespace std::chrono_literals;
using bench::Clock;

namespace {

const DeviceConfig kDevice{256, 64 * 1024};      // 256 tiles x 64 KiB = 16 MiB
constexpr std::size_t kMicroBatchFloats = 4096;  // 16 KiB per micro-batch
constexpr std::size_t kMicroBatchBytes = kMicroBatchFloats * 4;

// Step time (seconds) of Repeat(n, {StreamCopy, Execute(compute)}) with a link on which one
// micro-batch takes `io`.
double step_time(Device& dev, std::uint32_t io_tiles, std::uint32_t prefetch,
                 std::chrono::nanoseconds io, std::chrono::nanoseconds compute, std::uint64_t n) {
  EngineConfig c;
  c.io_tiles = io_tiles;
  c.prefetch_depth = prefetch;
  c.host_link = LinkModel::taking(io, kMicroBatchBytes);
  Engine engine(dev, c);
  InfeedQueue<Tensor> infeed(InfeedConfig{1, n + 8, prefetch});
  auto producer = infeed.make_producer();
  for (std::uint64_t i = 0; i < n; ++i) producer.push(Tensor(DType::kFloat32, {kMicroBatchFloats}));
  Buffer x = make_buffer(dev, "x", DType::kFloat32, kMicroBatchFloats);
  const Program body =
      Sequence{StreamCopy(infeed, x),
               Execute("compute", [compute](const ComputeContext&) { bench::spin_for(compute); })};
  engine.run(Repeat(8, body));  // warm up: pages touched, threads awake
  const EngineResult r = engine.run(Repeat(n - 8, body));
  return std::chrono::duration<double>(r.elapsed).count() / static_cast<double>(n - 8);
}

// Seconds per barrier for `threads` threads placed like `threads` devices.
double std_barrier_time(std::uint32_t threads, std::uint64_t rounds) {
  std::barrier sync(static_cast<std::ptrdiff_t>(threads));
  const double s = bench::on_placed_threads(threads, [&](std::uint32_t) {
    for (std::uint64_t i = 0; i < rounds; ++i) sync.arrive_and_wait();
  });
  return s / static_cast<double>(rounds);
}

double bsp_sync_time(DeviceGroup& devices, std::uint64_t rounds) {
  Engine engine(devices);
  auto group = std::make_shared<SyncGroup>(devices.size());
  engine.run(Repeat(100, Sync(group)));  // warm up
  const EngineResult r = engine.run(Repeat(rounds, Sync(group)));
  return std::chrono::duration<double>(r.elapsed).count() / static_cast<double>(rounds);
}

// Relative errors of `n` modeled copies of `modeled` each: as the I/O engine timed them
// (transfer begin to end, the modeled duration itself), and as the device saw them
// (StreamCopyMid: asking for the copy to seeing it done, hand-offs included).
struct CopyErrors {
  std::vector<double> engine, device;
};
CopyErrors copy_errors(Device& dev, std::chrono::nanoseconds modeled, std::uint64_t n) {
  EngineConfig c;
  c.host_link = LinkModel::taking(modeled, kMicroBatchBytes);
  c.trace = true;
  Engine engine(dev, c);
  InfeedQueue<Tensor> infeed(InfeedConfig{1, n + 1, 1});
  auto producer = infeed.make_producer();
  for (std::uint64_t i = 0; i < n; ++i) producer.push(Tensor(DType::kFloat32, {kMicroBatchFloats}));
  Buffer x = make_buffer(dev, "x", DType::kFloat32, kMicroBatchFloats);
  engine.run(Repeat(n, StreamCopy(infeed, x)));
  CopyErrors errors;
  const double m = static_cast<double>(modeled.count());
  auto error = [m](const TraceEvent& e) {
    return std::abs(static_cast<double>(e.end_ns - e.begin_ns) - m) / m;
  };
  for (const TraceEvent& e : engine.trace()->tracks()[0].events()) {
    if (e.phase == Phase::kStreamCopyMid) errors.device.push_back(error(e));
  }
  for (const TraceEvent& e : engine.trace()->tracks()[1].events())
    errors.engine.push_back(error(e));
  return errors;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bspflow device-model benchmark"};
  bench::CommonArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);

  bench::Report report("device");
  const std::uint64_t steps = args.quick ? 40 : 2000;
  const std::uint64_t rounds = args.quick ? 500 : 50000;
  const std::uint64_t copies = args.quick ? 20 : 400;
  report.note("machine",
              Topology::get().describe().substr(0, Topology::get().describe().find('\n')));

  {
    Device dev(0, kDevice);
    const double io = 100e-6, compute = 100e-6;
    const double overlapped = step_time(dev, 32, 2, 100us, 100us, steps);
    const double serial = step_time(dev, 0, 1, 100us, 100us, steps);
    report.figure("overlap_step_us", overlapped * 1e6);
    report.figure("serial_step_us", serial * 1e6);
    const double ov = overlapped / std::max(io, compute);
    const double se = serial / (io + compute);
    report.ratio("overlap_vs_max", ov, "<= 1.1", ov <= 1.1);
    report.ratio("serial_vs_sum", se, "0.95..1.05", se >= 0.95 && se <= 1.05);
    for (std::uint32_t d = 1; d <= 4; ++d) {
      report.figure("prefetch_sweep_d" + std::to_string(d) + "_us",
                    step_time(dev, 32, d, 100us, 100us, steps / 2) * 1e6);
    }

    // Stream copies as the I/O engine times them, against the floor: the same durations
    // waited out by a plain spin on the engine's core (no timers, no hand-offs), which misses
    // only the machine (hypervisor ticks, preemption). The two are measured in alternating
    // rounds, so a noisy spell of this VM falls on both.
    CopyErrors all, small, large;
    std::vector<double> floor_errors, floor_small, floor_large, idle_floor;
    const int copy_rounds = args.quick ? 1 : 8;
    const auto floor_core = IoEngine::pick_core({dev.placement().core.value_or(0)});
    for (int round = 0; round < copy_rounds; ++round) {
      for (auto [d, n, into] :
           {std::tuple{50us, copies, &small}, std::tuple{500us, copies / 4, &large}}) {
        CopyErrors e = copy_errors(dev, d, n);
        into->engine.insert(into->engine.end(), e.engine.begin(), e.engine.end());
        into->device.insert(into->device.end(), e.device.begin(), e.device.end());
      }
      // The floor: spins back to back, as the engine waits out copies (about 1 us apart); and
      // the same with a 5 us sleep between spins (shown, not the reference: a thread that
      // idles between waits lets the kernel do its tick's work while idle, which a thread
      // watching a deadline cannot).
      std::thread floor_thread([&] {
        if (floor_core) Topology::get().pin_current_thread(*floor_core);
        for (bool idle : {false, true}) {
          for (auto [d, n] : {std::pair{50us, copies}, std::pair{500us, copies / 4}}) {
            for (std::uint64_t i = 0; i < n; ++i) {
              const auto t0 = Clock::now();
              while (Clock::now() < t0 + std::chrono::nanoseconds(d)) {
              }
              const double took = static_cast<double>((Clock::now() - t0).count());
              const double m = static_cast<double>(std::chrono::nanoseconds(d).count());
              const double err = std::abs(took - m) / m;
              if (idle) {
                idle_floor.push_back(err);
                std::this_thread::sleep_for(5us);
              } else {
                floor_errors.push_back(err);
                (d == 50us ? floor_small : floor_large).push_back(err);
              }
            }
          }
        }
      });
      floor_thread.join();
    }
    for (CopyErrors* e : {&small, &large}) {
      all.engine.insert(all.engine.end(), e->engine.begin(), e->engine.end());
      all.device.insert(all.device.end(), e->device.begin(), e->device.end());
    }
    report.figure("streamcopy_error_50us_p50", bench::quantile(small.engine, 0.5));
    report.figure("streamcopy_error_500us_p50", bench::quantile(large.engine, 0.5));
    report.figure("streamcopy_error_50us_p99", bench::quantile(small.engine, 0.99));
    report.figure("streamcopy_error_500us_p99", bench::quantile(large.engine, 0.99));
    const double p50 = bench::quantile(all.engine, 0.5), p99 = bench::quantile(all.engine, 0.99);
    const double floor99 = bench::quantile(floor_errors, 0.99);
    report.ratio("streamcopy_error_p50", p50, "<= 0.02", p50 <= 0.02);
    report.figure("streamcopy_error_p99", p99);
    report.figure("spin_wait_error_p99", floor99);
    report.figure("spin_wait_error_50us_p99", bench::quantile(floor_small, 0.99));
    report.figure("spin_wait_error_500us_p99", bench::quantile(floor_large, 0.99));
    report.figure("spin_wait_idle_between_error_p99", bench::quantile(idle_floor, 0.99));
    // How many of the 50 us waits ended late by more than 10% (5 us), for the engine and the
    // floor: the p99s sit where these shares cross 1%, so the shares say which side of that
    // knee each was on and by how much.
    auto late_share = [](const std::vector<double>& errors) {
      const auto late =
          std::count_if(errors.begin(), errors.end(), [](double e) { return e > 0.1; });
      return errors.empty() ? 0.0 : static_cast<double>(late) / static_cast<double>(errors.size());
    };
    report.figure("streamcopy_late_share_50us", late_share(small.engine));
    report.figure("spin_wait_late_share_50us", late_share(floor_small));
    // A floor of 0 (a quiet machine) makes any tail an infinite ratio: then 0.10 absolute.
    const double vs_floor = p99 / std::max(floor99, 0.10 / 1.2);
    report.ratio("streamcopy_error_p99_vs_floor", vs_floor, "<= 1.2", vs_floor <= 1.2);
    report.figure("streamcopy_device_error_p50", bench::quantile(all.device, 0.5));
    report.figure("streamcopy_device_error_p99", bench::quantile(all.device, 0.99));

    // Tracing cost, and what the interpreter costs per iteration over a plain loop.
    const auto body = [](const ComputeContext&) { bench::spin_for(10us); };
    auto timed = [&](bool trace) {
      EngineConfig c;
      c.trace = trace;
      Engine engine(dev, c);
      const EngineResult r = engine.run(Repeat(steps, Execute("body", body)));
      return std::chrono::duration<double>(r.elapsed).count() / static_cast<double>(steps);
    };
    double off = 1e9, on = 1e9;
    for (int k = 0; k < 3; ++k) {
      off = std::min(off, timed(false));
      on = std::min(on, timed(true));
    }
    report.figure("trace_on_vs_off", on / off);
    const std::uint64_t empty_n = steps * 100;
    std::uint64_t sink = 0;
    const auto empty = [&sink](const ComputeContext& c) { sink += c.iteration; };
    Engine engine(dev);
    double interp = 1e9, raw = 1e9;
    for (int k = 0; k < 3; ++k) {
      const EngineResult r = engine.run(Repeat(empty_n, Execute("empty", empty)));
      interp = std::min(
          interp, std::chrono::duration<double>(r.elapsed).count() / static_cast<double>(empty_n));
      std::function<void(const ComputeContext&)> f = empty;  // called through the same type erasure
      ComputeContext ctx;
      const auto t0 = Clock::now();
      for (std::uint64_t i = 0; i < empty_n; ++i) {
        ctx.iteration = i;
        f(ctx);
      }
      raw = std::min(raw, bench::seconds_since(t0) / static_cast<double>(empty_n));
    }
    report.figure("interpreter_overhead_ns", (interp - raw) * 1e9);
    if (sink == 42) std::printf(" ");
  }

  {
    DeviceGroup two(2);
    const double bsp = bsp_sync_time(two, rounds);
    const double ref = std_barrier_time(2, rounds);
    report.figure("sync_2_devices_ns", bsp * 1e9);
    report.figure("std_barrier_2_threads_ns", ref * 1e9);
    report.ratio("sync_vs_std_barrier", bsp / ref, "<= 1.2", bsp / ref <= 1.2);
  }
  {
    DeviceGroup four(4);
    const double bsp = bsp_sync_time(four, rounds / 10);
    const double ref = std_barrier_time(4, rounds / 10);
    report.figure("sync_4_devices_2_cores_ns", bsp * 1e9);
    report.figure("std_barrier_4_threads_2_cores_ns", ref * 1e9);
    report.ratio("sync_oversubscribed_vs_std_barrier", bsp / ref, "<= 1.5", bsp / ref <= 1.5);
  }
  // ---- the modeled clock against the analytic formula ----
  {
    std::vector<double> errors;
    auto check = [&](const std::string& what, double modeled, double expected) {
      const double e = std::abs(modeled - expected) / expected;
      report.figure("modeled_clock_error_" + what, e);
      errors.push_back(e);
    };
    const DeviceModel m;  // the Mk2's figures
    const std::uint32_t tiles = kDevice.tiles;
    const double host_call = static_cast<double>(m.host_call.count());
    const std::uint64_t n = args.quick ? 10 : 50;
    const Work w{5e8, 0, WorkPrecision::kFloat16};  // about 10 us on 256 tiles
    const double compute_ns =
        m.ns(w.flops / (m.fp16_flops_per_tile_cycle * tiles) + m.sync_cycles_on_chip);
    auto ns_of = [](std::chrono::nanoseconds d) { return static_cast<double>(d.count()); };
    {  // compute sets
      Device dev(0, kDevice);
      Engine engine(dev);
      const EngineResult r =
          engine.run(Repeat(n, Execute("w", [](const ComputeContext&) {}).declare(w)));
      check("compute", ns_of(r.modeled.total), host_call + n * compute_ns);
    }
    {  // syncs across two devices doing different work: the slower sets the pace
      DeviceGroup two(2, kDevice);
      Engine engine(two);
      auto group = std::make_shared<SyncGroup>(2);
      const Work w2 = w.times(3);
      const EngineResult r = engine.run(
          {Repeat(n, Sequence{Execute("w", [](const ComputeContext&) {}).declare(w), Sync(group)}),
           Repeat(n,
                  Sequence{Execute("w", [](const ComputeContext&) {}).declare(w2), Sync(group)})});
      const double slow =
          m.ns(w2.flops / (m.fp16_flops_per_tile_cycle * tiles) + m.sync_cycles_on_chip);
      check("sync", ns_of(r.modeled.total), host_call + n * (slow + ns_of(m.sync_between_chips)));
    }
    {  // exchange between devices over the device link
      DeviceGroup two(2, kDevice);
      Engine engine(two);
      Buffer a = make_buffer(two[0], "a", DType::kFloat32, kMicroBatchFloats);
      Buffer b = make_buffer(two[1], "b", DType::kFloat32, kMicroBatchFloats);
      const EngineResult r = engine.run({Sequence{}, Repeat(n, Copy(a, b))});
      check("exchange", ns_of(r.modeled_by_device[1].total),
            host_call + n * ns_of(LinkModel::device().duration(kMicroBatchBytes)));
    }
    // Stream copies: in series without I/O tiles; overlapped with them, link-bound and
    // compute-bound.
    auto run_copies = [&](std::uint32_t io_tiles, std::chrono::nanoseconds io) {
      Device dev(0, kDevice);
      EngineConfig c;
      c.io_tiles = io_tiles;
      c.prefetch_depth = 2;
      c.host_link = LinkModel::taking(io, kMicroBatchBytes);
      Engine engine(dev, c);
      InfeedQueue<Tensor> infeed(InfeedConfig{1, n + 8, 2});
      auto producer = infeed.make_producer();
      for (std::uint64_t i = 0; i < n; ++i) {
        producer.push(Tensor(DType::kFloat32, {kMicroBatchFloats}));
      }
      Buffer x = make_buffer(dev, "x", DType::kFloat32, kMicroBatchFloats);
      return engine.run(Repeat(n, Sequence{StreamCopy(infeed, x),
                                           Execute("w", [](const ComputeContext&) {}).declare(w)}));
    };
    {
      const EngineResult r = run_copies(0, 20us);
      check("stream_copy_serial", ns_of(r.modeled.total), host_call + n * (20'000 + compute_ns));
    }
    const std::uint32_t io = 32;
    const double io_compute =
        m.ns(w.flops / (m.fp16_flops_per_tile_cycle * (tiles - io)) + m.sync_cycles_on_chip);
    const double handover =
        m.ns(kMicroBatchBytes / (m.exchange_bytes_per_tile_cycle * io) + m.sync_cycles_on_chip);
    {  // the link is the bottleneck: copy k ends at (k+1) x io after the launch
      const EngineResult r = run_copies(io, 40us);
      check("stream_copy_io_tiles_link_bound", ns_of(r.modeled.total),
            host_call + n * 40'000 + handover + io_compute);
    }
    {  // compute is: after the first copy, each step is the hand-over and the compute
      const EngineResult r = run_copies(io, 2us);
      check("stream_copy_io_tiles_compute_bound", ns_of(r.modeled.total),
            host_call + 2'000 + n * (handover + io_compute));
    }
    const double p50 = bench::quantile(errors, 0.5);
    report.ratio("modeled_clock_error_p50", p50, "<= 0.02", p50 <= 0.02);
  }
  return report.write(args.json_path) ? 0 : 1;
}
