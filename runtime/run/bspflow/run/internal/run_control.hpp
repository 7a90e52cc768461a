// The run room's internal API (not for users; installed because the engine's and the loops'
// templates include it): detail::RunControl, the shared state of one run behind an Engine
// run and behind a loop's Run handle, and the trace helpers a loop uses.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/stall.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

namespace detail {

struct StallWatch;  // run/detail/run_monitor.hpp (in the library)

// An allocator for over-aligned run state (members on cache lines of their own), built on
// plain operator new: aligned operator new goes through glibc's memalign, which bypasses its
// per-thread cache and takes the arena lock (a few hundred ns on each launch of a loop). The
// block is over-allocated by a cache line and aligned by hand; the raw pointer sits just
// below the aligned one. For std::allocate_shared.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::size_t kAlign = tunables::kCacheLine;
  static_assert(alignof(T) <= kAlign);
  CacheLineAllocator() noexcept = default;
  template <class U>
  // NOLINTNEXTLINE(google-explicit-constructor): the allocator requirements rebind implicitly
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > (std::numeric_limits<std::size_t>::max() - 2 * kAlign) / sizeof(T)) {
      throw std::bad_array_new_length();
    }
    void* raw = ::operator new(n * sizeof(T) + kAlign + sizeof(void*));
    const auto at = (reinterpret_cast<std::uintptr_t>(raw) + sizeof(void*) + kAlign - 1) &
                    ~std::uintptr_t{kAlign - 1};
    // The raw pointer is kept in the bytes just below the object, copied in and out as bytes
    // (no void* object lives there).
    std::memcpy(reinterpret_cast<unsigned char*>(at) - sizeof(void*), &raw, sizeof(void*));
    return reinterpret_cast<T*>(at);
  }
  void deallocate(T* p, std::size_t) noexcept {
    void* raw = nullptr;
    std::memcpy(&raw, reinterpret_cast<unsigned char*>(p) - sizeof(void*), sizeof(void*));
    ::operator delete(raw);
  }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
};

// A device of a watched run, as the stall report names it: "device 3 (replica 1)".
struct WatchedDevice {
  std::uint32_t device = 0;   // Device::id()
  std::uint32_t replica = 0;  // StallError::Wait::replica
  std::string role;           // "stage 2 of replica 0"; empty: "replica <replica>"
};

// The non-template part of a run's shared state: stop flag, completion, first failure, and
// each device's wait record for the stall check. Shared by the host and every device thread
// of one run (loops::repeat_async, Engine::run).
class RunControl {
 public:
  struct Failure {
    std::uint32_t device = 0;
    std::uint32_t replica = 0;
    std::uint64_t iteration = 0;
    std::exception_ptr cause;
  };
  struct ReplicaEnd {
    std::uint32_t device = 0;
    std::uint64_t iterations = 0;
    RunStatus status = RunStatus::kCompleted;
    bool failed = false;
    ModeledTime modeled{};  // the device's modeled clock at its end
  };

  // Setup path. Allocates (one end record and one wait record per replica). Throws only
  // std::bad_alloc.
  RunControl(std::uint32_t replicas, std::uint64_t requested);
  // Whichever thread lets go of the run last. Stops watching it if nobody did. Never throws.
  ~RunControl();
  RunControl(const RunControl&) = delete;
  RunControl& operator=(const RunControl&) = delete;

  // Host thread, before any replica starts: has the run's stall check (see
  // bspflow/run/stall.hpp) watch it until the last replica ends; nothing if check.limit
  // is 0. `name` opens the report ("loops::repeat"); `devices` names each replica's device.
  // Allocates. Throws only std::bad_alloc.
  void watch(const StallCheck& check, std::string name, std::vector<WatchedDevice> devices);
  // Any thread (replica `replica`'s device thread writes it, the monitor reads it). Never
  // blocks, never allocates, never throws.
  WaitNote* note(std::uint32_t replica) noexcept { return &notes_[replica]; }
  // The monitor thread, once, when the run stalled with OnStall::kFail: records the report
  // (unless a failure came first: it wins) and cancels the run. finish() throws it as
  // StallError. Never blocks for long, never throws.
  void stall(const std::string& message, std::vector<StallError::Wait> waits) noexcept;

  // Any thread. Stops every replica at its next iteration or wait, and wakes feeds (calls
  // the waker while the run is open, under a mutex). Idempotent. Never blocks for long,
  // never throws.
  void cancel() noexcept;
  // Device thread (or the host thread, for a device that refused its job). Records a body
  // failure (first one wins; later ones are counted) and cancels the rest. Never blocks for
  // long, never throws.
  void fail(Failure f) noexcept;
  // Device thread (or the host thread, for an abandoned replica), once per replica, after it
  // released its feeds. The last one makes done() true and wakes waiters. Never blocks for
  // long, never allocates, never throws.
  void replica_done(std::uint32_t replica, ReplicaEnd end) noexcept;

  // A device thread that touches the run without owning it (a loop's job holds a pointer):
  // the host calls attach() before it hands the job over, and the job calls detach() as its
  // last touch of the run (the host calls it for a job the device refused). Whoever frees the
  // run calls wait_detached() first: it waits (spin, then yield) until every attached thread
  // has detached, which they do just after the run's end, so it is nanoseconds unless one of
  // them was descheduled in between. Never allocate, never throw.
  void attach() noexcept { attached_.fetch_add(1, std::memory_order_relaxed); }
  void detach() noexcept { attached_.fetch_sub(1, std::memory_order_release); }
  void wait_detached() const noexcept;

  // Any thread. Never blocks, never allocates, never throws.
  const StopFlag& stop() const noexcept { return stop_; }
  std::uint64_t requested() const noexcept { return requested_; }
  // Any thread, once done(): from construction to the last replica's end.
  std::chrono::nanoseconds elapsed() const noexcept { return ended_ - started_; }
  bool done() const noexcept { return done_.load(std::memory_order_seq_cst); }
  // Any thread. Blocks (spin, then park) until done(). Never allocates.
  void wait() {
    done_point_.wait([&] { return done(); });
  }
  // Any thread. Blocks (spin, then park) until done() or for at most `d`; returns done().
  // Never allocates.
  bool wait_for(std::chrono::nanoseconds d) {
    return done_point_.wait_until([&] { return done(); }, std::chrono::steady_clock::now() + d);
  }
  // Setup path. Set once, before the run starts (not thread-safe against cancel()): wakes
  // whatever the replicas may be parked on. `waker` must not throw (cancel() is noexcept
  // and calls it). May allocate (the std::function).
  void set_waker(std::function<void()> waker) { waker_ = std::move(waker); }

  // Any thread, once done(): the run in modeled IPU time, the slowest replica's clock (and
  // its split), with every replica's undeclared compute steps. Never throws.
  ModeledTime modeled() const noexcept;
  // Any thread, once done(): replica r's modeled clock at its end. Never throws.
  const ModeledTime& modeled(std::uint32_t r) const noexcept { return ends_[r].modeled; }
  std::uint32_t replicas() const noexcept { return static_cast<std::uint32_t>(ends_.size()); }

  // Host thread, once, after done(): throws DeviceError if a replica failed, else StallError
  // if the run stalled and was ended for it (OnStall::kFail); else the overall status and
  // message. Per-replica iterations are written to `iterations`. The
  // failure's exception moves into the DeviceError, so the host thread that reads it also
  // frees it (a device thread dropping the last reference would race with that read as far
  // as ThreadSanitizer can tell: exception_ptr counts references inside libsupc++).
  // Never blocks for long. Allocates (the message, `iterations`).
  RunStatus finish(std::vector<std::uint64_t>& iterations, std::string& message);

 private:
  // A count this large is no count: a run meant to go until its infeed ends (a service
  // loop asking for 2^62 iterations). Messages then leave the count out.
  bool open_ended() const noexcept { return requested_ >= (std::uint64_t{1} << 53); }
  // " of 10", or "" for an open-ended run. Allocates.
  std::string of_requested() const {
    return open_ended() ? std::string() : " of " + std::to_string(requested_);
  }

  StopFlag stop_;
  std::function<void()> waker_;  // touches the run's feeds: only while !done_
  // Orders waker_ calls against the end of the run: the last replica_done() sets done_ under
  // it, so a cancel() after the end (a device destructor, a late Run::cancel) never wakes
  // feeds the host may already have destroyed, and one during a wake keeps the run open.
  std::mutex wake_mutex_;
  std::uint64_t requested_;
  std::vector<ReplicaEnd> ends_;
  std::atomic<std::uint32_t> remaining_;
  std::atomic<std::uint32_t> attached_{0};  // see attach()
  std::atomic<bool> done_{false};
  WaitPoint done_point_;
  std::chrono::steady_clock::time_point started_, ended_;
  mutable std::mutex mutex_;
  std::optional<Failure> failure_;
  std::uint32_t more_failures_ = 0;
  std::optional<StallError> stalled_;  // under mutex_: a stall that ended the run
  // One wait record per replica, each on its own cache line: note0_ for a run of one replica
  // (no allocation), more_notes_ for more.
  WaitNote note0_;
  std::unique_ptr<WaitNote[]> more_notes_;
  WaitNote* notes_;
  std::unique_ptr<StallWatch> watch_;  // while the monitor watches the run
  // Stops watching (waits for a look at the run in progress). Idempotent. Never throws.
  void unwatch() noexcept;
};

// A std::stop_callback's callable: cancels a run (a caller's std::stop_token, or an entry
// point's CancelGate, watching an Engine run or a loop).
struct CancelRun {
  RunControl* control;
  void operator()() const noexcept { control->cancel(); }
};

// Host thread. Writes a loop's trace; a failure is logged, not thrown (the run's result
// matters more). Blocks on file I/O; allocates. Never throws.
void write_trace_or_log(const Trace& trace, const std::string& path) noexcept;
// Any thread. BSPFLOW_TRACE, or "" when unset. Never blocks; may allocate (the returned
// string). Throws only std::bad_alloc.
std::string trace_path_from_env();

}  // namespace detail

}  // namespace bspflow
