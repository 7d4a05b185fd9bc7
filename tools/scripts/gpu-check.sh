#!/usr/bin/env bash
# The single-GPU check of a build, in two halves, since the GPU machine has no MLIR and takes at
# most 64 MiB of carried files (the tree included):
#   gpu-check.sh pack [OUT]   (here, in a build with CUDA and the compiler: HYBRID_BUILD, default
#                              build; ctest's e2e plan fixtures and the binaries must be built)
#     the stripped hybrid-run, hybrid-bench, hybrid_kernel_cuda_tests and hybrid_e2e_cuda_tests
#     (one xz -9 stream: they share most of their kernels' code, which a multi-threaded -6 kept
#     in separate 24 MB blocks: 19 MB against 6 MB), the e2e plans hybrid_e2e_cuda_tests loads
#     (xz -9: the cpu and cuda plans of a model share most bytes), the synthetic Kimi-Linear-48B plan k48 (hybrid-synth --config-only,
#     hybrid-compile --synthetic-weights: decode batch 128, prefill 8192, FP8 dense KV) and the
#     shared libraries the GPU machine lacks; prints the size to carry.
#   gpu-check.sh run [OUT] [--quick]   (there: the run command, with OUT carried)
#     unpacks (python's tarfile: no xz tool there), then the kernel tests, the e2e cuda tests,
#     the cold start (hybrid-run k48), hybrid-bench e2e (batch 1 and 8 at 1K and 8K, each row's
#     traced step in timeline-k48.json and the log's summaries), spec with
#     replay drafts (batch 1, 32, 128; 32 and 128 on batch-invariant kernels; batch 1 without
#     prefill graphs) and tune twice (the second must reuse every entry); --quick: the tests
#     and the cold start only. Logs and JSON records go to $OUT when set (the device machine's;
#     bundled into $OUT/check-logs.tar.gz at the end, KEEP naming files of $OUT to leave out),
#     else OUT/logs; one summary line per step, exit 1 when a step fails.
# OUT defaults to build-gpu-check in the repository (ignored by git: /build*/).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/tools/scripts/gpu-pack.sh"
half=${1:-}
require_half "$half"
shift
out=$root/build-gpu-check
quick=0
while [[ $# -gt 0 ]]; do
  case $1 in
  --quick) quick=1; shift ;;
  -*) echo "gpu-check.sh: unknown option '$1'" >&2; exit 2 ;;
  *) out=$1; shift ;;
  esac
done
out=$(realpath -m "$out")
binaries=(hybrid-run hybrid-bench hybrid_kernel_cuda_tests hybrid_e2e_cuda_tests)
# What hybrid_e2e_cuda_tests loads from HYBRID_E2E_DIR (tests/e2e/CudaDeviceTest.cpp).
plans=(kimi_linear_tiny kimi_linear_tiny-cuda kimi_linear_tiny-cuda-batch4
       kimi_linear_tiny-fp8kv kimi_linear_tiny-fp8kv-cuda
       kimi_attnres_tiny kimi_attnres_tiny-cuda kimi_attnres_tiny-cuda-batch4
       deepseek_v32_tiny deepseek_v32_tiny-cuda deepseek_v32_tiny-cuda-batch4
       deepseek_v32_tiny-quantized deepseek_v32_tiny-quantized-cuda
       deepseek_v32_tiny-fp8-indexer deepseek_v32_tiny-fp8-indexer-cuda
       deepseek_v32_tiny-topk128 deepseek_v32_tiny-topk128-cuda
       synth-mtp-cpu synth-mtp-cuda synth-dsv32-fp8-cpu synth-dsv32-fp8-cuda)

if [[ $half == pack ]]; then
  build=$(realpath -m "${HYBRID_BUILD:-$root/build}")
  for binary in "${binaries[@]}" hybrid-synth hybrid-compile; do
    [[ -x $build/bin/$binary ]] || { echo "gpu-check.sh: no $build/bin/$binary (HYBRID_BUILD)" >&2; exit 2; }
  done
  for plan in "${plans[@]}"; do
    [[ -d $build/tests/e2e/$plan ]] || {
      echo "gpu-check.sh: no plan $build/tests/e2e/$plan: run ctest's e2e fixtures first" \
           "(ctest --test-dir $build -R 'compile|checkpoint|reference')" >&2
      exit 2
    }
  done
  rm -rf "$out" && mkdir -p "$out/lib" || exit 1
  staging=$(mktemp -d) && trap 'rm -rf "$staging"' EXIT
  for binary in "${binaries[@]}"; do
    strip -o "$staging/$binary" "$build/bin/$binary" || exit 1
  done
  tar -cf - -C "$staging" "${binaries[@]}" | xz -T1 -9 > "$out/bins.tar.xz" || exit 1
  tar -cf - -C "$build/tests/e2e" "${plans[@]}" | xz -T2 -9 > "$out/e2e.tar.xz" || exit 1
  pack_libraries "$out/lib" "$build/bin/hybrid-bench"
  compile_k48 "$build" "$staging" "$out/k48" || exit 1
  tree=$(cd "$root" && git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  size=$(du -sb "$out" | cut -f1)
  echo "packed $out: $((size / 1048576)) MiB (+ the tree's $((tree / 1048576)) MiB; the limit is 64 MiB)"
  echo "on the GPU machine: tools/scripts/gpu-check.sh run $(realpath --relative-to="$root" "$out")"
  exit 0
fi

[[ -f $out/bins.tar.xz && -d $out/k48 ]] || { echo "gpu-check.sh: nothing packed at $out (run the pack half)" >&2; exit 2; }
logs=${OUT:-$out/logs}
mkdir -p "$logs"
unpack "$out/bins.tar.xz" "$out" && unpack "$out/e2e.tar.xz" "$out/e2e" || exit 1
export LD_LIBRARY_PATH=$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export HYBRID_E2E_DIR=$out/e2e HYBRID_TEST_DATA_DIR=$root/tests/data
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$logs/gpu.txt" 2>&1
summary=()
failures=0
# step NAME LOG SECONDS COMMAND...: runs it, keeps its log, adds a summary line.
step() {
  local name=$1 log=$logs/$2 limit=$3
  shift 3
  local start=$SECONDS code
  timeout "$limit" "$@" > "$log" 2>&1
  code=$?
  local result=ok
  [[ $code -eq 0 ]] || { result="FAILED (exit $code)"; failures=$((failures + 1)); }
  summary+=("$(printf '%-28s %-18s %4ss  %s' "$name" "$result" $((SECONDS - start)) "$(basename "$log")")")
}
step "kernel tests" kernel-tests.log 300 "$out/hybrid_kernel_cuda_tests"
step "e2e cuda tests" e2e-tests.log 300 "$out/hybrid_e2e_cuda_tests"
step "cold start (k48)" cold-start.log 120 "$out/hybrid-run" "$out/k48" --device cuda \
  --synthetic-weights --input-ids 1,2,3 --max-new-tokens 1
if ((!quick)); then
  step "e2e bench (k48)" e2e-bench.log 300 "$out/hybrid-bench" e2e --model "$out/k48" \
    --device cuda --synthetic-weights --batch 1,8 --context 1024,8192 --decode-steps 16 \
    --json "$logs/e2e-k48.json" --timeline "$logs/timeline-k48.json"
  step "spec bench (k48, replay)" spec-bench.log 300 "$out/hybrid-bench" spec --model "$out/k48" \
    --device cuda --synthetic-weights --batch 1,32,128 --prompt-tokens 512 --max-tokens 64 \
    --draft 4 --draft-source replay --replay-acceptance 1.0 --json "$logs/spec-k48-replay.json"
  # Batch-invariant kernels: identical outputs and batched passes that pay at batch 32 and 128.
  step "spec bench (batch-invariant)" spec-bench-invariant.log 300 "$out/hybrid-bench" spec \
    --model "$out/k48" --device cuda --synthetic-weights --batch 32,128 --prompt-tokens 512 \
    --max-tokens 64 --draft 4 --draft-source replay --replay-acceptance 1.0 --batch-invariant \
    --json "$logs/spec-k48-replay-invariant.json"
  # The same at batch 1 with the verification passes launched kernel by kernel: what the
  # prefill graphs gain.
  step "spec bench (no prefill graphs)" spec-bench-eager.log 200 "$out/hybrid-bench" spec \
    --model "$out/k48" --device cuda --synthetic-weights --batch 1 --prompt-tokens 512 \
    --max-tokens 64 --draft 4 --draft-source replay --replay-acceptance 1.0 --no-prefill-graphs \
    --json "$logs/spec-k48-replay-no-prefill-graphs.json"
  step "tune" tune-1.log 400 "$out/hybrid-bench" tune --preset deepseek-v32 kimi-linear-48b \
    --budget 300 --cache "$out/tune-cache"
  step "tune again (reuses)" tune-2.log 60 "$out/hybrid-bench" tune --preset deepseek-v32 \
    kimi-linear-48b --cache "$out/tune-cache"
  if ! grep -qE '(^| )0 tuned, ' "$logs/tune-2.log"; then # the summary starts its line
    summary+=("tune again: RE-TUNED (the second run should reuse every entry)")
    failures=$((failures + 1))
  fi
fi

echo "GPU: $(cat "$logs/gpu.txt")"
printf '%s\n' "${summary[@]}"
grep -hE '^\[  (PASSED|FAILED) ' "$logs/kernel-tests.log" "$logs/e2e-tests.log"
grep -hE '^(load|cold start)' "$logs/cold-start.log"
((quick)) || grep -hE '^(e2e |spec batch|  decode|[0-9]+ tuned)' "$logs"/e2e-bench.log \
  "$logs"/spec-bench.log "$logs"/spec-bench-invariant.log "$logs"/tune-1.log "$logs"/tune-2.log
bundle_logs "$logs" check-logs # every log and record comes back (tar -xzf check-logs.tar.gz)
if [[ $failures -gt 0 ]]; then
  echo "GPU CHECK FAILED ($failures)"
  exit 1
fi
echo "GPU CHECK OK"
