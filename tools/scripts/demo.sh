#!/usr/bin/env bash
# The main job (README): installs what is missing, builds, synthesizes a tiny hybrid checkpoint
# (Kimi-Linear layout: KDA + MLA + MoE) in the Hub format, compiles it and prints the imported
# model's summary and IR.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${HYBRID_DEMO_DIR:-$root/build/demo}
preset=${HYBRID_DEMO_PRESET:-kimi-linear-tiny}

"$root/tools/scripts/install-deps.sh"
"$root/tools/scripts/build.sh" "$root/build" >/dev/null
bin=$root/build/bin

echo "== synthesizing a $preset checkpoint in $work/checkpoint"
"$bin/hybrid-synth" --preset "$preset" --out "$work/checkpoint" --force

echo "== importing it"
"$bin/hybrid-compile" "$work/checkpoint" --emit=mlir -o "$work/model.mlir"
"$bin/hybrid-compile" "$work/checkpoint" --emit=summary
echo "== IR written to $work/model.mlir ($(wc -l < "$work/model.mlir") lines); first ops:"
head -n 8 "$work/model.mlir" | cut -c1-160
