"""moe_graph: Mixture-of-Experts training as one CUDA graph per iteration, with zero host-device syncs.

The public face: the sync-free grouped GEMM ops (``grouped_gemm``, ``grouped_gemm_wgrad``, ``gmm``,
``check_errors``) and ``GroupedLinear`` (TransformerEngine's drop-in). The layers below them, lowest first:
``ops`` (the compiled extension), ``parallel_state`` and ``cuda_graph``, ``grouped_linear``, ``distributed``
(buffers, DDP, ZeRO-1, launch) and ``moe`` (router, dispatcher, echo, experts, layer), ``train`` (pipeline
schedules, the training step, checkpoints), then ``integrations`` and the ``demo``. Every module imports without
a built extension; the grouped-GEMM entry points then raise an ``ImportError`` that says how to build.
``moe_graph.fp8`` (``ops.fp8``): FP8 recipes, ``autocast(recipe=...)``, the quantizers and scaled grouped GEMMs.
"""

from moe_graph.grouped_linear import GroupedLinear
from moe_graph.ops import check_errors, fp8, gmm, grouped_gemm, grouped_gemm_wgrad, reroute_tokens

__version__ = "0.1.0"

__all__ = ["GroupedLinear", "check_errors", "fp8", "gmm", "grouped_gemm", "grouped_gemm_wgrad", "reroute_tokens"]
