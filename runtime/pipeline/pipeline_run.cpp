// Pipeline::Impl::run_local (see bspflow/pipeline/pipeline.hpp): one run of the compiled
// programs on this instance's devices, and the result assembled from what they did.
#include <algorithm>
#include <stop_token>

#include "bspflow/pipeline/detail/pipeline_impl.hpp"
#include "bspflow/pipeline/pipeline.hpp"

namespace bspflow {

PipelineResult Pipeline::Impl::run_local(InfeedQueue<Batch>& infeed,
                                         std::uint64_t device_iterations,
                                         OutfeedQueue<std::vector<float>>* outfeed,
                                         const std::stop_token& stop) {
  Impl& im = *this;
  const std::uint64_t steps = device_iterations;  // a step: K micro-batches, one update
  im.ended_replica = 0;
  const std::uint32_t replicas = im.config.replicas;
  if (infeed.replicas() != replicas) {
    throw Error("infeed has " + std::to_string(infeed.replicas()) +
                " replica lane(s) but the pipeline has " + std::to_string(replicas) +
                " replica(s) (InfeedConfig::replicas = " + std::to_string(replicas) + ")");
  }
  if (outfeed != nullptr && outfeed->replicas() != replicas) {
    throw Error("outfeed has " + std::to_string(outfeed->replicas()) +
                " replica(s) but the pipeline has " + std::to_string(replicas) +
                " (OutfeedConfig::replicas = " + std::to_string(replicas) + ")");
  }
  // Attach the feeds: stage 0 of each replica reads its lane, the last stage writes. Claimed
  // here first, so a refusal (a lane or the outfeed already taken) releases what was claimed.
  std::vector<OutfeedQueue<std::vector<float>>::Writer> writers;
  {
    std::vector<InfeedQueue<Batch>::Reader> readers;
    readers.reserve(replicas);
    for (std::uint32_t r = 0; r < replicas; ++r) readers.push_back(infeed.reader(r));
    if (outfeed != nullptr) writers = outfeed->begin_run();
    for (std::uint32_t r = 0; r < replicas; ++r)
      im.run_of(r, 0).reader.emplace(std::move(readers[r]));
  }
  for (std::uint32_t r = 0; r < replicas; ++r) {
    Impl::StageRun& last = im.run_of(r, im.stages - 1);
    last.writer = outfeed != nullptr ? &writers[r] : nullptr;
    for (std::uint32_t s = 0; s < im.stages; ++s) {
      Impl::StageRun& sr = im.run_of(r, s);
      sr.fifo.clear();
      sr.cycle = sr.next_cycle = sr.step = sr.micro_batch = 0;
      sr.max_fifo = 0;
      sr.forwards = 0;
      sr.taken = sr.last_take = 0;
      sr.ended = sr.done = sr.got = false;
      sr.out_id[0].id = sr.out_id[1].id = sr.in_id = -1;
      sr.end_cycle.store(Impl::StageRun::kNever,
                         std::memory_order_relaxed);  // relaxed: no device runs yet
      sr.accumulated = 0;
      sr.updates = 0;
      sr.apply = true;
      std::fill(sr.accum.begin(), sr.accum.end(), 0.0f);
    }
  }
  im.cost_passes();
  const Clock::time_point start = Clock::now();
  for (auto& srp : im.runs) {  // the host link: free, and every I/O-tile buffer empty
    Impl::StageRun& sr = *srp;
    sr.link.start(start);
    sr.synthetic_ready = false;
    sr.polled_empty = false;
  }
  for (auto& h : im.handoffs) h->reset();
  // The host's own wait: handing the last stage's staged answers to the outfeed when the
  // devices are done. A stopped run stops it at once (they go in past the bound, or are
  // dropped and counted), and so does a stop requested while it waits for a reader.
  StopFlag host_stop;
  std::stop_callback on_stop(stop, [&host_stop, outfeed]() noexcept {
    host_stop.set();
    if (outfeed != nullptr) outfeed->wake_all();
  });
  auto detach = [&](bool deliver) {
    for (std::uint32_t r = 0; r < replicas; ++r) {
      im.run_of(r, 0).reader.reset();  // prefetched micro-batches go back to the lane
      im.run_of(r, im.stages - 1).writer = nullptr;
    }
    if (!deliver) host_stop.set();
    for (auto& w : writers) w.finish(deliver, &host_stop);
  };

  // Inference, after a stop or a failure: micro-batches taken but not answered go back to
  // the front of their lanes, oldest first, for the next run (all but `failed`, the one a
  // stage threw on, which the StageError names). Returns how many went back.
  auto give_back = [&](std::optional<std::pair<std::uint32_t, std::uint64_t>> failed) {
    std::uint64_t returned = 0;
    // Synthetic data: the ring holds copies of one micro-batch, which do not go back.
    if (im.config.training || im.config.synthetic_data) return returned;
    for (std::uint32_t r = 0; r < replicas; ++r) {
      Impl::StageRun& head = im.run_of(r, 0);
      std::vector<Batch>& ring = im.batches[r];
      for (std::uint64_t j = im.run_of(r, im.stages - 1).forwards; j < head.taken; ++j) {
        if (failed && failed->first == r && failed->second == j) continue;
        head.reader->put_back(std::move(ring[j % ring.size()]));
        ++returned;
      }
    }
    return returned;
  };

  std::vector<Program> programs;
  EngineResult er;
  PipelineResult result;
  auto host_link_figures = [&] {
    for (const auto& srp : im.runs) {
      result.host_bytes_in += srp->link.bytes_in();
      result.host_bytes_out += srp->link.bytes_out();
      result.host_wait += srp->link.waited();
    }
  };
  std::optional<EndOfInput> ended;
  try {
    im.plan.micro_batches = im.config.training ? im.k() : im.k() * steps;
    programs = im.compile(steps);
    auto wake = [&im, &infeed, outfeed] {
      for (auto& h : im.handoffs) h->wake();
      infeed.wake_all();
      if (outfeed != nullptr) outfeed->wake_all();
      if (im.across) im.across->wake();
    };
    if (im.across && im.config.training) {
      // This thread makes the exchanges across instances while the devices run.
      er = im.engine->run(
          programs, wake, [&im](const StopFlag& flag) { im.across->serve(flag); }, stop);
    } else {
      er = im.engine->run(programs, wake, nullptr, stop);
    }
  } catch (const DeviceError& e) {
    if (!im.config.training) {
      // A stage threw: the micro-batches around it were good and go back to the infeed.
      try {
        if (e.cause()) std::rethrow_exception(e.cause());
      } catch (const StageError& se) {
        const std::uint64_t returned = give_back(std::pair{se.replica(), se.micro_batch()});
        detach(false);
        throw StageError(std::string(se.what()) + " (" + std::to_string(returned) +
                             " other micro-batch(es) in flight went back to the infeed)",
                         se.stage(), se.device(), se.replica(), se.step(), se.micro_batch(),
                         se.cause());
      } catch (...) {
      }
      give_back(std::nullopt);
    }
    detach(false);
    if (e.cause()) {
      try {
        std::rethrow_exception(e.cause());
      } catch (const StageError&) {
        throw;
      } catch (const EndOfInput& end) {
        ended = end;
        im.ended_replica = end.replica;
      } catch (...) {
      }
    }
    if (!ended) throw;
  } catch (const StallError&) {
    // Stopped as by a cancel (OnStall::kFail): inference gives back what was in flight.
    give_back(std::nullopt);
    detach(false);
    throw;
  } catch (...) {
    detach(false);
    throw;
  }
  if (!im.config.training) {
    // Inference: every micro-batch taken was answered unless the run was stopped.
    const bool stopped = er.status == RunStatus::kCancelled;
    const std::uint64_t returned = stopped ? give_back(std::nullopt) : 0;
    detach(!stopped);
    std::uint64_t taken = 0, fewest = ~std::uint64_t{0}, dropped = 0;
    bool infeed_ended = false;
    for (std::uint32_t r = 0; r < replicas; ++r) {
      const Impl::StageRun& head = im.run_of(r, 0);
      const std::uint64_t answered = im.run_of(r, im.stages - 1).forwards;
      taken += head.taken;
      result.micro_batches += answered;
      fewest = std::min(fewest, answered);
      infeed_ended = infeed_ended || (head.ended && head.taken < im.plan.micro_batches);
      if (r < writers.size()) dropped += writers[r].dropped();
    }
    result.elapsed = er.elapsed;
    result.modeled = er.modeled;
    host_link_figures();
    result.fifo_depth.assign(im.stages, 0);
    result.iterations = fewest / im.k();
    result.status = stopped        ? RunStatus::kCancelled
                    : infeed_ended ? RunStatus::kEndOfData
                                   : RunStatus::kCompleted;
    const std::string asked = std::to_string(im.plan.micro_batches * replicas);
    if (stopped) {
      result.message = "cancelled: " + std::to_string(result.micro_batches) + " of " +
                       std::to_string(taken) + " micro-batch(es) taken were answered; " +
                       std::to_string(returned) + " went back to the infeed";
    } else if (infeed_ended) {
      result.message = "the infeed ended after " + std::to_string(taken) + " of " + asked +
                       " micro-batch(es); all " + std::to_string(result.micro_batches) +
                       " were answered";
    } else {
      result.message = "answered all " + asked + " micro-batch(es)";
    }
    if (dropped != 0) {
      result.message += "; " + std::to_string(dropped) +
                        " answer(s) were dropped: the stop came while the outfeed was full";
    }
    return result;
  }
  if (!ended) detach(er.completed());
  for (std::uint32_t s = 0; s < im.stages; ++s)
    result.fifo_depth.push_back(im.run_of(0, s).max_fifo);
  for (std::uint32_t r = 0; r < replicas; ++r)
    result.micro_batches += im.run_of(r, im.stages - 1).forwards;
  result.elapsed = er.elapsed;
  result.modeled = er.modeled;
  host_link_figures();
  if (ended) {
    result.status = RunStatus::kEndOfData;
    result.iterations = ended->step;
    result.message = "the infeed ended at step " + std::to_string(ended->step) + ", micro-batch " +
                     std::to_string(ended->micro_batch) + " of " + std::to_string(im.k()) + ": " +
                     std::to_string(ended->step) + " step(s) applied; the cut-short step (" +
                     std::to_string(ended->micro_batch) + " micro-batch(es) per replica) was not";
    return result;
  }
  result.status = er.status;
  // Training: the steps whose update every stage of every replica applied.
  result.iterations = ~std::uint64_t{0};
  for (const auto& srp : im.runs) result.iterations = std::min(result.iterations, srp->updates);
  result.message = er.message;
  return result;
}

}  // namespace bspflow
