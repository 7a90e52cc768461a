// runtime/: a loop, an Engine run or a Pipeline run that runs out of memory at any one
// allocation of its call, on the host, on a device's thread or on the I/O engine's, ends with an
// error and never hangs; the devices and the feeds stay usable and the device memory is given
// back. A served Stream likewise answers every request it accepted. An executable of its own:
// alloc_hook.cpp replaces the global operator new so that one chosen allocation of one chosen
// thread (by id, or by name for a thread the library starts) throws std::bad_alloc.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>

#include <bspflow/bspflow.hpp>

#include "alloc_hook.hpp"
#include "runtime_test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::kSmall;

using alloc_hook::arm;
using alloc_hook::disarm;

namespace {
// How many allocations `thread` makes while f() runs: the hook armed far off, so nothing
// fails; counted as the countdown moves.
template <class F>
long allocations_of(std::thread::id thread, F&& f) {
  constexpr long kFar = 1'000'000;
  arm(thread, kFar);
  f();
  const long left = alloc_hook::countdown();
  CHECK_FALSE(disarm());
  return kFar - left;
}

}  // namespace

namespace {
constexpr std::uint64_t kTrips = 8;
constexpr long kMaxAllocations = 20000;  // a call making more than this is a bug of its own

auto square = [](int& sum, int& x) {
  sum += x;
  return x * x;
};

// Ends the process if it is not destroyed within a minute: for a call that blocks (Engine::run).
class Watchdog {
 public:
  explicit Watchdog(long k)
      : thread_([this, k] {
          std::unique_lock lock(mutex_);
          if (!done_cv_.wait_for(lock, 60s, [this] { return done_; })) {
            std::fprintf(
                stderr, "alloc_failure_test: the run with allocation %ld failing never ended\n", k);
            std::_Exit(2);
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

struct Outcome {
  bool threw = false;     // std::bad_alloc, or a DeviceError it caused
  bool injected = false;  // the call made more than k allocations on the target
};

// Runs call() with allocation k of `target` failing (armed for the whole call), under a
// watchdog. The call either throws std::bad_alloc (itself, or as a DeviceError's cause) or
// returns; it throws only if the failure was injected.
template <class Call>
Outcome armed(std::thread::id target, long k, Call&& call) {
  Outcome o;
  std::exception_ptr cause;
  {
    Watchdog watchdog(k);
    arm(target, k);
    try {
      call();
    } catch (const std::bad_alloc&) {
      o.threw = true;
    } catch (const DeviceError& e) {
      o.threw = true;
      cause = e.cause();
    }
  }
  o.injected = disarm();
  INFO("allocation ", k, " failing");
  if (cause) CHECK_THROWS_AS(std::rethrow_exception(cause), std::bad_alloc);
  CHECK_FALSE((o.threw && !o.injected));
  return o;
}

// One call of loops::repeat with allocation k of `target` failing (launch, run and get()).
// Returns whether the failure was injected.
bool attempt(Device& device, std::thread::id target, long k) {
  InfeedQueue<int> in;
  OutfeedQueue<int> out;
  auto producer = in.make_producer();
  for (int i = 0; i < static_cast<int>(kTrips); ++i) producer.push(i);
  bool completed = false;
  int state = -1;
  const Outcome o = armed(target, k, [&] {
    auto r = loops::repeat(device, kTrips, square, 0, in, out);
    completed = r.completed();
    state = r.state();
  });
  INFO("allocation ", k, " failing (injected: ", o.injected, ")");
  if (!o.threw) {
    // Absorbed (or not reached): then nothing may be missing.
    CHECK(completed);
    CHECK(state == 0 + 1 + 2 + 3 + 4 + 5 + 6 + 7);
    CHECK(out.drain().size() == kTrips);
  }
  // Whatever happened, the device memory the call took is given back.
  CHECK(device.arena().used() == 0);
  return o.injected;
}

// After the sweep, the same device runs a whole loop again.
void check_device_still_runs(Device& device) {
  InfeedQueue<int> in;
  OutfeedQueue<int> out;
  auto producer = in.make_producer();
  for (int i = 0; i < static_cast<int>(kTrips); ++i) producer.push(i);
  auto r = loops::repeat(device, kTrips, square, 0, in, out);
  CHECK(r.completed());
  CHECK(r.state() == 28);
  CHECK(out.drain().size() == kTrips);
}

std::thread::id device_thread(Device& device) {
  std::thread::id id;
  loops::repeat(
      device, 1, [&](int&) { id = std::this_thread::get_id(); }, 0);
  return id;
}

// Sets BSPFLOW_TRACE for its lifetime (a traced run allocates on the device thread before its
// first trip: its trace labels).
struct TracedRuns {
  TracedRuns() : path(std::filesystem::temp_directory_path() / "bspflow_alloc_failure.json") {
    ::setenv("BSPFLOW_TRACE", path.c_str(), 1);
  }
  ~TracedRuns() {
    ::unsetenv("BSPFLOW_TRACE");
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
  std::filesystem::path path;
};

// Calls attempt(k) for k = 0, 1, 2, ... until the failure is no longer injected (the call
// made fewer than k allocations); returns that k.
template <class Attempt>
long sweep_allocations(Attempt&& attempt) {
  long k = 0;
  while (k < kMaxAllocations && attempt(k)) ++k;
  CHECK(k < kMaxAllocations);
  return k;
}

// sweep_allocations() of attempt(target, k), with the thread named `thread_name` as the target
// instead if given; then one whole run with nothing failing.
template <class Attempt>
void sweep_then_rerun(Attempt&& attempt, std::thread::id target, const char* thread_name) {
  alloc_hook::target_name(thread_name);
  const long k = sweep_allocations([&](long i) { return attempt(target, i); });
  alloc_hook::target_name(nullptr);
  MESSAGE("allocations swept: ", k);
  CHECK(attempt(std::thread::id{}, 0) == false);  // and a whole run again
}

// An Engine program on 2 devices, as examples/03_engine_program.cpp: each trip takes a tensor
// from the host, computes on the tiles, syncs, copies the other device's tensor, syncs again
// and sends it to the host.
struct EngineCase {
  explicit EngineCase(EngineConfig config) : engine(std::in_place, devices, config) {
    for (std::uint32_t d = 0; d < 2; ++d) {
      x.push_back(make_buffer(devices[d], "x", DType::kFloat32, kElements));
      y.push_back(make_buffer(devices[d], "y", DType::kFloat32, kElements));
      baseline[d] = devices[d].arena().used();
    }
  }
  // One run with allocation k of `target` failing, as attempt() for loops.
  bool attempt(std::thread::id target, long k) {
    using namespace program;
    InfeedQueue<Tensor> in(InfeedConfig{2});
    OutfeedQueue<Tensor> out(OutfeedConfig{2});
    std::vector<Program> programs;
    for (std::uint32_t d = 0; d < 2; ++d) {
      Buffer mine = x[d];
      programs.push_back(Repeat(
          kTrips, Sequence{StreamCopy(in, mine),
                           Execute("double", kElements,
                                   [mine](const ComputeContext&, const TileWork& w) {
                                     for (std::size_t i = w.begin; i < w.end; ++i)
                                       mine->as<float>()[i] *= 2;
                                   }),
                           Sync(sync), Copy(x[1 - d], y[d]), Sync(sync), StreamCopy(y[d], out)}));
    }
    auto producer = in.make_producer();
    for (std::uint64_t t = 0; t < kTrips; ++t) {
      for (std::uint32_t d = 0; d < 2; ++d)
        producer.push_to(d, Tensor(DType::kFloat32, {kElements}));
    }
    bool completed = false;
    const Outcome o = armed(target, k, [&] { completed = engine->run(programs).completed(); });
    INFO("allocation ", k, " failing (injected: ", o.injected, ")");
    if (!o.threw) {
      CHECK(completed);
      CHECK(out.drain().size() == 2 * kTrips);
    }
    for (std::uint32_t d = 0; d < 2; ++d) CHECK(devices[d].arena().used() == baseline[d]);
    return o.injected;
  }
  void sweep(std::thread::id target, const char* thread_name = nullptr) {
    sweep_then_rerun([&](std::thread::id t, long k) { return attempt(t, k); }, target, thread_name);
  }
  static constexpr std::size_t kElements = 64;
  DeviceGroup devices{2, kSmall};
  std::optional<Engine> engine;  // (optional: a test destroys it alone)
  std::shared_ptr<SyncGroup> sync = std::make_shared<SyncGroup>(2);
  std::vector<Buffer> x, y;
  std::size_t baseline[2] = {};
};

// A stage that does next to nothing: trainable (one weight), so that a training step has a
// backward pass, gradients and an optimizer step to set up.
class TinyStage final : public Stage {
 public:
  std::string name() const override { return "tiny"; }
  std::size_t output_elements() const override { return 1; }
  std::size_t gradient_elements() const override { return 1; }
  std::span<float> weights() override { return w_; }
  void forward(const StageContext&, ForwardArgs& a) override {
    a.output[0] = a.input.empty() ? w_[0] : a.input[0] + w_[0];
  }
  void backward(const StageContext&, BackwardArgs& a) override { a.gradients[0] = 0.0f; }

 private:
  float w_[1] = {1.0f};
};

// Two stages of S, as a Pipeline's stage factory.
template <class S>
StageList two_stages(std::uint32_t) {
  StageList l;
  l.push_back(std::make_unique<S>());
  l.push_back(std::make_unique<S>());
  return l;
}

// A Pipeline of 2 stages on 2 devices, `steps` steps of 4 micro-batches each, with allocation
// k of `target` failing (the pipeline itself is built first: only its run is swept).
bool pipeline_attempt(DeviceGroup& devices, bool training, std::thread::id target, long k) {
  PipelineConfig cfg;
  cfg.training = training;
  cfg.gradient_accumulation = 4;
  Pipeline pipe(devices, cfg, two_stages<TinyStage>);
  constexpr std::uint64_t kSteps = 2;
  InfeedQueue<Batch> infeed(InfeedConfig{1, kSteps * 4, 1});
  auto producer = infeed.make_producer();
  for (std::uint64_t i = 0; i < kSteps * 4; ++i) producer.push(Batch{});
  const std::size_t used[2] = {devices[0].arena().used(), devices[1].arena().used()};
  bool completed = false;
  const Outcome o = armed(target, k, [&] { completed = pipe.run(infeed, kSteps).completed(); });
  INFO("allocation ", k, " failing (injected: ", o.injected, ")");
  if (!o.threw) CHECK(completed);
  for (std::uint32_t d = 0; d < 2; ++d) CHECK(devices[d].arena().used() == used[d]);
  return o.injected;
}

// A served Stream (2 stages on 2 devices, StreamClients), one run with allocation k of `target`
// failing: start(), a client, kRequests pushes, close(), every response popped, wait(). Each
// call either throws std::bad_alloc or does its work; every request the stream accepted is
// answered exactly once, the result accounts for every one, and the stream serves again.
struct StreamCase {
  static constexpr int kRequests = 8;
  static Stream<int, int> build(DeviceGroup& devices, bool batch) {
    auto b = StreamBuilder<int>(devices).stage(
        "a", [](int x) { return x + 1; }, 0);
    if (batch) {
      return std::move(b)
          .batch_stage(
              "b",
              [](std::span<const int> xs) {
                std::vector<int> out;
                for (int x : xs) out.push_back(x * 2);
                return out;
              },
              BatchConfig{.max_batch = 4, .max_delay = 200us}, 1)
          .build();
    }
    return std::move(b)
        .stage(
            "b", [](int x) { return x * 2; }, 1)
        .build();
  }
  explicit StreamCase(bool batch) : stream(build(devices, batch)) {}

  // One run; returns whether the failure was injected.
  bool attempt(std::thread::id target, long k) {
    int accepted = 0, answered = 0, wrong = 0, lost = 0;
    // The accepted requests, in push order: their sequence numbers and values.
    std::uint64_t sent[kRequests] = {};
    int value[kRequests] = {};
    bool started = false, waited = false;
    StreamResult result;
    const Outcome o = armed(target, k, [&] {
      stream.start();
      started = true;
      auto client = stream.client();
      for (int i = 0; i < kRequests; ++i) {
        if (const Submission sub = client.push(i)) {
          sent[accepted] = sub.id.sequence;
          value[accepted++] = i;
        }
      }
      stream.close();
      for (int i = 0; i < accepted; ++i) {
        const auto r = client.pop_until(StreamClock::now() + 20s);
        if (!r) {
          ++lost;
          continue;
        }
        ++answered;
        // In push order: the i-th response answers the i-th accepted request.
        if (r->id.sequence != sent[i] || (r->ok() && *r->value != (value[i] + 1) * 2)) ++wrong;
      }
      result = stream.wait();
      waited = true;
    });
    INFO("allocation ", k, " failing (injected: ", o.injected, ")");
    if (started && !waited) {  // a call threw between start() and wait(): end the run
      Watchdog watchdog(k);
      stream.close();
      result = stream.wait();
    }
    if (started) {
      CHECK(lost == 0);  // every request the stream accepted was answered
      CHECK(wrong == 0);
      CHECK(result.accepted == static_cast<std::uint64_t>(accepted));
      CHECK(result.answered + result.unanswered == result.accepted);
      if (!o.threw) {
        CHECK(accepted == kRequests);
        CHECK(answered == kRequests);
        CHECK(result.drained());
        CHECK(result.answered == static_cast<std::uint64_t>(kRequests));
      }
    }
    return o.injected;
  }
  void sweep(std::thread::id target, const char* thread_name = nullptr) {
    sweep_then_rerun([&](std::thread::id t, long k) { return attempt(t, k); }, target, thread_name);
  }
  DeviceGroup devices{2, kSmall};
  Stream<int, int> stream;
};

void sweep(Device& device, std::thread::id target) {
  MESSAGE("allocations swept: ",
          sweep_allocations([&](long k) { return attempt(device, target, k); }));
  check_device_still_runs(device);
}
}  // namespace

TEST_SUITE_BEGIN("alloc_failure");

TEST_CASE("a loop called in a loop: a call allocates no more than its budget on the host") {
  // With the same hook, armed far off: how many allocations the calling thread makes in one
  // call of a loop with an infeed and an outfeed, once earlier calls have left what later
  // ones reuse (the outfeed writer's staging vector, the device arena's bookkeeping of the
  // prefetch buffer). A budget, not a timing: each allocation is a malloc on the host call's
  // path and a free in get(); the budget says when one is added.
  constexpr long kBudget = 22;
  Device device(0, kSmall);
  InfeedConfig in_config{1, 64, 4};
  in_config.producer_type = ProducerType::kSingle;
  InfeedQueue<std::uint64_t> infeed(in_config);
  OutfeedConfig out_config;
  out_config.consumer_type = ConsumerType::kSingle;
  out_config.capacity = 64;
  OutfeedQueue<std::uint64_t> outfeed(out_config);
  auto producer = infeed.make_producer();
  constexpr std::uint64_t kTrips = 8;
  auto call = [&] {
    auto run = loops::repeat_async(
        device, kTrips, [](int&, std::uint64_t& x) { return x; }, 0, infeed, outfeed);
    for (std::uint64_t i = 0; i < kTrips; ++i) producer.push(i);
    std::uint64_t read = 0;
    for (auto& e : outfeed) read += e.value == read ? 1 : 0;
    return run.get().completed() && read == kTrips;
  };
  auto allocations_of_call = [&](bool& ok) {
    return allocations_of(std::this_thread::get_id(), [&] { ok = call(); });
  };
  bool ok = false;
  const long first = allocations_of_call(ok);
  CHECK(ok);
  (void)allocations_of_call(ok);
  const long later = allocations_of_call(ok);
  CHECK(ok);
  MESSAGE("host allocations: first call ", first, ", a later call ", later);
  CHECK(later <= kBudget);
  CHECK(later < first);
}

// An inference stage that saves values in its forward pass, as a stage written for training
// does: inference stashes nothing, so nothing it saves is kept for a later pass.
class SavingStage final : public Stage {
 public:
  std::string name() const override { return "saving"; }
  std::size_t output_elements() const override { return 1; }
  void forward(const StageContext&, ForwardArgs& a) override {
    a.saved.assign(16, 1.0f);  // room for 16 values: an allocation unless kept
    a.output[0] = a.input.empty() ? 1.0f : a.input[0] + 1.0f;
  }
};

TEST_CASE("inference: a stage that saves values allocates nothing per micro-batch") {
  // With the same hook, armed far off on each device thread in turn: a run of many
  // micro-batches makes as many allocations there as a run of few (the old code freed what
  // the pass saved after each micro-batch, and allocated it again with the next one).
  DeviceGroup devices(2, kSmall);
  PipelineConfig cfg;
  cfg.training = false;
  cfg.gradient_accumulation = 4;
  Pipeline pipe(devices, cfg, two_stages<SavingStage>);
  auto allocations_of_run = [&](std::thread::id target, std::uint64_t steps) {
    InfeedQueue<Batch> infeed(InfeedConfig{1, steps * 4, 4});
    {
      auto producer = infeed.make_producer();
      for (std::uint64_t i = 0; i < steps * 4; ++i) producer.push(Batch{});
    }
    PipelineResult r;
    const long n = allocations_of(target, [&] { r = pipe.run(infeed, steps); });
    CHECK(r.completed());
    CHECK(r.micro_batches == steps * 4);
    return n;
  };
  for (std::uint32_t d = 0; d < 2; ++d) {
    CAPTURE(d);
    const std::thread::id target = device_thread(devices[d]);
    (void)allocations_of_run(target, 2);  // the first run leaves what later ones reuse
    const long few = allocations_of_run(target, 2);
    const long many = allocations_of_run(target, 32);
    MESSAGE("device ", d, " thread allocations: 8 micro-batches ", few, ", 128 micro-batches ",
            many);
    CHECK(many == few);
  }
}

TEST_CASE("out of memory at any allocation of the host's call: an error, never a hang") {
  Device device(0, kSmall);
  SUBCASE("untraced") {
    sweep(device, std::this_thread::get_id());
  }
  SUBCASE("traced") {
    TracedRuns traced;
    sweep(device, std::this_thread::get_id());
  }
}

TEST_CASE("out of memory at any allocation of the device thread: the run fails, never hangs") {
  // Before the run is set up there (a traced run's labels) as well as during its trips.
  Device device(0, kSmall);
  const std::thread::id target = device_thread(device);
  SUBCASE("untraced") {
    sweep(device, target);
  }
  SUBCASE("traced") {
    TracedRuns traced;
    sweep(device, target);
  }
}

TEST_CASE("out of memory at any allocation of an Engine run: an error, never a hang") {
  EngineConfig config;
  SUBCASE("host thread") {
    EngineCase c(config);
    c.sweep(std::this_thread::get_id());
  }
  SUBCASE("host thread, traced, with I/O tiles") {
    config.trace = true;
    config.io_tiles = 2;
    EngineCase c(config);
    c.sweep(std::this_thread::get_id());
  }
  SUBCASE("a device thread, traced, with I/O tiles") {
    config.trace = true;
    config.io_tiles = 2;
    EngineCase c(config);
    c.sweep(device_thread(c.devices[1]));
  }
}

TEST_CASE(
    "destroying an Engine after a run allocates nothing, so running out of memory cannot end it") {
  // A destructor cannot throw: an allocation that failed in it would end the process. The I/O
  // engine used to post its stop to its own thread (an allocation); it now stops the io_context.
  for (const std::uint32_t io_tiles : {0u, 2u}) {
    CAPTURE(io_tiles);
    EngineConfig config;
    config.trace = true;
    config.io_tiles = io_tiles;
    EngineCase c(config);
    CHECK(c.attempt(std::thread::id{}, 0) == false);  // a whole run: the engine thread has worked
    arm(std::this_thread::get_id(), 0);               // the host's next allocation fails
    c.engine.reset();
    CHECK_FALSE(disarm());
  }
}

TEST_CASE(
    "out of memory at any allocation of the I/O engine's thread: the run fails, never hangs") {
  // The engine thread copies and times the stream copies; its allocations (a timer's handler,
  // an output tensor for the host, the I/O track's events) end the transfer, not the process.
  EngineConfig config;
  SUBCASE("direct copies, traced") {
    config.trace = true;
    EngineCase c(config);
    c.sweep(std::thread::id{}, "bspflow-io");
  }
  SUBCASE("I/O tiles") {
    config.io_tiles = 2;
    EngineCase c(config);
    c.sweep(std::thread::id{}, "bspflow-io");
  }
  SUBCASE("I/O tiles, traced") {
    config.trace = true;
    config.io_tiles = 2;
    EngineCase c(config);
    c.sweep(std::thread::id{}, "bspflow-io");
  }
}

TEST_CASE("out of memory at any allocation of a Pipeline run: an error, never a hang") {
  DeviceGroup devices(2, kSmall);
  const std::thread::id host = std::this_thread::get_id();
  const std::thread::id device = device_thread(devices[1]);
  for (const bool training : {false, true}) {
    for (const std::thread::id target : {host, device}) {
      CAPTURE(training);
      CAPTURE(target == host);
      const long k =
          sweep_allocations([&](long i) { return pipeline_attempt(devices, training, target, i); });
      MESSAGE("allocations swept: ", k, std::string(training ? " (training, " : " (inference, "),
              std::string(target == host ? "host)" : "device thread)"));
    }
  }
}

TEST_CASE("out of memory at any allocation of a served Stream: never a hang or a lost request") {
  // Each thread of a served run: the host's (start, the client, close, wait), each stage's
  // device thread and the stream's stall monitor; with a plain second stage and a batch one.
  struct Target {
    const char* what;
    const char* thread_name;  // null: the host thread
  };
  for (const Target t :
       {Target{"host", nullptr}, Target{"first stage", "bspflow-dev0"},
        Target{"second stage", "bspflow-dev1"}, Target{"stall monitor", "bspflow-smon"}}) {
    for (const bool batch : {false, true}) {
      const std::string target = t.what;
      CAPTURE(target);
      CAPTURE(batch);
      StreamCase c(batch);
      c.sweep(t.thread_name ? std::thread::id{} : std::this_thread::get_id(), t.thread_name);
    }
  }
}

TEST_SUITE_END();
