// serve_bench's sections on stream graphs, priority classes, swaps and mixed deadlines (see
// serve_sections.hpp and the keys at the top of serve_bench.cpp). Every ratio is against a
// reference measured in the same run, rounds alternating, the median reported.
#include "serve_sections.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace serve {
namespace {

using namespace bspflow;
using namespace std::chrono_literals;
using bench::Clock;
using bench::spin_for;
using ns = std::chrono::nanoseconds;

struct Req {
  std::uint32_t idx = 0;
};
using Server = Stream<Req, Req>;

constexpr ns kStep{1'000};     // a graph node's work in the hop figure
constexpr ns kBranch{50'000};  // a branch's work in the fan-out figure

double us(double ns_value) {
  return ns_value / 1e3;
}

// A batch of n costs a + b*n of busy work; `cold`: the callable's first call also waits that
// long once (a model loading its weights from storage), which a swap's warm-up takes off the
// request path.
auto model_fn(ns a, ns b, ns cold = ns{0}) {
  return [a, b, cold, first = true](std::span<Req> batch) mutable {
    if (first && cold.count() > 0) std::this_thread::sleep_for(cold);
    first = false;
    spin_for(a + b * static_cast<std::int64_t>(batch.size()));
    return std::vector<Req>(batch.begin(), batch.end());
  };
}

BatchConfig batching(const Settings& s, bool deadline_aware, std::optional<ns> delay = {}) {
  BatchConfig c;
  c.max_batch = s.max_batch;
  c.deadline_aware = deadline_aware;
  c.max_delay = delay;
  return c;
}

// One request of an open loop: when it is sent (ns after the start), its deadline after
// that (0: none), its class, and which of the loop's clients sends it. Traffic of different
// kinds comes from different clients (an interactive front end, a batch job), as in a
// service: one client's responses come back in its push order, so a client mixing kinds
// would hold each answer behind its own earlier requests.
struct Send {
  std::int64_t at = 0;
  ns deadline{0};
  std::uint32_t priority = 0;
  std::uint32_t lane = 0;  // the client, 0..kLanes-1
};
constexpr std::uint32_t kLanes = 2;
// What became of it.
struct Outcome {
  enum class Fate : std::uint8_t { kUnsent, kRefused, kPending, kOk, kError } fate = Fate::kUnsent;
  std::int64_t latency = 0;      // from its scheduled send to its answer being popped
  std::int64_t answered_at = 0;  // ns after the start
  std::uint32_t version = 0;
};

// Sends `sends` through a started `stream` from this thread, with one client per lane (of
// the first send's priority on it), popping answers between sends, waits up to 1 s for the
// rest, closes the stream. `on_start` runs once, with the loop's start time, before the
// first send.
std::vector<Outcome> open_loop(Server& stream, const std::vector<Send>& sends,
                               const std::function<void(Clock::time_point)>& on_start = {}) {
  constexpr auto kNone = std::numeric_limits<std::uint32_t>::max();
  std::vector<Outcome> out(sends.size());
  {
    std::vector<StreamClient<Req, Req>> clients;
    std::array<std::vector<std::uint32_t>, kLanes> of_seq;  // by sequence - base: the send
    std::array<std::uint64_t, kLanes> base{};
    for (std::uint32_t l = 0; l < kLanes; ++l) {
      std::uint32_t priority = 0;
      for (const Send& x : sends) {
        if (x.lane == l) {
          priority = x.priority;
          break;
        }
      }
      clients.push_back(stream.client(priority));
      base[l] = ~std::uint64_t{0};
    }
    const auto t0 = Clock::now() + 1ms;
    if (on_start) on_start(t0);
    std::size_t pending = 0;
    auto take = [&](std::uint32_t l, const Response<Req>& r) {
      if (base[l] == ~std::uint64_t{0} || r.id.sequence < base[l]) return;
      const std::uint64_t k = r.id.sequence - base[l];
      if (k >= of_seq[l].size() || of_seq[l][k] == kNone) return;
      Outcome& o = out[of_seq[l][k]];
      if (o.fate != Outcome::Fate::kPending) return;
      const auto now = Clock::now();
      o.fate = r.ok() ? Outcome::Fate::kOk : Outcome::Fate::kError;
      o.latency = (now - (t0 + ns(sends[of_seq[l][k]].at))).count();
      o.answered_at = (now - t0).count();
      o.version = r.version;
      --pending;
    };
    auto drain = [&] {
      for (std::uint32_t l = 0; l < kLanes; ++l) {
        while (auto r = clients[l].try_pop()) take(l, *r);
      }
    };
    std::size_t i = 0;
    const auto stop_sending = t0 + ns(sends.empty() ? 0 : sends.back().at) + 500ms;
    while (i < sends.size()) {
      const auto due = t0 + ns(sends[i].at);
      const auto now = Clock::now();
      if (now >= due) {
        if (now > stop_sending) break;
        const std::uint32_t l = sends[i].lane;
        auto& client = clients[l];
        client.set_priority(sends[i].priority);
        const Deadline d = sends[i].deadline.count() > 0 ? due + sends[i].deadline : kNoDeadline;
        const Submission s = client.try_push(Req{static_cast<std::uint32_t>(i)}, d);
        if (s.accepted()) {
          if (base[l] == ~std::uint64_t{0}) base[l] = s.id.sequence;
          const std::uint64_t k = s.id.sequence - base[l];
          if (of_seq[l].size() <= k) of_seq[l].resize(k + 1, kNone);
          of_seq[l][k] = static_cast<std::uint32_t>(i);
          out[i].fate = Outcome::Fate::kPending;
          ++pending;
        } else {
          out[i].fate = Outcome::Fate::kRefused;
        }
        ++i;
      }
      drain();
    }
    const auto give_up = Clock::now() + 1s;
    while (pending > 0 && Clock::now() < give_up) {
      drain();
      std::this_thread::sleep_for(20us);
    }
    stream.close();
    stream.wait();
    drain();
  }
  return out;
}

// Poisson send times at `rate` per second from `from` to `to` seconds.
void poisson(std::vector<Send>& out, double rate, double from, double to, std::mt19937_64& rng,
             const std::function<Send(std::int64_t)>& make) {
  std::exponential_distribution<double> gap(rate / 1e9);
  for (double t = from * 1e9 + gap(rng); t < to * 1e9; t += gap(rng)) {
    out.push_back(make(static_cast<std::int64_t>(t)));
  }
}

double quantile_of(std::vector<double> v, double q) {
  return bench::quantile(v, q);
}

// Closed loop, one request in flight: p50 of `n` (after a tenth as warm-up), in ns.
double closed_p50(Server& stream, std::uint64_t n) {
  std::vector<double> lat;
  lat.reserve(n);
  {
    auto client = stream.client();
    for (std::uint64_t i = 0; i < n + n / 10; ++i) {
      const auto t0 = Clock::now();
      if (!client.push(Req{})) break;
      if (!client.pop()) break;
      if (i >= n / 10)
        lat.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    }
    stream.close();
    stream.wait();
  }
  return quantile_of(std::move(lat), 0.5);
}

}  // namespace

// ---- graphs ----

void graph_section(bench::Report& report, const Settings& s) {
  const int rounds = s.quick ? 1 : 5;
  const std::uint64_t n = s.quick ? 2'000 : 20'000;
  auto step = [](Req r) {
    spin_for(kStep);
    return r;
  };
  // The hop: 3 stages of 1 us as a 3-node graph on 3 devices that share core 1 (so the graph
  // runs them on one thread, without a hand-off), against the same work as one stage.
  std::vector<double> hops;
  DeviceGroup three(3, bench::devices_off_core0());
  for (int round = 0; round < rounds; ++round) {
    double fused_p50 = 0, graph_p50 = 0;
    for (int k = 0; k < 2; ++k) {
      if ((round + k) % 2 == 0) {
        Server fused = StreamBuilder<Req>(three)
                           .stage("all",
                                  [](Req r) {
                                    spin_for(3 * kStep);
                                    return r;
                                  })
                           .build();
        fused.start();
        fused_p50 = closed_p50(fused, n);
      } else {
        StreamGraph<Req> g(three);
        auto a = g.input().stage("a", step, 0);
        auto b = a.stage("b", step, 1);
        auto c = b.stage("c", step, 2);
        Server graph = std::move(g).build(c);
        graph.start();
        graph_p50 = closed_p50(graph, n);
      }
    }
    hops.push_back((graph_p50 - fused_p50) / 2 / 1e3);  // 2 hops between 3 nodes
  }
  const double h = bench::median(hops);
  report.spread("serve_graph_hop_p50_us", hops);
  report.ratio("serve_graph_hop_p50_us", h, "<= 2", h <= 2.0);

  // The fan-out: pre, then two 50 us branches on their own devices (cores), joined, against
  // one 50 us branch alone. The client runs pinned to core 0; a device placed there too (a
  // 2-core machine) is told so (Placement::shares_host), so its waits yield to the client.
  auto branch = [](Req r) {
    spin_for(kBranch);
    return r;
  };
  constexpr std::uint32_t kClientCore = 0;
  std::vector<Placement> places = Topology::get().place(2, true);
  for (Placement& p : places) p.shares_host = p.shares_host || p.core == kClientCore;
  Device d0(0, DeviceConfig{}, places[0]);
  Device d1(1, DeviceConfig{}, places[1]);
  DeviceList two(std::vector<Device*>{&d0, &d1});
  auto pinned_p50 = [&](Server& stream) {
    double p50 = 0;
    std::thread client([&] {
      Topology::get().pin_current_thread(kClientCore);
      p50 = closed_p50(stream, n / 10);
    });
    client.join();
    return p50;
  };
  // Two placements of one shape, pre and the left branch on device 0, the right branch on
  // device 1: the join on device 0 (waiting there for the round trip to device 1), and the
  // join where the right branch ends (where the stream guide and example 12 put it).
  auto fan_out = [&](std::uint32_t left_device, std::uint32_t join_device) {
    StreamGraph<Req> g(two);
    auto pre = g.input().stage(
        "pre", [](Req r) { return r; }, 0);
    auto left = pre.stage("left", branch, left_device);
    auto right = pre.stage("right", branch, 1);
    auto out = g.join(
        "join", [](Req x, Req) { return x; }, join_device, left, right);
    Server graph = std::move(g).build(out);
    graph.start();
    return pinned_p50(graph);
  };
  std::vector<double> ratios, local_ratios, fans, locals, singles;
  for (int round = 0; round < rounds; ++round) {
    double fan = 0, local = 0, single = 0;
    for (int k = 0; k < 3; ++k) {  // the order rotates each round
      switch ((round + k) % 3) {
        case 0:
          fan = fan_out(0, 0);
          break;
        case 1:
          local = fan_out(0, 1);
          break;
        default: {
          Server one = StreamBuilder<Req>(two).stage("branch", branch, 0).build();
          one.start();
          single = pinned_p50(one);
        }
      }
    }
    ratios.push_back(fan / single);
    local_ratios.push_back(local / single);
    fans.push_back(fan / 1e3);
    locals.push_back(local / 1e3);
    singles.push_back(single / 1e3);
  }
  const double r = bench::median(ratios);
  const double rl = bench::median(local_ratios);
  report.figure("serve_fanout_p50_us", bench::median(fans));
  report.figure("serve_fanout_join_at_branch_p50_us", bench::median(locals));
  report.figure("serve_fanout_one_branch_p50_us", bench::median(singles));
  report.spread("serve_fanout_vs_slowest_branch", ratios);
  report.ratio("serve_fanout_vs_slowest_branch", r, "<= 1.3", r <= 1.3);
  report.spread("serve_fanout_join_at_branch_vs_slowest_branch", local_ratios);
  report.ratio("serve_fanout_join_at_branch_vs_slowest_branch", rl, "<= 1.3", rl <= 1.3);
}

// ---- priority classes ----

void priority_section(bench::Report& report, const Settings& s) {
  const int rounds = s.quick ? 1 : 5;
  const double seconds = s.quick ? 0.2 : 1.0;
  const double full_batch =
      static_cast<double>((s.a + s.b * static_cast<std::int64_t>(s.max_batch)).count());
  DeviceGroup device(1, bench::devices_off_core0());
  auto build = [&](std::uint32_t classes) {
    StreamConfig c;
    c.priority_classes = classes;
    c.min_share = {0.0, 0.2, 0.0, 0.0};
    c.admission.policy = AdmissionPolicy::kReject;
    c.admission.queue_capacity = 16 * s.max_batch;
    c.response_capacity = std::size_t{1} << 15;
    return StreamBuilder<Req>(device, c)
        .batch_stage("model", model_fn(s.a, s.b), batching(s, true))
        .build();
  };
  std::vector<double> vs_bound, vs_flat, low_share, alone_p99s;
  for (int round = 0; round < rounds; ++round) {
    std::mt19937_64 rng(s.seed + 100 + static_cast<std::uint64_t>(round));
    std::bernoulli_distribution is_high(0.1);
    std::vector<Send> sends;
    poisson(sends, 2.0 * s.capacity, 0.0, seconds, rng, [&](std::int64_t t) {
      const std::uint32_t c = is_high(rng) ? 0u : 1u;
      return Send{t, ns{0}, c, c};
    });
    std::vector<Send> high_only;
    for (const Send& x : sends) {
      if (x.priority == 0) high_only.push_back(x);
    }
    double p99_classes = 0, p99_flat = 0, p99_alone = 0, share = 0;
    for (int k = 0; k < 3; ++k) {
      const int which = (round + k) % 3;
      if (which == 0) {  // two classes
        Server st = build(2);
        st.start();
        const auto out = open_loop(st, sends);
        std::vector<double> high;
        double low_ok = 0, all_ok = 0;
        for (std::size_t i = 0; i < out.size(); ++i) {
          if (out[i].fate != Outcome::Fate::kOk) continue;
          ++all_ok;
          if (sends[i].priority == 0) {
            high.push_back(static_cast<double>(out[i].latency));
          } else {
            ++low_ok;
          }
        }
        p99_classes = quantile_of(high, 0.99);
        share = all_ok > 0 ? low_ok / all_ok : 0;
      } else if (which == 1) {  // one class: the same traffic, the same requests measured
        std::vector<Send> flat = sends;
        for (Send& x : flat) x.priority = 0;  // the same two clients, one class
        Server st = build(1);
        st.start();
        const auto out = open_loop(st, flat);
        std::vector<double> high;
        for (std::size_t i = 0; i < out.size(); ++i) {
          if (out[i].fate == Outcome::Fate::kOk && sends[i].priority == 0) {
            high.push_back(static_cast<double>(out[i].latency));
          }
        }
        p99_flat = quantile_of(high, 0.99);
      } else {  // the high class alone
        Server st = build(2);
        st.start();
        const auto out = open_loop(st, high_only);
        std::vector<double> high;
        for (const Outcome& o : out) {
          if (o.fate == Outcome::Fate::kOk) high.push_back(static_cast<double>(o.latency));
        }
        p99_alone = quantile_of(high, 0.99);
      }
    }
    alone_p99s.push_back(us(p99_alone));
    vs_bound.push_back(p99_classes / (p99_alone + full_batch));
    vs_flat.push_back(p99_flat > 0 ? p99_classes / p99_flat : 0);
    low_share.push_back(share / 0.2);
  }
  report.figure("serve_priority_high_alone_p99_us", bench::median(alone_p99s));
  const double b = bench::median(vs_bound);
  report.spread("serve_priority_high_p99_vs_bound", vs_bound);
  report.ratio("serve_priority_high_p99_vs_bound", b, "<= 1.2", b <= 1.2);
  const double f = bench::median(vs_flat);
  report.ratio("serve_priority_high_p99_vs_no_classes", f, "<= 0.3", f <= 0.3);
  const double l = bench::median(low_share);
  report.ratio("serve_priority_low_share", l, ">= 1.0", l >= 1.0);
}

// ---- swaps ----

namespace {

struct SwapRun {
  std::uint64_t failed = 0;  // answered with an error, or never answered
  double window_p99 = 0, steady_p99 = 0;
  double first_p50 = 0, steady_p50 = 0, steady_first_p50 = 0;
  bool swapped = false;
};

// An open loop at `rate` for `seconds`, swapping "model" to a new version (with a cold first
// call, warmed by the swap) `swaps` times, evenly spread; the windows are each swap's duration
// and 20 ms either side, pooled (a single window holds too few requests for a stable p99),
// and the steady part is the rest after the first 50 ms.
SwapRun swap_run(DeviceList devices, std::uint32_t replicas, std::size_t memory, double rate,
                 double seconds, int swaps, const Settings& s, std::uint64_t seed,
                 bool warm = true) {
  StreamConfig c;
  c.replicas = replicas;
  c.response_capacity = std::size_t{1} << 15;
  c.admission.queue_capacity = std::size_t{1} << 14;
  const ns cold = 2ms;
  Server st = StreamBuilder<Req>(devices, c)
                  .batch_stage("model", model_fn(s.a, s.b, cold), batching(s, true))
                  .memory(memory)
                  .build();
  {  // the old version's own cold call, before the run
    st.start();
    auto warm_up = st.client();
    for (int i = 0; i < 4; ++i) warm_up.push(Req{});
    while (warm_up.pop()) {
    }
    st.close();
    st.wait();
  }
  std::mt19937_64 rng(seed);
  std::vector<Send> sends;
  poisson(sends, rate, 0.0, seconds, rng, [](std::int64_t t) { return Send{t, ns{0}, 0}; });
  std::vector<std::int64_t> from(static_cast<std::size_t>(swaps)), to(from.size());
  std::vector<std::uint32_t> versions(from.size());
  SwapRun r;
  r.swapped = true;
  std::thread swapper;
  st.start();
  const auto out = open_loop(st, sends, [&](Clock::time_point t0) {
    swapper = std::thread([&, t0] {
      // The operator's thread, at the lowest priority: its warm-up calls take CPU, and on
      // this machine the only core without a device is the client's.
      (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
      for (std::size_t k = 0; k < from.size(); ++k) {
        const double at = seconds * static_cast<double>(k + 1) / static_cast<double>(swaps + 1);
        std::this_thread::sleep_until(
            t0 + std::chrono::duration_cast<ns>(std::chrono::duration<double>(at)));
        from[k] = (Clock::now() - t0).count();
        // One warm-up input: the cold cost is the version's, not a batch size's, and every
        // warm-up call is CPU taken from the client's core.
        const SwapResult result =
            st.swap("model", model_fn(s.a, s.b, cold), std::vector<Req>(warm ? 1 : 0));
        to[k] = (Clock::now() - t0).count();
        versions[k] = result.version;
        r.swapped = r.swapped && result.swapped;
      }
    });
  });
  swapper.join();
  constexpr std::int64_t kSide = 20'000'000, kSettle = 50'000'000;
  auto in_window = [&](std::int64_t at) {
    for (std::size_t k = 0; k < from.size(); ++k) {
      if (at >= from[k] - kSide && at <= to[k] + kSide) return true;
    }
    return false;
  };
  std::vector<double> window, steady, first;
  std::vector<std::vector<std::pair<std::int64_t, double>>> new_version(from.size());
  std::vector<std::pair<std::int64_t, double>> answered;  // (answered at, latency), version 1
  for (std::size_t i = 0; i < out.size(); ++i) {
    const Outcome& o = out[i];
    if (o.fate == Outcome::Fate::kError || o.fate == Outcome::Fate::kPending ||
        o.fate == Outcome::Fate::kUnsent) {
      ++r.failed;
      continue;
    }
    if (o.fate != Outcome::Fate::kOk) continue;
    const auto lat = static_cast<double>(o.latency);
    const std::int64_t at = sends[i].at;
    if (in_window(at)) {
      window.push_back(lat);
    } else if (at >= kSettle) {
      steady.push_back(lat);
    }
    for (std::size_t k = 0; k < versions.size(); ++k) {
      if (o.version == versions[k]) new_version[k].emplace_back(o.answered_at, lat);
    }
    if (o.version < 2) answered.emplace_back(o.answered_at, lat);
  }
  // The first 20 answers after a moment: after each swap, the new version's; as the
  // reference, the same after moments of the steady part before the first swap (a moment
  // falls more often inside a long batch, so the answers just after one waited longer than a
  // typical answer).
  constexpr std::size_t kFirst = 20;
  for (auto& v : new_version) {
    std::sort(v.begin(), v.end());
    for (std::size_t k = 0; k < v.size() && k < kFirst; ++k) first.push_back(v[k].second);
  }
  std::sort(answered.begin(), answered.end());
  std::vector<double> at_moments;
  const std::int64_t steady_end = from.front() - kSide, steady_start = kSettle;
  for (int j = 0; j < 8 && steady_end > steady_start; ++j) {
    const std::int64_t moment = steady_start + (steady_end - steady_start) * j / 8;
    auto it = std::lower_bound(answered.begin(), answered.end(),
                               std::pair<std::int64_t, double>{moment, 0.0});
    std::vector<double> after;
    for (; it != answered.end() && after.size() < kFirst; ++it) after.push_back(it->second);
    if (after.size() == kFirst) at_moments.push_back(quantile_of(std::move(after), 0.5));
  }
  r.window_p99 = quantile_of(window, 0.99);
  r.steady_p99 = quantile_of(steady, 0.99);
  r.steady_p50 = quantile_of(steady, 0.5);
  r.steady_first_p50 = bench::median(at_moments);
  r.first_p50 = quantile_of(first, 0.5);
  return r;
}

}  // namespace

void swap_section(bench::Report& report, const Settings& s) {
  const int rounds = s.quick ? 1 : 5;
  const double seconds = s.quick ? 0.3 : 1.0;
  const int swaps = s.quick ? 1 : 3;  // per run
  DeviceGroup one(1, bench::devices_off_core0());
  // Two replicas sharing core 1, so that one can carry the load alone while the other swaps;
  // 1 MiB arenas: a version of 600 KiB fits once, not twice.
  DeviceConfig small = bench::devices_off_core0();
  small.tiles = 64;
  small.bytes_per_tile = 16 * 1024;
  DeviceGroup two(2, small);
  std::uint64_t failed = 0;
  std::vector<double> in_place, rolling, first, first_vs_all, first_cold;
  for (int round = 0; round < rounds; ++round) {
    const auto seed = s.seed + 300 + static_cast<std::uint64_t>(round);
    for (int k = 0; k < 2; ++k) {
      if ((round + k) % 2 == 0) {
        const SwapRun r = swap_run(one, 1, 256 * 1024, 0.8 * s.capacity, seconds, swaps, s, seed);
        failed += r.failed + (r.swapped ? 0 : 1);
        in_place.push_back(r.window_p99 / r.steady_p99);
        first.push_back(r.first_p50 / r.steady_first_p50);
        first_vs_all.push_back(r.first_p50 / r.steady_p50);
        // The same swap without warm-up inputs: the new version's first call is cold.
        const SwapRun c =
            swap_run(one, 1, 256 * 1024, 0.8 * s.capacity, seconds, swaps, s, seed, false);
        failed += c.failed + (c.swapped ? 0 : 1);
        first_cold.push_back(c.first_p50 / c.steady_first_p50);
      } else {
        const SwapRun r = swap_run(two, 2, 600 * 1024, 0.8 * s.capacity, seconds, swaps, s, seed);
        failed += r.failed + (r.swapped ? 0 : 1);
        rolling.push_back(r.window_p99 / r.steady_p99);
      }
    }
  }
  report.ratio("serve_swap_failed", static_cast<double>(failed), "= 0", failed == 0);
  const double ip = bench::median(in_place);
  report.spread("serve_swap_p99_vs_steady", in_place);
  report.ratio("serve_swap_p99_vs_steady", ip, "<= 1.3", ip <= 1.3);
  const double rl = bench::median(rolling);
  report.spread("serve_rolling_swap_p99_vs_steady", rolling);
  report.ratio("serve_rolling_swap_p99_vs_steady", rl, "<= 1.5", rl <= 1.5);
  report.figure("serve_swap_first_unwarmed_vs_steady_p50", bench::median(first_cold));
  report.figure("serve_swap_first_vs_all_steady_p50", bench::median(first_vs_all));
  const double f = bench::median(first);
  report.spread("serve_swap_first_vs_steady_p50", first);
  report.ratio("serve_swap_first_vs_steady_p50", f, "<= 1.2", f <= 1.2);
}

// ---- mixed deadlines, a changing load ----

// The deadline-aware stream (the defaults: admission earliest deadline first with its
// prediction, the batcher flushing for the tightest deadline waiting and running no request
// that would end late) against fixed-delay batchers as a dynamic batcher has them (first in,
// first out, no prediction; an expired request is still answered without running), each
// delay chosen once for the whole run. A figure: the greedy batcher (delay 0) with the
// deadline-aware admission, which says how much of the gain is admission's.
void mixed_section(bench::Report& report, const Settings& s) {
  const int rounds = s.quick ? 1 : 5;
  const double seconds = s.quick ? 0.3 : 1.5;
  const ns batch_time = s.a + s.b * static_cast<std::int64_t>(s.max_batch);
  const ns tight = 2 * batch_time, loose = 20 * batch_time;
  DeviceGroup device(1, bench::devices_off_core0());
  const std::array<std::optional<ns>, 4> delays{ns{0}, ns{50'000}, ns{200'000}, ns{1'000'000}};
  // Deadline-aware, each fixed delay, greedy with deadline-aware admission.
  constexpr std::size_t kContenders = 6;
  std::array<std::uint64_t, kContenders> on_time{};
  std::array<std::uint64_t, kContenders> sent{};
  double bound = 0;  // on time at most, summed over the rounds
  for (int round = 0; round < rounds; ++round) {
    // 30% -> 130% -> 70% of capacity, Poisson, and a burst of 3 full batches at the start of
    // the last phase; 20% of requests tight (2 batch times), 80% loose (20), from two clients.
    std::mt19937_64 rng(s.seed + 500 + static_cast<std::uint64_t>(round));
    std::bernoulli_distribution is_tight(0.2);
    auto make = [&](std::int64_t t) {
      const bool is_t = is_tight(rng);
      return Send{t, is_t ? tight : loose, 0, is_t ? 0u : 1u};
    };
    std::vector<Send> sends;
    poisson(sends, 0.3 * s.capacity, 0.0, seconds / 3, rng, make);
    poisson(sends, 1.3 * s.capacity, seconds / 3, 2 * seconds / 3, rng, make);
    const auto burst_at = static_cast<std::int64_t>(2 * seconds / 3 * 1e9);
    for (std::size_t k = 0; k < 3 * s.max_batch; ++k) sends.push_back(make(burst_at));
    poisson(sends, 0.7 * s.capacity, 2 * seconds / 3, seconds, rng, make);
    std::stable_sort(sends.begin(), sends.end(),
                     [](const Send& x, const Send& y) { return x.at < y.at; });
    // No scheduler answers on time more than every request of the light phases and, of the
    // overload's, what the capacity serves in that phase and a loose deadline after it.
    double overload = 0;
    for (const Send& x : sends) {
      if (x.at >= burst_at / 2 && x.at < burst_at) ++overload;
    }
    const double most = s.capacity * (seconds / 3 + std::chrono::duration<double>(loose).count());
    bound += static_cast<double>(sends.size()) - overload + std::min(overload, most);
    for (std::size_t k = 0; k < kContenders; ++k) {
      const std::size_t c = round % 2 == 0 ? k : kContenders - 1 - k;
      StreamConfig config;
      config.admission.policy = AdmissionPolicy::kReject;
      config.response_capacity = std::size_t{1} << 15;
      BatchConfig b = batching(s, true);
      if (c >= 1 && c <= 4) {
        b = batching(s, false, delays[c - 1]);
        config.admission.earliest_deadline_first = false;
        config.admission.predict = false;
      } else if (c == 5) {
        b = batching(s, false, ns{0});
      }
      Server st =
          StreamBuilder<Req>(device, config).batch_stage("model", model_fn(s.a, s.b), b).build();
      st.start();
      const auto out = open_loop(st, sends);
      for (std::size_t i = 0; i < out.size(); ++i) {
        ++sent[c];
        if (out[i].fate == Outcome::Fate::kOk && out[i].latency <= sends[i].deadline.count()) {
          ++on_time[c];
        }
      }
    }
  }
  std::size_t best = 1;
  for (std::size_t c = 2; c <= 4; ++c) {
    if (on_time[c] > on_time[best]) best = c;
  }
  auto share = [&](std::size_t c) {
    return static_cast<double>(on_time[c]) /
           static_cast<double>(std::max<std::uint64_t>(1, sent[c]));
  };
  report.figure("serve_goodput_mixed_deadline_aware_share", share(0));
  report.figure("serve_goodput_mixed_best_fixed_share", share(best));
  report.figure("serve_goodput_mixed_best_fixed_delay_us",
                static_cast<double>(delays[best - 1]->count()) / 1e3);
  report.figure("serve_goodput_mixed_greedy_with_admission_share", share(5));
  // What any scheduler could do here, from the measured capacity (a bound, not reached).
  report.figure("serve_goodput_mixed_capacity_bound_share",
                bound / static_cast<double>(std::max<std::uint64_t>(1, sent[0])));
  report.figure("serve_goodput_mixed_best_fixed_vs_bound",
                static_cast<double>(on_time[best]) / bound);
  const double ratio = on_time[best] > 0
                           ? static_cast<double>(on_time[0]) / static_cast<double>(on_time[best])
                           : 0.0;
  report.ratio("serve_goodput_mixed_vs_best_fixed", ratio, ">= 0.97", ratio >= 0.97);
}

}  // namespace serve
