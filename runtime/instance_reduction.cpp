// A distributed Pipeline's exchange across instances (see detail/instance_reduction.hpp).
#include "detail/instance_reduction.hpp"

#include <algorithm>
#include <cstdio>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "detail/instance_wire.hpp"

namespace bspflow::detail {

namespace {
constexpr auto put64 = &InstanceWire::put64;
constexpr auto get64 = &InstanceWire::get64;
std::string hex(std::uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(v));
  return text;
}
// Tail fields (floats after the instance's offset).
constexpr std::size_t kCode = 0, kSteps = 1, kHasChecksum = 4, kChecksum = 5;
}  // namespace

InstanceReduction::InstanceReduction(Instance& instance, std::vector<std::size_t> slot_sizes,
                                     std::uint32_t check_interval)
    : instance_(instance), sizes_(std::move(slot_sizes)), check_interval_(check_interval),
      checksums_(sizes_.size()) {
  for (std::size_t n : sizes_) {
    offsets_.push_back(payload_);
    payload_ += n;
  }
  wire_.assign(payload_ + instance_.count() * kTail, 0.0f);
  stopped_.assign(wire_.size(), 0.0f);
}

void InstanceReduction::begin_run(std::uint64_t steps, std::function<void()> cancel) {
  total_steps_ += applied_.load(std::memory_order_relaxed);  // the previous run's
  steps_ = steps;
  cancel_ = std::move(cancel);
  mismatch_instance_ = stopped_instance_ = instance_.count();
  // relaxed: no device runs yet (the Engine's start orders these before them)
  posted_.store(0, std::memory_order_relaxed);
  claimed_.store(0, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  applied_.store(0, std::memory_order_relaxed);
  closed_.store(false, std::memory_order_relaxed);
  finished_.store(false, std::memory_order_relaxed);
  stopped_by_peer_ = false;
  served_ = false;
  mismatch_.clear();
}

std::span<float> InstanceReduction::segment(std::uint32_t slot) noexcept {
  return std::span<float>(wire_).subspan(offsets_[slot], sizes_[slot]);
}

bool InstanceReduction::check_due(std::uint64_t step) const noexcept {
  return check_interval_ != 0 && (total_steps_ + step) % check_interval_ == 0;
}

bool InstanceReduction::exchange(std::uint32_t slot, std::uint64_t step, std::uint64_t checksum,
                                 Spin spin) {
  const std::uint64_t done = done_.load(std::memory_order_seq_cst);
  if (closed_.load(std::memory_order_seq_cst) || done > step) return false;  // given up on
  if (done < step) {
    throw Error("instance reduction: slot " + std::to_string(slot) + " posted step " +
                std::to_string(step) + " while step " + std::to_string(done) +
                " is exchanged (internal schedule error)");
  }
  checksums_[slot].store(checksum, std::memory_order_relaxed);  // published by the fetch_add
  if (posted_.fetch_add(1, std::memory_order_seq_cst) + 1 == sizes_.size() && claim(step)) {
    exchange_step(step, Kind::kContributing);  // the last to post makes the call
  } else {
    // Whoever claimed the step (the last slot, or the host for a stopped instance) always
    // finishes its call, so this wait ends without looking at the stop flag.
    const WaitMark mark(&exchange_site_);
    device_point_.wait(
        [&] {
          return done_.load(std::memory_order_seq_cst) > step ||
                 closed_.load(std::memory_order_seq_cst);
        },
        spin);
  }
  return applied(step);
}

bool InstanceReduction::wait_done(std::uint64_t step, Spin spin) {
  const WaitMark mark(&exchange_site_);
  device_point_.wait(
      [&] {
        return done_.load(std::memory_order_seq_cst) > step ||
               closed_.load(std::memory_order_seq_cst);
      },
      spin);
  return applied(step);
}

void InstanceReduction::wake() noexcept {
  host_point_.notify();
}

void InstanceReduction::exchange_step(std::uint64_t step, Kind kind) noexcept {
  const bool contributing = kind != Kind::kStopped;
  bool applied = false;
  try {
    const std::uint32_t count = instance_.count(), me = instance_.index();
    std::vector<float>& buffer = contributing ? wire_ : stopped_;
    std::fill(buffer.begin() + static_cast<std::ptrdiff_t>(payload_), buffer.end(),
              0.0f);  // every tail
    float* mine = buffer.data() + payload_ + me * kTail;
    mine[kCode] = contributing ? 0.0f : 1.0f;
    put64(mine + kSteps, steps_);
    if (kind == Kind::kContributing && check_due(step)) {
      std::uint64_t h = 0xcbf29ce484222325ull;  // the slots' checksums, in slot order
      for (const auto& c : checksums_)
        h = (h ^ c.load(std::memory_order_relaxed)) * 0x100000001b3ull;
      mine[kHasChecksum] = 1.0f;
      put64(mine + kChecksum, h);
    }
    InstanceWire::sum(instance_, buffer);

    bool everyone = true, checked = true, steps_differ = false, checksums_differ = false;
    std::string steps_seen, checksums_seen;
    const float* first = buffer.data() + payload_;
    const std::uint64_t first_steps = get64(first + kSteps),
                        first_checksum = get64(first + kChecksum);
    for (std::uint32_t i = 0; i < count; ++i) {
      const float* t = buffer.data() + payload_ + i * kTail;
      if (t[kCode] != 0.0f && stopped_instance_ == count) stopped_instance_ = i;
      everyone = everyone && t[kCode] == 0.0f;
      checked = checked && t[kHasChecksum] == 1.0f;
      const bool steps_differ_here = get64(t + kSteps) != first_steps;
      const bool checksum_differs_here = get64(t + kChecksum) != first_checksum;
      if ((steps_differ_here || checksum_differs_here) && mismatch_instance_ == count)
        mismatch_instance_ = i;
      steps_differ = steps_differ || steps_differ_here;
      checksums_differ = checksums_differ || checksum_differs_here;
    }
    if (steps_differ || (everyone && checked && checksums_differ)) {
      for (std::uint32_t i = 0; i < count; ++i) {
        const float* t = buffer.data() + payload_ + i * kTail;
        const std::string who = (i ? ", instance " : "instance ") + std::to_string(i) + ": ";
        steps_seen += who + std::to_string(get64(t + kSteps));
        checksums_seen += who + hex(get64(t + kChecksum));
      }
    }
    if (steps_differ) {
      mismatch_ = "the instances' runs have different step counts (" + steps_seen +
                  "): every instance must call Pipeline::run with the same device_iterations";
    } else if (everyone && checked && checksums_differ) {
      mismatch_ = "the weights differ across instances at step " + std::to_string(step) +
                  " (checksums: " + checksums_seen +
                  "): a stage's update() is not deterministic, or the stages did not start "
                  "from the same weights";
    }
    applied = everyone && mismatch_.empty();
  } catch (...) {
    // An MPI error seen here may not be seen by the other instances, which would then wait
    // in their next call for ever: end them all (Open MPI ends the job).
    log(LogLevel::kError, "distributed Pipeline: step " + std::to_string(step) +
                              "'s exchange across instances failed (" +
                              detail::describe_exception(std::current_exception()) +
                              "): ending every instance");
    instance_.abort(1);
  }
  if (kind == Kind::kNothing) {  // a run of 0 steps: only the mismatch matters
    done_.store(0, std::memory_order_seq_cst);
    return;
  }
  posted_.store(0, std::memory_order_seq_cst);
  if (applied) applied_.store(step + 1, std::memory_order_release);
  stopped_by_peer_ = contributing && !applied;
  const bool over = !applied || step + 1 == steps_;
  if (!applied) {
    // Not applied everywhere: the run is over. No thread claims another step, and this
    // instance's run stops before its waiting devices go on, so none starts another step.
    claimed_.store(kNoMoreClaims, std::memory_order_seq_cst);
    closed_.store(true, std::memory_order_seq_cst);
    if (cancel_) cancel_();
  }
  if (over) finished_.store(true, std::memory_order_seq_cst);
  done_.store(step + 1, std::memory_order_seq_cst);
  device_point_.notify();
  if (over) host_point_.notify();
}

void InstanceReduction::exchange_nothing() noexcept {
  served_ = true;
  if (claim(0)) exchange_step(0, Kind::kNothing);
}

void InstanceReduction::serve(const StopFlag& stop) noexcept {
  served_ = true;
  if (steps_ == 0) return;
  // Asleep while the devices make the calls.
  host_point_.wait([&] { return finished() || stop.requested(); }, Spin::kYield);
  // This instance stopped: the step its devices will not finish still gets its call (as
  // stopped), unless a device has claimed it (then wait for that one and look again).
  while (!finished() && !closed_.load(std::memory_order_seq_cst)) {
    const std::uint64_t k = done_.load(std::memory_order_seq_cst);
    if (k >= steps_) break;
    if (claim(k)) {
      exchange_step(k, Kind::kStopped);
      break;
    }
    device_point_.wait(
        [&] {
          return done_.load(std::memory_order_seq_cst) > k ||
                 closed_.load(std::memory_order_seq_cst);
        },
        Spin::kYield);
  }
  closed_.store(true, std::memory_order_seq_cst);
  device_point_.notify();
}

}  // namespace bspflow::detail
