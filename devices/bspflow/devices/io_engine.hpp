/// @file
/// IoEngine: the host side of the modeled host links, one thread running a Boost.Asio
/// io_context with a channel per device link; and the deadline waits (wait_until_deadline)
/// that every modeled duration uses. Asio itself is included by io_engine.cpp alone.
/// Guide: devices/README.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bspflow/base/stop_flag.hpp"
#include "bspflow/devices/device_tunables.hpp"

namespace bspflow {

/// The host side of the modeled host links. One thread runs a Boost.Asio io_context; each
/// channel is one device's link. A transfer does its real memcpy on the engine thread, then
/// completes when the link model says it would: a steady_timer wakes the thread shortly before
/// the deadline and it spins the rest (tunables::kTimerMargin), so modeled durations are met
/// to within about a microsecond. Transfers on one channel run one after another, as on one
/// link; channels are independent. A transfer may take longer than modeled if its real copy
/// does: the model is a floor. Public for people who model their own links; its main user is
/// the Engine's interpreter, which times an Engine run's stream copies with it.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class IoEngine {
 public:
  /// The clock transfers are timed on.
  using Clock = std::chrono::steady_clock;

  /// When a transfer ran.
  struct Times {
    Clock::time_point begin;  ///< start() succeeded: the transfer began
    Clock::time_point end;    ///< the modeled duration had passed (or the copy, if longer)
    /// Set when the transfer failed (done() then reports it cancelled): start() threw, or the
    /// engine thread ran out of memory to arm the transfer's timer. Null otherwise.
    std::exception_ptr error{};
  };

  /// What a transfer's start() found.
  enum class Start {
    kGo,    ///< copied: the transfer now takes its modeled time
    kWait,  ///< its data is not there yet: retried after a short, growing interval
    kSkip,  ///< nothing to move (end of data, stopped): completes at once
  };

  /// One transfer: its bytes, its modeled duration and the engine thread's callbacks.
  struct Transfer {
    std::size_t bytes = 0;                ///< what the transfer moves
    std::chrono::nanoseconds modeled{0};  ///< how long the link takes for it, from its start
    /// Engine thread: the real copy (see Start). If it throws, the transfer fails: done() is
    /// called at once, cancelled, with the exception in Times::error.
    std::function<Start()> start;
    /// Engine thread: the transfer ended (cancelled = the engine stopped first, or the transfer
    /// failed (Times::error says why); begin and end are then meaningless). Must not throw.
    /// Every transfer submit() accepted gets exactly one call.
    std::function<void(const Times& times, bool cancelled)> done;
    /// Set by submit(). The link model starts a transfer when it was asked for or when the
    /// link came free, whichever is later (not when the engine thread got round to it), so
    /// the engine's own wake-up latency does not add to modeled time.
    Clock::time_point submitted{};
  };

  /// Starts the engine thread with `channels` independent links (1..4096), pinned to `core`
  /// if given (see pick_core()). `core_shared`: devices run on that core too, so the engine
  /// spins toward a transfer's end only for kTimerMargin (else up to kIoSpinHorizonMax).
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit IoEngine(std::uint32_t channels, std::string name = "I/O engine",
                    std::optional<std::uint32_t> core = std::nullopt, bool core_shared = false);

  /// Where the engine thread should run next to devices on `device_cores`: the lowest of
  /// this process's cores (Topology::instance_cores()) no device uses, or else the first of
  /// them (where the host thread usually waits). nullopt without hwloc. A device spinning to
  /// meet a deadline must not share its core with the engine that ends the transfer. The
  /// first use of the topology discovers it (Topology::get()).
  /// Contract: any; blocks; allocates; throws bad_alloc.
  static std::optional<std::uint32_t> pick_core(const std::vector<std::uint32_t>& device_cores);
  /// Stops the thread and waits until it has returned; transfers not yet finished complete,
  /// on the destroying thread, with cancelled = true.
  /// Contract: host; blocks; no-alloc; noexcept.
  ~IoEngine();  // NOLINT(bugprone-exception-escape): io_engine.cpp says why nothing escapes
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  /// Queues `t` on `channel` (takes a short lock on Asio's queue). Throws bspflow::Error for
  /// a channel out of range; a transfer it did not accept gets no done() call. The engine
  /// thread's own work for an accepted transfer allocates only to arm a timer, and a failure
  /// there ends that transfer (see Times::error), never the engine.
  /// Contract: any; non-blocking; allocates; throws Error.
  void submit(std::uint32_t channel, Transfer t);

  /// If the engine thread sleeps, wakes it and waits (at most kIoWakeWaitMax) until it runs,
  /// so it watches for transfers for a while: call it before transfers come (a run starts),
  /// so the first does not end late by the engine's wake-up, which a VM can stretch to a
  /// millisecond. Returns at once when awake.
  /// Contract: any; blocks; allocates; throws bad_alloc.
  void wake();

  /// How many independent links the engine serves.
  std::uint32_t channels() const noexcept;
  /// The name the engine was given ("I/O engine").
  const std::string& name() const noexcept;
  /// Whether the engine thread's timer slack could be lowered (Linux prctl).
  bool low_timer_slack() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Lowers the calling thread's timer slack to 1 ns (Linux; a no-op elsewhere). Returns
/// whether it could.
/// Contract: any; non-blocking; no-alloc; noexcept.
bool lower_timer_slack() noexcept;

/// Sleeps until kTimerMargin before `deadline` (not at all if that is already past): the
/// first half of meeting a deadline precisely; the caller spins the rest.
/// Contract: any; blocks; no-alloc; noexcept.
void sleep_until_near(std::chrono::steady_clock::time_point deadline) noexcept;

/// Waits until `deadline`: sleeps until kTimerMargin before it, then spins the rest (yielding
/// the core between checks when `yield`: a thread that shares its core). For modeled
/// durations; bounded by the deadline, so it never spins forever. With a `stop` flag it sleeps
/// in slices of at most kModeledWaitSlice and returns false as soon as the flag is set; true:
/// the deadline passed.
/// Contract: any; blocks; no-alloc; noexcept.
bool wait_until_deadline(std::chrono::steady_clock::time_point deadline,
                         const StopFlag* stop = nullptr, bool yield = false) noexcept;

}  // namespace bspflow
