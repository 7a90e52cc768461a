// bspflow-info: what this machine offers bspflow. Prints the topology hwloc found (cores,
// hardware threads, NUMA nodes) and where N emulated devices would be placed, then starts
// them and reports whether each worker thread really got pinned.
//
//   bspflow-info              # placement of 1, 2 and 4 devices
//   bspflow-info --devices 8  # placement of 8 devices
#include <CLI/CLI.hpp>
#include <cstdio>
#include <vector>

#include <bspflow/bspflow.hpp>

int main(int argc, char** argv) {
  CLI::App app{"bspflow-info: topology and device placement"};
  std::vector<std::uint32_t> counts;
  app.add_option("-d,--devices", counts, "device counts to show placement for (default 1 2 4)")
      ->check(CLI::Range(1u, bspflow::tunables::kMaxReplicas));
  bool start = true;
  app.add_flag("!--no-start", start, "only print the plan; do not start devices");
  CLI11_PARSE(app, argc, argv);
  if (counts.empty()) counts = {1, 2, 4};

  const bspflow::Topology& topo = bspflow::Topology::get();
  std::printf("topology: %s", topo.describe().c_str());
  bspflow::DeviceConfig config;
  std::printf("device memory: %u tiles x %s = %s per device\n", config.tiles,
              bspflow::detail::format_bytes(config.bytes_per_tile).c_str(),
              bspflow::detail::format_bytes(config.memory_bytes()).c_str());

  for (std::uint32_t n : counts) {
    std::printf("\n%u device%s:\n", n, n == 1 ? "" : "s");
    for (const bspflow::Placement& p : topo.place(n)) {
      if (p.core) {
        std::printf("  device %u -> core %u (NUMA node %d)%s\n", p.device, *p.core, p.numa_node,
                    p.sharing > 1 ? ", shares its core" : "");
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
