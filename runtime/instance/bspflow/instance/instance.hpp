// Instances: the processes of a run spread over several processes or hosts, the way PopRun
// launches them (through MPI) and PopDist tells each its place. A process is an instance;
// Open MPI's rank and world size are the instance index and count. Each instance runs
// total_replicas / instances local replicas on its own devices.
//
//   mpirun -np 2 ./my_app                       # two instances on this host
//   const bspflow::Instance& me = bspflow::Instance::current();
//   const bspflow::InstanceLayout l = me.layout(4);  // 4 replicas in all
//   // instance 1 of 2: replicas 2..3 (l.replica_offset = 2, l.local_replicas = 2)
//
// Without Open MPI (built with -Dmpi=disabled, or not launched by mpirun) a process is the
// one instance of its run and every collective is the identity.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {

namespace detail {
struct InstanceWire;  // the Pipeline's per-step exchange (internal)
}  // namespace detail

// Where one instance sits in a run (PopDist's names in the comments). A plain value type.
struct InstanceLayout {
  std::uint32_t index = 0;           // getInstanceIndex()
  std::uint32_t count = 1;           // getNumInstances()
  std::uint32_t local_replicas = 1;  // getNumLocalReplicas(): total_replicas / count
  std::uint32_t replica_offset = 0;  // getReplicaIndexOffset(): index x local_replicas
  std::uint32_t total_replicas = 1;  // getNumTotalReplicas()

  // Any thread. The layout of instance `index` of `count` running `total_replicas` replicas.
  // Never blocks. Throws bspflow::Error naming the value and what is allowed if count is 0,
  // index >= count, total_replicas is 0, or total_replicas does not divide by count.
  static InstanceLayout of(std::uint32_t index, std::uint32_t count, std::uint32_t total_replicas);
  // Global replica index of local replica `local` (< local_replicas; not checked).
  std::uint32_t global_replica(std::uint32_t local) const noexcept {
    return replica_offset + local;
  }
  // "instance 1 of 2: replicas 2..3 of 4". Allocates.
  std::string describe() const;
  bool operator==(const InstanceLayout&) const = default;
};

// What Pipeline::run throws in every instance but the one that failed, when another
// instance's run failed (an exception in one of its stages) or its weights no longer match
// the others': which instance, its global replica (when known) and the step.
class InstanceError : public Error {
 public:
  InstanceError(const std::string& message, std::uint32_t instance, std::uint32_t replica,
                std::uint64_t step)
      : Error(message), instance_(instance), replica_(replica), step_(step) {}
  std::uint32_t instance() const noexcept { return instance_; }
  std::uint32_t replica() const noexcept { return replica_; }  // global replica index
  std::uint64_t step() const noexcept { return step_; }

 private:
  std::uint32_t instance_, replica_;
  std::uint64_t step_;
};

// This process's instance. One per process, made by the first current() call.
//
// Collectives (allreduce_sum, broadcast, all_agree, barrier, and a distributed Pipeline's
// constructor and run()) are made in the same order in every instance (MPI's rule), one at
// a time in each process (any thread: MPI runs at MPI_THREAD_SERIALIZED and each call holds
// a lock); they block until every instance has made the call. Without MPI they return at
// once.
class Instance {
 public:
  // Make the first call early in main(), before any device starts: it initialises MPI
  // (MPI_THREAD_SERIALIZED) when this library was built with it and the process was
  // launched by mpirun (Open MPI's environment is set); MPI is finalised at exit. Later
  // calls: any thread, never throw. Throws bspflow::Error if MPI cannot be initialised.
  static Instance& current();
  // Ends every instance of the run now (MPI_Abort, then exit with `code`): what an instance
  // that failed outside a collective calls so the others do not wait in their next one
  // (returning from main would wait in MPI_Finalize). Any thread. Never returns.
  [[noreturn]] void abort(int code = 1) noexcept;

  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;
  ~Instance();

  // Any thread. Never blocks, never throws.
  std::uint32_t index() const noexcept;        // MPI rank (0 without MPI)
  std::uint32_t count() const noexcept;        // MPI world size (1 without MPI)
  std::uint32_t local_index() const noexcept;  // among the instances on this host
  std::uint32_t local_count() const noexcept;  // instances on this host
  bool distributed() const noexcept { return count() > 1; }
  // "Open MPI 4.1.4, 2 instances" or "one process (built without MPI)". Allocates.
  std::string transport() const;
  // Any thread. InstanceLayout::of(index(), count(), total_replicas).
  InstanceLayout layout(std::uint32_t total_replicas) const;

  // Collectives (see above). allreduce_sum: every instance ends with the element-wise sum
  // of everyone's `values` (same length everywhere; throws bspflow::Error if the lengths
  // differ, in every instance). broadcast: everyone ends with instance `root`'s values.
  // all_agree: true in every instance when `ok` is true in every instance (how one
  // instance's failure or end of data reaches the others at a step boundary). Throws
  // bspflow::Error naming the call and MPI's message if MPI reports an error.
  void allreduce_sum(std::span<float> values);
  void allreduce_sum(std::span<double> values);
  void broadcast(std::span<float> values, std::uint32_t root = 0);
  bool all_agree(bool ok);
  void barrier();

 private:
  Instance();
  void setup_communicators();  // under MPI, after MPI_Init_thread
  friend struct detail::InstanceWire;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bspflow
