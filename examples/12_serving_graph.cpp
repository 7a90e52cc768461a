// 12_serving_graph: a stream graph serving two priority classes, and a model swapped while it
// serves.
//
// Each request is a number x. The graph, on each of 2 replicas of 2 devices:
//
//   pre (device 0)          f = 10 x
//   -> classify (device 0)  v1: f % 7, v2: f % 7 + 100   } two branches, side by side
//   -> embed (device 1)     2 f                           }
//   -> combine (device 1)   classify + embed: a join, one answer per request
//
// The join sits where its slower branch (embed) ends: classify's value waits for it there,
// while device 0 takes the next request. On device 0 it would hold device 0 for each round
// trip to device 1, and the graph would serve one request at a time (the build warns).
//
// The classify model holds 3/5 of its device's memory, so a new version does not fit beside
// the old one: the swap rolls, one replica at a time (it drains, swaps, warms and rejoins).
//
// 1. Overload with two classes: an interactive client (class 0) keeps 4 requests in flight
//    while two batch clients (class 1) push as fast as they can. Admission (kReject, 64
//    queued) refuses batch pushes, or sheds queued batch requests for interactive ones; the
//    interactive class is served first at every queue, and batch keeps its minimum share.
// 2. A rolling swap of "classify" to version 2 while an interactive and a batch client keep
//    pushing: every response says which version answered it, and its value must be that
//    version's.
// The host prints per-class latency and refusals, the answers by version, and each node's
// figures; it checks every answer and the stream's counts. Exits 0 if every check holds.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <bspflow/bspflow.hpp>
#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_graph.hpp>

namespace {

using namespace std::chrono_literals;
using bspflow::ErrorKind;
using bspflow::Refusal;
using U64 = std::uint64_t;

constexpr std::uint32_t kInteractive = 0, kBatch = 1;  // priority classes: 0 is served first
constexpr U64 kInteractiveRequests = 1500;
constexpr U64 kInteractiveWindow = 4;
constexpr std::size_t kQueueCapacity = 64;
constexpr std::chrono::microseconds kModelTime{30};

void busy(std::chrono::microseconds d) {  // the accelerator's time
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

// The classify model, version v.
auto classify(std::uint32_t v) {
  return [v](U64 f) -> U64 {
    busy(kModelTime);
    return f % 7 + (v >= 2 ? 100 : 0);
  };
}
// What a request x is answered with by a graph whose classify is version v.
U64 answer(U64 x, std::uint32_t v) {
  const U64 f = 10 * x;
  return f % 7 + (v >= 2 ? 100 : 0) + 2 * f;
}

using Client = bspflow::StreamClient<U64, U64>;

// What one client saw.
struct Seen {
  U64 accepted = 0, answered = 0, ok = 0, shed = 0, refused = 0, wrong = 0;
  std::array<U64, 3> by_version{};  // ok answers by version (1, 2)
};

// A client's accepted requests, oldest first; checks each response against the oldest (a
// client's responses come back in its push order).
struct Pending {
  std::deque<std::pair<bspflow::RequestId, U64>> q;
  void check(const bspflow::Response<U64>& r, Seen& seen, bool may_be_shed) {
    ++seen.answered;
    if (q.empty() || r.id != q.front().first) {
      ++seen.wrong;
      return;
    }
    const U64 x = q.front().second;
    q.pop_front();
    if (r.ok()) {
      ++seen.ok;
      ++seen.by_version[std::min<std::uint32_t>(r.version, 2)];
      if (*r.value != answer(x, r.version)) ++seen.wrong;
    } else if (may_be_shed && r.kind() == ErrorKind::kRejected) {
      ++seen.shed;  // a queued batch request shed for an interactive one
    } else {
      ++seen.wrong;
    }
  }
};

// An interactive client: `n` requests (or until `stop`), `window` in flight; never refused.
void interactive(Client& c, Seen& seen, U64 n, const std::atomic<bool>& stop) {
  Pending p;
  for (U64 x = 1; x <= n && !stop.load(); ++x) {
    if (c.outstanding() >= kInteractiveWindow) {
      if (auto r = c.pop()) p.check(*r, seen, false);
    }
    const bspflow::Submission s = c.push(x);
    if (!s) {
      ++seen.refused;
      ++seen.wrong;  // a higher class's push takes a lower one's place
      continue;
    }
    ++seen.accepted;
    p.q.emplace_back(s.id, x);
  }
  while (auto r = c.pop()) p.check(*r, seen, false);
  seen.wrong += p.q.size();
}

// A batch client: pushes without waiting until `stop`, reading responses as they come.
void batch(Client& c, Seen& seen, const std::atomic<bool>& stop) {
  Pending p;
  for (U64 x = 1; !stop.load(); ++x) {
    const bspflow::Submission s = c.try_push(U64{x});
    if (s) {
      ++seen.accepted;
      p.q.emplace_back(s.id, x);
    } else {
      ++seen.refused;
      const bool expected = s.refusal == Refusal::kQueueFull || s.refusal == Refusal::kOutranked ||
                            s.refusal == Refusal::kClientFull;
      if (!expected) ++seen.wrong;
      if (auto r = c.pop()) p.check(*r, seen, true);  // let the stream catch up
    }
    while (auto r = c.try_pop()) p.check(*r, seen, true);
  }
  while (auto r = c.pop()) p.check(*r, seen, true);
  seen.wrong += p.q.size();
}

Seen& operator+=(Seen& a, const Seen& b) {
  a.accepted += b.accepted;
  a.answered += b.answered;
  a.ok += b.ok;
  a.shed += b.shed;
  a.refused += b.refused;
  a.wrong += b.wrong;
  for (std::size_t v = 0; v < a.by_version.size(); ++v) a.by_version[v] += b.by_version[v];
  return a;
}

// Calls made by version `v` of "classify", from the stream's stats.
template <class S>
U64 version_calls(S& stream, std::uint32_t v) {
  for (const bspflow::StageStats& n : stream.stats().stages) {
    if (n.name != "classify") continue;
    for (const bspflow::VersionStats& s : n.versions) {
      if (s.version == v) return s.calls;
    }
  }
  return 0;
}

unsigned long long ull(U64 v) {
  return static_cast<unsigned long long>(v);
}
double us(U64 ns) {
  return static_cast<double>(ns) / 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::puts(
          "usage: 12_serving_graph\n"
          "  serves a graph (pre-processing, two branches side by side, a join) on 2 replicas to\n"
          "  two priority classes under overload, then swaps a branch's model to version 2,\n"
          "  one replica at a time, while it serves; checks every answer and the stream's\n"
          "  counts; exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "12_serving_graph: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }

  bspflow::StreamConfig config;
  config.replicas = 2;  // replica r on devices 2r and 2r + 1
  config.priority_classes = 2;
  config.min_share[kBatch] = 0.2;  // batch gets at least a fifth of what each queue serves
  config.admission.policy = bspflow::AdmissionPolicy::kReject;
  config.admission.queue_capacity = kQueueCapacity;

  bspflow::DeviceGroup devices(4);
  const std::size_t model_bytes = devices[0].arena().free_bytes() / 5 * 3;
  bspflow::StreamGraph<U64> g(devices, config);
  auto pre = g.input().stage(
      "pre", [](U64 x) { return 10 * x; }, 0);
  auto cls = pre.stage("classify", classify(1), 0).memory(model_bytes);
  auto emb = pre.stage(
      "embed",
      [](U64 f) {
        busy(kModelTime);
        return 2 * f;
      },
      1);
  auto out = g.join(
      "combine", [](U64 c, U64 e) { return c + e; }, 1, cls, emb);
  auto stream = std::move(g).build(out);  // a Stream<U64, U64>
  stream.start();

  // 1. Two classes under overload.
  std::atomic<bool> stop{false};
  Seen hi, lo1, lo2;
  {
    std::thread b1([&, c = stream.client()]() mutable {
      c.set_priority(kBatch);
      batch(c, lo1, stop);
    });
    std::thread b2([&, c = stream.client()]() mutable {
      c.set_priority(kBatch);
      batch(c, lo2, stop);
    });
    Client c = stream.client();  // class 0 by default
    interactive(c, hi, kInteractiveRequests, stop);
    stop = true;
    b1.join();
    b2.join();
  }
  Seen lo = lo1;
  lo += lo2;
  const bspflow::StreamStats s1 = stream.stats();
  std::printf("overload, two classes:\n");
  for (const bspflow::ClassStats& c : s1.by_class) {
    std::printf(
        "  class %u (%s): %llu answered, p50 %.0f us, p99 %.0f us; refused %llu (queue_full "
        "%llu, outranked %llu, client_full %llu); shed from the queue %llu\n",
        c.priority, c.priority == kInteractive ? "interactive" : "batch", ull(c.answered),
        us(c.latency_ns.value_at_percentile(50)), us(c.latency_ns.value_at_percentile(99)),
        ull(std::accumulate(c.refusals.begin(), c.refusals.end(), U64{0})),
        ull(c.refusals[static_cast<std::size_t>(Refusal::kQueueFull)]),
        ull(c.refusals[static_cast<std::size_t>(Refusal::kOutranked)]),
        ull(c.refusals[static_cast<std::size_t>(Refusal::kClientFull)]),
        ull(c.errors[static_cast<std::size_t>(ErrorKind::kRejected)]));
  }

  // 2. A rolling swap while both classes push.
  stop = false;
  Seen hi2, lo3;
  bspflow::SwapResult swapped;
  {
    std::thread b([&, c = stream.client()]() mutable {
      c.set_priority(kBatch);
      batch(c, lo3, stop);
    });
    std::thread i([&, c = stream.client()]() mutable { interactive(c, hi2, ~U64{0}, stop); });
    std::this_thread::sleep_for(20ms);
    // Warmed with three inputs on this thread, off the request path, then moved to replica by
    // replica; requests inside the old version finish on it.
    swapped = stream.swap("classify", classify(2), std::vector<U64>{10, 20, 30});
    // Serve a while on version 2 (up to 2 s on a busy machine).
    const auto give_up = std::chrono::steady_clock::now() + 2s;
    while (std::chrono::steady_clock::now() < give_up && version_calls(stream, 2) < 200) {
      std::this_thread::sleep_for(1ms);
    }
    stop = true;
    b.join();
    i.join();
  }
  Seen after = hi2;
  after += lo3;
  std::printf("swap: %s\n", swapped.message.c_str());
  std::printf("  answers by version while swapping: v1 %llu, v2 %llu\n", ull(after.by_version[1]),
              ull(after.by_version[2]));

  stream.close();
  const bspflow::StreamResult result = stream.wait();
  const bspflow::StreamStats st = stream.stats();
  std::printf("nodes:\n");
  for (const bspflow::StageStats& n : st.stages) {
    std::printf("  %-8s device %u: %llu calls, p50 %.1f us, queue wait p50 %.1f us", n.name.c_str(),
                n.device, ull(n.calls), us(n.service_ns.value_at_percentile(50)),
                us(n.queue_wait_ns.value_at_percentile(50)));
    if (!n.versions.empty()) std::printf(", version %u", n.versions.back().version);
    std::printf("\n");
  }
  std::printf("stream: %s\n", result.message.c_str());

  std::vector<std::string> failures;
  const auto expect = [&](bool holds, const char* what) {
    if (!holds) failures.emplace_back(what);
  };
  Seen all = hi;
  all += lo;
  all += after;
  expect(all.wrong == 0,
         "every response the right one, in push order, with its version's value or an allowed "
         "error");
  expect(hi.accepted == kInteractiveRequests && hi.ok == hi.accepted,
         "every interactive request accepted and answered with its value");
  expect(lo.refused + lo.shed > 0, "the overload refused or shed batch requests");
  expect(swapped.swapped && swapped.rolling && swapped.version == 2,
         "the swap rolled to version 2");
  expect(after.by_version[2] > 0, "version 2 answered after the swap");
  expect(result.drained() && result.unanswered == 0, "the stream drained on close");
  expect(st.accepted == all.accepted && st.answered == all.answered && st.ok == all.ok,
         "Stream::stats counts equal the clients'");
  expect(
      st.by_class.size() == 2 && st.by_class[kInteractive].accepted == hi.accepted + hi2.accepted,
      "the interactive class's count equals its clients'");
  expect(st.stages.size() == 4, "four nodes in the stats");
  for (const std::string& f : failures) std::fprintf(stderr, "FAILED: %s\n", f.c_str());
  if (!failures.empty()) return 1;
  std::printf("ok\n");
  return 0;
}
