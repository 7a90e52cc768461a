/// @file
/// LoaderConfig: what a DataLoader is asked for (batch size, shuffling, workers, mode, the
/// instance it is), and StepShape: the run shape it fills (device iterations, gradient
/// accumulation, replicas; bspflow::Options has them). See `<bspflow/data/data_loader.hpp>`.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "bspflow/base/tunables.hpp"
#include "bspflow/data/tensor.hpp"

namespace bspflow {

/// kSync: a step loads when asked, on the calling thread plus helpers. kAsync: worker threads
/// load steps ahead into a ring.
enum class LoaderMode { kSync, kAsync };
/// "sync" or "async".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(LoaderMode m) noexcept;

/// A plain value type; the loader copies it. validate() states the rules.
struct LoaderConfig {
  std::size_t batch_size = 1;  ///< micro-batch, samples; >= 1
  bool shuffle = false;        ///< random-access datasets only (checked by DataLoader)
  std::uint64_t seed = 0;      ///< shuffle seed
  bool drop_last = true;       ///< false: pad the last step (label -1)
  /// kAsync: 1..kMaxLoaderWorkers; kSync: helpers, 0..kMaxLoaderWorkers. A streaming
  /// dataset needs exactly 1 (kAsync) or 0 (kSync).
  std::uint32_t num_workers = 0;
  LoaderMode mode = LoaderMode::kSync;  ///< when and on which threads steps load
  /// kAsync: steps loaded ahead, 1..kMaxLoaderBuffer (kSync ignores it: one step at a time).
  std::uint32_t buffer_size = tunables::kDefaultLoaderBuffer;
  bool early_preload = false;  ///< kAsync only: start loading at construction
  /// kAsync only: keep loading across epoch ends (needs persistent_workers).
  bool load_indefinitely = false;
  bool persistent_workers = true;  ///< kAsync: keep workers between epochs
  /// kAsync: workers run at background priority (Linux SCHED_IDLE): they take every core
  /// time nothing else wants, and give a core up at once to the consumer or a device that
  /// wakes. Off: normal priority, so they compete with them for the cores (a woken consumer
  /// can wait a worker's time slice, a millisecond or more, when workers outnumber cores).
  bool background_workers = true;
  std::optional<DType> output_dtype;  ///< convert samples to this type (default: keep)
  /// Several processes (Instance, `<bspflow/instance/instance.hpp>`): this loader is instance
  /// `instance` of `instances` and loads its part of every epoch. Every instance shuffles
  /// the whole dataset with the same seed, then takes its own contiguous slice of that
  /// order, so no sample is seen twice or by no one: with drop_last each instance takes
  /// size / instances samples and steps() is the same everywhere (what is dropped, the
  /// remainder included, is counted by dropped() and logged once, by instance 0); without
  /// it the first size % instances instances take one sample more and every instance pads
  /// to the same number of steps. The replicas of the run shape are this instance's local
  /// replicas. instances 1..kMaxReplicas, instance below it.
  std::uint32_t instance = 0;
  std::uint32_t instances = 1;  ///< how many instances share the dataset
  /// Checks every field, and options that conflict (the message names them).
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

/// The run shape a loader fills: anything with device_iterations(), gradient_accumulation()
/// and replicas() (bspflow::Options), or a StepShape. Checked by the loader: device
/// iterations and gradient accumulation >= 1, replicas 1..kMaxReplicas.
struct StepShape {
  std::uint64_t device_iterations = 1;      ///< loop trips per host call
  std::uint32_t gradient_accumulation = 1;  ///< micro-batches per replica per weight update
  std::uint32_t replicas = 1;               ///< replicas the loader feeds
};
template <class O>
concept RunShape = requires(const O& o) {
  { o.device_iterations() } -> std::convertible_to<std::uint64_t>;
  { o.gradient_accumulation() } -> std::convertible_to<std::uint32_t>;
  { o.replicas() } -> std::convertible_to<std::uint32_t>;
};
/// The shape of `o`. It throws only what o's getters throw (bspflow::Options's never do):
/// noexcept when they are.
/// Contract: any; non-blocking; no-alloc; noexcept.
template <RunShape O>
StepShape step_shape(const O& o) noexcept(noexcept(StepShape{
    static_cast<std::uint64_t>(o.device_iterations()),
    static_cast<std::uint32_t>(o.gradient_accumulation()),
    static_cast<std::uint32_t>(o.replicas())})) {
  return StepShape{static_cast<std::uint64_t>(o.device_iterations()),
                   static_cast<std::uint32_t>(o.gradient_accumulation()),
                   static_cast<std::uint32_t>(o.replicas())};
}
/// `s` itself.
/// Contract: any; non-blocking; no-alloc; noexcept.
inline StepShape step_shape(const StepShape& s) noexcept {
  return s;
}

}  // namespace bspflow
