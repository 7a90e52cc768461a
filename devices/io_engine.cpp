// The I/O engine (see bspflow/devices/io_engine.hpp). The only file that includes Asio.
#include "bspflow/devices/io_engine.hpp"
#include "bspflow/devices/device_tunables.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

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
    std::deque<Transfer> queue;  // engine thread only
    bool busy = false;           // the front transfer has started (or is being retried)
    std::chrono::nanoseconds poll = tunables::kIoPollFirst;
    bool waited = false;          // the front transfer's data was not there at first
    Clock::time_point free_at{};  // when the previous transfer ended
    asio::steady_timer timer;
  };

  Impl(std::uint32_t n, std::string engine_name, std::optional<std::uint32_t> core)
      : name(std::move(engine_name)), work(asio::make_work_guard(ctx)) {
    channels.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) channels.push_back(std::make_unique<Channel>(ctx));
    thread = std::thread([this, core] {
      if (core) Topology::get().pin_current_thread(*core);
      slack_lowered.store(lower_timer_slack(), std::memory_order_relaxed);  // a diagnostic
      serve();
    });
  }

  // Engine thread: runs handlers; when there are none, polls for kSpinBudget before it
  // blocks in the io_context (epoll), whose wake-up takes tens of microseconds on a VM.
  void serve() {
    auto idle_since = Clock::now();
    for (;;) {
      if (ctx.poll() != 0) {
        idle_since = Clock::now();
        continue;
      }
      if (ctx.stopped()) return;
      if (Clock::now() - idle_since < tunables::kSpinBudget) {
        for (int i = 0; i < 16; ++i) detail::cpu_relax();
        continue;
      }
      if (ctx.run_one() == 0) return;  // stopped: out of work after the guard was reset
      idle_since = Clock::now();
    }
  }

  // Engine thread. Starts the channel's front transfer, or schedules a retry.
  void start_front(Channel& ch) {
    if (ch.queue.empty() || stopping.load(std::memory_order_relaxed))
      return;  // relaxed: re-checked at stop
    ch.busy = true;
    Transfer& t = ch.queue.front();
    const Clock::time_point now = Clock::now();
    // Modeled start: when asked for or when the link came free (see Transfer::submitted);
    // after a wait for data, when the data was found.
    const Clock::time_point begin =
        ch.waited ? now : std::min(now, std::max(t.submitted, ch.free_at));
    const Start what = t.start();
    if (what == Start::kSkip) {
      finish_front(ch, Times{begin, begin});
      return;
    }
    if (what == Start::kWait) {
      ch.waited = true;
      ch.timer.expires_after(ch.poll);
      ch.poll = std::min(ch.poll * 2, std::chrono::nanoseconds(tunables::kIoPollMax));
      ch.timer.async_wait([this, &ch](const boost::system::error_code& ec) {
        if (!ec) start_front(ch);
      });
      return;
    }
    ch.poll = tunables::kIoPollFirst;
    const Clock::time_point deadline = begin + t.modeled;
    ch.timer.expires_at(deadline - tunables::kTimerMargin);
    ch.timer.async_wait([this, &ch, begin, deadline](const boost::system::error_code& ec) {
      if (ec) return;                 // cancelled at stop: finished below
      wait_until_deadline(deadline);  // the timer fired within the margin: this spins
      finish_front(ch, Times{begin, Clock::now()});
    });
  }

  // Engine thread. The front transfer has ended: report it, start the next.
  void finish_front(Channel& ch, const Times& times) {
    Transfer t = std::move(ch.queue.front());
    ch.queue.pop_front();
    ch.busy = false;
    ch.waited = false;
    ch.free_at = times.end;
    t.done(times, false);
    start_front(ch);
  }

  std::string name;
  asio::io_context ctx;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  std::vector<std::unique_ptr<Channel>> channels;
  std::atomic<bool> stopping{false};
  std::atomic<bool> slack_lowered{false};
  std::thread thread;
};

IoEngine::IoEngine(std::uint32_t channels, std::string name, std::optional<std::uint32_t> core) {
  if (channels < 1 || channels > 4096) {
    detail::throw_bad_value("I/O engine channels", channels, "must be in 1..4096");
  }
  impl_ = std::make_unique<Impl>(channels, std::move(name), core);
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

IoEngine::~IoEngine() {
  Impl& im = *impl_;
  // On the engine thread: stop starting transfers, cancel timers, then let run() return.
  asio::post(im.ctx, [&im] {
    im.stopping.store(true, std::memory_order_relaxed);  // relaxed: engine thread only reads it
    for (auto& ch : im.channels) ch->timer.cancel();
    im.work.reset();
  });
  im.thread.join();
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
  asio::post(im.ctx, [&im, channel, t = std::move(t)]() mutable {
    if (im.stopping.load(std::memory_order_relaxed)) {  // relaxed: engine thread only
      if (t.done) t.done(Times{}, true);
      return;
    }
    Impl::Channel& ch = *im.channels[channel];
    ch.queue.push_back(std::move(t));
    if (!ch.busy) im.start_front(ch);
  });
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
