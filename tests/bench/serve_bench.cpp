// Serving benchmark: a model whose batch of n requests costs a + b*n of busy work
// (default 20 us + 2 us per request, so batching pays), served by a Stream with a batch stage,
// measured the way an inference server is: its capacity first, then an open-loop client at
// fractions of it. Keys (every ratio against references measured in the same run):
//
//   serve_capacity_requests_per_s   closed loop at saturation (8 batches outstanding, no
//       deadlines), deadline-aware batcher: the 100% of the loads below (a figure)
//   serve_goodput_vs_best_fixed_timeout_30, _70, _100, _130   requests answered with a value
//       within their deadline per second at that % of capacity, deadline-aware batching (no
//       max_delay) over the best of the fixed-delay batchers (deadline_aware off, max_delay
//       0, 50, 200, 1000 us) given the same arrivals; printed, no longer a target (at a
//       steady load the best fixed delay is already optimal: the two tie by construction)
//   serve_p99_vs_deadline_100   p99 latency of the requests answered with a value at 100%,
//       deadline-aware batching, over the deadline; target <= 1.0
//   serve_overload_lost_130   at 130%, runs with AdmissionPolicy::kReject and with kShed
//       (predict on): requests neither refused at push nor answered, both runs; target = 0
//   serve_overload_admitted_p99_vs_deadline_130   p99 latency of every admitted request's
//       answer (value or error; a lost one counts as never) over the deadline, the worse of
//       the two policies; target <= 1.0
//   serve_late_send_fraction_<load>, serve_overload_<policy>_late_send_fraction_130   sends
//       made over 50 us after their scheduled time (the client behind), a share of the sends:
//       figures that say when the client, not the stream, made requests late
//   serve_replicas_2_vs_1_throughput_vs_floor   closed-loop requests/s of 2 replicas (2
//       devices) over 1, over the machine's floor: 2 pinned threads doing the same batches
//       over 1; target >= 0.9
//   serve_cancel_wasted_stages_p99   3 stages on 2 devices, the client cancelling each
//       request shortly after its push: stage calls that started on a request after its
//       cancel() returned, p99 over the requests it cancelled; target <= 1
//   serve_stats_overhead_p50   closed-loop p50 (2 stages of 1 us), StreamConfig::stats on
//       over off, rounds alternating; target <= 1.02
//
// Graphs, priority classes, swaps and mixed deadlines (serve_sections.cpp; 5 alternating
// rounds, the median; the open loops there use a model 10 times as costly, measured as
// serve_x10_capacity_requests_per_s, and one client per kind of traffic):
//   serve_graph_hop_p50_us   closed-loop p50 of a 3-node chain built as a graph (its devices
//       sharing core 1, so fused on one thread) minus the same work as one stage, per hop;
//       target <= 2
//   serve_fanout_vs_slowest_branch   closed-loop p50 of a fan-out to two 50 us branches on
//       their own cores and a join, over one 50 us branch alone (the client pinned to core
//       0; a device there is told so, Placement::shares_host); target <= 1.3 (serial: 2)
//   serve_fanout_join_at_branch_vs_slowest_branch   the same with the join where the remote
//       branch ends (example 12's placement), not on pre's device; target <= 1.3
//   serve_priority_high_p99_vs_bound   10% high, 90% low class at 200% of capacity
//       (kReject, a queue of 16 batches): the high class's p99 over its p99 alone plus one
//       full batch's service time (a running batch is not preempted); target <= 1.2
//   serve_priority_high_p99_vs_no_classes   the same traffic in one class: the same requests'
//       p99 with classes over without; target <= 0.3
//   serve_priority_low_share   the low class's share of the answers over its configured
//       minimum share (0.2); target >= 1.0
//   serve_swap_failed   requests answered with an error or never, and swaps not done, over
//       an in-place swap at 80% of capacity and a rolling swap of 2 replicas at 40% of their
//       nominal capacity (they share core 1: one carries it alone); target = 0
//   serve_swap_p99_vs_steady, serve_rolling_swap_p99_vs_steady   3 swaps a run: p99 of the
//       requests sent from 20 ms before a swap to 20 ms after it over p99 of the others;
//       targets <= 1.3, 1.5
//   serve_swap_first_vs_steady_p50   p50 of the first 20 answers of each new version (its
//       first call is 2 ms cold; the swap warms it with one input) over p50 of the first 20
//       answers after moments before the swap; target <= 1.2. serve_swap_first_unwarmed_...
//       is the same without warm-up inputs (a figure: what warm-up buys)
//   serve_goodput_mixed_vs_best_fixed   20% of requests with a tight deadline (2 batch
//       times), 80% loose (20), the load stepping 30% -> 130% -> 70% of capacity with a
//       burst: requests answered within their deadline by the deadline-aware stream over the
//       best fixed-delay batcher (first in, first out, no prediction; 0, 50, 200, 1000 us,
//       one for the whole run), a parity guard: target >= 0.97, the defaults need no tuning to
//       match the best fixed delay chosen in hindsight. Every contender reaches
//       serve_goodput_mixed_capacity_bound_share (what any scheduler could answer on time
//       from the measured capacity), so no scheduler can lead by much here
//
// Placement (this VM has 2 cores): the client runs on core 0, which the stream reserves for it
// (DeviceConfig::host_cores), so the devices go on core 1 (one device, or two sharing it). The
// replicas' run cannot: two replicas need both cores, so device 0 is on core 1 and device 1 on
// core 0 beside the client, placed as sharing the host's core (Placement::shares_host: it
// spins briefly, then parks), and the client blocks in pop_until() instead of spinning. The
// floor's threads are placed the same way (Topology::place(2): cores 1 and 0), without a client.
//
// The open-loop client is one thread on core 0 that both sends and receives. It sends request
// i at its scheduled time t_i (Poisson arrivals: exponential gaps from a fixed seed, the same
// arrivals for every batcher at a load) with deadline t_i + D, by try_push: an open loop must
// not be slowed by the system it measures, so a refused push is counted, never retried. Between
// sends it pops its own responses with try_pop. A latency is pop time - t_i, from the scheduled
// time and not from the push: a send made late because the client fell behind is charged to
// the latency (coordinated omission corrected). Why one thread: responses come back to the
// client that pushed (a StreamClient is one per thread), and a second thread on core 0 would
// be time-sliced with the sender by the OS in milliseconds, so the latencies would measure its
// scheduler. One thread polling both
// never waits for the other; a response waits in the client's ring at most one send before it
// is popped. The sending ends at a fixed time (the schedule's end, or 0.5 s later if the client
// fell behind: the rest count as lost), then the client waits for what it is owed for at most
// D + 1 s, closes the stream and waits for it (a watchdog cancels it after 10 s, and ends the
// process 10 s later: the benchmark never hangs).
#include <time.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/devices/topology.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "bench_util.hpp"
#include "serve_sections.hpp"

using namespace bspflow;
using bench::Clock;
using bench::spin_for;
using namespace std::chrono_literals;

namespace {

using ns = std::chrono::nanoseconds;

struct Req {
  std::uint32_t idx = 0;  // the benchmark's own request number (default-constructible: padding)
};
using Server = Stream<Req, Req>;

// part / whole as a figure; 0 when there is no whole (nothing sent, nothing on time).
double share(std::uint64_t part, std::uint64_t whole) {
  return whole ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

// The model: a batch of n costs a + b*n.
struct Model {
  ns a{20'000};
  ns b{2'000};
  std::size_t max_batch = 16;
  ns batch_cost(std::size_t n) const { return a + b * static_cast<std::int64_t>(n); }
};

constexpr ns kChainWork{1'000};  // per stage of the closed-loop streams (as stream_bench's)

std::int64_t now_ns() {
  return std::chrono::duration_cast<ns>(Clock::now().time_since_epoch()).count();
}

ns to_ns(double seconds) {
  return std::chrono::duration_cast<ns>(std::chrono::duration<double>(seconds));
}

using bench::devices_off_core0;
using bench::pin_host;

// Ends the process if a phase outlives `limit`: first calls `on_late` (cancel the stream),
// then, `limit` later, prints what hung and exits 2. A benchmark must never hang.
class Watchdog {
 public:
  Watchdog(std::string what, ns limit, std::function<void()> on_late = {})
      : thread_([this, what = std::move(what), limit, on_late = std::move(on_late)] {
          std::unique_lock lock(mutex_);
          if (cv_.wait_for(lock, limit, [&] { return done_; })) return;
          std::fprintf(stderr, "serve_bench: %s: not done after %.0f s\n", what.c_str(),
                       std::chrono::duration<double>(limit).count());
          if (on_late) {
            lock.unlock();
            on_late();
            lock.lock();
            if (cv_.wait_for(lock, limit, [&] { return done_; })) return;
          }
          std::fprintf(stderr, "serve_bench: %s: still not done; exiting\n", what.c_str());
          std::fflush(stderr);
          std::_Exit(2);
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

int g_not_drained = 0;  // runs whose wait() did not say drained (printed at the end)
bool g_detail = false;  // --detail: time each open-loop push too

// Closes `stream` and waits for it to drain (cancelled after 10 s).
StreamResult finish(Server& stream, const std::string& what) {
  stream.close();
  Watchdog dog(what + ": drain after close()", 10s, [&] { stream.cancel(); });
  StreamResult r = stream.wait();
  if (!r.drained()) ++g_not_drained;
  return r;
}

// ---- the model as a batch stage ----

BatchConfig deadline_aware_batching(const Model& m) {
  BatchConfig c;
  c.max_batch = m.max_batch;
  c.max_delay = std::nullopt;
  c.deadline_aware = true;
  return c;
}

BatchConfig fixed_delay_batching(const Model& m, ns max_delay) {
  BatchConfig c;
  c.max_batch = m.max_batch;
  c.max_delay = max_delay;
  c.deadline_aware = false;
  return c;
}

Server build_server(DeviceList devices, const Model& m, const BatchConfig& batching,
                    StreamConfig config) {
  auto model = [a = m.a, b = m.b](std::span<Req> batch) {
    spin_for(a + b * static_cast<std::int64_t>(batch.size()));
    return std::vector<Req>(batch.begin(), batch.end());
  };
  return StreamBuilder<Req>(devices, std::move(config))
      .batch_stage("model", model, batching)
      .build();
}

// The open-loop runs' stream: admission by `policy` with prediction, and room enough in the
// client's ring that it never refuses for that (kClientFull).
StreamConfig serving_config(AdmissionPolicy policy) {
  StreamConfig c;
  c.admission.policy = policy;
  c.admission.predict = true;
  c.response_capacity = std::size_t{1} << 14;
  return c;
}

// ---- capacity: a closed loop at saturation ----

// Keeps `window` requests outstanding (no deadlines) for `seconds`; requests/s answered over
// the last 80% of it. Blocks in pop_until between bursts (the client may share its core with
// a device). Then drains and closes the stream.
// This thread's CPU time, in seconds.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
}

// `cpu_share`, if given: the share of one core the client thread used while counting.
double saturate(Server& stream, std::size_t window, double seconds, const std::string& what,
                double* cpu_share = nullptr) {
  double rate = 0;
  {
    auto client = stream.client();
    double cpu_at_warm = -1;
    const auto start = Clock::now();
    const auto warm = start + to_ns(seconds * 0.2);
    const auto end = start + to_ns(seconds);
    std::uint64_t counted = 0;
    for (;;) {
      const auto now = Clock::now();
      if (now >= end) break;
      while (client.outstanding() < window && client.try_push(Req{}).accepted()) {
      }
      auto r = client.pop_until(std::min<Deadline>(end, now + 100ms));
      const bool counting = Clock::now() >= warm;
      if (counting && cpu_at_warm < 0) cpu_at_warm = thread_cpu_seconds();
      while (r) {
        if (counting) ++counted;
        r = client.try_pop();
      }
    }
    rate = static_cast<double>(counted) / (seconds * 0.8);
    if (cpu_share != nullptr && cpu_at_warm >= 0) {
      *cpu_share = (thread_cpu_seconds() - cpu_at_warm) / (seconds * 0.8);
    }
    const auto give_up = Clock::now() + 2s;
    while (client.outstanding() > 0 && Clock::now() < give_up) {
      (void)client.pop_until(std::min<Deadline>(give_up, Clock::now() + 100ms));
    }
    finish(stream, what);
  }
  return rate;
}

// The machine's floor for replicas: `threads` threads placed and pinned like that many
// devices, each doing full batches of the model's busy work for about `seconds`.
double floor_rate(std::uint32_t threads, const Model& m, double seconds) {
  const ns cost = m.batch_cost(m.max_batch);
  const auto batches =
      std::max<std::uint64_t>(1, static_cast<std::uint64_t>(seconds * 1e9 / cost.count()));
  const double s = bench::on_placed_threads(threads, [&](std::uint32_t) {
    for (std::uint64_t k = 0; k < batches; ++k) spin_for(cost);
  });
  return static_cast<double>(threads * batches * m.max_batch) / s;
}

// ---- the open loop ----

// Send times (ns from the start) of a Poisson process of `rate` per second over `seconds`.
std::vector<std::int64_t> poisson_arrivals(double rate, double seconds, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate / 1e9);  // per ns
  std::vector<std::int64_t> at;
  at.reserve(static_cast<std::size_t>(rate * seconds * 1.1) + 16);
  for (double t = gap(rng); t < seconds * 1e9; t += gap(rng)) {
    at.push_back(static_cast<std::int64_t>(t));
  }
  return at;
}

struct OpenLoop {
  std::uint64_t sent = 0;      // pushes tried
  std::uint64_t accepted = 0;  // pushes admitted
  std::uint64_t refused = 0;   // pushes refused (nothing queued)
  std::uint64_t answered = 0;  // responses popped, any kind
  std::uint64_t ok = 0;        // answered with a value
  std::uint64_t on_time = 0;   // answered with a value within the deadline
  std::uint64_t lost = 0;      // admitted and never answered, or never sent (client behind)
  std::array<std::uint64_t, 4> errors{};      // by ErrorKind
  std::array<std::uint64_t, 7> refused_by{};  // by Refusal
  std::vector<double> ok_ns;                  // latency of each answer with a value
  std::vector<double> admitted_ns;  // latency of each admitted request's answer; lost: inf
  std::uint64_t slow_pushes = 0;    // try_push calls over 20 us (--detail)
  double slowest_push_us = 0;
  std::uint64_t late_sends = 0;   // sends over 50 us after their scheduled time
  std::uint64_t late_errors = 0;  // answered with an error after the deadline (--detail)
};

// Sends `at` (see poisson_arrivals) through a started `stream` with deadline D each, pops
// the responses on the same thread, then closes the stream. See the top of the file.
OpenLoop open_loop(Server& stream, const std::vector<std::int64_t>& at, ns deadline, double seconds,
                   const std::string& what) {
  enum class Fate : std::uint8_t { kUnsent, kRefused, kPending, kOk, kError };
  constexpr std::uint32_t kNobody = std::numeric_limits<std::uint32_t>::max();
  const std::size_t n = at.size();
  std::vector<std::int64_t> lat(n, 0);
  std::vector<Fate> fate(n, Fate::kUnsent);
  // Request of each accepted push, by RequestId::sequence - the first accepted one's (a push
  // uses at most one sequence number, so the offset stays below n).
  std::vector<std::uint32_t> idx_of_seq(n, kNobody);
  std::optional<std::uint64_t> base;
  OpenLoop r;
  {
    auto client = stream.client();
    const auto t0 = Clock::now() + 1ms;
    auto take = [&](Response<Req>& resp) {
      const auto now = Clock::now();
      if (!base || resp.id.sequence < *base) return;  // not a request of this run
      const std::uint64_t seq = resp.id.sequence - *base;
      if (seq >= n || idx_of_seq[seq] == kNobody) return;
      const std::uint32_t i = idx_of_seq[seq];
      if (fate[i] != Fate::kPending) return;  // a second answer: not counted twice
      ++r.answered;
      lat[i] = (now - (t0 + ns(at[i]))).count();
      if (resp.ok()) {
        fate[i] = Fate::kOk;
      } else {
        fate[i] = Fate::kError;
        ++r.errors[static_cast<std::size_t>(resp.kind())];
      }
    };
    const auto stop_sending = t0 + to_ns(seconds + 0.5);
    std::size_t i = 0;
    while (i < n) {
      const auto due = t0 + ns(at[i]);
      const auto now = Clock::now();
      if (now >= due) {
        if (now > stop_sending) break;  // hopelessly behind: the rest are never sent (lost)
        const Submission s = client.try_push(Req{static_cast<std::uint32_t>(i)}, due + deadline);
        if (now - due > 50us) ++r.late_sends;  // the client was behind its schedule
        if (g_detail) {
          const auto after = Clock::now();
          const double took = std::chrono::duration<double, std::micro>(after - now).count();
          if (took > 20) ++r.slow_pushes;
          r.slowest_push_us = std::max(r.slowest_push_us, took);
        }
        ++r.sent;
        if (s.accepted() && !base) base = s.id.sequence;
        if (s.accepted() && s.id.sequence - *base < n) {
          fate[i] = Fate::kPending;
          idx_of_seq[s.id.sequence - *base] = static_cast<std::uint32_t>(i);
          ++r.accepted;
        } else {
          fate[i] = Fate::kRefused;
          ++r.refused;
          ++r.refused_by[static_cast<std::size_t>(s.refusal)];
        }
        ++i;
      }
      while (auto resp = client.try_pop()) take(*resp);
    }
    const auto give_up = Clock::now() + deadline + 1s;
    while (r.answered < r.accepted && Clock::now() < give_up) {
      if (auto resp = client.pop_until(std::min<Deadline>(give_up, Clock::now() + 10ms))) {
        take(*resp);
      }
    }
    finish(stream, what);
    while (auto resp = client.try_pop()) take(*resp);  // answered while draining (late)
  }
  const double inf = std::numeric_limits<double>::infinity();
  r.ok_ns.reserve(r.answered);
  r.admitted_ns.reserve(r.accepted);
  for (std::size_t k = 0; k < n; ++k) {
    const auto l = static_cast<double>(lat[k]);
    switch (fate[k]) {
      case Fate::kUnsent:
        ++r.lost;
        break;
      case Fate::kRefused:
        break;
      case Fate::kPending:
        ++r.lost;
        r.admitted_ns.push_back(inf);
        break;
      case Fate::kOk:
        ++r.ok;
        if (lat[k] <= deadline.count()) ++r.on_time;
        r.ok_ns.push_back(l);
        r.admitted_ns.push_back(l);
        break;
      case Fate::kError:
        if (lat[k] > deadline.count()) ++r.late_errors;
        r.admitted_ns.push_back(l);
        break;
    }
  }
  return r;
}

// Adds one open-loop run's counts and latencies to `into`.
void add_to(OpenLoop& into, OpenLoop&& r) {
  into.sent += r.sent;
  into.accepted += r.accepted;
  into.refused += r.refused;
  into.answered += r.answered;
  into.ok += r.ok;
  into.on_time += r.on_time;
  into.lost += r.lost;
  for (std::size_t k = 0; k < r.errors.size(); ++k) into.errors[k] += r.errors[k];
  for (std::size_t k = 0; k < r.refused_by.size(); ++k) into.refused_by[k] += r.refused_by[k];
  into.ok_ns.insert(into.ok_ns.end(), r.ok_ns.begin(), r.ok_ns.end());
  into.admitted_ns.insert(into.admitted_ns.end(), r.admitted_ns.begin(), r.admitted_ns.end());
  into.slow_pushes += r.slow_pushes;
  into.slowest_push_us = std::max(into.slowest_push_us, r.slowest_push_us);
  into.late_sends += r.late_sends;
  into.late_errors += r.late_errors;
}

// One open-loop run's counts on stderr (--detail).
void print_detail(const std::string& what, const OpenLoop& r) {
  std::fprintf(stderr, "%s: sent %llu accepted %llu on_time %llu ok %llu lost %llu", what.c_str(),
               static_cast<unsigned long long>(r.sent), static_cast<unsigned long long>(r.accepted),
               static_cast<unsigned long long>(r.on_time), static_cast<unsigned long long>(r.ok),
               static_cast<unsigned long long>(r.lost));
  for (std::size_t k = 1; k < r.refused_by.size(); ++k) {
    if (r.refused_by[k] == 0) continue;
    std::fprintf(stderr, " refused_%s %llu", to_string(static_cast<Refusal>(k)),
                 static_cast<unsigned long long>(r.refused_by[k]));
  }
  for (std::size_t k = 0; k < r.errors.size(); ++k) {
    if (r.errors[k] == 0) continue;
    std::fprintf(stderr, " error_%s %llu", to_string(static_cast<ErrorKind>(k)),
                 static_cast<unsigned long long>(r.errors[k]));
  }
  std::fprintf(stderr, " late_ok %llu late_errors %llu",
               static_cast<unsigned long long>(r.ok - r.on_time),
               static_cast<unsigned long long>(r.late_errors));
  std::fprintf(stderr, " slow_pushes %llu slowest_push_us %.0f late_sends %llu\n",
               static_cast<unsigned long long>(r.slow_pushes), r.slowest_push_us,
               static_cast<unsigned long long>(r.late_sends));
}

// ---- cancellation ----

struct CancelFigures {
  std::uint64_t cancelled = 0;           // cancel() returned true
  std::uint64_t answered_cancelled = 0;  // responses of kind kCancelled
  std::uint64_t lost = 0;                // admitted, never answered
  double wasted_p99 = 0;                 // stage calls started after the cancel, p99
  double wasted_max = 0;
};

// 3 stages of `cost` (2 on device 0, 1 on device 1), each recording when it starts on each
// request. The client keeps `window` requests outstanding and cancels each at a random time
// 0..3*cost after its push; a stage call on a request that starts after its cancel() returned
// is wasted (one may start in the moment between the runtime's check and the return).
CancelFigures cancel_run(DeviceList devices, ns cost, std::uint32_t n, std::uint64_t seed) {
  constexpr std::uint32_t kStages = 3;
  constexpr std::uint32_t kNobody = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::atomic<std::int64_t>> started(std::size_t{kStages} * n);  // 0: never
  std::vector<std::int64_t> cancel_ns(n, 0);                                 // 0: not cancelled
  auto stage = [p = started.data(), n, cost](std::uint32_t s) {
    return [p, n, cost, s](Req r) {
      p[std::size_t{s} * n + r.idx].store(now_ns(), std::memory_order_relaxed);
      spin_for(cost);
      return r;
    };
  };
  Server stream = StreamBuilder<Req>(devices)
                      .stage("s0", stage(0), 0)
                      .stage("s1", stage(1), 0)
                      .stage("s2", stage(2), 1)
                      .build();
  stream.start();
  CancelFigures f;
  std::uint64_t accepted = 0;
  std::uint64_t answered = 0;
  {
    auto client = stream.client();
    struct Outstanding {
      std::uint32_t idx;
      RequestId id;
      Clock::time_point cancel_at;
      bool tried;
    };
    std::vector<Outstanding> out;
    std::vector<std::uint32_t> idx_of_seq(n, kNobody);  // as in open_loop
    std::optional<std::uint64_t> base;
    std::vector<bool> done(n, false);
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::int64_t> delay(0, 3 * cost.count());
    const std::size_t window = 4;
    auto take = [&](Response<Req>& resp) {
      if (!base || resp.id.sequence < *base) return;
      const std::uint64_t seq = resp.id.sequence - *base;
      if (seq >= n || idx_of_seq[seq] == kNobody || done[idx_of_seq[seq]]) return;
      const std::uint32_t i = idx_of_seq[seq];
      done[i] = true;
      ++answered;
      if (!resp.ok() && resp.kind() == ErrorKind::kCancelled) ++f.answered_cancelled;
      std::erase_if(out, [&](const Outstanding& o) { return o.idx == i; });
    };
    std::uint32_t next = 0;
    const auto give_up = Clock::now() + 30s;
    while ((next < n || !out.empty()) && Clock::now() < give_up) {
      if (next < n && out.size() < window) {
        const Submission s = client.try_push(Req{next});
        if (s.accepted() && !base) base = s.id.sequence;
        if (s.accepted() && s.id.sequence - *base < n) {
          idx_of_seq[s.id.sequence - *base] = next;
          out.push_back({next, s.id, Clock::now() + ns(delay(rng)), false});
          ++accepted;
        }
        ++next;
      }
      const auto now = Clock::now();
      for (auto& o : out) {
        if (o.tried || now < o.cancel_at) continue;
        o.tried = true;
        if (client.cancel(o.id)) {
          cancel_ns[o.idx] = now_ns();  // after cancel() returned
          ++f.cancelled;
        }
      }
      while (auto resp = client.try_pop()) take(*resp);
    }
    finish(stream, "cancel");
    while (auto resp = client.try_pop()) take(*resp);
  }
  f.lost = accepted - answered;
  std::vector<double> wasted;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (cancel_ns[i] == 0) continue;
    int w = 0;
    for (std::uint32_t s = 0; s < kStages; ++s) {
      if (started[std::size_t{s} * n + i].load(std::memory_order_relaxed) > cancel_ns[i]) ++w;
    }
    wasted.push_back(w);
  }
  f.wasted_p99 = bench::quantile(wasted, 0.99);
  f.wasted_max = wasted.empty() ? 0.0 : wasted.back();  // sorted by quantile()
  return f;
}

// ---- closed loops, one request in flight ----

// 2 stages of kChainWork on 2 devices (stream_bench's stream).
Server build_chain(DeviceList devices, StreamConfig config) {
  auto work = [](Req r) {
    spin_for(kChainWork);
    return r;
  };
  return StreamBuilder<Req>(devices, std::move(config)).stage("s0", work).stage("s1", work).build();
}

// Push, then wait for the response: spinning on try_pop (`spin`; gives up after 1 s) or
// blocking in pop(), as a client would (the caller's watchdog cancels the stream, which
// answers it). Latencies in ns; empty if a response did not come.
std::vector<double> client_closed_loop(Server& stream, std::uint64_t n, bool spin) {
  auto client = stream.client();
  std::vector<double> lat;
  lat.reserve(n);
  for (std::uint64_t i = 0; i < n + n / 10; ++i) {  // the first tenth warms up
    const auto t0 = Clock::now();
    if (!client.push(Req{})) return {};
    std::optional<Response<Req>> r;
    if (spin) {
      const auto give_up = t0 + 1s;
      while (!(r = client.try_pop()) && Clock::now() < give_up) detail::cpu_relax();
    } else {
      r = client.pop();
    }
    if (!r) return {};
    if (i >= n / 10)
      lat.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  return lat;
}

double p50_or_inf(std::vector<double> lat) {
  return lat.empty() ? std::numeric_limits<double>::infinity() : bench::quantile(lat, 0.5);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "serve_bench: a batching, deadline-aware stream under an open-loop client, against "
      "fixed-delay batchers and the machine's floor"};
  bench::CommonArgs common;
  common.add_to(app);
  double a_us = 20.0;
  double b_us = 2.0;
  std::size_t max_batch = 16;
  double deadline_us = 0.0;
  double seconds = 0.0;
  std::uint64_t seed = 27;
  bool detail = false;
  std::vector<int> only_loads;
  std::vector<std::string> sections;
  int rounds_opt = 0;
  app.add_option("--load", only_loads,
                 "run only these open-loop loads (% of capacity; diagnosis: the keys of the "
                 "others are not printed)")
      ->check(CLI::IsMember({30, 70, 100, 130}));
  app.add_option("--section", sections,
                 "run only these parts (diagnosis; the keys of the others are not printed)")
      ->check(CLI::IsMember(
          {"open-loop", "replicas", "closed-loop", "graph", "priority", "swap", "mixed"}));
  app.add_option("--rounds", rounds_opt, "open-loop rounds (0: 2, 1 with --quick)")
      ->check(CLI::Range(0, 100));
  app.add_flag("--detail", detail,
               "print each open-loop run's counts (refusals and errors by kind) to stderr");
  app.add_option("--a-us", a_us, "the model's cost per batch, microseconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--b-us", b_us, "the model's cost per request of a batch, microseconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-batch", max_batch, "requests per batch at most")
      ->check(CLI::Range(1, 4096));
  app.add_option("--deadline-us", deadline_us,
                 "each open-loop request's deadline after its send time, microseconds (0: 5 "
                 "full batches, 5 * (a + b * max_batch))")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seconds", seconds,
                 "length of each open-loop run (0: 1.5 s, 0.1 s with --quick)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "seed of the Poisson arrivals");
  CLI11_PARSE(app, argc, argv);
  g_detail = detail;

  pin_host();
  bench::Report report("serve");
  const Model m{std::chrono::duration_cast<ns>(std::chrono::duration<double, std::micro>(a_us)),
                std::chrono::duration_cast<ns>(std::chrono::duration<double, std::micro>(b_us)),
                max_batch};
  const ns deadline =
      deadline_us > 0
          ? std::chrono::duration_cast<ns>(std::chrono::duration<double, std::micro>(deadline_us))
          : 5 * m.batch_cost(m.max_batch);
  const double run_s = seconds > 0 ? seconds : (common.quick ? 0.1 : 1.5);
  const int rounds = rounds_opt > 0 ? rounds_opt : (common.quick ? 1 : 2);
  const auto load_wanted = [&](int load) {
    return only_loads.empty() ||
           std::find(only_loads.begin(), only_loads.end(), load) != only_loads.end();
  };
  const double deadline_f = static_cast<double>(deadline.count());
  report.note("placement",
              "client on core 0 (reserved), devices on core 1; 2 replicas: core 1 and core 0 "
              "(beside the client)");
  report.figure("serve_batch_cost_us",
                static_cast<double>(m.batch_cost(m.max_batch).count()) / 1e3);
  report.figure("serve_deadline_us", deadline_f / 1e3);

  const auto section_wanted = [&](const char* name) {
    return sections.empty() || std::find(sections.begin(), sections.end(), name) != sections.end();
  };

  // ---- capacity: one device on core 1, the 100% of the open loops below ----
  double capacity = 0;
  if (section_wanted("open-loop")) {
    DeviceGroup device(1, devices_off_core0());
    std::vector<double> caps;
    for (int round = 0; round < (common.quick ? 1 : 3); ++round) {
      StreamConfig config;
      config.response_capacity = std::size_t{1} << 14;
      Server s = build_server(device, m, deadline_aware_batching(m), config);
      s.start();
      caps.push_back(saturate(s, 8 * m.max_batch, common.quick ? 0.2 : 0.5, "capacity"));
    }
    capacity = bench::median(caps);
    report.figure("serve_capacity_requests_per_s", capacity);
  }

  // ---- goodput by batcher and load, overload: one device on core 1 ----
  if (section_wanted("open-loop")) {
    DeviceGroup device(1, devices_off_core0());

    if (capacity < 1000.0) {
      report.note("serve_goodput_vs_best_fixed_timeout",
                  "skipped: the capacity run answered almost nothing");
    } else {
      constexpr std::array<int, 4> kLoads{30, 70, 100, 130};
      const std::array<ns, 4> delays{0us, 50us, 200us, 1000us};
      constexpr std::size_t kContenders = 1 + 4;  // deadline-aware, then the fixed delays
      std::array<std::array<std::uint64_t, kContenders>, kLoads.size()> on_time{};
      std::array<std::vector<double>, kLoads.size()> ok_lat;             // deadline-aware, by load
      std::array<std::uint64_t, kLoads.size()> da_sent{}, da_refused{};  // deadline-aware
      std::array<std::uint64_t, kLoads.size()> da_late_sends{};          // deadline-aware
      std::array<std::array<std::uint64_t, 7>, kLoads.size()> da_refused_by{};
      OpenLoop overload[2];  // 130%, deadline-aware: kReject, kShed (pooled over rounds)
      // Each load's contenders run in short segments, round-robin (the order reversed every
      // other segment), each segment with its own arrivals, the same for every contender:
      // this VM's noise comes in spells of seconds, and a contender run in one piece could
      // catch a spell its rivals miss. Each contender's stream is built once per load and
      // runs again for every segment (what it measured carries over, as in a server).
      const int segments = common.quick ? 1 : 6;
      const double segment_s = run_s / segments;
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t l = 0; l < kLoads.size(); ++l) {
          if (!load_wanted(kLoads[l])) continue;
          const double rate = capacity * kLoads[l] / 100.0;
          std::vector<Server> servers;
          for (std::size_t c = 0; c < kContenders; ++c) {
            const BatchConfig batching =
                c == 0 ? deadline_aware_batching(m) : fixed_delay_batching(m, delays[c - 1]);
            servers.push_back(
                build_server(device, m, batching, serving_config(AdmissionPolicy::kReject)));
          }
          if (kLoads[l] == 130) {
            servers.push_back(build_server(device, m, deadline_aware_batching(m),
                                           serving_config(AdmissionPolicy::kShed)));
          }
          std::vector<OpenLoop> totals(servers.size());
          for (int seg = 0; seg < segments; ++seg) {
            const auto arrivals = poisson_arrivals(
                rate, segment_s, seed + 1000 * static_cast<std::uint64_t>(round) + 10 * seg + l);
            for (std::size_t k = 0; k < servers.size(); ++k) {
              const std::size_t c = (round * segments + seg) % 2 == 0 ? k : servers.size() - 1 - k;
              const std::string what = "open loop " + std::to_string(kLoads[l]) + "% " +
                                       (c < kContenders ? "batcher " + std::to_string(c) : "shed");
              servers[c].start();
              add_to(totals[c], open_loop(servers[c], arrivals, deadline, segment_s, what));
            }
          }
          for (std::size_t c = 0; c < servers.size(); ++c) {
            OpenLoop& r = totals[c];
            if (detail) {
              print_detail("open loop " + std::to_string(kLoads[l]) + "% " +
                               (c < kContenders ? "batcher " + std::to_string(c) : "shed"),
                           r);
            }
            if (c == kContenders) {
              add_to(overload[1], std::move(r));
              continue;
            }
            on_time[l][c] += r.on_time;
            if (c == 0) {
              da_sent[l] += r.sent;
              da_refused[l] += r.refused;
              da_late_sends[l] += r.late_sends;
              for (std::size_t k = 0; k < 7; ++k) da_refused_by[l][k] += r.refused_by[k];
              ok_lat[l].insert(ok_lat[l].end(), r.ok_ns.begin(), r.ok_ns.end());
              if (kLoads[l] == 130) add_to(overload[0], std::move(r));
            }
          }
        }
      }
      const double span = run_s * rounds;
      for (std::size_t l = 0; l < kLoads.size(); ++l) {
        if (!load_wanted(kLoads[l])) continue;
        const std::string load = std::to_string(kLoads[l]);
        std::size_t best = 1;
        for (std::size_t c = 2; c < kContenders; ++c) {
          if (on_time[l][c] > on_time[l][best]) best = c;
        }
        const double da = static_cast<double>(on_time[l][0]) / span;
        const double fixed = static_cast<double>(on_time[l][best]) / span;
        report.figure("serve_goodput_" + load + "_requests_per_s", da);
        report.figure("serve_goodput_" + load + "_best_fixed_requests_per_s", fixed);
        report.figure("serve_goodput_" + load + "_best_fixed_delay_us",
                      static_cast<double>(delays[best - 1].count()) / 1e3);
        // Every fixed batcher's goodput over the deadline-aware one's: how far apart the
        // contenders are, next to how far apart equal ones land on this machine.
        for (std::size_t c = 1; c < kContenders; ++c) {
          report.figure("serve_goodput_" + load + "_fixed_" +
                            std::to_string(delays[c - 1].count() / 1000) + "us_vs_deadline_aware",
                        share(on_time[l][c], on_time[l][0]));
        }
        report.figure("serve_p99_" + load + "_us", bench::quantile(ok_lat[l], 0.99) / 1e3);
        for (std::size_t k = 1; k < 7; ++k) {  // which refusals, by reason (0 left out)
          if (da_refused_by[l][k] == 0) continue;
          report.figure(
              "serve_refused_" + std::string(to_string(static_cast<Refusal>(k))) + "_" + load,
              static_cast<double>(da_refused_by[l][k]));
        }
        report.figure("serve_refused_fraction_" + load, share(da_refused[l], da_sent[l]));
        report.figure("serve_late_send_fraction_" + load, share(da_late_sends[l], da_sent[l]));
        const double ratio = fixed > 0 ? da / fixed
                             : da > 0  ? std::numeric_limits<double>::infinity()
                                       : 1.0;  // neither answered anything on time
        report.figure("serve_goodput_vs_best_fixed_timeout_" + load, ratio);  // withdrawn target
      }
      if (load_wanted(100)) {
        constexpr std::size_t kFull = 2;  // kLoads[kFull] == 100
        static_assert(kLoads[kFull] == 100);
        const double p99 = ok_lat[kFull].empty()
                               ? std::numeric_limits<double>::infinity()
                               : bench::quantile(ok_lat[kFull], 0.99) / deadline_f;
        report.ratio("serve_p99_vs_deadline_100", p99, "<= 1.0", p99 <= 1.0);
      }
      if (load_wanted(130)) {
        const char* names[2] = {"reject", "shed"};
        double worst_p99 = 0;
        std::uint64_t lost = 0;
        for (int p = 0; p < 2; ++p) {
          OpenLoop& o = overload[p];
          const std::string key = std::string("serve_overload_") + names[p];
          const double p99 =
              o.admitted_ns.empty() ? 0.0 : bench::quantile(o.admitted_ns, 0.99) / deadline_f;
          report.figure(key + "_refused_fraction_130", share(o.refused, o.sent));
          report.figure(key + "_lost_130", static_cast<double>(o.lost));
          report.figure(key + "_admitted_p99_us_130", p99 * deadline_f / 1e3);
          report.figure(key + "_late_send_fraction_130", share(o.late_sends, o.sent));
          worst_p99 = std::max(worst_p99, p99);
          lost += o.lost;
        }
        report.ratio("serve_overload_lost_130", static_cast<double>(lost), "= 0", lost == 0);
        report.ratio("serve_overload_admitted_p99_vs_deadline_130", worst_p99, "<= 1.0",
                     worst_p99 <= 1.0);
      }
    }
  }

  // ---- replicas: 2 devices on cores 1 and 0 against 1 on core 1, and the floor ----
  if (section_wanted("replicas")) {
    std::vector<Placement> places = Topology::get().place(2, true);
    for (Placement& p : places) {
      if (Topology::get().cores() >= 2 && p.core && *p.core == 0) p.shares_host = true;
    }
    Device d0(0, DeviceConfig{}, places[0]);
    Device d1(1, DeviceConfig{}, places[1]);
    const double secs = common.quick ? 0.1 : 0.5;
    std::vector<double> one, two, f1, f2, share;
    for (int round = 0; round < (common.quick ? 1 : 3); ++round) {
      {
        StreamConfig config;
        config.response_capacity = std::size_t{1} << 14;
        Server s = build_server(DeviceList(d0), m, deadline_aware_batching(m), config);
        s.start();
        one.push_back(saturate(s, 8 * m.max_batch, secs, "replicas 1"));
      }
      {
        StreamConfig config;
        config.replicas = 2;
        config.response_capacity = std::size_t{1} << 14;
        Server s = build_server(DeviceList(std::vector<Device*>{&d0, &d1}), m,
                                deadline_aware_batching(m), config);
        s.start();
        double cpu = 0;
        two.push_back(saturate(s, 16 * m.max_batch, secs, "replicas 2", &cpu));
        share.push_back(cpu);
      }
      f1.push_back(floor_rate(1, m, secs));
      f2.push_back(floor_rate(2, m, secs));
    }
    const double scaling = bench::median(two) / bench::median(one);
    const double machine = bench::median(f2) / bench::median(f1);
    report.figure("serve_replicas_1_requests_per_s", bench::median(one));
    report.figure("serve_replicas_2_requests_per_s", bench::median(two));
    report.figure("serve_replicas_2_vs_1_throughput", scaling);
    report.figure("machine_2_vs_1_throughput", machine);
    const double ratio = scaling / machine;
    // The client runs on core 0 beside replica 1's device: what it takes of that core is not
    // there for the replica. Shown (not a target) so the bound is visible.
    const double client = bench::median(share);
    report.figure("serve_replicas_2_client_cpu_share", client);
    report.figure("serve_replicas_2_vs_1_throughput_vs_floor_less_client",
                  scaling / (machine - std::min(client, 0.99)));
    report.ratio("serve_replicas_2_vs_1_throughput_vs_floor", ratio, ">= 0.9", ratio >= 0.9);
  }

  // ---- cancellation, stats and the response path: 2 devices on core 1 ----
  if (section_wanted("closed-loop")) {
    DeviceGroup devices(2, devices_off_core0());
    {
      const CancelFigures f = cancel_run(devices, m.a, common.quick ? 400 : 4000, seed);
      report.figure("serve_cancel_cancelled", static_cast<double>(f.cancelled));
      report.figure("serve_cancel_answered_cancelled", static_cast<double>(f.answered_cancelled));
      report.figure("serve_cancel_lost", static_cast<double>(f.lost));
      report.figure("serve_cancel_wasted_stages_max", f.wasted_max);
      report.ratio("serve_cancel_wasted_stages_p99", f.wasted_p99, "<= 1", f.wasted_p99 <= 1.0);
    }
    const std::uint64_t n = common.quick ? 2'000 : 20'000;
    const int closed_rounds = common.quick ? 3 : 7;
    {
      std::vector<double> on, off;
      for (int round = 0; round < closed_rounds; ++round) {
        for (int k = 0; k < 2; ++k) {
          const bool stats = (round + k) % 2 == 0;
          StreamConfig config;
          config.stats = stats;
          config.admission.predict = false;  // prediction needs the stats
          Server s = build_chain(devices, config);
          s.start();
          std::vector<double> lat;
          {
            Watchdog dog("stats closed loop", 60s, [&] { s.cancel(); });
            lat = client_closed_loop(s, n, true);
          }
          finish(s, "stats closed loop");
          (stats ? on : off).push_back(p50_or_inf(std::move(lat)));
        }
      }
      report.figure("serve_stats_on_p50_ns", bench::median(on));
      report.figure("serve_stats_off_p50_ns", bench::median(off));
      const double ratio = bench::median(on) / bench::median(off);
      report.ratio("serve_stats_overhead_p50", ratio, "<= 1.02", ratio <= 1.02);
    }
  }
  // ---- graphs, priority classes, swaps, mixed deadlines (serve_sections.cpp) ----
  // Their open loops run at up to twice the capacity, so their model costs 10 times as much:
  // one client thread then keeps up with its sends.
  if (section_wanted("graph")) {
    serve::graph_section(report, serve::Settings{m.a, m.b, m.max_batch, 0, common.quick, seed});
  }
  if (section_wanted("priority") || section_wanted("swap") || section_wanted("mixed")) {
    const Model slow{10 * m.a, 10 * m.b, m.max_batch};
    std::vector<double> caps;
    {
      DeviceGroup device(1, devices_off_core0());
      for (int round = 0; round < (common.quick ? 1 : 3); ++round) {
        StreamConfig config;
        config.response_capacity = std::size_t{1} << 14;
        Server s = build_server(device, slow, deadline_aware_batching(slow), config);
        s.start();
        caps.push_back(saturate(s, 8 * slow.max_batch, common.quick ? 0.2 : 0.5, "capacity x10"));
      }
    }
    const serve::Settings settings{slow.a,       slow.b, slow.max_batch, bench::median(caps),
                                   common.quick, seed};
    report.figure("serve_x10_capacity_requests_per_s", settings.capacity);
    if (settings.capacity < 100.0) {
      report.note("serve_priority_swap_mixed", "skipped: the capacity run answered almost nothing");
    } else {
      if (section_wanted("priority")) serve::priority_section(report, settings);
      if (section_wanted("swap")) serve::swap_section(report, settings);
      if (section_wanted("mixed")) serve::mixed_section(report, settings);
    }
  }
  report.figure("serve_runs_not_drained", g_not_drained);
  return report.write(common.json_path) ? 0 : 1;
}
