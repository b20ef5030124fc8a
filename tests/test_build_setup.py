"""The build's decisions that need no compiler (setup.py's helpers, imported without running the build): which GPU
targets a first run builds for, and how many compile jobs it starts."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("moe_graph_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines the helpers; the build runs only as __main__
    return mod


@pytest.mark.parametrize("cap, arch", [((9, 0), "90a"), ((10, 0), "100a"), ((8, 0), "80"), ((8, 9), "89"),
                                       ((12, 0), "120")])
def test_native_arch_of_a_compute_capability(setup_py, cap, arch):
    assert setup_py.arch_for_capability(*cap) == arch
    assert setup_py._archs(arch) == [arch]  # a valid MOE_GRAPH_ARCHS entry


@pytest.mark.parametrize("cores, gb, jobs", [(2, 23, 2), (64, 64, 16), (8, 3, 1), (1, 100, 1), (16, 128, 16)])
def test_max_jobs_from_cores_and_memory(setup_py, cores, gb, jobs):
    assert setup_py.default_max_jobs(cores, gb << 30) == jobs


def _summary(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("MOE_GRAPH_CUDA", "MOE_GRAPH_ARCHS", "MAX_JOBS")}
    full.update(env)
    # --name: setup.py decides everything and prints its summary, then setuptools prints the name (nothing is built)
    p = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_native_builds_for_the_gpus_present_or_cpu_only():
    # scripts/setup.sh's first run (MOE_GRAPH_CUDA unset) passes MOE_GRAPH_ARCHS=native
    import torch

    out = _summary(MOE_GRAPH_ARCHS="native")
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        want = ";".join({(9, 0): "90a", (10, 0): "100a"}.get(c, f"{c[0]}{c[1]}") for c in caps)
        assert re.search(rf"archs\s+{re.escape(want)}\n", out), out
    else:
        assert re.search(r"CUDA kernels\s+OFF", out) and "torch sees no GPU here: CPU extension only" in out, out
        assert "MOE_GRAPH_CUDA=1 bash scripts/setup.sh" in out, out
    assert re.search(r"MAX_JOBS\s+[1-9]", out), out


def test_ci_builds_both_architectures():
    import torch
    from torch.utils import cpp_extension as ce

    if torch.version.cuda is None or ce.CUDA_HOME is None:
        pytest.skip("no CUDA toolchain: MOE_GRAPH_CUDA=1 cannot build here")
    out = _summary(MOE_GRAPH_CUDA="1")
    assert re.search(r"CUDA kernels\s+ON", out) and re.search(r"archs\s+90a;100a\n", out), out
    out = _summary(MOE_GRAPH_CUDA="1", MOE_GRAPH_ARCHS="100a")  # an explicit list wins
    assert re.search(r"archs\s+100a\n", out), out


def _torch_cuda_flags(tmp_path, cc):
    """The flags torch's own BuildExtension gives a .cu file of an extension (its ninja writer intercepted: nothing
    is compiled), in a child process so that the environment and the patch stay there."""
    code = f"""
import os, sys
import torch.utils.cpp_extension as ce
from setuptools import setup
seen = {{}}
def capture(sources, objects, cflags, post_cflags, cuda_cflags, cuda_post_cflags, *a, **k):
    print(repr(cuda_post_cflags))
    raise SystemExit(0)
ce._write_ninja_file_and_compile_objects = capture
os.chdir({str(tmp_path)!r})
open("a.cpp", "w").write("int a() {{ return 0; }}\\n")
open("b.cu", "w").write("int b() {{ return 0; }}\\n")
setup(name="x", ext_modules=[ce.CUDAExtension("x", ["a.cpp", "b.cu"])], cmdclass={{"build_ext": ce.BuildExtension}},
      script_args=["build_ext", "--build-temp", "t"])
"""
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    if cc:
        env["CC"] = cc
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return eval(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cc", [None, "/usr/bin/gcc"])
def test_per_arch_objects_get_the_std_and_host_compiler_torch_gives_the_other_cu_files(setup_py, tmp_path,
                                                                                     monkeypatch, cc):
    from torch.utils import cpp_extension as ce

    if ce.CUDA_HOME is None:
        pytest.skip("no CUDA toolkit: torch's CUDAExtension cannot be set up")
    flags = _torch_cuda_flags(tmp_path, cc)
    std = [f for f in flags if f.startswith("-std=")]
    assert std and setup_py._torch_cxx_std() == std[-1]
    if cc:
        monkeypatch.setenv("CC", cc)
        i = flags.index("-ccbin")
        assert flags[i:i + 2] == setup_py._host_compiler_flags() == ["-ccbin", cc]
    else:
        monkeypatch.delenv("CC", raising=False)
        assert "-ccbin" not in flags and setup_py._host_compiler_flags() == []


def _shared_lib(tmp_path, name, flags):
    src = tmp_path / "so.cpp"
    src.write_text("#include <sstream>\n#include <string>\n"
                   "std::string f(long x) { std::ostringstream os; os << x; return os.str(); }\n")
    out = tmp_path / f"{name}.so"
    p = subprocess.run(["g++", "-shared", "-fPIC", "-O2", str(src), "-o", str(out)] + flags, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return str(out)


def test_link_flags_keep_libstdcxx_shared_under_a_driver_that_links_it_statically(setup_py, tmp_path):
    import shutil

    if shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.skip("needs g++ and nm")
    # a driver adding -static-libstdc++ (as a wrapper compiler did): the copy is detected ...
    assert setup_py.static_libstdcxx_copy(_shared_lib(tmp_path, "static", ["-static-libstdc++"])) is True
    # ... and the extension's link flags keep libstdc++ shared even then
    assert setup_py.static_libstdcxx_copy(
        _shared_lib(tmp_path, "fixed", setup_py.LINK_LIBSTDCXX + ["-static-libstdc++"])) is False
    assert setup_py.static_libstdcxx_copy(_shared_lib(tmp_path, "plain", [])) is False


def test_the_built_extension_has_no_static_libstdcxx(setup_py):
    import glob

    libs = glob.glob(os.path.join(ROOT, "python", "moe_graph", "_C*.so"))
    if not libs:
        pytest.skip("the extension is not built")
    for lib in libs:
        found = setup_py.static_libstdcxx_copy(lib)
        if found is None:
            pytest.skip("nm cannot read the extension")
        assert found is False, lib
