#!/usr/bin/env bash
# Installs the Debian packages hybrid builds with (DESIGN.md: dependencies only from Debian/PyPI).
# Skips apt entirely when everything is already there, so repeated runs cost nothing.
set -euo pipefail

packages=(
  cmake ninja-build ccache g++ python3 pkg-config libcpp-httplib-dev
  libmlir-19-dev mlir-19-tools llvm-19-dev llvm-19-tools
  libflatbuffers-dev flatbuffers-compiler
  libcli11-dev libzstd-dev libxxhash-dev nlohmann-json3-dev libgtest-dev
  libpcre2-dev # the tokenizer's split regexes
  clang libclang-rt-14-dev # libFuzzer (tools/scripts/fuzz.sh)
)

missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
