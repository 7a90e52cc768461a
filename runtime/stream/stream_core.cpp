// Streams: the untyped core (see bspflow/stream/detail/core.hpp): building, starting
// one device job per segment, the stall monitor, cancel, the answers a stopped run still owes,
// and the admission estimates.
#include "bspflow/stream/detail/core.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/log.hpp"

namespace bspflow::detail {

StreamCore::StreamCore(DeviceList d, StreamConfig c) : devices(std::move(d)), config(std::move(c)) {
  if (devices.size() == 0) throw Error("StreamBuilder: a stream needs at least one device");
  config.validate(devices.size());
  replicas = config.replicas;
  per_replica = devices.size() / replicas;
  runs.resize(replicas);
  for (std::uint32_t r = 0; r < replicas; ++r) {
    replica_meters.push_back(std::make_unique<ReplicaMeter>(config.priority_classes));
  }
}

StreamCore::~StreamCore() {
  if (running_) {
    cancel();
    wait_segments();
  }
  // Each version's memory goes back to its device's arena.
  for (std::uint32_t r = 0; r < runs.size(); ++r) {
    for (std::uint32_t n = 0; n < runs[r].memory.size(); ++n) {
      if (runs[r].memory[n] != nullptr) {
        devices[device_of(r, nodes[n].device)].arena().release(runs[r].memory[n]);
      }
    }
  }
}

bool StreamCore::share_core(std::uint32_t replica, std::uint32_t a, std::uint32_t b) const {
  const auto& pa = devices[device_of(replica, a)].placement();
  const auto& pb = devices[device_of(replica, b)].placement();
  return pa.core.has_value() && pb.core.has_value() && *pa.core == *pb.core;
}

void StreamCore::finish_build() {
  // Replicas on shared cores take turns: say so once, at build time.
  if (replicas < 2) return;
  for (std::uint32_t i = 0; i < devices.size(); ++i) {
    for (std::uint32_t j = i + 1; j < devices.size(); ++j) {
      const auto& pi = devices[i].placement();
      const auto& pj = devices[j].placement();
      if (i / per_replica == j / per_replica || !pi.core || !pj.core || *pi.core != *pj.core) {
        continue;
      }
      log(LogLevel::kWarning,
          "stream: replica " + std::to_string(i / per_replica) + " (device " +
              std::to_string(devices[i].id()) + ") and replica " + std::to_string(j / per_replica) +
              " (device " + std::to_string(devices[j].id()) + ") share core " +
              std::to_string(*pi.core) +
              ": they take turns on it, so the second replica adds no throughput there; "
              "give each replica cores of its own (fewer replicas or devices)");
      return;
    }
  }
}

WaitPolicy StreamCore::policy_for(std::uint32_t index) const {
  const WaitPolicy policy = config.device_wait.empty() ? config.wait : config.device_wait.at(index);
  const Placement& place = devices[index].placement();
  if (place.shares_core() && !place.shares_host && place.core) {
    // The core's other devices are all this stream's, and none of them runs a segment (their
    // stages were fused onto this device's thread): nobody there to yield to. Waits spin
    // tight, still bounded (busy-spin becomes spin-then-park), since the idle devices may
    // get other work later.
    std::uint32_t ours = 0;
    bool others_busy = false;
    for (std::uint32_t i = 0; i < devices.size(); ++i) {
      const Placement& p = devices[i].placement();
      if (!p.core || *p.core != *place.core) continue;
      ++ours;
      if (i == index) continue;
      for (const auto& seg : segments) others_busy = others_busy || seg->device_index == i;
    }
    if (ours == place.sharing && !others_busy) {
      return policy.strategy == WaitStrategy::kBusySpin ? WaitPolicy::spin_then_park() : policy;
    }
  }
  return place.wait_policy(policy);
}

void StreamCore::open_run(std::stop_token stop) {
  scope_.emplace(gate_, std::move(stop));
}

void StreamCore::close_run() noexcept {
  on_stop_.reset();
  scope_.reset();
}

namespace {
// Ends a stream's stall monitor thread, if it runs (its members, passed by StreamCore).
void stop_monitor(std::thread& monitor, std::mutex& mutex, std::condition_variable& cv,
                  bool& stop) noexcept {
  if (!monitor.joinable()) return;
  {
    std::lock_guard lock(mutex);
    stop = true;
  }
  cv.notify_all();
  monitor.join();
}
}  // namespace

void StreamCore::start(std::function<void()> wake_admission) {
  for (auto& run : runs) {
    for (auto& p : run.hops) p->reset();
  }
  for (auto& m : replica_meters) {
    m->stalled.store(false, std::memory_order_relaxed);
    m->failed.store(false, std::memory_order_relaxed);
    m->probing.store(false, std::memory_order_relaxed);
  }
  state_ = std::make_shared<StreamRunState>(static_cast<std::uint32_t>(segments.size()));
  std::vector<HopBase*> hops;
  for (auto& run : runs) {
    for (auto& p : run.hops) hops.push_back(p.get());
  }
  state_->set_waker([hops = std::move(hops), wake_admission = std::move(wake_admission)] {
    for (HopBase* p : hops) p->wake();
    wake_admission();
  });
  // Whoever ends last answers what a stopped run still holds: queued, or between devices.
  state_->set_on_end([this] { answer_leftovers(); });
  // The run's stop, watched from here (after the waker, before any segment starts).
  if (scope_) on_stop_.emplace(scope_->token(), CancelStream{state_});
  // The stall monitor before any device starts: if its thread cannot start (out of memory, no
  // threads left), start() throws with nothing running.
  if (timing() && config.call_stall_limit > std::chrono::nanoseconds::zero()) {
    monitor_stop_ = false;
    try {
      monitor_ = std::thread([this, limit = config.call_stall_limit] { monitor_loop(limit); });
    } catch (...) {
      on_stop_.reset();
      throw;
    }
  }
  started_ = std::chrono::steady_clock::now();
  running_ = true;
  // Every device's modeled clock starts with the one host call that launches the serving loop
  // (no device thread runs this stream's stages yet).
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    devices[d].clock().reset(static_cast<double>(devices[d].config().model.host_call.count()));
  }
  for (std::size_t i = 0; i < segments.size(); ++i) {
    Segment* seg = segments[i].get();
    seg->origin = started_;
    if (seg->batch) seg->batch->origin = started_;
    Device& device = devices[seg->device_index];
    auto state = state_;
    const OnError on_error = config.on_error;
    try {
      const WaitPolicy policy = policy_for(seg->device_index);
      device.submit(DeviceJob{[seg, policy, on_error, state] {
                                seg->run(policy, on_error, *state);
                                state->segment_done();
                              },
                              [state] { state->cancel(); }});
    } catch (...) {
      // This device refused the job: stop the ones started, let them end, then report.
      state_->cancel();
      for (std::size_t k = i; k < segments.size(); ++k) state_->segment_done();
      state_->wait_done();
      stop_monitor(monitor_, monitor_mutex_, monitor_cv_, monitor_stop_);
      on_stop_.reset();
      running_ = false;
      throw;
    }
  }
}

void StreamCore::monitor_loop(std::chrono::nanoseconds limit) {
  detail::name_this_thread("bspflow-smon");
  // Out of memory here must not end the process (an exception leaving a thread does): without
  // room for its bookkeeping the monitor stops for this run; a report it cannot write is
  // skipped (the stall is still counted and its replica still marked).
  std::vector<std::int64_t> reported;  // the call reported, by start: replica * nodes + node
  const auto n_nodes = static_cast<std::uint32_t>(nodes.size());
  try {
    reported.assign(static_cast<std::size_t>(replicas) * n_nodes, 0);
  } catch (...) {
    return;
  }
  const auto period = std::clamp<std::chrono::nanoseconds>(limit / 4, std::chrono::milliseconds(1),
                                                           std::chrono::milliseconds(100));
  std::unique_lock lock(monitor_mutex_);
  while (!monitor_cv_.wait_for(lock, period, [&] { return monitor_stop_; })) {
    const std::int64_t now = stream_ns(StreamClock::now());
    for (std::uint32_t r = 0; r < replicas; ++r) {
      bool stalled = false;
      for (std::uint32_t s = 0; s < n_nodes; ++s) {
        if (!runs[r].meters[s]) continue;
        const std::size_t i = static_cast<std::size_t>(r) * n_nodes + s;
        StageMeter& m = *runs[r].meters[s];
        const std::int64_t since = m.busy_since.load(std::memory_order_relaxed);
        if (since == 0 || now - since < limit.count()) continue;
        stalled = true;
        if (reported[i] == since) continue;
        reported[i] = since;
        bump(m.stalls);
        const std::uint32_t device = runs[r].nodes[s].device_id;
        try {
          log(LogLevel::kWarning,
              "stream stall: stage '" + nodes[s].name + "' (" + std::to_string(nodes[s].index) +
                  ") on device " + std::to_string(device) + " of replica " + std::to_string(r) +
                  " has held request " +
                  std::to_string(m.busy_sequence.load(std::memory_order_relaxed)) + " of client " +
                  std::to_string(m.busy_client.load(std::memory_order_relaxed)) + " for " +
                  std::to_string((now - since) / 1'000'000) +
                  " ms (StreamConfig::call_stall_limit " +
                  std::to_string(limit.count() / 1'000'000) +
                  " ms); its replica takes no new requests until it moves");
        } catch (...) {
        }
      }
      replica_meters[r]->stalled.store(stalled, std::memory_order_relaxed);
    }
  }
}

void StreamCore::wait_segments() {
  if (!running_) return;
  state_->wait_done();
  stop_monitor(monitor_, monitor_mutex_, monitor_cv_, monitor_stop_);
  answer_leftovers();  // done by the last segment already, unless it ran out of memory
  state_->disarm();
  running_ = false;
  close_run();
}

void StreamCore::answer_leftovers() {
  admission->close();
  if (state_->stop.requested()) {
    // Every request still queued or between devices gets its answer (once: a request held
    // in several hops is answered by the first sweep that finds it).
    for (auto& run : runs) {
      for (const auto& sweep : run.sweeps) sweep(*responder_base);
    }
    admission->cancel_all(*responder_base);
  }
}

void StreamCore::cancel() noexcept {
  gate_.cancel();
}

std::int64_t StreamCore::per_request_ns() const noexcept {
  std::int64_t sum = 0;
  for (std::uint32_t r = 0; r < replicas; ++r) {
    std::int64_t worst = 0;
    for (const auto& m : runs[r].meters) {
      if (!m) continue;
      const std::int64_t drain = m->drain_ns.load(std::memory_order_relaxed);
      worst = std::max(worst, drain > 0 ? drain : m->per_item_ns.load(std::memory_order_relaxed));
    }
    sum += worst;
  }
  return sum / replicas;
}

std::int64_t StreamCore::path_ns() const noexcept {
  std::int64_t sum = 0;
  for (std::uint32_t r = 0; r < replicas; ++r) {
    std::int64_t path = 0, longest = 0;
    for (const auto& m : runs[r].meters) {
      if (!m) continue;
      const std::int64_t call = m->call_ns.load(std::memory_order_relaxed);
      path += call;
      longest = std::max(longest, call);
    }
    sum += path + longest;
  }
  return sum / static_cast<std::int64_t>(replicas);
}

std::uint32_t StreamCore::live_replicas() const noexcept {
  std::uint32_t n = 0;
  for (const auto& m : replica_meters) {
    if (!m->closed_to_new() && !m->ejected.load(std::memory_order_relaxed)) ++n;
  }
  return n == 0 ? 1 : n;
}

std::uint32_t StreamCore::rotation() const noexcept {
  std::uint32_t n = 0;
  for (const auto& m : replica_meters) {
    if (!m->failed.load(std::memory_order_relaxed) && !m->ejected.load(std::memory_order_relaxed)) {
      ++n;
    }
  }
  return n;
}

void StreamCore::log_ejection(std::uint32_t replica, std::chrono::nanoseconds out) const {
  try {
    log(LogLevel::kWarning, "stream: replica " + std::to_string(replica) + " answered " +
                                std::to_string(config.ejection.consecutive_failures) +
                                " requests in a row with a stage failure: out of rotation for " +
                                describe_duration(out) +
                                ", then one request probes it (StreamConfig::ejection)");
  } catch (...) {
  }
}

}  // namespace bspflow::detail
