// Stream benchmark: a stream's request latency and throughput against a hand-written chain of
// the same pinned threads joined by SPSC rings, and against oneTBB flow graph. Keys:
//
//   stream_2dev_p50_vs_spsc_chain, stream_4dev_p50_vs_spsc_chain   closed loop (one request
//                       in flight), 1 us of work per stage, one stage per device    <= 1.5
//   stream_2dev_p99_vs_spsc_chain, stream_4dev_p99_vs_spsc_chain   the same, p99      <= 2.0
//   stream_2dev_throughput_vs_spsc_chain  requests/s with the stream kept full         >= 0.9
//   stream_2dev_p50_vs_tbb_flow_graph     closed-loop p50 over oneTBB flow graph with the
//                       same two serial function nodes                                 <= 1.0
//   stream_open_loop_lost_2dev, _4dev     requests unanswered at 50k requests/s for 2 s   0
//   stream_open_loop_p99_vs_spsc_chain_2dev, _4dev  p99 under that load over the chain's  <= 2
//
// Placement and waiting (this VM has 2 cores): the client (and, open loop, the pacing
// producer) run on core 0, which the stream reserves for them (DeviceConfig::host_cores), so
// the devices go on core 1 and share it (2 or 4 of them). Sharing a core with devices only
// makes their wait policy spin-then-park with a yielding spin of at least 50 us
// (WaitPolicy::capped_for_sharing(CoreSharing::kDevices)). The reference
// chain's threads are pinned to the same core and wait with the same capped policy on the
// same wait primitive; its rings are a minimal SPSC ring (cache-line padded indices, each
// side caching the other's). The client waits for its answer by spinning on its own core, in
// both. Every ratio's reference is measured in the same run, alternating with the stream.
// The stream is served through one StreamClient, which pushes and pops on the client's thread.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#if BSPFLOW_HAVE_TBB
#include <tbb/flow_graph.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>
#endif

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

using namespace bspflow;
using bench::Clock;
using bench::spin_for;

namespace {

constexpr std::chrono::nanoseconds kWork{1'000};

struct Req {
  std::int64_t t0 = 0;  // send time, ns since the clock's epoch
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

using bench::devices_off_core0;
using bench::pin_host;

// ---- the hand-written reference: N pinned threads joined by minimal SPSC rings ----

class RefRing {
 public:
  explicit RefRing(std::size_t capacity) : slots_(capacity) {}
  bool try_push(const Req& r) {
    if (tail_ - head_seen_ >= slots_.size()) {
      head_seen_ = head_.load(std::memory_order_acquire);
      if (tail_ - head_seen_ >= slots_.size()) return false;
    }
    slots_[tail_ % slots_.size()] = r;
    tail_pub_.store(++tail_, std::memory_order_release);
    point.notify_light();
    return true;
  }
  bool try_pop(Req& r) {
    if (tail_seen_ <= head_local_) {
      tail_seen_ = tail_pub_.load(std::memory_order_acquire);
      if (tail_seen_ <= head_local_) return false;
    }
    r = slots_[head_local_ % slots_.size()];
    head_.store(++head_local_, std::memory_order_release);
    return true;
  }
  detail::WaitPoint point;  // consumers park here

 private:
  std::vector<Req> slots_;
  alignas(64) std::uint64_t tail_ = 0;
  std::uint64_t head_seen_ = 0;
  alignas(64) std::uint64_t head_local_ = 0;
  std::uint64_t tail_seen_ = 0;
  alignas(64) std::atomic<std::uint64_t> tail_pub_{0};
  alignas(64) std::atomic<std::uint64_t> head_{0};
};

class RefChain {
 public:
  RefChain(std::uint32_t stages, const WaitPolicy& policy) : policy_(policy) {
    for (std::uint32_t i = 0; i <= stages; ++i) rings_.push_back(std::make_unique<RefRing>(64));
    const auto places = Topology::get().place(stages, true, devices_off_core0().host_cores);
    for (std::uint32_t s = 0; s < stages; ++s) {
      threads_.emplace_back([this, s, core = places[s].core] {
        if (core) Topology::get().pin_current_thread(*core);
        RefRing& in = *rings_[s];
        RefRing& out = *rings_[s + 1];
        Req r;
        for (;;) {
          if (!in.try_pop(r)) {
            detail::wait_with(
                in.point, policy_, [&] { return in.try_pop(r) || stop_.load(); },
                detail::Fence::kAsymmetric);
            if (stop_.load()) return;
          }
          spin_for(kWork);
          while (!out.try_push(r)) std::this_thread::yield();
        }
      });
    }
  }
  ~RefChain() {
    stop_.store(true);
    for (auto& r : rings_) r->point.notify();
    for (auto& t : threads_) t.join();
  }
  bool try_send(const Req& r) { return rings_.front()->try_push(r); }
  bool try_receive(Req& r) { return rings_.back()->try_pop(r); }

 private:
  WaitPolicy policy_;
  std::vector<std::unique_ptr<RefRing>> rings_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

// ---- the stream ----

struct StreamRig {
  explicit StreamRig(std::uint32_t devices)
      : group(devices, devices_off_core0()), stream(build(group, devices)),
        client(stream.client()) {
    stream.start();
  }
  ~StreamRig() {
    stream.close();
    while (client.pop()) {
    }
    stream.wait();
  }
  static Stream<Req, Req> build(DeviceGroup& g, std::uint32_t n) {
    auto work = [](Req r) {
      spin_for(kWork);
      return r;
    };
    auto b = StreamBuilder<Req>(g).stage("s0", work);
    if (n == 2) return std::move(b).stage("s1", work).build();
    return std::move(b).stage("s1", work).stage("s2", work).stage("s3", work).build();
  }
  // The same interface as RefChain's, so both are measured by the same code.
  // As the chain's: a push refused (kClientFull, the receiver behind by response_capacity)
  // is retried, so "lost" counts requests sent and never answered, not refusals.
  void send(const Req& r) {
    while (!client.push(r).accepted()) std::this_thread::yield();
  }
  bool try_send(const Req& r) { return client.try_push(Req(r)).accepted(); }
  bool try_receive(Req& r) {
    auto e = client.try_pop();
    if (e) r = *e->value;
    return e.has_value();
  }

  DeviceGroup group;
  Stream<Req, Req> stream;
  StreamClient<Req, Req> client;
};

// Closed loop: `n` requests, one in flight; latencies in ns.
template <class Send, class Receive>
std::vector<double> closed_loop(std::uint64_t n, Send&& send, Receive&& receive) {
  std::vector<double> lat;
  lat.reserve(n);
  for (std::uint64_t i = 0; i < n + n / 10; ++i) {  // the first tenth warms up
    const std::int64_t t0 = now_ns();
    send(Req{t0});
    Req r;
    while (!receive(r)) detail::cpu_relax();
    if (i >= n / 10) lat.push_back(static_cast<double>(now_ns() - t0));
  }
  return lat;
}

// Throughput: `n` requests sent as fast as the stream takes them, received on this thread.
template <class TrySend, class Receive>
double throughput(std::uint64_t n, TrySend&& try_send, Receive&& receive) {
  const auto t0 = Clock::now();
  std::uint64_t sent = 0, got = 0;
  Req r;
  while (got < n) {
    while (sent < n && try_send(Req{0})) ++sent;
    while (receive(r)) ++got;
  }
  return static_cast<double>(n) / bench::seconds_since(t0);
}

// Open loop: a pacing thread sends at `rate` per second for `seconds`; this thread
// receives. Returns the latencies and how many were not answered within a grace period.
template <class Send, class Receive>
std::pair<std::vector<double>, std::uint64_t> open_loop(double rate, double seconds, Send&& send,
                                                        Receive&& receive) {
  const auto period = std::chrono::nanoseconds(static_cast<std::int64_t>(1e9 / rate));
  const auto total = static_cast<std::uint64_t>(rate * seconds);
  std::atomic<std::uint64_t> sent{0};
  std::thread pacer([&] {
    pin_host();
    auto next = Clock::now();
    for (std::uint64_t i = 0; i < total; ++i) {
      // Yield while early: the receiver shares core 0 and must run between sends.
      while (Clock::now() < next) std::this_thread::yield();
      send(Req{now_ns()});
      sent.fetch_add(1, std::memory_order_release);
      next += period;
    }
  });
  std::vector<double> lat;
  lat.reserve(total);
  Req r;
  auto deadline = Clock::now() + std::chrono::duration<double>(seconds + 2.0);
  while (lat.size() < total && Clock::now() < deadline) {
    if (receive(r)) {
      lat.push_back(static_cast<double>(now_ns() - r.t0));
    } else {
      std::this_thread::yield();  // shares core 0 with the pacer
    }
  }
  pacer.join();
  return {lat, total - lat.size()};
}

// A stream's closed-loop latencies over `devices` devices.
std::vector<double> stream_closed_loop(std::uint32_t devices, std::uint64_t n) {
  StreamRig rig(devices);
  return closed_loop(
      n, [&](const Req& r) { rig.send(r); }, [&](Req& r) { return rig.try_receive(r); });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "stream_bench: stream latency and throughput vs a hand-written SPSC chain and oneTBB flow "
      "graph"};
  bench::CommonArgs common;
  common.add_to(app);
  CLI11_PARSE(app, argc, argv);
#if BSPFLOW_HAVE_TBB
  // oneTBB sizes its worker pool from the process's affinity when first used: start it
  // before this thread is pinned to one core, or it would run with no worker at all. Two
  // workers run the two serial nodes; the client stays on core 0.
  tbb::global_control tbb_threads(tbb::global_control::max_allowed_parallelism, 3);
  tbb::task_arena(2).initialize();
#endif
  pin_host();
  bench::Report report("stream");
  const std::uint64_t n = common.quick ? 2'000 : 20'000;
  const double open_seconds = common.quick ? 0.2 : 2.0;
  const WaitPolicy capped = WaitPolicy{}.capped_for_sharing(CoreSharing::kDevices);
  report.note("placement",
              "client on core 0 (reserved), devices and chain threads on the other core(s)");

  for (std::uint32_t devices : {2u, 4u}) {
    const std::string tag = std::to_string(devices) + "dev";
    std::vector<double> s50, s99, c50, c99;
    for (int round = 0; round < 3; ++round) {
      {
        auto lat = stream_closed_loop(devices, n);
        s50.push_back(bench::quantile(lat, 0.5));
        s99.push_back(bench::quantile(lat, 0.99));
      }
      {
        RefChain chain(devices, capped);
        auto lat = closed_loop(
            n,
            [&](const Req& r) {
              while (!chain.try_send(r)) {
              }
            },
            [&](Req& r) { return chain.try_receive(r); });
        c50.push_back(bench::quantile(lat, 0.5));
        c99.push_back(bench::quantile(lat, 0.99));
      }
    }
    report.figure("stream_" + tag + "_p50_ns", bench::median(s50));
    report.figure("spsc_chain_" + tag + "_p50_ns", bench::median(c50));
    const double r50 = bench::median(s50) / bench::median(c50);
    const double r99 = bench::median(s99) / bench::median(c99);
    report.ratio("stream_" + tag + "_p50_vs_spsc_chain", r50, "<= 1.5", r50 <= 1.5);
    report.ratio("stream_" + tag + "_p99_vs_spsc_chain", r99, "<= 2.0", r99 <= 2.0);
  }

  {
    std::vector<double> st, ct;
    for (int round = 0; round < 3; ++round) {
      {
        StreamRig rig(2);
        st.push_back(throughput(
            n * 5, [&](const Req& r) { return rig.try_send(r); },
            [&](Req& r) { return rig.try_receive(r); }));
      }
      {
        RefChain chain(2, capped);
        ct.push_back(throughput(
            n * 5, [&](Req r) { return chain.try_send(r); },
            [&](Req& r) { return chain.try_receive(r); }));
      }
    }
    report.figure("stream_2dev_requests_per_s", bench::median(st));
    report.figure("spsc_chain_2dev_requests_per_s", bench::median(ct));
    const double ratio = bench::median(st) / bench::median(ct);
    report.ratio("stream_2dev_throughput_vs_spsc_chain", ratio, ">= 0.9", ratio >= 0.9);
  }

#if BSPFLOW_HAVE_TBB
  {
    std::vector<double> s50, t50;
    for (int round = 0; round < 3; ++round) {
      {
        auto lat = stream_closed_loop(2, n);
        s50.push_back(bench::quantile(lat, 0.5));
      }
      {
        tbb::task_arena arena(2);
        std::atomic<std::int64_t> done{-1};
        std::optional<tbb::flow::graph> g;
        std::optional<tbb::flow::function_node<Req, Req>> a, b;
        arena.execute([&] {
          g.emplace();
          a.emplace(*g, tbb::flow::serial, [](Req r) {
            spin_for(kWork);
            return r;
          });
          b.emplace(*g, tbb::flow::serial, [&](Req r) {
            spin_for(kWork);
            done.store(r.t0, std::memory_order_release);
            return r;
          });
          tbb::flow::make_edge(*a, *b);
        });
        auto lat = closed_loop(
            n, [&](const Req& r) { arena.execute([&] { a->try_put(r); }); },
            [&](Req& r) {
              const std::int64_t d = done.load(std::memory_order_acquire);
              if (d < 0) return false;
              r.t0 = d;
              done.store(-1, std::memory_order_relaxed);  // relaxed: only this thread resets it
              return true;
            });
        arena.execute([&] { g->wait_for_all(); });
        t50.push_back(bench::quantile(lat, 0.5));
      }
    }
    report.figure("tbb_flow_graph_2dev_p50_ns", bench::median(t50));
    const double ratio = bench::median(s50) / bench::median(t50);
    report.ratio("stream_2dev_p50_vs_tbb_flow_graph", ratio, "<= 1.0", ratio <= 1.0);
  }
#else
  report.note("stream_2dev_p50_vs_tbb_flow_graph", "skipped (built without oneTBB)");
#endif

  for (std::uint32_t devices : {2u, 4u}) {
    const std::string tag = std::to_string(devices) + "dev";
    std::uint64_t lost = 0;
    double s99 = 0;
    {
      StreamRig rig(devices);
      auto [lat, l] = open_loop(
          50'000, open_seconds, [&](const Req& r) { rig.send(r); },
          [&](Req& r) { return rig.try_receive(r); });
      lost = l;
      s99 = bench::quantile(lat, 0.99);
    }
    double c99 = 0;
    {
      RefChain chain(devices, capped);
      auto [lat, l] = open_loop(
          50'000, open_seconds,
          [&](const Req& r) {
            while (!chain.try_send(r)) std::this_thread::yield();
          },
          [&](Req& r) { return chain.try_receive(r); });
      c99 = bench::quantile(lat, 0.99);
    }
    report.ratio("stream_open_loop_lost_" + tag, static_cast<double>(lost), "= 0", lost == 0);
    report.figure("stream_open_loop_" + tag + "_p99_ns", s99);
    report.figure("spsc_chain_open_loop_" + tag + "_p99_ns", c99);
    const double ratio = s99 / c99;
    report.ratio("stream_open_loop_p99_vs_spsc_chain_" + tag, ratio, "<= 2", ratio <= 2.0);
  }
  return report.write(common.json_path) ? 0 : 1;
}
