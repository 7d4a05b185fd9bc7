#!/usr/bin/env bash
# Configures and builds hybrid into BUILD_DIR (default: build/) with ccache.
# usage: tools/scripts/build.sh [BUILD_DIR] [extra cmake args...]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build_dir=${1:-$root/build}
shift || true

# ccache keyed on paths relative to the checkout, so a fresh clone elsewhere still hits.
export CCACHE_BASEDIR=$root
export CCACHE_NOHASHDIR=1
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
jobs=${HYBRID_BUILD_JOBS:-$(nproc)}

cmake -S "$root" -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release} \
  -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
  "$@"
# HYBRID_BUILD_TARGETS limits the build to some targets (space separated).
targets=()
for target in ${HYBRID_BUILD_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
