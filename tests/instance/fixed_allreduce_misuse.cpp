// A FixedAllReduce called with another length than the one agreed, in one instance of two:
// the others are already in the call, so every instance must end (no hang), with a log line
// naming both lengths. Run by tests/instance/expect_ended.py under mpirun (suite mpi).
#include <cstdio>
#include <vector>

#include <bspflow/bspflow.hpp>

int main() {
  bspflow::Instance& me = bspflow::Instance::current();
  const bspflow::FixedAllReduce<float> sum = me.fixed_allreduce<float>(4);
  std::vector<float> values(me.index() == 1 ? 3 : 4, 1.0f);
  sum.sum(values);
  std::puts("the call returned: it should have ended every instance");
  return 0;
}
