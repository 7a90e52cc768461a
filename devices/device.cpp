#include "bspflow/devices/device.hpp"

#include <sstream>

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/devices/device_error.hpp"

namespace bspflow {

void DeviceConfig::validate() const {
  if (tiles < 1 || tiles > tunables::kMaxTiles) {
    detail::throw_bad_value("tiles", tiles, "must be in 1.." + std::to_string(tunables::kMaxTiles));
  }
  if (bytes_per_tile < tunables::kArenaAlignment || bytes_per_tile > tunables::kMaxBytesPerTile) {
    detail::throw_bad_value("bytes_per_tile", bytes_per_tile,
                            "must be in " + std::to_string(tunables::kArenaAlignment) + ".." +
                                std::to_string(tunables::kMaxBytesPerTile));
  }
  model.validate();
}

namespace {
const DeviceConfig& validated(const DeviceConfig& c) {
  c.validate();
  return c;
}
Placement placement_for(std::uint32_t id, const DeviceConfig& config,
                        const std::optional<Placement>& given) {
  if (given) return *given;
  Placement p = Topology::get().place(id + 1, config.pin, config.host_cores)[id];
  p.sharing = 1;  // alone, as far as this device knows
  return p;
}
std::string budget(const DeviceConfig& c) {
  return format_bytes(c.memory_bytes()) + " (tiles " + std::to_string(c.tiles) +
         " x bytes_per_tile " + format_bytes(c.bytes_per_tile) + ")";
}
// The device's memory, checked against the machine's (and, on a machine with several NUMA
// nodes, its node's): a device cannot have more than there is.
std::size_t checked_memory(std::uint32_t id, const DeviceConfig& c, const Placement& p) {
  const Topology& topo = Topology::get();
  const std::size_t want = c.memory_bytes();
  auto refuse = [&](const std::string& where, std::size_t has) {
    throw OutOfMemoryError("device " + std::to_string(id) + " asks for " + budget(c) +
                               ", more than " + where + " has (" + format_bytes(has) +
                               "): lower tiles or bytes_per_tile",
                           want, has);
  };
  if (const std::size_t machine = topo.memory_bytes(); machine > 0 && want > machine)
    refuse("this machine", machine);
  if (topo.numa_nodes() > 1) {
    const std::size_t node = topo.numa_node_memory_bytes(p.numa_node);
    if (node > 0 && want > node) refuse("its NUMA node " + std::to_string(p.numa_node), node);
  }
  return want;
}
}  // namespace

Device::Device(std::uint32_t id, const DeviceConfig& config, std::optional<Placement> placement) try
    : id_(id), config_(validated(config)), placement_(placement_for(id, config_, placement)),
      arena_(checked_memory(id, config_, placement_), placement_.numa_node,
             "device " + std::to_string(id)) {
  thread_ = std::thread([this] { thread_main(); });
} catch (const std::bad_alloc&) {
  // The system would not map the device's memory (the arena reserves it whole and commits
  // pages as they are used): say who asked for what.
  const std::size_t machine = Topology::get().memory_bytes();
  throw OutOfMemoryError(
      "device " + std::to_string(id) + ": the system refused to reserve its memory, " +
          budget(config) + ", on a machine with " + format_bytes(machine) +
          " (devices made before it hold theirs too): lower tiles or bytes_per_tile, or "
          "make fewer devices",
      config.memory_bytes(), 0);
}

Device::~Device() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    if (running_ != nullptr && running_->cancel) running_->cancel();
    for (std::size_t k = next_job_; k < jobs_.size(); ++k) {
      if (jobs_[k].cancel) jobs_[k].cancel();
    }
  }
  submitted_.fetch_add(1, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
  mailbox_.notify();
  thread_.join();
}

void Device::submit(DeviceJob job) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw Error("device " + std::to_string(id_) + " is shutting down");
    jobs_.push_back(std::move(job));
  }
  submitted_.fetch_add(1, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
  mailbox_.notify();
}

bool Device::pinned() const noexcept {
  started_.wait([&] { return pin_state_.load() != 0; });
  return pin_state_.load() == 1;
}

void Device::thread_main() {
  detail::name_this_thread("bspflow-dev", id_);
  bool pinned = false;
  if (config_.pin && placement_.core) pinned = Topology::get().pin_current_thread(*placement_.core);
  pin_state_.store(pinned ? 1 : 2);  // seq_cst: see WaitPoint::notify()
  started_.notify();
  if (config_.pin && placement_.core && !pinned) {
    log(LogLevel::kWarning, "device " + std::to_string(id_) + ": could not pin to core " +
                                std::to_string(*placement_.core) + "; running unpinned");
  }
  std::uint64_t seen = 0;  // submissions (and stop requests) already looked at
  for (;;) {
    mailbox_.wait([&] { return submitted_.load() != seen; });
    seen = submitted_.load();
    // One lock per job: taking the next job and letting go of the last one share it. The
    // host submits its next job just as a job ends (a loop called in a loop), so a second
    // lock there found the host holding the mutex often enough to park both threads.
    std::unique_lock lock(mutex_);
    for (;;) {
      if (next_job_ == jobs_.size()) {
        jobs_.clear();  // keeps the room
        next_job_ = 0;
        if (stopping_) return;
        break;
      }
      DeviceJob job = std::move(jobs_[next_job_]);
      jobs_[next_job_++] = DeviceJob{};  // (what was moved from holds nothing now)
      running_ = &job;
      lock.unlock();
      // A job's own errors are its business (a loop records them for its host caller);
      // anything escaping is a bug in the job, reported rather than terminating.
      try {
        job.run();
      } catch (const std::exception& e) {
        log(LogLevel::kError, "device " + std::to_string(id_) + ": job threw: " + e.what());
      } catch (...) {
        log(LogLevel::kError, "device " + std::to_string(id_) + ": job threw a non-exception");
      }
      job.run = nullptr;  // what it holds goes now, outside the lock (cancel may still be called)
      lock.lock();
      running_ = nullptr;
    }
  }
}

DeviceGroup::DeviceGroup(std::uint32_t count, const DeviceConfig& config) {
  if (count < 1 || count > tunables::kMaxReplicas) {
    detail::throw_bad_value("device count", count,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
  config.validate();
  const Topology& topo = Topology::get();
  const std::vector<Placement> placements = topo.place(count, config.pin, config.host_cores);
  for (const Placement& p : placements) max_sharing_ = std::max(max_sharing_, p.sharing);
  if (max_sharing_ > 1) {
    std::ostringstream os;
    const std::size_t cores = topo.instance_cores().size();
    os << count << " devices on " << cores << (cores == 1 ? " core" : " cores");
    if (cores < topo.cores()) os << " of this process (" << topo.instance_cores_reason() << ")";
    if (!config.host_cores.empty())
      os << " (" << config.host_cores.size() << " kept for host threads)";
    os << ": devices share cores (up to " << max_sharing_
       << " per core); waits yield the core and park after a bounded spin, so this works, but "
          "expect lower throughput than with a core per device";
    log(LogLevel::kWarning, os.str());
  }
  // Together beyond the machine: allowed (an arena commits pages only as they are used),
  // but said, since a model that fills them will not fit.
  if (const std::size_t machine = topo.memory_bytes();
      machine > 0 && count > 1 &&
      static_cast<double>(count) * static_cast<double>(config.memory_bytes()) >
          static_cast<double>(machine)) {
    log(LogLevel::kWarning,
        std::to_string(count) + " devices of " + budget(config) + " each hold " +
            format_bytes(std::uint64_t{count} * config.memory_bytes()) +
            " of device memory together, more than this machine's " + format_bytes(machine) +
            ": this works while they use less than that (pages are committed as they are used), "
            "but models that fill them will not fit");
  }
  devices_.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    devices_.push_back(std::make_unique<Device>(i, config, placements[i]));
  }
}

}  // namespace bspflow
