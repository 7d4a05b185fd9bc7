#!/usr/bin/env bash
# The main job (README): installs what is missing, builds, synthesizes a tiny hybrid checkpoint
# (Kimi-Linear layout: KDA + NoPE MLA + MoE) in the Hub format, compiles it ahead of time into a
# plan + weight archive, and runs it on the cpu device: generated ids, time to first token and
# tokens per second.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${HYBRID_DEMO_DIR:-$root/build/demo}
preset=${HYBRID_DEMO_PRESET:-kimi-linear-tiny}
prompt=${HYBRID_DEMO_PROMPT:-$(seq -s, 1 48)}
new_tokens=${HYBRID_DEMO_NEW_TOKENS:-32}

"$root/tools/scripts/install-deps.sh"
"$root/tools/scripts/build.sh" "$root/build" >/dev/null
bin=$root/build/bin
export HYBRID_CACHE_DIR=${HYBRID_CACHE_DIR:-$work/cache}

echo "== synthesizing a $preset checkpoint in $work/checkpoint"
"$bin/hybrid-synth" --preset "$preset" --out "$work/checkpoint" --force

echo "== the imported model"
"$bin/hybrid-compile" "$work/checkpoint" --emit=summary

echo "== compiling (plan + weight archive, compilation cache in $HYBRID_CACHE_DIR)"
"$bin/hybrid-compile" "$work/checkpoint" -o "$work/compiled"

echo "== running on the cpu device"
"$bin/hybrid-run" "$work/compiled" --device cpu --input-ids "$prompt" \
  --max-new-tokens "$new_tokens" --output "$work/output.safetensors"
echo "== logits, gen_ids and gen_logits written to $work/output.safetensors"
