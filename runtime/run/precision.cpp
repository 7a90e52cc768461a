// Precision's checks (see bspflow/run/precision.hpp).
#include "bspflow/run/precision.hpp"

#include <cmath>
#include <sstream>

#include "bspflow/base/error.hpp"

namespace bspflow {

void Precision::validate() const {
  auto check_type = [](const char* field, DType t) {
    if (t != DType::kFloat32 && t != DType::kFloat16) {
      detail::throw_bad_value(field, to_string(t), "must be fp32 or fp16");
    }
  };
  check_type("precision.storage", storage);
  check_type("precision.partials", partials);
  if (!(loss_scaling > 0.0f) || !std::isfinite(loss_scaling)) {
    std::ostringstream os;
    os << loss_scaling;
    detail::throw_bad_value("precision.loss_scaling", os.str(),
                            "must be finite and above 0 (1 = no scaling)");
  }
}

}  // namespace bspflow
