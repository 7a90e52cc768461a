// Synthetic data on a device (see detail/device_run.hpp): each stream-copy destination filled
// once, seeded from the engine's seed, the device and the replica.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "bspflow/base/detail/random.hpp"
#include "bspflow/engine/detail/device_run.hpp"

namespace bspflow::detail {

namespace {

std::uint64_t mix_seed(std::uint64_t seed, std::uint32_t device, std::uint32_t replica) {
  std::uint64_t s =
      seed ^ (std::uint64_t{device} << 32) ^ (std::uint64_t{replica} * 0x9E3779B97F4A7C15ULL);
  detail::splitmix64(s);
  return detail::splitmix64(s);
}

void fill_synthetic(DeviceBuffer& b, SyntheticFill kind, std::uint64_t seed) {
  if (kind == SyntheticFill::kZeros) {
    std::memset(b.raw().data(), 0, b.bytes());
    return;
  }
  std::uint64_t state = seed;
  auto uniform = [&] {  // (0, 1]
    return (static_cast<double>(detail::splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
  };
  auto normal = [&] {  // Box-Muller; one value per call is plenty here
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  };
  switch (b.dtype()) {
    case DType::kFloat32:
      for (float& v : b.as<float>()) v = static_cast<float>(normal());
      break;
    case DType::kFloat16:
      for (std::uint16_t& v : b.as<std::uint16_t>()) v = to_half(static_cast<float>(normal()));
      break;
    case DType::kUint8:  // pixels: around mid-grey
      for (std::uint8_t& v : b.as<std::uint8_t>()) {
        v = static_cast<std::uint8_t>(std::clamp(std::lround(128.0 + 32.0 * normal()), 0L, 255L));
      }
      break;
    case DType::kInt32:
      for (std::int32_t& v : b.as<std::int32_t>())
        v = static_cast<std::int32_t>(std::lround(normal() * 100));
      break;
  }
}

}  // namespace

bool DeviceRun::synthesize(DeviceBuffer& buf) {
  if (!synthesized_.insert(&buf).second) return true;  // filled once, then left in place
  const Clock::time_point t0 = track_ ? Clock::now() : Clock::time_point{};
  fill_synthetic(buf, eng_.config.synthetic_fill, mix_seed(eng_.config.seed, device_.id(), index_));
  if (track_)
    track_->record(Phase::kCompute, t0, Clock::now(), 0, track_->add_label("synthetic data"));
  return true;
}

}  // namespace bspflow::detail
