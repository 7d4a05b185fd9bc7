#!/usr/bin/env bash
# The test command (README): installs what is missing, builds, runs every test (unit, kernels,
# lit, end to end; GPU tests skip themselves without a GPU), then the importer's bad-input and
# the runtime's unit tests again under AddressSanitizer.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
"$root/tools/scripts/install-deps.sh"

"$root/tools/scripts/build.sh" "$root/build"
ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"

if [[ ${HYBRID_SKIP_ASAN:-0} != 1 ]]; then
  CMAKE_BUILD_TYPE=RelWithDebInfo "$root/tools/scripts/build.sh" "$root/build-asan" \
    -DHYBRID_ENABLE_ASAN=ON -DHYBRID_ENABLE_CUDA=OFF
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$root/build-asan" --output-on-failure \
    -j "$(nproc)" -L 'unit|lit'
fi
