// loops::repeat: run n device iterations of a body on a device (or one replica per device
// of a group) without returning to the host (TF-IPU loops.repeat, PopTorch
// deviceIterations).
//
//   InfeedQueue<Pair> infeed;  OutfeedQueue<Result> outfeed;  Device device(0);
//   auto r = loops::repeat(device, 10, [](int& counter, Pair& x) {
//     ++counter;
//     return Result{x.a + x.b};
//   }, 0, infeed, outfeed);
//   // r.state() == 10, outfeed holds 10 entries
//
// The body is called as body(State&, In&) with an infeed, body(State&) without one, each
// optionally with a trailing `const Iteration&`. With an outfeed its return value is the
// iteration's output, shaped by the outfeed's OutputMode. Each replica gets its own copy of
// the body and of the initial state.
//
// Ending: after n iterations (kCompleted); when a replica reads past a closed, drained
// infeed (kEndOfData — TF-IPU aborts the process here, bspflow ends the loop and says so);
// on cancel (kCancelled). A body exception stops every replica and reaches the host as
// DeviceError with device, replica and iteration; outfeed entries written before it are
// still delivered. Every device thread is left idle and joinable; nothing hangs.
//
// Each overload takes the DeviceList, n (device iterations per replica), the body, the
// initial state and the feeds it uses: an infeed, an outfeed, both or neither. The feeds
// must have one lane per replica (replicas = devices.size()) and outlive the run (the Run
// handle waits for the loop when destroyed, so keep the feeds alive at least as long as it).
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_link_timeline.hpp"
#include "bspflow/devices/link_model.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/runtime/engine.hpp"
#include "bspflow/runtime/options.hpp"
#include "bspflow/runtime/program.hpp"
#include "bspflow/runtime/run.hpp"
#include "bspflow/runtime/trace.hpp"

namespace bspflow::loops {

// A loop runs on a DeviceList (bspflow/devices/device.hpp): one Device, or every device of a
// DeviceGroup (one replica each).

// The device model on a loop's path: how its elements cross the modeled host link. Pass one
// to the overloads that take it; the overloads without one move elements at memory speed
// (what the queue benchmarks measure).
//
// With it, each element taken off the infeed is a copy of host_bytes(element) bytes in and
// each output the outfeed delivers (every iteration for all(), each n-th for every_n(n),
// one at the end for final() and sum(), measured as the last output) a copy out, timed by
// host_link
// (HostLinkTimeline): without I/O tiles the device waits for each copy; with io_tiles the
// tiles copy up to the infeed's prefetch_depth elements ahead while the body computes (their
// memory, io_tiles x bytes per tile, is taken from each device's arena for the run, and must
// hold prefetch_depth elements). synthetic_data: each replica reads one element from its lane
// and its body sees that same element (as left by the previous iteration) every iteration;
// nothing crosses the link in either direction: the upper bound real data is measured
// against. RepeatResult::host_bytes_in / host_bytes_out / host_wait say what crossed.
//
// Bytes of an element: host_bytes(element) if such a function is found by argument-dependent
// lookup (bspflow::Tensor, bspflow::Batch: data and labels; define one for your own types that
// own heap memory), else size() x sizeof(value) for a std::vector of trivially copyable
// values, else sizeof(T) for a trivially copyable T; any other type does not compile with a
// LoopConfig.
struct LoopConfig {
  LinkModel host_link = LinkModel::host();
  std::uint32_t io_tiles = 0;  // 0, or even and below every device's tiles
  bool synthetic_data = false;

  // Any thread. host_link, io_tiles and synthetic_data from Options (prefetch_depth reaches
  // the loop through the infeed: Options::infeed_config()). Never blocks, never allocates.
  // Throws what Options::validate() throws.
  static LoopConfig from(const Options& options);
  // Any thread. Throws bspflow::Error naming the field, the value and what is allowed (odd
  // io_tiles, a bad link; io_tiles against the devices' tiles is checked when the loop
  // starts). Never blocks; allocates only for the message.
  void validate() const;
};

namespace detail {

// How many bytes an element moves over the host link (see LoopConfig).
template <class T>
concept HasHostBytes = requires(const T& v) {
  { host_bytes(v) } -> std::convertible_to<std::size_t>;
};
template <class T>
inline constexpr bool kIsTrivialVector = false;
template <class U, class A>
inline constexpr bool kIsTrivialVector<std::vector<U, A>> = std::is_trivially_copyable_v<U>;
template <class T>
inline constexpr bool kMeasurable =
    HasHostBytes<T> || kIsTrivialVector<T> || std::is_trivially_copyable_v<T>;
template <class T>
std::size_t element_bytes(const T& v) {
  if constexpr (HasHostBytes<T>) {
    return static_cast<std::size_t>(host_bytes(v));
  } else if constexpr (kIsTrivialVector<T>) {
    return v.size() * sizeof(typename T::value_type);
  } else {
    return sizeof(T);
  }
}
// One replica's link for a run: the timeline and, with I/O tiles, their memory in the
// device's arena (released with it).
class ReplicaLink {
 public:
  ReplicaLink(const LoopConfig& config, Device& device, std::uint32_t replica, std::uint32_t prefetch_depth);
  ReplicaLink(const ReplicaLink&) = delete;
  ReplicaLink& operator=(const ReplicaLink&) = delete;
  ~ReplicaLink();
  HostLinkTimeline timeline;
  bool synthetic;

 private:
  Arena* arena_ = nullptr;
  void* io_tiles_ = nullptr;
};

using bspflow::detail::RunControl;
using bspflow::detail::RunState;

struct NoFeed {};

template <class>
inline constexpr bool kAlwaysFalse = false;

template <class Body, class State, class In>
decltype(auto) call_body(Body& body, State& state, In* input, const Iteration& it) {
  if constexpr (std::is_same_v<In, NoFeed>) {
    if constexpr (std::is_invocable_v<Body&, State&, const Iteration&>) {
      return body(state, it);
    } else if constexpr (std::is_invocable_v<Body&, State&>) {
      return body(state);
    } else {
      static_assert(kAlwaysFalse<Body>,
                    "loop body without an infeed must be callable as body(State&) or "
                    "body(State&, const bspflow::Iteration&)");
    }
  } else {
    if constexpr (std::is_invocable_v<Body&, State&, In&, const Iteration&>) {
      return body(state, *input, it);
    } else if constexpr (std::is_invocable_v<Body&, State&, In&>) {
      return body(state, *input);
    } else {
      static_assert(kAlwaysFalse<Body>,
                    "loop body with an infeed must be callable as body(State&, In&) or "
                    "body(State&, In&, const bspflow::Iteration&)");
    }
  }
}

// The prefetch buffer of one replica's infeed reader, placed in the device's arena so the
// device's memory budget accounts for it.
template <class T>
class ArenaBuffer {
 public:
  ArenaBuffer(Arena& arena, std::size_t n, const std::string& name) : arena_(&arena), n_(n) {
    void* raw = arena.allocate(n * sizeof(T) + alignof(T), name);
    auto addr = reinterpret_cast<std::uintptr_t>(raw);
    addr = (addr + alignof(T) - 1) / alignof(T) * alignof(T);
    raw_ = raw;
    data_ = reinterpret_cast<T*>(addr);
    std::size_t built = 0;
    try {
      for (; built < n; ++built) new (data_ + built) T();
    } catch (...) {
      for (std::size_t i = 0; i < built; ++i) data_[i].~T();
      arena.release(raw);
      throw;
    }
  }
  ArenaBuffer(const ArenaBuffer&) = delete;
  ArenaBuffer& operator=(const ArenaBuffer&) = delete;
  ~ArenaBuffer() {
    for (std::size_t i = 0; i < n_; ++i) data_[i].~T();
    arena_->release(raw_);
  }
  std::span<T> span() noexcept { return {data_, n_}; }

 private:
  Arena* arena_;
  std::size_t n_;
  void* raw_ = nullptr;
  T* data_ = nullptr;
};

template <class InQ>
struct InfeedSide {  // no infeed
  using Value = NoFeed;
  InfeedSide(InQ*, Device&, std::uint32_t) {}
  bool reuse = false;
  template <bool kMayReuse = false>
  bool try_pop(NoFeed*&) {
    return true;
  }
  bool pop(NoFeed*&, const bspflow::detail::StopFlag*) { return true; }
  bool end_of_data() const { return false; }
  NoFeed* slot() { return nullptr; }
};

template <class T>
struct InfeedSide<InfeedQueue<T>> {
  using Value = T;
  InfeedSide(InfeedQueue<T>* q, Device& device, std::uint32_t replica)
      : buffer(std::make_unique<ArenaBuffer<T>>(
            device.arena(), q->prefetch_depth(),
            "infeed prefetch buffer (replica " + std::to_string(replica) + ")")),
        reader(q->reader(replica, buffer->span())) {}
  template <bool kMayReuse = false>
  bool try_pop(T*& out) {
    out = &value;
    if constexpr (kMayReuse) {
      if (reuse) return true;  // synthetic data: the element read first, every iteration
    }
    return reader->try_pop(value);
  }
  bool pop(T*& out, const bspflow::detail::StopFlag* stop) {
    out = &value;
    return reader->pop(value, stop);
  }
  bool end_of_data() const { return reader->end_of_data(); }
  // Order matters: the reader (which uses the buffer) is destroyed first.
  std::unique_ptr<ArenaBuffer<T>> buffer;
  std::optional<typename InfeedQueue<T>::Reader> reader;
  T value{};
  bool reuse = false;
};

template <class OutQ>
struct OutfeedSide {  // no outfeed
  template <bool kMeasure, class V>
  bool write(std::uint64_t, V&&, const bspflow::detail::StopFlag*, std::size_t&) {
    return true;
  }
  OutputMode mode() const noexcept { return OutputMode::all(); }
  bool flush(const bspflow::detail::StopFlag*) { return true; }
  void finish(bool, const bspflow::detail::StopFlag*) {}
};

template <class T>
struct OutfeedSide<OutfeedQueue<T>> {
  OutfeedSide(typename OutfeedQueue<T>::Writer w, OutputMode m) : writer(std::move(w)), out_mode(m) {}
  // kMeasure (a loop with a LoopConfig): sets `bytes` to the output's host bytes.
  template <bool kMeasure, class V>
  bool write(std::uint64_t i, V&& v, const bspflow::detail::StopFlag* stop, std::size_t& bytes) {
    if constexpr (kMeasure) {
      T value(std::forward<V>(v));
      bytes = element_bytes(value);
      return writer.write(i, std::move(value), stop);
    } else {
      return writer.write(i, T(std::forward<V>(v)), stop);
    }
  }
  OutputMode mode() const noexcept { return out_mode; }
  bool flush(const bspflow::detail::StopFlag* stop) { return writer.flush(stop); }
  void finish(bool deliver, const bspflow::detail::StopFlag* stop) { writer.finish(deliver, stop); }
  typename OutfeedQueue<T>::Writer writer;
  OutputMode out_mode;
};

template <class State, class Body, class InQ, class OutQ>
struct Replica {
  Replica(Body b, State s, InfeedSide<InQ> in, OutfeedSide<OutQ> out, std::unique_ptr<ReplicaLink> l)
      : body(std::move(b)), state(std::move(s)), infeed(std::move(in)), outfeed(std::move(out)),
        link(std::move(l)) {}
  Body body;
  State state;
  std::optional<InfeedSide<InQ>> infeed;
  std::optional<OutfeedSide<OutQ>> outfeed;
  std::unique_ptr<ReplicaLink> link;  // null: no LoopConfig, elements move at memory speed
};

// The device-thread side of one replica: every trip of the loop, fused into one function
// the interpreter calls once (program::FusedRepeat). Traced when frame.track is set: the
// wait for input (StreamCopyBegin), taking it (StreamCopyMid, with its modeled copy when the
// loop has a LoopConfig), the body (Compute) and handing the output over (StreamCopyMid, to
// the host).
// kLink: the loop has a LoopConfig (compiled apart, so a loop without one runs exactly the
// code it ran before the host link was modeled).
template <bool kLink, class State, class Body, class InQ, class OutQ>
RunStatus run_trips(Replica<State, Body, InQ, OutQ>& rep, const program::LoopFrame& frame,
                    std::uint32_t device, std::uint32_t replica, std::uint64_t n) {
  using In = typename InfeedSide<InQ>::Value;
  using Clock = std::chrono::steady_clock;
  constexpr bool kHasInfeed = !std::is_same_v<InQ, NoFeed>;
  constexpr bool kHasOutfeed = !std::is_same_v<OutQ, NoFeed>;
  const bspflow::detail::StopFlag* const stop = frame.stop;
  TraceTrack* const track = frame.track;
  // The host link (a LoopConfig): null, or this replica's timeline; synthetic data: none.
  HostLinkTimeline* const link = kLink && !rep.link->synthetic ? &rep.link->timeline : nullptr;
  if constexpr (kLink) rep.link->timeline.start(Clock::now());
  std::size_t last_out_bytes = 0;  // final() and sum(): one copy out when the loop ends
  bool produced = false;
  // The run's end: final() and sum() send their one entry; then the device waits for the
  // output copies still under way (I/O tiles).
  auto copy_final = [&] {
    if constexpr (kHasOutfeed && kLink) {
      if (!link) return;
      const OutputMode::Kind kind = rep.outfeed->mode().kind();
      if (produced && (kind == OutputMode::Kind::kFinal || kind == OutputMode::Kind::kSum)) {
        if (!link->copy_out(last_out_bytes, stop)) return;
      }
      link->finish_out(stop);
    }
  };
  for (std::uint64_t i = 0; i < n; ++i) {
    if (stop->requested()) return RunStatus::kCancelled;
    frame.ctx->iteration = i;
    Clock::time_point t0 = track ? Clock::now() : Clock::time_point{};
    In* input = nullptr;
    bool waited = false;
    if (!rep.infeed->template try_pop<kLink>(input)) {
      // Nothing ready: hand staged outfeed entries to the host before waiting for input.
      if (!rep.outfeed->flush(stop) || !rep.infeed->pop(input, stop)) {
        if (rep.infeed->end_of_data()) {
          copy_final();
          return RunStatus::kEndOfData;
        }
        return RunStatus::kCancelled;
      }
      waited = true;
      if (track) {
        const Clock::time_point t1 = Clock::now();
        track->record(Phase::kStreamCopyBegin, t0, t1);
        t0 = t1;
      }
    }
    std::size_t in_bytes = sizeof(In);
    if constexpr (kHasInfeed && kLink) {
      if (rep.link->synthetic) {
        rep.infeed->reuse = true;  // this element stands for every one of the run
      } else {
        in_bytes = element_bytes(*input);
        if (!link->copy_in(in_bytes, waited, stop)) return RunStatus::kCancelled;
      }
    }
    if (track) {
      const Clock::time_point t1 = Clock::now();
      if constexpr (kHasInfeed) track->record(Phase::kStreamCopyMid, t0, t1, in_bytes);
      t0 = t1;
    }
    const Iteration it{device, replica, i, n};
    if constexpr (kHasOutfeed) {
      using Ret = decltype(call_body(rep.body, rep.state, input, it));
      static_assert(!std::is_void_v<Ret>,
                    "with an outfeed, the loop body must return the iteration's output");
      auto&& out = call_body(rep.body, rep.state, input, it);
      if (track) {
        const Clock::time_point t1 = Clock::now();
        track->record(Phase::kCompute, t0, t1, 0, frame.label);
        t0 = t1;
      }
      std::size_t out_bytes = sizeof(Ret);
      if (!rep.outfeed->template write<kLink>(i, std::forward<decltype(out)>(out), stop, out_bytes)) {
        ++*frame.trips_done;  // the body ran; stopped while waiting for outfeed room
        return RunStatus::kCancelled;
      }
      if constexpr (kLink) {
        produced = true;
        last_out_bytes = out_bytes;
        if (link && rep.outfeed->mode().emits_at(i) && !link->copy_out(out_bytes, stop)) {
          ++*frame.trips_done;
          return RunStatus::kCancelled;
        }
      }
      if (track) track->record(Phase::kStreamCopyMid, t0, Clock::now(), out_bytes, 0, true);
    } else {
      call_body(rep.body, rep.state, input, it);
      if (track) track->record(Phase::kCompute, t0, Clock::now(), 0, frame.label);
    }
    ++*frame.trips_done;
    if (track) track->count_iteration();
  }
  copy_final();
  return RunStatus::kCompleted;
}

// The replica's program: a FusedRepeat that runs the trips and, at the end, delivers the
// outfeed's held results (after a full run or end of data: a partial final()/sum() would be
// mistaken for the real one), releases the feeds and hands the state over.
template <class State, class Body, class InQ, class OutQ>
Program replica_program(RunState<State>& run, Replica<State, Body, InQ, OutQ>& rep,
                        std::uint32_t device, std::uint32_t replica, std::uint64_t n) {
  auto loop = [&rep, device, replica, n](const program::LoopFrame& frame) {
    return rep.link ? run_trips<true>(rep, frame, device, replica, n) : run_trips<false>(rep, frame, device, replica, n);
  };
  auto finish = [&run, &rep, replica](bool deliver) {
    auto release = [&] {
      rep.outfeed.reset();
      rep.infeed.reset();  // releases the lane and the arena buffer
      if (rep.link) {
        const HostLinkTimeline& t = rep.link->timeline;
        run.links[replica] = {t.bytes_in(), t.bytes_out(), t.waited()};
        rep.link.reset();  // releases the I/O tiles
      }
      run.states[replica].emplace(std::move(rep.state));
    };
    try {
      rep.outfeed->finish(deliver, &run.control.stop());
    } catch (...) {
      release();
      throw;
    }
    release();
  };
  return program::FusedRepeat("loop body", n, std::move(loop), std::move(finish));
}

template <class State, class Body, class InQ, class OutQ>
Run<State> launch(const DeviceList& devices, std::uint64_t n, Body body, State init, InQ* infeed,
                  OutQ* outfeed, const LoopConfig* config = nullptr) {
  const std::uint32_t replicas = devices.size();
  if (replicas == 0) throw Error("loops::repeat needs at least one device");
  if (config) config->validate();
  if constexpr (!std::is_same_v<InQ, NoFeed>) {
    if (infeed->replicas() != replicas) {
      throw Error("infeed has " + std::to_string(infeed->replicas()) +
                  " replica lane(s) but the loop runs on " + std::to_string(replicas) +
                  " device(s); each replica needs its own lane (InfeedConfig::replicas = " +
                  std::to_string(replicas) + ")");
    }
  }
  if constexpr (!std::is_same_v<OutQ, NoFeed>) {
    if (outfeed->replicas() != replicas) {
      throw Error("outfeed has " + std::to_string(outfeed->replicas()) +
                  " replica(s) but the loop runs on " + std::to_string(replicas) +
                  " device(s) (OutfeedConfig::replicas = " + std::to_string(replicas) + ")");
    }
    const OutputMode mode = outfeed->mode();
    if (mode.kind() == OutputMode::Kind::kEveryN && mode.n() > n) {
      log(LogLevel::kWarning, "outfeed mode " + mode.to_string() + " with " + std::to_string(n) +
                                  " iterations delivers no entries");
    }
  }

  auto run = std::make_shared<RunState<State>>(replicas, n);
  if (std::string path = bspflow::detail::trace_path_from_env(); !path.empty()) {
    run->trace = std::make_unique<Trace>();
    for (std::uint32_t r = 0; r < replicas; ++r) {
      run->tracks.push_back(&run->trace->add_track("device " + std::to_string(devices[r].id()),
                                                   TraceTrack::Kind::kDevice, r));
    }
    run->trace_path = std::move(path);
  }
  using Rep = Replica<State, Body, InQ, OutQ>;
  std::vector<std::shared_ptr<Rep>> reps;
  reps.reserve(replicas);
  {
    // The links (I/O tiles checked and taken from the arenas) first, then readers (which
    // claim the infeed lanes), then outfeed writers (which attach the run): if anything
    // throws, everything built so far is released again.
    std::vector<std::unique_ptr<ReplicaLink>> links(replicas);
    if (config) {
      std::uint32_t depth = 1;
      if constexpr (!std::is_same_v<InQ, NoFeed>) depth = infeed->prefetch_depth();
      for (std::uint32_t r = 0; r < replicas; ++r) {
        links[r] = std::make_unique<ReplicaLink>(*config, devices[r], r, depth);
      }
    }
    std::vector<std::optional<InfeedSide<InQ>>> ins(replicas);
    for (std::uint32_t r = 0; r < replicas; ++r) ins[r].emplace(infeed, devices[r], r);
    std::vector<OutfeedSide<OutQ>> outs;
    if constexpr (!std::is_same_v<OutQ, NoFeed>) {
      for (auto& w : outfeed->begin_run()) outs.emplace_back(std::move(w), outfeed->mode());
    } else {
      outs.resize(replicas);
    }
    for (std::uint32_t r = 0; r < replicas; ++r) {
      reps.push_back(std::make_shared<Rep>(body, init, std::move(*ins[r]), std::move(outs[r]), std::move(links[r])));
    }
  }
  run->control.set_waker([infeed, outfeed] {
    if constexpr (!std::is_same_v<InQ, NoFeed>) infeed->wake_all();
    if constexpr (!std::is_same_v<OutQ, NoFeed>) outfeed->wake_all();
  });

  for (std::uint32_t r = 0; r < replicas; ++r) {
    Device& device = devices[r];
    std::shared_ptr<Rep> rep = reps[r];
    try {
      device.submit(DeviceJob{
          [run, rep, &device, r, n] {
            const Program program = replica_program(*run, *rep, device.id(), r, n);
            bspflow::detail::run_on_device(device, r, program, run->control, run->track(r));
          },
          [run] { run->control.cancel(); },
      });
    } catch (...) {
      // This device refused the job: stop the replicas already submitted, and finish this
      // one and the rest here so the run still completes.
      run->control.fail(RunControl::Failure{device.id(), r, 0, std::current_exception()});
      for (std::uint32_t k = r; k < replicas; ++k) {
        const Program program = replica_program(*run, *reps[k], devices[k].id(), k, n);
        bspflow::detail::abandon_on_device(devices[k], k, program, run->control);
      }
      break;
    }
  }
  return Run<State>(std::move(run));
}

// Sync calls with a bounded outfeed would deadlock if the run produces more entries than fit
// (nobody reads until the call returns): refuse them up front.
template <class OutQ>
void check_sync_outfeed(const OutQ* outfeed, std::uint64_t n) {
  if constexpr (!std::is_same_v<OutQ, NoFeed>) {
    // kSingle: each replica has a ring of `capacity` entries; kMulti: one queue for all.
    const bool per_replica = outfeed->config().consumer_type == ConsumerType::kSingle;
    const std::uint64_t entries = outfeed->mode().entries_for(n) * (per_replica ? 1 : outfeed->replicas());
    if (outfeed->capacity() != 0 && entries > outfeed->capacity()) {
      throw Error("outfeed capacity " + std::to_string(outfeed->capacity()) +
                  (per_replica ? " per replica" : "") + " < " + std::to_string(entries) +
                  " entries this run delivers" + (per_replica ? " to each replica" : "") +
                  ", and loops::repeat reads nothing until the loop ends: use "
                  "loops::repeat_async and read the outfeed while it runs, or raise the capacity" +
                  (per_replica ? "" : " (0 = unbounded)"));
    }
  }
}

}  // namespace detail

// ---- asynchronous: returns at once with a Run handle ----
//
// Host thread. Does not wait for the loop: it queues one job per device and returns; the
// body runs on the device threads. Allocates (the run's shared state, a copy of the body
// and of the initial state per replica, each replica's infeed prefetch buffer in its
// device's arena). Throws, before anything runs: bspflow::Error if `devices` is empty, a
// feed's replica count differs from devices.size(), an infeed lane already has a reader
// (another loop or a Pipeline is consuming it) or the outfeed is already attached to a
// running loop; OutOfMemoryError (a bspflow::Error) if a device's arena cannot hold its
// prefetch buffer. A body exception, or a device that refuses the job (shutting down), is
// not thrown here: Run::get() throws it as DeviceError. Logs a warning when an every_n
// outfeed would deliver no entry in n iterations.

// body(State&, In&[, const Iteration&]) returns the iteration's output (converted to Out).
template <class State, class Body, class In, class Out>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        InfeedQueue<In>& infeed, OutfeedQueue<Out>& outfeed) {
  return detail::launch(devices, n, std::move(body), std::move(init), &infeed, &outfeed);
}
// body(State&, In&[, const Iteration&]); what it returns is discarded.
template <class State, class Body, class In>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        InfeedQueue<In>& infeed) {
  return detail::launch(devices, n, std::move(body), std::move(init), &infeed,
                        static_cast<detail::NoFeed*>(nullptr));
}
// body(State&[, const Iteration&]) returns the iteration's output (converted to Out).
template <class State, class Body, class Out>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        OutfeedQueue<Out>& outfeed) {
  return detail::launch(devices, n, std::move(body), std::move(init),
                        static_cast<detail::NoFeed*>(nullptr), &outfeed);
}
// body(State&[, const Iteration&]); what it returns is discarded.
template <class State, class Body>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init) {
  return detail::launch(devices, n, std::move(body), std::move(init),
                        static_cast<detail::NoFeed*>(nullptr),
                        static_cast<detail::NoFeed*>(nullptr));
}

// With the device model (LoopConfig): the same three feed shapes, each element crossing the
// modeled host link. Also throws, before anything runs, bspflow::Error if config is invalid
// or its io_tiles are not below a device's tiles, and OutOfMemoryError if a device's arena
// cannot hold its I/O tiles; a device's I/O tiles that cannot hold prefetch_depth elements
// end the run with a DeviceError naming the device, the room and the element's bytes.
template <class State, class Body, class In, class Out>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        InfeedQueue<In>& infeed, OutfeedQueue<Out>& outfeed, const LoopConfig& config) {
  static_assert(detail::kMeasurable<In> && detail::kMeasurable<Out>, "with a LoopConfig, In and Out "
                "need host_bytes(const T&) (found by ADL), or be trivially copyable, or a std::vector of such");
  return detail::launch(devices, n, std::move(body), std::move(init), &infeed, &outfeed, &config);
}
template <class State, class Body, class In>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        InfeedQueue<In>& infeed, const LoopConfig& config) {
  static_assert(detail::kMeasurable<In>, "with a LoopConfig, In needs host_bytes(const In&) (found by "
                "ADL), or be trivially copyable, or a std::vector of such");
  return detail::launch(devices, n, std::move(body), std::move(init), &infeed,
                        static_cast<detail::NoFeed*>(nullptr), &config);
}
template <class State, class Body, class Out>
Run<State> repeat_async(DeviceList devices, std::uint64_t n, Body body, State init,
                        OutfeedQueue<Out>& outfeed, const LoopConfig& config) {
  static_assert(detail::kMeasurable<Out>, "with a LoopConfig, Out needs host_bytes(const Out&) (found by "
                "ADL), or be trivially copyable, or a std::vector of such");
  return detail::launch(devices, n, std::move(body), std::move(init),
                        static_cast<detail::NoFeed*>(nullptr), &outfeed, &config);
}

// ---- synchronous: returns the result when every replica has ended ----
//
// Host thread, not one of `devices`' own (it would wait for a job queued behind itself).
// Blocks (spin, then park) until every replica has ended, so an infeed must already hold
// enough elements (or be closed) or be fed by another thread. Allocates (as
// repeat_async). Throws what repeat_async throws, and, before anything runs,
// bspflow::Error if a bounded outfeed's capacity is below the entries this run delivers
// (nothing reads it until the call returns: use repeat_async and read while it runs, or
// capacity 0); then what Run::get() throws: DeviceError (device, replica, iteration,
// cause) if a replica's body threw. Returns the RepeatResult: kCompleted, kEndOfData or
// kCancelled (a device destroyed mid-run).

// As repeat_async with both feeds; checks the outfeed's capacity first.
template <class State, class Body, class In, class Out>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           InfeedQueue<In>& infeed, OutfeedQueue<Out>& outfeed) {
  detail::check_sync_outfeed(&outfeed, n);
  return repeat_async(devices, n, std::move(body), std::move(init), infeed, outfeed).get();
}
// As repeat_async with an infeed only.
template <class State, class Body, class In>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           InfeedQueue<In>& infeed) {
  return repeat_async(devices, n, std::move(body), std::move(init), infeed).get();
}
// As repeat_async with an outfeed only; checks the outfeed's capacity first.
template <class State, class Body, class Out>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           OutfeedQueue<Out>& outfeed) {
  detail::check_sync_outfeed(&outfeed, n);
  return repeat_async(devices, n, std::move(body), std::move(init), outfeed).get();
}
// As repeat_async without feeds.
template <class State, class Body>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init) {
  return repeat_async(devices, n, std::move(body), std::move(init)).get();
}

// With the device model (LoopConfig), as the repeat_async overloads above.
template <class State, class Body, class In, class Out>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           InfeedQueue<In>& infeed, OutfeedQueue<Out>& outfeed, const LoopConfig& config) {
  detail::check_sync_outfeed(&outfeed, n);
  return repeat_async(devices, n, std::move(body), std::move(init), infeed, outfeed, config).get();
}
template <class State, class Body, class In>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           InfeedQueue<In>& infeed, const LoopConfig& config) {
  return repeat_async(devices, n, std::move(body), std::move(init), infeed, config).get();
}
template <class State, class Body, class Out>
RepeatResult<State> repeat(DeviceList devices, std::uint64_t n, Body body, State init,
                           OutfeedQueue<Out>& outfeed, const LoopConfig& config) {
  detail::check_sync_outfeed(&outfeed, n);
  return repeat_async(devices, n, std::move(body), std::move(init), outfeed, config).get();
}

}  // namespace bspflow::loops
