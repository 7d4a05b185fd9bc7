#!/usr/bin/env bash
# Decode and prefill scaling at Kimi-Linear-48B shapes with synthetic weights (issue 11), in two
# halves, since the GPU machines have no MLIR:
#   scale-multi-gpu.sh compile [OUT] [--world-sizes 2,4]   (here, with hybrid-synth/compile)
#     hybrid-synth --preset kimi-linear-48b --config-only, then hybrid-compile --synthetic-weights
#     for cuda sm_90a (decode batch 64, prefill 8192 tokens, the dense-attention KV cache in FP8
#     tiles) unsharded (OUT/k48-cuda) and at tp=N, tp=N,ep=N and cp=N per world size (OUT/k48-tpN,
#     OUT/k48-tpN-epN, OUT/k48-cpN: each rank's archive names its slices, generated at load); the same
#     layouts of a synthetic kimi-linear-tiny (OUT/tiny-cuda, OUT/tiny-tpN, ...); OUT.tar.xz.
#   scale-multi-gpu.sh run [OUT] [--world-sizes 2,4] [--batch 1,8,64] [--context 1024]
#                          [--decode-steps 16] [--comm-share] [--timeline]  (there, on N GPUs)
#     unpacks OUT.tar.xz when OUT is absent; first the synthetic tiny model's sharded plans as N
#     processes against its one-GPU run (hybrid-run: logits within 2e-3, the same greedy ids: the
#     ranks' generated slices are the unsharded weights); then hybrid-bench e2e at k48 shapes on
#     one GPU and every sharded plan as N processes (launch-local.sh, NCCL), the same rows; prints
#     per layout and row TTFT, TPOT, decode tokens/s and the speedups against one GPU, the weights
#     each rank generated and the GPUs' peak memory (nvidia-smi, sampled each second), and names
#     any step a rank left on the cpu reference. World sizes above the GPU count are skipped.
#     --comm-share: each sharded layout runs again with hybrid-bench e2e --skip-collectives
#     (timing only) and the share of TTFT and TPOT spent communicating is printed per row:
#     1 - (time without collectives) / (time with them).
#     --timeline: each sharded layout records one extra decode step a row on every rank
#     (hybrid-bench e2e --timeline: CUPTI, rank 0's trace in logs/timeline-k48-LAYOUT.json) and
#     prints per row how much of the communication (NCCL's kernels) other streams' work hid.
# OUT defaults to build-scale in the repository. Binaries: HYBRID_SYNTH, HYBRID_COMPILE,
# HYBRID_RUN, HYBRID_BENCH (default build/bin/...). Exits 1 when a check or a run fails.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)

half=${1:-}
[[ $half == compile || $half == run ]] || {
  sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
shift
out=$root/build-scale
world_sizes=2 batches=1,8,64 contexts=1024 decode_steps=16 comm_share=0 timeline=0
while [[ $# -gt 0 ]]; do
  case $1 in
  --world-sizes) world_sizes=$2; shift 2 ;;
  --batch) batches=$2; shift 2 ;;
  --context) contexts=$2; shift 2 ;;
  --decode-steps) decode_steps=$2; shift 2 ;;
  --comm-share) comm_share=1; shift ;;
  --timeline) timeline=1; shift ;;
  -*) echo "scale-multi-gpu.sh: unknown option '$1'" >&2; exit 2 ;;
  *) out=$1; shift ;;
  esac
done
IFS=, read -r -a sizes <<< "$world_sizes"
for n in "${sizes[@]}"; do
  if ! [[ $n =~ ^[0-9]+$ ]] || [[ $n -lt 2 ]]; then
    echo "scale-multi-gpu.sh: --world-sizes: '$n' is not an integer >= 2" >&2
    exit 2
  fi
done
out=$(realpath -m "$out")

layouts() { # the sharded plan suffixes and their --shard values for world size $1
  echo "tp$1 tp=$1"           # heads and dense MLPs split; the routed experts stay whole
  echo "tp$1-ep$1 tp=$1,ep=$1" # and the routed experts spread over the ranks
  echo "cp$1 cp=$1"           # the prompt split over the ranks (zigzag), the weights whole
}

if [[ $half == compile ]]; then
  synth=${HYBRID_SYNTH:-$root/build/bin/hybrid-synth}
  compile=${HYBRID_COMPILE:-$root/build/bin/hybrid-compile}
  for tool in "$synth" "$compile"; do
    [[ -x $tool ]] || { echo "scale-multi-gpu.sh: no $(basename "$tool") at $tool (HYBRID_SYNTH / HYBRID_COMPILE)" >&2; exit 2; }
  done
  mkdir -p "$out"
  "$synth" --preset kimi-linear-48b --config-only --force --out "$out/k48" > /dev/null || exit 1
  echo '{"dense_attention_kv_cache":"fp8_tiles"}' > "$out/dense-fp8.json"
  args=("$out/k48" --synthetic-weights --no-cache --device=cuda --arch=sm_90a --decode-batch=64
        --prefill-tokens 8192 --quantization="$out/dense-fp8.json")
  "$compile" "${args[@]}" -o "$out/k48-cuda" > /dev/null || exit 1
  "$synth" --preset kimi-linear-tiny --config-only --force --out "$out/tiny" > /dev/null || exit 1
  tiny=("$out/tiny" --synthetic-weights=5 --no-cache --device=cuda --arch=sm_90a)
  "$compile" "${tiny[@]}" -o "$out/tiny-cuda" > /dev/null || exit 1
  for n in "${sizes[@]}"; do
    while read -r suffix shard; do
      "$compile" "${args[@]}" --shard="$shard" -o "$out/k48-$suffix" > /dev/null || exit 1
      "$compile" "${tiny[@]}" --shard="$shard" -o "$out/tiny-$suffix" > /dev/null || exit 1
    done < <(layouts "$n")
  done
  find "$out" -name '*.source' -delete # the compile cache's notes: not needed to run
  XZ_OPT=-9 tar -cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")" || exit 1
  echo "compiled into $out ($(du -sh "$out" | cut -f1)), packed as $out.tar.xz ($(du -h "$out.tar.xz" | cut -f1))"
  echo "on the GPU machine: tools/scripts/scale-multi-gpu.sh run $out --world-sizes $world_sizes"
  exit 0
fi

bench=${HYBRID_BENCH:-$root/build/bin/hybrid-bench}
run=${HYBRID_RUN:-$root/build/bin/hybrid-run}
for tool in "$bench" "$run"; do
  [[ -x $tool ]] || { echo "scale-multi-gpu.sh: no $(basename "$tool") at $tool (HYBRID_BENCH / HYBRID_RUN)" >&2; exit 2; }
done
if [[ ! -d $out && -f $out.tar.xz ]]; then # no xz tool there: python's tarfile reads it
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$out.tar.xz" "$(dirname "$out")" || exit 1
fi
[[ -d $out/k48-cuda ]] || { echo "scale-multi-gpu.sh: no plans at $out (run the compile half)" >&2; exit 2; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "GPUs: $gpus"
logs=$out/logs
mkdir -p "$logs"

failures=0
declare -A ttft1 tpot1 # the one-GPU run's rows, by "batch context"
rows=()
notes=()

# Runs "$@" while sampling every GPU's used memory each second; sets `peak` to the largest
# sample per GPU ("GPU0 61.2 GB, GPU1 60.9 GB"), and returns the command's exit code.
with_memory_peak() {
  local samples=$1 sampler code
  shift
  : > "$samples"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 > "$samples" 2>/dev/null &
  sampler=$!
  "$@"
  code=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  peak=$(awk -F', *' 'NF == 2 { if ($2 > max[$1]) max[$1] = $2 }
    END { for (g = 0; g < 64; ++g) if (g in max) printf "%sGPU%d %.1f GB", (n++ ? ", " : ""), g, max[g] / 1024 }' "$samples")
  return $code
}

# One layout's rows from its log ("e2e BATCH CONTEXT TTFT PREFILL TPOT DECODE ..."), with the
# speedups against the one-GPU rows.
record() {
  local layout=$1 gpus_used=$2 log=$3 code=$4 generated cpu
  if [[ $code -ne 0 ]] || ! grep -q '^e2e ' "$log"; then
    failures=$((failures + 1))
    rows+=("$(printf '%-10s %4s  FAILED (exit %s): %s' "$layout" "$gpus_used" "$code" "$log")")
    echo "---- $layout failed (exit $code), $log:" >&2
    tail -n 15 "$log" >&2
    return
  fi
  generated=$(grep -o 'synthetic weights: [0-9.]* GB generated' "$log" | head -1 | awk '{print $3}')
  notes+=("$(printf '%-10s weights per rank %s GB; peak memory %s' "$layout" "${generated:-?}" "${peak:-?}")")
  # Any dispatch a rank left on the cpu reference (placement report: "...; cpu reference: ...").
  cpu=$(grep -o 'cpu reference: .*' "$log" | grep -v 'cpu reference: none' | sort -u | tr '\n' ' ')
  [[ -n $cpu ]] && notes+=("$(printf '%-10s ON THE CPU REFERENCE: %s' "$layout" "$cpu")")
  while read -r _ batch context ttft _ tpot decode _; do
    local key="$batch $context" speedTpot=- speedTtft=-
    if [[ $gpus_used -eq 1 ]]; then
      ttft1[$key]=$ttft
      tpot1[$key]=$tpot
    else
      [[ -n ${tpot1[$key]:-} ]] && speedTpot=$(awk -v a="${tpot1[$key]}" -v b="$tpot" 'BEGIN { printf "%.2fx", a / b }')
      [[ -n ${ttft1[$key]:-} ]] && speedTtft=$(awk -v a="${ttft1[$key]}" -v b="$ttft" 'BEGIN { printf "%.2fx", a / b }')
    fi
    rows+=("$(printf '%-10s %4s %6s %8s %10s %10s %12s %9s %9s' "$layout" "$gpus_used" "$batch" \
      "$context" "$ttft" "$tpot" "$decode" "$speedTtft" "$speedTpot")")
  done < <(grep '^e2e ' "$log")
}

# The share of a layout's rows spent communicating: its real log against its run with every
# collective skipped (hybrid-bench e2e --skip-collectives).
shares=()
record_share() {
  local layout=$1 log=$2 skipped=$3 code=$4
  if [[ $code -ne 0 ]] || ! grep -q '^e2e ' "$skipped"; then
    failures=$((failures + 1))
    shares+=("$(printf '%-10s comm share: FAILED (exit %s): %s' "$layout" "$code" "$skipped")")
    tail -n 15 "$skipped" >&2
    return
  fi
  local -A ttftReal tpotReal
  while read -r _ batch context ttft _ tpot _; do
    ttftReal["$batch $context"]=$ttft
    tpotReal["$batch $context"]=$tpot
  done < <(grep '^e2e ' "$log")
  while read -r _ batch context ttft _ tpot _; do
    local key="$batch $context"
    [[ -n ${tpotReal[$key]:-} ]] || continue
    shares+=("$(awk -v l="$layout" -v b="$batch" -v c="$context" -v t="${ttftReal[$key]}" \
      -v ts="$ttft" -v p="${tpotReal[$key]}" -v ps="$tpot" 'BEGIN {
        printf "%-10s batch %4s context %7s: communication %4.1f%% of TTFT, %4.1f%% of TPOT", l, b, c,
          100 * (1 - ts / t), 100 * (1 - ps / p) }')")
  done < <(grep '^e2e ' "$skipped")
}

# --timeline: per row of a layout, the communication of its traced step and the part other work
# hid (the summary's "communication" line after each "timeline batch B context C" header).
overlaps=()
record_overlap() {
  local layout=$1 log=$2 line found=0
  while IFS= read -r line; do
    overlaps+=("$(printf '%-10s %s' "$layout" "$line")")
    found=1
  done < <(awk '/^timeline batch/ { row = $2 " " $3 " " $4 " " $5 }
                /^communication/ { print row " " $0 }' "$log")
  ((found)) || overlaps+=("$(printf '%-10s no communication traced: %s' "$layout" "$log")")
}

# The synthetic tiny model: each sharded plan on N GPUs against the one-GPU run.
checks=()
prompt=3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3
tiny=(--device cuda --synthetic-weights --kda-prefill recurrent --input-ids "$prompt"
      --max-new-tokens 8)
"$run" "$out/tiny-cuda" "${tiny[@]}" --output "$out/tiny-1gpu.safetensors" --dump-hidden \
  > "$logs/tiny-1gpu.log" 2>&1 || {
  failures=$((failures + 1))
  checks+=("synthetic tiny 1 GPU: FAILED, $logs/tiny-1gpu.log")
}
for n in "${sizes[@]}"; do
  [[ $n -le $gpus && -f $out/tiny-1gpu.safetensors ]] || continue
  while read -r suffix shard; do
    log=$logs/tiny-$suffix.log
    "$root/tools/scripts/launch-local.sh" -n "$n" --log-dir "$logs/tiny-$suffix" -- \
      "$run" "$out/tiny-$suffix" "${tiny[@]}" --compare-with "$out/tiny-1gpu.safetensors" \
      --tolerance 2e-3 > "$log" 2>&1
    code=$?
    diff=$(grep -o 'prompt logits: max abs diff [^ ]*' "$log" | head -1 | awk '{print $6}')
    if [[ $code -eq 0 ]] && grep -q 'gen_ids: 8 compared, identical' "$log" && grep -qx MATCH "$log"; then
      checks+=("$(printf 'synthetic tiny %-10s on %s GPUs vs 1 GPU: ok, logits diff %s' "$shard" "$n" "$diff")")
    else
      failures=$((failures + 1))
      checks+=("$(printf 'synthetic tiny %-10s on %s GPUs vs 1 GPU: FAILED (exit %s), %s' "$shard" "$n" "$code" "$log")")
      tail -n 15 "$log" >&2
    fi
  done < <(layouts "$n")
done

common=(--device cuda --synthetic-weights --batch "$batches" --context "$contexts"
        --decode-steps "$decode_steps")
log=$logs/k48-1gpu.log
with_memory_peak "$logs/k48-1gpu.memory" "$bench" e2e --model "$out/k48-cuda" "${common[@]}" > "$log" 2>&1
record "1 GPU" 1 "$log" $?
for n in "${sizes[@]}"; do
  if [[ $n -gt $gpus ]]; then
    rows+=("$(printf '%-10s %4s  skipped: %s GPUs here' "world $n" "$n" "$gpus")")
    continue
  fi
  while read -r suffix shard; do
    log=$logs/k48-$suffix.log
    traced=()
    ((timeline)) && traced=(--timeline "$logs/timeline-k48-$suffix.json")
    with_memory_peak "$logs/k48-$suffix.memory" \
      "$root/tools/scripts/launch-local.sh" -n "$n" --log-dir "$logs/k48-$suffix" -- \
      "$bench" e2e --model "$out/k48-$suffix" "${common[@]}" "${traced[@]}" > "$log" 2>&1
    record "$shard" "$n" "$log" $?
    ((timeline)) && record_overlap "$shard" "$log"
    if ((comm_share)); then
      "$root/tools/scripts/launch-local.sh" -n "$n" --log-dir "$logs/k48-$suffix-nocomm" -- \
        "$bench" e2e --model "$out/k48-$suffix" "${common[@]}" --skip-collectives \
        > "$log.nocomm" 2>&1
      record_share "$shard" "$log" "$log.nocomm" $?
    fi
  done < <(layouts "$n")
done

printf '%s\n' "${checks[@]}"
printf '%-10s %4s %6s %8s %10s %10s %12s %9s %9s\n' layout GPUs batch context "TTFT ms" \
  "TPOT us" "decode t/s" "TTFT x" "TPOT x"
printf '%s\n' "${rows[@]}"
printf '%s\n' "${notes[@]}"
((${#shares[@]})) && printf '%s\n' "${shares[@]}"
((${#overlaps[@]})) && printf '%s\n' "${overlaps[@]}"
if [[ $failures -gt 0 ]]; then
  echo "SCALING RUN FAILED ($failures)"
  exit 1
fi
echo "SCALING RUN DONE"
