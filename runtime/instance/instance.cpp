// Instances over Open MPI (see instance.hpp). Only this file includes <mpi.h>.
#include "bspflow/instance/instance.hpp"

#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/instance/internal/instance_wire.hpp"

#if BSPFLOW_HAVE_MPI
// The C API only: Open MPI's deprecated C++ bindings do not compile warning-free.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace bspflow {

InstanceLayout InstanceLayout::of(std::uint32_t index, std::uint32_t count,
                                  std::uint32_t total_replicas) {
  if (count == 0) detail::throw_bad_value("instance count", count, "must be at least 1");
  if (index >= count) {
    detail::throw_bad_value("instance index", index,
                            "must be below the instance count (" + std::to_string(count) + ")");
  }
  if (total_replicas == 0)
    detail::throw_bad_value("replicas", total_replicas, "must be at least 1");
  if (total_replicas % count != 0) {
    detail::throw_bad_value("replicas", total_replicas,
                            "must be a multiple of the instance count (" + std::to_string(count) +
                                "): each instance runs replicas / instances of them");
  }
  InstanceLayout l;
  l.index = index;
  l.count = count;
  l.total_replicas = total_replicas;
  l.local_replicas = total_replicas / count;
  l.replica_offset = index * l.local_replicas;
  return l;
}

std::string InstanceLayout::describe() const {
  return "instance " + std::to_string(index) + " of " + std::to_string(count) + ": replicas " +
         std::to_string(replica_offset) + ".." +
         std::to_string(replica_offset + local_replicas - 1) + " of " +
         std::to_string(total_replicas);
}

struct Instance::Impl {
  std::uint32_t index = 0, count = 1, local_index = 0, local_count = 1;
  bool mpi = false;             // this process runs under MPI
  bool we_initialised = false;  // and this library called MPI_Init_thread
  std::string library;          // MPI's library version, first line
  std::mutex calls;             // one collective at a time in this process (SERIALIZED)
#if BSPFLOW_HAVE_MPI
  MPI_Comm comm = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: bspflow's own traffic
#endif
};

#if BSPFLOW_HAVE_MPI
namespace {
void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}
// Launched by mpirun (Open MPI sets these; PMIx-based launchers the second).
bool launched_by_mpirun() {
  // The library reads the environment and never writes it.
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||  // NOLINT(concurrency-mt-unsafe)
         std::getenv("PMIX_RANK") != nullptr;               // NOLINT(concurrency-mt-unsafe)
}
}  // namespace
#endif

Instance::Instance() : impl_(std::make_unique<Impl>()) {
#if BSPFLOW_HAVE_MPI
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised && !launched_by_mpirun()) return;  // a plain process: one instance
  if (!initialised) {
    int provided = 0;
    // SERIALIZED: collectives may come from any host thread (a Pipeline::run on a thread
    // of the application's choosing), one at a time (Impl::calls).
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
              "MPI_Init_thread");
    impl_->we_initialised = true;
    if (provided < MPI_THREAD_SERIALIZED) {
      MPI_Finalize();
      throw Error(
          "MPI_Init_thread: this MPI library gives thread level " + std::to_string(provided) +
          ", below MPI_THREAD_SERIALIZED (" + std::to_string(MPI_THREAD_SERIALIZED) +
          "): bspflow's devices are threads, and MPI is called from whichever host thread runs");
    }
  }
  impl_->mpi = true;
  try {
    setup_communicators();
  } catch (...) {
    if (impl_->we_initialised) MPI_Finalize();
    throw;
  }
#endif
}

#if BSPFLOW_HAVE_MPI
void Instance::setup_communicators() {
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm), "MPI_Comm_dup");
  // Errors come back as return codes (thrown as bspflow::Error), not as an abort.
  MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(impl_->comm, &rank);
  MPI_Comm_size(impl_->comm, &size);
  impl_->index = static_cast<std::uint32_t>(rank);
  impl_->count = static_cast<std::uint32_t>(size);
  MPI_Comm host = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(impl_->comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host),
            "MPI_Comm_split_type");
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(host, &local_rank);
  MPI_Comm_size(host, &local_size);
  MPI_Comm_free(&host);
  impl_->local_index = static_cast<std::uint32_t>(local_rank);
  impl_->local_count = static_cast<std::uint32_t>(local_size);
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  impl_->library.assign(version, static_cast<std::size_t>(len));
  if (const auto cut = impl_->library.find_first_of(",\n"); cut != std::string::npos)
    impl_->library.resize(cut);
}
#endif

void Instance::abort(int code) noexcept {
#if BSPFLOW_HAVE_MPI
  if (impl_->mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Abort(MPI_COMM_WORLD, code);
  }
#endif
  std::_Exit(code);
}

Instance::~Instance() {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  MPI_Comm_free(&impl_->comm);
  if (impl_->we_initialised) MPI_Finalize();
#endif
}

Instance& Instance::current() {
  static Instance instance;  // destroyed at exit: finalises MPI if it initialised it
  return instance;
}

std::uint32_t Instance::index() const noexcept {
  return impl_->index;
}
std::uint32_t Instance::count() const noexcept {
  return impl_->count;
}
std::uint32_t Instance::local_index() const noexcept {
  return impl_->local_index;
}
std::uint32_t Instance::local_count() const noexcept {
  return impl_->local_count;
}

std::string Instance::transport() const {
#if BSPFLOW_HAVE_MPI
  if (impl_->mpi) return impl_->library + ", " + std::to_string(impl_->count) + " instance(s)";
  return "one process (built with MPI, not launched by mpirun)";
#else
  return "one process (built without MPI)";
#endif
}

InstanceLayout Instance::layout(std::uint32_t total_replicas) const {
  return InstanceLayout::of(impl_->index, impl_->count, total_replicas);
}

#if BSPFLOW_HAVE_MPI
namespace {
// Every instance must pass the same number of values: checked with one small all-reduce
// (max of n and of -n), so a mismatch is an error in every instance, not a hang or garbage.
void check_same_length(MPI_Comm comm, std::size_t n, const char* call) {
  if (n > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw Error(std::string(call) + ": " + std::to_string(n) +
                " values is more than one MPI call takes (" +
                std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  long long mine[2] = {static_cast<long long>(n), -static_cast<long long>(n)};
  long long all[2] = {0, 0};
  check_mpi(MPI_Allreduce(mine, all, 2, MPI_LONG_LONG, MPI_MAX, comm), call);
  if (all[0] != -all[1]) {
    throw Error(std::string(call) + ": instances passed different lengths (this one " +
                std::to_string(n) + ", from " + std::to_string(-all[1]) + " to " +
                std::to_string(all[0]) + "): every instance must reduce the same values");
  }
}
// `n` values of `type` at `data`, summed in place across the instances: one MPI call, of a
// length every instance has already agreed on.
void allreduce_in_place(MPI_Comm comm, void* data, std::size_t n, MPI_Datatype type) {
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), type, MPI_SUM, comm),
            "MPI_Allreduce");
}
// Both allreduce_sum overloads: the lengths checked, then the sum.
void sum_in_place(MPI_Comm comm, void* data, std::size_t n, MPI_Datatype type) {
  check_same_length(comm, n, "Instance::allreduce_sum");
  allreduce_in_place(comm, data, n, type);
}
}  // namespace
#endif

void Instance::allreduce_sum(std::span<float> values) {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  sum_in_place(impl_->comm, values.data(), values.size(), MPI_FLOAT);
#else
  (void)values;
#endif
}

void Instance::allreduce_sum(std::span<double> values) {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  sum_in_place(impl_->comm, values.data(), values.size(), MPI_DOUBLE);
#else
  (void)values;
#endif
}

void Instance::agree_on_length(std::size_t length, const char* call) {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  check_same_length(impl_->comm, length, call);
#else
  (void)length;
  (void)call;
#endif
}

void Instance::sum_agreed(void* data, std::size_t length, std::size_t agreed, bool doubles) {
  if (length != agreed) {
    if (distributed()) {
      // The others are waiting in this call already: no error can reach them, and a call
      // of another length is erroneous in MPI. End the run rather than leave them waiting.
      log(LogLevel::kError, "FixedAllReduce::sum: " + std::to_string(length) +
                                " values given in instance " + std::to_string(impl_->index) +
                                ", where every instance agreed on " + std::to_string(agreed) +
                                ": the others are already in the call, so every instance ends");
      abort(1);
    }
    detail::throw_bad_value(
        "FixedAllReduce::sum values", length,
        "must be the length every instance agreed on (" + std::to_string(agreed) + ")");
  }
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  allreduce_in_place(impl_->comm, data, length, doubles ? MPI_DOUBLE : MPI_FLOAT);
#else
  (void)data;
  (void)doubles;
#endif
}

void Instance::broadcast(std::span<float> values, std::uint32_t root) {
  if (root >= impl_->count) {
    detail::throw_bad_value(
        "broadcast root", root,
        "must be below the instance count (" + std::to_string(impl_->count) + ")");
  }
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  check_same_length(impl_->comm, values.size(), "Instance::broadcast");
  check_mpi(MPI_Bcast(values.data(), static_cast<int>(values.size()), MPI_FLOAT,
                      static_cast<int>(root), impl_->comm),
            "MPI_Bcast");
#else
  (void)values;
#endif
}

bool Instance::all_agree(bool ok) {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return ok;
  const std::lock_guard lock(impl_->calls);
  int mine = ok ? 1 : 0, all = 0;
  check_mpi(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_LAND, impl_->comm),
            "MPI_Allreduce (all_agree)");
  return all != 0;
#else
  return ok;
#endif
}

void Instance::barrier() {
#if BSPFLOW_HAVE_MPI
  if (!impl_->mpi || impl_->count == 1) return;
  const std::lock_guard lock(impl_->calls);
  check_mpi(MPI_Barrier(impl_->comm), "MPI_Barrier");
#endif
}

namespace detail {

void InstanceWire::sum(Instance& instance, std::span<float> values) {
#if BSPFLOW_HAVE_MPI
  Instance::Impl& im = *instance.impl_;
  if (!im.mpi || im.count == 1) return;
  const std::lock_guard lock(im.calls);
  allreduce_in_place(im.comm, values.data(), values.size(), MPI_FLOAT);
#else
  (void)instance;
  (void)values;
#endif
}

void InstanceWire::broadcast_text(Instance& instance, std::string& text, std::uint32_t root) {
#if BSPFLOW_HAVE_MPI
  Instance::Impl& im = *instance.impl_;
  if (!im.mpi || im.count == 1) return;
  const std::lock_guard lock(im.calls);
  if (im.index == root && text.size() > InstanceWire::kMaxText) text.resize(InstanceWire::kMaxText);
  unsigned long long length = text.size();
  check_mpi(MPI_Bcast(&length, 1, MPI_UNSIGNED_LONG_LONG, static_cast<int>(root), im.comm),
            "MPI_Bcast");
  text.resize(static_cast<std::size_t>(length));
  check_mpi(MPI_Bcast(text.data(), static_cast<int>(text.size()), MPI_CHAR, static_cast<int>(root),
                      im.comm),
            "MPI_Bcast");
#else
  (void)instance;
  (void)text;
  (void)root;
#endif
}

}  // namespace detail

}  // namespace bspflow
