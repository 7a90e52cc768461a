// The soak suite's shared parts (see soak_common.hpp).
#include "soak_common.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

using namespace bspflow;
using namespace std::chrono_literals;

namespace soak {

std::uint64_t env_u64(const char* name, std::uint64_t otherwise) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return otherwise;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (*end != '\0') {
    std::fprintf(stderr, "soak: %s=%s is not a number\n", name, v);
    std::exit(2);
  }
  return n;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::uint64_t Arrivals::missing() const {
  std::uint64_t n = 0;
  for (const auto& p : seen_) n += static_cast<std::uint64_t>(std::count(p.begin(), p.end(), 0));
  return n;
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> l(m_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::arm(std::string what, std::chrono::seconds limit) {
  std::lock_guard<std::mutex> l(m_);
  what_ = std::move(what);
  deadline_ = Clock::now() + limit;
  limit_ = limit;
  armed_ = true;
}

void Watchdog::disarm() {
  std::lock_guard<std::mutex> l(m_);
  armed_ = false;
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> l(m_);
  while (!quit_) {
    if (armed_ && Clock::now() >= deadline_) {
      std::fprintf(stderr, "soak: %s did not end within %lld s: it hangs\n", what_.c_str(),
                   static_cast<long long>(limit_.count()));
      std::fflush(stderr);
      std::abort();
    }
    cv_.wait_for(l, 100ms);
  }
}

std::string Seen::problems(std::uint64_t pushed, std::uint64_t skip) const {
  std::string out;
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < n_.size(); ++i) {
    const std::uint32_t want = i < pushed ? 1 : 0;
    const std::uint32_t got = n_[i].load();
    if (got != want && i != skip) {
      if (++bad <= 5) out += "id " + std::to_string(i) + " " + std::to_string(got) + " times; ";
    }
  }
  if (bad > 5) out += std::to_string(bad) + " ids in all; ";
  if (foreign_.load() != 0) out += std::to_string(foreign_.load()) + " ids never pushed; ";
  return out;
}

const Endings kCountedRunEndings{
    {},
    {{RunStatus::kCancelled, "cancelled"}, {RunStatus::kCompleted, "completed before the cancel"}},
    {{RunStatus::kEndOfData, "end of data"}, {RunStatus::kCompleted, "completed before the close"}},
};

bool check_ending(Trial& t, RunStatus status, const std::string& message, const Endings& endings) {
  const std::vector<Ending>& allowed = t.fault == Fault::kThrow   ? endings.thrown
                                       : t.fault == Fault::kClose ? endings.closed
                                                                  : endings.stopped;
  for (const Ending& e : allowed) {
    if (e.status == status) {
      t.outcome = e.outcome;
      return true;
    }
  }
  if (allowed.empty()) {
    CHECK_MESSAGE(false,
                  "the run returned (" << message << ") instead of throwing at the injected fault");
  } else {
    CHECK_MESSAGE(false, "the run ended " << to_string(status) << " (" << message
                                          << "), which the fault '"
                                          << kFaultNames[static_cast<std::size_t>(t.fault)]
                                          << "' does not allow");
  }
  t.outcome = std::string("unexpected: ") + to_string(status);
  return false;
}

void check_exactly_once(const Seen& seen, std::uint64_t pushed, std::vector<std::uint64_t> ids,
                        std::uint64_t undelivered, std::uint64_t skip) {
  const std::string problems = seen.problems(pushed, skip);
  CHECK_MESSAGE(problems.empty(), problems);
  std::sort(ids.begin(), ids.end());
  CHECK(std::adjacent_find(ids.begin(), ids.end()) == ids.end());  // no output twice
  CHECK(ids.size() + undelivered == pushed);
}

Stopper stopper_for(Rng& rng, const Trial& t) {
  Stopper s;
  if (t.fault == Fault::kCancel && rng.coin()) {
    s.before = true;
    s.source.request_stop();
  }
  return s;
}

void check_stopped_before(Trial& t, RunStatus status,
                          const std::vector<std::uint64_t>& iterations) {
  CHECK(status == RunStatus::kCancelled);
  for (const std::uint64_t i : iterations) CHECK(i == 0);
  t.outcome = "cancelled before it started (stop token)";
}

Closing closing_for(Rng& rng, const Trial& t, std::uint64_t total) {
  if (t.fault != Fault::kClose) return {total, false};
  if (rng.coin()) return {total, true};
  return {rng.below(total), false};
}

OutfeedConfig outfeed_config(std::uint32_t replicas, std::size_t capacity, Rng& rng) {
  OutfeedConfig c{replicas, OutputMode::all(), capacity};
  if (capacity != 0 && rng.coin()) c.consumer_type = ConsumerType::kSingle;
  return c;
}

void spin_for(std::chrono::microseconds d) {
  if (d.count() == 0) return;
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

std::chrono::microseconds micros(Rng& rng, std::uint64_t max) {
  return std::chrono::microseconds(rng.in(0, max));
}

}  // namespace soak
