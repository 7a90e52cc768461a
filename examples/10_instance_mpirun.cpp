// 10_instance_mpirun: instances (PopRun / PopDist) and an all-reduce across them.
//
//   10_instance_mpirun                    # one process: the one instance of its run
//   mpirun -np 2 10_instance_mpirun       # two processes: instances 0 and 1
//
// Under mpirun every process is an Instance: Open MPI's rank is its index, the world size
// the count. The numbers 1..1000 x count are shared out: instance i takes every count-th
// one, starting at i + 1. Each instance adds up its share on its own device (a loop of 1000
// iterations, no feeds), then Instance::allreduce_sum adds the instances' partial sums, so
// every instance ends with the same total. Each checks it is the sum of 1..1000 x count;
// alone, with no mpirun, the all-reduce is the identity and the same check holds.
// Launched by mpirun against a bspflow built without MPI, every process would think itself
// alone: the example says so and exits 77 (a skip, to meson).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <bspflow/bspflow.hpp>

namespace {
constexpr std::uint64_t kPerInstance = 1000;  // numbers each instance adds up
}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::puts(
          "usage: 10_instance_mpirun   (or: mpirun -np N 10_instance_mpirun)\n  no options: sums "
          "1..1000 x N over N instances with an all-reduce, checks the total, exits 0 if right");
      return 0;
    }
    std::fprintf(stderr, "10_instance_mpirun: unknown argument '%s' (try --help)\n", argv[i]);
    return 2;
  }
  // First, before any device: under mpirun this joins the other processes (MPI_Init).
  bspflow::Instance& me = bspflow::Instance::current();
  const char* world = std::getenv("OMPI_COMM_WORLD_SIZE");  // set by Open MPI's mpirun
  if (world != nullptr && std::stoul(world) > 1 && !me.distributed()) {
    std::printf(
        "skipped: launched by mpirun with %s processes, but bspflow was built without MPI (%s)\n",
        world, me.transport().c_str());
    return 77;
  }
  const std::uint64_t count = me.count(), index = me.index();
  if (index == 0) std::printf("%s\n", me.transport().c_str());

  // This instance's share on its own device: iteration j adds the number index + 1 + j x count.
  // An instance that fails outside a collective ends the whole run (Instance::abort), so the
  // others are not left waiting in the all-reduce.
  double share = 0;
  bool completed = false;
  try {
    bspflow::Device device(0);
    auto body = [count, index](double& sum, const bspflow::Iteration& it) {
      sum += static_cast<double>(index + 1 + it.index * count);
    };
    const auto r = bspflow::loops::repeat(device, kPerInstance, body, 0.0);
    share = r.state();
    completed = r.completed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "10_instance_mpirun: instance %llu: %s\n",
                 static_cast<unsigned long long>(index), e.what());
    me.abort(1);
  }
  std::vector<double> total{share};
  me.allreduce_sum(total);  // a collective: every instance calls it; all end with the sum

  const std::uint64_t n = kPerInstance * count;
  const double expected = static_cast<double>(n * (n + 1) / 2);  // exact in a double
  const double my_share = static_cast<double>(kPerInstance * (index + 1) +
                                              count * kPerInstance * (kPerInstance - 1) / 2);
  std::printf("instance %llu of %llu: my share %.0f, all-reduced total %.0f (1..%llu: %.0f)\n",
              static_cast<unsigned long long>(index), static_cast<unsigned long long>(count), share,
              total[0], static_cast<unsigned long long>(n), expected);
  if (!completed || share != my_share || total[0] != expected) {
    std::fprintf(stderr, "FAILED: instance %llu expected the share %.0f and the total %.0f\n",
                 static_cast<unsigned long long>(index), my_share, expected);
    return 1;
  }
  if (index == 0) std::printf("ok\n");
  return 0;
}
