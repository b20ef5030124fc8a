#!/usr/bin/env bash
# One scripted GPU session (e.g. through the `device` tool), sized for one call of 10 minutes on one H100 from a bare
# machine: build for the local GPU only (with the grouped kernels' ptxas resource usage), the toolchain and a probe
# of an op's error path (cuda-gdb backtrace if it crashes), the GPU tests (the CUDA tests of every kernel family, one
# pytest per file), compute-sanitizer memcheck + racecheck + synccheck on every custom
# kernel (the project's kernels, not CUTLASS's: --kernel-name kns=moe_graph), the self-check and the
# benchmarks (incl. fine-grained experts, fused bias, fp32 wgrad overwrite); logs and JSON go to $OUT (default
# ./moe_graph_results, never the tracked benchmarks/results/). Needs the nvidia-cutlass wheel (pip, or carried in
# .whl/). Each stage has a time limit (seconds: BUILD_S, TEST_S, SANITIZE_S per tool, BENCH_S) so that one stage
# that hangs cannot spend the session; the CPU emulator (tests/test_emulator.py) has already run every custom kernel.
#
#   bash benchmarks/run_gpu.sh [build|test|sanitize|memcheck|bench|all ...]   (default: all)
#
# Stages can run in separate calls; the in-place build is reused. Set MOE_GRAPH_COMMIT to the measured commit when
# the copy has no .git (it goes into every JSON).
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
BUILD_S=${BUILD_S:-270} TEST_S=${TEST_S:-120} SANITIZE_S=${SANITIZE_S:-75} BENCH_S=${BENCH_S:-120}
SESSION_S=${SESSION_S:-570} START=$SECONDS
# the stage's limit, cut to what is left of the session (the benchmarks, last, get the rest)
lim() { local left=$((SESSION_S - (SECONDS - START))); [ "$left" -lt "$1" ] && echo $((left > 5 ? left : 5)) || echo "$1"; }
# The CUDA tests of every custom kernel family (each launches its kernels on the device and compares with the CPU).
KERNEL_TESTS="tests/test_activation.py tests/test_permute.py tests/test_dispatch_layout.py tests/test_reroute.py
  tests/test_planner.py tests/test_grouped_gemm_cuda.py tests/test_fp8_quantize.py tests/test_fp8_gemm_cuda.py
  tests/test_overlap.py tests/test_exchange_cuda.py"  # test_overlap: the shared expert's side stream in one graph, no syncs;
# test_exchange_cuda: the fused exchange kernels on min(GPUs, 4) NCCL ranks against the host reference
KERNEL_K="cuda or gpu or graph or sync"
want() { [[ " $stages " == *" all "* || " $stages " == *" $1 "* ]]; }
rc=0

if want build; then
  cap=$(python3 -c "import torch; p=torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')")
  echo "== build for sm_${cap}a"
  MOE_GRAPH_ARCHS=${cap}a MAX_JOBS=${MAX_JOBS:-16} timeout "$(lim $BUILD_S)" python3 setup.py build_ext --inplace \
    > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  if grep -n C7510 "$OUT/build.log"; then echo "C7510 WARNING"; rc=1; fi
  sed -n '/ptxas resource usage/,/^====/p' "$OUT/build.log"
  if grep -E "REG:[0-9]+ STACK:[0-9]+ SHARED:[0-9]+ LOCAL:[1-9]" "$OUT/build.log"; then echo "SPILLS"; rc=1; fi
fi
if want build || want test; then
  # the toolchain the build used (torch gives nvcc CC as its host compiler; every object of the .so must share it)
  echo "== toolchain: CC=${CC:-unset} CXX=${CXX:-unset}; $(${CXX:-c++} --version 2>/dev/null | head -1); $(nvcc --version | tail -1)"
  # an op that raises (its message built in the extension): a crash here means the .so mixes C++ runtimes
  probe='from moe_graph.ops._lib import ops
try:
    ops._grouped_plan_forward(90, 100, 2, 64, 64, False, False, 4)
except RuntimeError as e:
    print("error path ok:", str(e)[:60])'
  if ! timeout 60 python3 -c "$probe"; then
    echo "ERROR PATH CRASHED"; rc=1
    command -v cuda-gdb >/dev/null && timeout 90 cuda-gdb -q -batch -ex run -ex bt --args python3 -c "$probe" 2>&1 | tail -30
  fi
fi
if want test; then
  echo "== self-check"; timeout "$(lim 60)" python3 -m moe_graph.selfcheck 2>&1 | tee "$OUT/selfcheck.log" || rc=1
  echo "== host launch logic and the GPU tests of every kernel family (one pytest per file: a crash hides no other)"
  for t in tests/test_grouped_launch_logic.py tests/test_fp8_launch_logic.py $KERNEL_TESTS; do
    timeout "$(lim 60)" python3 -X faulthandler -m pytest -q -p no:cacheprovider --maxfail=3 "$t" -k "$KERNEL_K or launch" \
      > "$OUT/gpu_tests_$(basename "$t" .py).log" 2>&1
    m=$?; [ $m -eq 0 ] || [ $m -eq 5 ] || rc=1  # 5: nothing selected
    echo "  $t: exit $m; $(tail -1 "$OUT/gpu_tests_$(basename "$t" .py).log")"
  done
  if [ -n "${ALL_TESTS:-}" ]; then  # the whole suite: longer than one call leaves after the other stages
    python3 -m pytest -q tests -p no:cacheprovider -rs > "$OUT/gpu_all_tests.log" 2>&1 || rc=1
    tail -25 "$OUT/gpu_all_tests.log"
  fi
fi
if want sanitize; then
  for tool in memcheck racecheck synccheck; do
    echo "== compute-sanitizer $tool on the project's kernels"
    timeout "$(lim $SANITIZE_S)" compute-sanitizer --tool $tool --error-exitcode 3 --kernel-name kns=moe_graph \
      python3 -m pytest -q -x -p no:cacheprovider $KERNEL_TESTS -k "$KERNEL_K" > "$OUT/$tool.log" 2>&1
    m=$?; echo "$tool exit code: $m (124: time limit)"; grep -m5 "ERROR SUMMARY\|Race reported\|Barrier error" "$OUT/$tool.log"
    tail -3 "$OUT/$tool.log"; [ $m -eq 0 ] || rc=1
  done
fi
if [[ " $stages " == *" memcheck "* ]]; then  # the older grouped GEMM + reroute memcheck (sanitize covers it)
  echo "== compute-sanitizer memcheck (CUDA tests of the grouped GEMM and the reroute kernels)"
  timeout "$(lim $SANITIZE_S)" compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_grouped_gemm_cuda.py tests/test_reroute.py -k "cuda or gpu or graph or sync" > "$OUT/memcheck.log" 2>&1
  m=$?; echo "memcheck exit code: $m"; tail -8 "$OUT/memcheck.log"; [ $m -eq 0 ] || rc=1
fi
if want bench; then
  echo "== benchmarks"
  timeout "$(lim $BENCH_S)" python3 benchmarks/bench_grouped_gemm.py 2>&1 | tee "$OUT/bench_grouped_gemm.log"
  timeout "$(lim 60)" python3 benchmarks/bench_fp8_gemm.py --quick 2>&1 | tee "$OUT/bench_fp8_gemm.log"
  # the fused exchange kernels vs all_to_all_vdev_2d and NCCL, EP = the GPUs present (own process launch, NCCL)
  timeout "$(lim $BENCH_S)" python3 benchmarks/bench_exchange_gpu.py 2>&1 | tee "$OUT/bench_exchange_gpu.log"
  # step time of the schedules serial / overlap_shared_expert / overlap_microbatches / both (one graph each) and, from a
  # torch.profiler trace, the time >= 2 streams run kernels and the exposed dispatch/combine kernels (EP 1: local moves)
  timeout "$(lim $BENCH_S)" python3 benchmarks/bench_overlap_gpu.py 2>&1 | grep -v "^USDT:" | tee "$OUT/bench_overlap_gpu.log"
  for b in bench_echo bench_moe_layer bench_optimizer; do
    timeout "$(lim $BENCH_S)" python3 benchmarks/$b.py 2>&1 | tail -40 | tee "$OUT/$b.log"
  done
  echo "== demo"; timeout "$(lim 120)" python3 -m moe_graph.demo --quick --out "$OUT/demo" 2>&1 | tail -20 | tee "$OUT/demo.log"
fi
exit $rc
