// OutputMode: what the host sees of a value the device writes to an outfeed every
// iteration (TF-IPU IPUOutfeedMode / PopTorch OutputMode, same meanings):
//   all()        one entry per iteration (and, with gradient accumulation, per accumulation
//                step) per replica;
//   final()      the last iteration's entry, per replica;
//   sum()        the element-wise sum over all iterations, per replica;
//   every_n(n)   iterations n-1, 2n-1, ... (10 iterations, every_n(5): iterations 4 and 9).
//
// A plain value type (two words): any thread may create, copy or read one.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace bspflow {

class OutputMode {
 public:
  enum class Kind { kAll, kFinal, kSum, kEveryN };

  // Any thread. Never blocks, never allocates, never throws.
  static constexpr OutputMode all() noexcept { return OutputMode(Kind::kAll, 1); }
  static constexpr OutputMode final() noexcept { return OutputMode(Kind::kFinal, 1); }
  static constexpr OutputMode sum() noexcept { return OutputMode(Kind::kSum, 1); }
  // Any thread. Never blocks, never allocates. Throws bspflow::Error naming the field, the
  // value and what is allowed if n == 0.
  static OutputMode every_n(std::uint64_t n);
  // Any thread. Parses "all", "final", "sum", "every_n:N" (as the examples' --output-mode
  // takes it). Never blocks; may allocate (a temporary copy of the digits). Throws
  // bspflow::Error naming the text and the accepted forms (for "every_n:0", the one
  // every_n() throws).
  static OutputMode parse(std::string_view text);

  // Any thread. Never blocks, never allocates, never throws.
  constexpr Kind kind() const noexcept { return kind_; }
  constexpr std::uint64_t n() const noexcept { return n_; }

  // Does iteration `i` (0-based) of a loop produce a host-visible entry right away?
  // (final and sum produce theirs once, when the loop ends.) Any thread. Never blocks,
  // never allocates, never throws.
  constexpr bool emits_at(std::uint64_t i) const noexcept {
    switch (kind_) {
      case Kind::kAll:
        return true;
      case Kind::kEveryN:
        return (i + 1) % n_ == 0;
      default:
        return false;
    }
  }
  // Entries one replica delivers for a loop of `iterations` iterations. Any thread. Never
  // blocks, never allocates, never throws.
  constexpr std::uint64_t entries_for(std::uint64_t iterations) const noexcept {
    switch (kind_) {
      case Kind::kAll:
        return iterations;
      case Kind::kEveryN:
        return iterations / n_;
      default:
        return iterations == 0 ? 0 : 1;
    }
  }

  // Any thread. "all", "final", "sum" or "every_n:N" (what parse() reads back). Never
  // blocks; may allocate (the returned string). Throws only std::bad_alloc.
  std::string to_string() const;
  // Any thread. Never blocks, never allocates, never throws.
  friend constexpr bool operator==(OutputMode, OutputMode) noexcept = default;

 private:
  constexpr OutputMode(Kind kind, std::uint64_t n) noexcept : kind_(kind), n_(n) {}
  Kind kind_;
  std::uint64_t n_;
};

}  // namespace bspflow
