// The base room's logging: levels, the handler, the filter (bspflow/base/log.hpp).
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include <bspflow/base/log.hpp>

using namespace bspflow;

TEST_SUITE_BEGIN("log");

TEST_CASE("messages below the level are dropped; the handler gets the rest") {
  std::vector<std::pair<LogLevel, std::string>> seen;
  const LogLevel before = log_level();
  set_log_handler([&](LogLevel l, std::string_view m) { seen.emplace_back(l, std::string(m)); });
  set_log_level(LogLevel::kInfo);
  log(LogLevel::kDebug, "hidden");
  log(LogLevel::kInfo, "shown");
  log(LogLevel::kError, "also shown");
  log(LogLevel::kOff, "never");
  set_log_level(LogLevel::kOff);
  log(LogLevel::kError, "off");
  set_log_handler(nullptr);
  set_log_level(before);
  REQUIRE(seen.size() == 2);
  CHECK(seen[0] == std::pair<LogLevel, std::string>{LogLevel::kInfo, "shown"});
  CHECK(seen[1] == std::pair<LogLevel, std::string>{LogLevel::kError, "also shown"});
}

TEST_CASE("log_once says each distinct message once per process") {
  std::vector<std::string> seen;
  set_log_handler([&](LogLevel, std::string_view m) { seen.emplace_back(m); });
  CHECK(log_once(LogLevel::kWarning, "log_once test: cause A"));
  CHECK_FALSE(log_once(LogLevel::kWarning, "log_once test: cause A"));
  CHECK(log_once(LogLevel::kWarning, "log_once test: cause B"));
  CHECK(log_once(LogLevel::kError, "log_once test: cause A"));  // another level: another cause
  set_log_handler(nullptr);
  CHECK(seen == std::vector<std::string>{"log_once test: cause A", "log_once test: cause B",
                                         "log_once test: cause A"});
}

TEST_CASE("levels have names") {
  CHECK(to_string(LogLevel::kDebug) == "debug");
  CHECK(to_string(LogLevel::kWarning) == "warning");
  CHECK(to_string(LogLevel::kOff) == "off");
}

TEST_SUITE_END();
