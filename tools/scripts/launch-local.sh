#!/usr/bin/env bash
# Starts COMMAND as N processes on this node, one per GPU, with the variables a multi-node
# launcher (torchrun, Slurm wrappers) sets: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT. hybrid-run --device cuda and hybrid-bench e2e read them
# (docs/parallelism.md): rank RANK joins NCCL on GPU LOCAL_RANK, rank 0 reports.
#
# Usage: launch-local.sh [-n N] [--nnodes M --node-rank K] [--master-addr A] [--master-port P]
#                        [--log-dir D] -- COMMAND ARGS...
#   -n N            processes on this node (default: the GPUs nvidia-smi lists, else 1)
#   --nnodes M      nodes in the launch (default 1); this node's ranks are K*N .. K*N+N-1
#   --node-rank K   this node's index (default 0); on node 0 rank 0 listens on MASTER_PORT
#   --master-addr   rank 0's host (default 127.0.0.1; set it on every node of a multi-node launch)
#   --master-port   its port (default: a random free-looking one in 20000-59999)
#   --log-dir D     rank r's output goes to D/rank<r>.log (default: a new temporary directory);
#                   the node's first rank also prints to this terminal.
# Exits 0 when every local rank does; when one fails the others are stopped (their collectives
# would wait for it until their timeout) and the failing rank's log tail is printed.
set -uo pipefail

local_ranks=""
nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port="" log_dir=""
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case $1 in
  -n) local_ranks=$2; shift 2 ;;
  --nnodes) nnodes=$2; shift 2 ;;
  --node-rank) node_rank=$2; shift 2 ;;
  --master-addr) master_addr=$2; shift 2 ;;
  --master-port) master_port=$2; shift 2 ;;
  --log-dir) log_dir=$2; shift 2 ;;
  -h | --help) usage; exit 0 ;;
  --) shift; break ;;
  *) echo "launch-local.sh: unknown option '$1' (the command follows --)" >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "launch-local.sh: no command (launch-local.sh [options] -- COMMAND ARGS...)" >&2
  exit 2
fi
if [[ -z $local_ranks ]]; then
  local_ranks=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ $local_ranks -ge 1 ]] || local_ranks=1
fi
for value in "$local_ranks" "$nnodes" "$node_rank"; do
  if ! [[ $value =~ ^[0-9]+$ ]]; then
    echo "launch-local.sh: '$value' is not a non-negative integer (-n, --nnodes, --node-rank)" >&2
    exit 2
  fi
done
if [[ $local_ranks -lt 1 || $nnodes -lt 1 || $node_rank -ge $nnodes ]]; then
  echo "launch-local.sh: -n $local_ranks, --nnodes $nnodes, --node-rank $node_rank: need" \
       "N >= 1 and 0 <= K < M" >&2
  exit 2
fi
[[ -n $master_port ]] || master_port=$((20000 + RANDOM % 40000))
[[ -n $log_dir ]] || log_dir=$(mktemp -d /tmp/hybrid-launch.XXXXXX)
mkdir -p "$log_dir"
world=$((nnodes * local_ranks))
first=$((node_rank * local_ranks))

declare -A rank_of # the running ranks' process ids
for ((local = 0; local < local_ranks; ++local)); do
  rank=$((first + local))
  if [[ $local -eq 0 ]]; then # the node's first rank also to the terminal
    RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$local LOCAL_WORLD_SIZE=$local_ranks \
      MASTER_ADDR=$master_addr MASTER_PORT=$master_port \
      "$@" > >(tee "$log_dir/rank$rank.log") 2>&1 &
  else
    RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$local LOCAL_WORLD_SIZE=$local_ranks \
      MASTER_ADDR=$master_addr MASTER_PORT=$master_port \
      "$@" > "$log_dir/rank$rank.log" 2>&1 &
  fi
  rank_of[$!]=$rank
done

# Stops the ranks still running (only the processes started here).
stop_others() {
  for pid in "${!rank_of[@]}"; do
    kill "$pid" 2>/dev/null
  done
}
trap 'stop_others; exit 130' INT TERM

status=0
while [[ ${#rank_of[@]} -gt 0 ]]; do
  wait -n -p done_pid "${!rank_of[@]}"
  code=$?
  rank=${rank_of[$done_pid]:-?}
  unset "rank_of[$done_pid]"
  if [[ $code -ne 0 && $status -eq 0 ]]; then
    status=$code
    echo "launch-local.sh: rank $rank exited with $code; stopping the others" >&2
    echo "---- $log_dir/rank$rank.log (last 20 lines)" >&2
    tail -n 20 "$log_dir/rank$rank.log" >&2
    stop_others
  fi
done
wait # the tee of the first rank
echo "launch-local.sh: $local_ranks of $world ranks on this node, logs in $log_dir" >&2
exit $status
