// Batch stages (bspflow/stream/stream_serving.hpp's BatchConfig, ItemResult): every request
// answered once with its own value, batch sizes within bounds and allowed sizes, the first
// request's wait bounded by max_delay, padding never seen; per-item failures; a batch that
// throws; and deadline-aware flushing without max_delay.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "serve_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::check_clean;
using test::contains;
using test::Drive;
using test::kSpan;
using test::run_clients;
using test::spin_for;
using test::sum;
using U64 = std::uint64_t;

namespace {

// Slack for timing bounds on a loaded 2-core machine (a thread may wait a scheduler tick or
// several): 20 ms, more under ThreadSanitizer.
std::chrono::nanoseconds slack() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(0.02 / test::scale()));
}

// A batch stage's input: the value, when it was pushed, and whether it is a request (padding
// is default-constructed: real == false).
struct Item {
  U64 v = 0;
  StreamClock::time_point pushed{};
  bool real = false;
};

// What a batch stage saw, written by its device thread only and read after wait().
struct BatchLog {
  std::vector<std::size_t> sizes;                  // span sizes (padded)
  std::vector<std::size_t> real;                   // requests in each
  std::chrono::nanoseconds longest_first_wait{0};  // batch start - its earliest push
  std::chrono::nanoseconds longest_service{0};     // one call
};

}  // namespace

TEST_SUITE_BEGIN("stream_batching");

TEST_CASE("batching: each request answered once with its own value, sizes within bounds") {
  DeviceGroup group(1);
  // Without and with allowed sizes; max_delay 2 ms from the batch's first request.
  const std::vector<BatchConfig> configs{
      BatchConfig{.max_batch = 8, .max_delay = 2ms},
      BatchConfig{.max_batch = 8, .max_delay = 2ms, .allowed_sizes = {1, 2, 4, 8}}};
  for (const BatchConfig& cfg : configs) {
    CAPTURE(cfg.allowed_sizes.size());
    auto log = std::make_shared<BatchLog>();
    auto model = [log](std::span<Item> batch) {
      const auto start = StreamClock::now();
      std::size_t real = 0;
      auto first = StreamClock::time_point::max();
      for (const Item& it : batch) {
        if (!it.real) continue;
        ++real;
        first = std::min(first, it.pushed);
      }
      spin_for(std::chrono::microseconds(50 + 10 * batch.size()));  // a + b * n: batching pays
      std::vector<U64> out;
      out.reserve(batch.size());
      for (const Item& it : batch) out.push_back(it.v * 2);
      log->sizes.push_back(batch.size());
      log->real.push_back(real);
      if (real > 0) {
        log->longest_first_wait =
            std::max(log->longest_first_wait,
                     std::chrono::duration_cast<std::chrono::nanoseconds>(start - first));
      }
      log->longest_service = std::max(
          log->longest_service,
          std::chrono::duration_cast<std::chrono::nanoseconds>(StreamClock::now() - start));
      return out;
    };
    auto stream = StreamBuilder<Item>(group).batch_stage("model", model, cfg).build();
    stream.start();
    // 2 clients, at most 4 unanswered each: what waits always fits in one batch, so the
    // first request of a batch waits at most one batch's service time, then max_delay.
    constexpr int kClients = 2;
    const U64 per = 300;
    const auto tallies = run_clients(
        stream, kClients, Drive{.requests = per, .window = 4},
        [](int k, U64 i) {
          if (i % 8 == 7) {  // irregular arrivals
            std::this_thread::sleep_for(std::chrono::microseconds(200 * (i * 37 % 5)));
          }
          return Item{U64(k) * kSpan + i, StreamClock::now(), true};
        },
        [](int k, U64 i, const Response<U64>& r) {
          return r.ok() && *r.value == 2 * (U64(k) * kSpan + i);
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    CHECK(r.answered == per * kClients);
    check_clean(tallies);
    CHECK(sum(tallies).ok == per * kClients);  // padding is never answered
    REQUIRE(!log->sizes.empty());
    std::size_t requests = 0, padding = 0, largest = 0;
    bool sizes_ok = true, padded_ok = true;
    for (std::size_t b = 0; b < log->sizes.size(); ++b) {
      const std::size_t size = log->sizes[b], real = log->real[b];
      requests += real;
      padding += size - real;
      largest = std::max(largest, real);
      sizes_ok = sizes_ok && size >= 1 && size <= cfg.max_batch;
      if (!cfg.allowed_sizes.empty()) {
        sizes_ok = sizes_ok && std::find(cfg.allowed_sizes.begin(), cfg.allowed_sizes.end(),
                                         size) != cfg.allowed_sizes.end();
      }
      padded_ok = padded_ok && real >= 1 && size == cfg.padded(real);  // the next allowed size
    }
    CHECK(sizes_ok);
    CHECK(padded_ok);
    CHECK(requests == per * kClients);          // each request in one batch
    CHECK(log->sizes.size() < per * kClients);  // and some batches held several
    if (cfg.allowed_sizes.empty()) CHECK(padding == 0);
    CAPTURE(log->longest_first_wait.count());
    CAPTURE(log->longest_service.count());
    CHECK(log->longest_first_wait <= *cfg.max_delay + log->longest_service + slack());
    const StreamStats st = stream.stats();
    REQUIRE(st.stages.size() == 1);
    CHECK(st.stages[0].batched);
    CHECK(st.stages[0].name == "model");
    CHECK(st.stages[0].calls == log->sizes.size());
    CHECK(st.stages[0].padded == padding);
    CHECK(st.stages[0].batch_size.count() == log->sizes.size());  // before padding:
    CHECK(st.stages[0].batch_size.sum() == per * kClients);       // the requests
    CHECK(st.stages[0].batch_size.max() == largest);
  }
}

TEST_CASE("batching: ItemResult::failure fails only that item") {
  DeviceGroup group(1);
  auto stream = StreamBuilder<U64>(group)
                    .batch_stage(
                        "model",
                        [](std::span<U64> batch) {
                          std::vector<ItemResult<U64>> out;
                          for (U64 x : batch) {
                            if (x % 5 == 2) {
                              out.push_back(ItemResult<U64>::failure("odd one out"));
                            } else {
                              out.push_back(x * 2);
                            }
                          }
                          return out;
                        },
                        BatchConfig{.max_batch = 4, .max_delay = 500us})
                    .build();
  stream.start();
  const U64 n = 200;
  const auto tallies = run_clients(
      stream, 1, Drive{.requests = n, .window = 16}, [](int, U64 i) { return i; },
      [](int, U64 i, const Response<U64>& r) {
        if (i % 5 == 2) {
          return !r.ok() && r.kind() == ErrorKind::kStageFailed && r.error->stage_name == "model" &&
                 contains(r.error->message, "odd one out");
        }
        return r.ok() && *r.value == 2 * i;
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  check_clean(tallies);
  CHECK(tallies[0].errors_of(ErrorKind::kStageFailed) == n / 5);
  CHECK(tallies[0].ok == n - n / 5);
  CHECK(r.errors == n / 5);
  CHECK(stream.stats().errors_of(ErrorKind::kStageFailed) == n / 5);
}

TEST_CASE("batching: a batch that throws answers each of its requests with the error") {
  DeviceGroup group(1);
  auto thrown = std::make_shared<std::set<U64>>();  // the device thread's; read after wait()
  auto stream = StreamBuilder<U64>(group)
                    .batch_stage(
                        "model",
                        [thrown](std::span<U64> batch) {
                          const bool poisoned = std::any_of(batch.begin(), batch.end(), [](U64 x) {
                            return x == 13 || x == 101;
                          });
                          if (poisoned) {
                            thrown->insert(batch.begin(), batch.end());
                            throw std::runtime_error("batch blew up");
                          }
                          std::vector<U64> out(batch.begin(), batch.end());
                          for (U64& x : out) x *= 2;
                          return out;
                        },
                        BatchConfig{.max_batch = 8, .max_delay = 1ms})
                    .build();
  stream.start();
  const U64 n = 200;
  std::set<U64> failed;  // the client thread's; read after join
  bool causes_ok = true;
  const auto tallies = run_clients(
      stream, 1, Drive{.requests = n, .window = 16}, [](int, U64 i) { return i; },
      [&](int, U64 i, const Response<U64>& r) {
        if (r.ok()) return *r.value == 2 * i;
        failed.insert(i);
        try {
          std::rethrow_exception(r.error->cause);
        } catch (const std::runtime_error& e) {
          causes_ok = causes_ok && std::string(e.what()) == "batch blew up";
        } catch (...) {
          causes_ok = false;
        }
        return r.kind() == ErrorKind::kStageFailed && r.error->stage_name == "model";
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  check_clean(tallies);
  CHECK(failed.count(13) == 1);
  CHECK(failed.count(101) == 1);
  CHECK(failed == *thrown);  // exactly the requests of the batches that threw
  CHECK(causes_ok);
  CHECK(r.errors == failed.size());
}

TEST_CASE("batching: deadline-aware without max_delay flushes the last batch in time") {
  DeviceGroup group(1);
  auto stream = StreamBuilder<U64>(group)
                    .batch_stage(
                        "model",
                        [](std::span<U64> batch) {
                          spin_for(std::chrono::microseconds(50 + 10 * batch.size()));
                          return std::vector<U64>(batch.begin(), batch.end());
                        },
                        BatchConfig{.max_batch = 8})
                    .build();
  stream.start();
  // 30 requests 2 ms apart, each due 100 ms after its push: the last 6 have no followers, and
  // the batcher must not wait for any past their deadline.
  const U64 n = 30;
  const auto tallies = run_clients(
      stream, 1,
      Drive{.requests = n, .window = n, .deadline = [](U64) { return StreamClock::now() + 100ms; }},
      [](int, U64 i) {
        std::this_thread::sleep_for(2ms);
        return i;
      },
      [](int, U64 i, const Response<U64>& r) { return r.ok() && *r.value == i; });
  stream.close();
  CHECK(stream.wait().drained());
  check_clean(tallies);
  CHECK(tallies[0].ok == n);  // none expired, none refused
  CHECK(tallies[0].refused_total() == 0);
}

TEST_SUITE_END();
