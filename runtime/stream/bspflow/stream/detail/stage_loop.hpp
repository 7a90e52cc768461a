// Internal to streams (installed because the stream templates use it): one segment's loop on
// its device thread. It takes each request from its source (or a batch of them, when a batch
// stage heads the segment) and runs its ops for it in the graph's order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bspflow/stream/detail/batch.hpp"
#include "bspflow/stream/detail/generation.hpp"
#include "bspflow/stream/detail/ops.hpp"
#include "bspflow/stream/detail/segment.hpp"

namespace bspflow::detail {

class Segment {
 public:
  std::uint32_t replica = 0;
  std::uint32_t device_index = 0;              // the device (in the stream's DeviceList) it runs on
  std::unique_ptr<Source> source;              // where each request starts here
  std::unique_ptr<BatchHeadBase> batch;        // the batch stage heading it, if any
  std::unique_ptr<GenerateHeadBase> generate;  // the generate stage heading it, if any
  std::vector<std::unique_ptr<OpBase>> ops;    // in the graph's order (after the batch stage)
  std::vector<HopBase*> exports;               // closed when the loop ends
  std::function<void()> begin_batch, end_batch;  // the output's per-batch notifications
  Incoming incoming;                 // the request the source gave last (TakeOp reads it)
  const NodeRun* first = nullptr;    // the node whose queue wait the source records
  const NodeRun* held_at = nullptr;  // names a request held here when the run stops
  ReplicaMeter* replica_meter = nullptr;
  ResponderBase* responder_base = nullptr;
  bool timing = false;
  bool from_input = false;    // its source is the admission queue (modeled arrival = the push)
  bool answer_early = false;  // a batch's early errors are answered, not forwarded (a chain)
  bool abort_on_failure = false;
  StreamClock::time_point origin{};

  // Device thread: serves requests until its source ends or the run stops.
  void run(const WaitPolicy& policy, OnError on_error, StreamRunState& state) {
    SegmentCtx ctx{&policy, &state, on_error, abort_on_failure};
    try {
      if (batch) {
        serve_batches(ctx);
      } else if (generate) {
        serve_generation(ctx);
      } else {
        serve(ctx);
      }
    } catch (...) {  // the runtime itself failed (not a stage): end the run, say why
      state.fail(runtime_failure(std::current_exception()));
    }
    for (HopBase* p : exports) p->close();
  }

 private:
  void start_frame(InFlight& f, const RequestMeta& meta) {
    f.meta = meta;
    f.timing = timing;
    f.origin = origin;
    f.failure.reset();
    f.modeled =
        from_input ? static_cast<double>(std::max<std::int64_t>(0, (meta.arrival - origin).count()))
                   : meta.modeled_ns;
    if (timing) {
      f.t = StreamClock::now();
      if (first != nullptr && first->meter != nullptr) {
        const auto w = (f.t - meta.enqueued).count();
        first->meter->wait.record(static_cast<std::uint64_t>(w > 0 ? w : 0));
      }
    }
  }

  // Runs the ops for the request in flight; false when the run must stop.
  bool run_ops(InFlight& f, SegmentCtx& ctx, std::size_t from) {
    for (std::size_t i = from; i < ops.size(); ++i) {
      if (!ops[i]->run(f, ctx)) {
        answer_held(f.meta, f.failure);
        return false;
      }
    }
    return true;
  }

  void serve(SegmentCtx& ctx) {
    const StopFlag& stop = ctx.state->stop;
    InFlight f;
    for (;;) {
      if (stop.requested()) return;
      if (!source->try_next(incoming) && !source->next(incoming, *ctx.policy, stop)) return;
      start_frame(f, incoming.meta);
      if (!run_ops(f, ctx, 0)) return;
    }
  }

  void serve_batches(SegmentCtx& ctx) {
    const StopFlag& stop = ctx.state->stop;
    const std::function<void()> nothing = [] {};
    InFlight f;
    for (;;) {
      if (stop.requested()) return;
      if (!batch->collect(*source, *ctx.policy, stop, nothing)) return;
      const std::size_t n = batch->size();
      if (answer_early) {
        // A chain: requests that will not run (expired, cancelled, would finish late, failed
        // earlier) are answered now, not after the batch: their clients learn at once.
        for (std::size_t i = 0; i < n; ++i) {
          if (batch->early_error(i) != nullptr) {
            responder_base->answer_error(batch->meta(i), batch->early_error(i));
          }
        }
      }
      InFlight bf;
      bf.timing = timing;
      bf.origin = origin;
      bf.t = StreamClock::now();
      batch->run(bf);
      struct Notify {
        Segment& s;
        explicit Notify(Segment& seg) : s(seg) {
          if (s.begin_batch) s.begin_batch();
        }
        ~Notify() {
          if (s.end_batch) s.end_batch();
        }
      } notify(*this);
      for (std::size_t i = 0; i < n; ++i) {
        if (answer_early && batch->early_error(i) != nullptr) continue;  // answered above
        f.meta = batch->meta(i);
        f.timing = timing;
        f.origin = origin;
        f.failure.reset();
        f.modeled = f.meta.modeled_ns;
        f.t = bf.t;
        batch->fill(i);
        if (!run_ops(f, ctx, 0)) {
          for (std::size_t k = i + 1; k < n; ++k) {
            if (answer_early && batch->early_error(k) != nullptr) continue;
            answer_held(batch->meta(k), batch->early_error(k));
          }
          batch->clear();
          return;
        }
      }
      batch->clear();
    }
  }

  // The generate stage's iterations: each output it makes runs the segment's ops as an
  // occurrence of its request. On a stop, the sequences it holds are answered.
  void serve_generation(SegmentCtx& ctx) {
    InFlight f;
    const GenerateHeadBase::Emit emit = [&](const RequestMeta& meta) {
      f.meta = meta;
      f.timing = timing;
      f.origin = origin;
      f.failure.reset();
      f.modeled = meta.modeled_ns;
      if (timing) f.t = StreamClock::now();
      return run_ops(f, ctx, 0);
    };
    const std::function<void()> batch_begin = [&] {
      if (begin_batch) begin_batch();
    };
    const std::function<void()> batch_end = [&] {
      if (end_batch) end_batch();
    };
    bool served = false;
    try {
      served = generate->serve(*source, *ctx.policy, ctx.state->stop, emit, batch_begin, batch_end);
    } catch (...) {  // the runtime failed: what the stage holds is answered all the same
      generate->answer_held([&](const RequestMeta& meta) { answer_held(meta, nullptr); });
      throw;
    }
    if (!served) {
      generate->answer_held([&](const RequestMeta& meta) { answer_held(meta, nullptr); });
    }
  }

  std::shared_ptr<const RequestError> runtime_failure(const std::exception_ptr& e) const;
  // On a stop, a request held here is answered: with `error` if it has one (a fail-fast
  // failure), else kCancelled.
  void answer_held(const RequestMeta& meta, std::shared_ptr<const RequestError> error);
};

}  // namespace bspflow::detail
