// The soak suite's Stream part (see soak_test.cpp): requests exactly once at volume through
// a Stream (3 producers, 4 stages on 2 devices), and the fault-injection trial.
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/runtime/stream.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace soak {

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
  const bool ok = r.drained() && r.accepted == total && r.answered == total && received == total &&
                  errors == 0 && disorder == 0 && all_ids && checksum == pushed_checksum.load();
  std::printf("soak: Stream, %u producers, %llu stages on %u devices: %llu requests: %s (%.1f s)\n",
              producers, static_cast<unsigned long long>(kStages), devices,
              static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, values right" : "FAILED (see above)",
              seconds_since(t0));
}

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
          if (throws && s == fail_stage && x - s == fail_value)
            throw std::runtime_error("injected fault");
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
      for (std::uint64_t i = 0; i < per_producer && producer.push(p * per_producer + i); ++i)
        ++pushed;
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
  // A stage that throws is answered with an error (kRespond) or stops the stream (kFailFast).
  const Endings endings{
      {on_error == OnError::kRespond
           ? Ending{StreamStatus::kDrained, "an error response, the stream went on (kRespond)"}
           : Ending{StreamStatus::kFailed, "failed fast (kFailFast)"}},
      {{StreamStatus::kCancelled, "cancelled"},
       {StreamStatus::kDrained, "drained before the cancel"}},
      {{StreamStatus::kDrained, "drained after the close"}}};
  check_ending(t, r.status, r.message, endings);
  if (t.fault == Fault::kThrow && on_error == OnError::kRespond) {
    CHECK(r.unanswered == 0);
    CHECK(errors == (fail_value < total ? 1u : 0u));
  } else if (t.fault == Fault::kThrow) {
    REQUIRE(r.failure != nullptr);
    CHECK(r.failure->stage == fail_stage);
    CHECK(contains(r.failure->message, "injected fault"));
    CHECK(r.unanswered >= 1);
  } else if (t.fault == Fault::kClose) {
    CHECK(r.unanswered == 0);
  }
  // Same devices, a second run answers what the first did not take.
  const std::uint64_t unanswered = r.unanswered;
  // Unbounded: read after the run.
  OutfeedQueue<Response<std::uint64_t>> out2(OutfeedConfig{.capacity = 0});
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
                "first run: " << r.message << " (accepted " << r.accepted << ", answered "
                              << r.answered << ", delivered " << delivered
                              << "); second run: " << r2.message);
  CHECK(right);
}

}  // namespace soak
