// The serve path's service estimates (the stream room's detail/: BatchCostModel, ewma,
// LateFeedback): a preempted call moves the estimates by a bounded step, sizes not measured
// come from the line through those that were, and admission widens its predicted wait while
// answers come late, narrowing it again once they are on time.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>

#include <bspflow/stream/stream.hpp>
#include <bspflow/stream/stream_serving.hpp>

using namespace bspflow;

TEST_SUITE_BEGIN("stream_estimates");

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

TEST_SUITE_END();
