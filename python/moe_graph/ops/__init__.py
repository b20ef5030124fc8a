"""moe_graph ops: thin wrappers over ``torch.ops.moe_graph.*`` (one module per op family)."""

from .grouped_gemm import check_errors, gmm, grouped_bias_grad, grouped_gemm, grouped_gemm_wgrad, read_error_flag

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "grouped_bias_grad", "gmm", "check_errors", "read_error_flag"]

try:  # token rerouting (echo experts)
    from .reroute import reroute_tokens  # noqa: F401

    __all__.append("reroute_tokens")
except ImportError:  # pragma: no cover - only while the reroute op is not part of the build
    pass
