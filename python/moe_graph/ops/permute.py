"""Row expansion and reduction over a route index: ``expand_rows`` / ``reduce_rows`` (differentiable, w.r.t. the
rows and the weights) over the native ops ``torch.ops.moe_graph.{expand_rows, reduce_rows, route_dot}`` (C++ on CPU,
CUDA kernels on GPU), their fake (meta) implementations, and a pure-torch path for builds without the ops.

Semantics (defined by the native ops, ``csrc/permute/permute.h``; the torch path here computes the same): ``n``
tokens with ``K`` routes each, ``m`` routed rows (e.g. an expert-input buffer). Route ``r = j*K + k`` is token
``j``'s ``k``-th route. Two index tensors describe one routing and are inverses of each other:

- ``route_rows [n, K]`` int64: the row of each route, ``m`` (the sentinel) for a route without a row;
- ``route_of_row [m]`` int64: the route of each row, ``n*K`` (the sentinel) for a padding row.

``expand_rows(src [n, H], route_of_row, route_rows, weights=None) -> [m, H]``: ``out[i] = w[r] * src[r // K]``
with ``r = route_of_row[i]`` (no weights: an exact copy), a zero row for the sentinel.
``reduce_rows(src [m, H], route_rows, route_of_row, weights=None) -> [n, H]``: ``out[j] = sum_k w[j, k] *
src[route_rows[j, k]]``, ``k`` ascending, accumulated in float32 (float64 for float64 data) from ``+0``, the
sentinel skipped. Output dtype = ``src``'s; ``weights [n, K]`` in ``src``'s dtype or float32. The two are adjoint:
each one's backward is the other with the same weights, the weights' gradient is ``route_dot`` (a dot product per
route); no atomics anywhere, deterministic. A permutation is ``K = 1``.

Indices outside ``[0, sentinel]``: a ``RuntimeError`` naming the argument on the CPU; on CUDA they read as the
sentinel and set the device error flag's ``INDEX_OUT_OF_RANGE`` bit (``moe_graph.check_errors()``): no sync,
capturable.

``expand_quantize(src, route_of_row, route_rows, m_splits, recipe)``: the FP8 expert input straight from the tokens
(``torch.ops.moe_graph.expand_quantize_pair``, ``csrc/permute/expand_quantize.h``): the rowwise and the per-group
columnwise copy of ``expand_rows(src, route_of_row, route_rows)``, bit-equal to ``ops.fp8.quantize_pair`` of it,
without the 16-bit expanded rows in memory; its input gradient is ``expand_rows``' (``reduce_rows``, no weights).
FP8 dispatch's two ops (the same native family): ``expand_pack`` (``expand_quantize_pack``: the send rows quantized
and packed with their scales, ``ops.fp8.pack_rows``' layout) and ``expand_quantize_packed`` (``expand_quantize_pair``
with ``packed_cols``: the expert input's rowwise copy gathered from the packed rows, its columnwise copy quantized
from their dequantized values).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_graph.ops import fp8 as _fp8
from moe_graph.ops._lib import has_kernel
from moe_graph.ops.reroute import real_host_values

__all__ = ["expand_rows", "reduce_rows", "route_dot", "native_available", "expand_quantize",
           "expand_quantize_available", "expand_quantize_copies", "expand_pack", "expand_quantize_packed",
           "expand_pack_available"]

_EXPAND = "moe_graph::expand_rows"
_REDUCE = "moe_graph::reduce_rows"
_DOT = "moe_graph::route_dot"
_EXPAND_QUANTIZE = "moe_graph::expand_quantize_pair"
_EXPAND_PACK = "moe_graph::expand_quantize_pack"


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def native_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has the permute ops for ``device_type`` ("cpu" or "cuda")."""
    return has_kernel(_EXPAND, device_type) and has_kernel(_REDUCE, device_type) and has_kernel(_DOT, device_type)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------- the torch path (no build) --
def _checked_index(index: torch.Tensor, sentinel: int, op: str, name: str) -> torch.Tensor:
    """``index`` with values outside ``[0, sentinel]`` replaced by the sentinel; on eager CPU values such a value
    raises instead (the native ops' rule)."""
    bad = (index < 0) | (index > sentinel)
    if index.device.type == "cpu" and real_host_values(index) and bool(bad.any()):
        pos = int(bad.reshape(-1).nonzero()[0])
        raise RuntimeError(f"{op}: {name} holds {int(index.reshape(-1)[pos])} at flat position {pos}, outside "
                           f"[0, {sentinel}] ({sentinel} is the sentinel)")
    return torch.where(bad, sentinel, index)


def _expand_torch(src, route_of_row, K: int, weights=None):
    n, H = src.shape
    r = _checked_index(route_of_row, n * K, "expand_rows", "route_of_row")
    rows = torch.where(r == n * K, n, torch.div(r, max(K, 1), rounding_mode="floor"))
    out = torch.cat([src, src.new_zeros(1, H)]).index_select(0, rows)
    if weights is None:
        return out
    acc = _acc_dtype(src.dtype)
    w = torch.cat([weights.reshape(-1).to(acc), weights.new_zeros(1, dtype=acc)]).index_select(0, r)
    return (w[:, None] * out.to(acc)).to(src.dtype)


def _gather_routes(src, route_rows):
    """``[n, K, H]`` in the accumulation dtype: the row of each route, zeros for the sentinel."""
    m, H = src.shape
    n, K = route_rows.shape
    acc = _acc_dtype(src.dtype)
    ext = torch.cat([src.to(acc), src.new_zeros(1, H, dtype=acc)])
    return ext.index_select(0, route_rows.reshape(-1)).view(n, K, H)


def _reduce_torch(src, route_rows, weights=None):
    m, H = src.shape
    n, K = route_rows.shape
    g = _gather_routes(src, _checked_index(route_rows, m, "reduce_rows", "route_rows"))
    acc = torch.zeros(n, H, dtype=g.dtype, device=src.device)
    for k in range(K):  # k ascending, as the native op
        acc = acc + (g[:, k] if weights is None else weights[:, k:k + 1].to(g.dtype) * g[:, k])
    return acc.to(src.dtype)


def _route_dot_torch(rows, src, route_rows):
    g = _gather_routes(src, _checked_index(route_rows, src.shape[0], "route_dot", "route_rows"))
    return (rows.to(g.dtype)[:, None, :] * g).sum(-1)


# ------------------------------------------------------------------------------------------ dispatch per op --
def _expand(src, route_of_row, K: int, weights=None):
    if native_available(src.device.type):
        return torch.ops.moe_graph.expand_rows(src, route_of_row, K, weights)
    return _expand_torch(src, route_of_row, K, weights)


def _reduce(src, route_rows, weights=None):
    if native_available(src.device.type):
        return torch.ops.moe_graph.reduce_rows(src, route_rows, weights)
    return _reduce_torch(src, route_rows, weights)


def _route_dot(rows, src, route_rows):
    if native_available(rows.device.type):
        return torch.ops.moe_graph.route_dot(rows, src, route_rows)
    return _route_dot_torch(rows, src, route_rows)


# --------------------------------------------------------------------------------------------------- autograd --
class _ExpandRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, route_of_row, route_rows, weights, handoff):
        ctx.save_for_backward(src if ctx.needs_input_grad[3] else None, route_rows, weights)
        ctx.handoff = handoff
        return _expand(src, route_of_row, route_rows.shape[1], weights)

    @staticmethod
    def backward(ctx, g):
        src, route_rows, weights = ctx.saved_tensors
        g = g.contiguous()
        handoff = ctx.handoff
        grad_src = None
        if ctx.needs_input_grad[0] and handoff is not None:  # one route, no weights: a gather from +0 (GradHandoff)
            copies = expand_quantize_copies(g, route_rows.reshape(-1), 1, handoff.m_splits, handoff.recipe,
                                            handoff.recipe.bwd_dtype, plus_zero=True)
            grad_src = handoff.give(copies, (route_rows.shape[0], g.shape[1]), g, lambda: _reduce(g, route_rows))
        elif ctx.needs_input_grad[0]:
            grad_src = _reduce(g, route_rows, weights)
        grad_w = _route_dot(src, g, route_rows).to(weights.dtype) if ctx.needs_input_grad[3] else None
        return grad_src, None, None, grad_w, None


class _ReduceRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, route_rows, route_of_row, weights, handoff):
        ctx.save_for_backward(src if ctx.needs_input_grad[3] else None, route_rows, route_of_row, weights)
        ctx.handoff = handoff
        return _reduce(src, route_rows, weights)

    @staticmethod
    def backward(ctx, g):
        src, route_rows, route_of_row, weights = ctx.saved_tensors
        g = g.contiguous()
        K, handoff = route_rows.shape[1], ctx.handoff
        grad_src = None
        if ctx.needs_input_grad[0] and handoff is not None:  # src's gradient as its FP8 copies (GradHandoff)
            copies = expand_quantize_copies(g, route_of_row, K, handoff.m_splits, handoff.recipe,
                                            handoff.recipe.bwd_dtype, weights)
            grad_src = handoff.give(copies, (route_of_row.shape[0], g.shape[1]), g,
                                    lambda: _expand(g, route_of_row, K, weights))
        elif ctx.needs_input_grad[0]:
            grad_src = _expand(g, route_of_row, K, weights)
        grad_w = _route_dot(g, src, route_rows).to(weights.dtype) if ctx.needs_input_grad[3] else None
        return grad_src, None, None, grad_w, None


def _check_args(op: str, src, a, a_name: str, a_dim: int, b, b_name: str, b_dim: int, weights) -> None:
    if not isinstance(src, torch.Tensor) or src.dim() != 2:
        raise ValueError(f"{op}: src must be a 2-D tensor, got {getattr(src, 'shape', type(src).__name__)}")
    for t, name, dim in ((a, a_name, a_dim), (b, b_name, b_dim)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype != torch.int64:
            raise ValueError(f"{op}: {name} must be a {dim}-D int64 tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}")
    if weights is not None and not isinstance(weights, torch.Tensor):
        raise ValueError(f"{op}: weights must be a tensor [n, K] or None, got {type(weights).__name__}")


def expand_rows(src: torch.Tensor, route_of_row: torch.Tensor, route_rows: torch.Tensor,
                weights: Optional[torch.Tensor] = None, grad_handoff: Optional["_fp8.GradHandoff"] = None
                ) -> torch.Tensor:
    """``[m, H]``: row ``i`` is ``weights[r] * src[r // K]`` for ``r = route_of_row[i]`` (a copy without weights),
    zero for ``r == n*K``. ``src [n, H]``; ``route_of_row [m]`` and ``route_rows [n, K]`` int64, the two inverse
    indices of one routing (``K = route_rows.shape[1]``; ``route_rows`` serves the backward, a ``reduce_rows`` of
    the gradient). Differentiable w.r.t. ``src`` and ``weights``.

    Example: ``src = [[a], [b]]`` (n=2, K=2), ``route_of_row = [3, 0, 4]`` -> ``[[b], [a], [0]]``
    (``route_rows = [[1, 3], [3, 0]]``: routes 1 and 2 have no row, sentinel m=3).

    ``grad_handoff`` (an ``ops.fp8.GradHandoff`` bound to ``src``, the FP8 GEMM output it stands for; ``K = 1``, no
    weights; needs :func:`expand_quantize_available`): backward writes ``src``'s gradient (``reduce_rows`` of the
    gradient over ``route_rows``: each row a gather added to ``+0``) as its two FP8 copies for that GEMM's backward
    (:func:`expand_quantize_copies` with ``plus_zero``: the bytes of quantizing the 16-bit gradient, ``-0`` read
    as ``+0`` as the sum does) and hands autograd a zero-stride zero: the combine's backward at EP > 1."""
    _check_args("expand_rows", src, route_of_row, "route_of_row", 1, route_rows, "route_rows", 2, weights)
    if route_rows.shape[0] != src.shape[0]:
        raise ValueError(f"expand_rows: route_rows must have shape [n, K] with n = {src.shape[0]} (the rows of src), "
                         f"got {tuple(route_rows.shape)}")
    if grad_handoff is not None and not (route_rows.shape[1] == 1 and weights is None and grad_handoff.binds(src)
                                         and expand_quantize_available(src.device.type)):
        raise ValueError("expand_rows: grad_handoff needs K = 1 (route_rows [n, 1]), no weights, to be bound to src "
                         "(GradHandoff.bind) and the expand_quantize op (expand_quantize_available)")
    return _ExpandRows.apply(src, route_of_row, route_rows, weights, grad_handoff)


def reduce_rows(src: torch.Tensor, route_rows: torch.Tensor, route_of_row: torch.Tensor,
                weights: Optional[torch.Tensor] = None, grad_handoff: Optional["_fp8.GradHandoff"] = None
                ) -> torch.Tensor:
    """``[n, H]``: row ``j`` is ``sum_k weights[j, k] * src[route_rows[j, k]]`` (``k`` ascending, float32
    accumulation for 16-bit data; a plain sum without weights), routes equal to ``m`` skipped. ``src [m, H]``;
    ``route_rows [n, K]`` and ``route_of_row [m]`` int64, the two inverse indices of one routing (``route_of_row``
    serves the backward, an ``expand_rows`` of the gradient). Differentiable w.r.t. ``src`` and ``weights``.

    ``grad_handoff`` (an ``ops.fp8.GradHandoff`` bound to ``src``, the FP8 GEMM output it stands for; needs
    :func:`expand_quantize_available`): backward writes ``src``'s gradient as its two FP8 copies for that GEMM's
    backward (:func:`expand_quantize_copies` of the gradient, the weights applied and rounded to its dtype before
    quantizing: the bytes of quantizing the 16-bit gradient) and hands autograd a zero-stride zero; the weights'
    gradient is unchanged."""
    _check_args("reduce_rows", src, route_rows, "route_rows", 2, route_of_row, "route_of_row", 1, weights)
    if route_of_row.shape[0] != src.shape[0]:
        raise ValueError(f"reduce_rows: route_of_row must have shape [m] with m = {src.shape[0]} (the rows of src), "
                         f"got {tuple(route_of_row.shape)}")
    if grad_handoff is not None and not (grad_handoff.binds(src) and expand_quantize_available(src.device.type)):
        raise ValueError("reduce_rows: grad_handoff must be bound to src (GradHandoff.bind) and needs the "
                         "expand_quantize op (expand_quantize_available)")
    return _ReduceRows.apply(src, route_rows, route_of_row, weights, grad_handoff)


def route_dot(rows: torch.Tensor, src: torch.Tensor, route_rows: torch.Tensor) -> torch.Tensor:
    """``[n, K]`` in the accumulation dtype: ``out[j, k] = <rows[j], src[route_rows[j, k]]>`` (0 for the sentinel
    ``m``), the weights' gradient of :func:`reduce_rows` (the same native op; not differentiable)."""
    _check_args("route_dot", rows, route_rows, "route_rows", 2, route_rows, "route_rows", 2, None)
    return _route_dot(rows.contiguous(), src.contiguous(), route_rows)


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def expand_quantize_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has :func:`expand_quantize`'s op (and the row ops) for ``device_type``."""
    return native_available(device_type) and has_kernel(_EXPAND_QUANTIZE, device_type)


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def expand_pack_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has :func:`expand_pack` and :func:`expand_quantize_packed`'s ops for
    ``device_type`` (FP8 dispatch's fused send and receive ops)."""
    return expand_quantize_available(device_type) and has_kernel(_EXPAND_PACK, device_type)


def _pair_tiles(recipe) -> Tuple[int, int, int, int, bool]:
    """``(rowwise tile rows, cols, columnwise tile rows, cols, mx)``: ``ops.fp8.quantize_pair``'s tiles."""
    tr, tc, mx, _ = _fp8.TILES[_fp8.row_tiles(recipe)]
    ctr, ctc, _, _ = _fp8.TILES[_fp8._PLANS[recipe.kind][3]]  # quantize_columns' tiles
    return tr, tc, ctr, ctc, mx


def expand_quantize_copies(src: torch.Tensor, route_of_row: Optional[torch.Tensor], K: int, m_splits: torch.Tensor,
                           recipe, dtype: torch.dtype, weights: Optional[torch.Tensor] = None, plus_zero: bool = False):
    """``((q, scale per row), (q_t, scale_t))``: ``ops.fp8.quantize_pair(expand_rows(src, route_of_row, .., weights),
    m_splits, recipe, dtype)`` bit for bit from one op that reads each row of ``src`` in place (the expanded rows
    are never in memory); ``route_of_row`` None: the rows of ``src`` as they are (``K`` 1, no index read);
    ``weights [n, K]`` (``src``'s dtype or fp32) or None; ``plus_zero`` (no weights, ``K = 1``): each element read
    as ``+0 + x``, the rows of ``reduce_rows(src, route_rows [m, 1])`` (``-0`` becomes ``+0``; ``route_of_row`` is
    then ``route_rows`` flattened). Not differentiable."""
    tr, tc, ctr, ctc, mx = _pair_tiles(recipe)
    with torch.no_grad():
        q, s, qt, st = torch.ops.moe_graph.expand_quantize_pair(
            src.detach(), route_of_row, K, m_splits, [tr, tc, ctr, ctc], dtype, mx, float(recipe.amax_epsilon),
            bool(recipe.power_2_scale), None if weights is None else weights.detach(), 0, plus_zero)
    if recipe.kind == "tensor":  # the scales' layouts of ops.fp8.quantize_pair (one per row / per column)
        st = st.expand(qt.shape[0], st.shape[1]).contiguous()
    return (q, _fp8._row_scales(s, m_splits, q.shape[0], recipe.kind)), (qt, st)


def expand_quantize(src: torch.Tensor, route_of_row: torch.Tensor, route_rows: torch.Tensor,
                    m_splits: torch.Tensor, recipe) -> "_fp8.QuantizedRows":
    """The expert input in FP8 written straight from the tokens: ``expand_rows(src, route_of_row, route_rows)``
    (no weights) quantized rowwise (the first expert GEMM's input) and columnwise per group of ``m_splits`` (its
    wgrad's input) under ``recipe`` (``ops.fp8.Recipe``, its forward dtype), the results of
    ``ops.fp8.quantize_pair`` of those rows bit for bit, by one op that reads each token row in place: the 16-bit
    expanded rows are never written nor read back (:func:`expand_quantize_copies`). Returns a ``QuantizedRows``
    (``columns`` set) that ``grouped_linear.fp8_grouped_linear`` reads as is; its carrier takes the input gradient
    ``[m, H]`` back to ``src`` as ``expand_rows``' backward does (``reduce_rows`` over ``route_rows``, no weights).
    Needs :func:`expand_quantize_available`. Sync-free; the same index rules as :func:`expand_rows` (an
    out-of-range index raises on the CPU, reads as the sentinel and sets ``INDEX_OUT_OF_RANGE`` on CUDA)."""
    _check_args("expand_quantize", src, route_of_row, "route_of_row", 1, route_rows, "route_rows", 2, None)
    if route_rows.shape[0] != src.shape[0]:
        raise ValueError(f"expand_quantize: route_rows must have shape [n, K] with n = {src.shape[0]} (the rows of "
                         f"src), got {tuple(route_rows.shape)}")
    (q, s), columns = expand_quantize_copies(src, route_of_row, route_rows.shape[1], m_splits, recipe,
                                             recipe.fwd_dtype)
    rows = _fp8.carrier(src, route_of_row.shape[0], lambda g: _reduce(g, route_rows))
    return _fp8.QuantizedRows(rows, q, s, recipe.kind, columns)


def expand_pack(src: torch.Tensor, route_of_row: Optional[torch.Tensor], K: int, recipe) -> torch.Tensor:
    """FP8 dispatch's send rows in one op: ``ops.fp8.pack_rows(expand_rows(src, route_of_row, ...))`` bit for bit,
    ``uint8 [m, B]`` (``route_of_row [m]`` over ``n*K`` routes of ``src [n, H]``, the sentinel ``n*K`` an all-zero
    row; ``None``: the rows of ``src`` themselves, ``K`` 1), without the expanded or the quantized rows in memory.
    Not differentiable (FP8 dispatch's carrier takes the gradient home); needs :func:`expand_quantize_available`."""
    _fp8.check_row_local(recipe)
    if route_of_row is not None:
        _check_args("expand_pack", src, route_of_row, "route_of_row", 1, route_of_row, "route_of_row", 1, None)
    return torch.ops.moe_graph.expand_quantize_pack(src.detach(), route_of_row, K, recipe.fwd_dtype,
                                                    recipe.kind == "mxfp8", float(recipe.amax_epsilon),
                                                    bool(recipe.power_2_scale))


def expand_quantize_packed(packed: torch.Tensor, route_of_row: Optional[torch.Tensor], K: int,
                           m_splits: torch.Tensor, recipe, carrier: torch.Tensor) -> "_fp8.QuantizedRows":
    """The FP8 expert input from packed FP8 rows (``ops.fp8.pack_rows`` / :func:`expand_pack`, e.g. as they arrived
    from the exchange) in one op: row ``i`` is packed row ``route_of_row[i] // K`` (the sentinel: a zero row; None:
    packed row ``i``, ``K`` 1, e.g. a receive buffer already in the expert rows' layout), its
    rowwise copy the row's own bytes and scales (``ops.fp8.unpack_rows`` of the gathered rows), its per-group
    columnwise copy (``m_splits``) quantized from the dequantized rows, bit-equal to ``ops.fp8.quantize_columns``
    with ``x_scale`` (what the first FP8 GEMM would compute from ``unpack_rows``' rows). ``carrier`` ``[m, H]``:
    the returned ``QuantizedRows``' autograd path (``ops.fp8.carrier``)."""
    H = carrier.shape[1]
    _fp8.check_row_local(recipe)
    if route_of_row is not None:
        _check_args("expand_quantize_packed", packed, route_of_row, "route_of_row", 1, route_of_row, "route_of_row",
                    1, None)
    tr, tc, ctr, ctc, mx = _pair_tiles(recipe)
    q, s, qt, st = torch.ops.moe_graph.expand_quantize_pair(packed, route_of_row, K, m_splits, [tr, tc, ctr, ctc],
                                                            recipe.fwd_dtype, mx, float(recipe.amax_epsilon),
                                                            bool(recipe.power_2_scale), None, H)
    return _fp8.QuantizedRows(carrier, q, s, recipe.kind, (qt, st))


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the ops
        return

    @torch.library.register_fake(_EXPAND)
    def _(src, route_of_row, K, weights=None):
        torch._check(src.dim() == 2, lambda: "expand_rows: src must be a 2-D tensor [n, H]")
        torch._check(route_of_row.dim() == 1, lambda: "expand_rows: route_of_row must be a 1-D tensor [m]")
        return src.new_empty((route_of_row.shape[0], src.shape[1]))

    @torch.library.register_fake(_REDUCE)
    def _(src, route_rows, weights=None):
        torch._check(src.dim() == 2, lambda: "reduce_rows: src must be a 2-D tensor [m, H]")
        torch._check(route_rows.dim() == 2, lambda: "reduce_rows: route_rows must be a 2-D tensor [n, K]")
        return src.new_empty((route_rows.shape[0], src.shape[1]))

    if has_kernel(_EXPAND_QUANTIZE, "cpu"):
        @torch.library.register_fake(_EXPAND_QUANTIZE)
        def _(src, route_of_row, K, m_splits, tiles, fp8_dtype, mx, eps, pow2, weights=None, packed_cols=0,
              plus_zero=False):
            m, H = (src.shape[0] if route_of_row is None else route_of_row.shape[0]), packed_cols or src.shape[1]
            scale_dtype = torch.float8_e8m0fnu if mx else torch.float32
            out = []
            for tr, tc, transpose in ((tiles[0], tiles[1], False), (tiles[2], tiles[3], True)):
                rt, ct = _fp8.row_tile_capacity(m, m_splits.shape[0], tr), 1 if tc == 0 else -(-H // tc)
                out.append(src.new_empty((H, m) if transpose else (m, H), dtype=fp8_dtype))
                out.append(src.new_empty((ct, rt) if transpose else (rt, ct), dtype=scale_dtype))
            return tuple(out)

    if has_kernel(_EXPAND_PACK, "cpu"):
        @torch.library.register_fake(_EXPAND_PACK)
        def _(src, route_of_row, K, fp8_dtype, mx, eps, pow2):
            m, H = (src.shape[0] if route_of_row is None else route_of_row.shape[0]), src.shape[1]
            return src.new_empty((m, H + (-(-H // 32) if mx else 4 * -(-H // 128))), dtype=torch.uint8)

    @torch.library.register_fake(_DOT)
    def _(rows, src, route_rows):
        torch._check(route_rows.dim() == 2, lambda: "route_dot: route_rows must be a 2-D tensor [n, K]")
        return rows.new_empty(tuple(route_rows.shape), dtype=_acc_dtype(rows.dtype))


_register()
