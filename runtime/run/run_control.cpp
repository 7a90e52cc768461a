// RunControl: the shared state of one run (see bspflow/run/internal/run_control.hpp).
#include "bspflow/run/internal/run_control.hpp"

#include <charconv>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>

#include "bspflow/base/log.hpp"
#include "bspflow/devices/device_error.hpp"
#include "bspflow/run/detail/run_monitor.hpp"

namespace bspflow {

const char* to_string(RunStatus s) noexcept {
  switch (s) {
    case RunStatus::kCompleted:
      return "completed";
    case RunStatus::kEndOfData:
      return "end of data";
    case RunStatus::kCancelled:
      return "cancelled";
    case RunStatus::kFailed:
      return "failed";
  }
  return "?";
}

namespace detail {

RunControl::RunControl(std::uint32_t replicas, std::uint64_t requested)
    : requested_(requested), ends_(replicas), remaining_(replicas),
      started_(std::chrono::steady_clock::now()),
      more_notes_(replicas > 1 ? std::make_unique<WaitNote[]>(replicas) : nullptr),
      notes_(replicas > 1 ? more_notes_.get() : &note0_) {
  // Until its device starts the replica, it waits for its turn there.
  for (std::uint32_t r = 0; r < replicas; ++r) {
    notes_[r].site.store(&not_started_site(), std::memory_order_relaxed);  // before any thread
  }
}

RunControl::~RunControl() {
  unwatch();
}

void RunControl::watch(const StallCheck& check, std::string name,
                       std::vector<WatchedDevice> devices) {
  if (check.limit.count() == 0 || watch_) return;
  auto w = std::make_unique<StallWatch>();
  w->control = this;
  w->replicas = static_cast<std::uint32_t>(ends_.size());
  w->name = std::move(name);
  w->devices = std::move(devices);
  w->devices.resize(ends_.size());
  w->check = check;
  watch_run(w.get());
  watch_ = std::move(w);
}

void RunControl::unwatch() noexcept {
  if (!watch_) return;
  unwatch_run(watch_.get());
  watch_.reset();  // the monitor no longer holds it
}

void RunControl::stall(const std::string& message, std::vector<StallError::Wait> waits) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!failure_ && !stalled_) {
      try {
        stalled_.emplace(message, std::move(waits));
      } catch (...) {  // no memory for the report: end the run all the same
      }
    }
  }
  cancel();
}

void RunControl::cancel() noexcept {
  stop_.set();
  std::lock_guard lock(wake_mutex_);
  if (waker_ && !done()) waker_();
}

void RunControl::fail(Failure f) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!failure_) {
      failure_ = std::move(f);
    } else {
      ++more_failures_;
    }
  }
  cancel();
}

void RunControl::replica_done(std::uint32_t replica, ReplicaEnd end) noexcept {
  ends_[replica] = end;  // each replica writes only its own slot
  // relaxed: see WaitNote (a report reads it; a move so the monitor sees the change).
  notes_[replica].site.store(&ended_site(), std::memory_order_relaxed);
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // No look at the run after this (its sites may read feeds the host frees once done).
    unwatch();
    ended_ = std::chrono::steady_clock::now();  // published by done_
    {
      std::lock_guard lock(wake_mutex_);
      done_.store(true, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
    }
    done_point_.notify();
  }
}

void RunControl::wait_detached() const noexcept {
  auto detached = [&] { return attached_.load(std::memory_order_acquire) == 0; };
  if (spin_until(detached)) return;
  while (!detached()) std::this_thread::yield();
}

ModeledTime RunControl::modeled() const noexcept {
  ModeledTime slowest{};
  std::uint64_t undeclared = 0;
  for (const ReplicaEnd& e : ends_) {
    if (e.modeled.total > slowest.total) slowest = e.modeled;
    undeclared += e.modeled.undeclared;
  }
  slowest.undeclared = undeclared;
  return slowest;
}

RunStatus RunControl::finish(std::vector<std::uint64_t>& iterations, std::string& message) {
  iterations.clear();
  for (const ReplicaEnd& e : ends_) iterations.push_back(e.iterations);
  {
    std::lock_guard lock(mutex_);
    if (failure_) {
      std::ostringstream os;
      os << "device " << failure_->device << " (replica " << failure_->replica
         << ") failed at iteration " << failure_->iteration << of_requested() << ": "
         << describe_exception(failure_->cause);
      if (more_failures_ > 0) {
        os << " (and " << more_failures_ << " more replica" << (more_failures_ == 1 ? "" : "s")
           << " failed)";
      }
      Failure f = std::move(*failure_);
      failure_.reset();
      throw DeviceError(os.str(), f.device, f.replica, f.iteration, std::move(f.cause));
    }
    if (stalled_) {
      StallError e = std::move(*stalled_);
      stalled_.reset();
      throw e;
    }
  }
  RunStatus status = RunStatus::kCompleted;
  for (const ReplicaEnd& e : ends_) {
    if (e.status == RunStatus::kCancelled) status = RunStatus::kCancelled;
    if (e.status == RunStatus::kEndOfData && status == RunStatus::kCompleted) {
      status = RunStatus::kEndOfData;
    }
  }
  const auto n = ends_.size();
  if (status == RunStatus::kCompleted) {
    // Every run that goes well ends here: built without a stream (this message through an
    // ostringstream took 900 ns on this project's VM, concatenated 220-330 ns) and without
    // snprintf (its format parsing was 1,700 of the 3,800 instructions of a loop's get(),
    // counted with callgrind). Formatted in place: one allocation for the string.
    auto put_count = [&](std::uint64_t v) {
      char digits[24];  // 20 at most
      message.append(digits, std::to_chars(digits, digits + sizeof(digits), v).ptr);
    };
    message.clear();
    message.reserve(80);  // the longest: 10 + 20 + 15 + 20 + 9 characters
    message += "completed ";
    put_count(requested_);
    message += requested_ == 1 ? " iteration on " : " iterations on ";
    put_count(n);
    message += n == 1 ? " replica" : " replicas";
    return status;
  }
  std::ostringstream os;
  switch (status) {
    case RunStatus::kCompleted:  // (returned above)
      break;
    case RunStatus::kEndOfData:
    case RunStatus::kCancelled:
    case RunStatus::kFailed: {  // (not reached: a failure throws above)
      os << (status == RunStatus::kEndOfData ? "end of data: infeed closed and drained"
                                             : "cancelled");
      const char* sep = " (";
      for (std::size_t r = 0; r < n; ++r) {
        os << sep << "replica " << r << " on device " << ends_[r].device << ": "
           << ends_[r].iterations << of_requested() << " iteration"
           << (ends_[r].iterations == 1 && open_ended() ? "" : "s");
        if (ends_[r].status != status) os << ", " << to_string(ends_[r].status);
        sep = "; ";
      }
      os << ")";
      break;
    }
  }
  message = os.str();
  return status;
}

void write_trace_or_log(const Trace& trace, const std::string& path) noexcept {
  try {
    trace.write_chrome_json(path);
  } catch (const std::exception& e) {
    log(LogLevel::kError, e.what());
  }
}

std::string trace_path_from_env() {
  // The library reads the environment and never writes it.
  const char* env = std::getenv("BSPFLOW_TRACE");  // NOLINT(concurrency-mt-unsafe)
  return env != nullptr ? std::string(env) : std::string();
}

}  // namespace detail
}  // namespace bspflow
