"""Sync-free grouped GEMM: thin wrappers over ``torch.ops.moe_graph.*``, fake (meta) impls and autograd.

Rows of ``a`` are grouped by expert in expert order; ``m_splits[e]`` rows belong to expert ``e``. ``m_splits`` is
an int32/int64 tensor on ``a.device`` (a device tensor: the host never reads it, so nothing syncs) or a Python
list (copied to the device). Buffers may hold more rows than ``sum(m_splits)`` (static capacity for CUDA graphs):
those output rows are zero. A sum larger than the buffer sets the device error flag (``check_errors()``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ._lib import ops

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "gmm", "grouped_bias_grad"]


# ----------------------------------------------------------------------------------------------- fake impls --
@torch.library.register_fake("moe_graph::grouped_gemm")
def _(a, b, m_splits, trans_b, bias):
    n = (b[0].shape[1] if trans_b else b[0].shape[2]) if (len(b) == 1 and b[0].dim() == 3) else (
        b[0].shape[0] if trans_b else b[0].shape[1]
    )
    return a.new_empty((a.shape[0], n))


@torch.library.register_fake("moe_graph::grouped_gemm_out")
def _(a, b, m_splits, trans_b, bias, out):
    return None


@torch.library.register_fake("moe_graph::grouped_gemm_wgrad")
def _(a, dy, m_splits, out_dtype):
    return a.new_empty((m_splits.shape[0], dy.shape[1], a.shape[1]), dtype=out_dtype or a.dtype)


@torch.library.register_fake("moe_graph::grouped_gemm_wgrad_out")
def _(a, dy, m_splits, out, accumulate, accumulate_mask):
    return None


@torch.library.register_fake("moe_graph::grouped_bias_grad")
def _(dy, m_splits):
    return dy.new_empty((m_splits.shape[0], dy.shape[1]), dtype=torch.float64 if dy.dtype == torch.float64 else torch.float32)


# ---------------------------------------------------------------------------------------------- utilities --
def _as_splits(m_splits, device: torch.device) -> torch.Tensor:
    """A device tensor is used as is (no copy, no sync). A list/tuple (TransformerEngine's API) is copied to
    ``device`` from pinned memory without blocking the host; it cannot be captured in a CUDA graph (its values
    would be frozen into the graph), so pass a device tensor there."""
    if isinstance(m_splits, torch.Tensor):
        return m_splits
    if isinstance(m_splits, (list, tuple)):
        host = torch.tensor([int(x) for x in m_splits], dtype=torch.int64)
        if device.type != "cuda":
            return host.to(device)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "moe_graph: m_splits given as a Python list inside CUDA graph capture; its values would be frozen "
                "into the graph. Pass the per-expert counts as a device tensor (e.g. from the router) instead.")
        return host.pin_memory().to(device, non_blocking=True)
    raise TypeError(f"m_splits must be a tensor or a list of ints, got {type(m_splits).__name__}")


def _as_list(t: TensorOrList, name: str) -> List[torch.Tensor]:
    if isinstance(t, torch.Tensor):
        return [t]
    if isinstance(t, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in t):
        return list(t)
    raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(t).__name__}")


def _stack_bias(bias) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        return bias
    return torch.stack(list(bias))


_DUMMY_WGRAD: dict = {}


def _dummy_wgrad(w: torch.Tensor) -> torch.Tensor:
    """Zero gradient returned for weights whose gradient already went into ``main_grad`` (as TE does), so that
    grad-accumulation hooks still fire; cached per (shape, dtype, device)."""
    key = (tuple(w.shape), w.dtype, w.device)
    t = _DUMMY_WGRAD.get(key)
    if t is None:
        t = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        _DUMMY_WGRAD[key] = t
    return t


# ------------------------------------------------------------------------------------------------ autograd --
class _GroupedGemmFn(torch.autograd.Function):
    """y = grouped(a @ W_e^T or a @ W_e) + bias_e; backward: dgrad and wgrad through the sync-free kernels.

    ``fuse_main_grad``: the weights' gradients are accumulated in place into ``w.main_grad`` (fp32 or the
    weight dtype) inside the GEMM epilogue; ``w.grad_added_to_main_grad`` is set and a dummy zero grad returned.
    """

    @staticmethod
    def forward(ctx, a, m_splits, trans_b, bias, fuse_main_grad, *weights):
        out = ops.grouped_gemm(a, list(weights), m_splits, trans_b, bias)
        ctx.trans_b = trans_b
        ctx.fuse_main_grad = fuse_main_grad
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.num_weights = len(weights)
        ctx.save_for_backward(a, m_splits, *weights)
        return out

    @staticmethod
    def backward(ctx, dy):
        a, m_splits, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        da = dw = db = None
        if ctx.needs_input_grad[0]:
            da = ops.grouped_gemm(dy, weights, m_splits, not ctx.trans_b, None)
        w_grads = [None] * len(weights)
        if any(ctx.needs_input_grad[5:]):
            # trans_b: dW_e = dy_e^T a_e ([N, K]); else dW_e = a_e^T dy_e ([K, N]).
            lhs, rhs = (a, dy) if ctx.trans_b else (dy, a)
            if ctx.fuse_main_grad:
                main_grads = [w.main_grad for w in weights]
                ops.grouped_gemm_wgrad_out(lhs, rhs, m_splits, main_grads, True, None)
                for w in weights:
                    w.grad_added_to_main_grad = True
                w_grads = [_dummy_wgrad(w) for w in weights]
            else:
                dw = ops.grouped_gemm_wgrad(lhs, rhs, m_splits, None)
                if len(weights) == 1 and weights[0].dim() == 3:
                    w_grads = [dw]
                else:
                    w_grads = list(dw.unbind(0))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = ops.grouped_bias_grad(dy, m_splits).to(ctx.bias_dtype)
        return (da, None, None, db, None, *w_grads)


# ------------------------------------------------------------------------------------------------ public ops --
def grouped_gemm(
    a: torch.Tensor,
    b: TensorOrList,
    m_splits,
    *,
    trans_b: bool = True,
    bias: Optional[TensorOrList] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Grouped ``a_e @ b_e^T`` (``trans_b=True``, b ``[E, N, K]``) or ``a_e @ b_e`` (b ``[E, K, N]``).

    Args:
        a: ``[M, K]`` bf16/fp16 (CPU also fp32/fp64). Rows grouped by expert.
        b: ``[E, N, K]`` / ``[E, K, N]`` tensor or a list of E 2-D tensors (one parameter per expert).
        m_splits: int32/int64 ``[E]`` on ``a.device`` (zero syncs) or a Python list.
        bias: ``[E, N]`` or a list of E ``[N]`` tensors, added to each expert's rows.
        out: optional preallocated ``[M, N]`` (no autograd through ``out=``).

    Returns ``[M, N]``; rows past ``sum(m_splits)`` are zero.

    Example::

        >>> a = torch.randn(6, 4); w = torch.randn(2, 3, 4)
        >>> y = grouped_gemm(a, w, [2, 3])    # rows 0-1 use w[0], rows 2-4 use w[1], row 5 is zero
    """
    weights = _as_list(b, "b")
    splits = _as_splits(m_splits, a.device)
    bias_t = _stack_bias(bias)
    if out is not None:
        if torch.is_grad_enabled() and (a.requires_grad or any(w.requires_grad for w in weights)):
            raise RuntimeError("grouped_gemm: out= does not support autograd; call without out= to get gradients")
        ops.grouped_gemm_out(a, weights, splits, trans_b, bias_t, out)
        return out
    needs_grad = torch.is_grad_enabled() and (
        a.requires_grad or any(w.requires_grad for w in weights) or (bias_t is not None and bias_t.requires_grad)
    )
    if not needs_grad:
        return ops.grouped_gemm(a, weights, splits, trans_b, bias_t)
    return _GroupedGemmFn.apply(a, splits, trans_b, bias_t, False, *weights)


def grouped_gemm_wgrad(
    a: torch.Tensor,
    dy: torch.Tensor,
    m_splits,
    *,
    out: Optional[TensorOrList] = None,
    accumulate: Union[bool, torch.Tensor] = False,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Per-expert weight gradient ``dW_e = dy_e^T @ a_e``, shape ``[E, N, K]`` (matches ``b`` with trans_b=True).

    Args:
        a: ``[M, K]`` layer input; dy: ``[M, N]`` output gradient (same dtype).
        out: optional ``[E, N, K]`` tensor or list of E ``[N, K]`` tensors, fp32 (a ``main_grad``) or a's dtype.
        accumulate: bool, or a bool tensor ``[E]`` on the device: per expert, add into ``out`` (true) or
            overwrite it (false). Experts without tokens get zeros, or stay unchanged when accumulating.

    Returns ``out`` (or a new ``[E, N, K]`` tensor in a's dtype).
    """
    splits = _as_splits(m_splits, a.device)
    if out is None:
        if isinstance(accumulate, torch.Tensor) or accumulate:
            raise ValueError("grouped_gemm_wgrad: accumulate needs out= (the tensor to accumulate into)")
        return ops.grouped_gemm_wgrad(a, dy, splits, None)
    outs = _as_list(out, "out")
    if isinstance(accumulate, torch.Tensor):
        ops.grouped_gemm_wgrad_out(a, dy, splits, outs, False, accumulate)
    else:
        ops.grouped_gemm_wgrad_out(a, dy, splits, outs, bool(accumulate), None)
    return out


def grouped_bias_grad(dy: torch.Tensor, m_splits) -> torch.Tensor:
    """``db[e] = sum of dy rows of expert e`` -> ``[E, N]`` fp32 (fp64 for fp64 input)."""
    return ops.grouped_bias_grad(dy, _as_splits(m_splits, dy.device))


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """Drop-in for the ``grouped_gemm`` package's ``ops.gmm`` (used by Megatron's GroupedMLP), with autograd.

    ``b`` is ``[E, K, N]`` (``trans_b=False``) or ``[E, N, K]`` (``trans_b=True``); ``batch_sizes`` is the number
    of rows per expert (a CPU tensor as in that package, a device tensor, or a list).
    """
    if isinstance(batch_sizes, torch.Tensor) and batch_sizes.device.type == "cpu" and a.device.type != "cpu":
        batch_sizes = batch_sizes.tolist()  # host values (no device sync): copied like a list below
    return grouped_gemm(a, b, batch_sizes, trans_b=trans_b)
