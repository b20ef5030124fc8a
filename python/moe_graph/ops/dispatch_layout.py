"""The token dispatcher's index bookkeeping in two native ops (C++ on CPU, CUDA kernels on GPU; semantics in
``csrc/permute/dispatch_layout.h``): :func:`dispatch_layout` turns the router's top-k indices into send slots and
counts, :func:`receive_layout` orders the rows a rank received by local expert. Integer outputs, no autograd; no host
sync, capturable, deterministic (stable counting sorts, no order-dependent atomics).

Layout. ``n = T * K`` routes (route ``r`` = token ``r // K``, choice ``r % K``) into ``C`` routing columns; column ``c``
goes to rank ``column_rank[c]`` as its local expert ``column_local[c]``. A route is *live* when valid (``valid`` mask)
and *kept* when among the first ``capacity`` live routes of its destination in drop order (``route_order``, a
permutation of the routes: the "probs" policy's probability order; ``None``: route order, the "position" policy). A
kept route goes to send slot ``destination * capacity + position``, positions ordered by (local expert, route): at
one rank the send buffer already is the expert input grouped by local expert, padding rows after the real ones.
Sentinels: ``route_slot == R * capacity`` (dropped or not live), ``route_of_slot == n`` (empty slot).

Errors: a valid route whose index lies outside ``[0, C)``, table entries outside their range and a ``route_order``
that is no permutation raise on the CPU; on CUDA the device error flag's ``INDEX_OUT_OF_RANGE`` bit is set (the
route counts as not live; ``moe_graph.check_errors()`` reports it). Receive counts below 0 or past ``capacity`` per
source: CPU raises, CUDA sets ``NEGATIVE_SPLIT`` / ``SPLITS_OVERFLOW`` and clamps.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from moe_graph.ops._lib import has_kernel, require

__all__ = ["dispatch_layout", "receive_layout", "DispatchLayout", "native_available"]

_LAYOUT = "moe_graph::dispatch_layout"
_RECV = "moe_graph::receive_layout"


class DispatchLayout(NamedTuple):
    route_slot: torch.Tensor  # [T*K] int64 send slot of each route (R*capacity: dropped or not live)
    route_of_slot: torch.Tensor  # [R*capacity] int64 route in each send slot (T*K: empty)
    send_counts: torch.Tensor  # [R, num_local_columns] int64 kept routes per (destination, local expert)
    column_counts: torch.Tensor  # [C] int64 live routes per column (before drops)
    dropped: torch.Tensor  # 0-dim int64 live routes over the capacity


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def native_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has the layout ops for ``device_type`` ("cpu" or "cuda")."""
    return has_kernel(_LAYOUT, device_type) and has_kernel(_RECV, device_type)


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
) -> DispatchLayout:
    """Send slots of ``indices [T, K]`` (int32/int64) over the column tables ``column_rank`` / ``column_local``
    (``[C]`` int64); ``valid``: optional ``[T, K]`` bool; ``route_order``: optional ``[T*K]`` int64 drop order.
    ``counters``: optional ``(dropped_routes, step_dropped_routes, step_max_load_ratio)`` (one element each; int64,
    int64, float64) that take this call's drops (added) and largest load ratio (``max(ratio, max_d live_d * R / n)``)
    in place.

    Example (one rank, 3 experts, top-2, capacity 4)::

        indices = [[2, 0], [0, 1]]  ->  send slots ordered by (expert, route): routes 1, 2 (expert 0), 3 (expert 1),
        0 (expert 2): route_slot = [3, 0, 1, 2], route_of_slot = [1, 2, 3, 0], send_counts = [[2, 1, 1]]
    """
    require()
    dr, sd, sm = counters if counters is not None else (None, None, None)
    return DispatchLayout(*torch.ops.moe_graph.dispatch_layout(
        indices, valid, column_rank, column_local, route_order, int(num_ep_ranks), int(num_local_columns),
        int(capacity), dr, sd, sm))


def receive_layout(recv_counts: torch.Tensor, capacity: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``recv_counts [R, num_local_columns]`` int64 (row ``s``: the ``send_counts`` row source rank ``s`` sent this
    rank) -> ``(expert_row_source [R*capacity], recv_row_target [R*capacity], m_splits [num_local_columns])``: the
    expert input groups the received rows by local expert, then source rank, then the sender's order, padding last;
    ``expert_row_source[i]`` is the receive row of expert row ``i`` and ``recv_row_target`` its inverse (``R*capacity``:
    none)."""
    require()
    return torch.ops.moe_graph.receive_layout(recv_counts, int(capacity))


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the ops
        return

    @torch.library.register_fake(_LAYOUT)
    def _(indices, valid, column_rank, column_local, route_order, num_ep_ranks, num_local_columns, capacity,
          dropped_routes=None, step_dropped_routes=None, step_max_load_ratio=None):
        torch._check(indices.dim() == 2, lambda: "dispatch_layout: indices must be a 2-D tensor [T, K]")
        n = indices.shape[0] * indices.shape[1]
        new = lambda *shape: indices.new_empty(shape, dtype=torch.int64)  # noqa: E731
        return (new(n), new(num_ep_ranks * capacity), new(num_ep_ranks, num_local_columns),
                new(column_rank.shape[0]), new())

    @torch.library.register_fake(_RECV)
    def _(recv_counts, capacity):
        torch._check(recv_counts.dim() == 2, lambda: "receive_layout: recv_counts must be [R, num_local_columns]")
        R, Lc = recv_counts.shape
        return (recv_counts.new_empty(R * capacity), recv_counts.new_empty(R * capacity), recv_counts.new_empty(Lc))


_register()
