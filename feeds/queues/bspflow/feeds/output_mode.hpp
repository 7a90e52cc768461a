/// @file
/// OutputMode: what the host sees of a value the device writes to an outfeed every
/// iteration (TF-IPU IPUOutfeedMode / PopTorch OutputMode, same meanings): all(), final(),
/// sum() or every_n(n). Guide: feeds/README.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace bspflow {

/// A plain value type (two words): any thread may create, copy or read one.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class OutputMode {
 public:
  /// Which of the modes: all(), final(), sum() or every_n().
  enum class Kind { kAll, kFinal, kSum, kEveryN };

  /// One entry per iteration (with gradient accumulation, per accumulation step) per
  /// replica.
  static constexpr OutputMode all() noexcept { return OutputMode(Kind::kAll, 1); }
  /// The last iteration's entry, per replica.
  static constexpr OutputMode final() noexcept { return OutputMode(Kind::kFinal, 1); }
  /// The element-wise sum over all iterations, per replica.
  static constexpr OutputMode sum() noexcept { return OutputMode(Kind::kSum, 1); }
  /// Iterations n-1, 2n-1, ... (10 iterations, every_n(5): iterations 4 and 9). Throws
  /// bspflow::Error if n is 0.
  /// Contract: any; non-blocking; no-alloc; throws Error.
  static OutputMode every_n(std::uint64_t n);
  /// Parses "all", "final", "sum", "every_n:N" (as the examples' `--output-mode` takes it).
  /// Throws bspflow::Error naming the text and the accepted forms (for "every_n:0", the one
  /// every_n() throws).
  /// Contract: any; non-blocking; allocates; throws Error.
  static OutputMode parse(std::string_view text);

  /// Which mode this is.
  constexpr Kind kind() const noexcept { return kind_; }
  /// every_n()'s n; 1 for the other modes.
  constexpr std::uint64_t n() const noexcept { return n_; }

  /// Does iteration `i` (0-based) of a loop produce a host-visible entry right away?
  /// (final and sum produce theirs once, when the loop ends.)
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
  /// Entries one replica delivers for a loop of `iterations` iterations.
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

  /// "all", "final", "sum" or "every_n:N" (what parse() reads back).
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string to_string() const;
  /// Whether both are the same mode with the same n.
  friend constexpr bool operator==(OutputMode, OutputMode) noexcept = default;

 private:
  constexpr OutputMode(Kind kind, std::uint64_t n) noexcept : kind_(kind), n_(n) {}
  Kind kind_;
  std::uint64_t n_;
};

}  // namespace bspflow
