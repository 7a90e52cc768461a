// Feed benchmark. Every figure is a ratio against a reference measured in the same run:
//  - feed_throughput_vs_moodycamel: elements/s through infeed -> loops::repeat (empty body,
//    8-byte elements, 1000 device iterations per host call) -> outfeed, over raw moodycamel
//    ConcurrentQueue one-producer-one-consumer (tokens, one element per call). Both use two
//    threads on the same two cores: for bspflow the host thread pushes a step's 1000
//    elements and then reads its 1000 outfeed entries while the device thread loops.
//  - feed_bulk_throughput_vs_moodycamel: the same path with push_bulk (1000 per call) and
//    prefetch depth 32, over raw moodycamel's bulk API (enqueue_bulk of 1000, try_dequeue_bulk
//    of 32) on the same two threads and cores; target >= 1.0. Its ratio over the
//    element-wise reference is printed too (..._elementwise). The bulk path's outfeed has one
//    reader and says so (ConsumerType::kSingle); feed_bulk_multi_reader_* is it with kMulti.
//  - feed_bulk_throughput_vs_moodycamel_same_shape: the bulk path over moodycamel's bulk API
//    moving the same shape by hand (two hops, a result per element, a hand-shake per step of
//    1000); target >= 1.0. moodycamel_bulk_same_shape_vs_single_hop shows how far below its
//    own single hop moodycamel lands in that shape on this machine: the bound of the key above.
//  - roundtrip_p50/p99_vs_pingpong: one element host -> device -> host, against an atomic
//    ping-pong between two threads pinned to the same two cores; target p50 <= 1.1.
//    pingpong_2line_vs_pingpong is the same ping-pong carrying a payload in a second cache line
//    each way, as a queue's slot and index are: the floor of any data-carrying hand-off here;
//    roundtrip_p50_vs_pingpong_2line is the round trip against that floor.
//  - host_call_p50_ns / host_call_mean_ns: one host call of a one-iteration loop (launch, one
//    element in, its output out, get()): the cost device iterations amortize. Its mean over
//    the round trip's p50 is host_call_mean_vs_roundtrip_p50 (no target).
// The infeeds have one producer and say so (ProducerType::kSingle: single-producer lanes);
// feed_multi_throughput_vs_moodycamel is the element-wise figure with ProducerType::kMulti.
// The round trip's outfeed has one reader and says so (ConsumerType::kSingle: a ring per
// replica); roundtrip_multi_p50_vs_pingpong is the same trip with ConsumerType::kMulti.
//
//   feed_bench [--json FILE] [--quick]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

namespace {

using bench::Clock;
using bench::seconds_since;

struct Cores {
  std::uint32_t host = 0;
  std::uint32_t device = 0;
};

Cores pick_cores() {
  const auto& topo = bspflow::Topology::get();
  const auto placement = topo.place(1);
  Cores c;
  c.device = placement[0].core.value_or(0);
  c.host = 0;
  return c;
}

using bench::pin;

// The two moodycamel references call enqueue_bulk, inlined: GCC 12 warns there with a bogus
// -Wstringop-overflow, as in BoundedQueue.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif

// Raw moodycamel, one producer and one consumer thread: one element per call, or with
// `bulk` its bulk API as the feed's bulk path moves them (the producer enqueues 1000 at a time
// with enqueue_bulk, the consumer dequeues up to 32 at a time with try_dequeue_bulk).
double moodycamel_rate(std::uint64_t n, const Cores& cores, bool bulk) {
  constexpr std::uint64_t kChunk = 1000;
  moodycamel::ConcurrentQueue<std::uint64_t> q;
  std::atomic<bool> go{false};
  std::uint64_t sum = 0;
  std::thread consumer([&] {
    pin(cores.device);
    moodycamel::ConsumerToken tok(q);
    while (!go.load(std::memory_order_acquire)) {
    }
    if (bulk) {
      std::uint64_t v[32];
      for (std::uint64_t got = 0; got < n;) {
        const std::size_t k = q.try_dequeue_bulk(tok, v, 32);
        for (std::size_t i = 0; i < k; ++i) sum += v[i];
        got += k;
      }
    } else {
      std::uint64_t v = 0;
      for (std::uint64_t got = 0; got < n;) {
        if (q.try_dequeue(tok, v)) {
          sum += v;
          ++got;
        }
      }
    }
  });
  pin(cores.host);
  moodycamel::ProducerToken tok(q);
  std::vector<std::uint64_t> chunk(bulk ? kChunk : 0);
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  if (bulk) {
    for (std::uint64_t i = 0; i < n; i += kChunk) {
      for (std::uint64_t k = 0; k < kChunk; ++k) chunk[k] = i + k;
      q.enqueue_bulk(tok, chunk.data(), kChunk);
    }
  } else {
    for (std::uint64_t i = 0; i < n; ++i) q.enqueue(tok, i);
  }
  consumer.join();
  const double t = seconds_since(t0);
  if (sum != n * (n - 1) / 2) std::fprintf(stderr, "moodycamel reference lost elements\n");
  return static_cast<double>(n) / t;
}

// The bulk path's shape built by hand from moodycamel's bulk API: per step of 1000 the host
// starts the step (one release store, where bspflow launches a run), enqueue_bulk's the 1000,
// then try_dequeue_bulk's (32 at a time) the 1000 results; the worker dequeues 32 at a time,
// makes one {value, iteration} result per element and enqueue_bulk's them to a second queue,
// then says the step is done. Same threads, cores and element counts as bspflow_rate. It
// shows what moodycamel itself moves when the path has two hops, a per-element loop and a
// hand-shake per step, against its single hop (moodycamel_rate with bulk).
double moodycamel_same_shape_rate(std::uint64_t steps, const Cores& cores) {
  constexpr std::uint64_t kIterations = 1000;
  struct Result {
    std::uint64_t value;
    std::uint64_t iteration;
  };
  moodycamel::ConcurrentQueue<std::uint64_t> in;
  moodycamel::ConcurrentQueue<Result> out;
  std::atomic<std::uint64_t> started{0};
  std::atomic<std::uint64_t> finished{0};
  std::thread worker([&] {
    pin(cores.device);
    moodycamel::ConsumerToken in_tok(in);
    moodycamel::ProducerToken out_tok(out);
    std::uint64_t v[32];
    Result staged[32];
    for (std::uint64_t s = 1; s <= steps; ++s) {
      while (started.load(std::memory_order_acquire) < s) {
      }
      for (std::uint64_t done = 0; done < kIterations;) {
        const std::size_t k = in.try_dequeue_bulk(in_tok, v, 32);
        for (std::size_t i = 0; i < k; ++i) staged[i] = Result{v[i], done + i};
        if (k != 0) out.enqueue_bulk(out_tok, staged, k);
        done += k;
      }
      finished.store(s, std::memory_order_release);
    }
  });
  pin(cores.host);
  moodycamel::ProducerToken in_tok(in);
  moodycamel::ConsumerToken out_tok(out);
  std::vector<std::uint64_t> batch(kIterations);
  Result got[32];
  std::uint64_t sum = 0;
  const auto t0 = Clock::now();
  for (std::uint64_t s = 1; s <= steps; ++s) {
    started.store(s, std::memory_order_release);
    const std::uint64_t base = (s - 1) * kIterations;
    for (std::uint64_t i = 0; i < kIterations; ++i) batch[i] = base + i;
    in.enqueue_bulk(in_tok, batch.data(), kIterations);
    for (std::uint64_t r = 0; r < kIterations;) {
      const std::size_t k = out.try_dequeue_bulk(out_tok, got, 32);
      for (std::size_t i = 0; i < k; ++i) sum += got[i].value;
      r += k;
    }
    while (finished.load(std::memory_order_acquire) < s) {
    }
  }
  const double t = seconds_since(t0);
  worker.join();
  const std::uint64_t n = steps * kIterations;
  if (sum != n * (n - 1) / 2)
    std::fprintf(stderr, "moodycamel same-shape reference lost elements\n");
  return static_cast<double>(n) / t;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// infeed -> repeat(1000, empty body) -> outfeed; host pushes a step, then drains it.
double bspflow_rate(std::uint64_t steps, bool bulk, std::uint32_t prefetch, const Cores& cores,
                    bspflow::Device& device,
                    bspflow::ProducerType producers = bspflow::ProducerType::kSingle,
                    bspflow::ConsumerType readers = bspflow::ConsumerType::kMulti) {
  constexpr std::uint64_t kIterations = 1000;
  bspflow::InfeedConfig config{1, 1024, prefetch};
  config.producer_type = producers;
  bspflow::InfeedQueue<std::uint64_t> infeed(config);
  bspflow::OutfeedConfig out_config;
  out_config.consumer_type = readers;
  if (readers == bspflow::ConsumerType::kSingle) out_config.capacity = 1024;
  bspflow::OutfeedQueue<std::uint64_t> outfeed(out_config);
  auto producer = infeed.make_producer();
  pin(cores.host);
  std::vector<std::uint64_t> batch(kIterations);
  std::uint64_t sum = 0;
  std::uint64_t received = 0;
  auto body = [](int&, std::uint64_t& x) { return x; };
  const auto t0 = Clock::now();
  for (std::uint64_t s = 0; s < steps; ++s) {
    auto run = bspflow::loops::repeat_async(device, kIterations, body, 0, infeed, outfeed);
    const std::uint64_t base = s * kIterations;
    if (bulk) {
      for (std::uint64_t i = 0; i < kIterations; ++i) batch[i] = base + i;
      producer.push_bulk(0, batch);
    } else {
      for (std::uint64_t i = 0; i < kIterations; ++i) producer.push(base + i);
    }
    for (auto& e : outfeed) {
      sum += e.value;
      ++received;
    }
    run.get();
  }
  const double t = seconds_since(t0);
  const std::uint64_t n = steps * kIterations;
  if (received != n || sum != n * (n - 1) / 2) std::fprintf(stderr, "bspflow feed lost elements\n");
  return static_cast<double>(n) / t;
}

// The feeds of the one-element trips: a one-producer infeed and an outfeed with `readers`
// (a ring of 1024 per replica when kSingle).
struct TripFeeds {
  static bspflow::InfeedConfig in_config() {
    bspflow::InfeedConfig config;
    config.producer_type = bspflow::ProducerType::kSingle;
    return config;
  }
  static bspflow::OutfeedConfig out_config(bspflow::ConsumerType readers) {
    bspflow::OutfeedConfig config;
    config.consumer_type = readers;
    if (readers == bspflow::ConsumerType::kSingle) config.capacity = 1024;
    return config;
  }
  explicit TripFeeds(bspflow::ConsumerType readers)
      : infeed(in_config()), outfeed(out_config(readers)) {}
  bspflow::InfeedQueue<std::uint64_t> infeed;
  bspflow::OutfeedQueue<std::uint64_t> outfeed;
};

// One element host -> device -> host through infeed, a running loop and outfeed (ns each).
std::vector<double> roundtrip(std::uint64_t n, const Cores& cores, bspflow::Device& device,
                              bspflow::ConsumerType readers) {
  TripFeeds feeds(readers);
  auto& [infeed, outfeed] = feeds;
  auto run = bspflow::loops::repeat_async(
      device, n, [](int&, std::uint64_t& x) { return x; }, 0, infeed, outfeed);
  auto producer = infeed.make_producer();
  pin(cores.host);
  std::vector<double> rtt;
  rtt.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    producer.push(i);
    const auto e = outfeed.pop();
    rtt.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    if (!e || e->value != i) {
      std::fprintf(stderr, "round trip lost element %llu\n", static_cast<unsigned long long>(i));
      break;
    }
  }
  run.get();
  return rtt;
}

// One host call of a one-iteration loop, `calls` times: launch (repeat_async), one element
// in, its output out, get(). What device iterations amortize (ns per call, each).
std::vector<double> host_calls(std::uint64_t calls, const Cores& cores, bspflow::Device& device) {
  TripFeeds feeds(bspflow::ConsumerType::kSingle);
  auto& [infeed, outfeed] = feeds;
  auto producer = infeed.make_producer();
  pin(cores.host);
  std::vector<double> ns;
  ns.reserve(calls);
  for (std::uint64_t i = 0; i < calls; ++i) {
    const auto t0 = Clock::now();
    auto run = bspflow::loops::repeat_async(
        device, 1, [](int&, std::uint64_t& x) { return x; }, 0, infeed, outfeed);
    producer.push(i);
    const auto e = outfeed.pop();
    const auto r = run.get();
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    if (!e || e->value != i || r.status != bspflow::RunStatus::kCompleted) {
      std::fprintf(stderr, "host call %llu lost its element\n", static_cast<unsigned long long>(i));
      break;
    }
  }
  return ns;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bspflow feed benchmark"};
  bench::CommonArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);

  const Cores cores = pick_cores();
  const std::uint64_t elements = args.quick ? 200'000 : 4'000'000;
  const std::uint64_t steps = elements / 1000;
  // Round trips: rounds of 25,000 (about 4 ms a kind at 150 ns a trip).
  const std::uint64_t trips = 25'000;
  const int trip_rounds = args.quick ? 1 : 8;
  constexpr int kRepeats = 5;

  bench::Report report("feed");
  report.note("machine", bspflow::Topology::get().describe().substr(
                             0, bspflow::Topology::get().describe().find('\n')));
  report.note("cores_used", "host core " + std::to_string(cores.host) + ", device core " +
                                std::to_string(cores.device));

  bspflow::Device device(0, bspflow::DeviceConfig{64, 64 * 1024},
                         bspflow::Topology::get().place(1)[0]);

  // Interleave reference and subject runs so drift on a shared machine hits both alike, and
  // take each ratio within its round (the keys: medians of the rounds' ratios; the figures:
  // medians of the rounds' figures). This VM's core-to-core latency jumps between levels every
  // few seconds, so two medians taken over all rounds may come from different levels.
  std::vector<double> raw, raw_bulk, elementwise, multi, bulk, bulk_multi, same_shape;
  std::vector<double> r_elem, r_multi, r_bulk, r_bulk_elem, r_shape, r_shape_hop, r_bulk_multi;
  for (int r = 0; r < kRepeats; ++r) {
    raw.push_back(moodycamel_rate(elements, cores, false));
    raw_bulk.push_back(moodycamel_rate(elements, cores, true));
    elementwise.push_back(bspflow_rate(steps, false, 1, cores, device));
    multi.push_back(bspflow_rate(steps, false, 1, cores, device, bspflow::ProducerType::kMulti));
    bulk.push_back(bspflow_rate(steps, true, 32, cores, device, bspflow::ProducerType::kSingle,
                                bspflow::ConsumerType::kSingle));
    same_shape.push_back(moodycamel_same_shape_rate(steps, cores));
    bulk_multi.push_back(bspflow_rate(steps, true, 32, cores, device));
    r_elem.push_back(elementwise.back() / raw.back());
    r_multi.push_back(multi.back() / raw.back());
    r_bulk.push_back(bulk.back() / raw_bulk.back());
    r_bulk_elem.push_back(bulk.back() / raw.back());
    r_shape.push_back(bulk.back() / same_shape.back());
    r_shape_hop.push_back(same_shape.back() / raw_bulk.back());
    r_bulk_multi.push_back(bulk_multi.back() / same_shape.back());
  }
  report.figure("moodycamel_1p1c_elements_per_s", bench::median(raw));
  report.figure("feed_elements_per_s", bench::median(elementwise));
  report.figure("feed_bulk_prefetch32_elements_per_s", bench::median(bulk));
  const double elem = bench::median(r_elem);
  report.ratio("feed_throughput_vs_moodycamel", elem, ">= 0.6", elem >= 0.6);
  report.ratio("feed_multi_throughput_vs_moodycamel", bench::median(r_multi), "(no target)", true);
  report.figure("moodycamel_bulk_1p1c_elements_per_s", bench::median(raw_bulk));
  const double bulk_ratio = bench::median(r_bulk);
  report.ratio("feed_bulk_throughput_vs_moodycamel", bulk_ratio, ">= 1.0", bulk_ratio >= 1.0);
  report.figure("feed_bulk_throughput_vs_moodycamel_elementwise", bench::median(r_bulk_elem));
  // The bound of the bulk key on this machine: moodycamel's bulk API moving the same shape.
  report.figure("moodycamel_bulk_same_shape_elements_per_s", bench::median(same_shape));
  report.figure("moodycamel_bulk_same_shape_vs_single_hop", bench::median(r_shape_hop));
  const double shape = bench::median(r_shape);
  report.ratio("feed_bulk_throughput_vs_moodycamel_same_shape", shape, ">= 1.0", shape >= 1.0);
  report.spread("feed_bulk_throughput_vs_moodycamel_same_shape", r_shape);
  report.figure("feed_bulk_multi_reader_elements_per_s", bench::median(bulk_multi));
  report.ratio("feed_bulk_multi_reader_vs_moodycamel_same_shape", bench::median(r_bulk_multi),
               "(no target)", true);

  // Round trips: short rounds, the ping-pong and the two trips back to back in each.
  std::vector<double> pp50, pp99, rt50, rt99, rtm50, r_rt50, r_rt99, r_rtm50, r_pp2, r_rt_pp2;
  std::vector<double> call50, call_mean, r_call;
  for (int r = 0; r < trip_rounds; ++r) {
    std::vector<double> pp = bench::pingpong(trips, cores.host, cores.device);
    std::vector<double> pp2 = bench::pingpong_2line(trips, cores.host, cores.device);
    std::vector<double> rt = roundtrip(trips, cores, device, bspflow::ConsumerType::kSingle);
    std::vector<double> rtm = roundtrip(trips, cores, device, bspflow::ConsumerType::kMulti);
    pp50.push_back(bench::quantile(pp, 0.5));
    pp99.push_back(bench::quantile(pp, 0.99));
    rt50.push_back(bench::quantile(rt, 0.5));
    rt99.push_back(bench::quantile(rt, 0.99));
    rtm50.push_back(bench::quantile(rtm, 0.5));
    r_rt50.push_back(rt50.back() / pp50.back());
    r_rt99.push_back(rt99.back() / pp99.back());
    r_rtm50.push_back(rtm50.back() / pp50.back());
    const double pp2_50 = bench::quantile(pp2, 0.5);
    r_pp2.push_back(pp2_50 / pp50.back());
    r_rt_pp2.push_back(rt50.back() / pp2_50);
    std::vector<double> calls = host_calls(trips / 5, cores, device);
    call50.push_back(bench::quantile(calls, 0.5));
    call_mean.push_back(std::accumulate(calls.begin(), calls.end(), 0.0) /
                        static_cast<double>(std::max<std::size_t>(calls.size(), 1)));
    r_call.push_back(call_mean.back() / rt50.back());
  }
  report.figure("pingpong_p50_ns", bench::median(pp50));
  report.figure("pingpong_p99_ns", bench::median(pp99));
  report.figure("roundtrip_p50_ns", bench::median(rt50));
  report.figure("roundtrip_p99_ns", bench::median(rt99));
  const double trip = bench::median(r_rt50);
  report.ratio("roundtrip_p50_vs_pingpong", trip, "<= 1.1", trip <= 1.1);
  report.spread("roundtrip_p50_vs_pingpong", r_rt50);
  report.ratio("roundtrip_p99_vs_pingpong", bench::median(r_rt99), "(no target)", true);
  report.figure("pingpong_2line_vs_pingpong", bench::median(r_pp2));
  report.ratio("roundtrip_p50_vs_pingpong_2line", bench::median(r_rt_pp2), "(no target)", true);
  report.figure("roundtrip_multi_p50_ns", bench::median(rtm50));
  report.ratio("roundtrip_multi_p50_vs_pingpong", bench::median(r_rtm50), "(no target)", true);
  report.figure("host_call_p50_ns", bench::median(call50));
  report.figure("host_call_mean_ns", bench::median(call_mean));
  report.ratio("host_call_mean_vs_roundtrip_p50", bench::median(r_call), "(no target)", true);

  if (!report.write(args.json_path)) {
    std::fprintf(stderr, "could not write %s\n", args.json_path.c_str());
    return 1;
  }
  return 0;
}
