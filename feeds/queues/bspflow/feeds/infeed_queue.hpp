/// @file
/// `InfeedQueue<T>`: host producers to device replicas (TF-IPU IPUInfeedQueue). One bounded
/// lane per replica; host threads push through Producer handles, and each replica's device
/// takes its lane's elements through a Reader. Guide: feeds/README.md.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait_note.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/stop_flag.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/feeds/detail/bounded_queue.hpp"
#include "bspflow/feeds/detail/spsc_lane.hpp"
#include "bspflow/feeds/push_result.hpp"

namespace bspflow {

/// Who pushes into an infeed: one Producer at a time, or several at once.
enum class ProducerType { kMulti, kSingle };

/// An infeed's shape: its replica lanes, their capacity, the prefetch depth and who pushes.
struct InfeedConfig {
  std::uint32_t replicas = 1;                                      ///< 1..kMaxReplicas
  std::size_t capacity = tunables::kDefaultInfeedCapacity;         ///< per lane, >= prefetch_depth
  std::uint32_t prefetch_depth = tunables::kDefaultPrefetchDepth;  ///< 1..255
  /// kSingle: at most one live Producer (faster lanes); kMulti: any number.
  ProducerType producer_type = ProducerType::kMulti;
  /// Checks every field.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate() const;
};

/// Bounded lanes from host producers to device replicas. Elements one Producer routes to
/// one replica reach it in the order pushed; nothing is promised across producers. close()
/// ends the data: each replica drains what was pushed before, then its reader reports end of
/// data. Elements a Reader took off its lane but did not hand out go back to the lane's front
/// for the next Reader of that replica.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class T>
class InfeedQueue {
  using Lane = detail::BoundedQueue<T>;
  struct LaneSlot;  ///< below; declared here because Reader names it (clang insists)

 public:
  using value_type = T;

  /// Validates the config and allocates the lanes.
  /// Contract: host; non-blocking; allocates; throws Error.
  explicit InfeedQueue(InfeedConfig config = {}) : config_(config) {
    config_.validate();
    lanes_.reserve(config_.replicas);
    for (std::uint32_t r = 0; r < config_.replicas; ++r) {
      lanes_.push_back(std::make_unique<LaneSlot>(config_.capacity, single()));
      lanes_.back()->site = {
          detail::WaitKind::kInfeed, "an element of the infeed's lane " + std::to_string(r),
          [this, r] {
            const std::size_t n = size_approx(r);
            return (n == 0 ? std::string("empty") : std::to_string(n) + " queued") +
                   (closed() ? ", closed" : ", not closed");
          }};
    }
  }
  InfeedQueue(const InfeedQueue&) = delete;
  InfeedQueue& operator=(const InfeedQueue&) = delete;

  /// A host producer's handle. One per producing thread; a Producer itself is not
  /// thread-safe. Must not outlive its queue. A push into a ProducerType::kMulti lane
  /// allocates a queue block when the lane's preallocated ones are in use; a kSingle lane
  /// never allocates.
  /// Contract of every member: producer; non-blocking; no-alloc; noexcept, unless tagged.
  class Producer {
   public:
    /// Pushes into the next replica's lane (round-robin), waiting while it is full. Returns
    /// false (nothing pushed) once the queue is closed.
    /// Contract: producer; blocks; allocates; throws bad_alloc.
    bool push(T value) { return push_to(next_replica(), std::move(value)); }

    /// kOk: pushed (moved from value). kFull / kClosed: value untouched, and the
    /// round-robin position stays, so a retry targets the same replica.
    /// Contract: producer; non-blocking; allocates; throws bad_alloc.
    PushResult try_push(T&& value) {
      LaneSlot& l = *queue_->lanes_[cursor_];
      const PushResult r = l.spsc ? l.spsc->try_push(std::move(value))
                                  : l.mpmc->try_push(tokens_[cursor_], std::move(value));
      if (r == PushResult::kOk) advance();
      return r;
    }

    /// Explicit routing: pushes into `replica`'s lane, waiting while it is full; false once
    /// closed. Throws bspflow::Error for a replica out of range.
    /// Contract: producer; blocks; allocates; throws Error.
    bool push_to(std::uint32_t replica, T value) {
      check_replica(replica);
      LaneSlot& l = *queue_->lanes_[replica];
      return l.spsc ? l.spsc->push(std::move(value))
                    : l.mpmc->push(tokens_[replica], std::move(value));
    }

    /// Moves `values` into one replica's lane in order, in bulk (far cheaper per element
    /// than push), waiting while the lane is full. Returns how many were pushed (fewer once
    /// closed). Throws bspflow::Error for a replica out of range.
    /// Contract: producer; blocks; allocates; throws Error.
    std::size_t push_bulk(std::uint32_t replica, std::span<T> values) {
      check_replica(replica);
      LaneSlot& l = *queue_->lanes_[replica];
      return l.spsc ? l.spsc->push_bulk(values.begin(), values.size())
                    : l.mpmc->push_bulk(tokens_[replica], values.begin(), values.size());
    }

    /// The replica lanes of the infeed this producer pushes into.
    std::uint32_t replicas() const noexcept { return queue_->replicas(); }

    /// Takes over `o`'s place as a producer; `o` is left without a queue.
    Producer(Producer&& o) noexcept
        : queue_(std::exchange(o.queue_, nullptr)), tokens_(std::move(o.tokens_)),
          cursor_(o.cursor_) {}
    Producer& operator=(Producer&&) = delete;
    /// A single-producer queue accepts a new Producer once this one is gone.
    ~Producer() {
      if (queue_ != nullptr && queue_->single())
        queue_->producer_live_.store(false, std::memory_order_release);
    }

   private:
    friend class InfeedQueue;
    /// The replica push() targets: the round-robin position, then advances it.
    std::uint32_t next_replica() noexcept {
      const std::uint32_t r = cursor_;
      advance();
      return r;
    }
    explicit Producer(InfeedQueue& q) : queue_(&q) {
      if (q.single()) {
        if (q.producer_live_.exchange(true, std::memory_order_acq_rel)) {
          throw Error(
              "this infeed takes one producer at a time (InfeedConfig::producer_type = "
              "ProducerType::kSingle) and already has one: keep using it, destroy it "
              "first, or configure ProducerType::kMulti");
        }
        return;
      }
      tokens_.reserve(q.replicas());
      for (std::uint32_t r = 0; r < q.replicas(); ++r)
        tokens_.push_back(q.lanes_[r]->mpmc->make_token());
    }
    void advance() noexcept { cursor_ = cursor_ + 1 == queue_->replicas() ? 0 : cursor_ + 1; }
    void check_replica(std::uint32_t replica) const {
      if (replica >= queue_->replicas()) {
        detail::throw_bad_value(
            "replica", replica,
            "must be below the infeed's replica count " + std::to_string(queue_->replicas()));
      }
    }

    InfeedQueue* queue_;
    std::vector<typename Lane::Token> tokens_;  ///< kMulti: one per lane
    std::uint32_t cursor_ = 0;
  };

  /// A new Producer (with ProducerType::kMulti, it allocates its producer tokens). Throws
  /// bspflow::Error with ProducerType::kSingle while another Producer is live.
  /// Contract: any; non-blocking; allocates; throws Error.
  Producer make_producer() { return Producer(*this); }

  /// The device side of one replica's lane. Holds the prefetch buffer: up to prefetch_depth
  /// elements moved off the lane in one bulk dequeue, ahead of use. Only one Reader per lane
  /// exists at a time; it is used by one thread (the replica's device thread).
  /// Contract of every member: device; non-blocking; no-alloc; noexcept, unless tagged.
  class Reader {
   public:
    /// Takes over `other`'s lane and prefetch buffer; `other` is left without a lane.
    Reader(Reader&& other) noexcept
        : lane_(std::exchange(other.lane_, nullptr)), owned_(std::move(other.owned_)),
          buffer_(other.buffer_), pos_(other.pos_), count_(other.count_),
          end_of_data_(other.end_of_data_), returned_(std::move(other.returned_)) {}
    Reader& operator=(Reader&&) = delete;
    /// Hands elements prefetched but not popped (and any put_back()) back to the lane's
    /// front, for the next Reader of this replica.
    /// Contract: device; non-blocking; allocates; noexcept.
    ~Reader() {
      if (lane_ == nullptr) return;
      auto& carry = lane_->carry;
      for (std::size_t i = count_; i > pos_; --i) carry.push_front(std::move(buffer_[i - 1]));
      for (auto it = returned_.rbegin(); it != returned_.rend(); ++it) {
        carry.push_front(std::move(*it));
      }
      lane_->reader_active.store(false, std::memory_order_release);
    }

    /// Gives back an element it popped but did not use (a prefetch that arrived after its
    /// loop ended); returned elements go back to the lane's front in the order they were put
    /// back, ahead of anything still prefetched.
    /// Contract: device; non-blocking; allocates; throws bad_alloc.
    void put_back(T&& value) { returned_.push_back(std::move(value)); }

    /// True when the lane is closed and nothing is left for this reader (what pop() reports
    /// as end of data).
    bool at_end() const noexcept {
      return pos_ == count_ && lane_->carry.empty() && lane_->drained();
    }

    /// Moves the next element into `out`, waiting while the lane is empty as `policy` says
    /// (null: spin, then park). Returns false at end of data (closed and drained:
    /// end_of_data() is then true) or when `stop` is set. Throws only what T's move
    /// assignment throws: noexcept when it is.
    /// Contract: device; blocks; no-alloc; noexcept.
    bool pop(T& out, const StopFlag* stop = nullptr, const WaitPolicy* policy = nullptr) noexcept(
        noexcept(std::declval<T&>() = std::declval<T&&>())) {
      if (pos_ == count_ && !refilled_from_carry() && !refilled(wait_for_more(stop, policy))) {
        end_of_data_ = lane_->drained();
        return false;
      }
      out = std::move(buffer_[pos_++]);
      return true;
    }

    /// Moves the next element into `out` if one is ready (in the prefetch buffer or on the
    /// lane) and returns true; else false. Throws only what T's move assignment throws, as
    /// pop().
    bool try_pop(T& out) noexcept(noexcept(std::declval<T&>() = std::declval<T&&>())) {
      if (pos_ == count_ && !refilled_from_carry() &&
          !refilled(lane_->try_pop_bulk(buffer_.data(), buffer_.size()))) {
        return false;
      }
      out = std::move(buffer_[pos_++]);
      return true;
    }

    /// Whether the last pop() returned false because the lane was closed and drained.
    bool end_of_data() const noexcept { return end_of_data_; }
    /// Elements already moved off the lane into the prefetch buffer, not yet popped.
    std::size_t prefetched() const noexcept { return count_ - pos_; }

   private:
    friend class InfeedQueue;
    /// pop()'s slow path: the prefetch buffer is empty, so the device waits on the lane (its
    /// stall check's record says so while it does).
    std::size_t wait_for_more(const StopFlag* stop, const WaitPolicy* policy) {
      const detail::WaitMark mark(&lane_->site);
      return lane_->pop_bulk(buffer_.data(), buffer_.size(), stop, policy);
    }
    /// The prefetch buffer now holds n fresh elements; false if n is 0.
    bool refilled(std::size_t n) noexcept {
      count_ = n;
      pos_ = 0;
      return n != 0;
    }
    /// Serves what an earlier Reader left (see ~Reader) before anything on the lane.
    bool refilled_from_carry() {
      auto& carry = lane_->carry;
      if (carry.empty()) return false;
      std::size_t n = 0;
      for (; n < buffer_.size() && !carry.empty(); ++n) {
        buffer_[n] = std::move(carry.front());
        carry.pop_front();
      }
      return refilled(n);
    }
    Reader(LaneSlot& lane, std::span<T> buffer, std::unique_ptr<T[]> owned)
        : lane_(&lane), owned_(std::move(owned)), buffer_(buffer) {}

    LaneSlot* lane_;
    std::unique_ptr<T[]> owned_;
    std::span<T> buffer_;
    std::size_t pos_ = 0;
    std::size_t count_ = 0;
    bool end_of_data_ = false;
    std::vector<T> returned_;
  };

  /// The reader for `replica`, with a prefetch buffer in `buffer` (which must hold exactly
  /// prefetch_depth() constructed elements and outlive the reader) or, if empty, one it
  /// allocates. Throws bspflow::Error if the replica is out of range or its lane already has
  /// a reader.
  /// Contract: any; non-blocking; allocates; throws Error.
  Reader reader(std::uint32_t replica, std::span<T> buffer = {}) {
    if (replica >= replicas()) {
      detail::throw_bad_value(
          "replica", replica,
          "must be below the infeed's replica count " + std::to_string(replicas()));
    }
    if (!buffer.empty() && buffer.size() != config_.prefetch_depth) {
      detail::throw_bad_value(
          "prefetch buffer size", buffer.size(),
          "must equal prefetch_depth " + std::to_string(config_.prefetch_depth));
    }
    LaneSlot& slot = *lanes_[replica];
    if (slot.reader_active.exchange(true, std::memory_order_acq_rel)) {
      throw Error("infeed lane of replica " + std::to_string(replica) +
                  " already has a reader: one loop at a time may consume a replica's lane");
    }
    std::unique_ptr<T[]> owned;
    if (buffer.empty()) {
      owned = std::make_unique<T[]>(config_.prefetch_depth);
      buffer = std::span<T>(owned.get(), config_.prefetch_depth);
    }
    return Reader(slot, buffer, std::move(owned));
  }

  /// End of data (see the class comment). Idempotent. With ProducerType::kSingle it waits
  /// for a push in progress to finish, so that push is either refused or delivered.
  /// Contract: any; blocks; no-alloc; noexcept.
  void close() noexcept {
    for (auto& l : lanes_) l->spsc ? l->spsc->close() : l->mpmc->close();
  }
  /// Whether close() has been called.
  bool closed() const noexcept {
    const LaneSlot& l = *lanes_.front();
    return l.spsc ? l.spsc->is_closed() : l.mpmc->is_closed();
  }

  /// Wakes parked readers and producers so they re-check their stop flags.
  void wake_all() noexcept {
    for (auto& l : lanes_) l->spsc ? l->spsc->wake_all() : l->mpmc->wake_all();
  }

  /// The replica lanes (InfeedConfig::replicas).
  std::uint32_t replicas() const noexcept { return config_.replicas; }
  /// Elements a reader moves off its lane ahead of use (InfeedConfig::prefetch_depth).
  std::uint32_t prefetch_depth() const noexcept { return config_.prefetch_depth; }
  /// Elements one lane holds at most (InfeedConfig::capacity).
  std::size_t capacity() const noexcept { return config_.capacity; }
  /// The config the infeed was built with.
  const InfeedConfig& config() const noexcept { return config_; }
  /// Elements in a lane (pushed, not yet taken by its reader); approximate while running.
  std::size_t size_approx(std::uint32_t replica) const noexcept {
    const LaneSlot& l = *lanes_[replica];
    return l.spsc ? l.spsc->size_approx() : l.mpmc->size_approx();
  }
  /// Elements pushed into `replica`'s lane so far.
  std::uint64_t total_pushed(std::uint32_t replica) const noexcept {
    const LaneSlot& l = *lanes_[replica];
    return l.spsc ? l.spsc->total_pushed() : l.mpmc->total_pushed();
  }

 private:
  struct LaneSlot {
    /// kMulti: moodycamel under a bound, single consumer (one Reader at a time, handed over
    /// through reader_active). kSingle: a single-producer ring.
    LaneSlot(std::size_t capacity, bool single_producer) {
      if (single_producer) {
        spsc.emplace(capacity);
      } else {
        mpmc.emplace(capacity, /*single_consumer=*/true);
        consumer.emplace(mpmc->make_consumer_token());
      }
    }
    std::size_t pop_bulk(T* out, std::size_t max, const StopFlag* stop, const WaitPolicy* policy) {
      return spsc ? spsc->pop_bulk(out, max, stop, policy)
                  : mpmc->pop_bulk(out, max, stop, &*consumer, policy);
    }
    std::size_t try_pop_bulk(T* out, std::size_t max) {
      return spsc ? spsc->try_pop_bulk(out, max) : mpmc->try_pop_bulk(out, max, &*consumer);
    }
    bool drained() const noexcept { return spsc ? spsc->drained() : mpmc->drained(); }

    std::optional<detail::SpscLane<T>> spsc;
    std::optional<Lane> mpmc;
    std::optional<typename Lane::ConsumerToken> consumer;  ///< used by the lane's one active Reader
    std::atomic<bool> reader_active{false};
    detail::WaitSite site;  ///< what a device waiting on this lane waits for
    /// Taken off the lane by an earlier Reader and not handed out: the next Reader serves
    /// these first. Touched only by the active Reader (handed over through reader_active).
    std::deque<T> carry;
  };
  bool single() const noexcept { return config_.producer_type == ProducerType::kSingle; }

  InfeedConfig config_;
  std::vector<std::unique_ptr<LaneSlot>> lanes_;
  std::atomic<bool> producer_live_{false};  ///< kSingle: a Producer exists
};

}  // namespace bspflow
