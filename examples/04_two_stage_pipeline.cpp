// 04_two_stage_pipeline: training a model split into two stages on two emulated devices.
//
// The model is y = w x + b, learnt from samples of y = 3x - 1 (the targets travel as the
// batches' integer labels). Stage 0 (device 0) computes w x; stage 1 (device 1) adds b and
// the squared-error loss. A Stage is yours: forward pass, backward pass (this micro-batch's
// gradients) and update (here plain SGD). The Pipeline runs them with the Grouped schedule,
// sums gradients over 4 micro-batches, averages them and calls update once per step.
// The host checks that w and b reach 3 and -1.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string_view>
#include <vector>

#include <bspflow/bspflow.hpp>

using namespace bspflow;
constexpr std::size_t kBatch = 4;  // samples per micro-batch
constexpr float kLearningRate = 0.05f;

struct Scale final : Stage {  // stage 0: output = w x
  float w = 0;
  std::string name() const override { return "scale"; }
  std::size_t output_elements() const override { return kBatch; }
  std::size_t gradient_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    for (std::size_t i = 0; i < kBatch; ++i) a.output[i] = w * a.batch.data.as<float>()[i];
  }
  void backward(const StageContext&, BackwardArgs& a) override {  // d loss / d w
    for (std::size_t i = 0; i < kBatch; ++i)
      a.gradients[0] += a.grad_output[i] * a.batch.data.as<float>()[i];
  }
  void update(const StageContext&, std::span<const float> g) override { w -= kLearningRate * g[0]; }
};

struct BiasLoss final : Stage {  // stage 1: output = mean of (input + b - label)^2, to the outfeed
  float b = 0;
  std::string name() const override { return "bias+loss"; }
  std::size_t output_elements() const override { return 1; }
  std::size_t gradient_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    a.saved.assign(kBatch, 0.0f);  // the errors, kept for the backward pass
    a.output[0] = 0;
    for (std::size_t i = 0; i < kBatch; ++i) {
      a.saved[i] = a.input[i] + b - static_cast<float>(a.batch.labels[i]);
      a.output[0] += a.saved[i] * a.saved[i] / kBatch;
    }
  }
  void backward(const StageContext&, BackwardArgs& a) override {
    for (std::size_t i = 0; i < kBatch; ++i) {
      a.grad_input[i] = 2 * a.saved[i] / kBatch;  // d loss / d input: sent back to stage 0
      a.gradients[0] += a.grad_input[i];          // d loss / d b
    }
  }
  void update(const StageContext&, std::span<const float> g) override { b -= kLearningRate * g[0]; }
};

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 04_two_stage_pipeline\n  no options: trains, checks the weights, exits 0 if "
          "right");
      return 0;
    }
    std::fprintf(stderr, "04_two_stage_pipeline: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  PipelineConfig cfg;  // pipelined, Grouped schedule, bsp sync, training
  cfg.gradient_accumulation =
      4;  // micro-batches per weight update (Grouped needs >= 3 for 2 stages)
  DeviceGroup devices(cfg.devices_needed(2));
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    StageList stages;
    stages.push_back(std::make_unique<Scale>());
    stages.push_back(std::make_unique<BiasLoss>());
    return stages;
  });
  constexpr std::uint64_t kSteps = 200;  // weight updates, all in one host call
  const std::uint64_t k = cfg.gradient_accumulation;
  InfeedQueue<Batch> infeed(InfeedConfig{1, kSteps * k, 2});
  OutfeedQueue<std::vector<float>> outfeed(
      OutfeedConfig{1, OutputMode::all(), 0});  // a loss per micro-batch
  auto producer = infeed.make_producer();
  for (std::uint64_t m = 0; m < kSteps * k; ++m) {  // micro-batch m: x in -2..2, label 3x - 1
    Batch batch;
    batch.data = Tensor(DType::kFloat32, {kBatch, 1});
    for (std::size_t i = 0; i < kBatch; ++i) {
      const int x = static_cast<int>((m * kBatch + i) % 5) - 2;
      batch.data.as<float>()[i] = static_cast<float>(x);
      batch.labels.push_back(3 * x - 1);
    }
    batch.valid = kBatch;
    producer.push(std::move(batch));
  }
  const PipelineResult r = pipe.run(infeed, kSteps, &outfeed);
  std::vector<double> loss(kSteps);  // per step: the mean over its micro-batches
  for (const auto& e : outfeed.drain())
    loss[e.iteration / k] += e.value[0] / static_cast<double>(k);
  const float w = static_cast<Scale&>(pipe.stage(0, 0)).w,
              b = static_cast<BiasLoss&>(pipe.stage(0, 1)).b;
  std::printf("%s: %llu steps, %llu micro-batches in %.1f ms\n", to_string(r.status),
              static_cast<unsigned long long>(r.iterations),
              static_cast<unsigned long long>(r.micro_batches),
              static_cast<double>(r.elapsed.count()) / 1e6);
  for (std::uint64_t s : {1, 10, 50, 100, 200}) {
    std::printf("  step %3llu: mean loss %.3g\n", static_cast<unsigned long long>(s), loss[s - 1]);
  }
  std::printf("learnt y = %.5f x %+.5f\n", static_cast<double>(w), static_cast<double>(b));
  if (!r.completed() || r.iterations != kSteps || std::fabs(w - 3) > 1e-3f ||
      std::fabs(b + 1) > 1e-3f) {
    std::fprintf(stderr, "FAILED: %s; expected y = 3 x - 1 after %llu steps\n", r.message.c_str(),
                 static_cast<unsigned long long>(kSteps));
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
