#!/usr/bin/env bash
# Runs every libFuzzer target (tests/fuzz) for SECONDS each (default 60) from its seed corpus and
# reports executions and crashes: tools/scripts/fuzz.sh [SECONDS] [TARGET...]
# With HYBRID_FUZZ_RUNS=N each target runs exactly N inputs from a fixed seed instead (the test
# command's deterministic smoke run).
# Builds the `fuzz` preset (clang, ASan + UBSan). New inputs go to build-fuzz/corpus/<target>, crash
# inputs to build-fuzz/crashes/<target>-*; the exit status is 1 when any target crashed. A crash
# input belongs in tests/fuzz/corpus/<target>/ once fixed, as a regression seed.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(safetensors_header plan_loader weight_archive cache_entry bench_record completion_request tokenizer_loader model_config config_importer)

mkdir -p build-fuzz
cmake --preset fuzz > build-fuzz/configure.log 2>&1 || { cat build-fuzz/configure.log; exit 2; }
ninja -C build-fuzz "${targets[@]/#/fuzz_}" > /dev/null
mkdir -p build-fuzz/crashes
failed=0
for target in "${targets[@]}"; do
  corpus=build-fuzz/corpus/$target
  mkdir -p "$corpus"
  cp -n tests/fuzz/corpus/"$target"/* "$corpus"/ 2>/dev/null || true
  log=build-fuzz/fuzz_$target.log
  status=0
  budget=(-max_total_time="$seconds")
  [[ -z ${HYBRID_FUZZ_RUNS:-} ]] || budget=(-runs="$HYBRID_FUZZ_RUNS" -seed=1)
  ASAN_OPTIONS=detect_leaks=1 build-fuzz/bin/fuzz_"$target" "$corpus" \
      "${budget[@]}" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 \
      -artifact_prefix=build-fuzz/crashes/"$target"- > "$log" 2>&1 || status=$?
  runs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  crashes=$(find build-fuzz/crashes -name "$target-*" | wc -l)
  printf '%-20s %12s executions  %3d crash inputs  %s\n' "$target" "$runs" "$crashes" \
      "$([[ $status -eq 0 ]] && echo ok || echo "FAILED (see $log)")"
  [[ $status -eq 0 && $crashes -eq 0 ]] || failed=1
done
exit $failed
