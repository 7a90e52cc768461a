// The soak suite (opt-in: meson test -C build --suite soak; not part of the default run).
//
// 1. Exactly once at volume: BSPFLOW_SOAK_ELEMENTS (default 10^7) elements through each of
//    loops::repeat (4 producers x 2 replicas, and 3 x 3: 3 devices on 2 cores), Pipeline
//    inference (2 producers x 2 replicas of 2 stages: 4 devices) and a Stream (3 producers,
//    4 stages on 2 devices): every element arrives once, with the right value, in each
//    producer's order, and the checksums agree.
// 2. Seeded fault injection: BSPFLOW_SOAK_TRIALS (default 2000) trials, each one fault (a
//    body or stage throws at a random place, a cancel at a random time, the infeed closed
//    mid-run, an outfeed reader that stops early) in one of loops::repeat, Engine programs,
//    Pipeline inference, Pipeline training and Streams, over 1-4 devices (4 on 2 cores). Each
//    trial must end within a time limit (else the process aborts naming the trial) with the
//    status and context the fault calls for; what was produced before the fault is delivered
//    or still in the outfeed; every element pushed is processed exactly once over the trial's
//    run and a second run on the same devices (which also shows they are reusable), except
//    the one a stage threw on (named by the error) and, for Streams, the requests the result
//    counts as unanswered. Training trials check that every replica applied the same steps
//    and that the pipeline trains again afterwards.
//
// A failing trial prints its number and seed; BSPFLOW_SOAK_TRIAL=N runs trial N alone and
// BSPFLOW_SOAK_SEED changes every trial's seed (trial N uses seed + N). The suite prints the
// trials per API and fault, and how each ended.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>
#include <bspflow/runtime/stream.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::contains;

namespace {

const DeviceConfig kSmall{64, 64 * 1024};

std::uint64_t env_u64(const char* name, std::uint64_t otherwise) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return otherwise;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (*end != '\0') {
    std::fprintf(stderr, "soak: %s=%s is not a number\n", name, v);
    std::exit(2);
  }
  return n;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---------------------------------------------------------------------------------------
// Exactly once at volume
// ---------------------------------------------------------------------------------------

// One bit per element, per producer: how many times each arrived, and whether any arrived
// twice or never.
class Arrivals {
 public:
  Arrivals(std::uint32_t producers, std::uint64_t per_producer)
      : seen_(producers, std::vector<std::uint8_t>(per_producer, 0)) {}
  void arrive(std::uint32_t producer, std::uint64_t seq) {
    if (producer >= seen_.size() || seq >= seen_[producer].size()) {
      ++foreign_;
      return;
    }
    if (seen_[producer][seq]++ != 0) ++duplicates_;
  }
  std::uint64_t missing() const {
    std::uint64_t n = 0;
    for (const auto& p : seen_) n += static_cast<std::uint64_t>(std::count(p.begin(), p.end(), 0));
    return n;
  }
  std::uint64_t duplicates() const { return duplicates_; }
  std::uint64_t foreign() const { return foreign_; }

 private:
  std::vector<std::vector<std::uint8_t>> seen_;
  std::uint64_t duplicates_ = 0, foreign_ = 0;
};

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser: a checksum term per element
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr std::uint32_t kMaxProducers = 8;

// loops::repeat's per-replica state: what the body saw, checked on the device.
struct LoopTally {
  std::uint64_t count = 0, checksum = 0, disorder = 0;
  std::array<std::uint64_t, kMaxProducers> next{};  // the next sequence expected per producer
};

void soak_repeat(std::uint32_t producers, std::uint32_t replicas, std::uint64_t elements) {
  // At least `elements` in all, a multiple of replicas per producer.
  const std::uint64_t per_producer = (elements + producers * replicas - 1) / (producers * replicas) * replicas;
  const std::uint64_t total = per_producer * producers;
  const auto t0 = Clock::now();
  DeviceGroup group(replicas, kSmall);
  InfeedQueue<std::uint64_t> infeed(InfeedConfig{replicas, 1024, 16});
  OutfeedQueue<std::uint64_t> outfeed(OutfeedConfig{replicas, OutputMode::all(), 1 << 16});
  auto body = [](LoopTally& t, std::uint64_t& x) {
    const auto p = static_cast<std::uint32_t>(x >> 40);
    const std::uint64_t seq = x & ((std::uint64_t{1} << 40) - 1);
    if (p >= kMaxProducers || seq < t.next[p]) ++t.disorder;  // per producer, per replica: increasing
    if (p < kMaxProducers) t.next[p] = seq + 1;
    ++t.count;
    t.checksum += mix(x);
    return x;
  };
  Run<LoopTally> run = loops::repeat_async(group, total / replicas, body, LoopTally{}, infeed, outfeed);
  std::vector<std::thread> threads;
  std::atomic<std::uint32_t> finished{0};
  std::atomic<std::uint64_t> pushed_checksum{0};
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      auto producer = infeed.make_producer();
      std::uint64_t sum = 0;
      for (std::uint64_t s = 0; s < per_producer; ++s) {
        const std::uint64_t x = (std::uint64_t{p} << 40) | s;
        sum += mix(x);
        if (!producer.push(x)) break;
      }
      pushed_checksum += sum;
      if (++finished == producers) infeed.close();
    });
  }
  Arrivals arrivals(producers, per_producer);
  std::vector<std::array<std::uint64_t, kMaxProducers>> next(replicas);
  std::uint64_t out_disorder = 0, out_checksum = 0, received = 0;
  for (auto& e : outfeed) {
    const auto p = static_cast<std::uint32_t>(e.value >> 40);
    const std::uint64_t seq = e.value & ((std::uint64_t{1} << 40) - 1);
    arrivals.arrive(p, seq);
    if (p < kMaxProducers && e.replica < replicas) {
      if (seq < next[e.replica][p]) ++out_disorder;
      next[e.replica][p] = seq + 1;
    }
    out_checksum += mix(e.value);
    ++received;
  }
  for (auto& t : threads) t.join();
  const RepeatResult<LoopTally> r = run.get();
  CHECK(r.completed());
  std::uint64_t count = 0, checksum = 0, disorder = 0;
  for (const LoopTally& t : r.states) {
    count += t.count;
    checksum += t.checksum;
    disorder += t.disorder;
  }
  CHECK(count == total);
  CHECK(received == total);
  CHECK(arrivals.missing() == 0);
  CHECK(arrivals.duplicates() == 0);
  CHECK(arrivals.foreign() == 0);
  CHECK(disorder == 0);
  CHECK(out_disorder == 0);
  CHECK(checksum == pushed_checksum.load());
  CHECK(out_checksum == pushed_checksum.load());
  const bool ok = count == total && received == total && arrivals.missing() == 0 && arrivals.duplicates() == 0 &&
                  arrivals.foreign() == 0 && disorder == 0 && out_disorder == 0 && checksum == pushed_checksum.load() &&
                  out_checksum == pushed_checksum.load();
  std::printf("soak: loops::repeat, %u producers x %u replicas: %llu elements: %s (%.1f s)\n", producers, replicas,
              static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, checksums equal" : "FAILED (see above)", seconds_since(t0));
}

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
        if (x[i] != static_cast<float>(a.batch.indices[i] % 1000)) throw std::runtime_error("data and indices disagree");
        sum += x[i];
      }
      const std::uint64_t first = a.batch.indices[0];
      a.output[0] = static_cast<float>(first >> 40);                                        // producer
      a.output[1] = static_cast<float>((first & ((std::uint64_t{1} << 40) - 1)) / kSamples);  // sequence
      a.output[2] = static_cast<float>(sum);
      return;
    }
    for (std::size_t i = 0; i < 3; ++i) a.output[i] = a.input[i];
  }
};

void soak_pipeline_inference(std::uint32_t producers, std::uint32_t replicas, std::uint64_t elements) {
  constexpr std::uint32_t kStages = 2;
  const std::uint64_t per_producer = (elements + kSamples * producers - 1) / (kSamples * producers);  // at least `elements` samples
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
      if (static_cast<double>(e.value.at(2)) != static_cast<double>(static_cast<float>(want))) ++bad_sum;
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
  const bool ok = r.status == RunStatus::kEndOfData && r.micro_batches == total && received == total &&
                  arrivals.missing() == 0 && arrivals.duplicates() == 0 && arrivals.foreign() == 0 && disorder == 0 &&
                  bad_sum == 0;
  std::printf("soak: Pipeline inference, %u producers x %u replicas x %u stages: %llu micro-batches (%llu samples): "
              "%s (%.1f s)\n",
              producers, replicas, kStages, static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(total * kSamples),
              ok ? "exactly once, in order, sums right" : "FAILED (see above)", seconds_since(t0));
}

void soak_stream(std::uint32_t producers, std::uint32_t devices, std::uint64_t elements) {
  constexpr std::uint64_t kStages = 4;
  const std::uint64_t per_producer = (elements + producers - 1) / producers;  // at least `elements`
  const std::uint64_t total = per_producer * producers;
  const auto t0 = Clock::now();
  DeviceGroup group(devices, kSmall);
  auto plus = [](std::uint64_t x) { return x + 1; };
  auto stream = StreamBuilder<std::uint64_t>(group, StreamConfig{.capacity = 64})
                    .stage("s0", plus, 0)
                    .stage("s1", plus, 0)
                    .stage("s2", plus, devices > 1 ? 1 : 0)
                    .stage("s3", plus, devices > 1 ? 1 : 0)
                    .build();
  InfeedQueue<Request<std::uint64_t>> infeed(InfeedConfig{.capacity = 1024});
  OutfeedQueue<Response<std::uint64_t>> outfeed(OutfeedConfig{.capacity = 4096});
  stream.start(infeed, outfeed);
  std::vector<std::uint32_t> ids(producers);
  std::vector<std::thread> threads;
  std::atomic<std::uint32_t> finished{0};
  std::atomic<std::uint64_t> pushed_checksum{0};
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      RequestProducer<std::uint64_t> producer(infeed);
      ids[p] = producer.id();
      std::uint64_t sum = 0;
      for (std::uint64_t s = 0; s < per_producer; ++s) {
        const std::uint64_t x = mix((std::uint64_t{p} << 40) | s) >> 8;
        sum += x + kStages;
        if (!producer.push(x)) break;
      }
      pushed_checksum += sum;
      if (++finished == producers) infeed.close();
    });
  }
  std::map<std::uint32_t, std::uint64_t> next;  // producer id -> the next sequence expected
  std::uint64_t received = 0, disorder = 0, errors = 0, checksum = 0;
  for (auto& e : outfeed) {
    const Response<std::uint64_t>& r = e.value;
    if (r.id.sequence != next[r.id.producer]) ++disorder;
    next[r.id.producer] = r.id.sequence + 1;
    if (!r.ok()) {
      ++errors;
    } else {
      checksum += *r.value;
    }
    ++received;
  }
  for (auto& t : threads) t.join();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.accepted == total);
  CHECK(r.answered == total);
  CHECK(received == total);
  CHECK(errors == 0);
  CHECK(disorder == 0);  // each producer's sequence 0, 1, 2, ...: none missing, none twice
  for (std::uint32_t id : ids) CHECK(next[id] == per_producer);
  CHECK(checksum == pushed_checksum.load());
  bool all_ids = true;
  for (std::uint32_t id : ids) all_ids = all_ids && next[id] == per_producer;
  const bool ok = r.drained() && r.accepted == total && r.answered == total && received == total && errors == 0 &&
                  disorder == 0 && all_ids && checksum == pushed_checksum.load();
  std::printf("soak: Stream, %u producers, %llu stages on %u devices: %llu requests: %s (%.1f s)\n", producers,
              static_cast<unsigned long long>(kStages), devices, static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, values right" : "FAILED (see above)", seconds_since(t0));
}

// ---------------------------------------------------------------------------------------
// Fault injection
// ---------------------------------------------------------------------------------------

enum class Api { kLoops, kEngine, kPipelineInference, kPipelineTraining, kStream };
enum class Fault { kThrow, kCancel, kClose, kReaderStops };
constexpr std::array<const char*, 5> kApiNames{"loops::repeat", "Engine", "Pipeline inference", "Pipeline training",
                                                "Stream"};
constexpr std::array<const char*, 4> kFaultNames{"throws", "cancel", "infeed closed", "reader stops"};

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : g_(seed) {}
  std::uint64_t in(std::uint64_t lo, std::uint64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(g_);
  }
  std::uint64_t below(std::uint64_t n) { return in(0, n - 1); }
  bool coin() { return in(0, 1) == 1; }

 private:
  std::mt19937_64 g_;
};

// Ends the process if a trial does not finish in time: a hang cannot be failed from inside.
class Watchdog {
 public:
  Watchdog() : thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> l(m_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(std::string what, std::chrono::seconds limit) {
    std::lock_guard<std::mutex> l(m_);
    what_ = std::move(what);
    deadline_ = Clock::now() + limit;
    limit_ = limit;
    armed_ = true;
  }
  void disarm() {
    std::lock_guard<std::mutex> l(m_);
    armed_ = false;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    while (!quit_) {
      if (armed_ && Clock::now() >= deadline_) {
        std::fprintf(stderr, "soak: %s did not end within %lld s: it hangs\n", what_.c_str(),
                     static_cast<long long>(limit_.count()));
        std::fflush(stderr);
        std::abort();
      }
      cv_.wait_for(l, 100ms);
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::string what_;
  Clock::time_point deadline_{};
  std::chrono::seconds limit_{0};
  bool armed_ = false, quit_ = false;
  std::thread thread_;
};

// How many times each element id was processed (any thread).
class Seen {
 public:
  explicit Seen(std::size_t n) : n_(n) {}
  void add(std::uint64_t id) {
    if (id < n_.size()) {
      n_[id].fetch_add(1, std::memory_order_relaxed);
    } else {
      foreign_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  // Ids [0, pushed) processed other than once (except `skip`), and ids beyond: "" if none.
  std::string problems(std::uint64_t pushed, std::uint64_t skip = kNone) const {
    std::string out;
    std::uint64_t bad = 0;
    for (std::uint64_t i = 0; i < n_.size(); ++i) {
      const std::uint32_t want = i < pushed ? 1 : 0;
      const std::uint32_t got = n_[i].load();
      if (got != want && i != skip) {
        if (++bad <= 5) out += "id " + std::to_string(i) + " " + std::to_string(got) + " times; ";
      }
    }
    if (bad > 5) out += std::to_string(bad) + " ids in all; ";
    if (foreign_.load() != 0) out += std::to_string(foreign_.load()) + " ids never pushed; ";
    return out;
  }
  std::uint32_t count(std::uint64_t id) const { return n_.at(id).load(); }

 private:
  std::vector<std::atomic<std::uint32_t>> n_;
  std::atomic<std::uint64_t> foreign_{0};
};

struct Trial {
  std::uint64_t number = 0;
  Api api = Api::kLoops;
  Fault fault = Fault::kThrow;
  std::uint32_t devices = 1;
  std::string outcome;  // how it ended, for the tally
};

// The "infeed closed mid-run" fault, two ways: the producer stops after a random number of
// elements and closes the infeed, or another thread closes it at a random time while the
// producer pushes. Other faults push everything, then close.
struct Closing {
  std::uint64_t push = 0;     // elements the producer offers
  bool from_outside = false;  // another thread closes the infeed (close_later)
};
Closing closing_for(Rng& rng, const Trial& t, std::uint64_t total) {
  if (t.fault != Fault::kClose) return {total, false};
  if (rng.coin()) return {total, true};
  return {rng.below(total), false};
}

// The trial's outfeed: unbounded, or bounded with one reader (a ring per replica) or shared
// (the reader-stops fault).
OutfeedConfig outfeed_config(std::uint32_t replicas, std::size_t capacity, Rng& rng) {
  OutfeedConfig c{replicas, OutputMode::all(), capacity};
  if (capacity != 0 && rng.coin()) c.consumer_type = ConsumerType::kSingle;
  return c;
}

// Busy for `d` (a body that takes time, so a cancel can land mid-run).
void spin_for(std::chrono::microseconds d) {
  if (d.count() == 0) return;
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

// A thread that closes an infeed after a random delay (the "infeed closed mid-run" fault).
template <class Q>
std::thread close_later(Q& queue, std::chrono::microseconds after) {
  return std::thread([&queue, after] {
    std::this_thread::sleep_for(after);
    queue.close();
  });
}

// Pops `k` entries (or fewer if `give_up` is set first), then stops reading: the outfeed
// reader that stops early. Returns what it read.
template <class T>
std::vector<OutfeedEntry<T>> read_then_stop(OutfeedQueue<T>& out, std::uint64_t k, const std::atomic<bool>& give_up) {
  std::vector<OutfeedEntry<T>> got;
  while (got.size() < k && !give_up.load()) {
    if (auto e = out.try_pop()) {
      got.push_back(std::move(*e));
    } else {
      std::this_thread::sleep_for(20us);
    }
  }
  return got;
}


std::chrono::microseconds micros(Rng& rng, std::uint64_t max) {
  return std::chrono::microseconds(rng.in(0, max));
}

// The cancel and reader-stops faults against a run in progress: `ended_within(d)` waits up
// to d for the run to end and says whether it has, `cancel()` stops it. A cancel comes after a
// random delay of up to `cancel_within`; a reader reads up to `read_at_most` entries (or until
// the run ends by itself), stops, and the run, which cannot end by itself now, is cancelled.
// Engine and Pipeline cancel() stop the run in progress, if any: one that comes before the run
// has started finds none, so the cancel is repeated until the run has ended. Returns what the
// reader read.
template <class T, class Ended, class Cancel>
std::vector<OutfeedEntry<T>> stop_fault(Rng& rng, const Trial& t, OutfeedQueue<T>& out,
                                        std::uint64_t cancel_within, std::uint64_t read_at_most,
                                        Ended ended_within, Cancel cancel) {
  std::vector<OutfeedEntry<T>> read;
  if (t.fault == Fault::kCancel) {
    std::this_thread::sleep_for(micros(rng, cancel_within));
    while (!ended_within(200us)) cancel();
  } else if (t.fault == Fault::kReaderStops) {
    const std::uint64_t k = rng.in(0, read_at_most);
    std::atomic<bool> give_up{false};
    std::thread watcher([&] {
      while (!ended_within(1ms)) {
      }
      give_up = true;  // a run that ends (the outfeed held everything) ends the reading too
    });
    read = read_then_stop(out, k, give_up);
    std::this_thread::sleep_for(micros(rng, 2000));
    while (!ended_within(1ms)) cancel();
    watcher.join();
  }
  return read;
}

// ---- loops::repeat ----

void loops_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const std::uint32_t d = group.size();
  const std::uint64_t n = rng.in(20, 300);  // iterations per replica
  const std::uint64_t total = n * d;
  const auto prefetch = static_cast<std::uint32_t>(rng.in(1, 8));
  InfeedQueue<std::uint64_t> in(InfeedConfig{d, rng.in(prefetch, 32), prefetch});
  const std::size_t out_capacity = t.fault == Fault::kReaderStops ? rng.in(1, 16) : 0;
  OutfeedQueue<std::uint64_t> out(outfeed_config(d, out_capacity, rng));
  Seen seen(total);
  std::vector<std::atomic<std::uint64_t>> ok(d);
  const auto fail_replica = static_cast<std::uint32_t>(rng.below(d));
  const std::uint64_t fail_at = rng.below(n);
  const bool throws = t.fault == Fault::kThrow;
  std::atomic<std::uint64_t> pushed{0};
  const Closing closing = closing_for(rng, t, total);
  std::thread producer([&] {
    auto p = in.make_producer();
    for (std::uint64_t i = 0; i < closing.push && p.push(i); ++i) ++pushed;
    in.close();
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  const std::chrono::microseconds work = t.fault == Fault::kCancel ? micros(rng, 20) : std::chrono::microseconds(0);
  auto body = [&](int&, std::uint64_t& x, const Iteration& it) {
    seen.add(x);
    spin_for(work);
    if (throws && it.replica == fail_replica && it.index == fail_at) throw std::runtime_error("injected fault");
    ok[it.replica].fetch_add(1, std::memory_order_relaxed);
    return x;
  };
  Run<int> run = loops::repeat_async(group, n, body, 0, in, out);
  const std::vector<OutfeedEntry<std::uint64_t>> read = stop_fault(
      rng, t, out, 3000, 20, [&](auto d) { return run.wait_for(d); }, [&] { run.cancel(); });
  std::optional<RepeatResult<int>> r;
  try {
    r = run.get();
    CHECK_FALSE(throws);
  } catch (const DeviceError& e) {
    CHECK(throws);
    CHECK(e.replica() == fail_replica);
    CHECK(e.device() == fail_replica);
    CHECK(e.iteration() == fail_at);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "DeviceError at the injected place";
  }
  if (r) {
    switch (t.fault) {
      case Fault::kCancel:
      case Fault::kReaderStops:
        CHECK((r->status == RunStatus::kCancelled || r->status == RunStatus::kCompleted));
        t.outcome = r->status == RunStatus::kCancelled ? "cancelled" : "completed before the cancel";
        break;
      case Fault::kClose:
        CHECK((r->status == RunStatus::kEndOfData || r->status == RunStatus::kCompleted));
        if (r->status == RunStatus::kEndOfData) CHECK(contains(r->message, "end of data"));
        t.outcome = r->status == RunStatus::kEndOfData ? "end of data" : "completed before the close";
        break;
      case Fault::kThrow: break;
    }
    for (std::uint32_t rep = 0; rep < d; ++rep) CHECK(r->iterations[rep] == ok[rep].load());
  }
  if (closer.joinable()) closer.join();
  // What each replica produced before the fault was delivered, in order: iterations 0, 1, ...
  std::vector<std::uint64_t> delivered(d, 0);
  std::vector<std::uint64_t> ids;
  bool ordered = true;
  const auto take = [&](const OutfeedEntry<std::uint64_t>& e) {
    ordered = ordered && e.replica < d && e.iteration == delivered[e.replica];
    if (e.replica < d) ++delivered[e.replica];
    ids.push_back(e.value);
  };
  for (const auto& e : read) take(e);
  for (const auto& e : out.drain()) take(e);
  CHECK(ordered);
  for (std::uint32_t rep = 0; rep < d; ++rep) CHECK(delivered[rep] == ok[rep].load());
  // The same devices take what is left: every element pushed is processed exactly once.
  OutfeedQueue<std::uint64_t> rest(OutfeedConfig{d, OutputMode::all(), 0});
  const RepeatResult<int> r2 = loops::repeat(
      group, std::uint64_t{1} << 40,
      [&](int& c, std::uint64_t& x) {
        seen.add(x);
        ++c;
        return x;
      },
      0, in, rest);
  producer.join();
  CHECK(r2.status == RunStatus::kEndOfData);
  std::uint64_t second = 0;
  for (const auto& e : rest.drain()) {
    ids.push_back(e.value);
    ++second;
  }
  std::uint64_t done2 = 0;
  for (std::uint64_t c : r2.iterations) done2 += c;
  CHECK(second == done2);
  // The element the body threw on was processed (seen) once and, rightly, has no output.
  const std::string problems = seen.problems(pushed.load());
  CHECK_MESSAGE(problems.empty(), problems);
  std::sort(ids.begin(), ids.end());
  CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());  // no output twice
  CHECK(ids.size() + (throws ? 1 : 0) == pushed.load());
}

// ---- Engine programs ----

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
  std::thread producer([&] {
    auto p = in.make_producer();
    for (std::uint64_t i = 0; i < closing.push; ++i) {
      Tensor x(DType::kFloat32, {kElements});
      x.as<float>()[0] = static_cast<float>(i);
      if (!p.push(std::move(x))) break;
      ++pushed;
    }
    in.close();
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  const auto program_for = [&](std::uint32_t dev, std::uint64_t trips, OutfeedQueue<Tensor>& to, bool fault_here,
                               bool sync_here) {
    Buffer x = make_buffer(group[dev], "x", DType::kFloat32, kElements);
    program::Sequence body{
        program::StreamCopy(in, x),
        program::Execute("work", [&, x, fault_here](const ComputeContext& c) {
          const auto id = static_cast<std::uint64_t>(x->as<float>()[0]);
          seen.add(id);
          if (fault_here && c.iteration == fail_at) throw std::runtime_error("injected fault");
          ok[c.replica].fetch_add(1, std::memory_order_relaxed);
          x->as<float>()[1] = static_cast<float>(id) + 0.5f;
        })};
    if (sync_here) body.steps.push_back(program::Sync(sync));
    body.steps.push_back(program::StreamCopy(x, to));
    return Program(program::Repeat(trips, std::move(body)));
  };
  std::vector<Program> programs;
  for (std::uint32_t dev = 0; dev < d; ++dev) programs.push_back(program_for(dev, n, out, throws && dev == fail_device, with_sync));
  auto running = std::async(std::launch::async, [&] { return engine.run(programs); });
  const auto ended_within = [&](auto d) { return running.wait_for(d) == std::future_status::ready; };
  const std::vector<OutfeedEntry<Tensor>> read =
      stop_fault(rng, t, out, 3000, 12, ended_within, [&] { engine.cancel(); });
  std::optional<EngineResult> r;
  try {
    r = running.get();
    CHECK_FALSE(throws);
  } catch (const DeviceError& e) {
    CHECK(throws);
    CHECK(e.device() == fail_device);
    CHECK(e.iteration() == fail_at);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "DeviceError at the injected place";
  }
  if (r) {
    switch (t.fault) {
      case Fault::kCancel:
      case Fault::kReaderStops:
        CHECK((r->status == RunStatus::kCancelled || r->status == RunStatus::kCompleted));
        t.outcome = r->status == RunStatus::kCancelled ? "cancelled" : "completed before the cancel";
        break;
      case Fault::kClose:
        CHECK((r->status == RunStatus::kEndOfData || r->status == RunStatus::kCompleted));
        t.outcome = r->status == RunStatus::kEndOfData ? "end of data" : "completed before the close";
        break;
      case Fault::kThrow: break;
    }
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
  for (std::uint32_t dev = 0; dev < d; ++dev) drain.push_back(program_for(dev, std::uint64_t{1} << 40, rest, false, false));
  const EngineResult r2 = engine.run(drain);
  producer.join();
  CHECK(r2.status == RunStatus::kEndOfData);
  std::fill(delivered.begin(), delivered.end(), 0);
  for (const auto& e : rest.drain()) take(e);
  CHECK(ordered);
  CHECK(right);
  for (std::uint32_t dev = 0; dev < d; ++dev) CHECK(delivered[dev] == ok[dev].load());
  const std::string problems = seen.problems(pushed.load());
  CHECK_MESSAGE(problems.empty(), problems);
  std::sort(ids.begin(), ids.end());
  CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());
  CHECK(ids.size() + cut + (throws ? 1 : 0) == pushed.load());
  if (cut != 0) t.outcome += ", a trip cut short";
}

// ---- Pipelines ----

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
  Seen answered(total);  // counted at the last stage
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
  std::thread producer([&] {
    auto p = in.make_producer();
    for (std::uint64_t i = 0; i < closing.push && p.push(micro_batch(i)); ++i) ++pushed;
    in.close();
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  auto running = std::async(std::launch::async, [&] { return pipe.run(in, std::uint64_t{1} << 40, &out); });
  const auto ended_within = [&](auto d) { return running.wait_for(d) == std::future_status::ready; };
  const std::vector<OutfeedEntry<std::vector<float>>> read =
      stop_fault(rng, t, out, 5000, 12, ended_within, [&] { pipe.cancel(); });
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
  if (r) {
    switch (t.fault) {
      case Fault::kThrow:
        // The run may end before the failing micro-batch reaches the stage: never, since
        // the infeed holds it until it is taken; so a run that returns is a defect.
        CHECK_MESSAGE(false, "the run returned (" << r->message << ") instead of throwing StageError");
        break;
      case Fault::kCancel:
      case Fault::kReaderStops:
        CHECK((r->status == RunStatus::kCancelled || r->status == RunStatus::kEndOfData));
        t.outcome = r->status == RunStatus::kCancelled ? "cancelled" : "ended (end of data) before the cancel";
        break;
      case Fault::kClose:
        CHECK(r->status == RunStatus::kEndOfData);
        t.outcome = "end of data";
        break;
    }
  }
  if (closer.joinable()) closer.join();
  std::vector<std::uint64_t> ids;
  for (const auto& e : read) ids.push_back(static_cast<std::uint64_t>(e.value.at(0)));
  for (const auto& e : out.drain()) ids.push_back(static_cast<std::uint64_t>(e.value.at(0)));
  if (r) CHECK(ids.size() == r->micro_batches);  // every answer delivered (read, or still queued)
  // Same devices, a second run: the micro-batches that went back to the infeed and the rest.
  for (std::uint32_t rep = 0; rep < replicas; ++rep) static_cast<Tag&>(pipe.stage(rep, fail_stage)).fail_on = -1;
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
  if (threw) CHECK(answered.count(fail_id) == 0);  // the one it threw on is not answered (the error names it)
  const std::string problems = answered.problems(pushed.load(), skip);
  CHECK_MESSAGE(problems.empty(), problems);
  std::sort(ids.begin(), ids.end());
  CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());
  CHECK(ids.size() + (threw ? 1 : 0) == pushed.load());
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
    if (fail.load() && ctx.step == fail_step && ctx.micro_batch == fail_micro_batch && ctx.replica == fail_replica) {
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

void pipeline_training_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const auto shape = pipeline_shape(rng, group.size());
  const std::uint32_t stages = shape.first, replicas = shape.second;
  PipelineConfig cfg;
  cfg.replicas = replicas;
  cfg.schedule = std::array{PipelineSchedule::kGrouped, PipelineSchedule::kInterleaved,
                            PipelineSchedule::kSequential}[rng.below(3)];
  cfg.sync = rng.coin() ? SyncMode::kBsp : SyncMode::kDataflow;
  cfg.gradient_accumulation = cfg.min_gradient_accumulation(stages) + static_cast<std::uint32_t>(rng.below(2));
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
  std::thread producer([&] {
    auto p = in.make_producer();
    for (std::uint64_t i = 0;
         i < closing.push && p.push(micro_batch(i, 1, 0.25f + 0.01f * static_cast<float>(i % 7))); ++i) {
      ++pushed;
    }
    in.close();
  });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  auto running = std::async(std::launch::async, [&] { return pipe.run(in, steps, &out); });
  const auto ended_within = [&](auto d) { return running.wait_for(d) == std::future_status::ready; };
  const std::vector<OutfeedEntry<std::vector<float>>> read =
      stop_fault(rng, t, out, 5000, 12, ended_within, [&] { pipe.cancel(); });
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
    switch (t.fault) {
      case Fault::kThrow: CHECK_MESSAGE(false, "the run returned (" << r->message << ") instead of throwing StageError"); break;
      case Fault::kCancel:
      case Fault::kReaderStops:
        CHECK((r->status == RunStatus::kCancelled || r->status == RunStatus::kCompleted));
        t.outcome = r->status == RunStatus::kCancelled ? "cancelled" : "completed before the cancel";
        break;
      case Fault::kClose:
        CHECK((r->status == RunStatus::kEndOfData || r->status == RunStatus::kCompleted));
        if (r->status == RunStatus::kEndOfData) {
          CHECK(r->iterations <= pushed.load() / (std::uint64_t{k} * replicas));
          CHECK(contains(r->message, "the infeed ended at step"));
        }
        t.outcome = r->status == RunStatus::kEndOfData ? "end of data" : "completed before the close";
        break;
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
  for (std::uint64_t i = 0; i < again * k * replicas; ++i) REQUIRE(p2.push(micro_batch(i, 1, 0.5f)));
  in2.close();
  OutfeedQueue<std::vector<float>> out2(OutfeedConfig{replicas, OutputMode::all(), 0});
  const PipelineResult r2 = pipe.run(in2, again, &out2);
  CHECK(r2.completed());
  CHECK(r2.iterations == again);
  CHECK(out2.drain().size() == again * k * replicas);
}

// ---- Streams ----

void stream_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const std::uint32_t d = group.size();
  const auto stages = static_cast<std::uint32_t>(rng.in(d, 4));
  const bool throws = t.fault == Fault::kThrow;
  const OnError on_error = throws && rng.coin() ? OnError::kFailFast : OnError::kRespond;
  StreamConfig cfg;
  cfg.capacity = rng.in(1, 16);
  cfg.on_error = on_error;
  cfg.wait = rng.coin() ? WaitPolicy{} : WaitPolicy::park();
  const auto producers = static_cast<std::uint32_t>(rng.in(1, 3));
  const std::uint64_t per_producer = rng.in(10, 300);
  const std::uint64_t total = per_producer * producers;
  // A request's value is its index (producer k's i-th: k * per_producer + i); every stage adds 1.
  const std::uint64_t fail_value = rng.below(total);
  const auto fail_stage = static_cast<std::uint32_t>(rng.below(stages));
  auto builder = StreamBuilder<std::uint64_t>(group, cfg);
  for (std::uint32_t s = 0; s < stages; ++s) {
    builder = std::move(builder).stage(
        "s" + std::to_string(s),
        [s, throws, fail_value, fail_stage](std::uint64_t x) {
          if (throws && s == fail_stage && x - s == fail_value) throw std::runtime_error("injected fault");
          return x + 1;
        },
        s * d / stages);
  }
  auto stream = std::move(builder).build();
  InfeedQueue<Request<std::uint64_t>> in(InfeedConfig{.capacity = rng.in(1, 32)});
  const std::size_t out_capacity = t.fault == Fault::kReaderStops ? rng.in(1, 8) : 0;
  OutfeedQueue<Response<std::uint64_t>> out(OutfeedConfig{.capacity = out_capacity});
  stream.start(in, out);
  Seen answered(total);
  std::atomic<std::uint64_t> pushed{0};
  std::atomic<std::uint32_t> finished{0};
  std::vector<std::uint32_t> ids(producers);
  std::vector<std::thread> threads;
  std::mutex ids_mutex;
  std::map<std::uint32_t, std::uint32_t> index_of;  // producer id -> k
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      RequestProducer<std::uint64_t> producer(in);
      {
        std::lock_guard<std::mutex> l(ids_mutex);
        index_of[producer.id()] = p;
      }
      for (std::uint64_t i = 0; i < per_producer && producer.push(p * per_producer + i); ++i) ++pushed;
      if (++finished == producers) in.close();
    });
  }
  std::thread closer;
  if (t.fault == Fault::kClose) closer = close_later(in, micros(rng, 3000));
  std::vector<OutfeedEntry<Response<std::uint64_t>>> read;
  std::atomic<bool> give_up{false};
  std::atomic<bool> ended{false};
  std::thread watcher;
  if (t.fault == Fault::kReaderStops) {
    // stream.wait() is for the one thread that started it; the watcher polls the outfeed's
    // end instead: give up reading after a while if the stream ended by itself.
    watcher = std::thread([&] {
      const auto until = Clock::now() + 200ms;
      while (!ended.load() && Clock::now() < until) std::this_thread::sleep_for(1ms);
      give_up = true;
    });
    read = read_then_stop(out, rng.in(0, 12), give_up);
    std::this_thread::sleep_for(micros(rng, 2000));
    stream.cancel();
  } else if (t.fault == Fault::kCancel) {
    std::this_thread::sleep_for(micros(rng, 3000));
    stream.cancel();
  }
  std::vector<OutfeedEntry<Response<std::uint64_t>>> rest;
  if (t.fault != Fault::kReaderStops) {
    for (auto& e : out) rest.push_back(std::move(e));  // ends when the stream has ended
  }
  const StreamResult r = stream.wait();
  ended = true;
  if (watcher.joinable()) watcher.join();
  for (auto& e : out.drain()) rest.push_back(std::move(e));
  if (closer.joinable()) closer.join();
  std::uint64_t errors = 0;
  bool right = true;
  std::uint64_t delivered = 0;
  const auto take = [&](const OutfeedEntry<Response<std::uint64_t>>& e) {
    ++delivered;
    std::uint32_t k = 0;
    {
      std::lock_guard<std::mutex> l(ids_mutex);
      k = index_of.at(e.value.id.producer);
    }
    const std::uint64_t value = k * per_producer + e.value.id.sequence;
    answered.add(value);
    if (e.value.ok()) {
      right = right && *e.value.value == value + stages;
    } else {
      ++errors;
      right = right && value == fail_value && e.value.error->stage == fail_stage;
    }
  };
  for (const auto& e : read) take(e);
  for (const auto& e : rest) take(e);
  CHECK(right);
  CHECK(delivered == r.answered);  // every answer delivered (read, or still queued)
  CHECK(r.accepted == r.answered + r.unanswered);
  switch (t.fault) {
    case Fault::kThrow:
      if (on_error == OnError::kRespond) {
        CHECK(r.drained());
        CHECK(r.unanswered == 0);
        CHECK(errors == (fail_value < total ? 1u : 0u));
        t.outcome = "an error response, the stream went on (kRespond)";
      } else {
        CHECK(r.status == StreamStatus::kFailed);
        REQUIRE(r.failure != nullptr);
        CHECK(r.failure->stage == fail_stage);
        CHECK(contains(r.failure->message, "injected fault"));
        CHECK(r.unanswered >= 1);
        t.outcome = "failed fast (kFailFast)";
      }
      break;
    case Fault::kCancel:
    case Fault::kReaderStops:
      CHECK((r.status == StreamStatus::kCancelled || r.status == StreamStatus::kDrained));
      t.outcome = r.status == StreamStatus::kCancelled ? "cancelled" : "drained before the cancel";
      break;
    case Fault::kClose:
      CHECK(r.drained());
      CHECK(r.unanswered == 0);
      t.outcome = "drained after the close";
      break;
  }
  // Same devices, a second run answers what the first did not take.
  const std::uint64_t unanswered = r.unanswered;
  OutfeedQueue<Response<std::uint64_t>> out2(OutfeedConfig{.capacity = 0});  // unbounded: read after
  const StreamResult r2 = stream.run(in, out2);
  for (const auto& e : out2.drain()) take(e);
  for (auto& th : threads) th.join();
  CHECK(r2.drained());
  CHECK(r2.unanswered == 0);
  // Every request pushed answered once over the two runs, but for those the first run counts
  // as cut short (unanswered: taken, then stopped by the cancel or the failure).
  std::uint64_t once = 0, twice = 0;
  for (std::uint64_t v = 0; v < total; ++v) {
    const std::uint32_t c = answered.count(v);
    once += c == 1 ? 1 : 0;
    twice += c > 1 ? 1 : 0;
  }
  CHECK(twice == 0);
  CHECK_MESSAGE(once + unanswered == pushed.load(),
                "first run: " << r.message << " (accepted " << r.accepted << ", answered " << r.answered
                              << ", delivered " << delivered << "); second run: " << r2.message);
  CHECK(right);
}

void fault_injection() {
  const std::uint64_t trials = env_u64("BSPFLOW_SOAK_TRIALS", 2000);
  const std::uint64_t base_seed = env_u64("BSPFLOW_SOAK_SEED", 20261124);
  const char* only = std::getenv("BSPFLOW_SOAK_TRIAL");
  const std::uint64_t first = only != nullptr ? env_u64("BSPFLOW_SOAK_TRIAL", 0) : env_u64("BSPFLOW_SOAK_FROM", 0);
  const std::uint64_t last = only != nullptr ? first + 1 : trials;
  const std::chrono::seconds limit(env_u64("BSPFLOW_SOAK_TRIAL_SECONDS", 60));
  std::array<std::unique_ptr<DeviceGroup>, 5> groups;  // by device count, reused by every trial
  for (std::uint32_t d = 1; d <= 4; ++d) groups[d] = std::make_unique<DeviceGroup>(d, kSmall);
  std::map<std::string, std::map<std::string, std::uint64_t>> tally;  // "api, fault" -> outcome -> trials
  std::map<std::uint32_t, std::uint64_t> by_devices;
  Watchdog watchdog;
  const auto t0 = Clock::now();
  double slowest = 0;
  for (std::uint64_t i = first; i < last; ++i) {
    Trial t;
    t.number = i;
    t.api = static_cast<Api>(i % 5);
    t.fault = static_cast<Fault>((i / 5) % 4);
    t.devices = static_cast<std::uint32_t>(1 + (i / 20) % 4);
    const std::uint64_t seed = base_seed + i;
    Rng rng(seed);
    const std::string name = "trial " + std::to_string(i) + " (seed " + std::to_string(seed) + ": " +
                             kApiNames[static_cast<std::size_t>(t.api)] + ", " +
                             kFaultNames[static_cast<std::size_t>(t.fault)] + ", " + std::to_string(t.devices) +
                             " device" + (t.devices == 1 ? "" : "s") + "; rerun alone with BSPFLOW_SOAK_TRIAL=" +
                             std::to_string(i) + ")";
    INFO(name);
    watchdog.arm(name, limit);
    const auto started = Clock::now();
    DeviceGroup& group = *groups[t.devices];
    switch (t.api) {
      case Api::kLoops: loops_trial(rng, t, group); break;
      case Api::kEngine: engine_trial(rng, t, group); break;
      case Api::kPipelineInference: pipeline_inference_trial(rng, t, group); break;
      case Api::kPipelineTraining: pipeline_training_trial(rng, t, group); break;
      case Api::kStream: stream_trial(rng, t, group); break;
    }
    watchdog.disarm();
    slowest = std::max(slowest, seconds_since(started));
    tally[std::string(kApiNames[static_cast<std::size_t>(t.api)]) + ", " + kFaultNames[static_cast<std::size_t>(t.fault)]]
         [t.outcome.empty() ? "?" : t.outcome]++;
    ++by_devices[t.devices];
  }
  std::printf("soak: %llu fault-injection trials in %.1f s (slowest %.2f s; limit %lld s each)\n",
              static_cast<unsigned long long>(last - first), seconds_since(t0), slowest,
              static_cast<long long>(limit.count()));
  for (const auto& [what, outcomes] : tally) {
    std::uint64_t n = 0;
    std::string how;
    for (const auto& [outcome, count] : outcomes) {
      n += count;
      how += (how.empty() ? "" : ", ") + std::to_string(count) + " " + outcome;
    }
    std::printf("  %-40s %4llu: %s\n", what.c_str(), static_cast<unsigned long long>(n), how.c_str());
  }
  std::string devices;
  for (const auto& [d, n] : by_devices) {
    devices += (devices.empty() ? "" : ", ") + std::to_string(n) + " on " + std::to_string(d);
  }
  std::printf("  by devices: %s (4 devices share 2 cores here)\n", devices.c_str());
}

}  // namespace

TEST_SUITE("soak") {

TEST_CASE("exactly once at volume: loops::repeat, Pipeline inference, Stream") {
  const std::uint64_t elements = env_u64("BSPFLOW_SOAK_ELEMENTS", 10'000'000);
  if (std::getenv("BSPFLOW_SOAK_TRIAL") != nullptr) return;  // reproducing one fault trial
  soak_repeat(4, 2, elements);
  soak_repeat(3, 3, elements);
  soak_pipeline_inference(2, 2, elements);
  soak_stream(3, 2, elements);
}

TEST_CASE("seeded fault injection over loops, Engine programs, Pipelines and Streams") { fault_injection(); }

}  // TEST_SUITE
