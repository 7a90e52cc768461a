/// @file
/// Generative serving (see runtime/stream/README.md, "Generative serving"): a generate stage
/// answers each request with a sequence of outputs, one per device iteration, batched per
/// iteration rather than per request. Its configuration (GenerateConfig), the paged state
/// each sequence keeps in its device's arena (PagedState), the view of a sequence its step
/// gets (Generation) and what the step returns for each (StepOutput).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bspflow/base/error.hpp"
#include "bspflow/stream/detail/request_state.hpp"

namespace bspflow {

/// What a generate stage does when a sequence needs a new block of state and none is free.
enum class MemoryPolicy : std::uint8_t {
  /// Preempt (the default): the active sequence of the lowest priority class, the youngest
  /// within it, gives its blocks back; its state waits in host memory and it resumes, before
  /// any new sequence, once its blocks fit again. It is answered once, in the end.
  kPreempt,
  /// The sequence that needs the block ends with an ErrorKind::kStageFailed error that says
  /// so (and what holds the memory).
  kFail,
  /// Reserve at admission: a sequence is admitted only when blocks for max_length iterations
  /// are free, and keeps them to its end. Never preempts, and admits fewer sequences: for
  /// comparison with paging.
  kReserve,
};
/// The policy's name: "preempt", "fail" or "reserve".
/// Contract: any; non-blocking; no-alloc; noexcept.
const char* to_string(MemoryPolicy policy) noexcept;

/// How a generate stage (StreamBuilder::generate_stage, Node::generate_stage) runs its
/// iterations and keeps its sequences' state. validate() states the ranges.
struct GenerateConfig {
  /// Sequences in one iteration at most (the active set): 1..4096.
  std::uint32_t max_active = 8;
  /// Iterations a sequence runs at most: its output at the last one is final whatever the
  /// step says. A stage given a length function (generate_stage's last argument: a
  /// request's own bound, as max_tokens) takes the smaller of the two. 1..2^24.
  std::uint32_t max_length = 256;
  /// State entries in one block (vLLM's block size, in tokens): 1..2^20.
  std::size_t block_entries = 16;
  /// Entries a sequence may add to its state in one iteration (room the stage makes before
  /// each call): 1..block_entries.
  std::uint32_t entries_per_step = 1;
  /// Bytes of the device's arena for the state blocks of all sequences, taken when the
  /// stream is built (each replica on its own device). 0 (the default): room for max_active
  /// sequences of max_length, so nothing is ever preempted. Otherwise at least one block.
  std::size_t memory = 0;
  /// What happens when a sequence needs a block and none is free.
  MemoryPolicy memory_policy = MemoryPolicy::kPreempt;
  /// The longest a request may wait for its first output, from its push (time to first
  /// token): one still without an output past it ends with ErrorKind::kDeadlineExceeded, at
  /// the latest at the next iteration boundary. The request's own deadline bounds the whole
  /// sequence. nullopt (the default): no bound but the deadline; else 1 us..1 h.
  std::optional<std::chrono::nanoseconds> first_token_timeout{};
  /// Outputs per response: 1 (the default) streams each iteration's output as its own
  /// response; k > 1 joins k outputs, appended in order, into one response (the last holds
  /// what is left), so the step's output type must be a container with insert(end(), first,
  /// last), such as std::string or std::vector. Later nodes and the client see each joined
  /// response once. 1..max_length.
  std::uint32_t stream_every = 1;

  /// Checks every field, for state entries of `entry_bytes` each. Throws Error naming the
  /// field, the value and what is allowed.
  /// Contract: any; non-blocking; allocates (the message); throws Error.
  void validate(std::size_t entry_bytes) const;
  /// Blocks one sequence of `iterations` iterations needs at most.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t blocks_for(std::uint64_t iterations) const noexcept {
    const std::uint64_t entries = iterations * entries_per_step;
    return static_cast<std::size_t>((entries + block_entries - 1) / block_entries);
  }
  /// The pool's size in blocks, for entries of `entry_bytes`: memory / block bytes, or
  /// max_active * blocks_for(max_length) when memory is 0.
  /// Contract: any; non-blocking; no-alloc; noexcept.
  std::size_t pool_blocks(std::size_t entry_bytes) const noexcept {
    if (memory == 0) return static_cast<std::size_t>(max_active) * blocks_for(max_length);
    return memory / (block_entries * entry_bytes);
  }
};

namespace detail {
template <class In, class E, class Out>
class GenerateHead;
class Versioned;
// Why a request bound to `iterations` could never run on a pool of `pool` blocks, with
// `memory` (the device arena's report) after it.
std::string too_large(const GenerateConfig& config, std::uint32_t iterations, std::size_t pool,
                      const std::string& memory);
// Whether outputs of type T can be joined (GenerateConfig::stream_every): appended in order.
template <class T>
concept JoinableOutput = std::default_initializable<T> && requires(T& a, T& b) {
  a.insert(a.end(), std::make_move_iterator(b.begin()), std::make_move_iterator(b.end()));
  a.clear();
};
}  // namespace detail

/// One sequence's state: entries of type E (trivially copyable, such as one token's keys
/// and values), kept in fixed-size blocks of its device's arena and found through its block
/// table, so it grows without a maximum length reserved and without fragmenting. The
/// stage makes room for GenerateConfig::entries_per_step new entries before each call.
/// Contract of every member: device; non-blocking; no-alloc; noexcept, unless tagged.
template <class E>
class PagedState {
  static_assert(std::is_trivially_copyable_v<E>,
                "a generate stage's state entries must be trivially copyable (they live in the "
                "device arena and move to host memory when a sequence is preempted)");

 public:
  /// Entries held.
  std::size_t size() const noexcept { return size_; }
  /// Whether it holds none (the sequence's first iteration, or after a restart).
  bool empty() const noexcept { return size_ == 0; }
  /// Entries its blocks have room for.
  std::size_t capacity() const noexcept { return table_.size() * per_block_; }
  /// Entry i (i < size()).
  E& operator[](std::size_t i) noexcept { return *at(i); }
  /// Entry i (i < size()).
  const E& operator[](std::size_t i) const noexcept { return *at(i); }
  /// Adds an entry. Throws Error when the step adds more than entries_per_step in one call
  /// (no room was made for it).
  /// Contract: device; non-blocking; no-alloc; throws Error.
  void push_back(const E& e) {
    if (size_ == capacity()) {
      throw Error("PagedState::push_back: no room for entry " + std::to_string(size_) +
                  ": a step adds at most GenerateConfig::entries_per_step entries per sequence "
                  "and iteration");
    }
    ::new (static_cast<void*>(at(size_))) E(e);
    ++size_;
  }
  /// The block table: the pool's block numbers holding entries 0.., in order.
  std::span<const std::uint32_t> blocks() const noexcept { return table_; }
  /// Entries per block (GenerateConfig::block_entries).
  std::size_t block_entries() const noexcept { return per_block_; }

 private:
  template <class, class, class>
  friend class detail::GenerateHead;
  E* at(std::size_t i) const noexcept {
    return base_ + static_cast<std::size_t>(table_[i / per_block_]) * per_block_ + i % per_block_;
  }
  E* base_ = nullptr;
  std::size_t per_block_ = 1;
  std::vector<std::uint32_t> table_;
  std::size_t size_ = 0;
};

/// What a generate stage's step sees of one active sequence: its request's input, its
/// paged state, and how many iterations it has run.
/// Contract of every member: device; non-blocking; no-alloc; noexcept.
template <class In, class E>
class Generation {
 public:
  /// The request's value (the stage's input); the step may keep what it likes in it.
  In& input() noexcept { return *input_; }
  /// The request's value.
  const In& input() const noexcept { return *input_; }
  /// The sequence's state, in the device arena.
  PagedState<E>& state() noexcept { return state_; }
  /// The sequence's state.
  const PagedState<E>& state() const noexcept { return state_; }
  /// Iterations it has run before this one (0 at its first).
  std::uint32_t step() const noexcept { return step_; }
  /// The most iterations it runs: its output at that one is final. The stage's length
  /// function's value for its request (clamped to 1..GenerateConfig::max_length), or
  /// max_length when the stage has none.
  std::uint32_t max_length() const noexcept { return limit_; }
  /// The request it answers.
  RequestId id() const noexcept { return meta_.id; }
  /// Its priority class.
  std::uint32_t priority() const noexcept { return meta_.priority; }

 private:
  template <class, class, class>
  friend class detail::GenerateHead;
  std::optional<In> input_;
  PagedState<E> state_;
  std::uint32_t step_ = 0;
  std::uint32_t limit_ = 0;  // max_length()
  detail::RequestMeta meta_{};
  std::uint32_t parts_ = 0;               // responses sent for it so far
  std::vector<E> saved_;                  // its state while preempted (host memory)
  StreamClock::time_point last_out_{};    // when its last response was made
  std::shared_ptr<void> joined_;          // outputs held for its next response (stream_every)
  std::uint32_t held_ = 0;                // how many
  detail::Versioned* version_ = nullptr;  // the step's version it started on
};

/// What a generate stage's step returns for one sequence: its output of this iteration (a
/// partial response, or the final one), or why the sequence failed.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
template <class Out>
class StepOutput {
 public:
  /// The output type.
  using value_type = Out;
  /// This iteration's output; the sequence goes on (until max_length).
  /// Throws only what Out's move constructor throws.
  static StepOutput next(Out value) noexcept(noexcept(Out(std::declval<Out&&>()))) {
    StepOutput s;
    s.value_.emplace(std::move(value));
    return s;
  }
  /// Its last output: the sequence is done, its response final, its state freed.
  /// Throws only what Out's move constructor throws.
  static StepOutput last(Out value) noexcept(noexcept(Out(std::declval<Out&&>()))) {
    StepOutput s = next(std::move(value));
    s.done_ = true;
    return s;
  }
  /// The sequence failed, for `why`: it ends with ErrorKind::kStageFailed; the others go on.
  // NOLINTNEXTLINE(performance-unnecessary-value-param): a sink, moved from
  static StepOutput failure(std::string why) noexcept {
    StepOutput s;
    s.error_ = std::move(why);
    s.done_ = true;
    return s;
  }
  /// Whether it holds an output (not a failure).
  bool ok() const noexcept { return value_.has_value(); }
  /// Whether the sequence ends here.
  bool done() const noexcept { return done_; }
  /// The output; only when ok().
  Out& value() noexcept { return *value_; }
  /// Why it failed; empty when ok().
  const std::string& error() const noexcept { return error_; }

 private:
  StepOutput() = default;
  std::optional<Out> value_;
  std::string error_;
  bool done_ = false;
};

}  // namespace bspflow
