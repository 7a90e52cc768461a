// Internal to streams (installed because the stream templates use it): the ops a segment
// runs for each request. TakeOp starts a request from the segment's source, ImportOp takes a
// node's value from another segment, StageOp / JoinOp / RouteOp / MergeOp run the graph's
// nodes, ExportOp hands a value to another segment, OutputOp answers the client. A stage's
// callable is versioned (VersionCell), so Stream::swap() can replace it between two calls.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bspflow/stream/detail/segment.hpp"

namespace bspflow::detail {

// One version of a stage's callable (or a batch stage's): numbered per stream.
class Versioned {
 public:
  virtual ~Versioned() = default;
  std::uint32_t version = 1;
  std::atomic<std::uint64_t> calls{0};  // one writer: the device thread of its replica
};
template <class X, class Y>
class StageFn : public Versioned {
 public:
  virtual Y call(X&& x) = 0;
};
// GCC 12 warns of a "maybe uninitialized" std::string inside a callable that takes one by
// value once the callable is inlined here: a false positive (GCC bug 105562).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
template <class X, class Y, class F>
class StageFnOf final : public StageFn<X, Y> {
 public:
  explicit StageFnOf(F f) : f_(std::move(f)) {}
  Y call(X&& x) override { return f_(std::move(x)); }

 private:
  F f_;
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The version of a stage that one replica runs. The device thread takes the current version
// for each call (acquire()) and lets go after it (release()); a swap stores the new version,
// then waits until no call holds the old one (quiescent()) before it retires it.
class VersionCell {
 public:
  // Device thread: the version to call now, marked in use.
  Versioned* acquire() noexcept {
    for (;;) {
      Versioned* v = current.load(std::memory_order_acquire);
      in_use.store(v, std::memory_order_seq_cst);
      if (current.load(std::memory_order_seq_cst) == v) return v;
    }
  }
  void release() noexcept { in_use.store(nullptr, std::memory_order_release); }
  // Host thread: whether no call holds `v` now (after `current` no longer points to it, no
  // new call can take it).
  bool quiescent(const Versioned* v) const noexcept {
    return in_use.load(std::memory_order_seq_cst) != v;
  }
  std::atomic<Versioned*> current{nullptr};
  std::atomic<Versioned*> in_use{nullptr};
};

// Records the op's call in the node's meter (timing) around `call`.
template <class Call>
auto timed(InFlight& f, const NodeRun& n, std::size_t items, Call&& call) {
  if (!f.timing || n.meter == nullptr) return call();
  StageMeter& m = *n.meter;
  const auto t0 = f.t;
  m.begin(t0, f.meta.id);
  struct End {
    InFlight& f;
    StageMeter& m;
    StreamClock::time_point t0;
    std::size_t items;
    ~End() {
      f.t = StreamClock::now();
      m.end((f.t - t0).count(), items);
    }
  } end{f, m, t0, items};
  return call();
}

// The error a node answers a request with when its callable threw.
std::shared_ptr<const RequestError> failure_of(const InFlight& f, const NodeRun& n,
                                               const std::exception_ptr& cause);
// After node `n` failed for the request in flight: other branches drop it; fail-fast stops
// the run (false).
bool after_failure(InFlight& f, SegmentCtx& ctx, const std::shared_ptr<const RequestError>& e);

// Starts the request from the segment's source: its value (or error, or skip mark) into the
// first node's slot.
template <class T>
class TakeOp final : public OpBase {
 public:
  TakeOp(Incoming& incoming, Slot<T>& out) : incoming_(incoming), out_(out) {}
  bool run(InFlight&, SegmentCtx&) override {
    if (incoming_.error) {
      out_.set_error(std::move(incoming_.error));
    } else if (incoming_.skipped || incoming_.value == nullptr) {
      out_.set_skipped();
    } else {
      out_.set(std::move(*static_cast<T*>(incoming_.value)));
    }
    return true;
  }

 private:
  Incoming& incoming_;
  Slot<T>& out_;
};

// Takes a node's value for the request in flight from another segment (the same request: every
// path sees the requests of one class in one order).
template <class T>
class ImportOp final : public OpBase {
 public:
  ImportOp(Hop<T>& hop, Slot<T>& out, std::string what)
      : hop_(hop), out_(out), what_(std::move(what)) {}
  bool run(InFlight& f, SegmentCtx& ctx) override {
    Queued<T>* e = hop_.front(f.meta.priority, *ctx.policy, ctx.state->stop);
    if (e == nullptr) return false;  // stopped (a closed hop cannot lack this request)
    if (!(e->meta.id == f.meta.id)) {
      throw Error("stream internal error: " + what_ + " received request " +
                  std::to_string(e->meta.id.sequence) + " of client " +
                  std::to_string(e->meta.id.client) + " while serving request " +
                  std::to_string(f.meta.id.sequence) + " of client " +
                  std::to_string(f.meta.id.client));
    }
    f.modeled = std::max(f.modeled, e->meta.modeled_ns);
    f.meta.version = std::max(f.meta.version, e->meta.version);
    // The next node's call starts now, not when this segment's last node ended: a join's
    // service time leaves out the wait for its other branches.
    if (f.timing) f.t = StreamClock::now();
    if (e->error) {
      out_.set_error(std::move(e->error));
    } else if (e->skipped || !e->value) {
      out_.set_skipped();
    } else {
      out_.set(std::move(*e->value));
    }
    hop_.pop(f.meta.priority);
    return true;
  }

 private:
  Hop<T>& hop_;
  Slot<T>& out_;
  std::string what_;
};

// Hands a node's value for the request in flight to another segment.
template <class T>
class ExportOp final : public OpBase {
 public:
  ExportOp(Slot<T>& in, Hop<T>& hop) : in_(in), hop_(hop) {}
  bool run(InFlight& f, SegmentCtx& ctx) override {
    queued_.meta = f.meta;
    queued_.meta.modeled_ns = f.modeled;
    if (f.timing) queued_.meta.enqueued = f.t;
    in_.copy_state_to(queued_);
    return hop_.push(f.meta.priority, std::move(queued_), *ctx.policy, ctx.state->stop);
  }

 private:
  Slot<T>& in_;
  Hop<T>& hop_;
  Queued<T> queued_;
};

// A stage node: its callable on the input's value.
template <class X, class Y>
class StageOp final : public OpBase {
 public:
  StageOp(Slot<X>& in, Slot<Y>& out, const NodeRun& node) : in_(in), out_(out), node_(node) {}
  VersionCell cell;
  bool run(InFlight& f, SegmentCtx& ctx) override {
    if (in_.error) {
      out_.set_error(in_.error);
      return true;
    }
    if (in_.skipped) {
      out_.set_skipped();
      return true;
    }
    if (auto dead = check_live(f, node_)) {
      out_.set_error(std::move(dead));
      return true;
    }
    // The version is read and its count bumped before it is let go: a swap frees it after.
    auto* fn = static_cast<StageFn<X, Y>*>(cell.acquire());
    f.meta.version = std::max(f.meta.version, fn->version);
    try {
      X x = in_.take();
      out_.set(timed(f, node_, 1, [&] { return fn->call(std::move(x)); }));
      bump(fn->calls);
      cell.release();
    } catch (...) {
      bump(fn->calls);
      cell.release();
      auto e = failure_of(f, node_, std::current_exception());
      out_.set_error(e);
      return after_failure(f, ctx, e);
    }
    charge(f, node_, 1);
    return true;
  }

 private:
  Slot<X>& in_;
  Slot<Y>& out_;
  const NodeRun& node_;
};

// Of the errors a request met on several branches, the one to answer it with: a stage's
// failure first (it names the branch that failed), then an expiry, a shed, a cancel.
inline const std::shared_ptr<const RequestError>* worse_error(
    const std::shared_ptr<const RequestError>* a, const std::shared_ptr<const RequestError>* b) {
  if (a == nullptr) return b;
  if (b == nullptr) return a;
  return static_cast<int>((*b)->kind) < static_cast<int>((*a)->kind) ? b : a;
}

// A join node: its callable on every input's value, once all are there.
template <class Y, class F, class... Xs>
class JoinOp final : public OpBase {
 public:
  JoinOp(F f, Slot<Y>& out, const NodeRun& node, Slot<Xs>&... ins)
      : f_(std::move(f)), out_(out), node_(node), ins_(ins...) {}
  bool run(InFlight& fr, SegmentCtx& ctx) override {
    const std::shared_ptr<const RequestError>* err = nullptr;
    bool all_skipped = true, any_skipped = false;
    std::apply(
        [&](auto&... in) {
          ((err = in.get().error ? worse_error(err, &in.get().error) : err), ...);
          ((all_skipped = all_skipped && in.get().skipped), ...);
          ((any_skipped = any_skipped || in.get().skipped), ...);
        },
        ins_);
    if (err != nullptr) {
      out_.set_error(*err);
      return true;
    }
    if (all_skipped) {
      out_.set_skipped();
      return true;
    }
    if (any_skipped) {  // not reached: the builder refuses a join whose inputs some request skips
      out_.set_error(failure_of(
          fr, node_,
          std::make_exception_ptr(Error("a branch of the join was skipped by a route"))));
      return true;
    }
    if (auto dead = check_live(fr, node_)) {
      out_.set_error(std::move(dead));
      return true;
    }
    try {
      out_.set(timed(fr, node_, 1, [&] {
        return std::apply([&](auto&... in) { return f_(in.get().take()...); }, ins_);
      }));
    } catch (...) {
      auto e = failure_of(fr, node_, std::current_exception());
      out_.set_error(e);
      return after_failure(fr, ctx, e);
    }
    charge(fr, node_, 1);
    return true;
  }

 private:
  F f_;
  Slot<Y>& out_;
  const NodeRun& node_;
  std::tuple<std::reference_wrapper<Slot<Xs>>...> ins_;
};

// A route node: its chooser picks one branch for each request; the others skip it.
template <class X, class C>
class RouteOp final : public OpBase {
 public:
  RouteOp(C choose, Slot<X>& in, std::vector<Slot<X>*> outs, const NodeRun& node)
      : choose_(std::move(choose)), in_(in), outs_(std::move(outs)), node_(node) {}
  bool run(InFlight& f, SegmentCtx& ctx) override {
    if (in_.error || in_.skipped) {
      for (Slot<X>* o : outs_) in_.skipped ? o->set_skipped() : o->set_error(in_.error);
      return true;
    }
    if (auto dead = check_live(f, node_)) {
      for (Slot<X>* o : outs_) o->set_error(dead);
      return true;
    }
    std::size_t k = 0;
    try {
      k = timed(f, node_, 1, [&] { return static_cast<std::size_t>(choose_(*in_.value)); });
      if (k >= outs_.size()) {
        throw Error("route '" + node_.name + "' chose branch " + std::to_string(k) + " of " +
                    std::to_string(outs_.size()) + " (branches are 0.." +
                    std::to_string(outs_.size() - 1) + ")");
      }
    } catch (...) {
      auto e = failure_of(f, node_, std::current_exception());
      for (Slot<X>* o : outs_) o->set_error(e);
      return after_failure(f, ctx, e);
    }
    for (std::size_t i = 0; i < outs_.size(); ++i) {
      if (i == k) {
        outs_[i]->set(in_.take());
      } else {
        outs_[i]->set_skipped();
      }
    }
    charge(f, node_, 1);
    return true;
  }

 private:
  C choose_;
  Slot<X>& in_;
  std::vector<Slot<X>*> outs_;
  const NodeRun& node_;
};

// A merge node: the one branch a route chose (its value or its error).
template <class T>
class MergeOp final : public OpBase {
 public:
  MergeOp(std::vector<Slot<T>*> ins, Slot<T>& out) : ins_(std::move(ins)), out_(out) {}
  bool run(InFlight&, SegmentCtx&) override {
    const std::shared_ptr<const RequestError>* err = nullptr;
    for (Slot<T>* in : ins_) {
      if (in->skipped) continue;
      if (in->error) {
        err = worse_error(err, &in->error);
        continue;
      }
      out_.set(in->take());
      return true;
    }
    if (err != nullptr) {
      out_.set_error(*err);
    } else {
      out_.set_skipped();
    }
    return true;
  }

 private:
  std::vector<Slot<T>*> ins_;
  Slot<T>& out_;
};

// Where a replica's answers go (the Responder's side of the last segment).
template <class Out>
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  virtual void put(const RequestMeta& meta, Response<Out>&& r) = 0;
  virtual void begin_batch() {}
  virtual void end_batch() {}
};

// The stream's output node: answers the client.
template <class T>
class OutputOp final : public OpBase {
 public:
  OutputOp(Slot<T>& in, ResponseSink<T>& sink, const NodeRun& node)
      : in_(in), sink_(sink), node_(node) {}
  bool run(InFlight& f, SegmentCtx&) override {
    Response<T> r;
    r.id = f.meta.id;
    r.version = f.meta.version;
    r.priority = f.meta.priority;
    r.index = f.meta.part;
    r.final = !f.meta.partial;
    if (in_.error) {
      r.error = in_.error;
      r.final = true;
    } else if (in_.skipped || !in_.has_value()) {
      r.error = failure_of(
          f, node_,
          std::make_exception_ptr(Error("no branch answered it (every route skipped it)")));
    } else {
      r.value.emplace(in_.take());
    }
    sink_.put(f.meta, std::move(r));
    return true;
  }

 private:
  Slot<T>& in_;
  ResponseSink<T>& sink_;
  const NodeRun& node_;
};

}  // namespace bspflow::detail
