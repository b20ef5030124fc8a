"""Every custom CUDA kernel runs on the CPU in an emulated CUDA execution model (tests/emulator): the ``*_cuda.cu``
sources compiled as host C++ with AddressSanitizer and UBSan against a small shim, each block's threads as
cooperative fibers that meet at barriers and warp collectives, and run in a chosen order between them (forward,
reverse, seeded random). Each kernel family is launched through its host launcher on the CPU tests' kinds of input
and compared bit for bit with the CPU implementation under every schedule (a sum whose order the kernel fixes
differently from the CPU loop: within a tolerance of the CPU, and bit for bit across schedules). Broken variants (a
removed barrier, a lane-order dependence, an out-of-bounds write) are shown to be caught.

The build (about a minute on 2 cores) is cached in build/emulator/<hash of sources and flags>/. MOE_EMU_FULL=1 runs
the whole matrix (larger shapes, the echo plan at R = 256, more random schedules)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "tests", "emulator")
FULL = os.environ.get("MOE_EMU_FULL", "") not in ("", "0")
SCHEDULES = "forward,reverse,random:1" + (",random:2,random:3" if FULL else "")
# Kernel sources (every *_cuda.cu: the per-architecture CUTLASS files are CUTLASS's kernels, not emulated) and the
# CPU implementations they are compared with.
KERNELS = ["activation/activation_cuda.cu", "permute/permute_cuda.cu", "permute/dispatch_layout_cuda.cu",
           "reroute/reroute_cuda.cu", "reroute/echo_plan_cuda.cu", "grouped_gemm/grouped_gemm_cuda.cu",
           "fp8/quantize_cuda.cu", "fp8/scaled_gemm_cuda.cu", "exchange/exchange_cuda.cu"]
CPU = ["activation/activation_cpu.cpp", "permute/permute_cpu.cpp", "permute/dispatch_layout_cpu.cpp",
       "reroute/reroute_cpu.cpp", "reroute/echo_plan_cpu.cpp", "grouped_gemm/grouped_plan.cpp",
       "fp8/quantize_cpu.cpp", "fp8/scaled_plan.cpp", "exchange/exchange_cpu.cpp"]
HARNESS = ["moe_emu.cpp", "harness.cpp", "harness_grouped.cpp", "harness_scaled.cpp", "harness_exchange.cpp",
           "harness_permute_quantize.cpp"]
# longest first (their runs go two at a time: the long ones first leave no long one for last)
FAMILIES = ["fp8_quantize", "activation", "fp8_scaled", "grouped", "permute_quantize", "echo_plan", "permute",
            "exchange", "dispatch", "reroute", "reroute_indices", "aligned", "receive"]


def _cuda_include():
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes.append("/usr/local/cuda")
    for h in homes:
        if h and os.path.isfile(os.path.join(h, "include", "cuda_runtime_api.h")):
            inc = [os.path.join(h, "include")]
            if os.path.isdir(os.path.join(h, "include", "cccl")):
                inc.append(os.path.join(h, "include", "cccl"))
            return inc
    return None


def _cutlass_include():
    d = os.environ.get("CUTLASS_DIR")
    if d:
        return [os.path.join(d, "include"), os.path.join(d, "tools", "util", "include")]
    try:
        import cutlass_library
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return [inc, os.path.join(os.path.dirname(inc), "tools", "util", "include")] if os.path.isdir(inc) else None


def _torch_include():
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "include")


def _build():
    """Compiles the harness (cached by a hash of every source under csrc/ and tests/emulator/, this file and the
    flags; earlier builds are removed); returns its path, or a reason to skip."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler ({cxx})"
    cuda = _cuda_include()
    if cuda is None:
        return None, "no CUDA toolkit headers (cuda_runtime_api.h, cuda_bf16.h)"
    cutlass = _cutlass_include()
    if cutlass is None:
        return None, "no CUTLASS/CuTe headers (nvidia-cutlass wheel or CUTLASS_DIR)"
    flags = ["-std=c++20", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=undefined", f"-I{EMU}", f"-I{os.path.join(EMU, 'include')}",
             f"-I{os.path.join(ROOT, 'csrc')}"] + [f"-isystem{d}" for d in cuda + cutlass]
    emu_flags = ["-DMOE_GRAPH_EMULATE", "-DMOE_GRAPH_WITH_CUDA", "-DMOE_GRAPH_BUILD_SM90", "-DMOE_GRAPH_BUILD_SM100", "-include", "moe_emu.h"]
    h = hashlib.sha256(" ".join([cxx] + flags + emu_flags).encode())
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    with open(os.path.abspath(__file__), "rb") as fh:  # the source lists above
        h.update(fh.read())
    for top in (os.path.join(ROOT, "csrc"), EMU):
        for dirpath, _, files in sorted(os.walk(top)):
            for f in sorted(files):
                p = os.path.join(dirpath, f)
                h.update(os.path.relpath(p, ROOT).encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
    out = os.path.join(ROOT, "build", "emulator", h.hexdigest()[:16])
    exe = os.path.join(out, "harness")
    if os.path.exists(exe):
        return exe, None
    os.makedirs(out, exist_ok=True)
    jobs = []
    for src in KERNELS:
        jobs.append(([cxx] + flags + emu_flags + ["-x", "c++", "-c", os.path.join(ROOT, "csrc", src)], src))
    for src in CPU:
        jobs.append(([cxx] + flags + [f"-isystem{_torch_include()}", "-c", os.path.join(ROOT, "csrc", src)], src))
    for src in HARNESS:
        jobs.append(([cxx] + flags + emu_flags + ["-c", os.path.join(EMU, src)], src))
    # the longest compiles first (about 40, 20, 20, 15, 12, 11 s on one core): none is left to run alone at the end
    heavy = ["fp8/quantize_cuda.cu", "activation/activation_cuda.cu", "harness_scaled.cpp", "harness_grouped.cpp",
             "harness.cpp", "fp8/quantize_cpu.cpp"]
    jobs.sort(key=lambda job: heavy.index(job[1]) if job[1] in heavy else len(heavy))
    objs = []

    def compile_one(job):
        cmd, src = job
        obj = os.path.join(out, src.replace("/", "_") + ".o")
        r = subprocess.run(cmd + ["-o", obj], capture_output=True, text=True)
        return obj, src, r

    with ThreadPoolExecutor(max_workers=int(os.environ.get("MAX_JOBS") or 2)) as pool:
        for obj, src, r in pool.map(compile_one, jobs):
            assert r.returncode == 0, f"emulator build of {src} failed:\n{r.stderr[-4000:]}"
            objs.append(obj)
    tmp = exe + ".tmp"
    r = subprocess.run([cxx, "-fsanitize=address,undefined", "-o", tmp] + objs, capture_output=True, text=True)
    assert r.returncode == 0, f"emulator link failed:\n{r.stderr[-4000:]}"
    os.replace(tmp, exe)
    for old in os.listdir(os.path.dirname(out)):  # earlier builds of this checkout (other sources): not reused
        if old != os.path.basename(out) and re.fullmatch(r"[0-9a-f]{16}", old):
            shutil.rmtree(os.path.join(os.path.dirname(out), old), ignore_errors=True)
    return exe, None


@pytest.fixture(scope="module")
def harness():
    exe, why = _build()
    if exe is None:
        pytest.skip(why)
    return exe


def _cmd_env(exe, family, args, fault, schedules):
    env = dict(os.environ)
    env.pop("MOE_EMU_FAULT", None)
    if fault:
        env["MOE_EMU_FAULT"] = fault
    # leaks are not what this checks (the harness exits at the first difference); stop at the first error
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return [exe, family, "--schedules", schedules] + (["--full"] if FULL else []) + list(args), env


def _run(exe, family, *args, fault=None, schedules=SCHEDULES, timeout=600):
    cmd, env = _cmd_env(exe, family, args, fault, schedules)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


class _FamilyRuns:
    """The selected families' harness runs, started together, at most ``jobs`` at a time (each is one
    single-threaded process: with 2 cores, two at once take about half the time of one after the other), the longest
    first. ``result(family)`` waits for one; ``close()`` kills the runs still going and cancels those not started
    (the module's tests ended early, passed or failed): no harness process outlives the module."""

    def __init__(self, exe, families, jobs, timeout=1200):  # a last resort (the harness reports deadlocks itself):
        # the longest run takes about 80 s alone on an idle core, up to 450 s on a machine loaded 10 times over
        self._exe, self._timeout = exe, timeout
        self._procs, self._lock, self._closed = set(), threading.Lock(), False
        self._pool = ThreadPoolExecutor(max_workers=jobs)
        order = sorted(families, key=lambda f: FAMILIES.index(f))  # FAMILIES is longest first
        self._futures = {f: self._pool.submit(self._one, f) for f in order}

    def _one(self, family):
        cmd, env = _cmd_env(self._exe, family, (), None, SCHEDULES)
        with self._lock:
            if self._closed:
                raise RuntimeError("the module ended before this family ran")
            # argv[0] a plain name: the per-test check for leftover processes (conftest) looks for test processes by
            # their command lines, and a checkout path may contain one of its marks; this run belongs to the module
            proc = subprocess.Popen(["emulator-harness"] + cmd[1:], executable=cmd[0], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self._procs.add(proc)
        try:
            out, err = proc.communicate(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(killed after {self._timeout} s)"
        finally:
            with self._lock:
                self._procs.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def result(self, family):
        return self._futures[family].result()

    def close(self):
        with self._lock:
            self._closed = True
            for proc in self._procs:
                proc.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def family_runs(harness, request):
    """Starts every selected family's run at once (the module's first test that needs one), ends them with the
    module."""
    selected = [item.callspec.params["family"] for item in request.session.items
                if item.originalname == "test_kernels_equal_cpu_under_every_schedule"
                and item.module is request.module]
    runs = _FamilyRuns(harness, selected, jobs=int(os.environ.get("MAX_JOBS") or 2))
    yield runs
    runs.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_equal_cpu_under_every_schedule(family_runs, family):
    r = family_runs.result(family)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"ok {family}:" in r.stdout, out[-3000:]
    sys.stdout.write(r.stdout)


# A broken variant must fail: (family, fault, schedules that catch it, schedules that do not).
BROKEN = [
    # reroute apply: the barrier between zeroing the tile's spare columns and moving tokens into them, removed
    ("reroute", "syncthreads:-1:-1", "forward,reverse,random:1", None),
    # index reroute: the shared histogram used before every thread has zeroed it
    ("reroute_indices", "syncthreads:-1:-1", "forward,reverse,random:1", None),
    # receive_layout's tables: later phases read counts other threads have not written yet
    ("receive", "syncthreads:-1:-1", "reverse", None),
    # dispatch_layout's stable rank: without the first __syncwarp the highest peer lane advances the running count
    # before the lower lanes read it: a lane-order dependence that the forward order hides
    ("dispatch", "syncwarp:-1:0", "reverse", "forward"),
    ("dispatch", "syncwarp:-1:0", "random:1", None),
    # echo plan: the level-search warps' named barrier (bar.sync 1, 512) removed
    ("echo_plan", "named:-1:-1", "forward,reverse,random:1", None),
    # grouped GEMM argument kernel: the block scan's barriers removed
    ("grouped", "syncthreads:-1:-1", "reverse", None),
    # fp8 quantizer: the tile's shared amax reduction without its barriers
    ("fp8_quantize", "syncthreads:-1:-1", "reverse", None),
    # expand_quantize: the same reduction of the tile's amax over the gathered rows without its barriers
    ("permute_quantize", "syncthreads:-1:-1", "reverse", None),
]


@pytest.mark.parametrize("family,fault,catch,miss", BROKEN, ids=[f"{b[0]}-{b[1]}-{b[2]}" for b in BROKEN])
def test_broken_variants_are_caught(harness, family, fault, catch, miss):
    r = _run(harness, family, fault=fault, schedules=catch)
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"{family} with {fault} under {catch} was not caught:\n{out[-3000:]}"
    assert "FAIL" in out or "moe_emu:" in out or "AddressSanitizer" in out, out[-3000:]
    if miss:
        r = _run(harness, family, fault=fault, schedules=miss)
        assert r.returncode == 0, "the schedule that should miss this fault caught it; update the table"


@pytest.mark.parametrize("selftest,expect", [("selftest_oob", "AddressSanitizer"),
                                             ("selftest_smem_oob", "AddressSanitizer"),
                                             ("selftest_race", "FAIL"),
                                             ("selftest_divergent_shfl", "moe_emu:")])
def test_emulator_catches_memory_errors_and_races(harness, selftest, expect):
    r = _run(harness, selftest)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and expect in out, out[-3000:]


# The fused exchange on R emulated devices (the multi-device mode): each injected fault of the peer-memory protocol
# is caught, and how. fence:-1: the system fences (and the fence of every release) do nothing, so no store into a
# peer becomes visible (the count tables read as poison: nothing arrives); fence:1: only launch 1 (device 0's data
# kernel) without them: its rows reach the receivers as poison (0xff); peer: a block's first signal goes to the next
# peer (one peer never gets it: a deadlock, reported); nosignal: a block's second signal is not sent (a deadlock);
# guard: the capacity guard removed, rows past a receive buffer are written (AddressSanitizer).
EXCHANGE_FAULTS = [("fence:-1:-1", "FAIL"), ("fence:1:-1", "emulated 0xff"), ("peer:-1:0", "deadlock"),
                   ("nosignal:-1:1", "deadlock"), ("guard:-1:-1", "AddressSanitizer")]


@pytest.mark.parametrize("fault,expect", EXCHANGE_FAULTS, ids=[f[0] for f in EXCHANGE_FAULTS])
def test_exchange_faults_are_caught(harness, fault, expect):
    r = _run(harness, "exchange", fault=fault, schedules="forward", timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and expect in out, f"exchange with {fault}: not caught as {expect}:\n{out[-3000:]}"
