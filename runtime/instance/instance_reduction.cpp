// A distributed Pipeline's exchange across instances (see
// bspflow/instance/internal/instance_reduction.hpp).
#include "bspflow/instance/internal/instance_reduction.hpp"

#include <algorithm>
#include <cstdio>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/instance/internal/instance_wire.hpp"

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
                                     std::uint32_t check_interval, std::size_t bucket_bytes)
    : instance_(instance), sizes_(std::move(slot_sizes)), check_interval_(check_interval),
      checksums_(sizes_.size()), posted_(sizes_.size()) {
  // Laid out in call order (slot S-1 first), so a bucket's slots are one range and slot 0's
  // segment and the tails that follow it are one call.
  offsets_.assign(sizes_.size(), 0);
  std::size_t open_bytes = 0;
  bool open = false;
  for (std::size_t s = sizes_.size(); s-- > 0;) {
    offsets_[s] = payload_;
    payload_ += sizes_[s];
    const auto slot = static_cast<std::uint32_t>(s);
    if (!open) {
      buckets_.push_back(Bucket{slot, slot, offsets_[s], 0});
      open = true;
      open_bytes = 0;
    }
    buckets_.back().low = slot;
    open_bytes += sizes_[s] * sizeof(float);
    if (open_bytes >= bucket_bytes || s == 0) {
      buckets_.back().end = payload_;
      open = false;
    }
  }
  wire_.assign(payload_ + instance_.count() * kTail, 0.0f);
  stopped_.assign(wire_.size(), 0.0f);
  buckets_.back().end = wire_.size();  // slot 0's: with the tails
}

void InstanceReduction::begin_run(std::uint64_t steps, std::function<void()> cancel) {
  total_steps_ += applied_.load(std::memory_order_relaxed);  // the previous run's
  steps_ = steps;
  cancel_ = std::move(cancel);
  mismatch_instance_ = stopped_instance_ = instance_.count();
  // relaxed: no device runs yet (the Engine's start orders these before them)
  for (auto& p : posted_) p.store(0, std::memory_order_relaxed);
  turn_.store(0, std::memory_order_relaxed);
  stopping_.store(false, std::memory_order_relaxed);
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
  checksums_[slot].store(checksum, std::memory_order_relaxed);  // published by the post
  posted_[slot].store(step + 1, std::memory_order_seq_cst);
  pump(false);
  return wait_done(step, spin);
}

bool InstanceReduction::wait_done(std::uint64_t step, Spin spin) {
  // Whoever holds the turn (a device, or the host for a stopped instance) always finishes
  // the step's calls, so this wait ends without looking at the stop flag.
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

bool InstanceReduction::posted(const Bucket& b, std::uint64_t step) const noexcept {
  for (std::uint32_t slot = b.low; slot <= b.high; ++slot) {
    if (posted_[slot].load(std::memory_order_seq_cst) != step + 1) return false;
  }
  return true;
}

void InstanceReduction::pump(bool host) noexcept {
  for (;;) {
    std::uint64_t turn = turn_.load(std::memory_order_seq_cst);
    // Odd: a call is being made (its maker looks at the next bucket after it) or closed.
    if (turn & 1) return;
    const std::uint64_t n = turn / 2, step = n / buckets();
    if (step >= steps_) return;
    // Posts and turns are stored before they are looked at (seq_cst): of the threads that
    // made the last post or moved the turn, at least one sees the bucket ready; the CAS picks
    // one.
    if (!host && !posted(buckets_[n % buckets()], step)) return;
    if (!turn_.compare_exchange_strong(turn, turn + 1, std::memory_order_seq_cst)) continue;
    send(n, false);
  }
}

void InstanceReduction::send(std::uint64_t n, bool nothing) noexcept {
  const std::uint64_t step = n / buckets();
  const Bucket& b = buckets_[n % buckets()];
  const bool last = b.low == 0;
  // The host sends zeros for a bucket its devices did not post in full (a device may still
  // be writing its segment).
  const bool posted = !nothing && this->posted(b, step);
  // A step is contributed unless the host is making the calls (this instance stopped):
  // then its tail says stopped, whatever was posted.
  const bool contributing = !nothing && !stopping_.load(std::memory_order_seq_cst);
  std::vector<float>& buffer = posted ? wire_ : stopped_;
  const std::span<float> bucket = std::span<float>(buffer).subspan(b.begin, b.end - b.begin);
  bool applied = false;
  try {
    if (!posted) {
      std::fill(buffer.begin() + static_cast<std::ptrdiff_t>(b.begin),
                buffer.begin() + static_cast<std::ptrdiff_t>(last ? payload_ : b.end), 0.0f);
    }
    if (last) {
      std::fill(buffer.begin() + static_cast<std::ptrdiff_t>(payload_), buffer.end(),
                0.0f);  // every tail
      float* mine = buffer.data() + payload_ + instance_.index() * kTail;
      mine[kCode] = contributing || nothing ? 0.0f : 1.0f;
      put64(mine + kSteps, steps_);
      if (contributing && check_due(step)) {
        std::uint64_t h = 0xcbf29ce484222325ull;  // the slots' checksums, in slot order
        for (const auto& c : checksums_)
          h = (h ^ c.load(std::memory_order_relaxed)) * 0x100000001b3ull;
        mine[kHasChecksum] = 1.0f;
        put64(mine + kChecksum, h);
      }
    }
    // Every instance agreed on the sizes: an empty bucket is skipped everywhere.
    if (!bucket.empty()) InstanceWire::sum(instance_, bucket);
    if (last) applied = read_tails(step, buffer.data() + payload_) && contributing;
  } catch (...) {
    // An MPI error seen here may not be seen by the other instances, which would then wait
    // in their next call for ever: end them all (Open MPI ends the job).
    log(LogLevel::kError, "distributed Pipeline: step " + std::to_string(step) +
                              "'s exchange across instances failed (" +
                              detail::describe_exception(std::current_exception()) +
                              "): ending every instance");
    instance_.abort(1);
  }
  if (nothing) return;  // a run of 0 steps: only the mismatch matters
  if (!last) {
    turn_.store(2 * (n + 1), std::memory_order_seq_cst);
    device_point_.notify();  // the host may wait for the turn
    return;
  }
  if (applied) applied_.store(step + 1, std::memory_order_release);
  stopped_by_peer_ = contributing && !applied;
  const bool over = !applied || step + 1 == steps_;
  if (!applied) {
    // Not applied everywhere: the run is over. No thread claims another bucket, and this
    // instance's run stops before its waiting devices go on, so none starts another step.
    turn_.store(kClosed, std::memory_order_seq_cst);
    closed_.store(true, std::memory_order_seq_cst);
    if (cancel_) cancel_();
  }
  if (over) finished_.store(true, std::memory_order_seq_cst);
  done_.store(step + 1, std::memory_order_seq_cst);
  // The turn moves on last: whoever claims the next step's buckets (a device, or the host
  // if this instance stops) finds this step's result published, so done_ only grows.
  if (applied) turn_.store(2 * (n + 1), std::memory_order_seq_cst);
  device_point_.notify();
  if (over) host_point_.notify();
}

bool InstanceReduction::read_tails(std::uint64_t step, const float* tails) {
  const std::uint32_t count = instance_.count();
  bool everyone = true, checked = true, steps_differ = false, checksums_differ = false;
  std::string steps_seen, checksums_seen;
  const std::uint64_t first_steps = get64(tails + kSteps),
                      first_checksum = get64(tails + kChecksum);
  for (std::uint32_t i = 0; i < count; ++i) {
    const float* t = tails + i * kTail;
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
      const float* t = tails + i * kTail;
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
  return everyone && mismatch_.empty();
}

void InstanceReduction::exchange_nothing() noexcept {
  served_ = true;
  // Step 0's calls, every bucket of it, with only the step count (0) in the tail.
  for (std::uint64_t n = 0; n < buckets(); ++n) send(n, true);
}

void InstanceReduction::serve(const StopFlag& stop) noexcept {
  served_ = true;
  if (steps_ == 0) return;
  // Asleep while the devices make the calls.
  host_point_.wait([&] { return finished() || stop.requested(); }, Spin::kYield);
  // This instance stopped: the rest of the current step's calls (and, if a device finished
  // that step meanwhile, the next one's) are made here, as stopped. A call a device is
  // making is waited for.
  stopping_.store(true, std::memory_order_seq_cst);
  while (!finished() && !closed_.load(std::memory_order_seq_cst)) {
    const std::uint64_t turn = turn_.load(std::memory_order_seq_cst);
    if (turn & 1) {
      device_point_.wait(
          [&] {
            return turn_.load(std::memory_order_seq_cst) != turn ||
                   closed_.load(std::memory_order_seq_cst);
          },
          Spin::kYield);
      continue;
    }
    if (turn / 2 / buckets() >= steps_) break;
    pump(true);
  }
  closed_.store(true, std::memory_order_seq_cst);
  device_point_.notify();
}

}  // namespace bspflow::detail
