// t02_io_overlap: what I/O tiles and prefetch buy (the IPU optimisation guide's figures 4.6
// and 4.7, made runnable).
//
// One device runs the same workload four ways: I/O tiles 0 or 32, prefetch depth 1 or 3.
// By default a micro-batch is 24576 fp32 (96 KiB) on a 1 GB/s link, so the copy (103 us)
// and the compute (100 us) take about as long: the case the guide's figures show.
// Each step copies one micro-batch from the host over the modeled host link, then computes
// on it. Without I/O tiles the copy happens before the compute (step = I/O + compute); with
// them the copy for the next step runs during this step's compute (step = max of the two).
// Each run writes a Chrome trace (open it in https://ui.perfetto.dev) and prints the
// per-phase summary, in CPU time and in modeled IPU time: the compute declares the work that
// takes --compute-us on all the device's tiles, so with I/O tiles it runs on fewer tiles and
// takes longer there (modeled_io_tiles_compute_cost: what giving tiles to I/O costs).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <bspflow/bspflow.hpp>

using namespace bspflow;
using namespace bspflow::program;
using Clock = std::chrono::steady_clock;

namespace {

struct Setup {
  std::uint32_t io_tiles;
  std::uint32_t prefetch;
};

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::kFloat32;
  if (s == "fp16") return DType::kFloat16;
  return DType::kUint8;
}

// Reads every element of the micro-batch as a float (what normalising 8-bit input on the
// device would do), then spins until `compute` has passed: real work with a known duration.
double consume(DeviceBuffer& x, std::chrono::microseconds compute, Clock::time_point start) {
  double sum = 0;
  switch (x.dtype()) {
    case DType::kFloat32:
      for (float v : x.as<float>()) sum += v;
      break;
    case DType::kFloat16:
      for (std::uint16_t v : x.as<std::uint16_t>()) sum += from_half(v);
      break;
    default:
      for (std::uint8_t v : x.as<std::uint8_t>()) sum += v / 255.0;
      break;
  }
  while (Clock::now() - start < compute) {
  }
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"t02_io_overlap: step time with and without I/O tiles, prefetch 1 and 3"};
  app.option_defaults()->always_capture_default();  // --help shows every option's default
  std::size_t elements = 24576;
  double link_gbytes_per_s = 1.0;  // gigabytes (not gigabits) per second
  int compute_us = 100;
  std::uint64_t steps = 300;
  std::string dtype_name = "fp32";
  std::string trace_dir = ".";
  app.add_option("--elements", elements, "elements per micro-batch")->check(CLI::Range(1, 1 << 26));
  app.add_option("--compute-us", compute_us, "compute per step, microseconds")
      ->check(CLI::Range(1, 100000));
  app.add_option("--link-gbytes-per-s", link_gbytes_per_s,
                 "host link bandwidth, GB/s (5 us latency per copy)")
      ->check(CLI::Range(0.001, 1000.0));
  app.add_option("--steps", steps, "steps per run")->check(CLI::Range(2, 1000000));
  app.add_option("--dtype", dtype_name, "transfer element type")
      ->check(CLI::IsMember({"fp32", "fp16", "uint8"}));
  app.add_option("--trace-dir", trace_dir, "write the four traces here ('' = none)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; an unknown or bad argument: 2
  }

  const DType dtype = parse_dtype(dtype_name);
  const std::size_t bytes = elements * dtype_size(dtype);
  LinkModel link = LinkModel::host();
  link.bytes_per_second = link_gbytes_per_s * 1e9;
  const auto io = link.duration(bytes);
  const auto compute = std::chrono::microseconds(compute_us);
  std::printf("micro-batch: %zu %s = %s; host link %s -> modeled I/O %.1f us; compute %d us\n",
              elements, to_string(dtype), bspflow::format_bytes(bytes).c_str(),
              link.describe().c_str(), static_cast<double>(io.count()) / 1e3, compute_us);
  const double io_us = static_cast<double>(io.count()) / 1e3;
  const double serial_us = io_us + compute_us;
  const double overlap_us = std::max(io_us, static_cast<double>(compute_us));

  Device device(0);
  // In modeled IPU time the compute declares the work that takes --compute-us on all of the
  // device's tiles (fp32): with I/O tiles it runs on fewer and takes longer.
  const DeviceModel& dm = device.config().model;
  const Work work{static_cast<double>(compute_us) * 1e-6 * dm.clock_hz *
                  dm.fp32_flops_per_tile_cycle * device.config().tiles * dm.efficiency};
  double modeled_compute_without = 0, modeled_compute_with = 0;
  int failures = 0;
  for (const Setup s : {Setup{0, 1}, Setup{0, 3}, Setup{32, 1}, Setup{32, 3}}) {
    EngineConfig config;
    config.io_tiles = s.io_tiles;
    config.prefetch_depth = s.prefetch;
    config.host_link = link;
    config.trace = true;
    if (!trace_dir.empty()) {
      config.trace_path = trace_dir + "/t02_io_overlap_io" + std::to_string(s.io_tiles) + "_p" +
                          std::to_string(s.prefetch) + ".json";
    }
    Engine engine(device, config);
    // The host queues every micro-batch up front, so the step times show the device and the
    // link alone (t01_data_loading is about keeping a host producer fast enough).
    InfeedQueue<Tensor> infeed(InfeedConfig{1, steps, s.prefetch});
    Buffer x = make_buffer(device, "x", dtype, elements);
    double device_sum = 0;
    const Program program = Repeat(
        steps, Sequence{StreamCopy(infeed, x), Execute("compute", [&](const ComputeContext&) {
                                                 device_sum += consume(*x, compute, Clock::now());
                                               }).declare(work)});
    // The host feeds micro-batch i filled with the value i % 7 (as this dtype).
    double host_sum = 0;
    {
      auto producer = infeed.make_producer();
      for (std::uint64_t i = 0; i < steps; ++i) {
        Tensor t(dtype, {elements}, Tensor::Init::kNone);
        const int v = static_cast<int>(i % 7);
        switch (dtype) {
          case DType::kFloat32:
            for (float& e : t.as<float>()) e = static_cast<float>(v);
            host_sum += double(v) * elements;
            break;
          case DType::kFloat16:
            for (std::uint16_t& e : t.as<std::uint16_t>()) e = to_half(static_cast<float>(v));
            host_sum += double(v) * elements;
            break;
          default:
            for (std::uint8_t& e : t.as<std::uint8_t>()) e = static_cast<std::uint8_t>(v);
            host_sum += v / 255.0 * elements;
            break;
        }
        producer.push(std::move(t));
      }
    }
    const EngineResult r = engine.run(program);
    const double step_us =
        std::chrono::duration<double, std::micro>(r.elapsed).count() / static_cast<double>(steps);
    const bool overlapped = s.io_tiles > 0;
    const double model_us = overlapped ? overlap_us : serial_us;
    std::printf("\nio_tiles %2u, prefetch %u: step %.1f us (model: %s = %.1f us, ratio %.2f)\n",
                s.io_tiles, s.prefetch, step_us, overlapped ? "max(io, compute)" : "io + compute",
                model_us, step_us / model_us);
    std::printf("  %s\n",
                overlapped
                    ? "the I/O tiles receive the next micro-batch while the compute tiles work: "
                      "the device waits for the host only when the link is the slower side"
                    : (s.prefetch > 1 ? "prefetch alone cannot hide the copy: without I/O tiles "
                                        "the device itself moves each micro-batch before computing"
                                      : "every step: StreamCopyBegin/Mid/End on the device, then "
                                        "compute; the link and the tiles take turns"));
    const double modeled_step_us =
        static_cast<double>((r.modeled.total - r.modeled.host_call).count()) / 1e3 /
        static_cast<double>(steps);
    const double modeled_compute_us =
        static_cast<double>(r.modeled.compute.count()) / 1e3 / static_cast<double>(steps);
    (overlapped ? modeled_compute_with : modeled_compute_without) = modeled_compute_us;
    std::printf("  modeled IPU: step %.1f us, compute %.1f us on %u compute tiles\n",
                modeled_step_us, modeled_compute_us, device.config().tiles - s.io_tiles);
    std::printf("%s", engine.summary().to_string().c_str());
    if (!config.trace_path.empty()) std::printf("  trace: %s\n", config.trace_path.c_str());
    if (!r.completed() || r.iterations.front() != steps ||
        std::abs(device_sum - host_sum) > 1e-6 * (1 + host_sum)) {
      std::printf("  WRONG: status %s, %llu steps, device sum %.6g, host sum %.6g\n",
                  to_string(r.status), static_cast<unsigned long long>(r.iterations.front()),
                  device_sum, host_sum);
      ++failures;
    }
  }
  // The guide's trade: I/O tiles hide the copies, and the tiles they take no longer compute.
  const double cost = modeled_compute_with / modeled_compute_without;
  std::printf(
      "\nmodeled_io_tiles_compute_cost: %.4f (compute per step with 32 I/O tiles over "
      "without: %u of %u tiles compute)\n",
      cost, device.config().tiles - 32, device.config().tiles);
  if (!(cost > 1.0)) {
    std::printf("WRONG: I/O tiles should cost compute tiles in modeled time\n");
    ++failures;
  }
  std::printf("\n%s\n", failures == 0 ? "all four runs moved every micro-batch exactly once"
                                      : "FAILED: see WRONG lines above");
  return failures == 0 ? 0 : 1;
}
