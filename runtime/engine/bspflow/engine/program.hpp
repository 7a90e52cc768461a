/// @file
/// Programs, Poplar-style: the nodes of a small tree a device interprets (Sequence, Execute,
/// Sync, Copy, StreamCopy, RemoteCopy, AllReduce, Repeat, RepeatWhile), the Program that holds
/// one, and what a vertex sees (ComputeContext, TileWork). The Engine
/// (`<bspflow/engine/engine.hpp>`) runs one program per device.
/// Guide: runtime/engine/README.md.
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
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

/// Where an Execute's vertex runs.
struct ComputeContext {
  std::uint32_t device = 0;         ///< the device's id (Device::id())
  std::uint32_t replica = 0;        ///< the device's index in the engine's device list
  std::uint64_t iteration = 0;      ///< trip of the outermost Repeat (0 outside one)
  std::uint32_t compute_tiles = 0;  ///< tiles - io_tiles
  /// The run's stop request: a codelet that waits for something must give up when it is set
  /// (and be woken by the waker passed to Engine::run).
  const StopFlag* stop = nullptr;
};
/// The share of an Execute's work items one tile gets: [begin, end).
struct TileWork {
  std::uint32_t tile = 0;  ///< the compute tile, 0..compute_tiles-1
  std::size_t begin = 0;   ///< its first work item
  std::size_t end = 0;     ///< one past its last work item
};

class Program;

namespace program {
/// Runs its steps in order.
struct Sequence {
  /// The steps of a braced list.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  Sequence(std::initializer_list<Program> steps);
  /// The steps of a vector.
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  explicit Sequence(std::vector<Program> steps);
  std::vector<Program> steps;  ///< run in this order
};
/// A compute set, run by the device thread.
struct Execute {
  /// Called once per tile that got work items, with its share.
  using Vertex = std::function<void(const ComputeContext&, const TileWork&)>;
  /// `work_items` split evenly over the compute tiles, `vertex` called once per tile that got
  /// some; work_items = 0: called once for the whole device (tile 0, range [0, 0)). Throws
  /// bspflow::Error if `vertex` is empty.
  /// Contract: host; non-blocking; allocates; throws Error.
  Execute(std::string name, std::size_t work_items, Vertex vertex);
  /// `codelet` called once for the whole device. Throws bspflow::Error if it is empty.
  /// Contract: host; non-blocking; allocates; throws Error.
  Execute(std::string name, std::function<void(const ComputeContext&)> codelet);
  /// Declares what a real IPU does for this compute set (the modeled clock, see
  /// bspflow/devices/device_model.hpp): with work_items, `cost` is one item's (each compute
  /// tile does its share; the busiest sets the time); without, the whole set's, spread over
  /// the compute tiles. A Work that declares nothing (Work{}) says the step costs nothing
  /// (say, a codelet that only moves host data). Undeclared (the default), the step costs
  /// nothing in modeled time and is counted in ModeledTime::undeclared. Returns *this.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  Execute& declare(Work cost) & noexcept {
    this->cost = cost;
    return *this;
  }
  /// declare() on a temporary (`Execute(...).declare(cost)`). Returns *this, moved.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  Execute&& declare(Work cost) && noexcept {
    this->cost = cost;
    return std::move(*this);
  }
  /// The compute set's label in the trace.
  std::string name;
  /// Items split over the compute tiles (0: the codelet, or one vertex call for the device).
  std::size_t work_items = 0;
  Vertex vertex;                                       ///< set by the first constructor
  std::function<void(const ComputeContext&)> codelet;  ///< set by the second
  std::optional<Work> cost;                            ///< declare()
};
/// A barrier across the devices of a SyncGroup; every participant's program must sync on it.
struct Sync {
  /// Throws bspflow::Error if `group` is null.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  explicit Sync(std::shared_ptr<SyncGroup> group);
  std::shared_ptr<SyncGroup> group;  ///< the barrier every participant arrives at
};
/// A copy between device buffers; between devices it also takes the device link's modeled
/// time.
struct Copy {
  /// Throws bspflow::Error if a buffer is null or the two differ in dtype or size.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Copy(Buffer src, Buffer dst);
  /// The buffer copied from.
  Buffer src, dst;  ///< the buffer copied into
};
/// A copy between host and device over the modeled host link.
struct StreamCopy {
  /// Host -> device: the next tensor of the replica's infeed lane into `dst` (same dtype and
  /// byte size, checked when it arrives). Reading past a closed, drained infeed ends the
  /// device's program with RunStatus::kEndOfData. Throws bspflow::Error if `dst` is null.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  StreamCopy(InfeedQueue<Tensor>& from, Buffer dst);
  /// Device -> host: `src` as a tensor into the outfeed, shaped by its OutputMode with the
  /// outermost Repeat's trip as the iteration. Throws bspflow::Error if `src` is null.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  StreamCopy(Buffer src, OutfeedQueue<Tensor>& to);
  InfeedQueue<Tensor>* infeed = nullptr;    ///< host -> device: the infeed read (else null)
  OutfeedQueue<Tensor>* outfeed = nullptr;  ///< device -> host: the outfeed written (else null)
  Buffer buffer;                            ///< the device side: `dst` or `src`
};
/// A copy between device memory and host memory the program owns (Poplar's remote buffers:
/// offloaded optimiser state, weights): `copy` moves the data and returns the bytes it moved;
/// the device then takes the host link's modeled time for them (StreamCopyMid in the trace,
/// direction `to_host`).
struct RemoteCopy {
  /// Throws bspflow::Error if `copy` is empty.
  /// Contract: host; non-blocking; allocates; throws Error.
  RemoteCopy(std::string name, bool to_host,
             std::function<std::size_t(const ComputeContext&)> copy);
  std::string name;  ///< the copy's label in the trace
  bool to_host;      ///< the direction: true from device to host
  /// Moves the data and returns the bytes it moved.
  std::function<std::size_t(const ComputeContext&)> copy;
  /// Takes its modeled time to the end even when the run stops (and the Sequence goes on):
  /// for work that must complete once started (a distributed training step's tail).
  bool finish_on_stop = false;
};
/// The data movement of an all-reduce across `replicas` devices, one AllReduce on each of
/// them (between two Syncs of their group, so no one reads a peer's gradients early): the
/// device takes the device link's modeled time for a ring all-reduce of the bytes `bytes`
/// returns, its own contribution (LinkModel::ring_allreduce). The summing itself is an
/// Execute before it. Exchange in the trace, labelled `name`. `replicas` must be the size of
/// the group of the Sync it runs after (or, with none before it, the first Sync after it):
/// Engine::run refuses another count before anything runs. Without any Sync it is modelled
/// time alone.
struct AllReduce {
  /// Throws bspflow::Error if `replicas` is outside 1..tunables::kMaxReplicas or `bytes` is
  /// empty.
  /// Contract: host; non-blocking; allocates; throws Error.
  AllReduce(std::string name, std::uint32_t replicas,
            std::function<std::size_t(const ComputeContext&)> bytes);
  std::string name;        ///< the exchange's label in the trace
  std::uint32_t replicas;  ///< the devices taking part (the size of the Sync's group)
  /// Returns this device's contribution, in bytes.
  std::function<std::size_t(const ComputeContext&)> bytes;
  bool finish_on_stop = false;  ///< as RemoteCopy::finish_on_stop
};
/// Runs its body `count` times.
struct Repeat {
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  Repeat(std::uint64_t count, Program body);
  std::uint64_t count;        ///< trips of the body
  std::vector<Program> body;  ///< one element (a vector only to break the type cycle)
};
/// Runs its body while a condition holds, at most a number of trips.
struct RepeatWhile {
  /// Runs body while condition(context) holds, checked before each trip; at most
  /// `max_trips` trips (a guard against a condition that never turns false). Throws
  /// bspflow::Error if `condition` is empty.
  /// Contract: host; non-blocking; allocates; throws Error.
  RepeatWhile(std::function<bool(const ComputeContext&)> condition, Program body,
              std::uint64_t max_trips = UINT64_MAX);
  /// Checked before each trip: the body runs while it returns true.
  std::function<bool(const ComputeContext&)> condition;
  std::vector<Program> body;  ///< one element (a vector only to break the type cycle)
  std::uint64_t max_trips;    ///< the most trips, whatever the condition says
};
}  // namespace program

/// One node of a program tree, held shared: copying a Program copies a pointer. Each node
/// type converts to a Program implicitly, like Poplar's program classes.
/// Contract of every member: host; non-blocking; allocates; throws bad_alloc, unless tagged.
class Program {
 public:
  /// The node types a program tree is made of.
  using Node = std::variant<program::Sequence, program::Execute, program::Sync, program::Copy,
                            program::StreamCopy, program::Repeat, program::RepeatWhile,
                            program::FusedRepeat, program::RemoteCopy, program::AllReduce>;
  // Each node converts to a program implicitly, as Poplar's program classes do: a tree is
  // written as nested nodes (NOLINT below: google-explicit-constructor).
  /// A program of one Sequence node.
  Program(program::Sequence n);  // NOLINT(google-explicit-constructor)
  /// A program of one Execute node.
  Program(program::Execute n);  // NOLINT(google-explicit-constructor)
  /// A program of one Sync node.
  Program(program::Sync n);  // NOLINT(google-explicit-constructor)
  /// A program of one Copy node.
  Program(program::Copy n);  // NOLINT(google-explicit-constructor)
  /// A program of one StreamCopy node.
  Program(program::StreamCopy n);  // NOLINT(google-explicit-constructor)
  /// A program of one Repeat node.
  Program(program::Repeat n);  // NOLINT(google-explicit-constructor)
  /// A program of one RepeatWhile node.
  Program(program::RepeatWhile n);  // NOLINT(google-explicit-constructor)
  /// A program of one FusedRepeat node.
  Program(program::FusedRepeat n);  // NOLINT(google-explicit-constructor)
  /// A program of one RemoteCopy node.
  Program(program::RemoteCopy n);  // NOLINT(google-explicit-constructor)
  /// A program of one AllReduce node.
  Program(program::AllReduce n);  // NOLINT(google-explicit-constructor)
  /// The node this program is.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  const Node& node() const noexcept { return *node_; }

 private:
  std::shared_ptr<const Node> node_;
};

}  // namespace bspflow
