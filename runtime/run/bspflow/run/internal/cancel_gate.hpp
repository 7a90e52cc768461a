// The run room's internal API (not for users; installed because the stream's templates
// include it): the stop of one blocking run() call, detail::CancelGate behind
// Engine::cancel(), Pipeline::cancel() and Stream::cancel(), and the std::stop_token a caller
// gives run().
#pragma once

#include <mutex>
#include <optional>
#include <stop_token>
#include <utility>

namespace bspflow::detail {

// A std::stop_callback's callable: requests a stop on `source` (a caller's token forwarded
// to a run's own source).
struct RequestStop {
  mutable std::stop_source source;
  void operator()() const noexcept { source.request_stop(); }
};

// An entry point's cancel(), for one run() call at a time. The call opens a Scope as its
// first statement and closes it when it returns; cancel() from any thread in between stops
// that call's run, whether its devices have started yet or not (before: they take nothing
// and end kCancelled). Between calls cancel() does nothing: a stop meant for a run that may
// not have started yet is a std::stop_token given to run(), which the Scope watches too.
class CancelGate {
 public:
  // Host thread, first thing in run() (at most one open at a time per gate). Its token()
  // is stopped by `caller` (before, during or after this), by the gate's cancel(), and by
  // nothing else. Allocates (the stop state); throws only std::bad_alloc.
  class Scope {
   public:
    Scope(CancelGate& gate, std::stop_token caller) : gate_(gate) {
      {
        std::lock_guard lock(gate_.mutex_);
        gate_.open_ = &source_;
      }
      // Runs at once if the caller's stop was already requested.
      caller_.emplace(std::move(caller), RequestStop{source_});
    }
    // Host thread, when run() returns: later cancel() calls do nothing; waits for a caller's
    // stop request in progress on another thread. Never throws.
    ~Scope() {
      caller_.reset();
      std::lock_guard lock(gate_.mutex_);
      gate_.open_ = nullptr;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    // Any thread. The run's stop: give it to what the run starts. Never blocks, never throws.
    std::stop_token token() const noexcept { return source_.get_token(); }

   private:
    CancelGate& gate_;
    std::stop_source source_;
    std::optional<std::stop_callback<RequestStop>> caller_;
  };

  // Any thread. Stops the run() call in progress, if any (see Scope); its stop callbacks run
  // on this thread, after the gate's mutex is released. Never blocks for long, never throws.
  void cancel() noexcept {
    std::stop_source open(std::nostopstate);
    {
      std::lock_guard lock(mutex_);
      if (open_ != nullptr) open = *open_;  // a copy shares the state: no allocation
    }
    open.request_stop();
  }

 private:
  std::mutex mutex_;
  std::stop_source* open_ = nullptr;  // the open Scope's source; under mutex_
};

}  // namespace bspflow::detail
