"""A fresh clone before the build: every module of the package imports without ``moe_graph._C`` (the promise of the
package's and ``ops/_lib.py``'s docstrings), ``import moe_graph`` imports no torch, the grouped GEMM then raises
the ``ImportError`` that says how to build, and ``moe_graph.fp8`` is a module of its own. Run in a clean interpreter
on a copy of the package without the compiled library."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import importlib, pkgutil, sys
import moe_graph
assert "torch" not in sys.modules, "import moe_graph imported torch"
failed = {}
for m in pkgutil.walk_packages(moe_graph.__path__, "moe_graph."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = repr(e)
assert "moe_graph._C" not in sys.modules
# the Megatron integrations need megatron-core (an optional dependency) and say so; nothing else may fail
optional = {k for k, v in failed.items() if k.startswith("moe_graph.integrations.megatron") and "megatron-core" in v}
assert set(failed) == optional, {k: failed[k] for k in set(failed) - optional}
import torch
try:
    moe_graph.grouped_gemm(torch.zeros(4, 8), torch.zeros(2, 8, 8), torch.tensor([2, 2]))
except ImportError as e:
    assert "moe_graph._C is not built" in str(e) and "pip install" in str(e), e
else:
    raise AssertionError("grouped_gemm ran without the extension")
from moe_graph.fp8 import autocast, Float8BlockScaling
import moe_graph.fp8, moe_graph.ops.fp8
assert autocast is moe_graph.ops.fp8.autocast and moe_graph.fp8.__all__ == moe_graph.ops.fp8.__all__
print("ok", len(failed))
"""


def test_every_module_imports_without_the_extension(tmp_path):
    shutil.copytree(os.path.join(ROOT, "python", "moe_graph"), tmp_path / "moe_graph",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    p = subprocess.run([sys.executable, "-c", _PROBE], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]


def test_fp8_is_a_module_with_the_ops_names():
    import moe_graph
    import moe_graph.fp8
    import moe_graph.ops.fp8 as ops_fp8
    from moe_graph.fp8 import autocast

    assert moe_graph.fp8 is sys.modules["moe_graph.fp8"] and autocast is ops_fp8.autocast
    assert all(getattr(moe_graph.fp8, n) is getattr(ops_fp8, n) for n in ops_fp8.__all__)
    assert moe_graph.GroupedLinear is sys.modules["moe_graph.grouped_linear"].GroupedLinear
