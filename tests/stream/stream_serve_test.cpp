// Serving with a Stream (bspflow/stream/stream_client.hpp, stream_serving.hpp, the serve
// path of stream.hpp): replicas answering exactly once and in each client's order (2
// devices, and 2-stage chains on 4), a replica whose stage throws while the other serves;
// batch stages (every request answered once with its own value, batch sizes within bounds and
// allowed sizes, the first request's wait bounded by max_delay, padding never seen, per-item
// failures, a batch that throws, deadline-aware flushing); deadlines, cancels and admission
// (reject, shed, a burst) answered or refused with the right kind; per-client responses with 4
// client threads; stats equal to the responses seen and their writers;
// drain on close and on cancel with batches in flight, 20 times each; stall detection; and the
// errors a user can make.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <bspflow/devices/device.hpp>
#include <bspflow/devices/topology.hpp>
#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>
#include <bspflow/stream/stream_config.hpp>
#include <bspflow/stream/stream_serving.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;

namespace {

using U64 = std::uint64_t;
using test::eventually;
using test::Gate;
using Client = StreamClient<U64, U64>;

// Client k's i-th value is k * kSpan + i.
constexpr U64 kSpan = 1'000'000'000;

// How long a client waits for a response before the test counts it as lost (rather than
// hanging): 10 s, longer under ThreadSanitizer (BSPFLOW_TEST_SCALE).
std::chrono::nanoseconds patience() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(10.0 / test::scale()));
}

// Slack for timing bounds on a loaded 2-core machine (a thread may wait a scheduler tick or
// several): 20 ms, more under ThreadSanitizer.
std::chrono::nanoseconds slack() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(0.02 / test::scale()));
}

void spin_for(std::chrono::nanoseconds d) {
  const auto until = StreamClock::now() + d;
  while (StreamClock::now() < until) {
  }
}

std::size_t index_of(Refusal r) {
  return static_cast<std::size_t>(r);
}
std::size_t index_of(ErrorKind k) {
  return static_cast<std::size_t>(k);
}

// What one client saw of its own requests.
struct Tally {
  std::uint32_t client = 0;                // StreamClient::id()
  std::uint64_t accepted = 0;              // pushes accepted
  std::array<std::uint64_t, 7> refused{};  // pushes refused, by Refusal
  std::uint64_t answered = 0;              // responses popped
  std::uint64_t ok = 0;                    // of those, with a value
  std::array<std::uint64_t, 4> errors{};   // of those, errors by ErrorKind
  std::uint64_t disorder = 0;              // a response before an earlier accepted request's
  std::uint64_t unknown = 0;               // a response to no outstanding request of this client
  std::uint64_t wrong = 0;                 // a response the test's check refused
  std::uint64_t missing = 0;               // accepted, never answered within patience()
  std::uint64_t refused_total() const {
    return std::accumulate(refused.begin(), refused.end(), std::uint64_t{0});
  }
  std::uint64_t errors_total() const {
    return std::accumulate(errors.begin(), errors.end(), std::uint64_t{0});
  }
  std::uint64_t errors_of(ErrorKind k) const { return errors[index_of(k)]; }
  std::uint64_t refused_of(Refusal r) const { return refused[index_of(r)]; }
  Tally& operator+=(const Tally& o) {
    accepted += o.accepted;
    answered += o.answered;
    ok += o.ok;
    for (std::size_t i = 0; i < refused.size(); ++i) refused[i] += o.refused[i];
    for (std::size_t i = 0; i < errors.size(); ++i) errors[i] += o.errors[i];
    disorder += o.disorder;
    unknown += o.unknown;
    wrong += o.wrong;
    missing += o.missing;
    return *this;
  }
};

// One client's bookkeeping: its unanswered requests (sequence -> index of the push), in push
// order.
class Ledger {
 public:
  Ledger(std::uint32_t client, bool ordered) : client_(client), ordered_(ordered) {}

  void pushed(const Submission& s, std::uint64_t index, Tally& t) {
    if (!s.accepted()) {
      ++t.refused[index_of(s.refusal)];
      return;
    }
    ++t.accepted;
    pending_[s.id.sequence] = index;
    order_.push_back(s.id.sequence);
  }

  // The index of the push `r` answers; nullopt (counted as unknown) if it answers none of
  // this client's outstanding requests (a second answer, or another client's).
  template <class Out>
  std::optional<std::uint64_t> answered(const Response<Out>& r, Tally& t) {
    ++t.answered;
    if (r.ok()) {
      ++t.ok;
    } else {
      ++t.errors[index_of(r.kind())];
    }
    const auto it = pending_.find(r.id.sequence);
    if (r.id.client != client_ || it == pending_.end()) {
      ++t.unknown;
      return std::nullopt;
    }
    while (!order_.empty() && pending_.count(order_.front()) == 0) order_.pop_front();
    if (ordered_ && order_.front() != r.id.sequence) ++t.disorder;
    const std::uint64_t index = it->second;
    pending_.erase(it);
    return index;
  }

  std::size_t outstanding() const { return pending_.size(); }

 private:
  std::uint32_t client_;
  bool ordered_;
  std::unordered_map<std::uint64_t, std::uint64_t> pending_;
  std::deque<std::uint64_t> order_;
};

struct Drive {
  std::uint64_t requests = 0;    // pushes offered
  bool ordered = true;           // responses must come in push order
  std::size_t window = 64;       // unanswered requests at most before the client pops
  bool stop_on_refusal = false;  // stop pushing at the first refusal (the stream closed)
  std::function<Deadline(std::uint64_t)> deadline{};  // none: kNoDeadline
  std::atomic<std::uint64_t>* accepted = nullptr;     // counts accepted pushes for others
};

// One client thread's work: pushes make(i) for i < d.requests, popping its oldest responses
// while it has d.window unanswered, then pops the rest. Each response is checked against its
// push: this client's, answering an outstanding request once, in push order if d.ordered,
// and check(i, response).
template <class In, class Out, class Make, class Check>
Tally drive(StreamClient<In, Out>& c, const Drive& d, Make make, Check check) {
  Tally t;
  t.client = c.id();
  Ledger ledger(c.id(), d.ordered);
  const auto take_one = [&]() -> bool {
    auto r = c.pop_until(StreamClock::now() + patience());
    if (!r) return false;
    if (auto i = ledger.answered(*r, t)) {
      if (!check(*i, *r)) ++t.wrong;
    }
    return true;
  };
  for (std::uint64_t i = 0; i < d.requests; ++i) {
    while (ledger.outstanding() >= d.window && take_one()) {
    }
    In value = make(i);
    const Submission s = c.push(std::move(value), d.deadline ? d.deadline(i) : kNoDeadline);
    ledger.pushed(s, i, t);
    if (s.accepted() && d.accepted != nullptr) d.accepted->fetch_add(1);
    if (!s.accepted() && d.stop_on_refusal) break;
  }
  while (ledger.outstanding() > 0 && take_one()) {
  }
  t.missing = ledger.outstanding();
  return t;
}

// Every accepted request of every client answered once, in push order, as the check wanted.
void check_clean(const std::vector<Tally>& tallies) {
  for (const Tally& t : tallies) {
    CAPTURE(t.client);
    CHECK(t.answered == t.accepted);
    CHECK(t.missing == 0);
    CHECK(t.unknown == 0);
    CHECK(t.disorder == 0);
    CHECK(t.wrong == 0);
  }
}

// A run of `clients` client threads on `stream`, each driving d with make(k, i) and
// check(k, i, response); returns their tallies.
template <class In, class Out, class Make, class Check>
std::vector<Tally> run_clients(Stream<In, Out>& stream, int clients, const Drive& d, Make make,
                               Check check) {
  std::vector<StreamClient<In, Out>> handles;
  handles.reserve(static_cast<std::size_t>(clients));
  for (int k = 0; k < clients; ++k) handles.push_back(stream.client());
  std::vector<Tally> tallies(static_cast<std::size_t>(clients));
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      const auto uk = static_cast<std::size_t>(k);
      tallies[uk] = drive(
          handles[uk], d, [&](std::uint64_t i) { return make(k, i); },
          [&](std::uint64_t i, const Response<Out>& r) { return check(k, i, r); });
    });
  }
  for (auto& t : threads) t.join();
  return tallies;
}

Tally sum(const std::vector<Tally>& tallies) {
  Tally s;
  for (const Tally& t : tallies) s += t;
  return s;
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

const auto plus1 = [](U64 x) { return x + 1; };

}  // namespace

TEST_SUITE_BEGIN("stream_serve");

TEST_CASE("replicas: exactly once and in each client's order, 3 clients (2 and 4 devices)") {
  // 10^5 requests here, seconds at most on 2 cores; the soak suite sends 10^6.
  constexpr int kClients = 3;
  const U64 per = test::scaled(100'000, 3'000) / kClients;
  for (const std::uint32_t devices : {2u, 4u}) {
    CAPTURE(devices);
    DeviceGroup group(devices);  // 4: two 2-stage replicas, 4 devices on 2 cores
    auto builder = StreamBuilder<U64>(group, StreamConfig{.replicas = 2});
    auto stream = devices == 2
                      ? std::move(builder).stage("a", plus1).build()
                      : std::move(builder).stage("a", plus1, 0).stage("b", plus1, 1).build();
    const U64 stages = devices == 2 ? 1 : 2;
    CHECK(stream.stages() == stages);
    stream.start();
    const auto tallies = run_clients(
        stream, kClients, Drive{.requests = per, .window = 256},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [&](int k, U64 i, const Response<U64>& r) {
          return r.ok() && *r.value == U64(k) * kSpan + i + stages;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    CHECK(r.accepted == per * kClients);
    CHECK(r.answered == per * kClients);
    CHECK(r.unanswered == 0);
    CHECK(r.errors == 0);
    CHECK(r.refused == 0);
    check_clean(tallies);
    for (const Tally& t : tallies) {
      CHECK(t.accepted == per);
      CHECK(t.ok == per);
    }
    const StreamStats st = stream.stats();
    REQUIRE(st.replicas.size() == 2);
    CHECK(st.replicas[0].taken + st.replicas[1].taken == per * kClients);
    CHECK(st.replicas[0].taken > 0);  // both serve
    CHECK(st.replicas[1].taken > 0);
    CHECK(st.replicas[0].answered + st.replicas[1].answered == per * kClients);
  }
}

TEST_CASE("replicas: a replica whose stage throws answers with errors while the other serves") {
  DeviceGroup group(2);
  // Each replica has its own copy of the stage; the first copy called throws on every request.
  auto claims = std::make_shared<std::atomic<int>>(0);
  auto flaky = [claims, me = -1](U64 x) mutable -> U64 {
    if (me < 0) me = claims->fetch_add(1);
    if (me == 0) throw std::runtime_error("replica broken");
    return x + 1;
  };
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.replicas = 2}).stage("flaky", flaky).build();
  stream.start();
  constexpr int kClients = 3;
  const U64 per = test::scaled(3'000, 300);
  std::atomic<U64> bad_errors{0};
  const auto tallies = run_clients(
      stream, kClients, Drive{.requests = per, .window = 32},
      [](int k, U64 i) { return U64(k) * kSpan + i; },
      [&](int k, U64 i, const Response<U64>& r) {
        if (r.ok()) return *r.value == U64(k) * kSpan + i + 1;
        const bool right = r.kind() == ErrorKind::kStageFailed && r.error->stage_name == "flaky" &&
                           contains(r.error->message, "replica broken");
        if (!right) ++bad_errors;
        return right;
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == per * kClients);
  check_clean(tallies);
  const Tally all = sum(tallies);
  CHECK(all.accepted == per * kClients);
  CHECK(all.ok + all.errors_of(ErrorKind::kStageFailed) == all.answered);
  CHECK(all.ok > 0);                                  // the good replica served
  CHECK(all.errors_of(ErrorKind::kStageFailed) > 0);  // and the broken one was used
  CHECK(bad_errors.load() == 0);
  CHECK(r.errors == all.errors_of(ErrorKind::kStageFailed));
  CHECK(claims->load() == 2);  // two copies ran
}

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

TEST_CASE("deadlines: an expired request is answered kDeadlineExceeded without running") {
  DeviceGroup group(1);
  std::atomic<int> calls{0};
  // predict off: the expiry must be the stage's, not admission's.
  auto stream = StreamBuilder<U64>(group, StreamConfig{.admission = {.predict = false}})
                    .stage("slow",
                           [&calls](U64 x) {
                             ++calls;
                             std::this_thread::sleep_for(x == 0 ? 30ms : 5ms);
                             return x + 1;
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  const auto t0 = StreamClock::now();
  // A deadline already past is refused at push; nothing is queued.
  const Submission past = c.push(99, t0 - 1ms);
  CHECK_FALSE(past.accepted());
  CHECK(past.refusal == Refusal::kDeadlinePassed);
  CHECK(c.outstanding() == 0);
  REQUIRE(c.push(0).accepted());  // no deadline: holds the stage 30 ms
  // Once the stage runs it: the queue serves the earliest deadline first, and a request with
  // no deadline after the others.
  while (calls.load() == 0) std::this_thread::yield();
  const auto t1 = StreamClock::now();
  // Due 10 ms after t1: the stage takes them 30 ms after t1 at the earliest.
  std::vector<Submission> near;
  for (U64 i = 1; i <= 5; ++i) near.push_back(c.push(i, t1 + 10ms));
  REQUIRE(c.push(6).accepted());  // no deadline: runs
  std::uint64_t near_accepted = 0, near_refused = 0;
  for (const Submission& s : near) {
    if (s.accepted()) {
      ++near_accepted;
    } else {
      ++near_refused;  // only if this thread was held 10 ms between t0 and the push
      CHECK(s.refusal == Refusal::kDeadlinePassed);
    }
  }
  CHECK(near_accepted >= 1);
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 2 + near_accepted);
  CHECK(got.front().ok());
  CHECK(*got.front().value == 1);
  CHECK(got.back().ok());
  CHECK(*got.back().value == 7);
  for (std::size_t i = 1; i + 1 < got.size(); ++i) {
    CAPTURE(i);
    REQUIRE_FALSE(got[i].ok());
    CHECK(got[i].kind() == ErrorKind::kDeadlineExceeded);
    CHECK(got[i].error->stage_name == "slow");
  }
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(calls.load() == 2);  // the expired ones never ran
  const StreamStats st = stream.stats();
  CHECK(st.errors_of(ErrorKind::kDeadlineExceeded) == near_accepted);
  CHECK(st.refused(Refusal::kDeadlinePassed) == 1 + near_refused);
  CHECK(r.refused == 1 + near_refused);
}

TEST_CASE("cancel: a queued request is answered kCancelled and never runs") {
  DeviceGroup group(2);
  Gate gate;
  auto ran_a = std::make_shared<std::vector<U64>>();  // device 0's; read after wait()
  auto ran_b = std::make_shared<std::vector<U64>>();  // device 1's
  auto stream = StreamBuilder<U64>(group)
                    .stage("a",
                           [&gate, ran_a](U64 x) {
                             ran_a->push_back(x);
                             if (x == 0) gate.hold();
                             return x;
                           })
                    .stage("b",
                           [ran_b](U64 x) {
                             ran_b->push_back(x);
                             return x + 100;
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  const Submission first = c.push(0);
  REQUIRE(first.accepted());
  REQUIRE(gate.wait_entered());  // request 0 is held in stage a
  std::vector<Submission> queued;
  for (U64 i = 1; i <= 6; ++i) {
    queued.push_back(c.push(i));
    REQUIRE(queued.back().accepted());
  }
  CHECK(c.cancel(queued[1].id));                   // 2
  CHECK(c.cancel(queued[3].id));                   // 4
  CHECK(c.cancel(queued[4].id));                   // 5
  CHECK(c.cancel(first.id));                       // running in a: dropped at the boundary to b
  CHECK_FALSE(c.cancel(RequestId{c.id(), 1000}));  // never sent
  gate.open = true;
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 7);
  const std::set<U64> cancelled{0, 2, 4, 5};
  for (U64 i = 0; i < 7; ++i) {
    CAPTURE(i);
    CHECK(got[i].id.sequence == (i == 0 ? first.id.sequence : queued[i - 1].id.sequence));
    if (cancelled.count(i) != 0) {
      REQUIRE_FALSE(got[i].ok());
      CHECK(got[i].kind() == ErrorKind::kCancelled);
    } else {
      REQUIRE(got[i].ok());
      CHECK(*got[i].value == i + 100);
    }
  }
  CHECK_FALSE(c.cancel(queued[0].id));  // answered already
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == 7);
  CHECK(*ran_a == std::vector<U64>{0, 1, 3, 6});  // the queued cancelled ones never ran
  CHECK(*ran_b == std::vector<U64>{1, 3, 6});     // nor did the held one after its cancel
  CHECK(stream.stats().errors_of(ErrorKind::kCancelled) == 4);
}

TEST_CASE(
    "admission kReject: pushes beyond queue_capacity are refused, every accepted one answered") {
  DeviceGroup group(1);
  Gate gate;
  auto stream = StreamBuilder<std::string>(
                    group, StreamConfig{.hop_capacity = 1,
                                        .admission = {.policy = AdmissionPolicy::kReject,
                                                      .queue_capacity = 4,
                                                      .predict = false}})
                    .stage("echo",
                           [&gate](std::string s) {
                             if (s == "hold") gate.hold();
                             return s + "!";
                           })
                    .build();
  stream.start();
  auto c = stream.client();
  REQUIRE(c.push("hold").accepted());
  REQUIRE(gate.wait_entered());
  std::vector<std::string> accepted;
  std::uint64_t refused = 0;
  bool untouched = true, reasons = true;
  for (int i = 0; i < 30; ++i) {
    std::string s = "req-" + std::to_string(i);
    const Submission sub = c.try_push(std::move(s));
    if (sub.accepted()) {
      accepted.push_back("req-" + std::to_string(i));
    } else {
      ++refused;
      reasons = reasons && sub.refusal == Refusal::kQueueFull;
      untouched = untouched && s == "req-" + std::to_string(i);  // NOLINT: left untouched
    }
  }
  // push() refuses at once too under kReject (it blocks only under kBlock).
  const Submission blocking = c.push("one more");
  CHECK(blocking.refusal == Refusal::kQueueFull);
  CHECK(accepted.size() >= 4);  // the queue's bound, give or take what a replica has taken
  CHECK(accepted.size() <= 4 + 8);
  CHECK(refused == 30 - accepted.size());
  CHECK(reasons);
  CHECK(untouched);
  gate.open = true;
  std::vector<std::string> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) {
    CHECK(r->ok());
    if (r->ok()) got.push_back(*r->value);
  }
  REQUIRE(got.size() == 1 + accepted.size());  // nothing lost
  CHECK(got[0] == "hold!");
  for (std::size_t i = 0; i < accepted.size(); ++i) CHECK(got[i + 1] == accepted[i] + "!");
  // With room again, pushes are accepted.
  REQUIRE(c.push("after").accepted());
  auto last = c.pop_until(StreamClock::now() + patience());
  REQUIRE(last.has_value());
  CHECK(*last->value == "after!");
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.accepted == accepted.size() + 2);
  CHECK(r.answered == r.accepted);
  CHECK(r.refused == refused + 1);
  CHECK(stream.stats().refused(Refusal::kQueueFull) == refused + 1);
}

TEST_CASE("admission kShed: the request with the least slack is shed") {
  DeviceGroup group(1);
  Gate gate;
  auto stream =
      StreamBuilder<U64>(group, StreamConfig{.hop_capacity = 1,
                                             .admission = {.policy = AdmissionPolicy::kShed,
                                                           .queue_capacity = 4,
                                                           .predict = false}})
          .stage("model",
                 [&gate](U64 x) {
                   if (x == 0) gate.hold();
                   return x;
                 })
          .build();
  stream.start();
  auto c = stream.client();
  REQUIRE(c.push(0).accepted());  // no deadline: holds the stage
  REQUIRE(gate.wait_entered());
  // Deadlines far off and later with each push: each newcomer has more slack than the queued,
  // so a queued one (the earliest due) is shed and the newcomer admitted.
  const auto base = StreamClock::now() + 60s;
  constexpr U64 kPushed = 20;
  std::vector<Submission> subs;
  for (U64 i = 1; i <= kPushed; ++i) {
    subs.push_back(c.push(i, base + std::chrono::seconds(i)));
    CHECK(subs.back().accepted());
  }
  // Due before every queued one: the newcomer has the least slack and is refused.
  const Submission urgent = c.push(999, base - 30s);
  CHECK(urgent.refusal == Refusal::kShed);
  gate.open = true;
  std::vector<Response<U64>> got;
  while (auto r = c.pop_until(StreamClock::now() + patience())) got.push_back(std::move(*r));
  REQUIRE(got.size() == 1 + kPushed);  // every accepted one answered
  CHECK(got[0].ok());
  std::uint64_t rejected = 0;
  bool kinds = true;
  for (U64 i = 1; i <= kPushed; ++i) {
    if (got[i].ok()) {
      kinds = kinds && *got[i].value == i;
    } else {
      ++rejected;
      kinds = kinds && got[i].kind() == ErrorKind::kRejected;
    }
  }
  CHECK(kinds);
  CHECK(rejected >= kPushed - 4 - 8);  // all but the queue's 4 (give or take a replica's take)
  for (U64 i = kPushed - 3; i <= kPushed; ++i) {
    CAPTURE(i);
    CHECK(got[i].ok());  // the 4 with the most slack were never shed
  }
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  CHECK(r.answered == 1 + kPushed);
  const StreamStats st = stream.stats();
  CHECK(st.errors_of(ErrorKind::kRejected) == rejected);
  CHECK(st.refused(Refusal::kShed) == 1);
}

TEST_CASE("admission under a burst: every push is accepted and answered, or refused") {
  for (const AdmissionPolicy policy : {AdmissionPolicy::kReject, AdmissionPolicy::kShed}) {
    const bool shed = policy == AdmissionPolicy::kShed;
    CAPTURE(shed);
    DeviceGroup group(1);
    auto stream =
        StreamBuilder<U64>(
            group,
            StreamConfig{.admission = {.policy = policy, .queue_capacity = 8, .predict = false}})
            .stage("model",
                   [](U64 x) {
                     spin_for(20us);
                     return x + 1;
                   })
            .build();
    stream.start();
    constexpr int kClients = 3;
    const U64 per = test::scaled(1'500, 150);
    const auto tallies = run_clients(
        stream, kClients,
        Drive{.requests = per,
              .window = 32,
              .deadline =
                  [](U64 i) {
                    return StreamClock::now() + 1s +
                           std::chrono::milliseconds(10 * static_cast<std::int64_t>(i % 7));
                  }},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [&](int k, U64 i, const Response<U64>& r) {
          if (r.ok()) return *r.value == U64(k) * kSpan + i + 1;
          return shed && r.kind() == ErrorKind::kRejected;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    check_clean(tallies);
    const Tally all = sum(tallies);
    CHECK(all.accepted + all.refused_total() == per * kClients);  // accepted or refused
    const Refusal reason = shed ? Refusal::kShed : Refusal::kQueueFull;
    CHECK(all.refused_of(reason) == all.refused_total());  // and for the policy's reason
    CHECK(all.refused_total() + all.errors_of(ErrorKind::kRejected) > 0);  // overloaded
    CHECK(r.accepted == all.accepted);
    CHECK(r.answered == all.accepted);
    CHECK(r.refused == all.refused_total());
    const StreamStats st = stream.stats();
    CHECK(st.answered == all.answered);
    CHECK(st.refused() == all.refused_total());
    CHECK(st.refused(reason) == all.refused_total());
    CHECK(st.errors_of(ErrorKind::kRejected) == all.errors_of(ErrorKind::kRejected));
  }
}

TEST_CASE("per-client responses: 4 client threads, each its own, exactly once") {
  DeviceGroup group(2);
  for (const Ordering ordering : {Ordering::kPerClient, Ordering::kNone}) {
    const bool ordered = ordering == Ordering::kPerClient;
    CAPTURE(ordered);
    auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2, .ordering = ordering})
                      .stage("model", [](U64 x) { return x * 3 + 1; })
                      .build();
    stream.start();
    constexpr int kClients = 4;
    const U64 per = test::scaled(5'000, 500);
    // kNone: any order (unknown == 0 still says exactly once).
    const auto tallies = run_clients(
        stream, kClients, Drive{.requests = per, .ordered = ordered, .window = 64},
        [](int k, U64 i) { return U64(k) * kSpan + i; },
        [](int k, U64 i, const Response<U64>& r) {
          return r.ok() && *r.value == (U64(k) * kSpan + i) * 3 + 1;
        });
    stream.close();
    const StreamResult r = stream.wait();
    CHECK(r.drained());
    check_clean(tallies);
    U64 accepted = 0;
    for (const Tally& t : tallies) {
      // The only refusal allowed: kClientFull, when a request held up on one replica (its
      // device descheduled on a loaded machine) keeps response_capacity sequence numbers
      // unanswered while the other replica answers the rest.
      CHECK(t.refused_total() == t.refused_of(Refusal::kClientFull));
      CHECK(t.ok == t.accepted);
      CHECK(t.accepted + t.refused_total() == per);
      accepted += t.accepted;
    }
    CHECK(r.answered == accepted);
  }
}

TEST_CASE("stats equal the responses seen; OpenMetrics and .hgrm writers") {
  DeviceGroup group(2);
  auto stream = StreamBuilder<U64>(group)
                    .stage("check",
                           [](U64 x) {
                             if (x % 10 == 3) throw std::invalid_argument("malformed");
                             return x;
                           })
                    .stage("model", plus1)
                    .build();
  stream.start();
  auto c = stream.client();
  constexpr U64 kPast = 3;
  for (U64 i = 0; i < kPast; ++i) {
    CHECK(c.push(i, StreamClock::now() - 1s).refusal == Refusal::kDeadlinePassed);
  }
  const U64 n = 1000;
  bool latencies = true;
  const auto tallies = run_clients(
      stream, 1, Drive{.requests = n, .window = 64}, [](int, U64 i) { return i; },
      [&](int, U64 i, const Response<U64>& r) {
        latencies = latencies && r.latency > std::chrono::nanoseconds(0);
        if (i % 10 == 3) return !r.ok() && r.kind() == ErrorKind::kStageFailed;
        return r.ok() && *r.value == i + 1;
      });
  stream.close();
  const StreamResult r = stream.wait();
  CHECK(r.drained());
  check_clean(tallies);
  const Tally& t = tallies[0];
  CHECK(latencies);
  const StreamStats st = stream.stats();
  CHECK(st.accepted == n);
  CHECK(st.answered == t.answered);
  CHECK(st.ok == t.ok);
  CHECK(st.ok + std::accumulate(st.errors.begin(), st.errors.end(), U64{0}) == st.answered);
  for (const ErrorKind k : {ErrorKind::kStageFailed, ErrorKind::kDeadlineExceeded,
                            ErrorKind::kRejected, ErrorKind::kCancelled}) {
    CAPTURE(to_string(k));
    CHECK(st.errors_of(k) == t.errors_of(k));
  }
  CHECK(st.errors_of(ErrorKind::kStageFailed) == n / 10);
  CHECK(st.latency_ns.count() == st.answered);
  CHECK(st.refused(Refusal::kDeadlinePassed) == kPast);
  CHECK(st.refused() == kPast);
  CHECK(st.queued == 0);
  REQUIRE(st.stages.size() == 2);
  CHECK(st.stages[0].name == "check");
  CHECK(st.stages[1].name == "model");
  CHECK_FALSE(st.stages[0].batched);
  CHECK(st.stages[0].calls == n);
  CHECK(st.stages[1].calls == n - n / 10);  // failed requests skip later stages
  CHECK(st.stages[0].service_ns.count() == st.stages[0].calls);
  CHECK(st.stages[1].service_ns.count() == st.stages[1].calls);
  CHECK(st.stages[0].stalls == 0);
  REQUIRE(st.replicas.size() == 1);
  CHECK(st.replicas[0].taken == n);
  CHECK(st.replicas[0].answered == n);
  CHECK_FALSE(st.replicas[0].stalled);
  CHECK_FALSE(st.replicas[0].failed);
  CHECK(r.accepted == n);
  CHECK(r.answered == n);
  CHECK(r.errors == n / 10);
  CHECK(r.refused == kPast);

  std::ostringstream metrics;
  st.write_openmetrics(metrics);
  const std::string text = metrics.str();
  CHECK(contains(text, "# TYPE bspflow_stream_"));
  CHECK(contains(text, "_bucket{"));  // the histograms
  CHECK_FALSE(contains(text, "# EOF"));
  std::ostringstream labelled;
  st.write_openmetrics(labelled, "svc", MetricLabels{{"model", "m1"}});
  CHECK(contains(labelled.str(), "# TYPE svc_"));
  CHECK(contains(labelled.str(), "model=\"m1\""));
  CHECK_FALSE(contains(labelled.str(), "bspflow_stream_"));
  std::ostringstream bad;
  CHECK_THROWS_AS(st.write_openmetrics(bad, "9 bad"), Error);
  std::ostringstream hgrm;
  st.write_latency_hgrm(hgrm);
  CHECK(contains(hgrm.str(), "Percentile"));
}

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

TEST_CASE("stall detection: a held call is reported; the other replica keeps answering") {
  DeviceGroup group(2);
  Gate gate;
  constexpr U64 kHold = 1'000'000;
  auto stream = StreamBuilder<U64>(group, StreamConfig{.replicas = 2, .call_stall_limit = 50ms})
                    .stage("model",
                           [&gate](U64 x) {
                             if (x == kHold) gate.hold();
                             return x + 1;
                           })
                    .build();
  stream.start();
  auto a = stream.client();
  auto b = stream.client();
  const auto held_at = StreamClock::now();
  REQUIRE(a.push(kHold).accepted());
  REQUIRE(gate.wait_entered());
  // The replica holding it is marked stalled once the call outlives the limit.
  std::optional<std::size_t> stalled;
  CHECK(eventually([&] {
    const StreamStats st = stream.stats();
    for (std::size_t i = 0; i < st.replicas.size(); ++i) {
      if (st.replicas[i].stalled) stalled = i;
    }
    return stalled.has_value();
  }));
  REQUIRE(stalled.has_value());
  const U64 taken_when_stalled = stream.stats().replicas.at(*stalled).taken;
  CHECK(taken_when_stalled == 1);
  // Meanwhile another client is answered by the other replica, closed loop.
  U64 answered = 0;
  for (U64 i = 0; i < 50; ++i) {
    if (!b.push(i).accepted()) break;
    auto r = b.pop_until(StreamClock::now() + 2s);
    if (!r || !r->ok() || *r->value != i + 1) break;
    ++answered;
  }
  CHECK(answered == 50);
  CHECK(stream.stats().replicas.at(*stalled).taken == taken_when_stalled);  // nothing new for it
  // Hold ~300 ms in all, then let it go: it is answered and the replica moves again.
  std::this_thread::sleep_until(held_at + 300ms);
  gate.open = true;
  auto held = a.pop_until(StreamClock::now() + patience());
  REQUIRE(held.has_value());
  CHECK(held->ok());
  CHECK(eventually([&] { return !stream.stats().replicas.at(*stalled).stalled; }));
  stream.close();
  CHECK(stream.wait().drained());
  const StreamStats st = stream.stats();
  REQUIRE(st.stages.size() == 1);
  CHECK(st.stages[0].stalls >= 1);
  CHECK(st.answered == 51);
}

TEST_CASE("serving errors name the problem") {
  DeviceGroup group(2);
  auto id = [](U64 x) { return x; };
  auto twice = [](std::span<U64> b) { return std::vector<U64>(b.begin(), b.end()); };
  // A batch stage must be the first stage on its device (it forms batches from its input).
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group)
                      .stage("pre", id, 0)
                      .batch_stage("model", twice, BatchConfig{}, 0)
                      .build(),
                  Error);
  CHECK_NOTHROW((void)StreamBuilder<U64>(group)
                    .stage("pre", id, 0)
                    .batch_stage("model", twice, BatchConfig{}, 1)
                    .build());
  // Replicas must divide the devices.
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<U64>(group, StreamConfig{.replicas = 3}).stage("a", id).build();
      }),
      "replicas"));
  CHECK(contains(
      error_of([&] {
        (void)StreamBuilder<U64>(group, StreamConfig{.replicas = 0}).stage("a", id).build();
      }),
      "replicas"));
  // A stage's device counts within its replica: 2 replicas of 2 devices have device 0 only.
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group, StreamConfig{.replicas = 2})
                      .stage("a", id, 0)
                      .stage("b", id, 1)
                      .build(),
                  Error);
  // Batch configs.
  CHECK(contains(error_of([] { BatchConfig{.max_batch = 0}.validate(); }), "max_batch"));
  CHECK_THROWS_AS((void)StreamBuilder<U64>(group)
                      .batch_stage("model", twice, BatchConfig{.max_batch = 0})
                      .build(),
                  Error);
  CHECK(contains(error_of([] {
                   BatchConfig{.max_batch = 4, .allowed_sizes = {4, 2}}.validate();
                 }),
                 "allowed_sizes"));
  CHECK_THROWS_AS((BatchConfig{.max_batch = 8, .allowed_sizes = {1, 2, 4}}.validate()), Error);
  CHECK_NOTHROW((BatchConfig{.max_batch = 8, .allowed_sizes = {1, 2, 4, 8}}.validate()));
  const BatchConfig sizes{.max_batch = 8, .allowed_sizes = {1, 2, 4, 8}};
  CHECK(sizes.padded(1) == 1);
  CHECK(sizes.padded(3) == 4);
  CHECK(sizes.padded(5) == 8);
  CHECK(BatchConfig{}.padded(3) == 3);
  auto two = StreamBuilder<U64>(group, StreamConfig{.replicas = 2}).stage("a", id).build();
  // A stream that is not serving refuses pushes: kClosed.
  auto c = two.client();
  CHECK(c.push(1).refusal == Refusal::kClosed);
  two.start();
  CHECK(c.push(2).accepted());
  auto r = c.pop_until(StreamClock::now() + patience());
  REQUIRE(r.has_value());
  CHECK(*r->value == 2);
  two.close();
  CHECK(c.push(3).refusal == Refusal::kClosed);
  CHECK(two.wait().drained());
}

TEST_CASE("estimates: a preempted call moves the service estimates by a bounded step") {
  // A batch stage's cost model (per size, and the line through all sizes).
  detail::BatchCostModel model(16);
  CHECK(model.estimate(16) == 0.0);  // nothing measured yet
  for (int i = 0; i < 20; ++i) model.add(16, 52'000.0);
  CHECK(model.estimate(16) == doctest::Approx(52'000.0));
  model.add(16, 5'000'000.0);  // a call stretched by a preemption: counted as 2x the estimate
  CHECK(model.estimate(16) <= 52'000.0 * (1.0 + 1.0 / 8.0) + 1.0);
  for (int i = 0; i < 40; ++i) model.add(16, 52'000.0);
  CHECK(model.estimate(16) == doctest::Approx(52'000.0).epsilon(0.01));
  // A real slowdown still moves it: 16 calls at twice the time more than double... within 20.
  for (int i = 0; i < 20; ++i) model.add(16, 104'000.0);
  CHECK(model.estimate(16) > 90'000.0);
  // Sizes not measured come from the line a + b*n through those that were.
  detail::BatchCostModel line(16);
  for (int i = 0; i < 30; ++i) {
    line.add(4, 28'000.0);
    line.add(8, 36'000.0);
  }
  CHECK(line.estimate(16) == doctest::Approx(52'000.0).epsilon(0.01));
  CHECK(line.estimate(1) == doctest::Approx(22'000.0).epsilon(0.01));

  // The stage meters' moving averages: an outlier counts as twice the average.
  std::atomic<std::int64_t> avg{0};
  detail::ewma(avg, 1'000);
  CHECK(avg.load() == 1'000);
  detail::ewma(avg, 1'000'000);
  CHECK(avg.load() == 1'000 + (2'000 - 1'000) / 16);
}

TEST_CASE("estimates: admission widens its predicted wait while answers come late") {
  using detail::LateFeedback;
  LateFeedback f;
  CHECK(f.slack() == 0.0);
  std::uint64_t timed = 0, late = 0;
  // On time: nothing changes.
  for (int w = 0; w < 4; ++w) {
    timed += LateFeedback::kWindow;
    f.update(timed, late);
  }
  CHECK(f.slack() == 0.0);
  // 5% late over a window: an eighth wider each window, up to kMaxSlack.
  for (int w = 0; w < 3; ++w) {
    timed += LateFeedback::kWindow;
    late += LateFeedback::kWindow / 20;
    f.update(timed, late);
  }
  CHECK(f.slack() == doctest::Approx(0.375));
  for (int w = 0; w < 100; ++w) {
    timed += LateFeedback::kWindow;
    late += LateFeedback::kWindow / 20;
    f.update(timed, late);
  }
  CHECK(f.slack() == doctest::Approx(LateFeedback::kMaxSlack));
  // Updates within a window wait for the window to fill.
  f.update(timed + LateFeedback::kWindow / 2, late);
  CHECK(f.slack() == doctest::Approx(LateFeedback::kMaxSlack));
  // On time again: it narrows by a thirty-second per window, back to the measured wait.
  for (int w = 0; w < 200; ++w) {
    timed += LateFeedback::kWindow;
    f.update(timed, late);
  }
  CHECK(f.slack() == 0.0);
  // Counts that start over (meters reset) start the window over.
  f.update(10, 10);
  CHECK(f.slack() == 0.0);
}

TEST_CASE("a client's waits: set_wait(), and no spinning on a device's core") {
  DeviceGroup devices(1);
  Stream<U64, U64> s = StreamBuilder<U64>(devices).stage("id", [](U64 v) { return v; }).build();
  s.start();
  {
    auto c = s.client();
    CHECK_THROWS_AS(c.set_wait(WaitPolicy{WaitStrategy::kSpinThenPark, -1ns}), Error);
    c.set_wait(WaitPolicy::park());
    CHECK(c.wait_policy().strategy == WaitStrategy::kPark);
    REQUIRE(c.push(7));
    auto r = c.pop_until(StreamClock::now() + patience());
    REQUIRE(r.has_value());
    CHECK(*r->value == 7);
  }
  const auto& core = devices[0].placement().core;
  if (core && Topology::get().has_hwloc()) {
    // A client thread pinned to the device's core yields and parks soon; one on another core
    // (or unpinned) keeps the default.
    std::thread([&] {
      REQUIRE(Topology::get().pin_current_thread(*core));
      CHECK(Topology::get().current_thread_core() == *core);
      auto c = s.client();
      const WaitPolicy w = c.wait_policy();
      CHECK(w.yields);
      CHECK(w.spin_budget() <= tunables::kSharedCoreSpinBudget);
      REQUIRE(c.push(8));
      auto r = c.pop();
      REQUIRE(r.has_value());
      CHECK(*r->value == 8);
    }).join();
  }
  {
    auto c = s.client();
    if (!Topology::get().current_thread_core() || Topology::get().current_thread_core() != core) {
      CHECK_FALSE(c.wait_policy().yields);
    }
  }
  s.close();
  CHECK(s.wait().drained());
}

TEST_CASE("error kinds and refusals have names") {
  CHECK(std::string(to_string(ErrorKind::kStageFailed)) == "stage_failed");
  CHECK(std::string(to_string(ErrorKind::kDeadlineExceeded)) == "deadline_exceeded");
  CHECK(std::string(to_string(ErrorKind::kRejected)) == "rejected");
  CHECK(std::string(to_string(ErrorKind::kCancelled)) == "cancelled");
  CHECK(std::string(to_string(Refusal::kNone)) == "accepted");
  CHECK(std::string(to_string(Refusal::kQueueFull)) == "queue_full");
  CHECK(Submission{}.accepted());
  CHECK_FALSE(Submission{.refusal = Refusal::kShed}.accepted());
}

TEST_SUITE_END();

TEST_CASE("clients come and go while their answers are being delivered") {
  // Each short-lived client's ring is freed by the stream once its last deliverer has let go
  // (regression: it was freed when the last response was counted, before the deliverer woke
  // the client, so a new client() could free memory a device thread was still touching; the
  // sanitizer builds see it). One stream answers singly, the other in batches.
  for (const bool batched : {false, true}) {
    CAPTURE(batched);
    DeviceGroup devices(1);
    Stream<U64, U64> s =
        batched ? StreamBuilder<U64>(devices)
                      .batch_stage(
                          "model",
                          [](std::span<U64> xs) {
                            std::vector<ItemResult<U64>> out;
                            for (U64 x : xs) out.push_back(x + 1);
                            return out;
                          },
                          BatchConfig{.max_batch = 4, .max_delay = 100us})
                      .build()
                : StreamBuilder<U64>(devices).stage("model", [](U64 x) { return x + 1; }).build();
    s.start();
    std::atomic<int> answered{0};
    constexpr int kThreads = 2, kClients = 60, kEach = 3;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int k = 0; k < kClients; ++k) {
          auto c = s.client();
          for (int i = 0; i < kEach; ++i) REQUIRE(c.push(static_cast<U64>(t * 1000 + i)));
          for (int i = 0; i < kEach; ++i) {
            auto r = c.pop_until(StreamClock::now() + patience());
            if (r && r->ok() && *r->value == static_cast<U64>(t * 1000 + i + 1)) ++answered;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    s.close();
    const StreamResult r = s.wait();
    CHECK(r.drained());
    CHECK(answered.load() == kThreads * kClients * kEach);
  }
}
