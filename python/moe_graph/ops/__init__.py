"""moe_graph ops: thin wrappers over ``torch.ops.moe_graph.*`` (one module per op family)."""

from moe_graph.ops.activation import expert_activation
from moe_graph.ops import fp8
from moe_graph.ops.errors import check_errors, flag_error_if, read_error_flag
from moe_graph.ops.grouped_gemm import gmm, grouped_bias_grad, grouped_gemm, grouped_gemm_wgrad
from moe_graph.ops.permute import expand_rows, reduce_rows
from moe_graph.ops.reroute import reroute_indices, reroute_tokens

__all__ = [
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "grouped_bias_grad",
    "gmm",
    "check_errors",
    "read_error_flag",
    "flag_error_if",
    "reroute_tokens",
    "reroute_indices",
    "expand_rows",
    "reduce_rows",
    "expert_activation",
    "fp8",
]
