#!/usr/bin/env bash
# The main job: set up, run the grouped-GEMM self-check (CPU correctness everywhere; CUDA correctness, graph
# capture and no-sync checks on a GPU), then the end-to-end demo (a small MoE transformer LM trained with expert
# parallelism, echo load balancing, the static dispatcher, the ZeRO-1 optimizer and, on a GPU, one CUDA graph per
# iteration), and on a GPU the grouped-GEMM benchmark. The demo writes into ./moe_graph_demo at the checkout's root
# (git-ignored; --out DIR elsewhere), the benchmark into ./moe_graph_results/. Nothing tracked is modified.
# Extra arguments go to the demo (e.g. --quick, --ep 4, --save ckpt --save-every 50: ./moe_graph_demo/ckpt).
# The build (scripts/setup.sh) is for this machine: without a GPU the CPU extension only (MOE_GRAPH_CUDA=1 builds the
# CUDA kernels for sm_90a and sm_100a, as CI does), with GPUs the kernels of their architectures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
$PY -m moe_graph.selfcheck
$PY -m moe_graph.demo "$@"
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $PY benchmarks/bench_grouped_gemm.py
else
  echo "[main] no CUDA device: the grouped-GEMM benchmark needs a GPU (CPU correctness was checked above)"
fi
