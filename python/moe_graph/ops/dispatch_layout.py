"""The token dispatcher's index bookkeeping in native ops (C++ on CPU, CUDA kernels on GPU; semantics in
``csrc/permute/dispatch_layout.h``): :func:`dispatch_layout` turns the router's top-k indices into send slots and
counts, :func:`receive_layout` orders the rows a rank received by local expert, :func:`aligned_groups` regroups the
expert groups to aligned starts (the FP8 wgrad's). Integer outputs, no autograd; no host sync, capturable,
deterministic (stable counting sorts, no order-dependent atomics).

Layout. ``n = T * K`` routes (route ``r`` = token ``r // K``, choice ``r % K``) into ``C`` routing columns; column ``c``
goes to rank ``column_rank[c]`` as its local expert ``column_local[c]``. A route is *live* when valid (``valid`` mask)
and *kept* when among the first ``capacity`` live routes of its destination in drop order (``route_order``, a
permutation of the routes: the "probs" policy's probability order; ``None``: route order, the "position" policy). A
kept route goes to send slot ``destination * capacity + position``, positions ordered by (local expert, route): at
one rank the send buffer already is the expert input grouped by local expert, padding rows after the real ones.
Sentinels: ``route_slot == N`` (dropped or not live; ``N = R * capacity`` send slots), ``route_of_slot == n`` (empty
slot).

Aligned groups (``align``, the FP8 experts' 16-row group starts): at one rank ``dispatch_layout(..., align=a)`` lays
the send slots out as the aligned expert input itself, each local expert's group starting at a multiple of ``a`` rows
with zero rows after it, ``N =`` :func:`aligned_padded_rows` ``(capacity, Lc, a)`` slots, and returns the padded
counts (``aligned_counts``); at R > 1 ``receive_layout(..., align=a)`` does the same for the received rows. Both
equal :func:`aligned_groups` of the align-1 layout composed into its index maps, without the extra launches.

Quota mode (``dest_quota [R]``, the per-destination-capacity exchange of :mod:`moe_graph.moe.exchange`): destination
``d`` keeps its first ``max(dest_quota[d], 0)`` live routes in drop order instead of ``capacity``, and the send slots
are packed: ``N = n``, destination ``d``'s rows start after the kept rows of the destinations before it (no padding
between destinations, empty slots after the last kept route); ``capacity`` is not used.

Errors: a valid route whose index lies outside ``[0, C)``, table entries outside their range and a ``route_order``
that is no permutation raise on the CPU; on CUDA the device error flag's ``INDEX_OUT_OF_RANGE`` bit is set (the
route counts as not live; ``moe_graph.check_errors()`` reports it). Receive counts below 0 or past ``capacity`` per
source: CPU raises, CUDA sets ``NEGATIVE_SPLIT`` / ``SPLITS_OVERFLOW`` and clamps.

The native ops define the semantics; builds without them (or devices without a kernel) take a pure-torch path here
that computes the same outputs with stable sorts and scatters (sync-free; on eager CPU values it raises for a valid
route's index out of range and for bad receive counts, elsewhere it reads them as not live / clamped, unflagged).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from moe_graph.ops._lib import has_kernel
from moe_graph.ops.reroute import real_host_values

__all__ = ["aligned_groups", "aligned_padded_rows", "dispatch_layout", "receive_layout", "DispatchLayout",
           "ReceiveLayout", "native_available"]

_LAYOUT = "moe_graph::dispatch_layout"
_RECV = "moe_graph::receive_layout"
_ALIGN = "moe_graph::aligned_groups"


class DispatchLayout(NamedTuple):
    route_slot: torch.Tensor  # [T*K] int64 send slot of each route (R*capacity: dropped or not live)
    route_of_slot: torch.Tensor  # [R*capacity] int64 route in each send slot (T*K: empty)
    send_counts: torch.Tensor  # [R, num_local_columns] int64 kept routes per (destination, local expert)
    column_counts: torch.Tensor  # [C] int64 live routes per column (before drops)
    dropped: torch.Tensor  # 0-dim int64 live routes over the capacity
    aligned_counts: torch.Tensor  # [R, num_local_columns] int64 send_counts rounded up to a multiple of align


class ReceiveLayout(NamedTuple):
    expert_row_source: torch.Tensor  # [P] int64 receive row of each expert-input row (R*capacity: padding)
    recv_row_target: torch.Tensor  # [R*capacity] int64 expert-input row of each receive row (P: empty)
    m_splits: torch.Tensor  # [num_local_columns] int64 received rows per local expert
    aligned_m_splits: torch.Tensor  # [num_local_columns] int64 m_splits rounded up to a multiple of align


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def native_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has the layout ops (all three) for ``device_type`` ("cpu" or "cuda")."""
    return has_kernel(_LAYOUT, device_type) and has_kernel(_RECV, device_type) and has_kernel(_ALIGN, device_type)


def dispatch_layout(
    indices: torch.Tensor,
    column_rank: torch.Tensor,
    column_local: torch.Tensor,
    num_ep_ranks: int,
    num_local_columns: int,
    capacity: int,
    valid: Optional[torch.Tensor] = None,
    route_order: Optional[torch.Tensor] = None,
    counters: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    dest_quota: Optional[torch.Tensor] = None,
    align: int = 1,
) -> DispatchLayout:
    """Send slots of ``indices [T, K]`` (int32/int64) over the column tables ``column_rank`` / ``column_local``
    (``[C]`` int64); ``valid``: optional ``[T, K]`` bool; ``route_order``: optional ``[T*K]`` int64 drop order.
    ``counters``: optional ``(dropped_routes, step_dropped_routes, step_max_load_ratio)`` (one element each; int64,
    int64, float64) that take this call's drops (added) and largest load ratio (``max(ratio, max_d live_d * R / n)``)
    in place. ``dest_quota``: optional ``[R]`` int64 per-destination limits (quota mode: packed send slots, see the
    module docstring). ``align``: with ``align > 1`` (one rank, no ``dest_quota``) each local expert's group starts
    at a multiple of ``align`` send slots (``route_of_slot [aligned_padded_rows(capacity, Lc, align)]``);
    ``aligned_counts`` are the groups' padded rows (``send_counts`` rounded up; ``align = 1``: equal).

    Example (one rank, 3 experts, top-2, capacity 4)::

        indices = [[2, 0], [0, 1]]  ->  send slots ordered by (expert, route): routes 1, 2 (expert 0), 3 (expert 1),
        0 (expert 2): route_slot = [3, 0, 1, 2], route_of_slot = [1, 2, 3, 0], send_counts = [[2, 1, 1]]
    """
    dr, sd, sm = counters if counters is not None else (None, None, None)
    R, Lc, cap, align = int(num_ep_ranks), int(num_local_columns), int(capacity), _check_align(align, "dispatch_layout")
    if align > 1 and (R != 1 or dest_quota is not None):
        raise ValueError(f"dispatch_layout: align > 1 needs num_ep_ranks == 1 and dest_quota None (the send buffer "
                         f"is the expert input; at R > 1 receive_layout aligns it), got align={align}, "
                         f"num_ep_ranks={R}, dest_quota {'given' if dest_quota is not None else 'None'}")
    args = (indices, valid, column_rank, column_local, route_order, R, Lc, cap, dr, sd, sm, dest_quota)
    if native_available(indices.device.type):
        return DispatchLayout(*torch.ops.moe_graph.dispatch_layout(*args, align=align))
    return _layout_torch(*args, align=align)


def receive_layout(recv_counts: torch.Tensor, capacity: int, align: int = 1) -> ReceiveLayout:
    """``recv_counts [R, num_local_columns]`` int64 (row ``s``: the ``send_counts`` row source rank ``s`` sent this
    rank) -> ``(expert_row_source [P], recv_row_target [R*capacity], m_splits [num_local_columns],
    aligned_m_splits [num_local_columns])``: the expert input groups the received rows by local expert, then source
    rank, then the sender's order, each group starting at a multiple of ``align`` rows with zero rows after it
    (``align = 1``: back to back, padding last); ``P =`` :func:`aligned_padded_rows` ``(R*capacity, Lc, align)``
    (``align = 1``: ``R*capacity``). ``expert_row_source[i]`` is the receive row of expert row ``i`` (``R*capacity``:
    a zero row) and ``recv_row_target`` its inverse (``P``: an empty receive row); ``aligned_m_splits`` are the
    groups' padded rows."""
    align = _check_align(align, "receive_layout")
    if native_available(recv_counts.device.type):
        return ReceiveLayout(*torch.ops.moe_graph.receive_layout(recv_counts, int(capacity), align))
    return _receive_torch(recv_counts, int(capacity), align)


def _check_align(align, op: str) -> int:
    if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20:
        raise ValueError(f"{op}: align must be an int in [1, 2^20], got {align!r}")
    return align


def aligned_padded_rows(rows: int, num_groups: int, align: int) -> int:
    """Rows of :func:`aligned_groups`' padded layout: ``ceil((rows + (align - 1) * G) / align) * align``."""
    return -(-(rows + (align - 1) * num_groups) // align) * align


def aligned_groups(m_splits: torch.Tensor, rows: int, align: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``m_splits [G]`` int64 (rows per expert group over ``rows`` rows; negative counts read as 0, groups past
    ``rows`` clamped as the grouped GEMM reads them) -> ``(padded_m_splits [G], source_of_padded [P],
    padded_of_source [rows])``: the groups regrouped so that each starts at a multiple of ``align`` rows, zero rows
    after each, ``P =`` :func:`aligned_padded_rows`; ``source_of_padded`` holds each padded row's source row
    (``rows``: a zero row), ``padded_of_source`` its inverse (``P``: a row past the groups). Two launches on CUDA."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"aligned_groups: rows must be an int >= 0, got {rows!r}")
    _check_align(align, "aligned_groups")
    if not isinstance(m_splits, torch.Tensor) or m_splits.dim() != 1:
        raise ValueError(f"aligned_groups: m_splits must be a 1-D tensor [G], got "
                         f"{tuple(m_splits.shape) if isinstance(m_splits, torch.Tensor) else type(m_splits).__name__}")
    m = m_splits.to(torch.int64)
    if native_available(m.device.type):
        return torch.ops.moe_graph.aligned_groups(m, rows, align)
    return _aligned_torch(m, rows, align)


# ---------------------------------------------------------------------------------- the torch path (no build) --
def _eager_check(bad: torch.Tensor, message) -> None:
    """Raises ``message(flat position)`` when ``bad`` has a true entry and its values are real host values."""
    if bad.device.type == "cpu" and real_host_values(bad) and bool(bad.any()):
        raise RuntimeError(message(int(bad.reshape(-1).nonzero()[0])))


def _layout_torch(indices, valid, column_rank, column_local, route_order, R, Lc, cap, dropped_routes=None,
                  step_dropped_routes=None, step_max_load_ratio=None, dest_quota=None, align=1) -> DispatchLayout:
    T, K = indices.shape
    n, C, dev = T * K, column_rank.shape[0], indices.device
    block = aligned_padded_rows(cap, Lc, align)  # one destination's send slots (align 1: cap)
    N = n if dest_quota is not None else R * block
    i64 = dict(dtype=torch.int64, device=dev)
    idx = indices.reshape(-1).to(torch.int64)
    want = valid.reshape(-1) if valid is not None else torch.ones(n, dtype=torch.bool, device=dev)
    _eager_check(want & ((idx < 0) | (idx >= C)), lambda r: f"dispatch_layout: indices must be in [0, {C}) (the "
                 f"routing columns) for valid routes; indices[{r // K}, {r % K}] = {int(idx[r])}")
    col = torch.where(want & (idx >= 0) & (idx < C), idx, 0)
    d_col, l_col = column_rank.index_select(0, col), column_local.index_select(0, col)
    live = want & (idx >= 0) & (idx < C) & (d_col >= 0) & (d_col < R) & (l_col >= 0) & (l_col < Lc)
    dst = torch.where(live, d_col, R)
    # (1) drop order: each destination's first `limit` live routes are kept (`cap`, or its quota)
    limit = torch.full((R + 1,), cap, **i64) if dest_quota is None else torch.cat(
        [dest_quota.to(torch.int64).clamp(min=0), dest_quota.new_zeros(1, dtype=torch.int64)])
    seq = route_order if route_order is not None else torch.arange(n, **i64)
    d_seq = dst.index_select(0, seq)
    by_dst = torch.argsort(d_seq, stable=True)
    live_count = torch.zeros(R + 1, **i64).scatter_add_(0, dst, torch.ones_like(dst))
    d_sorted = d_seq.index_select(0, by_dst)
    rank = torch.arange(n, **i64) - (live_count.cumsum(0) - live_count).index_select(0, d_sorted)
    kept = torch.zeros(n, dtype=torch.bool, device=dev).scatter_(
        0, seq.index_select(0, by_dst), (d_sorted < R) & (rank < limit.index_select(0, d_sorted)))
    # (2) positions by (destination, local expert, route)
    key = torch.where(kept, dst * Lc + l_col, R * Lc)
    by_key = torch.argsort(key, stable=True)
    key_count = torch.zeros(R * Lc + 1, **i64).scatter_add_(0, key, torch.ones_like(key))
    k_sorted = key.index_select(0, by_key)
    key_start = key_count.cumsum(0) - key_count  # the first sorted position of each key
    counts = key_count[:R * Lc].view(R, Lc)
    padded = (counts + align - 1) // align * align
    if dest_quota is not None:  # packed: the kept routes' sorted positions are their slots
        slot = torch.arange(n, **i64)
    else:  # d * block + the group's aligned start within the block + the route's rank within its key
        group = (padded.cumsum(1) - padded + torch.arange(R, **i64).view(R, 1) * block).reshape(-1)
        group = torch.cat([group, group.new_zeros(1)])
        slot = torch.arange(n, **i64) - (key_start - group).index_select(0, k_sorted)
    slot = torch.where(k_sorted < R * Lc, slot, N)
    route_slot = torch.empty(n, **i64).scatter_(0, by_key, slot)
    route_of_slot = torch.full((N + 1,), n, **i64).scatter_(0, slot, by_key)[:N]
    column_counts = torch.zeros(C, **i64).scatter_add_(0, col, live.to(torch.int64))
    dropped = (live_count[:R] - limit[:R]).clamp(min=0).sum()
    if dropped_routes is not None:
        dropped_routes.add_(dropped)
    if step_dropped_routes is not None:
        step_dropped_routes.add_(dropped)
    if step_max_load_ratio is not None and n:
        ratio = live_count[:R].max().to(torch.float64) * R / n  # the native rounding: (max * R) / n
        step_max_load_ratio.copy_(torch.maximum(step_max_load_ratio, ratio.view_as(step_max_load_ratio)))
    return DispatchLayout(route_slot, route_of_slot, counts, column_counts, dropped, padded)


def _receive_torch(recv_counts, cap, align=1):
    R, Lc = recv_counts.shape
    N, dev = R * cap, recv_counts.device
    P = aligned_padded_rows(N, Lc, align)
    _eager_check(recv_counts < 0, lambda i: f"receive_layout: recv_counts must be >= 0; recv_counts[{i // Lc}, "
                 f"{i % Lc}] = {int(recv_counts.reshape(-1)[i])}")
    end = recv_counts.clamp(min=0).cumsum(1)
    _eager_check(end > cap, lambda i: f"receive_layout: each row of recv_counts must sum to at most capacity={cap}; "
                 f"recv_counts[{i // Lc}, {i % Lc}] = {int(recv_counts.reshape(-1)[i])} goes past it")
    end = end.clamp(max=cap)
    row_start = torch.cat([end.new_zeros(R, 1), end[:, :-1]], 1)
    cnt = end - row_start
    m_splits = cnt.sum(0)
    padded = (m_splits + align - 1) // align * align
    col_base = (padded.cumsum(0) - padded)[None, :] + (cnt.cumsum(0) - cnt)
    pos = torch.arange(cap, dtype=torch.int64, device=dev).expand(R, cap).contiguous()
    local = torch.searchsorted(row_start, pos, right=True) - 1  # the last local expert starting at or before pos
    real = pos < end.gather(1, local)
    target = torch.where(real, col_base.gather(1, local) + pos - row_start.gather(1, local), P).reshape(N)
    source = torch.full((P + 1,), N, dtype=torch.int64, device=dev).scatter_(
        0, target, torch.arange(N, dtype=torch.int64, device=dev))[:P]
    return ReceiveLayout(source, target, m_splits, padded)


def _aligned_torch(m_splits, rows, align):
    G, dev = m_splits.shape[0], m_splits.device
    end = m_splits.clamp(min=0).cumsum(0).clamp(max=rows)
    start = torch.cat([end.new_zeros(1), end[:-1]])
    m = end - start
    pm = (m + align - 1) // align * align
    pend = pm.cumsum(0)
    pstart = pend - pm
    P = aligned_padded_rows(rows, G, align)
    p = torch.arange(P, device=dev)
    g = torch.searchsorted(pend, p, right=True).clamp(max=max(G - 1, 0))
    if G:
        live = (p < pend[-1]) & (p - pstart[g] < m[g])
        source = torch.where(live, start[g] + p - pstart[g], rows)
    else:
        source = torch.full((P,), rows, dtype=torch.int64, device=dev)
    r = torch.arange(rows, device=dev)
    h = torch.searchsorted(end, r, right=True).clamp(max=max(G - 1, 0))
    target = torch.where(r < end[-1], pstart[h] + (r - start[h]), P) if G else torch.full_like(r, P)
    return pm, source, target


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the ops
        return

    @torch.library.register_fake(_LAYOUT)
    def _(indices, valid, column_rank, column_local, route_order, num_ep_ranks, num_local_columns, capacity,
          dropped_routes=None, step_dropped_routes=None, step_max_load_ratio=None, dest_quota=None, align=1):
        torch._check(indices.dim() == 2, lambda: "dispatch_layout: indices must be a 2-D tensor [T, K]")
        n = indices.shape[0] * indices.shape[1]
        new = lambda *shape: indices.new_empty(shape, dtype=torch.int64)  # noqa: E731
        N = n if dest_quota is not None else num_ep_ranks * aligned_padded_rows(capacity, num_local_columns, align)
        return (new(n), new(N), new(num_ep_ranks, num_local_columns),
                new(column_rank.shape[0]), new(), new(num_ep_ranks, num_local_columns))

    @torch.library.register_fake(_ALIGN)
    def _(m_splits, rows, align):
        torch._check(m_splits.dim() == 1, lambda: "aligned_groups: m_splits must be [G]")
        G = m_splits.shape[0]
        return (m_splits.new_empty(G), m_splits.new_empty(aligned_padded_rows(rows, G, align)),
                m_splits.new_empty(rows))

    @torch.library.register_fake(_RECV)
    def _(recv_counts, capacity, align=1):
        torch._check(recv_counts.dim() == 2, lambda: "receive_layout: recv_counts must be [R, num_local_columns]")
        R, Lc = recv_counts.shape
        return (recv_counts.new_empty(aligned_padded_rows(R * capacity, Lc, align)),
                recv_counts.new_empty(R * capacity), recv_counts.new_empty(Lc), recv_counts.new_empty(Lc))


_register()
