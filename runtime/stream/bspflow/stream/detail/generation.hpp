// Internal to streams (installed because the stream templates use it): a generate stage at
// the head of its segment (generate_stage). It keeps an active set of sequences and runs one
// iteration of the step for all of them at a time: between two iterations, sequences that
// ended leave, waiting ones join, up to max_active and as the block pool allows. Each
// sequence's state lives in fixed-size blocks of one arena allocation (the block pool),
// found through its block table. Each output leaves as an occurrence of its request (a
// partial response, or the final one) through the segment's ops.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/devices/arena.hpp"
#include "bspflow/stream/detail/ops.hpp"
#include "bspflow/stream/detail/segment.hpp"
#include "bspflow/stream/generate.hpp"

namespace bspflow::detail {

// One version of a generate stage's step.
template <class In, class E, class Out>
class GenerateFn : public Versioned {
 public:
  virtual std::vector<StepOutput<Out>> call(std::span<Generation<In, E>> active) = 0;
};
template <class In, class E, class Out, class F>
class GenerateFnOf final : public GenerateFn<In, E, Out> {
 public:
  explicit GenerateFnOf(F f) : f_(std::move(f)) {}
  std::vector<StepOutput<Out>> call(std::span<Generation<In, E>> active) override {
    return f_(active);
  }

 private:
  F f_;
};

// Whether F is a generate stage's step for inputs X: its call operator (not a template)
// takes a std::span<Generation<X, E>>; Entry is then E.
template <class M>
struct StepArgOf {
  using type = void;
};
template <class C, class R, class A>
struct StepArgOf<R (C::*)(A)> {
  using type = A;
};
template <class C, class R, class A>
struct StepArgOf<R (C::*)(A) const> {
  using type = A;
};
template <class C, class R, class A>
struct StepArgOf<R (C::*)(A) noexcept> {
  using type = A;
};
template <class C, class R, class A>
struct StepArgOf<R (C::*)(A) const noexcept> {
  using type = A;
};
template <class A, class X>
struct GenerationSpan : std::false_type {
  using Entry = void;
};
template <class X, class E>
struct GenerationSpan<std::span<Generation<X, E>>, X> : std::true_type {
  using Entry = E;
};
template <class F, class X, class = void>
struct GenerateStep : std::false_type {
  using Entry = void;
};
template <class F, class X>
struct GenerateStep<F, X, std::void_t<decltype(&F::operator())>>
    : GenerationSpan<std::decay_t<typename StepArgOf<decltype(&F::operator())>::type>, X> {};

// A generate stage at the head of its segment, untyped for the segment's loop.
class GenerateHeadBase {
 public:
  virtual ~GenerateHeadBase() = default;
  // Runs the segment's ops for one occurrence: the head's output slot holds its value or
  // error. False: the run must stop.
  using Emit = std::function<bool(const RequestMeta&)>;
  // Device thread: serves until the source has ended and no sequence is left (true), or the
  // run stops (false; then answer_held() answers what it still holds). `batch` / `unbatch`
  // frame one iteration's outputs (the clients are woken once each, at the end).
  virtual bool serve(Source& source, const WaitPolicy& policy, const StopFlag& stop,
                     const Emit& emit, const std::function<void()>& batch,
                     const std::function<void()>& unbatch) = 0;
  // Device thread, on a stop: every sequence it holds, given to `answer` (once each), its
  // blocks freed.
  virtual void answer_held(const std::function<void(const RequestMeta&)>& answer) = 0;
  VersionCell cell;
  const NodeRun* node = nullptr;
  GenerateMeter meter;
};

template <class In, class E, class Out>
class GenerateHead final : public GenerateHeadBase {
  static_assert(alignof(E) <= 64, "a state entry's alignment must be at most the arena's (64)");

 public:
  // Takes the block pool from `arena` (OutOfMemoryError with the arena's report).
  // `length`: each request's own bound on its iterations, or empty (max_length for all).
  GenerateHead(const GenerateConfig& config, Slot<Out>& out, Arena& arena, const std::string& what,
               std::function<std::uint32_t(const In&)> length)
      : config_(config), out_(out), arena_(arena), blocks_(config.pool_blocks(sizeof(E))),
        reserve_(config.memory_policy == MemoryPolicy::kReserve), length_(std::move(length)) {
    const std::size_t block_bytes = config_.block_entries * sizeof(E);
    base_ = static_cast<E*>(arena_.allocate(blocks_ * block_bytes, what));
    free_.reserve(blocks_);
    for (std::size_t b = blocks_; b-- > 0;) free_.push_back(static_cast<std::uint32_t>(b));
    seqs_.resize(config_.max_active);
    for (Generation<In, E>& s : seqs_) {
      s.state_.base_ = base_;
      s.state_.per_block_ = config_.block_entries;
      s.state_.table_.reserve(std::min(blocks_, config_.blocks_for(config_.max_length)));
    }
    gone_.assign(config_.max_active, 0);
    meter.blocks.store(blocks_, std::memory_order_relaxed);
    meter.max_active = config_.max_active;
    meter.first_blocks = first_blocks();
  }
  ~GenerateHead() override { arena_.release(base_); }
  GenerateHead(const GenerateHead&) = delete;
  GenerateHead& operator=(const GenerateHead&) = delete;

  bool serve(Source& source, const WaitPolicy& policy, const StopFlag& stop, const Emit& emit,
             const std::function<void()>& batch, const std::function<void()>& unbatch) override {
    for (;;) {
      if (stop.requested()) return false;
      protect();
      if (!end_dead(emit)) return false;
      if (!resume(emit)) return false;
      // New sequences, while there is room and none waits preempted (those go first). One
      // whose first blocks are not free (kReserve: its length's) waits here until they are.
      while (preempted_.empty() && active_ < config_.max_active) {
        if (!holding_) {
          if (free_.size() < first_blocks() || !source.try_next(in_)) break;
          hold_incoming();
        }
        // Waits for its blocks; one cancelled or past its deadline meanwhile ends now (take).
        if (admission_blocks() > free_.size() && admission_blocks() <= blocks_ &&
            !ended(in_.meta, 0)) {
          break;
        }
        holding_ = false;
        if (!take(in_, emit)) return false;
      }
      if (active_ == 0) {
        // With nothing active every block is free, so a request held above was taken.
        if (!preempted_.empty()) continue;  // resume() fails it or brings it back
        // Idle: park until a request comes (or the source ends, or the run stops), holding
        // no version.
        cell.release();
        if (!source.next(in_, policy, stop)) return !stop.requested();
        current_ = cell.acquire();
        hold_incoming();
        holding_ = false;
        if (!take(in_, emit)) return false;
        continue;
      }
      if (!grow(emit)) return false;
      if (active_ == 0) continue;
      if (!iterate(emit, batch, unbatch)) return false;
    }
  }

  void answer_held(const std::function<void(const RequestMeta&)>& answer) override {
    if (holding_) {  // taken from the source, waiting for its first blocks
      RequestMeta m = in_.meta;
      m.part = 0;
      m.partial = false;
      answer(m);
      holding_ = false;
    }
    for (std::size_t i = 0; i < active_; ++i) {
      answer(final_meta(seqs_[i]));
      free_blocks(seqs_[i]);
    }
    active_ = 0;
    for (Generation<In, E>& s : preempted_) answer(final_meta(s));
    preempted_.clear();
    cell.release();
    publish();
  }

 private:
  // Each sequence runs on the version it started on. The cell's in_use names the oldest
  // version a held sequence runs (a swap retires a version only once in_use no longer names
  // it), or, with none held, the current one; new sequences start on the current version.
  // Swaps go one at a time and each waits for its old version, so at most two are held: a
  // current one that its swap cannot retire before the older one is let go.
  void protect() {
    Versioned* oldest = nullptr;
    const auto older = [&](Versioned* v) {
      if (oldest == nullptr || v->version < oldest->version) oldest = v;
    };
    for (std::size_t i = 0; i < active_; ++i) older(seqs_[i].version_);
    for (Generation<In, E>& p : preempted_) older(p.version_);
    if (oldest == nullptr) {
      current_ = cell.acquire();
      return;
    }
    if (cell.in_use.load(std::memory_order_relaxed) != oldest) {
      cell.in_use.store(oldest, std::memory_order_seq_cst);
    }
    current_ = cell.current.load(std::memory_order_seq_cst);
  }

  // The fewest blocks a new sequence takes at admission: its first iteration's, or under
  // kReserve all of max_length's (with a length function, each request's own: at least
  // one iteration's).
  std::size_t first_blocks() const noexcept {
    return reserve_ && !length_ ? config_.blocks_for(config_.max_length) : config_.blocks_for(1);
  }

  // The request just taken from the source (in_) is held: its bound, from the length
  // function (a throw ends it in take()).
  void hold_incoming() {
    holding_ = true;
    in_limit_ = config_.max_length;
    in_failed_ = nullptr;
    if (!length_ || in_.error || in_.skipped || in_.value == nullptr) return;
    try {
      in_limit_ = std::clamp<std::uint32_t>(length_(*static_cast<const In*>(in_.value)), 1,
                                            config_.max_length);
    } catch (...) {
      in_failed_ = std::current_exception();
    }
  }
  // The blocks the held request takes at admission (0: it takes none, it ends in take()).
  std::size_t admission_blocks() const noexcept {
    if (in_failed_ || in_.error || in_.skipped || in_.value == nullptr) return 0;
    return reserve_ ? config_.blocks_for(in_limit_) : config_.blocks_for(1);
  }

  // The meta of the sequence's next occurrence.
  static RequestMeta occurrence(Generation<In, E>& s, bool last) {
    RequestMeta m = s.meta_;
    m.part = s.parts_++;
    m.partial = !last;
    return m;
  }
  static RequestMeta final_meta(Generation<In, E>& s) { return occurrence(s, true); }

  // Ends sequence `s` with `error` (its final occurrence), after a response with the
  // outputs it holds (stream_every).
  bool end_with(Generation<In, E>& s, std::shared_ptr<const RequestError> error, const Emit& emit) {
    if (s.held_ != 0) {
      release(s);
      if (node->meter != nullptr) timed(s, StreamClock::now());
      if (!emit(occurrence(s, false))) return false;  // stopped: answered as held
    }
    out_.set_error(std::move(error));
    bump(meter.sequences);
    return emit(final_meta(s));
  }
  std::shared_ptr<const RequestError> failure(const Generation<In, E>& s, const std::string& why,
                                              std::exception_ptr cause = nullptr) const {
    return make_request_error(ErrorKind::kStageFailed, s.meta_, node->index, node->name,
                              node->device_id, why, std::move(cause));
  }

  // A request from the source: an error it carries is passed on; a live one joins the
  // active set with its first blocks (the caller checked that they are free).
  bool take(Incoming& in, const Emit& emit) {
    RequestMeta meta = in.meta;
    meta.part = 0;
    meta.partial = false;
    if (in.error || in.skipped || in.value == nullptr) {
      if (in.error) {
        out_.set_error(std::move(in.error));
      } else {
        out_.set_skipped();
      }
      return emit(meta);
    }
    if (auto dead = ended(meta, 0)) {
      out_.set_error(std::move(dead));
      return emit(meta);
    }
    if (in_failed_ || (length_ && config_.blocks_for(in_limit_) > blocks_)) {
      out_.set_error(
          in_failed_ ? make_request_error(
                           ErrorKind::kStageFailed, meta, node->index, node->name, node->device_id,
                           "length function failed: " + describe_exception(in_failed_), in_failed_)
                     : make_request_error(
                           ErrorKind::kStageFailed, meta, node->index, node->name, node->device_id,
                           too_large(config_, in_limit_, blocks_,
                                     arena_.owner() + "'s arena: " + arena_.report())));
      return emit(meta);
    }
    if (node->meter != nullptr && meta.enqueued != StreamClock::time_point{}) {
      const auto w = (StreamClock::now() - meta.enqueued).count();
      node->meter->wait.record(static_cast<std::uint64_t>(w > 0 ? w : 0));
    }
    Generation<In, E>& s = seqs_[active_];
    s.input_.emplace(std::move(*static_cast<In*>(in.value)));
    s.meta_ = meta;
    s.version_ = current_;
    s.meta_.version = std::max(s.meta_.version, current_->version);
    s.step_ = 0;
    s.limit_ = in_limit_;
    s.parts_ = 0;
    s.held_ = 0;
    s.state_.size_ = 0;
    s.state_.table_.clear();
    add_blocks(s, admission_blocks());
    ++active_;
    publish();
    return true;
  }

  // At an iteration boundary: sequences cancelled (or dropped by another branch) or past
  // their deadline end, active or preempted.
  bool end_dead(const Emit& emit) {
    bool any = false;
    for (std::size_t i = 0; i < active_; ++i) {
      if (auto dead = ended(seqs_[i].meta_, seqs_[i].parts_)) {
        gone_[i] = 1;
        any = true;
        if (!end_with(seqs_[i], std::move(dead), emit)) return false;
      }
    }
    if (any) compact();
    for (std::size_t i = 0; i < preempted_.size();) {
      if (auto dead = ended(preempted_[i].meta_, preempted_[i].parts_)) {
        const bool ok = end_with(preempted_[i], std::move(dead), emit);
        preempted_.erase(preempted_.begin() + static_cast<std::ptrdiff_t>(i));
        if (!ok) return false;
        continue;
      }
      ++i;
    }
    publish();
    return true;
  }

  // Brings preempted sequences back, the highest class and oldest first, while their
  // blocks fit; one that could never fit ends with an error.
  bool resume(const Emit& emit) {
    while (!preempted_.empty() && active_ < config_.max_active) {
      Generation<In, E>& p = preempted_.front();
      const std::size_t need = blocks_for_entries(p.saved_.size() + config_.entries_per_step);
      if (need > blocks_) {
        const bool ok = end_with(p, out_of_memory(p, need), emit);
        preempted_.erase(preempted_.begin());
        if (!ok) return false;
        continue;
      }
      if (free_.size() < need) return true;
      Generation<In, E>& s = seqs_[active_];
      move_progress(s, p);
      s.state_.table_.clear();
      add_blocks(s, need);
      s.state_.size_ = 0;
      for (const E& e : p.saved_) s.state_.push_back(e);
      preempted_.erase(preempted_.begin());
      ++active_;
    }
    publish();
    return true;
  }

  // Makes room for each active sequence's next entries: a block from the pool, or (when
  // none is free) per the memory policy.
  bool grow(const Emit& emit) {
    for (std::size_t i = 0; i < active_; ++i) {
      if (gone_[i] != 0) continue;
      Generation<In, E>& s = seqs_[i];
      const std::size_t need =
          blocks_for_entries(s.state_.size_ + config_.entries_per_step) - s.state_.table_.size();
      if (need == 0 || reserve_) continue;
      if (s.state_.table_.size() + need > blocks_) {
        gone_[i] = 1;
        if (!end_with(s, out_of_memory(s, s.state_.table_.size() + need), emit)) return false;
        continue;
      }
      while (free_.size() < need) {
        if (config_.memory_policy == MemoryPolicy::kFail) break;
        const std::size_t v = victim();
        preempt(seqs_[v]);
        gone_[v] = 2;
        if (v == i) break;
      }
      if (gone_[i] != 0) continue;  // preempted itself
      if (free_.size() < need) {
        gone_[i] = 1;
        if (!end_with(s, out_of_memory(s, s.state_.table_.size() + need), emit)) return false;
        continue;
      }
      add_blocks(s, need);
    }
    compact();
    publish();
    return true;
  }

  // Whether `a` comes after `b` in resume order: a lower class, or the same class and younger.
  // Preemption takes the last in that order.
  static bool resumes_after(const RequestMeta& a, const RequestMeta& b) noexcept {
    return a.priority > b.priority || (a.priority == b.priority && a.order > b.order);
  }

  // The active sequence to preempt: the lowest class, the youngest within it.
  std::size_t victim() const noexcept {
    std::size_t v = active_;
    for (std::size_t i = 0; i < active_; ++i) {
      if (gone_[i] != 0) continue;
      if (v == active_) {
        v = i;
        continue;
      }
      if (resumes_after(seqs_[i].meta_, seqs_[v].meta_)) v = i;
    }
    return v;
  }

  // Moves what a sequence has done so far (its input, request, steps, responses, version,
  // held outputs) from one Generation to another: an active slot and a preempted copy. Not
  // its state.
  static void move_progress(Generation<In, E>& to, Generation<In, E>& from) {
    to.input_ = std::move(from.input_);
    to.meta_ = from.meta_;
    to.step_ = from.step_;
    to.limit_ = from.limit_;
    to.parts_ = from.parts_;
    to.last_out_ = from.last_out_;
    to.version_ = from.version_;
    to.joined_ = std::move(from.joined_);
    to.held_ = from.held_;
    from.held_ = 0;
  }

  // Moves sequence `s` to host memory: its entries are copied out, its blocks freed, and it
  // waits (in class, then admission order) to resume.
  void preempt(Generation<In, E>& s) {
    Generation<In, E> p;
    p.saved_.reserve(s.state_.size_);
    for (std::size_t i = 0; i < s.state_.size_; ++i) p.saved_.push_back(s.state_[i]);
    move_progress(p, s);
    free_blocks(s);
    const auto at = std::find_if(preempted_.begin(), preempted_.end(),
                                 [&](const auto& q) { return resumes_after(q.meta_, p.meta_); });
    bump(meter.by_class[std::min<std::size_t>(p.meta_.priority, kPriorityClasses - 1)].preemptions);
    preempted_.insert(at, std::move(p));
    bump(meter.preemptions);
  }

  // One iteration: the step for every active sequence, then each one's output leaves.
  bool iterate(const Emit& emit, const std::function<void()>& batch,
               const std::function<void()>& unbatch) {
    const std::size_t n = active_;
    StageMeter* m = node->meter;
    const auto t0 = StreamClock::now();
    if (m != nullptr) m->begin(t0, seqs_[0].meta_.id);
    results_.clear();
    // One call per version the active set runs (protect() keeps each alive): the older
    // version's sequences first. `split`: where the second call's sequences begin.
    std::size_t split = n;
    for (std::size_t i = 1; i < n && split == n; ++i) {
      if (seqs_[i].version_ != seqs_[0].version_) split = 0;
    }
    if (split == 0) {
      Versioned* older = seqs_[0].version_;
      for (std::size_t i = 1; i < n; ++i) {
        if (seqs_[i].version_->version < older->version) older = seqs_[i].version_;
      }
      const auto first = std::stable_partition(
          seqs_.begin(), seqs_.begin() + static_cast<std::ptrdiff_t>(n),
          [older](const Generation<In, E>& g) { return g.version_ == older; });
      split = static_cast<std::size_t>(first - seqs_.begin());
    }
    std::array<std::exception_ptr, 2> failed{};
    for (int part = 0; part < 2; ++part) {
      const std::size_t from = part == 0 ? 0 : split, to = part == 0 ? split : n;
      if (from == to) continue;
      auto* fn = static_cast<GenerateFn<In, E, Out>*>(seqs_[from].version_);
      const std::size_t before = results_.size();
      try {
        std::vector<StepOutput<Out>> got =
            fn->call(std::span<Generation<In, E>>(seqs_.data() + from, to - from));
        if (got.size() != to - from) {
          throw Error("generate stage '" + node->name + "' returned " + std::to_string(got.size()) +
                      " output(s) for " + std::to_string(to - from) +
                      " active sequence(s): one per sequence");
        }
        for (StepOutput<Out>& o : got) results_.push_back(std::move(o));
      } catch (...) {
        failed[static_cast<std::size_t>(part)] = std::current_exception();
        while (results_.size() > before) results_.pop_back();
        for (std::size_t i = from; i < to; ++i) results_.push_back(StepOutput<Out>::failure(""));
      }
      bump(fn->calls);
    }
    const auto t1 = StreamClock::now();
    if (m != nullptr) {
      m->end((t1 - t0).count(), n);
      m->batch.record(n);
    }
    if (node->model != nullptr) {
      InFlight f;
      charge(f, *node, n);
    }
    bump(meter.iterations);
    struct Frame {
      const std::function<void()>& end;
      ~Frame() { end(); }
    };
    batch();
    Frame frame{unbatch};
    for (std::size_t i = 0; i < n; ++i) {
      Generation<In, E>& s = seqs_[i];
      ++s.step_;
      bool ok = true;
      if (const std::exception_ptr& f = failed[i < split ? 0 : 1]) {
        gone_[i] = 1;
        ok = end_with(s, failure(s, "failed: " + describe_exception(f), f), emit);
      } else if (StepOutput<Out>& r = results_[i]; !r.ok()) {
        gone_[i] = 1;
        ok = end_with(s, failure(s, "failed: " + r.error()), emit);
      } else {
        const bool last = r.done() || s.step_ >= s.limit_;
        bool respond = true;
        if (config_.stream_every > 1) {
          hold(s, std::move(r.value()));
          respond = last || s.held_ >= config_.stream_every;
          if (respond) release(s);
        } else {
          out_.set(std::move(r.value()));
        }
        bump(meter.tokens);
        bump(meter.by_class[std::min<std::size_t>(s.meta_.priority, kPriorityClasses - 1)].tokens);
        if (last) {
          gone_[i] = 1;
          bump(meter.sequences);
        }
        if (respond) {
          if (m != nullptr) timed(s, t1);
          RequestMeta occ = occurrence(s, last);
          if (m != nullptr) occ.enqueued = t1;
          ok = emit(occ);
        }
      }
      if (!ok) {
        // Stopped: this occurrence was answered; the rest of the set is held (answer_held).
        compact();
        return false;
      }
    }
    compact();
    publish();
    return true;
  }

  // Whether a sequence that has given `parts` outputs ends here: the error it ends with
  // (cancelled, dropped by another branch, past its deadline or first_token_timeout), or null.
  std::shared_ptr<const RequestError> ended(const RequestMeta& meta, std::uint32_t parts) const {
    InFlight probe;
    probe.meta = meta;
    if (auto dead = check_live(probe, *node)) return dead;
    if (parts != 0 || !config_.first_token_timeout) return nullptr;
    const auto waited = StreamClock::now() - meta.arrival;
    if (waited <= *config_.first_token_timeout) return nullptr;
    return make_request_error(
        ErrorKind::kDeadlineExceeded, meta, node->index, node->name, node->device_id,
        "had no first output " +
            describe_duration(std::chrono::duration_cast<std::chrono::nanoseconds>(waited)) +
            " after its push, past GenerateConfig::first_token_timeout (" +
            describe_duration(*config_.first_token_timeout) + ")");
  }

  // An error for a sequence that needs `need` blocks of a pool that cannot give them.
  std::shared_ptr<const RequestError> out_of_memory(const Generation<In, E>& s,
                                                    std::size_t need) const {
    return failure(s, "ran out of state memory: it needs " + std::to_string(need) +
                          " block(s) of " + std::to_string(config_.block_entries) +
                          " entries, and the pool of " + std::to_string(blocks_) + " has " +
                          std::to_string(free_.size()) + " free (memory policy '" +
                          to_string(config_.memory_policy) + "'; device arena: " + arena_.report() +
                          ")");
  }

  // Times a response of `s` made at `t`: from its push for its first, else from its last.
  void timed(Generation<In, E>& s, StreamClock::time_point t) {
    GenerateMeter::ByClass& bc =
        meter.by_class[std::min<std::size_t>(s.meta_.priority, kPriorityClasses - 1)];
    const auto since = t - (s.parts_ == 0 ? s.meta_.arrival : s.last_out_);
    (s.parts_ == 0 ? bc.ttft : bc.itl)
        .record(static_cast<std::uint64_t>(std::max<std::int64_t>(0, since.count())));
    s.last_out_ = t;
  }
  // Appends output `v` to those `s` holds for its next response (stream_every > 1, which
  // the builder allows only for joinable outputs).
  static void hold(Generation<In, E>& s, Out&& v) {
    if constexpr (JoinableOutput<Out>) {
      if (!s.joined_) s.joined_ = std::make_shared<Out>();
      Out& j = *static_cast<Out*>(s.joined_.get());
      if (s.held_ == 0) {
        j = std::move(v);
      } else {
        j.insert(j.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
      }
      ++s.held_;
    }
  }
  // Puts the outputs `s` holds in the stage's output slot, for one response.
  void release(Generation<In, E>& s) {
    if constexpr (JoinableOutput<Out>) {
      Out& j = *static_cast<Out*>(s.joined_.get());
      out_.set(std::move(j));
      j.clear();  // a moved-from container is valid, not necessarily empty
    }
    s.held_ = 0;
  }

  std::size_t blocks_for_entries(std::size_t entries) const noexcept {
    return (entries + config_.block_entries - 1) / config_.block_entries;
  }
  void add_blocks(Generation<In, E>& s, std::size_t k) {
    for (std::size_t j = 0; j < k; ++j) {
      s.state_.table_.push_back(free_.back());
      free_.pop_back();
    }
  }
  void free_blocks(Generation<In, E>& s) {
    for (std::uint32_t b : s.state_.table_) free_.push_back(b);
    s.state_.table_.clear();
    s.state_.size_ = 0;
    s.input_.reset();
  }
  // Drops the sequences marked gone (1: ended, 2: preempted, its blocks already freed)
  // from the active set, keeping the others' order.
  void compact() {
    std::size_t j = 0;
    for (std::size_t i = 0; i < active_; ++i) {
      if (gone_[i] != 0) {
        if (gone_[i] == 1) free_blocks(seqs_[i]);
        gone_[i] = 0;
        continue;
      }
      if (i != j) std::swap(seqs_[i], seqs_[j]);
      ++j;
    }
    active_ = j;
  }
  void publish() noexcept {
    meter.active.store(active_, std::memory_order_relaxed);
    meter.waiting.store(preempted_.size(), std::memory_order_relaxed);
    meter.blocks_used.store(blocks_ - free_.size(), std::memory_order_relaxed);
  }

  GenerateConfig config_;
  Slot<Out>& out_;
  Arena& arena_;
  std::size_t blocks_;  // the pool's size
  bool reserve_;
  E* base_ = nullptr;
  std::vector<std::uint32_t> free_;      // free block numbers (the last is taken first)
  std::vector<Generation<In, E>> seqs_;  // max_active slots: 0..active_-1 are the active set
  std::size_t active_ = 0;
  std::vector<std::uint8_t> gone_;            // by slot: leaves at the next compact()
  std::vector<Generation<In, E>> preempted_;  // in host memory, in resume order
  std::vector<StepOutput<Out>> results_;
  Versioned* current_ = nullptr;  // the version new sequences start on (protect())
  std::function<std::uint32_t(const In&)> length_;  // each request's bound, or empty
  Incoming in_;                                     // the request taken last from the source
  bool holding_ = false;                            // in_ waits for its first blocks
  std::uint32_t in_limit_ = 0;                      // in_'s bound (hold_incoming())
  std::exception_ptr in_failed_;                    // what the length function threw for in_
};

}  // namespace bspflow::detail
