/// @file
/// Many emulated IPUs: a model split into stages over devices (pipelined, sharded or all on
/// one device), replicated, with gradient accumulation, compiled to one program per device
/// and run by the Engine. Holds the Pipeline, its config (PipelineConfig), the Stage a user
/// writes, the schedule as numbers (PipelinePlan) and what a run returns (PipelineResult).
/// Guide: runtime/pipeline/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/data/batch.hpp"
#include "bspflow/devices/device.hpp"
#include "bspflow/devices/link_model.hpp"
#include "bspflow/feeds/infeed_queue.hpp"
#include "bspflow/feeds/outfeed_queue.hpp"
#include "bspflow/pipeline/memory.hpp"
#include "bspflow/run/options.hpp"
#include "bspflow/run/run_result.hpp"
#include "bspflow/run/stall.hpp"
#include "bspflow/run/trace.hpp"

namespace bspflow {

/// Where the stages run: pipelined (stage s on its own device, all stages busy at once),
/// sharded (on their own devices, one stage at a time) or single (a replica's stages all on
/// one device).
enum class ExecutionStrategy { kPipelined, kSharded, kSingle };
/// When each stage runs each micro-batch's forward and backward pass.
enum class PipelineSchedule { kGrouped, kInterleaved, kSequential };
/// bsp: every cycle the stages of a replica compute, sync, then exchange over the modeled
/// device link; dataflow: neighbouring stages hand off through bounded queues, without a
/// global barrier.
enum class SyncMode { kBsp, kDataflow };
/// How gradients are combined over micro-batches and replicas (PopTorch's
/// accumulationAndReplicationReductionType): Mean (default) or Sum.
enum class ReductionType { kMean, kSum };
/// With Mean: a running mean updated each micro-batch, or the sum divided once at the end
/// (PopTorch's meanAccumulationAndReplicationReductionStrategy; Post is the default).
enum class MeanStyle { kPost, kRunning };
/// "pipelined", "sharded" or "single".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(ExecutionStrategy v) noexcept;
/// "grouped", "interleaved" or "sequential".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(PipelineSchedule v) noexcept;
/// "bsp" or "dataflow".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(SyncMode v) noexcept;

/// Where a stage's pass runs (passed by const reference, valid for that call).
struct StageContext {
  std::uint32_t stage = 0;        ///< the stage's index in its replica, from 0
  std::uint32_t device = 0;       ///< the id of the device it runs on (Device::id())
  std::uint32_t replica = 0;      ///< the replica (this instance's), from 0
  std::uint64_t step = 0;         ///< 0-based step of this run
  std::uint64_t micro_batch = 0;  ///< within the step
  /// PipelineConfig::precision.storage: with kFloat16 the runtime rounds activations and
  /// gradients to half precision where it stores them; a stage keeping its weights in the
  /// same precision rounds them itself (say, after update()).
  DType storage = DType::kFloat32;
};

/// A pass's arguments. The spans and references point into runtime buffers: valid for that
/// call only.
struct ForwardArgs {
  const Batch& batch;            ///< the micro-batch: data (stage 0's input), labels, valid
  std::span<const float> input;  ///< the previous stage's output (empty for stage 0)
  std::span<float> output;       ///< this stage's output: output_elements() values
  /// What backward will need: kept in the activation FIFO (training). In inference nothing is
  /// kept: it is a vector of the stage's own, cleared before each pass (filled with assign or
  /// push_back, its room serves the next pass).
  std::vector<float>& saved;
};
/// A backward pass's arguments. The spans and references point into runtime buffers: valid
/// for that call only.
struct BackwardArgs {
  const Batch& batch;  ///< the micro-batch, as the forward pass got it
  /// As the forward pass saw it. Empty for stage 0, and for a stage whose memory() says
  /// backward_reads_input = false (unless PipelineConfig::recompute, which keeps inputs).
  std::span<const float> input;
  const std::vector<float>& saved;     ///< as the forward pass left it (recomputed if asked)
  std::span<const float> grad_output;  ///< d loss / d output (empty for the last stage)
  std::span<float> grad_input;         ///< to fill: d loss / d input (empty for stage 0)
  std::span<float> gradients;          ///< to fill: this micro-batch's parameter gradients
};

/// What a stage keeps on its device, in elements, for the Pipeline's memory plan (the
/// Pipeline multiplies by the bytes of the storage type; optimiser state is fp32).
/// A plain value type.
struct StageMemory {
  /// A field left at kAuto is not declared: the Pipeline works it out (see each field).
  static constexpr std::size_t kAuto = ~std::size_t{0};
  /// Weights. kAuto: gradient_elements().
  std::size_t parameters = kAuto;
  /// The optimiser's state. kAuto: optimizer_state().size().
  std::size_t optimizer_state = kAuto;
  /// What the forward pass keeps in ForwardArgs::saved per micro-batch (the activation
  /// stash holds one per micro-batch in flight; with recomputation, one while backward
  /// runs). kAuto: not declared (the stash counts the stage's inputs only). When declared,
  /// a forward pass that saves more throws bspflow::Error.
  std::size_t saved = kAuto;
  /// Scratch a pass needs while it runs (not always live).
  std::size_t working = 0;
  /// Whether backward reads BackwardArgs::input. A stage that keeps what it needs of its
  /// input in `saved` (or needs none of it) says false: the activation stash then holds no
  /// copy of its input per micro-batch in flight (saving that memory and a copy of every
  /// input on the stage's device), and backward gets an empty input. With
  /// PipelineConfig::recompute the stash keeps inputs regardless (the forward pass runs again
  /// from them) and backward gets them.
  bool backward_reads_input = true;
};

/// What a real IPU does for one stage, for the modeled clock (see
/// bspflow/devices/device_model.hpp): one micro-batch's forward and backward passes and one
/// optimiser step, each spread over its device's compute tiles. A pass left unset declares no
/// cost: it costs nothing in modeled time and is counted in ModeledTime::undeclared.
struct StageCost {
  /// One micro-batch's forward pass.
  std::optional<Work> forward, backward, update;  ///< one optimiser step
  /// \var backward
  /// One micro-batch's backward pass.
};

/// One pipeline stage (a forward function, a backward function and its parameters and
/// optimiser state); each replica has its own. The passes (forward, backward, update) and,
/// during a run, optimizer_state() are called on the stage's device thread only, one call at
/// a time. name(), output_elements() and gradient_elements() (and, with offload_optimizer,
/// optimizer_state()) are also called on the host thread by the Pipeline constructor and
/// run(), while no pass runs. What a pass throws stops the run: Pipeline::run() throws it
/// as StageError (what was thrown is its cause()). The tags below say what the Pipeline
/// expects of an override: `any` marks a member called on the host thread and the device
/// thread, never two calls at once. The queries below the destructor are not declared
/// noexcept (that would oblige every override to say so too): an override should not throw
/// from them, and one that does fails the Pipeline call that asked (its constructor or run()).
class Stage {
 public:
  /// Called by the Pipeline's destructor (or its constructor, when it fails).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  virtual ~Stage() = default;
  /// Names the stage in the trace and in errors.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  virtual std::string name() const = 0;
  /// Values this stage outputs per micro-batch (fixed: IPU programs have static shapes;
  /// read once, at construction, and must be at least 1). The last stage's output is what
  /// the outfeed receives (say, loss and correct count).
  /// Contract: host; non-blocking; no-alloc; throws what the override throws.
  virtual std::size_t output_elements() const = 0;
  /// Size of the parameter gradient (0: nothing to train). Read once, at construction.
  /// Contract: host; non-blocking; no-alloc; throws what the override throws.
  virtual std::size_t gradient_elements() const { return 0; }
  /// What the stage holds on its device (see StageMemory; the default declares nothing
  /// beyond gradient_elements() weights and optimizer_state()). Read once, at construction.
  /// Contract: host; non-blocking; no-alloc; throws what the override throws.
  virtual StageMemory memory() const { return {}; }
  /// What the passes cost on a real IPU at `precision` (the run's: PipelineConfig::precision
  /// as WorkPrecision), for the modeled clock. Called once per run. The default declares
  /// nothing.
  /// Contract: host; non-blocking; no-alloc; throws what the override throws.
  virtual StageCost cost(WorkPrecision precision) const {
    (void)precision;
    return {};
  }
  /// Fills args.output (and args.saved, for backward). What it throws stops the run.
  /// Contract: device; non-blocking; allocates; throws Error.
  virtual void forward(const StageContext& ctx, ForwardArgs& args) = 0;
  /// Training only. Fills grad_input and gradients (zeroed before the call). What it throws
  /// stops the run. The default throws bspflow::Error (the stage has no backward pass).
  /// Contract: device; non-blocking; allocates; throws Error.
  virtual void backward(const StageContext& ctx, BackwardArgs& args);
  /// Training only, once per step: the optimiser step with the micro-batch gradients reduced
  /// over the step and the replicas (identical on every replica). What it throws stops the
  /// run. The default does nothing.
  /// Contract: device; non-blocking; allocates; throws Error.
  virtual void update(const StageContext& ctx, std::span<const float> gradients);
  /// The optimiser state update() uses (say AdamW's moments; empty: none). With
  /// PipelineConfig::offload_optimizer it lives in host memory between updates: the runtime
  /// streams it in just before update() and out just after, and zeroes this memory meanwhile.
  /// Must return the same span (size) every time.
  /// Contract: any; non-blocking; no-alloc; throws what the override throws.
  virtual std::span<float> optimizer_state() { return {}; }
  /// The values update() changes (the weights; empty, the default: none). Called on the host
  /// thread, and on the device thread between updates; must return the same span (size)
  /// every time. Only a distributed Pipeline reads it: it broadcasts instance 0's weights
  /// (and optimiser state) to every instance at construction and compares a checksum of them
  /// across instances every PipelineConfig::weight_check_interval steps. A stage that returns
  /// nothing is neither broadcast nor checked.
  /// Contract: any; non-blocking; no-alloc; throws what the override throws.
  virtual std::span<float> weights() { return {}; }
};
/// One replica's stages, in pipeline order.
using StageList = std::vector<std::unique_ptr<Stage>>;
/// Makes replica r's stages (every replica must start from the same weights). Called on the
/// host thread by the Pipeline constructor, for r = 0, 1, ... in order; must return the same
/// number of stages, none null, every time. What it throws, the constructor throws.
using StageFactory = std::function<StageList(std::uint32_t replica)>;

/// A Pipeline's shape: the host side (HostIO, below) and the Pipeline's own fields.
/// PipelineConfig::from(options) derives one from a run's Options. A plain value type;
/// Pipeline copies it. validate() states the rules.
///
/// The host side (HostIO): host_link carries stage 0's micro-batches in (data and labels),
/// the last stage's outputs out, and optimiser state offload. io_tiles per device (0, or even
/// and below the devices' tiles): with them the host link moves up to prefetch_depth
/// micro-batches ahead of stage 0 (and outputs off the last stage) while the devices compute;
/// without, stage 0 waits for each micro-batch's copy and the last stage for each output's.
/// Their memory (io_tiles x bytes per tile) is in every device's memory plan and must hold
/// prefetch_depth micro-batches. synthetic_data: no host copies (the upper bound on
/// throughput): stage 0 takes one micro-batch per replica from its lane when a run starts
/// and every micro-batch of the run is a copy of it, already on the device; nothing else is
/// read from the infeed, and nothing goes back to it on a cancel. Outputs still reach the
/// outfeed, without link time.
struct PipelineConfig : HostIO {
  /// Where the stages run: pipelined, sharded or single.
  ExecutionStrategy strategy = ExecutionStrategy::kPipelined;
  /// Unset (the default): each strategy's own, Grouped for pipelined and Sequential for sharded
  /// and single (which run one stage at a time). Sharded and single over several stages take
  /// only Sequential: another schedule is refused, since they cannot honour it.
  std::optional<PipelineSchedule> schedule;
  /// How a replica's stages exchange: BSP supersteps, or dataflow hand-off.
  SyncMode sync = SyncMode::kBsp;
  /// K: micro-batches per step; >= min_gradient_accumulation(stages).
  std::uint32_t gradient_accumulation = 1;
  /// How gradients are combined over micro-batches and replicas: mean or sum.
  ReductionType reduction = ReductionType::kMean;
  /// With kMean: the sum divided once at the end (kPost), or a running mean.
  MeanStyle mean = MeanStyle::kPost;
  std::uint32_t replicas = 1;  ///< >= 1
  bool training = true;        ///< false: inference, forward passes only
  /// Device mapping (PopTorch's Stage/Block placement on IPUs): stage s of a replica runs on
  /// that replica's device device_mapping[s]. Consecutive stages may share a device, which
  /// then runs their passes one after another in each cycle (their exchange is a local
  /// copy). Empty (the default): stage s on device s. One entry per stage, starting at 0 and
  /// rising by 0 or 1 from one stage to the next; strategy pipelined or sharded, bsp sync.
  std::vector<std::uint32_t> device_mapping;
  bool recompute = false;  ///< keep only stage inputs; recompute the rest for backward
  /// How tensors are stored (fp32 or fp16) and accumulated, and static loss scaling.
  Precision precision{};
  /// Training: keep each stage's optimiser state in host memory, streamed in before each
  /// update and out after it over the host link (stream copies in the trace).
  bool offload_optimizer = false;
  /// Activations and gradients between devices; the Engine validates both links.
  LinkModel device_link = LinkModel::device();
  bool trace = false;  ///< also on with BSPFLOW_TRACE=FILE
  /// When no device moves while every device still running waits (stage 0 for the infeed,
  /// the last stage for outfeed room, a stage for its neighbour or a sync), for stall.limit:
  /// the run logs what each waits for; with OnStall::kFail it also ends (as after cancel())
  /// and run() throws StallError (see bspflow/run/stall.hpp). 0 = no check. A serving
  /// run idle on an open infeed counts as stalled: set 0, or a limit past your idle spells.
  StallCheck stall;
  /// Training over several instances (processes launched by mpirun; see instance.hpp):
  /// `replicas` is this instance's local replicas (InstanceLayout::local_replicas), and the
  /// gradients are reduced in two levels, over the local replicas in process and then across
  /// every instance (one MPI_Allreduce per bucket, see exchange_bucket_bytes, made in place
  /// by the device thread whose gradients complete the bucket), so every replica of every
  /// instance applies the same update. The constructor checks every instance built the same
  /// pipeline and broadcasts instance 0's weights (Stage::weights()) and optimiser state;
  /// run() ends every instance at the same step with a status that names the instance that
  /// stopped. The constructor and run() are collectives: every
  /// instance makes them, in the same order, one distributed Pipeline at a time, with no
  /// other collective (Instance, MPI) made meanwhile. With one instance (no mpirun) the same
  /// machinery runs and every exchange is the identity: the weights are those of a plain
  /// run. Inference only checks the pipelines match (each instance answers its own
  /// requests). Must be the same in every instance.
  bool distributed = false;
  /// distributed: a checksum of every stage's weights is compared across instances every
  /// this many steps (counted over all runs; 0: never): a mismatch ends the run in every
  /// instance (InstanceError). Default: every step in a debug build of bspflow, every 100
  /// otherwise (the checksum rides on the step's all-reduce; its cost is one pass over the
  /// weights).
  std::optional<std::uint32_t> weight_check_interval;
  /// distributed training: the gradients cross instances in buckets, one MPI_Allreduce each,
  /// made in the order the backward pass frees them (the last stage's device slot first), so
  /// a bucket is reduced while the earlier stages still compute (PyTorch DDP's bucketing).
  /// Consecutive device slots share a bucket until it holds at least this many bytes; slot
  /// 0's closes the last one. 0: a bucket per slot. Default 25 MiB (DDP's bucket_cap_mb): each
  /// extra bucket costs a call (about 80 us over TCP on loopback here), which pays only when
  /// the earlier stages' remaining backward pass is long enough to hide a bucket (see
  /// runtime/pipeline/README.md). Must be the same in every instance.
  std::size_t exchange_bucket_bytes = std::size_t{25} << 20;

  /// The pipeline's config from a run's Options: host_io(), device_link, replicas,
  /// gradient_accumulation, precision, the stall check. Throws what Options::validate()
  /// throws.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static PipelineConfig from(const Options& options);

  /// Devices the strategy needs for `stages` stages: devices_per_replica x replicas.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::uint32_t devices_needed(std::uint32_t stages) const noexcept;
  /// Devices one replica's stages use: single 1; else the device mapping's last entry + 1
  /// (without one: stages).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::uint32_t devices_per_replica(std::uint32_t stages) const noexcept;
  /// The schedule the pipeline runs: `schedule`, or when unset Grouped for pipelined and
  /// Sequential for sharded and single.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  PipelineSchedule effective_schedule() const noexcept;
  /// The smallest gradient accumulation for which the schedule reaches a steady state where
  /// every stage is busy in a cycle: Grouped 2N-1, Interleaved N, Sequential 1 (training;
  /// inference: 1, since all device iterations x K micro-batches of a run flow through one
  /// filled pipeline).
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::uint32_t min_gradient_accumulation(std::uint32_t stages) const noexcept;
  /// Throws bspflow::Error naming the field, the value and what is allowed (or the fields
  /// that conflict): stages 0, replicas 0, a bad precision, what the Engine refuses (odd
  /// io_tiles, prefetch_depth outside 1..255, a bad link), a device mapping of the wrong
  /// length, not starting at 0, skipping or going back, or with strategy single or dataflow
  /// sync, K below min_gradient_accumulation, a schedule other than Sequential with sharded
  /// or single over several stages, dataflow without pipelined.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  void validate(std::uint32_t stages) const;
};

/// One cycle of one stage: which micro-batch it runs forward and/or backward (-1: none).
struct CycleWork {
  std::int64_t forward = -1;   ///< the micro-batch it runs forward
  std::int64_t backward = -1;  ///< the micro-batch it runs backward
};
/// The schedule as numbers (tests and tools use it; the runtime compiles from it). A plain
/// value type.
/// Contract of every member: any; non-blocking; no-alloc; noexcept.
struct PipelinePlan {
  /// The schedule the numbers are for.
  PipelineSchedule schedule = PipelineSchedule::kGrouped;
  std::uint32_t stages = 1;         ///< N: stages per replica
  std::uint64_t micro_batches = 1;  ///< K (inference: every micro-batch of the run)
  bool training = true;             ///< false: forward passes only
  /// Cycles of one step (inference: of the whole run).
  std::uint64_t cycles() const noexcept;
  /// What `stage` (< stages) runs in `cycle`.
  CycleWork at(std::uint32_t stage, std::uint64_t cycle) const noexcept;
  /// Inputs a stage keeps between a forward pass and its backward pass, beyond the current
  /// one: 2(N-1-s), N-1-s, 0 (for K large enough; inference: 0).
  std::uint32_t fifo_depth(std::uint32_t stage) const noexcept;
};

/// A stage threw: which stage, on which device and replica, at which step and micro-batch.
/// Pipeline::run() throws it on the host thread once every device has stopped; cause() is
/// what the stage threw.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class StageError : public Error {
 public:
  /// The message, where the stage failed, and what it threw.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  StageError(const std::string& message, std::uint32_t stage, std::uint32_t device,
             std::uint32_t replica, std::uint64_t step, std::uint64_t micro_batch,
             std::exception_ptr cause)
      : Error(message), stage_(stage), device_(device), replica_(replica), step_(step),
        micro_batch_(micro_batch), cause_(std::move(cause)) {}
  /// The stage that threw, by its index in the replica.
  std::uint32_t stage() const noexcept { return stage_; }
  /// The id of the device it ran on.
  std::uint32_t device() const noexcept { return device_; }
  /// Its replica (this instance's).
  std::uint32_t replica() const noexcept { return replica_; }
  /// The step of the run it threw in, from 0.
  std::uint64_t step() const noexcept { return step_; }
  /// The micro-batch within that step.
  std::uint64_t micro_batch() const noexcept { return micro_batch_; }
  /// What the stage threw.
  const std::exception_ptr& cause() const noexcept { return cause_; }

 private:
  std::uint32_t stage_, device_, replica_;
  std::uint64_t step_, micro_batch_;
  std::exception_ptr cause_;
};

/// What Pipeline::run() returns: how the run ended (RunResult: status kCompleted, kEndOfData
/// or kCancelled, message, elapsed wall time of the Engine run, the host link: bytes of
/// micro-batches in (data and labels) and of outputs out (none with synthetic data), and how
/// long devices waited for it: stage 0 for input, the last stage for room to put outputs; an
/// input-bound pipeline shows there), and what it did. A plain value type.
struct PipelineResult : RunResult {
  /// Device iterations completed (training: weights updated), per replica (the fewest any
  /// device completed).
  std::uint64_t iterations = 0;
  /// Forward passes of the last stage, all replicas (inference: micro-batches answered).
  std::uint64_t micro_batches = 0;
  /// Per stage (replica 0): the most inputs its activation FIFO held while a forward pass
  /// added one — compare with PipelinePlan::fifo_depth.
  std::vector<std::uint32_t> fifo_depth;
};

/// Runs a model split into stages over a group of devices. One run at a time: run() must
/// not be called again (from any thread) before it returns.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Pipeline {
 public:
  /// Builds every replica's stages (make_stages(r)), checks the config against the stage
  /// count and the devices (the group needs devices_needed(); extra devices stay idle), plans
  /// every device's memory (memory()) and holds it in the device arenas, and starts the
  /// Engine (its I/O engine thread). The group must outlive the Pipeline. Distributed: a
  /// collective, it waits until every instance has built its Pipeline. Throws
  /// bspflow::Error naming the field, the value and what is allowed for a bad config or
  /// link, and bspflow::Error saying what is wrong for too few devices, an empty factory, a
  /// null stage, a stage with output_elements() 0 or replicas with different stage counts;
  /// PipelineOutOfMemoryError (an OutOfMemoryError, a bspflow::Error) if a device cannot
  /// hold its tensors: it names the device, the largest holders and what would help, and
  /// carries the whole report; whatever make_stages throws.
  /// Contract: host; blocks; allocates; throws Error.
  Pipeline(const DeviceList& devices, const PipelineConfig& config,
           const StageFactory& make_stages);
  /// Not during run(). Stops the Engine's I/O thread, waiting until it has returned, and
  /// frees the stages and buffers.
  /// Contract: host; blocks; no-alloc; noexcept.
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs `device_iterations` steps: each replica takes K micro-batches per step from its
  /// infeed lane (stage 0 pops them); the last stage's output of every micro-batch goes to
  /// `outfeed` (one lane per replica, shaped by its OutputMode; iteration = step x K + i).
  /// Waits until every device has stopped, so the infeed must already hold the
  /// micro-batches (or be closed) or be fed by another thread, and a bounded outfeed must be
  /// read by another thread or hold every entry (nothing here reads it, and nothing checks).
  /// A stopped run (cancel(), the stop token, a failure) never waits for that reader: the
  /// answers the last stage still holds go in past the bound (or, with one reader and its
  /// spare room full, are dropped and counted in the message), and a stop requested while
  /// run() waits at the end for room ends that wait. Allocates the compiled programs and,
  /// with an outfeed, one vector per micro-batch.
  ///
  /// Throws, before anything runs, bspflow::Error if the infeed or outfeed replica count
  /// differs from the config's replicas, an infeed lane already has a reader or the outfeed
  /// is already attached to a run (having let go of every lane it had claimed). A stage
  /// exception is thrown as StageError after every device has stopped; any other device
  /// failure as DeviceError; a stall with OnStall::kFail as StallError. An infeed that ends
  /// mid-run ends it with kEndOfData; a step cut short is not applied (the message says how
  /// many micro-batches it dropped). cancel() ends it with kCancelled.
  ///
  /// Distributed training (PipelineConfig::distributed): a collective; every instance must
  /// call it with the same device_iterations (else every instance throws bspflow::Error). A
  /// step is applied in every instance or in none: when one instance stops (end of data,
  /// cancel, a stage exception), every instance stops at the same step boundary with the
  /// same `iterations` and a message naming that instance. The instance whose stage threw
  /// throws StageError (its message starts with the instance); the others throw
  /// InstanceError naming that instance, its replica, the step and its message. Weights
  /// that no longer match (weight_check_interval) end every instance with InstanceError. An
  /// MPI error is thrown as bspflow::Error.
  ///
  /// Inference (training = false): stage 0 takes up to device_iterations x K micro-batches
  /// as they arrive, so a large count makes a serving loop that ends when the infeed ends.
  /// Every micro-batch taken is answered before the run returns kEndOfData (micro_batches
  /// says how many). After a cancel or a StageError, the good micro-batches still in flight
  /// go back to the front of their lanes, oldest first, for the next run; the one a stage
  /// threw on does not (the error names it).
  /// Contract: host; blocks; allocates; throws Error.
  PipelineResult run(InfeedQueue<Batch>& infeed, std::uint64_t device_iterations,
                     OutfeedQueue<std::vector<float>>* outfeed = nullptr);
  /// Like run(infeed, device_iterations, outfeed); the run also stops when `stop` is
  /// requested: before the call, while the run is set up, or while the devices run (as
  /// cancel() does). Stopped before any device started, it returns kCancelled having taken
  /// nothing from the infeed (0 iterations, 0 micro-batches). Waits and throws as that
  /// overload does. (Distributed: a stop in one instance stops them all at the same step
  /// boundary, as cancel() does.)
  /// Contract: host; blocks; allocates; throws Error.
  PipelineResult run(InfeedQueue<Batch>& infeed, std::uint64_t device_iterations,
                     OutfeedQueue<std::vector<float>>* outfeed, std::stop_token stop);

  /// Stops the run of the run() call in progress, from the moment run() is called until it
  /// returns (a cancel() while the run is set up is never lost); run() returns kCancelled
  /// (inference: the micro-batches in flight go back to the infeed). Between runs it does
  /// nothing: to stop a run that may not have started yet, give run() a std::stop_token.
  void cancel() noexcept;

  /// The config the Pipeline was built with.
  const PipelineConfig& config() const noexcept;
  /// Stages per replica.
  std::uint32_t stages() const noexcept;
  /// Replica r's stage s (read its weights between runs). Throws bspflow::Error naming both
  /// indices and the counts if either is out of range.
  /// Contract: host; non-blocking; no-alloc; throws Error.
  Stage& stage(std::uint32_t replica, std::uint32_t s);
  /// Between runs: the schedule (after an inference run: that run's, over all its
  /// micro-batches).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  const PipelinePlan& plan() const noexcept;
  /// Every device's tensors as the constructor planned and allocated them.
  const MemoryReport& memory() const noexcept;
  /// Between runs: the last run's trace (nullptr when tracing is off or before the first
  /// run).
  /// Contract: host; non-blocking; no-alloc; noexcept.
  const Trace* trace() const noexcept;
  /// Between runs: the last run's summary (empty when tracing is off).
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  TraceSummary summary() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bspflow
