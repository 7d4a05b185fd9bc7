#!/usr/bin/env bash
# The test command (README): installs what is missing, builds, runs the unit and lit tests (the
# importer's and runtime's bad-input cases among them) and the threaded serving, scheduler, prefix
# cache and speculative-decoding tests under AddressSanitizer, a libFuzzer smoke run of every parser
# of outside bytes, then every test
# (unit, kernels, lit, end to end; GPU tests skip themselves without a GPU) with ctest, whose
# summary closes the output.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
"$root/tools/scripts/install-deps.sh"

"$root/tools/scripts/build.sh" "$root/build"

if [[ ${HYBRID_SKIP_ASAN:-0} != 1 ]]; then
  # Only what those tests run; the libraries parsing untrusted bytes are instrumented.
  HYBRID_BUILD_TARGETS="hybrid_unit_tests hybrid_kernel_tests hybrid_comm_tests hybrid_serve_tests \
hybrid_e2e_tests hybrid-opt hybrid-compile hybrid-run hybrid-synth" \
    CMAKE_BUILD_TYPE=RelWithDebInfo "$root/tools/scripts/build.sh" "$root/build-asan" \
    -DHYBRID_ENABLE_ASAN=ON -DHYBRID_ENABLE_CUDA=OFF
  ASAN_OPTIONS=detect_leaks=1 "$root/build-asan/bin/hybrid_unit_tests" --gtest_brief=1
  # The reference kernels (the cpu device's arithmetic) and the collectives between rank threads.
  ASAN_OPTIONS=detect_leaks=1 "$root/build-asan/bin/hybrid_kernel_tests" --gtest_brief=1
  ASAN_OPTIONS=detect_leaks=1 "$root/build-asan/bin/hybrid_comm_tests" --gtest_brief=1
  ASAN_OPTIONS=detect_leaks=1 python3 /usr/lib/llvm-19/build/utils/lit/lit.py -sv \
    "$root/build-asan/tests/lit"
  # The runtime's shared pages, snapshots, replay and the server's threads, on the goldens.
  for model in kimi_linear_tiny deepseek_v32_tiny kimi_attnres_tiny; do
    "$root/build-asan/bin/hybrid-compile" "$root/tests/data/$model" \
      -o "$root/build-asan/tests/e2e/$model" --no-cache --quantization=none > /dev/null
    "$root/build-asan/bin/hybrid-compile" "$root/tests/data/$model" \
      -o "$root/build-asan/tests/e2e/$model-batch4" --no-cache --quantization=none \
      --decode-batch=4 > /dev/null
  done
  ASAN_OPTIONS=detect_leaks=1 "$root/build-asan/bin/hybrid_serve_tests" --gtest_brief=1
  ASAN_OPTIONS=detect_leaks=1 "$root/build-asan/bin/hybrid_e2e_tests" --gtest_brief=1 \
    --gtest_filter='*PrefixCache*:Scheduler*:*Speculative*:*Rollback*:PromptLookup*:*DecodeBatch*'
fi

if [[ ${HYBRID_SKIP_FUZZ:-0} != 1 ]]; then
  # Every parser of outside bytes under libFuzzer: a fixed number of inputs from a fixed seed, so
  # the result does not depend on the machine's speed (tools/scripts/fuzz.sh runs longer).
  HYBRID_FUZZ_RUNS=${HYBRID_FUZZ_RUNS:-20000} "$root/tools/scripts/fuzz.sh"
fi

ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"
