#!/usr/bin/env bash
# Install draftwise and what it needs. The CPU build of torch is asked for by exact version first, so
# pip takes the local CPU wheel (or the CPU index) instead of several GB of CUDA packages.
#
# Opt-in: `./install.sh --peers` (or DRAFTWISE_PEERS=1) also builds llama-cpp-python from source for the
# llama.cpp peers of `draftwise bench` (llama-ar, llama-pld; about 5 minutes on 2 cores). Its default
# native build (-march=native) turns on the AMX kernels, which segfault on some Intel machines, so the
# instruction sets are named one by one from /proc/cpuinfo and AMX is always off. An installed
# llama-cpp-python is kept; DRAFTWISE_PEERS_REBUILD=1 uninstalls it first to rebuild with these flags.
set -euo pipefail
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PEERS=${DRAFTWISE_PEERS:-0}
for arg in "$@"; do
  case "$arg" in
    --peers) PEERS=1 ;;
    -h|--help) echo "usage: $0 [--peers]   (--peers, or DRAFTWISE_PEERS=1: also build llama-cpp-python)"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (usage: $0 [--peers])" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==${TORCH_VERSION}" \
    || "$PY" -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -e ".[serve,bench,test]"

# CMAKE_ARGS for a portable llama.cpp build: what this CPU has, never AMX, never -march=native. The same
# choice as draftwise.bench.llama_peers.safe_cmake_args (a test keeps them equal); $1: a cpuinfo file.
llama_cmake_args() {
  local flags args="-DGGML_NATIVE=OFF"
  flags=" $(grep -m1 '^flags' "${1:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "
  has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
  if has avx2; then
    args+=" -DGGML_AVX=ON -DGGML_AVX2=ON"
    has fma && args+=" -DGGML_FMA=ON"
    has f16c && args+=" -DGGML_F16C=ON"
    has bmi2 && args+=" -DGGML_BMI2=ON"
  elif has avx; then
    args+=" -DGGML_AVX=ON -DGGML_AVX2=OFF"
  fi
  if has avx512f avx512cd avx512vl avx512dq avx512bw; then  # ggml's GGML_AVX512 compiles for all five
    args+=" -DGGML_AVX512=ON"
    has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"
    has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
  fi
  echo "$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

if [[ "$PEERS" == 1 ]]; then
  if [[ "${DRAFTWISE_PEERS_REBUILD:-0}" == 1 ]]; then
    "$PY" -m pip uninstall -y llama-cpp-python || true
  fi
  export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }$(llama_cmake_args)"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}
  echo "install.sh: building llama-cpp-python from source with CMAKE_ARGS=$CMAKE_ARGS" >&2
  # --no-binary: never a prebuilt wheel; --no-cache-dir: never a wheel pip built earlier with other flags
  "$PY" -m pip install --no-cache-dir --no-binary llama-cpp-python -e ".[peers]"
fi
