/// @file
/// The device room's tunables, with their limits: an emulated IPU's memory and the timing of
/// its modeled links. (The shared ones, cache line, waiting and queue sizes, are in
/// bspflow/base/tunables.hpp; both are in namespace bspflow::tunables.)
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace bspflow::tunables {

/// Device memory: tiles x bytes per tile (IPU Mk2: 1472 tiles of 624 KiB).
inline constexpr std::uint32_t kDefaultTiles = 1472;
/// The most tiles a device may have.
inline constexpr std::uint32_t kMaxTiles = 1u << 20;
/// Memory per tile unless told otherwise: the Mk2's 624 KiB.
inline constexpr std::size_t kDefaultBytesPerTile = std::size_t{624} * 1024;
/// The most memory a tile may have: 64 MiB.
inline constexpr std::size_t kMaxBytesPerTile = std::size_t{64} << 20;
/// Every arena allocation is rounded up to this many bytes; also the least memory per tile.
inline constexpr std::size_t kArenaAlignment = 64;

/// Modeled durations (the host link, exchange between devices): a thread that must wait until
/// a deadline sleeps (timer slack lowered to 1 ns) until this long before it, then spins the
/// rest. Covers the wake-up latency of a timer on a loaded VM, so a modeled 50 us copy ends
/// within about a microsecond of its deadline; a smaller margin saves CPU and costs accuracy.
inline constexpr std::chrono::nanoseconds kTimerMargin{60'000};
/// A thread waiting out a modeled duration that can be stopped (a device taking a Copy between
/// devices, a RemoteCopy or an AllReduce: wait_until_deadline with a stop flag) sleeps toward
/// the margin in slices of at most this, checking for a stop between them: a cancel is seen
/// within a slice.
inline constexpr std::chrono::nanoseconds kModeledWaitSlice{1'000'000};

/// A device waits out a modeled transfer it takes alone (a Copy between devices, a RemoteCopy,
/// an AllReduce) in real time only when it lasts at least this long: a shorter one ends sooner
/// than the two clock reads that would time it (about 20 ns each on a VM), so waiting would
/// put the real time further from the model than not waiting. The modeled clock counts every
/// transfer in full either way. Host stream copies (HostLinkTimeline) keep a timeline of the
/// link, where short copies add up: a device waits there only once the link's backlog reaches
/// this long.
inline constexpr std::chrono::nanoseconds kShortestRealWait{20};

/// The I/O engine stops relying on its timer and spins toward a transfer's end this long
/// before it at most: the horizon adapts to how late the engine's timer fires on this machine
/// (twice its recent worst lateness plus kTimerMargin), so a VM whose timers wake hundreds of
/// microseconds late still ends copies on time, at the cost of spinning the engine's core
/// (one no device uses) that long. On a core shared with devices it stays at kTimerMargin.
inline constexpr std::chrono::nanoseconds kIoSpinHorizonMax{1'000'000};

/// IoEngine::wake() waits at most this long for a sleeping engine thread to run.
inline constexpr std::chrono::nanoseconds kIoWakeWaitMax{20'000'000};

/// The I/O engine polls an empty infeed for the next prefetch with this interval, doubling up
/// to the maximum (the engine thread serves every device's link, so it must not block).
inline constexpr std::chrono::nanoseconds kIoPollFirst{5'000};
/// The longest interval the I/O engine's polling of an empty infeed doubles up to.
inline constexpr std::chrono::nanoseconds kIoPollMax{200'000};

}  // namespace bspflow::tunables
