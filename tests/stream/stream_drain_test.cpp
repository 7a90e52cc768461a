// Draining a served Stream (Stream::close, Stream::cancel): on close and on cancel, with
// batches forming and in flight and clients still pushing, every accepted request is
// answered and reaches its client, 20 rounds each.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "runtime_test_util.hpp"
#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_clean;
using test::Drive;
using test::eventually;
using test::kSpan;
using test::plus1;
using test::run_clients;
using test::spin_for;
using test::sum;
using test::Tally;
using U64 = std::uint64_t;

TEST_SUITE_BEGIN("stream_drain");

TEST_CASE("drain on close and on cancel with batches in flight loses nothing (20 rounds)") {
  DeviceGroup group(2);
  constexpr int kRounds = 20;
  constexpr int kClients = 2;
  const U64 per = test::scaled(400, 100);
  for (const bool cancel : {false, true}) {
    CAPTURE(cancel);
    for (int round = 0; round < kRounds; ++round) {
      CAPTURE(round);
      auto stream =
          StreamBuilder<U64>(group)
              .batch_stage(
                  "model",
                  [](std::span<U64> batch) {
                    spin_for(std::chrono::microseconds(20 + 2 * batch.size()));
                    std::vector<U64> out(batch.begin(), batch.end());
                    for (U64& x : out) x *= 2;
                    return out;
                  },
                  BatchConfig{.max_batch = 8, .max_delay = 500us, .allowed_sizes = {2, 4, 8}}, 0)
              .stage("post", plus1, 1)
              .build();
      stream.start();
      std::atomic<U64> accepted{0};
      std::vector<Tally> tallies;
      std::thread clients([&] {
        tallies = run_clients(
            stream, kClients,
            Drive{.requests = per, .window = 32, .stop_on_refusal = true, .accepted = &accepted},
            [](int k, U64 i) { return U64(k) * kSpan + i; },
            [&](int k, U64 i, const Response<U64>& r) {
              if (r.ok()) return *r.value == 2 * (U64(k) * kSpan + i) + 1;
              return cancel && r.kind() == ErrorKind::kCancelled;
            });
      });
      // Stop mid-stream: with some requests accepted, batches forming and in flight.
      const U64 stop_at = per * kClients / 3 + static_cast<U64>(round) * 7;
      eventually([&] { return accepted.load() >= stop_at; });
      if (cancel) {
        stream.cancel();
      } else {
        stream.close();
      }
      // The stream answers what it accepted while the clients pop.
      const StreamResult r = stream.wait();
      clients.join();
      check_clean(tallies);
      const Tally all = sum(tallies);
      for (const Tally& t : tallies) {
        // A client stops at its first refusal: the stream closed, or it pushed everything.
        CHECK(t.refused_total() == t.refused_of(Refusal::kClosed));
        CHECK(t.refused_total() <= 1);
      }
      CHECK(r.accepted == all.accepted);
      CHECK(r.answered == r.accepted);  // every accepted request answered
      CHECK(r.unanswered == 0);
      CHECK(all.answered == all.accepted);  // and its client got the answer
      if (cancel) {
        CHECK(r.status == RunStatus::kCancelled);
        CHECK(all.ok + all.errors_of(ErrorKind::kCancelled) == all.answered);
      } else {
        CHECK(r.drained());
        CHECK(all.ok == all.answered);
      }
    }
  }
}

TEST_SUITE_END();
