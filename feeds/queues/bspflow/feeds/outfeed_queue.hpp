/// @file
/// `OutfeedQueue<T>`: device replicas to the host (TF-IPU IPUOutfeedQueue), shaped by an
/// OutputMode (`<bspflow/feeds/output_mode.hpp>`). Each entry carries the replica and
/// iteration it came from; the host may read while the loop still runs.
/// Guide: feeds/README.md.
#pragma once

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/detail/tick_clock.hpp"
#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/feeds/detail/bounded_queue.hpp"
#include "bspflow/feeds/detail/spsc_lane.hpp"
#include "bspflow/feeds/output_mode.hpp"

namespace bspflow {

/// Who reads an outfeed: one host thread at a time, or several at once.
enum class ConsumerType { kMulti, kSingle };

/// An outfeed's shape: its replicas, what the host sees of their values, its capacity and who
/// reads.
struct OutfeedConfig {
  std::uint32_t replicas = 1;           ///< 1..kMaxReplicas
  OutputMode mode = OutputMode::all();  ///< what the host sees of each replica's values
  /// Entries (kMulti: in all, 0 = unbounded; kSingle: per replica, 1..kMaxQueueCapacity).
  std::size_t capacity = tunables::kDefaultOutfeedCapacity;
  /// kSingle: one reading thread at a time (faster; needs a capacity); kMulti: any number.
  ConsumerType consumer_type = ConsumerType::kMulti;
  /// Checks every field.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

/// One value a replica wrote to an outfeed, with where it came from.
template <class T>
struct OutfeedEntry {
  std::uint32_t replica = 0;    ///< the replica that wrote it
  std::uint64_t iteration = 0;  ///< for sum(): the last iteration summed
  T value{};                    ///< what the device wrote (sum(): the sum)
};

namespace detail {

template <class T>
concept PlusAssignable = requires(T& a, const T& b) {
  a += b;
};

template <class T>
concept ElementwiseSummable =
    std::ranges::random_access_range<T> && PlusAssignable<std::ranges::range_value_t<T>>;

template <class T>
inline constexpr bool kSummable = PlusAssignable<T> || ElementwiseSummable<T>;

/// acc += v, element-wise for arrays and vectors of summable elements.
template <class T>
void accumulate(T& acc, const T& v) {
  if constexpr (PlusAssignable<T>) {
    acc += v;
  } else if constexpr (ElementwiseSummable<T>) {
    auto a = std::ranges::begin(acc);
    auto b = std::ranges::begin(v);
    const auto n = std::ranges::size(acc) < std::ranges::size(v) ? std::ranges::size(acc)
                                                                 : std::ranges::size(v);
    for (std::size_t i = 0; i < n; ++i) a[i] += b[i];
  }
}

}  // namespace detail

/// Entries from device replicas to the host. Order: per replica, in iteration order;
/// replicas interleave in no promised order. Entries written before a failure are delivered;
/// a failed replica's final() or sum() value is not (it would be a partial result). Readers
/// are consumers: any number at once with ConsumerType::kMulti, one at a time with kSingle
/// (two caught reading at once get a bspflow::Error).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class T>
class OutfeedQueue {
  using Queue = detail::BoundedQueue<OutfeedEntry<T>>;
  using Lane = detail::SpscLane<OutfeedEntry<T>>;
  /// A run stopped while a bounded outfeed is full still hands over what its devices wrote:
  /// past the capacity. With one reader (kSingle) each replica's ring keeps room for this
  /// many more entries (one write-combining batch and a final()/sum() value; slot counts are
  /// powers of two, so this may double a ring of capacity one; rings above 2^20 entries keep
  /// only the power-of-two slack); a shared queue (kMulti) takes them whatever its capacity.
  static constexpr std::size_t kStoppedSpare = tunables::kOutfeedCombine + 1;
  static constexpr std::size_t spare_slots(std::size_t capacity) noexcept {
    return capacity <= (std::size_t{1} << 20) ? kStoppedSpare : 0;
  }

 public:
  /// One entry: a value and the replica and iteration that wrote it.
  using Entry = OutfeedEntry<T>;
  /// What the outfeed holds: an Entry.
  using value_type = Entry;

  /// Validates the config. A sum() outfeed needs a T with += or an array/vector of such
  /// elements (else it throws bspflow::Error).
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit OutfeedQueue(OutfeedConfig config = {}) : config_(config) {
    config_.validate();
    if (config_.mode.kind() == OutputMode::Kind::kSum && !detail::kSummable<T>) {
      throw Error(
          "OutputMode sum() needs an outfeed type with += or an array/vector of "
          "elements with +=; this type has neither (use all(), final() or every_n)");
    }
    // What a device waiting for room waits for (its stall check's record), per replica.
    room_sites_.reserve(config_.replicas);
    for (std::uint32_t r = 0; r < config_.replicas; ++r) {
      room_sites_.push_back({detail::WaitKind::kOutfeed,
                             single() ? "room in the outfeed's ring of replica " + std::to_string(r)
                                      : std::string("room in the outfeed"),
                             [this, r] {
                               return std::to_string(size_approx(r)) + " of " +
                                      std::to_string(capacity()) + " entries";
                             }});
    }
    spare_staging_.resize(config_.replicas);
    // No run attached yet: reading now ends at once instead of hanging.
    if (single()) {
      lanes_.reserve(config_.replicas);
      for (std::uint32_t r = 0; r < config_.replicas; ++r) {
        lanes_.push_back(
            std::make_unique<Lane>(config_.capacity, &readable_, spare_slots(config_.capacity)));
        lanes_.back()->close_quiescent();
      }
    } else {
      queue_.emplace(config_.capacity);
      queue_->close();
    }
  }
  OutfeedQueue(const OutfeedQueue&) = delete;
  OutfeedQueue& operator=(const OutfeedQueue&) = delete;

  // ---- host side: any thread; several at once with ConsumerType::kMulti only ----

  /// Waits (spin, then park) until an entry is available; nullopt once no run is attached
  /// (or the attached run ended) and every entry was read.
  /// Contract: consumer; blocks; no-alloc; throws Error.
  std::optional<Entry> pop() {
    Entry e;
    if (read(&e, 1, true) == 0) return std::nullopt;
    return e;
  }
  /// The next entry if one is available now; else nullopt.
  /// Contract: consumer; non-blocking; no-alloc; throws Error.
  std::optional<Entry> try_pop() {
    Entry e;
    if (read(&e, 1, false) == 0) return std::nullopt;
    return e;
  }
  /// Every entry available now.
  /// Contract: consumer; non-blocking; allocates; throws Error.
  std::vector<Entry> drain() {
    std::vector<Entry> out;
    for (;;) {
      const std::size_t have = out.size();
      out.resize(have + 64);
      const std::size_t n = read(out.data() + have, 64, false);
      out.resize(have + n);
      if (n == 0) return out;
    }
  }

  /// Range-for over the outfeed: pops until the attached run ends and the queue is empty.
  /// Reads in batches of up to kBatch entries (whatever is available; it never waits for a
  /// full batch), so entries it has taken but not yet yielded are invisible to other readers.
  /// Contract of every member: consumer; non-blocking; no-alloc; noexcept, unless tagged.
  class Iterator {
   public:
    /// The most entries the iterator reads at once.
    static constexpr std::size_t kBatch = 32;
    /// What the iterator yields: an Entry.
    using value_type = Entry;
    /// Distance between iterators, as an input iterator declares it.
    using difference_type = std::ptrdiff_t;
    /// The current entry.
    Entry& operator*() const noexcept { return buffer_[pos_]; }
    /// The current entry's members.
    Entry* operator->() const noexcept { return &buffer_[pos_]; }
    /// The next entry; once the batch is used up, waits for more (until an entry is
    /// available or the run ends).
    /// Contract: consumer; blocks; no-alloc; throws Error.
    Iterator& operator++() {
      if (++pos_ == count_) refill();
      return *this;
    }
    /// As the prefix increment.
    /// Contract: consumer; blocks; no-alloc; throws Error.
    void operator++(int) { ++*this; }
    /// Whether reading is over: the run ended and every entry was read (`it` equals end()).
    friend bool operator==(const Iterator& it, std::default_sentinel_t) { return it.count_ == 0; }

   private:
    friend class OutfeedQueue;
    explicit Iterator(OutfeedQueue* q) : q_(q), buffer_(kBatch) {
      if (q->queue_) consumer_.emplace(q->queue_->make_consumer_token());
      refill();
    }
    void refill() {
      pos_ = 0;
      count_ = q_->read(buffer_.data(), kBatch, true, consumer_ ? &*consumer_ : nullptr);
    }
    OutfeedQueue* q_;
    std::optional<typename Queue::ConsumerToken> consumer_;  ///< kMulti
    mutable std::vector<Entry> buffer_;
    std::size_t pos_ = 0;
    std::size_t count_ = 0;
  };
  /// An iterator at the first entry: waits for it as pop() does.
  /// Contract: consumer; blocks; allocates; throws Error.
  Iterator begin() { return Iterator(this); }
  /// The end of the entries.
  std::default_sentinel_t end() const noexcept { return {}; }

  /// A run is attached and at least one of its replicas has not finished.
  bool running() const noexcept { return active_writers_.load(std::memory_order_acquire) != 0; }
  /// Entries handed to the host and not yet read, all replicas. Approximate while a run
  /// writes or a host thread reads.
  std::size_t size_approx() const noexcept {
    if (queue_) return queue_->size_approx();
    std::size_t n = 0;
    for (const auto& lane : lanes_) n += lane->size_approx();
    return n;
  }
  /// What counts against the capacity for `replica`'s writes: with ConsumerType::kSingle the
  /// entries in that replica's ring, with kMulti in the whole shared queue (as
  /// size_approx()). Approximate while a run writes or a host thread reads. kSingle:
  /// `replica < replicas()`.
  std::size_t size_approx(std::uint32_t replica) const noexcept {
    return queue_ ? queue_->size_approx() : lanes_[replica]->size_approx();
  }

  // ---- device side ----

  /// One replica's writer for one run. Used by that replica's device thread only. Handing
  /// entries over to a ConsumerType::kMulti outfeed allocates a queue block when the shared
  /// queue outgrows its preallocated ones; kSingle rings never allocate.
  class Writer {
   public:
    /// Takes over `o`'s part of the run; `o` is left with none.
    /// Contract: any; non-blocking; no-alloc; noexcept.
    Writer(Writer&& o) noexcept
        : q_(std::exchange(o.q_, nullptr)), replica_(o.replica_), lane_(o.lane_),
          token_(std::move(o.token_)), staged_(std::move(o.staged_)), dropped_(o.dropped_),
          rate_(o.rate_), below_ticks_(o.below_ticks_), last_check_(o.last_check_),
          since_check_(o.since_check_), check_every_(o.check_every_), held_(std::move(o.held_)),
          graveyard_(o.graveyard_) {}
    Writer& operator=(Writer&&) = delete;
    /// Ends this replica's part of the run as finish(false) does, if finish() was not called
    /// (waiting while a bounded outfeed is full).
    /// Contract: device; blocks; allocates; noexcept.
    ~Writer() {
      if (q_ != nullptr) finish(false);
    }

    /// Applies the output mode to iteration `i`'s value. Entries of fast iterations are
    /// staged and handed over in bulk (see tunables::kOutfeedCombine). Waits while a bounded
    /// outfeed is full, until `stop` is set (see flush()); returns false only if entries were
    /// dropped. The caller checks `stop` itself.
    /// Contract: device; blocks; allocates; throws bad_alloc.
    bool write(std::uint64_t i, T&& value, const StopFlag* stop = nullptr) {
      const OutputMode mode = q_->config_.mode;
      if (mode.emits_at(i)) {
        staged_.push_back(Entry{replica_, i, std::move(value)});
        if (staged_.size() >= tunables::kOutfeedCombine) return flush(stop);
        // The clock is read every kOutfeedClockEvery entries while iterations are fast (it
        // costs as much as a fast iteration), and every entry once they are not. It is the
        // tick clock (detail/tick_clock.hpp): a third of steady_clock's cost here.
        if (++since_check_ < check_every_) return true;
        const std::uint64_t now = detail::ticks_now(*rate_);
        const bool fast = now - last_check_ < since_check_ * below_ticks_;
        last_check_ = now;
        since_check_ = 0;
        check_every_ = fast ? tunables::kOutfeedClockEvery : 1;
        return fast || flush(stop);
      }
      if (mode.kind() == OutputMode::Kind::kFinal) {
        held_ = Entry{replica_, i, std::move(value)};
      } else if (mode.kind() == OutputMode::Kind::kSum) {
        if constexpr (detail::kSummable<T>) {
          if (held_) {
            detail::accumulate(held_->value, value);
            held_->iteration = i;
          } else {
            held_ = Entry{replica_, i, std::move(value)};
          }
        }
      }
      return true;
    }

    /// Hands every staged entry to the host now (the runtime calls it before the device
    /// waits for input). Waits while a bounded outfeed is full, until `stop` is set: then
    /// what the device has written still goes in, past the capacity (at most kStoppedSpare
    /// per replica per stopped run). Returns false only if entries were dropped (dropped()).
    /// Contract: device; blocks; allocates; throws bad_alloc.
    bool flush(const StopFlag* stop = nullptr) {
      if (staged_.empty()) return true;
      const std::size_t n = staged_.size();
      const detail::WaitSite* site = &q_->room_sites_[replica_];
      const std::size_t pushed =
          lane_ != nullptr ? lane_->push_bulk(staged_.begin(), n, stop, site)
                           : q_->queue_->push_bulk(*token_, staged_.begin(), n, stop, site);
      if (pushed != n) [[unlikely]]
        return keep_stopped(pushed) == n;
      staged_.clear();
      return true;
    }

    /// Entries dropped: written, never handed to the host, because the stop found the
    /// outfeed full and its spare room (kStoppedSpare) too (a reader that stopped for several
    /// runs in a row).
    /// Contract: device; non-blocking; no-alloc; noexcept.
    std::uint64_t dropped() const noexcept { return dropped_; }
    /// From now on the entries this writer drops (see dropped()) are moved into `*to`, in the
    /// order written, instead of being destroyed, so the caller can tell which ones they were
    /// (a stream counts the error responses among them); null (the default): destroyed.
    /// `*to` must outlive the writer's use; only the dropping call (a write, flush or finish
    /// after a stop) touches it.
    /// Contract: device; non-blocking; no-alloc; noexcept.
    void keep_dropped(std::vector<Entry>* to) noexcept { graveyard_ = to; }

    /// Ends this replica's part of the run, delivering the final()/sum() value when
    /// `deliver_held` (false after a failure: a partial sum is no result). Waits as flush()
    /// does. The last writer of the run to finish ends it, which ends the host's range-for.
    /// Contract: device; blocks; allocates; throws bad_alloc.
    void finish(bool deliver_held, const StopFlag* stop = nullptr) {
      if (q_ == nullptr) return;
      flush(stop);
      if (deliver_held && held_) deliver(std::move(*held_), stop);
      held_.reset();
      OutfeedQueue* q = std::exchange(q_, nullptr);
      staged_.clear();  // kept for the next run (before the countdown begin_run() waits on)
      q->spare_staging_[replica_] = std::move(staged_);
      // The last writer ends the run for the readers, after the count reached 0: a reader
      // that saw the end also sees running() false (and may attach the next run at once).
      // No other writer pushes any more (each one's countdown released its last push to us), so
      // it may close their rings too, without the fence a close racing a push needs.
      if (q->active_writers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        if (q->queue_) q->queue_->close();
        for (auto& lane : q->lanes_) lane->close_quiescent();
      }
    }

   private:
    friend class OutfeedQueue;
    Writer(OutfeedQueue& q, std::uint32_t replica) : q_(&q), replica_(replica) {
      if (q.queue_) {
        token_.emplace(q.queue_->make_token());
      } else {
        lane_ = q.lanes_[replica].get();
      }
      staged_ = std::move(q.spare_staging_[replica]);  // the last run's, its room kept
      staged_.reserve(tunables::kOutfeedCombine);
    }
    /// The stopped path of flush() and deliver(), out of line (the write path stays small
    /// enough to be inlined into a device's loop). Hands
    /// staged_[pushed..] over past the bound and empties staged_; returns how many of its entries
    /// are now with the host.
    [[gnu::noinline, gnu::cold]] std::size_t keep_stopped(std::size_t pushed) {
      const std::size_t n = staged_.size();
      const auto rest = staged_.begin() + static_cast<std::ptrdiff_t>(pushed);
      const std::size_t kept =
          pushed + (lane_ != nullptr ? lane_->push_bulk_spare(rest, n - pushed)
                                     : q_->queue_->push_bulk_past_bound(*token_, rest, n - pushed));
      dropped_ += n - kept;
      if (graveyard_ != nullptr) {
        // (insert: one more push_back caller stopped GCC inlining it in write(): -15%.)
        graveyard_->insert(
            graveyard_->end(),
            std::make_move_iterator(staged_.begin() + static_cast<std::ptrdiff_t>(kept)),
            std::make_move_iterator(staged_.end()));
      }
      staged_.clear();
      return kept;
    }
    /// (Not through flush(): a third caller stopped GCC inlining flush() in write(): -15%.)
    bool deliver(Entry&& e, const StopFlag* stop) {
      const detail::WaitSite* site = &q_->room_sites_[replica_];
      if (lane_ != nullptr ? lane_->push(std::move(e), stop, site)
                           : q_->queue_->push(*token_, std::move(e), stop, site)) {
        return true;
      }
      // A refused push leaves the value untouched.
      staged_.push_back(std::move(e));  // NOLINT(bugprone-use-after-move)
      return keep_stopped(0) == 1;
    }

    OutfeedQueue* q_;
    std::uint32_t replica_;
    Lane* lane_ = nullptr;                        ///< kSingle: this replica's ring
    std::optional<typename Queue::Token> token_;  ///< kMulti: its sub-queue of the shared queue
    std::vector<Entry> staged_;                   ///< write-combining: entries not yet handed over
    std::uint64_t dropped_ = 0;                   ///< staged entries a stop kept from the host
    const detail::TickRate* rate_ = &detail::tick_rate();
    /// kOutfeedCombineBelow in ticks; last_check_: when the clock was last read (0: never).
    std::uint64_t below_ticks_ = detail::ticks_in(*rate_, tunables::kOutfeedCombineBelow);
    std::uint64_t last_check_ = 0;
    std::uint32_t since_check_ = 0;  ///< entries staged since the clock was last read
    std::uint32_t check_every_ = 1;
    std::optional<Entry> held_;
    std::vector<Entry>* graveyard_ = nullptr;  ///< keep_dropped(): where dropped entries go
  };

  /// Attaches a run and returns one writer per replica (the runtime calls it when it
  /// launches a run). Throws bspflow::Error if a run is already attached.
  /// Contract: host; non-blocking; allocates; throws Error.
  std::vector<Writer> begin_run() {
    std::uint32_t idle = 0;
    if (!active_writers_.compare_exchange_strong(idle, config_.replicas,
                                                 std::memory_order_acq_rel)) {
      throw Error(
          "outfeed is already attached to a running loop; wait for that run to end "
          "or use another OutfeedQueue");
    }
    if (queue_) {
      queue_->reopen();
    } else {
      for (auto& lane : lanes_) lane->reopen();
    }
    std::vector<Writer> writers;
    writers.reserve(config_.replicas);
    for (std::uint32_t r = 0; r < config_.replicas; ++r) writers.push_back(Writer(*this, r));
    return writers;
  }

  /// Wakes parked writers and readers so they re-check their stop flags.
  void wake_all() noexcept {
    if (queue_) queue_->wake_all();
    for (auto& lane : lanes_) lane->wake_all();
  }

  /// The replicas that write (OutfeedConfig::replicas).
  std::uint32_t replicas() const noexcept { return config_.replicas; }
  /// What the host sees of each replica's values (OutfeedConfig::mode).
  OutputMode mode() const noexcept { return config_.mode; }
  /// The capacity in entries (OutfeedConfig::capacity: kMulti in all, kSingle per replica).
  std::size_t capacity() const noexcept { return config_.capacity; }
  /// The config the outfeed was built with.
  const OutfeedConfig& config() const noexcept { return config_; }

 private:
  bool single() const noexcept { return config_.consumer_type == ConsumerType::kSingle; }

  /// Moves up to `max` entries into out[0..); waits for the first one when `block`. 0: none
  /// available (not blocking), or the run ended and everything was read.
  std::size_t read(Entry* out, std::size_t max, bool block,
                   typename Queue::ConsumerToken* ctok = nullptr) {
    if (queue_) {
      return block ? queue_->pop_bulk(out, max, nullptr, ctok)
                   : queue_->try_pop_bulk(out, max, ctok);
    }
    ReaderGuard guard(reading_);
    if (lanes_.size() == 1)
      return block ? lanes_[0]->pop_bulk(out, max) : lanes_[0]->try_pop_bulk(out, max);
    for (;;) {
      if (const std::size_t n = try_lanes(out, max)) return n;
      if (!block) return 0;
      bool ended = true;
      for (const auto& lane : lanes_) ended = ended && lane->drained();
      if (ended) return try_lanes(out, max);
      readable_.wait(
          [&] {
            bool all_sealed = true;
            for (const auto& lane : lanes_) {
              if (lane->has_entries()) return true;
              all_sealed = all_sealed && lane->sealed();
            }
            return all_sealed;
          },
          Spin::kTight, detail::Fence::kAsymmetric);
    }
  }
  /// kSingle, several replicas: the first lane with entries, starting after the last one read.
  std::size_t try_lanes(Entry* out, std::size_t max) {
    for (std::size_t k = 0; k < lanes_.size(); ++k) {
      next_lane_ = next_lane_ + 1 == lanes_.size() ? 0 : next_lane_ + 1;
      if (const std::size_t n = lanes_[next_lane_]->try_pop_bulk(out, max)) return n;
    }
    return 0;
  }
  /// kSingle: catches two threads reading at once (an uncontended exchange on a line only
  /// the reader writes).
  class ReaderGuard {
   public:
    explicit ReaderGuard(std::atomic<bool>& flag) : flag_(flag) {
      if (flag_.exchange(true, std::memory_order_acquire)) {
        throw Error(
            "this outfeed has one reader at a time (OutfeedConfig::consumer_type = "
            "ConsumerType::kSingle) and another thread is reading it now: read it from "
            "one thread at a time, or configure ConsumerType::kMulti");
      }
    }
    ~ReaderGuard() { flag_.store(false, std::memory_order_release); }
    ReaderGuard(const ReaderGuard&) = delete;
    ReaderGuard& operator=(const ReaderGuard&) = delete;

   private:
    std::atomic<bool>& flag_;
  };

  OutfeedConfig config_;
  std::vector<detail::WaitSite> room_sites_;       ///< what a writer waiting for room waits for
  std::optional<Queue> queue_;                     ///< kMulti: one queue shared by every replica
  std::vector<std::unique_ptr<Lane>> lanes_;       ///< kSingle: a ring per replica
  std::vector<std::vector<Entry>> spare_staging_;  ///< per replica: staged_ between runs
  std::atomic<std::uint32_t> active_writers_{0};
  /// kSingle reader state: written by the one reading thread only.
  alignas(tunables::kCacheLine) std::atomic<bool> reading_{false};
  std::size_t next_lane_ = 0;
  detail::WaitPoint readable_;  ///< a replica's ring has entries or was sealed
};

}  // namespace bspflow
