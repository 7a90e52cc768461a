// devices/: IoEngine (bspflow/devices/io_engine.hpp): a transfer does its copy and takes its
// modeled time; transfers queued at shutdown end as cancelled; near and far ends on several
// channels, a woken engine, shutdown with transfers being spun toward.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#endif

#include <bspflow/devices/io_engine.hpp>

#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("io_engine");

TEST_CASE("I/O engine: a transfer does its copy and takes at least its modeled time") {
  IoEngine io(2);
  std::atomic<int> done{0};
  std::vector<char> src(1000, 'x'), dst(1000, 0);
  IoEngine::Times times;
  io.submit(1, IoEngine::Transfer{1000, 300us,
                                  [&] {
                                    std::copy(src.begin(), src.end(), dst.begin());
                                    return IoEngine::Start::kGo;
                                  },
                                  [&](const IoEngine::Times& t, bool cancelled) {
                                    times = t;
                                    done.store(cancelled ? 2 : 1);
                                  }});
  while (done.load() == 0) std::this_thread::sleep_for(50us);
  CHECK(done.load() == 1);
  CHECK(times.end - times.begin >= 300us);
  CHECK(dst == src);
  CHECK(contains(error_of([&] { io.submit(2, {}); }), "I/O engine channel = 2"));
}

TEST_CASE("I/O engine: transfers still queued at shutdown end as cancelled") {
  std::atomic<int> cancelled{0}, finished{0};
  {
    IoEngine io(1);
    for (int i = 0; i < 3; ++i) {
      io.submit(0, IoEngine::Transfer{
                       0, 200ms, [] { return IoEngine::Start::kGo; },
                       [&](const IoEngine::Times&, bool c) { (c ? cancelled : finished)++; }});
    }
    std::this_thread::sleep_for(5ms);
  }
  CHECK(cancelled.load() + finished.load() == 3);
  CHECK(cancelled.load() >= 2);
}

TEST_CASE("I/O engine: channels with near and far ends all finish, none before its end") {
  // A 50 us transfer is spun toward at once; 300 us and 3 ms ones wait on a timer first.
  // A sleeping engine woken by wake() takes them as an awake one does.
  IoEngine io(3);
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      std::this_thread::sleep_for(5ms);  // past the idle watch: the engine thread sleeps
      io.wake();
    }
    const std::chrono::microseconds modeled[3] = {3000us, 300us, 50us};
    std::atomic<int> done{0};
    IoEngine::Times times[3];
    for (std::uint32_t c = 0; c < 3; ++c) {
      io.submit(c, IoEngine::Transfer{0, modeled[c], [] { return IoEngine::Start::kGo; },
                                      [&, c](const IoEngine::Times& t, bool cancelled) {
                                        if (!cancelled) times[c] = t;
                                        done.fetch_add(cancelled ? 100 : 1);
                                      }});
    }
    while (done.load() < 3) std::this_thread::sleep_for(50us);
    CHECK(done.load() == 3);
    for (int c = 0; c < 3; ++c) CHECK(times[c].end - times[c].begin >= modeled[c]);
  }
}

TEST_CASE("I/O engine: shutdown with transfers near their end accounts for each") {
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ended{0};
    {
      IoEngine io(2);
      for (int i = 0; i < 4; ++i) {
        io.submit(static_cast<std::uint32_t>(i % 2),
                  IoEngine::Transfer{0, std::chrono::microseconds(20 + 40 * i),
                                     [] { return IoEngine::Start::kGo; },
                                     [&](const IoEngine::Times&, bool) { ended++; }});
      }
      std::this_thread::sleep_for(std::chrono::microseconds(10 * round));
    }
    CHECK(ended.load() == 4);
  }
}

TEST_CASE(
    "I/O engine: a transfer whose start() throws ends cancelled with the error; the next runs") {
  IoEngine io(1);
  std::atomic<int> failed{0}, finished{0};
  std::exception_ptr error;
  io.submit(0, IoEngine::Transfer{8, 10us, []() -> IoEngine::Start { throw std::bad_alloc(); },
                                  [&](const IoEngine::Times& t, bool cancelled) {
                                    if (cancelled && t.error) {
                                      error = t.error;
                                      failed.store(1);
                                    }
                                  }});
  io.submit(0, IoEngine::Transfer{8, 10us, [] { return IoEngine::Start::kGo; },
                                  [&](const IoEngine::Times& t, bool cancelled) {
                                    finished.store(!cancelled && !t.error ? 1 : 2);
                                  }});
  while (finished.load() == 0) std::this_thread::sleep_for(50us);
  CHECK(failed.load() == 1);
  CHECK(finished.load() == 1);
  CHECK_THROWS_AS(std::rethrow_exception(error), std::bad_alloc);
}

#if defined(__linux__)
TEST_CASE("I/O engine: its thread is named bspflow-io") {
  IoEngine io(1);
  std::atomic<bool> done{false};
  char name[16] = {};
  io.submit(0, IoEngine::Transfer{0, 0ns,
                                  [&] {
                                    pthread_getname_np(pthread_self(), name, sizeof name);
                                    return IoEngine::Start::kGo;
                                  },
                                  [&](const IoEngine::Times&, bool) { done.store(true); }});
  while (!done.load()) std::this_thread::sleep_for(50us);
  CHECK(std::string(name) == "bspflow-io");
}
#endif

TEST_SUITE_END();
