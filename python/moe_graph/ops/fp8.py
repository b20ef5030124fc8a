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

from moe_graph.ops._lib import has_kernel, ops, require

__all__ = ["TILES", "quantize", "dequantize", "row_tile_capacity", "native_available", "scaled_grouped_gemm",
           "scaled_grouped_wgrad"]

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
             transpose: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` (rows grouped by ``m_splits [E]``) or ``x [B, M, K]`` to FP8 -> ``(q, scale)``.

    Args:
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
    return ops.fp8_quantize(x.contiguous(), m_splits, tr, tc, fp8_dtype, mx, float(eps), bool(pow2_scales), t)


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
    qf = q.float()
    if t:
        qf, scale = qf.transpose(-1, -2), scale.transpose(-1, -2)
    rows, cols = qf.shape[-2], qf.shape[-1]
    return qf * _expand(scale, rows, cols, tr, tc, m_splits)


def scaled_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                        m_splits: torch.Tensor, *, block_k: int, block_n: int, bias: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[r] = sum_kb (A[r, kb] . B[e, n, kb]) * a_scale[r, kb] * b_scale[e, n // block_n, kb] (+ bias[e])``:
    FP8 ``a [M, K]`` (rows grouped by ``m_splits``), ``b [E, N, K]``, fp32 or E8M0 scales; fp32 accumulation, one
    rounding to ``out_dtype``; rows past ``sum(m_splits)`` are zero (``csrc/fp8/scaled_gemm.h``)."""
    require()
    return ops.fp8_scaled_grouped_gemm(a, a_scale, b, b_scale, m_splits, int(block_k), int(block_n), bias, out_dtype)


def scaled_grouped_wgrad(a_t: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
                         m_splits: torch.Tensor, *, block_m: int, out: Optional[torch.Tensor] = None,
                         accumulate: bool = False) -> torch.Tensor:
    """``dW[e] (+)= sum_t (dy^T_t . x^T_t) * a_scale[:, t] * b_scale[:, t]`` over group ``e``'s tiles of
    ``block_m`` tokens: ``a_t = dy^T [N, M]``, ``b_t = x^T [K, M]`` (the columnwise copies) -> fp32 ``[E, N, K]``
    (``out``, e.g. a ``main_grad``, written or, with ``accumulate``, added to)."""
    require()
    if out is None:
        out = torch.empty((m_splits.shape[0], a_t.shape[0], b_t.shape[0]), dtype=torch.float32, device=a_t.device)
        accumulate = False
    ops.fp8_scaled_grouped_wgrad_out(a_t, a_scale, b_t, b_scale, m_splits, int(block_m), out, bool(accumulate))
    return out


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the op
        return

    @torch.library.register_fake(_OP)
    def _(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose):
        rows, cols = x.shape[-2], x.shape[-1]
        groups = 0 if m_splits is None else m_splits.shape[0]
        rt = row_tile_capacity(rows, groups, tile_rows)
        ct = 1 if tile_cols == 0 else -(-cols // tile_cols)
        lead = tuple(x.shape[:-2])
        q = x.new_empty(lead + ((cols, rows) if transpose else (rows, cols)), dtype=fp8_dtype)
        s = x.new_empty(lead + ((ct, rt) if transpose else (rt, ct)),
                        dtype=torch.float8_e8m0fnu if mx else torch.float32)
        return q, s

    @torch.library.register_fake("moe_graph::fp8_scaled_grouped_gemm")
    def _(a, a_scale, b, b_scale, m_splits, block_k, block_n, bias, out_dtype):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    @torch.library.register_fake("moe_graph::fp8_scaled_grouped_wgrad_out")
    def _(a_t, a_scale, b_t, b_scale, m_splits, block_m, out, accumulate):
        return None


_register()
