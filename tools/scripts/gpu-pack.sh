# Sourced by gpu-check.sh and gpu-ab.sh: what both pack for the GPU machine, so the two carry the
# same libraries and benchmark the same plan.

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

# compile_k48 BUILD STAGING OUT: the synthetic Kimi-Linear-48B plan the GPU checks benchmark
# (hybrid-synth --config-only, hybrid-compile --synthetic-weights for sm_90a: decode batch 128,
# prefill 8192 tokens, the dense-attention KV cache in FP8 tiles) at OUT, its sources dropped.
compile_k48() {
  local build=$1 staging=$2 out=$3
  "$build/bin/hybrid-synth" --preset kimi-linear-48b --config-only --force --out "$staging/k48" \
    > /dev/null || return 1
  echo '{"dense_attention_kv_cache":"fp8_tiles"}' > "$staging/dense-fp8.json"
  "$build/bin/hybrid-compile" "$staging/k48" --synthetic-weights --no-cache -o "$out" \
    --device=cuda --arch=sm_90a --decode-batch=128 --prefill-tokens 8192 \
    --quantization="$staging/dense-fp8.json" > /dev/null || return 1
  find "$out" -name '*.source' -delete
}

# unpack TAR_XZ DIR: the GPU machine has no xz tool; python's tarfile reads it.
unpack() {
  mkdir -p "$2" &&
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
}
