#!/bin/sh
# Runs one libFuzzer target: run_fuzz.sh TARGET WORK_DIR CORPUS_DIR...
#   BSPFLOW_FUZZ_SECONDS   how long (default 30)
# It starts from the checked-in corpus directories (seeds, regressions), which it leaves as
# they are; new inputs it finds go to WORK_DIR, kept for the next run. A crash, leak,
# sanitizer report, out-of-memory (2 GiB) or slow input (10 s) fails the run and leaves the
# input as WORK_DIR/crash-*, oom-* or timeout-*: add it under tests/fuzz/regressions/<target>/
# with the fix. Inputs are capped at 64 KiB.
set -eu
target=$1 work=$2
shift 2
mkdir -p "$work"
exec "$target" -max_total_time="${BSPFLOW_FUZZ_SECONDS:-30}" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$work/" "$work" "$@"
