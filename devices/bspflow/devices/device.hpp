/// @file
/// Device: one emulated IPU. A worker thread pinned (with hwloc) to its own core where
/// there are enough cores, a memory arena on that core's NUMA node, and a tile budget.
/// Work reaches the device as jobs, run one at a time in submission order on its thread.
///
/// DeviceGroup: several devices placed by the Topology policy (see topology.hpp); a loop
/// over a group runs one replica per device.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/arena.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/devices/device_model.hpp"
#include "bspflow/devices/device_tunables.hpp"
#include "bspflow/devices/modeled_clock.hpp"
#include "bspflow/devices/topology.hpp"

namespace bspflow {

/// One device's shape: its memory, its pinning and the IPU its clock models.
struct DeviceConfig {
  std::uint32_t tiles = tunables::kDefaultTiles;  ///< 1..kMaxTiles
  /// Memory per tile, kArenaAlignment..kMaxBytesPerTile.
  std::size_t bytes_per_tile = tunables::kDefaultBytesPerTile;
  bool pin = true;  ///< pin the worker thread to its placed core (needs hwloc)
  /// Cores the application keeps for its own host threads (clients, the I/O engine's
  /// neighbours): devices are placed on other cores, and a device that must sit on one of
  /// these never spins long there (Placement::shares_host). Each must be below the core count.
  std::vector<std::uint32_t> host_cores{};
  /// What a real IPU would take for the work the device declares (the modeled clock; the Mk2's
  /// figures by default, see device_model.hpp).
  DeviceModel model{};
  /// Checks every field (the model's too): a bspflow::Error names the field, the value and
  /// the allowed range.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
  /// The device's memory: tiles x bytes_per_tile.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t memory_bytes() const noexcept { return std::size_t{tiles} * bytes_per_tile; }
};

/// A unit of work for a device thread. `run` executes on the device thread; `cancel` may be
/// called from any thread (the device's destructor calls it for queued and running jobs) and
/// must make `run` return promptly.
struct DeviceJob {
  std::function<void()> run;     ///< The work; runs on the device thread.
  std::function<void()> cancel;  ///< Makes a running `run` return promptly; any thread.
};

/// One emulated IPU: a worker thread that runs the device's jobs, its memory arena and its
/// modeled clock.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Device {
 public:
  /// Validates `config`, reserves the arena (an OutOfMemoryError when the machine, its NUMA
  /// node or the system cannot hold it), starts and pins the worker thread.
  /// Without an explicit placement, device `id` takes the place the Topology policy gives
  /// device `id` of a group (device 0: the highest core).
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit Device(std::uint32_t id, const DeviceConfig& config = {},
                  std::optional<Placement> placement = std::nullopt);
  /// Cancels queued and running jobs, waits until they return, joins the thread.
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// Queues a job. Jobs run in submission order. Throws bspflow::Error if the device is
  /// being destroyed.
  /// Contract: any; non-blocking; allocates; throws Error.
  void submit(DeviceJob job);

  /// The device's number, as given to the constructor.
  std::uint32_t id() const noexcept { return id_; }
  /// The shape the device was built with.
  const DeviceConfig& config() const noexcept { return config_; }
  /// Where the device sits: its core, NUMA node and whether it shares the core.
  const Placement& placement() const noexcept { return placement_; }
  /// The device's memory.
  Arena& arena() noexcept { return arena_; }
  /// The time a real IPU would have taken for the device's last run. The runtime resets and
  /// advances it on the device thread during a run; any thread may read it once the run has
  /// ended.
  /// Contract: device; non-blocking; no-alloc; noexcept.
  ModeledClock& clock() noexcept { return clock_; }
  /// The same clock, read-only.
  const ModeledClock& clock() const noexcept { return clock_; }
  /// Whether the worker thread is actually pinned (false without hwloc, or if refused).
  /// Waits until the thread has tried.
  /// Contract: any; blocks; no-alloc; noexcept.
  bool pinned() const noexcept;
  /// True on this device's worker thread.
  bool on_device_thread() const noexcept { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void thread_main();

  const std::uint32_t id_;
  const DeviceConfig config_;
  const Placement placement_;
  Arena arena_;
  ModeledClock clock_;

  /// The mailbox: jobs under a mutex (taken once per host call by the host and once per job
  /// by the device thread), plus a seq_cst count the device thread waits on with spin-then-park, so
  /// a host that launches loop after loop finds the device still spinning, not asleep.
  mutable std::mutex mutex_;
  /// Queued jobs: jobs_[next_job_..] (under mutex_). A vector whose room is kept (cleared once
  /// every job was taken): the device thread never frees a block the submitting thread
  /// allocated (a std::deque would, every few jobs, and the two threads would meet on the
  /// allocator's lock).
  std::vector<DeviceJob> jobs_;
  std::size_t next_job_ = 0;
  DeviceJob* running_ = nullptr;
  bool stopping_ = false;
  std::atomic<std::uint64_t> submitted_{0};  ///< jobs submitted, or stop requests
  detail::WaitPoint mailbox_;
  std::atomic<int> pin_state_{0};  ///< 0 = not tried yet, 1 = pinned, 2 = unpinned
  mutable detail::WaitPoint started_;
  std::thread thread_;
};

/// Several devices placed by the Topology policy (see topology.hpp); a loop over a group runs
/// one replica per device.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class DeviceGroup {
 public:
  /// `count` devices (1..kMaxReplicas) placed by Topology::place; logs a warning when they
  /// must share cores, or when together they hold more memory than the machine has.
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit DeviceGroup(std::uint32_t count, const DeviceConfig& config = {});

  /// How many devices the group holds.
  std::uint32_t size() const noexcept { return static_cast<std::uint32_t>(devices_.size()); }
  /// Device `i` (below size()).
  Device& operator[](std::uint32_t i) noexcept { return *devices_[i]; }
  /// Device `i` (below size()), read-only.
  const Device& operator[](std::uint32_t i) const noexcept { return *devices_[i]; }
  /// The first of the devices, in order; each element is a std::unique_ptr<Device>.
  auto begin() noexcept { return devices_.begin(); }
  /// Past the last of the devices.
  auto end() noexcept { return devices_.end(); }
  /// Devices per core at the most (1 = every device has a core of its own).
  std::uint32_t max_sharing() const noexcept { return max_sharing_; }

 private:
  std::vector<std::unique_ptr<Device>> devices_;
  std::uint32_t max_sharing_ = 1;
};

/// What a run uses: one Device, or every device of a DeviceGroup (implicit from either), in
/// order; replica r runs on element r.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class DeviceList {
 public:
  // A device, or a group, converts to a list where a list is taken (NOLINT below:
  // google-explicit-constructor).
  /// The one device.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  DeviceList(Device& device) : list_{&device} {}  // NOLINT(google-explicit-constructor)
  /// These devices, in this order.
  explicit DeviceList(std::vector<Device*> devices) noexcept : list_(std::move(devices)) {}
  /// Every device of `group`, in order.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  DeviceList(DeviceGroup& group) {  // NOLINT(google-explicit-constructor)
    for (auto& d : group) list_.push_back(d.get());
  }
  /// How many devices the list holds.
  std::uint32_t size() const noexcept { return static_cast<std::uint32_t>(list_.size()); }
  /// Device `i` (below size()): the device replica `i` runs on.
  Device& operator[](std::uint32_t i) const noexcept { return *list_[i]; }

 private:
  std::vector<Device*> list_;
};

}  // namespace bspflow
