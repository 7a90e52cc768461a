// Streams: a generate stage's configuration (see bspflow/stream/generate.hpp).
#include "bspflow/stream/generate.hpp"

#include <chrono>
#include <string>

#include "bspflow/base/error.hpp"

namespace bspflow {

const char* to_string(MemoryPolicy policy) noexcept {
  switch (policy) {
    case MemoryPolicy::kPreempt:
      return "preempt";
    case MemoryPolicy::kFail:
      return "fail";
    case MemoryPolicy::kReserve:
      return "reserve";
  }
  return "unknown";
}

void GenerateConfig::validate(std::size_t entry_bytes) const {
  if (max_active == 0 || max_active > 4096) {
    detail::throw_bad_value("GenerateConfig::max_active", max_active, "must be 1..4096");
  }
  if (max_length == 0 || max_length > (1u << 24)) {
    detail::throw_bad_value("GenerateConfig::max_length", max_length, "must be 1..16777216");
  }
  if (block_entries == 0 || block_entries > (std::size_t{1} << 20)) {
    detail::throw_bad_value("GenerateConfig::block_entries", block_entries,
                            "must be 1..1048576 (a block holds at least one entry)");
  }
  if (entries_per_step == 0 || entries_per_step > block_entries) {
    detail::throw_bad_value("GenerateConfig::entries_per_step", entries_per_step,
                            "must be 1..block_entries (" + std::to_string(block_entries) + ")");
  }
  const std::size_t block_bytes = block_entries * entry_bytes;
  if (memory != 0 && memory < block_bytes) {
    detail::throw_bad_value("GenerateConfig::memory", memory,
                            "must be 0 (room for max_active sequences of max_length) or at least "
                            "one block (" +
                                std::to_string(block_entries) + " entries of " +
                                std::to_string(entry_bytes) +
                                " bytes: " + std::to_string(block_bytes) + " bytes)");
  }
  if (first_token_timeout && (*first_token_timeout < std::chrono::microseconds(1) ||
                              *first_token_timeout > std::chrono::hours(1))) {
    detail::throw_bad_value("GenerateConfig::first_token_timeout", *first_token_timeout,
                            "must be 1 us..1 h, or nullopt for no bound");
  }
  if (stream_every == 0 || stream_every > max_length) {
    detail::throw_bad_value("GenerateConfig::stream_every", stream_every,
                            "must be 1..max_length (" + std::to_string(max_length) +
                                "): outputs joined into one response");
  }
  const std::size_t pool = pool_blocks(entry_bytes);
  if (pool > (std::size_t{1} << 31)) {
    detail::throw_bad_value("GenerateConfig::memory", memory,
                            "holds more than 2^31 blocks: make block_entries larger");
  }
  if (memory_policy == MemoryPolicy::kReserve && pool < blocks_for(max_length)) {
    detail::throw_bad_value("GenerateConfig::memory", memory,
                            "must hold one sequence of max_length (" + std::to_string(max_length) +
                                " iterations: " + std::to_string(blocks_for(max_length)) +
                                " blocks of " + std::to_string(block_bytes) +
                                " bytes) under MemoryPolicy::kReserve, which reserves that much "
                                "for each sequence at admission");
  }
}

namespace detail {

std::string too_large(const GenerateConfig& config, std::uint32_t iterations, std::size_t pool,
                      const std::string& memory) {
  return "it asks for up to " + std::to_string(iterations) + " iteration(s), which need " +
         std::to_string(config.blocks_for(iterations)) + " block(s) of " +
         std::to_string(config.block_entries) +
         " entries, more than the generate stage's whole pool of " + std::to_string(pool) +
         " block(s): it could never run (" + memory + ")";
}

}  // namespace detail

}  // namespace bspflow
