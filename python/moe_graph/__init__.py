"""moe_graph: sync-free grouped GEMM and MoE training machinery for one-CUDA-graph-per-iteration training.

The pure-Python training machinery (``parallel_state``, ``buffers``, ``optimizer``, ``pipeline``, ``planner``)
imports without the compiled extension; the grouped-GEMM ops and ``GroupedLinear`` need ``moe_graph._C``
and are loaded on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    # name -> module that defines it
    "grouped_gemm": "ops",
    "grouped_gemm_wgrad": "ops",
    "gmm": "ops",
    "check_errors": "ops",
    "reroute_tokens": "ops",
    "GroupedLinear": "grouped_linear",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'moe_graph' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
