// program::FusedRepeat and program::LoopFrame: machinery for loops::repeat, not API. A
// FusedRepeat is a Program node (the Program constructor takes one) that loops::repeat
// compiles its typed feeds and body to; the names stay in namespace program so the
// interpreter and the loop compiler spell them as they spell the other nodes. Included by
// bspflow/engine/program.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "bspflow/base/stop_flag.hpp"
#include "bspflow/devices/modeled_clock.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

struct ComputeContext;  // bspflow/engine/program.hpp

namespace program {

// What the interpreter hands a FusedRepeat's loop: where it runs, when to stop, where to
// record, and the counters it advances.
struct LoopFrame {
  ComputeContext* ctx;        // ctx->iteration: set by the loop to the trip in progress
  const StopFlag* stop;       // checked by the loop before each trip and in every wait
  TraceTrack* track;          // null when untraced
  std::uint32_t label;        // the trace label of the loop's compute (its name)
  std::uint64_t* trips_done;  // advanced by the loop after each completed trip
  ModeledClock* clock;        // the device's modeled clock, advanced by the loop's trips
};
// Repeat(count, {StreamCopy in, Execute(name), StreamCopy out}) compiled into one function
// that runs every trip: what loops::repeat compiles its typed feeds and body to, so the
// interpreter does not walk a tree (or call through a std::function) once per element.
// Only as a whole device program (not inside another node).
struct FusedRepeat {
  using Loop = std::function<RunStatus(const LoopFrame&)>;
  // `loop` runs the trips and says how it ended: kCompleted, kEndOfData (its input ended)
  // or kCancelled (stop requested); an exception is a failure at ctx->iteration.
  // `finish(deliver)` runs once on the device thread when the run ends (deliver: it neither
  // failed nor was cancelled), before the host hears the end.
  FusedRepeat(std::string name, std::uint64_t count, Loop loop, std::function<void(bool)> finish);
  std::string name;
  std::uint64_t count;
  Loop loop;
  std::function<void(bool)> finish;
};

}  // namespace program
}  // namespace bspflow
