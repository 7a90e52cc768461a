// Programs, Poplar-style: a small tree a device interprets, and the Engine that runs one
// program per device with the host link modeled and every phase traced.
//
//   DeviceGroup devices(2);
//   Engine engine(devices, EngineConfig{.io_tiles = 32, .prefetch_depth = 2});
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

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "bspflow/detail/wait.hpp"
#include "bspflow/device.hpp"
#include "bspflow/infeed_queue.hpp"
#include "bspflow/link_model.hpp"
#include "bspflow/options.hpp"
#include "bspflow/outfeed_queue.hpp"
#include "bspflow/run.hpp"
#include "bspflow/tensor.hpp"
#include "bspflow/trace.hpp"

namespace bspflow {

// Memory in one device's arena, typed as `elements` of a DType. Counts against the device's
// memory budget (OutOfMemoryError if it does not fit). Zero-filled at creation.
class DeviceBuffer {
 public:
  DeviceBuffer(Device& device, std::string name, DType dtype, std::size_t elements);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  Device& device() const noexcept { return *device_; }
  const std::string& name() const noexcept { return name_; }
  DType dtype() const noexcept { return dtype_; }
  std::size_t elements() const noexcept { return elements_; }
  std::size_t bytes() const noexcept { return elements_ * dtype_size(dtype_); }
  std::span<std::byte> raw() noexcept { return {data_, bytes()}; }
  std::span<const std::byte> raw() const noexcept { return {data_, bytes()}; }
  // The elements as E (uint8_t, uint16_t for fp16, float, int32_t). Throws bspflow::Error
  // if E does not match dtype().
  template <class E>
  std::span<E> as() {
    static_assert(kIsElement<E>, "DeviceBuffer::as<E>: E must be uint8_t, uint16_t (fp16), "
                                 "float or int32_t");
    if (dtype_of<E>() != dtype_) throw_mismatch(dtype_of<E>());
    return {reinterpret_cast<E*>(data_), elements_};
  }

 private:
  [[noreturn]] void throw_mismatch(DType asked) const;

  Device* device_;
  std::string name_;
  DType dtype_;
  std::size_t elements_;
  std::byte* data_;
};
using Buffer = std::shared_ptr<DeviceBuffer>;
Buffer make_buffer(Device& device, std::string name, DType dtype, std::size_t elements);

// Where an Execute's vertex runs.
struct ComputeContext {
  std::uint32_t device = 0;
  std::uint32_t replica = 0;         // the device's index in the engine's device list
  std::uint64_t iteration = 0;       // trip of the outermost Repeat (0 outside one)
  std::uint32_t compute_tiles = 0;   // tiles - io_tiles
  // The run's stop request: a codelet that waits for something must give up when it is set
  // (and be woken by the waker passed to Engine::run).
  const detail::StopFlag* stop = nullptr;
};
// The share of an Execute's work items one tile gets: [begin, end).
struct TileWork {
  std::uint32_t tile = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
};

// A barrier across `participants` devices. The arrival count and the generation share one
// atomic word, so the last arrival opens the barrier on the cache line it already holds
// (one line moves between cores per arrival and one per release, the least a barrier
// can do). Waiting spins briefly (tunables::kSpinBudget), then parks, so it is live with
// more devices than cores.
class SyncGroup {
 public:
  explicit SyncGroup(std::uint32_t participants);
  // Device thread. Returns when every participant has arrived (true), or when `stop` is set
  // (false; the group is then unusable for this run). Spin::kYield for a device that shares
  // its core: it gives the core to the others between checks.
  bool arrive_and_wait(const detail::StopFlag& stop, detail::Spin spin = detail::Spin::kTight);
  // Any thread: wakes parked participants so they re-check their stop flag.
  void wake() noexcept { point_.notify(); }
  // Between runs only (nobody waiting): forgets arrivals of a run that was stopped midway.
  void reset() noexcept { state_.store(0, std::memory_order_relaxed); }  // relaxed: no waiters
  std::uint32_t participants() const noexcept { return participants_; }

 private:
  static constexpr std::uint64_t kCountMask = 0xffff'ffffu;  // low half: arrivals this round
  static std::uint64_t generation(std::uint64_t state) noexcept { return state >> 32; }

  const std::uint32_t participants_;
  alignas(tunables::kCacheLine) std::atomic<std::uint64_t> state_{0};  // generation << 32 | arrivals
  detail::WaitPoint point_;
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
  std::string name;
  std::size_t work_items = 0;
  Vertex vertex;                                       // set by the first constructor
  std::function<void(const ComputeContext&)> codelet;  // set by the second
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
  RemoteCopy(std::string name, bool to_host, std::function<std::size_t(const ComputeContext&)> copy);
  std::string name;
  bool to_host;
  std::function<std::size_t(const ComputeContext&)> copy;
};
struct Repeat {
  Repeat(std::uint64_t count, Program body);
  std::uint64_t count;
  std::vector<Program> body;  // one element (a vector only to break the type cycle)
};
// What the interpreter hands a FusedRepeat's loop: where it runs, when to stop, where to
// record, and the counters it advances.
struct LoopFrame {
  ComputeContext* ctx;              // ctx->iteration: set by the loop to the trip in progress
  const detail::StopFlag* stop;     // checked by the loop before each trip and in every wait
  TraceTrack* track;                // null when untraced
  std::uint32_t label;              // the trace label of the loop's compute (its name)
  std::uint64_t* trips_done;        // advanced by the loop after each completed trip
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
                            program::FusedRepeat, program::RemoteCopy>;
  Program(program::Sequence n);    // NOLINT: implicit, like Poplar's program classes
  Program(program::Execute n);     // NOLINT
  Program(program::Sync n);        // NOLINT
  Program(program::Copy n);        // NOLINT
  Program(program::StreamCopy n);  // NOLINT
  Program(program::Repeat n);      // NOLINT
  Program(program::RepeatWhile n); // NOLINT
  Program(program::FusedRepeat n); // NOLINT
  Program(program::RemoteCopy n);  // NOLINT
  const Node& node() const noexcept { return *node_; }

 private:
  std::shared_ptr<const Node> node_;
};

// What replaces host data when synthetic data is on: nothing is copied from the host, the
// device fills each stream-copy destination once, seeded differently per device and replica.
enum class SyntheticData { kOff, kZeros, kRandomNormal };

struct EngineConfig {
  std::uint32_t io_tiles = 0;            // 0, or even, below the device's tiles, >= one micro-batch
  std::uint32_t prefetch_depth = 1;      // 1..255: micro-batches the I/O tiles move ahead
  LinkModel host_link = LinkModel::host();
  LinkModel device_link = LinkModel::device();
  SyntheticData synthetic = SyntheticData::kOff;
  std::uint64_t seed = 0;                // for kRandomNormal
  bool trace = false;                    // record a trace (also on if BSPFLOW_TRACE is set)
  std::string trace_path;                // write it here after each run (BSPFLOW_TRACE=FILE)

  // From Options: io_tiles, prefetch_depth, synthetic data (random normal).
  static EngineConfig from(const Options& options);
  // Field ranges; throws bspflow::Error naming the field, the value and what is allowed.
  void validate() const;
};

struct EngineResult {
  RunStatus status = RunStatus::kCompleted;
  std::vector<std::uint64_t> iterations;  // outermost Repeat trips completed, per device
  std::string message;
  std::chrono::nanoseconds elapsed{0};    // wall time of the run
  bool completed() const noexcept { return status == RunStatus::kCompleted; }
};

class Engine {
 public:
  // Setup path. Validates the config (throws bspflow::Error) and starts the I/O engine
  // thread. The devices must outlive the engine.
  Engine(DeviceList devices, EngineConfig config = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Host thread. Runs programs[d] on device d (or one program on every device), blocks
  // until all have ended. Checks the programs first: I/O tiles must hold the largest
  // host->device micro-batch, sync groups must match the devices using them, buffers must
  // be on the device that runs them (throws bspflow::Error with a suggestion). A vertex or
  // codelet exception stops every device and is thrown as DeviceError (device, replica,
  // iteration); every thread is left idle.
  EngineResult run(const std::vector<Program>& programs);
  EngineResult run(const Program& program);
  // Like run(programs), for codelets that wait on something of their own: `wake` (any
  // thread, must not throw) is called when the run stops early, after the stop flag is set,
  // so whatever they wait on can let them see it.
  EngineResult run(const std::vector<Program>& programs, std::function<void()> wake);

  // Any thread. Stops the current run (if any) at each device's next Repeat trip or wait;
  // run() then returns RunStatus::kCancelled. Never blocks for long, never throws.
  void cancel() noexcept;

  // The last run's trace (nullptr when tracing is off or before the first run).
  const Trace* trace() const noexcept;
  // The last run's summary (empty when tracing is off).
  TraceSummary summary() const;

  const EngineConfig& config() const noexcept;
  std::uint32_t devices() const noexcept;
  std::uint32_t compute_tiles() const noexcept;  // per device: tiles - io_tiles
  // Whether the I/O engine thread runs with 1 ns timer slack.
  bool low_timer_slack() const noexcept;

  // The I/O-tile count the rule of thumb gives for one micro-batch of `bytes` on a device
  // like `config`: the smallest even power of two >= 1.05 x bytes / bytes per tile (at least
  // 2). nullopt when even the largest allowed count (below the tile count) cannot hold it.
  static std::optional<std::uint32_t> suggest_io_tiles(std::size_t bytes,
                                                       const DeviceConfig& config);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace detail {
// Device thread: runs `program` (a FusedRepeat) as replica `replica` of a run that
// `control` tracks, through the same interpreter as Engine::run, for loops built elsewhere
// (loops::repeat). Records into `track` if it is not null. A failure goes to
// control.fail(); the end is reported through control.replica_done().
void run_on_device(Device& device, std::uint32_t replica, const Program& program,
                   RunControl& control, TraceTrack* track);
// Host thread, instead of run_on_device when the device refused the job: finishes the
// program's loops without delivering and reports the replica's end.
void abandon_on_device(Device& device, std::uint32_t replica, const Program& program,
                       RunControl& control) noexcept;
}  // namespace detail

}  // namespace bspflow
