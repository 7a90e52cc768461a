// The Engine (see bspflow/engine/engine.hpp): checks a run's programs against the devices
// and the config, sets up the links and one DeviceRun (the interpreter) per device, and
// collects the end.
#include "bspflow/engine/engine.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <stop_token>
#include <string>

#include "bspflow/base/error.hpp"
#include "bspflow/devices/io_engine.hpp"
#include "bspflow/engine/detail/device_run.hpp"
#include "bspflow/run/internal/cancel_gate.hpp"

namespace bspflow {

using Clock = std::chrono::steady_clock;
using detail::DeviceRun;
using detail::EngineState;

// ---- config ----

EngineConfig EngineConfig::from(const Options& options) {
  EngineConfig c;
  static_cast<HostIO&>(c) = options.host_io();
  c.synthetic_fill = SyntheticFill::kRandomNormal;
  c.device_link = options.device_link();
  c.stall = options.stall_check();
  return c;
}

void EngineConfig::validate() const {
  HostIO::validate();
  device_link.validate("device link");
  stall.validate();
}

std::optional<std::uint32_t> Engine::suggest_io_tiles(std::size_t bytes,
                                                      const DeviceConfig& config) noexcept {
  const double need =
      1.05 * static_cast<double>(bytes) / static_cast<double>(config.bytes_per_tile);
  for (std::uint64_t n = 2; n < config.tiles; n *= 2) {
    if (static_cast<double>(n) >= need) return static_cast<std::uint32_t>(n);
  }
  return std::nullopt;
}

namespace {

// One run's shared state: held by every device job and I/O callback of the run, so the
// last one to finish frees it (the host may return before they have all let go).
struct RunShared {
  RunShared(std::uint32_t devices, std::uint64_t requested) : control(devices, requested) {}
  detail::RunControl control;
  std::vector<Program> programs;
  std::vector<std::unique_ptr<DeviceRun>> runs;
  std::map<OutfeedQueue<Tensor>*, std::vector<OutfeedQueue<Tensor>::Writer>> writers;
  std::set<SyncGroup*> groups;
  std::set<InfeedQueue<Tensor>*> infeeds;
};

// What a program uses, gathered before the run.
struct Uses {
  std::vector<const program::StreamCopy*> streams;
  std::vector<const program::Execute*> executes;
  std::vector<std::pair<const void*, std::string>> transfers;  // RemoteCopy, AllReduce: labels
  const program::FusedRepeat* fused = nullptr;                 // only ever the whole program
  std::set<SyncGroup*> groups;
  std::vector<const DeviceBuffer*> buffers;  // buffers the device itself touches
  std::optional<std::uint64_t> outer_count;
  // Each AllReduce and the group of the Sync it runs after (in program order), else of the
  // first Sync after it; null without any Sync: modelled time alone.
  std::vector<std::pair<const program::AllReduce*, SyncGroup*>> all_reduces;
  SyncGroup* last_sync = nullptr;
};

void gather(const Program& p, Uses& u, bool in_repeat, const Program& root) {
  std::visit(
      [&](const auto& n) {
        using N = std::decay_t<decltype(n)>;
        if constexpr (std::is_same_v<N, program::Sequence>) {
          for (const Program& s : n.steps) gather(s, u, in_repeat, root);
        } else if constexpr (std::is_same_v<N, program::Execute>) {
          u.executes.push_back(&n);
        } else if constexpr (std::is_same_v<N, program::Sync>) {
          u.groups.insert(n.group.get());
          u.last_sync = n.group.get();
          for (auto& [reduce, group] : u.all_reduces) {
            if (group == nullptr) group = u.last_sync;  // none before it: the first after
          }
        } else if constexpr (std::is_same_v<N, program::Copy>) {
          u.buffers.push_back(n.dst.get());
        } else if constexpr (std::is_same_v<N, program::StreamCopy>) {
          u.streams.push_back(&n);
          u.buffers.push_back(n.buffer.get());
        } else if constexpr (std::is_same_v<N, program::Repeat>) {
          if (!in_repeat && !u.outer_count) u.outer_count = n.count;
          gather(n.body.front(), u, true, root);
        } else if constexpr (std::is_same_v<N, program::RemoteCopy> ||
                             std::is_same_v<N, program::AllReduce>) {
          u.transfers.emplace_back(&n, n.name);  // host memory, or the device link: a label
          if constexpr (std::is_same_v<N, program::AllReduce>) {
            u.all_reduces.emplace_back(&n, u.last_sync);
          }
        } else if constexpr (std::is_same_v<N, program::FusedRepeat>) {
          if (&n != std::get_if<program::FusedRepeat>(&root.node())) {
            throw Error("FusedRepeat '" + n.name +
                        "' must be a device's whole program, not "
                        "part of a Sequence or Repeat (it runs every trip itself)");
          }
          u.fused = &n;
          u.outer_count = n.count;
        } else {
          gather(n.body.front(), u, true, root);
        }
      },
      p.node());
}

}  // namespace

// ---- Engine ----

struct Engine::Impl : EngineState {
  detail::CancelGate gate;  // cancel(): the run() call in progress
  // How stall reports name a run and its devices (detail::name_runs); empty: the defaults.
  std::string run_name = "Engine::run";
  std::vector<detail::WatchedDevice> watched;
};

Engine::Engine(const DeviceList& devices, EngineConfig config) : impl_(std::make_unique<Impl>()) {
  config.validate();
  if (devices.size() == 0) throw Error("Engine needs at least one device");
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    Device& dev = devices[d];
    if (config.io_tiles >= dev.config().tiles) {
      detail::throw_bad_value("io_tiles", config.io_tiles,
                              "must be below the device's " + std::to_string(dev.config().tiles) +
                                  " tiles (an even number, leaving tiles to compute on)");
    }
    impl_->devices.push_back(&dev);
  }
  if (std::string env = detail::trace_path_from_env(); !env.empty()) {
    config.trace = true;
    if (config.trace_path.empty()) config.trace_path = std::move(env);
  }
  impl_->compute_tiles = impl_->devices.front()->config().tiles - config.io_tiles;
  impl_->config = std::move(config);
  std::vector<std::uint32_t> cores;
  for (Device* d : impl_->devices) {
    if (d->placement().core) cores.push_back(*d->placement().core);
  }
  // The engine spins toward a transfer's end only on a core no device can run on.
  const std::optional<std::uint32_t> io_core = IoEngine::pick_core(cores);
  const bool io_shared = !io_core || cores.size() < impl_->devices.size() ||
                         std::find(cores.begin(), cores.end(), *io_core) != cores.end();
  impl_->io = std::make_unique<IoEngine>(devices.size(), "I/O engine", io_core, io_shared);
}

Engine::~Engine() = default;

EngineResult Engine::run(const Program& program) {
  return run(std::vector<Program>(impl_->devices.size(), program));
}

EngineResult Engine::run(const std::vector<Program>& programs) {
  return run(programs, nullptr);
}

EngineResult Engine::run(const std::vector<Program>& programs, std::function<void()> wake) {
  return run(programs, std::move(wake), nullptr, std::stop_token());
}

EngineResult Engine::run(const std::vector<Program>& programs, std::function<void()> wake,
                         const std::function<void(const StopFlag&)>& host) {
  return run(programs, std::move(wake), host, std::stop_token());
}

EngineResult Engine::run(const Program& program, std::stop_token stop) {
  return run(std::vector<Program>(impl_->devices.size(), program), nullptr, nullptr,
             std::move(stop));
}

EngineResult Engine::run(const std::vector<Program>& programs, std::stop_token stop) {
  return run(programs, nullptr, nullptr, std::move(stop));
}

EngineResult Engine::run(const std::vector<Program>& programs, std::function<void()> wake,
                         const std::function<void(const StopFlag&)>& host, std::stop_token stop) {
  Impl& im = *impl_;
  // From here to the return a cancel() is never lost, and `stop` is watched too.
  detail::CancelGate::Scope scope(im.gate, std::move(stop));
  im.io->wake();  // the run's first transfer must not wait for the engine thread's wake-up
  const auto n = static_cast<std::uint32_t>(im.devices.size());
  if (programs.size() != n) {
    throw Error("Engine::run: " + std::to_string(programs.size()) + " programs for " +
                std::to_string(n) + " devices (give one program per device, or one for all)");
  }
  // Check the programs against the devices and the config.
  std::vector<Uses> uses(n);
  std::map<SyncGroup*, std::uint32_t> group_users;
  for (std::uint32_t d = 0; d < n; ++d) {
    gather(programs[d], uses[d], false, programs[d]);
    for (const DeviceBuffer* b : uses[d].buffers) {
      if (&b->device() != im.devices[d]) {
        throw Error(
            "the program of device " + std::to_string(im.devices[d]->id()) + " uses buffer '" +
            b->name() + "' of device " + std::to_string(b->device().id()) +
            ": stream copies and the destination of a Copy must be on the device that runs them");
      }
    }
    for (SyncGroup* g : uses[d].groups) ++group_users[g];
    // An all-reduce's ring is the devices of the sync group it runs between.
    for (const auto& [reduce, group] : uses[d].all_reduces) {
      if (group != nullptr && reduce->replicas != group->participants()) {
        detail::throw_bad_value("AllReduce '" + reduce->name + "' replicas", reduce->replicas,
                                "must be " + std::to_string(group->participants()) + " on device " +
                                    std::to_string(im.devices[d]->id()) +
                                    ", the participants of the sync group it runs between (the "
                                    "devices that all-reduce together)");
      }
    }
    std::size_t micro_batch = 0;
    std::set<const InfeedQueue<Tensor>*> seen;
    for (const program::StreamCopy* s : uses[d].streams) {
      if (s->infeed && seen.insert(s->infeed).second) micro_batch += s->buffer->bytes();
      if (s->infeed && s->infeed->replicas() != n) {
        throw Error("infeed of buffer '" + s->buffer->name() + "' has " +
                    std::to_string(s->infeed->replicas()) +
                    " replica lane(s) but the engine runs " + std::to_string(n) +
                    " device(s): device d reads lane d (InfeedConfig::replicas = " +
                    std::to_string(n) + ")");
      }
      if (s->outfeed && s->outfeed->replicas() != n) {
        throw Error("outfeed of buffer '" + s->buffer->name() + "' has " +
                    std::to_string(s->outfeed->replicas()) + " replica(s) but the engine runs " +
                    std::to_string(n) +
                    " device(s) (OutfeedConfig::replicas = " + std::to_string(n) + ")");
      }
    }
    const DeviceConfig& dc = im.devices[d]->config();
    if (im.config.io_tiles > 0 && micro_batch > 0 &&
        static_cast<double>(im.config.io_tiles) * static_cast<double>(dc.bytes_per_tile) <
            1.05 * static_cast<double>(micro_batch)) {
      const auto suggestion = suggest_io_tiles(micro_batch, dc);
      throw Error("io_tiles = " + std::to_string(im.config.io_tiles) + " hold " +
                  format_bytes(std::uint64_t{im.config.io_tiles} * dc.bytes_per_tile) +
                  ", too little for one micro-batch of " + format_bytes(micro_batch) +
                  " (with 5% headroom) on device " + std::to_string(im.devices[d]->id()) + ": " +
                  (suggestion
                       ? "use io_tiles = " + std::to_string(*suggestion) + " (leaving " +
                             std::to_string(dc.tiles - *suggestion) + " compute tiles)"
                       : std::string("no even count below the device's ") +
                             std::to_string(dc.tiles) + " tiles holds it; shrink the micro-batch"));
    }
  }
  for (auto& [g, users] : group_users) {
    if (users != g->participants()) {
      throw Error("a sync group of " + std::to_string(g->participants()) +
                  " participants is used by " + std::to_string(users) +
                  " device program(s): every participant must sync on it, "
                  "or the others would wait forever");
    }
  }

  // Set up the run: tracks, links (readers claim lanes, writers attach), device runs.
  const Clock::time_point origin = Clock::now();
  std::unique_ptr<Trace> trace;
  if (im.config.trace) trace = std::make_unique<Trace>(origin);
  std::vector<TraceTrack*> tracks(n, nullptr), io_tracks(n, nullptr);
  if (trace) {
    for (std::uint32_t d = 0; d < n; ++d) {
      tracks[d] = &trace->add_track("device " + std::to_string(im.devices[d]->id()),
                                    TraceTrack::Kind::kDevice, d);
    }
    for (std::uint32_t d = 0; d < n; ++d) {
      io_tracks[d] = &trace->add_track("I/O engine: link " + std::to_string(im.devices[d]->id()),
                                       TraceTrack::Kind::kIo, d);
    }
  }
  auto shared = std::allocate_shared<RunShared>(detail::CacheLineAllocator<RunShared>{}, n,
                                                uses.front().outer_count.value_or(1));
  RunShared& rs = *shared;
  detail::RunControl& control = rs.control;
  rs.programs = programs;
  for (std::uint32_t d = 0; d < n; ++d) {
    rs.runs.push_back(
        std::make_unique<DeviceRun>(im, *im.devices[d], d, control, tracks[d], io_tracks[d]));
    DeviceRun& run = *rs.runs[d];
    run.set_owner(shared);
    for (const program::Execute* e : uses[d].executes) run.label(e, e->name);
    for (const auto& [node, name] : uses[d].transfers) run.label(node, name);
    if (uses[d].fused) run.add_fused(*uses[d].fused);
    run.set_groups(std::vector<SyncGroup*>(uses[d].groups.begin(), uses[d].groups.end()));
    for (const program::StreamCopy* s : uses[d].streams) {
      if (s->infeed) {
        run.add_infeed(*s->infeed, *s->buffer);
        rs.infeeds.insert(s->infeed);
      } else {
        auto it = rs.writers.find(s->outfeed);
        if (it == rs.writers.end())
          it = rs.writers.emplace(s->outfeed, s->outfeed->begin_run()).first;
        run.add_outfeed(*s->outfeed, *s->buffer, &it->second[d]);
      }
    }
    run.allocate_out_slots();
  }
  for (auto& [g, users] : group_users) {
    g->reset();  // a run stopped midway may have left arrivals behind
    rs.groups.insert(g);
  }
  control.set_waker(
      [&rs, wake = std::move(wake)] {  // called only while the run is open: rs is alive
        if (wake) wake();
        for (SyncGroup* g : rs.groups) g->wake();
        for (InfeedQueue<Tensor>* q : rs.infeeds) q->wake_all();
        for (auto& [q, w] : rs.writers) q->wake_all();
        for (auto& r : rs.runs) r->wake();
      });
  // The run's stop, watched from here (after the waker, before any device starts): a stop
  // already requested cancels now, and every device ends at its first look, taking nothing.
  std::stop_callback<detail::CancelRun> on_stop(scope.token(), detail::CancelRun{&control});
  if (im.config.stall.limit.count() != 0) {  // watched for a stall until the last device ends
    std::vector<detail::WatchedDevice> watched = im.watched;
    if (watched.size() != n) {
      watched.clear();
      for (std::uint32_t d = 0; d < n; ++d) watched.push_back({im.devices[d]->id(), d, {}});
    }
    control.watch(im.config.stall, im.run_name, std::move(watched));
  }

  for (std::uint32_t d = 0; d < n; ++d) {
    try {
      im.devices[d]->submit(DeviceJob{[shared, d] { shared->runs[d]->run(shared->programs[d]); },
                                      [shared] { shared->control.cancel(); }});
    } catch (...) {
      control.fail(
          detail::RunControl::Failure{im.devices[d]->id(), d, 0, std::current_exception()});
      for (std::uint32_t k = d; k < n; ++k) rs.runs[k]->abandon();
      break;
    }
  }
  std::exception_ptr host_failure;
  if (host) {
    try {
      host(control.stop());
    } catch (...) {
      host_failure = std::current_exception();
      control.cancel();
    }
  }
  control.wait();
  const Clock::time_point end = Clock::now();
  // Every device has reported its end and no longer reads its program: let go of the
  // programs here, so buffers they hold are freed on this thread, not by whichever device
  // thread drops the run's shared state last (perhaps while the host destroys a device).
  rs.programs.clear();
  if (trace) {
    trace->set_end(end);
    im.trace = std::move(trace);
    if (!im.config.trace_path.empty()) im.trace->write_chrome_json(im.config.trace_path);
  }
  EngineResult result;
  result.elapsed = end - origin;
  result.modeled = control.modeled();
  for (std::uint32_t r = 0; r < control.replicas(); ++r) {
    result.modeled_by_device.push_back(control.modeled(r));
  }
  for (const auto& r : rs.runs) {
    result.host_bytes_in += r->host_bytes_in();
    result.host_bytes_out += r->host_bytes_out();
    result.host_wait += r->host_wait();
  }
  if (host_failure) {
    try {  // the devices' own failure, if any, is dropped for the host's
      (void)control.finish(result.iterations, result.message);
    } catch (...) {
    }
    std::rethrow_exception(host_failure);
  }
  result.status = control.finish(result.iterations, result.message);
  return result;
}

void Engine::cancel() noexcept {
  impl_->gate.cancel();
}

namespace detail {
namespace {
// A one-device engine for a loop built elsewhere: no link, no I/O engine, every tile computes.
struct LoneRun {
  LoneRun(Device& device, std::uint32_t replica, const Program& program, RunControl& control,
          TraceTrack* track) {
    gather(program, uses, false, program);
    if (uses.fused == nullptr) {  // (gather() allows a FusedRepeat only as the whole program)
      throw Error("run_on_device: only a FusedRepeat program runs outside an Engine");
    }
    state.compute_tiles = device.config().tiles;  // a loop's own io_tiles: see LoopCost
    run.emplace(state, device, replica, control, track, nullptr);
    run->add_fused(*uses.fused);
  }
  Uses uses;
  EngineState state;
  std::optional<DeviceRun> run;
};

// A replica whose run could not be set up: its FusedRepeat finishes without delivering (the
// feeds are released; a second error is dropped, the first is the one reported) and the run
// hears its end.
void end_unrun(Device& device, std::uint32_t replica, const Program& program,
               RunControl& control) noexcept {
  if (const auto* fused = std::get_if<program::FusedRepeat>(&program.node())) {
    try {
      fused->finish(false);
    } catch (...) {
    }
  }
  control.replica_done(replica,
                       RunControl::ReplicaEnd{device.id(), 0, RunStatus::kCancelled, true});
}
}  // namespace

void run_on_device(Device& device, std::uint32_t replica, const Program& program,
                   RunControl& control, TraceTrack* track) noexcept {
  std::optional<LoneRun> lone;
  try {
    lone.emplace(device, replica, program, control, track);
  } catch (...) {  // (out of memory for its trace labels; a program that is no FusedRepeat)
    control.fail(RunControl::Failure{device.id(), replica, 0, std::current_exception()});
    end_unrun(device, replica, program, control);
    return;
  }
  lone->run->run(program);
}

void name_runs(Engine& engine, std::string name, std::vector<WatchedDevice> devices) {
  engine.impl_->run_name = std::move(name);
  engine.impl_->watched = std::move(devices);
}

void abandon_on_device(Device& device, std::uint32_t replica, const Program& program,
                       RunControl& control) noexcept {
  std::optional<LoneRun> lone;
  try {
    lone.emplace(device, replica, program, control, nullptr);
  } catch (...) {  // the refusal is the error reported
    end_unrun(device, replica, program, control);
    return;
  }
  lone->run->abandon();
}
}  // namespace detail

const Trace* Engine::trace() const noexcept {
  return impl_->trace.get();
}
TraceSummary Engine::summary() const {
  return impl_->trace ? impl_->trace->summary() : TraceSummary{};
}
const EngineConfig& Engine::config() const noexcept {
  return impl_->config;
}
std::uint32_t Engine::devices() const noexcept {
  return static_cast<std::uint32_t>(impl_->devices.size());
}
std::uint32_t Engine::compute_tiles() const noexcept {
  return impl_->compute_tiles;
}
bool Engine::low_timer_slack() const noexcept {
  return impl_->io->low_timer_slack();
}

}  // namespace bspflow
