"""The one place that loads the compiled extension ``moe_graph._C`` (which registers ``torch.ops.moe_graph.*``) and
answers "does the loaded extension have a native kernel for this op on this device type?".

Importing this module never fails: without a built extension :func:`available` is False, the pure-torch paths
(planner, dispatcher, training machinery) still import and run, and the grouped-GEMM entry points raise the
``ImportError`` of :func:`require`, which says how to build.
"""

from __future__ import annotations

import functools

import torch

try:
    from moe_graph import _C  # noqa: F401  (importing registers the ops)

    LOAD_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only on installs without a build
    LOAD_ERROR = e

ops = torch.ops.moe_graph


def available() -> bool:
    """True when ``moe_graph._C`` is loaded."""
    return LOAD_ERROR is None


def require() -> None:
    """Raise a clear ``ImportError`` when ``moe_graph._C`` is not built."""
    if LOAD_ERROR is not None:
        raise ImportError("moe_graph._C is not built. Install with `pip install --no-build-isolation -e .` "
                          f"(see README.md); original error: {LOAD_ERROR}")


@functools.lru_cache(maxsize=None)
def has_kernel(op: str, device_type: str) -> bool:
    """True when the loaded extension registers ``op`` ("moe_graph::name") for ``device_type`` ("cpu"/"cuda").
    Decided once per (op, device type) for the process."""
    if not available():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, device_type.upper())
    except RuntimeError:  # the loaded extension predates the op
        return False


def cuda_built() -> bool:
    """True when the extension has CUDA kernels registered (the CUDA build)."""
    return has_kernel("moe_graph::grouped_gemm", "cuda")
