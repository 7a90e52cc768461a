// Swapping a stage under load (Stream::swap): nothing failed or lost and every response
// tagged with its version; a failing warm-up leaves the old version serving; a rolling swap
// when device memory holds one version only; a swap refused with the out-of-memory report; a
// cancelled swap; and the errors a user can make.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;
using U64 = std::uint64_t;

namespace {

// Keeps a client pushing and popping on its own thread until stopped; counts what came
// back, by version, and whatever was wrong (an error, a value its version would not give).
class Load {
 public:
  template <class S>
  explicit Load(S& stream) {
    thread_ = std::thread([this, client = stream.client()]() mutable {
      auto take = [&](const Response<U64>& r) {
        ++answered;
        if (!r.ok()) {
          ++failed;
          return;
        }
        // Version v adds v to the request's value (the sequence number).
        if (*r.value != r.id.sequence + r.version) ++wrong;
        if (r.version == 1) ++v1;
        if (r.version >= 2) ++later;
      };
      while (!stop_.load()) {
        if (!client.push(client.sent())) {
          if (auto r = client.pop()) take(*r);
        }
        while (auto r = client.try_pop()) take(*r);
        if (client.outstanding() > 8) {
          if (auto r = client.pop()) take(*r);
        }
      }
      while (auto r = client.pop()) take(*r);
      sent = client.sent();
    });
  }
  void finish() {
    stop_ = true;
    thread_.join();
  }
  std::atomic<U64> answered{0}, failed{0}, wrong{0}, v1{0}, later{0};
  U64 sent = 0;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

auto adds(U64 v) {
  return [v](U64 x) { return x + v; };
}

}  // namespace

TEST_SUITE_BEGIN("stream_swap");

TEST_CASE("a swap under load: nothing failed or lost, each response tagged with its version") {
  DeviceGroup group(2, test::kSmall);
  auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2})
                    .stage("model", adds(1))
                    .memory(64 * 1024)
                    .build();
  stream.start();
  Load load(stream);
  std::this_thread::sleep_for(20ms);
  const SwapResult r = stream.swap("model", adds(2), std::vector<U64>{1, 2, 3});
  CHECK(r.swapped);
  CHECK_FALSE(r.rolling);  // 2 x 64 KiB fit in each 1 MiB arena
  CHECK(r.version == 2);
  CHECK(r.replicas_swapped == 2);
  CHECK(contains(r.message, "swapped in place"));
  std::this_thread::sleep_for(20ms);
  load.finish();
  stream.close();
  const StreamResult res = stream.wait();
  CHECK(res.drained());
  CHECK(load.failed.load() == 0);
  CHECK(load.wrong.load() == 0);
  CHECK(load.answered.load() == load.sent);  // nothing lost
  CHECK(load.v1.load() > 0);
  CHECK(load.later.load() > 0);
  const StreamStats st = stream.stats();
  REQUIRE(st.stages[0].versions.size() == 1);  // the old version has drained
  CHECK(st.stages[0].versions[0].version == 2);
  CHECK(st.stages[0].versions[0].replicas == 2);
}

TEST_CASE("a warm-up that fails leaves the old version serving, and says why") {
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<U64>(group).stage("model", adds(1)).build();
  stream.start();
  auto client = stream.client();
  auto broken = [](U64 x) -> U64 {
    if (x == 3) throw std::runtime_error("weights do not load");
    return x;
  };
  const SwapResult r = stream.swap("model", broken, std::vector<U64>{1, 2, 3});
  CHECK_FALSE(r.swapped);
  CHECK(r.replicas_swapped == 0);
  REQUIRE(r.error != nullptr);
  CHECK(contains(r.message, "warm-up failed"));
  CHECK(contains(r.message, "weights do not load"));
  REQUIRE(client.push(10));
  auto resp = client.pop();
  REQUIRE(resp.has_value());
  CHECK(*resp->value == 11);
  CHECK(resp->version == 1);
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("a rolling swap when a device holds one version only, under load") {
  DeviceGroup group(2, test::kSmall);  // 1 MiB arena per device
  auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2})
                    .stage("model", adds(1))
                    .memory(600 * 1024)
                    .build();
  stream.start();
  Load load(stream);
  std::this_thread::sleep_for(20ms);
  const SwapResult r = stream.swap("model", adds(2), std::vector<U64>{7}, SwapOptions{});
  CHECK(r.swapped);
  CHECK(r.rolling);
  CHECK(r.replicas_swapped == 2);
  CHECK(contains(r.message, "one replica at a time"));
  std::this_thread::sleep_for(20ms);
  load.finish();
  stream.close();
  CHECK(stream.wait().drained());
  CHECK(load.failed.load() == 0);
  CHECK(load.wrong.load() == 0);
  CHECK(load.answered.load() == load.sent);
  CHECK(load.later.load() > 0);
}

TEST_CASE("a version that does not fit even alone is refused with the out-of-memory report") {
  DeviceGroup group(1, test::kSmall);
  auto stream = StreamBuilder<U64>(group).stage("model", adds(1)).memory(128 * 1024).build();
  const SwapResult r =
      stream.swap("model", adds(2), std::vector<U64>{1}, SwapOptions{.memory = 4 << 20});
  CHECK_FALSE(r.swapped);
  REQUIRE(r.error != nullptr);
  CHECK(contains(r.message, "refused"));
  try {
    std::rethrow_exception(r.error);
  } catch (const OutOfMemoryError& e) {
    CHECK(contains(e.what(), "needs 4.0 MiB"));
    CHECK(contains(e.what(), "stream stage 'model' version 1"));  // the report's holder
    CHECK(e.requested() == 4u << 20);
  }
  // The old version still serves.
  stream.start();
  auto client = stream.client();
  REQUIRE(client.push(1));
  CHECK(*client.pop()->value == 2);
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("a swap can be cancelled: the replicas not yet swapped keep the old version") {
  DeviceGroup group(2, test::kSmall);
  auto hold = std::make_shared<std::atomic<bool>>(false);
  auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2})
                    .stage("model",
                           [hold](U64 x) {
                             while (x == 0 && !hold->load()) std::this_thread::sleep_for(100us);
                             return x + 1;
                           })
                    .memory(600 * 1024)
                    .build();
  // Stopped before it starts: nothing changes.
  std::stop_source before;
  before.request_stop();
  SwapResult r = stream.swap("model", adds(2), std::vector<U64>{}, {}, before.get_token());
  CHECK(r.cancelled);
  CHECK(r.replicas_swapped == 0);
  // Stopped while a replica drains: request 0 holds a replica, the rolling swap waits for it.
  stream.start();
  auto client = stream.client();
  REQUIRE(client.push(0));
  std::this_thread::sleep_for(5ms);
  std::stop_source during;
  std::thread canceller([&] {
    std::this_thread::sleep_for(20ms);
    during.request_stop();
  });
  r = stream.swap("model", adds(2), std::vector<U64>{}, {}, during.get_token());
  canceller.join();
  CHECK(r.cancelled);
  CHECK(r.rolling);
  CHECK(r.replicas_swapped <= 1);
  CHECK_FALSE(r.swapped);
  hold->store(true);
  auto first = client.pop();
  REQUIRE(first.has_value());
  CHECK(first->ok());
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("a batch stage is swapped with a batch callable") {
  DeviceGroup group(1, test::kSmall);
  auto batch = [](U64 add) {
    return [add](std::span<U64> xs) {
      std::vector<U64> out;
      for (U64 x : xs) out.push_back(x + add);
      return out;
    };
  };
  auto stream = StreamBuilder<U64>(group).batch_stage("model", batch(1)).build();
  const SwapResult r = stream.swap("model", batch(5), std::vector<U64>{1, 2});
  CHECK(r.swapped);
  stream.start();
  auto client = stream.client();
  REQUIRE(client.push(1));
  auto resp = client.pop();
  REQUIRE(resp.has_value());
  CHECK(*resp->value == 6);
  CHECK(resp->version == r.version);
  stream.close();
  CHECK(stream.wait().drained());
}

TEST_CASE("swap errors name the problem") {
  DeviceGroup group(2, test::kSmall);
  StreamGraph<U64> g(group);
  auto a = g.input().stage("a", adds(1), 0);
  auto b = a.stage("b", adds(1), 1);
  auto c = a.stage("c", adds(1), 1);
  auto j = g.join(
      "j", [](U64 x, U64 y) { return x + y; }, 1, b, c);
  auto stream = std::move(g).build(j);
  CHECK(contains(error_of([&] { (void)stream.swap("nope", adds(2), std::vector<U64>{}); }),
                 "no stage named 'nope' (its stages: a, b, c, j)"));
  CHECK(contains(error_of([&] {
                   (void)stream.swap(
                       "j", [](U64 x) { return x; }, std::vector<U64>{});
                 }),
                 "'j' is a join, route or merge"));
  CHECK(contains(error_of([&] {
                   (void)stream.swap(
                       "a", [](int x) { return x; }, std::vector<int>{});
                 }),
                 "takes another type than the warm-up inputs"));
  CHECK(contains(error_of([&] {
                   (void)stream.swap(
                       "a", [](U64 x) { return std::to_string(x); }, std::vector<U64>{});
                 }),
                 "is not a stage with this output type"));
}

TEST_SUITE_END();
