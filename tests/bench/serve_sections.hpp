// serve_bench's sections on graphs, priority classes, swaps and mixed deadlines
// (serve_sections.cpp). Each prints its keys into `report`.
#pragma once

#include <chrono>
#include <cstdint>

#include "bench_util.hpp"

namespace serve {

struct Settings {
  std::chrono::nanoseconds a{20'000};  // the model's cost per batch
  std::chrono::nanoseconds b{2'000};   // and per request of a batch
  std::size_t max_batch = 16;
  double capacity = 0;  // requests/s of the model on one device (measured by serve_bench)
  bool quick = false;
  std::uint64_t seed = 27;
};

// serve_graph_hop_p50_us, serve_fanout_vs_slowest_branch.
void graph_section(bench::Report& report, const Settings& s);
// serve_priority_high_p99_vs_bound, serve_priority_high_p99_vs_no_classes,
// serve_priority_low_share.
void priority_section(bench::Report& report, const Settings& s);
// serve_swap_failed, serve_swap_p99_vs_steady, serve_rolling_swap_p99_vs_steady,
// serve_swap_first_vs_steady_p50.
void swap_section(bench::Report& report, const Settings& s);
// serve_goodput_mixed_vs_best_fixed.
void mixed_section(bench::Report& report, const Settings& s);

}  // namespace serve
