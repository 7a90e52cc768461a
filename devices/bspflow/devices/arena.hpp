/// @file
/// Arena: one device's memory, tiles x bytes-per-tile of it, reserved once on the device's
/// NUMA node (pages commit on first touch) and handed out in named allocations.
/// Guide: devices/README.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "bspflow/devices/device_error.hpp"

namespace bspflow {

/// One device's memory, handed out in named allocations. Allocating and releasing take a short
/// lock (setup paths, not the hot loop).
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class Arena {
 public:
  /// A live allocation: its name, its offset in the arena and its size.
  struct Allocation {
    std::string name;        ///< What the allocation was made for, as allocate() was told.
    std::size_t offset = 0;  ///< Where it starts, in bytes from the arena's start.
    std::size_t bytes = 0;   ///< Its size in bytes, rounded up to the arena alignment.
  };

  /// Reserves `bytes` on `numa_node`. `owner` names the arena in messages ("device 0").
  /// Contract: host; non-blocking; allocates; throws bad_alloc.
  Arena(std::size_t bytes, int numa_node, std::string owner);
  /// Gives the memory back to the system.
  /// Contract: host; non-blocking; no-alloc; noexcept.
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  /// `bytes` (rounded up to the arena alignment, 64) named `what`. Zero bytes is allowed and
  /// returns a unique non-null allocation of the alignment's size. When the arena cannot hold
  /// it, the OutOfMemoryError's message says how much was asked, how much is free (and the
  /// largest free block) and which named allocations hold the rest.
  /// Contract: any; non-blocking; allocates; throws OutOfMemoryError.
  void* allocate(std::size_t bytes, std::string_view what);
  /// Frees an allocation from this arena; a pointer it did not hand out is ignored.
  void release(void* ptr) noexcept;

  /// The arena's size in bytes.
  std::size_t capacity() const noexcept { return capacity_; }
  /// Bytes held by live allocations (each rounded up to the alignment).
  std::size_t used() const noexcept;
  /// Bytes not held by any allocation: capacity() - used().
  std::size_t free_bytes() const noexcept;
  /// The largest run of free bytes in one piece: the most one allocation can get.
  std::size_t largest_free_block() const noexcept;
  /// Live allocations, largest first.
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::vector<Allocation> allocations() const;
  /// What holds the memory, by name, largest first (the first eight names):
  /// "12.0 MiB used of 897.0 MiB, held by: 'weights' 8.0 MiB, 'prefetch buffer' 4.0 MiB".
  /// Contract: any; non-blocking; allocates; throws bad_alloc.
  std::string report() const;
  /// The name the arena goes by in messages ("device 0").
  const std::string& owner() const noexcept { return owner_; }

 private:
  std::string report_locked() const;
  std::size_t largest_free_locked() const;

  std::string owner_;
  std::size_t capacity_;
  std::byte* base_;
  mutable std::mutex mutex_;
  /// offset -> bytes: the free blocks, coalesced, and an entry of 0 bytes at each allocation
  /// (release() reuses it, so giving memory back never allocates).
  std::map<std::size_t, std::size_t> free_;
  std::map<std::size_t, Allocation> allocations_;  ///< offset -> allocation
  std::size_t used_ = 0;
  /// Map nodes release() took out, for allocate() to use again: a buffer allocated and
  /// released with every run (a loop's prefetch buffer) costs no heap allocation after the
  /// first (its name's string keeps its room too). A few of each, for a run's several.
  static constexpr std::size_t kSpareNodes = 4;
  std::array<decltype(free_)::node_type, kSpareNodes> spare_free_{};
  std::array<decltype(allocations_)::node_type, kSpareNodes> spare_allocations_{};
  std::size_t spare_free_count_ = 0, spare_allocations_count_ = 0;
  /// Give back / take a node (the spare array full: the node is freed; empty: none).
  template <class Node, class Spares>
  static void keep_node(Node&& node, Spares& spares, std::size_t& count) noexcept {
    if (count < spares.size()) spares[count++] = std::forward<Node>(node);
  }
  template <class Spares>
  static auto take_node(Spares& spares, std::size_t& count) noexcept {
    return count > 0 ? std::move(spares[--count]) : typename Spares::value_type{};
  }
};

}  // namespace bspflow
