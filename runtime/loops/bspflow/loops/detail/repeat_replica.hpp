// loops::repeat's machinery, part one: one replica of a loop on its device (its feeds' ends,
// its host link, the fused trips the interpreter runs). Not part of the API (see
// bspflow/loops/repeat.hpp); installed because repeat's templates include it.
#pragma once

#include <charconv>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/devices/host_link_timeline.hpp"
#include "bspflow/engine/engine.hpp"
#include "bspflow/engine/program.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/loops/run.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow::loops {

namespace detail {

// How many bytes an element moves over the host link (see loops::repeat).
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
  ReplicaLink(const HostIO& config, Device& device, std::uint32_t replica,
              std::uint32_t prefetch_depth);
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
  ArenaBuffer(Arena& arena, std::size_t n, std::string_view name) : arena_(&arena), n_(n) {
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
  bool pop(NoFeed*&, const bspflow::StopFlag*) { return true; }
  bool end_of_data() const { return false; }
  NoFeed* slot() { return nullptr; }
};

template <class T>
struct InfeedSide<InfeedQueue<T>> {
  using Value = T;
  InfeedSide(InfeedQueue<T>* q, Device& device, std::uint32_t replica)
      : buffer(std::make_unique<ArenaBuffer<T>>(device.arena(), q->prefetch_depth(),
                                                buffer_name(replica).view())),
        reader(q->reader(replica, buffer->span())) {}
  // "infeed prefetch buffer (replica 3)", built without the heap.
  struct Name {
    char text[64];
    std::size_t size;
    std::string_view view() const noexcept { return {text, size}; }
  };
  static Name buffer_name(std::uint32_t replica) noexcept {
    constexpr std::string_view kHead = "infeed prefetch buffer (replica ";
    Name name{};
    kHead.copy(name.text, kHead.size());
    char* end =
        std::to_chars(name.text + kHead.size(), name.text + sizeof(name.text) - 1, replica).ptr;
    *end++ = ')';
    name.size = static_cast<std::size_t>(end - name.text);
    return name;
  }
  template <bool kMayReuse = false>
  bool try_pop(T*& out) {
    out = &value;
    if constexpr (kMayReuse) {
      if (reuse) return true;  // synthetic data: the element read first, every iteration
    }
    return reader->try_pop(value);
  }
  bool pop(T*& out, const bspflow::StopFlag* stop) {
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
  bool write(std::uint64_t, V&&, const bspflow::StopFlag*, std::size_t&) {
    return true;
  }
  OutputMode mode() const noexcept { return OutputMode::all(); }
  bool flush(const bspflow::StopFlag*) { return true; }
  void finish(bool, const bspflow::StopFlag*) {}
};

template <class T>
struct OutfeedSide<OutfeedQueue<T>> {
  OutfeedSide(typename OutfeedQueue<T>::Writer w, OutputMode m)
      : writer(std::move(w)), out_mode(m) {}
  // kMeasure (a loop with a HostIO): sets `bytes` to the output's host bytes.
  template <bool kMeasure, class V>
  bool write(std::uint64_t i, V&& v, const bspflow::StopFlag* stop, std::size_t& bytes) {
    if constexpr (kMeasure) {
      T value(std::forward<V>(v));
      bytes = element_bytes(value);
      return writer.write(i, std::move(value), stop);
    } else {
      return writer.write(i, T(std::forward<V>(v)), stop);
    }
  }
  OutputMode mode() const noexcept { return out_mode; }
  bool flush(const bspflow::StopFlag* stop) { return writer.flush(stop); }
  void finish(bool deliver, const bspflow::StopFlag* stop) { writer.finish(deliver, stop); }
  typename OutfeedQueue<T>::Writer writer;
  OutputMode out_mode;
};

template <class State, class Body, class InQ, class OutQ>
struct Replica {
  Replica(Body b, State s, InfeedSide<InQ> in, OutfeedSide<OutQ> out,
          std::unique_ptr<ReplicaLink> l, Device& dev, std::uint32_t index, std::uint64_t trips)
      : body(std::move(b)), state(std::move(s)), infeed(std::move(in)), outfeed(std::move(out)),
        link(std::move(l)), device(dev), replica(index), n(trips) {}
  Body body;
  State state;
  std::optional<InfeedSide<InQ>> infeed;
  std::optional<OutfeedSide<OutQ>> outfeed;
  std::unique_ptr<ReplicaLink> link;  // null: no HostIO, elements move at memory speed
  // The body's modeled time per trip (ns); < 0: it declared no cost (loops::repeat's Work).
  double body_ns = -1;
  // Where it runs and how far.
  Device& device;
  const std::uint32_t replica;  // its index in the run
  const std::uint64_t n;        // the trips it runs (the loop's count)
};

// A trip's body in modeled time: its declared cost (body_ns >= 0), or one undeclared step.
inline void charge_body(double body_ns, ModeledClock* clock) noexcept {
  if (clock == nullptr) return;
  if (body_ns >= 0) {
    clock->compute(body_ns);
  } else {
    clock->undeclared();
  }
}

// The device-thread side of one replica: every trip of the loop, fused into one function
// the interpreter calls once (program::FusedRepeat). Traced when frame.track is set: the
// wait for input (StreamCopyBegin), taking it (StreamCopyMid, with its modeled copy when the
// loop has a HostIO), the body (Compute) and handing the output over (StreamCopyMid, to
// the host).
// kLink: the loop has a HostIO (compiled apart, so a loop without one runs exactly the
// code it ran before the host link was modeled).
template <bool kLink, class State, class Body, class InQ, class OutQ>
RunStatus run_trips(Replica<State, Body, InQ, OutQ>& rep, const program::LoopFrame& frame) {
  const std::uint32_t device = rep.device.id();
  const std::uint32_t replica = rep.replica;
  const std::uint64_t n = rep.n;
  using In = typename InfeedSide<InQ>::Value;
  using Clock = std::chrono::steady_clock;
  constexpr bool kHasInfeed = !std::is_same_v<InQ, NoFeed>;
  constexpr bool kHasOutfeed = !std::is_same_v<OutQ, NoFeed>;
  const bspflow::StopFlag* const stop = frame.stop;
  TraceTrack* const track = frame.track;
  // The host link (a HostIO): null, or this replica's timeline; synthetic data: none.
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
      charge_body(rep.body_ns, frame.clock);
      if (track) {
        const Clock::time_point t1 = Clock::now();
        track->record(Phase::kCompute, t0, t1, 0, frame.label);
        t0 = t1;
      }
      std::size_t out_bytes = sizeof(Ret);
      if (!rep.outfeed->template write<kLink>(i, std::forward<decltype(out)>(out), stop,
                                              out_bytes)) {
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
      charge_body(rep.body_ns, frame.clock);
      if (track) track->record(Phase::kCompute, t0, Clock::now(), 0, frame.label);
    }
    ++*frame.trips_done;
    if (track) track->count_iteration();
  }
  copy_final();
  return RunStatus::kCompleted;
}

}  // namespace detail
}  // namespace bspflow::loops
