// The base room's errors: the one message shape every validation error takes, byte counts
// and exception descriptions (bspflow/base/error.hpp).
#include <doctest/doctest.h>

#include <bspflow/base/error.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::error_of;

TEST_SUITE_BEGIN("error");

TEST_CASE("throw_bad_value names the field, the value given and what is allowed") {
  CHECK(error_of([] { detail::throw_bad_value("prefetch_depth", 0, "must be in 1..255"); }) ==
        "prefetch_depth = 0 is not allowed: must be in 1..255");
  CHECK(error_of([] { detail::throw_bad_value("mode", "'fast'", "use a or b"); }) ==
        "mode = 'fast' is not allowed: use a or b");
}

TEST_CASE("format_bytes picks the unit") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1024) == "1.0 KiB");
  CHECK(format_bytes(624 * 1024) == "624.0 KiB");
  CHECK(format_bytes(std::uint64_t{3} << 30) == "3.0 GiB");
  CHECK(format_bytes(std::uint64_t{5} << 40) == "5.0 TiB");
}

TEST_CASE("describe_exception gives the message, or says what it cannot") {
  CHECK(detail::describe_exception(nullptr) == "no exception");
  CHECK(detail::describe_exception(std::make_exception_ptr(Error("bad input"))) == "bad input");
  CHECK(detail::describe_exception(std::make_exception_ptr(42)) ==
        "unknown exception (not derived from std::exception)");
}

TEST_SUITE_END();
