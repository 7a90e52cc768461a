// Streams: the untyped part (see bspflow/stream/stream.hpp): config checks, placement
// checks, starting one device job per segment, the stall monitor, cancel, and the result.
#include "bspflow/stream/stream.hpp"

#include <algorithm>
#include <string>

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/log.hpp"

namespace bspflow {

const char* to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::kStageFailed:
      return "stage_failed";
    case ErrorKind::kDeadlineExceeded:
      return "deadline_exceeded";
    case ErrorKind::kRejected:
      return "rejected";
    case ErrorKind::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

const char* to_string(Refusal r) noexcept {
  switch (r) {
    case Refusal::kNone:
      return "accepted";
    case Refusal::kQueueFull:
      return "queue_full";
    case Refusal::kDeadlineUnreachable:
      return "deadline_unreachable";
    case Refusal::kDeadlinePassed:
      return "deadline_passed";
    case Refusal::kClientFull:
      return "client_full";
    case Refusal::kShed:
      return "shed";
    case Refusal::kClosed:
      return "closed";
  }
  return "unknown";
}

StreamConfig StreamConfig::from(const Options& options) {
  StreamConfig c;
  c.replicas = options.replicas();
  return c;
}

void StreamConfig::validate(std::uint32_t devices) const {
  if (hop_capacity < 1 || hop_capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("StreamConfig::hop_capacity", hop_capacity,
                            "must be in 1.." + std::to_string(tunables::kMaxQueueCapacity) +
                                " requests between two devices");
  }
  wait.validate();
  if (!device_wait.empty() && device_wait.size() != devices) {
    detail::throw_bad_value("StreamConfig::device_wait size", device_wait.size(),
                            "must be 0 (every device uses `wait`) or one per device of the "
                            "stream (" +
                                std::to_string(devices) + ")");
  }
  for (const WaitPolicy& w : device_wait) w.validate();
  if (replicas < 1 || replicas > kMaxStreamReplicas) {
    detail::throw_bad_value("StreamConfig::replicas", replicas,
                            "must be in 1.." + std::to_string(kMaxStreamReplicas));
  }
  if (devices % replicas != 0) {
    detail::throw_bad_value("StreamConfig::replicas", replicas,
                            "must divide the stream's " + std::to_string(devices) +
                                " device(s): each replica gets devices/replicas of them");
  }
  constexpr std::size_t kMax = std::size_t{1} << 20;
  if (admission.queue_capacity < 1 || admission.queue_capacity > kMax) {
    detail::throw_bad_value("StreamConfig::admission.queue_capacity", admission.queue_capacity,
                            "must be in 1..1048576 requests");
  }
  if (response_capacity < 1 || response_capacity > kMax) {
    detail::throw_bad_value("StreamConfig::response_capacity", response_capacity,
                            "must be in 1..1048576 responses per client");
  }
  if (call_stall_limit < std::chrono::nanoseconds::zero() ||
      call_stall_limit > std::chrono::nanoseconds(std::chrono::hours(24))) {
    detail::throw_bad_value("StreamConfig::call_stall_limit", call_stall_limit,
                            "must be in 0 ns..24 h (0 turns stall detection off)");
  }
}

namespace detail {

std::uint32_t next_client_id() noexcept {
  static std::atomic<std::uint32_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed);  // relaxed: only uniqueness matters
}

std::shared_ptr<const RequestError> make_request_error(ErrorKind kind, const RequestMeta& meta,
                                                       std::uint32_t stage,
                                                       const std::string& stage_name,
                                                       std::uint32_t device, const std::string& why,
                                                       std::exception_ptr cause) {
  auto e = std::make_shared<RequestError>();
  e->kind = kind;
  e->stage = stage;
  e->stage_name = stage_name;
  e->device = device;
  e->id = meta.id;
  e->cause = std::move(cause);
  e->message = "stage '" + stage_name + "' (" + std::to_string(stage) + ") on device " +
               std::to_string(device) + ": request " + std::to_string(meta.id.sequence) +
               " of client " + std::to_string(meta.id.client) + " " + why;
  return e;
}

std::shared_ptr<const RequestError> SegmentBase::describe(const StageFailure& f,
                                                          const RequestId& id) const {
  const std::uint32_t at = f.stage - first_stage;
  const std::string& name = names.at(at);
  const std::uint32_t device = devices.at(at);
  if (f.kind != ErrorKind::kStageFailed) {
    RequestMeta meta;
    meta.id = id;
    return make_request_error(f.kind, meta, f.stage, name, device,
                              f.kind == ErrorKind::kCancelled
                                  ? "was not run: its client cancelled it"
                                  : "was not run: its deadline had passed");
  }
  auto e = std::make_shared<RequestError>();
  e->kind = ErrorKind::kStageFailed;
  e->stage = f.stage;
  e->stage_name = name;
  e->device = device;
  e->id = id;
  e->cause = f.cause;
  e->message = "stage '" + e->stage_name + "' (" + std::to_string(f.stage) + ") on device " +
               std::to_string(e->device) + " failed on request " + std::to_string(id.sequence) +
               " of client " + std::to_string(id.client) + ": " + describe_exception(f.cause);
  return e;
}

std::shared_ptr<const RequestError> SegmentBase::runtime_failure(
    const std::exception_ptr& e) const {
  auto err = std::make_shared<RequestError>();
  err->stage = first_stage;
  err->stage_name = names.front();
  err->device = devices.front();
  err->cause = e;
  err->message = "stream runtime failed on device " + std::to_string(devices.front()) + ": " +
                 describe_exception(e);
  if (replica_meter != nullptr) replica_meter->failed.store(true, std::memory_order_relaxed);
  return err;
}

void SegmentBase::answer_held(const RequestMeta& meta, std::shared_ptr<const RequestError> error,
                              std::uint32_t stage) {
  if (!error) {
    const std::uint32_t at =
        std::min<std::uint32_t>(stage - first_stage, static_cast<std::uint32_t>(names.size() - 1));
    error = make_request_error(ErrorKind::kCancelled, meta, stage, names[at], devices[at],
                               "was not run: the stream was cancelled");
  }
  answerer->answer_error(meta, std::move(error));
}

void StreamRunState::cancel() noexcept {
  stop.set();
  std::lock_guard lock(waker_mutex_);
  if (waker_) waker_();
}

void StreamRunState::set_waker(std::function<void()> waker) {
  std::lock_guard lock(waker_mutex_);
  waker_ = std::move(waker);
}

void StreamRunState::disarm() {
  std::lock_guard lock(waker_mutex_);
  waker_ = nullptr;
}

void StreamRunState::fail(std::shared_ptr<const RequestError> error) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!failure_) failure_ = std::move(error);
  }
  cancel();
}

std::shared_ptr<const RequestError> StreamRunState::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

void StreamRunState::segment_done() noexcept {
  if (ending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && on_end_) {
    // The last segment: no other touches the rings or the queue any more.
    try {
      on_end_();
    } catch (...) {  // out of memory while answering: the host's wait() sweeps again
    }
  }
  remaining_.fetch_sub(1, std::memory_order_seq_cst);
  done_.notify();
}

void StreamRunState::wait_done() {
  done_.wait([&] { return remaining_.load(std::memory_order_seq_cst) == 0; });
}

StreamCore::StreamCore(DeviceList d, StreamConfig c) : devices(d), config(std::move(c)) {
  if (devices.size() == 0) throw Error("StreamBuilder: a stream needs at least one device");
  config.validate(devices.size());
  replicas = config.replicas;
  per_replica = devices.size() / replicas;
  ring_depths.resize(replicas);
}

StreamCore::~StreamCore() {
  if (running_) {
    cancel();
    wait_segments();
  }
}

bool StreamCore::share_core(std::uint32_t replica, std::uint32_t a, std::uint32_t b) const {
  const auto& pa = devices[device_of(replica, a)].placement();
  const auto& pb = devices[device_of(replica, b)].placement();
  return pa.core.has_value() && pb.core.has_value() && *pa.core == *pb.core;
}

void StreamCore::finish_build() {
  const auto stages = static_cast<std::uint32_t>(stage_names.size());
  stage_meters.clear();
  meter_ptrs.clear();
  for (std::uint32_t i = 0; i < replicas * stages; ++i) {
    stage_meters.push_back(std::make_unique<StageMeter>());
    meter_ptrs.push_back(stage_meters.back().get());
  }
  for (std::uint32_t r = 0; r < replicas; ++r) {
    replica_meters.push_back(std::make_unique<ReplicaMeter>());
  }
  // The modeled clock: each stage's device clock and declared cost (StreamBuilder::cost).
  stage_costs.resize(stages);
  stage_models.assign(static_cast<std::size_t>(replicas) * stages, StageModel{});
  for (std::uint32_t r = 0; r < replicas; ++r) {
    for (std::uint32_t k = 0; k < stages; ++k) {
      Device& device = devices[device_of(r, stage_devices[k])];
      StageModel& m = stage_models[static_cast<std::size_t>(r) * stages + k];
      m.clock = &device.clock();
      if (!stage_costs[k]) continue;
      const DeviceModel& dm = device.config().model;
      const std::uint32_t tiles = device.config().tiles;
      // A call's fixed part (with its on-chip sync), and each item's share beyond it.
      m.per_call_ns = dm.ns(dm.compute_cycles(stage_costs[k]->second, tiles));
      m.per_item_ns =
          dm.ns(dm.compute_cycles(stage_costs[k]->first, tiles) - dm.sync_cycles_on_chip);
      m.declared = true;
    }
  }
  for (auto& seg : segments) {
    seg->meters = meter_ptrs.data() + static_cast<std::size_t>(seg->replica) * stages;
    seg->models = stage_models.data() + static_cast<std::size_t>(seg->replica) * stages;
    seg->replica_meter = replica_meters[seg->replica].get();
    seg->timing = timing();
    if (BatchHeadBase* b = seg->batch_head()) {
      b->meters = seg->meters;
      b->models = seg->models;
      b->stages = stages;
      b->timing = timing();
    }
  }
  // Replicas on shared cores take turns: say so once, at build time.
  if (replicas > 1) {
    for (std::uint32_t i = 0; i < devices.size(); ++i) {
      for (std::uint32_t j = i + 1; j < devices.size(); ++j) {
        const auto& pi = devices[i].placement();
        const auto& pj = devices[j].placement();
        if (i / per_replica == j / per_replica || !pi.core || !pj.core || *pi.core != *pj.core) {
          continue;
        }
        log(LogLevel::kWarning,
            "stream: replica " + std::to_string(i / per_replica) + " (device " +
                std::to_string(devices[i].id()) + ") and replica " +
                std::to_string(j / per_replica) + " (device " + std::to_string(devices[j].id()) +
                ") share core " + std::to_string(*pi.core) +
                ": they take turns on it, so the second replica adds no throughput there; "
                "give each replica cores of its own (fewer replicas or devices)");
        return;
      }
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

void StreamCore::start(std::function<void()> wake_intake) {
  for (auto& reset : ring_resets) reset();
  for (auto& m : replica_meters) {
    m->stalled.store(false, std::memory_order_relaxed);
    m->failed.store(false, std::memory_order_relaxed);
  }
  state_ = std::make_shared<StreamRunState>(static_cast<std::uint32_t>(segments.size()));
  state_->set_waker([wakes = ring_wakes, wake_intake = std::move(wake_intake)] {
    for (const auto& w : wakes) w();
    wake_intake();
  });
  // Whoever ends last answers what a stopped run still holds: queued, or between devices.
  state_->set_on_end([this] { answer_leftovers(); });
  // The run's stop, watched from here (after the waker, before any segment starts).
  if (scope_) on_stop_.emplace(scope_->token(), CancelStream{state_});
  // The stall monitor before any device starts: if its thread cannot start (out of memory, no
  // threads left), start() throws with nothing running. (Started last, it left a run going.)
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
    SegmentBase* seg = segments[i].get();
    seg->origin = started_;
    if (BatchHeadBase* b = seg->batch_head()) b->origin = started_;
    seg->answerer = answerer;
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
  std::vector<std::int64_t> reported;  // the call reported, by start
  try {
    reported.assign(stage_meters.size(), 0);
  } catch (...) {
    return;
  }
  const auto stages = static_cast<std::uint32_t>(stage_names.size());
  const auto period = std::clamp<std::chrono::nanoseconds>(limit / 4, std::chrono::milliseconds(1),
                                                           std::chrono::milliseconds(100));
  std::unique_lock lock(monitor_mutex_);
  while (!monitor_cv_.wait_for(lock, period, [&] { return monitor_stop_; })) {
    const std::int64_t now = stream_ns(StreamClock::now());
    for (std::uint32_t r = 0; r < replicas; ++r) {
      bool stalled = false;
      for (std::uint32_t s = 0; s < stages; ++s) {
        const std::size_t i = static_cast<std::size_t>(r) * stages + s;
        StageMeter& m = *stage_meters[i];
        const std::int64_t since = m.busy_since.load(std::memory_order_relaxed);
        if (since == 0 || now - since < limit.count()) continue;
        stalled = true;
        if (reported[i] == since) continue;
        reported[i] = since;
        bump(m.stalls);
        const std::uint32_t device = devices[device_of(r, stage_devices[s])].id();
        try {
          log(LogLevel::kWarning,
              "stream stall: stage '" + stage_names[s] + "' (" + std::to_string(s) +
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
  intake->close();
  if (state_->stop.requested()) {
    // Every request still queued or between devices gets its answer.
    for (const auto& sweep : ring_cancels) sweep(*answerer);
    intake->cancel_all(*answerer);
  }
}

void StreamCore::cancel() noexcept {
  gate_.cancel();
}

std::int64_t StreamCore::per_request_ns() const noexcept {
  const auto stages = stage_names.size();
  std::int64_t sum = 0;
  for (std::uint32_t r = 0; r < replicas; ++r) {
    std::int64_t worst = 0;
    for (std::size_t s = 0; s < stages; ++s) {
      const StageMeter& m = *meter_ptrs[r * stages + s];
      const std::int64_t drain = m.drain_ns.load(std::memory_order_relaxed);
      worst = std::max(worst, drain > 0 ? drain : m.per_item_ns.load(std::memory_order_relaxed));
    }
    sum += worst;
  }
  return sum / replicas;
}

std::int64_t StreamCore::path_ns() const noexcept {
  const auto stages = stage_names.size();
  std::int64_t sum = 0;
  for (std::uint32_t r = 0; r < replicas; ++r) {
    std::int64_t path = 0, longest = 0;
    for (std::size_t s = 0; s < stages; ++s) {
      const std::int64_t call = meter_ptrs[r * stages + s]->call_ns.load(std::memory_order_relaxed);
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
    if (!m->stalled.load(std::memory_order_relaxed) && !m->failed.load(std::memory_order_relaxed)) {
      ++n;
    }
  }
  return n == 0 ? 1 : n;
}

}  // namespace detail
}  // namespace bspflow
