// 07_options_run_shape: Options as the one place a run is stated (poptorch.Options).
//
// One Options says the shape of a host step: 5 device iterations, 2 micro-batches each
// (gradient accumulation), 2 replicas, prefetch 3 with 2 I/O tiles on 64-tile devices. Every
// piece of the run is built from it, never restated: the infeed (a lane per replica), the
// outfeed, the devices, the host side of the link (opts.host_io(): what a loops::repeat run
// takes) and an inference Pipeline (PipelineConfig::from(opts)). Its one stage counts the samples
// of each micro-batch and sums their numbers; the host checks that one step took exactly
// samples_per_step = micro-batch x device iterations x gradient accumulation x replicas
// samples (4 x 5 x 2 x 2 = 80), each once.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string_view>

#include <bspflow/bspflow.hpp>

using namespace bspflow;
constexpr std::size_t kMicroBatch = 4;  // samples per micro-batch

struct CountSamples final : Stage {  // output: [samples, sum of their numbers]
  std::string name() const override { return "count"; }
  std::size_t output_elements() const override { return 2; }
  void forward(const StageContext&, ForwardArgs& a) override {
    a.output[0] = static_cast<float>(a.batch.valid);
    a.output[1] = 0;
    for (std::size_t i = 0; i < a.batch.valid; ++i) a.output[1] += a.batch.data.as<float>()[i];
  }
};

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 07_options_run_shape\n  no options: builds a run from one Options, runs one "
          "step, checks its samples, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "07_options_run_shape: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  Options opts;
  opts.device_iterations(5).gradient_accumulation(2).replicas(2);
  opts.prefetch_depth(3).io_tiles(2).tiles(64);
  opts.producer_type(ProducerType::kSingle);                       // one host thread pushes,
  opts.consumer_type(ConsumerType::kSingle).outfeed_capacity(64);  // one reads (<= 64 per replica)
  std::printf("the run, stated once:\n%s\n", opts.describe().c_str());

  InfeedQueue<Batch> infeed(opts.infeed_config());                  // 2 lanes, prefetch 3
  OutfeedQueue<std::vector<float>> outfeed(opts.outfeed_config());  // all(), 2 replicas
  const HostIO host = opts.host_io();                               // link, I/O tiles, prefetch
  PipelineConfig cfg = PipelineConfig::from(opts);                  // replicas, K, and the HostIO
  cfg.training = false;  // inference: each device iteration answers K micro-batches
  DeviceGroup devices(cfg.devices_needed(1), opts.device_config());  // 1 stage x 2 replicas
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    StageList stages;
    stages.push_back(std::make_unique<CountSamples>());
    return stages;
  });
  std::printf("host side: %u I/O tiles, prefetch %u, %s; %u devices of %u tiles\n", host.io_tiles,
              host.prefetch_depth, host.host_link.describe().c_str(), devices.size(),
              opts.device_config().tiles);

  // One step's micro-batches, samples numbered 0, 1, 2, ...; the producer deals them to the
  // replicas in turn.
  const std::uint64_t samples = opts.samples_per_step(kMicroBatch);
  auto producer = infeed.make_producer();
  for (std::uint64_t m = 0; m < samples / kMicroBatch; ++m) {
    Batch b;
    b.data = Tensor(DType::kFloat32, {kMicroBatch, 1});
    auto x = b.data.as<float>();
    for (std::size_t i = 0; i < kMicroBatch; ++i) x[i] = static_cast<float>(m * kMicroBatch + i);
    b.labels.assign(kMicroBatch, 0);
    b.valid = kMicroBatch;
    producer.push(std::move(b));
  }
  const PipelineResult r = pipe.run(infeed, opts.device_iterations(), &outfeed);

  std::uint64_t seen = 0, entries = 0;
  double sum = 0;
  for (const auto& e : outfeed.drain()) {
    seen += static_cast<std::uint64_t>(e.value[0]);
    sum += e.value[1];
    ++entries;
  }
  std::printf("%s: %llu micro-batches answered, %llu samples (samples_per_step(%zu) = %llu)\n",
              to_string(r.status), static_cast<unsigned long long>(entries),
              static_cast<unsigned long long>(seen), kMicroBatch,
              static_cast<unsigned long long>(samples));
  const bool agree = infeed.replicas() == cfg.replicas && outfeed.replicas() == cfg.replicas &&
                     infeed.prefetch_depth() == host.prefetch_depth &&
                     cfg.prefetch_depth == host.prefetch_depth && cfg.io_tiles == host.io_tiles &&
                     devices.size() == opts.replicas();
  if (!r.completed() || !agree || samples != 80 || seen != samples ||
      entries * kMicroBatch != samples || sum != static_cast<double>(samples * (samples - 1) / 2)) {
    std::fprintf(
        stderr,
        "FAILED: %s; expected one step of %llu samples, each once, from configs that agree\n",
        r.message.c_str(), static_cast<unsigned long long>(samples));
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
