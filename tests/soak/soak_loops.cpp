// The soak suite's loops::repeat part (see soak_test.cpp): elements exactly once at volume
// through 4 producers x 2 replicas and 3 x 3 (3 devices on 2 cores), and the fault-injection
// trial.
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
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

namespace {

// loops::repeat's per-replica state: what the body saw, checked on the device.
struct LoopTally {
  std::uint64_t count = 0, checksum = 0, disorder = 0;
  std::array<std::uint64_t, kMaxProducers> next{};  // the next sequence expected per producer
};

}  // namespace

void soak_repeat(std::uint32_t producers, std::uint32_t replicas, std::uint64_t elements) {
  // At least `elements` in all, a multiple of replicas per producer.
  const std::uint64_t per_producer =
      (elements + producers * replicas - 1) / (producers * replicas) * replicas;
  const std::uint64_t total = per_producer * producers;
  const auto t0 = Clock::now();
  DeviceGroup group(replicas, kSmall);
  InfeedQueue<std::uint64_t> infeed(InfeedConfig{replicas, 1024, 16});
  OutfeedQueue<std::uint64_t> outfeed(OutfeedConfig{replicas, OutputMode::all(), 1 << 16});
  auto body = [](LoopTally& t, std::uint64_t& x) {
    const auto p = static_cast<std::uint32_t>(x >> 40);
    const std::uint64_t seq = x & ((std::uint64_t{1} << 40) - 1);
    if (p >= kMaxProducers || seq < t.next[p])
      ++t.disorder;  // per producer, per replica: increasing
    if (p < kMaxProducers) t.next[p] = seq + 1;
    ++t.count;
    t.checksum += mix(x);
    return x;
  };
  Run<LoopTally> run =
      loops::repeat_async(group, total / replicas, body, LoopTally{}, infeed, outfeed);
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
  const bool ok = count == total && received == total && arrivals.missing() == 0 &&
                  arrivals.duplicates() == 0 && arrivals.foreign() == 0 && disorder == 0 &&
                  out_disorder == 0 && checksum == pushed_checksum.load() &&
                  out_checksum == pushed_checksum.load();
  std::printf("soak: loops::repeat, %u producers x %u replicas: %llu elements: %s (%.1f s)\n",
              producers, replicas, static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, checksums equal" : "FAILED (see above)",
              seconds_since(t0));
}

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
  std::thread producer = produce(in, closing.push, pushed, [](std::uint64_t i) { return i; });
  std::thread closer;
  if (closing.from_outside) closer = close_later(in, micros(rng, 3000));
  const std::chrono::microseconds work =
      t.fault == Fault::kCancel ? micros(rng, 20) : std::chrono::microseconds(0);
  auto body = [&](int&, std::uint64_t& x, const Iteration& it) {
    seen.add(x);
    spin_for(work);
    if (throws && it.replica == fail_replica && it.index == fail_at)
      throw std::runtime_error("injected fault");
    ok[it.replica].fetch_add(1, std::memory_order_relaxed);
    return x;
  };
  Stopper stopper = stopper_for(rng, t);
  const bool by_token = stopper.before || rng.coin();  // else Run::cancel()
  Run<int> run = loops::repeat_async(group, n, body, 0, in, out, stopper.token());
  const std::vector<OutfeedEntry<std::uint64_t>> read = stop_fault(
      rng, t, out, 3000, 20, [&](auto d) { return run.wait_for(d); },
      [&] { by_token ? (void)stopper.source.request_stop() : run.cancel(); }, stopper);
  std::optional<RepeatResult<int>> r;
  try {
    r = run.get();
  } catch (const DeviceError& e) {
    CHECK(throws);
    CHECK(e.replica() == fail_replica);
    CHECK(e.device() == fail_replica);
    CHECK(e.iteration() == fail_at);
    CHECK(contains(e.what(), "injected fault"));
    t.outcome = "DeviceError at the injected place";
  }
  if (r) {
    check_ending(t, r->status, r->message, kCountedRunEndings);
    if (r->status == RunStatus::kEndOfData) CHECK(contains(r->message, "end of data"));
    for (std::uint32_t rep = 0; rep < d; ++rep) CHECK(r->iterations[rep] == ok[rep].load());
    if (stopper.before) check_stopped_before(t, r->status, r->iterations);
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
  check_exactly_once(seen, pushed.load(), std::move(ids), throws ? 1 : 0);
}

}  // namespace soak
