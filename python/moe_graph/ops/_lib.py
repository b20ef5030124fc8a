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



def available() -> bool:
    """True when ``moe_graph._C`` is loaded."""
    return LOAD_ERROR is None


def require() -> None:
    """Raise a clear ``ImportError`` when ``moe_graph._C`` is not built."""
    if LOAD_ERROR is not None:
        raise ImportError("moe_graph._C is not built: run `bash scripts/setup.sh` in the checkout, or install with "
                          f"`pip install --no-build-isolation -e .` (see README.md); original error: {LOAD_ERROR}")


class _NotBuilt:
    """``ops`` without a build: naming any op raises :func:`require`'s ImportError (not torch's AttributeError)."""

    def __getattr__(self, name):
        require()


# torch.ops.moe_graph.<op>: the native ops (every caller goes through this name)
ops = torch.ops.moe_graph if available() else _NotBuilt()


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
