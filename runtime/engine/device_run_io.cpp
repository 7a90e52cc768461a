// DeviceRun's stream copies (see detail/device_run.hpp): each element over the modeled host
// link, directly (the device waits for the I/O engine's transfer) or through I/O-tile slots
// that the engine fills and empties while the device computes.
#include "bspflow/engine/detail/device_run.hpp"

#include <cstring>
#include <exception>
#include <utility>

#include "bspflow/base/error.hpp"

namespace bspflow::detail {

std::string DeviceRun::tensor_mismatch(const InLink& link, const Tensor& t) {
  if (t.dtype() == link.dtype && t.bytes() == link.bytes) return {};
  return "infeed element for buffer '" + link.name + "' is " + std::to_string(t.elements()) + " " +
         to_string(t.dtype()) + " (" + std::to_string(t.bytes()) + " bytes); the buffer takes " +
         std::to_string(link.bytes / dtype_size(link.dtype)) + " " + to_string(link.dtype) + " (" +
         std::to_string(link.bytes) + " bytes)";
}

void DeviceRun::transfer_and_wait(Clock::time_point start, std::size_t bytes, bool to_host,
                                  std::function<void()> copy) {
  std::atomic<int> done{0};
  const auto modeled = eng_.config.host_link.duration(bytes);
  const Clock::time_point earliest_end = start + modeled;
  eng_.io->submit(
      index_, IoEngine::Transfer{
                  bytes, modeled,
                  [&copy] {
                    copy();
                    return IoEngine::Start::kGo;
                  },
                  [&, keep = owner_.lock()](const IoEngine::Times& t, bool) {
                    if (t.error) {
                      io_failed(t.error);
                    } else {
                      record_io(t, bytes, to_host);
                    }
                    done.store(1, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
                    point_.notify();
                  }});
  auto arrived = [&] { return done.load(std::memory_order_seq_cst) != 0; };
  sleep_until_near(earliest_end);
  const Clock::time_point spin_end = earliest_end + tunables::kSpinBudget;
  for (unsigned i = 0; !arrived(); ++i) {
    detail::cpu_relax();
    if ((i & 63u) == 0 && Clock::now() >= spin_end) {
      point_.wait(arrived);
      break;
    }
  }
}

bool DeviceRun::copy_in(InLink& link, DeviceBuffer& buf) {
  const Clock::time_point t0 = Clock::now();
  if (!link.reader->try_pop(link.staging) && !link.reader->pop(link.staging, &stop_)) {
    if (link.reader->end_of_data()) status_ = RunStatus::kEndOfData;
    return false;
  }
  const Clock::time_point t1 = Clock::now();
  if (std::string wrong = tensor_mismatch(link, link.staging); !wrong.empty()) throw Error(wrong);
  transfer_and_wait(t1, link.bytes, false,
                    [&] { std::memcpy(buf.raw().data(), link.staging.raw().data(), link.bytes); });
  link.modeled.copy_in(clock_, host_link_ns(link.bytes), 0);
  const Clock::time_point t2 = Clock::now();
  host_bytes_in_ += link.bytes;
  host_wait_ += t2 - t1;
  link.staging = Tensor();  // the host buffer goes back (to its pool, if it has one)
  if (track_) {
    if (t1 - t0 > std::chrono::nanoseconds(0)) track_->record(Phase::kStreamCopyBegin, t0, t1);
    track_->record(Phase::kStreamCopyMid, t1, t2, link.bytes);
    track_->record(Phase::kStreamCopyEnd, t2, Clock::now());
  }
  return true;
}

bool DeviceRun::copy_in_from_io_tiles(InLink& link, DeviceBuffer& buf) {
  Slot& slot = *link.slots[link.next_use % link.slots.size()];
  const Clock::time_point t0 = Clock::now();
  auto arrived = [&] {
    return slot.state.load(std::memory_order_seq_cst) >= kReady || stop_.requested();
  };
  if (!arrived()) {
    const WaitMark mark(&link.io_site);
    point_.wait(arrived);
  }
  const Clock::time_point t1 = Clock::now();
  if (track_ && t1 - t0 > std::chrono::microseconds(1))
    track_->record(Phase::kStreamCopyBegin, t0, t1);
  const int state = slot.state.load(std::memory_order_acquire);
  if (state == kEnd) {
    status_ = RunStatus::kEndOfData;
    return false;
  }
  if (state == kFailed) {
    if (slot.failure) std::rethrow_exception(std::exchange(slot.failure, nullptr));
    throw Error(slot.error);
  }
  if (state != kReady) return false;  // stopped
  host_bytes_in_ += link.bytes;
  host_wait_ += t1 - t0;
  std::memcpy(buf.raw().data(), slot.mem, link.bytes);  // I/O tiles -> compute tiles
  link.modeled.copy_in(clock_, host_link_ns(link.bytes), handover_ns(link.bytes));
  slot.tensor = Tensor();
  slot.state.store(kFree, std::memory_order_relaxed);  // relaxed: only this thread reads it now
  ++link.next_use;
  submit_fill(link, slot);
  if (track_) track_->record(Phase::kStreamCopyEnd, t1, Clock::now(), link.bytes);
  return true;
}

void DeviceRun::submit_fill(InLink& link, Slot& slot) {
  const auto modeled = eng_.config.host_link.duration(link.bytes);
  post(slot,
       IoEngine::Transfer{
           link.bytes, modeled,
           [this, &link, &slot] {  // engine thread: the reader's consumer while the run lasts
             if (stop_.requested() || link.closing.load(std::memory_order_acquire)) {
               slot.state.store(kSkipped, std::memory_order_relaxed);  // relaxed: done() publishes
               return IoEngine::Start::kSkip;
             }
             if (!link.reader->try_pop(slot.tensor)) {
               if (!link.reader->at_end()) return IoEngine::Start::kWait;
               slot.state.store(kEnd, std::memory_order_relaxed);
               return IoEngine::Start::kSkip;
             }
             slot.error = tensor_mismatch(link, slot.tensor);
             if (!slot.error.empty()) {
               slot.state.store(kFailed, std::memory_order_relaxed);
               return IoEngine::Start::kSkip;
             }
             std::memcpy(slot.mem, slot.tensor.raw().data(), link.bytes);
             return IoEngine::Start::kGo;
           },
           [this, keep = owner_.lock(), &link, &slot](const IoEngine::Times& t, bool cancelled) {
             int s = slot.state.load(std::memory_order_relaxed);
             if (s == kFilling) {
               if (!cancelled) record_io(t, link.bytes, false);
               s = !cancelled ? kReady : t.error ? kFailed : kSkipped;
               if (t.error) slot.failure = t.error;  // the device throws it (the run fails)
             }
             slot.state.store(s, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
             in_flight_.fetch_sub(1, std::memory_order_seq_cst);
             point_.notify();
           }});
}

bool DeviceRun::copy_out(OutLink& link, DeviceBuffer& buf) {
  const Clock::time_point t0 = Clock::now();
  Tensor out(buf.dtype(), {buf.elements()}, Tensor::Init::kNone);
  transfer_and_wait(t0, buf.bytes(), true,
                    [&] { std::memcpy(out.raw().data(), buf.raw().data(), buf.bytes()); });
  const Clock::time_point t1 = Clock::now();
  link.modeled.copy_out(clock_, host_link_ns(buf.bytes()), 0);
  host_bytes_out_ += buf.bytes();
  host_wait_ += t1 - t0;
  const bool ok = link.writer->write(ctx_.iteration, std::move(out), &stop_);
  if (track_) {
    track_->record(Phase::kStreamCopyMid, t0, t1, buf.bytes(), 0, true);
    track_->record(Phase::kStreamCopyEnd, t1, Clock::now());
  }
  return ok;
}

bool DeviceRun::copy_out_to_io_tiles(OutLink& link, DeviceBuffer& buf) {
  Slot& slot = *link.slots[link.next_use % link.slots.size()];
  const Clock::time_point t0 = Clock::now();
  auto room = [&] {
    return slot.state.load(std::memory_order_seq_cst) != kFilling || stop_.requested();
  };
  if (!room()) {
    const WaitMark mark(&link.io_site);
    point_.wait(room);
  }
  const Clock::time_point t1 = Clock::now();
  if (track_ && t1 - t0 > std::chrono::microseconds(1))
    track_->record(Phase::kStreamCopyBegin, t0, t1);
  if (stop_.requested()) return false;
  const std::size_t bytes = buf.bytes();
  host_bytes_out_ += bytes;
  host_wait_ += t1 - t0;
  std::memcpy(slot.mem, buf.raw().data(), bytes);  // compute tiles -> I/O tiles
  link.modeled.copy_out(clock_, host_link_ns(bytes), handover_ns(bytes));
  slot.iteration = ctx_.iteration;
  const DType dtype = buf.dtype();
  const std::size_t elements = buf.elements();
  post(slot, IoEngine::Transfer{
                 bytes, eng_.config.host_link.duration(bytes),
                 [&slot, dtype, elements, bytes] {
                   slot.tensor = Tensor(dtype, {elements}, Tensor::Init::kNone);
                   std::memcpy(slot.tensor.raw().data(), slot.mem, bytes);
                   return IoEngine::Start::kGo;
                 },
                 [this, keep = owner_.lock(), &link, &slot, bytes](const IoEngine::Times& t,
                                                                   bool cancelled) {
                   if (t.error) io_failed(t.error);  // the entry is lost: the run fails
                   if (!cancelled) {
                     record_io(t, bytes, true);
                     // The engine thread writes while the device computes on; the device
                     // flushes and finishes the writer only after every outbound transfer has
                     // ended.
                     try {
                       if (!link.writer->write(slot.iteration, std::move(slot.tensor), &stop_))
                         lost_.fetch_add(1);
                     } catch (...) {
                       lost_.fetch_add(1);
                     }
                   }
                   slot.tensor = Tensor();
                   slot.state.store(kFree,
                                    std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
                   in_flight_.fetch_sub(1, std::memory_order_seq_cst);
                   point_.notify();
                 }});
  ++link.next_use;
  if (track_) track_->record(Phase::kStreamCopyEnd, t1, Clock::now(), bytes, 0, true);
  return true;
}

}  // namespace bspflow::detail
