"""Build moe_graph._C: CPU kernels + op registration always; CUDA kernels when nvcc and a CUDA torch exist.

Environment:
  MOE_GRAPH_CUDA=0        force a CPU-only build (=1 forces CUDA and fails loudly if it cannot be built)
  MOE_GRAPH_ARCHS         GPU targets, ';'-separated (default "90a;100a"). Files named *_sm90.cu build only for
                          9x targets and *_sm100.cu only for 10x targets; other .cu files build for all.
  CUTLASS_DIR             a CUTLASS checkout (its include/ is used) instead of the nvidia-cutlass wheel
  MAX_JOBS                parallel compile jobs (ninja)
Never probes a GPU: everything is decided from the environment and the installed toolchain.
"""

import glob
import os
import re
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    return v.strip().lower() not in ("0", "false", "off", "no")


def _cutlass_include():
    d = os.environ.get("CUTLASS_DIR")
    if d:
        inc = os.path.join(d, "include")
        if not os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
            sys.exit(f"moe_graph build: CUTLASS_DIR={d} has no include/cutlass/cutlass.h")
        return [inc, os.path.join(d, "tools", "util", "include")], f"CUTLASS_DIR={d}"
    try:
        import cutlass_library  # from the nvidia-cutlass wheel
    except ImportError:
        return None, "not found (pip install nvidia-cutlass, or set CUTLASS_DIR)"
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h")):
        return None, f"nvidia-cutlass wheel without headers at {inc}"
    return [inc, os.path.join(os.path.dirname(inc), "tools", "util", "include")], inc


def _cuda_include_dirs():
    """CUDA library headers (cuBLAS, cuSPARSE, ...) that torch's ATen/cuda headers include: the nvidia/cu13 (or
    cu12) wheel headers shipped with a CUDA torch. They are searched after the toolkit's (-idirafter), because
    the wheels' runtime headers are incomplete."""
    dirs = []
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13", "cu12"):
                inc = os.path.join(base, sub, "include")
                if os.path.isdir(inc):
                    dirs.append(inc)
    except ImportError:
        pass
    return dirs


def _archs():
    raw = os.environ.get("MOE_GRAPH_ARCHS", "90a;100a")
    archs = [a.strip() for a in re.split(r"[;, ]+", raw) if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d+[af]?", a):
            sys.exit(f"moe_graph build: bad MOE_GRAPH_ARCHS entry {a!r} (expected e.g. 90a;100a)")
    return archs


def _default_cuda_home():
    """CUDA_HOME, when unset: the toolkit of nvcc on PATH (symlinks resolved) or /usr/local/cuda."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    import shutil

    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:  # the first with both the compiler and the runtime headers
        if os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")) and os.path.exists(
            os.path.join(home, "bin", "nvcc")
        ):
            os.environ["CUDA_HOME"] = home
            return


def main():
    _default_cuda_home()
    import torch
    from torch.utils import cpp_extension as ce

    want_cuda = _env_flag("MOE_GRAPH_CUDA")
    nvcc_ok = ce.CUDA_HOME is not None and os.path.exists(os.path.join(ce.CUDA_HOME, "bin", "nvcc"))
    torch_cuda = torch.version.cuda is not None
    cutlass_inc, cutlass_msg = _cutlass_include()
    can_cuda = nvcc_ok and torch_cuda and cutlass_inc is not None
    if want_cuda is True and not can_cuda:
        sys.exit(
            "moe_graph build: MOE_GRAPH_CUDA=1 but CUDA cannot be built "
            f"(nvcc: {nvcc_ok}, CUDA torch: {torch_cuda}, CUTLASS: {cutlass_msg})"
        )
    use_cuda = can_cuda if want_cuda is None else (want_cuda and can_cuda)
    archs = _archs() if use_cuda else []

    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)) if use_cuda else []

    def arch_family(a):
        return int(re.match(r"\d+", a).group()) // 10

    # Per-arch files: *_sm90.cu for 9x, *_sm100.cu for 10x; a file whose arch is not built is dropped.
    kept = []
    for src in cu_sources:
        m = re.search(r"_sm(\d+)\.cu$", src)
        if m and not any(arch_family(a) == int(m.group(1)) // 10 for a in archs):
            continue
        kept.append(src)
    cu_sources = kept

    cxx = ["-O3", "-DNDEBUG"]
    define = []
    include_dirs = [os.path.join(ROOT, "csrc")]
    nvcc = [
        "-O3",
        "-DNDEBUG",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-Xptxas=--warn-on-spills",
        "--diag-suppress=2908",  # CUTLASS headers under C++20: implicit capture of `this` (deprecated, harmless)
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        "--use_fast_math",
    ]
    if use_cuda:
        define.append("-DMOE_GRAPH_WITH_CUDA")
        include_dirs += cutlass_inc
        cxx += [f"-idirafter{d}" for d in _cuda_include_dirs()]
        for a in archs:
            nvcc.append(f"-gencode=arch=compute_{a},code=sm_{a}")
            define.append(f"-DMOE_GRAPH_BUILD_SM{arch_family(a) * 10}")
    cxx += define
    nvcc += define

    print("=" * 72)
    print("moe_graph build summary")
    print(f"  torch          {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"  CUDA kernels   {'ON' if use_cuda else 'OFF'}"
          + ("" if use_cuda else f"  (nvcc: {nvcc_ok}, CUDA torch: {torch_cuda}, MOE_GRAPH_CUDA={os.environ.get('MOE_GRAPH_CUDA', '')})"))
    print(f"  CUDA_HOME      {ce.CUDA_HOME}")
    print(f"  archs          {';'.join(archs) if archs else '-'}")
    print(f"  CUTLASS        {cutlass_msg}")
    print(f"  sources        {len(cpp_sources)} C++, {len(cu_sources)} CUDA")
    print("=" * 72)

    Ext = ce.CUDAExtension if use_cuda else ce.CppExtension
    ext = Ext(
        name="moe_graph._C",
        sources=cpp_sources + cu_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc} if use_cuda else {"cxx": cxx},
        py_limited_api=False,
    )
    setup(
        ext_modules=[ext],
        cmdclass={"build_ext": ce.BuildExtension.with_options(use_ninja=True)},
    )


main()
