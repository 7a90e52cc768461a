// The soak suite's Pipeline part (see soak_test.cpp): micro-batches exactly once at volume
// through Pipeline inference (2 producers x 2 replicas of 2 stages), and the fault-injection
// trials of Pipeline inference and training.
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace soak {

namespace {

// Pipeline inference: a micro-batch of kSamples samples carries its producer and sequence
// in its indices; stage 0 checks the data against them, the last stage answers with the
// micro-batch's producer and sequence (exact in a float below 2^24).
constexpr std::size_t kSamples = 256;

class Check final : public Stage {
 public:
  std::string name() const override { return "check"; }
  std::size_t output_elements() const override { return 3; }
  void forward(const StageContext& ctx, ForwardArgs& a) override {
    if (ctx.stage == 0) {
      const auto x = a.batch.data.as<float>();
      double sum = 0;
      for (std::size_t i = 0; i < kSamples; ++i) {
        if (x[i] != static_cast<float>(a.batch.indices[i] % 1000))
          throw std::runtime_error("data and indices disagree");
        sum += x[i];
      }
      const std::uint64_t first = a.batch.indices[0];
      a.output[0] = static_cast<float>(first >> 40);  // producer
      a.output[1] =
          static_cast<float>((first & ((std::uint64_t{1} << 40) - 1)) / kSamples);  // sequence
      a.output[2] = static_cast<float>(sum);
      return;
    }
    for (std::size_t i = 0; i < 3; ++i) a.output[i] = a.input[i];
  }
};

// (stages, replicas) pairs that use exactly `devices` devices.
std::pair<std::uint32_t, std::uint32_t> pipeline_shape(Rng& rng, std::uint32_t devices) {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> shapes;
  for (std::uint32_t s = 1; s <= devices; ++s) {
    if (devices % s == 0) shapes.emplace_back(s, devices / s);
  }
  return shapes[rng.below(shapes.size())];
}

// Inference stage: stage 0 reads the micro-batch's id; every stage passes it on, and may
// throw on one id.
class Tag final : public Stage {
 public:
  explicit Tag(Seen* seen) : seen_(seen) {}
  std::string name() const override { return "tag"; }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext& ctx, ForwardArgs& a) override {
    const float id = ctx.stage == 0 ? static_cast<float>(a.batch.indices.front()) : a.input[0];
    if (fail_on.load() == static_cast<std::int64_t>(id)) throw std::runtime_error("injected fault");
    spin_for(work);
    if (last && seen_ != nullptr) seen_->add(static_cast<std::uint64_t>(id));
    a.output[0] = id;
  }
  std::atomic<std::int64_t> fail_on{-1};
  bool last = false;
  std::chrono::microseconds work{0};

 private:
  Seen* seen_;
};

Batch micro_batch(std::uint64_t id, std::size_t samples = 1, float value = 1.0f) {
  Batch b;
  b.data = Tensor(DType::kFloat32, {samples});
  for (float& x : b.data.as<float>()) x = value;
  b.labels.assign(samples, 0);
  b.indices.assign(samples, id);
  b.valid = samples;
  return b;
}

// Training stage: y = w x + b on one value per micro-batch; the last stage's loss is
// (y - 1)^2 / 2. Small enough to run many trials, real enough that replicas must agree.
class Affine final : public Stage {
 public:
  Affine(bool last, float w) : last_(last), p_{w, 0.1f} {}
  std::string name() const override { return last_ ? "loss" : "affine"; }
  std::size_t output_elements() const override { return 1; }
  std::size_t gradient_elements() const override { return 2; }
  std::span<float> weights() override { return p_; }
  void forward(const StageContext& ctx, ForwardArgs& a) override {
    if (fail.load() && ctx.step == fail_step && ctx.micro_batch == fail_micro_batch &&
        ctx.replica == fail_replica) {
      throw std::runtime_error("injected fault");
    }
    spin_for(work);
    const float x = ctx.stage == 0 ? a.batch.data.as<float>()[0] : a.input[0];
    const float y = p_[0] * x + p_[1];
    a.output[0] = last_ ? 0.5f * (y - 1.0f) * (y - 1.0f) : y;
  }
  void backward(const StageContext& ctx, BackwardArgs& a) override {
    const float x = ctx.stage == 0 ? a.batch.data.as<float>()[0] : a.input[0];
    const float dy = last_ ? (p_[0] * x + p_[1] - 1.0f) : a.grad_output[0];
    if (!a.grad_input.empty()) a.grad_input[0] = dy * p_[0];
    a.gradients[0] = dy * x;
    a.gradients[1] = dy;
  }
  void update(const StageContext&, std::span<const float> g) override {
    p_[0] -= 0.01f * g[0];
    p_[1] -= 0.01f * g[1];
  }
  std::atomic<bool> fail{false};
  std::chrono::microseconds work{0};
  std::uint64_t fail_step = 0, fail_micro_batch = 0;
  std::uint32_t fail_replica = 0;

 private:
  bool last_;
  std::array<float, 2> p_;
};

}  // namespace

void soak_pipeline_inference(std::uint32_t producers, std::uint32_t replicas,
                             std::uint64_t elements) {
  constexpr std::uint32_t kStages = 2;
  const std::uint64_t per_producer = (elements + kSamples * producers - 1) /
                                     (kSamples * producers);  // at least `elements` samples
  const std::uint64_t total = per_producer * producers;
  const auto t0 = Clock::now();
  PipelineConfig cfg;
  cfg.training = false;
  cfg.replicas = replicas;
  DeviceGroup group(cfg.devices_needed(kStages), kSmall);
  Pipeline pipe(group, cfg, [](std::uint32_t) {
    StageList l;
    for (std::uint32_t s = 0; s < kStages; ++s) l.push_back(std::make_unique<Check>());
    return l;
  });
  InfeedQueue<Batch> infeed(InfeedConfig{replicas, 64, 4});
  OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{replicas, OutputMode::all(), 0});
  std::vector<std::thread> threads;
  std::atomic<std::uint32_t> finished{0};
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      auto producer = infeed.make_producer();
      for (std::uint64_t s = 0; s < per_producer; ++s) {
        Batch b;
        b.data = Tensor(DType::kFloat32, {kSamples});
        auto x = b.data.as<float>();
        b.labels.assign(kSamples, 0);
        b.indices.resize(kSamples);
        for (std::size_t i = 0; i < kSamples; ++i) {
          b.indices[i] = (std::uint64_t{p} << 40) | (s * kSamples + i);
          x[i] = static_cast<float>(b.indices[i] % 1000);
        }
        b.valid = kSamples;
        if (!producer.push(std::move(b))) break;
      }
      if (++finished == producers) infeed.close();
    });
  }
  Arrivals arrivals(producers, per_producer);
  std::uint64_t received = 0, disorder = 0, bad_sum = 0;
  std::vector<std::array<std::uint64_t, kMaxProducers>> next(replicas);
  std::atomic<bool> done{false};
  std::thread reader([&] {
    const auto take = [&](const OutfeedEntry<std::vector<float>>& e) {
      const auto p = static_cast<std::uint32_t>(e.value.at(0));
      const auto s = static_cast<std::uint64_t>(e.value.at(1));
      arrivals.arrive(p, s);
      if (p < kMaxProducers && e.replica < replicas) {
        if (s < next[e.replica][p]) ++disorder;
        next[e.replica][p] = s + 1;
      }
      double want = 0;  // the data's sum: (index % 1000) over the micro-batch's samples
      for (std::size_t i = 0; i < kSamples; ++i) {
        want += static_cast<double>(((std::uint64_t{p} << 40) | (s * kSamples + i)) % 1000);
      }
      if (static_cast<double>(e.value.at(2)) != static_cast<double>(static_cast<float>(want)))
        ++bad_sum;
      ++received;
    };
    while (!done.load()) {
      if (auto e = outfeed.try_pop()) {
        take(*e);
      } else {
        std::this_thread::sleep_for(50us);
      }
    }
    for (const auto& e : outfeed.drain()) take(e);
  });
  const PipelineResult r = pipe.run(infeed, std::uint64_t{1} << 40, &outfeed);
  done = true;
  reader.join();
  for (auto& t : threads) t.join();
  CHECK(r.status == RunStatus::kEndOfData);
  CHECK(r.micro_batches == total);
  CHECK(received == total);
  CHECK(arrivals.missing() == 0);
  CHECK(arrivals.duplicates() == 0);
  CHECK(arrivals.foreign() == 0);
  CHECK(disorder == 0);
  CHECK(bad_sum == 0);
  const bool ok = r.status == RunStatus::kEndOfData && r.micro_batches == total &&
                  received == total && arrivals.missing() == 0 && arrivals.duplicates() == 0 &&
                  arrivals.foreign() == 0 && disorder == 0 && bad_sum == 0;
  std::printf(
      "soak: Pipeline inference, %u producers x %u replicas x %u stages: %llu micro-batches (%llu "
      "samples): "
      "%s (%.1f s)\n",
      producers, replicas, kStages, static_cast<unsigned long long>(total),
      static_cast<unsigned long long>(total * kSamples),
      ok ? "exactly once, in order, sums right" : "FAILED (see above)", seconds_since(t0));
}

void pipeline_inference_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const auto shape = pipeline_shape(rng, group.size());
  const std::uint32_t stages = shape.first, replicas = shape.second;
  PipelineConfig cfg;
  cfg.training = false;
  cfg.replicas = replicas;
  cfg.sync = rng.coin() ? SyncMode::kBsp : SyncMode::kDataflow;
  cfg.gradient_accumulation = static_cast<std::uint32_t>(rng.in(1, 3));
  const std::uint64_t total = rng.in(10, 200);
  const std::chrono::microseconds work = micros(rng, 30);  // per micro-batch and stage
  Seen answered(total);                                    // counted at the last stage
  Pipeline pipe(group, cfg, [&](std::uint32_t) {
    StageList l;
    for (std::uint32_t s = 0; s < stages; ++s) {
      auto tag = std::make_unique<Tag>(&answered);
      tag->last = s + 1 == stages;
      tag->work = work;
      l.push_back(std::move(tag));
    }
    return l;
  });
  const bool throws = t.fault == Fault::kThrow;
  const std::uint64_t fail_id = rng.below(total);
  const auto fail_stage = static_cast<std::uint32_t>(rng.below(stages));
  if (throws) {
    for (std::uint32_t r = 0; r < replicas; ++r) {
      static_cast<Tag&>(pipe.stage(r, fail_stage)).fail_on = static_cast<std::int64_t>(fail_id);
    }
  }
  const auto prefetch = static_cast<std::uint32_t>(rng.in(1, 4));
  InfeedQueue<Batch> in(InfeedConfig{replicas, rng.in(prefetch, 32), prefetch});
  const std::size_t out_capacity = t.fault == Fault::kReaderStops ? rng.in(1, 8) : 0;
  OutfeedQueue<std::vector<float>> out(outfeed_config(replicas, out_capacity, rng));
  std::atomic<std::uint64_t> pushed{0};
  const Closing closing = closing_for(rng, t, total);
  std::thread producer =
      produce(in, closing.push, pushed, [](std::uint64_t i) { return micro_batch(i); });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  // Stopped through the run's token (see engine_trial).
  Stopper stopper = stopper_for(rng, t);
  auto running = std::async(std::launch::async, [&] {
    return pipe.run(in, std::uint64_t{1} << 40, &out, stopper.token());
  });
  const auto ended_within = [&](auto d) {
    return running.wait_for(d) == std::future_status::ready;
  };
  const std::vector<OutfeedEntry<std::vector<float>>> read = stop_fault(
      rng, t, out, 5000, 12, ended_within, [&] { stopper.source.request_stop(); }, stopper);
  std::optional<PipelineResult> r;
  bool threw = false;
  try {
    r = running.get();
  } catch (const StageError& e) {
    threw = true;
    CHECK(throws);
    CHECK(e.stage() == fail_stage);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "StageError at the injected stage";
  }
  // Under kThrow the run may end before the failing micro-batch reaches the stage: never,
  // since the infeed holds it until it is taken; so a run that returns is a defect. The run
  // asks for 2^40 steps: it ends only by a stop or at the end of data.
  const Endings endings{{},
                        {{RunStatus::kCancelled, "cancelled"},
                         {RunStatus::kEndOfData, "ended (end of data) before the cancel"}},
                        {{RunStatus::kEndOfData, "end of data"}}};
  if (r) {
    check_ending(t, r->status, r->message, endings);
    if (stopper.before) check_stopped_before(t, r->status, {r->micro_batches});
  }
  if (closer.joinable()) closer.join();
  std::vector<std::uint64_t> ids;
  for (const auto& e : read) ids.push_back(static_cast<std::uint64_t>(e.value.at(0)));
  for (const auto& e : out.drain()) ids.push_back(static_cast<std::uint64_t>(e.value.at(0)));
  if (r) CHECK(ids.size() == r->micro_batches);  // every answer delivered (read, or still queued)
  // Same devices, a second run: the micro-batches that went back to the infeed and the rest.
  for (std::uint32_t rep = 0; rep < replicas; ++rep)
    static_cast<Tag&>(pipe.stage(rep, fail_stage)).fail_on = -1;
  OutfeedQueue<std::vector<float>> rest(OutfeedConfig{replicas, OutputMode::all(), 0});
  const PipelineResult r2 = pipe.run(in, std::uint64_t{1} << 40, &rest);
  producer.join();
  CHECK(r2.status == RunStatus::kEndOfData);
  std::uint64_t second = 0;
  for (const auto& e : rest.drain()) {
    ids.push_back(static_cast<std::uint64_t>(e.value.at(0)));
    ++second;
  }
  CHECK(second == r2.micro_batches);
  const std::uint64_t skip = threw ? fail_id : Seen::kNone;
  if (threw)
    CHECK(answered.count(fail_id) ==
          0);  // the one it threw on is not answered (the error names it)
  check_exactly_once(answered, pushed.load(), std::move(ids), threw ? 1 : 0, skip);
}

void pipeline_training_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const auto shape = pipeline_shape(rng, group.size());
  const std::uint32_t stages = shape.first, replicas = shape.second;
  PipelineConfig cfg;
  cfg.replicas = replicas;
  cfg.schedule = std::array{PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                            PipelineSchedule::kSequential}[rng.below(3)];
  cfg.sync = rng.coin() ? SyncMode::kBsp : SyncMode::kDataflow;
  cfg.gradient_accumulation =
      cfg.min_gradient_accumulation(stages) + static_cast<std::uint32_t>(rng.below(2));
  const std::uint32_t k = cfg.gradient_accumulation;
  const std::uint64_t steps = rng.in(2, 10);
  const std::chrono::microseconds work = micros(rng, 100);  // per forward pass
  Pipeline pipe(group, cfg, [&](std::uint32_t) {
    StageList l;
    for (std::uint32_t s = 0; s < stages; ++s) {
      auto stage = std::make_unique<Affine>(s + 1 == stages, 0.5f + 0.1f * static_cast<float>(s));
      stage->work = work;
      l.push_back(std::move(stage));
    }
    return l;
  });
  const bool throws = t.fault == Fault::kThrow;
  const auto fail_stage = static_cast<std::uint32_t>(rng.below(stages));
  const std::uint64_t fail_step = rng.below(steps);
  const auto fail_replica = static_cast<std::uint32_t>(rng.below(replicas));
  if (throws) {
    auto& s = static_cast<Affine&>(pipe.stage(fail_replica, fail_stage));
    s.fail_step = fail_step;
    s.fail_micro_batch = rng.below(k);
    s.fail_replica = fail_replica;
    s.fail = true;
  }
  const std::uint64_t total = steps * k * replicas;
  const auto prefetch = static_cast<std::uint32_t>(rng.in(1, 4));
  InfeedQueue<Batch> in(InfeedConfig{replicas, std::max<std::uint64_t>(total, prefetch), prefetch});
  const std::size_t out_capacity = t.fault == Fault::kReaderStops ? rng.in(1, 8) : 0;
  OutfeedQueue<std::vector<float>> out(outfeed_config(replicas, out_capacity, rng));
  std::atomic<std::uint64_t> pushed{0};
  const Closing closing = closing_for(rng, t, total);
  std::thread producer = produce(in, closing.push, pushed, [](std::uint64_t i) {
    return micro_batch(i, 1, 0.25f + 0.01f * static_cast<float>(i % 7));
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  Stopper stopper = stopper_for(rng, t);  // (see engine_trial)
  auto running =
      std::async(std::launch::async, [&] { return pipe.run(in, steps, &out, stopper.token()); });
  const auto ended_within = [&](auto d) {
    return running.wait_for(d) == std::future_status::ready;
  };
  const std::vector<OutfeedEntry<std::vector<float>>> read = stop_fault(
      rng, t, out, 5000, 12, ended_within, [&] { stopper.source.request_stop(); }, stopper);
  std::optional<PipelineResult> r;
  try {
    r = running.get();
  } catch (const StageError& e) {
    CHECK(throws);
    CHECK(e.stage() == fail_stage);
    CHECK(e.replica() == fail_replica);
    CHECK(e.step() == fail_step);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "StageError at the injected stage and step";
  }
  producer.join();
  if (closer.joinable()) closer.join();
  if (r) {
    check_ending(t, r->status, r->message, kCountedRunEndings);
    if (stopper.before) check_stopped_before(t, r->status, {r->iterations, r->micro_batches});
    if (r->status == RunStatus::kEndOfData) {
      CHECK(r->iterations <= pushed.load() / (std::uint64_t{k} * replicas));
      CHECK(contains(r->message, "the infeed ended at step"));
    }
    CHECK(r->iterations <= steps);
    // Every micro-batch of every applied step answered (delivered, or still queued).
    const std::uint64_t outputs = read.size() + out.drain().size();
    CHECK(outputs >= r->iterations * k * replicas);
    CHECK(outputs <= pushed.load());
  }
  // Every replica applied the same updates, fault or not.
  for (std::uint32_t s = 0; s < stages; ++s) {
    const std::span<float> w0 = pipe.stage(0, s).weights();
    for (std::uint32_t rep = 1; rep < replicas; ++rep) {
      const std::span<float> w = pipe.stage(rep, s).weights();
      CHECK(std::equal(w0.begin(), w0.end(), w.begin(), w.end()));
    }
  }
  // The pipeline trains again, on the same devices: a whole run completes.
  static_cast<Affine&>(pipe.stage(fail_replica, fail_stage)).fail = false;
  const std::uint64_t again = 2;
  InfeedQueue<Batch> in2(InfeedConfig{replicas, again * k, 1});
  auto p2 = in2.make_producer();
  for (std::uint64_t i = 0; i < again * k * replicas; ++i)
    REQUIRE(p2.push(micro_batch(i, 1, 0.5f)));
  in2.close();
  OutfeedQueue<std::vector<float>> out2(OutfeedConfig{replicas, OutputMode::all(), 0});
  const PipelineResult r2 = pipe.run(in2, again, &out2);
  CHECK(r2.completed());
  CHECK(r2.iterations == again);
  CHECK(out2.drain().size() == again * k * replicas);
}

}  // namespace soak
