// The soak suite's Engine part (see soak_test.cpp): the fault-injection trial of Engine
// programs (StreamCopy in, Execute, an optional Sync, StreamCopy out, with or without I/O
// tiles).
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace soak {

void engine_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const std::uint32_t d = group.size();
  constexpr std::size_t kElements = 16;
  const std::uint64_t n = rng.in(10, 150);
  const std::uint64_t total = n * d;
  EngineConfig config;
  config.io_tiles = rng.coin() ? 0 : 4;
  config.prefetch_depth = static_cast<std::uint32_t>(rng.in(1, 3));
  Engine engine(group, config);
  InfeedQueue<Tensor> in(InfeedConfig{d, rng.in(1, 16), 1});
  const std::size_t out_capacity = t.fault == Fault::kReaderStops ? rng.in(1, 8) : 0;
  OutfeedQueue<Tensor> out(outfeed_config(d, out_capacity, rng));
  const bool with_sync = rng.coin();
  auto sync = std::make_shared<SyncGroup>(d);
  Seen seen(total);
  std::vector<std::atomic<std::uint64_t>> ok(d);
  const auto fail_device = static_cast<std::uint32_t>(rng.below(d));
  const std::uint64_t fail_at = rng.below(n);
  const bool throws = t.fault == Fault::kThrow;
  std::atomic<std::uint64_t> pushed{0};
  const Closing closing = closing_for(rng, t, total);
  std::thread producer = produce(in, closing.push, pushed, [](std::uint64_t i) {
    Tensor x(DType::kFloat32, {kElements});
    x.as<float>()[0] = static_cast<float>(i);
    return x;
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  const auto program_for = [&](std::uint32_t dev, std::uint64_t trips, OutfeedQueue<Tensor>& to,
                               bool fault_here, bool sync_here) {
    Buffer x = make_buffer(group[dev], "x", DType::kFloat32, kElements);
    program::Sequence body{program::StreamCopy(in, x),
                           program::Execute("work", [&, x, fault_here](const ComputeContext& c) {
                             const auto id = static_cast<std::uint64_t>(x->as<float>()[0]);
                             seen.add(id);
                             if (fault_here && c.iteration == fail_at)
                               throw std::runtime_error("injected fault");
                             ok[c.replica].fetch_add(1, std::memory_order_relaxed);
                             x->as<float>()[1] = static_cast<float>(id) + 0.5f;
                           })};
    if (sync_here) body.steps.push_back(program::Sync(sync));
    body.steps.push_back(program::StreamCopy(x, to));
    return Program(program::Repeat(trips, std::move(body)));
  };
  std::vector<Program> programs;
  for (std::uint32_t dev = 0; dev < d; ++dev)
    programs.push_back(program_for(dev, n, out, throws && dev == fail_device, with_sync));
  // Stopped through the run's token: a cancel() before the other thread has called run()
  // would reach no run (cancel() stops the run() call in progress only).
  Stopper stopper = stopper_for(rng, t);
  auto running =
      std::async(std::launch::async, [&] { return engine.run(programs, stopper.token()); });
  const auto ended_within = [&](auto d) {
    return running.wait_for(d) == std::future_status::ready;
  };
  const std::vector<OutfeedEntry<Tensor>> read = stop_fault(
      rng, t, out, 3000, 12, ended_within, [&] { stopper.source.request_stop(); }, stopper);
  std::optional<EngineResult> r;
  try {
    r = running.get();
  } catch (const DeviceError& e) {
    CHECK(throws);
    CHECK(e.device() == fail_device);
    CHECK(e.iteration() == fail_at);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "DeviceError at the injected place";
  }
  if (r) {
    check_ending(t, r->status, r->message, kCountedRunEndings);
    if (stopper.before) check_stopped_before(t, r->status, r->iterations);
  }
  if (closer.joinable()) closer.join();
  std::vector<std::uint64_t> delivered(d, 0);
  std::vector<std::uint64_t> ids;
  bool ordered = true, right = true;
  const auto take = [&](const OutfeedEntry<Tensor>& e) {
    ordered = ordered && e.replica < d && e.iteration == delivered[e.replica];
    if (e.replica < d) ++delivered[e.replica];
    const auto v = e.value.as<float>();
    right = right && v[1] == v[0] + 0.5f;
    ids.push_back(static_cast<std::uint64_t>(v[0]));
  };
  for (const auto& e : read) take(e);
  for (const auto& e : out.drain()) take(e);
  CHECK(ordered);
  // A trip the stop cut short (a failure on another device, a cancel, another device's end
  // of data reaching this one at a Sync) does not run its later steps: the element it took
  // is consumed, not delivered. At most one per device; the result counts finished trips.
  std::uint64_t cut = 0;
  for (std::uint32_t dev = 0; dev < d; ++dev) {
    CHECK(ok[dev].load() >= delivered[dev]);
    CHECK(ok[dev].load() <= delivered[dev] + 1);
    if (r) CHECK(r->iterations[dev] == delivered[dev]);
    cut += ok[dev].load() - delivered[dev];
  }
  // Same devices, a second run without syncs (lanes may hold different counts) takes the rest.
  std::fill(ok.begin(), ok.end(), 0);
  OutfeedQueue<Tensor> rest(OutfeedConfig{d, OutputMode::all(), 0});
  std::vector<Program> drain;
  for (std::uint32_t dev = 0; dev < d; ++dev)
    drain.push_back(program_for(dev, std::uint64_t{1} << 40, rest, false, false));
  const EngineResult r2 = engine.run(drain);
  producer.join();
  CHECK(r2.status == RunStatus::kEndOfData);
  std::fill(delivered.begin(), delivered.end(), 0);
  for (const auto& e : rest.drain()) take(e);
  CHECK(ordered);
  CHECK(right);
  for (std::uint32_t dev = 0; dev < d; ++dev) CHECK(delivered[dev] == ok[dev].load());
  check_exactly_once(seen, pushed.load(), std::move(ids), cut + (throws ? 1 : 0));
  if (cut != 0) t.outcome += ", a trip cut short";
}

}  // namespace soak
