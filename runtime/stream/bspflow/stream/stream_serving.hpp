/// @file
/// Serving with a Stream (see stream.hpp and runtime/stream/README.md): a batch stage's
/// configuration and per-item results, and what Stream::stats() reports.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bspflow/stream/histogram.hpp"
#include "bspflow/stream/request.hpp"

namespace bspflow {

/// How a batch stage (StreamBuilder::batch_stage) forms its batches from whatever is waiting.
/// A batch is flushed when it holds max_batch requests, or when nothing more is waiting and
/// waiting longer does not pay: past max_delay after its first request arrived, or (with
/// deadline_aware) when the next request is not expected before the oldest deadline would be
/// missed by waiting. Without deadlines and without max_delay, a batch is whatever is
/// waiting when the device is free (greedy).
struct BatchConfig {
  std::size_t max_batch = 8;  ///< 1..4096 requests per call
  /// The longest the first request of a batch waits for others (from its arrival at the
  /// stage's device, not from the end of the last batch); nullopt: no fixed bound.
  std::optional<std::chrono::nanoseconds> max_delay{};
  /// The batch sizes the model accepts (an IPU graph is compiled for fixed micro-batch
  /// sizes), ascending; a batch is padded up to the next one. Empty: any size 1..max_batch.
  /// Non-empty: max_batch is its last size or smaller. Padding needs a default-constructible
  /// input type; padded outputs are dropped (a caller never sees them).
  std::vector<std::size_t> allowed_sizes{};
  /// Flush early when waiting longer would make the oldest request miss its deadline (from the
  /// stage's own service time per batch size, measured online).
  bool deadline_aware = true;
  /// Checks every field.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
  /// The size a batch of n requests is padded to (n without allowed_sizes).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t padded(std::size_t n) const noexcept;
};

/// One output of a batch stage that may fail single items: a value, or why this item failed
/// (that request is answered with ErrorKind::kStageFailed; the others go on).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class T>
class ItemResult {
 public:
  /// Implicit, like std::optional's. Throws only what T's move constructor throws: noexcept
  /// when it is.
  // NOLINTNEXTLINE(google-explicit-constructor): a batch stage returns plain values
  ItemResult(T value) noexcept(noexcept(T(std::declval<T&&>()))) : value_(std::move(value)) {}
  /// An item that failed, for `why`: its request is answered ErrorKind::kStageFailed.
  // NOLINTNEXTLINE(performance-unnecessary-value-param): a sink, moved from
  static ItemResult failure(std::string why) noexcept {
    ItemResult r;
    r.error_ = std::move(why);
    return r;
  }
  /// Whether it holds a value.
  bool ok() const noexcept { return value_.has_value(); }
  /// The value; only when ok().
  T& value() noexcept { return *value_; }
  /// Why the item failed; empty when ok().
  const std::string& error() const noexcept { return error_; }

 private:
  ItemResult() = default;
  std::optional<T> value_;
  std::string error_;
};

/// How many requests one version of a stage has run, and on how many replicas it serves now
/// (0 once a swap has moved every replica off it and its last call has ended).
struct VersionStats {
  std::uint32_t version = 0;   ///< its number: 1 at build, each Stream::swap() the next
  std::uint32_t replicas = 0;  ///< replicas whose requests it runs (or that still run a call)
  std::uint64_t calls = 0;     ///< calls made by this version (requests, or batches)
};

/// One priority class's share of a generate stage's figures (GenerateStats::by_class).
struct GenerateClassStats {
  std::uint32_t priority = 0;     ///< the class
  HistogramSnapshot ttft_ns;      ///< push to the first output being made, per sequence
  HistogramSnapshot itl_ns;       ///< between two outputs of a sequence being made
  std::uint64_t tokens = 0;       ///< outputs made
  std::uint64_t preemptions = 0;  ///< its sequences moved to host memory
};

/// A generate stage's figures (StageStats::generation), summed over its replicas. Times are
/// taken on the device as each output is made (a client reads it a hand-off later);
/// tokens/s is `tokens` over the time between two reads.
struct GenerateStats {
  std::uint64_t iterations = 0;   ///< iterations run (calls of the step)
  std::uint64_t tokens = 0;       ///< outputs made (each a partial or final response)
  std::uint64_t sequences = 0;    ///< sequences ended (done, failed, cancelled or expired)
  std::uint64_t preemptions = 0;  ///< sequences moved to host memory for want of a block
  std::uint64_t blocks = 0;       ///< the block pools' size
  std::uint64_t blocks_used = 0;  ///< blocks held by sequences now
  std::uint64_t active = 0;       ///< sequences in the active sets now
  std::uint64_t preempted = 0;    ///< sequences waiting in host memory now
  HistogramSnapshot ttft_ns;      ///< time to first output, every class
  HistogramSnapshot itl_ns;       ///< time between outputs, every class
  /// By priority class (StreamConfig::priority_classes of them).
  std::vector<GenerateClassStats> by_class;
};

/// One stage's (graph node's) figures, over all replicas (Stream::stats()).
struct StageStats {
  std::string name;                 ///< the stage's name
  std::uint32_t stage = 0;          ///< index in the stream (the order of the builder's calls)
  std::uint32_t device = 0;         ///< device index within a replica (StreamBuilder's)
  bool batched = false;             ///< a batch stage
  HistogramSnapshot service_ns;     ///< per call: one request, or one batch
  HistogramSnapshot queue_wait_ns;  ///< per request: arrival at the stage's device to its call
  HistogramSnapshot batch_size;     ///< batch stages: requests per call (before padding)
  std::uint64_t calls = 0;          ///< calls made (requests, or batches)
  std::uint64_t padded = 0;         ///< batch stages: padding items added
  std::uint64_t stalls = 0;         ///< times a call outlived StreamConfig::call_stall_limit
  /// A generate stage's iterations, outputs, sequences and blocks (its calls are iterations,
  /// its batch_size the active set); nullopt for other stages.
  std::optional<GenerateStats> generation{};
  /// Its versions while more than one is live (during a swap, until the old one drained),
  /// else its one version.
  std::vector<VersionStats> versions;
};

/// One replica's state.
struct ReplicaStats {
  std::uint32_t replica = 0;    ///< the replica's index
  std::uint64_t taken = 0;      ///< requests its first stage took
  std::uint64_t answered = 0;   ///< responses it delivered
  bool stalled = false;         ///< a stage's call is past call_stall_limit now (takes nothing new)
  bool failed = false;          ///< its runtime failed (takes nothing new)
  bool ejected = false;         ///< out of rotation after consecutive stage failures (Ejection)
  std::uint64_t ejections = 0;  ///< times it was ejected
  bool draining = false;        ///< a rolling swap is swapping it (takes nothing new)
  std::vector<std::size_t> ring_depths;  ///< requests waiting between its devices, hop by hop
};

/// The labels StreamStats::write_openmetrics() and the prometheus-cpp adapter set on their own
/// samples: a user label of one of these names is refused (a sample with a label twice is
/// invalid).
inline constexpr std::array<std::string_view, 8> kStreamMetricLabels{
    "stage", "replica", "outcome", "reason", "hop", "class", "version", "le"};

/// One priority class's figures (StreamStats::by_class).
struct ClassStats {
  std::uint32_t priority = 0;                       ///< the class (0: served first)
  HistogramSnapshot latency_ns;                     ///< push to answer
  std::uint64_t accepted = 0;                       ///< requests admitted
  std::uint64_t answered = 0;                       ///< responses delivered, errors included
  std::uint64_t ok = 0;                             ///< of those, with a value
  std::array<std::uint64_t, kErrorKinds> errors{};  ///< by ErrorKind
  std::array<std::uint64_t, kRefusals> refusals{};  ///< pushes refused, by Refusal
  std::size_t queued = 0;                           ///< admitted, not yet taken by a replica
  std::size_t blocked = 0;  ///< kBlock pushes waiting for a place now (the queue is full)
};

/// What a stream has done so far. Stream::stats() reads it at any time from any thread; the
/// histograms are merged from the device threads' own (snapshots: counts may lag by the
/// requests in flight). Counts are since the Stream was built.
struct StreamStats {
  std::vector<StageStats> stages;                   ///< one per stage, in stream order
  std::vector<ReplicaStats> replicas;               ///< one per replica
  HistogramSnapshot latency_ns;                     ///< push to answer, every response
  std::uint64_t accepted = 0;                       ///< requests admitted
  std::uint64_t answered = 0;                       ///< responses delivered, errors included
  std::uint64_t ok = 0;                             ///< of those, with a value
  std::array<std::uint64_t, kErrorKinds> errors{};  ///< by ErrorKind
  std::array<std::uint64_t, kRefusals> refusals{};  ///< StreamClient pushes refused, by Refusal
  std::size_t queued = 0;                           ///< admitted, not yet taken by a replica
  std::size_t blocked = 0;           ///< kBlock pushes waiting for a place now (the queue is full)
  std::vector<ClassStats> by_class;  ///< one per priority class (the same, by class)
  /// Responses that were errors of kind `k`.
  std::uint64_t errors_of(ErrorKind k) const noexcept {
    return errors[static_cast<std::size_t>(k)];
  }
  /// Pushes refused for reason `r`.
  std::uint64_t refused(Refusal r) const noexcept { return refusals[static_cast<std::size_t>(r)]; }
  std::uint64_t refused() const noexcept;  ///< every reason

  /// Writes the stats as OpenMetrics 1.0 text families named `prefix`_...: counters
  /// (requests and latency by class, responses by class and outcome, refusals by class and
  /// reason, stage stalls, calls by stage and version, replica ejections), gauges (queued by
  /// class, each replica's stalled, ejected and draining, and the ring depth of each hop
  /// between a replica's devices), and histograms (latency by class, service and queue wait by
  /// stage, in seconds; batch size by stage). Labels `labels` are added to every sample. Does
  /// not write `# EOF` (the caller ends the exposition). Throws bspflow::Error on an invalid
  /// prefix or label name, or a label named like one the families set themselves
  /// (kStreamMetricLabels).
  /// Contract: any; non-blocking; allocates; throws Error.
  void write_openmetrics(std::ostream& out, std::string_view prefix = "bspflow_stream",
                         const MetricLabels& labels = {}) const;
  /// Writes the end-to-end latency as an HdrHistogram .hgrm percentile file in microseconds.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  void write_latency_hgrm(std::ostream& out) const;
};

}  // namespace bspflow
