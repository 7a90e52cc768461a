// runtime/: the Run handle (bspflow/runtime/run.hpp): cancelling it, dropping it, or destroying
// the device under it never hangs.
#include <doctest/doctest.h>

#include <chrono>

#include <bspflow/bspflow.hpp>

#include "runtime_test_util.hpp"
#include "test_util.hpp"

using namespace bspflow;
using namespace std::chrono_literals;
using test::contains;
using test::kSmall;

TEST_SUITE_BEGIN("run");

TEST_CASE("cancel, dropping the Run handle, or destroying the device never hangs") {
  InfeedQueue<int> in;  // never fed: the loop waits on it
  SUBCASE("cancel") {
    Device device(0, kSmall);
    auto run = loops::repeat_async(
        device, 10, [](int&, int&) {}, 0, in);
    CHECK_FALSE(run.wait_for(5ms));
    run.cancel();
    auto r = run.get();
    CHECK(r.status == RunStatus::kCancelled);
    CHECK(contains(r.message, "cancelled"));
  }
  SUBCASE("dropping the handle cancels and waits") {
    Device device(0, kSmall);
    {
      auto run = loops::repeat_async(
          device, 10, [](int&, int&) {}, 0, in);
    }
    CHECK(device.arena().used() == 0);
  }
  SUBCASE("destroying the device cancels its run") {
    Run<int> run;
    {
      Device device(0, kSmall);
      run = loops::repeat_async(
          device, 10, [](int&, int&) {}, 0, in);
    }
    CHECK(run.get().status == RunStatus::kCancelled);
  }
}

TEST_SUITE_END();
