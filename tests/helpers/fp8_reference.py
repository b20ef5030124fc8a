"""Plain-PyTorch FP8 quantizers with TransformerEngine's reference semantics (an independent transcription of
``tests/pytorch/references/`` in TransformerEngine: ``quantize_scale_calc.scale_from_amax_tensor``, the blockwise
1x128 / 128x128 reference, the per-tensor current-scaling reference) and of its MXFP8 quantizer, computed in float64
(TE's C++ test reference ``tests/cpp/operator/test_cast_mxfp8.cu`` ``compute_ref``: ``float_to_e8m0(block_amax *
max_reciprocal())`` then ``x * exp2f_rcp(e)``; ``float_to_e8m0`` / ``exp2f_rcp`` in ``tests/cpp/test_common.h``
lines 480-513 and the kernels' ``ptx::exp2f_rcp<float>`` in ``transformer_engine/common/util/ptx.cuh`` lines
305-317, read at TE commit d0067d0: the multiplier is ``2^(127 - e)`` for every ``e`` up to 253, ``e == 0``
included (``2^127``, since TE PR #2647; before it ``exp2f_rcp(0)`` was 1 and such blocks came out zero), ``2^-127``
for ``e == 254`` and NaN for 255). Host loops over the expert groups: test oracles only, never on a hot path.

Non-finite input follows moe_graph's documented rule (docs/fp8.md), which is TE's on +-inf: a NaN in a tile makes
its amax NaN (TE's ``std::max`` / ``fmaxf`` would skip it), so its scale is NaN and every byte of the tile is 0x7F;
every NaN byte is the canonical 0x7F (the GPU's ``cvt.rn.satfinite``; torch and x86 keep a NaN's sign bit, and
x86's ``inf * 0`` is -NaN) and a NaN fp32 scale is the canonical +NaN.

Every function returns ``(q, scale)`` in moe_graph's layout (see ``moe_graph.ops.fp8``): compact scales
(``[rows / TR, cols / TC]`` per group, groups stacked), no cuBLAS padding or transposition of the scales.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["scale_from_amax", "quantize_tiles", "quantize_mxfp8", "quantize_grouped", "dequantized", "PLAN",
           "QDQLinear", "qdq_linear", "qdq_swiglu_mlp"]


def _to_fp8(v: torch.Tensor, quant_dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even cast (``v`` fp32 or float64 with exact values), NaN -> canonical 0x7F."""
    fp8_max = torch.finfo(quant_dtype).max
    q = v.clamp(-fp8_max, fp8_max).to(quant_dtype).view(torch.uint8)
    return torch.where(v.isnan(), torch.full_like(q, 0x7F), q).view(quant_dtype)


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` with every NaN replaced by +NaN 0x7FC00000."""
    nan = torch.tensor(0x7FC00000, dtype=torch.int32).view(torch.float32)
    return torch.where(t.isnan(), nan, t)


def scale_from_amax(amax: torch.Tensor, quant_dtype: torch.dtype, *, eps: float, pow2_scales: bool,
                    inf_value: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) from an fp32 amax: TE's rule (``inf_value``: what an infinite scale becomes)."""
    fp8_max = torch.finfo(quant_dtype).max
    amax = torch.maximum(amax, torch.tensor(eps, dtype=torch.float32))
    scale = torch.div(torch.tensor(fp8_max, dtype=torch.float32), amax)
    scale = torch.where(scale == float("inf"), torch.tensor(inf_value, dtype=torch.float32), scale)
    if pow2_scales:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - 1)
        scale = torch.where(amax == float("inf"), torch.zeros_like(scale), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return _canonical_nan(scale), _canonical_nan(torch.reciprocal(scale))


def _pad_to(x: torch.Tensor, tr: int, tc: int) -> torch.Tensor:
    m, k = x.shape
    return torch.nn.functional.pad(x, (0, (-k) % tc, 0, (-m) % tr))


def quantize_tiles(x: torch.Tensor, quant_dtype: torch.dtype, tr: int, tc: int, *, eps: float = 0.0,
                   pow2_scales: bool = False, per_tensor: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """One matrix ``[M, K]`` in tiles ``tr x tc`` (0: the whole extent), zero-padded partial tiles, fp32 scales.
    Returns ``(q [M, K], scale_inv [ceil(M/tr), ceil(K/tc)])``."""
    m, k = x.shape
    tr_ = tr or max(m, 1)
    tc_ = tc or max(k, 1)
    inf_value = torch.finfo(torch.float32 if per_tensor else x.dtype).max
    xp = _pad_to(x.float(), tr_, tc_)  # |x| and x * scale are exact / rounded once in fp32 either way
    mp, kp = xp.shape
    tiled = xp.reshape(mp // tr_, tr_, kp // tc_, tc_)
    if tiled.numel():
        amax = tiled.abs().amax(dim=(1, 3)).float()
    else:  # an empty group keeps its one per-tensor scale (amax 0); empty blockwise groups have no tiles
        amax = torch.zeros(1 if per_tensor else mp // tr_, 1 if per_tensor else kp // tc_)
        return x.to(quant_dtype), scale_from_amax(amax, quant_dtype, eps=eps, pow2_scales=pow2_scales,
                                                  inf_value=torch.finfo(torch.float32).max)[1]
    scale, scale_inv = scale_from_amax(amax, quant_dtype, eps=eps, pow2_scales=pow2_scales, inf_value=inf_value)
    q = _to_fp8(tiled * scale[:, None, :, None], quant_dtype)
    return q.reshape(mp, kp)[:m, :k].contiguous(), scale_inv


def _e8m0_te(v: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0`` (``cvt.rp.satfinite.ue8m0x2.f32``) of fp32 ``v >= 0``, from its definition rather than
    its bits: the biased exponent of the smallest power of two >= v, clamped to [0, 254] (v <= 2^-127 gives 0,
    v > 2^127 and inf saturate to 254), 0 for 0, 255 for NaN. uint8."""
    mant, ex = torch.frexp(v.double())  # v = mant * 2^ex, mant in [0.5, 1)
    k = torch.where(mant == 0.5, ex - 1, ex).to(torch.int64)  # ceil(log2(v))
    e = (k + 127).clamp(0, 254)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 255), e)
    return e.to(torch.uint8)


def _exp2f_rcp_te(e: torch.Tensor) -> torch.Tensor:
    """TE's ``exp2f_rcp``: the float64 factor ``2^(127 - e)`` (e == 0: 2^127, e == 254: 2^-127), NaN for 255."""
    f = torch.exp2(127.0 - e.to(torch.float64))
    return torch.where(e == 255, torch.full_like(f, float("nan")), f)


def quantize_mxfp8(x: torch.Tensor, quant_dtype: torch.dtype, block: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 rowwise: ``[M, K]`` in 1 x ``block`` blocks -> ``(q [M, K], E8M0 [M, ceil(K/block)])``. The block
    amax (NaN-propagating) times fp32 ``1 / fp8_max`` is rounded to fp32 as TE computes it (the float64 product of
    two fp32 values is exact, one rounding to fp32); ``x * 2^(127 - e)`` is exact in float64."""
    m, k = x.shape
    xp = _pad_to(x.double(), 1, block)
    tiled = xp.reshape(m, xp.shape[1] // block, block)
    amax = tiled.abs().amax(dim=-1) if tiled.numel() else torch.zeros(m, xp.shape[1] // block, dtype=torch.float64)
    rcp = float(torch.tensor(1.0 / torch.finfo(quant_dtype).max, dtype=torch.float32))  # Quantized_Limits::max_reciprocal
    e = _e8m0_te((amax * rcp).float())
    q = _to_fp8(tiled * _exp2f_rcp_te(e)[..., None], quant_dtype)
    return q.reshape(m, xp.shape[1])[:, :k].contiguous(), e.view(torch.float8_e8m0fnu)


def _quantize_one(x: torch.Tensor, quant_dtype: torch.dtype, tiles: str, eps: float, pow2_scales: bool):
    if tiles == "1x128":
        return quantize_tiles(x, quant_dtype, 1, 128, eps=eps, pow2_scales=pow2_scales)
    if tiles == "128x1":  # columnwise: 1x128 tiles of x^T
        return quantize_tiles(x.t().contiguous(), quant_dtype, 1, 128, eps=eps, pow2_scales=pow2_scales)
    if tiles == "128x128":
        return quantize_tiles(x, quant_dtype, 128, 128, eps=eps, pow2_scales=pow2_scales)
    if tiles == "tensor":
        return quantize_tiles(x, quant_dtype, 0, 0, eps=eps, pow2_scales=pow2_scales, per_tensor=True)
    if tiles == "1x32":
        return quantize_mxfp8(x, quant_dtype)
    if tiles == "32x1":
        return quantize_mxfp8(x.t().contiguous(), quant_dtype)
    raise ValueError(tiles)


def quantize_grouped(x: torch.Tensor, m_splits: Optional[Sequence[int]], tiles: str,
                     quant_dtype: torch.dtype = torch.float8_e4m3fn, *, eps: float = 0.0, pow2_scales: bool = False,
                     row_tiles: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """moe_graph's grouped layout from the per-group references: each group quantized on its own, scales stacked
    group after group (``row_tiles`` rows, the rest 1), rows past ``sum(m_splits)`` zero. ``x [B, M, K]``
    (without ``m_splits``) quantizes each batch entry."""
    if x.dim() == 3:
        outs = [quantize_grouped(xb, None, tiles, quant_dtype, eps=eps, pow2_scales=pow2_scales) for xb in x]
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    m, k = x.shape
    transposed = tiles in ("128x1", "32x1")
    mx = tiles in ("1x32", "32x1")
    splits: List[int] = [m] if m_splits is None else [int(s) for s in m_splits]
    qs, ss = [], []
    start = 0
    for s in splits:
        q, sc = _quantize_one(x[start:start + s], quant_dtype, tiles, eps, pow2_scales)
        qs.append(q)
        ss.append(sc.t() if transposed else sc)  # scale rows follow the groups' row tiles
        start += s
    used = start
    q = torch.cat(qs, dim=1 if transposed else 0)
    pad = torch.zeros((k, m - used) if transposed else (m - used, k), dtype=quant_dtype)
    q = torch.cat([q, pad], dim=1 if transposed else 0)
    scale = torch.cat(ss, dim=0)
    if row_tiles is not None and row_tiles > scale.shape[0]:
        one = torch.full((row_tiles - scale.shape[0], scale.shape[1]), 127 if mx else 1.0,
                         dtype=torch.uint8 if mx else torch.float32)
        scale = torch.cat([scale.view(torch.uint8) if mx else scale, one], dim=0)
        scale = scale.view(torch.float8_e8m0fnu) if mx else scale
    if transposed:
        scale = scale.t().contiguous()
    return q.contiguous(), scale.contiguous()


# ------------------------------------------------------------------------------ quantize-dequantize oracle --
# Which tiles each recipe quantizes with (TE's Float8BlockScaling / MXFP8BlockScaling / Float8CurrentScaling):
# (rowwise activations/gradients, weight forward copy, weight dgrad copy, columnwise activations/gradients)
PLAN = {"blockwise": ("1x128", "128x128", "128x128", "128x1"), "mxfp8": ("1x32", "1x32", "32x1", "32x1"),
        "tensor": ("tensor", "tensor", "tensor", "tensor")}


def dequantized(x: torch.Tensor, tiles: str, quant_dtype: torch.dtype, pow2_scales: bool = True) -> torch.Tensor:
    """float64 ``dequantize(quantize(x))`` of ONE matrix ``x [m, k]`` (one expert group, rows in GEMM order) with
    the reference quantizers above: ``"128x1"`` / ``"32x1"`` are tiles along the rows (the columnwise copies)."""
    if tiles in ("1x32", "32x1"):
        xx = x if tiles == "1x32" else x.t()
        q, e = quantize_mxfp8(xx.contiguous(), quant_dtype)
        s = torch.exp2(e.view(torch.uint8).double() - 127).repeat_interleave(32, 1)[:, :xx.shape[1]]
        d = q.double() * s
        return d if tiles == "1x32" else d.t()
    if tiles == "tensor":
        q, s = quantize_tiles(x, quant_dtype, 0, 0, pow2_scales=pow2_scales, per_tensor=True)
        return q.double() * s.double().reshape(())
    tr, tc = {"1x128": (1, 128), "128x128": (128, 128), "128x1": (1, 128)}[tiles]
    xx = x.t().contiguous() if tiles == "128x1" else x
    q, s = quantize_tiles(xx, quant_dtype, tr, tc, pow2_scales=pow2_scales)
    s = s.double().repeat_interleave(tr, 0)[:xx.shape[0]].repeat_interleave(tc, 1)[:, :xx.shape[1]]
    d = q.double() * s
    return d.t() if tiles == "128x1" else d


class QDQLinear(torch.autograd.Function):
    """``y = x @ w^T`` of ONE expert group (``x [m, K]``, rows in the order they reach the GEMM; ``w [N, K]``) with
    TE-reference quantize-dequantize of every GEMM operand, products in float64, results in ``x``'s / ``w``'s
    dtype: forward ``Q(x, rows) Q(w)^T``, dgrad ``Q(dy, rows) Q(w, dgrad copy)``, wgrad ``Q(dy, cols)^T Q(x, cols)``
    (the columnwise tiles run over this group's rows only). ``kind``: a :data:`PLAN` key; forward operands in
    ``fwd_dtype``, gradients in ``bwd_dtype`` (E5M2 for TE's HYBRID format)."""

    @staticmethod
    def forward(ctx, x, w, kind, fwd_dtype, bwd_dtype, pow2):
        rows, wt, _, _ = PLAN[kind]
        ctx.save_for_backward(x, w)
        ctx.cfg = (kind, fwd_dtype, bwd_dtype, pow2)
        if x.shape[0] == 0:
            return x.new_zeros(0, w.shape[0])
        return (dequantized(x, rows, fwd_dtype, pow2) @ dequantized(w, wt, fwd_dtype, pow2).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        kind, fd, bd, pow2 = ctx.cfg
        rows, _, wd, cols = PLAN[kind]
        if x.shape[0] == 0:
            return torch.zeros_like(x), torch.zeros_like(w), None, None, None, None
        dx = (dequantized(dy, rows, bd, pow2) @ dequantized(w, wd, fd, pow2)).to(x.dtype)
        dw = (dequantized(dy, cols, bd, pow2).t() @ dequantized(x, cols, fd, pow2)).to(w.dtype)
        return dx, dw, None, None, None, None


def qdq_linear(x: torch.Tensor, w: torch.Tensor, recipe) -> torch.Tensor:
    """:class:`QDQLinear` with a recipe object (``kind``, ``fwd_dtype``, ``bwd_dtype``, ``power_2_scale``)."""
    return QDQLinear.apply(x, w, recipe.kind, recipe.fwd_dtype, recipe.bwd_dtype, recipe.power_2_scale)


def qdq_swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, recipe,
                   row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One expert group's MLP in FP8: ``fc1`` (``w1 [2F, H]``: gate half then up half), ``silu(a) * b`` (times
    ``row_scale`` per row, one rounding to ``x``'s dtype, computed in float64), ``fc2`` (``w2 [H, F]``)."""
    h = qdq_linear(x, w1, recipe)
    a, b = h.double().chunk(2, dim=-1)
    mid = torch.nn.functional.silu(a) * b
    if row_scale is not None:
        mid = mid * row_scale.double()[:, None]
    return qdq_linear(mid.to(x.dtype), w2, recipe)
