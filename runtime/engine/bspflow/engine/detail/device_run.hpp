// Internal (not installed): the interpreter. A DeviceRun runs one device's program for one
// Engine run, on the device thread: it walks the program tree, moves stream copies over the
// modeled host link (directly, or through I/O-tile slots the I/O engine fills ahead), and
// records the trace.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bspflow/devices/io_engine.hpp"
#include "bspflow/engine/engine.hpp"

namespace bspflow::detail {

using Clock = std::chrono::steady_clock;

enum SlotState : int { kFree, kFilling, kReady, kEnd, kFailed, kSkipped };

// One I/O-tile buffer: a micro-batch the engine moved (to device) or is moving (to host).
struct Slot {
  std::byte* mem = nullptr;
  std::atomic<int> state{kFree};
  Tensor tensor;  // to device: the host tensor (given back if unused); to host: the entry
  std::uint64_t iteration = 0;
  std::string error;
  std::exception_ptr failure;  // to device: the transfer failed (the engine ran out of memory)
};

struct InLink {  // one infeed, seen from one device
  std::optional<InfeedQueue<Tensor>::Reader> reader;
  std::size_t bytes = 0;  // per micro-batch (every StreamCopy from this infeed moves as many)
  DType dtype = DType::kFloat32;
  std::string name;                          // "infeed to 'x'" for messages
  std::vector<std::unique_ptr<Slot>> slots;  // io_tiles > 0
  std::size_t next_use = 0;
  std::atomic<bool> closing{false};  // the device is done: fetch nothing more
  Tensor staging;                    // io_tiles = 0: the element being moved
  ModeledLink modeled;               // its copies in modeled time
  WaitSite io_site;                  // io_tiles > 0: the device waits for the I/O tiles
};

struct OutLink {  // one outfeed, seen from one device
  std::optional<OutfeedQueue<Tensor>::Writer> writer;
  std::vector<std::unique_ptr<Slot>> slots;  // io_tiles > 0
  std::size_t bytes = 0;                     // of the largest source (sizes the slots)
  std::size_t next_use = 0;
  ModeledLink modeled;  // its copies in modeled time
  WaitSite io_site;     // io_tiles > 0: the device waits for a free I/O-tile buffer
};

// What the device runs need of the engine.
struct EngineState {
  std::vector<Device*> devices;
  EngineConfig config;
  std::unique_ptr<IoEngine> io;
  std::unique_ptr<Trace> trace;
  std::uint32_t compute_tiles = 0;
};

class DeviceRun {
 public:
  DeviceRun(EngineState& engine, Device& device, std::uint32_t index, detail::RunControl& control,
            TraceTrack* track, TraceTrack* io_track)
      : eng_(engine), device_(device), index_(index), control_(control), stop_(control.stop()),
        track_(track), io_track_(io_track), clock_(device.clock()), model_(device.config().model) {
    ctx_.device = device_.id();
    ctx_.replica = index;
    ctx_.compute_tiles = engine.compute_tiles;
    ctx_.stop = &stop_;
  }

  // Whichever thread lets go of the run last. Gives back to the arena any I/O-tile memory
  // finish() did not (a run refused while it was set up). Never throws.
  ~DeviceRun() { release_slots(); }
  DeviceRun(const DeviceRun&) = delete;
  DeviceRun& operator=(const DeviceRun&) = delete;

  // Host thread, before the run: the links this device's program uses.
  void add_infeed(InfeedQueue<Tensor>& q, const DeviceBuffer& dst);
  void add_outfeed(OutfeedQueue<Tensor>& q, const DeviceBuffer& src,
                   OutfeedQueue<Tensor>::Writer* w);
  void allocate_out_slots();
  // A program node's trace label (an Execute, a RemoteCopy, an AllReduce).
  void label(const void* node, const std::string& name) {
    labels_[node] = track_ ? track_->add_label(name) : 0;
  }
  void add_fused(const program::FusedRepeat& f) {
    fused_ = &f;  // (gather() allows a FusedRepeat only as the whole program: one at most)
    fused_label_ = track_ ? track_->add_label(f.name) : 0;
  }

  // Host thread, before the run: the sync groups this device's program uses (its end of
  // data aborts them, so the others end at their next Sync).
  void set_groups(std::vector<SyncGroup*> groups) { groups_ = std::move(groups); }

  // Device thread: the whole run.
  void run(const Program& program);

  // Host thread, instead of run() when the device refused the job: releases the links.
  void abandon() noexcept;

  void wake() noexcept { point_.notify(); }
  // Host thread, once the run has ended: bytes of stream copies in and out over the host
  // link, and how long this device waited for them.
  std::uint64_t host_bytes_in() const noexcept { return host_bytes_in_; }
  std::uint64_t host_bytes_out() const noexcept { return host_bytes_out_; }
  std::chrono::nanoseconds host_wait() const noexcept { return host_wait_; }
  // Host thread, before the run: what keeps this object alive (the run's shared state).
  // Every I/O-engine callback holds it, because the engine may still be inside one when the
  // device has already seen the transfer end and the host has moved on.
  void set_owner(std::weak_ptr<void> owner) { owner_ = std::move(owner); }

 private:
  // Device thread: the I/O tiles' first fills, then the program; sets status_ (throws what
  // the program throws).
  void run_program(const Program& program);

  // false: the program must stop (end of data, or stop requested).
  bool exec(const Program& p) {
    return std::visit([this](const auto& node) { return exec_node(node); }, p.node());
  }

  bool exec_node(const program::Sequence& s);

  bool exec_node(const program::Execute& e);

  bool exec_node(const program::FusedRepeat& f);

  bool exec_node(const program::RemoteCopy& r);

  bool exec_node(const program::AllReduce& a);

  // Takes a modeled transfer of `d`, begun at `start`, on this device's thread (Copy between
  // devices, RemoteCopy, AllReduce): waits until start + d, seeing a stop and yielding the
  // core when it shares it, unless waits_for(d) says it is too short to wait out (then true
  // at once; `start` is not read). false: a stop came first. `finish`: the whole time, stop
  // or not (then true).
  bool take_modeled_time(Clock::time_point start, std::chrono::nanoseconds d, bool finish = false) {
    if (!waits_for(d)) return true;
    return wait_until_deadline(start + d, finish ? nullptr : &stop_,
                               device_.placement().shares_core());
  }
  // Whether a modeled transfer of `d` is waited out in real time (and the clock read for it):
  // not when it is shorter than the clock reads would be (tunables::kShortestRealWait).
  static bool waits_for(std::chrono::nanoseconds d) noexcept {
    return d >= tunables::kShortestRealWait;
  }

  bool exec_node(const program::Sync& s);

  // Modeled nanoseconds of a host-link copy of `bytes`, and of handing `bytes` over between
  // the I/O tiles and the compute tiles.
  double host_link_ns(std::size_t bytes) const noexcept {
    return static_cast<double>(eng_.config.host_link.duration(bytes).count());
  }
  double handover_ns(std::size_t bytes) const noexcept {
    return model_.ns(model_.exchange_cycles(static_cast<double>(bytes), eng_.config.io_tiles));
  }

  bool exec_node(const program::Copy& c);

  bool exec_node(const program::Repeat& r) {
    return loop([&](std::uint64_t trip) { return trip < r.count; }, r.body.front());
  }
  bool exec_node(const program::RepeatWhile& r) {
    return loop([&](std::uint64_t trip) { return trip < r.max_trips && r.condition(ctx_); },
                r.body.front());
  }
  template <class More>
  bool loop(More&& more, const Program& body) {
    const bool outermost = !in_repeat_;
    in_repeat_ = true;
    for (std::uint64_t trip = 0; more(trip); ++trip) {
      if (stop_.requested()) return false;
      if (outermost) ctx_.iteration = trip;
      if (!exec(body)) return false;
      if (outermost) {
        ++iterations_;
        if (track_) track_->count_iteration();
      }
    }
    if (outermost) in_repeat_ = false;
    return true;
  }

  bool exec_node(const program::StreamCopy& s);

  bool synthesize(DeviceBuffer& buf);

  // What is wrong with a host tensor for this link's buffers; empty if nothing.
  static std::string tensor_mismatch(const InLink& link, const Tensor& t);

  // io_tiles = 0: has the I/O engine do `copy` (bytes moved to_host or not) over the
  // modeled link, asked for at `start`, and waits for it: sleeps until shortly before it can
  // end, spins until a little after, then parks (so a late engine costs no CPU).
  void transfer_and_wait(Clock::time_point start, std::size_t bytes, bool to_host,
                         std::function<void()> copy);

  // Engine thread (in a transfer's done(), which must not throw): a trace event that cannot be
  // recorded (out of memory) fails the run, as it would on the device thread.
  void record_io(const IoEngine::Times& t, std::size_t bytes, bool to_host) noexcept {
    if (!io_track_) return;
    try {
      io_track_->record(Phase::kTransfer, t.begin, t.end, bytes, 0, to_host);
    } catch (...) {
      io_failed(std::current_exception());
    }
  }
  // Engine thread: the first failure of the engine's side of this run (a transfer that failed,
  // a trace event it could not record), thrown by finish(), which reads it once every transfer
  // has ended. Set before the transfer's in-flight count drops (or its done flag is set), which
  // publishes it.
  void io_failed(std::exception_ptr e) noexcept {
    if (!io_failure_) io_failure_ = std::move(e);
  }

  // io_tiles = 0: wait for the host's element, move it over the modeled link, hand it over.
  bool copy_in(InLink& link, DeviceBuffer& buf);

  // io_tiles > 0: take the next micro-batch the I/O tiles hold, refill the buffer it used.
  bool copy_in_from_io_tiles(InLink& link, DeviceBuffer& buf);

  // Device thread: asks the engine to move the next micro-batch into `slot`.
  void submit_fill(InLink& link, Slot& slot);

  // Device thread: hands the engine a transfer of `slot`, which is in flight until the
  // transfer's end. If the engine cannot take it (out of memory), the slot is free again and
  // the error propagates: finish() would otherwise wait for a transfer that never ends.
  void post(Slot& slot, IoEngine::Transfer transfer) {
    slot.state.store(kFilling, std::memory_order_relaxed);  // relaxed: published by the post
    ++in_flight_;
    try {
      eng_.io->submit(index_, std::move(transfer));
    } catch (...) {
      slot.state.store(kFree, std::memory_order_relaxed);
      in_flight_.fetch_sub(1, std::memory_order_relaxed);
      throw;
    }
  }

  // io_tiles = 0: move the result over the modeled link, then into the outfeed.
  bool copy_out(OutLink& link, DeviceBuffer& buf);

  // io_tiles > 0: drop the result into a free outbound I/O buffer; the engine moves it on.
  bool copy_out_to_io_tiles(OutLink& link, DeviceBuffer& buf);

  // The I/O-tile buffers still held, back to the arena (each once). Never throws.
  void release_slots() noexcept;

  // Device thread, at the end: let the engine finish with this device's buffers, give
  // prefetched micro-batches back to their infeeds, deliver held outfeed entries.
  void finish(bool deliver);

  EngineState& eng_;
  Device& device_;
  const std::uint32_t index_;
  detail::RunControl& control_;
  const StopFlag& stop_;
  TraceTrack* track_;
  TraceTrack* io_track_;
  ModeledClock& clock_;  // the device's: this run's modeled time
  const DeviceModel& model_;
  ComputeContext ctx_;
  bool in_repeat_ = false;
  std::vector<SyncGroup*> groups_;  // the sync groups its program uses (set_groups)
  std::uint64_t iterations_ = 0;
  RunStatus status_ = RunStatus::kCompleted;
  std::uint64_t host_bytes_in_ = 0, host_bytes_out_ = 0;  // device thread; read after the run
  std::chrono::nanoseconds host_wait_{0};
  std::map<const InfeedQueue<Tensor>*, InLink> ins_;
  std::map<const OutfeedQueue<Tensor>*, OutLink> outs_;
  std::map<const void*, std::uint32_t> labels_;  // by program node
  const program::FusedRepeat* fused_ = nullptr;
  std::uint32_t fused_label_ = 0;
  std::set<const DeviceBuffer*> synthesized_;
  struct CopyCost {                       // exec_node(Copy)'s modeled cost of a size
    std::size_t bytes = ~std::size_t{0};  // none yet (no buffer is that large)
    bool between = false;                 // between devices (the device link's time)
    std::chrono::nanoseconds link{0};
    double modeled_ns = 0;
  };
  std::array<CopyCost, 4> copy_costs_{};
  std::uint32_t next_copy_cost_ = 0;  // the one replaced next
  std::atomic<std::uint32_t> in_flight_{0};
  std::atomic<std::uint32_t> lost_{0};
  std::exception_ptr io_failure_;  // see io_failed()
  detail::WaitPoint point_;
  std::weak_ptr<void> owner_;
};

}  // namespace bspflow::detail
