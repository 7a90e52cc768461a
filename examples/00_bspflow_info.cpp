// bspflow-info: what this machine offers bspflow. Prints the topology hwloc found (cores,
// hardware threads, NUMA nodes) and where N emulated devices would be placed, then starts
// them and reports whether each worker thread really got pinned.
//
//   bspflow-info              # placement of 1, 2 and 4 devices
//   bspflow-info --devices 8  # placement of 8 devices
//
// It also prints the hwloc release and API version it was compiled against and those of
// the hwloc library loaded at run time, and what the machine offers for pinning (threads to
// cores, memory to NUMA nodes, the hardware threads this process may use), when built with
// hwloc's headers (meson found hwloc).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#if BSPFLOW_INFO_HWLOC
#include <hwloc.h>

namespace {

std::string api_version(unsigned v) {  // hwloc packs X.Y.Z as (X << 16) + (Y << 8) + Z
  return std::to_string(v >> 16) + '.' + std::to_string((v >> 8) & 0xff) + '.' +
         std::to_string(v & 0xff);
}

// Compiled against: HWLOC_VERSION and HWLOC_API_VERSION from the headers. At run time:
// hwloc_get_api_version() from the loaded library, and its release, which hwloc records as
// the "hwlocVersion" info of a topology's root object when it discovers the machine. Then
// what the machine offers for pinning: whether this OS lets hwloc bind a thread to cores
// and memory to NUMA nodes, and which hardware threads this process may use (a cgroup,
// taskset or mpirun's binding may allow fewer than the machine has).
void print_hwloc() {
  std::string runtime_release = "unknown";
  std::string pinning = "unknown (hwloc could not load the topology)";
  hwloc_topology_t topology = nullptr;
  if (hwloc_topology_init(&topology) == 0) {
    if (hwloc_topology_load(topology) == 0) {
      const char* v = hwloc_obj_get_info_by_name(hwloc_get_root_obj(topology), "hwlocVersion");
      if (v != nullptr) runtime_release = v;
      const hwloc_topology_support* support = hwloc_topology_get_support(topology);
      const bool threads =
          support->cpubind->set_thread_cpubind || support->cpubind->set_thisthread_cpubind;
      const bool memory = support->membind->set_area_membind || support->membind->alloc_membind;
      char* allowed = nullptr;
      char* all = nullptr;
      // Allowed: what the OS lets the process use (cgroups) and what it is bound to (taskset,
      // mpirun --bind-to), together.
      hwloc_bitmap_t usable = hwloc_bitmap_dup(hwloc_topology_get_allowed_cpuset(topology));
      hwloc_bitmap_t bound = hwloc_bitmap_alloc();
      if (usable != nullptr && bound != nullptr &&
          hwloc_get_cpubind(topology, bound, HWLOC_CPUBIND_PROCESS) == 0) {
        hwloc_bitmap_and(usable, usable, bound);
      }
      if (usable != nullptr) hwloc_bitmap_list_asprintf(&allowed, usable);
      hwloc_bitmap_free(bound);
      hwloc_bitmap_free(usable);
      hwloc_bitmap_list_asprintf(&all, hwloc_topology_get_complete_cpuset(topology));
      pinning = std::string("threads to cores ") + (threads ? "yes" : "no (devices run unpinned)") +
                ", memory to NUMA nodes " +
                (memory ? "yes" : "no (arenas use the OS's default placement)") +
                "; this process may use hardware threads " + (allowed != nullptr ? allowed : "?") +
                " of " + (all != nullptr ? all : "?");
      std::free(allowed);
      std::free(all);
    }
    hwloc_topology_destroy(topology);
  }
  const unsigned runtime_api = hwloc_get_api_version();
  std::printf("hwloc: compiled against %s (API %s); running with library %s (API %s)%s\n",
              HWLOC_VERSION, api_version(HWLOC_API_VERSION).c_str(), runtime_release.c_str(),
              api_version(runtime_api).c_str(),
              runtime_api == HWLOC_API_VERSION
                  ? ""
                  : ": API versions differ, rebuild bspflow against this hwloc");
  std::printf("pinning: %s\n", pinning.c_str());
}

}  // namespace
#endif

int main(int argc, char** argv) {
  CLI::App app{"bspflow-info: topology and device placement"};
  app.option_defaults()->always_capture_default();  // --help shows every option's default
  std::vector<std::uint32_t> counts{1, 2, 4};
  app.add_option("-d,--devices", counts,
                 "device counts to show placement for (repeat the option for several)")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxReplicas));
  std::vector<std::uint32_t> host_cores;
  app.add_option("--host-cores", host_cores,
                 "cores the application keeps for its own threads (DeviceConfig::host_cores); "
                 "devices are placed elsewhere (default: none)");
  bool start = true;
  app.add_flag("!--no-start", start,
               "only print the plan; do not start devices (default: start them)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help: 0; an unknown or bad argument: 2
  }

  const bspflow::Topology& topo = bspflow::Topology::get();
  std::printf("topology: %s", topo.describe().c_str());
  const bspflow::Instance& instance = bspflow::Instance::current();
  std::printf("instance: %u of %u (%u on this host), %s\n", instance.index(), instance.count(),
              instance.local_count(), instance.transport().c_str());
#if BSPFLOW_INFO_HWLOC
  print_hwloc();
#else
  std::printf(
      "hwloc: this tool was built without hwloc's headers; the topology line above says what the "
      "library uses\n");
  std::printf("pinning: %s\n", topo.has_hwloc()
                                   ? "see the placements below (this tool cannot ask hwloc itself)"
                                   : "none: bspflow was built without hwloc, devices run unpinned");
#endif
  bspflow::DeviceConfig config;
  config.host_cores = host_cores;
  for (std::uint32_t c : host_cores) {
    if (c >= topo.cores()) {
      std::fprintf(stderr,
                   "bspflow-info: --host-cores %u is not allowed: this machine has cores 0..%u\n",
                   c, topo.cores() - 1);
      return 2;
    }
  }
  std::printf("device memory: %u tiles x %s = %s per device\n", config.tiles,
              bspflow::format_bytes(config.bytes_per_tile).c_str(),
              bspflow::format_bytes(config.memory_bytes()).c_str());

  for (std::uint32_t n : counts) {
    std::printf("\n%u device%s:\n", n, n == 1 ? "" : "s");
    for (const bspflow::Placement& p : topo.place(n, config.pin, host_cores)) {
      if (p.core) {
        std::printf("  device %u -> core %u (NUMA node %d)%s%s\n", p.device, *p.core, p.numa_node,
                    p.sharing > 1 ? ", shares its core with other devices" : "",
                    p.shares_host ? ", shares a reserved host core: spins capped" : "");
      } else {
        std::printf("  device %u -> unpinned\n", p.device);
      }
    }
    if (start) {
      bspflow::set_log_level(bspflow::LogLevel::kError);  // the plan above already says it
      bspflow::DeviceGroup group(n, config);
      std::uint32_t pinned = 0;
      for (auto& d : group) pinned += d->pinned() ? 1 : 0;
      std::printf("  started: %u of %u worker threads pinned\n", pinned, n);
      bspflow::set_log_level(bspflow::LogLevel::kWarning);
    }
  }
  return 0;
}
