// feeds/: OutputMode (bspflow/feeds/output_mode.hpp): which iterations emit, how many entries a
// run gives, parsing and its errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <bspflow/feeds/output_mode.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("output_mode");

TEST_CASE("output modes: which iterations emit, and parsing") {
  const OutputMode every5 = OutputMode::every_n(5);
  std::vector<std::uint64_t> hits;
  for (std::uint64_t i = 0; i < 10; ++i) {
    if (every5.emits_at(i)) hits.push_back(i);
  }
  CHECK(hits == std::vector<std::uint64_t>{4, 9});
  CHECK(every5.entries_for(10) == 2);
  CHECK(OutputMode::all().entries_for(10) == 10);
  CHECK(OutputMode::final().entries_for(10) == 1);
  CHECK(OutputMode::sum().entries_for(0) == 0);
  CHECK(OutputMode::parse("every_n:5") == every5);
  CHECK(OutputMode::parse("sum") == OutputMode::sum());
  CHECK(OutputMode::parse("final").to_string() == "final");
  const std::string bad = error_of([] { OutputMode::parse("every_n:0"); });
  CHECK(contains(bad, "n = 0"));
  const std::string junk = error_of([] { OutputMode::parse("most"); });
  CHECK(contains(junk, "'most'"));
  CHECK(contains(junk, "all, final, sum or every_n:N"));
}

TEST_SUITE_END();
