/// @file
/// The Engine: runs one Program per device (`<bspflow/engine/program.hpp>`), with the host
/// link modeled by the I/O engine, I/O tiles, synthetic data, and every phase traced; its
/// config (EngineConfig) and result (EngineResult).
/// Guide: runtime/engine/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/base/stop_flag.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/devices/link_model.hpp"
#include "bspflow/engine/program.hpp"
#include "bspflow/run/internal/run_control.hpp"
#include "bspflow/run/options.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/stall.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

/// What a device generates when synthetic data is on (HostIO::synthetic_data): nothing is
/// copied from the host, the device fills each stream-copy destination once, seeded
/// differently per device and replica.
enum class SyntheticFill { kZeros, kRandomNormal };

/// An Engine run's shape: the host side (HostIO: host_link, io_tiles, prefetch_depth,
/// synthetic_data; for an Engine io_tiles must hold one micro-batch and prefetch_depth counts
/// micro-batches) and the Engine's own fields. EngineConfig::from(options) derives one.
struct EngineConfig : HostIO {
  /// The modeled link between devices: a Copy between devices and an AllReduce take its time.
  LinkModel device_link = LinkModel::device();
  SyntheticFill synthetic_fill = SyntheticFill::kRandomNormal;  ///< with synthetic_data
  std::uint64_t seed = 0;                                       ///< for kRandomNormal
  bool trace = false;      ///< record a trace (also on if BSPFLOW_TRACE is set)
  std::string trace_path;  ///< write it here after each run (BSPFLOW_TRACE=FILE)
  /// When no device moves while every device still running waits (an infeed, an outfeed, a
  /// Sync), for stall.limit: the run logs what each waits for; with OnStall::kFail it also
  /// ends and run() throws StallError (see bspflow/run/stall.hpp). 0 = no check.
  StallCheck stall;

  /// The engine's config from a run's Options: host_io(), device_link, the stall check;
  /// synthetic data generated as random normal. Throws what Options::validate() throws.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static EngineConfig from(const Options& options);
  /// Field ranges (HostIO::validate, the device link, the stall check); throws
  /// bspflow::Error naming the field, the value and what is allowed.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

/// How an Engine run ended (RunResult: status, message, elapsed, host link), and the
/// outermost Repeat trips each device completed.
struct EngineResult : RunResult {
  std::vector<std::uint64_t> iterations;  ///< per device
  /// Each device's modeled clock at its end (RunResult::modeled is the slowest's).
  std::vector<ModeledTime> modeled_by_device;
};

class Engine;
namespace detail {
void name_runs(Engine& engine, std::string name, std::vector<WatchedDevice> devices);
}  // namespace detail

/// Runs one Program per device of its device list, over the modeled host link.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Engine {
 public:
  /// Validates the config (throws bspflow::Error) and starts the I/O engine thread. The
  /// devices must outlive the engine.
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit Engine(const DeviceList& devices, EngineConfig config = {});
  /// Stops the I/O engine thread and waits until it has returned.
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Runs programs[d] on device d and waits until all have ended. Checks the programs first:
  /// I/O tiles must hold the largest host->device micro-batch, sync groups must match the
  /// devices using them, an AllReduce's replicas its sync group's size, buffers must be on
  /// the device that runs them (throws bspflow::Error with a suggestion); a run refused
  /// while it sets up (a lane already has a reader, an outfeed is attached to another run, an
  /// arena too full for the I/O tiles) gives back every lane and byte it took. A vertex or
  /// codelet exception stops every device and is thrown as DeviceError (device, replica,
  /// iteration); every thread is left idle. A run that stalls with OnStall::kFail
  /// (EngineConfig::stall) throws StallError once every device has stopped.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const std::vector<Program>& programs);
  /// run(programs) with `program` on every device.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const Program& program);
  /// Like run(programs), for codelets that wait on something of their own: `wake` (any
  /// thread, must not throw) is called when the run stops early, after the stop flag is set,
  /// so whatever they wait on can let them see it.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const std::vector<Program>& programs, std::function<void()> wake);
  /// Like run(programs, wake), and the calling (host) thread runs `host` once the devices
  /// have started, before it waits for their end: work that must be done on a host thread
  /// while the devices run (a distributed Pipeline's MPI calls). `host` gets the run's stop
  /// flag; it must return once its work is done or the flag is set (`wake` is where to make
  /// it look). If `host` throws, the run is cancelled and, once every device has ended, the
  /// exception is rethrown.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const std::vector<Program>& programs, std::function<void()> wake,
                   const std::function<void(const StopFlag&)>& host);
  /// Each like the overload without `stop`; the run also stops when `stop` is requested:
  /// before the call, while the run is set up, or while the devices run (as cancel() does).
  /// Stopped before any device started, it returns kCancelled with 0 iterations and takes
  /// nothing from any infeed. Waits until every device has ended. Throws what the overload
  /// without `stop` throws. (`wake` and `host` may be null.)
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const std::vector<Program>& programs, std::stop_token stop);
  /// run(program) that also stops when `stop` is requested.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const Program& program, std::stop_token stop);
  /// run(programs, wake, host) that also stops when `stop` is requested.
  /// Contract: host; blocks; allocates; throws Error.
  EngineResult run(const std::vector<Program>& programs, std::function<void()> wake,
                   const std::function<void(const StopFlag&)>& host, std::stop_token stop);

  /// Stops the run of the run() call in progress, from the moment run() is called until it
  /// returns (a cancel() while the run is set up is never lost), at each device's next
  /// Repeat trip or wait; run() then returns RunStatus::kCancelled. Between runs it does
  /// nothing: to stop a run that may not have started yet, give run() a std::stop_token.
  void cancel() noexcept;

  /// Between runs: the last run's trace (nullptr when tracing is off or before the first
  /// run).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  const Trace* trace() const noexcept;
  /// Between runs: the last run's summary (empty when tracing is off).
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  TraceSummary summary() const;

  /// The config the Engine was built with.
  const EngineConfig& config() const noexcept;
  /// How many devices it runs programs on.
  std::uint32_t devices() const noexcept;
  std::uint32_t compute_tiles() const noexcept;  ///< per device: tiles - io_tiles
  /// Whether the I/O engine thread runs with 1 ns timer slack.
  bool low_timer_slack() const noexcept;

  /// The I/O-tile count the rule of thumb gives for one micro-batch of `bytes` on a device
  /// like `config`: the smallest even power of two >= 1.05 x bytes / bytes per tile (at least
  /// 2). nullopt when even the largest allowed count (below the tile count) cannot hold it.
  static std::optional<std::uint32_t> suggest_io_tiles(std::size_t bytes,
                                                       const DeviceConfig& config) noexcept;

 private:
  friend void detail::name_runs(Engine&, std::string, std::vector<detail::WatchedDevice>);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace detail {
/// Runs `program` (a FusedRepeat) as replica `replica` of a run that `control` tracks,
/// through the same interpreter as Engine::run, for loops built elsewhere (loops::repeat).
/// Records into `track` if it is not null. A failure goes to control.fail(), also one in
/// setting the run up; the end is always reported through control.replica_done().
/// Contract: device; blocks; allocates; noexcept.
void run_on_device(Device& device, std::uint32_t replica, const Program& program,
                   RunControl& control, TraceTrack* track) noexcept;
/// Instead of run_on_device when the device refused the job: finishes the program's loops
/// without delivering and reports the replica's end.
/// Contract: host; non-blocking; allocates; noexcept.
void abandon_on_device(Device& device, std::uint32_t replica, const Program& program,
                       RunControl& control) noexcept;
/// Between runs: how the engine's stall reports name its runs and its devices (a
/// Pipeline's: "Pipeline::run", "stage 1 of replica 0"); by default "Engine::run" and
/// "replica d".
/// Contract: host; non-blocking; allocates; throws bad_alloc.
void name_runs(Engine& engine, std::string name, std::vector<WatchedDevice> devices);
}  // namespace detail

}  // namespace bspflow
