# Sourced by gpu-check.sh and gpu-ab.sh: what both pack for the GPU machine, so the two carry the
# same libraries and benchmark the same plan.

# print_usage: the calling script's leading comment block (after the shebang), unmarked: its
# usage lives in one place, with no line range to keep in step with it.
print_usage() {
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# require_half HALF: the scripts' two halves are `pack` (here) and `run` (on the GPU machine);
# anything else prints the usage and exits 2.
require_half() {
  [[ $1 == pack || $1 == run ]] && return 0
  print_usage
  exit 2
}

# pack_libraries LIB_DIR BINARY...: the Debian packages' libraries the GPU machine lacks (as the
# binaries link them), and CUPTI for --timeline (opened at run time, so not in ldd's list).
pack_libraries() {
  local lib=$1 binary library path
  shift
  for binary in "$@"; do
    for library in libcpp-httplib.so libxxhash.so; do
      path=$(ldd "$binary" | awk -v l="$library" 'index($1, l) == 1 { print $3 }')
      [[ -n $path ]] && cp -L "$path" "$lib/"
    done
  done
  path=$(ldconfig -p | awk '$1 == "libcupti.so.13" { print $NF; exit }')
  [[ -n $path ]] && cp -L "$path" "$lib/"
  return 0
}

# compile_model BUILD STAGING OUT PRESET[:LAYERS]: a synthetic plan for the GPU checks at OUT
# (hybrid-synth --config-only, hybrid-compile --synthetic-weights for sm_90a: decode batch 128,
# prefill 8192 tokens), its sources dropped. DeepSeek-V3.2 presets take their FP8 weights, as the
# checkpoint; LAYERS cuts the model; the whole Kimi-Linear-48B keeps its dense-attention KV cache
# in FP8 tiles (the plan every benchmark record of it measured).
compile_model() {
  local build=$1 staging=$2 out=$3 preset=${4%%:*} layers="" synth=() compile=()
  [[ $4 == *:* ]] && layers=${4#*:}
  [[ -n $layers ]] && synth+=(--layers "$layers")
  [[ $preset == deepseek-v32* ]] && synth+=(--fp8)
  if [[ $preset == kimi-linear-48b && -z $layers ]]; then
    echo '{"dense_attention_kv_cache":"fp8_tiles"}' > "$staging/dense-fp8.json"
    compile+=(--quantization="$staging/dense-fp8.json")
  fi
  "$build/bin/hybrid-synth" --preset "$preset" "${synth[@]}" --config-only --force \
    --out "$staging/model" > /dev/null || return 1
  "$build/bin/hybrid-compile" "$staging/model" --synthetic-weights --no-cache -o "$out" \
    --device=cuda --arch=sm_90a --decode-batch=128 --prefill-tokens 8192 "${compile[@]}" \
    > /dev/null || return 1
  find "$out" -name '*.source' -delete
}

# compile_k48 BUILD STAGING OUT: the synthetic Kimi-Linear-48B plan gpu-check.sh benchmarks.
compile_k48() { compile_model "$1" "$2" "$3" kimi-linear-48b; }

# unpack TAR_XZ DIR: the GPU machine has no xz tool; python's tarfile reads it.
unpack() {
  mkdir -p "$2" &&
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
}

# bundle_logs DIR NAME: on the GPU machine (OUT set), the files a run wrote to DIR moved into
# one DIR/NAME.tar.gz (python's tarfile), since a device call brings back at most 8 files; here
# `tar -xzf` opens it. Files other steps of the same call put in $OUT beside them stay as they are
# when listed in KEEP (space-separated names).
bundle_logs() {
  local dir=$1 name=$2
  [[ -n ${OUT:-} && $dir == "$OUT" ]] || return 0
  python3 - "$dir" "$name" "${KEEP:-}" <<'PY'
import os, sys, tarfile
folder, name, keep = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
files = sorted(f for f in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, f)) and f not in keep and not f.endswith(".tar.gz"))
with tarfile.open(os.path.join(folder, name + ".tar.gz"), "w:gz") as bundle:
    for f in files:
        bundle.add(os.path.join(folder, f), arcname=f)
for f in files:
    os.remove(os.path.join(folder, f))
print(f"{len(files)} files in {name}.tar.gz")
PY
}
