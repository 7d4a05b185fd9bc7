#!/usr/bin/env bash
# A sharded model as one process per rank, launched the torchrun way (RANK, WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT; the cpu device's ranks talk over TCP): rank 0's output is printed,
# every rank must exit 0. Usage: shard_processes.sh HYBRID_RUN WORLD_SIZE MODEL_DIR ARGS...
set -uo pipefail
run=$1 world=$2 model=$3
shift 3
for attempt in 1 2 3; do # a port another process took: try another
  port=$((20000 + RANDOM % 40000))
  pids=()
  for ((rank = 1; rank < world; ++rank)); do
    RANK=$rank WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$run" "$model" "$@" > /dev/null &
    pids+=($!)
  done
  output=$(RANK=0 WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$run" "$model" "$@" 2>&1)
  status=$?
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  if [[ $status -ne 0 && $output == *"cannot listen"* && $attempt -lt 3 ]]; then
    continue
  fi
  echo "$output"
  [[ $status -eq 0 ]] && echo "ALL RANKS OK"
  exit $status
done
