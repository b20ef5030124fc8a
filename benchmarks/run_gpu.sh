#!/usr/bin/env bash
# One scripted GPU session (e.g. through the `device` tool): build for the local GPU (with the grouped kernels'
# ptxas resource usage), run the GPU tests, the CUDA-graph tests under compute-sanitizer memcheck, the self-check
# and the benchmarks (incl. fine-grained experts, fused bias, fp32 wgrad overwrite); copy logs and JSON to
# $OUT (default ./moe_graph_results, never the tracked benchmarks/results/). Needs the nvidia-cutlass wheel (pip, or carried in .whl/).
#
#   bash benchmarks/run_gpu.sh [build|test|memcheck|bench|all ...]   (default: all)
#
# Stages can run in separate calls (each fits a 10-minute limit); the in-place build is reused. Set
# MOE_GRAPH_COMMIT to the measured commit when the copy has no .git (it goes into every JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-moe_graph_results}
mkdir -p "$OUT"
export MOE_GRAPH_RESULTS="$OUT"   # every benchmark's default JSON/PNG path (benchmarks/common.results_dir)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import cutlass_library" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/cutlass_library ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
stages=${*:-all}
want() { [[ " $stages " == *" all "* || " $stages " == *" $1 "* ]]; }
rc=0

if want build; then
  cap=$(python3 -c "import torch; p=torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
  echo "== build for sm_${cap}a"
  MOE_GRAPH_ARCHS=${cap}a MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  if grep -n C7510 "$OUT/build.log"; then echo "C7510 WARNING"; rc=1; fi
  sed -n '/ptxas resource usage/,/^====/p' "$OUT/build.log"
  if grep -E "REG:[0-9]+ STACK:[0-9]+ SHARED:[0-9]+ LOCAL:[1-9]" "$OUT/build.log"; then echo "SPILLS"; rc=1; fi
fi
if want test; then
  echo "== self-check"; python3 -m moe_graph.selfcheck 2>&1 | tee "$OUT/selfcheck.log" || rc=1
  echo "== host launch logic and the GPU tests of the grouped GEMM first (fail fast), then all tests"
  python3 -m pytest -q -x -p no:cacheprovider tests/test_grouped_launch_logic.py tests/test_grouped_gemm_cuda.py \
    2>&1 | tail -15 | tee "$OUT/grouped_gemm_gpu_tests.log" || rc=1
  python3 -m pytest -q tests -p no:cacheprovider -rs > "$OUT/gpu_tests.log" 2>&1 || rc=1
  tail -25 "$OUT/gpu_tests.log"
fi
if want memcheck; then
  echo "== compute-sanitizer memcheck (CUDA tests of the grouped GEMM and the reroute kernels)"
  compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_grouped_gemm_cuda.py tests/test_reroute.py -k "cuda or gpu or graph or sync" > "$OUT/memcheck.log" 2>&1
  m=$?; echo "memcheck exit code: $m"; tail -8 "$OUT/memcheck.log"; [ $m -eq 0 ] || rc=1
fi
if want bench; then
  echo "== benchmarks"
  python3 benchmarks/bench_grouped_gemm.py 2>&1 | tee "$OUT/bench_grouped_gemm.log"
  for b in bench_echo bench_moe_layer bench_optimizer; do python3 benchmarks/$b.py 2>&1 | tail -40 | tee "$OUT/$b.log"; done
  echo "== demo"; python3 -m moe_graph.demo --quick --out "$OUT/demo" 2>&1 | tail -20 | tee "$OUT/demo.log"
fi
exit $rc
