#!/usr/bin/env bash
# A/B of two builds' decode steps on one GPU, in two halves (the GPU machine has no MLIR and takes
# at most 64 MiB of carried files, the tree included):
#   gpu-ab.sh pack OUT --base BUILD --candidate BUILD [--model PRESET[:LAYERS]]   (here)
#     the two stripped hybrid-bench binaries (xz), the libraries the GPU machine lacks and a
#     synthetic plan (the candidate's hybrid-synth / hybrid-compile): by default Kimi-Linear-48B
#     as gpu-check.sh packs it (FP8 dense KV, decode batch 128), or another preset, e.g.
#     deepseek-v32-671b:6 (its FP8 weights, 6 layers); prints the size to carry.
#   gpu-ab.sh run OUT [--rounds 2] [--batch 1] [--context 1024] [--decode-steps 32]
#     (there, with OUT carried) hybrid-bench e2e with --timeline, base and candidate alternated
#     for each round: per run the TPOT and the most exposed kernels of the traced step, then the
#     candidate's kernels against the base's (hybrid-bench timeline --against). Logs and traces
#     go to $OUT when set (the device machine's; bundled into $OUT/ab-logs.tar.gz, since a call
#     brings back at most 8 files; KEEP names files of $OUT to leave out), else OUT/logs.
# Kernel switches or environment variables of a candidate go in the environment of the run half.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/tools/scripts/gpu-pack.sh"
half=${1:-}
require_half "$half"
shift
out="" base="" candidate="" rounds=2 batch=1 context=1024 steps=32 model=kimi-linear-48b
while [[ $# -gt 0 ]]; do
  case $1 in
  --base) base=$2; shift 2 ;;
  --candidate) candidate=$2; shift 2 ;;
  --model) model=$2; shift 2 ;;
  --rounds) rounds=$2; shift 2 ;;
  --batch) batch=$2; shift 2 ;;
  --context) context=$2; shift 2 ;;
  --decode-steps) steps=$2; shift 2 ;;
  -*) echo "gpu-ab.sh: unknown option '$1'" >&2; exit 2 ;;
  *) out=$1; shift ;;
  esac
done
[[ -n $out ]] || { echo "gpu-ab.sh: no OUT folder" >&2; exit 2; }
out=$(realpath -m "$out")

if [[ $half == pack ]]; then
  [[ -n $base && -n $candidate ]] || { echo "gpu-ab.sh pack: --base and --candidate are required" >&2; exit 2; }
  for build in "$base" "$candidate"; do
    [[ -x $build/bin/hybrid-bench ]] || { echo "gpu-ab.sh: no $build/bin/hybrid-bench" >&2; exit 2; }
  done
  for tool in hybrid-synth hybrid-compile; do
    [[ -x $candidate/bin/$tool ]] || { echo "gpu-ab.sh: no $candidate/bin/$tool" >&2; exit 2; }
  done
  rm -rf "$out" && mkdir -p "$out/lib" || exit 1
  staging=$(mktemp -d) && trap 'rm -rf "$staging"' EXIT
  strip -o "$staging/hybrid-bench-base" "$base/bin/hybrid-bench" || exit 1
  strip -o "$staging/hybrid-bench-candidate" "$candidate/bin/hybrid-bench" || exit 1
  tar -cf - -C "$staging" hybrid-bench-base hybrid-bench-candidate | xz -T1 -9 > "$out/bins.tar.xz" ||
    exit 1
  pack_libraries "$out/lib" "$base/bin/hybrid-bench" "$candidate/bin/hybrid-bench"
  compile_model "$candidate" "$staging" "$out/model" "$model" || exit 1
  size=$(du -sb "$out" | cut -f1)
  echo "packed $out: $((size / 1048576)) MiB (+ the tree; the limit is 64 MiB)"
  echo "on the GPU machine: tools/scripts/gpu-ab.sh run $(realpath --relative-to="$root" "$out")"
  exit 0
fi

[[ -f $out/bins.tar.xz && -d $out/model ]] || { echo "gpu-ab.sh: nothing packed at $out (run the pack half)" >&2; exit 2; }
logs=${OUT:-$out/logs}
mkdir -p "$logs"
unpack "$out/bins.tar.xz" "$out" || exit 1
export LD_LIBRARY_PATH=$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
failures=0
for ((round = 1; round <= rounds; ++round)); do
  for side in base candidate; do
    log=$logs/$side-$round.log
    timeout 300 "$out/hybrid-bench-$side" e2e --model "$out/model" --device cuda --synthetic-weights \
      --batch "$batch" --context "$context" --decode-steps "$steps" \
      --timeline "$logs/timeline-$side-$round.json" > "$log" 2>&1
    code=$?
    if [[ $code -ne 0 ]]; then
      failures=$((failures + 1))
      echo "round $round $side: FAILED (exit $code), $log"
      tail -n 5 "$log"
      continue
    fi
    echo "round $round $side: $(grep '^e2e ' "$log" | awk '{printf "batch %s context %s TPOT %s us; ", $2, $3, $6}')"
    # The traced step's most exposed kernels (the summary's table rows after its header).
    awk '/^  name / { table = 1; shown = 0; next } /^timeline/ { table = 0 }
         table && shown < 8 { print "   " $0; ++shown }' "$log"
  done
  # The candidate's traced steps against the base's, kernel by kernel (the largest changes).
  if [[ -f $logs/timeline-base-$round.json && -f $logs/timeline-candidate-$round.json ]]; then
    "$out/hybrid-bench-candidate" timeline "$logs/timeline-candidate-$round.json" \
      --against "$logs/timeline-base-$round.json" --top 10 | sed 's/^/   /'
  fi
done
bundle_logs "$logs" ab-logs # every log and trace comes back (tar -xzf ab-logs.tar.gz)
if [[ $failures -gt 0 ]]; then
  echo "A/B FAILED ($failures)"
  exit 1
fi
echo "A/B DONE"
