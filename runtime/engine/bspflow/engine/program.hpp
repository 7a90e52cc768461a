// Programs, Poplar-style: a small tree a device interprets (the Engine in
// bspflow/engine/engine.hpp runs one program per device, with the host link modeled and every
// phase traced).
//
//   DeviceGroup devices(2);
//   EngineConfig config;  // or EngineConfig::from(options)
//   config.io_tiles = 32;
//   Engine engine(devices, config);
//   Buffer x0 = make_buffer(devices[0], "x", DType::kFloat32, 1024);
//   Program p0 = program::Repeat(100, program::Sequence{
//       program::StreamCopy(infeed, x0),                 // host -> device
//       program::Execute("scale", 1024, [&](const ComputeContext&, TileWork w) { ... }),
//       program::Sync(group),                           // barrier across devices
//       program::Copy(x0, y1),                          // exchange to another device
//       program::StreamCopy(x0, outfeed)});             // device -> host
//   EngineResult r = engine.run({p0, p1});
//
// Nodes: Sequence (in order), Execute (a compute set: work items partitioned over the
// device's compute tiles, run by the device thread), Sync (a barrier across a SyncGroup of
// devices), Copy (memcpy between device buffers; between devices it also takes the modeled
// device-link time), StreamCopy (host <-> device over the modeled host link), Repeat(n) and
// RepeatWhile(condition).
//
// Stream copies. With io_tiles = 0 the device does the copy before it computes: it waits for
// the host's data (StreamCopyBegin), the I/O engine moves it and takes the link's modeled
// time (StreamCopyMid), and the device hands it over (StreamCopyEnd). With io_tiles > 0 the
// I/O engine moves up to prefetch_depth micro-batches ahead into I/O-tile buffers while the
// device computes; the device's StreamCopy waits only if the next one is not there yet
// (StreamCopyBegin) and then copies it from the I/O tiles (StreamCopyEnd). Outbound copies
// likewise: the device drops its result into a free I/O-tile buffer and computes on.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "bspflow/base/stop_flag.hpp"
#include "bspflow/data/tensor.hpp"
#include "bspflow/devices/device_model.hpp"
#include "bspflow/engine/detail/fused_repeat.hpp"
#include "bspflow/engine/device_buffer.hpp"
#include "bspflow/engine/sync_group.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/run/detail/run_control.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

// Where an Execute's vertex runs.
struct ComputeContext {
  std::uint32_t device = 0;
  std::uint32_t replica = 0;        // the device's index in the engine's device list
  std::uint64_t iteration = 0;      // trip of the outermost Repeat (0 outside one)
  std::uint32_t compute_tiles = 0;  // tiles - io_tiles
  // The run's stop request: a codelet that waits for something must give up when it is set
  // (and be woken by the waker passed to Engine::run).
  const StopFlag* stop = nullptr;
};
// The share of an Execute's work items one tile gets: [begin, end).
struct TileWork {
  std::uint32_t tile = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
};

class Program;

namespace program {
struct Sequence {
  Sequence(std::initializer_list<Program> steps);
  explicit Sequence(std::vector<Program> steps);
  std::vector<Program> steps;
};
struct Execute {
  using Vertex = std::function<void(const ComputeContext&, const TileWork&)>;
  // `work_items` split evenly over the compute tiles, `vertex` called once per tile that got
  // some; work_items = 0: called once for the whole device (tile 0, range [0, 0)).
  Execute(std::string name, std::size_t work_items, Vertex vertex);
  Execute(std::string name, std::function<void(const ComputeContext&)> codelet);
  // Declares what a real IPU does for this compute set (the modeled clock, see
  // bspflow/devices/device_model.hpp): with work_items, `cost` is one item's (each compute
  // tile does its share; the busiest sets the time); without, the whole set's, spread over
  // the compute tiles. A Work that declares nothing (Work{}) says the step costs nothing
  // (say, a codelet that only moves host data). Undeclared (the default), the step costs
  // nothing in modeled time and is counted in ModeledTime::undeclared. Returns *this.
  Execute& declare(Work cost) & {
    this->cost = cost;
    return *this;
  }
  Execute&& declare(Work cost) && {
    this->cost = cost;
    return std::move(*this);
  }
  std::string name;
  std::size_t work_items = 0;
  Vertex vertex;                                       // set by the first constructor
  std::function<void(const ComputeContext&)> codelet;  // set by the second
  std::optional<Work> cost;                            // declare()
};
struct Sync {
  explicit Sync(std::shared_ptr<SyncGroup> group);
  std::shared_ptr<SyncGroup> group;
};
struct Copy {
  Copy(Buffer src, Buffer dst);  // same dtype and size, else bspflow::Error
  Buffer src, dst;
};
struct StreamCopy {
  // Host -> device: the next tensor of the replica's infeed lane into `dst` (same dtype and
  // byte size, checked when it arrives). Reading past a closed, drained infeed ends the
  // device's program with RunStatus::kEndOfData.
  StreamCopy(InfeedQueue<Tensor>& from, Buffer dst);
  // Device -> host: `src` as a tensor into the outfeed, shaped by its OutputMode with the
  // outermost Repeat's trip as the iteration.
  StreamCopy(Buffer src, OutfeedQueue<Tensor>& to);
  InfeedQueue<Tensor>* infeed = nullptr;
  OutfeedQueue<Tensor>* outfeed = nullptr;
  Buffer buffer;
};
// A copy between device memory and host memory the program owns (Poplar's remote buffers:
// offloaded optimiser state, weights): `copy` moves the data and returns the bytes it moved;
// the device then takes the host link's modeled time for them (StreamCopyMid in the trace,
// direction `to_host`).
struct RemoteCopy {
  RemoteCopy(std::string name, bool to_host,
             std::function<std::size_t(const ComputeContext&)> copy);
  std::string name;
  bool to_host;
  std::function<std::size_t(const ComputeContext&)> copy;
  // Takes its modeled time to the end even when the run stops (and the Sequence goes on):
  // for work that must complete once started (a distributed training step's tail).
  bool finish_on_stop = false;
};
// The data movement of an all-reduce across `replicas` devices, one AllReduce on each of
// them (between two Syncs of their group, so no one reads a peer's gradients early): the
// device takes the device link's modeled time for a ring all-reduce of the bytes `bytes`
// returns, its own contribution (LinkModel::ring_allreduce). The summing itself is an
// Execute before it. Exchange in the trace, labelled `name`. `replicas` must be the size of
// the group of the Sync it runs after (or, with none before it, the first Sync after it):
// Engine::run refuses another count before anything runs. Without any Sync it is modelled
// time alone.
struct AllReduce {
  AllReduce(std::string name, std::uint32_t replicas,
            std::function<std::size_t(const ComputeContext&)> bytes);
  std::string name;
  std::uint32_t replicas;
  std::function<std::size_t(const ComputeContext&)> bytes;
  bool finish_on_stop = false;  // as RemoteCopy::finish_on_stop
};
struct Repeat {
  Repeat(std::uint64_t count, Program body);
  std::uint64_t count;
  std::vector<Program> body;  // one element (a vector only to break the type cycle)
};
struct RepeatWhile {
  // Runs body while condition(context) holds, checked before each trip; at most
  // `max_trips` trips (a guard against a condition that never turns false).
  RepeatWhile(std::function<bool(const ComputeContext&)> condition, Program body,
              std::uint64_t max_trips = UINT64_MAX);
  std::function<bool(const ComputeContext&)> condition;
  std::vector<Program> body;
  std::uint64_t max_trips;
};
}  // namespace program

class Program {
 public:
  using Node = std::variant<program::Sequence, program::Execute, program::Sync, program::Copy,
                            program::StreamCopy, program::Repeat, program::RepeatWhile,
                            program::FusedRepeat, program::RemoteCopy, program::AllReduce>;
  Program(program::Sequence n);     // NOLINT: implicit, like Poplar's program classes
  Program(program::Execute n);      // NOLINT
  Program(program::Sync n);         // NOLINT
  Program(program::Copy n);         // NOLINT
  Program(program::StreamCopy n);   // NOLINT
  Program(program::Repeat n);       // NOLINT
  Program(program::RepeatWhile n);  // NOLINT
  Program(program::FusedRepeat n);  // NOLINT (loops::repeat's; see detail/fused_repeat.hpp)
  Program(program::RemoteCopy n);   // NOLINT
  Program(program::AllReduce n);    // NOLINT
  const Node& node() const noexcept { return *node_; }

 private:
  std::shared_ptr<const Node> node_;
};

}  // namespace bspflow
