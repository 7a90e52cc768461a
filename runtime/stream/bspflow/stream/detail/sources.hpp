// Internal to streams (installed because the stream templates use it): the sources a segment
// takes its requests from: the admission queue (AdmissionSource, one per replica) or a hop
// from another segment (HopSource).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/admission.hpp"
#include "bspflow/stream/detail/class_picker.hpp"
#include "bspflow/stream/detail/hop.hpp"
#include "bspflow/stream/detail/meters.hpp"
#include "bspflow/stream/detail/segment.hpp"

namespace bspflow::detail {

// A replica's source at the stream's input: the admission queue (skipped while the replica
// takes nothing new: stalled, draining, or ejected until a probe is due).
template <class In>
class AdmissionSource final : public Source {
 public:
  AdmissionSource(AdmissionQueue<In>& admission, ReplicaMeter& meter, std::uint32_t replica,
                  bool ejecting)
      : admission_(admission), meter_(meter), replica_(static_cast<std::uint8_t>(replica)),
        ejecting_(ejecting) {}
  std::uint64_t taken() const noexcept { return taken_; }
  // With a generate stage in each replica: where new sequences go (GenerateBalance).
  void balance(std::shared_ptr<const GenerateBalance> b) noexcept { balance_ = std::move(b); }
  void begin() noexcept { taken_ = 0; }

  bool try_next(Incoming& out) override {
    bool probe = false;
    if (!open_to_new(probe) || defer() || !admission_.try_take(queued_)) return false;
    if (probe) meter_.probing.store(true, std::memory_order_release);
    out.meta = queued_.meta;
    out.meta.replica = replica_;
    out.meta.probe = probe;
    out.value = &*queued_.value;
    out.error.reset();
    out.skipped = false;
    ++taken_;
    bump(meter_.taken);
    return true;
  }
  bool next(Incoming& out, const WaitPolicy& policy, const StopFlag& stop) override {
    for (;;) {
      if (stop.requested()) return false;
      if (try_next(out)) return true;
      if (admission_.ended()) return false;
      bool probe = false;
      if (!open_to_new(probe)) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // until it takes again
        continue;
      }
      if (admission_.waiting() && defer()) {
        // A sibling takes it (it has room): look again shortly, it may not take them all.
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      admission_.wait(policy, stop);
    }
  }

 private:
  // Whether this replica takes a new request now. An ejected replica takes one (a probe,
  // `probe` true) once its time out has passed; its answer decides (ReplicaSink).
  bool open_to_new(bool& probe) noexcept {
    probe = false;
    if (meter_.closed_to_new()) return false;
    if (!ejecting_ || !meter_.ejected.load(std::memory_order_acquire)) return true;
    if (meter_.probing.load(std::memory_order_acquire)) return false;
    if (stream_ns(StreamClock::now()) < meter_.ejected_until.load(std::memory_order_relaxed)) {
      return false;
    }
    probe = true;
    return true;
  }

  bool defer() const noexcept { return balance_ != nullptr && balance_->defer(replica_); }

  AdmissionQueue<In>& admission_;
  ReplicaMeter& meter_;
  std::shared_ptr<const GenerateBalance> balance_;
  std::uint8_t replica_;
  bool ejecting_;
  Queued<In> queued_;
  std::uint64_t taken_ = 0;  // device thread only; read by the host after the run
};

// A segment's source from another segment: its Hop, the higher class first (ClassPicker).
template <class T>
class HopSource final : public Source {
 public:
  HopSource(Hop<T>& hop, const std::array<double, kPriorityClasses>& min_share)
      : hop_(hop), picker_(min_share) {}
  bool try_next(Incoming& out) override {
    const std::uint32_t ready = hop_.ready();
    if (ready == 0) return false;
    const std::uint32_t c = picker_.pick(ready);
    picker_.served(c);
    Queued<T>* e = hop_.try_front(c);
    current_ = std::move(*e);
    hop_.pop(c);
    out.meta = current_.meta;
    out.error = std::move(current_.error);
    out.skipped = current_.skipped;
    out.value = current_.value ? &*current_.value : nullptr;
    return true;
  }
  bool next(Incoming& out, const WaitPolicy& policy, const StopFlag& stop) override {
    for (;;) {
      if (try_next(out)) return true;
      if (stop.requested() || !hop_.wait_any(policy, stop)) return try_next(out);
    }
  }

 private:
  Hop<T>& hop_;
  ClassPicker picker_;
  Queued<T> current_;  // the request being served (its value is moved from in place)
};

}  // namespace bspflow::detail
