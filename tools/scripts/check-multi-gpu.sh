#!/usr/bin/env bash
# Sharded plans on several GPUs (issues 10 / 11), in two halves, since the GPU machines have no
# MLIR:
#   check-multi-gpu.sh compile [OUT] [--world-sizes 2,4]   (here, with hybrid-compile)
#     the golden checkpoints (tests/data: kimi_linear_tiny, kimi_attnres_tiny, deepseek_v32_tiny)
#     for cuda sm_90a, unsharded (OUT/<model>-cuda) and at tp=N, tp=N,ep=N, cp=N and cp=N,ep=N
#     (the experts' all-to-all; N dividing their 8 experts) for each world size, and tp=2,cp=N/2
#     for even N >= 4 (OUT/<model>-cuda-tpN, -tpN-epN, -cpN, -cpN-epN, -tp2-cpM), unquantized;
#     and a synthetic FP8 DeepSeek-V3.2 (hybrid-synth --preset deepseek-v32-shard-tiny --fp8:
#     128x128 block scales, widths whose tp=2 slices are whole blocks) unsharded and at tp=2,
#     tp=2,ep=2, cp=N and cp=N,ep=N (tp=2,cp=N/2 for even N >= 4; tp=4 would cut its blocks and
#     is refused); also, whatever the world sizes, the plans that hybrid_shard_cuda_tests loads
#     (the goldens' tp=2, tp=2,ep=2, cp=2, cp=2,ep=2 and tp=2,cp=2, the FP8
#     model's cp=2: its loopback tests run them as threads on one GPU; not part of the run half's
#     table unless a world size names them); then OUT.tar.xz of them.
#   check-multi-gpu.sh run [OUT] [--world-sizes 2,4]       (there, on N GPUs)
#     unpacks OUT.tar.xz when OUT is absent; per model: the unsharded plan on one GPU against the
#     golden file (logits within 2e-3, the same 12 greedy ids; the FP8 model has no golden file:
#     its one-GPU run on a fixed 100-token prompt is the reference), then every sharded plan as N
#     processes (launch-local.sh: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, NCCL)
#     against that one-GPU run: prompt logits and hidden states within 2e-3 and the same 12 ids,
#     with decode graphs and (tp=N) without. World sizes above the GPU count are skipped, named.
#     Then hybrid_shard_cuda_tests on OUT when HYBRID_SHARD_TESTS names it.
# OUT defaults to build-multi-gpu in the repository. Binaries: HYBRID_COMPILE, HYBRID_SYNTH,
# HYBRID_RUN (default build/bin/...). Prints a table; exits 1 when any run fails or differs.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
models=(kimi_linear_tiny kimi_attnres_tiny deepseek_v32_tiny)
fp8_model=deepseek_v32_shard_tiny_fp8 # synthetic (hybrid-synth, seed 5), FP8 block-scaled
fp8_prompt=$(for i in $(seq 0 99); do printf '%s' "$(((i * 53 + 7) % 256))"; [[ $i -lt 99 ]] && printf ,; done)
tolerance=2e-3
new_tokens=12

half=${1:-}
[[ $half == compile || $half == run ]] || {
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
shift
out=$root/build-multi-gpu
world_sizes=2
while [[ $# -gt 0 ]]; do
  case $1 in
  --world-sizes) world_sizes=$2; shift 2 ;;
  -*) echo "check-multi-gpu.sh: unknown option '$1'" >&2; exit 2 ;;
  *) out=$1; shift ;;
  esac
done
IFS=, read -r -a sizes <<< "$world_sizes"
for n in "${sizes[@]}"; do
  if ! [[ $n =~ ^[0-9]+$ ]] || [[ $n -lt 2 ]]; then
    echo "check-multi-gpu.sh: --world-sizes: '$n' is not an integer >= 2" >&2
    exit 2
  fi
done
out=$(realpath -m "$out")

layouts() { # the sharded plan suffixes and their --shard values for world size $1
  echo "tp$1 tp=$1"
  echo "tp$1-ep$1 tp=$1,ep=$1"
  echo "cp$1 cp=$1" # context-parallel prefill: zigzag attention, KDA's state-passing scan
  if ((8 % $1 == 0)); then # the experts over the context ranks: the prefill's all-to-all
    echo "cp$1-ep$1 cp=$1,ep=$1"
  fi
  if (($1 >= 4 && $1 % 2 == 0)); then
    echo "tp2-cp$(($1 / 2)) tp=2,cp=$(($1 / 2))" # a communicator per group, split from the world
  fi
}
shard_test_layouts() { # the plans tests/e2e/ShardCudaTest.cpp loads, any world size
  layouts 2
  echo "tp2-cp2 tp=2,cp=2" # ContextAndTensorGroupsNeedASplittableCommunicator: 4 loopback ranks
}
fp8_layouts() { # the FP8 model's: its 128x128 blocks split at tp=2 only
  if (($1 == 2)); then
    echo "tp2 tp=2"
    echo "tp2-ep2 tp=2,ep=2"
  fi
  echo "cp$1 cp=$1"
  if ((8 % $1 == 0)); then # its experts' all-to-all, grouped around the FP8 GEMMs
    echo "cp$1-ep$1 cp=$1,ep=$1"
  fi
  if (($1 >= 4 && $1 % 2 == 0)); then
    echo "tp2-cp$(($1 / 2)) tp=2,cp=$(($1 / 2))"
  fi
}

if [[ $half == compile ]]; then
  compile=${HYBRID_COMPILE:-$root/build/bin/hybrid-compile}
  [[ -x $compile ]] || { echo "check-multi-gpu.sh: no hybrid-compile at $compile (HYBRID_COMPILE)" >&2; exit 2; }
  mkdir -p "$out"
  for model in "${models[@]}"; do
    args=("$root/tests/data/$model" --no-cache --quantization=none --device=cuda --arch=sm_90a)
    "$compile" "${args[@]}" -o "$out/$model-cuda" > /dev/null || exit 1
    declare -A compiled=()
    for n in "${sizes[@]}"; do
      while read -r suffix shard; do
        "$compile" "${args[@]}" --shard="$shard" -o "$out/$model-cuda-$suffix" > /dev/null || exit 1
        compiled[$suffix]=1
      done < <(layouts "$n")
    done
    while read -r suffix shard; do # the rest of what hybrid_shard_cuda_tests loads
      [[ -n ${compiled[$suffix]:-} ]] && continue
      "$compile" "${args[@]}" --shard="$shard" -o "$out/$model-cuda-$suffix" > /dev/null || exit 1
    done < <(shard_test_layouts)
    unset compiled
  done
  synth=${HYBRID_SYNTH:-$root/build/bin/hybrid-synth}
  [[ -x $synth ]] || { echo "check-multi-gpu.sh: no hybrid-synth at $synth (HYBRID_SYNTH)" >&2; exit 2; }
  checkpoint=$out/$fp8_model-checkpoint
  "$synth" --preset deepseek-v32-shard-tiny --fp8 --seed 5 --out "$checkpoint" --force > /dev/null ||
    exit 1
  args=("$checkpoint" --no-cache --quantization=none --device=cuda --arch=sm_90a --prefill-tokens 64)
  "$compile" "${args[@]}" -o "$out/$fp8_model-cuda" > /dev/null || exit 1
  fp8_cp2=
  for n in "${sizes[@]}"; do
    while read -r suffix shard; do
      "$compile" "${args[@]}" --shard="$shard" -o "$out/$fp8_model-cuda-$suffix" > /dev/null || exit 1
      [[ $suffix == cp2 ]] && fp8_cp2=1
    done < <(fp8_layouts "$n")
  done
  if [[ -z $fp8_cp2 ]]; then # hybrid_shard_cuda_tests' ContextParallelFp8ExpertsTakeTheStepsForm
    "$compile" "${args[@]}" --shard=cp=2 -o "$out/$fp8_model-cuda-cp2" > /dev/null || exit 1
  fi
  rm -rf "$checkpoint" # packed into the plans' archives
  find "$out" -name '*.source' -delete # the compile cache's notes: not needed to run
  # -9: a 64 MiB window, where the ranks' copies of the same weights repeat (110 MB: 47.6 MB at
  # the default level, 12.4 MB at -9)
  XZ_OPT=-9 tar -cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")" || exit 1
  echo "compiled into $out ($(du -sh "$out" | cut -f1)), packed as $out.tar.xz ($(du -h "$out.tar.xz" | cut -f1))"
  echo "on the GPU machine: tools/scripts/check-multi-gpu.sh run $out --world-sizes $world_sizes"
  exit 0
fi

run=${HYBRID_RUN:-$root/build/bin/hybrid-run}
[[ -x $run ]] || { echo "check-multi-gpu.sh: no hybrid-run at $run (HYBRID_RUN)" >&2; exit 2; }
if [[ ! -d $out && -f $out.tar.xz ]]; then # no xz tool there: python's tarfile reads it
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$out.tar.xz" "$(dirname "$out")" || exit 1
fi
[[ -d $out ]] || { echo "check-multi-gpu.sh: no plans at $out (run the compile half)" >&2; exit 2; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "GPUs: $gpus"
logs=$out/logs
mkdir -p "$logs"

failures=0
rows=()
# One check: a name, its log, and whether it passed (12 identical ids and MATCH).
record() {
  local name=$1 log=$2 code=$3 verdict diff
  diff=$(grep -o 'prompt logits: max abs diff [^ ]*' "$log" | head -1 | awk '{print $6}')
  if [[ $code -eq 0 ]] && grep -q "gen_ids: $new_tokens compared, identical" "$log" &&
     grep -qx MATCH "$log"; then
    verdict=ok
  else
    verdict=FAILED
    failures=$((failures + 1))
    echo "---- $name failed (exit $code), $log:" >&2
    tail -n 15 "$log" >&2
  fi
  rows+=("$(printf '%-52s %-7s %s' "$name" "$verdict" "${diff:--}")")
}

common=(--device cuda --kda-prefill recurrent --max-new-tokens "$new_tokens" --tolerance "$tolerance")
# One model: MODEL INPUTS GOLDEN LAYOUTS; GOLDEN empty: the one-GPU run is only the reference.
check_model() {
  local model=$1 inputs=$2 golden=$3 layouts_of=$4 n suffix shard variant extra log
  local one_gpu=$out/$model-1gpu.safetensors
  log=$logs/$model-1gpu.log
  if [[ -n $golden ]]; then
    "$run" "$out/$model-cuda" "${common[@]}" --input-ids "$inputs" --compare-with "$golden" \
      --output "$one_gpu" --dump-hidden > "$log" 2>&1
    record "$model 1 GPU vs golden" "$log" $?
  else
    "$run" "$out/$model-cuda" "${common[@]}" --input-ids "$inputs" --output "$one_gpu" \
      --dump-hidden > "$log" 2>&1
    local code=$?
    if [[ $code -eq 0 ]]; then
      rows+=("$(printf '%-52s %-7s %s' "$model 1 GPU (the reference)" ok -)")
    else
      failures=$((failures + 1))
      rows+=("$(printf '%-52s %-7s %s' "$model 1 GPU (the reference)" FAILED -)")
      tail -n 15 "$log" >&2
      return
    fi
  fi
  for n in "${sizes[@]}"; do
    if [[ $n -gt $gpus ]]; then
      rows+=("$(printf '%-52s %-7s %s' "$model world $n" skipped "$gpus GPUs here")")
      continue
    fi
    while read -r suffix shard; do
      variants=("graphs")
      [[ $suffix == "tp$n" ]] && variants+=("eager")
      for variant in "${variants[@]}"; do
        extra=()
        [[ $variant == eager ]] && extra=(--no-cuda-graphs)
        log=$logs/$model-$suffix-$variant.log
        "$root/tools/scripts/launch-local.sh" -n "$n" --log-dir "$logs/$model-$suffix-$variant" -- \
          "$run" "$out/$model-cuda-$suffix" "${common[@]}" "${extra[@]}" --input-ids "$inputs" \
          --compare-with "$one_gpu" > "$log" 2>&1
        record "$model $shard on $n GPUs ($variant) vs 1 GPU" "$log" $?
      done
    done < <("$layouts_of" "$n")
  done
}

for model in "${models[@]}"; do
  golden=$root/tests/data/$model/golden.safetensors
  check_model "$model" "$golden" "$golden" layouts
done
check_model "$fp8_model" "$fp8_prompt" "" fp8_layouts

if [[ -n ${HYBRID_SHARD_TESTS:-} ]]; then
  log=$logs/hybrid_shard_cuda_tests.log
  HYBRID_E2E_DIR=$out HYBRID_TEST_DATA_DIR=$root/tests/data "$HYBRID_SHARD_TESTS" > "$log" 2>&1
  code=$?
  verdict=ok
  [[ $code -eq 0 ]] || { verdict=FAILED; failures=$((failures + 1)); tail -n 30 "$log" >&2; }
  rows+=("$(printf '%-52s %-7s %s' hybrid_shard_cuda_tests "$verdict" \
    "$(grep -o '[0-9]* tests\? .*PASSED.*\|PASSED.*' "$log" | tail -1)")")
fi

printf '%-52s %-7s %s\n' check result "max |logits diff|"
printf '%s\n' "${rows[@]}"
if [[ $failures -gt 0 ]]; then
  echo "MULTI-GPU CHECK FAILED ($failures)"
  exit 1
fi
echo "MULTI-GPU CHECK OK"
