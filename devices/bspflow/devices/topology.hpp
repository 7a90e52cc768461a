/// @file
/// Topology: the machine's cores and NUMA nodes, discovered once with hwloc, and the placement
/// policy for emulated devices. hwloc itself is included by topology.cpp alone.
/// Guide: devices/README.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bspflow/base/wait_policy.hpp"

namespace bspflow {

/// One physical core.
struct CoreInfo {
  std::uint32_t index = 0;     ///< logical core index 0..cores()-1
  std::uint32_t first_pu = 0;  ///< OS index of the core's first hardware thread
  std::uint32_t pus = 1;       ///< hardware threads on the core
  int numa_node = 0;           ///< OS index of the NUMA node that holds the core
};

/// Where one device runs.
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct Placement {
  /// The device's index in its group.
  std::uint32_t device = 0;
  std::optional<std::uint32_t> core;  ///< nullopt: unpinned
  /// The NUMA node of the device's core, where its memory is reserved.
  int numa_node = 0;
  std::uint32_t sharing = 1;  ///< devices placed on this core (1 = a core of its own)
  bool shares_host = false;   ///< on a core reserved for host threads (or unpinned beside them)
  /// Whether a thread on this placement must not spin long (it would take the core from a
  /// device or host thread beside it): waits yield, and spin budgets are capped.
  bool shares_core() const noexcept { return sharing > 1 || shares_host; }
  /// How a thread on this placement should wait, given `policy`: as is on a core of its own,
  /// else policy.capped_for_sharing() (beside a host thread, or beside devices only).
  WaitPolicy wait_policy(const WaitPolicy& policy) const noexcept {
    if (!shares_core()) return policy;
    return policy.capped_for_sharing(shares_host ? CoreSharing::kHostThread
                                                 : CoreSharing::kDevices);
  }
};

/// The machine's cores and NUMA nodes, and the placement policy: device i goes on its own
/// physical core, taken from the highest core down (core 0 is where the host's main thread and
/// the OS usually run), skipping the cores the application keeps for its own host threads
/// (DeviceConfig::host_cores). Devices go there only when every core is kept, and then say so
/// (Placement::shares_host), so they never spin long on a core a host thread uses. When
/// devices outnumber the cores left they share cores round-robin; every wait in bspflow spins
/// only briefly before parking there, so nothing livelocks. Without hwloc (a build with the
/// option -Dhwloc=disabled, or discovery failed) devices run unpinned.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Topology {
 public:
  /// Discovers the topology on the first call, then returns it. A call made while the first
  /// one discovers waits for it.
  /// Contract: any; blocks; allocates; throws bad_alloc.
  static const Topology& get();

  /// Whether hwloc discovered the topology (false: devices run unpinned).
  bool has_hwloc() const noexcept { return hwloc_ != nullptr; }
  /// The machine's physical cores.
  std::uint32_t cores() const noexcept { return static_cast<std::uint32_t>(cores_.size()); }
  /// The machine's hardware threads (processing units).
  std::uint32_t pus() const noexcept { return pus_; }
  /// The machine's NUMA nodes (at least 1).
  std::uint32_t numa_nodes() const noexcept { return numa_nodes_; }

  /// Where `devices` devices would be placed (see the policy above), keeping off `host_cores`
  /// where it can, on this process's cores (instance_cores()). Pure; logs nothing. Throws
  /// bspflow::Error if a host core is not below cores().
  /// Contract: any; non-blocking; allocates; throws Error.
  std::vector<Placement> place(std::uint32_t devices, bool pin = true,
                               const std::vector<std::uint32_t>& host_cores = {}) const;

  /// Binds the calling thread to `core`'s first hardware thread. Returns false (and leaves
  /// the thread unpinned) without hwloc or if the OS refuses.
  /// Contract: any; non-blocking; allocates; noexcept.
  bool pin_current_thread(std::uint32_t core) const noexcept;
  /// The core the calling thread is bound to, when its affinity is one hardware thread of one
  /// core (as pin_current_thread() leaves it); nullopt otherwise. One system call.
  std::optional<std::uint32_t> current_thread_core() const noexcept;

  /// `bytes` of memory bound to `numa_node` (plain anonymous memory without hwloc). Pages are
  /// committed on first touch. Throws std::bad_alloc on failure.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  void* allocate(std::size_t bytes, int numa_node) const;
  /// Gives back `bytes` of memory that allocate() returned.
  void release(void* ptr, std::size_t bytes) const noexcept;
  /// This machine's memory in bytes (the larger of the physical pages the OS reports and
  /// hwloc's total; 0 if neither says).
  std::size_t memory_bytes() const noexcept;
  /// NUMA node `numa_node`'s own memory in bytes (0 if unknown: no hwloc, or no such node).
  std::size_t numa_node_memory_bytes(int numa_node) const noexcept;

  /// "2 cores (2 hardware threads), 1 NUMA node, hwloc API 2.9.0" plus one line per core and
  /// the cores this process's devices take.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;

  /// The cores this process's devices may take (ascending), and why. Several instances of
  /// a multi-process run (mpirun) on one host must not pin devices onto the same core: a
  /// binding the launcher already made (mpirun --bind-to core) is honoured (the cores the
  /// process may run on); otherwise, under Open MPI with several processes on this host
  /// (OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE), instance i of L takes the i-th of L equal
  /// slices of the cores (core i mod cores when there are more instances than cores);
  /// otherwise every core. Found once, when the topology is discovered.
  const std::vector<std::uint32_t>& instance_cores() const noexcept { return instance_cores_; }
  /// Why instance_cores() holds those cores ("every core (one instance on this host)").
  const std::string& instance_cores_reason() const noexcept { return instance_reason_; }
  /// The slice rule above, pure: the cores of instance `local_index` of `local_count` on a
  /// host of `cores` cores. Throws bspflow::Error unless local_index < local_count and
  /// cores >= 1.
  /// Contract: any; non-blocking; allocates; throws Error.
  static std::vector<std::uint32_t> slice_for_instance(std::uint32_t cores,
                                                       std::uint32_t local_index,
                                                       std::uint32_t local_count);

  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

 private:
  Topology();
  void find_instance_cores();  ///< sets instance_cores_ and instance_reason_
  void* hwloc_ = nullptr;      ///< hwloc_topology_t, kept opaque so hwloc stays in topology.cpp
  std::vector<CoreInfo> cores_;
  std::uint32_t pus_ = 1;
  std::uint32_t numa_nodes_ = 1;
  std::vector<std::uint32_t> instance_cores_;
  std::string instance_reason_;
};

}  // namespace bspflow
