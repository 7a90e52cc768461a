// Streams: the untyped half of Stream::swap() (see bspflow/stream/detail/core.hpp):
// where the new version fits, then each replica moved to it at a request boundary, in place
// or one replica at a time.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "bspflow/devices/device_error.hpp"
#include "bspflow/stream/detail/core.hpp"

namespace bspflow::detail {

std::uint32_t StreamCore::swappable(std::string_view name) const {
  std::string all;
  for (std::uint32_t n = 0; n < nodes.size(); ++n) {
    const NodeSpec& s = nodes[n];
    if (s.index == kNoIndex) continue;
    if (s.name == name) {
      if (s.kind == NodeKind::kStage || s.kind == NodeKind::kBatch ||
          s.kind == NodeKind::kGenerate) {
        return n;
      }
      throw Error("Stream::swap: '" + s.name +
                  "' is a join, route or merge: only a stage's, a batch stage's or a generate "
                  "stage's callable can be swapped");
    }
    all += (all.empty() ? "" : ", ") + s.name;
  }
  throw Error("Stream::swap: the stream has no stage named '" + std::string(name) +
              "' (its stages: " + all + ")");
}

namespace {
// Waits (polling, 50 us at a time) until `done()`, or `stop`; returns done().
template <class Done>
bool wait_for(Done&& done, const std::stop_token& stop) {
  while (!done()) {
    if (stop.stop_requested()) return done();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}
}  // namespace

SwapResult StreamCore::swap(std::uint32_t node, std::vector<std::unique_ptr<Versioned>> fresh,
                            std::size_t memory, const std::stop_token& stop) {
  std::lock_guard lock(swap_mutex_);
  const NodeSpec& spec = nodes[node];
  SwapResult res;
  res.version = fresh.front()->version;
  const std::string what =
      "stream stage '" + spec.name + "' version " + std::to_string(res.version);
  auto arena = [&](std::uint32_t r) -> Arena& {
    return devices[device_of(r, spec.device)].arena();
  };
  // Moves replica r to its new version (and its memory): stores it, then retires the old one
  // once no call holds it.
  auto install = [&](std::uint32_t r, void* mem) {
    ReplicaRun& run = runs[r];
    VersionCell& cell = *run.cells[node];
    Versioned* old = cell.current.load();
    Versioned* next = fresh[r].get();
    {
      std::lock_guard v(versions_mutex_);
      run.versions.emplace_back(node, std::move(fresh[r]));
    }
    cell.current.store(next, std::memory_order_seq_cst);
    while (!cell.quiescent(old)) std::this_thread::sleep_for(std::chrono::microseconds(20));
    {
      std::lock_guard v(versions_mutex_);
      std::erase_if(run.versions, [&](const auto& e) { return e.second.get() == old; });
    }
    if (run.memory[node] != nullptr && run.memory[node] != mem) arena(r).release(run.memory[node]);
    run.memory[node] = mem;
    run.memory_bytes[node] = memory;
    ++res.replicas_swapped;
  };

  // In place: every device holds both versions for a moment.
  std::vector<void*> got(replicas, nullptr);
  bool in_place = true;
  if (memory > 0) {
    try {
      for (std::uint32_t r = 0; r < replicas; ++r) {
        got[r] = arena(r).allocate(memory, what + " (replica " + std::to_string(r) + ")");
      }
    } catch (const OutOfMemoryError&) {
      for (std::uint32_t r = 0; r < replicas; ++r) {
        if (got[r] != nullptr) arena(r).release(got[r]);
        got[r] = nullptr;
      }
      in_place = false;
    }
  }
  if (in_place) {
    if (stop.stop_requested()) {
      for (std::uint32_t r = 0; r < replicas; ++r) {
        if (got[r] != nullptr) arena(r).release(got[r]);
      }
      res.cancelled = true;
      res.message = "cancelled before any replica swapped: version " + std::to_string(res.version) +
                    " was not installed";
      return res;
    }
    for (std::uint32_t r = 0; r < replicas; ++r) install(r, got[r]);
    res.swapped = true;
    res.message = "swapped in place: every replica runs version " + std::to_string(res.version);
    return res;
  }

  // One at a time: each device must hold the new version once the old one is freed.
  for (std::uint32_t r = 0; r < replicas; ++r) {
    Arena& a = arena(r);
    const std::size_t room = a.free_bytes() + runs[r].memory_bytes[node];
    if (memory > room) {
      res.error = std::make_exception_ptr(OutOfMemoryError(
          what + " needs " + format_bytes(memory) + " on device " +
              std::to_string(devices[device_of(r, spec.device)].id()) + " (replica " +
              std::to_string(r) + "), which has " + format_bytes(room) +
              " even without the version it replaces: refused, the old version keeps "
              "serving. " +
              a.report(),
          memory, room));
      res.message = "refused: " + what +
                    " does not fit on its device, even one version at a "
                    "time; the old version keeps serving";
      return res;
    }
  }
  res.rolling = true;
  for (std::uint32_t r = 0; r < replicas; ++r) {
    if (stop.stop_requested()) {
      res.cancelled = true;
      break;
    }
    ReplicaMeter& m = *replica_meters[r];
    m.draining.store(true, std::memory_order_release);
    const bool drained = wait_for(
        [&] {
          return m.taken.load(std::memory_order_acquire) == m.left.load(std::memory_order_acquire);
        },
        stop);
    if (!drained) {
      m.draining.store(false, std::memory_order_release);
      res.cancelled = true;
      break;
    }
    ReplicaRun& run = runs[r];
    if (run.memory[node] != nullptr) {
      arena(r).release(run.memory[node]);
      run.memory[node] = nullptr;
    }
    void* mem = nullptr;
    try {
      if (memory > 0)
        mem = arena(r).allocate(memory, what + " (replica " + std::to_string(r) + ")");
    } catch (const OutOfMemoryError&) {
      res.error = std::current_exception();
      // Put the old version's memory back: it fitted a moment ago.
      try {
        if (run.memory_bytes[node] > 0) {
          run.memory[node] =
              arena(r).allocate(run.memory_bytes[node], "stream stage '" + spec.name + "'");
        }
      } catch (...) {
      }
      m.draining.store(false, std::memory_order_release);
      res.message = "stopped at replica " + std::to_string(r) + ": " + what +
                    " did not fit once the old version was freed (fragmented memory)";
      return res;
    }
    install(r, mem);
    m.draining.store(false, std::memory_order_release);
  }
  res.swapped = res.replicas_swapped == replicas;
  if (res.swapped) {
    res.message =
        "swapped one replica at a time: every replica runs version " + std::to_string(res.version);
  } else {
    res.message = "cancelled after " + std::to_string(res.replicas_swapped) + " of " +
                  std::to_string(replicas) + " replicas: the others keep the old version";
  }
  return res;
}

}  // namespace bspflow::detail
