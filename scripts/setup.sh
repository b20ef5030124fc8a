#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: Python packages, then an incremental build of moe_graph._C in place
# (python/moe_graph/_C*.so; an unchanged build leaves the file alone). What is built:
#   MOE_GRAPH_CUDA unset (a first run): the CUDA kernels for the GPUs of this machine only (MOE_GRAPH_ARCHS=native,
#     when nvcc and a CUDA build of torch are present); no GPU: the CPU extension only, and the summary says so.
#   MOE_GRAPH_CUDA=1 (CI, .ci/run): every CUDA kernel for MOE_GRAPH_ARCHS (default 90a;100a); fails if it cannot.
#   MOE_GRAPH_CUDA=0: CPU only. MOE_GRAPH_ARCHS, when set, always wins. MAX_JOBS: setup.py's default (cores, memory).
# Fails if the build fails or if ptxas serialized a wgmma pipeline (warning C7510).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

missing=()
$PY -c "import torch" 2>/dev/null || missing+=("torch==2.14.1")  # CUDA build: needed to compile the kernels
for mod_pkg in cutlass_library:nvidia-cutlass pybind11:pybind11 ninja:ninja pytest:pytest hypothesis:hypothesis \
               expecttest:expecttest numpy:numpy matplotlib:matplotlib; do
  $PY -c "import ${mod_pkg%%:*}" 2>/dev/null || missing+=("${mod_pkg##*:}")
done
# test dependency (tests/test_hf_models.py, moe_graph.integrations.hf), pinned: its MoE blocks are the oracle
$PY -c "import sys, transformers; sys.exit(transformers.__version__ != '5.24.0')" 2>/dev/null \
  || missing+=("transformers==5.24.0")
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  $PY -m pip install -q "${missing[@]}"
fi

mkdir -p build
if [ -z "${MOE_GRAPH_CUDA:-}" ] && [ -z "${MOE_GRAPH_ARCHS:-}" ]; then
  export MOE_GRAPH_ARCHS=native  # build for the GPUs this machine has (none: CPU only)
fi
echo "[setup] building moe_graph._C (log: build/build.log)"
if ! $PY setup.py build_ext --inplace > build/build.log 2>&1; then
  grep -E "error|Error" build/build.log | head -40 || true
  tail -20 build/build.log
  echo "[setup] BUILD FAILED" >&2
  exit 1
fi
sed -n '/moe_graph build summary/,/^====/p' build/build.log
sed -n '/moe_graph grouped GEMM kernels: ptxas resource usage/,/^====/p' build/build.log
if grep -E "REG:[0-9]+ STACK:[0-9]+ SHARED:[0-9]+ LOCAL:[1-9]" build/build.log | grep -q .; then
  echo "[setup] a kernel uses local memory (spills): failing the build" >&2
  exit 1
fi
if grep -E "ptxas (warning|W)" build/build.log | grep -q .; then
  grep -nE "ptxas (warning|W)" build/build.log | head
  echo "[setup] ptxas warnings: failing the build" >&2
  exit 1
fi
if grep -q "C7510" build/build.log; then
  grep -n "C7510" build/build.log | head
  echo "[setup] ptxas warning C7510 (wgmma pipeline serialized): failing the build" >&2
  exit 1
fi
echo "[setup] ok"
