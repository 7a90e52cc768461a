#!/bin/sh
# bspflow developer entry point. Installs what the build needs (Debian packages, with
# apt-get, as root or through sudo), configures meson, builds, then runs one thing:
#
#   ./dev.sh demo          build and run the main demo
#   ./dev.sh test [ARGS]   build and run every test suite (meson test; ARGS go to it)
#   ./dev.sh bench         build and run the benchmarks (opt-in; prints key: value figures)
#   ./dev.sh tsan          build under ThreadSanitizer (build-tsan/) and run the thread tests
#   ./dev.sh asan          the same with AddressSanitizer + UBSan (build-asan/)
#   ./dev.sh fuzz [ARGS]   build the libFuzzer targets with clang (build-fuzz/) and run each
#                          for BSPFLOW_FUZZ_SECONDS (default 30); ARGS go to meson test
#   ./dev.sh consumers     install the library (staged) and build a program against it
#                          through pkg-config, CMake and a meson subproject
#   ./dev.sh deps          only install the packages
#
# Environment: BUILD_DIR (default build), MESON_ARGS (extra `meson setup` options for a new
# build directory, e.g. -Dwerror=true).
set -eu
cd "$(dirname "$0")"

PACKAGES="g++ meson ninja-build pkg-config cmake libconcurrentqueue-dev libboost-dev \
libhwloc-dev doctest-dev libcli11-dev nlohmann-json3-dev zlib1g-dev dataset-fashion-mnist \
libeigen3-dev libtbb-dev libreaderwriterqueue-dev openmpi-bin libopenmpi-dev"

# The fuzz targets' compiler and libFuzzer (Debian 12's clang is clang 14).
FUZZ_PACKAGES="clang libfuzzer-14-dev"

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

# configure DIR [meson options...]: set up DIR once; later runs just rebuild.
configure() {
  dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    # shellcheck disable=SC2086  # MESON_ARGS is a list of options
    meson setup "$dir" "$@" ${MESON_ARGS:-}
  fi
  meson compile -C "$dir"
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
    configure "$build"
    "$build/examples/t03_fashion_mnist_pipeline" "$@"
    ;;
  test)
    install_deps
    configure "$build"
    meson test -C "$build" --print-errorlogs "$@"
    ;;
  bench)
    install_deps
    configure "$build"
    meson test -C "$build" --benchmark --suite bench "$@"
    ;;
  tsan)
    install_deps
    configure "${BUILD_DIR:-build-tsan}" -Db_sanitize=thread -Db_lundef=false -Dexamples=false
    meson test -C "${BUILD_DIR:-build-tsan}" --print-errorlogs \
      --suite base --suite feeds --suite data --suite devices --suite runtime "$@"
    ;;
  asan)
    install_deps
    configure "${BUILD_DIR:-build-asan}" -Db_sanitize=address,undefined -Db_lundef=false \
      -Dexamples=false
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 meson test -C "${BUILD_DIR:-build-asan}" \
      --print-errorlogs --suite base --suite feeds --suite data --suite devices --suite runtime \
      --suite fuzz_corpus "$@"
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
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    [ -z "$what" ] || { echo "dev.sh: unknown command '$what'" >&2; exit 2; }
    ;;
esac
