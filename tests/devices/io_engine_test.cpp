// devices/: IoEngine (bspflow/devices/io_engine.hpp): a transfer does its copy and takes its
// modeled time; transfers queued at shutdown end as cancelled.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

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

TEST_SUITE_END();
