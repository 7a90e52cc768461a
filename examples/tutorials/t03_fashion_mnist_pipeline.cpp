// t03_fashion_mnist_pipeline: PopTorch's pipelining tutorial in C++ on real data. Trains a
// classifier on Fashion-MNIST pipelined over 4 emulated IPUs (batch 40, 10 device
// iterations, gradient accumulation 10, AdamW lr 0.001), then evaluates it with an
// inference pipeline (batch 8, 100 device iterations) and prints the test accuracy.
//
//   t03_fashion_mnist_pipeline [--epochs N] [--batch-size B] [--test-batch-size B]
//       [--device-iterations D] [--gradient-accumulation K] [--replicas R]
//       [--learning-rate LR] [--strategy pipelined|sharded] [--schedule auto|grouped|
//       interleaved|sequential] [--sync bsp|dataflow] [--eight-bit-io] [--offload-optimiser]
//       [--trace FILE]
//       [--precision fp32|fp16] [--loss-scaling S] [--recompute] [--memory]
//       [--loader sync|async] [--io-tiles N] [--device-mapping 0,0,1,2]
//       [--data-dir DIR] [--model conv|mlp]
//   mpirun -np 2 t03_fashion_mnist_pipeline --replicas 2    # one replica per process
//
// The model is the tutorial's network (conv 5x5 1->10, max-pool, ReLU, conv 5x5 10->20,
// max-pool, ReLU, dense 320->256, ReLU, dense 256->10), split like the tutorial into 4
// stages, one per device: each conv block, then each dense layer. --model mlp trains a
// faster MLP instead. Layers, loss and AdamW live in examples/common (the runtime
// schedules, it does not do deep learning). A loader thread
// feeds the infeed while the devices train (a DataLoader with shuffling, one step ahead).
//
// Under mpirun each process is an instance (bspflow::Instance) running --replicas /
// instances replicas on its own devices: its DataLoader takes its part of every epoch, the
// gradients are reduced across the instances every step (PipelineConfig::distributed), each
// instance evaluates its part of the test set and instance 0 prints the sums.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "model_kit.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::size_t batch = 40;
  std::size_t test_batch = 8;
  std::uint64_t device_iterations = 10;
  std::uint32_t gradient_accumulation = 10;
  std::uint32_t replicas = 1;
  std::uint32_t epochs = 5;  // about 87% test accuracy, ~30 s on 2 cores
  std::string model = "conv";
  float lr = 0.001f;
  std::string strategy = "pipelined";
  std::vector<std::uint32_t> device_mapping;  // empty: stage s on device s
  std::string schedule = "auto";  // the strategy's own: grouped, or sequential when sharded
  std::string sync = "bsp";
  bool eight_bit = false;
  bool offload = false;
  bool recompute = false;
  std::string precision = "fp32";
  float loss_scaling = 1.0f;
  bool memory = false;
  std::string loader = "async";
  std::uint32_t io_tiles = 0;
  std::string trace;
  std::string data_dir = bspflow::idx::kDebianFashionMnistDir;
  std::uint64_t max_steps = 0;     // per epoch; 0 = the whole epoch
  std::uint64_t test_samples = 0;  // 0 = all 10000
  double min_accuracy = 0;         // exit 1 below this (the tests use it)
  std::uint32_t stages = 4;        // the model split into 1, 2 or 4 pipeline stages
  std::uint32_t tiles = bspflow::tunables::kDefaultTiles;
  std::size_t bytes_per_tile = bspflow::tunables::kDefaultBytesPerTile;
  double link_gbytes_per_s = 10;
  std::string output_mode = "final";  // PopTorch's default for training
  std::uint32_t loader_workers = 1;
};

// Per-device share of time spent computing, accumulated over every host call.
struct Utilisation {
  std::vector<std::int64_t> compute, total;
  std::vector<std::string> names;
  void add(const bspflow::TraceSummary& s) {
    std::size_t d = 0;
    for (const auto& t : s.tracks) {
      if (t.kind != bspflow::TraceTrack::Kind::kDevice) continue;
      if (compute.size() <= d) {
        compute.push_back(0);
        total.push_back(0);
        names.push_back(t.name);
      }
      compute[d] += t.ns[static_cast<std::size_t>(bspflow::Phase::kCompute)];
      total[d] += t.total_ns;
      ++d;
    }
  }
};

void progress(bool tty, std::uint32_t epoch, std::uint32_t epochs, std::uint64_t step,
              std::uint64_t steps, double loss, double acc) {
  if (!tty && step != steps) return;  // logs get one line per epoch
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * step / std::max<std::uint64_t>(steps, 1));
  std::string bar(static_cast<std::size_t>(filled), '=');
  if (filled < kWidth) bar += '>';
  bar.resize(kWidth, ' ');
  std::printf("%sepoch %u/%u [%s] %llu/%llu  loss %.4f  accuracy %5.1f%%%s", tty ? "\r" : "", epoch,
              epochs, bar.c_str(), static_cast<unsigned long long>(step),
              static_cast<unsigned long long>(steps), loss, 100 * acc, step == steps ? "\n" : "");
  std::fflush(stdout);
}

// The run shape, stated once: the pipeline, the infeed, the outfeed and the loader all
// take it from these Options (as PopTorch's tutorial passes one poptorch.Options to its
// DataLoader and its model).
bspflow::Options training_options(const Settings& st) {
  bspflow::Options opts;
  opts.device_iterations(st.device_iterations)
      .gradient_accumulation(st.gradient_accumulation)
      .replicas(st.replicas)
      .infeed_capacity(2 * st.device_iterations * st.gradient_accumulation)  // a step ahead
      .prefetch_depth(2)
      .output_mode(bspflow::OutputMode::parse(st.output_mode))
      .outfeed_capacity(0)
      .io_tiles(st.io_tiles)
      .tiles(st.tiles)
      .bytes_per_tile(st.bytes_per_tile)
      .host_link(bspflow::LinkModel{st.link_gbytes_per_s * 1e9, std::chrono::nanoseconds{5'000}})
      .precision(st.precision == "fp16"
                     ? bspflow::Precision::half(st.loss_scaling)
                     : bspflow::Precision{bspflow::DType::kFloat32, bspflow::DType::kFloat32,
                                          st.loss_scaling});
  return opts;
}

// Sums `values` over every instance (identity in a plain process).
void sum_over_instances(std::vector<double>& values) {
  bspflow::Instance::current().allreduce_sum(values);
}

bspflow::PipelineConfig pipeline_config(const Settings& st, const bspflow::Options& opts) {
  bspflow::PipelineConfig cfg = bspflow::PipelineConfig::from(opts);
  cfg.strategy = st.strategy == "sharded" ? bspflow::ExecutionStrategy::kSharded
                                          : bspflow::ExecutionStrategy::kPipelined;
  if (st.schedule != "auto") {  // else unset: the strategy's own schedule
    cfg.schedule = st.schedule == "interleaved"  ? bspflow::PipelineSchedule::kInterleaved
                   : st.schedule == "sequential" ? bspflow::PipelineSchedule::kSequential
                                                 : bspflow::PipelineSchedule::kGrouped;
  }
  cfg.sync = st.sync == "dataflow" ? bspflow::SyncMode::kDataflow : bspflow::SyncMode::kBsp;
  cfg.offload_optimizer = st.offload;
  cfg.recompute = st.recompute;
  cfg.device_mapping = st.device_mapping;
  cfg.trace = true;  // for the utilisation summary (costs about nothing: see device_bench)
  return cfg;
}

int run(Settings st) {
  const std::uint32_t stage_count = st.stages;
  bspflow::Instance& inst = bspflow::Instance::current();
  const bspflow::InstanceLayout layout = inst.layout(st.replicas);  // throws unless it divides
  const bool speak = inst.index() == 0;                             // instance 0 prints for the run
  const std::uint32_t total_replicas = st.replicas;
  st.replicas = layout.local_replicas;
  const bspflow::TensorDataset train = bspflow::mnist_dataset(st.data_dir, "train");
  const bspflow::TensorDataset test = bspflow::mnist_dataset(st.data_dir, "t10k");
  kit::AdamW adamw;
  adamw.lr = st.lr;

  const bspflow::Options opts = training_options(st);
  bspflow::PipelineConfig cfg = pipeline_config(st, opts);
  cfg.distributed = inst.distributed();  // reduce across the instances too
  if (cfg.gradient_accumulation < cfg.min_gradient_accumulation(stage_count)) {
    // Which layouts take this gradient accumulation: Grouped needs 2N-1 micro-batches per
    // step over N stages, Interleaved N, Sequential 1.
    std::string fits;
    for (std::uint32_t n : {1u, 2u, 4u}) {
      if (cfg.min_gradient_accumulation(n) <= cfg.gradient_accumulation) {
        fits += (fits.empty() ? "" : ", ") + std::string("--stages ") + std::to_string(n);
      }
    }
    std::fprintf(stderr,
                 "t03_fashion_mnist_pipeline: --gradient-accumulation %u is too small for the %s "
                 "schedule over %u stages (it needs %u); with this schedule it works with: %s; "
                 "or use --schedule interleaved (N) or sequential (1)\n",
                 cfg.gradient_accumulation, bspflow::to_string(cfg.effective_schedule()),
                 stage_count, cfg.min_gradient_accumulation(stage_count),
                 fits.empty() ? "none" : fits.c_str());
    return 2;
  }
  cfg.validate(stage_count);  // a bad --device-mapping says so before any device is made
  bspflow::DeviceGroup devices(cfg.devices_needed(stage_count), opts.device_config());
  const kit::Model model = st.model == "mlp" ? kit::Model::kMlp : kit::Model::kConv;
  bspflow::Pipeline pipe(devices, cfg, [&](std::uint32_t) {
    return kit::make_model(model, stage_count, st.batch, adamw);
  });

  bspflow::LoaderConfig lc;
  lc.batch_size = st.batch;
  lc.shuffle = true;
  lc.seed = 42;
  lc.mode = st.loader == "sync" ? bspflow::LoaderMode::kSync : bspflow::LoaderMode::kAsync;
  lc.num_workers = st.loader == "sync" ? 0 : st.loader_workers;
  lc.instance = inst.index();  // this instance's part of every epoch
  lc.instances = inst.count();
  if (!st.eight_bit) lc.output_dtype = bspflow::DType::kFloat32;  // widened on the host
  bspflow::DataLoader loader(opts, train, lc);
  const std::uint64_t steps =
      st.max_steps ? std::min(st.max_steps, loader.steps()) : loader.steps();
  const std::uint64_t per_step = loader.plan().samples_per_step();

  if (speak) {
    std::printf(
        "training: the %s model, %s over %u devices (%s schedule, %s sync), %u replica(s); batch "
        "%zu x %llu device "
        "iterations x %u accumulation x %u replica(s) = %llu samples per step, %llu steps per "
        "epoch%s\n",
        kit::to_string(model), st.strategy.c_str(), cfg.devices_needed(stage_count) * inst.count(),
        bspflow::to_string(cfg.effective_schedule()), bspflow::to_string(cfg.sync), total_replicas,
        st.batch, static_cast<unsigned long long>(st.device_iterations), st.gradient_accumulation,
        total_replicas, static_cast<unsigned long long>(per_step * inst.count()),
        static_cast<unsigned long long>(steps), st.eight_bit ? ", 8-bit I/O" : "");
    if (inst.distributed()) {
      std::printf(
          "instances: %u processes (%s), %u replica(s) each; gradients reduced in process, then "
          "across the "
          "instances every step\n",
          inst.count(), inst.transport().c_str(), layout.local_replicas);
    }
  }
  if (!speak) {
  } else if (st.memory) {
    std::printf("%s", pipe.memory().to_string().c_str());
  } else {
    std::printf("memory: peak %s per device at the most (storage %s; --memory prints the report)\n",
                bspflow::format_bytes(pipe.memory().peak()).c_str(),
                bspflow::to_string(cfg.precision.storage));
  }
  const bool tty = isatty(STDOUT_FILENO) != 0;
  Utilisation util;
  double train_seconds = 0;
  std::uint64_t trained = 0;
  std::uint64_t link_bytes = 0;
  std::chrono::nanoseconds link_wait{0};
  double modeled_seconds = 0;  // the same training in modeled IPU time
  bool modeled_complete = true;
  for (std::uint32_t epoch = 1; epoch <= st.epochs; ++epoch) {
    bspflow::InfeedQueue<bspflow::Batch> infeed(opts.infeed_config());
    bspflow::OutfeedQueue<std::vector<float>> outfeed(opts.outfeed_config());
    // The loader thread stays up to one step ahead of the devices (the infeed's capacity).
    std::jthread feeder([&] {
      auto producer = infeed.make_producer();
      for (std::uint64_t s = 0; s < steps; ++s) {
        // false: the loader's epoch ended (only with --max-steps out of step with it).
        if (!loader.feed_next(producer) && !loader.feed_next(producer)) break;
      }
      infeed.close();
    });
    double loss = 0, acc = 0;
    const auto t0 = Clock::now();
    for (std::uint64_t s = 1; s <= steps; ++s) {
      const bspflow::PipelineResult r = pipe.run(infeed, opts.device_iterations(), &outfeed);
      if (!r.completed()) {  // every instance ends the same way (the Pipeline agrees on it)
        std::fprintf(stderr, "training stopped: %s\n", r.message.c_str());
        infeed.close();  // the loader thread may wait for room: let it end
        return 1;
      }
      util.add(pipe.summary());
      modeled_seconds += std::chrono::duration<double>(r.modeled.total).count();
      modeled_complete = modeled_complete && r.modeled.complete();
      link_bytes += r.host_bytes_in + r.host_bytes_out;
      link_wait += r.host_wait;
      std::vector<double> sums{0, 0, 0};       // loss, correct, valid
      for (const auto& e : outfeed.drain()) {  // Final: the last micro-batch of each replica
        const auto h = kit::HeadOutput::from(e.value);
        sums[0] += h.loss_sum;
        sums[1] += h.correct;
        sums[2] += h.valid;
      }
      sum_over_instances(sums);  // every replica of every instance
      loss = sums[0] / std::max(sums[2], 1.0);
      acc = sums[1] / std::max(sums[2], 1.0);
      if (speak) progress(tty, epoch, st.epochs, s, steps, loss, acc);
    }
    train_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    trained += steps * per_step * inst.count();
    feeder.join();
  }
  if (speak && !st.trace.empty() && pipe.trace() != nullptr)
    pipe.trace()->write_chrome_json(st.trace);

  // Evaluation: an inference pipeline over the same devices with the trained weights.
  // Its own run shape: 100 device iterations of one micro-batch, every output kept (All,
  // PopTorch's default for inference).
  const std::uint64_t test_iterations = 100;
  bspflow::Options topts = opts;
  topts.device_iterations(test_iterations)
      .gradient_accumulation(1)
      .infeed_capacity(2 * test_iterations)
      .output_mode(bspflow::OutputMode::all());
  bspflow::PipelineConfig icfg = pipeline_config(st, topts);
  icfg.training = false;
  bspflow::Pipeline infer(devices, icfg, [&](std::uint32_t) {
    bspflow::StageList stages = kit::make_model(model, stage_count, st.test_batch, adamw);
    for (std::uint32_t s = 0; s < stage_count; ++s) {
      auto& trained_stage = static_cast<kit::LayerStage&>(pipe.stage(0, s));
      static_cast<kit::LayerStage&>(*stages[s]).set_parameters(trained_stage.parameters());
    }
    return stages;
  });
  bspflow::LoaderConfig tl;
  tl.batch_size = st.test_batch;
  tl.drop_last = false;        // every test image counts; the last step is padded (label -1)
  tl.instance = inst.index();  // each instance evaluates its part; the counts are summed
  tl.instances = inst.count();
  if (!st.eight_bit) tl.output_dtype = bspflow::DType::kFloat32;
  bspflow::DataLoader test_loader(topts, test, tl);
  bspflow::InfeedQueue<bspflow::Batch> tin(topts.infeed_config());
  bspflow::OutfeedQueue<std::vector<float>> tout(topts.outfeed_config());
  auto producer = tin.make_producer();
  double correct = 0, valid = 0;
  const std::uint64_t test_steps =
      st.test_samples
          ? std::max<std::uint64_t>(
                1, st.test_samples / (test_loader.plan().samples_per_step() * inst.count()))
          : test_loader.steps();
  const auto e0 = Clock::now();
  for (std::uint64_t s = 0; s < test_steps && test_loader.feed_next(producer); ++s) {
    const bspflow::PipelineResult r = infer.run(tin, topts.device_iterations(), &tout);
    if (!r.completed()) {
      std::fprintf(stderr, "evaluation stopped: %s\n", r.message.c_str());
      // Evaluation is each instance's own: the others would wait in the sum below.
      if (inst.distributed()) inst.abort(1);
      return 1;
    }
    for (const auto& e : tout.drain()) {
      const auto h = kit::HeadOutput::from(e.value);
      correct += h.correct;
      valid += h.valid;
    }
  }
  std::vector<double> counts{correct, valid};
  sum_over_instances(counts);
  correct = counts[0];
  valid = counts[1];
  const double eval_seconds = std::chrono::duration<double>(Clock::now() - e0).count();
  const double accuracy = correct / std::max(valid, 1.0);
  if (!speak) return accuracy < st.min_accuracy ? 1 : 0;

  std::printf("\nsummary\n");
  std::printf("  training: %llu samples in %.1f s = %.0f samples/s on this CPU\n",
              static_cast<unsigned long long>(trained), train_seconds,
              static_cast<double>(trained) / train_seconds);
  std::printf(
      "  modeled IPU: the same training in %.3f s = %.0f samples/s%s (the device side: the "
      "loader is this host's; the throughput verdict uses this figure)\n",
      modeled_seconds, static_cast<double>(trained) / std::max(modeled_seconds, 1e-12),
      modeled_complete ? "" : " (incomplete: some compute declared no cost)");
  std::printf(
      "  test accuracy: %.2f%% on %.0f images (inference: batch %zu, %llu device iterations, %.0f "
      "images/s)\n",
      100 * accuracy, valid, st.test_batch, static_cast<unsigned long long>(test_iterations),
      valid / eval_seconds);
  std::printf("  host link while training: %s moved, devices waited %.2f s for it (%s)\n",
              bspflow::format_bytes(link_bytes).c_str(),
              std::chrono::duration<double>(link_wait).count(),
              st.io_tiles > 0 ? "I/O tiles: copies overlap compute"
                              : "no I/O tiles: every copy waited for");
  std::printf(
      "  device utilisation while training (share of time computing, from the trace summary%s):\n",
      inst.distributed() ? "; instance 0's devices" : "");
  for (std::size_t d = 0; d < util.names.size(); ++d) {
    std::printf("    %-10s %5.1f%%\n", util.names[d].c_str(),
                100.0 * static_cast<double>(util.compute[d]) /
                    static_cast<double>(std::max<std::int64_t>(util.total[d], 1)));
  }
  if (!st.trace.empty())
    std::printf("  trace of the last training step: %s (open in https://ui.perfetto.dev)\n",
                st.trace.c_str());
  if (accuracy < st.min_accuracy) {
    std::fprintf(stderr, "test accuracy %.2f%% is below --min-accuracy %.2f%%\n", 100 * accuracy,
                 100 * st.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // First, before any device: under mpirun this joins the other processes (MPI_Init).
  bspflow::Instance& inst = bspflow::Instance::current();
  Settings st;
  CLI::App app{
      "t03_fashion_mnist_pipeline: train Fashion-MNIST pipelined over 4 emulated IPUs, then test "
      "it"};
  app.option_defaults()->always_capture_default();  // --help shows every option's default
  app.add_option("--batch-size", st.batch, "micro-batch size for training")
      ->check(CLI::Range(1, 4096));
  app.add_option("--test-batch-size", st.test_batch, "micro-batch size for evaluation")
      ->check(CLI::Range(1, 4096));
  app.add_option("--device-iterations", st.device_iterations, "steps per host call")
      ->check(CLI::Range(1, 100000));
  app.add_option("--gradient-accumulation", st.gradient_accumulation,
                 "micro-batches per weight update")
      ->check(CLI::Range(1, 100000));
  app.add_option("--replicas", st.replicas,
                 "copies of the 4-stage pipeline (4 devices each, or as --device-mapping says), in "
                 "all: under mpirun each process runs replicas / processes of them")
      ->check(CLI::Range(1, 16));
  app.add_option("--epochs", st.epochs, "passes over the 60000 training images")
      ->check(CLI::Range(1, 1000));
  app.add_option("--learning-rate", st.lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--strategy", st.strategy, "execution strategy")
      ->check(CLI::IsMember({"pipelined", "sharded"}));
  app.add_option("--schedule", st.schedule,
                 "pipeline schedule (auto: grouped when pipelined, sequential when sharded, the "
                 "only one sharding can honour)")
      ->check(CLI::IsMember({"auto", "grouped", "interleaved", "sequential"}));
  app.add_option("--sync", st.sync, "bsp (IPU-faithful) or dataflow")
      ->check(CLI::IsMember({"bsp", "dataflow"}));
  app.add_flag(
      "--eight-bit-io", st.eight_bit,
      "send images as uint8, normalised on the device (default: off, fp32 widened on the host)");
  app.add_flag("--offload-optimiser", st.offload,
               "keep AdamW's state in host memory, streamed around each update (default: off)");
  app.add_option("--precision", st.precision,
                 "storage of weights, activations and gradients (fp16: half the memory; partials "
                 "stay fp32)")
      ->check(CLI::IsMember({"fp32", "fp16"}));
  app.add_option("--loss-scaling", st.loss_scaling,
                 "static loss scaling (gradients scaled before they are stored)")
      ->check(CLI::Range(1.0f, 65504.0f));
  app.add_flag(
      "--recompute", st.recompute,
      "stash only stage inputs; recompute activations for the backward pass (default: off)");
  app.add_option("--device-mapping", st.device_mapping,
                 "the device of each of the 4 stages, e.g. 0,0,1,2 (consecutive stages may share "
                 "one; default: one each)")
      ->delimiter(',')
      ->expected(4);
  app.add_option(
         "--loader", st.loader,
         "async: a worker thread prepares batches ahead; sync: the feeding thread prepares each")
      ->check(CLI::IsMember({"sync", "async"}));
  app.add_option("--io-tiles", st.io_tiles,
                 "I/O tiles per device: the host link moves micro-batches ahead while the devices "
                 "compute (0: each copy is waited for)")
      ->check(CLI::Range(0u, 1024u));
  app.add_flag("--memory", st.memory,
               "print the memory report of every device (default: the peak only)");
  app.add_option("--trace", st.trace,
                 "write the last training step's trace (Chrome JSON) here (default: none)");
  app.add_option("--data-dir", st.data_dir,
                 "Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)");
  app.add_option("--model", st.model, "the tutorial's conv net, or an MLP")
      ->check(CLI::IsMember({"conv", "mlp"}));
  app.add_option("--stages", st.stages,
                 "pipeline stages the model is split into (Grouped needs gradient accumulation "
                 ">= 2N-1: 2 stages take 3)")
      ->check(CLI::IsMember({1, 2, 4}));
  app.add_option("--tiles", st.tiles, "tiles per device")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxTiles));
  app.add_option("--bytes-per-tile", st.bytes_per_tile, "memory per tile, bytes")
      ->check(CLI::Range(std::size_t{bspflow::tunables::kArenaAlignment},
                         bspflow::tunables::kMaxBytesPerTile));
  app.add_option("--link-gbytes-per-s", st.link_gbytes_per_s,
                 "host link bandwidth, GB/s (5 us latency per copy)")
      ->check(CLI::Range(0.001, 1000.0));
  app.add_option("--output-mode", st.output_mode,
                 "what the host sees of the outfeed while training: final, all, sum, every_n(N)")
      ->check([](const std::string& v) {
        try {
          (void)bspflow::OutputMode::parse(v);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("--loader-workers", st.loader_workers, "the asynchronous loader's worker threads")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxLoaderWorkers));
  app.add_option("--max-steps", st.max_steps, "host steps per epoch (0: the whole epoch)");
  app.add_option("--test-samples", st.test_samples, "test images to evaluate (0: all)");
  app.add_option("--min-accuracy", st.min_accuracy,
                 "exit 1 if the test accuracy is below this (0..1)")
      ->check(CLI::Range(0.0, 1.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; an unknown or bad argument: 2
  }
  try {
    return run(st);
  } catch (const std::exception& e) {
    std::fprintf(
        stderr, "t03_fashion_mnist_pipeline%s: %s\n",
        inst.distributed() ? (" (instance " + std::to_string(inst.index()) + ")").c_str() : "",
        e.what());
    // An error only this instance saw (a missing file, a bad option) would leave the
    // others waiting in their next collective: end them all.
    if (inst.distributed()) inst.abort(1);
    return 1;
  }
}
