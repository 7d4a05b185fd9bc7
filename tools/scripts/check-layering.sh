#!/usr/bin/env bash
# DESIGN.md section 2: runtime/, kernels/ and cache/ never include MLIR or LLVM.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
leaks=$(grep -rnE '#include *[<"](mlir|llvm)/' "$root/runtime" "$root/kernels" "$root/cache" 2>/dev/null || true)
if [[ -n $leaks ]]; then
  echo "layering violation: runtime/, kernels/ and cache/ must not include MLIR or LLVM:"
  echo "$leaks"
  exit 1
fi
echo "layering: runtime/, kernels/, cache/ are free of MLIR and LLVM includes"
