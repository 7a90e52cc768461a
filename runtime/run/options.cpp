#include "bspflow/run/options.hpp"

#include <limits>
#include <sstream>

#include "bspflow/base/error.hpp"
#include "bspflow/run/detail/run_monitor.hpp"

namespace bspflow {

namespace {
std::string range(std::uint64_t lo, std::uint64_t hi) {
  return "must be in " + std::to_string(lo) + ".." + std::to_string(hi);
}
}  // namespace

Options& Options::device_iterations(std::uint64_t n) {
  if (n < 1) detail::throw_bad_value("device_iterations", n, "must be at least 1");
  device_iterations_ = n;
  return *this;
}

Options& Options::replicas(std::uint32_t n) {
  if (n < 1 || n > tunables::kMaxReplicas) {
    detail::throw_bad_value("replicas", n, range(1, tunables::kMaxReplicas));
  }
  replicas_ = n;
  return *this;
}

Options& Options::gradient_accumulation(std::uint32_t n) {
  if (n < 1) detail::throw_bad_value("gradient_accumulation", n, "must be at least 1");
  gradient_accumulation_ = n;
  return *this;
}

Options& Options::output_mode(OutputMode mode) noexcept {
  output_mode_ = mode;
  return *this;
}

Options& Options::prefetch_depth(std::uint32_t depth) {
  if (depth < tunables::kMinPrefetchDepth || depth > tunables::kMaxPrefetchDepth) {
    detail::throw_bad_value("prefetch_depth", depth,
                            range(tunables::kMinPrefetchDepth, tunables::kMaxPrefetchDepth));
  }
  host_io_.prefetch_depth = depth;
  return *this;
}

Options& Options::infeed_capacity(std::size_t elements) {
  if (elements < 1 || elements > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("infeed_capacity", elements, range(1, tunables::kMaxQueueCapacity));
  }
  infeed_capacity_ = elements;
  return *this;
}

Options& Options::outfeed_capacity(std::size_t entries) {
  if (entries > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value(
        "outfeed_capacity", entries,
        "must be 0 (unbounded) or at most " + std::to_string(tunables::kMaxQueueCapacity));
  }
  outfeed_capacity_ = entries;
  return *this;
}

Options& Options::io_tiles(std::uint32_t tiles) {
  if (tiles % 2 != 0) {
    detail::throw_bad_value("io_tiles", tiles,
                            "must be 0 or an even number (e.g. " + std::to_string(tiles + 1) + ")");
  }
  host_io_.io_tiles = tiles;
  return *this;
}

Options& Options::host_link(const LinkModel& link) {
  link.validate("host link");
  host_io_.host_link = link;
  return *this;
}

Options& Options::synthetic_data(bool on) noexcept {
  host_io_.synthetic_data = on;
  return *this;
}

Options& Options::precision(const Precision& p) {
  p.validate();
  precision_ = p;
  return *this;
}

Options& Options::tiles(std::uint32_t n) {
  if (n < 1 || n > tunables::kMaxTiles)
    detail::throw_bad_value("tiles", n, range(1, tunables::kMaxTiles));
  tiles_ = n;
  return *this;
}

Options& Options::bytes_per_tile(std::size_t bytes) {
  if (bytes < tunables::kArenaAlignment || bytes > tunables::kMaxBytesPerTile) {
    detail::throw_bad_value("bytes_per_tile", bytes,
                            range(tunables::kArenaAlignment, tunables::kMaxBytesPerTile));
  }
  bytes_per_tile_ = bytes;
  return *this;
}

Options& Options::producer_type(ProducerType type) noexcept {
  producer_type_ = type;
  return *this;
}

Options& Options::consumer_type(ConsumerType type) noexcept {
  consumer_type_ = type;
  return *this;
}

Options& Options::pin(bool on) noexcept {
  pin_ = on;
  return *this;
}

Options& Options::run_stall_limit(std::chrono::nanoseconds limit) {
  StallCheck check = stall_;
  check.limit = limit;
  check.validate();
  stall_ = check;
  return *this;
}

Options& Options::on_stall(OnStall action) noexcept {
  stall_.on_stall = action;
  return *this;
}

void Options::validate() const {
  if (host_io_.io_tiles >= tiles_) {
    detail::throw_bad_value(
        "io_tiles", host_io_.io_tiles,
        "must be below tiles (" + std::to_string(tiles_) + "), leaving tiles for compute");
  }
  if (infeed_capacity_ < host_io_.prefetch_depth) {
    detail::throw_bad_value(
        "infeed_capacity", infeed_capacity_,
        "must be at least prefetch_depth (" + std::to_string(host_io_.prefetch_depth) + ")");
  }
  if (consumer_type_ == ConsumerType::kSingle && outfeed_capacity_ == 0) {
    detail::throw_bad_value("outfeed_capacity", outfeed_capacity_,
                            "must be at least 1 with consumer_type(ConsumerType::kSingle): each "
                            "replica writes into a ring, which needs a bound (0 = unbounded needs "
                            "ConsumerType::kMulti)");
  }
}

std::uint64_t Options::samples_per_step(std::uint64_t micro_batch) const {
  if (micro_batch < 1) detail::throw_bad_value("micro_batch", micro_batch, "must be at least 1");
  std::uint64_t out = micro_batch;
  for (std::uint64_t f :
       {device_iterations_, std::uint64_t{gradient_accumulation_}, std::uint64_t{replicas_}}) {
    if (out > std::numeric_limits<std::uint64_t>::max() / f) {
      throw Error(
          "samples per step overflows 64 bits: micro_batch x device_iterations x "
          "gradient_accumulation x replicas is too large");
    }
    out *= f;
  }
  return out;
}

InfeedConfig Options::infeed_config() const {
  validate();
  InfeedConfig c{replicas_, infeed_capacity_, host_io_.prefetch_depth};
  c.producer_type = producer_type_;
  return c;
}

OutfeedConfig Options::outfeed_config() const {
  validate();
  return OutfeedConfig{replicas_, output_mode_, outfeed_capacity_, consumer_type_};
}

DeviceConfig Options::device_config() const {
  validate();
  DeviceConfig c{tiles_, bytes_per_tile_, pin_};
  c.model = device_model_;
  return c;
}

HostIO Options::host_io() const {
  validate();
  return host_io_;
}

Options& Options::device_model(const DeviceModel& model) {
  model.validate();
  device_model_ = model;
  return *this;
}

Options& Options::device_link(const LinkModel& link) {
  link.validate("device link");
  device_link_ = link;
  return *this;
}

std::string Options::describe() const {
  std::ostringstream os;
  os << "device_iterations = " << device_iterations_ << '\n'
     << "replicas = " << replicas_ << '\n'
     << "gradient_accumulation = " << gradient_accumulation_ << '\n'
     << "output_mode = " << output_mode_.to_string() << '\n'
     << "prefetch_depth = " << host_io_.prefetch_depth << '\n'
     << "infeed_capacity = " << infeed_capacity_ << '\n'
     << "outfeed_capacity = " << outfeed_capacity_ << (outfeed_capacity_ == 0 ? " (unbounded)" : "")
     << '\n'
     << "producer_type = " << (producer_type_ == ProducerType::kSingle ? "single" : "multi") << '\n'
     << "consumer_type = " << (consumer_type_ == ConsumerType::kSingle ? "single" : "multi") << '\n'
     << "io_tiles = " << host_io_.io_tiles << '\n'
     << "host_link = " << host_io_.host_link.describe() << '\n'
     << "synthetic_data = " << (host_io_.synthetic_data ? "true" : "false") << '\n'
     << "tiles = " << tiles_ << '\n'
     << "bytes_per_tile = " << bytes_per_tile_ << '\n'
     << "pin = " << (pin_ ? "true" : "false") << '\n'
     << "device_model = " << device_model_.describe() << '\n'
     << "device_link = " << device_link_.describe() << '\n'
     << "precision = storage " << to_string(precision_.storage) << ", partials "
     << to_string(precision_.partials) << ", loss scaling " << precision_.loss_scaling << '\n'
     << "run_stall_limit = " << detail::describe_duration(stall_.limit)
     << (stall_.limit.count() == 0 ? " (no check)" : "") << '\n'
     << "on_stall = " << (stall_.on_stall == OnStall::kFail ? "fail" : "log") << '\n';
  return os.str();
}

}  // namespace bspflow
