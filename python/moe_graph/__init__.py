"""moe_graph: Mixture-of-Experts training as one CUDA graph per iteration, with zero host-device syncs.

The public face: the sync-free grouped GEMM ops (``grouped_gemm``, ``grouped_gemm_wgrad``, ``gmm``,
``check_errors``) and ``GroupedLinear`` (TransformerEngine's drop-in). The layers below them, lowest first:
``ops`` (the compiled extension), ``parallel_state`` and ``cuda_graph``, ``grouped_linear``, ``distributed``
(buffers, DDP, ZeRO-1, launch) and ``moe`` (router, dispatcher, echo, experts, layer), ``train`` (pipeline
schedules, the training step, checkpoints), then ``integrations`` and the ``demo``. Every module imports without
a built extension; the grouped-GEMM entry points then raise an ``ImportError`` that says how to build.
``moe_graph.fp8``: FP8 recipes, ``autocast(recipe=...)``, the quantizers and scaled grouped GEMMs.

``import moe_graph`` itself imports neither torch nor the extension: the names below are looked up on first use
(PEP 562), so that a command (``python -m moe_graph.demo``) checks its flags before the heavy imports.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_PUBLIC = {"GroupedLinear": "moe_graph.grouped_linear", "check_errors": "moe_graph.ops", "gmm": "moe_graph.ops",
           "grouped_gemm": "moe_graph.ops", "grouped_gemm_wgrad": "moe_graph.ops", "reroute_tokens": "moe_graph.ops",
           "fp8": None}  # None: a submodule

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from moe_graph import fp8  # noqa: F401
    from moe_graph.grouped_linear import GroupedLinear  # noqa: F401
    from moe_graph.ops import check_errors, gmm, grouped_gemm, grouped_gemm_wgrad, reroute_tokens  # noqa: F401


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'moe_graph' has no attribute {name!r}")
    module = _PUBLIC[name]
    value = importlib.import_module(f"moe_graph.{name}") if module is None else getattr(
        importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
