#!/usr/bin/env bash
# Build (and run) the kernel core's stand-alone test (csrc/tests/selftest.cpp), without torch.
#   build_selftest.sh native  [OUT]   build for this machine and run it (every path this CPU has)
#   build_selftest.sh aarch64 [OUT]   cross-compile for ARM (g++-aarch64-linux-gnu) and run it under
#                                     qemu-aarch64 (qemu-user): plain NEON and dotprod paths
# Prints one checksum per case; they must equal the x86 ones (tests/test_kernels.py pins them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)/csrc"
target=${1:-native}
out=${2:-$(mktemp -d)/selftest-$target}
# every .cpp of the kernel except the torch bindings, and the test itself
src=("$here"/tests/selftest.cpp "$here"/core/*.cpp "$here"/arch/*/*.cpp "$here"/gguf/*.cpp)
flags=(-O2 -pthread -std=c++17 -ffp-contract=off -fno-fast-math -w -I"$here")
case "$target" in
  native)
    "${CXX:-g++}" "${flags[@]}" "${src[@]}" -o "$out"
    "$out" ;;
  aarch64)
    aarch64-linux-gnu-g++ "${flags[@]}" -static "${src[@]}" -o "$out"
    qemu-aarch64 -cpu max "$out" ;;  # "max" has the dot-product extension: both NEON paths run
  *) echo "usage: $0 native|aarch64 [OUT]" >&2; exit 2 ;;
esac
