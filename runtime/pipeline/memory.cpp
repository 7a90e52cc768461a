// The memory report (see bspflow/pipeline/memory.hpp): sums, and the text a user reads.
#include "bspflow/pipeline/memory.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "bspflow/base/error.hpp"

namespace bspflow {

const char* to_string(MemoryCategory c) noexcept {
  switch (c) {
    case MemoryCategory::kParameters:
      return "parameters";
    case MemoryCategory::kOptimizerState:
      return "optimiser state";
    case MemoryCategory::kGradients:
      return "gradients";
    case MemoryCategory::kActivationStash:
      return "activation stash";
    case MemoryCategory::kExchange:
      return "exchange";
    case MemoryCategory::kWorking:
      return "working";
    case MemoryCategory::kIoTiles:
      return "I/O tiles";
  }
  return "?";
}

const char* to_string(Liveness l) noexcept {
  switch (l) {
    case Liveness::kAlways:
      return "always live";
    case Liveness::kCompute:
      return "compute phase";
    case Liveness::kPass:
      return "during its stage's passes";
    case Liveness::kUpdate:
      return "update phase";
  }
  return "?";
}

std::size_t DeviceMemory::always_live() const noexcept {
  return phase(Liveness::kAlways);
}

std::size_t DeviceMemory::phase(Liveness l) const noexcept {
  std::size_t sum = 0;
  for (const TensorMemory& t : tensors) {
    if (t.liveness == l) sum += t.bytes;
  }
  return sum;
}

std::size_t DeviceMemory::compute_peak() const noexcept {
  // Stages on one device run their passes one at a time: the largest stage's pass memory.
  std::size_t largest = 0;
  for (const TensorMemory& t : tensors) {
    if (t.liveness != Liveness::kPass) continue;
    std::size_t stage = 0;
    for (const TensorMemory& u : tensors) {
      if (u.liveness == Liveness::kPass && u.stage == t.stage && u.replica == t.replica)
        stage += u.bytes;
    }
    largest = std::max(largest, stage);
  }
  return phase(Liveness::kCompute) + largest;
}

std::size_t DeviceMemory::not_always_live() const noexcept {
  return std::max(compute_peak(), phase(Liveness::kUpdate));
}

std::size_t DeviceMemory::category(MemoryCategory c) const noexcept {
  std::size_t sum = 0;
  for (const TensorMemory& t : tensors) {
    if (t.category == c) sum += t.bytes;
  }
  return sum;
}

bool MemoryReport::fits() const noexcept {
  return std::all_of(devices.begin(), devices.end(),
                     [](const DeviceMemory& d) { return d.fits(); });
}

std::size_t MemoryReport::peak() const noexcept {
  std::size_t most = 0;
  for (const DeviceMemory& d : devices) most = std::max(most, d.peak());
  return most;
}

std::string MemoryReport::to_string(std::size_t largest) const {
  std::ostringstream os;
  os << "memory (storage " << bspflow::to_string(precision.storage) << ", partials "
     << bspflow::to_string(precision.partials);
  if (precision.loss_scaling != 1.0f) os << ", loss scaling " << precision.loss_scaling;
  os << ")\n";
  for (const DeviceMemory& d : devices) {
    os << "  device " << d.device << ": peak " << format_bytes(d.peak()) << " of "
       << format_bytes(d.capacity) << (d.fits() ? " (fits)" : " (DOES NOT FIT)") << "; always live "
       << format_bytes(d.always_live()) << ", not always live " << format_bytes(d.not_always_live())
       << " (compute phase " << format_bytes(d.compute_peak()) << ", update phase "
       << format_bytes(d.phase(Liveness::kUpdate)) << ")\n    by category:";
    bool any = false;
    for (std::size_t c = 0; c < kMemoryCategories; ++c) {
      const auto cat = static_cast<MemoryCategory>(c);
      const std::size_t bytes = d.category(cat);
      if (bytes == 0) continue;
      os << (any ? ", " : " ") << bspflow::to_string(cat) << " " << format_bytes(bytes);
      any = true;
    }
    if (!any) os << " nothing";
    os << "\n";
    for (std::size_t i = 0; i < d.tensors.size() && i < largest; ++i) {
      const TensorMemory& t = d.tensors[i];
      os << "    " << format_bytes(t.bytes) << "  " << t.name << " ("
         << bspflow::to_string(t.liveness) << ")\n";
    }
    if (d.tensors.size() > largest)
      os << "    ... and " << d.tensors.size() - largest << " smaller tensor(s)\n";
  }
  if (!suggestions.empty()) {
    os << "  what would help:\n";
    for (const std::string& s : suggestions) os << "    - " << s << "\n";
  }
  return os.str();
}

}  // namespace bspflow
