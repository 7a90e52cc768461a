// Streams: the untyped part (see bspflow/runtime/stream.hpp): config checks, placement
// checks, starting one device job per segment, cancel, and the result.
#include "bspflow/runtime/stream.hpp"

#include <string>

#include "bspflow/base/log.hpp"

namespace bspflow {

void StreamConfig::validate(std::uint32_t devices) const {
  if (capacity < 1 || capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("StreamConfig::capacity", capacity,
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
}

namespace detail {

std::uint32_t next_request_producer_id() noexcept {
  static std::atomic<std::uint32_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed);  // relaxed: only uniqueness matters
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
  remaining_.fetch_sub(1, std::memory_order_seq_cst);
  done_.notify();
}

void StreamRunState::wait_done() {
  done_.wait([&] { return remaining_.load(std::memory_order_seq_cst) == 0; });
}

StreamCore::StreamCore(DeviceList d, StreamConfig c) : devices(d), config(std::move(c)) {}

StreamCore::~StreamCore() {
  if (running_) {
    cancel();
    wait_segments();
  }
}

WaitPolicy StreamCore::policy_for(std::uint32_t index) const {
  const WaitPolicy policy = config.device_wait.empty() ? config.wait : config.device_wait.at(index);
  return devices[index].placement().wait_policy(policy);
}

void StreamCore::start(std::function<void()> wake_feeds) {
  for (auto& reset : ring_resets) reset();
  state_ = std::make_shared<StreamRunState>(static_cast<std::uint32_t>(segments.size()));
  state_->set_waker([wakes = ring_wakes, wake_feeds = std::move(wake_feeds)] {
    for (const auto& w : wakes) w();
    wake_feeds();
  });
  started_ = std::chrono::steady_clock::now();
  running_ = true;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    SegmentBase* seg = segments[i].get();
    Device& device = devices[seg->device_index];
    const WaitPolicy policy = policy_for(seg->device_index);
    auto state = state_;
    const OnError on_error = config.on_error;
    try {
      device.submit(DeviceJob{[seg, &device, policy, on_error, state] {
                                seg->run(device, policy, on_error, *state);
                                state->segment_done();
                              },
                              [state] { state->cancel(); }});
    } catch (...) {
      // This device refused the job: stop the ones started, let them end, then report.
      state_->cancel();
      for (std::size_t k = i; k < segments.size(); ++k) state_->segment_done();
      state_->wait_done();
      running_ = false;
      throw;
    }
  }
}

void StreamCore::wait_segments() {
  if (!running_) return;
  state_->wait_done();
  state_->disarm();
  running_ = false;
}

void StreamCore::cancel() noexcept {
  if (state_) state_->cancel();
}

StreamResult StreamCore::finish(std::uint64_t accepted, std::uint64_t delivered,
                                std::uint64_t errors) {
  StreamResult r;
  r.elapsed = std::chrono::steady_clock::now() - started_;
  r.accepted = accepted;
  r.answered = delivered;
  r.errors = errors;
  r.unanswered = accepted >= delivered ? accepted - delivered : 0;
  r.failure = state_ ? state_->failure() : nullptr;
  if (r.failure) {
    r.status = RunStatus::kFailed;
  } else if (state_ && state_->stop.requested()) {
    r.status = RunStatus::kCancelled;
  } else {
    r.status = RunStatus::kCompleted;
  }
  // A Stream's normal end reads "drained": the infeed closed and everything answered.
  r.message = std::string(r.status == RunStatus::kCompleted ? "drained" : to_string(r.status)) +
              ": " + std::to_string(accepted) + " request(s) accepted, " +
              std::to_string(delivered) + " answered (" + std::to_string(errors) +
              " with an error), " + std::to_string(r.unanswered) + " unanswered";
  if (r.failure) r.message += "; " + r.failure->message;
  if (r.status == RunStatus::kCompleted && r.unanswered != 0) {
    // Cannot happen by design: say so loudly rather than hide a lost request.
    log(LogLevel::kError, "stream drained with unanswered requests: " + r.message);
  }
  return r;
}

}  // namespace detail
}  // namespace bspflow
