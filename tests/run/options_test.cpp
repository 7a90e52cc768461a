// runtime/: Options (bspflow/run/options.hpp): each bad value an error naming the option,
// the cross-option rules, samples per step, the feed configs it makes.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>

#include <bspflow/bspflow.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("options");

TEST_CASE("options: each bad value is an error naming the option, the value and what is allowed") {
  Options o;
  CHECK(contains(error_of([&] { o.device_iterations(0); }), "device_iterations = 0"));
  CHECK(contains(error_of([&] { o.replicas(0); }),
                 "replicas = 0 is not allowed: must be in 1..1024"));
  CHECK(contains(error_of([&] { o.gradient_accumulation(0); }), "gradient_accumulation = 0"));
  CHECK(contains(error_of([&] { o.prefetch_depth(0); }),
                 "prefetch_depth = 0 is not allowed: must be in 1..255"));
  CHECK(contains(error_of([&] { o.prefetch_depth(256); }), "1..255"));
  CHECK(contains(error_of([&] { o.io_tiles(3); }), "io_tiles = 3"));
  CHECK(contains(error_of([&] { o.tiles(0); }), "tiles = 0"));
  CHECK(contains(error_of([&] { o.bytes_per_tile(1); }), "bytes_per_tile = 1"));
  CHECK(contains(error_of([&] { o.infeed_capacity(0); }), "infeed_capacity = 0"));
  // Cross-option rules are checked by validate() and by the config getters.
  o.tiles(32).io_tiles(32);
  CHECK(contains(error_of([&] { o.validate(); }),
                 "io_tiles = 32 is not allowed: must be below tiles (32)"));
  o.io_tiles(16);
  o.prefetch_depth(8).infeed_capacity(4);
  CHECK(contains(error_of([&] { (void)o.infeed_config(); }), "infeed_capacity = 4"));
  o.infeed_capacity(8);
  CHECK(error_of([&] { o.validate(); }) == "<no error>");
  CHECK(contains(o.describe(), "prefetch_depth = 8"));
}

TEST_CASE("options: samples per step = micro-batch x iterations x accumulation x replicas") {
  Options o;
  o.device_iterations(10).gradient_accumulation(4).replicas(2);
  CHECK(o.samples_per_step(16) == 16 * 10 * 4 * 2);
  CHECK(contains(error_of([&] { (void)o.samples_per_step(0); }), "micro_batch = 0"));
  o.device_iterations(std::numeric_limits<std::uint64_t>::max() / 2);
  CHECK(contains(error_of([&] { (void)o.samples_per_step(16); }), "overflows"));
  const InfeedConfig in = Options().replicas(3).prefetch_depth(2).infeed_config();
  CHECK(in.replicas == 3);
  CHECK(in.prefetch_depth == 2);
  const OutfeedConfig out = Options().output_mode(OutputMode::every_n(5)).outfeed_config();
  CHECK(out.mode == OutputMode::every_n(5));
}

TEST_CASE("options: every config derives from Options, the host side as one HostIO") {
  Options o;
  o.prefetch_depth(3).io_tiles(8).synthetic_data(true).host_link(
      LinkModel{2e9, std::chrono::microseconds(3)});
  o.replicas(2).gradient_accumulation(7).tiles(64).bytes_per_tile(4096).pin(false);
  const HostIO io = o.host_io();
  CHECK(io.prefetch_depth == 3);
  CHECK(io.io_tiles == 8);
  CHECK(io.synthetic_data);
  CHECK(io.host_link.bytes_per_second == 2e9);
  const EngineConfig e = EngineConfig::from(o);
  CHECK(static_cast<const HostIO&>(e).io_tiles == 8);
  CHECK(e.prefetch_depth == 3);
  CHECK(e.synthetic_data);
  CHECK(e.synthetic_fill == SyntheticFill::kRandomNormal);
  const PipelineConfig p = PipelineConfig::from(o);
  CHECK(p.io_tiles == 8);
  CHECK(p.prefetch_depth == 3);
  CHECK(p.synthetic_data);
  CHECK(p.replicas == 2);
  CHECK(p.gradient_accumulation == 7);
  CHECK(o.infeed_config().prefetch_depth == io.prefetch_depth);
  const DeviceConfig d = o.device_config();
  CHECK(d.tiles == 64);
  CHECK(d.bytes_per_tile == 4096);
  CHECK_FALSE(d.pin);
  // Each config checks what it derives: io_tiles must stay below the tiles.
  o.tiles(8);
  CHECK(contains(error_of([&] { (void)o.host_io(); }),
                 "io_tiles = 8 is not allowed: must be below tiles (8)"));
  CHECK(contains(error_of([&] { (void)PipelineConfig::from(o); }), "must be below tiles (8)"));
  // HostIO checks its own fields.
  HostIO bad;
  bad.prefetch_depth = 0;
  CHECK(contains(error_of([&] { bad.validate(); }),
                 "prefetch_depth = 0 is not allowed: must be in 1..255"));
  bad.prefetch_depth = 1;
  bad.io_tiles = 3;
  CHECK(contains(error_of([&] { bad.validate(); }), "io_tiles = 3"));
}

TEST_CASE("options: one run shape for the pipeline, its feeds and its loader") {
  Options o;
  o.device_iterations(3).gradient_accumulation(5).replicas(2).infeed_capacity(30).prefetch_depth(2);
  o.output_mode(OutputMode::final()).outfeed_capacity(0);
  const PipelineConfig p = PipelineConfig::from(o);
  CHECK(p.replicas == 2);
  CHECK(p.gradient_accumulation == 5);
  CHECK(p.training);  // everything else keeps its default
  CHECK(p.schedule == PipelineConfig{}.schedule);
  const InfeedConfig in = o.infeed_config();
  CHECK(in.replicas == p.replicas);
  CHECK(in.capacity == 30);
  const OutfeedConfig out = o.outfeed_config();
  CHECK(out.replicas == p.replicas);
  CHECK(out.mode == OutputMode::final());
  CHECK(out.capacity == 0);
  // The loader fills steps of micro-batch x device iterations x accumulation x replicas.
  SyntheticDataset::Config dc;
  dc.size = 300;
  dc.spec = SampleSpec{DType::kFloat32, {4}};
  const SyntheticDataset data(dc);
  LoaderConfig lc;
  lc.batch_size = 2;
  DataLoader loader(o, data, lc);
  CHECK(loader.plan().samples_per_step() == o.samples_per_step(2));  // 2 x 3 x 5 x 2 = 60
  CHECK(loader.steps() == 300 / 60);
  // A bad shape is refused where it is built, naming the option.
  Options bad;
  bad.prefetch_depth(4).infeed_capacity(2);
  CHECK(contains(error_of([&] { (void)PipelineConfig::from(bad); }), "infeed_capacity"));
}

TEST_CASE("options: precision reaches the pipeline config, and a bad one is refused") {
  Options o;
  CHECK(PipelineConfig::from(o).precision == Precision{});  // fp32 by default
  o.precision(Precision::half(128.0f));
  const PipelineConfig p = PipelineConfig::from(o);
  CHECK(p.precision.storage == DType::kFloat16);
  CHECK(p.precision.partials == DType::kFloat32);
  CHECK(p.precision.loss_scaling == 128.0f);
  CHECK(contains(o.describe(), "precision = storage fp16, partials fp32, loss scaling 128"));
  const std::string why = error_of([&] {
    o.precision(Precision{DType::kFloat16, DType::kFloat16, -1.0f});
  });
  CHECK(contains(why, "precision.loss_scaling = -1"));
  CHECK(o.precision().loss_scaling == 128.0f);  // not stored
}

TEST_CASE("options: I/O tiles, prefetch depth and synthetic data reach the pipeline config") {
  Options o;
  o.io_tiles(32).prefetch_depth(3).infeed_capacity(8).synthetic_data(true);
  const PipelineConfig p = PipelineConfig::from(o);
  CHECK(p.io_tiles == 32);
  CHECK(p.prefetch_depth == 3);
  CHECK(p.synthetic_data);
  const PipelineConfig d = PipelineConfig::from(Options{});
  CHECK(d.io_tiles == 0);
  CHECK(d.prefetch_depth == Options{}.prefetch_depth());
  CHECK_FALSE(d.synthetic_data);
}

TEST_CASE("options: one client thread each side, said once") {
  Options o;
  CHECK(o.infeed_config().producer_type == ProducerType::kMulti);  // defaults: shared
  CHECK(o.outfeed_config().consumer_type == ConsumerType::kMulti);
  o.producer_type(ProducerType::kSingle).consumer_type(ConsumerType::kSingle).outfeed_capacity(64);
  CHECK(o.infeed_config().producer_type == ProducerType::kSingle);
  const OutfeedConfig out = o.outfeed_config();
  CHECK(out.consumer_type == ConsumerType::kSingle);
  CHECK(out.capacity == 64);
  CHECK(contains(o.describe(), "producer_type = single"));
  CHECK(contains(o.describe(), "consumer_type = single"));
  CHECK(o.producer_type() == ProducerType::kSingle);
  CHECK(o.consumer_type() == ConsumerType::kSingle);
  // The queues they build behave as said: a second producer is refused.
  InfeedQueue<int> in(o.infeed_config());
  auto first = in.make_producer();
  CHECK(contains(error_of([&] { auto second = in.make_producer(); }), "ProducerType::kSingle"));
  // A ring needs a bound.
  o.outfeed_capacity(0);
  const std::string why = error_of([&] { o.validate(); });
  CHECK(contains(why, "outfeed_capacity = 0"));
  CHECK(contains(why, "ConsumerType::kMulti"));
}

TEST_CASE("a loop given the run's Options takes its host side, and refuses gradient accumulation") {
  DeviceGroup devices(1, DeviceConfig{64, 16 * 1024});
  Options opts;
  opts.device_iterations(5).synthetic_data(true);
  InfeedQueue<int> in(opts.infeed_config());
  in.make_producer().push(3);
  auto r = loops::repeat(
      devices, opts.device_iterations(), [](int& s, int x) { s += x; }, 0, in, opts);
  CHECK(r.completed());
  CHECK(r.state(0) == 15);  // synthetic data: the one element stands for every iteration
  opts.gradient_accumulation(4);
  const std::string why = error_of([&] {
    (void)loops::repeat(
        devices, opts.device_iterations(), [](int& s, int x) { s += x; }, 0, in, opts);
  });
  CHECK(contains(why, "loops::repeat: Options gradient_accumulation = 4"));
  CHECK(contains(why, "must be 1 for a loop"));
}

TEST_SUITE_END();
