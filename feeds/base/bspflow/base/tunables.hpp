/// @file
/// Every tunable of bspflow in one place, with its limits. Options and configs validate
/// against these; change a default here and it changes everywhere.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace bspflow::tunables {

/// Size of a cache line; hot counters written by different threads sit this far apart.
inline constexpr std::size_t kCacheLine = 64;

/// Prefetch depth: how many elements per replica are moved toward the device ahead of use
/// (TF-IPU's prefetch_depth). The device takes up to this many in one bulk dequeue.
inline constexpr std::uint32_t kMinPrefetchDepth = 1;
/// The largest prefetch depth.
inline constexpr std::uint32_t kMaxPrefetchDepth = 255;
/// The prefetch depth a feed uses unless told otherwise.
inline constexpr std::uint32_t kDefaultPrefetchDepth = 1;

/// Infeed capacity in elements per replica lane. A producer that finds its lane full blocks
/// (push) or gets Full (try_push): memory never grows past capacity per lane.
inline constexpr std::size_t kDefaultInfeedCapacity = 256;
/// The largest capacity of a queue (an infeed lane, an outfeed, a stream hop): 2^30.
inline constexpr std::size_t kMaxQueueCapacity = std::size_t{1} << 30;

/// Outfeed capacity in entries. 0 = unbounded (host memory, as on the IPU, where the host
/// side of an outfeed is a host buffer). Set a bound to give the device backpressure when
/// the host reads while the loop runs.
inline constexpr std::size_t kDefaultOutfeedCapacity = 0;

/// Outfeed write-combining. While iterations take less than kOutfeedCombineBelow each, a
/// device stages its entries instead of enqueueing them, and hands staged entries over in one
/// bulk enqueue when kOutfeedCombine are staged, when iterations get slower, when its infeed
/// has nothing ready (before it would wait), and when the loop ends. Fast loops then touch
/// the host-shared queue once per batch instead of once per entry. The device reads a clock
/// (the tick clock, detail/tick_clock.hpp) once per kOutfeedClockEvery entries while fast,
/// once per entry otherwise, so an entry is held back by at most kOutfeedClockEvery
/// iterations (none while the device waits for input).
inline constexpr std::size_t kOutfeedCombine = 32;
/// Iterations faster than this let a device stage its outfeed entries.
inline constexpr std::chrono::nanoseconds kOutfeedCombineBelow{2'000};
/// While iterations are fast, a device reads the clock once per this many entries.
inline constexpr std::uint32_t kOutfeedClockEvery = 8;

/// A bulk push into a single-producer lane (an infeed's push_bulk, an outfeed's staged
/// entries) publishes its elements at least every kBulkPublishBytes of them (at least one
/// element at a time), so the reader starts on the first ones while the rest are still being
/// copied, instead of waiting for the whole batch. 1 KiB: 128 eight-byte elements, about
/// 0.3 us of copying here; the reader sees one index move per 16 cache lines of data.
inline constexpr std::size_t kBulkPublishBytes = 1024;
/// How many elements of T that is: the part a bulk push publishes at a time (at least one).
template <class T>
inline constexpr std::size_t kBulkPublishElements = kBulkPublishBytes / sizeof(T) > 0
                                                        ? kBulkPublishBytes / sizeof(T)
                                                        : 1;

/// Streams: hand-off ring slots between the devices of a stream (requests in flight between
/// two neighbouring stages), default and limit.
inline constexpr std::size_t kDefaultStreamCapacity = 64;

/// Replicas per feed / devices per group.
inline constexpr std::uint32_t kMaxReplicas = 1024;

/// DataLoader: worker threads (kAsync needs at least one) and steps loaded ahead in kAsync
/// mode (PopTorch's AsynchronousDataAccessor buffer_size, default 3).
inline constexpr std::uint32_t kMaxLoaderWorkers = 256;
/// Steps a kAsync DataLoader loads ahead unless told otherwise.
inline constexpr std::uint32_t kDefaultLoaderBuffer = 3;
/// The most steps a kAsync DataLoader may load ahead.
inline constexpr std::uint32_t kMaxLoaderBuffer = 1024;

/// Waiting: spin this long (with a CPU pause hint) before parking on a futex. Long enough to
/// catch a partner thread that answers within a few microseconds, short enough that a
/// thread sharing its core with another (4 devices on 2 cores) gives the core up quickly.
inline constexpr std::chrono::nanoseconds kSpinBudget{20'000};

/// WaitPolicy (wait_policy.hpp): the longest spin a spin-then-park policy may ask for, and the
/// spin a waiter that shares its core with a host thread the application reserved is capped
/// to, yielding between checks, before it parks (beside devices only, see below).
inline constexpr std::chrono::nanoseconds kMaxSpinBudget{1'000'000'000};
/// The longest spin of a waiter that shares its core with a reserved host thread.
inline constexpr std::chrono::nanoseconds kSharedCoreSpinBudget{5'000};
/// The yielding spin of a waiter whose core is shared by devices only (no host thread): at
/// least this long. Each check gives the core to whichever device has work, so a longer spin
/// costs them a sched_yield per check, not the core; shorter ones made a chain of devices on
/// one core park between the requests of a closed loop and then pay a wake-up (and, with
/// asymmetric fences, a process-wide barrier) per device per request: 4 devices on one core
/// answered in 12 us or in 220 us, at random, with 5 us (stream_bench).
inline constexpr std::chrono::nanoseconds kDeviceSharedSpinBudget{50'000};

/// A device with a core of its own waiting at a BSP sync spins this long before parking. A
/// device idles a whole stage time while a pipeline fills and drains; parking then costs a
/// futex wake on both sides (10-30 us on a VM) on every such cycle. The core is the device's
/// anyway (as an IPU's tiles are), so spinning costs nobody else. Devices that share a core
/// yield instead and park after kSpinBudget.
inline constexpr std::chrono::nanoseconds kSyncSpinBudget{1'000'000};

/// A run's stall check (StallCheck::limit, `<bspflow/run/stall.hpp>`): how long every
/// running device of a loop, Engine or Pipeline run may wait with none of them moving before
/// the run says so. 30 s by default (long enough that a producer that is only slow is not
/// taken for a hang; a serving Pipeline idle on an open infeed says so once per run); 0
/// turns it off. The monitor looks at a run every limit / 4, clamped to 1 ms..1 s.
inline constexpr std::chrono::nanoseconds kDefaultRunStallLimit{30'000'000'000};
/// The shortest stall limit a run accepts, other than 0 (off): 1 ms.
inline constexpr std::chrono::nanoseconds kMinRunStallLimit{1'000'000};
/// The longest stall limit a run accepts: 24 h.
inline constexpr std::chrono::nanoseconds kMaxRunStallLimit{86'400'000'000'000};

}  // namespace bspflow::tunables
