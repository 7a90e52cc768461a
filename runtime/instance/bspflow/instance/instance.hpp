/// @file
/// Instances: a run spread over several processes or hosts, the way PopRun launches them
/// (through MPI) and PopDist tells each its place. Instance (this process, and collectives
/// across instances), InstanceLayout (the replicas an instance runs) and InstanceError.
/// Guide: runtime/instance/README.md.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {

namespace detail {
struct InstanceWire;  // the Pipeline's per-step exchange (internal)
}  // namespace detail

/// Where one instance sits in a run (PopDist's names in the comments). A plain value type.
struct InstanceLayout {
  std::uint32_t index = 0;           ///< getInstanceIndex()
  std::uint32_t count = 1;           ///< getNumInstances()
  std::uint32_t local_replicas = 1;  ///< getNumLocalReplicas(): total_replicas / count
  std::uint32_t replica_offset = 0;  ///< getReplicaIndexOffset(): index x local_replicas
  std::uint32_t total_replicas = 1;  ///< getNumTotalReplicas()

  /// The layout of instance `index` of `count` running `total_replicas` replicas. Throws
  /// bspflow::Error if count is 0, index >= count, total_replicas is 0, or total_replicas
  /// does not divide by count.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static InstanceLayout of(std::uint32_t index, std::uint32_t count, std::uint32_t total_replicas);
  /// Global replica index of local replica `local` (< local_replicas; not checked).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::uint32_t global_replica(std::uint32_t local) const noexcept {
    return replica_offset + local;
  }
  /// Returns "instance 1 of 2: replicas 2..3 of 4".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string describe() const;
  /// Whether both layouts are the same in every field.
  bool operator==(const InstanceLayout&) const = default;
};

/// What Pipeline::run throws in every instance but the one that failed, when another
/// instance's run failed (an exception in one of its stages) or its weights no longer match
/// the others': which instance, its global replica (when known) and the step.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class InstanceError : public Error {
 public:
  /// The message, the failed instance, its global replica and the step.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  InstanceError(const std::string& message, std::uint32_t instance, std::uint32_t replica,
                std::uint64_t step)
      : Error(message), instance_(instance), replica_(replica), step_(step) {}
  /// The instance whose run failed.
  std::uint32_t instance() const noexcept { return instance_; }
  std::uint32_t replica() const noexcept { return replica_; }  ///< global replica index
  /// The step that failed.
  std::uint64_t step() const noexcept { return step_; }

 private:
  std::uint32_t instance_, replica_;
  std::uint64_t step_;
};

class Instance;

/// An all-reduce (sum) of a length every instance agreed on once, when
/// Instance::fixed_allreduce<T>(length) made it: each sum() is then one MPI_Allreduce, in
/// place, without Instance::allreduce_sum()'s check of the lengths (a small collective of its
/// own before every call). For a loop that reduces buffers of the same size again and again,
/// as MPI-4's persistent collectives (MPI_Allreduce_init) fix their arguments once. T is
/// float or double. A plain value (copy it freely); it refers to its Instance, which lives
/// until exit.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class T>
requires std::same_as<T, float> || std::same_as<T, double>
class FixedAllReduce {
 public:
  /// The number of values every instance agreed on.
  std::size_t length() const noexcept { return length_; }
  /// A collective (see Instance; it blocks until every instance has made the call): every
  /// instance ends with the element-wise sum of everyone's `values`. `values` must hold
  /// length() values. Another size is a programming error that the other instances cannot
  /// learn of, since they are already waiting in the call: with several instances it logs
  /// what was given and what was agreed and ends every instance (Instance::abort(1)), as MPI
  /// ends a job on an erroneous call, rather than leave them waiting; in a run of one
  /// instance it throws bspflow::Error saying the same. Throws bspflow::Error naming the call
  /// and MPI's message if MPI reports an error. MPI may allocate.
  /// Contract: any; blocks; allocates; throws Error.
  void sum(std::span<T> values) const;

 private:
  friend class Instance;
  FixedAllReduce(Instance& instance, std::size_t length) noexcept
      : instance_(&instance), length_(length) {}
  Instance* instance_;
  std::size_t length_;
};

/// This process's instance. One per process, made by the first current() call.
///
/// Collectives (allreduce_sum, broadcast, all_agree, barrier, and a distributed Pipeline's
/// constructor and run()) are made in the same order in every instance (MPI's rule), one at
/// a time in each process (any thread: MPI runs at MPI_THREAD_SERIALIZED and each call holds
/// a lock); they block until every instance has made the call. Without MPI a process is the
/// one instance of its run and they return at once.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Instance {
 public:
  /// This process's instance. Make the first call early in main(), before any device
  /// starts: it initialises MPI (MPI_THREAD_SERIALIZED) when this library was built with it
  /// and the process was launched by mpirun (Open MPI's environment is set), blocking while
  /// MPI initialises; MPI is finalised at exit. Throws bspflow::Error if MPI cannot be
  /// initialised. Later calls return the same instance from any thread without blocking,
  /// allocating or throwing.
  /// Contract: host; blocks; allocates; throws Error.
  static Instance& current();
  /// Ends every instance of the run now (MPI_Abort, then exit with `code`): what an instance
  /// that failed outside a collective calls so the others do not wait in their next one
  /// (returning from main would wait in MPI_Finalize). Never returns.
  [[noreturn]] void abort(int code = 1) noexcept;

  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;
  /// Runs at exit: frees bspflow's communicator and finalises MPI if current() initialised
  /// it (MPI_Finalize may wait for the other instances).
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Instance();

  std::uint32_t index() const noexcept;        ///< MPI rank (0 without MPI)
  std::uint32_t count() const noexcept;        ///< MPI world size (1 without MPI)
  std::uint32_t local_index() const noexcept;  ///< among the instances on this host
  std::uint32_t local_count() const noexcept;  ///< instances on this host
  /// Whether the run has more than one instance.
  bool distributed() const noexcept { return count() > 1; }
  /// Returns "Open MPI 4.1.4, 2 instances" or "one process (built without MPI)".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string transport() const;
  /// InstanceLayout::of(index(), count(), total_replicas).
  /// Contract: any; non-blocking; no-alloc; throws Error.
  InstanceLayout layout(std::uint32_t total_replicas) const;

  /// A collective (see the class comment; it blocks until every instance has made the call):
  /// every instance ends with the element-wise sum of everyone's `values`. Throws
  /// bspflow::Error, in every instance, if the lengths differ, and bspflow::Error naming the
  /// call and MPI's message if MPI reports an error. MPI may allocate.
  /// Contract: any; blocks; allocates; throws Error.
  void allreduce_sum(std::span<float> values);
  /// allreduce_sum() for doubles.
  /// Contract: any; blocks; allocates; throws Error.
  void allreduce_sum(std::span<double> values);
  /// A collective: every instance agrees to all-reduce `length` values of T (float or
  /// double) from now on, and gets the FixedAllReduce that does it with one MPI call each
  /// time. Throws bspflow::Error, in every instance, if the lengths differ (one small
  /// all-reduce checks them, as allreduce_sum does every time) or if `length` is more than
  /// one MPI call takes, and bspflow::Error naming the call and MPI's message if MPI reports
  /// an error.
  /// Contract: any; blocks; allocates; throws Error.
  template <class T>
  requires std::same_as<T, float> || std::same_as<T, double> FixedAllReduce<T> fixed_allreduce(
      std::size_t length) {
    agree_on_length(length, "Instance::fixed_allreduce");
    return FixedAllReduce<T>(*this, length);
  }
  /// A collective: everyone ends with instance `root`'s values (same length everywhere).
  /// Throws bspflow::Error if root is not below count(), if the lengths differ, or naming the
  /// call and MPI's message if MPI reports an error.
  /// Contract: any; blocks; allocates; throws Error.
  void broadcast(std::span<float> values, std::uint32_t root = 0);
  /// A collective: true in every instance when `ok` is true in every instance (how one
  /// instance's failure or end of data reaches the others at a step boundary). Throws
  /// bspflow::Error naming the call and MPI's message if MPI reports an error.
  /// Contract: any; blocks; allocates; throws Error.
  bool all_agree(bool ok);
  /// A collective: returns once every instance has called it. Throws bspflow::Error naming
  /// the call and MPI's message if MPI reports an error.
  /// Contract: any; blocks; allocates; throws Error.
  void barrier();

 private:
  Instance();
  void setup_communicators();  ///< under MPI, after MPI_Init_thread
  /// A collective: throws Error in every instance if their lengths differ.
  void agree_on_length(std::size_t length, const char* call);
  /// One MPI_Allreduce (sum, in place) of an agreed length, or the wrong-length error.
  void sum_agreed(void* data, std::size_t length, std::size_t agreed, bool doubles);
  template <class T>
  requires std::same_as<T, float> || std::same_as<T, double>
  friend class FixedAllReduce;
  friend struct detail::InstanceWire;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <class T>
requires std::same_as<T, float> || std::same_as<T, double>
void FixedAllReduce<T>::sum(std::span<T> values) const {
  instance_->sum_agreed(values.data(), values.size(), length_, std::same_as<T, double>);
}

}  // namespace bspflow
