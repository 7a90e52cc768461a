// Helpers shared by the doctest suites.
#pragma once

#include <cstdlib>
#include <functional>
#include <string>

#include <bspflow/base/error.hpp>

namespace test {

// BSPFLOW_TEST_SCALE scales the load tests (1 = full size; the ThreadSanitizer build runs
// with a smaller scale because TSan slows everything ~10x).
inline double scale() {
  const char* s = std::getenv("BSPFLOW_TEST_SCALE");
  if (s == nullptr) return 1.0;
  const double v = std::atof(s);
  return v > 0 ? v : 1.0;
}
inline std::uint64_t scaled(std::uint64_t n, std::uint64_t at_least = 1) {
  const auto v = static_cast<std::uint64_t>(static_cast<double>(n) * scale());
  return v < at_least ? at_least : v;
}

// The message of the bspflow::Error `f` throws; "<no error>" if it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const bspflow::Error& e) {
    return e.what();
  }
  return "<no error>";
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace test
