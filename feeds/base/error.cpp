// Error helpers shared by every room (see bspflow/base/error.hpp).
#include <cstdio>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {
namespace detail {

void throw_bad_value(std::string_view name, std::string_view given, std::string_view allowed) {
  std::string msg;
  msg.append(name).append(" = ").append(given).append(" is not allowed: ").append(allowed);
  throw Error(msg);
}

void throw_bad_value(std::string_view name, std::chrono::nanoseconds given,
                     std::string_view allowed) {
  throw_bad_value(name, std::string_view(describe_duration(given)), allowed);
}

std::string describe_duration(std::chrono::nanoseconds d) {
  const std::int64_t ns = d.count();
  char text[48];
  auto in = [&](double unit, const char* name) {
    std::snprintf(text, sizeof text, "%.4g %s", static_cast<double>(ns) / unit, name);
    return std::string(text);
  };
  const std::int64_t size = ns < 0 ? -ns : ns;
  if (size >= 1'000'000'000) return in(1e9, "s");
  if (size >= 1'000'000) return in(1e6, "ms");
  if (size >= 1'000) return in(1e3, "us");
  return std::to_string(ns) + " ns";
}

std::string count_of(std::uint64_t n, std::string_view noun) {
  std::string out = std::to_string(n);
  out.append(" ").append(noun);
  if (n != 1) out.append("s");
  return out;
}

std::string describe_exception(const std::exception_ptr& e) {
  if (!e) return "no exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

}  // namespace detail

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit]);
  }
  return buf;
}

}  // namespace bspflow
