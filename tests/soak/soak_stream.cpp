// The soak suite's Stream part (see soak_test.cpp): requests exactly once at volume through
// a Stream (3 clients, 4 stages on 2 devices), and the fault-injection trial. Serving through
// StreamClients is in soak_serving.cpp (the run at volume and the serving trials) and
// soak_graph.cpp (the graph trials).
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;

namespace soak {

void soak_stream(std::uint32_t producers, std::uint32_t devices, std::uint64_t elements) {
  constexpr std::uint64_t kStages = 4;
  const std::uint64_t per_client = (elements + producers - 1) / producers;  // at least `elements`
  const std::uint64_t total = per_client * producers;
  const auto t0 = Clock::now();
  DeviceGroup group(devices, kSmall);
  auto plus = [](std::uint64_t x) { return x + 1; };
  auto stream = StreamBuilder<std::uint64_t>(group, StreamConfig{.hop_capacity = 64})
                    .stage("s0", plus, 0)
                    .stage("s1", plus, 0)
                    .stage("s2", plus, devices > 1 ? 1 : 0)
                    .stage("s3", plus, devices > 1 ? 1 : 0)
                    .build();
  stream.start();
  std::vector<std::thread> threads;
  std::atomic<std::uint64_t> pushed_checksum{0}, checksum{0}, received{0}, disorder{0}, errors{0},
      short_clients{0};
  for (std::uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p, client = stream.client()]() mutable {
      std::uint64_t sum = 0, got = 0, next = 0, bad_order = 0, bad = 0, sum_back = 0;
      auto take = [&](const Response<std::uint64_t>& r) {
        if (r.id.sequence != next++ || r.id.client != client.id()) ++bad_order;
        if (!r.ok()) {
          ++bad;
        } else {
          sum_back += *r.value;
        }
        ++got;
      };
      for (std::uint64_t s = 0; s < per_client; ++s) {
        const std::uint64_t x = mix((std::uint64_t{p} << 40) | s) >> 8;
        sum += x + kStages;
        while (!client.push(x)) {
          if (auto r = client.pop()) take(*r);  // its response slots are full: pop first
        }
        while (auto r = client.try_pop()) take(*r);
      }
      while (auto r = client.pop()) take(*r);
      pushed_checksum += sum;
      checksum += sum_back;
      received += got;
      disorder += bad_order;
      errors += bad;
      if (got != per_client) ++short_clients;
    });
  }
  for (auto& t : threads) t.join();
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.accepted == total);
  CHECK(r.answered == total);
  CHECK(received.load() == total);
  CHECK(errors.load() == 0);
  CHECK(disorder.load() == 0);  // each client's sequence 0, 1, 2, ...: none missing, none twice
  CHECK(short_clients.load() == 0);
  CHECK(checksum.load() == pushed_checksum.load());
  const bool ok = r.drained() && r.accepted == total && r.answered == total &&
                  received.load() == total && errors.load() == 0 && disorder.load() == 0 &&
                  short_clients.load() == 0 && checksum.load() == pushed_checksum.load();
  std::printf("soak: Stream, %u clients, %llu stages on %u devices: %llu requests: %s (%.1f s)\n",
              producers, static_cast<unsigned long long>(kStages), devices,
              static_cast<unsigned long long>(total),
              ok ? "exactly once, in order, values right" : "FAILED (see above)",
              seconds_since(t0));
}

// One seeded trial of a chain under a fault: a stage throws (kRespond or kFailFast), the
// stream is closed mid-run, cancelled (by cancel() or a stop token, before or during the
// run), or its clients stop reading and go away mid-run. Every accepted request is answered
// exactly once (to a client still there), and a second run on the same stream serves again.
void stream_trial(Rng& rng, Trial& t, DeviceGroup& group) {
  const std::uint32_t d = group.size();
  const auto stages = static_cast<std::uint32_t>(rng.in(d, 4));
  const bool throws = t.fault == Fault::kThrow;
  const OnError on_error = throws && rng.coin() ? OnError::kFailFast : OnError::kRespond;
  StreamConfig cfg;
  cfg.hop_capacity = rng.in(1, 16);
  cfg.on_error = on_error;
  cfg.wait = rng.coin() ? WaitPolicy{} : WaitPolicy::park();
  cfg.response_capacity = rng.in(1, 64);
  const auto clients = static_cast<std::uint32_t>(rng.in(1, 3));
  const std::uint64_t per_client = rng.in(10, 300);
  const std::uint64_t total = per_client * clients;
  // A request's value is its index (client k's i-th: k * per_client + i); every stage adds 1.
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
  Stopper stopper = stopper_for(rng, t);
  const bool by_token = stopper.before || rng.coin();
  const auto cancel = [&] { by_token ? (void)stopper.source.request_stop() : stream.cancel(); };
  stream.start(stopper.token());
  Seen answered(total);
  std::atomic<std::uint64_t> accepted{0}, delivered{0}, errors{0}, wrong{0};
  std::atomic<bool> leave{false};  // kReaderStops: the clients stop reading and go away
  const bool leaves = t.fault == Fault::kReaderStops;
  std::vector<std::thread> threads;
  for (std::uint32_t k = 0; k < clients; ++k) {
    threads.emplace_back([&, k, client = stream.client()]() mutable {
      std::map<std::uint64_t, std::uint64_t> value_of;  // sequence -> request value
      auto take = [&](const Response<std::uint64_t>& r) {
        const auto it = value_of.find(r.id.sequence);
        if (it == value_of.end()) {
          ++wrong;
          return;
        }
        const std::uint64_t value = it->second;
        value_of.erase(it);
        answered.add(value);
        ++delivered;
        if (r.ok()) {
          if (*r.value != value + stages) ++wrong;
        } else if (r.kind() == ErrorKind::kStageFailed) {
          ++errors;
          if (value != fail_value || r.error->stage != fail_stage) ++wrong;
        } else if (r.kind() != ErrorKind::kCancelled) {
          ++wrong;
        }
      };
      for (std::uint64_t i = 0; i < per_client; ++i) {
        if (leaves && leave.load()) return;  // destroyed with requests outstanding
        const std::uint64_t value = k * per_client + i;
        const Submission s = client.push(value);
        if (s.refusal == Refusal::kClientFull) {
          if (leaves) return;
          if (auto r = client.pop()) take(*r);
          --i;
          continue;
        }
        if (!s) break;  // closed, cancelled or failed: admission has ended
        ++accepted;
        value_of[s.id.sequence] = value;
        if (!leaves) {
          while (auto r = client.try_pop()) take(*r);
        }
      }
      if (leaves) {
        while (!leave.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
        return;
      }
      while (auto r = client.pop()) take(*r);
      if (!value_of.empty()) ++wrong;  // accepted, never answered
    });
  }
  if (t.fault == Fault::kClose) {
    std::this_thread::sleep_for(micros(rng, 3000));
    stream.close();
  } else if (t.fault == Fault::kCancel && !stopper.before) {
    std::this_thread::sleep_for(micros(rng, 3000));
    cancel();
  } else if (leaves) {
    std::this_thread::sleep_for(micros(rng, 2000));
    leave = true;
    for (auto& th : threads) th.join();
    threads.clear();
    cancel();
  }
  if (t.fault == Fault::kThrow) {
    for (auto& th : threads) th.join();  // every client pushed all it could and popped its answers
    threads.clear();
    stream.close();
  }
  std::thread closer;
  if (t.fault != Fault::kClose && t.fault != Fault::kThrow) {
    // Clients that still push end once admission ends: close, for a run not stopped.
    closer = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      stream.close();
    });
  }
  for (auto& th : threads) th.join();
  const StreamResult r = stream.wait();
  if (closer.joinable()) closer.join();
  CHECK(wrong.load() == 0);
  CHECK(r.accepted == accepted.load());
  CHECK(r.unanswered == 0);  // a StreamClient's request is always answered
  if (!leaves) {
    CHECK(delivered.load() == r.answered);  // every answer reached its client
    CHECK(answered.problems(total).find("twice") == std::string::npos);
  }
  // A stage that throws is answered with an error (kRespond) or stops the stream (kFailFast).
  const Endings endings{
      {on_error == OnError::kRespond
           ? Ending{RunStatus::kCompleted, "an error response, the stream went on (kRespond)"}
           : Ending{RunStatus::kFailed, "failed fast (kFailFast)"}},
      {{RunStatus::kCancelled, "cancelled"}, {RunStatus::kCompleted, "drained before the cancel"}},
      {{RunStatus::kCompleted, "drained after the close"}}};
  check_ending(t, r.status, r.message, endings);
  if (stopper.before) CHECK(r.status == RunStatus::kCancelled);
  if (t.fault == Fault::kThrow && on_error == OnError::kRespond) {
    CHECK(errors.load() == (fail_value < accepted.load() ? 1u : 0u));
  } else if (t.fault == Fault::kThrow && r.status == RunStatus::kFailed) {
    REQUIRE(r.failure != nullptr);
    CHECK(r.failure->stage == fail_stage);
    CHECK(contains(r.failure->message, "injected fault"));
  }
  // Same devices, a second run serves again, exactly once.
  auto again = stream.client();
  stream.start();
  std::uint64_t ok = 0;
  auto take = [&](const Response<std::uint64_t>& resp) {
    ok += resp.ok() && *resp.value == 1000 + resp.id.sequence + stages;
  };
  for (std::uint64_t i = 0; i < 20; ++i) {
    // At most response_capacity unpopped (it may be below 20): pop the oldest first.
    if (again.outstanding() >= cfg.response_capacity) take(*again.pop());
    const Submission sub = again.push(1000 + i);
    CAPTURE(std::string(to_string(sub.refusal)));
    REQUIRE(sub);
  }
  stream.close();
  while (auto resp = again.pop()) take(*resp);
  const StreamResult r2 = stream.wait();
  CHECK(r2.drained());
  CHECK(ok == 20);
}

}  // namespace soak
