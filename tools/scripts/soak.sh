#!/bin/bash
# Bounded soak of hybrid-serve (issue 12): the cpu device with the tiny Kimi-Linear checkpoint,
# steady concurrent streaming load over loopback (hybrid-bench serve) for DURATION seconds, the
# server's resident memory sampled after every round. Stops by itself; prints the rounds and the
# RSS series, and exits 1 when a request failed, the server died, or its RSS after the first
# round grew by more than 10% (and 16 MiB).
#   tools/scripts/soak.sh [DURATION_SECONDS=1200]   (BUILD=build by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
DURATION=${1:-1200}
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

"$BUILD/bin/hybrid-compile" tests/data/kimi_linear_tiny -o "$WORK/model" --no-cache > /dev/null
"$BUILD/bin/hybrid-serve" "$WORK/model" --port 0 --max-sequences 4 --prefix-cache 2 \
  > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
PORT=""
for _ in $(seq 100); do
  PORT=$(sed -n 's|.*listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$WORK/server.log")
  [ -n "$PORT" ] && break
  sleep 0.1
done
[ -n "$PORT" ] || { echo "soak: the server did not start"; cat "$WORK/server.log"; exit 1; }

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status"; }
echo "soak: hybrid-serve (cpu, kimi_linear_tiny) on port $PORT for ${DURATION} s"
START=$(date +%s)
ROUND=0 FAILED=0 COMPLETED=0 FIRST_RSS="" MAX_RSS=0 RSS=0
while [ $(( $(date +%s) - START )) -lt "$DURATION" ]; do
  ROUND=$((ROUND + 1))
  # Prompts repeat every other round (seeds 1 and 2), so prefix-cache hits and misses both run.
  if ! "$BUILD/bin/hybrid-bench" serve --host 127.0.0.1 --port "$PORT" --requests 48 \
      --concurrency 6 --prompt-tokens 48 --max-tokens 24 --seed $((ROUND % 2 + 1)) \
      > "$WORK/round.txt" 2>&1; then
    echo "soak: round $ROUND: the load generator failed"; cat "$WORK/round.txt"; exit 1
  fi
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "soak: the server died"; cat "$WORK/server.log"; exit 1; }
  line=$(grep -m1 '^requests' "$WORK/round.txt")
  done_now=$(echo "$line" | sed -n 's/.*: \([0-9]*\) completed, \([0-9]*\) failed.*/\1/p')
  failed_now=$(echo "$line" | sed -n 's/.*: \([0-9]*\) completed, \([0-9]*\) failed.*/\2/p')
  COMPLETED=$((COMPLETED + done_now)); FAILED=$((FAILED + failed_now))
  RSS=$(rss_kib)
  [ -z "$FIRST_RSS" ] && FIRST_RSS=$RSS
  [ "$RSS" -gt "$MAX_RSS" ] && MAX_RSS=$RSS
  printf 'round %4d  t=%5d s  %s  rss %d KiB  %s\n' "$ROUND" $(( $(date +%s) - START )) \
    "$(echo "$line" | sed 's/.*: //')" "$RSS" "$(grep -m1 '^duration' "$WORK/round.txt")"
done
echo "soak: $ROUND rounds, $COMPLETED requests completed, $FAILED failed"
echo "soak: server RSS after round 1 $FIRST_RSS KiB, max $MAX_RSS KiB, last $RSS KiB"
[ "$FAILED" -eq 0 ] || { echo "soak: FAILED requests"; exit 1; }
LIMIT=$(( FIRST_RSS + FIRST_RSS / 10 > FIRST_RSS + 16384 ? FIRST_RSS + FIRST_RSS / 10 : FIRST_RSS + 16384 ))
[ "$RSS" -le "$LIMIT" ] || { echo "soak: RSS grew past $LIMIT KiB"; exit 1; }
echo "soak: PASSED"
