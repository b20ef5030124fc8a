"""Sync-free grouped GEMM: thin wrappers over ``torch.ops.moe_graph.*``, fake (meta) impls and autograd.

Rows of ``a`` are grouped by expert in expert order; ``m_splits[e]`` rows belong to expert ``e``. ``m_splits`` is
an int32/int64 tensor on ``a.device`` (a device tensor: the host never reads it, so nothing syncs) or a Python
list (copied to the device). Buffers may hold more rows than ``sum(m_splits)`` (static capacity for CUDA graphs):
those output rows are zero. A sum larger than the buffer sets the device error flag (``check_errors()``).
"""

from __future__ import annotations

import operator
from typing import Callable, List, Optional, Sequence, Union

import torch

from moe_graph.ops._lib import available, ops, require

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = ["grouped_gemm", "grouped_gemm_wgrad", "gmm", "grouped_bias_grad", "grouped_gemm_autograd", "as_splits",
           "zero_wgrad_placeholder", "deferred_wgrad_placeholders", "is_zero_wgrad_placeholder", "resolve_main_grad", "has_main_grad_source"]


# ----------------------------------------------------------------------------------------------- fake impls --
if available():  # without a build the entry points raise require()'s ImportError

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
def _split_ints(m_splits) -> List[int]:
    """The entries of a list/tuple m_splits as Python ints: ints (and numpy / 0-d integer tensor ints) only; a
    float, bool or None is an error (never silently truncated)."""
    vals = []
    for i, x in enumerate(m_splits):
        if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
            raise TypeError(f"m_splits[{i}] must be an int (a token count), got bool {x!r}")
        try:
            v = operator.index(x)
        except TypeError:
            raise TypeError(
                f"m_splits[{i}] must be an int (a token count), got {type(x).__name__} {x!r}") from None
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"m_splits[{i}] = {v} does not fit in int64")
        vals.append(v)
    return vals


def as_splits(m_splits, device: torch.device) -> torch.Tensor:
    """A device tensor is used as is (no copy, no sync). A list/tuple (TransformerEngine's API) is copied to
    ``device`` from pinned memory without blocking the host; it cannot be captured in a CUDA graph (its values
    would be frozen into the graph), so pass a device tensor there."""
    if isinstance(m_splits, torch.Tensor):
        return m_splits
    if isinstance(m_splits, (list, tuple)):
        host = torch.tensor(_split_ints(m_splits), dtype=torch.int64)
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


_ZERO_WGRAD_PLACEHOLDERS: dict = {}


def deferred_wgrad_placeholders(params, fuse: bool) -> list:
    """What backward returns for weights whose gradient is deferred (``delay_wgrad_compute``: ``backward_dw`` computes
    it later): with ``fuse`` (into ``main_grad``) each weight is marked ``grad_added_to_main_grad`` and gets a
    :func:`zero_wgrad_placeholder`, else a zero-stride zero (the real gradient is added to ``.grad`` later)."""
    if fuse:
        for w in params:
            w.grad_added_to_main_grad = True
        return [zero_wgrad_placeholder(w) for w in params]
    return [w.new_zeros(()).expand(w.shape) for w in params]


def zero_wgrad_placeholder(w: torch.Tensor) -> torch.Tensor:
    """Zero placeholder gradient for a weight whose gradient already went (or will go) into ``main_grad``, so that
    autograd still runs the weight's grad-accumulation node and DDP's hooks fire (TransformerEngine does the same).

    A fresh ``detach()`` alias of one zero buffer cached per (shape, dtype, device): nothing else holds the
    returned tensor object, so autograd adopts it as ``w.grad`` instead of cloning a full-size zero per weight per
    microbatch, and no memory is allocated. Weights of one shape share the buffer, so ``w.grad`` of a fused weight
    is a placeholder (read ``main_grad``). If anything wrote into the buffer (its version counter moved), it is
    left to its holders and a new zero buffer is cached."""
    key = (tuple(w.shape), w.dtype, w.device)
    entry = _ZERO_WGRAD_PLACEHOLDERS.get(key)
    if entry is None or entry[0]._version != entry[1]:
        t = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        entry = (t, t._version)
        _ZERO_WGRAD_PLACEHOLDERS[key] = entry
    return entry[0].detach()


def is_zero_wgrad_placeholder(g: Optional[torch.Tensor]) -> bool:
    """Whether ``g`` is (an alias of) the cached zero placeholder, never written since it was handed out."""
    if g is None:
        return False
    entry = _ZERO_WGRAD_PLACEHOLDERS.get((tuple(g.shape), g.dtype, g.device))
    return entry is not None and g.data_ptr() == entry[0].data_ptr() and entry[0]._version == entry[1]


def resolve_main_grad(w: torch.Tensor) -> torch.Tensor:
    """``w.main_grad``, fetched lazily as TransformerEngine does: Megatron-FSDP parameters (``__fsdp_param__``)
    allocate it through ``w.get_main_grad()`` only before backward. The result is stored as ``w.main_grad``."""
    if hasattr(w, "__fsdp_param__") and callable(getattr(w, "get_main_grad", None)):
        w.main_grad = w.get_main_grad()
    mg = getattr(w, "main_grad", None)
    if mg is None:
        raise RuntimeError(
            "fused weight-gradient accumulation: a weight has no .main_grad (and no get_main_grad()) at backward; "
            "allocate it before backward (Megatron's DDP does)")
    return mg


def has_main_grad_source(w: torch.Tensor) -> bool:
    """A ``main_grad`` now, or a lazy ``get_main_grad()`` (Megatron-FSDP) that will provide one in backward."""
    return getattr(w, "main_grad", None) is not None or callable(getattr(w, "get_main_grad", None))


# ------------------------------------------------------------------------------------------------ autograd --
# Autograd is registered on the ops themselves (torch.library.register_autograd), so ``torch.ops.moe_graph.*``
# differentiate under eager, torch.compile and opcheck alike. The backward math of grouped_gemm lives in one
# place, ``_grouped_gemm_backward``; ``_GroupedGemmFn`` only adds the fused ``main_grad`` accumulation on top.


def _weight_grads(a, dy, m_splits, trans_b, weights, main_grads=None, accumulate=True):
    """Per-weight gradients of ``y = grouped(a @ W_e^T or a @ W_e)`` for output gradient ``dy`` (contiguous).

    With ``main_grads`` (one tensor per weight) they are written there in place, added (``accumulate``) or
    overwriting, and None is returned per weight; otherwise one gradient per weight in ``a``'s dtype."""
    # trans_b: dW_e = dy_e^T a_e ([N, K]); else dW_e = a_e^T dy_e ([K, N]).
    lhs, rhs = (a, dy) if trans_b else (dy, a)
    if main_grads is not None:
        ops.grouped_gemm_wgrad_out(lhs, rhs, m_splits, list(main_grads), bool(accumulate), None)
        return [None] * len(weights)
    dw = ops.grouped_gemm_wgrad(lhs, rhs, m_splits, None)
    return [dw] if (len(weights) == 1 and weights[0].dim() == 3) else list(dw.unbind(0))


def _grouped_gemm_backward(dy, a, weights, m_splits, trans_b, bias_dtype, need_a, need_w, need_bias, main_grads=None,
                           accumulate=True):
    """Gradients of ``y = grouped(a @ W_e^T or a @ W_e) + bias_e`` -> ``(da, [dW per weight], db)``.

    ``need_w``: one bool per weight (entries for False are None). ``main_grads``: one tensor per weight to
    accumulate (or, with ``accumulate=False``, write) the weight gradients into in place (fused path); then the
    returned weight grads are None."""
    dy = dy.contiguous()
    da = db = None
    w_grads = [None] * len(weights)
    if need_a:
        da = ops.grouped_gemm(dy, weights, m_splits, not trans_b, None)
    if any(need_w):
        parts = _weight_grads(a, dy, m_splits, trans_b, weights, main_grads, accumulate)
        w_grads = [g if n else None for g, n in zip(parts, need_w)]
    if need_bias:
        db = ops.grouped_bias_grad(dy, m_splits).to(bias_dtype)
    return da, w_grads, db


def _grouped_gemm_setup_context(ctx, inputs, output):
    a, b, m_splits, trans_b, bias = inputs
    ctx.trans_b = trans_b
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(a, m_splits, *b)


def _grouped_gemm_autograd_backward(ctx, dy):
    a, m_splits, *weights = ctx.saved_tensors
    need_a, need_w, _, _, need_bias = ctx.needs_input_grad  # need_w: one bool per tensor of b
    da, w_grads, db = _grouped_gemm_backward(
        dy, a, weights, m_splits, ctx.trans_b, ctx.bias_dtype, need_a, list(need_w), need_bias and ctx.bias_dtype is not None
    )
    return da, w_grads, None, None, db


def _wgrad_setup_context(ctx, inputs, output):
    a, dy, m_splits, out_dtype = inputs
    ctx.save_for_backward(a, dy, m_splits)


def _wgrad_autograd_backward(ctx, g):
    # dW_e = dy_e^T a_e with g = d(dW) [E, N, K]: da_e = dy_e g_e, ddy_e = a_e g_e^T (rows past the sum get 0).
    a, dy, m_splits = ctx.saved_tensors
    g = g.to(a.dtype).contiguous()
    da = ops.grouped_gemm(dy, [g], m_splits, False, None) if ctx.needs_input_grad[0] else None
    ddy = ops.grouped_gemm(a, [g], m_splits, True, None) if ctx.needs_input_grad[1] else None
    return da, ddy, None, None


def _expert_rows_broadcast(g: torch.Tensor, m_splits: torch.Tensor, rows: int) -> torch.Tensor:
    """Row r of the result is ``g[e]`` for the expert e owning row r (negative counts as 0, as the kernels do),
    zero past ``sum(m_splits)``; sync-free (no host read of m_splits)."""
    ends = torch.cumsum(m_splits.clamp(min=0).to(torch.int64), 0)
    expert = torch.searchsorted(ends, torch.arange(rows, device=g.device), right=True)  # in [0, E]
    return torch.cat([g, g.new_zeros((1, g.shape[1]))])[expert]


def _bias_grad_setup_context(ctx, inputs, output):
    dy, m_splits = inputs
    ctx.rows = dy.shape[0]
    ctx.dy_dtype = dy.dtype
    ctx.save_for_backward(m_splits)


def _bias_grad_autograd_backward(ctx, g):
    (m_splits,) = ctx.saved_tensors
    ddy = _expert_rows_broadcast(g, m_splits, ctx.rows).to(ctx.dy_dtype) if ctx.needs_input_grad[0] else None
    return ddy, None


if available():  # autograd on the ops; without a build the entry points raise require()'s ImportError
    torch.library.register_autograd(
        "moe_graph::grouped_gemm", _grouped_gemm_autograd_backward, setup_context=_grouped_gemm_setup_context
    )
    torch.library.register_autograd(
        "moe_graph::grouped_gemm_wgrad", _wgrad_autograd_backward, setup_context=_wgrad_setup_context
    )
    torch.library.register_autograd(
        "moe_graph::grouped_bias_grad", _bias_grad_autograd_backward, setup_context=_bias_grad_setup_context
    )


class _GroupedGemmFn(torch.autograd.Function):
    """grouped_gemm with TransformerEngine's two special weight-gradient modes (the plain path is
    ``ops.grouped_gemm``, autograd registered above; all of them use ``_grouped_gemm_backward``):

    * ``fuse_main_grad``: the weight gradients go in place into ``w.main_grad`` (fp32 or the weight dtype; fetched
      at backward, lazily through ``get_main_grad()`` for Megatron-FSDP parameters) inside the GEMM epilogue,
      added (``accumulate``) or overwriting (TE's ``is_first_microbatch=True`` or ``w.overwrite_main_grad``);
      ``w.grad_added_to_main_grad`` is set and a zero placeholder returned (no allocation, see
      ``zero_wgrad_placeholder``)
      so that the grad-accumulation hooks still fire.
    * ``defer`` (a callable, TE's ``delay_wgrad_compute``): backward computes the input gradient only and hands
      ``(a, dy, m_splits)`` to ``defer``; the weight- and bias-gradient work runs later
      (``GroupedLinear.backward_dw``). As in TE, a placeholder weight gradient is still returned (fused: the
      shared zero placeholder with ``grad_added_to_main_grad`` set; otherwise a zero-stride zero that autograd
      adds without a copy, or materializes as ``w.grad`` for ``backward_dw`` to add into), and the bias gradient
      is delivered by ``backward_dw``, so that hooks that require a gradient (Megatron's DDP with
      ``overlap_grad_reduce``) see one when ``backward_dw`` triggers them.
    """

    @staticmethod
    def forward(ctx, a, m_splits, trans_b, bias, fuse_main_grad, accumulate, defer, *weights):
        out = ops.grouped_gemm(a, list(weights), m_splits, trans_b, bias)
        ctx.trans_b = trans_b
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.fuse_main_grad, ctx.accumulate, ctx.defer = fuse_main_grad, accumulate, defer
        # The weight objects themselves (not only saved tensors) for main_grad and grad_added_to_main_grad:
        # under saved_tensors_hooks (e.g. save_on_cpu offloading) the saved weights unpack as new tensors
        # without those attributes. The saved copies carry the GEMM operands and their version check.
        ctx.weight_objects = weights
        ctx.save_for_backward(a, m_splits, *weights)
        return out

    @staticmethod
    def backward(ctx, dy):
        a, m_splits, *weights = ctx.saved_tensors
        n_fixed = 7  # inputs before *weights
        need_w = any(ctx.needs_input_grad[n_fixed:])
        need_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
        deferred = need_w and ctx.defer is not None
        fused = need_w and not deferred and ctx.fuse_main_grad
        params = ctx.weight_objects
        main_grads = [resolve_main_grad(w) for w in params] if fused else None
        need_w_now = [need_w and not deferred] * len(weights)  # main_grad accumulation covers the whole group
        da, w_grads, db = _grouped_gemm_backward(
            dy, a, weights, m_splits, ctx.trans_b, ctx.bias_dtype, ctx.needs_input_grad[0], need_w_now,
            need_bias and not deferred, main_grads, ctx.accumulate,
        )
        if deferred:
            ctx.defer(a, dy.contiguous(), m_splits)
            w_grads = deferred_wgrad_placeholders(params, ctx.fuse_main_grad)
        elif fused:
            for w in params:
                w.grad_added_to_main_grad = True
            w_grads = [zero_wgrad_placeholder(w) for w in params]
        return (da, None, None, db, None, None, None, *w_grads)


def grouped_gemm_autograd(a: torch.Tensor, weights: Sequence[torch.Tensor], m_splits: torch.Tensor, *,
                          trans_b: bool = True, bias: Optional[torch.Tensor] = None, fuse_main_grad: bool = False,
                          accumulate: bool = True, defer: Optional[Callable] = None) -> torch.Tensor:
    """Differentiable grouped GEMM with TransformerEngine's weight-gradient modes (the layer-facing entry point of
    :class:`moe_graph.GroupedLinear` and the MoE experts; ``m_splits`` is already a device tensor, see
    :func:`as_splits`).

    * ``fuse_main_grad``: the weight gradients go in place into each ``w.main_grad`` (added when ``accumulate``,
      else overwritten), ``w.grad_added_to_main_grad`` is set and autograd gets :func:`zero_wgrad_placeholder`.
    * ``defer``: a callable; backward computes the input gradient only and calls ``defer(a, dy, m_splits)`` for
      the weight- and bias-gradient work (TE's ``delay_wgrad_compute``).

    Without either it is ``torch.ops.moe_graph.grouped_gemm``, whose autograd is registered on the op."""
    if fuse_main_grad or defer is not None:
        return _GroupedGemmFn.apply(a, m_splits, trans_b, bias, fuse_main_grad, accumulate, defer, *weights)
    return ops.grouped_gemm(a, list(weights), m_splits, trans_b, bias)


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
    splits = as_splits(m_splits, a.device)
    bias_t = _stack_bias(bias)
    if out is not None:
        if torch.is_grad_enabled() and (a.requires_grad or any(w.requires_grad for w in weights)):
            raise RuntimeError("grouped_gemm: out= does not support autograd; call without out= to get gradients")
        ops.grouped_gemm_out(a, weights, splits, trans_b, bias_t, out)
        return out
    return ops.grouped_gemm(a, weights, splits, trans_b, bias_t)  # differentiable: autograd is on the op


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

    Returns ``out`` (or a new ``[E, N, K]`` tensor in a's dtype). Without ``out=`` it is differentiable with
    respect to ``a`` and ``dy`` (double backward of grouped_gemm).
    """
    splits = as_splits(m_splits, a.device)
    if out is None:
        if isinstance(accumulate, torch.Tensor) or accumulate:
            raise ValueError("grouped_gemm_wgrad: accumulate needs out= (the tensor to accumulate into)")
        return ops.grouped_gemm_wgrad(a, dy, splits, None)
    if torch.is_grad_enabled() and (a.requires_grad or dy.requires_grad):
        raise RuntimeError("grouped_gemm_wgrad: out= does not support autograd; call without out= to get gradients")
    outs = _as_list(out, "out")
    if isinstance(accumulate, torch.Tensor):
        ops.grouped_gemm_wgrad_out(a, dy, splits, outs, False, accumulate)
    else:
        ops.grouped_gemm_wgrad_out(a, dy, splits, outs, bool(accumulate), None)
    return out


def grouped_bias_grad(dy: torch.Tensor, m_splits) -> torch.Tensor:
    """``db[e] = sum of dy rows of expert e`` -> ``[E, N]`` fp32 (fp64 for fp64 input)."""
    return ops.grouped_bias_grad(dy, as_splits(m_splits, dy.device))


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """Drop-in for the ``grouped_gemm`` package's ``ops.gmm`` (used by Megatron's GroupedMLP), with autograd.

    ``b`` is ``[E, K, N]`` (``trans_b=False``) or ``[E, N, K]`` (``trans_b=True``); ``batch_sizes`` is the number
    of rows per expert (a CPU tensor as in that package, a device tensor, or a list).
    """
    if isinstance(batch_sizes, torch.Tensor) and batch_sizes.device.type == "cpu" and a.device.type != "cpu":
        batch_sizes = batch_sizes.tolist()  # host values (no device sync): copied like a list below
    return grouped_gemm(a, b, batch_sizes, trans_b=trans_b)
