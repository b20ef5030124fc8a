"""FP8 quantization in tiles, per expert group: ``quantize`` over the native op ``torch.ops.moe_graph.fp8_quantize``
(C++ on CPU, a CUDA kernel on GPU; semantics in ``csrc/fp8/quantize.h``) and its fake (meta) implementation.

One op covers TransformerEngine's recipes (``TILES`` names them):

* ``"1x128"`` / ``"128x1"``: ``Float8BlockScaling`` activations and gradients, rowwise copy and the columnwise copy
  (tiles of 128 rows, written transposed for wgrad), fp32 ``scale_inv`` (TE's ``pow_2_scales`` and ``eps``);
* ``"128x128"``: ``Float8BlockScaling`` weights (``[E, N, K]``: one block grid per expert);
* ``"1x32"`` / ``"32x1"``: ``MXFP8BlockScaling``, E8M0 scales (``torch.float8_e8m0fnu``);
* ``"tensor"``: ``Float8CurrentScaling``, one fp32 scale per expert group.

Tiles restart at every group of ``m_splits`` (a device tensor: no host sync, capturable); a partial tile is
quantized as if padded with zeros. Rows past ``sum(m_splits)`` get ``q = 0``; scale entries of no tile hold 1.
Scales: ``[row_tiles, col_tiles]`` with a static ``row_tiles`` (:func:`row_tile_capacity`), group ``g``'s tiles
following those of the groups before it (``ceil(m_h / TR)`` each). ``transpose=True`` writes ``q`` as ``[K, M]``
and the scales as ``[col_tiles, row_tiles]``. Dequantize with :func:`dequantize`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_graph.ops._lib import available, has_kernel, ops, require
from moe_graph.ops.activation import gated_kind

__all__ = ["TILES", "quantize", "dequantize", "row_tile_capacity", "native_available", "scaled_grouped_gemm",
           "scaled_grouped_wgrad", "Recipe", "Float8BlockScaling", "MXFP8BlockScaling", "Float8CurrentScaling",
           "DelayedScaling", "as_recipe", "autocast", "current_recipe", "quantize_rows", "quantize_columns",
           "quantize_weight", "gemm_blocks", "row_tiles", "QuantizedRows", "carrier", "pack_rows", "unpack_rows", "packed_row_bytes",
           "nonfinite_flag", "quantize_pair", "quantize_activation", "GradHandoff"]

_OP = "moe_graph::fp8_quantize"

# name -> (tile rows, tile cols, E8M0 scales, written transposed)
TILES = {
    "1x128": (1, 128, False, False),
    "128x1": (128, 1, False, True),
    "128x128": (128, 128, False, False),
    "1x32": (1, 32, True, False),
    "32x1": (32, 1, True, True),
    "tensor": (0, 0, False, False),
}


@torch.compiler.assume_constant_result
def native_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has the FP8 quantizer for ``device_type``."""
    return has_kernel(_OP, device_type)


def row_tile_capacity(rows: int, groups: int, tile_rows: int) -> int:
    """Scale rows for ``rows`` rows in ``groups`` groups (0: no m_splits) of tiles of ``tile_rows`` rows."""
    if tile_rows == 0:
        return max(groups, 1)
    per = -(-rows // tile_rows)
    return per if groups == 0 else min(per + groups, rows)


def quantize(x: torch.Tensor, m_splits: Optional[torch.Tensor] = None, *, tiles: str = "1x128",
             fp8_dtype: torch.dtype = torch.float8_e4m3fn, eps: float = 0.0, pow2_scales: bool = False,
             transpose: Optional[bool] = None, x_scale: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` (rows grouped by ``m_splits [E]``) or ``x [B, M, K]`` to FP8 -> ``(q, scale)``.

    Args:
        x_scale: ``x`` is itself FP8 ``[M, K]`` with these rowwise scales (``[M, ceil(K / 128)]`` fp32 scale_inv:
            1x128 tiles; ``[M, ceil(K / 32)]`` E8M0: 1x32): requantized from :func:`dequantize`'s fp32 values in
            one pass, without them in memory (the columnwise copy of FP8-dispatched rows).
        tiles: a key of :data:`TILES` (``"1x128"``, ``"128x1"``, ``"128x128"``, ``"1x32"``, ``"32x1"``, ``"tensor"``).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        eps, pow2_scales: TE's amax epsilon and power-of-two scales (fp32 scales only).
        transpose: override the layout of ``tiles`` (``"128x128"`` with ``transpose=True`` is the weight's
            columnwise copy, ``[E, K, N]`` with transposed block scales).
    """
    if tiles not in TILES:
        raise ValueError(f"tiles must be one of {sorted(TILES)}, got {tiles!r}")
    tr, tc, mx, t = TILES[tiles]
    if transpose is not None:
        t = bool(transpose)
    if isinstance(m_splits, (list, tuple)):
        m_splits = torch.tensor(m_splits, dtype=torch.int64, device=x.device)
    require()
    return ops.fp8_quantize(x.contiguous(), m_splits, tr, tc, fp8_dtype, mx, float(eps), bool(pow2_scales), t,
                            None if x_scale is None else x_scale.contiguous())


def nonfinite_flag(device) -> Optional[torch.Tensor]:
    """The FP8 quantizers' non-finite flag of ``device``: an int32 ``[1]`` device tensor (an alias of the flag, not
    a copy) that every quantizer op sets to 1 when a tile's amax is inf or NaN (no host sync). The distributed
    optimizer's inf/nan check reads it with the gradients and clears it, so such a step is skipped on every rank
    (:meth:`moe_graph.distributed.optimizer.DistributedOptimizer.step`); other loops may read and ``zero_()`` it
    themselves. It accumulates until cleared. ``None`` without the compiled extension. The first call on a CUDA
    device must run outside graph capture (it allocates the flag, as the first quantize does)."""
    if not available():
        return None
    return ops.fp8_nonfinite_flag(torch.empty(0, device=device))


def _expand(scale: torch.Tensor, rows: int, cols: int, tr: int, tc: int, m_splits: Optional[torch.Tensor],
            ) -> torch.Tensor:
    """Per-element fp32 factors [rows, cols] of a non-transposed scale grid (batched: leading dims kept)."""
    s = scale.float()  # E8M0 bytes decode to their powers of two
    col_idx = torch.arange(cols, device=scale.device) // tc if tc else torch.zeros(cols, dtype=torch.long,
                                                                                    device=scale.device)
    if m_splits is None:
        row_idx = torch.arange(rows, device=scale.device) // tr if tr else torch.zeros(rows, dtype=torch.long,
                                                                                      device=scale.device)
    else:
        m = m_splits.long().clamp(min=0)
        ends = torch.cumsum(m, 0)
        starts = ends - m
        tiles = torch.ones_like(m) if tr == 0 else (m + tr - 1) // tr
        tile_start = torch.cumsum(tiles, 0) - tiles
        r = torch.arange(rows, device=scale.device)
        g = torch.searchsorted(ends, r, right=True).clamp(max=m.numel() - 1)
        local = r - starts[g]
        row_idx = tile_start[g] + (local // tr if tr else 0)
        row_idx = torch.where(r < ends[-1], row_idx, torch.zeros_like(row_idx)) if m.numel() else r * 0
    return s[..., row_idx, :][..., :, col_idx]


def dequantize(q: torch.Tensor, scale: torch.Tensor, m_splits: Optional[torch.Tensor] = None, *,
               tiles: str = "1x128", transpose: Optional[bool] = None) -> torch.Tensor:
    """fp32 ``decode(q) * scale`` in ``x``'s layout ``[.., M, K]`` (a transposed ``q`` is transposed back).
    Rows past ``sum(m_splits)`` dequantize to 0. Plain torch ops, no host sync."""
    tr, tc, _, t = TILES[tiles]
    if transpose is not None:
        t = bool(transpose)
    if tr == 1 and not t and m_splits is None and q.dim() == 2 and tc and q.shape[1] % tc == 0:
        # row tiles (1x128, 1x32) of whole tiles: one broadcast multiply, no per-element factor tensor
        M, K = q.shape
        return (q.float().view(M, K // tc, tc) * scale.float().unsqueeze(-1)).view(M, K)
    qf = q.float()
    if t:
        qf, scale = qf.transpose(-1, -2), scale.transpose(-1, -2)
    rows, cols = qf.shape[-2], qf.shape[-1]
    return qf * _expand(scale, rows, cols, tr, tc, m_splits)


def _require_gemm(device_type: str) -> None:
    """The op has a kernel for ``device_type`` in this build (CUDA: a build with the CUTLASS kernels; which recipe
    runs on which GPU is the kernel's own check: Float8BlockScaling on sm_90, MXFP8 on sm_100, a clear error on
    other GPUs, E5M2 operands or unsupported shapes, see docs/fp8.md)."""
    require()
    if not has_kernel("moe_graph::fp8_scaled_grouped_gemm", device_type):
        raise NotImplementedError(f"moe_graph: the FP8 scaled grouped GEMM has no {device_type} kernel in this build "
                                  "(a CPU-only build, or one without CUTLASS: rebuild with CUDA for sm_90a / sm_100a)")


def scaled_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                        m_splits: torch.Tensor, *, block_k: int, block_n: int, bias: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[r] = sum_kb (A[r, kb] . B[e, n, kb]) * a_scale[r, kb] * b_scale[e, n // block_n, kb] (+ bias[e])``:
    FP8 ``a [M, K]`` (rows grouped by ``m_splits``), ``b [E, N, K]``, fp32 or E8M0 scales; fp32 accumulation, one
    rounding to ``out_dtype``; rows past ``sum(m_splits)`` are zero (``csrc/fp8/scaled_gemm.h``)."""
    _require_gemm(a.device.type)
    return ops.fp8_scaled_grouped_gemm(a, a_scale, b, b_scale, m_splits, int(block_k), int(block_n), bias, out_dtype)


def scaled_grouped_wgrad(a_t: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
                         m_splits: torch.Tensor, *, block_m: int, out: Optional[torch.Tensor] = None,
                         accumulate: bool = False) -> torch.Tensor:
    """``dW[e] (+)= sum_t (dy^T_t . x^T_t) * a_scale[:, t] * b_scale[:, t]`` over group ``e``'s tiles of
    ``block_m`` tokens: ``a_t = dy^T [N, M]``, ``b_t = x^T [K, M]`` (the columnwise copies) -> fp32 ``[E, N, K]``
    (``out``, e.g. a ``main_grad``, written or, with ``accumulate``, added to)."""
    _require_gemm(a_t.device.type)
    if out is None:
        out = torch.empty((m_splits.shape[0], a_t.shape[0], b_t.shape[0]), dtype=torch.float32, device=a_t.device)
        accumulate = False
    ops.fp8_scaled_grouped_wgrad_out(a_t, a_scale, b_t, b_scale, m_splits, int(block_m), out, bool(accumulate))
    return out


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the op
        return

    @torch.library.register_fake(_OP)
    def _(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose, x_scale=None):
        rows, cols = x.shape[-2], x.shape[-1]
        groups = 0 if m_splits is None else m_splits.shape[0]
        rt = row_tile_capacity(rows, groups, tile_rows)
        ct = 1 if tile_cols == 0 else -(-cols // tile_cols)
        lead = tuple(x.shape[:-2])
        q = x.new_empty(lead + ((cols, rows) if transpose else (rows, cols)), dtype=fp8_dtype)
        s = x.new_empty(lead + ((ct, rt) if transpose else (rt, ct)),
                        dtype=torch.float8_e8m0fnu if mx else torch.float32)
        return q, s

    @torch.library.register_fake("moe_graph::fp8_quantize_pair")
    def _(x, m_splits, tiles, fp8_dtype, mx, eps, pow2, activation, alpha, limit, row_scale, grad_y=None,
          grad_scale=None):
        rows = x.shape[0]
        forward_act = activation is not None and grad_y is None and gated_kind(activation)
        cols = x.shape[1] // 2 if forward_act else x.shape[1]  # grad_y: the backward's grad_h, like h
        groups = 0 if m_splits is None else m_splits.shape[0]
        sd = torch.float8_e8m0fnu if mx else torch.float32
        rt0, rt1 = row_tile_capacity(rows, groups, tiles[0]), row_tile_capacity(rows, groups, tiles[2])
        ct0 = 1 if tiles[1] == 0 else -(-cols // tiles[1])
        ct1 = 1 if tiles[3] == 0 else -(-cols // tiles[3])
        return (x.new_empty((rows, cols), dtype=fp8_dtype), x.new_empty((rt0, ct0), dtype=sd),
                x.new_empty((cols, rows), dtype=fp8_dtype), x.new_empty((ct1, rt1), dtype=sd))

    @torch.library.register_fake("moe_graph::fp8_nonfinite_flag")
    def _(device_like):
        return torch.empty(1, dtype=torch.int32, device=device_like.device)

    @torch.library.register_fake("moe_graph::fp8_scaled_grouped_gemm")
    def _(a, a_scale, b, b_scale, m_splits, block_k, block_n, bias, out_dtype):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    @torch.library.register_fake("moe_graph::fp8_scaled_grouped_wgrad_out")
    def _(a_t, a_scale, b_t, b_scale, m_splits, block_m, out, accumulate):
        return None


_register()


# --------------------------------------------------------------------------------------- recipes, autocast --
# moe_graph's equivalents of TransformerEngine's recipe objects (``transformer_engine.common.recipe``); TE's own
# objects are accepted wherever these are (``as_recipe``). ``fp8_format``: "E4M3" (every tensor in E4M3) or
# "HYBRID" (E4M3 forward, E5M2 gradients), as TE's ``Format``.
import contextlib as _contextlib
import dataclasses as _dataclasses
import threading as _threading
import weakref as _weakref


@_dataclasses.dataclass(frozen=True)
class Recipe:
    """One FP8 recipe: ``kind`` "blockwise" (1x128 activations/gradients, 128x128 weights, fp32 scales), "mxfp8"
    (1x32 blocks, E8M0 scales) or "tensor" (one scale per expert group / per expert weight)."""

    kind: str = "blockwise"
    fp8_format: str = "E4M3"
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if self.kind not in ("blockwise", "mxfp8", "tensor"):
            raise ValueError(f"Recipe.kind must be 'blockwise', 'mxfp8' or 'tensor', got {self.kind!r}")
        if self.fp8_format not in ("E4M3", "HYBRID"):
            raise ValueError(f"Recipe.fp8_format must be 'E4M3' or 'HYBRID', got {self.fp8_format!r}")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "HYBRID" else torch.float8_e4m3fn


def Float8BlockScaling(fp8_format: str = "E4M3", power_2_scale: bool = True, amax_epsilon: float = 0.0) -> Recipe:
    """TE's ``Float8BlockScaling`` (DeepSeek-V3's recipe; Megatron's ``--fp8-recipe blockwise``)."""
    return Recipe("blockwise", fp8_format, power_2_scale, amax_epsilon)


def MXFP8BlockScaling(fp8_format: str = "E4M3") -> Recipe:
    """TE's ``MXFP8BlockScaling`` (Megatron's ``--fp8-recipe mxfp8``)."""
    return Recipe("mxfp8", fp8_format, True, 0.0)


def Float8CurrentScaling(fp8_format: str = "HYBRID", power_2_scale: bool = False, amax_epsilon: float = 0.0) -> Recipe:
    """TE's ``Float8CurrentScaling`` (Megatron's ``--fp8-recipe tensorwise``): one scale per expert group."""
    return Recipe("tensor", fp8_format, power_2_scale, amax_epsilon)


def DelayedScaling(fp8_format: str = "HYBRID", **_ignored) -> Recipe:
    """TE's ``DelayedScaling``, run as current scaling (the amax of this step instead of an amax history: no
    history to keep in the graph; TE's margin / history options are ignored)."""
    return Recipe("tensor", fp8_format, False, 0.0)


def as_recipe(recipe) -> Recipe:
    """A :class:`Recipe` from one of ours, TE's recipe objects (by class name and fields), a kind string or
    Megatron's ``fp8_recipe`` names ("blockwise", "mxfp8", "tensorwise", "delayed")."""
    if recipe is None:
        return Float8BlockScaling()
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return {"blockwise": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "tensorwise": Float8CurrentScaling,
                "tensor": Float8CurrentScaling, "delayed": DelayedScaling}[recipe]()
    name = type(recipe).__name__
    fmt = getattr(getattr(recipe, "fp8_format", None), "name", None) or "E4M3"
    fmt = "HYBRID" if fmt == "HYBRID" else "E4M3"
    q = getattr(recipe, "fp8_quant_fwd_inp", None)
    pow2 = bool(getattr(q, "power_2_scale", True)) if q is not None else None
    eps = float(getattr(q, "amax_epsilon", 0.0)) if q is not None else 0.0
    if name == "Float8BlockScaling":
        return Recipe("blockwise", fmt, True if pow2 is None else pow2, eps)
    if name == "MXFP8BlockScaling":
        return Recipe("mxfp8", fmt, True, 0.0)
    if name == "Float8CurrentScaling":
        return Recipe("tensor", fmt, False if pow2 is None else pow2, eps)
    if name == "DelayedScaling":
        return Recipe("tensor", fmt, False, 0.0)
    raise ValueError(f"unsupported FP8 recipe {name} (moe_graph runs Float8BlockScaling, MXFP8BlockScaling, "
                     "Float8CurrentScaling and DelayedScaling)")


_STATE = _threading.local()


@_contextlib.contextmanager
def autocast(enabled: bool = True, recipe=None):
    """``with moe_graph.fp8.autocast(recipe=Float8BlockScaling()):`` runs ``GroupedLinear`` layers (and the MoE
    layers built on them) in FP8 (TE's ``fp8_autocast(enabled, fp8_recipe)``); nests, restores on exit."""
    prev = getattr(_STATE, "recipe", None)
    _STATE.recipe = as_recipe(recipe) if enabled else None
    try:
        yield
    finally:
        _STATE.recipe = prev


def current_recipe() -> Optional[Recipe]:
    """The recipe of the innermost active :func:`autocast` (or of TE's ``fp8_autocast`` when TE is importable),
    else None."""
    r = getattr(_STATE, "recipe", None)
    if r is not None:
        return r
    manager = _te_state_manager()
    if manager is not None and manager.is_fp8_enabled():
        return as_recipe(manager.get_fp8_recipe())
    return None


_TE_MANAGER: list = []


def _te_state_manager():
    """TE's FP8GlobalStateManager when TE is importable (looked up once per process), else None."""
    if not _TE_MANAGER:
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
        except Exception:  # noqa: BLE001 - no TE here
            FP8GlobalStateManager = None
        _TE_MANAGER.append(FP8GlobalStateManager)
    return _TE_MANAGER[0]


# Which tiles / block sizes each recipe uses for the three GEMMs (forward, dgrad, wgrad).
_PLANS = {
    #          x / dy rows   weight      w^T (transpose=True)  wgrad columnwise  (BK, BN)    BM
    "blockwise": ("1x128", "128x128", "128x128", "128x1", (128, 128), 128),
    "mxfp8": ("1x32", "1x32", "32x1", "32x1", (32, 1), 32),
    "tensor": ("tensor", "tensor", "tensor", "tensor", (0, 0), 0),
}


def _row_scales(scale: torch.Tensor, m_splits: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """Per-tensor recipe: the per-group scale [E, 1] as one scale per row [M, 1] (sync-free gather)."""
    if kind != "tensor":
        return scale
    e = m_splits.shape[0]
    group = torch.searchsorted(torch.cumsum(m_splits.long(), 0), torch.arange(rows, device=scale.device),
                               right=True).clamp(max=max(e - 1, 0))
    return scale[group]


def quantize_rows(x: torch.Tensor, m_splits: torch.Tensor, recipe: Recipe, dtype: torch.dtype):
    """The rowwise copy of an activation / gradient [M, K] for the forward or dgrad GEMM -> (q, scale per row)."""
    q, s = quantize(x, m_splits, tiles=row_tiles(recipe), fp8_dtype=dtype, eps=recipe.amax_epsilon,
                    pow2_scales=recipe.power_2_scale)
    return q, _row_scales(s, m_splits, x.shape[0], recipe.kind)


def row_tiles(recipe: Recipe) -> str:
    """The recipe's tiles for the rowwise copies of activations and gradients (a :data:`TILES` key)."""
    return _PLANS[recipe.kind][0]


def quantize_columns(x: torch.Tensor, m_splits: torch.Tensor, recipe: Recipe, dtype: torch.dtype,
                     x_scale: Optional[torch.Tensor] = None):
    """The columnwise (transposed) copy [K, M] of an activation / gradient for the wgrad GEMM -> (q_t, scale_t).
    ``x_scale``: ``x`` is the rowwise FP8 copy with these scales (:func:`quantize`'s requantization)."""
    tiles = _PLANS[recipe.kind][3]
    q, s = quantize(x, m_splits, tiles=tiles, fp8_dtype=dtype, eps=recipe.amax_epsilon,
                    pow2_scales=recipe.power_2_scale, transpose=True, x_scale=x_scale)
    if recipe.kind == "tensor":
        s = s.expand(x.shape[1], s.shape[1]).contiguous()
    return q, s


def fuses_row_scale_gradient(recipe: Recipe) -> bool:
    """True when :func:`quantize_pair`'s fused activation backward can write the row-scale gradient under
    ``recipe`` (rowwise tiles of one row and at most 256 columns: Float8BlockScaling, MXFP8; not per-tensor
    scaling)."""
    rows, cols = TILES[_PLANS[recipe.kind][0]][:2]
    return rows == 1 and 1 <= cols <= 256


def quantize_pair(x: torch.Tensor, m_splits: torch.Tensor, recipe: Recipe, dtype: torch.dtype, *,
                  activation: Optional[str] = None, row_scale: Optional[torch.Tensor] = None,
                  swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, grad_y: Optional[torch.Tensor] = None,
                  grad_scale: Optional[torch.Tensor] = None):
    """Both copies of an activation / gradient ``x [M, K]`` from one op (one launch on CUDA, TE's cast-transpose):
    ``((q, scale per row), (q_t, scale_t))``, bit-equal to :func:`quantize_rows` and :func:`quantize_columns`.
    With ``activation`` (and ``row_scale``, ``swiglu_alpha``, ``swiglu_limit``: those of
    ``ops.activation.expert_activation``), ``x`` is the activation's input ``h`` and the copies are those of
    ``expert_activation(h, ...)``, computed per element from ``h`` without the activation's output in memory.
    With ``activation`` and ``grad_y`` (the activation output's gradient ``[M, F]``, ``h``'s dtype) the copies are
    those of the activation backward's ``grad_h`` (``[M, W]`` like ``h``; the first result of
    ``ops.expert_activation_backward(grad_y, h, row_scale, ...)``), computed per element from ``grad_y``, ``h`` and
    ``row_scale`` without ``grad_h`` in memory; with ``grad_scale`` too (``[M]``, ``row_scale``'s dtype, written:
    recipes whose rowwise tiles are one row, :func:`fuses_row_scale_gradient`) the same pass writes there the
    row-scale gradient, the second result of ``ops.expert_activation_backward`` (bit-equal on the CPU; on CUDA in
    the kernel's summation order, within fp32 summation rounding)."""
    kind = recipe.kind
    tr, tc, mx, _ = TILES[_PLANS[kind][0]]
    ctr, ctc, _, _ = TILES[_PLANS[kind][3]]
    require()
    q, s, qt, st = ops.fp8_quantize_pair(x.contiguous(), m_splits, [tr, tc, ctr, ctc], dtype, mx,
                                         float(recipe.amax_epsilon), bool(recipe.power_2_scale), activation,
                                         float(swiglu_alpha), float(swiglu_limit),
                                         None if row_scale is None else row_scale.contiguous(),
                                         None if grad_y is None else grad_y.contiguous(), grad_scale)
    if kind == "tensor":
        st = st.expand(qt.shape[0], st.shape[1]).contiguous()
    return (q, _row_scales(s, m_splits, x.shape[0], kind)), (qt, st)


def quantize_weight(w: torch.Tensor, recipe: Recipe):
    """Both copies of the expert weights ``[E, N, K]``: ``(q, scale)`` for the forward and ``(q_t, scale_t)``
    (``[E, K, N]``) for the dgrad GEMM."""
    _, tw, twt, _, _, _ = _PLANS[recipe.kind]
    kw = dict(fp8_dtype=recipe.fwd_dtype, eps=recipe.amax_epsilon, pow2_scales=recipe.power_2_scale)
    q, s = quantize(w, tiles=tw, **kw)
    if recipe.kind == "mxfp8":
        qt, st = quantize(w, tiles=twt, transpose=True, **kw)
    else:  # square blocks / one scale: the columnwise copy is the exact transpose
        qt, st = q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
    return q, s, qt, st


def gemm_blocks(recipe: Recipe) -> Tuple[int, int, int]:
    """(block_k, block_n, block_m) of the recipe's scaled GEMMs."""
    (bk, bn), bm = _PLANS[recipe.kind][4], _PLANS[recipe.kind][5]
    return bk, bn, bm


# --- FP8 dispatch: rows quantized before they move -------------------------------------------------------------
# The rowwise tiles of the "blockwise" (1x128) and "mxfp8" (1x32) recipes lie within one row, so a token quantized
# once at its source gives, row for row, the bytes the first expert GEMM would compute from its copy of the token:
# the token moves as its FP8 bytes followed by its scale bytes (``pack_rows`` / ``unpack_rows``).
ROW_LOCAL_KINDS = ("blockwise", "mxfp8")


@_dataclasses.dataclass
class QuantizedRows:
    """Expert-input rows quantized rowwise before the exchange (``MoELayer(fp8_dispatch=True)``): ``data [M, K]``
    FP8 and ``scale [M, K / tile]`` (fp32 ``scale_inv`` for "blockwise", E8M0 for "mxfp8"), which the first expert
    GEMM reads without requantizing (``grouped_linear.fp8_grouped_linear``), and ``carrier``: an ``[M, K]``
    zero-stride tensor of the activation dtype (no memory) through which autograd takes that GEMM's input gradient
    back to the source tokens."""

    carrier: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor
    kind: str
    columns: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # the wgrad's copy (q_t, scale_t), when made with
    # the rows (:func:`quantize_activation`); None: quantized from the rows (FP8 dispatch)

    @property
    def shape(self) -> torch.Size:
        return self.carrier.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.carrier.dtype

    @property
    def device(self) -> torch.device:
        return self.carrier.device


class _Carrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source, rows, grad_back):
        ctx.grad_back = grad_back
        return source.new_zeros(()).expand(rows, source.shape[1])

    @staticmethod
    def backward(ctx, g):
        return ctx.grad_back(g.contiguous()), None, None


def carrier(source: torch.Tensor, rows: int, grad_back) -> torch.Tensor:
    """A ``QuantizedRows.carrier``: an ``[rows, K]`` zero-stride tensor of ``source``'s dtype (no memory) standing for
    rows whose bytes moved outside autograd; backward hands its gradient ``[rows, K]`` to ``grad_back``, which maps
    it to ``source``'s gradient (e.g. the dispatch's reverse exchange and route sum)."""
    return _Carrier.apply(source, rows, grad_back)


class _ActivationCarrier(torch.autograd.Function):
    """The fused activation's autograd node: forward returns the carrier (no memory) and both FP8 copies of
    ``expert_activation(h, ...)``; backward is the activation's own backward (``grad_h``, ``grad_row_scale``)."""

    @staticmethod
    def forward(ctx, h, row_scale, m_splits, recipe, activation, alpha, limit):
        (q, s), (qt, st) = quantize_pair(h, m_splits, recipe, recipe.fwd_dtype, activation=activation,
                                         row_scale=row_scale, swiglu_alpha=alpha, swiglu_limit=limit)
        ctx.save_for_backward(h, row_scale)
        ctx.options = (activation, alpha, limit)
        ctx.mark_non_differentiable(q, s, qt, st)
        ctx.set_materialize_grads(False)  # no zero gradients written for the FP8 copies (None reaches backward)
        return h.new_zeros(()).expand(h.shape[0], q.shape[1]), q, s, qt, st

    @staticmethod
    def backward(ctx, g, *_):
        if g is None:  # the carrier got no gradient
            return (None,) * 7
        h, row_scale = ctx.saved_tensors
        grad_h, grad_scale = ops.expert_activation_backward(g.contiguous(), h, row_scale, *ctx.options)
        return grad_h, (grad_scale if row_scale is not None and ctx.needs_input_grad[1] else None), \
            None, None, None, None, None


def quantize_activation(h: torch.Tensor, m_splits: torch.Tensor, recipe: Recipe, activation: str,
                        row_scale: Optional[torch.Tensor] = None, *, swiglu_alpha: float = 1.702,
                        swiglu_limit: float = 7.0) -> QuantizedRows:
    """The fused producer of fc2's FP8 input: ``expert_activation(h, activation, row_scale, ...)`` quantized
    rowwise (fc2's forward) and columnwise (fc2's wgrad) in one op from ``h [M, 2F]`` / ``[M, F]`` (rows grouped
    by ``m_splits``), without the activation's 16-bit output in memory; the bytes equal quantizing that output.
    Returns a :class:`QuantizedRows` (``columns`` set) that ``grouped_linear.fp8_grouped_linear`` reads as is;
    gradients reach ``h`` and ``row_scale`` through the activation's backward."""
    carrier_, q, s, qt, st = _ActivationCarrier.apply(h.contiguous(), row_scale, m_splits, recipe, activation,
                                                      float(swiglu_alpha), float(swiglu_limit))
    return QuantizedRows(carrier_, q, s, recipe.kind, (qt, st))


class GradHandoff:
    """An FP8 GEMM's output gradient handed over as its two FP8 copies by the op that consumes the GEMM's output
    (fc2's ``dy`` from the combine's backward): made in the forward with the GEMM's ``recipe`` and ``m_splits``,
    bound to the GEMM's output (:meth:`bind`); the consumer's backward, when :meth:`binds` its input, writes the
    copies and returns :meth:`give`'s zero-stride gradient (no memory) instead of the 16-bit one; the GEMM's
    backward gets them with :meth:`take`. A gradient that is not exactly that zero-stride tensor (another consumer
    of the output summed its gradient into it) gets the consumer's 16-bit gradient added back instead (made then,
    from what :meth:`give` was handed): the result stays that of the 16-bit hand-off. One forward, one backward:
    :meth:`take` clears what was given."""

    def __init__(self, recipe: Recipe, m_splits: torch.Tensor):
        self.recipe, self.m_splits = recipe, m_splits
        self._output = None
        self._given = None  # (copies, zero-stride gradient, the 16-bit gradient's maker)

    def bind(self, output: torch.Tensor) -> None:
        """The GEMM's forward output, whose gradient this hand-off stands for (a weak reference: no cycle)."""
        self._output = _weakref.ref(output)

    def binds(self, t: torch.Tensor) -> bool:
        """True when ``t`` is the bound output itself (not a view, a copy nor a later op's result)."""
        return self._output is not None and self._output() is t

    def give(self, copies, shape, like: torch.Tensor, dense) -> torch.Tensor:
        """The consumer's backward: ``copies = ((q, scale per row), (q_t, scale_t))`` of its gradient for the
        output (``shape`` ``[M, N]``, ``like``'s dtype and device), ``dense()`` that gradient in 16 bits (the
        fallback). Returns the zero-stride zero gradient (no memory) to hand autograd."""
        zero = like.new_zeros(()).expand(*shape)
        self._given = (copies, zero, dense)
        return zero

    def take(self, dy: Optional[torch.Tensor]):
        """The GEMM's backward for its output gradient ``dy``: ``(copies, None)`` when ``dy`` is exactly
        :meth:`give`'s zero gradient, else ``(None, the gradient)``: ``dy`` itself when nothing was given, ``dy``
        plus the consumer's 16-bit gradient when ``dy`` holds other gradients summed into the given zero."""
        given, self._given = self._given, None
        if given is None:
            return None, dy
        copies, zero, dense = given
        if (dy is not None and dy.data_ptr() == zero.data_ptr() and dy.stride() == zero.stride()
                and dy.shape == zero.shape and dy.dtype == zero.dtype):
            return copies, None
        g = dense()
        return None, g if dy is None else dy + g


def check_row_local(recipe: Recipe) -> None:
    """Raises a ValueError unless ``recipe``'s activation tiles lie within one row (:data:`ROW_LOCAL_KINDS`)."""
    if recipe.kind not in ROW_LOCAL_KINDS:
        raise ValueError(f"FP8 dispatch needs a recipe whose activation tiles lie within a row ({ROW_LOCAL_KINDS}); "
                         f"got {recipe.kind!r} (per-tensor scales depend on every row of an expert's group)")


def packed_row_bytes(hidden: int, recipe: Recipe) -> int:
    """Bytes of one token on the wire under FP8 dispatch: ``hidden`` FP8 bytes and the row's scale bytes
    (``4 * ceil(hidden / 128)`` for "blockwise", ``ceil(hidden / 32)`` for "mxfp8")."""
    check_row_local(recipe)
    return hidden + (4 * -(-hidden // 128) if recipe.kind == "blockwise" else -(-hidden // 32))


def pack_rows(x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """``x [T, K]`` quantized rowwise (the recipe's forward tiles and dtype, TE's semantics) -> ``[T, B]`` uint8
    rows, each its FP8 bytes then its scale bytes (:func:`packed_row_bytes`). Sync-free."""
    check_row_local(recipe)
    if x.dim() != 2:
        raise ValueError(f"pack_rows: x must be [T, K], got shape {tuple(x.shape)}")
    q, s = quantize_rows(x, None, recipe, recipe.fwd_dtype)
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, carrier: torch.Tensor, recipe: Recipe) -> QuantizedRows:
    """Moved ``[M, B]`` uint8 rows (:func:`pack_rows`; all-zero padding rows dequantize to 0) -> ``QuantizedRows``
    with ``carrier [M, K]`` as the autograd path."""
    K = carrier.shape[1]
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape != (carrier.shape[0],
                                                                             packed_row_bytes(K, recipe)):
        raise ValueError(f"unpack_rows: packed must be uint8 [{carrier.shape[0]}, {packed_row_bytes(K, recipe)}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    scale_dtype = torch.float32 if recipe.kind == "blockwise" else torch.float8_e8m0fnu
    data = packed[:, :K].contiguous().view(recipe.fwd_dtype)
    scale = packed[:, K:].contiguous().view(scale_dtype)
    return QuantizedRows(carrier, data, scale, recipe.kind)
