// Internal to streams (installed because the stream templates use it): the admission queue,
// where every StreamClient's request waits for a replica: priority classes, each served
// earliest deadline first, one shared capacity, and the admission policies (block, reject,
// shed, predicted deadlines). Its parts: its lock, and one class's requests.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bspflow/base/detail/wait.hpp"
#include "bspflow/stream/detail/class_picker.hpp"
#include "bspflow/stream/detail/core.hpp"
#include "bspflow/stream/detail/request_state.hpp"
#include "bspflow/stream/detail/responses.hpp"

namespace bspflow::detail {

// The admission queue's lock: held for a few hundred nanoseconds at most, by one client push
// or one device take, so a waiter spins briefly, then yields, and never sleeps on a futex (a
// std::mutex's wake-up is a system call on each side whenever a client and a device meet).
class AdmissionLock {
 public:
  void lock() noexcept {
    for (unsigned spins = 0; held_.exchange(true, std::memory_order_acquire);) {
      while (held_.load(std::memory_order_relaxed)) {
        if (++spins < 128) {
          cpu_relax();
        } else {
          std::this_thread::yield();  // the holder may share this core
        }
      }
    }
  }
  void unlock() noexcept { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// Heap order: the request served later compares less.
template <class In>
struct Later {
  bool operator()(const Queued<In>& a, const Queued<In>& b) const noexcept {
    if (a.meta.deadline != b.meta.deadline) return a.meta.deadline > b.meta.deadline;
    return a.meta.order > b.meta.order;
  }
};

// One class's requests. With earliest-deadline-first, those with a deadline in a heap
// (the earliest on top), served before the others; the others (all of them without
// earliest-deadline-first) in a ring, in push order: O(1) for requests without deadlines.
// Both hold `capacity` from the start, so the steady state allocates nothing.
template <class In>
class ClassQueue {
 public:
  void reserve(std::size_t capacity, bool edf) {
    if (edf) heap_.reserve(capacity);
    ring_.resize(capacity);
  }
  std::size_t size() const noexcept { return heap_.size() + count_; }
  bool empty() const noexcept { return size() == 0; }
  void push(Queued<In>&& e, bool edf) {
    if (edf && e.meta.deadline != kNoDeadline) {
      heap_.push_back(std::move(e));
      std::push_heap(heap_.begin(), heap_.end(), Later<In>{});
    } else {
      ring_[(head_ + count_) % ring_.size()] = std::move(e);
      ++count_;
    }
  }
  // The next one served; the queue must not be empty.
  void pop(Queued<In>& out) {
    if (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), Later<In>{});
      out = std::move(heap_.back());
      heap_.pop_back();
      return;
    }
    out = std::move(ring_[head_]);
    head_ = (head_ + 1) % ring_.size();
    --count_;
  }
  // Element i: the heap's (in heap order), then the ring's (in push order).
  const Queued<In>& at(std::size_t i) const {
    return i < heap_.size() ? heap_[i] : ring_[(head_ + i - heap_.size()) % ring_.size()];
  }
  // The index of the request served last: the ring's newest, else the heap's latest.
  std::size_t latest() const {
    if (count_ > 0) return size() - 1;
    std::size_t last = 0;
    for (std::size_t i = 1; i < heap_.size(); ++i) {
      if (Later<In>{}(heap_[i], heap_[last])) last = i;
    }
    return last;
  }
  // Removes element i (shed).
  void remove(std::size_t i) {
    if (i < heap_.size()) {
      heap_[i] = std::move(heap_.back());
      heap_.pop_back();
      std::make_heap(heap_.begin(), heap_.end(), Later<In>{});
      return;
    }
    // Close the gap in the ring: the later ones move up one place.
    for (std::size_t k = i - heap_.size(); k + 1 < count_; ++k) {
      ring_[(head_ + k) % ring_.size()] = std::move(ring_[(head_ + k + 1) % ring_.size()]);
    }
    ring_[(head_ + count_ - 1) % ring_.size()] = Queued<In>{};
    --count_;
  }

 private:
  std::vector<Queued<In>> heap_;
  std::vector<Queued<In>> ring_;
  std::size_t head_ = 0, count_ = 0;
};

// What a request will need of a generate stage that reads the stream's input and declares
// its requests' lengths, checked at push: `need(&value)` gives its blocks (calling the
// user's length function), and one that needs more than `pool` is refused kTooLarge with
// `describe(&value, need)`.
struct InputSizeCheck {
  std::function<std::size_t(const void*)> need;
  std::size_t pool = 0;
  std::function<std::string(const void*, std::size_t)> describe;
};

// The admission queue of the StreamClients' requests, and the admission policy. One queue
// per priority class (ClassQueue: the earliest deadline first, then push order), sharing one
// capacity. Shared by the Stream and its clients (a client may outlive the Stream): once
// detach()ed it refuses every push without touching the Stream, and detach() waits for the
// pushes already inside.
template <class In>
class AdmissionQueue final : public AdmissionQueueBase {
 public:
  explicit AdmissionQueue(StreamCore& core)
      : core_(&core), capacity_(core.config.admission.queue_capacity),
        classes_(core.config.priority_classes), edf_(core.config.admission.earliest_deadline_first),
        reject_(core.config.admission.policy == AdmissionPolicy::kReject),
        predict_(core.config.admission.predict),
        fast_full_refusal_(classes_ == 1 && core.config.admission.policy != AdmissionPolicy::kShed),
        picker_(core.config.min_share) {
    for (std::uint32_t c = 0; c < classes_; ++c) queue_[c].reserve(capacity_, edf_);
  }

  // Set when the stream is built: the state a request will need (InputSizeCheck).
  void size_check(InputSizeCheck check) { size_check_ = std::move(check); }

  // Client thread. Admits `value` (moved from only if accepted) or says why not.
  Submission push(ClientState& client, std::uint32_t id, std::uint64_t sequence,
                  std::uint64_t outstanding, std::uint32_t priority, In& value, Deadline deadline,
                  bool blocking) {
    Submission s{RequestId{id, sequence}, Refusal::kNone};
    const auto now = StreamClock::now();
    if (deadline != kNoDeadline && deadline <= now) {
      return refuse(s, Refusal::kDeadlinePassed, priority);
    }
    if (size_check_.need) {
      const std::size_t need = size_check_.need(&value);  // the user's length function
      if (need > size_check_.pool) {
        std::lock_guard lock(mutex_);
        if (!open_) return refuse(s, Refusal::kClosed, priority);
        s.reason = std::make_shared<const std::string>(size_check_.describe(&value, need));
        return refuse(s, Refusal::kTooLarge, priority);
      }
    }
    if (outstanding >= client.capacity()) return refuse(s, Refusal::kClientFull, priority);
    // A full queue that this push can neither wait on nor shed from refuses it without the
    // lock, so that a client retrying try_push() does not slow the devices taking from it.
    if (fast_full_refusal_ && (!blocking || reject_) && (deadline == kNoDeadline || !predict_) &&
        count_.load(std::memory_order_acquire) >= capacity_ &&
        open_flag_.load(std::memory_order_acquire)) {
      return refuse(s, Refusal::kQueueFull, priority);
    }
    std::optional<RequestMeta> victim;
    std::unique_lock lock(mutex_);
    if (!open_) return refuse(s, Refusal::kClosed, priority);
    // From here until the end of this call the Stream is in use: detach() waits for it.
    ++inside_;
    struct Leave {
      AdmissionQueue& in;
      std::unique_lock<AdmissionLock>& lock;
      ~Leave() {
        if (!lock.owns_lock()) lock.lock();
        --in.inside_;
      }
    } leave{*this, lock};
    // kBlock, full: this push waits in its class's line (me) for a place promised to it.
    Blocked me;
    me.cls = priority;
    bool waiting = false;
    bool promoted = false;  // leaving the line made another waiter next up: wake it
    for (;;) {
      Refusal r = Refusal::kNone;
      const auto at = waiting ? StreamClock::now() : now;
      if (!open_) {
        r = Refusal::kClosed;
      } else if (waiting && deadline != kNoDeadline && deadline <= at) {
        r = Refusal::kDeadlinePassed;  // it passed while the push waited
      } else {
        r = admit(at, deadline, priority, victim, waiting ? &me : nullptr);
        if (r == Refusal::kNone) break;
        if (r == Refusal::kQueueFull && blocking &&
            core_->config.admission.policy == AdmissionPolicy::kBlock) {
          if (!waiting) {
            waiting = true;
            enlist(me);
          }
          lock.unlock();
          const auto ready = [&] {
            return (next_up_.load(std::memory_order_seq_cst) == &me &&
                    count_.load(std::memory_order_seq_cst) < capacity_) ||
                   !open_flag_.load(std::memory_order_seq_cst);
          };
          if (deadline == kNoDeadline) {
            not_full_.wait(ready);
          } else {
            not_full_.wait_until(ready, deadline);  // then refused kDeadlinePassed
          }
          lock.lock();
          continue;
        }
      }
      if (waiting && delist(me)) {
        lock.unlock();
        not_full_.notify();
      }
      return refuse(s, r, priority);
    }
    if (waiting) promoted = delist(me);
    Queued<In> e;
    e.meta = RequestMeta{s.id, deadline, now, now, &client};
    e.meta.order = order_++;
    e.meta.priority = static_cast<std::uint8_t>(priority);
    e.value.emplace(std::move(value));
    queue_[priority].push(std::move(e), edf_);
    ++size_;
    bump(accepted_[priority]);
    accepted_run_.store(accepted_run_.load(std::memory_order_relaxed) + 1,
                        std::memory_order_relaxed);
    count_.store(size_, std::memory_order_seq_cst);
    StreamCore* core = core_;
    lock.unlock();
    not_empty_.notify();
    if (promoted) not_full_.notify();  // the next waiter may have a place already
    if (victim) {
      core->responder_base->answer_error(*victim, shed_error(*core, *victim, priority), false);
    }
    return s;
  }

  // Device thread: the next request by class (ClassPicker) and, in its class, by deadline.
  // Never blocks long (the queue's mutex).
  bool try_take(Queued<In>& out) {
    if (count_.load(std::memory_order_acquire) == 0) return false;
    {
      std::lock_guard lock(mutex_);
      if (size_ == 0) return false;
      std::uint32_t ready = 0;
      for (std::uint32_t c = 0; c < classes_; ++c) {
        if (!queue_[c].empty()) ready |= 1u << c;
      }
      const std::uint32_t c = picker_.pick(ready);
      picker_.served(c);
      queue_[c].pop(out);
      --size_;
      count_.store(size_, std::memory_order_seq_cst);
    }
    not_full_.notify();
    return true;
  }
  // Device thread: blocks until something is queued, the queue is closed, or `stop`.
  void wait(const WaitPolicy& policy, const StopFlag& stop) {
    wait_with(not_empty_, policy, [&] {
      return count_.load(std::memory_order_seq_cst) != 0 ||
             !open_flag_.load(std::memory_order_seq_cst) || stop.requested();
    });
  }
  // Any thread: whether a request waits now.
  bool waiting() const noexcept { return count_.load(std::memory_order_acquire) != 0; }
  // Device thread: closed and nothing left.
  bool ended() const noexcept {
    return !open_flag_.load(std::memory_order_seq_cst) &&
           count_.load(std::memory_order_seq_cst) == 0;
  }

  void open() override {
    std::lock_guard lock(mutex_);
    if (core_ == nullptr) return;
    accepted_run_.store(0, std::memory_order_relaxed);
    open_ = true;
    open_flag_.store(true, std::memory_order_seq_cst);
  }
  void close() noexcept override {
    {
      std::lock_guard lock(mutex_);
      open_ = false;
      open_flag_.store(false, std::memory_order_seq_cst);
    }
    wake();
  }
  // Host thread: the Stream is going away. Pushes are refused from now on; returns once no
  // push is still inside (using the Stream).
  void detach() noexcept {
    close();
    std::unique_lock lock(mutex_);
    core_ = nullptr;
    while (inside_ != 0) {  // a push blocked on a full queue was woken by close()
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
    }
  }
  void cancel_all(ResponderBase& responder_base) override {
    for (;;) {
      Queued<In> e;
      if (!try_take(e)) return;
      responder_base.answer_error(
          e.meta,
          make_request_error(ErrorKind::kCancelled, e.meta, 0, core_->node_name(0),
                             core_->devices[0].id(), "was not run: the stream was cancelled"),
          false);
    }
  }
  void wake() noexcept override {
    not_empty_.notify();
    not_full_.notify();
  }
  std::size_t size() const noexcept override { return count_.load(std::memory_order_relaxed); }
  std::size_t size_of(std::uint32_t c) const override {
    std::lock_guard lock(mutex_);
    return c < classes_ ? queue_[c].size() : 0;
  }
  std::uint64_t accepted() const noexcept override {
    return accepted_run_.load(std::memory_order_relaxed);
  }
  std::uint32_t blocked_of(std::uint32_t c) const noexcept override {
    return c < classes_ ? blocked_[c].load(std::memory_order_relaxed) : 0;
  }
  std::uint64_t accepted_of(std::uint32_t c) const noexcept override {
    return accepted_[c].load(std::memory_order_relaxed);
  }
  std::uint64_t refused(std::uint32_t c, Refusal r) const noexcept override {
    return refusals_[c][static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
  }

 private:
  // A kBlock push waiting for a place, on the waiting push's own stack.
  struct Blocked {
    Blocked* prev = nullptr;
    Blocked* next = nullptr;
    std::uint32_t cls = 0;
  };

  // Under the lock: whether a request of class `c` with `deadline` can be queued now (`me`:
  // the waiting push asking again, or null for a new push). A full
  // queue may shed a queued request (a lower class's, or under kShed the least slack among the
  // lowest class's and the newcomer): removed from the queue, answered by the caller once
  // unlocked.
  Refusal admit(StreamClock::time_point now, Deadline deadline, std::uint32_t c,
                std::optional<RequestMeta>& victim, const Blocked* me) {
    const Admission& a = core_->config.admission;
    // Only with a queue ahead: an empty queue admits, so the stages keep measuring (a
    // prediction that refused everything would never learn that the stream got faster).
    std::size_t ahead = 0;
    for (std::uint32_t k = 0; k <= c; ++k) ahead += queue_[k].size();
    const std::int64_t per =
        (a.predict && deadline != kNoDeadline) || a.policy == AdmissionPolicy::kShed
            ? core_->per_request_ns()
            : 0;
    if (a.predict && deadline != kNoDeadline && per > 0 && ahead > 0) {
      learn_from_late();
      // The whole rounds ahead of it (each live replica takes one request a round).
      const auto rounds = static_cast<std::int64_t>(ahead / core_->live_replicas());
      const auto wait =
          static_cast<double>(rounds * per + core_->path_ns()) * (1.0 + late_feedback_.slack());
      const auto done = now + std::chrono::nanoseconds(static_cast<std::int64_t>(wait));
      if (done > deadline) return Refusal::kDeadlineUnreachable;
    }
    // kBlock: the next free place is promised to the oldest waiting push of the highest class
    // that waits. Every other push leaves it alone, unless it is of a higher class than every
    // waiter (it would have come first anyway).
    if (blocked_total_ != 0) {
      const Blocked* first = next_up_.load(std::memory_order_relaxed);
      if (first != me && first->cls <= c) return Refusal::kQueueFull;
    }
    if (size_ < capacity_) return Refusal::kNone;
    // Full. The lowest class queued, and whether a lower one than the newcomer's is there.
    std::uint32_t lowest = 0;
    for (std::uint32_t k = 0; k < classes_; ++k) {
      if (!queue_[k].empty()) lowest = k;
    }
    if (a.policy == AdmissionPolicy::kBlock) return Refusal::kQueueFull;
    if (lowest > c) {  // shed the lowest class's request served last
      take_victim(lowest, pick_latest(lowest), victim);
      return Refusal::kNone;
    }
    if (a.policy == AdmissionPolicy::kReject) {
      return lowest < c ? Refusal::kOutranked : Refusal::kQueueFull;
    }
    // kShed: the least slack among the newcomer and the queued requests of its class (the
    // lowest queued; a higher class is never shed for it).
    if (lowest < c) return Refusal::kOutranked;
    const auto slack = [&](Deadline d, std::size_t pos) {
      if (d == kNoDeadline) return std::chrono::nanoseconds::max();
      return std::chrono::duration_cast<std::chrono::nanoseconds>(d - now) -
             std::chrono::nanoseconds(static_cast<std::int64_t>(pos + 1) * per);
    };
    // Only requests with a deadline have a finite slack: they are the heap's (or, without
    // earliest-deadline-first, the ring's).
    const ClassQueue<In>& q = queue_[c];
    std::size_t worst = q.size();
    auto least = slack(deadline, size_);
    for (std::size_t i = 0; i < q.size(); ++i) {
      const auto sl = slack(q.at(i).meta.deadline, i);
      if (sl < least) {
        least = sl;
        worst = i;
      }
    }
    if (worst == q.size()) return Refusal::kShed;  // the newcomer has the least slack
    take_victim(c, worst, victim);
    return Refusal::kNone;
  }

  // Under the lock: `b` joins the end of its class's line. Its class's count is stats()'s
  // `blocked`. Never allocates (b lives on the waiting push's stack).
  void enlist(Blocked& b) noexcept {
    b.prev = line_tail_[b.cls];
    b.next = nullptr;
    (b.prev != nullptr ? b.prev->next : line_head_[b.cls]) = &b;
    line_tail_[b.cls] = &b;
    ++blocked_total_;
    blocked_[b.cls].store(blocked_[b.cls].load(std::memory_order_relaxed) + 1,
                          std::memory_order_relaxed);  // relaxed: a figure for stats()
    refresh_next_up();
  }
  // Under the lock: `b` leaves its line. True when another waiter became next up: the caller
  // wakes the waiters once unlocked, as next_up_'s contract says.
  bool delist(Blocked& b) noexcept {
    (b.prev != nullptr ? b.prev->next : line_head_[b.cls]) = b.next;
    (b.next != nullptr ? b.next->prev : line_tail_[b.cls]) = b.prev;
    --blocked_total_;
    blocked_[b.cls].store(blocked_[b.cls].load(std::memory_order_relaxed) - 1,
                          std::memory_order_relaxed);
    return refresh_next_up() && next_up_.load(std::memory_order_relaxed) != nullptr;
  }
  // Under the lock: next_up_ becomes the head of the highest class's line. True if it changed.
  bool refresh_next_up() noexcept {
    const Blocked* n = nullptr;
    for (std::uint32_t c = 0; c < classes_ && n == nullptr; ++c) n = line_head_[c];
    if (n == next_up_.load(std::memory_order_relaxed)) return false;
    next_up_.store(n, std::memory_order_seq_cst);
    return true;
  }

  // The index (ClassQueue::at) of class c's request served last.
  std::size_t pick_latest(std::uint32_t c) const { return queue_[c].latest(); }
  void take_victim(std::uint32_t c, std::size_t i, std::optional<RequestMeta>& victim) {
    victim = queue_[c].at(i).meta;
    queue_[c].remove(i);
    --size_;
  }
  static std::shared_ptr<const RequestError> shed_error(StreamCore& core, const RequestMeta& v,
                                                        std::uint32_t newcomer) {
    const std::string why =
        newcomer < v.priority
            ? "was shed by admission control: the queue was full and a request of priority "
              "class " +
                  std::to_string(newcomer) + " (higher than its " + std::to_string(v.priority) +
                  ") needed its place"
            : "was shed by admission control (AdmissionPolicy::kShed): the queue was full and "
              "it had the least slack";
    return make_request_error(ErrorKind::kRejected, v, 0, core.node_name(0), core.devices[0].id(),
                              why);
  }

  // Under the lock: admission's feedback from the answers so far (LateFeedback).
  void learn_from_late() noexcept {
    std::uint64_t timed = 0, late = 0;
    for (const auto& m : core_->replica_meters) {
      timed += m->timed.load(std::memory_order_relaxed);
      late += m->late.load(std::memory_order_relaxed);
    }
    late_feedback_.update(timed, late);
  }

  // Counts the refusal in the admission itself (never in the Stream, which may be gone).
  Submission refuse(Submission s, Refusal r, std::uint32_t c) noexcept {
    s.refusal = r;
    // relaxed: a count read by stats(); any client thread adds to it.
    refusals_[c][static_cast<std::size_t>(r)].fetch_add(1, std::memory_order_relaxed);
    return s;
  }

  InputSizeCheck size_check_;
  StreamCore* core_;  // under mutex_; nullptr once detached
  std::size_t capacity_;
  std::uint32_t classes_;
  bool edf_;
  bool reject_;             // AdmissionPolicy::kReject
  bool predict_;            // Admission::predict
  bool fast_full_refusal_;  // one class, no shedding: a full queue refuses without the lock
  mutable AdmissionLock mutex_;
  std::size_t inside_ = 0;  // pushes using the Stream now (under mutex_)
  std::array<ClassQueue<In>, kPriorityClasses> queue_;  // under mutex_
  // kBlock pushes waiting for a place (Blocked): a line per class, oldest first (under
  // mutex_), their count by class (written under mutex_, read by stats()), and the one the
  // next free place is promised to. next_up_ is stored seq_cst under mutex_, and whoever moves it
  // to another waiter calls not_full_.notify() after unlocking: a waiter's predicate reads it, so
  // no wake-up is lost (WaitPoint's contract).
  std::array<Blocked*, kPriorityClasses> line_head_{}, line_tail_{};
  std::uint32_t blocked_total_ = 0;
  std::array<std::atomic<std::uint32_t>, kPriorityClasses> blocked_{};
  std::atomic<const Blocked*> next_up_{nullptr};
  std::size_t size_ = 0;
  std::uint64_t order_ = 0;
  ClassPicker picker_;  // under mutex_
  bool open_ = false;
  std::atomic<bool> open_flag_{false};
  std::atomic<std::size_t> count_{0};
  std::atomic<std::uint64_t> accepted_run_{0};                           // written under mutex_
  std::array<std::atomic<std::uint64_t>, kPriorityClasses> accepted_{};  // under mutex_
  std::array<std::array<std::atomic<std::uint64_t>, kRefusals>, kPriorityClasses> refusals_{};
  LateFeedback late_feedback_;  // under mutex_
  WaitPoint not_empty_, not_full_;
};

}  // namespace bspflow::detail
