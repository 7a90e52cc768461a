// What the soak suite's files share (soak_test.cpp describes the suite): the environment,
// the exactly-once bookkeeping (Arrivals, Seen, mix), the fault-injection trial (Trial, Rng,
// Watchdog, the faults' helpers), the one outcome check every trial makes of a run that
// returned (check_ending), the exactly-once check at the end of a trial, and the entry points
// of each subsystem's file: soak_loops.cpp, soak_engine.cpp, soak_pipeline.cpp,
// soak_stream.cpp. What the serving files (soak_serving.cpp, soak_graph.cpp) share besides is
// in soak_serve.hpp.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace soak {

using Clock = std::chrono::steady_clock;

inline const bspflow::DeviceConfig kSmall{64, 64 * 1024};

// The unsigned number in environment variable `name`, or `otherwise` if it is unset or
// empty. Anything else ends the process (exit 2) naming the variable.
std::uint64_t env_u64(const char* name, std::uint64_t otherwise);

double seconds_since(Clock::time_point t0);

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
  std::uint64_t missing() const;
  std::uint64_t duplicates() const { return duplicates_; }
  std::uint64_t foreign() const { return foreign_; }

 private:
  std::vector<std::vector<std::uint8_t>> seen_;
  std::uint64_t duplicates_ = 0, foreign_ = 0;
};

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser: a checksum term per element
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline constexpr std::uint32_t kMaxProducers = 8;

// The runs at volume, one per subsystem, each of at least `elements` elements: loops::repeat
// (soak_loops.cpp), Pipeline inference (soak_pipeline.cpp), a Stream (soak_stream.cpp).
void soak_repeat(std::uint32_t producers, std::uint32_t replicas, std::uint64_t elements);
void soak_pipeline_inference(std::uint32_t producers, std::uint32_t replicas,
                             std::uint64_t elements);
void soak_stream(std::uint32_t producers, std::uint32_t devices, std::uint64_t elements);

// ---------------------------------------------------------------------------------------
// Fault injection
// ---------------------------------------------------------------------------------------

enum class Api { kLoops, kEngine, kPipelineInference, kPipelineTraining, kStream };
enum class Fault { kThrow, kCancel, kClose, kReaderStops };
inline constexpr std::array<const char*, 5> kApiNames{
    "loops::repeat", "Engine", "Pipeline inference", "Pipeline training", "Stream"};
inline constexpr std::array<const char*, 4> kFaultNames{"throws", "cancel", "infeed closed",
                                                        "reader stops"};

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
  ~Watchdog();
  void arm(std::string what, std::chrono::seconds limit);
  void disarm();

 private:
  void loop();
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
      n_[id].fetch_add(1, std::memory_order_relaxed);  // relaxed: read after the threads are joined
    } else {
      foreign_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  // Ids [0, pushed) processed other than once (except `skip`), and ids beyond: "" if none.
  std::string problems(std::uint64_t pushed, std::uint64_t skip = kNone) const;
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

// How a run that returned (rather than threw) may end under a trial's fault, and what the
// tally calls each ending.
struct Ending {
  bspflow::RunStatus status;
  const char* outcome;
};
struct Endings {
  std::vector<Ending> thrown;   // Fault::kThrow; none: the fault must make the run throw
  std::vector<Ending> stopped;  // Fault::kCancel, Fault::kReaderStops
  std::vector<Ending> closed;   // Fault::kClose
};
// A run asked for a number of iterations (loops::repeat, Engine programs, Pipeline
// training): a stop or a close may come only after it completed.
extern const Endings kCountedRunEndings;

// The outcome check every trial makes of a run that returned: its status must be one the
// trial's fault allows (`endings`; none allowed: the fault should have made the run throw),
// and t.outcome becomes that ending's name. Returns whether the status was allowed.
bool check_ending(Trial& t, bspflow::RunStatus status, const std::string& message,
                  const Endings& endings);

// The exactly-once check at the end of a trial's two runs: every id below `pushed` was
// processed (`seen`) once, but `skip` (the one a stage threw on, if any), and no other id;
// the outputs `ids` hold each at most once, and all of them but `undelivered` (processed,
// rightly without an output: the one a body threw on, trips a stop cut short).
void check_exactly_once(const Seen& seen, std::uint64_t pushed, std::vector<std::uint64_t> ids,
                        std::uint64_t undelivered, std::uint64_t skip = Seen::kNone);

// The "infeed closed mid-run" fault, two ways: the producer stops after a random number of
// elements and closes the infeed, or another thread closes it at a random time while the
// producer pushes. Other faults push everything, then close.
struct Closing {
  std::uint64_t push = 0;     // elements the producer offers
  bool from_outside = false;  // another thread closes the infeed (close_later)
};
Closing closing_for(Rng& rng, const Trial& t, std::uint64_t total);

// The trial's outfeed: unbounded, or bounded with one reader (a ring per replica) or shared
// (the reader-stops fault).
bspflow::OutfeedConfig outfeed_config(std::uint32_t replicas, std::size_t capacity, Rng& rng);

// Busy for `d` (a body that takes time, so a cancel can land mid-run).
void spin_for(std::chrono::microseconds d);

std::chrono::microseconds micros(Rng& rng, std::uint64_t max);

// The trial's producer: a thread that offers make(i) for i < count until a push is refused
// (the infeed was closed), counts what was taken in `pushed`, then closes the infeed.
template <class T, class Make>
std::thread produce(bspflow::InfeedQueue<T>& in, std::uint64_t count,
                    std::atomic<std::uint64_t>& pushed, Make make) {
  return std::thread([&in, count, &pushed, make] {
    auto p = in.make_producer();
    for (std::uint64_t i = 0; i < count && p.push(make(i)); ++i) ++pushed;
    in.close();
  });
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
std::vector<bspflow::OutfeedEntry<T>> read_then_stop(bspflow::OutfeedQueue<T>& out, std::uint64_t k,
                                                     const std::atomic<bool>& give_up) {
  std::vector<bspflow::OutfeedEntry<T>> got;
  while (got.size() < k && !give_up.load()) {
    if (auto e = out.try_pop()) {
      got.push_back(std::move(*e));
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return got;
}

// A trial's stop token: the cancel fault stops half of its runs before they start (the
// token given to run(), stopped before the call: the run must take nothing and end
// kCancelled), the other half once, at a random time (stop_fault). Other faults never stop it.
struct Stopper {
  std::stop_source source;
  bool before = false;  // stopped before the run was started
  std::stop_token token() const { return source.get_token(); }
};
Stopper stopper_for(Rng& rng, const Trial& t);
// A run stopped before it started: kCancelled, no iteration anywhere (it took nothing; the
// exactly-once check then finds every element processed by the second run). Names the outcome.
void check_stopped_before(Trial& t, bspflow::RunStatus status,
                          const std::vector<std::uint64_t>& iterations);

// The cancel and reader-stops faults against a run in progress: `ended_within(d)` waits up
// to d for the run to end and says whether it has, `cancel()` stops it (exactly once: a
// stop token is never lost, nor a cancel() made once the run's call has begun). A cancel
// comes after a random delay of up to `cancel_within` (none if the trial's stopper stopped
// the run before it started); a reader reads up to `read_at_most` entries (or until the run
// ends by itself), stops, and the run, which cannot end by itself now, is cancelled. Returns
// what the reader read.
template <class T, class Ended, class Cancel>
std::vector<bspflow::OutfeedEntry<T>> stop_fault(Rng& rng, const Trial& t,
                                                 bspflow::OutfeedQueue<T>& out,
                                                 std::uint64_t cancel_within,
                                                 std::uint64_t read_at_most, Ended ended_within,
                                                 Cancel cancel, const Stopper& stopper) {
  using std::chrono::milliseconds;
  std::vector<bspflow::OutfeedEntry<T>> read;
  if (t.fault == Fault::kCancel) {
    if (stopper.before) return read;
    std::this_thread::sleep_for(micros(rng, cancel_within));
    cancel();
  } else if (t.fault == Fault::kReaderStops) {
    const std::uint64_t k = rng.in(0, read_at_most);
    std::atomic<bool> give_up{false};
    std::thread watcher([&] {
      while (!ended_within(milliseconds(1))) {
      }
      give_up = true;  // a run that ends (the outfeed held everything) ends the reading too
    });
    read = read_then_stop(out, k, give_up);
    std::this_thread::sleep_for(micros(rng, 2000));
    cancel();
    watcher.join();
  }
  return read;
}

// One trial per subsystem, on `group`'s devices, with the fault t.fault; each sets t.outcome:
// loops::repeat (soak_loops.cpp), Engine programs (soak_engine.cpp), Pipeline inference and
// training (soak_pipeline.cpp), a Stream (soak_stream.cpp).
void loops_trial(Rng& rng, Trial& t, bspflow::DeviceGroup& group);
void engine_trial(Rng& rng, Trial& t, bspflow::DeviceGroup& group);
void pipeline_inference_trial(Rng& rng, Trial& t, bspflow::DeviceGroup& group);
void pipeline_training_trial(Rng& rng, Trial& t, bspflow::DeviceGroup& group);
void stream_trial(Rng& rng, Trial& t, bspflow::DeviceGroup& group);

}  // namespace soak
