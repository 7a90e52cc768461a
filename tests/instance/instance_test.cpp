// runtime/: Instance and InstanceLayout (bspflow/instance/instance.hpp) in a plain process:
// the layout arithmetic PopDist's queries return, its errors, and one instance whose
// collectives are the identity. The same queries under mpirun: tests/mpi/.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <bspflow/bspflow.hpp>

#include "test_util.hpp"

using namespace bspflow;
using test::contains;
using test::error_of;

TEST_SUITE_BEGIN("instance");

TEST_CASE("layout: each instance runs replicas / instances of them, offset by its index") {
  const InstanceLayout one = InstanceLayout::of(0, 1, 4);
  CHECK(one.local_replicas == 4);
  CHECK(one.replica_offset == 0);
  for (std::uint32_t count : {2u, 4u}) {
    for (std::uint32_t i = 0; i < count; ++i) {
      const InstanceLayout l = InstanceLayout::of(i, count, 8);
      CHECK(l.index == i);
      CHECK(l.count == count);
      CHECK(l.total_replicas == 8);
      CHECK(l.local_replicas == 8 / count);
      CHECK(l.replica_offset == i * (8 / count));
      CHECK(l.global_replica(l.local_replicas - 1) == (i + 1) * (8 / count) - 1);
    }
  }
  CHECK(InstanceLayout::of(1, 2, 4).describe() == "instance 1 of 2: replicas 2..3 of 4");
}

TEST_CASE("layout: a replica count that does not divide by the instance count is refused") {
  const std::string why = error_of([] { InstanceLayout::of(0, 2, 3); });
  CHECK(contains(why, "replicas = 3"));
  CHECK(contains(why, "multiple of the instance count (2)"));
  CHECK(contains(error_of([] { InstanceLayout::of(2, 2, 4); }), "instance index = 2"));
  CHECK(contains(error_of([] { InstanceLayout::of(0, 0, 4); }), "instance count = 0"));
  CHECK(contains(error_of([] { InstanceLayout::of(0, 1, 0); }), "replicas = 0"));
}

TEST_CASE("a plain process is the one instance of its run; collectives change nothing") {
  Instance& me = Instance::current();
  CHECK(&me == &Instance::current());
  CHECK(me.index() == 0);
  CHECK(me.count() == 1);
  CHECK_FALSE(me.distributed());
  CHECK(me.local_count() == 1);
  CHECK(contains(me.transport(), "one process"));
  CHECK(me.layout(2) == InstanceLayout::of(0, 1, 2));
  std::vector<float> v{1, 2, 3};
  me.allreduce_sum(v);
  me.broadcast(v);
  CHECK(v == std::vector<float>{1, 2, 3});
  CHECK(me.all_agree(true));
  CHECK_FALSE(me.all_agree(false));
  me.barrier();
  CHECK(contains(error_of([&] { me.broadcast(v, 1); }), "broadcast root = 1"));
}

TEST_CASE("a fixed all-reduce in one instance: the identity, and a wrong length is an error") {
  Instance& me = Instance::current();
  const FixedAllReduce<float> sum = me.fixed_allreduce<float>(3);
  CHECK(sum.length() == 3);
  std::vector<float> v{1, 2, 3};
  sum.sum(v);
  CHECK(v == std::vector<float>{1, 2, 3});
  const FixedAllReduce<double> doubles = me.fixed_allreduce<double>(0);
  std::vector<double> none;
  doubles.sum(none);
  std::vector<float> four(4, 1.0f);
  const std::string e = error_of([&] { sum.sum(four); });
  CHECK(contains(e, "FixedAllReduce::sum values = 4"));
  CHECK(contains(e, "agreed on (3)"));
  CHECK(four == std::vector<float>(4, 1.0f));  // untouched
}

TEST_SUITE_END();
