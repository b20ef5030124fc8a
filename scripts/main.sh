#!/usr/bin/env bash
# The main job: set up, then the grouped-GEMM self-check (CPU correctness everywhere; CUDA correctness, graph
# capture and no-sync checks on a GPU) and, on a GPU, the benchmark (table + JSON + PNG in benchmarks/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
$PY -m moe_graph.selfcheck
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $PY benchmarks/bench_grouped_gemm.py "$@"
else
  echo "[main] no CUDA device: the grouped-GEMM benchmark needs a GPU (CPU correctness was checked above)"
fi
