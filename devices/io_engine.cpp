// The I/O engine (see bspflow/devices/io_engine.hpp). The only file that includes Asio.
#include "bspflow/devices/io_engine.hpp"
#include "bspflow/devices/device_tunables.hpp"

#include <algorithm>
#include <atomic>
#include <list>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "bspflow/base/detail/thread_name.hpp"
#include "bspflow/base/detail/wait.hpp"
#include "bspflow/base/error.hpp"
#include "bspflow/base/tunables.hpp"
#include "bspflow/devices/topology.hpp"

namespace bspflow {

namespace asio = boost::asio;

bool lower_timer_slack() noexcept {
#if defined(__linux__)
  return prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL) == 0;
#else
  return false;
#endif
}

void sleep_until_near(std::chrono::steady_clock::time_point deadline) noexcept {
  if (deadline - std::chrono::steady_clock::now() > tunables::kTimerMargin) {
    std::this_thread::sleep_until(deadline - tunables::kTimerMargin);
  }
}

bool wait_until_deadline(std::chrono::steady_clock::time_point deadline, const StopFlag* stop,
                         bool yield) noexcept {
  using Clock = std::chrono::steady_clock;
  if (stop == nullptr) sleep_until_near(deadline);
  for (;;) {
    if (stop != nullptr && stop->requested()) return false;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return true;
    const Clock::duration left = deadline - now;
    if (left > tunables::kTimerMargin) {
      // Only with a stop flag: sleep toward the margin in slices, so a stop is seen within one.
      std::this_thread::sleep_for(
          std::min<Clock::duration>(left - tunables::kTimerMargin, tunables::kModeledWaitSlice));
    } else if (yield) {
      std::this_thread::yield();  // a neighbour on this core may have work
    } else {
      detail::cpu_relax();
    }
  }
}

struct IoEngine::Impl {
  struct Channel {
    explicit Channel(asio::io_context& ctx) : timer(ctx) {}
    // Engine thread only. A list: submit() makes the node on the caller's thread, and the engine
    // thread splices it in, so queueing never allocates there.
    std::list<Transfer> queue;
    bool busy = false;  // the front transfer has started (or is being retried)
    std::chrono::nanoseconds poll = tunables::kIoPollFirst;
    bool waited = false;          // the front transfer's data was not there at first
    Clock::time_point free_at{};  // when the previous transfer ended
    // The front transfer's modeled start and end (on Impl::due once the end is near enough
    // that the engine spins toward it).
    Clock::time_point begin{}, deadline{};
    asio::steady_timer timer;
  };

  Impl(std::uint32_t n, std::string engine_name, std::optional<std::uint32_t> core,
       bool core_shared)
      : name(std::move(engine_name)), work(asio::make_work_guard(ctx)), shared(core_shared) {
    channels.reserve(n);
    due.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) channels.push_back(std::make_unique<Channel>(ctx));
    thread = std::thread([this, core] {
      if (core) Topology::get().pin_current_thread(*core);
      detail::name_this_thread("bspflow-io");
      slack_lowered.store(lower_timer_slack(), std::memory_order_relaxed);  // a diagnostic
      serve();
    });
  }

  // Engine thread: runs handlers; when there are none, polls for kSpinBudget (on a core no
  // device uses, for kSyncSpinBudget, yielding after the first kSpinBudget) before it blocks
  // in the io_context (epoll), whose wake-up takes tens of microseconds on a VM, and up to
  // milliseconds at its tail: a transfer asked for then would end that much late. While a transfer
  // is due (its end within the horizon) it never blocks: it spins toward the nearest end, the way a
  // bare spin on this core would, and polls for new work only when some was posted (or a timer may
  // be due) and the end is not about to pass (a poll is a syscall, about a microsecond on a VM).
  void serve() {
    auto idle_since = Clock::now();
    auto polled_at = idle_since;
    std::uint64_t posts_seen = 0;
    for (;;) {
      if (!due.empty()) {
        const Clock::time_point nearest = finish_due(Clock::now());
        if (due.empty()) {
          idle_since = Clock::now();
          continue;
        }
        const Clock::time_point now = Clock::now();
        const std::uint64_t posts = posted.load(std::memory_order_acquire);
        if (nearest - now > kPollGuard &&
            (posts != posts_seen || now - polled_at > kTimerPollEvery)) {
          posts_seen = posts;
          polled_at = now;
          ctx.poll();
          if (ctx.stopped()) return;
        } else {
          detail::cpu_relax();
        }
        continue;
      }
      posts_seen = posted.load(std::memory_order_acquire);
      if (ctx.poll() != 0) {
        idle_since = Clock::now();
        continue;
      }
      if (ctx.stopped()) return;
      const auto idle = Clock::now() - idle_since;
      if (idle < tunables::kSpinBudget) {
        for (int i = 0; i < 16; ++i) detail::cpu_relax();
        continue;
      }
      if (!shared && idle < tunables::kSyncSpinBudget) {
        // No device runs here: keep watching a while longer, yielding to host threads, so
        // the next transfer of a run does not wait for this thread's wake-up.
        std::this_thread::yield();
        continue;
      }
      sleeping.store(true, std::memory_order_release);
      const std::size_t ran = ctx.run_one();
      sleeping.store(false, std::memory_order_release);
      if (ran == 0) return;  // stopped: out of work after the guard was reset
      idle_since = Clock::now();
    }
  }

  // Engine thread: finishes every due transfer whose end has come (starting the next on
  // its channel); returns the nearest end still ahead.
  Clock::time_point finish_due(Clock::time_point now) {
    Clock::time_point nearest = Clock::time_point::max();
    for (std::size_t i = 0; i < due.size();) {
      Channel& ch = *due[i];
      if (ch.deadline > now) {
        nearest = std::min(nearest, ch.deadline);
        ++i;
        continue;
      }
      due[i] = due.back();
      due.pop_back();
      finish_front(ch, Times{ch.begin, now});  // may put the channel back on `due`
      now = Clock::now();
      i = 0;  // the list changed: look again
      nearest = Clock::time_point::max();
    }
    return nearest;
  }

  // Engine thread: the channel's end is within the horizon; the engine spins toward it.
  void make_due(Channel& ch) { due.push_back(&ch); }

  // How long before a transfer's end the engine stops relying on its timer and spins. It
  // adapts to how late the timer has been firing here (a decaying maximum of the lateness,
  // twice over, plus a margin), between kTimerMargin and kIoSpinHorizonMax; on a core shared
  // with devices it stays at kTimerMargin (a spin there takes their time). It only decays
  // as timers fire: once it exceeds the transfers, the engine spins through them (it watches
  // its own core; a decay by time made it fall back to timers and yields, which on this VM
  // gave the core away for milliseconds and made every other copy late).
  std::chrono::nanoseconds horizon() const {
    if (shared) return tunables::kTimerMargin;
    const auto h = std::chrono::nanoseconds(2 * late_max_ns) + tunables::kTimerMargin;
    return std::min<std::chrono::nanoseconds>(h, tunables::kIoSpinHorizonMax);
  }
  // A timer asked for `asked` ran its handler now: how late, whatever made it so (a slow
  // wake-up, or a yield that gave the core away for a time slice).
  void timer_fired(Clock::time_point asked) {
    const Clock::time_point now = Clock::now();
    const std::int64_t late = std::max<std::int64_t>(0, (now - asked).count());
    late_max_ns = std::max<std::int64_t>(late, late_max_ns - late_max_ns / 128);
  }

  // Engine thread. Starts the channel's front transfer, or schedules a retry.
  void start_front(Channel& ch) {
    if (ch.queue.empty() || stopping.load(std::memory_order_relaxed))
      return;  // relaxed: ordered by the io_context's stop and the join
    ch.busy = true;
    Transfer& t = ch.queue.front();
    const Clock::time_point now = Clock::now();
    // Modeled start: when asked for or when the link came free (see Transfer::submitted);
    // after a wait for data, when the data was found.
    const Clock::time_point begin =
        ch.waited ? now : std::min(now, std::max(t.submitted, ch.free_at));
    Start what = Start::kSkip;
    try {
      what = t.start();
    } catch (...) {
      fail_front(ch, std::current_exception());
      return;
    }
    if (what == Start::kSkip) {
      finish_front(ch, Times{begin, begin});
      return;
    }
    if (what == Start::kWait) {
      ch.waited = true;
      ch.timer.expires_after(ch.poll);
      ch.poll = std::min(ch.poll * 2, std::chrono::nanoseconds(tunables::kIoPollMax));
      try {
        ch.timer.async_wait([this, &ch](const boost::system::error_code& ec) {
          if (!ec) start_front(ch);
        });
      } catch (...) {  // out of memory for the timer's handler: nothing was taken, so it fails
        fail_front(ch, std::current_exception());
      }
      return;
    }
    ch.poll = tunables::kIoPollFirst;
    ch.begin = begin;
    ch.deadline = begin + t.modeled;
    const Clock::time_point armed = Clock::now();  // after the copy: it may take a while
    const Clock::time_point wake = ch.deadline - horizon();
    if (wake <= armed) {
      make_due(ch);
      return;
    }
    ch.timer.expires_at(wake);
    try {
      ch.timer.async_wait([this, &ch, wake](const boost::system::error_code& ec) {
        if (ec) return;  // cancelled at stop: finished below
        timer_fired(wake);
        make_due(ch);
      });
    } catch (...) {  // out of memory for the timer's handler: spin toward the end instead
      make_due(ch);
    }
  }

  // Engine thread. The front transfer has ended: report it, start the next.
  void finish_front(Channel& ch, const Times& times, bool cancelled = false) {
    Transfer t = std::move(ch.queue.front());
    ch.queue.pop_front();
    ch.busy = false;
    ch.waited = false;
    if (!cancelled) ch.free_at = times.end;
    t.done(times, cancelled);
    start_front(ch);
  }
  // Engine thread. The front transfer failed (`error`): it ends cancelled, the next starts.
  void fail_front(Channel& ch, std::exception_ptr error) {
    ch.poll = tunables::kIoPollFirst;
    Times times;
    times.error = std::move(error);
    finish_front(ch, times, true);
  }

  std::string name;
  asio::io_context ctx;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  std::vector<std::unique_ptr<Channel>> channels;
  // A poll is skipped when the nearest end is closer than this; timers are looked at at
  // least this often while transfers are due.
  static constexpr std::chrono::nanoseconds kPollGuard{5'000};
  static constexpr std::chrono::nanoseconds kTimerPollEvery{50'000};
  std::vector<Channel*> due;  // engine thread only
  const bool shared;
  std::int64_t late_max_ns = 0;          // engine thread only
  std::atomic<std::uint64_t> posted{0};  // submits, so a spinning engine polls only for them
  std::atomic<bool> sleeping{false};     // blocked in the io_context (for wake())
  std::atomic<std::uint64_t> wakes{0};   // wake() handlers run
  std::atomic<bool> stopping{false};
  std::atomic<bool> slack_lowered{false};
  std::thread thread;
};

IoEngine::IoEngine(std::uint32_t channels, std::string name, std::optional<std::uint32_t> core,
                   bool core_shared) {
  if (channels < 1 || channels > 4096) {
    detail::throw_bad_value("I/O engine channels", channels, "must be in 1..4096");
  }
  impl_ = std::make_unique<Impl>(channels, std::move(name), core, core_shared);
}

std::optional<std::uint32_t> IoEngine::pick_core(const std::vector<std::uint32_t>& device_cores) {
  const Topology& topo = Topology::get();
  if (!topo.has_hwloc()) return std::nullopt;
  // This process's cores only (several instances on a host each have their own).
  const std::vector<std::uint32_t>& mine = topo.instance_cores();
  for (std::uint32_t c : mine) {
    if (std::find(device_cores.begin(), device_cores.end(), c) == device_cores.end()) return c;
  }
  return mine.empty() ? 0 : mine.front();
}

// Nothing here throws in practice: join() only throws for a thread that is not joinable (the
// constructor's always is), and a transfer's done callback must not throw (io_engine.hpp).
IoEngine::~IoEngine() {  // NOLINT(bugprone-exception-escape)
  Impl& im = *impl_;
  // Stops the engine thread without allocating (posting a stop handler would, and a destructor
  // cannot throw): no transfer starts from here on, and the thread returns from its next look
  // at the io_context.
  im.stopping.store(true, std::memory_order_release);
  im.ctx.stop();
  im.posted.fetch_add(1, std::memory_order_release);  // a spinning engine polls, and sees it
  im.thread.join();
  // The engine thread is gone: cancel the timers here, then run what is left in the
  // io_context (timer handlers, which see their cancellation; transfers submitted late, by a
  // callback or racing the stop, which end cancelled since stopping is set).
  for (auto& ch : im.channels) ch->timer.cancel();
  im.work.reset();
  im.ctx.restart();
  im.ctx.poll();
  for (auto& ch : im.channels) {
    for (Transfer& t : ch->queue) {
      if (t.done) t.done(Times{}, true);
    }
    ch->queue.clear();
  }
}

void IoEngine::submit(std::uint32_t channel, Transfer t) {
  if (channel >= impl_->channels.size()) {
    detail::throw_bad_value("I/O engine channel", channel,
                            "must be below " + std::to_string(impl_->channels.size()));
  }
  Impl& im = *impl_;
  t.submitted = Clock::now();
  std::list<Transfer> node;  // made here: the engine thread only splices it in
  node.push_back(std::move(t));
  asio::post(im.ctx, [&im, channel, node = std::move(node)]() mutable {
    if (im.stopping.load(std::memory_order_relaxed)) {  // relaxed: as in start_front
      if (node.front().done) node.front().done(Times{}, true);
      return;
    }
    Impl::Channel& ch = *im.channels[channel];
    ch.queue.splice(ch.queue.end(), node);
    if (!ch.busy) im.start_front(ch);
  });
  im.posted.fetch_add(1, std::memory_order_release);  // after the post: a spinning engine polls
}

void IoEngine::wake() {
  Impl& im = *impl_;
  if (std::this_thread::get_id() == im.thread.get_id()) return;  // a callback: it is awake
  // Posted even when the engine watches: running it restarts the engine's idle watch, so it
  // does not go to sleep just as the transfers come.
  const std::uint64_t before = im.wakes.load(std::memory_order_acquire);
  asio::post(im.ctx, [&im] { im.wakes.fetch_add(1, std::memory_order_release); });
  im.posted.fetch_add(1, std::memory_order_release);
  if (!im.sleeping.load(std::memory_order_acquire)) return;  // watching: it sees the post
  // Until it runs (bounded: a wake-up that takes longer only makes the first transfer late).
  const auto give_up = Clock::now() + tunables::kIoWakeWaitMax;
  while (im.wakes.load(std::memory_order_acquire) == before && Clock::now() < give_up) {
    std::this_thread::yield();
  }
}

std::uint32_t IoEngine::channels() const noexcept {
  return static_cast<std::uint32_t>(impl_->channels.size());
}
const std::string& IoEngine::name() const noexcept {
  return impl_->name;
}
bool IoEngine::low_timer_slack() const noexcept {
  return impl_->slack_lowered.load(std::memory_order_relaxed);  // relaxed: a diagnostic
}

}  // namespace bspflow
