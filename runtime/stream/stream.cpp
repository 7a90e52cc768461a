// Streams: names, config checks, request errors, a run's shared state, the checks of a
// graph being built and where its nodes run (see bspflow/stream/stream.hpp).
#include "bspflow/stream/stream.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <string>

namespace bspflow {

const char* to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::kStageFailed:
      return "stage_failed";
    case ErrorKind::kDeadlineExceeded:
      return "deadline_exceeded";
    case ErrorKind::kRejected:
      return "rejected";
    case ErrorKind::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

const char* to_string(Refusal r) noexcept {
  switch (r) {
    case Refusal::kNone:
      return "accepted";
    case Refusal::kQueueFull:
      return "queue_full";
    case Refusal::kDeadlineUnreachable:
      return "deadline_unreachable";
    case Refusal::kDeadlinePassed:
      return "deadline_passed";
    case Refusal::kClientFull:
      return "client_full";
    case Refusal::kShed:
      return "shed";
    case Refusal::kClosed:
      return "closed";
    case Refusal::kOutranked:
      return "outranked";
    case Refusal::kTooLarge:
      return "too_large";
  }
  return "unknown";
}

StreamConfig StreamConfig::from(const Options& options) noexcept {
  StreamConfig c;
  c.replicas = options.replicas();
  return c;
}

void StreamConfig::validate(std::uint32_t devices) const {
  if (hop_capacity < 1 || hop_capacity > tunables::kMaxQueueCapacity) {
    detail::throw_bad_value("StreamConfig::hop_capacity", hop_capacity,
                            "must be in 1.." + std::to_string(tunables::kMaxQueueCapacity) +
                                " requests between two devices");
  }
  wait.validate();
  if (!device_wait.empty() && device_wait.size() != devices) {
    detail::throw_bad_value("StreamConfig::device_wait size", device_wait.size(),
                            "must be 0 (every device uses `wait`) or one per device of the "
                            "stream (" +
                                std::to_string(devices) + ")");
  }
  for (const WaitPolicy& w : device_wait) w.validate();
  if (replicas < 1 || replicas > kMaxStreamReplicas) {
    detail::throw_bad_value("StreamConfig::replicas", replicas,
                            "must be in 1.." + std::to_string(kMaxStreamReplicas));
  }
  if (devices % replicas != 0) {
    detail::throw_bad_value("StreamConfig::replicas", replicas,
                            "must divide the stream's " + std::to_string(devices) +
                                " device(s): each replica gets devices/replicas of them");
  }
  constexpr std::size_t kMax = std::size_t{1} << 20;
  if (admission.queue_capacity < 1 || admission.queue_capacity > kMax) {
    detail::throw_bad_value("StreamConfig::admission.queue_capacity", admission.queue_capacity,
                            "must be in 1..1048576 requests");
  }
  if (response_capacity < 1 || response_capacity > kMax) {
    detail::throw_bad_value("StreamConfig::response_capacity", response_capacity,
                            "must be in 1..1048576 responses per client");
  }
  if (priority_classes < 1 || priority_classes > kPriorityClasses) {
    detail::throw_bad_value("StreamConfig::priority_classes", priority_classes,
                            "must be in 1.." + std::to_string(kPriorityClasses));
  }
  double shares = 0;
  for (std::uint32_t c = 0; c < kPriorityClasses; ++c) {
    const double s = min_share[c];
    if (!(s >= 0.0 && s <= 1.0)) {
      detail::throw_bad_value("StreamConfig::min_share[" + std::to_string(c) + "]",
                              std::to_string(s), "must be in 0..1");
    }
    if (c < priority_classes) shares += s;
  }
  if (shares > 1.0 + 1e-9) {
    detail::throw_bad_value("StreamConfig::min_share (sum of the classes in use)",
                            std::to_string(shares), "must be at most 1");
  }
  if (ejection.consecutive_failures > 1'000'000) {
    detail::throw_bad_value("StreamConfig::ejection.consecutive_failures",
                            ejection.consecutive_failures, "must be 0 (off) or in 1..1000000");
  }
  if (ejection.consecutive_failures > 0) {
    const auto hour = std::chrono::nanoseconds(std::chrono::hours(1));
    if (ejection.base_time < std::chrono::microseconds(1) || ejection.base_time > hour) {
      detail::throw_bad_value("StreamConfig::ejection.base_time", ejection.base_time,
                              "must be in 1 us..1 h");
    }
    if (ejection.max_time < ejection.base_time || ejection.max_time > hour) {
      detail::throw_bad_value(
          "StreamConfig::ejection.max_time", ejection.max_time,
          "must be in base_time (" + detail::describe_duration(ejection.base_time) + ")..1 h");
    }
  }
  if (call_stall_limit < std::chrono::nanoseconds::zero() ||
      call_stall_limit > std::chrono::nanoseconds(std::chrono::hours(24))) {
    detail::throw_bad_value("StreamConfig::call_stall_limit", call_stall_limit,
                            "must be in 0 ns..24 h (0 turns stall detection off)");
  }
}

namespace detail {

std::uint32_t next_client_id() noexcept {
  static std::atomic<std::uint32_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed);  // relaxed: only uniqueness matters
}

std::shared_ptr<const RequestError> make_request_error(ErrorKind kind, const RequestMeta& meta,
                                                       std::uint32_t stage,
                                                       const std::string& stage_name,
                                                       std::uint32_t device, const std::string& why,
                                                       std::exception_ptr cause) {
  auto e = std::make_shared<RequestError>();
  e->kind = kind;
  e->stage = stage;
  e->stage_name = stage_name;
  e->device = device;
  e->id = meta.id;
  e->cause = std::move(cause);
  e->message = "stage '" + stage_name + "' (" + std::to_string(stage) + ") on device " +
               std::to_string(device) + ": request " + std::to_string(meta.id.sequence) +
               " of client " + std::to_string(meta.id.client) + " " + why;
  return e;
}

std::shared_ptr<const RequestError> check_live(const InFlight& f, const NodeRun& n) {
  const RequestMeta& m = f.meta;
  if (m.client->cancelled(m.id.sequence)) {
    return make_request_error(ErrorKind::kCancelled, m, n.index, n.name, n.device_id,
                              "was not run: its client cancelled it");
  }
  if (m.client->aborted(m.id.sequence)) {
    return make_request_error(ErrorKind::kCancelled, m, n.index, n.name, n.device_id,
                              "was not run: another branch failed on it");
  }
  if (m.deadline != kNoDeadline) {
    const auto now = f.timing ? f.t : StreamClock::now();
    if (now > m.deadline) {
      return make_request_error(ErrorKind::kDeadlineExceeded, m, n.index, n.name, n.device_id,
                                "was not run: its deadline had passed");
    }
  }
  return nullptr;
}

std::shared_ptr<const RequestError> failure_of(const InFlight& f, const NodeRun& n,
                                               const std::exception_ptr& cause) {
  auto e = std::make_shared<RequestError>();
  e->kind = ErrorKind::kStageFailed;
  e->stage = n.index;
  e->stage_name = n.name;
  e->device = n.device_id;
  e->id = f.meta.id;
  e->cause = cause;
  e->message = "stage '" + n.name + "' (" + std::to_string(n.index) + ") on device " +
               std::to_string(n.device_id) + " failed on request " +
               std::to_string(f.meta.id.sequence) + " of client " +
               std::to_string(f.meta.id.client) + ": " + describe_exception(cause);
  return e;
}

bool after_failure(InFlight& f, SegmentCtx& ctx, const std::shared_ptr<const RequestError>& e) {
  if (ctx.abort_on_failure) f.meta.client->abort(f.meta.id.sequence);
  if (ctx.on_error == OnError::kFailFast) {
    f.failure = e;
    ctx.state->fail(e);
    return false;
  }
  return true;
}

std::shared_ptr<const RequestError> Segment::runtime_failure(const std::exception_ptr& e) const {
  auto err = std::make_shared<RequestError>();
  const NodeRun& at = *held_at;
  err->stage = at.index;
  err->stage_name = at.name;
  err->device = at.device_id;
  err->cause = e;
  err->message = "stream runtime failed on device " + std::to_string(at.device_id) + ": " +
                 describe_exception(e);
  if (replica_meter != nullptr) replica_meter->failed.store(true, std::memory_order_relaxed);
  return err;
}

void Segment::answer_held(const RequestMeta& meta, std::shared_ptr<const RequestError> error) {
  if (!error) {
    const NodeRun& at = *held_at;
    error = make_request_error(ErrorKind::kCancelled, meta, at.index, at.name, at.device_id,
                               "was not run: the stream was cancelled");
  }
  responder_base->answer_error(meta, std::move(error));
}

void StreamRunState::cancel() noexcept {
  stop.set();
  std::lock_guard lock(waker_mutex_);
  if (waker_) waker_();
}

void StreamRunState::set_waker(std::function<void()> waker) {
  std::lock_guard lock(waker_mutex_);
  waker_ = std::move(waker);
}

void StreamRunState::disarm() {
  std::lock_guard lock(waker_mutex_);
  waker_ = nullptr;
}

void StreamRunState::fail(std::shared_ptr<const RequestError> error) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!failure_) failure_ = std::move(error);
  }
  cancel();
}

std::shared_ptr<const RequestError> StreamRunState::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

void StreamRunState::segment_done() noexcept {
  if (ending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && on_end_) {
    // The last segment: no other touches the hops or the queue any more.
    try {
      on_end_();
    } catch (...) {  // out of memory while answering: the host's wait() sweeps again
    }
  }
  remaining_.fetch_sub(1, std::memory_order_seq_cst);
  done_.notify();
}

void StreamRunState::wait_done() {
  done_.wait([&] { return remaining_.load(std::memory_order_seq_cst) == 0; });
}

// ---- a graph being built ----

namespace {
const char* kind_name(NodeKind k) {
  switch (k) {
    case NodeKind::kInput:
      return "input";
    case NodeKind::kStage:
      return "stage";
    case NodeKind::kBatch:
      return "batch stage";
    case NodeKind::kJoin:
      return "join";
    case NodeKind::kRoute:
      return "route";
    case NodeKind::kBranch:
      return "branch";
    case NodeKind::kMerge:
      return "merge";
    case NodeKind::kGenerate:
      return "generate stage";
  }
  return "node";
}
}  // namespace

std::uint32_t GraphBuild::add(NodeSpec spec, std::unique_ptr<NodeType> type, OpMaker maker,
                              BatchMaker batch, GenerateMaker generate) {
  if (built) throw Error("StreamGraph: the graph was built already; build a new one");
  StreamCore& c = *core;
  const std::string what = std::string(kind_name(spec.kind)) + " '" + spec.name + "'";
  if (spec.kind != NodeKind::kInput && spec.kind != NodeKind::kBranch) {
    if (spec.name.empty())
      throw Error("StreamGraph: a " + std::string(kind_name(spec.kind)) +
                  " needs a name (stats, errors and swaps name it)");
    for (const NodeSpec& n : c.nodes) {
      if (n.name == spec.name) {
        throw Error(what + ": the name is taken by another node of the stream; names are unique");
      }
    }
    if (spec.device >= c.per_replica) {
      throw_bad_value(
          what + " device", spec.device,
          c.replicas > 1
              ? "must be below the " + std::to_string(c.per_replica) + " device(s) of each replica"
              : "must be below the stream's " + std::to_string(c.per_replica) + " device(s)");
    }
  }
  const auto id = static_cast<std::uint32_t>(c.nodes.size());
  for (std::uint32_t in : spec.inputs) {
    NodeSpec& p = c.nodes.at(in);
    if (in == 0 && p.consumers.empty()) p.device = spec.device;  // the input: its first reader's
    if (std::find(p.consumers.begin(), p.consumers.end(), id) == p.consumers.end()) {
      p.consumers.push_back(id);
    }
  }
  if (spec.kind != NodeKind::kInput && spec.kind != NodeKind::kBranch) {
    spec.index = static_cast<std::uint32_t>(c.named.size());
    c.named.push_back(id);
  }
  c.nodes.push_back(std::move(spec));
  types.push_back(std::move(type));
  makers.push_back(std::move(maker));
  batch_makers.push_back(std::move(batch));
  generate_makers.push_back(std::move(generate));
  return id;
}

void GraphBuild::check_node(const GraphBuild* owner, std::uint32_t id,
                            const std::string& where) const {
  if (built) throw Error("StreamGraph: the graph was built already (" + where + ")");
  if (owner != this || id >= core->nodes.size()) {
    throw Error(where + ": a node of another StreamGraph (a graph's nodes read its own only)");
  }
}

namespace {

// "branch 0", "branches 0 and 2", "branches 0, 1 and 3".
std::string branch_list(const std::set<std::uint32_t>& branches) {
  std::string out = branches.size() == 1 ? "branch " : "branches ";
  std::size_t k = 0;
  for (std::uint32_t b : branches) {
    if (k > 0) out += k + 1 == branches.size() ? " and " : ", ";
    out += std::to_string(b);
    ++k;
  }
  return out;
}

// A join's inputs must be reached by the same requests: one reached only through some
// branches of a route, beside one reached whichever branch the route takes, would leave the
// join without the first for the requests the route sends elsewhere. `cond` says, for each
// node so far, which branches of which routes reach it.
void check_join_inputs(const StreamCore& c, std::uint32_t join,
                       const std::vector<std::map<std::uint32_t, std::set<std::uint32_t>>>& cond) {
  const NodeSpec& s = c.nodes[join];
  for (const auto& [route, branches] : cond[join]) {
    const std::uint32_t rt = route;
    const auto decided = [&](std::uint32_t p) { return cond[p].count(rt) != 0; };
    const auto q = std::find_if(s.inputs.begin(), s.inputs.end(), decided);
    const auto p = std::find_if_not(s.inputs.begin(), s.inputs.end(), decided);
    if (p == s.inputs.end()) continue;
    const std::string& r = c.nodes[rt].name;
    throw Error("join '" + s.name + "' takes input '" + c.nodes[*q].name +
                "', reached only through " + branch_list(cond[*q].at(rt)) + " of route '" + r +
                "', and input '" + c.nodes[*p].name + "', reached whichever branch route '" + r +
                "' takes: a request that route '" + r +
                "' sends down another branch would reach the join without '" + c.nodes[*q].name +
                "'; merge the branches of route '" + r + "' before the join");
  }
}

}  // namespace

void GraphBuild::check(std::uint32_t output) {
  StreamCore& c = *core;
  if (c.named.empty()) throw Error("StreamGraph::build: a stream needs at least one stage");
  const auto n = static_cast<std::uint32_t>(c.nodes.size());
  // Every node reaches the output.
  std::vector<bool> reaches(n, false);
  reaches[output] = true;
  for (std::uint32_t i = output + 1; i-- > 0;) {
    if (!reaches[i]) continue;
    for (std::uint32_t p : c.nodes[i].inputs) reaches[p] = true;
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    if (!reaches[i] && c.nodes[i].kind != NodeKind::kBranch) {
      throw Error(std::string(kind_name(c.nodes[i].kind)) + " '" + c.nodes[i].name +
                  "' reaches no output: every node must lead to the stream's output '" +
                  c.nodes[output].name + "' (join or merge its branch)");
    }
    if (!reaches[i]) {
      throw Error("branch '" + c.nodes[i].name + "' of route '" +
                  c.nodes[c.nodes[i].inputs[0]].name +
                  "' reaches no output: every branch must lead to a merge");
    }
  }
  // Which branches of which routes a node depends on: route id -> the branches reaching it.
  std::vector<std::map<std::uint32_t, std::set<std::uint32_t>>> cond(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    NodeSpec& s = c.nodes[i];
    const std::string what = std::string(kind_name(s.kind)) + " '" + s.name + "'";
    if (s.kind == NodeKind::kBranch) {
      cond[i] = cond[s.inputs[0]];
      cond[i][s.inputs[0]] = {s.branch};
    } else if (s.kind == NodeKind::kMerge) {
      std::map<std::uint32_t, std::set<std::uint32_t>> all;
      for (std::uint32_t p : s.inputs) {
        for (const auto& [route, branches] : cond[p])
          all[route].insert(branches.begin(), branches.end());
      }
      // The merged route: the last one some input depends on; every input must come through
      // a different branch of it.
      std::uint32_t route = 0;
      for (const auto& [r, b] : all) route = std::max(route, r);
      if (route == 0) throw Error(what + ": its inputs come through no route; use a join");
      std::set<std::uint32_t> seen;
      for (std::uint32_t p : s.inputs) {
        const auto it = cond[p].find(route);
        if (it == cond[p].end()) {
          throw Error(what + ": input '" + c.nodes[p].name + "' does not come through route '" +
                      c.nodes[route].name + "' as its other inputs do");
        }
        for (std::uint32_t b : it->second) {
          if (!seen.insert(b).second) {
            throw Error(what + ": two inputs come through branch " + std::to_string(b) +
                        " of route '" + c.nodes[route].name + "'");
          }
        }
      }
      cond[i] = all;
      std::uint32_t k = 0;
      for (const NodeSpec& b : c.nodes) {
        if (b.kind == NodeKind::kBranch && b.inputs[0] == route) ++k;
      }
      if (seen.size() == k) {
        cond[i].erase(route);
      } else {
        cond[i][route] = seen;
      }
    } else {
      for (std::uint32_t p : s.inputs) {
        for (const auto& [route, branches] : cond[p]) {
          auto it = cond[i].find(route);
          if (it != cond[i].end() && it->second != branches) {
            throw Error(what + " takes inputs reached through different branches of route '" +
                        c.nodes[route].name +
                        "': a request runs one branch only, so it would "
                        "never have them all; merge the branches instead");
          }
          cond[i][route] = branches;
        }
      }
      if (s.kind == NodeKind::kJoin) check_join_inputs(c, i, cond);
    }
    s.routed = !cond[i].empty();
  }
  if (!cond[output].empty()) {
    throw Error("output '" + c.nodes[output].name +
                "' is reached through only some branches of "
                "route '" +
                c.nodes[cond[output].begin()->first].name +
                "': merge the branches so every request is answered");
  }
  // A generate stage's outputs travel on as occurrences of their request, one per output:
  // the nodes after it read only what follows it, and no route decides whether it runs.
  std::vector<std::uint32_t> gen_of(n, kNoIndex);  // the generate stage a node follows
  for (std::uint32_t i = 0; i < n; ++i) {
    const NodeSpec& s = c.nodes[i];
    const std::string what = std::string(kind_name(s.kind)) + " '" + s.name + "'";
    std::uint32_t from = kNoIndex;
    for (std::uint32_t p : s.inputs) from = std::min(from, gen_of[p]);
    for (std::uint32_t p : s.inputs) {
      if (gen_of[p] == from) continue;
      const std::uint32_t q = *std::find_if(s.inputs.begin(), s.inputs.end(),
                                            [&](std::uint32_t x) { return gen_of[x] == from; });
      const std::uint32_t after = gen_of[p] == kNoIndex ? q : p;
      const std::uint32_t before = gen_of[p] == kNoIndex ? p : q;
      throw Error(what + " takes input '" + c.nodes[after].name +
                  "', which follows generate stage '" + c.nodes[gen_of[after]].name +
                  "' (one value per output), and input '" + c.nodes[before].name +
                  "', which does not: the nodes after a generate stage read only what follows it");
    }
    if (s.kind == NodeKind::kGenerate) {
      if (from != kNoIndex) {
        throw Error(what + " follows generate stage '" + c.nodes[from].name +
                    "': a request passes through one generate stage at most");
      }
      if (s.routed) {
        throw Error(what +
                    " is reached through a route's branch: a generate stage serves every "
                    "request of its stream; put it before the route or after the merge");
      }
      from = i;
      c.streaming = true;
    }
    gen_of[i] = from;
  }
  c.output = output;
}

SegmentPlacement place_nodes(const StreamCore& core, std::uint32_t replica) {
  const auto n = static_cast<std::uint32_t>(core.nodes.size());
  SegmentPlacement pl;
  pl.segment_of.assign(n, 0);
  std::map<std::uint32_t, std::uint32_t> seg_of_device;
  for (std::uint32_t i = 0; i < n; ++i) {
    const NodeSpec& s = core.nodes[i];
    if (s.kind == NodeKind::kBranch) {  // filled by its route, where the route runs
      pl.segment_of[i] = pl.segment_of[s.inputs[0]];
      continue;
    }
    const auto it = seg_of_device.find(s.device);
    if (it != seg_of_device.end()) {
      pl.segment_of[i] = it->second;
      continue;
    }
    // A device that takes its first node's one input from a segment on its core runs in
    // that segment (no hand-off between two threads of one core). A batch stage heads a
    // segment of its own.
    if (core.config.fuse_shared_cores && i != 0 && s.kind != NodeKind::kBatch &&
        s.kind != NodeKind::kGenerate && s.inputs.size() == 1) {
      const std::uint32_t from = pl.segment_of[s.inputs[0]];
      if (core.share_core(replica, pl.device_of[from], s.device)) {
        pl.segment_of[i] = from;
        seg_of_device[s.device] = from;
        continue;
      }
    }
    pl.segment_of[i] = static_cast<std::uint32_t>(pl.device_of.size());
    seg_of_device[s.device] = pl.segment_of[i];
    pl.device_of.push_back(s.device);
  }
  return pl;
}

std::vector<std::string> round_trips(const StreamCore& core, const SegmentPlacement& pl) {
  const auto n = static_cast<std::uint32_t>(core.nodes.size());
  // The segments each node's value passed through on its way (itself included).
  std::vector<std::set<std::uint32_t>> through(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    through[i].insert(pl.segment_of[i]);
    for (std::uint32_t p : core.nodes[i].inputs)
      through[i].insert(through[p].begin(), through[p].end());
  }
  std::vector<std::string> found;
  for (std::uint32_t s = 0; s < pl.device_of.size(); ++s) {
    // As wire() lays the segment out: the first input from another segment is its source,
    // every later one an import that the segment's thread waits for mid-request.
    bool started = false;
    std::set<std::uint32_t> taken;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (pl.segment_of[i] != s) continue;
      const NodeSpec& spec = core.nodes[i];
      if (spec.kind == NodeKind::kInput) started = true;
      for (std::uint32_t p : spec.inputs) {
        if (pl.segment_of[p] == s || !taken.insert(p).second) continue;
        if (!started) {
          started = true;
          continue;
        }
        if (through[p].count(s) == 0) continue;
        const std::string here = std::to_string(pl.device_of[s]);
        const std::string there = std::to_string(pl.device_of[pl.segment_of[p]]);
        found.push_back(
            "stream: '" + spec.name + "' on device " + here + " waits for '" + core.nodes[p].name +
            "' from device " + there + ", which device " + here +
            " handed the same request to: device " + here +
            " takes no new request while it waits, so device " + there +
            " is given one request at a time (a batch stage there runs batches of 1). Put '" +
            spec.name + "' on device " + there +
            ", where its input ends, or give it a device of its own "
            "(the stream guide: where a join belongs)");
      }
    }
  }
  return found;
}

std::vector<std::uint32_t> segment_order(const StreamCore& core, const SegmentPlacement& pl,
                                         std::uint32_t s) {
  const auto n = static_cast<std::uint32_t>(core.nodes.size());
  std::vector<std::uint32_t> here;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (pl.segment_of[i] == s) here.push_back(i);
  }
  if (here.size() <= 2) return here;
  // anc[i][k]: node k is an ancestor of node i (ids are a topological order: inputs first).
  std::vector<std::vector<char>> anc(n, std::vector<char>(n, 0));
  for (std::uint32_t i = 0; i < n; ++i) {
    for (std::uint32_t p : core.nodes[i].inputs) {
      anc[i][p] = 1;
      for (std::uint32_t k = 0; k < p; ++k) anc[i][k] = static_cast<char>(anc[i][k] | anc[p][k]);
    }
  }
  const auto in_seg = [&](std::uint32_t i) { return pl.segment_of[i] == s; };
  // The source: the first node's first input from another segment (none for the input).
  std::uint32_t source = n;
  for (std::uint32_t p : core.nodes[here[0]].inputs) {
    if (!in_seg(p)) {
      source = p;
      break;
    }
  }
  // 0: leads to another segment, 1: local, 2: waits for another segment (an import).
  std::vector<int> rank(n, 1);
  for (std::uint32_t i : here) {
    for (std::uint32_t p : core.nodes[i].inputs) {
      if (!in_seg(p) && p != source) rank[i] = 2;
    }
  }
  for (std::uint32_t i : here) {
    if (rank[i] == 2) continue;
    for (std::uint32_t j : here) {
      if (j != i && anc[j][i] == 0) continue;  // i itself, or a node after it here
      for (std::uint32_t c : core.nodes[j].consumers) {
        if (!in_seg(c)) rank[i] = 0;
      }
    }
  }
  // Waiting nodes still come in build order, and every node below the one a segment waits at
  // has run there (its exports are out), so segments never wait on each other in a circle.
  std::vector<std::uint32_t> order{here[0]};
  std::vector<char> done(n, 0);
  done[here[0]] = 1;
  while (order.size() < here.size()) {
    std::uint32_t best = n;
    for (std::uint32_t i : here) {  // ascending: a tie goes to the lower id
      if (done[i] != 0) continue;
      bool ready = true;
      for (std::uint32_t k : here) ready = ready && (done[k] != 0 || anc[i][k] == 0);
      if (ready && (best == n || rank[i] < rank[best])) best = i;
    }
    done[best] = 1;
    order.push_back(best);
  }
  return order;
}

}  // namespace detail
}  // namespace bspflow
