// loops::repeat's machinery, part two: the launch of a run (one replica per device) and how
// a call's feeds are told apart. Not part of the API (see bspflow/loops/repeat.hpp);
// installed because repeat's templates include it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/base/log.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/host_io.hpp"
#include "bspflow/engine/engine.hpp"
#include "bspflow/engine/program.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/loops/detail/repeat_replica.hpp"
#include "bspflow/loops/run.hpp"
#include "bspflow/run/options.hpp"
#include "bspflow/run/stall.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow::loops::detail {

using bspflow::detail::CancelRun;
using bspflow::detail::RunAccess;
using bspflow::detail::RunControl;
using bspflow::detail::RunState;

// The replica's program: a FusedRepeat that runs the trips and, at the end, delivers the
// outfeed's held results (after a full run or end of data: a partial final()/sum() would be
// mistaken for the real one), releases the feeds and hands the state over.
// Both callables capture pointers only (at most 16 bytes, trivially copyable), so their
// std::function keeps them in place instead of on the heap.
// Built on the host thread by launch(), before any device runs: a failure here (it allocates)
// reaches the caller of loops::repeat, not a device thread.
template <class State, class Body, class InQ, class OutQ>
Program replica_program(RunState<State>& run, Replica<State, Body, InQ, OutQ>& rep) {
  auto loop = [r = &rep](const program::LoopFrame& frame) {
    return r->link ? run_trips<true>(*r, frame) : run_trips<false>(*r, frame);
  };
  auto finish = [shared = &run, r = &rep](bool deliver) {
    auto release = [shared, r] {
      r->outfeed.reset();
      r->infeed.reset();  // releases the lane and the arena buffer
      if (r->link) {
        const HostLinkTimeline& t = r->link->timeline;
        shared->links[r->replica] = {t.bytes_in(), t.bytes_out(), t.waited()};
        r->link.reset();  // releases the I/O tiles
      }
      shared->states[r->replica].emplace(std::move(r->state));
    };
    try {
      r->outfeed->finish(deliver, &shared->control.stop());
    } catch (...) {
      release();
      throw;
    }
    release();
  };
  return program::FusedRepeat("loop body", rep.n, std::move(loop), std::move(finish));
}

template <class State, class Body, class InQ, class OutQ>
Run<State> launch(const DeviceList& devices, std::uint64_t n, Body body, State init, InQ* infeed,
                  OutQ* outfeed, const HostIO* config = nullptr, const Work* work = nullptr,
                  const std::stop_token* stop = nullptr, const StallCheck* check = nullptr) {
  const std::uint32_t replicas = devices.size();
  if (replicas == 0) throw Error("loops::repeat needs at least one device");
  if (config) config->validate();
  const StallCheck stall = check != nullptr ? *check : StallCheck{};
  stall.validate();
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

  auto run = std::allocate_shared<RunState<State>>(
      bspflow::detail::CacheLineAllocator<RunState<State>>{}, replicas, n);
  if (std::string path = bspflow::detail::trace_path_from_env(); !path.empty()) {
    run->trace = std::make_unique<Trace>();
    for (std::uint32_t r = 0; r < replicas; ++r) {
      run->tracks.push_back(&run->trace->add_track("device " + std::to_string(devices[r].id()),
                                                   TraceTrack::Kind::kDevice, r));
    }
    run->trace_path = std::move(path);
  }
  using Rep = Replica<State, Body, InQ, OutQ>;
  // What the device jobs run: kept by the run's state, so the host thread frees it with the
  // state (Run::get() or the handle's end), and a device thread frees nothing once its
  // replica has ended. (Each job owned its replica and program before: the device thread
  // freed them just as the host allocated its next launch, and the two threads met on the
  // allocator's lock often enough to park each other, a loop called in a loop.) A job holds
  // only a pointer to it (stored in the std::function itself, no heap block), so the run
  // counts the device threads still touching it (RunControl::attach/detach) instead.
  struct Jobs {
    RunState<State>* run;
    std::vector<std::shared_ptr<Rep>> reps;
    std::vector<Program> programs;
  };
  auto jobs = std::make_shared<Jobs>();
  jobs->run = run.get();
  std::vector<std::shared_ptr<Rep>>& reps = jobs->reps;
  reps.reserve(replicas);
  {
    // The links (I/O tiles checked and taken from the arenas) first, then readers (which
    // claim the infeed lanes), then outfeed writers (which attach the run): if anything
    // throws, everything built so far is released again.
    std::vector<std::unique_ptr<ReplicaLink>> links(replicas);
    if (config) {
      // The I/O tiles move what the infeed's reader prefetches; without an infeed, the
      // HostIO's depth sizes the output buffers.
      std::uint32_t depth = config->prefetch_depth;
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
      reps.push_back(std::make_shared<Rep>(body, init, std::move(*ins[r]), std::move(outs[r]),
                                           std::move(links[r]), devices[r], r, n));
      // The body's modeled time per trip, on the tiles the I/O tiles leave for compute.
      const DeviceModel& model = devices[r].config().model;
      const std::uint32_t tiles = devices[r].config().tiles - (config ? config->io_tiles : 0);
      if (work != nullptr) {
        reps.back()->body_ns = work->declared() ? model.ns(model.compute_cycles(*work, tiles)) : 0;
      }
      if (reps.back()->link) reps.back()->link->timeline.attach(&devices[r].clock(), model);
    }
  }
  // Each replica's program, built here so nothing the device thread does before its run can
  // fail for want of memory (a run whose replica never starts would never end).
  std::vector<Program>& programs = jobs->programs;
  programs.reserve(replicas);
  for (std::uint32_t r = 0; r < replicas; ++r) programs.push_back(replica_program(*run, *reps[r]));
  run->jobs = jobs;
  run->control.set_waker([infeed, outfeed] {
    (void)infeed;  // (one of them is an unused NoFeed* in a loop without that feed)
    (void)outfeed;
    if constexpr (!std::is_same_v<InQ, NoFeed>) infeed->wake_all();
    if constexpr (!std::is_same_v<OutQ, NoFeed>) outfeed->wake_all();
  });
  // The caller's stop, watched from here (after the waker, before any replica starts: a stop
  // already requested cancels now, and every replica ends at its first look, taking nothing).
  std::unique_ptr<std::stop_callback<CancelRun>> on_stop;
  if (stop != nullptr && stop->stop_possible()) {
    on_stop = std::make_unique<std::stop_callback<CancelRun>>(*stop, CancelRun{&run->control});
  }
  if (stall.limit.count() != 0) {  // watched for a stall until the last replica ends
    std::vector<bspflow::detail::WatchedDevice> watched;
    watched.reserve(replicas);
    for (std::uint32_t r = 0; r < replicas; ++r) watched.push_back({devices[r].id(), r, {}});
    run->control.watch(stall, "loops::repeat", std::move(watched));
  }

  for (std::uint32_t r = 0; r < replicas; ++r) {
    Device& device = devices[r];
    run->control.attach();  // the run's memory stays until this job's detach()
    try {
      device.submit(DeviceJob{
          // Raw pointers (no heap block): the run's state, which keeps what the job runs,
          // outlives the job's detach() (~RunState waits for it; the Run handle waits for the
          // run's end before it lets go of the state).
          [j = jobs.get(), r] {
            const Rep& rep = *j->reps[r];
            bspflow::detail::run_on_device(rep.device, r, j->programs[r], j->run->control,
                                           j->run->track(r));
            j->run->control.detach();  // the job's last touch of the run
          },
          // The device calls a job's cancel only under its lock while the job exists.
          [control = &run->control] { control->cancel(); },
      });
    } catch (...) {
      run->control.detach();  // (the job was not queued: it never runs)
      // This device refused the job: stop the replicas already submitted, and finish this
      // one and the rest here so the run still completes.
      run->control.fail(RunControl::Failure{device.id(), r, 0, std::current_exception()});
      for (std::uint32_t k = r; k < replicas; ++k) {
        bspflow::detail::abandon_on_device(devices[k], k, programs[k], run->control);
      }
      break;
    }
  }
  return RunAccess::make(std::move(run), std::move(on_stop));
}

// Sync calls with a bounded outfeed would deadlock if the run produces more entries than fit
// (nobody reads until the call returns), counting those an earlier run left unread: refuse
// them up front.
template <class OutQ>
void check_sync_outfeed(const OutQ* outfeed, std::uint64_t n) {
  if constexpr (!std::is_same_v<OutQ, NoFeed>) {
    const std::uint64_t capacity = outfeed->capacity();
    if (capacity == 0) return;
    // kSingle: each replica has a ring of `capacity` entries; kMulti: one queue for all.
    const bool per_replica = outfeed->config().consumer_type == ConsumerType::kSingle;
    const std::uint64_t entries =
        outfeed->mode().entries_for(n) * (per_replica ? 1 : outfeed->replicas());
    if (entries == 0) return;
    // Already there: the fullest ring (kSingle), or the shared queue.
    std::uint64_t waiting = 0;
    std::uint32_t fullest = 0;
    for (std::uint32_t r = 0; r < (per_replica ? outfeed->replicas() : 1); ++r) {
      const std::uint64_t here = outfeed->size_approx(r);
      if (here > waiting) {
        waiting = here;
        fullest = r;
      }
    }
    if (waiting + entries <= capacity) return;
    const std::string already =
        waiting == 0 ? std::string()
        : per_replica
            ? std::to_string(waiting) + " entries already in replica " + std::to_string(fullest) +
                  "'s ring (unread, from an earlier run) + "
            : std::to_string(waiting) + " entries already in it (unread, from an earlier run) + ";
    throw Error("outfeed capacity " + std::to_string(capacity) +
                (per_replica ? " per replica" : "") + " < " + already + std::to_string(entries) +
                " entries this run delivers" + (per_replica ? " to each replica" : "") +
                ", and loops::repeat reads nothing until the loop ends: " +
                (waiting == 0 ? "" : "read or drain() the outfeed first, ") +
                "use loops::repeat_async and read " + (waiting == 0 ? "the outfeed" : "it") +
                " while it runs, or raise the capacity" + (per_replica ? "" : " (0 = unbounded)"));
  }
}

// ---- the feeds a loops::repeat call names (any of an infeed, an outfeed, a HostIO) ----

template <class T>
inline constexpr bool kIsInfeed = false;
template <class T>
inline constexpr bool kIsInfeed<InfeedQueue<T>> = true;
template <class T>
inline constexpr bool kIsOutfeed = false;
template <class T>
inline constexpr bool kIsOutfeed<OutfeedQueue<T>> = true;
template <class T>
inline constexpr bool kIsHostIO = std::is_same_v<T, HostIO>;
template <class T>
inline constexpr bool kIsWork = std::is_same_v<T, Work>;
template <class T>
inline constexpr bool kIsOptions = std::is_same_v<T, Options>;
template <class T>
inline constexpr bool kIsStopToken = std::is_same_v<T, std::stop_token>;
template <class T>
inline constexpr bool kIsStallCheck = std::is_same_v<T, StallCheck>;

template <class F>
using Bare = std::remove_cvref_t<F>;

// The element type a queue carries.
template <class Q>
struct ElementOf;
template <class T>
struct ElementOf<InfeedQueue<T>> {
  using type = T;
};
template <class T>
struct ElementOf<OutfeedQueue<T>> {
  using type = T;
};

// The first type of Fs... that Pick selects, or NoFeed.
template <template <class> class Pick, class... Fs>
struct FirstOf {
  using type = NoFeed;
};
template <template <class> class Pick, class F, class... Fs>
struct FirstOf<Pick, F, Fs...> {
  using type =
      std::conditional_t<Pick<Bare<F>>::value, Bare<F>, typename FirstOf<Pick, Fs...>::type>;
};
template <class T>
struct PickInfeed : std::bool_constant<kIsInfeed<T>> {};
template <class T>
struct PickOutfeed : std::bool_constant<kIsOutfeed<T>> {};

// The queue types a call names (NoFeed where absent), checked: only feeds and a HostIO,
// each at most once, queues as lvalues (they must outlive the run).
template <class... Fs>
struct Feeds {
  static constexpr int kInfeeds = (0 + ... + int{kIsInfeed<Bare<Fs>>});
  static constexpr int kOutfeeds = (0 + ... + int{kIsOutfeed<Bare<Fs>>});
  static constexpr int kHostIOs = (0 + ... + int{kIsHostIO<Bare<Fs>>});
  static constexpr int kWorks = (0 + ... + int{kIsWork<Bare<Fs>>});
  static constexpr int kOptions = (0 + ... + int{kIsOptions<Bare<Fs>>});
  static constexpr int kStopTokens = (0 + ... + int{kIsStopToken<Bare<Fs>>});
  static constexpr int kStallChecks = (0 + ... + int{kIsStallCheck<Bare<Fs>>});
  static_assert(((kIsInfeed<Bare<Fs>> || kIsOutfeed<Bare<Fs>> || kIsHostIO<Bare<Fs>> ||
                  kIsWork<Bare<Fs>> || kIsOptions<Bare<Fs>> || kIsStopToken<Bare<Fs>> ||
                  kIsStallCheck<Bare<Fs>>)&&...),
                "loops::repeat takes, after the initial state, only feeds: an InfeedQueue<In>&, "
                "an OutfeedQueue<Out>&, a const HostIO& (its host link) or the run's const "
                "Options& (its host_io() and stall_check()), a const Work& (the body's cost per "
                "trip, for the modeled clock), a std::stop_token and a const StallCheck&, each "
                "at most once, in any order");
  static_assert(kWorks <= 1, "loops::repeat takes at most one Work (the body's cost per trip)");
  static_assert(kOptions <= 1, "loops::repeat takes at most one Options");
  static_assert(kHostIOs + kOptions <= 1,
                "loops::repeat takes its host side once: a HostIO or the Options it comes from");
  static_assert(kStallChecks + kOptions <= 1,
                "loops::repeat takes its stall check once: a StallCheck or the Options it "
                "comes from");
  static_assert(kInfeeds <= 1, "loops::repeat takes at most one InfeedQueue");
  static_assert(kOutfeeds <= 1, "loops::repeat takes at most one OutfeedQueue");
  static_assert(kHostIOs <= 1, "loops::repeat takes at most one HostIO");
  static_assert(kStopTokens <= 1, "loops::repeat takes at most one std::stop_token");
  static_assert(kStallChecks <= 1, "loops::repeat takes at most one StallCheck");
  static_assert(((!(kIsInfeed<Bare<Fs>> || kIsOutfeed<Bare<Fs>>) ||
                  std::is_lvalue_reference_v<Fs>)&&...),
                "loops::repeat takes its queues by reference: pass a named InfeedQueue or "
                "OutfeedQueue that outlives the run");
  static_assert(((!(kIsInfeed<Bare<Fs>> || kIsOutfeed<Bare<Fs>>) ||
                  !std::is_const_v<std::remove_reference_t<Fs>>)&&...),
                "loops::repeat reads from and writes to its queues: pass a non-const "
                "InfeedQueue or OutfeedQueue");
  using In = typename FirstOf<PickInfeed, Fs...>::type;
  using Out = typename FirstOf<PickOutfeed, Fs...>::type;
};

// A pointer to the one argument of type Q among fs..., or null.
template <class Q, class F>
Q* pointer_if(F& f) noexcept {
  if constexpr (std::is_same_v<Bare<F>, std::remove_cv_t<Q>>) {
    // Queues come as non-const lvalues; a HostIO and a stop token are only read.
    return const_cast<Q*>(&f);
  } else {
    return nullptr;
  }
}
template <class Q, class... Fs>
Q* find_feed(Fs&... fs) noexcept {
  Q* out = nullptr;
  ((out = out != nullptr ? out : pointer_if<Q>(fs)), ...);
  return out;
}

// loops::repeat_async's body: checks the element types a HostIO measures, then launches.
template <class State, class Body, class... Fs>
Run<State> launch_with(const DeviceList& devices, std::uint64_t n, Body body, State init,
                       Fs&... fs) {
  using F = Feeds<Fs&...>;
  using InQ = typename F::In;
  using OutQ = typename F::Out;
  if constexpr (F::kHostIOs + F::kOptions == 1) {
    if constexpr (!std::is_same_v<InQ, NoFeed>) {
      static_assert(kMeasurable<typename ElementOf<InQ>::type>,
                    "with a HostIO, the infeed's element needs host_bytes(const T&) (found by "
                    "ADL), or to be trivially copyable, or a std::vector of such");
    }
    if constexpr (!std::is_same_v<OutQ, NoFeed>) {
      static_assert(kMeasurable<typename ElementOf<OutQ>::type>,
                    "with a HostIO, the outfeed's element needs host_bytes(const T&) (found by "
                    "ADL), or to be trivially copyable, or a std::vector of such");
    }
  }
  const HostIO* io = find_feed<const HostIO>(fs...);
  const StallCheck* check = find_feed<const StallCheck>(fs...);
  std::optional<HostIO> from_options;
  if (const Options* opts = find_feed<const Options>(fs...)) {
    if (opts->gradient_accumulation() > 1) {
      bspflow::detail::throw_bad_value(
          "loops::repeat: Options gradient_accumulation", opts->gradient_accumulation(),
          "must be 1 for a loop: a loop has no weight update to accumulate for, and a "
          "DataLoader built from these Options feeds gradient_accumulation x device_iterations "
          "micro-batches per step, more than the loop's iterations take (set "
          "gradient_accumulation(1), or run device_iterations x gradient_accumulation "
          "iterations with opts.host_io())");
    }
    from_options = opts->host_io();
    io = &*from_options;
    check = &opts->stall_check();  // (the Options outlive launch(), which copies it)
  }
  return launch(devices, n, std::move(body), std::move(init), find_feed<InQ>(fs...),
                find_feed<OutQ>(fs...), io, find_feed<const Work>(fs...),
                find_feed<const std::stop_token>(fs...), check);
}

}  // namespace bspflow::loops::detail
