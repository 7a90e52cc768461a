// mpi/: Instance under mpirun (meson suite `mpi`: 2 and 4 processes, TCP forced with
// --mca btl self,tcp so the path between hosts runs over loopback). BSPFLOW_EXPECT_INSTANCES
// says how many processes the launch made. Every process runs every case (collectives are
// called in the same order everywhere).
#include <doctest/doctest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

using namespace bspflow;

namespace {
std::uint32_t expected_instances() {
  const char* e = std::getenv("BSPFLOW_EXPECT_INSTANCES");
  return e ? static_cast<std::uint32_t>(std::stoul(e)) : 1;
}
}  // namespace

TEST_SUITE_BEGIN("instance_mpi");

TEST_CASE("each process is one instance: rank and world size, and the layout PopDist gives") {
  Instance& me = Instance::current();
  const std::uint32_t n = expected_instances();
  REQUIRE(me.count() == n);
  CHECK(me.index() < n);
  CHECK(me.distributed() == (n > 1));
  CHECK(me.local_count() == n);  // one host
  CHECK(me.local_index() == me.index());
  CHECK(me.transport().find("Open MPI") != std::string::npos);
  const InstanceLayout l = me.layout(4 * n);
  CHECK(l.local_replicas == 4);
  CHECK(l.replica_offset == 4 * me.index());
  CHECK(l.total_replicas == 4 * n);
  // Every instance's replicas, gathered with a sum: disjoint and covering 0..4n-1.
  std::vector<float> owner(4 * n, 0.0f);
  for (std::uint32_t r = 0; r < l.local_replicas; ++r) owner[l.global_replica(r)] += 1.0f;
  me.allreduce_sum(owner);
  for (float o : owner) CHECK(o == 1.0f);
  if (n > 1)
    CHECK_THROWS_WITH_AS(me.layout(n + 1), doctest::Contains("multiple of the instance count"),
                         Error);
}

TEST_CASE("allreduce_sum, broadcast, all_agree and barrier across instances") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((me.index() + 1) * i);
  me.allreduce_sum(v);
  const float ranks = static_cast<float>(n * (n + 1) / 2);
  for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == ranks * static_cast<float>(i));
  std::vector<double> d{0.5 * me.index()};
  me.allreduce_sum(d);
  CHECK(d[0] == 0.5 * n * (n - 1) / 2);
  std::vector<float> w(16, static_cast<float>(me.index() + 7));
  me.broadcast(w, n - 1);
  for (float x : w) CHECK(x == static_cast<float>(n + 6));
  CHECK(me.all_agree(true));
  CHECK_FALSE(me.all_agree(me.index() != n - 1));  // the last one says no: everyone hears it
  me.barrier();
}

TEST_CASE("a fixed all-reduce: one agreement on the length, then sums of that length") {
  Instance& me = Instance::current();
  const std::uint32_t n = me.count();
  const FixedAllReduce<float> floats = me.fixed_allreduce<float>(1000);
  const FixedAllReduce<double> doubles = me.fixed_allreduce<double>(2);
  CHECK(floats.length() == 1000);
  const float ranks = static_cast<float>(n * (n + 1) / 2);
  std::vector<float> v(1000);
  for (int round = 0; round < 3; ++round) {  // the same agreement, call after call
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>((me.index() + 1) * (i + round));
    floats.sum(v);
    for (std::size_t i = 0; i < v.size(); ++i)
      REQUIRE(v[i] == ranks * static_cast<float>(i + round));
    std::vector<double> d{0.5 * me.index(), 1.0};
    doubles.sum(d);
    CHECK(d[0] == 0.5 * n * (n - 1) / 2);
    CHECK(d[1] == static_cast<double>(n));
  }
  // Lengths that differ are refused when the instances agree, in every instance.
  if (n > 1) {
    try {
      (void)me.fixed_allreduce<float>(3 + me.index());
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("instances passed different lengths") != std::string::npos);
    }
  }
  me.barrier();  // still usable
}

TEST_CASE("instances passing different lengths get an error in every instance, not a hang") {
  Instance& me = Instance::current();
  if (me.count() == 1) return;
  std::vector<float> v(3 + me.index());
  try {
    me.allreduce_sum(v);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("instances passed different lengths") != std::string::npos);
  }
  me.barrier();  // still usable
}

TEST_CASE(
    "instances on one host pin their devices onto disjoint cores (or honour the launcher's "
    "binding)") {
  Instance& me = Instance::current();
  const Topology& topo = Topology::get();
  CAPTURE(topo.instance_cores_reason());
  const char* bound = std::getenv("BSPFLOW_EXPECT_BOUND");
  if (bound != nullptr && std::string(bound) == "1") {
    CHECK(topo.instance_cores_reason().find("bound by the launcher") != std::string::npos);
  } else if (me.count() > 1) {
    CHECK(topo.instance_cores_reason().find("instance " + std::to_string(me.local_index()) +
                                            " of ") != std::string::npos);
  }
  // Where each instance's devices go, gathered: with no more instances than cores, no core
  // is used by two instances; with more, they share evenly.
  std::vector<float> used(topo.cores(), 0.0f);
  for (const Placement& p : topo.place(2)) {
    if (p.core) used[*p.core] = 1.0f;  // this instance uses the core
  }
  me.allreduce_sum(used);
  const float most = static_cast<float>((me.local_count() + topo.cores() - 1) / topo.cores());
  if (topo.has_hwloc()) {
    for (float u : used) CHECK(u <= most);
  }
}

TEST_CASE(
    "each instance's DataLoader loads a disjoint part of the epoch; together, every sample once") {
  Instance& me = Instance::current();
  SyntheticDataset::Config dc;
  dc.size = 1001;
  dc.spec = SampleSpec{DType::kUint8, {4}};
  SyntheticDataset data(dc);
  for (bool drop_last : {true, false}) {
    CAPTURE(drop_last);
    LoaderConfig c;
    c.batch_size = 8;
    c.shuffle = true;
    c.seed = 11;
    c.drop_last = drop_last;
    c.instance = me.index();
    c.instances = me.count();
    DataLoader loader(StepShape{3, 1, 1}, data, c);
    std::vector<float> seen(dc.size, 0.0f);
    double steps = 0;
    for (auto& step : loader) {
      ++steps;
      for (const Batch& b : step.replica(0)) {
        for (std::size_t k = 0; k < b.valid; ++k) seen[b.indices[k]] += 1.0f;
      }
    }
    me.allreduce_sum(seen);
    std::vector<double> all_steps{steps};
    me.allreduce_sum(all_steps);
    CHECK(all_steps[0] == steps * me.count());  // the same number of steps everywhere
    double total = 0;
    for (float x : seen) {
      CHECK(x <= 1.0f);  // nobody saw a sample another instance saw
      total += x;
    }
    CHECK(total + static_cast<double>(loader.dropped()) == static_cast<double>(dc.size));
  }
}

TEST_SUITE_END();
