#!/bin/sh
# Builds and runs the consumer (main.cpp) the three ways a project takes bspflow in:
#   1. pkg-config, against a staged `meson install` of BUILD_DIR (default build);
#   2. CMake's find_package(bspflow CONFIG) against the same staged install (with clang++
#      when it is there, so the public headers are also compiled by a second compiler);
#   3. meson, with this source tree as the subproject subprojects/bspflow.
# Every step builds in fresh temporary directories. Called by .ci/run and ./dev.sh consumers.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/tests/consumers"
build="$root/${BUILD_DIR:-build}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

prefix="$work/stage"
meson install -C "$build" --destdir "$prefix" --quiet
pcdir=$(find "$prefix" -name bspflow.pc -printf '%h\n' | head -n 1)
libdir=$(dirname "$pcdir")

echo "consumers: pkg-config"
# The .pc file names the real prefix; point pkg-config at the staged copy.
PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_SYSROOT_DIR="$prefix" \
  sh -c "c++ -o '$work/pc_consumer' '$here/main.cpp' \$(pkg-config --cflags --libs bspflow)"
LD_LIBRARY_PATH="$libdir" "$work/pc_consumer"

echo "consumers: CMake find_package(bspflow CONFIG)"
cxx=c++
command -v clang++ >/dev/null 2>&1 && cxx=clang++
cmake -S "$here/cmake" -B "$work/cmake" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_PREFIX_PATH="$(dirname "$libdir" | sed 's|/lib$||')" -DCMAKE_BUILD_TYPE=Release
cmake --build "$work/cmake"
LD_LIBRARY_PATH="$libdir" "$work/cmake/consumer"

echo "consumers: meson subproject"
cp -r "$here/meson" "$work/meson"
mkdir -p "$work/meson/subprojects"
ln -s "$root" "$work/meson/subprojects/bspflow"
cp "$here/main.cpp" "$work/main.cpp"
meson setup "$work/meson/build" "$work/meson" --force-fallback-for=bspflow
meson compile -C "$work/meson/build"
"$work/meson/build/consumer"
echo "consumers: all three built and ran"
