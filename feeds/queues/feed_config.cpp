// Infeed and outfeed config checks (see bspflow/feeds/infeed_queue.hpp, outfeed_queue.hpp).
#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"

namespace bspflow {

namespace {

void check_replicas(std::uint32_t replicas) {
  if (replicas < 1 || replicas > tunables::kMaxReplicas) {
    detail::throw_bad_value("replicas", replicas,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
}

}  // namespace

void InfeedConfig::validate() const {
  check_replicas(replicas);
  if (prefetch_depth < tunables::kMinPrefetchDepth ||
      prefetch_depth > tunables::kMaxPrefetchDepth) {
    detail::throw_bad_value("prefetch_depth", prefetch_depth,
                            "must be in " + std::to_string(tunables::kMinPrefetchDepth) + ".." +
                                std::to_string(tunables::kMaxPrefetchDepth));
  }
  if (capacity < prefetch_depth || capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("infeed capacity", capacity,
                            "must be in prefetch_depth (" + std::to_string(prefetch_depth) + ").." +
                                std::to_string(tunables::kMaxQueueCapacity) +
                                " elements per replica");
  }
}

void OutfeedConfig::validate() const {
  check_replicas(replicas);
  if (consumer_type == ConsumerType::kSingle) {
    if (capacity < 1 || capacity > tunables::kMaxQueueCapacity) {
      detail::throw_bad_value("outfeed capacity", capacity,
                              "must be in 1.." + std::to_string(tunables::kMaxQueueCapacity) +
                                  " entries per replica with ConsumerType::kSingle (each "
                                  "replica writes into a ring, which needs a bound; 0 = "
                                  "unbounded needs ConsumerType::kMulti)");
    }
  } else if (capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("outfeed capacity", capacity,
                            "must be 0 (unbounded) or at most " +
                                std::to_string(tunables::kMaxQueueCapacity) + " entries");
  }
}

}  // namespace bspflow
