// runtime/: when a run cannot make progress (bspflow/run/stall.hpp): a loop on an empty
// open infeed, a loop whose bounded outfeed nobody reads, Engine devices at a Sync one of them
// will never reach, a Pipeline short of input: each says once what every device waits for, and
// with OnStall::kFail ends with StallError. A device that computes is never taken for stalled.
// Nothing here is timed: a stall check with a short limit (20 ms) fires eventually, and each
// test waits for it under a guard (a run that never reports is cancelled after 10 s and the
// test fails).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "pipeline/dense_stage.hpp"
#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using test::kSmall;

namespace {

constexpr std::chrono::nanoseconds kLimit = 20ms;

// Collects the stall reports logged while it lives (other warnings pass through unseen).
class Reports {
 public:
  Reports() {
    set_log_handler([this](LogLevel level, std::string_view message) {
      if (level != LogLevel::kWarning ||
          message.find("no device has made progress") == std::string_view::npos)
        return;
      std::lock_guard lock(m_);
      seen_.emplace_back(message);
    });
  }
  ~Reports() { set_log_handler({}); }
  std::vector<std::string> seen() const {
    std::lock_guard lock(m_);
    return seen_;
  }
  // Waits for the first report (never timed: `guard` ends a run that never stalls).
  std::string first(const test::Rescue& guard) const {
    while (!guard.fired()) {
      if (auto s = seen(); !s.empty()) return s.front();
      std::this_thread::yield();
    }
    return "<no stall reported>";
  }

 private:
  mutable std::mutex m_;
  std::vector<std::string> seen_;
};

// A micro-batch for test::Dense(5, ...) stages: kDenseBatch rows of 5 values.
Batch dense_batch(std::uint64_t m) {
  Batch b;
  b.data = Tensor(DType::kFloat32, {test::kDenseBatch, 5});
  for (float& x : b.data.as<float>()) x = 0.1f * static_cast<float>(m % 7);
  for (std::size_t i = 0; i < test::kDenseBatch; ++i) {
    b.labels.push_back(static_cast<std::int32_t>((m + i) % 3));
  }
  b.valid = test::kDenseBatch;
  return b;
}

}  // namespace

TEST_SUITE_BEGIN("stall");

TEST_CASE("a loop on an empty infeed nobody closes says once what each device waits for") {
  Reports reports;
  DeviceGroup pair(2, kSmall);
  InfeedQueue<int> in(InfeedConfig{2, 8, 1});  // never fed, never closed
  auto run = loops::repeat_async(
      pair, 1000, [](int&, int&) {}, 0, in, StallCheck{kLimit, OnStall::kLog});
  test::Rescue guard(10s, [&] { run.cancel(); });
  const std::string report = reports.first(guard);
  CHECK_FALSE(guard.fired());
  CAPTURE(report);
  CHECK(report.rfind("loops::repeat: no device has made progress for 20 ms (StallCheck::limit): ",
                     0) == 0);
  CHECK(contains(report, "device " + std::to_string(pair[0].id()) +
                             " (replica 0) waits for an element of the infeed's lane 0 (empty, "
                             "not closed)"));
  CHECK(contains(report, "device " + std::to_string(pair[1].id()) +
                             " (replica 1) waits for an element of the infeed's lane 1 (empty, "
                             "not closed)"));
  CHECK(contains(report, "Push to the infeed or close it, or cancel the run"));
  // OnStall::kLog: the run goes on, and feeding it makes progress again.
  CHECK_FALSE(run.ready());
  run.cancel();
  CHECK(run.get().status == RunStatus::kCancelled);
  CHECK(reports.seen().size() == 1);  // once per run
}

TEST_CASE("a loop whose bounded outfeed nobody reads ends with StallError (OnStall::kFail)") {
  Reports reports;
  Device device(0, kSmall);
  OutfeedQueue<int> out(OutfeedConfig{1, OutputMode::all(), 4});
  auto run = loops::repeat_async(
      device, std::uint64_t{1} << 40, [](int& s) { return s++; }, 0, out,
      StallCheck{kLimit, OnStall::kFail});
  test::Rescue guard(10s, [&] { run.cancel(); });
  try {
    (void)run.get();
    FAIL("no StallError");
  } catch (const StallError& e) {
    CAPTURE(std::string(e.what()));
    CHECK(
        contains(e.what(), "device 0 (replica 0) waits for room in the outfeed (4 of 4 entries)"));
    CHECK(contains(e.what(), "Read the outfeed, or cancel the run"));
    CHECK(contains(e.what(), "(OnStall::kFail: the run ends with StallError)"));
    REQUIRE(e.waits().size() == 1);
    CHECK(e.waits()[0].device == 0);
    CHECK(e.waits()[0].replica == 0);
    CHECK(e.waits()[0].waits_for == "room in the outfeed (4 of 4 entries)");
  }
  CHECK_FALSE(guard.fired());
  CHECK(reports.seen().size() == 1);
  CHECK(out.drain().size() >= 4);  // what the device wrote is still there
  // The device is idle again: the next loop runs.
  CHECK(loops::repeat(
            device, 2, [](int& s) { ++s; }, 0)
            .completed());
}

TEST_CASE("a loop given the run's Options takes its stall check from them") {
  // Options::run_stall_limit()/on_stall() reach a loop that takes the Options as a feed (its host
  // side comes from them too); a loop takes its stall check once, so the Options and a
  // StallCheck together do not compile.
  Reports reports;
  Device device(0, kSmall);
  OutfeedQueue<int> out(OutfeedConfig{1, OutputMode::all(), 4});
  const Options opts = Options().run_stall_limit(kLimit).on_stall(OnStall::kFail);
  auto run = loops::repeat_async(
      device, std::uint64_t{1} << 40, [](int& s) { return s++; }, 0, out, opts);
  test::Rescue guard(10s, [&] { run.cancel(); });
  CHECK_THROWS_AS((void)run.get(), StallError);
  CHECK_FALSE(guard.fired());
  CHECK(reports.seen().size() == 1);
  (void)out.drain();
}

TEST_CASE("Engine: devices at a Sync another device will never reach; the Engine runs again") {
  Reports reports;
  DeviceGroup pair(2, kSmall);
  EngineConfig config;
  config.stall = {kLimit, OnStall::kFail};
  Engine engine(pair, config);
  auto group = std::make_shared<SyncGroup>(2);
  // Device 0 syncs twice, device 1 once and ends: device 0 waits at its second Sync for ever.
  const Program p0 = program::Repeat(2, program::Sync(group));
  const Program p1 = program::Sync(group);
  test::Rescue guard(10s, [&] { engine.cancel(); });
  try {
    (void)engine.run({p0, p1});
    FAIL("no StallError");
  } catch (const StallError& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.rfind("Engine::run: no device has made progress for 20 ms", 0) == 0);
    CHECK(contains(what, "device " + std::to_string(pair[0].id()) +
                             " (replica 0) waits for the other devices of a sync group of 2 (1 "
                             "of 2 arrived)"));
    CHECK(contains(what, "device " + std::to_string(pair[1].id()) + " (replica 1) has ended"));
    CHECK(contains(what,
                   "Let every device of a sync group reach its Sync (one that has ended "
                   "never will), or cancel the run"));
    REQUIRE(e.waits().size() == 2);
    CHECK(e.waits()[0].waits_for == "the other devices of a sync group of 2 (1 of 2 arrived)");
    CHECK(e.waits()[1].waits_for == "nothing: it has ended");
  }
  CHECK_FALSE(guard.fired());
  CHECK(engine.run({p1, p1}).completed());
}

TEST_CASE("Pipeline: training short of input ends with StallError; inference gives back") {
  Reports reports;
  const std::uint32_t n = 2, k = 3;
  for (const bool training : {true, false}) {
    CAPTURE(training);
    PipelineConfig cfg;
    cfg.training = training;
    cfg.gradient_accumulation = k;
    cfg.stall = {kLimit, OnStall::kFail};
    DeviceGroup devices(cfg.devices_needed(n), kSmall);
    Pipeline pipe(devices, cfg, [](std::uint32_t) {
      StageList l;
      l.push_back(std::make_unique<test::Dense>(5, 4, false, 0.0f));
      l.push_back(std::make_unique<test::Dense>(4, 3, true, 1.0f));
      return l;
    });
    InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < k - 1; ++i) REQUIRE(p.push(dense_batch(i)));  // short
    test::Rescue guard(10s, [&] { pipe.cancel(); });
    try {
      (void)pipe.run(infeed, 1);
      FAIL("no StallError");
    } catch (const StallError& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.rfind("Pipeline::run: no device has made progress", 0) == 0);
      CHECK(contains(what,
                     "(stage 0 of replica 0) waits for an element of the infeed's lane 0 "
                     "(empty, not closed)"));
      CHECK(contains(what,
                     "(stage 1 of replica 0) waits for the other devices of a sync "
                     "group of 2 (1 of 2 arrived). Push to the infeed or close it, or "
                     "cancel the run"));
    }
    CHECK_FALSE(guard.fired());
    // Training consumed what it took (the step cut short is not applied); inference had
    // answered both and waited for more: nothing was left in flight to give back.
    CHECK(infeed.size_approx(0) == 0);
    for (std::uint64_t i = 0; i < k + 1; ++i) REQUIRE(p.push(dense_batch(i)));
    infeed.close();
    const PipelineResult next = pipe.run(infeed, 1);
    CHECK((training ? next.completed() : next.status == RunStatus::kCompleted));
  }
}

TEST_CASE("Pipeline inference stalled on an outfeed nobody reads gives back what is in flight") {
  // The last stage waits for room in an outfeed of 1; stage 0 keeps taking requests until
  // the pipeline is full, then waits at the sync. The run ends with StallError, and every
  // request is either in the outfeed (answered) or back in the infeed, once.
  Reports reports;
  PipelineConfig cfg;
  cfg.training = false;
  cfg.stall = {kLimit, OnStall::kFail};
  DeviceGroup devices(cfg.devices_needed(3), kSmall);
  Pipeline pipe(devices, cfg, [](std::uint32_t) {
    StageList l;
    l.push_back(std::make_unique<test::Dense>(5, 4, false, 0.0f));
    l.push_back(std::make_unique<test::Dense>(4, 4, false, 1.0f));
    l.push_back(std::make_unique<test::Dense>(4, 3, true, 2.0f));
    return l;
  });
  InfeedQueue<Batch> infeed(InfeedConfig{1, 64, 1});
  OutfeedQueue<std::vector<float>> outfeed(OutfeedConfig{1, OutputMode::all(), 1});
  const std::uint64_t pushed = 20;
  {
    auto p = infeed.make_producer();
    for (std::uint64_t i = 0; i < pushed; ++i) REQUIRE(p.push(dense_batch(i)));
  }
  test::Rescue guard(10s, [&] { pipe.cancel(); });
  std::string what;
  try {
    (void)pipe.run(infeed, pushed, &outfeed);
  } catch (const StallError& e) {
    what = e.what();
  }
  CHECK_FALSE(guard.fired());
  CAPTURE(what);
  CHECK(contains(what, "(stage 2 of replica 0) waits for room in the outfeed (1 of 1 entries)"));
  CHECK(contains(what, "Read the outfeed, or cancel the run"));
  const std::size_t answered = outfeed.drain().size();
  CHECK(answered >= 1);
  // What was in flight went back to the front of the lane: the next run answers the rest.
  infeed.close();
  OutfeedQueue<std::vector<float>> rest;
  const PipelineResult next = pipe.run(infeed, pushed, &rest);
  CHECK(next.status == RunStatus::kEndOfData);
  CHECK(rest.drain().size() == next.micro_batches);
  CHECK(answered + next.micro_batches == pushed);  // nothing lost, nothing twice
}

TEST_CASE("a device that computes is never taken for stalled, however long it takes") {
  Reports reports;
  DeviceGroup pair(2, kSmall);
  // A loop with no feeds whose body takes 200 ms: no wait at all.
  const auto r = loops::repeat(
      pair[0], 2, [](int&) { std::this_thread::sleep_for(100ms); }, 0,
      StallCheck{10ms, OnStall::kFail});
  CHECK(r.completed());
  // Device 1 waits at a Sync while device 0 computes for 200 ms first: one device computes.
  EngineConfig config;
  config.stall = {10ms, OnStall::kFail};
  Engine engine(pair, config);
  auto group = std::make_shared<SyncGroup>(2);
  const Program slow = program::Sequence{
      program::Execute("slow", [](const ComputeContext&) { std::this_thread::sleep_for(200ms); }),
      program::Sync(group)};
  CHECK(engine.run({slow, program::Sync(group)}).completed());
  CHECK(reports.seen().empty());
}

TEST_CASE("the check is off with limit 0, and a bad limit is refused naming it") {
  Reports reports;
  Device device(0, kSmall);
  InfeedQueue<int> in;
  auto run = loops::repeat_async(
      device, 10, [](int&, int&) {}, 0, in, StallCheck{0ns, OnStall::kFail});
  CHECK_FALSE(run.wait_for(50ms));  // waits, unreported (a run would have 2 looks by now)
  run.cancel();
  CHECK(run.get().status == RunStatus::kCancelled);
  CHECK(reports.seen().empty());
  CHECK(error_of([] { StallCheck{-1ns}.validate(); }) ==
        "StallCheck::limit = -1 ns is not allowed: must be 0 (no check) or in 1 ms..24 h");
  CHECK(contains(error_of([] { Options().run_stall_limit(500us); }), "StallCheck::limit = 500 us"));
  EngineConfig config;
  config.stall.limit = 25h;
  CHECK(contains(error_of([&] { config.validate(); }), "StallCheck::limit = 9e+04 s"));
  Options opts;
  opts.run_stall_limit(5s).on_stall(OnStall::kFail);
  CHECK(EngineConfig::from(opts).stall.limit == 5s);
  CHECK(PipelineConfig::from(opts).stall.on_stall == OnStall::kFail);
  CHECK(contains(opts.describe(), "run_stall_limit = 5 s\non_stall = fail\n"));
}

TEST_SUITE_END();
