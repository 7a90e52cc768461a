// Output modes (see bspflow/feeds/output_mode.hpp).
#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/feeds/output_mode.hpp"

namespace bspflow {

OutputMode OutputMode::every_n(std::uint64_t n) {
  if (n == 0) detail::throw_bad_value("OutputMode every_n(n): n", n, "must be at least 1");
  return OutputMode(Kind::kEveryN, n);
}

OutputMode OutputMode::parse(std::string_view text) {
  if (text == "all") return all();
  if (text == "final") return final();
  if (text == "sum") return sum();
  constexpr std::string_view kEvery = "every_n:";
  if (text.substr(0, kEvery.size()) == kEvery) {
    const std::string digits(text.substr(kEvery.size()));
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos &&
        digits.size() < 19) {
      return every_n(std::stoull(digits));
    }
  }
  detail::throw_bad_value("output mode", "'" + std::string(text) + "'",
                          "use all, final, sum or every_n:N with N >= 1");
}

std::string OutputMode::to_string() const {
  switch (kind_) {
    case Kind::kAll:
      return "all";
    case Kind::kFinal:
      return "final";
    case Kind::kSum:
      return "sum";
    case Kind::kEveryN:
      return "every_n:" + std::to_string(n_);
  }
  return "?";
}

}  // namespace bspflow
