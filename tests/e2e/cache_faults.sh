#!/usr/bin/env bash
# The compilation cache under faults, with real hybrid-compile processes (issue 12):
#  1. four processes compiling one model into one cache at once all succeed with the same plan,
#     leave exactly one valid entry, and a fifth compile is a cache hit;
#  2. compiles killed (SIGKILL) at several moments never leave an entry that is read back wrong:
#     the next compile succeeds with the same plan, as a hit or a fresh compile (the store writes
#     a temporary file, fsyncs it and renames it into place);
#  3. a flipped byte in the entry is detected, the plan recompiled (the same bytes) and the entry
#     replaced;
#  4. a full disk (a tiny tmpfs, where the user may mount one) gives a clear warning and a working,
#     uncached compile.
# Usage: cache_faults.sh HYBRID_COMPILE MODEL_DIR
set -euo pipefail
compile=$1
model=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cache=$work/cache

run() { "$compile" "$model" -o "$work/$1" --cache-dir "$cache" --quantization=none; }
entries() { find "$cache" -name '*.hyc' | wc -l; }

run reference > "$work/reference.log"
rm -rf "$cache"

# 1. Four at once.
for i in 1 2 3 4; do run "concurrent$i" > "$work/concurrent$i.log" 2>&1 & done
failed=0
for job in $(jobs -p); do wait "$job" || failed=1; done
[[ $failed == 0 ]] || { echo "FAIL: a concurrent compile failed"; cat "$work"/concurrent*.log; exit 1; }
for i in 1 2 3 4; do
  cmp -s "$work/reference/plan.hyplan" "$work/concurrent$i/plan.hyplan" ||
    { echo "FAIL: concurrent compile $i wrote another plan"; exit 1; }
done
[[ $(entries) == 1 ]] || { echo "FAIL: $(entries) cache entries after four compiles, expected 1"; exit 1; }
run fifth | grep -q "cache hit" || { echo "FAIL: the fifth compile missed the cache"; exit 1; }
echo "concurrent: 4 compiles, 1 entry, identical plans, then a hit"

# 2. Killed at several moments (from before the import to after the plan write), each time into
#    an empty cache, so the kill may land while the entry is being written.
for delay in 0 0.005 0.01 0.02 0.03 0.05 0.08 0.12; do
  rm -rf "$cache"
  run killed > /dev/null 2>&1 &
  victim=$!
  sleep "$delay"
  kill -KILL "$victim" 2> /dev/null || true
  wait "$victim" 2> /dev/null || true
  run after > "$work/after.log" 2>&1 ||
    { echo "FAIL: the compile after a kill at ${delay}s failed"; cat "$work/after.log"; exit 1; }
  cmp -s "$work/reference/plan.hyplan" "$work/after/plan.hyplan" ||
    { echo "FAIL: the compile after a kill at ${delay}s wrote another plan"; exit 1; }
  [[ $(entries) == 1 ]] || { echo "FAIL: $(entries) entries after a kill at ${delay}s"; exit 1; }
done
echo "killed: 8 compiles killed at 0-120 ms, every following compile correct, 1 entry"

# 3. A flipped byte in the middle of the entry.
entry=$(find "$cache" -name '*.hyc')
size=$(stat -c %s "$entry")
offset=$((size / 2))
byte=$(od -An -tu1 -j "$offset" -N1 "$entry" | tr -d ' ')
printf "$(printf '\\%03o' $(((byte + 1) % 256)))" |
  dd of="$entry" bs=1 seek="$offset" conv=notrunc status=none
run flipped > "$work/flipped.log" 2>&1
grep -q "compiled" "$work/flipped.log" || { echo "FAIL: a corrupted entry was used"; cat "$work/flipped.log"; exit 1; }
cmp -s "$work/reference/plan.hyplan" "$work/flipped/plan.hyplan" ||
  { echo "FAIL: the recompiled plan differs"; exit 1; }
run repaired | grep -q "cache hit" || { echo "FAIL: the entry was not replaced"; exit 1; }
echo "corrupted: flipped byte detected, recompiled, entry replaced"

# 4. A full disk: a cache on a 4 KiB tmpfs (where this user may mount one) cannot take the entry;
#    the compile says so and still writes the plan.
full=$work/full
mkdir -p "$full"
if mount -t tmpfs -o size=4k tmpfs "$full" 2> /dev/null; then
  status=0
  "$compile" "$model" -o "$work/on-full" --cache-dir "$full" --quantization=none \
    > /dev/null 2> "$work/full.log" || status=$?
  umount "$full"
  [[ $status == 0 ]] || { echo "FAIL: the compile with a full cache failed"; cat "$work/full.log"; exit 1; }
  grep -q "warning: the plan is not cached: .*No space left on device" "$work/full.log" ||
    { echo "FAIL: no clear warning for the full cache"; cat "$work/full.log"; exit 1; }
  cmp -s "$work/reference/plan.hyplan" "$work/on-full/plan.hyplan" ||
    { echo "FAIL: the uncached plan differs"; exit 1; }
  echo "full disk: warned ($(sed 's/^warning: //' "$work/full.log")), plan written uncached"
else
  echo "full disk: skipped (this user cannot mount a tmpfs)"
fi
echo "CACHE FAULTS OK"
