// Generative serving benchmark: a generate stage (iteration-level batching, paged state)
// against a request-level batch stage running the same modeled decoder, and paged state
// against state reserved for the maximum length. Keys:
//
//   gen_throughput_vs_request_batching  tokens/s at saturation (2,000 sequences queued at
//                       the start), max batch 8 for both, over the request-level batcher  >= 2.0
//   gen_ttft_p99_vs_request_batching    p99 time to first token at 70% of the request-level
//                       batcher's capacity, over the batcher's own                        <= 0.3
//   gen_itl_p99_vs_iteration_bound      p99 gap between two tokens of a sequence at the
//                       client, at 70% of the generate stage's capacity, over a + b*max_active
//                                                                                         <= 2.0
//   gen_throughput_paged_vs_reserved    tokens/s at saturation with device memory for 8
//                       maximum-length sequences and max_active 64, paged over reserved   >= 2.0
//   gen_lost, gen_blocks_leaked         after 10^5 sequences, 10% cancelled, 10% past their
//                       deadline, memory tight enough to preempt: sequences not answered
//                       exactly once (or out of order), blocks still held                 0, 0
//   gen_preempted_answered_once         of the sequences preempted, the share answered
//                       exactly once                                                      1.0
//
// Workload: lengths geometric with mean 32, capped at 256 iterations. An iteration costs
// a + b*active (a = 40 us, b = 1 us): decoding reads the weights once per iteration. The
// request-level batch runs until its longest sequence ends, every iteration costing
// a + b*(batch size): static batching pads the finished sequences. Arrivals are open loop with
// exponential gaps. One device (pinned off core 0); two client threads on core 0, each with
// its own StreamClient (Ordering::kNone: a client's sequences stream side by side). Each
// comparison alternates its contenders over 5 rounds and reports the median.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "bench_util.hpp"

using namespace bspflow;
using bench::Clock;
using bench::spin_for;

namespace {

constexpr std::chrono::nanoseconds kA{40'000};  // an iteration's fixed cost
constexpr std::chrono::nanoseconds kB{1'000};   // and its cost per sequence
constexpr std::uint32_t kMaxLength = 256;
constexpr std::uint32_t kMaxBatch = 8;
constexpr std::uint32_t kClients = 2;

struct Prompt {
  std::uint32_t length = 1;
};

std::vector<Prompt> workload(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::geometric_distribution<std::uint32_t> extra(1.0 / 32.0);  // mean 31, so lengths mean 32
  std::vector<Prompt> w(n);
  for (Prompt& p : w) p.length = std::min(kMaxLength, 1 + extra(rng));
  return w;
}

StreamConfig stream_config() {
  StreamConfig sc;
  sc.ordering = Ordering::kNone;
  sc.admission.queue_capacity = 1u << 14;
  sc.response_capacity = 1u << 14;
  return sc;
}

// The generate stage: one modeled iteration for the active set.
auto iterative(DeviceGroup& devices, const GenerateConfig& gc) {
  auto step = [](std::span<Generation<Prompt, std::byte>> active) {
    spin_for(kA + kB * static_cast<std::int64_t>(active.size()));
    std::vector<StepOutput<std::uint32_t>> out;
    out.reserve(active.size());
    for (auto& g : active) {
      g.state().push_back(std::byte{1});
      const std::uint32_t t = g.step();
      out.push_back(t + 1 >= g.input().length ? StepOutput<std::uint32_t>::last(t)
                                              : StepOutput<std::uint32_t>::next(t));
    }
    return out;
  };
  return StreamBuilder<Prompt>(devices, stream_config())
      .generate_stage<std::byte>("gen", step, gc)
      .build();
}

// The request-level contender: a batch runs until its longest sequence ends; each answer is
// the whole sequence (its token count).
auto request_level(DeviceGroup& devices) {
  BatchConfig bc;
  bc.max_batch = kMaxBatch;
  auto batch = [](std::span<Prompt> ps) {
    std::uint32_t longest = 0;
    for (const Prompt& p : ps) longest = std::max(longest, p.length);
    for (std::uint32_t i = 0; i < longest; ++i) {
      spin_for(kA + kB * static_cast<std::int64_t>(ps.size()));
    }
    std::vector<std::uint32_t> out;
    for (const Prompt& p : ps) out.push_back(p.length);
    return out;
  };
  return StreamBuilder<Prompt>(devices, stream_config()).batch_stage("batch", batch, bc).build();
}

// What the client threads saw: time to first token and gaps between tokens, in ns, and the
// tokens received.
struct Seen {
  std::vector<double> ttft, itl;
  std::uint64_t tokens = 0;
  double seconds = 0;
};

// Runs `w` through `stream` from kClients threads on core 0. rate_per_s 0: every sequence
// pushed at once (saturation); else open loop with exponential gaps at that total rate.
// `streaming`: a response is one token (else it carries the sequence's token count).
template <class S>
Seen drive(S& stream, const std::vector<Prompt>& w, double rate_per_s, bool streaming,
           std::uint64_t seed) {
  std::vector<decltype(stream.client())> clients;
  for (std::uint32_t k = 0; k < kClients; ++k) clients.push_back(stream.client());
  stream.start();
  std::vector<Seen> seen(kClients);
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < kClients; ++k) {
    threads.emplace_back([&, k] {
      bench::pin_host();
      auto& c = clients[k];
      Seen& s = seen[k];
      std::mt19937_64 rng(seed + k);
      std::exponential_distribution<double> gap(rate_per_s / kClients);
      std::vector<Clock::time_point> pushed, last;
      std::vector<bool> started;
      auto next = t0;
      const auto on = [&](const Response<std::uint32_t>& r) {
        const auto now = Clock::now();
        const std::uint64_t i = r.id.sequence;
        if (!started[i]) {
          started[i] = true;
          s.ttft.push_back(std::chrono::duration<double, std::nano>(now - pushed[i]).count());
        } else {
          s.itl.push_back(std::chrono::duration<double, std::nano>(now - last[i]).count());
        }
        last[i] = now;
        if (r.ok()) s.tokens += streaming ? 1 : *r.value;
      };
      for (std::size_t i = k; i < w.size(); i += kClients) {
        if (rate_per_s > 0) {
          next += std::chrono::nanoseconds(static_cast<std::int64_t>(gap(rng) * 1e9));
          while (Clock::now() < next) {
            if (auto r = c.try_pop()) {
              on(*r);
            } else {
              std::this_thread::yield();
            }
          }
        }
        pushed.push_back(Clock::now());
        last.push_back(pushed.back());
        started.push_back(false);
        while (!c.push(w[i])) {
        }
      }
      while (c.outstanding() > 0) {
        if (auto r = c.try_pop()) {
          on(*r);
        } else {
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  Seen all;
  all.seconds = bench::seconds_since(t0);
  stream.close();
  (void)stream.wait();
  for (Seen& s : seen) {
    all.ttft.insert(all.ttft.end(), s.ttft.begin(), s.ttft.end());
    all.itl.insert(all.itl.end(), s.itl.begin(), s.itl.end());
    all.tokens += s.tokens;
  }
  return all;
}

double tokens_per_s(const Seen& s) {
  return static_cast<double>(s.tokens) / s.seconds;
}

// 10^5 sequences (10^4 quick): 10% cancelled, 10% with a deadline they miss, memory for
// four maximum-length sequences with max_active 32. Sequences not answered exactly once and
// in order, blocks still held, and the share of preempted sequences answered exactly once.
struct Accounting {
  std::uint64_t lost = 0, leaked = 0, preempted = 0, preempted_once = 0;
};
Accounting accounting(std::size_t n) {
  DeviceGroup devices(1, bench::devices_off_core0());
  GenerateConfig gc;
  gc.max_active = 32;
  gc.memory = 4 * kMaxLength;  // std::byte entries
  // The step sees a preempted sequence come back after a gap in its iterations.
  auto iteration = std::make_shared<std::uint64_t>(0);
  auto last_seen = std::make_shared<std::unordered_map<std::uint64_t, std::uint64_t>>();
  auto preempted = std::make_shared<std::unordered_set<std::uint64_t>>();
  auto step = [iteration, last_seen, preempted](std::span<Generation<Prompt, std::byte>> active) {
    ++*iteration;
    std::vector<StepOutput<std::uint32_t>> out;
    out.reserve(active.size());
    for (auto& g : active) {
      const std::uint64_t key = (std::uint64_t{g.id().client} << 40) ^ g.id().sequence;
      auto [it, fresh] = last_seen->try_emplace(key, *iteration);
      if (!fresh && it->second + 1 != *iteration) preempted->insert(key);
      it->second = *iteration;
      g.state().push_back(std::byte{1});
      const std::uint32_t t = g.step();
      out.push_back(t + 1 >= g.input().length ? StepOutput<std::uint32_t>::last(t)
                                              : StepOutput<std::uint32_t>::next(t));
    }
    return out;
  };
  StreamConfig sc = stream_config();
  sc.admission.queue_capacity = 256;
  sc.admission.predict = false;
  auto stream =
      StreamBuilder<Prompt>(devices, sc).generate_stage<std::byte>("gen", step, gc).build();
  const std::vector<Prompt> w = workload(n, 99);
  std::vector<StreamClient<Prompt, std::uint32_t>> clients;
  for (std::uint32_t k = 0; k < kClients; ++k) clients.push_back(stream.client());
  stream.start();
  std::mutex m;
  Accounting acc;
  std::map<std::uint64_t, std::uint32_t> finals;  // key -> finals seen (under m)
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < kClients; ++k) {
    threads.emplace_back([&, k] {
      bench::pin_host();
      auto& c = clients[k];
      std::mt19937_64 rng(7 + k);
      std::uniform_int_distribution<int> pct(0, 99);
      std::vector<std::uint32_t> next_index, final_count;
      std::uint64_t bad = 0;
      const auto on = [&](const Response<std::uint32_t>& r) {
        const std::uint64_t i = r.id.sequence;
        if (r.index != next_index[i] || final_count[i] != 0) ++bad;
        ++next_index[i];
        if (r.final) ++final_count[i];
      };
      for (std::size_t i = k; i < w.size(); i += kClients) {
        const int roll = pct(rng);
        const Deadline d =
            roll < 10 ? StreamClock::now() + std::chrono::microseconds(200) : kNoDeadline;
        Submission s;
        while (!(s = c.push(w[i], d))) {
          if (s.refusal == Refusal::kDeadlinePassed || s.refusal == Refusal::kDeadlineUnreachable)
            break;
          if (auto r = c.try_pop()) on(*r);
        }
        if (!s) continue;
        next_index.resize(s.id.sequence + 1, 0);
        final_count.resize(s.id.sequence + 1, 0);
        if (roll >= 10 && roll < 20) c.cancel(s.id);
        while (auto r = c.try_pop()) on(*r);
      }
      while (auto r = c.pop()) on(*r);
      std::lock_guard lock(m);
      acc.lost += bad;
      for (std::uint64_t i = 0; i < final_count.size(); ++i) {
        if (final_count[i] != 1) ++acc.lost;
        finals[(std::uint64_t{c.id()} << 40) ^ i] = final_count[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  stream.close();
  (void)stream.wait();
  const StreamStats st = stream.stats();
  acc.leaked = st.stages.at(0).generation ? st.stages.at(0).generation->blocks_used : 0;
  acc.preempted = preempted->size();
  for (std::uint64_t key : *preempted) {
    const auto it = finals.find(key);
    if (it != finals.end() && it->second == 1) ++acc.preempted_once;
  }
  return acc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "generate_bench: iteration-level batching and paged state against request-level batching "
      "and reserved state"};
  bench::CommonArgs common;
  common.add_to(app);
  CLI11_PARSE(app, argc, argv);
  bench::pin_host();
  bench::Report report("generate");
  const std::size_t n = common.quick ? 200 : 2'000;
  const int rounds = common.quick ? 1 : 5;
  report.note("workload",
              "lengths geometric mean 32, cap 256; iteration 40 us + 1 us per sequence");
  report.note("placement", "one device off core 0; two client threads on core 0");

  // Saturation: both contenders, alternating.
  GenerateConfig gc;
  gc.max_active = kMaxBatch;
  gc.max_length = kMaxLength;
  std::vector<double> it_tps, rq_tps, rq_seq_per_s, it_seq_per_s;
  for (int round = 0; round < rounds; ++round) {
    const auto w = workload(n, 1 + round);
    {
      DeviceGroup devices(1, bench::devices_off_core0());
      auto s = iterative(devices, gc);
      const Seen seen = drive(s, w, 0, true, round);
      it_tps.push_back(tokens_per_s(seen));
      it_seq_per_s.push_back(static_cast<double>(w.size()) / seen.seconds);
    }
    {
      DeviceGroup devices(1, bench::devices_off_core0());
      auto s = request_level(devices);
      const Seen seen = drive(s, w, 0, false, round);
      rq_tps.push_back(tokens_per_s(seen));
      rq_seq_per_s.push_back(static_cast<double>(w.size()) / seen.seconds);
    }
  }
  report.figure("gen_iterative_tokens_per_s", bench::median(it_tps));
  report.figure("gen_request_batching_tokens_per_s", bench::median(rq_tps));
  const double thr = bench::median(it_tps) / bench::median(rq_tps);
  report.ratio("gen_throughput_vs_request_batching", thr, ">= 2.0", thr >= 2.0);

  // Time to first token at 70% of the request-level batcher's capacity.
  const double rq_rate = 0.7 * bench::median(rq_seq_per_s);
  std::vector<double> it_ttft, rq_ttft;
  for (int round = 0; round < rounds; ++round) {
    const auto w = workload(n, 100 + round);
    {
      DeviceGroup devices(1, bench::devices_off_core0());
      auto s = iterative(devices, gc);
      Seen seen = drive(s, w, rq_rate, true, 100 + round);
      it_ttft.push_back(bench::quantile(seen.ttft, 0.99));
    }
    {
      DeviceGroup devices(1, bench::devices_off_core0());
      auto s = request_level(devices);
      Seen seen = drive(s, w, rq_rate, false, 100 + round);
      rq_ttft.push_back(bench::quantile(seen.ttft, 0.99));
    }
  }
  report.figure("gen_ttft_p99_ns", bench::median(it_ttft));
  report.figure("gen_request_batching_ttft_p99_ns", bench::median(rq_ttft));
  const double ttft = bench::median(it_ttft) / bench::median(rq_ttft);
  report.ratio("gen_ttft_p99_vs_request_batching", ttft, "<= 0.3", ttft <= 0.3);

  // Inter-token latency at 70% of the generate stage's own capacity.
  const double it_rate = 0.7 * bench::median(it_seq_per_s);
  std::vector<double> itl;
  for (int round = 0; round < rounds; ++round) {
    DeviceGroup devices(1, bench::devices_off_core0());
    auto s = iterative(devices, gc);
    Seen seen = drive(s, workload(n, 200 + round), it_rate, true, 200 + round);
    itl.push_back(bench::quantile(seen.itl, 0.99));
  }
  const double bound = static_cast<double>((kA + kB * kMaxBatch).count());
  report.figure("gen_itl_p99_ns", bench::median(itl));
  const double itl_ratio = bench::median(itl) / bound;
  report.ratio("gen_itl_p99_vs_iteration_bound", itl_ratio, "<= 2.0", itl_ratio <= 2.0);

  // Paged against reserved: memory for 8 maximum-length sequences, max_active 64.
  std::vector<double> paged, reserved;
  for (int round = 0; round < rounds; ++round) {
    const auto w = workload(n, 300 + round);
    for (MemoryPolicy policy : {MemoryPolicy::kPreempt, MemoryPolicy::kReserve}) {
      GenerateConfig pc;
      pc.max_active = 64;
      pc.max_length = kMaxLength;
      pc.memory = 8 * kMaxLength;  // std::byte entries
      pc.memory_policy = policy;
      DeviceGroup devices(1, bench::devices_off_core0());
      auto s = iterative(devices, pc);
      const double tps = tokens_per_s(drive(s, w, 0, true, 300 + round));
      (policy == MemoryPolicy::kPreempt ? paged : reserved).push_back(tps);
    }
  }
  report.figure("gen_paged_tokens_per_s", bench::median(paged));
  report.figure("gen_reserved_tokens_per_s", bench::median(reserved));
  const double pr = bench::median(paged) / bench::median(reserved);
  report.ratio("gen_throughput_paged_vs_reserved", pr, ">= 2.0", pr >= 2.0);

  // Every sequence accounted for.
  const Accounting acc = accounting(common.quick ? 10'000 : 100'000);
  report.ratio("gen_lost", static_cast<double>(acc.lost), "== 0", acc.lost == 0);
  report.ratio("gen_blocks_leaked", static_cast<double>(acc.leaked), "== 0", acc.leaked == 0);
  report.figure("gen_preempted", static_cast<double>(acc.preempted));
  const double once = acc.preempted == 0 ? 0.0
                                         : static_cast<double>(acc.preempted_once) /
                                               static_cast<double>(acc.preempted);
  report.ratio("gen_preempted_answered_once", once, "== 1.0 (with some preempted)",
               acc.preempted > 0 && once == 1.0);
  return report.write(common.json_path) ? 0 : 1;
}
