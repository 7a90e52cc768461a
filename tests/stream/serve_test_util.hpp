// Helpers shared by the serving tests (stream_replicas_test.cpp, stream_batching_test.cpp,
// stream_deadline_test.cpp, stream_cancel_test.cpp, stream_admission_test.cpp,
// stream_clients_test.cpp, stream_stats_test.cpp, stream_drain_test.cpp,
// stream_serve_errors_test.cpp): client threads that push, pop and check every response
// against its push (drive, run_clients), what each client saw (Tally), and the timing helpers.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <numeric>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <bspflow/stream/request.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_client.hpp>

#include "test_util.hpp"

namespace test {

// Client k's i-th value is k * kSpan + i.
inline constexpr std::uint64_t kSpan = 1'000'000'000;

// How long a client waits for a response before the test counts it as lost (rather than
// hanging): 10 s, longer under ThreadSanitizer (BSPFLOW_TEST_SCALE).
inline std::chrono::nanoseconds patience() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(10.0 / scale()));
}

inline void spin_for(std::chrono::nanoseconds d) {
  const auto until = bspflow::StreamClock::now() + d;
  while (bspflow::StreamClock::now() < until) {
  }
}

inline std::size_t index_of(bspflow::Refusal r) {
  return static_cast<std::size_t>(r);
}
inline std::size_t index_of(bspflow::ErrorKind k) {
  return static_cast<std::size_t>(k);
}

// What one client saw of its own requests.
struct Tally {
  std::uint32_t client = 0;                // StreamClient::id()
  std::uint64_t accepted = 0;              // pushes accepted
  std::array<std::uint64_t, 8> refused{};  // pushes refused, by Refusal
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
  std::uint64_t errors_of(bspflow::ErrorKind k) const { return errors[index_of(k)]; }
  std::uint64_t refused_of(bspflow::Refusal r) const { return refused[index_of(r)]; }
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

  void pushed(const bspflow::Submission& s, std::uint64_t index, Tally& t) {
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
  std::optional<std::uint64_t> answered(const bspflow::Response<Out>& r, Tally& t) {
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
  std::function<bspflow::Deadline(std::uint64_t)> deadline{};  // none: kNoDeadline
  std::atomic<std::uint64_t>* accepted = nullptr;              // counts accepted pushes for others
};

// One client thread's work: pushes make(i) for i < d.requests, popping its oldest responses
// while it has d.window unanswered, then pops the rest. Each response is checked against its
// push: this client's, answering an outstanding request once, in push order if d.ordered,
// and check(i, response).
template <class In, class Out, class Make, class Check>
Tally drive(bspflow::StreamClient<In, Out>& c, const Drive& d, Make make, Check check) {
  Tally t;
  t.client = c.id();
  Ledger ledger(c.id(), d.ordered);
  const auto take_one = [&]() -> bool {
    auto r = c.pop_until(bspflow::StreamClock::now() + patience());
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
    const bspflow::Submission s =
        c.push(std::move(value), d.deadline ? d.deadline(i) : bspflow::kNoDeadline);
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
inline void check_clean(const std::vector<Tally>& tallies) {
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
std::vector<Tally> run_clients(bspflow::Stream<In, Out>& stream, int clients, const Drive& d,
                               Make make, Check check) {
  std::vector<bspflow::StreamClient<In, Out>> handles;
  handles.reserve(static_cast<std::size_t>(clients));
  for (int k = 0; k < clients; ++k) handles.push_back(stream.client());
  std::vector<Tally> tallies(static_cast<std::size_t>(clients));
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k) {
    threads.emplace_back([&, k] {
      const auto uk = static_cast<std::size_t>(k);
      tallies[uk] = drive(
          handles[uk], d, [&](std::uint64_t i) { return make(k, i); },
          [&](std::uint64_t i, const bspflow::Response<Out>& r) { return check(k, i, r); });
    });
  }
  for (auto& t : threads) t.join();
  return tallies;
}

inline Tally sum(const std::vector<Tally>& tallies) {
  Tally s;
  for (const Tally& t : tallies) s += t;
  return s;
}

inline constexpr auto plus1 = [](std::uint64_t x) { return x + 1; };

}  // namespace test
