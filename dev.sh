#!/bin/sh
# bspflow developer entry point. Installs what the build needs (Debian packages, with
# apt-get, as root or through sudo), configures meson, builds what the command needs, then
# runs it:
#
#   ./dev.sh demo [ARGS]   build the library and the main demo only, and run it (ARGS go to
#                          the demo; --help lists them)
#   ./dev.sh test [ARGS]   build what the tests need and run them (meson test; ARGS go to it)
#   ./dev.sh bench [ARGS]  build and run the benchmarks (opt-in; prints key: value figures)
#                          and keep their JSON in build/bench-results/DATE_COMMIT/, or in
#                          the directory $BSPFLOW_BENCH_OUT names
#   ./dev.sh docs          the API reference with Doxygen: build/docs/html/index.html; any
#                          warning fails it
#   ./dev.sh tsan          build under ThreadSanitizer (build-tsan/) and run the thread tests
#   ./dev.sh asan          the same with AddressSanitizer + UBSan (build-asan/)
#   ./dev.sh fuzz [ARGS]   build the libFuzzer targets with clang (build-fuzz/) and run each
#                          for BSPFLOW_FUZZ_SECONDS (default 30); ARGS go to meson test
#   ./dev.sh consumers     install the library (staged) and build a program against it
#                          through pkg-config, CMake and a meson subproject
#   ./dev.sh format [--check]  lay out every C++ file with clang-format 14 (.clang-format);
#                          --check changes nothing and fails if a file is not laid out (it
#                          names a library file over 500 lines, without failing)
#   ./dev.sh tidy [FILE...] clang-tidy 14 (.clang-tidy) over the library's sources (runtime/,
#                          devices/, feeds/) and their headers; any finding fails it
#   ./dev.sh ab REV [BENCH...] [--runs N] [--quick]
#                          same-run A/B: builds REV's benchmarks in build-ab/<commit>
#                          (cached), runs each BENCH (default: feed pipeline) alternately
#                          from REV and from the working tree N times (default 5) and prints
#                          every key's median and range for both, and the difference
#   ./dev.sh deps          only install the packages
#
# Environment: BUILD_DIR (default build), MESON_ARGS (extra `meson setup` options for a new
# build directory, e.g. -Dwerror=true), BSPFLOW_BENCH_OUT (where bench keeps its JSON).
set -eu
cd "$(dirname "$0")"

PACKAGES="g++ meson ninja-build pkg-config cmake libconcurrentqueue-dev libboost-dev \
libhwloc-dev doctest-dev libcli11-dev nlohmann-json3-dev zlib1g-dev dataset-fashion-mnist \
libeigen3-dev libtbb-dev libreaderwriterqueue-dev openmpi-bin libopenmpi-dev prometheus-cpp-dev \
wamerican"

# The fuzz targets' compiler and libFuzzer (Debian 12's clang is clang 14).
FUZZ_PACKAGES="clang libfuzzer-14-dev"

# The formatter (Debian 12's clang-format is clang-format 14, the version .clang-format is
# written for), the A/B command's interpreter, and the API reference's generator.
FORMAT_PACKAGES="clang-format-14"
AB_PACKAGES="python3"
DOCS_PACKAGES="doxygen"
# The linter (Debian 12's clang-tidy is clang-tidy 14, the version .clang-tidy is written for).
TIDY_PACKAGES="clang-tidy-14"

# The rooms' test suites (meson test --suite ...): what the sanitizer builds run.
ROOM_SUITES="--suite base --suite feeds --suite data --suite devices --suite run --suite engine \
--suite loops --suite pipeline --suite stream --suite instance"

# cxx_files: every C++ file git tracks, outside the wrap fallbacks and the fuzz corpus.
cxx_files() {
  git ls-files '*.cpp' '*.hpp' '*.h' '*.cc' | grep -v -e '^subprojects/' -e '^tests/fuzz/corpus/' \
    -e '^tests/fuzz/regressions/'
}

# install_deps [PACKAGES...]: installs those of the packages (default: $PACKAGES) missing.
install_deps() {
  missing=""
  for p in ${*:-$PACKAGES}; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
      missing="$missing $p"
    fi
  done
  [ -z "$missing" ] && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "dev.sh: missing packages:$missing (no apt-get here: install them by hand)" >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    sudo=""
  elif command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  else
    echo "dev.sh: missing packages:$missing (run as root, or install them by hand)" >&2
    exit 1
  fi
  echo "dev.sh: installing$missing"
  $sudo apt-get update -q
  # shellcheck disable=SC2086  # the list is meant to split
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends $missing
}

# setup DIR [meson options...]: set up DIR once; a later run applies the options given here
# to it again (an older directory takes up what this script now asks for).
setup() {
  dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    # shellcheck disable=SC2086  # MESON_ARGS is a list of options
    meson setup "$dir" "$@" ${MESON_ARGS:-}
  elif [ $# -gt 0 ]; then
    meson configure "$dir" "$@"
  fi
}

# configure DIR [meson options...]: set up DIR, then build everything in it.
configure() {
  setup "$@"
  meson compile -C "$1"
}

build=${BUILD_DIR:-build}
what=${1:-}
[ $# -gt 0 ] && shift

case "$what" in
  deps)
    install_deps
    ;;
  demo)
    install_deps
    setup "$build"
    # Only the library and the demo (with the model kit it uses), not every test and
    # benchmark: a first run on a new machine shows something quickly.
    meson compile -C "$build" t03_fashion_mnist_pipeline
    "$build/examples/t03_fashion_mnist_pipeline" "$@"
    ;;
  test)
    install_deps
    setup "$build"
    # meson test builds what the chosen tests run, and nothing else.
    meson test -C "$build" --print-errorlogs "$@"
    ;;
  bench)
    install_deps
    configure "$build"
    meson test -C "$build" --benchmark --suite bench "$@"
    # The figures, dated, outside the source tree: build/bench-results/<date>_<hhmm>_<commit>
    # [-dirty]/<bench>.json, or the directory BSPFLOW_BENCH_OUT names.
    stamp="$(date -u +%Y-%m-%d_%H%M)_$(git rev-parse --short HEAD 2>/dev/null || echo nogit)"
    git diff --quiet HEAD -- 2>/dev/null || stamp="$stamp-dirty"
    out=${BSPFLOW_BENCH_OUT:-$build/bench-results/$stamp}
    mkdir -p "$out"
    for f in "$build"/tests/bench/*.json; do
      [ -f "$f" ] && cp "$f" "$out/"
    done
    echo "dev.sh bench: figures kept in $out/ (python3 tests/bench/table.py $out renders them)"
    ;;
  docs)
    install_deps
    install_deps $DOCS_PACKAGES
    setup "$build"
    # The build directory may predate doxygen: look for it again.
    [ -f "$build/tests/docs/Doxyfile" ] || meson setup --reconfigure "$build" >/dev/null
    meson compile -C "$build" docs
    echo "dev.sh docs: the reference is in $build/docs/html/index.html"
    ;;
  tidy)
    install_deps
    install_deps $TIDY_PACKAGES
    setup "$build"  # its compile_commands.json says how each source is compiled
    if [ $# -gt 0 ]; then
      files="$*"
    else
      files=$(git ls-files 'runtime/*.cpp' 'devices/*.cpp' 'feeds/*.cpp')
    fi
    # shellcheck disable=SC2086  # one argument per file
    run-clang-tidy-14 -p "$build" -quiet -j "$(nproc)" $files
    echo "dev.sh tidy: $(echo $files | wc -w) sources, no finding"
    ;;
  tsan)
    install_deps
    # Line tables only (-g1): reports still name file and line, at half the compile time.
    # No `meson compile` first: `meson test` builds only what the chosen suites run (not the
    # benchmarks, the soak suite or the MPI tests).
    setup "${BUILD_DIR:-build-tsan}" -Db_sanitize=thread -Db_lundef=false -Dexamples=false \
      -Dcpp_args=-g1
    meson test -C "${BUILD_DIR:-build-tsan}" --print-errorlogs \
      $ROOM_SUITES "$@"
    ;;
  asan)
    install_deps
    # -O1 and line tables only (-g1): AddressSanitizer's advice for its builds, and a third of
    # the compile time of -O2 -g here; reports still name file and line. As for tsan, only
    # what the suites run is built.
    setup "${BUILD_DIR:-build-asan}" -Db_sanitize=address,undefined -Db_lundef=false \
      -Dexamples=false -Doptimization=1 -Dcpp_args=-g1
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C "${BUILD_DIR:-build-asan}" \
      --print-errorlogs $ROOM_SUITES --suite fuzz_corpus "$@"
    ;;
  fuzz)
    install_deps
    install_deps $FUZZ_PACKAGES
    CC=clang CXX=clang++ configure "${BUILD_DIR:-build-fuzz}" -Dfuzz=true -Dexamples=false \
      -Db_sanitize=address,undefined -Db_lundef=false
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C "${BUILD_DIR:-build-fuzz}" \
      --print-errorlogs --suite fuzz "$@"
    ;;
  consumers)
    install_deps
    configure "$build"
    BUILD_DIR="$build" tests/consumers/check.sh
    ;;
  format)
    install_deps $FORMAT_PACKAGES
    if [ "${1:-}" = "--check" ]; then
      # shellcheck disable=SC2046  # one argument per file
      if ! clang-format-14 --dry-run --Werror $(cxx_files); then
        echo "dev.sh format: the files above are not laid out as .clang-format says: run ./dev.sh format" >&2
        exit 1
      fi
      echo "dev.sh format: $(cxx_files | wc -l) files laid out as .clang-format says"
      # A file holds one idea; its length is a hint to look, never the reason to split it or
      # cut its comments. A library file over 500 lines is named, not failed.
      long=$(cxx_files | grep -e '^runtime/' -e '^devices/' -e '^feeds/' | xargs wc -l |
        awk '$2 != "total" && $1 > 500 { print $2 " (" $1 " lines)" }')
      if [ -n "$long" ]; then
        echo "dev.sh format: note: library files over 500 lines (does each hold one idea?): $long" >&2
      fi
    elif [ $# -eq 0 ]; then
      # shellcheck disable=SC2046
      clang-format-14 -i $(cxx_files)
    else
      echo "dev.sh format: unknown argument '$1' (allowed: --check, or nothing)" >&2
      exit 2
    fi
    ;;
  ab)
    [ $# -ge 1 ] || { echo "dev.sh ab: usage: ./dev.sh ab REV [BENCH...] [--runs N] [--quick]" >&2; exit 2; }
    install_deps
    install_deps $AB_PACKAGES
    rev=$1
    shift
    commit=$(git rev-parse --verify --quiet "$rev^{commit}") ||
      { echo "dev.sh ab: '$rev' is not a commit of this repository" >&2; exit 2; }
    benches=""
    ab_args=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --runs) [ $# -ge 2 ] || { echo "dev.sh ab: --runs needs a number" >&2; exit 2; }
                ab_args="$ab_args --runs $2"; shift 2 ;;
        --quick) ab_args="$ab_args --quick"; shift ;;
        -*) echo "dev.sh ab: unknown option '$1' (allowed: --runs N, --quick)" >&2; exit 2 ;;
        *) benches="$benches $1"; shift ;;
      esac
    done
    [ -n "$benches" ] || benches="feed pipeline"
    side="build-ab/$commit"
    if [ ! -f "$side/src/meson.build" ]; then
      rm -rf "$side"
      mkdir -p "$side/src"
      git archive "$commit" | tar -x -C "$side/src"
    fi
    [ -f "$side/build/build.ninja" ] || meson setup "$side/build" "$side/src" -Dexamples=false >/dev/null
    # Only the benchmarks compared, on both sides (not every test and example of the tree).
    setup "$build"
    for b in $benches; do
      ninja -C "$side/build" "tests/bench/${b}_bench" >/dev/null
      ninja -C "$build" "tests/bench/${b}_bench" >/dev/null
    done
    # shellcheck disable=SC2086  # lists meant to split
    python3 tests/bench/ab.py --a "$side/build" --a-name "$(git rev-parse --short "$commit")" \
      --b "$build" --b-name "working tree" $ab_args $benches
    ;;
  *)
    sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'
    [ -z "$what" ] || { echo "dev.sh: unknown command '$what'" >&2; exit 2; }
    ;;
esac
