// Topology discovery and thread/memory binding. hwloc is included here and nowhere else.
#include "bspflow/devices/topology.hpp"

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <sstream>
#include <thread>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"

#if BSPFLOW_HAVE_HWLOC
#include <hwloc.h>
#endif

namespace bspflow {

#if BSPFLOW_HAVE_HWLOC
namespace {
hwloc_topology_t as_topo(void* p) {
  return static_cast<hwloc_topology_t>(p);
}
}  // namespace
#endif

Topology::Topology() {
#if BSPFLOW_HAVE_HWLOC
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    hwloc_ = topo;
    const int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    const int npus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
    const int nnuma = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    pus_ = npus > 0 ? static_cast<std::uint32_t>(npus) : 1;
    numa_nodes_ = nnuma > 0 ? static_cast<std::uint32_t>(nnuma) : 1;
    for (int i = 0; i < ncores; ++i) {
      hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, static_cast<unsigned>(i));
      CoreInfo info;
      info.index = static_cast<std::uint32_t>(i);
      const int first = hwloc_bitmap_first(core->cpuset);
      info.first_pu = first >= 0 ? static_cast<std::uint32_t>(first) : 0;
      const int weight = hwloc_bitmap_weight(core->cpuset);
      info.pus = weight > 0 ? static_cast<std::uint32_t>(weight) : 1;
      // The NUMA node whose cpuset contains this core (nodes hang off non-leaf objects).
      for (int n = 0; n < nnuma; ++n) {
        hwloc_obj_t node =
            hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(n));
        if (node->cpuset != nullptr && hwloc_bitmap_isincluded(core->cpuset, node->cpuset)) {
          info.numa_node = static_cast<int>(node->os_index);
          break;
        }
      }
      cores_.push_back(info);
    }
    if (!cores_.empty()) {
      find_instance_cores();
      return;
    }
    hwloc_topology_destroy(topo);
    hwloc_ = nullptr;
    log(LogLevel::kWarning, "hwloc found no cores; devices will run unpinned");
  } else {
    if (topo != nullptr) hwloc_topology_destroy(topo);
    log(LogLevel::kWarning, "hwloc topology discovery failed; devices will run unpinned");
  }
#endif
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  pus_ = n;
  numa_nodes_ = 1;
  for (unsigned i = 0; i < n; ++i) cores_.push_back(CoreInfo{i, i, 1, 0});
  find_instance_cores();
}

namespace {
// A non-negative integer from the environment, or nullopt.
std::optional<std::uint32_t> env_count(const char* name) {
  // The library reads the environment and never writes it.
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe)
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long n = std::strtoul(v, &end, 10);
  if (*end != '\0' || n > 1u << 20) return std::nullopt;
  return static_cast<std::uint32_t>(n);
}
std::string join_cores(const std::vector<std::uint32_t>& cores) {
  std::string s;
  for (std::uint32_t c : cores) s += (s.empty() ? "" : ",") + std::to_string(c);
  return s;
}
}  // namespace

std::vector<std::uint32_t> Topology::slice_for_instance(std::uint32_t cores,
                                                        std::uint32_t local_index,
                                                        std::uint32_t local_count) {
  if (cores == 0) detail::throw_bad_value("cores", cores, "must be at least 1");
  if (local_index >= local_count) {
    detail::throw_bad_value(
        "local instance index", local_index,
        "must be below the instances on this host (" + std::to_string(local_count) + ")");
  }
  std::vector<std::uint32_t> out;
  if (local_count >= cores) {
    out.push_back(local_index % cores);
    return out;
  }
  const std::uint64_t begin = std::uint64_t{local_index} * cores / local_count;
  const std::uint64_t end = std::uint64_t{local_index + 1} * cores / local_count;
  for (std::uint64_t c = begin; c < end; ++c) out.push_back(static_cast<std::uint32_t>(c));
  return out;
}

void Topology::find_instance_cores() {
  const auto ncores = static_cast<std::uint32_t>(cores_.size());
  // 1. A binding the launcher made: the cores whose first hardware thread this process may
  //    run on, when that is not every core.
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(getpid(), sizeof mask, &mask) == 0) {  // the process's (main thread's) mask
    std::vector<std::uint32_t> bound;
    for (const CoreInfo& c : cores_) {
      if (c.first_pu < CPU_SETSIZE && CPU_ISSET(c.first_pu, &mask)) bound.push_back(c.index);
    }
    if (!bound.empty() && bound.size() < ncores) {
      instance_cores_ = bound;
      instance_reason_ = "bound by the launcher to core(s) " + join_cores(bound);
      return;
    }
  }
  // 2. Several Open MPI processes on this host, unbound: a slice each.
  const std::optional<std::uint32_t> local_rank = env_count("OMPI_COMM_WORLD_LOCAL_RANK");
  const std::optional<std::uint32_t> local_size = env_count("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local_rank && local_size && *local_size > 1 && *local_rank < *local_size) {
    instance_cores_ = slice_for_instance(ncores, *local_rank, *local_size);
    instance_reason_ = "instance " + std::to_string(*local_rank) + " of " +
                       std::to_string(*local_size) + " on this host: core(s) " +
                       join_cores(instance_cores_) +
                       (*local_size > ncores ? " (more instances than cores: they share)" : "");
    return;
  }
  // 3. Every core.
  for (std::uint32_t i = 0; i < ncores; ++i) instance_cores_.push_back(i);
  instance_reason_ = "every core (one instance on this host)";
}

Topology::~Topology() {
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ != nullptr) hwloc_topology_destroy(as_topo(hwloc_));
#endif
}

const Topology& Topology::get() {
  static const Topology topology;
  return topology;
}

std::vector<Placement> Topology::place(std::uint32_t devices, bool pin,
                                       const std::vector<std::uint32_t>& host_cores) const {
  const auto ncores = static_cast<std::uint32_t>(cores_.size());
  std::vector<bool> reserved(ncores, false);
  for (std::uint32_t c : host_cores) {
    if (c >= ncores) {
      detail::throw_bad_value("host core", c,
                              "must be below the machine's " + std::to_string(ncores) + " cores");
    }
    reserved[c] = true;
  }
  // The cores devices may take (this instance's), highest first; all of this instance's if
  // every one is reserved.
  std::vector<const CoreInfo*> usable;
  for (std::size_t k = instance_cores_.size(); k-- > 0;) {
    if (!reserved[instance_cores_[k]]) usable.push_back(&cores_[instance_cores_[k]]);
  }
  const bool on_host_cores = usable.empty();
  if (on_host_cores) {
    for (std::size_t k = instance_cores_.size(); k-- > 0;)
      usable.push_back(&cores_[instance_cores_[k]]);
  }
  const auto n = static_cast<std::uint32_t>(usable.size());
  const bool pinned = pin && has_hwloc();
  std::vector<Placement> out;
  out.reserve(devices);
  for (std::uint32_t d = 0; d < devices; ++d) {
    const CoreInfo& core = *usable[d % n];
    Placement p;
    p.device = d;
    if (pinned) p.core = core.index;
    p.numa_node = core.numa_node;
    // Devices sharing this core: those with the same d % n.
    p.sharing = devices / n + ((d % n) < (devices % n) ? 1 : 0);
    // Unpinned devices may run anywhere, the reserved cores included.
    p.shares_host = !host_cores.empty() && (on_host_cores || !pinned);
    out.push_back(p);
  }
  return out;
}

bool Topology::pin_current_thread(std::uint32_t core) const noexcept {
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ == nullptr || core >= cores_.size()) return false;
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  if (set == nullptr) return false;
  hwloc_bitmap_only(set, cores_[core].first_pu);
  const int rc = hwloc_set_cpubind(as_topo(hwloc_), set, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free(set);
  return rc == 0;
#else
  (void)core;
  return false;
#endif
}

std::optional<std::uint32_t> Topology::current_thread_core() const noexcept {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) != 0 || CPU_COUNT(&mask) != 1) return std::nullopt;
  for (const CoreInfo& c : cores_) {
    if (c.first_pu < CPU_SETSIZE && CPU_ISSET(c.first_pu, &mask)) return c.index;
  }
  return std::nullopt;
}

void* Topology::allocate(std::size_t bytes, int numa_node) const {
  if (bytes == 0) bytes = 1;
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ != nullptr) {
    hwloc_obj_t node =
        hwloc_get_numanode_obj_by_os_index(as_topo(hwloc_), static_cast<unsigned>(numa_node));
    if (node != nullptr) {
      void* p = hwloc_alloc_membind(as_topo(hwloc_), bytes, node->nodeset, HWLOC_MEMBIND_BIND,
                                    HWLOC_MEMBIND_BYNODESET);
      if (p != nullptr) return p;
    }
  }
#else
  (void)numa_node;
#endif
  // No hwloc (or binding refused): plain anonymous memory. MAP_NORESERVE because an arena
  // reserves the device's whole budget but touches only what it hands out.
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

std::size_t Topology::memory_bytes() const noexcept {
  // The larger of the OS's physical pages and hwloc's total (on some VMs hwloc counts only
  // part of the memory: 11.6 GiB of 23 GiB on the development VM).
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  std::size_t bytes =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ != nullptr) {
    const hwloc_obj_t root = hwloc_get_root_obj(as_topo(hwloc_));
    if (root != nullptr)
      bytes = std::max<std::size_t>(bytes, static_cast<std::size_t>(root->total_memory));
  }
#endif
  return bytes;
}

std::size_t Topology::numa_node_memory_bytes(int numa_node) const noexcept {
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ != nullptr && numa_node >= 0) {
    const hwloc_obj_t node =
        hwloc_get_numanode_obj_by_os_index(as_topo(hwloc_), static_cast<unsigned>(numa_node));
    if (node != nullptr && node->attr != nullptr)
      return static_cast<std::size_t>(node->attr->numanode.local_memory);
  }
#else
  (void)numa_node;
#endif
  return 0;
}

void Topology::release(void* ptr, std::size_t bytes) const noexcept {
  if (ptr == nullptr) return;
  if (bytes == 0) bytes = 1;
#if BSPFLOW_HAVE_HWLOC
  if (hwloc_ != nullptr) {
    // hwloc_alloc_membind and the mmap fallback below both map anonymous memory, which
    // hwloc_free unmaps.
    hwloc_free(as_topo(hwloc_), ptr, bytes);
    return;
  }
#endif
  ::munmap(ptr, bytes);
}

std::string Topology::describe() const {
  std::ostringstream os;
  os << cores() << (cores() == 1 ? " core" : " cores") << " (" << pus_ << " hardware threads), "
     << numa_nodes_ << (numa_nodes_ == 1 ? " NUMA node" : " NUMA nodes");
#if BSPFLOW_HAVE_HWLOC
  if (has_hwloc()) {
    const unsigned v = hwloc_get_api_version();
    os << ", hwloc API " << (v >> 16) << '.' << ((v >> 8) & 0xff) << '.' << (v & 0xff);
  } else {
    os << ", hwloc discovery failed (devices unpinned)";
  }
#else
  os << ", built without hwloc (devices unpinned)";
#endif
  os << '\n';
  for (const CoreInfo& c : cores_) {
    os << "  core " << c.index << ": first hardware thread " << c.first_pu << ", " << c.pus
       << (c.pus == 1 ? " thread" : " threads") << ", NUMA node " << c.numa_node << '\n';
  }
  os << "  devices of this process: " << instance_reason_ << '\n';
  return os.str();
}

}  // namespace bspflow
