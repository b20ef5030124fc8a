#!/usr/bin/env bash
# One scripted GPU session (e.g. through the `device` tool): build for the local GPU, run the GPU tests, the
# CUDA-graph tests under compute-sanitizer memcheck, the self-check and the benchmarks; copy logs and JSON to
# $OUT (or benchmarks/results/ when OUT is unset). Needs the nvidia-cutlass wheel (pip, or carried in .whl/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
cap=$(python3 -c "import torch; p=torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
arch=$([ "$cap" = "90" ] && echo 90a || echo "${cap}a")
echo "== build for sm_$arch"
MOE_GRAPH_ARCHS=$arch MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -n C7510 "$OUT/build.log" && echo "C7510 WARNING"
echo "== self-check"; python3 -m moe_graph.selfcheck 2>&1 | tee "$OUT/selfcheck.log"
echo "== all tests (GPU tests included)"; python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "== compute-sanitizer memcheck"
compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x tests/test_grouped_gemm_cuda.py -k "forward_matches_reference and bfloat16 or overflow or wgrad" -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
echo "memcheck exit code: $?"; tail -5 "$OUT/memcheck.log"
echo "== benchmarks"; python3 benchmarks/bench_grouped_gemm.py 2>&1 | tee "$OUT/bench_grouped_gemm.log"
for b in bench_echo bench_moe_layer; do python3 benchmarks/$b.py 2>&1 | tail -30 | tee "$OUT/$b.log"; done
echo "== demo"; python3 -m moe_graph.demo --quick 2>&1 | tail -20 | tee "$OUT/demo.log"
cp benchmarks/results/*.json benchmarks/results/*.png "$OUT/" 2>/dev/null || true
