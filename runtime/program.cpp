// The program interpreter and the Engine (see bspflow/program.hpp).
#include "bspflow/program.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "bspflow/detail/random.hpp"
#include "bspflow/error.hpp"
#include "bspflow/io_engine.hpp"
#include "bspflow/log.hpp"

namespace bspflow {

using Clock = std::chrono::steady_clock;

// ---- buffers ----

DeviceBuffer::DeviceBuffer(Device& device, std::string name, DType dtype, std::size_t elements)
    : device_(&device), name_(std::move(name)), dtype_(dtype), elements_(elements) {
  if (elements != 0 && bytes() / elements != dtype_size(dtype)) {
    throw Error("buffer '" + name_ + "': " + std::to_string(elements) + " elements overflow");
  }
  data_ = static_cast<std::byte*>(device.arena().allocate(bytes(), "buffer '" + name_ + "'"));
  std::memset(data_, 0, bytes());
}

DeviceBuffer::~DeviceBuffer() { device_->arena().release(data_); }

void DeviceBuffer::throw_mismatch(DType asked) const {
  throw Error("buffer '" + name_ + "' holds " + to_string(dtype_) + ", not " + to_string(asked));
}

Buffer make_buffer(Device& device, std::string name, DType dtype, std::size_t elements) {
  return std::make_shared<DeviceBuffer>(device, std::move(name), dtype, elements);
}

// ---- sync ----

SyncGroup::SyncGroup(std::uint32_t participants) : participants_(participants) {
  if (participants < 1 || participants > tunables::kMaxReplicas) {
    detail::throw_bad_value("sync group participants", participants,
                            "must be in 1.." + std::to_string(tunables::kMaxReplicas));
  }
}

bool SyncGroup::arrive_and_wait(const detail::StopFlag& stop, detail::Spin spin) {
  const std::uint64_t before = state_.fetch_add(1, std::memory_order_acq_rel);
  const std::uint64_t gen = generation(before);
  if ((before & kCountMask) + 1 == participants_) {
    // Last to arrive: the next generation with no arrivals, in one store. Nobody arrives for
    // the next round before seeing it, so no arrival can be lost. seq_cst: see
    // WaitPoint::notify(). The generation wraps after 2^32 rounds; waiters compare for
    // inequality, so that is harmless.
    state_.store(((gen + 1) & kCountMask) << 32, std::memory_order_seq_cst);
    point_.notify();
    // Sharing a core: let a participant just woken on it run now, instead of at the end of
    // our time slice (a scheduler tick, milliseconds) while we compute the next superstep.
    if (spin == detail::Spin::kYield) std::this_thread::yield();
    return true;
  }
  point_.wait([&] { return generation(state_.load(std::memory_order_seq_cst)) != gen || stop.requested(); }, spin,
              detail::Fence::kSymmetric,
              spin == detail::Spin::kYield ? tunables::kSpinBudget : tunables::kSyncSpinBudget);
  return generation(state_.load(std::memory_order_acquire)) != gen;
}

// ---- program nodes ----

namespace program {
Sequence::Sequence(std::initializer_list<Program> s) : steps(s) {}
Sequence::Sequence(std::vector<Program> s) : steps(std::move(s)) {}
Execute::Execute(std::string n, std::size_t items, Vertex v)
    : name(std::move(n)), work_items(items), vertex(std::move(v)) {
  if (!vertex) throw Error("Execute '" + name + "': the vertex is empty");
}
Execute::Execute(std::string n, std::function<void(const ComputeContext&)> c)
    : name(std::move(n)), codelet(std::move(c)) {
  if (!codelet) throw Error("Execute '" + name + "': the codelet is empty");
}
Sync::Sync(std::shared_ptr<SyncGroup> g) : group(std::move(g)) {
  if (!group) throw Error("Sync: the sync group is null");
}
Copy::Copy(Buffer s, Buffer d) : src(std::move(s)), dst(std::move(d)) {
  if (!src || !dst) throw Error("Copy: a buffer is null");
  if (src->dtype() != dst->dtype() || src->elements() != dst->elements()) {
    throw Error("Copy from '" + src->name() + "' (" + std::to_string(src->elements()) + " " +
                to_string(src->dtype()) + ") to '" + dst->name() + "' (" +
                std::to_string(dst->elements()) + " " + to_string(dst->dtype()) +
                "): buffers must have the same element type and count");
  }
}
StreamCopy::StreamCopy(InfeedQueue<Tensor>& from, Buffer dst) : infeed(&from), buffer(std::move(dst)) {
  if (!buffer) throw Error("StreamCopy: the destination buffer is null");
}
StreamCopy::StreamCopy(Buffer src, OutfeedQueue<Tensor>& to) : outfeed(&to), buffer(std::move(src)) {
  if (!buffer) throw Error("StreamCopy: the source buffer is null");
}
Repeat::Repeat(std::uint64_t n, Program b) : count(n), body{std::move(b)} {}
RepeatWhile::RepeatWhile(std::function<bool(const ComputeContext&)> c, Program b, std::uint64_t max)
    : condition(std::move(c)), body{std::move(b)}, max_trips(max) {
  if (!condition) throw Error("RepeatWhile: the condition is empty");
}
RemoteCopy::RemoteCopy(std::string n, bool h, std::function<std::size_t(const ComputeContext&)> c)
    : name(std::move(n)), to_host(h), copy(std::move(c)) {
  if (!copy) throw Error("RemoteCopy '" + name + "': the copy function is empty");
}
FusedRepeat::FusedRepeat(std::string n, std::uint64_t c, Loop l, std::function<void(bool)> f)
    : name(std::move(n)), count(c), loop(std::move(l)), finish(std::move(f)) {
  if (!loop) throw Error("FusedRepeat '" + name + "': the loop is empty");
  if (!finish) throw Error("FusedRepeat '" + name + "': the finish step is empty");
}
}  // namespace program

Program::Program(program::Sequence n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Execute n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Sync n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Copy n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::StreamCopy n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::Repeat n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::RepeatWhile n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::FusedRepeat n) : node_(std::make_shared<const Node>(std::move(n))) {}
Program::Program(program::RemoteCopy n) : node_(std::make_shared<const Node>(std::move(n))) {}

// ---- config ----

EngineConfig EngineConfig::from(const Options& options) {
  EngineConfig c;
  c.io_tiles = options.io_tiles();
  c.prefetch_depth = options.prefetch_depth();
  if (options.synthetic_data()) c.synthetic = SyntheticData::kRandomNormal;
  return c;
}

void EngineConfig::validate() const {
  if (prefetch_depth < tunables::kMinPrefetchDepth || prefetch_depth > tunables::kMaxPrefetchDepth) {
    detail::throw_bad_value("prefetch_depth", prefetch_depth, "must be in 1..255");
  }
  if (io_tiles % 2 != 0) {
    detail::throw_bad_value("io_tiles", io_tiles, "must be 0 or an even number");
  }
  host_link.validate("host link");
  device_link.validate("device link");
}

std::optional<std::uint32_t> Engine::suggest_io_tiles(std::size_t bytes, const DeviceConfig& config) {
  const double need = 1.05 * static_cast<double>(bytes) / static_cast<double>(config.bytes_per_tile);
  for (std::uint64_t n = 2; n < config.tiles; n *= 2) {
    if (static_cast<double>(n) >= need) return static_cast<std::uint32_t>(n);
  }
  return std::nullopt;
}

// ---- the interpreter ----

namespace {

enum SlotState : int { kFree, kFilling, kReady, kEnd, kFailed, kSkipped };

// One I/O-tile buffer: a micro-batch the engine moved (to device) or is moving (to host).
struct Slot {
  std::byte* mem = nullptr;
  std::atomic<int> state{kFree};
  Tensor tensor;        // to device: the host tensor (given back if unused); to host: the entry
  std::uint64_t iteration = 0;
  std::string error;
};

struct InLink {  // one infeed, seen from one device
  std::optional<InfeedQueue<Tensor>::Reader> reader;
  std::size_t bytes = 0;   // per micro-batch (every StreamCopy from this infeed moves as many)
  DType dtype = DType::kFloat32;
  std::string name;        // "infeed to 'x'" for messages
  std::vector<std::unique_ptr<Slot>> slots;  // io_tiles > 0
  std::size_t next_use = 0;
  std::atomic<bool> closing{false};          // the device is done: fetch nothing more
  Tensor staging;                            // io_tiles = 0: the element being moved
};

struct OutLink {  // one outfeed, seen from one device
  std::optional<OutfeedQueue<Tensor>::Writer> writer;
  std::vector<std::unique_ptr<Slot>> slots;  // io_tiles > 0
  std::size_t bytes = 0;                     // of the largest source (sizes the slots)
  std::size_t next_use = 0;
};

std::uint64_t mix_seed(std::uint64_t seed, std::uint32_t device, std::uint32_t replica) {
  std::uint64_t s = seed ^ (std::uint64_t{device} << 32) ^ (std::uint64_t{replica} * 0x9E3779B97F4A7C15ULL);
  detail::splitmix64(s);
  return detail::splitmix64(s);
}

void fill_synthetic(DeviceBuffer& b, SyntheticData kind, std::uint64_t seed) {
  if (kind == SyntheticData::kZeros) {
    std::memset(b.raw().data(), 0, b.bytes());
    return;
  }
  std::uint64_t state = seed;
  auto uniform = [&] {  // (0, 1]
    return (static_cast<double>(detail::splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
  };
  auto normal = [&] {  // Box-Muller; one value per call is plenty here
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  };
  switch (b.dtype()) {
    case DType::kFloat32:
      for (float& v : b.as<float>()) v = static_cast<float>(normal());
      break;
    case DType::kFloat16:
      for (std::uint16_t& v : b.as<std::uint16_t>()) v = to_half(static_cast<float>(normal()));
      break;
    case DType::kUint8:  // pixels: around mid-grey
      for (std::uint8_t& v : b.as<std::uint8_t>()) {
        v = static_cast<std::uint8_t>(std::clamp(std::lround(128.0 + 32.0 * normal()), 0L, 255L));
      }
      break;
    case DType::kInt32:
      for (std::int32_t& v : b.as<std::int32_t>()) v = static_cast<std::int32_t>(std::lround(normal() * 100));
      break;
  }
}

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
      : eng_(engine), device_(device), index_(index), control_(control),
        stop_(control.stop()), track_(track), io_track_(io_track) {
    ctx_.device = device_.id();
    ctx_.replica = index;
    ctx_.compute_tiles = engine.compute_tiles;
    ctx_.stop = &stop_;
  }

  // Host thread, before the run: the links this device's program uses.
  void add_infeed(InfeedQueue<Tensor>& q, const DeviceBuffer& dst) {
    auto [it, fresh] = ins_.try_emplace(&q);
    InLink& link = it->second;
    if (!fresh) {
      if (link.bytes != dst.bytes() || link.dtype != dst.dtype()) {
        throw Error("device " + std::to_string(device_.id()) + ": two StreamCopy from one infeed "
                    "into buffers of different sizes ('" + link.name + "' and '" + dst.name() +
                    "'): every copy from an infeed moves one micro-batch of one size");
      }
      return;
    }
    link.bytes = dst.bytes();
    link.dtype = dst.dtype();
    link.name = dst.name();
    if (eng_.config.synthetic != SyntheticData::kOff) return;  // no host copies at all
    link.reader.emplace(q.reader(index_));
    if (eng_.config.io_tiles > 0) {
      for (std::uint32_t k = 0; k < eng_.config.prefetch_depth; ++k) {
        auto slot = std::make_unique<Slot>();
        slot->mem = static_cast<std::byte*>(device_.arena().allocate(
            link.bytes, "I/O tiles: prefetch " + std::to_string(k) + " for '" + dst.name() + "'"));
        link.slots.push_back(std::move(slot));
      }
    }
  }
  void add_outfeed(OutfeedQueue<Tensor>& q, const DeviceBuffer& src, OutfeedQueue<Tensor>::Writer* w) {
    auto [it, fresh] = outs_.try_emplace(&q);
    OutLink& link = it->second;
    if (fresh) link.writer.emplace(std::move(*w));
    if (eng_.config.io_tiles > 0 && eng_.config.synthetic == SyntheticData::kOff) {
      // One outbound I/O buffer per prefetch step, sized for the largest source.
      if (link.slots.empty()) {
        for (std::uint32_t k = 0; k < eng_.config.prefetch_depth; ++k) link.slots.push_back(std::make_unique<Slot>());
      }
      link.bytes = std::max(link.bytes, src.bytes());
    }
  }
  void allocate_out_slots() {
    for (auto& [q, link] : outs_) {
      for (std::size_t k = 0; k < link.slots.size(); ++k) {
        link.slots[k]->mem = static_cast<std::byte*>(device_.arena().allocate(
            link.bytes, "I/O tiles: outbound " + std::to_string(k)));
      }
    }
  }
  void label(const program::Execute& e) { labels_[&e] = track_ ? track_->add_label(e.name) : 0; }
  void add_fused(const program::FusedRepeat& f) {
    fused_.push_back(&f);
    fused_label_ = track_ ? track_->add_label(f.name) : 0;
  }

  // Device thread: the whole run.
  void run(const Program& program) {
    // Once per device thread (a system call: not once per run).
    static thread_local const bool slack_lowered = lower_timer_slack();
    (void)slack_lowered;
    bool failed = false;
    try {
      for (auto& [q, link] : ins_) {
        for (auto& slot : link.slots) submit_fill(link, *slot);
      }
      if (!exec(program) && status_ == RunStatus::kCompleted) status_ = RunStatus::kCancelled;
    } catch (...) {
      failed = true;
      control_.fail(detail::RunControl::Failure{device_.id(), index_, ctx_.iteration, std::current_exception()});
    }
    try {
      finish(!failed && status_ != RunStatus::kCancelled);
    } catch (...) {
      if (!failed) control_.fail(detail::RunControl::Failure{device_.id(), index_, ctx_.iteration, std::current_exception()});
      failed = true;
    }
    control_.replica_done(index_, detail::RunControl::ReplicaEnd{device_.id(), iterations_, status_, failed});
  }

  // Host thread, instead of run() when the device refused the job: releases the links.
  void abandon() noexcept {
    try {
      finish(false);
    } catch (...) {  // the refusal is the error reported
    }
    control_.replica_done(index_, detail::RunControl::ReplicaEnd{device_.id(), 0, RunStatus::kCancelled, true});
  }

  void wake() noexcept { point_.notify(); }
  // Host thread, before the run: what keeps this object alive (the run's shared state).
  // Every I/O-engine callback holds it, because the engine may still be inside one when the
  // device has already seen the transfer end and the host has moved on.
  void set_owner(std::weak_ptr<void> owner) { owner_ = std::move(owner); }

 private:
  // false: the program must stop (end of data, or stop requested).
  bool exec(const Program& p) {
    return std::visit([this](const auto& node) { return exec_node(node); }, p.node());
  }

  bool exec_node(const program::Sequence& s) {
    for (const Program& step : s.steps) {
      if (!exec(step)) return false;
    }
    return true;
  }

  bool exec_node(const program::Execute& e) {
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
    if (track_) track_->record(Phase::kCompute, t0, Clock::now(), 0, labels_[&e]);
    return true;
  }

  bool exec_node(const program::FusedRepeat& f) {
    const program::LoopFrame frame{&ctx_, &stop_, track_, fused_label_, &iterations_};
    const RunStatus end = f.loop(frame);
    if (end == RunStatus::kCompleted) return true;
    status_ = end;
    return false;
  }

  bool exec_node(const program::RemoteCopy& r) {
    const Clock::time_point t0 = Clock::now();
    const std::size_t bytes = r.copy(ctx_);
    wait_until_deadline(t0 + eng_.config.host_link.duration(bytes));
    if (track_) track_->record(Phase::kStreamCopyMid, t0, Clock::now(), bytes, 0, r.to_host);
    return true;
  }

  bool exec_node(const program::Sync& s) {
    const Clock::time_point t0 = track_ ? Clock::now() : Clock::time_point{};
    const bool ok = s.group->arrive_and_wait(stop_, device_.placement().sharing > 1
                                                        ? detail::Spin::kYield
                                                        : detail::Spin::kTight);
    if (track_) track_->record(Phase::kSync, t0, Clock::now());
    return ok;
  }

  bool exec_node(const program::Copy& c) {
    // Between devices the copy takes the device link's modeled time (none on one device).
    const std::chrono::nanoseconds link = &c.src->device() != &c.dst->device()
                                              ? eng_.config.device_link.duration(c.dst->bytes())
                                              : std::chrono::nanoseconds{0};
    const Clock::time_point t0 = track_ || link.count() > 0 ? Clock::now() : Clock::time_point{};
    std::memcpy(c.dst->raw().data(), c.src->raw().data(), c.dst->bytes());
    if (link.count() > 0) wait_until_deadline(t0 + link);
    if (track_) track_->record(Phase::kExchange, t0, Clock::now(), c.dst->bytes());
    return true;
  }

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

  bool exec_node(const program::StreamCopy& s) {
    DeviceBuffer& buf = *s.buffer;
    if (s.infeed != nullptr) {
      InLink& link = ins_.at(s.infeed);
      if (eng_.config.synthetic != SyntheticData::kOff) return synthesize(buf);
      return eng_.config.io_tiles > 0 ? copy_in_from_io_tiles(link, buf) : copy_in(link, buf);
    }
    if (eng_.config.synthetic != SyntheticData::kOff) return true;  // nothing leaves either
    OutLink& link = outs_.at(s.outfeed);
    return eng_.config.io_tiles > 0 ? copy_out_to_io_tiles(link, buf) : copy_out(link, buf);
  }

  bool synthesize(DeviceBuffer& buf) {
    if (!synthesized_.insert(&buf).second) return true;  // filled once, then left in place
    const Clock::time_point t0 = track_ ? Clock::now() : Clock::time_point{};
    fill_synthetic(buf, eng_.config.synthetic, mix_seed(eng_.config.seed, device_.id(), index_));
    if (track_) track_->record(Phase::kCompute, t0, Clock::now(), 0, track_->add_label("synthetic data"));
    return true;
  }

  // What is wrong with a host tensor for this link's buffers; empty if nothing.
  static std::string tensor_mismatch(const InLink& link, const Tensor& t) {
    if (t.dtype() == link.dtype && t.bytes() == link.bytes) return {};
    return "infeed element for buffer '" + link.name + "' is " + std::to_string(t.elements()) + " " +
           to_string(t.dtype()) + " (" + std::to_string(t.bytes()) + " bytes); the buffer takes " +
           std::to_string(link.bytes / dtype_size(link.dtype)) + " " + to_string(link.dtype) + " (" +
           std::to_string(link.bytes) + " bytes)";
  }

  // io_tiles = 0: has the I/O engine do `copy` (bytes moved to_host or not) over the
  // modeled link, asked for at `start`, and waits for it: sleeps until shortly before it can
  // end, spins until a little after, then parks (so a late engine costs no CPU).
  void transfer_and_wait(Clock::time_point start, std::size_t bytes, bool to_host,
                         std::function<void()> copy) {
    std::atomic<int> done{0};
    const auto modeled = eng_.config.host_link.duration(bytes);
    const Clock::time_point earliest_end = start + modeled;
    eng_.io->submit(index_, IoEngine::Transfer{
        bytes, modeled,
        [&copy] {
          copy();
          return IoEngine::Start::kGo;
        },
        [&, keep = owner_.lock()](const IoEngine::Times& t, bool) {
          record_io(t, bytes, to_host);
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

  void record_io(const IoEngine::Times& t, std::size_t bytes, bool to_host) {
    if (io_track_) io_track_->record(Phase::kTransfer, t.begin, t.end, bytes, 0, to_host);
  }

  // io_tiles = 0: wait for the host's element, move it over the modeled link, hand it over.
  bool copy_in(InLink& link, DeviceBuffer& buf) {
    const Clock::time_point t0 = Clock::now();
    if (!link.reader->try_pop(link.staging) && !link.reader->pop(link.staging, &stop_)) {
      if (link.reader->end_of_data()) status_ = RunStatus::kEndOfData;
      return false;
    }
    const Clock::time_point t1 = Clock::now();
    if (std::string wrong = tensor_mismatch(link, link.staging); !wrong.empty()) throw Error(wrong);
    transfer_and_wait(t1, link.bytes, false,
                      [&] { std::memcpy(buf.raw().data(), link.staging.raw().data(), link.bytes); });
    const Clock::time_point t2 = Clock::now();
    link.staging = Tensor();  // the host buffer goes back (to its pool, if it has one)
    if (track_) {
      if (t1 - t0 > std::chrono::nanoseconds(0)) track_->record(Phase::kStreamCopyBegin, t0, t1);
      track_->record(Phase::kStreamCopyMid, t1, t2, link.bytes);
      track_->record(Phase::kStreamCopyEnd, t2, Clock::now());
    }
    return true;
  }

  // io_tiles > 0: take the next micro-batch the I/O tiles hold, refill the buffer it used.
  bool copy_in_from_io_tiles(InLink& link, DeviceBuffer& buf) {
    Slot& slot = *link.slots[link.next_use % link.slots.size()];
    const Clock::time_point t0 = Clock::now();
    auto arrived = [&] { return slot.state.load(std::memory_order_seq_cst) >= kReady || stop_.requested(); };
    if (!arrived()) point_.wait(arrived);
    const Clock::time_point t1 = Clock::now();
    if (track_ && t1 - t0 > std::chrono::microseconds(1)) track_->record(Phase::kStreamCopyBegin, t0, t1);
    const int state = slot.state.load(std::memory_order_acquire);
    if (state == kEnd) {
      status_ = RunStatus::kEndOfData;
      return false;
    }
    if (state == kFailed) throw Error(slot.error);
    if (state != kReady) return false;  // stopped
    std::memcpy(buf.raw().data(), slot.mem, link.bytes);  // I/O tiles -> compute tiles
    slot.tensor = Tensor();
    slot.state.store(kFree, std::memory_order_relaxed);  // relaxed: only this thread reads it now
    ++link.next_use;
    submit_fill(link, slot);
    if (track_) track_->record(Phase::kStreamCopyEnd, t1, Clock::now(), link.bytes);
    return true;
  }

  // Device thread: asks the engine to move the next micro-batch into `slot`.
  void submit_fill(InLink& link, Slot& slot) {
    slot.state.store(kFilling, std::memory_order_relaxed);  // relaxed: published by the post
    ++in_flight_;
    const auto modeled = eng_.config.host_link.duration(link.bytes);
    eng_.io->submit(index_, IoEngine::Transfer{
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
            s = cancelled ? kSkipped : kReady;
          }
          slot.state.store(s, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
          in_flight_.fetch_sub(1, std::memory_order_seq_cst);
          point_.notify();
        }});
  }

  // io_tiles = 0: move the result over the modeled link, then into the outfeed.
  bool copy_out(OutLink& link, DeviceBuffer& buf) {
    const Clock::time_point t0 = Clock::now();
    Tensor out(buf.dtype(), {buf.elements()}, Tensor::Init::kNone);
    transfer_and_wait(t0, buf.bytes(), true,
                      [&] { std::memcpy(out.raw().data(), buf.raw().data(), buf.bytes()); });
    const Clock::time_point t1 = Clock::now();
    const bool ok = link.writer->write(ctx_.iteration, std::move(out), &stop_);
    if (track_) {
      track_->record(Phase::kStreamCopyMid, t0, t1, buf.bytes(), 0, true);
      track_->record(Phase::kStreamCopyEnd, t1, Clock::now());
    }
    return ok;
  }

  // io_tiles > 0: drop the result into a free outbound I/O buffer; the engine moves it on.
  bool copy_out_to_io_tiles(OutLink& link, DeviceBuffer& buf) {
    Slot& slot = *link.slots[link.next_use % link.slots.size()];
    const Clock::time_point t0 = Clock::now();
    auto room = [&] { return slot.state.load(std::memory_order_seq_cst) != kFilling || stop_.requested(); };
    if (!room()) point_.wait(room);
    const Clock::time_point t1 = Clock::now();
    if (track_ && t1 - t0 > std::chrono::microseconds(1)) track_->record(Phase::kStreamCopyBegin, t0, t1);
    if (stop_.requested()) return false;
    const std::size_t bytes = buf.bytes();
    std::memcpy(slot.mem, buf.raw().data(), bytes);  // compute tiles -> I/O tiles
    slot.iteration = ctx_.iteration;
    slot.state.store(kFilling, std::memory_order_relaxed);  // relaxed: published by the post
    ++link.next_use;
    ++in_flight_;
    const DType dtype = buf.dtype();
    const std::size_t elements = buf.elements();
    eng_.io->submit(index_, IoEngine::Transfer{
        bytes, eng_.config.host_link.duration(bytes),
        [&slot, dtype, elements, bytes] {
          slot.tensor = Tensor(dtype, {elements}, Tensor::Init::kNone);
          std::memcpy(slot.tensor.raw().data(), slot.mem, bytes);
          return IoEngine::Start::kGo;
        },
        [this, keep = owner_.lock(), &link, &slot, bytes](const IoEngine::Times& t, bool cancelled) {
          if (!cancelled) {
            record_io(t, bytes, true);
            // The engine thread writes while the device computes on; the device flushes and
            // finishes the writer only after every outbound transfer has ended.
            try {
              if (!link.writer->write(slot.iteration, std::move(slot.tensor), &stop_)) lost_.fetch_add(1);
            } catch (...) {
              lost_.fetch_add(1);
            }
          }
          slot.tensor = Tensor();
          slot.state.store(kFree, std::memory_order_seq_cst);  // seq_cst: see WaitPoint::notify()
          in_flight_.fetch_sub(1, std::memory_order_seq_cst);
          point_.notify();
        }});
    if (track_) track_->record(Phase::kStreamCopyEnd, t1, Clock::now(), bytes, 0, true);
    return true;
  }

  // Device thread, at the end: let the engine finish with this device's buffers, give
  // prefetched micro-batches back to their infeeds, deliver held outfeed entries.
  void finish(bool deliver) {
    for (const program::FusedRepeat* f : fused_) f->finish(deliver);
    const Clock::time_point t0 = Clock::now();
    for (auto& [q, link] : ins_) link.closing.store(true, std::memory_order_release);
    point_.wait([&] { return in_flight_.load(std::memory_order_seq_cst) == 0; });
    if (track_ && Clock::now() - t0 > std::chrono::microseconds(1)) track_->record(Phase::kIdle, t0, Clock::now());
    for (auto& [q, link] : ins_) {
      if (!link.reader) continue;
      for (std::size_t k = 0; k < link.slots.size(); ++k) {  // oldest first
        Slot& slot = *link.slots[(link.next_use + k) % link.slots.size()];
        if (slot.state.load(std::memory_order_acquire) == kReady) link.reader->put_back(std::move(slot.tensor));
      }
      link.reader.reset();
      for (auto& slot : link.slots) device_.arena().release(slot->mem);
    }
    for (auto& [q, link] : outs_) {
      if (link.writer) link.writer->finish(deliver && lost_.load() == 0, &stop_);
      link.writer.reset();
      for (auto& slot : link.slots) device_.arena().release(slot->mem);
    }
    if (lost_.load() != 0) {
      throw Error(std::to_string(lost_.load()) + " outfeed entr" + (lost_.load() == 1 ? "y" : "ies") +
                  " could not be delivered (the run was stopped while the outfeed was full)");
    }
  }

  EngineState& eng_;
  Device& device_;
  const std::uint32_t index_;
  detail::RunControl& control_;
  const detail::StopFlag& stop_;
  TraceTrack* track_;
  TraceTrack* io_track_;
  ComputeContext ctx_;
  bool in_repeat_ = false;
  std::uint64_t iterations_ = 0;
  RunStatus status_ = RunStatus::kCompleted;
  std::map<const InfeedQueue<Tensor>*, InLink> ins_;
  std::map<const OutfeedQueue<Tensor>*, OutLink> outs_;
  std::map<const program::Execute*, std::uint32_t> labels_;
  std::vector<const program::FusedRepeat*> fused_;
  std::uint32_t fused_label_ = 0;
  std::set<const DeviceBuffer*> synthesized_;
  std::atomic<std::uint32_t> in_flight_{0};
  std::atomic<std::uint32_t> lost_{0};
  detail::WaitPoint point_;
  std::weak_ptr<void> owner_;
};

// One run's shared state: held by every device job and I/O callback of the run, so the
// last one to finish frees it (the host may return before they have all let go).
struct RunShared {
  RunShared(std::uint32_t devices, std::uint64_t requested) : control(devices, requested) {}
  detail::RunControl control;
  std::vector<Program> programs;
  std::vector<std::unique_ptr<DeviceRun>> runs;
  std::map<OutfeedQueue<Tensor>*, std::vector<OutfeedQueue<Tensor>::Writer>> writers;
  std::set<SyncGroup*> groups;
  std::set<InfeedQueue<Tensor>*> infeeds;
};

// What a program uses, gathered before the run.
struct Uses {
  std::vector<const program::StreamCopy*> streams;
  std::vector<const program::Execute*> executes;
  const program::FusedRepeat* fused = nullptr;  // only ever the whole program
  std::set<SyncGroup*> groups;
  std::vector<const DeviceBuffer*> buffers;  // buffers the device itself touches
  std::optional<std::uint64_t> outer_count;
};

void gather(const Program& p, Uses& u, bool in_repeat, const Program& root) {
  std::visit(
      [&](const auto& n) {
        using N = std::decay_t<decltype(n)>;
        if constexpr (std::is_same_v<N, program::Sequence>) {
          for (const Program& s : n.steps) gather(s, u, in_repeat, root);
        } else if constexpr (std::is_same_v<N, program::Execute>) {
          u.executes.push_back(&n);
        } else if constexpr (std::is_same_v<N, program::Sync>) {
          u.groups.insert(n.group.get());
        } else if constexpr (std::is_same_v<N, program::Copy>) {
          u.buffers.push_back(n.dst.get());
        } else if constexpr (std::is_same_v<N, program::StreamCopy>) {
          u.streams.push_back(&n);
          u.buffers.push_back(n.buffer.get());
        } else if constexpr (std::is_same_v<N, program::Repeat>) {
          if (!in_repeat && !u.outer_count) u.outer_count = n.count;
          gather(n.body.front(), u, true, root);
        } else if constexpr (std::is_same_v<N, program::RemoteCopy>) {
          // host memory of the program's own: nothing to set up
        } else if constexpr (std::is_same_v<N, program::FusedRepeat>) {
          if (&n != std::get_if<program::FusedRepeat>(&root.node())) {
            throw Error("FusedRepeat '" + n.name + "' must be a device's whole program, not "
                        "part of a Sequence or Repeat (it runs every trip itself)");
          }
          u.fused = &n;
          u.outer_count = n.count;
        } else {
          gather(n.body.front(), u, true, root);
        }
      },
      p.node());
}

}  // namespace

// ---- Engine ----

struct Engine::Impl : EngineState {
  std::mutex current_mutex;
  std::shared_ptr<RunShared> current;  // the run in progress, for cancel()
};

Engine::Engine(DeviceList devices, EngineConfig config) : impl_(std::make_unique<Impl>()) {
  config.validate();
  if (devices.size() == 0) throw Error("Engine needs at least one device");
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    Device& dev = devices[d];
    if (config.io_tiles >= dev.config().tiles) {
      detail::throw_bad_value("io_tiles", config.io_tiles,
                              "must be below the device's " + std::to_string(dev.config().tiles) +
                                  " tiles (an even number, leaving tiles to compute on)");
    }
    impl_->devices.push_back(&dev);
  }
  if (std::string env = detail::trace_path_from_env(); !env.empty()) {
    config.trace = true;
    if (config.trace_path.empty()) config.trace_path = std::move(env);
  }
  impl_->compute_tiles = impl_->devices.front()->config().tiles - config.io_tiles;
  impl_->config = std::move(config);
  std::vector<std::uint32_t> cores;
  for (Device* d : impl_->devices) {
    if (d->placement().core) cores.push_back(*d->placement().core);
  }
  impl_->io = std::make_unique<IoEngine>(devices.size(), "I/O engine", IoEngine::pick_core(cores));
}

Engine::~Engine() = default;

EngineResult Engine::run(const Program& program) {
  return run(std::vector<Program>(impl_->devices.size(), program));
}

EngineResult Engine::run(const std::vector<Program>& programs) { return run(programs, nullptr); }

EngineResult Engine::run(const std::vector<Program>& programs, std::function<void()> wake) {
  Impl& im = *impl_;
  const auto n = static_cast<std::uint32_t>(im.devices.size());
  if (programs.size() != n) {
    throw Error("Engine::run: " + std::to_string(programs.size()) + " programs for " +
                std::to_string(n) + " devices (give one program per device, or one for all)");
  }
  // Check the programs against the devices and the config.
  std::vector<Uses> uses(n);
  std::map<SyncGroup*, std::uint32_t> group_users;
  for (std::uint32_t d = 0; d < n; ++d) {
    gather(programs[d], uses[d], false, programs[d]);
    for (const DeviceBuffer* b : uses[d].buffers) {
      if (&b->device() != im.devices[d]) {
        throw Error("the program of device " + std::to_string(im.devices[d]->id()) + " uses buffer '" +
                    b->name() + "' of device " + std::to_string(b->device().id()) +
                    ": stream copies and the destination of a Copy must be on the device that runs them");
      }
    }
    for (SyncGroup* g : uses[d].groups) ++group_users[g];
    std::size_t micro_batch = 0;
    std::set<const InfeedQueue<Tensor>*> seen;
    for (const program::StreamCopy* s : uses[d].streams) {
      if (s->infeed && seen.insert(s->infeed).second) micro_batch += s->buffer->bytes();
      if (s->infeed && s->infeed->replicas() != n) {
        throw Error("infeed of buffer '" + s->buffer->name() + "' has " + std::to_string(s->infeed->replicas()) +
                    " replica lane(s) but the engine runs " + std::to_string(n) +
                    " device(s): device d reads lane d (InfeedConfig::replicas = " + std::to_string(n) + ")");
      }
      if (s->outfeed && s->outfeed->replicas() != n) {
        throw Error("outfeed of buffer '" + s->buffer->name() + "' has " + std::to_string(s->outfeed->replicas()) +
                    " replica(s) but the engine runs " + std::to_string(n) +
                    " device(s) (OutfeedConfig::replicas = " + std::to_string(n) + ")");
      }
    }
    const DeviceConfig& dc = im.devices[d]->config();
    if (im.config.io_tiles > 0 && micro_batch > 0 &&
        static_cast<double>(im.config.io_tiles) * static_cast<double>(dc.bytes_per_tile) <
            1.05 * static_cast<double>(micro_batch)) {
      const auto suggestion = suggest_io_tiles(micro_batch, dc);
      throw Error("io_tiles = " + std::to_string(im.config.io_tiles) + " hold " +
                  detail::format_bytes(std::uint64_t{im.config.io_tiles} * dc.bytes_per_tile) +
                  ", too little for one micro-batch of " + detail::format_bytes(micro_batch) +
                  " (with 5% headroom) on device " + std::to_string(im.devices[d]->id()) + ": " +
                  (suggestion ? "use io_tiles = " + std::to_string(*suggestion) + " (leaving " +
                                    std::to_string(dc.tiles - *suggestion) + " compute tiles)"
                              : std::string("no even count below the device's ") +
                                    std::to_string(dc.tiles) + " tiles holds it; shrink the micro-batch"));
    }
  }
  for (auto& [g, users] : group_users) {
    if (users != g->participants()) {
      throw Error("a sync group of " + std::to_string(g->participants()) + " participants is used by " +
                  std::to_string(users) + " device program(s): every participant must sync on it, "
                  "or the others would wait forever");
    }
  }

  // Set up the run: tracks, links (readers claim lanes, writers attach), device runs.
  const Clock::time_point origin = Clock::now();
  std::unique_ptr<Trace> trace;
  if (im.config.trace) trace = std::make_unique<Trace>(origin);
  std::vector<TraceTrack*> tracks(n, nullptr), io_tracks(n, nullptr);
  if (trace) {
    for (std::uint32_t d = 0; d < n; ++d) {
      tracks[d] = &trace->add_track("device " + std::to_string(im.devices[d]->id()), TraceTrack::Kind::kDevice, d);
    }
    for (std::uint32_t d = 0; d < n; ++d) {
      io_tracks[d] = &trace->add_track("I/O engine: link " + std::to_string(im.devices[d]->id()), TraceTrack::Kind::kIo, d);
    }
  }
  auto shared = std::make_shared<RunShared>(n, uses.front().outer_count.value_or(1));
  RunShared& rs = *shared;
  detail::RunControl& control = rs.control;
  rs.programs = programs;
  for (std::uint32_t d = 0; d < n; ++d) {
    rs.runs.push_back(std::make_unique<DeviceRun>(im, *im.devices[d], d, control, tracks[d], io_tracks[d]));
    DeviceRun& run = *rs.runs[d];
    run.set_owner(shared);
    for (const program::Execute* e : uses[d].executes) run.label(*e);
    if (uses[d].fused) run.add_fused(*uses[d].fused);
    for (const program::StreamCopy* s : uses[d].streams) {
      if (s->infeed) {
        run.add_infeed(*s->infeed, *s->buffer);
        rs.infeeds.insert(s->infeed);
      } else {
        auto it = rs.writers.find(s->outfeed);
        if (it == rs.writers.end()) it = rs.writers.emplace(s->outfeed, s->outfeed->begin_run()).first;
        run.add_outfeed(*s->outfeed, *s->buffer, &it->second[d]);
      }
    }
    run.allocate_out_slots();
  }
  for (auto& [g, users] : group_users) {
    g->reset();  // a run stopped midway may have left arrivals behind
    rs.groups.insert(g);
  }
  control.set_waker([&rs, wake = std::move(wake)] {  // called only while the run is open: rs is alive
    if (wake) wake();
    for (SyncGroup* g : rs.groups) g->wake();
    for (InfeedQueue<Tensor>* q : rs.infeeds) q->wake_all();
    for (auto& [q, w] : rs.writers) q->wake_all();
    for (auto& r : rs.runs) r->wake();
  });

  {
    std::lock_guard lock(im.current_mutex);
    im.current = shared;
  }
  for (std::uint32_t d = 0; d < n; ++d) {
    try {
      im.devices[d]->submit(DeviceJob{[shared, d] { shared->runs[d]->run(shared->programs[d]); },
                                      [shared] { shared->control.cancel(); }});
    } catch (...) {
      control.fail(detail::RunControl::Failure{im.devices[d]->id(), d, 0, std::current_exception()});
      for (std::uint32_t k = d; k < n; ++k) rs.runs[k]->abandon();
      break;
    }
  }
  control.wait();
  const Clock::time_point end = Clock::now();
  // Every device has reported its end and no longer reads its program: let go of the
  // programs here, so buffers they hold are freed on this thread, not by whichever device
  // thread drops the run's shared state last (perhaps while the host destroys a device).
  rs.programs.clear();
  {
    std::lock_guard lock(im.current_mutex);
    im.current.reset();
  }
  if (trace) {
    trace->set_end(end);
    im.trace = std::move(trace);
    if (!im.config.trace_path.empty()) im.trace->write_chrome_json(im.config.trace_path);
  }
  EngineResult result;
  result.elapsed = end - origin;
  result.status = control.finish(result.iterations, result.message);
  return result;
}

void Engine::cancel() noexcept {
  std::lock_guard lock(impl_->current_mutex);
  if (impl_->current) impl_->current->control.cancel();
}

namespace detail {
namespace {
// A one-device engine for a loop built elsewhere: no link, no I/O engine, every tile computes.
struct LoneRun {
  LoneRun(Device& device, std::uint32_t replica, const Program& program, RunControl& control,
          TraceTrack* track) {
    gather(program, uses, false, program);
    if (uses.fused == nullptr) {  // (gather() allows a FusedRepeat only as the whole program)
      throw Error("run_on_device: only a FusedRepeat program runs outside an Engine");
    }
    state.compute_tiles = device.config().tiles;
    run.emplace(state, device, replica, control, track, nullptr);
    run->add_fused(*uses.fused);
  }
  Uses uses;
  EngineState state;
  std::optional<DeviceRun> run;
};
}  // namespace

void run_on_device(Device& device, std::uint32_t replica, const Program& program,
                   RunControl& control, TraceTrack* track) {
  LoneRun lone(device, replica, program, control, track);
  lone.run->run(program);
}

void abandon_on_device(Device& device, std::uint32_t replica, const Program& program,
                       RunControl& control) noexcept {
  try {
    LoneRun lone(device, replica, program, control, nullptr);
    lone.run->abandon();
  } catch (...) {  // not a FusedRepeat: nothing to finish
    control.replica_done(replica, RunControl::ReplicaEnd{device.id(), 0, RunStatus::kCancelled, true});
  }
}
}  // namespace detail

const Trace* Engine::trace() const noexcept { return impl_->trace.get(); }
TraceSummary Engine::summary() const { return impl_->trace ? impl_->trace->summary() : TraceSummary{}; }
const EngineConfig& Engine::config() const noexcept { return impl_->config; }
std::uint32_t Engine::devices() const noexcept { return static_cast<std::uint32_t>(impl_->devices.size()); }
std::uint32_t Engine::compute_tiles() const noexcept { return impl_->compute_tiles; }
bool Engine::low_timer_slack() const noexcept { return impl_->io->low_timer_slack(); }

}  // namespace bspflow
