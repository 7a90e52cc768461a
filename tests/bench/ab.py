#!/usr/bin/env python3
"""Same-run A/B of benchmarks: runs each benchmark of two builds alternately and compares.

  ab.py --a DIR_A --a-name NAME_A --b DIR_B --b-name NAME_B [--runs N] [--quick] BENCH...

DIR_A and DIR_B are meson build directories holding tests/bench/<BENCH>_bench. Each round
runs every benchmark once from A and once from B (the order alternates each round, so drift
on a shared machine falls on both sides alike), each writing its figures with --json. Then,
for each numeric key, prints the median and the range of A and of B and the difference of
the medians in percent of A. Exit 0 when every run succeeded, 1 otherwise.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(build, bench, quick, extra):
    exe = os.path.join(build, "tests", "bench", f"{bench}_bench")
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"ab: {exe} is not built (ninja -C {build} tests/bench/{bench}_bench)")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [exe, "--json", path] + (["--quick"] if quick else []) + extra
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.stderr.write(f"ab: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}\n")
            return None
        with open(path) as f:
            data = json.load(f)
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    finally:
        os.unlink(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--a-name", default="A")
    ap.add_argument("--b", required=True)
    ap.add_argument("--b-name", default="B")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write every figure of every run here")
    ap.add_argument("benches", nargs="+")
    opts = ap.parse_args()
    if opts.runs < 1:
        raise SystemExit(f"ab: --runs {opts.runs} is not allowed: must be at least 1")
    figures = {b: {"a": [], "b": []} for b in opts.benches}
    ok = True
    for round_ in range(opts.runs):
        sides = [("a", opts.a), ("b", opts.b)]
        if round_ % 2 == 1:
            sides.reverse()
        for bench in opts.benches:
            for side, build in sides:
                got = run_once(build, bench, opts.quick, [])
                if got is None:
                    ok = False
                else:
                    figures[bench][side].append(got)
        print(f"ab: round {round_ + 1}/{opts.runs} done", file=sys.stderr, flush=True)
    width = max((len(k) for b in figures.values() for r in b["a"] + b["b"] for k in r), default=10)
    for bench in opts.benches:
        print(f"\n== {bench}_bench: {opts.a_name} (A) vs {opts.b_name} (B), "
              f"{len(figures[bench]['a'])} + {len(figures[bench]['b'])} runs, alternating")
        print(f"{'key':<{width}}  {'A median':>12} {'A range':>25}  {'B median':>12} {'B range':>25}  {'B-A':>8}")
        keys = sorted({k for r in figures[bench]["a"] + figures[bench]["b"] for k in r})
        for k in keys:
            a = [r[k] for r in figures[bench]["a"] if k in r]
            b = [r[k] for r in figures[bench]["b"] if k in r]
            if not a or not b:
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            diff = f"{100.0 * (mb - ma) / ma:+.1f}%" if ma != 0 else "n/a"
            print(f"{k:<{width}}  {ma:>12.4g} {f'{min(a):.4g}..{max(a):.4g}':>25}  "
                  f"{mb:>12.4g} {f'{min(b):.4g}..{max(b):.4g}':>25}  {diff:>8}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"a": opts.a_name, "b": opts.b_name, "figures": figures}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
