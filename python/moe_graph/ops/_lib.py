"""Loading of the compiled extension ``moe_graph._C`` (which registers ``torch.ops.moe_graph.*``)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def load() -> None:
    try:
        from .. import _C  # noqa: F401  (import registers the ops)
    except ImportError as e:  # pragma: no cover - exercised only on broken installs
        raise ImportError(
            "moe_graph._C is not built. Install with `pip install --no-build-isolation -e .` "
            "(see README.md); original error: " + str(e)
        ) from e


def cuda_built() -> bool:
    """True when the extension has CUDA kernels registered (the CUDA build)."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key("moe_graph::grouped_gemm", "CUDA")


load()
ops = torch.ops.moe_graph
