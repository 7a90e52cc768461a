// The interpreter (see detail/device_run.hpp).
#include "bspflow/engine/detail/device_run.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/run/internal/wait_sites.hpp"

namespace bspflow::detail {

void DeviceRun::add_infeed(InfeedQueue<Tensor>& q, const DeviceBuffer& dst) {
  auto [it, fresh] = ins_.try_emplace(&q);
  InLink& link = it->second;
  if (!fresh) {
    if (link.bytes != dst.bytes() || link.dtype != dst.dtype()) {
      throw Error("device " + std::to_string(device_.id()) +
                  ": two StreamCopy from one infeed "
                  "into buffers of different sizes ('" +
                  link.name + "' and '" + dst.name() +
                  "'): every copy from an infeed moves one micro-batch of one size");
    }
    return;
  }
  link.bytes = dst.bytes();
  link.dtype = dst.dtype();
  link.name = dst.name();
  link.io_site = {WaitKind::kInfeed,
                  "the next micro-batch for buffer '" + dst.name() + "', which the I/O tiles " +
                      "fetch from the infeed's lane " + std::to_string(index_),
                  [&q, lane = index_] {
                    const std::size_t n = q.size_approx(lane);
                    return (n == 0 ? std::string("empty") : std::to_string(n) + " queued") +
                           (q.closed() ? ", closed" : ", not closed");
                  }};
  if (eng_.config.synthetic_data) return;  // no host copies at all
  link.reader.emplace(q.reader(index_));
  if (eng_.config.io_tiles > 0) {
    for (std::uint32_t k = 0; k < eng_.config.prefetch_depth; ++k) {
      Slot& slot = *link.slots.emplace_back(std::make_unique<Slot>());  // listed, then filled:
      slot.mem = static_cast<std::byte*>(device_.arena().allocate(      // release_slots() frees
          link.bytes, "I/O tiles: prefetch " + std::to_string(k) + " of " + dst.name()));
    }
  }
}

void DeviceRun::add_outfeed(OutfeedQueue<Tensor>& q, const DeviceBuffer& src,
                            OutfeedQueue<Tensor>::Writer* w) {
  auto [it, fresh] = outs_.try_emplace(&q);
  OutLink& link = it->second;
  if (fresh) {
    link.writer.emplace(std::move(*w));
    link.io_site = {WaitKind::kOutfeed,
                    "a free I/O-tile buffer for the outfeed (the I/O engine waits for room in "
                    "it)",
                    [&q, lane = index_] {
                      return std::to_string(q.size_approx(lane)) + " of " +
                             std::to_string(q.capacity()) + " entries";
                    }};
  }
  if (eng_.config.io_tiles > 0 && !eng_.config.synthetic_data) {
    // One outbound I/O buffer per prefetch step, sized for the largest source.
    if (link.slots.empty()) {
      for (std::uint32_t k = 0; k < eng_.config.prefetch_depth; ++k)
        link.slots.push_back(std::make_unique<Slot>());
    }
    link.bytes = std::max(link.bytes, src.bytes());
  }
}

void DeviceRun::allocate_out_slots() {
  for (auto& [q, link] : outs_) {
    for (std::size_t k = 0; k < link.slots.size(); ++k) {
      link.slots[k]->mem = static_cast<std::byte*>(
          device_.arena().allocate(link.bytes, "I/O tiles: outbound " + std::to_string(k)));
    }
  }
}

void DeviceRun::run(const Program& program) {
  // Once per device thread (a system call: not once per run).
  static thread_local const bool slack_lowered = lower_timer_slack();
  (void)slack_lowered;
  clock_.reset(static_cast<double>(model_.host_call.count()), track_);
  // This device's wait record for the run's stall check: every wait of this thread marks
  // it from here on (see bspflow/base/detail/wait_note.hpp); its turn has come.
  detail::WaitNote* const note = control_.note(index_);
  detail::WaitNote* const outer = detail::set_this_thread_wait_note(note);
  note->site.store(nullptr, std::memory_order_relaxed);  // relaxed: see WaitNote
  note->moves.store(note->moves.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  bool failed = false;
  try {
    // Stopped before it started (a std::stop_token stopped before the run, a cancel() during
    // its setup): end cancelled, taking nothing from any feed.
    if (stop_.requested()) {
      status_ = RunStatus::kCancelled;
    } else {
      run_program(program);
    }
  } catch (...) {
    failed = true;
    control_.fail(detail::RunControl::Failure{device_.id(), index_, ctx_.iteration,
                                              std::current_exception()});
  }
  try {
    finish(!failed && status_ != RunStatus::kCancelled);
  } catch (...) {
    if (!failed)
      control_.fail(detail::RunControl::Failure{device_.id(), index_, ctx_.iteration,
                                                std::current_exception()});
    failed = true;
  }
  detail::set_this_thread_wait_note(outer);
  control_.replica_done(index_, detail::RunControl::ReplicaEnd{device_.id(), iterations_, status_,
                                                               failed, clock_.time()});
}

void DeviceRun::run_program(const Program& program) {
  for (auto& [q, link] : ins_) {
    link.modeled.start(clock_.now(), eng_.config.io_tiles, eng_.config.prefetch_depth);
    for (auto& slot : link.slots) submit_fill(link, *slot);
  }
  for (auto& [q, link] : outs_) {
    link.modeled.start(clock_.now(), eng_.config.io_tiles, eng_.config.prefetch_depth);
  }
  if (exec(program)) return;
  if (status_ == RunStatus::kEndOfData) {
    // The devices this one syncs with would wait for it at their next Sync forever: they end
    // there, each after finishing what it does before that Sync.
    for (SyncGroup* g : groups_) g->abort();
  } else if (status_ == RunStatus::kCompleted) {
    status_ = RunStatus::kCancelled;
  }
}

void DeviceRun::abandon() noexcept {
  try {
    finish(false);
  } catch (...) {  // the refusal is the error reported
  }
  control_.replica_done(
      index_, detail::RunControl::ReplicaEnd{device_.id(), 0, RunStatus::kCancelled, true});
}

bool DeviceRun::exec_node(const program::Sequence& s) {
  for (const Program& step : s.steps) {
    if (!exec(step)) return false;
  }
  return true;
}

bool DeviceRun::exec_node(const program::Execute& e) {
  const Clock::time_point t0 = track_ ? Clock::now() : Clock::time_point{};
  if (e.codelet) {
    e.codelet(ctx_);
  } else if (e.work_items == 0) {
    e.vertex(ctx_, TileWork{0, 0, 0});
  } else {
    const std::uint32_t tiles = std::max<std::uint32_t>(1, ctx_.compute_tiles);
    const std::size_t per = (e.work_items + tiles - 1) / tiles;
    std::uint32_t tile = 0;
    for (std::size_t b = 0; b < e.work_items; b += per, ++tile) {
      e.vertex(ctx_, TileWork{tile, b, std::min(e.work_items, b + per)});
    }
  }
  if (!e.cost) {
    clock_.undeclared();
  } else if (e.cost->declared()) {
    clock_.compute(
        model_.ns(e.work_items > 0 ? model_.item_cycles(*e.cost, e.work_items, ctx_.compute_tiles)
                                   : model_.compute_cycles(*e.cost, ctx_.compute_tiles)),
        track_ ? labels_[&e] : 0);
  }
  if (track_) track_->record(Phase::kCompute, t0, Clock::now(), 0, labels_[&e]);
  return true;
}

bool DeviceRun::exec_node(const program::FusedRepeat& f) {
  const program::LoopFrame frame{&ctx_, &stop_, track_, fused_label_, &iterations_, &clock_};
  const RunStatus end = f.loop(frame);
  if (end == RunStatus::kCompleted) return true;
  status_ = end;
  return false;
}

bool DeviceRun::exec_node(const program::RemoteCopy& r) {
  const Clock::time_point t0 = Clock::now();
  const std::size_t bytes = r.copy(ctx_);
  clock_.link_until(clock_.now() + host_link_ns(bytes));
  const bool ok = take_modeled_time(t0, eng_.config.host_link.duration(bytes), r.finish_on_stop);
  if (track_)
    track_->record(Phase::kStreamCopyMid, t0, Clock::now(), bytes, labels_[&r], r.to_host);
  return ok;
}

bool DeviceRun::exec_node(const program::AllReduce& a) {
  const Clock::time_point t0 = Clock::now();
  const std::size_t bytes = a.bytes(ctx_);
  const auto ring = eng_.config.device_link.ring_allreduce(bytes, a.replicas);
  clock_.exchange(static_cast<double>(ring.count()));
  const bool ok = take_modeled_time(t0, ring, a.finish_on_stop);
  if (track_) track_->record(Phase::kExchange, t0, Clock::now(), bytes, labels_[&a]);
  return ok;
}

bool DeviceRun::exec_node(const program::Sync& s) {
  const Clock::time_point t0 = track_ ? Clock::now() : Clock::time_point{};
  double latest = clock_.now();
  const bool ok = s.group->arrive_and_wait(
      stop_, device_.placement().shares_core() ? Spin::kYield : Spin::kTight, &latest);
  if (ok) {
    clock_.sync_to(latest, s.group->participants() > 1
                               ? static_cast<double>(model_.sync_between_chips.count())
                               : model_.ns(model_.sync_cycles_on_chip));
  }
  if (track_) track_->record(Phase::kSync, t0, Clock::now());
  // A device this one syncs with ran out of data: the run ends here, as an end of data.
  if (!ok && !stop_.requested() && s.group->aborted()) status_ = RunStatus::kEndOfData;
  return ok;
}

bool DeviceRun::exec_node(const program::Copy& c) {
  const std::size_t bytes = c.dst->bytes();
  const bool between = &c.src->device() != &c.dst->device();
  // The copy's modeled cost: between devices the device link's time (none on one device), on
  // one device the exchange's. This run keeps it for the last 4 (size, between devices) pairs
  // its Copies needed (a pipeline's forward and backward exchanges alternate sizes), the one
  // kept longest replaced first.
  CopyCost* cost = nullptr;
  for (CopyCost& k : copy_costs_) {
    if (k.bytes == bytes && k.between == between) {
      cost = &k;
      break;
    }
  }
  if (cost == nullptr) {
    cost = &copy_costs_[next_copy_cost_++ % copy_costs_.size()];
    cost->link = between ? eng_.config.device_link.duration(bytes) : std::chrono::nanoseconds{0};
    cost->modeled_ns =
        cost->link.count() > 0
            ? static_cast<double>(cost->link.count())
            : model_.ns(model_.exchange_cycles(static_cast<double>(bytes), ctx_.compute_tiles));
    cost->bytes = bytes;
    cost->between = between;
  }
  const std::chrono::nanoseconds link = cost->link;
  // Read the clock only for a trace or a wait (take_modeled_time reads t0 only then).
  const Clock::time_point t0 = track_ || waits_for(link) ? Clock::now() : Clock::time_point{};
  std::memcpy(c.dst->raw().data(), c.src->raw().data(), bytes);
  clock_.exchange(cost->modeled_ns);
  const bool ok = take_modeled_time(t0, link);
  if (track_) track_->record(Phase::kExchange, t0, Clock::now(), bytes);
  return ok;
}

bool DeviceRun::exec_node(const program::StreamCopy& s) {
  DeviceBuffer& buf = *s.buffer;
  if (s.infeed != nullptr) {
    InLink& link = ins_.at(s.infeed);
    if (eng_.config.synthetic_data) return synthesize(buf);
    return eng_.config.io_tiles > 0 ? copy_in_from_io_tiles(link, buf) : copy_in(link, buf);
  }
  if (eng_.config.synthetic_data) return true;  // nothing leaves either
  OutLink& link = outs_.at(s.outfeed);
  return eng_.config.io_tiles > 0 ? copy_out_to_io_tiles(link, buf) : copy_out(link, buf);
}

void DeviceRun::finish(bool deliver) {
  if (fused_ != nullptr) fused_->finish(deliver);
  for (auto& [q, link] : outs_) link.modeled.finish_out(clock_);
  const Clock::time_point t0 = Clock::now();
  for (auto& [q, link] : ins_) link.closing.store(true, std::memory_order_release);
  auto drained = [&] { return in_flight_.load(std::memory_order_seq_cst) == 0; };
  if (!drained()) {
    const WaitMark mark(&io_drain_site());
    point_.wait(drained);
  }
  if (track_ && Clock::now() - t0 > std::chrono::microseconds(1))
    track_->record(Phase::kIdle, t0, Clock::now());
  for (auto& [q, link] : ins_) {
    if (!link.reader) continue;
    for (std::size_t k = 0; k < link.slots.size(); ++k) {  // oldest first
      Slot& slot = *link.slots[(link.next_use + k) % link.slots.size()];
      if (slot.state.load(std::memory_order_acquire) == kReady)
        link.reader->put_back(std::move(slot.tensor));
    }
    link.reader.reset();
  }
  for (auto& [q, link] : outs_) {
    if (link.writer) link.writer->finish(deliver && lost_.load() == 0 && !io_failure_, &stop_);
    link.writer.reset();
  }
  release_slots();
  // Thrown without a reference kept here: this run's state may be freed last by the I/O
  // engine's thread (a finished transfer's done() keeps it), and the exception must not be
  // freed there while the host still reads it (ThreadSanitizer cannot see the exception's
  // reference count, in libstdc++, order the two: 3 of 21 runs of test_alloc_failure; 0 of
  // 20 since).
  if (io_failure_) std::rethrow_exception(std::exchange(io_failure_, nullptr));
  if (lost_.load() != 0) {
    throw Error(std::to_string(lost_.load()) + " outfeed entr" + (lost_.load() == 1 ? "y" : "ies") +
                " could not be delivered (the run was stopped while the outfeed was full)");
  }
}

void DeviceRun::release_slots() noexcept {
  auto release = [&](std::vector<std::unique_ptr<Slot>>& slots) {
    for (auto& slot : slots) {
      if (slot->mem != nullptr) device_.arena().release(std::exchange(slot->mem, nullptr));
    }
  };
  for (auto& [q, link] : ins_) release(link.slots);
  for (auto& [q, link] : outs_) release(link.slots);
}

}  // namespace bspflow::detail
