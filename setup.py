"""Build moe_graph._C: CPU kernels + op registration always; CUDA kernels when nvcc and a CUDA torch exist.

Environment:
  MOE_GRAPH_CUDA=0        force a CPU-only build (=1 forces CUDA and fails loudly if it cannot be built)
  MOE_GRAPH_ARCHS         GPU targets, ';'-separated (default "90a;100a"). Files named *_sm90.cu are compiled only
                          for the 9x targets and *_sm100.cu only for the 10x targets (per-source -gencode: no
                          dead-stub pass of the other architecture); other .cu files build for all.
                          "native" (scripts/setup.sh's default when MOE_GRAPH_CUDA is unset): the architectures of
                          the GPUs torch sees (compute capability 9.0 -> 90a, 10.0 -> 100a, others their sm_XY);
                          no GPU: a CPU-only build (the summary's "note" line says so and how to build the kernels).
  CUTLASS_DIR             a CUTLASS checkout (its include/ is used) instead of the nvidia-cutlass wheel
  MAX_JOBS                parallel compile jobs (ninja; default min(cores, available memory GB // 4), at least 1:
                          nvcc on a CUTLASS file takes ~4 GB)
Probes the GPUs only for MOE_GRAPH_ARCHS=native; otherwise everything is decided from the environment and the
installed toolchain.

An unchanged rebuild touches nothing: the library is relinked only when an object or the link command changed, and
`build_ext --inplace` replaces python/moe_graph/_C*.so (atomically: a process that loaded the old file keeps it)
only when the built file differs.

The per-architecture CUTLASS files are compiled by a small ninja file of their own (build/arch_objects/), with
`--resource-usage`; the build log ends with a table of the grouped GEMM kernels' registers, stack, local memory
(spills) and shared memory. The C++ host code of the grouped GEMM's launch logic is compiled with the CuTe headers
whenever they and the CUDA headers are found (also in CPU-only builds), so CPU tests can check it.
"""

import filecmp
import glob
import os
import re
import shlex
import shutil
import subprocess
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


def _cuda_header_dirs(cuda_home):
    """CUDA runtime headers and libcu++ (cuda/std/..., under include/cccl since CUDA 13) for host compilers."""
    if not cuda_home:
        return []
    inc = os.path.join(cuda_home, "include")
    if not os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")):
        return []
    dirs = [inc]
    if os.path.isdir(os.path.join(inc, "cccl", "cuda", "std")):
        dirs.append(os.path.join(inc, "cccl"))
    return dirs


def _arch_of_source(src):
    m = re.search(r"_sm(\d+)\.cu$", src)
    return int(m.group(1)) if m else None


def _arch_family(a):
    return int(re.match(r"\d+", a).group()) // 10


def _torch_cxx_std():
    """The -std= torch's BuildExtension gives the extension's other sources (C++17 up to torch 2.1x, C++20 after;
    read from its cpp_extension module, which appends the flag when none is given). The per-arch objects use the
    same, so that every object of the .so sees one language standard."""
    import inspect

    from torch.utils import cpp_extension

    try:
        src = inspect.getsource(cpp_extension)
    except (OSError, TypeError):
        return "-std=c++17"
    return "-std=c++20" if "'-std=c++20'" in src else "-std=c++17"


def _host_compiler_flags():
    """-ccbin $CC, as torch passes it to nvcc for the other .cu files (torch.utils.cpp_extension: CC, when set, is
    nvcc's host compiler): every object of the .so from one host compiler (and one libstdc++'s headers)."""
    cc = os.environ.get("CC")
    return ["-ccbin", cc] if cc else []


# libstdc++ linked dynamically, whatever the compiler driver adds: a driver that links it statically
# (-static-libstdc++, as a wrapper compiler on one GPU machine did) puts a second copy of the iostream / locale code
# in the .so beside the process's own (torch's), and the first number written into an error message crashed
# (std::basic_ostream::_M_insert<long> of the copy calling into the other copy's locale facets). An explicit
# -lstdc++ before the driver's implicit one resolves every reference to the shared library.
LINK_LIBSTDCXX = ["-Wl,-Bdynamic", "-lstdc++"]
# A symbol the static libstdc++ defines and the shared one only exports: defined in the .so = a static copy.
STATIC_LIBSTDCXX_PROBE = "_ZNSo9_M_insertIlEERSoT_"  # std::basic_ostream<char>::_M_insert<long>


def static_libstdcxx_copy(library: str):
    """True when ``library`` defines libstdc++'s own symbols (a static copy), False when not, None when ``nm`` is
    missing or cannot read it."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    p = subprocess.run([nm, "-D", "--defined-only", library], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True)
    if p.returncode != 0:
        return None
    return any(line.split()[-1] == STATIC_LIBSTDCXX_PROBE for line in p.stdout.splitlines() if line.strip())


def _compile_arch_objects(sources, archs, nvcc, flags, build_dir, jobs):
    """Compiles each *_smXX.cu with only the -gencode of its architecture family (ninja, incremental through
    depfiles); returns (objects, ptxas resource-usage lines)."""
    os.makedirs(build_dir, exist_ok=True)
    lines = ["ninja_required_version = 1.3", f"nvcc = {nvcc}", "rule nvcc_arch",
             "  command = $nvcc -MD -MF $out.d $flags -c $in -o $out", "  depfile = $out.d", "  deps = gcc", ""]
    objects = []
    for src in sources:
        fam = _arch_of_source(src) // 10
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if _arch_family(a) == fam]
        obj = os.path.join(build_dir, os.path.basename(src)[:-3] + ".o")
        objects.append(obj)
        lines += [f"build {obj}: nvcc_arch {os.path.abspath(src)}",
                  "  flags = " + " ".join(shlex.quote(f) for f in flags + gencode), ""]
    ninja_file = os.path.join(build_dir, "build.ninja")
    text = "\n".join(lines) + "\n"
    if not os.path.exists(ninja_file) or open(ninja_file).read() != text:
        with open(ninja_file, "w") as f:
            f.write(text)
    proc = subprocess.run(["ninja", "-f", ninja_file, "-j", str(jobs)], cwd=build_dir, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        sys.exit("moe_graph build: compiling the per-architecture CUDA sources failed (see above)")
    return objects, proc.stdout


def _resource_table(ptxas_out):
    """One line per grouped GEMM kernel from `ptxas --resource-usage` output: arch, configuration, kind, element
    type, registers, stack frame and spill bytes (read from the mangled names: c++filt gives up on them), and one
    summary line for the small kernels."""
    rows, others = [], []
    pat = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'\n(?:.*\n)*?\s*(\d+) bytes stack frame, "
                     r"(\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers")
    for m in pat.finditer(ptxas_out):
        name, arch, stack, st, ld, regs = m.groups()
        spill = int(st) + int(ld)
        if not name.startswith("_ZN7cutlass13device_kernel"):
            others.append((int(regs), int(stack), spill))
            continue
        if "FP8Blockwise" in name:
            cfg = "fp8 blockwise 128x128"
        elif "Mxf8f6f4" in name or "BlockScaled" in name:
            cfg = "mxfp8 1sm 128x128"
        elif "Cooperative" in name:
            cfg = "cooperative 128x256"
        elif "Pingpong" in name:
            cfg = "pingpong 64x128"
        else:
            mn = re.search(r"SM100_MMA_F16BF16_(2x1SM_)?SS\w*?fLi(\d+)ELi(\d+)E", name)
            cfg = (("2sm " if mn.group(1) else "1sm ") + f"{mn.group(2)}x{mn.group(3)}") if mn else "?"
        lin = re.search(r"LinearCombinationI(f|\w+?_)f(v|f|\w+?_)f", name)
        if "RowBroadcast" in name:
            kind = "forward (bias fused)"
        elif lin:
            kind = "wgrad " + ("fp32" if lin.group(1) == "f" else "16-bit") + (
                " overwrite" if lin.group(2) == "v" else " accumulate")
        else:
            kind = "?"
        elem = "e4m3" if "float_e4m3_t" in name else "bf16" if name.find("bfloat16_t") != -1 and (name.find("half_t") == -1 or
                                                           name.find("bfloat16_t") < name.find("half_t")) else "fp16"
        rows.append(f"  {arch:8s} {cfg:20s} {kind:24s} {elem:5s} regs {regs:>3s}  stack {stack:>3s}  spill {spill}")
    rows = sorted(rows)
    if others:
        rows.append(f"  + {len(others)} argument/helper kernels: regs <= {max(r for r, _, _ in others)}, "
                    f"stack <= {max(s for _, s, _ in others)}, spill bytes {sum(x for _, _, x in others)}")
    return rows


# the CUTLASS kernels use architecture-specific features (wgmma, tcgen05): those parts build for their "a" target
_ARCH_SPECIFIC = {(9, 0): "90a", (10, 0): "100a"}
CI_HOWTO = "MOE_GRAPH_CUDA=1 bash scripts/setup.sh builds every CUDA kernel for sm_90a and sm_100a, as CI does"


def arch_for_capability(major, minor):
    """The MOE_GRAPH_ARCHS entry for a GPU of compute capability ``major.minor``: 9.0 -> 90a, 10.0 -> 100a, else XY."""
    return _ARCH_SPECIFIC.get((major, minor), f"{major}{minor}")


def _native_archs():
    """The architectures of the GPUs torch sees (sorted, once each); empty without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return []
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return [arch_for_capability(*c) for c in sorted(caps)]


def default_max_jobs(cores, mem_bytes):
    """Parallel compile jobs: one per core, at most one per 4 GB of memory (nvcc on a CUTLASS file), at least 1."""
    return max(1, min(cores, mem_bytes // (4 << 30)))


def _available_memory():
    try:
        with open("/proc/meminfo") as f:
            return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _archs(raw):
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
    raw_archs, note = os.environ.get("MOE_GRAPH_ARCHS") or "90a;100a", None
    if raw_archs.strip() == "native":
        raw_archs = ";".join(_native_archs())
        if not raw_archs and want_cuda:
            sys.exit("moe_graph build: MOE_GRAPH_CUDA=1 with MOE_GRAPH_ARCHS=native, but torch sees no GPU "
                     "(name the targets, e.g. MOE_GRAPH_ARCHS='90a;100a')")
        if not raw_archs:
            want_cuda, note = False, f"torch sees no GPU here: CPU extension only ({CI_HOWTO})"
    use_cuda = can_cuda if want_cuda is None else (want_cuda and can_cuda)
    archs = _archs(raw_archs) if use_cuda else []
    if not os.environ.get("MAX_JOBS"):  # torch's ninja build and the per-arch ninja file read it
        os.environ["MAX_JOBS"] = str(default_max_jobs(len(os.sched_getaffinity(0)), _available_memory()))

    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)) if use_cuda else []

    # Per-arch files: *_sm90.cu for 9x, *_sm100.cu for 10x (compiled apart, for their own family only); a file
    # whose arch is not built is dropped.
    arch_sources = [s for s in cu_sources
                    if _arch_of_source(s) and any(_arch_family(a) == _arch_of_source(s) // 10 for a in archs)]
    cu_sources = [s for s in cu_sources if not _arch_of_source(s)]

    # -g0: Python's CFLAGS carry -g; debug info triples the compile time of a torch-heavy file (34 s -> 12 s of CPU
    # for csrc/common/error_flag.cpp) and was never used
    cxx = ["-O3", "-DNDEBUG", "-g0"]
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
        # No --use_fast_math: it flushes fp32 denormals (-ftz=true) in the CUTLASS epilogues (bias add, main_grad
        # accumulation) and the bias-gradient sums, where the CPU implementation keeps them.
    ]
    if use_cuda:
        define.append("-DMOE_GRAPH_WITH_CUDA")
        include_dirs += cutlass_inc
        cxx += [f"-idirafter{d}" for d in _cuda_include_dirs()]
        for a in archs:
            nvcc.append(f"-gencode=arch=compute_{a},code=sm_{a}")
            define.append(f"-DMOE_GRAPH_BUILD_SM{_arch_family(a) * 10}")
    # Host-side CuTe for the launch-logic tests (grouped_probe.cpp), in CPU-only builds too.
    cute_dirs = []
    if cutlass_inc is not None:
        cute_dirs = _cuda_header_dirs(ce.CUDA_HOME)
        if cute_dirs:
            define.append("-DMOE_GRAPH_HAVE_CUTE")
            include_dirs += [d for d in cutlass_inc if d not in include_dirs]
            cxx += [f"-idirafter{d}" for d in cute_dirs]
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
    print(f"  sources        {len(cpp_sources)} C++, {len(cu_sources)} CUDA, {len(arch_sources)} per-arch CUDA")
    print(f"  host CuTe      {'ON (launch-logic tests)' if cute_dirs else 'OFF (no CUTLASS or CUDA headers)'}")
    print(f"  MAX_JOBS       {os.environ['MAX_JOBS']}")
    if note:
        print(f"  note           {note}")
    print("=" * 72)

    Ext = ce.CUDAExtension if use_cuda else ce.CppExtension
    ext = Ext(
        name="moe_graph._C",
        sources=cpp_sources + cu_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc} if use_cuda else {"cxx": cxx},
        extra_link_args=LINK_LIBSTDCXX if sys.platform.startswith("linux") else [],
        py_limited_api=False,
    )
    base = ce.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        def build_extensions(self):
            if arch_sources:
                # The flags torch's ninja build gives every .cu, without the -gencode list (added per file).
                flags = [f for f in nvcc if not f.startswith("-gencode")] + list(ce.COMMON_NVCC_FLAGS)
                flags += ["--compiler-options", "-fPIC", "--resource-usage", "-DTORCH_API_INCLUDE_EXTENSION_H",
                          "-DTORCH_EXTENSION_NAME=_C", _torch_cxx_std()] + _host_compiler_flags()
                flags += [f"-I{os.path.abspath(d)}" for d in include_dirs + ce.include_paths(device_type="cuda")]
                objs, out = _compile_arch_objects(
                    arch_sources, archs, os.path.join(ce.CUDA_HOME, "bin", "nvcc"), flags,
                    os.path.join(os.path.abspath(self.build_temp), "arch_objects"),
                    int(os.environ["MAX_JOBS"]))
                for e in self.extensions:
                    e.extra_objects = list(e.extra_objects or []) + objs
                    e.depends = list(e.depends or []) + objs  # relink when only a per-arch object changed
                table = _resource_table(out)
                print("=" * 72)
                print("moe_graph grouped GEMM kernels: ptxas resource usage (LOCAL > 0 means spills; empty when "
                      "the objects were up to date)")
                for row in table:
                    print(row)
                print("=" * 72, flush=True)
            super().build_extensions()

        def build_extension(self, ext):
            # torch's ninja build forces build_extension (ninja compiles incrementally) and so relinks every time;
            # link only when an object is newer than the library or the link command changed (a stamp beside it).
            link = self.compiler.link_shared_object

            def link_if_changed(objects, output, *args, **kwargs):
                stamp, cmd = output + ".link", repr((sorted(objects), args, sorted(kwargs.items())))
                if (os.path.exists(output) and os.path.exists(stamp) and open(stamp).read() == cmd
                        and all(os.path.getmtime(o) <= os.path.getmtime(output) for o in objects)):
                    print(f"moe_graph build: {os.path.basename(output)} up to date (not relinked)", flush=True)
                    return
                link(objects, output, *args, **kwargs)
                if static_libstdcxx_copy(output):
                    os.remove(output)
                    sys.exit(f"moe_graph build: {output} contains a static copy of libstdc++ (the compiler driver "
                             f"links it statically despite {' '.join(LINK_LIBSTDCXX)}); it would crash beside "
                             "torch's libstdc++. Build with a compiler that links libstdc++ dynamically (CXX/CC).")
                with open(stamp, "w") as f:
                    f.write(cmd)

            self.compiler.link_shared_object = link_if_changed
            try:
                super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link

        def copy_extensions_to_source(self):
            # --inplace: setuptools rewrites the file in place on every build (a process that loaded it sees it
            # change under it); replace it by a rename, and only when the built library differs.
            build_py = self.get_finalized_command("build_py")
            for e in self.extensions:
                inplace, built = self._get_inplace_equivalent(build_py, e)
                if os.path.exists(inplace) and filecmp.cmp(built, inplace, shallow=False):
                    continue
                shutil.copy2(built, inplace + ".tmp")
                os.replace(inplace + ".tmp", inplace)
                print(f"moe_graph build: installed {inplace}", flush=True)

    setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__ too; tests import its helpers
    main()
