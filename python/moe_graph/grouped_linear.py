"""``GroupedLinear``: a drop-in for ``transformer_engine.pytorch.GroupedLinear`` on the sync-free grouped GEMM.

Differences that matter for CUDA graphs: ``m_splits`` may be a device tensor (no ``.tolist()``, no sync) and the
whole forward/backward is capturable. With ``fuse_wgrad_accumulation=True`` the weight gradients are added into
``weight.main_grad`` inside the GEMM epilogue and ``weight.grad_added_to_main_grad`` is set, as Megatron's DDP
expects (``is_first_microbatch=True`` or ``weight.overwrite_main_grad`` overwrite ``main_grad`` instead, as in TE;
``main_grad`` may be provided lazily by ``weight.get_main_grad()`` for Megatron-FSDP parameters). The zero
placeholder returned to autograd for such weights becomes ``weight.grad`` without a copy.

``delay_wgrad_compute=True`` (TE's, used by Megatron to overlap the weight-gradient GEMMs with expert-parallel
communication): backward computes the input gradient only, returns placeholder weight gradients (as TE) and
queues the weight-gradient GEMM; ``backward_dw()`` runs the oldest queued one (into ``main_grad`` or
``weight.grad``), delivers the bias gradients (weights and biases are marked ``skip_backward_post_hook``, as in TE)
and then calls the hooks registered with ``register_wgrad_accumulation_and_reduce_hooks`` (Megatron's and
moe_graph's DDP register their grad-ready hooks there for such parameters).
"""

from __future__ import annotations

import collections
import pickle
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from moe_graph.ops import fp8 as _fp8
from moe_graph.ops._lib import ops as _ops
from moe_graph.ops.grouped_gemm import (
    as_splits,
    grouped_bias_grad,
    grouped_gemm_autograd,
    grouped_gemm_wgrad,
    has_main_grad_source,
    deferred_wgrad_placeholders,
    is_zero_wgrad_placeholder,
    resolve_main_grad,
    zero_wgrad_placeholder,
)

__all__ = ["GroupedLinear", "fp8_grouped_linear", "fp8_grouped_linear_activation", "gathered_fp8_weight",
           "fp8_forward", "fp8_dgrad", "fp8_wgrad", "split_quantized"]


def _default_init(std: float = 0.023) -> Callable[[torch.Tensor], None]:
    # TransformerEngine's default init_method: normal(0, 0.023).
    def init_(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)

    return init_


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GroupedLinear: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Accumulate ``g`` into ``p.grad`` as autograd would (set when None or an untouched zero placeholder)."""
    if p.grad is None or is_zero_wgrad_placeholder(p.grad):
        p.grad = g.to(p.dtype)
    else:
        p.grad.add_(g)


def fp8_forward(x: torch.Tensor, splits: torch.Tensor, recipe, wq, bias: Optional[torch.Tensor], need_w: bool,
                xq=None):
    """FP8 forward GEMM of ``x [M, K]`` (rows grouped by ``splits``) with the weights' quantized copies ``wq``
    (``moe_graph.fp8.quantize_weight``): ``(y, xt)``, ``xt`` the columnwise copy of ``x`` for the wgrad (None
    without ``need_w``), both quantized by one op. Bias (fp32 in the epilogue) as given. ``xq``: ``(q, scale,
    columns)`` made before this GEMM (``x`` is then only the autograd carrier): by the fused activation
    (``columns`` its columnwise copy) or before the rows moved (FP8 dispatch, ``columns`` None: the columnwise
    copy is quantized from the dequantized rows, DeepSeek-V3's FP8 dispatch)."""
    qw, sw = wq[0], wq[1]
    bk, bn, _ = _fp8.gemm_blocks(recipe)
    xt = None
    if xq is not None:  # (q, scale, columnwise copy or None)
        qx, sx, xt = xq
    elif need_w:  # both copies from one op (cast-transpose)
        (qx, sx), xt = _fp8.quantize_pair(x, splits, recipe, recipe.fwd_dtype)
    else:
        qx, sx = _fp8.quantize_rows(x, splits, recipe, recipe.fwd_dtype)
    b32 = None if bias is None else bias.detach().float()
    y = _fp8.scaled_grouped_gemm(qx, sx, qw, sw, splits, block_k=bk, block_n=bn, bias=b32, out_dtype=x.dtype)
    if not need_w:
        xt = None
    elif xt is None:  # FP8 dispatch: requantized from the rowwise copy in one op (no fp32 rows in memory)
        xt = _fp8.quantize_columns(qx, splits, recipe, recipe.fwd_dtype, x_scale=sx)
    return y, xt


def split_quantized(x, recipe):
    """``(x, xq)``: a ``moe_graph.fp8.QuantizedRows`` (FP8 dispatch, or the fused activation's output) as its
    autograd carrier and ``(data, scale, columns)`` for :func:`fp8_forward`; any other ``x`` as ``(x, None)``."""
    if not isinstance(x, _fp8.QuantizedRows):
        return x, None
    if x.kind != recipe.kind:
        raise ValueError(f"fp8_grouped_linear: x was quantized for the {x.kind!r} recipe before dispatch, but "
                         f"the active recipe is {recipe.kind!r}")
    return x.carrier, (x.data, x.scale, x.columns)


def fp8_dgrad(dy: torch.Tensor, splits: torch.Tensor, recipe, qwt: torch.Tensor, swt: torch.Tensor,
              out_dtype: torch.dtype, dyq=None) -> torch.Tensor:
    """FP8 input gradient: ``dy`` quantized rowwise (the recipe's backward dtype; ``dyq``: that copy, made with
    the columnwise one) times the weights' dgrad copy."""
    bk, bn, _ = _fp8.gemm_blocks(recipe)
    qdy, sdy = dyq if dyq is not None else _fp8.quantize_rows(dy, splits, recipe, recipe.bwd_dtype)
    return _fp8.scaled_grouped_gemm(qdy, sdy, qwt, swt, splits, block_k=bk, block_n=bn, out_dtype=out_dtype)


def fp8_wgrad(dy: torch.Tensor, splits: torch.Tensor, recipe, xt, dyt=None, out: Optional[torch.Tensor] = None,
              accumulate: bool = False) -> torch.Tensor:
    """FP8 weight gradient, fp32 ``[E, N, K]``: the columnwise copies of ``dy`` (quantized here, or ``dyt``) and
    ``x`` (``xt`` from :func:`fp8_forward`), tiles along each group's rows in the order they reach the GEMM.
    ``out``: an fp32 ``[E, N, K]`` (a ``main_grad``) the GEMM writes or, with ``accumulate``, adds to in its
    epilogue (one fp32 add of the fp32 sum, ``csrc/fp8/scaled_gemm.h``); returned."""
    qdyt, sdyt = dyt if dyt is not None else _fp8.quantize_columns(dy, splits, recipe, recipe.bwd_dtype)
    return _fp8.scaled_grouped_wgrad(qdyt, sdyt, xt[0], xt[1], splits, block_m=_fp8.gemm_blocks(recipe)[2], out=out,
                                     accumulate=accumulate)


def _fp8_main_grad_out(weights, fuse: bool) -> Optional[torch.Tensor]:
    """The ``main_grad`` the FP8 wgrad GEMM accumulates into itself: fused delivery to one stacked weight whose
    ``main_grad`` is a contiguous fp32 tensor of its shape ``[E, N, K]`` (MoELayer's experts under DDP). None
    otherwise (separate weights, a bf16 ``main_grad``): the GEMM then writes a fresh fp32 ``dw`` that
    :func:`_deliver_wgrad` hands over."""
    if not fuse or weights is None or len(weights) != 1:
        return None
    w = weights[0]
    mg = resolve_main_grad(w)
    if (mg.dtype != torch.float32 or w.dim() != 3 or mg.shape != w.shape or not mg.is_contiguous()
            or mg.device != w.device):
        return None
    return mg


def _fp8_wgrad_delivered(weights, n_weights: int, dy, splits, recipe, xt, dyt, fuse: bool, accumulate: bool,
                         w_dtype) -> list:
    """The FP8 weight gradient computed and handed to the weights (:func:`_deliver_wgrad`): straight into the fp32
    stacked ``main_grad`` by the GEMM's epilogue where :func:`_fp8_main_grad_out` finds one (no fp32 ``[E, N, K]``
    temporary, no second read and write of ``main_grad``), else through a fresh fp32 ``dw``."""
    mg = _fp8_main_grad_out(weights, fuse)
    if mg is not None:
        fp8_wgrad(dy, splits, recipe, xt, dyt, out=mg, accumulate=accumulate)
        return _deliver_wgrad(weights, n_weights, None, fuse, accumulate, w_dtype)
    return _deliver_wgrad(weights, n_weights, fp8_wgrad(dy, splits, recipe, xt, dyt), fuse, accumulate, w_dtype)


def _deliver_wgrad(weights, n_weights: int, dw: Optional[torch.Tensor], fuse: bool, accumulate: bool, w_dtype) -> list:
    """Hands the fp32 ``dw [E, N, K]`` to the weights: fused into ``main_grad`` (one add, or a write for the first
    microbatch; the zero placeholders returned), else as autograd gradients in the weights' dtype. ``dw`` None:
    the GEMM already accumulated into ``main_grad`` (fused only)."""
    if fuse:
        with torch.no_grad():
            per = [None] * len(weights) if dw is None else ([dw] if len(weights) == 1 else list(dw.unbind(0)))
            for w, g in zip(weights, per):
                if g is not None:
                    mg = resolve_main_grad(w)
                    if accumulate:
                        mg.add_(g.to(mg.dtype))
                    else:
                        mg.copy_(g)
                w.grad_added_to_main_grad = True
        return [zero_wgrad_placeholder(w) for w in weights]
    g = dw.to(w_dtype)
    return [g] if n_weights == 1 else list(g.unbind(0))


def _deliver_fp8_dw(weights, dy, splits, recipe, xt, fuse: bool, accumulate: bool) -> None:
    """:meth:`GroupedLinear.backward_dw`'s FP8 wgrad and delivery: into ``main_grad`` as the fused backward (by
    the GEMM itself where it can), else added to ``.grad`` as autograd would (set when None or the backward's zero
    placeholder)."""
    if fuse:
        _fp8_wgrad_delivered(weights, len(weights), dy, splits, recipe, xt, None, True, accumulate, None)
        return
    dw = fp8_wgrad(dy, splits, recipe, xt)
    for w, g in zip(weights, [dw] if len(weights) == 1 else dw.unbind(0)):
        _add_grad(w, g)


def _fp8_linear_forward(ctx, x, splits, recipe, wq, bias, fuse, accumulate, defer, xq, weights):
    """:class:`_Fp8GroupedLinear`'s forward (also the first half of :class:`_Fp8LinearActivation`): ``(y, the
    tensors its backward needs)``; the rest of what :func:`_fp8_linear_backward` reads goes on ``ctx``."""
    need_w = any(w.requires_grad for w in weights)
    y, xt = fp8_forward(x, splits, recipe, wq, bias, need_w, xq)
    ctx.recipe, ctx.fuse, ctx.accumulate, ctx.need_w, ctx.defer = recipe, fuse, accumulate, need_w, defer
    ctx.weights = weights if (fuse or defer is not None) else None
    ctx.n_weights, ctx.w_dtype = len(weights), weights[0].dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.x_dtype = x.dtype
    return y, (splits, wq[2], wq[3], *(xt if xt is not None else ()))


def _fp8_linear_backward(ctx, saved, dy, need_dx: bool, need_db: bool, dy_copies=None):
    """:class:`_Fp8GroupedLinear`'s backward for the output gradient ``dy [M, N]`` -> ``(dx, db, weight grads)``.
    ``dy_copies``: ``dy``'s rowwise and columnwise FP8 copies ``((q, scale), (q_t, scale_t))`` made by their
    producer (the fused activation backward), ``dy`` then None: no bias gradient, no deferred wgrad."""
    splits, qwt, swt, *xt = saved
    recipe = ctx.recipe
    deferred = ctx.need_w and ctx.defer is not None
    dyq, dyt = dy_copies if dy_copies is not None else (None, None)
    if dy_copies is None and need_dx and ctx.need_w and not deferred:  # both copies of dy from one op
        dyq, dyt = _fp8.quantize_pair(dy, splits, recipe, recipe.bwd_dtype)
    dx = fp8_dgrad(dy, splits, recipe, qwt, swt, ctx.x_dtype, dyq) if need_dx else None
    dws = [None] * ctx.n_weights
    if deferred:
        ctx.defer(tuple(xt), dy, splits)
        dws = deferred_wgrad_placeholders(ctx.weights, ctx.fuse)
    elif ctx.need_w:
        dws = _fp8_wgrad_delivered(ctx.weights, ctx.n_weights, dy, splits, recipe, xt, dyt, ctx.fuse,
                                   ctx.accumulate, ctx.w_dtype)
    db = None
    if need_db and not deferred:
        db = grouped_bias_grad(dy, splits).to(ctx.bias_dtype)
    ctx.weights = ctx.defer = None
    return dx, db, dws


class _Fp8GroupedLinear(torch.autograd.Function):
    """FP8 forward / dgrad / wgrad of GroupedLinear (``ops.fp8``'s scaled grouped GEMMs, the recipe's tiles):
    inputs quantized rowwise for the forward and columnwise (saved) for wgrad, gradients likewise, the weights'
    two copies from the layer's per-step cache. Bias gradient from the unquantized ``dy`` (as TE). Sync-free.
    ``defer`` (``delay_wgrad_compute``): backward computes dgrad only and hands ``(xt, dy, splits)`` to it; the
    weights get placeholders (as the bf16 path, :func:`moe_graph.ops.grouped_gemm.grouped_gemm_autograd`)."""

    @staticmethod
    def forward(ctx, x, splits, recipe, wq, bias, fuse, accumulate, defer, xq, handoff, *weights):
        y, saved = _fp8_linear_forward(ctx, x, splits, recipe, wq, bias, fuse, accumulate, defer, xq, weights)
        ctx.save_for_backward(*saved)
        ctx.handoff = handoff
        return y

    @staticmethod
    def backward(ctx, dy):
        copies = None
        if ctx.handoff is not None:  # dy's FP8 copies from the output's consumer (ops.fp8.GradHandoff; kept for
            copies, dy = ctx.handoff.take(dy)  # a second backward of a retained graph, which gives them again)
        if copies is not None:
            dx, db, dws = _fp8_linear_backward(ctx, ctx.saved_tensors, None, ctx.needs_input_grad[0], False, copies)
        else:
            dx, db, dws = _fp8_linear_backward(ctx, ctx.saved_tensors, dy.contiguous(), ctx.needs_input_grad[0],
                                               ctx.needs_input_grad[4])
        return (dx, None, None, None, db, None, None, None, None, None, *dws)


class _Fp8LinearActivation(torch.autograd.Function):
    """fc1 and the expert activation of the FP8 experts as one autograd node (:func:`fp8_grouped_linear_activation`).
    Forward: :class:`_Fp8GroupedLinear`'s, then both FP8 copies of ``expert_activation(h, ...)`` from ``h`` (the
    fused producer of fc2's input, ``ops.fp8.quantize_activation``'s op); returns the zero-stride carrier and the
    copies. Backward, for the carrier's gradient ``g``: fc1's two FP8 ``dy`` copies are quantized straight from
    ``(g, h, row_scale)`` (``ops.fp8.quantize_pair(h, ..., grad_y=g)``: the activation backward's ``grad_h``
    computed per element, never written in 16 bits nor read again), with the row-scale gradient from the same
    pass (``grad_scale``; under per-tensor scaling from ``expert_activation_backward`` without ``grad_h``), then
    fc1's dgrad / wgrad as :class:`_Fp8GroupedLinear`.
    fc1's bias gradient is a sum of ``grad_h``: with a bias that needs it, ``grad_h`` is written and quantized as
    in the separate nodes. Every result equals fc1's node followed by ``ops.fp8.quantize_activation``'s bit for
    bit (on CUDA the row-scale gradient within fp32 summation rounding: the kernel's order, csrc/fp8/quantize.h);
    no zero gradients are made for the FP8 copies (``set_materialize_grads(False)``)."""

    @staticmethod
    def forward(ctx, x, splits, recipe, wq, bias, fuse, accumulate, xq, act, row_scale, *weights):
        h, saved = _fp8_linear_forward(ctx, x, splits, recipe, wq, bias, fuse, accumulate, None, xq, weights)
        activation, alpha, limit = act
        (q, s), (qt, st) = _fp8.quantize_pair(h, splits, recipe, recipe.fwd_dtype, activation=activation,
                                              row_scale=row_scale, swiglu_alpha=alpha, swiglu_limit=limit)
        ctx.save_for_backward(*saved, h, row_scale)
        ctx.act = act
        ctx.mark_non_differentiable(q, s, qt, st)
        ctx.set_materialize_grads(False)  # no zero gradients written for the FP8 copies (None reaches backward)
        return h.new_zeros(()).expand(h.shape[0], q.shape[1]), q, s, qt, st

    @staticmethod
    def backward(ctx, g, *_):
        if g is None:  # the carrier got no gradient: nothing reaches fc1 or the row scale
            return (None,) * (10 + ctx.n_weights)
        *saved, h, row_scale = ctx.saved_tensors
        g = g.contiguous()
        need_dx, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        need_ds = row_scale is not None and ctx.needs_input_grad[9]
        activation, alpha, limit = ctx.act
        ds = None
        if need_db:  # fc1's bias gradient sums grad_h: written, as in the separate nodes
            grad_h, grad_scale = _ops.expert_activation_backward(g, h, row_scale, *ctx.act)
            dx, db, dws = _fp8_linear_backward(ctx, saved, grad_h, need_dx, True)
            ds = grad_scale if need_ds else None
        else:
            copies = None
            recipe = ctx.recipe
            if need_dx or ctx.need_w:
                # the row-scale gradient in the same pass where the recipe's rowwise tiles are rows
                ds = torch.empty_like(row_scale) if need_ds and _fp8.fuses_row_scale_gradient(recipe) else None
                copies = _fp8.quantize_pair(h, saved[0], recipe, recipe.bwd_dtype, activation=activation,
                                            row_scale=row_scale, swiglu_alpha=alpha, swiglu_limit=limit, grad_y=g,
                                            grad_scale=ds)
            dx, db, dws = _fp8_linear_backward(ctx, saved, None, need_dx, False, copies)
            if need_ds and ds is None:  # the row-scale gradient alone (per-tensor scaling, or no fc1 gradient)
                ds = _ops.expert_activation_backward(g, h, row_scale, *ctx.act, False)[1]
        return (dx, None, None, None, db, None, None, None, None, ds, *dws)


def gathered_fp8_weight(weights, recipe):
    """The FP8 copies ``(q, scale, qt, st)`` the distributed optimizer keeps for a single ``[E, N, K]`` weight under
    ``DistributedOptimizer(fp8_param_gather=...)`` (quantized once per step, gathered in FP8:
    ``moe_graph.distributed.fp8_params``), else None (the caller quantizes the 16-bit weight)."""
    cache = getattr(weights[0], "fp8_gathered", None) if len(weights) == 1 else None
    return None if cache is None else cache.copies(recipe)


def _fp8_weight_copies(weights: List[torch.Tensor], recipe, cache_owner: Optional[object]):
    """The weights' two FP8 copies for :func:`fp8_grouped_linear` (gathered by the optimizer, cached on
    ``cache_owner`` while the weights are unchanged, or quantized here)."""
    gathered = gathered_fp8_weight(weights, recipe)
    if gathered is not None:
        return gathered
    key = (recipe, tuple((w.data_ptr(), w._version) for w in weights))
    cache = getattr(cache_owner, "_fp8_weight_cache", None) if cache_owner is not None else None
    if cache is None or cache[0] != key:
        with torch.no_grad():
            w3 = weights[0] if len(weights) == 1 and weights[0].dim() == 3 else torch.stack(
                [w.detach() for w in weights])
            cache = (key, _fp8.quantize_weight(w3.detach().contiguous(), recipe))
        if cache_owner is not None:
            cache_owner._fp8_weight_cache = cache
    return cache[1]


def fp8_grouped_linear(x: torch.Tensor, splits: torch.Tensor, weights: List[torch.Tensor],
                       bias: Optional[torch.Tensor], recipe, *, fuse: bool = False, accumulate: bool = True,
                       cache_owner: Optional[object] = None,
                       grad_handoff: Optional["_fp8.GradHandoff"] = None) -> torch.Tensor:
    """``x [M, K]`` times the expert weights (one ``[E, N, K]`` tensor or ``E`` tensors ``[N, K]``) in FP8 with
    ``recipe`` (``moe_graph.fp8.Recipe``), differentiable in ``x``, the weights and ``bias [E, N]``; ``fuse``:
    weight gradients into ``main_grad``. With ``cache_owner`` the weights' quantized copies are kept on it and
    reused while the weights are the same tensors with the same version counters (only for weights updated in
    place through themselves: an update through another view of their storage, e.g. a contiguous parameter
    buffer, is not seen). ``x`` may be a ``moe_graph.fp8.QuantizedRows`` (FP8 dispatch): its rowwise copy is used
    as is, and the wgrad's columnwise copy is quantized from its fp32 dequantization.

    ``grad_handoff`` (``moe_graph.fp8.GradHandoff`` of this ``recipe`` and ``splits``; no ``bias``): bound to the
    output here; the backward takes the output gradient's FP8 copies from it where the output's consumer wrote
    them (the combine's backward), instead of quantizing a 16-bit gradient (the same bytes)."""
    if grad_handoff is not None and (bias is not None or grad_handoff.recipe != recipe
                                     or grad_handoff.m_splits is not splits):
        raise ValueError("fp8_grouped_linear: grad_handoff needs no bias and the layer's recipe and splits")
    x, xq = split_quantized(x, recipe)
    wq = _fp8_weight_copies(weights, recipe, cache_owner)
    y = _Fp8GroupedLinear.apply(x, splits, recipe, wq, bias, fuse, accumulate, None, xq, grad_handoff, *weights)
    if grad_handoff is not None:
        grad_handoff.bind(y)
    return y


def fp8_grouped_linear_activation(x: torch.Tensor, splits: torch.Tensor, weights: List[torch.Tensor],
                                  bias: Optional[torch.Tensor], recipe, activation: str,
                                  row_scale: Optional[torch.Tensor] = None, *, swiglu_alpha: float = 1.702,
                                  swiglu_limit: float = 7.0, fuse: bool = False,
                                  accumulate: bool = True) -> "_fp8.QuantizedRows":
    """fc1 then the expert activation in FP8, as one autograd node: ``expert_activation(fp8_grouped_linear(x,
    ...), activation, row_scale, ...)`` as a ``moe_graph.fp8.QuantizedRows`` holding both FP8 copies of the
    activation's output (``ops.fp8.quantize_activation``), the next FP8 GEMM's input. The same forward as those two
    calls; backward quantizes fc1's output gradient (the activation backward's ``grad_h``) into its two FP8 copies
    straight from the activation's output gradient, without ``grad_h`` in memory (:class:`_Fp8LinearActivation`).
    Every result and gradient equals the two calls' bit for bit (on CUDA the row-scale gradient within fp32
    summation rounding). Arguments: :func:`fp8_grouped_linear`'s and
    ``ops.fp8.quantize_activation``'s."""
    x, xq = split_quantized(x, recipe)
    wq = _fp8_weight_copies(weights, recipe, None)
    carrier_, q, s, qt, st = _Fp8LinearActivation.apply(
        x, splits, recipe, wq, bias, fuse, accumulate, xq, (activation, float(swiglu_alpha), float(swiglu_limit)),
        None if row_scale is None else row_scale.contiguous(), *weights)
    return _fp8.QuantizedRows(carrier_, q, s, recipe.kind, (qt, st))


class GroupedLinear(nn.Module):
    """E linear layers applied to consecutive row groups of one input (one grouped GEMM).

    Args follow TransformerEngine's ``GroupedLinear`` (every TE keyword is accepted by name; unknown keywords
    raise ``TypeError``): ``num_gemms`` experts, each ``y = x W_e^T + b_e`` with ``W_e`` of shape
    ``[out_features, in_features]``. ``tp_size`` with ``parallel_mode="column"`` (``"row"``) divides
    ``out_features`` (``in_features``), as in TE; the layer itself does no tensor-parallel communication (neither
    does TE's: Megatron's MoE dispatcher does it), and ``sequence_parallel`` is recorded as TE does
    (``tp_size > 1 and sequence_parallel``) for the parameter attributes Megatron reads.
    Parameters are ``weight0..weight{E-1}`` (TE layout) or one ``weight`` ``[E, out, in]`` with
    ``single_grouped_weight=True``; biases ``bias0..`` or one ``bias`` ``[E, out]`` with ``single_grouped_bias``
    (default: the same as ``single_grouped_weight``; TE's default is False, and TE then packs the biases every
    forward as this layer does). State dicts of every layout load into every layout.
    ``save_original_input`` is recorded (TE saves the unquantized input with it; without fp8 the input is what is
    saved anyway). ``use_grouped_tensor`` and ``name`` are accepted (the grouped GEMM is always used).
    ``device="meta"`` defers initialization to :meth:`reset_parameters`, as TE does.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: Optional[bool] = None,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
    ) -> None:
        super().__init__()
        _check_int("num_gemms", num_gemms, 1)
        _check_int("in_features", in_features, 1)
        _check_int("out_features", out_features, 1)
        if ub_overlap_rs or ub_overlap_ag:
            raise NotImplementedError("GroupedLinear: userbuffers overlap (ub_overlap_*) is not supported")
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"GroupedLinear: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(f"GroupedLinear: use_grouped_tensor must be a bool or None, got {use_grouped_tensor!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"GroupedLinear: name must be a str or None, got {type(name).__name__}")
        if tp_group is not None and hasattr(tp_group, "size"):
            tp_size = tp_group.size()
        _check_int("tp_size", tp_size, 1)
        if parallel_mode == "column":
            if out_features % tp_size:
                raise ValueError(f"GroupedLinear: out_features {out_features} not divisible by tp_size {tp_size}")
            out_features //= tp_size
        elif parallel_mode == "row":
            if in_features % tp_size:
                raise ValueError(f"GroupedLinear: in_features {in_features} not divisible by tp_size {tp_size}")
            in_features //= tp_size

        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.single_grouped_weight = bool(single_grouped_weight)
        self.single_grouped_bias = self.single_grouped_weight if single_grouped_bias is None else bool(single_grouped_bias)
        self.parallel_mode = parallel_mode
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.save_original_input = bool(save_original_input)
        self.ub_name = ub_name
        self.name = name
        self.use_grouped_tensor = use_grouped_tensor
        self.init_method = init_method
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []
        self._wgrad_queue: collections.deque = collections.deque()
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        factory = dict(device=device, dtype=self.params_dtype)

        # Registration order as TE: weight0, bias0, weight1, bias1, ... (grouped parameters in place of expert 0).
        for e in range(num_gemms):
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{e}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
            elif e == 0:
                self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **factory))
            if bias and not self.single_grouped_bias:
                self.register_parameter(f"bias{e}", nn.Parameter(torch.empty(out_features, **factory)))
            elif bias and e == 0:
                self.bias = nn.Parameter(torch.empty(num_gemms, out_features, **factory))
        if not bias and self.single_grouped_bias:
            self.register_parameter("bias", None)

        self.reset_parameters(defer_init=torch.device(device).type == "meta")
        self._set_parallel_attributes()

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialize in place, as TE: every expert weight with ``init_method`` (default normal(0, 0.023))
        inside ``get_rng_state_tracker().fork(rng_tracker_name)``, biases zero, and the parameter attributes set
        again (``to_empty`` replaces the parameter objects). ``defer_init=True`` does nothing (meta-device
        construction); Megatron-FSDP materializes the parameters (``to_empty``) and calls this."""
        if defer_init:
            return
        self._set_parallel_attributes()
        base_init = self.init_method if self.init_method is not None else _default_init()
        tracker = self.get_rng_state_tracker() if self.get_rng_state_tracker is not None else None
        with torch.no_grad():
            for w in self._weights():
                for t in (w.unbind(0) if self.single_grouped_weight else [w]):
                    # As TE: weights are initialized inside the model-parallel RNG tracker's fork (Megatron
                    # passes its tracker and, for experts, the expert-parallel stream, so that EP ranks get
                    # different experts).
                    if tracker is None:
                        base_init(t)
                    else:
                        with (tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()):
                            base_init(t)
            for b in self._biases() or []:
                b.zero_()

    def _set_parallel_attributes(self) -> None:
        # Megatron reads these (TE sets them the same way): weights are always tensor-parallel tensors, split
        # along the output (column / None) or input (row) dimension; a column-parallel bias is split too, a
        # row-parallel one carries ``sequence_parallel``. With delayed wgrad, weights and biases skip the autograd
        # grad hook (TE): their gradients are complete only after backward_dw, which triggers the hooks.
        lead_w = 1 if self.single_grouped_weight else 0
        lead_b = 1 if self.single_grouped_bias else 0
        for w in self._weights():
            w.fp8_grouped_weight = self.single_grouped_weight  # DistributedOptimizer(fp8_param_gather=...)
            w.tensor_model_parallel = True
            w.partition_dim = lead_w + (1 if self.parallel_mode == "row" else 0)
            w.partition_stride = 1
        for b in self._biases() or []:
            if self.parallel_mode == "row":
                b.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, lead_b, 1
        if self.delay_wgrad_compute:
            for p in self._weights() + (self._biases() or []):
                p.skip_backward_post_hook = True

    # ---------------------------------------------------------------------------------------------- params --
    def _weights(self) -> List[torch.Tensor]:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def _biases(self) -> Optional[List[torch.Tensor]]:
        if not self.use_bias:
            return None
        if self.single_grouped_bias:
            return [self.bias]
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)]

    def _stacked_bias(self) -> Optional[torch.Tensor]:
        bs = self._biases()
        if bs is None:
            return None
        return bs[0] if self.single_grouped_bias else torch.stack(bs)

    # --------------------------------------------------------------------------------------------- forward --
    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None):
        """``inp``: ``[..., in_features]``, rows grouped by expert; ``m_splits``: list or device tensor ``[E]``.

        With ``return_bias=True`` returns ``(out, biases)`` (the single ``[E, out]`` bias, or the list of per-expert
        biases), as TE."""
        if inp.shape[-1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: inp must have last dimension in_features={self.in_features}, got shape {tuple(inp.shape)}"
            )
        if isinstance(m_splits, torch.Tensor) and m_splits.numel() != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must have {self.num_gemms} entries, got {m_splits.numel()}")
        if not isinstance(m_splits, torch.Tensor) and len(m_splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must have {self.num_gemms} entries, got {len(m_splits)}")
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        if not x.is_contiguous():
            x = x.contiguous()
        splits = as_splits(m_splits, x.device)
        weights = self._weights()
        fuse = self.fuse_wgrad_accumulation and torch.is_grad_enabled()
        if fuse:
            for w in weights:
                if not has_main_grad_source(w):
                    raise RuntimeError(
                        "GroupedLinear(fuse_wgrad_accumulation=True): every weight needs a .main_grad tensor "
                        "(fp32 or the weight dtype), as Megatron's DDP allocates, or a get_main_grad() that "
                        "provides one before backward (Megatron-FSDP)"
                    )
        # TE: with fuse_wgrad_accumulation the first microbatch overwrites main_grad (None: accumulate), and so
        # does every microbatch of a weight marked overwrite_main_grad (Megatron-FSDP); read at forward, as TE.
        accumulate = True if is_first_microbatch is None else not is_first_microbatch
        if getattr(weights[0], "overwrite_main_grad", False):
            accumulate = False
        bias = None if self.return_bias else self._stacked_bias()
        recipe = _fp8.current_recipe()
        self.fp8 = recipe is not None
        if recipe is not None:
            out = self._fp8_forward(x, splits, weights, bias, recipe, is_first_microbatch, fuse, accumulate)
            out = out.reshape(*lead, self.out_features)
            if self.return_bias:
                bs = self._biases()
                return out, (None if bs is None else (bs[0] if self.single_grouped_bias else bs))
            return out
        defer = None
        if self.delay_wgrad_compute and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            queue = self._wgrad_queue
            with_bias = bias is not None and bias.requires_grad

            def defer(a, dy, splits_, fuse=fuse, accumulate=accumulate, with_bias=with_bias):
                queue.append((a, dy, splits_, fuse, accumulate, with_bias, None))

        out = grouped_gemm_autograd(x, weights, splits, bias=bias, fuse_main_grad=fuse, accumulate=accumulate,
                                    defer=defer)
        out = out.reshape(*lead, self.out_features)
        if self.return_bias:
            bs = self._biases()
            return out, (None if bs is None else (bs[0] if self.single_grouped_bias else bs))
        return out

    def _fp8_forward(self, x, splits, weights, bias, recipe, is_first_microbatch, fuse, accumulate):
        """The FP8 path (under ``moe_graph.fp8.autocast`` or TE's ``fp8_autocast``). The weights are quantized
        once per step: ``is_first_microbatch=False`` reuses the copies quantized by the step's first microbatch
        (TE's weight caching); True or None quantizes them again. With ``delay_wgrad_compute`` the backward queues
        the columnwise copy of ``x`` and ``dy`` for :meth:`backward_dw`, which runs the FP8 wgrad."""
        if recipe.kind == "blockwise" and x.dtype == torch.float64:
            raise TypeError("GroupedLinear: FP8 needs fp32, bf16 or fp16 inputs, got float64")
        self._fp8_recipe = recipe
        cache = getattr(self, "_fp8_step_cache", None)
        gathered = gathered_fp8_weight(weights, recipe)
        if gathered is not None:  # quantized by the optimizer's step (fp8_param_gather)
            cache = (recipe, gathered)
        elif is_first_microbatch is not False or cache is None or cache[0] != recipe:
            with torch.no_grad():
                w3 = weights[0] if self.single_grouped_weight else torch.stack([w.detach() for w in weights])
                cache = (recipe, _fp8.quantize_weight(w3.detach().contiguous(), recipe))
            self._fp8_step_cache = cache
        defer = None
        if self.delay_wgrad_compute and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            queue = self._wgrad_queue
            with_bias = bias is not None and bias.requires_grad

            def defer(xt, dy, splits_, fuse=fuse, accumulate=accumulate, with_bias=with_bias, recipe=recipe):
                queue.append((xt, dy, splits_, fuse, accumulate, with_bias, recipe))

        return _Fp8GroupedLinear.apply(x, splits, recipe, cache[1], bias, fuse, accumulate, defer, None, None,
                                       *weights)

    # ------------------------------------------------------------------------------- delayed weight grads --
    def need_backward_dw(self) -> bool:
        """Whether :meth:`backward_dw` must run to finish the weight gradients (``delay_wgrad_compute``)."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Register ``hook()`` to run at the end of each :meth:`backward_dw` (TE's API; DDP's grad-ready hooks)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        """Run the registered hooks (TE's API; Megatron calls it for fused TE ops that ran ``backward_dw``)."""
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def backward_dw(self) -> None:
        """Run the oldest queued weight-gradient GEMM (one per backward since the last call) and deliver the bias
        gradients (TE delivers them here in delayed mode), then trigger the hooks.

        Fused (``fuse_wgrad_accumulation``): into ``weight.main_grad`` (added, or written for the first
        microbatch / ``overwrite_main_grad``) with ``grad_added_to_main_grad`` set. Otherwise added to
        ``weight.grad`` (set when None or still backward's zero placeholder), as autograd would; bias gradients are
        added to ``bias.grad`` the same way (TE sets them only when None, dropping later microbatches'). A call
        with nothing queued does nothing. Sync-free and capturable like the backward.
        """
        if not self.delay_wgrad_compute or not self._wgrad_queue:
            return
        a, dy, splits, fuse, accumulate, with_bias, recipe = self._wgrad_queue.popleft()
        weights = self._weights()
        with torch.no_grad():
            if recipe is not None:  # FP8: a = the columnwise copy of x saved by the forward
                _deliver_fp8_dw(weights, dy, splits, recipe, a, fuse, accumulate)
            elif fuse:
                grouped_gemm_wgrad(a, dy, splits, out=[resolve_main_grad(w) for w in weights], accumulate=accumulate)
                for w in weights:
                    w.grad_added_to_main_grad = True
            else:
                dw = grouped_gemm_wgrad(a, dy, splits)  # [E, out, in]
                for w, g in zip(weights, [dw] if self.single_grouped_weight else dw.unbind(0)):
                    _add_grad(w, g)
            if with_bias:
                db = grouped_bias_grad(dy, splits)
                biases = self._biases()
                for b, g in zip(biases, [db] if self.single_grouped_bias else db.unbind(0)):
                    _add_grad(b, g)
        del a, dy, splits
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    # --------------------------------------------------------------------------------- TE base-module surface --
    # Megatron's TEGroupedLinear subclasses TE's GroupedLinear and reads these in its checkpoint hooks
    # (merge_extra_states, _split_extra_state); with them it subclasses this class unchanged. ``fp8`` is set by
    # each forward (inside an FP8 autocast or not), as TE's modules do.
    fp8 = False
    fp8_calibration = False
    _fp8_recipe = None

    @property
    def fp8_meta(self) -> dict:
        return {"fp8_checkpoint": self._fp8_recipe is not None, "recipe": self._fp8_recipe}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE API: nothing to initialize without fp8."""
        del num_gemms

    def _decode_extra_state(self, state):
        return state

    # --------------------------------------------------------------------------------------- state dict I/O --
    def get_extra_state(self) -> torch.Tensor:
        """TE's ``_extra_state``: the FP8 metadata as pickled bytes in a uint8 tensor (TE's encoding), here the
        recipe (block and current scaling keep no scales between steps); empty for a layer never run in FP8."""
        if self._fp8_recipe is None:
            return torch.empty(0, dtype=torch.uint8)
        r = self._fp8_recipe
        state = {"recipe": {"kind": r.kind, "fp8_format": r.fp8_format, "power_2_scale": r.power_2_scale,
                            "amax_epsilon": r.amax_epsilon}, "moe_graph_fp8": 1}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Restores the recipe saved by :meth:`get_extra_state` (an empty tensor or None: nothing); TE's own
        metadata (a recipe object) is mapped with ``moe_graph.fp8.as_recipe``; delayed-scaling amax histories
        are dropped (moe_graph runs them as current scaling)."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return None
        if isinstance(state, torch.Tensor):
            state = pickle.loads(state.detach().cpu().numpy().tobytes())
        elif hasattr(state, "getvalue"):  # TE's older io.BytesIO form
            state = torch.load(state, weights_only=False)
        r = state.get("recipe") if isinstance(state, dict) else None
        if isinstance(r, dict):
            self._fp8_recipe = _fp8.Recipe(**r)
        elif r is not None:
            self._fp8_recipe = _fp8.as_recipe(r)
        return None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, transactional for this layer: every layout loads (see the class doc);
        an expert-count or shape mismatch, or (``strict``) missing/unexpected keys or real biases for a
        ``bias=False`` layer, raise before any parameter is written."""
        self._strict_load = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            del self._strict_load

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Converts between TE's per-expert layout (weight0.., bias0..) and the single grouped layout, validating
        # everything (expert count, shapes, keys) before anything is copied: on an error nothing of this layer is
        # written and torch's load_state_dict raises with the messages. torch passes strict=True here always;
        # the caller's strictness is known when this layer's own load_state_dict was called (None: via a parent).
        strict = getattr(self, "_strict_load", None)
        E = self.num_gemms
        own = {k[len(prefix):] for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]}
        errors: List[str] = []
        converted = {}
        for kind, single, wanted in (("weight", self.single_grouped_weight, True), ("bias", self.single_grouped_bias, self.use_bias)):
            indexed = sorted(int(n[len(kind):]) for n in own if n[len(kind):].isdigit() and n.startswith(kind))
            grouped = kind in own
            if not wanted:  # bias=False: TE writes no bias (or empty tensors); a real bias is not dropped silently
                names = [kind] * grouped + [f"{kind}{i}" for i in indexed]
                real = [n for n in names if not (isinstance(state_dict[prefix + n], torch.Tensor) and state_dict[prefix + n].numel() == 0)]
                for n in names:
                    state_dict.pop(prefix + n)
                if real and strict:
                    errors.append(f"the checkpoint has biases {real} but the layer was built with bias=False")
                else:  # reported (raises under a strict load through a parent), never dropped silently
                    unexpected_keys.extend(prefix + n for n in real)
                continue
            if grouped and indexed:
                errors.append(f"the checkpoint has both {kind!r} and {kind}{indexed[0]}.. (one layout expected)")
                continue
            if grouped:
                t = state_dict.pop(prefix + kind)
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != E:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    errors.append(f"{prefix}{kind} has shape {shape}: expected {E} experts (num_gemms={E}) in dim 0")
                    continue
                parts = list(t.unbind(0))
            elif indexed:
                if indexed != list(range(E)):
                    errors.append(
                        f"the checkpoint has {kind}{{i}} for experts {indexed}, the layer has num_gemms={E} "
                        f"(experts 0..{E - 1})")
                    for i in indexed:
                        state_dict.pop(f"{prefix}{kind}{i}")
                    continue
                parts = [state_dict.pop(f"{prefix}{kind}{i}") for i in range(E)]
            else:
                continue  # missing: reported below
            if single:
                if not all(isinstance(x, torch.Tensor) for x in parts) or len({tuple(x.shape) for x in parts}) != 1:
                    errors.append(f"{prefix}{kind}{{i}} have different shapes")
                    continue
                converted[kind] = torch.stack(parts) if not grouped else t
            else:
                converted.update({f"{kind}{e}": x for e, x in enumerate(parts)})
        for i in range(1, E):  # TE's dist-checkpoint per-expert fp8 metadata (none here)
            state_dict.pop(f"{prefix}_extra_state{i}", None)
        expected = {n: p for n, p in self._parameters.items() if p is not None}
        for n, t in converted.items():
            if n in expected and isinstance(t, torch.Tensor) and t.shape != expected[n].shape:
                errors.append(f"{prefix}{n}: checkpoint shape {tuple(t.shape)}, layer shape {tuple(expected[n].shape)}")
        missing = [prefix + n for n in expected if n not in converted]
        leftover = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]
                    and k[len(prefix):] not in expected and k[len(prefix):] != "_extra_state"]
        if errors:
            error_msgs.extend(f"GroupedLinear({prefix or 'root'}): {m}" for m in errors)
            for k in leftover:
                state_dict.pop(k)
            return
        if strict and (missing or leftover):
            missing_keys.extend(missing)
            unexpected_keys.extend(leftover)
            for k in leftover:
                state_dict.pop(k)
            return  # strict load fails: nothing written
        for n, t in converted.items():
            state_dict[prefix + n] = t
        state_dict.setdefault(f"{prefix}_extra_state", torch.empty(0, dtype=torch.uint8))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, delay_wgrad_compute={self.delay_wgrad_compute}"
        )
