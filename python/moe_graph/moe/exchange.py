"""The expert-parallel exchange with a capacity per *destination rank*: the apportionment rule and the
variable-size backends that move only the routed rows.

Two capacity rules (``TokenDispatcher(exchange=...)``, ``MoELayer(exchange=...)``):

* **per pair** (``exchange="nccl"``, the fixed-split all-to-all): each (source, destination) pair has ``capacity =
  ceil(cf * T * K / R)`` rows, the all-to-all always moves ``R * capacity`` rows per rank, padding included, and a
  route overflows when its *pair* is full. Pairs are far less balanced than destinations when ranks see different
  data, so at EP 64 the factor needed for no overflow is 3-5x (``benchmarks/bench_exchange.py``).
* **per destination** (``exchange="symm_mem"``): each rank's receive buffer holds ``capacity = ceil(cf * T * K)``
  rows (its mean load times the factor), shared by all sources; only the routed rows travel. A route overflows only
  when its destination's total demand passes the buffer. Then every source keeps a share proportional to its demand
  (:func:`destination_quotas`: largest remainders, ties to the lower source rank), so the drops are deterministic,
  fair across sources and computed identically on every rank from the all-gathered ``[R, R]`` demand (with echo off
  it is the ``[R, E]`` expert counts the layer gathers anyway, summed per rank: no extra exchange).

Within a source, the rows for one destination are the first ``quota`` live routes in drop order
(:func:`moe_graph.ops.dispatch_layout.dispatch_layout` in quota mode: packed send slots ordered by destination,
local expert, route); the receiver's expert input groups them by local expert, then source rank, then the sender's
order, padding rows last: the same order as the per-pair path, so everything after the exchange is shared.

Backends of the per-destination rule (chosen once at construction, never during capture):

* :class:`SymmMemExchange` (CUDA, torch's NVSHMEM ``symm_mem.all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``):
  split sizes read on the device, rows land grouped by local expert; sync-free and capturable. Buffers are symmetric
  allocations made once per shape (collective: before capture).
* :class:`HostSizedExchange` (any process group, e.g. gloo on CPUs): the same semantics with the split sizes read on
  the host (``all_to_all_single`` with splits); a CPU has no graph to capture, so the tests, the dropless rerun and
  the training-equivalence rows run the per-destination rule here.

Bad counts: a negative demand, one past ``T * K`` and a gathered row of this rank that differs from its own count
are clamped and set the device error flag's ``EXCHANGE_COUNTS`` bit (``moe_graph.check_errors()`` names it); rows
that would not fit a receive buffer are never written past it. Gathered counts that differ between ranks (a
corrupted all-gather: another rank's row changed on one rank, every value still in range) are caught by
:func:`flag_if_ranks_disagree` (a position-weighted checksum of the gathered matrix, its max and min over the group
in one 2-element all-reduce) and set the same bit; the plan is then computed from the rank's own copy (a checksum
can miss a corruption whose weighted sum is unchanged: unlikely, not impossible).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.distributed as dist

try:  # torch's symmetric memory (NVSHMEM exchange): optional
    from torch.distributed import _symmetric_memory as _symm
except ImportError:  # pragma: no cover - torch without it
    _symm = None

from moe_graph.ops.dispatch_layout import aligned_groups, aligned_padded_rows
from moe_graph.ops.errors import EXCHANGE_COUNTS, flag_error_if
from moe_graph.ops.nvlink import FusedDispatch, NvlinkExchange, OrderedStream, kernels_available
from moe_graph.ops.fp8 import QuantizedRows, carrier, quantize_pair
from moe_graph.ops.permute import expand_quantize_copies, reduce_rows, route_dot
from moe_graph.streams import exchange_issued

__all__ = [
    "EXCHANGES",
    "capacity_for",
    "destination_capacity",
    "destination_quotas",
    "checked_demand",
    "checksum_weights",
    "flag_if_ranks_disagree",
    "HostSizedExchange",
    "SymmMemExchange",
    "symm_mem_available",
    "nvlink_available",
    "FusedDispatch",
    "FusedState",
    "HostSizedFusedExchange",
    "CompletedExchange",
    "is_fused",
    "resolve_exchange",
    "exchange_bytes",
    "inter_node_rows",
]

# "nccl": fixed-split all-to-all, capacity per (source, destination) pair; "symm_mem": variable-size exchange,
# capacity per destination; "auto": symm_mem where torch's NVSHMEM exchange exists for the group, else nccl
# "nvlink": the per-destination rule through a *fused* backend (:class:`HostSizedFusedExchange` on CPU process
# groups, ``moe_graph.ops.nvlink``'s kernels on CUDA): rows read straight from the token rows, placed at their final
# receive rows, the combine reduces the K routes in the same op
EXCHANGES = ("nccl", "symm_mem", "nvlink", "auto")


def capacity_for(num_tokens: int, topk: int, num_ep_ranks: int, capacity_factor: Optional[float]) -> int:
    """Routes each rank may send to each rank: ``ceil(capacity_factor * T * K / R)`` (at least 1, at most
    ``T * K``); ``None`` -> ``T * K`` (dropless)."""
    full = num_tokens * topk
    if capacity_factor is None:
        return max(full, 1)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
    return max(1, min(full, int(math.ceil(round(capacity_factor * full / num_ep_ranks, 6)))))


def destination_capacity(num_tokens: int, topk: int, num_ep_ranks: int, capacity_factor: Optional[float]) -> int:
    """Rows of one rank's receive buffer under the per-destination rule: ``ceil(capacity_factor * T * K)`` (at least
    1, at most ``R * T * K``); ``None`` -> ``R * T * K`` (dropless: every route of every rank fits)."""
    full = num_tokens * topk * num_ep_ranks
    if capacity_factor is None:
        return max(full, 1)
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
    return max(1, min(full, int(math.ceil(round(capacity_factor * num_tokens * topk, 6)))))


def destination_quotas(demand: torch.Tensor, capacity: int) -> torch.Tensor:
    """``demand [R, R]`` int64 (row ``s``: live routes source ``s`` has for each destination) -> ``quota [R, R]``:
    the routes each source may send each destination. A destination whose total fits keeps everything; one past
    ``capacity`` gives each source ``floor(demand * capacity / total)`` plus one for the sources with the largest
    remainders (ties: lower source rank) until ``capacity`` is reached (Hamilton's apportionment). Sync-free device
    ops, the same result on every rank; ``quota <= demand`` and every column sums to ``min(total, capacity)``."""
    if demand.dim() != 2 or demand.shape[0] != demand.shape[1]:
        raise ValueError(f"demand must be [R, R], got shape {tuple(demand.shape)}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    R = demand.shape[0]
    demand = demand.to(torch.int64)
    total = demand.sum(0, keepdim=True)  # [1, R] per destination
    over = total > capacity
    scaled = demand * capacity
    share = torch.where(over, torch.div(scaled, total.clamp(min=1), rounding_mode="floor"), demand)
    rem = torch.where(over, scaled - share * total, 0)
    left = torch.where(over, capacity - share.sum(0, keepdim=True), 0)  # [1, R], < R
    # per destination, rank the sources by remainder (descending; stable: ties keep the lower source first)
    order = torch.argsort(-rem, dim=0, stable=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(R, device=demand.device).unsqueeze(1).expand(R, R))
    return share + ((place < left) & (rem > 0)).to(torch.int64)


def checked_demand(gathered: torch.Tensor, local: torch.Tensor, ep_rank: int, max_count: int) -> torch.Tensor:
    """The all-gathered ``[R, R]`` demand, made safe to plan with: negative entries read as 0, entries past
    ``max_count`` (the routes one rank has, ``T * K``) as ``max_count``, and this rank's row is its own ``local``
    count; each of these sets ``EXCHANGE_COUNTS`` on the device (no sync)."""
    bad = (gathered < 0) | (gathered > max_count)
    flag_error_if(bad | (gathered[ep_rank] != local).unsqueeze(0), EXCHANGE_COUNTS)
    safe = gathered.clamp(0, max_count)
    return torch.cat([safe[:ep_rank], local.to(safe.dtype).unsqueeze(0), safe[ep_rank + 1:]])


def checksum_weights(numel: int, device=None) -> torch.Tensor:
    """``[2, numel]`` int64 position weights of :func:`flag_if_ranks_disagree`'s checksum: row 0 a fixed
    pseudo-random sequence in ``[1, 2**20)`` (so that moving counts between positions, e.g. a row rolled by two
    experts, changes the weighted sum; counts below ``2**23`` over up to ``2**16`` positions cannot overflow int64),
    row 1 its negation (the max and the min of the checksum come out of one MAX all-reduce)."""
    idx = torch.arange(numel, dtype=torch.int64)
    w = (idx * 2654435761 + 40503) % 1048573 + 1
    return torch.stack([w, -w]).to(device)


def flag_if_ranks_disagree(gathered: torch.Tensor, weights: torch.Tensor, group=None) -> None:
    """Sets ``EXCHANGE_COUNTS`` on every rank of ``group`` when the all-gathered integer matrix ``gathered``
    (``[R, E]`` counts, ``[R, R]`` demand: the same on every rank unless a gather was corrupted) differs between
    ranks: each rank's checksum ``c = sum(gathered * w)`` and ``-c`` (``weights``: :func:`checksum_weights` of at
    least ``gathered.numel()`` positions), one MAX all-reduce of these 2 int64 (16 bytes) giving ``max c`` and
    ``-min c``, the flag set where they differ. Device ops only (no host sync), capturable: per call 2 kernels,
    the all-reduce, and the flag's 6 small kernels. A collective: every rank of ``group`` calls it."""
    n = gathered.numel()
    both = (gathered.reshape(1, n).to(torch.int64) * weights[:, :n]).sum(1)  # [c, -c]
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # [max c, -min c]
    flag_error_if(both.sum(), EXCHANGE_COUNTS)  # max c - min c != 0


def exchange_bytes(num_tokens: int, topk: int, num_ep_ranks: int, hidden_size: int, element_size: int,
                   capacity_factor: Optional[float], routed_rows: Optional[float] = None) -> dict:
    """Bytes one dispatch of one layer costs each rank under both rules: ``receive`` (the receive buffer) and
    ``wire`` (rows that leave the rank, own rows included): per pair ``R * ceil(cf * T * K / R)`` rows both ways
    whatever the routing; per destination a ``ceil(cf * T * K)``-row buffer and only the routed rows on the wire
    (``routed_rows``, default ``T * K``)."""
    R, TK = num_ep_ranks, num_tokens * topk
    pair = capacity_for(num_tokens, topk, R, capacity_factor)
    row = hidden_size * element_size
    routed = TK if routed_rows is None else routed_rows
    return {"pair": {"receive": R * pair * row, "wire": R * pair * row},
            "destination": {"receive": destination_capacity(num_tokens, topk, R, capacity_factor) * row,
                            "wire": int(routed * row)}}


def inter_node_rows(dest_rank: torch.Tensor, source_rank, ranks_per_node: int,
                    valid: Optional[torch.Tensor] = None) -> dict:
    """Rows that cross between nodes in one dispatch (the combine sends as many back): ``dest_rank [..., T, K]``
    int64, the destination rank of each route (``valid`` masks routes out), sent by ``source_rank`` (an int, or a
    tensor broadcasting against ``dest_rank[..., 0, 0]`` for a batch of sources); nodes of ``ranks_per_node``
    consecutive ranks. ``{"per_route": routes to another node (the flat exchange sends each), "per_node": distinct
    (token, other node) pairs (the node-aware exchange sends each once)}``, summed over the batch (ints)."""
    G = ranks_per_node
    live = torch.ones_like(dest_rank, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    src_node = torch.as_tensor(source_rank).to(torch.int64) // G
    src_node = src_node.reshape(src_node.shape + (1, 1)) if src_node.dim() else src_node
    node = dest_rank.to(torch.int64) // G
    remote = live & (node != src_node)
    n_nodes = int(node.max()) + 1 if node.numel() else 1
    hit = torch.zeros(dest_rank.shape[:-1] + (n_nodes,), dtype=torch.int64).scatter_add_(
        -1, torch.where(remote, node, 0), remote.to(torch.int64)) > 0
    return {"per_route": int(remote.sum()), "per_node": int(hit.sum())}


# ---------------------------------------------------------------------------------------------- backends --
class _Plan:
    """One dispatch's exchange plan, shared by the rows that go forward (tokens, probabilities) and back."""

    def __init__(self, send_counts: torch.Tensor, capacity: int):
        self.send_counts = send_counts  # [R, Lc] kept routes per (destination, local expert)
        self.capacity = capacity  # receive rows
        self.m_splits: Optional[torch.Tensor] = None  # [Lc] rows per local expert of the expert input


class HostSizedExchange:
    """The per-destination exchange with split sizes read on the host: ``all_to_all_single`` with splits over any
    process group (gloo on CPUs). Each call syncs (host sizes), so it is for CPUs and eager runs, not for graphs."""

    def __init__(self, group=None):
        self.group = group
        self.num_ranks = dist.get_world_size(group)

    def plan(self, send_counts: torch.Tensor, capacity: int) -> _Plan:
        p = _Plan(send_counts, capacity)
        R, Lc = send_counts.shape
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)  # row s: from source s
        recv = recv_counts.clamp(min=0)
        flag_error_if(recv_counts < 0, EXCHANGE_COUNTS)
        # the rows that fit the buffer, in source order (a corrupted count never writes past it)
        flat = recv.reshape(-1)
        end = flat.cumsum(0).clamp(max=capacity)
        fit = end - torch.cat([end.new_zeros(1), end[:-1]])
        flag_error_if((fit != flat).any().view(1), EXCHANGE_COUNTS)
        fit = fit.view(R, Lc)
        p.send_splits = send_counts.sum(1).tolist()
        p.recv_splits = recv.sum(1).tolist()  # what each source sends (all of it is received, then cut to the fit)
        # received rows (source, local expert, order) -> expert rows (local expert, source, order)
        recv_start = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).view(R, Lc)
        fit_t = fit.t().reshape(-1)  # [(l, s)]
        expert_start = (fit_t.cumsum(0) - fit_t).view(Lc, R).t()
        sizes = fit.reshape(-1).tolist()
        src = [torch.arange(a, a + n) for a, n in zip(recv_start.reshape(-1).tolist(), sizes)]
        dst = [torch.arange(a, a + n) for a, n in zip(expert_start.reshape(-1).tolist(), sizes)]
        dev = send_counts.device
        p.recv_index = torch.cat(src).to(dev) if src else torch.zeros(0, dtype=torch.int64, device=dev)
        p.expert_index = torch.cat(dst).to(dev) if dst else torch.zeros(0, dtype=torch.int64, device=dev)
        p.m_splits = fit.sum(0)
        return p

    def align(self, p: _Plan, align: int) -> torch.Tensor:
        """Lays plan ``p``'s expert rows out with every local expert's group starting at a multiple of ``align`` rows
        (zero rows after each; :func:`moe_graph.ops.dispatch_layout.aligned_groups` composed into the placement
        index, so the rows still move once): ``p.capacity`` becomes the padded rows; returns the padded
        ``m_splits`` (``p.m_splits`` keeps the received rows per expert)."""
        m, source_of_padded, padded_of_source = aligned_groups(p.m_splits, p.capacity, align)
        p.expert_index = padded_of_source.index_select(0, p.expert_index)
        p.capacity = source_of_padded.shape[0]
        return m

    def _receive(self, send: torch.Tensor, p: _Plan) -> torch.Tensor:
        """The rows every source sent this rank, source-major (the forward all-to-all of ``send``'s packed rows)."""
        recv = send.new_empty((sum(p.recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send[:sum(p.send_splits)].contiguous(), p.recv_splits, p.send_splits,
                               group=self.group)
        return recv

    def to_experts(self, send: torch.Tensor, p: _Plan) -> torch.Tensor:
        """Send-slot rows ``[n, X]`` (packed, by destination) -> expert input ``[capacity, X]``."""
        recv = self._receive(send, p)
        out = send.new_zeros((p.capacity,) + tuple(send.shape[1:]))
        return out.index_copy_(0, p.expert_index, recv.index_select(0, p.recv_index))

    def to_experts_read(self, send: torch.Tensor, p: _Plan, read):
        """:meth:`to_experts` with the expert input made by ``read(received rows, source_row [capacity])`` from the
        received rows (``source_row[i]``: the received row of expert row ``i``, the number of received rows for a
        zero row), e.g. the two FP8 copies written by one op (:func:`to_experts_quantized`); not differentiable."""
        recv = self._receive(send, p)
        source_row = torch.full((p.capacity,), recv.shape[0], dtype=torch.int64, device=send.device)
        source_row.index_copy_(0, p.expert_index, p.recv_index)  # the received row of each expert row; else none
        return read(recv, source_row)

    def to_sources(self, rows: torch.Tensor, p: _Plan, num_slots: int) -> torch.Tensor:
        """Expert rows ``[capacity, X]`` -> this rank's send slots ``[num_slots, X]`` (the adjoint of
        :meth:`to_experts`; rows that did not fit come back as zeros)."""
        X = rows.shape[1:]
        back = rows.new_zeros((sum(p.recv_splits),) + tuple(X))
        back.index_copy_(0, p.recv_index, rows.index_select(0, p.expert_index))
        out = rows.new_zeros((num_slots,) + tuple(X))
        dist.all_to_all_single(out[:sum(p.send_splits)], back, p.send_splits, p.recv_splits, group=self.group)
        return out


def symm_mem_available(group=None, device: Optional[torch.device] = None) -> bool:
    """True when torch's NVSHMEM ``all_to_all_vdev_2d`` can serve ``group`` on ``device`` (a CUDA device, torch
    built with NVSHMEM, the runtime library present). Never raises."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    if _symm is None:
        return False
    try:
        return bool(_symm.is_nvshmem_available()) and hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d")
    except (AttributeError, RuntimeError):
        return False


class SymmMemExchange:
    """The per-destination exchange on torch's NVSHMEM symmetric memory: ``all_to_all_vdev_2d`` sends each
    ``(destination, local expert)`` chunk of the packed send buffer with splits read on the device and lands the rows
    grouped by local expert, then source rank; ``all_to_all_vdev_2d_offset`` is the exact reverse. Sync-free and
    capturable; the symmetric buffers are allocated once per (rows, row shape, dtype) on first use, which is a
    collective: run one eager step before capture (``FullIterationGraph``'s warm-up does).

    ``all_to_all_vdev_2d`` starts each local expert's rows after ``max(rows, 1)`` rows of the one before (an empty
    expert keeps one row: CUTLASS takes no empty group), so its layout has a gap per empty expert. The expert input
    is read out of its receive buffer by one row gather into this exchange's own layout: the groups back to back
    (what ``m_splits`` says), or with :meth:`align` each starting at a multiple of ``align`` rows, zero rows
    elsewhere; the reverse exchange reads that layout (``all_to_all_vdev_2d_offset`` takes any chunk offsets)."""

    def __init__(self, group=None, device=None):
        symm = self._symm = _symm
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.num_ranks = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        symm.enable_symm_mem_for_group(self.group_name)
        backend = symm.get_backend(self.device)
        if backend is None:
            symm.set_backend("NVSHMEM")  # global, and fixed once a symmetric tensor exists
        elif backend != "NVSHMEM":
            raise RuntimeError(f"exchange='symm_mem' needs the NVSHMEM symmetric-memory backend, but this process "
                               f"already allocates with {backend!r}; use exchange='nccl'")
        self._ops = torch.ops.symm_mem
        self._buffers = {}
        self._ordered = OrderedStream(self.device)  # the symmetric buffers are shared by every call

    def _buffer(self, tag: str, rows: int, row_shape, dtype) -> torch.Tensor:
        key = (tag, rows, tuple(row_shape), dtype)
        if key not in self._buffers:
            buf = self._symm.empty((rows,) + tuple(row_shape), dtype=dtype, device=self.device)
            buf.zero_()  # once: rows no exchange writes stay zero (the receive buffer's last row is read as one)
            self._symm.rendezvous(buf, self.group_name)
            self._buffers[key] = buf
        return self._buffers[key]

    def plan(self, send_counts: torch.Tensor, capacity: int) -> _Plan:
        # the splits live in the plan (ordinary memory), copied into the shared symmetric buffers at each call: a
        # later layer's dispatch reuses those buffers before this one's backward runs
        p = _Plan(send_counts, capacity)
        p.splits_offsets = None  # [2, R * Lc] of the expert input's chunks (expert-major), kept for the reverse one
        p.received_rows = capacity  # at most (the quotas' cut); p.capacity: the expert input's rows
        p.align, p.aligned_m_splits = None, None
        return p

    def align(self, p: _Plan, align: int) -> torch.Tensor:
        """Lays plan ``p``'s expert input out with every local expert's group starting at a multiple of ``align``
        rows (zero rows after each, as :meth:`HostSizedExchange.align`): ``p.capacity`` becomes the padded rows
        (:func:`moe_graph.ops.dispatch_layout.aligned_padded_rows`); returns the padded ``m_splits`` ``[Lc]``, a
        device tensor the forward exchange fills in place (the counts come back with the rows; ``p.m_splits``
        keeps the received rows per expert)."""
        Lc = p.send_counts.shape[1]
        p.align = int(align)
        p.capacity = aligned_padded_rows(p.capacity, Lc, p.align)
        p.aligned_m_splits = torch.zeros(Lc, dtype=torch.int64, device=p.send_counts.device)
        return p.aligned_m_splits

    def to_experts(self, send: torch.Tensor, p: _Plan) -> torch.Tensor:
        out, p.splits_offsets, p.m_splits = self._ordered.run(self._to_experts, send, p)
        return out

    def to_experts_read(self, send: torch.Tensor, p: _Plan, read):
        """:meth:`to_experts` with the expert input made by ``read(receive buffer, source_row [capacity])`` in place
        of the row gather (``source_row[i]``: the buffer row of expert row ``i``, a zero row for pad rows), on the
        exchange's stream before the buffer can be reused; not differentiable (:func:`to_experts_quantized`)."""
        out, p.splits_offsets, p.m_splits = self._ordered.run(self._to_experts, send, p, read)
        return out

    def to_sources(self, rows: torch.Tensor, p: _Plan, num_slots: int) -> torch.Tensor:
        return self._ordered.run(self._to_sources, rows, p, num_slots)

    def _to_experts(self, send: torch.Tensor, p: _Plan, read=None) -> torch.Tensor:
        R, Lc = p.send_counts.shape
        X = tuple(send.shape[1:])
        splits = self._buffer("in_splits", R * Lc, (), torch.int64)
        splits.copy_(p.send_counts.reshape(-1))
        so = self._buffer("out_splits_offsets", 2, (R * Lc,), torch.int64)
        src = self._buffer("send", send.shape[0], X, send.dtype)
        src.copy_(send)
        # the exchange's layout takes at most the received rows plus one per empty expert; one more, never written
        # (zero since allocation), is what pad rows read
        landing = p.received_rows
        dst = self._buffer("recv", landing + Lc + 1, X, send.dtype)
        self._ops.all_to_all_vdev_2d(src, dst, splits, so, self.group_name)
        got = so.clone()  # row 0: rows per (local expert, source), expert-major; row 1: where they landed
        chunk_rows = got[0]
        m_splits = chunk_rows.view(Lc, R).sum(1)
        # the padded counts are written by the plan's first exchange (a gradient sent the same way later must not
        # touch them: the grouped GEMM saved them for its backward)
        source_row, chunk_start = expert_input_rows(chunk_rows, got[1], m_splits, p.capacity, landing + Lc, p.align,
                                                    p.aligned_m_splits if p.splits_offsets is None else None)
        # a copy (the buffer is reused by the next call) in this exchange's layout, or what read makes of it
        out = dst.index_select(0, source_row) if read is None else read(dst, source_row)
        return out, torch.stack([chunk_rows, chunk_start]), m_splits

    def _to_sources(self, rows: torch.Tensor, p: _Plan, num_slots: int) -> torch.Tensor:
        if p.splits_offsets is None:
            raise RuntimeError("SymmMemExchange.to_sources: the plan has not been sent forward (to_experts) yet")
        X = tuple(rows.shape[1:])
        so_in = self._buffer("in_splits_offsets", 2, (p.splits_offsets.shape[1],), torch.int64)
        so_in.copy_(p.splits_offsets)
        so_out = self._buffer("back_splits_offsets", 2, (p.splits_offsets.shape[1],), torch.int64)
        src = self._buffer("recv_back", rows.shape[0], X, rows.dtype)
        src.copy_(rows)
        dst = self._buffer("send_back", num_slots, X, rows.dtype)
        self._ops.all_to_all_vdev_2d_offset(src, dst, so_in, so_out, self.group_name)
        pos = torch.arange(num_slots, device=rows.device).view((-1,) + (1,) * len(X))
        return torch.where(pos < p.send_counts.sum(), dst, 0)


def expert_input_rows(chunk_rows: torch.Tensor, landed_at: torch.Tensor, m_splits: torch.Tensor, rows: int,
                      zero_row: int, align: Optional[int], padded_out: Optional[torch.Tensor]):
    """``(source_row [rows], chunk_start [G * R])``: the expert input's layout (groups back to back, or each
    starting at a multiple of ``align`` rows; ``padded_out [G]`` gets the padded counts) read out of a receive
    buffer where chunk ``c`` (expert-major, ``chunk_rows [G * R]`` rows each) landed at row ``landed_at[c]``:
    ``source_row[i]`` is the buffer row of expert-input row ``i`` (``zero_row``, a zero row, for pad rows), and
    ``chunk_start`` where each chunk starts in the expert input (device ops, no sync)."""
    G = m_splits.shape[0]
    group = m_splits if align is None else (m_splits + (align - 1)) // align * align
    if padded_out is not None:
        padded_out.copy_(group)
    per = chunk_rows.view(G, -1)
    chunk_start = ((torch.cumsum(group, 0) - group).view(G, 1) + (torch.cumsum(per, 1) - per)).reshape(-1)
    pos = torch.arange(rows, device=chunk_rows.device)
    c = (torch.searchsorted(chunk_start, pos, right=True) - 1).clamp(min=0)
    rel = pos - chunk_start.index_select(0, c)
    live = (rel >= 0) & (rel < chunk_rows.index_select(0, c))
    return torch.where(live, landed_at.index_select(0, c) + rel, zero_row), chunk_start


# ------------------------------------------------------------------------------------- the fused backend --
class CompletedExchange:
    """The async form's handle where the work is already done when ``*_async`` returns (CPU process groups):
    ``wait()`` returns the result."""

    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result


class FusedState:
    """One dispatch's state for a fused backend: the layout (``route_of_slot``, ``send_counts``), the shape
    (``topk``, ``capacity``: the real rows a rank receives at most, ``align``: the row alignment of the receive
    groups, ``rows``: the expert input's rows ``P = aligned_padded_rows(capacity, Lc, align)``) and what the
    forward dispatch returned (``route_row``, ``m_splits``: the padded counts the grouped GEMM reads, ``counts``:
    the rows that arrived per local expert, ``row_weights``), shared by the forward rows, the row weights, the
    combine and the backward passes."""

    def __init__(self, route_of_slot: torch.Tensor, send_counts: torch.Tensor, topk: int, capacity: int,
                 align: int = 1):
        self.route_of_slot, self.send_counts, self.topk, self.capacity = route_of_slot, send_counts, topk, capacity
        self.align = align
        self.rows = aligned_padded_rows(capacity, send_counts.shape[1], align)
        self.route_row: Optional[torch.Tensor] = None
        self.m_splits: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.row_weights: Optional[torch.Tensor] = None

    def dispatch(self, fx, rows: torch.Tensor, weights: Optional[torch.Tensor], reader=None) -> FusedDispatch:
        """``fx.dispatch`` of ``rows`` [T, *X] on this layout (the alignment and ``reader`` passed only when set:
        backends without them keep working)."""
        extra = {} if self.align == 1 else {"align": self.align}
        if reader is not None:
            extra["reader"] = reader
        return fx.dispatch(rows, self.route_of_slot, self.send_counts, self.topk, self.capacity, weights, **extra)

    def take(self, out: FusedDispatch) -> torch.Tensor:
        self.route_row, self.m_splits, self.row_weights = out.route_row, out.m_splits, out.row_weights
        self.counts = out.m_splits if out.counts is None else out.counts
        return out.expert_in


def is_fused(backend) -> bool:
    """Whether a per-destination backend has the fused interface (``dispatch`` / ``combine`` / ``gather_routes``)
    instead of the plan / ``to_experts`` / ``to_sources`` one."""
    return all(callable(getattr(backend, m, None)) for m in ("dispatch", "combine", "gather_routes"))


def reduce_routes(routes: torch.Tensor, route_row: torch.Tensor, topk: int,
                  weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``routes [T*K, *X]`` (each route's expert row) -> ``[T, *X]``: ``sum_{k ascending} w[t, k] * routes[t*K+k]``
    over the routes with ``route_row >= 0``, accumulated in fp32 (fp64 for fp64) from +0, in ``routes``' dtype; ``w =
    1`` without ``weights [T*K]``. The native ``reduce_rows``: the same arithmetic as the per-pair path's combine."""
    TK = route_row.shape[0]
    X = tuple(routes.shape[1:])
    idx = torch.arange(TK, device=route_row.device)
    rr = torch.where(route_row >= 0, idx, TK).view(TK // topk, topk)
    w = None if weights is None else weights.reshape(TK // topk, topk)
    y = reduce_rows(routes.reshape(TK, math.prod(X)), rr, idx, w)
    return y.view((TK // topk,) + X)


def _placement(counts: torch.Tensor, capacity: int, align: int = 1):
    """``counts [R src, R dst, Lc]`` -> ``(start, fit)`` of the same shape: how many rows of the ``(src, local
    expert)`` chunk arrive at ``dst`` (the chunks cut in source-major order where their running sum reaches
    ``capacity``, as ``csrc/exchange/exchange.h``; the rest are never written) and the first receive row of those
    (rows grouped by local expert, then source, then the sender's order; local expert ``l``'s group starting at
    ``sum_{l' < l} ceil(fit of l' / align) * align``)."""
    flat = counts.permute(1, 0, 2).flatten(1)  # [dst, (src, l)]
    fit = (capacity - (flat.cumsum(1) - flat)).clamp(min=0).minimum(flat).view_as(flat)
    fit = fit.view(counts.shape[1], counts.shape[0], -1).permute(1, 0, 2)  # [src, dst, l]
    padded = -(-fit.sum(0) // align) * align  # [dst, l]
    start = (padded.cumsum(1) - padded).unsqueeze(0) + (fit.cumsum(0) - fit)  # after earlier sources' rows
    return start, fit


def _ranges(starts, sizes) -> torch.Tensor:
    """``cat(arange(a, a + n))`` over host lists (int64)."""
    parts = [torch.arange(a, a + n) for a, n in zip(starts, sizes) if n]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class HostSizedFusedExchange:
    """The fused ("nvlink") exchange's semantics with split sizes read on the host, over any process group (gloo on
    CPUs): the interface the CUDA backend (``moe_graph.ops.nvlink``) implements with one kernel per direction.

    * ``dispatch(rows [T, *X], route_of_slot [N], send_counts [R, Lc], topk, capacity, weights=None, align=1,
      reader=None)`` ->
      :class:`FusedDispatch`: the counts are all-gathered (``[R, R, Lc]``: every rank places every row the same
      way), each kept route's token row is gathered once straight from ``rows`` (no ``expand_rows`` send copy) and
      sent with ``all_to_all_single`` to its destination, which writes it at its final receive row; rows at or past
      ``capacity`` are not sent (``EXCHANGE_COUNTS``). ``weights [T*K]`` (any float dtype, kept) travel beside the
      rows. Any row dtype moves bit for bit (FP8 dispatch's uint8 rows). ``expert_in`` is a fresh tensor.
      ``align``: every local expert's group starts at a multiple of ``align`` rows (zero rows between; ``P =
      aligned_padded_rows(capacity, Lc, align)`` rows, ``route_row = dest * P + row``, ``m_splits`` the padded
      counts, ``counts`` the rows that arrived), as ``csrc/exchange/exchange.h``.
    * ``gather_routes(expert_out [capacity, *X], route_row) -> [T*K, *X]``: each route's row pulled from its
      destination (a request exchange of row indices, then the rows), zeros for ``-1``.
    * ``combine(expert_out, route_row, topk, weights=None) -> [T, *X]``: ``gather_routes`` then
      :func:`reduce_routes` (fp32 accumulation, ``k`` ascending).

    ``ranks_per_node`` (``G``, dividing ``R``; default ``R``: one node): the node-aware two-level exchange. Dispatch
    sends each token row once per (token, destination node) to the rank of that node with this rank's local index
    (the inter-node stage), with the ``K`` routes' receive rows beside it; that rank fans it out to the destination
    ranks of its node (the intra-node stage). Combine pulls the routes inside the node to that rank, reduces them
    there (fp32, ``k`` ascending) and sends one fp32 partial row per (token, node) back, summed over nodes in node
    order: equal to the flat combine up to the fp32 summation order. Expert inputs, ``m_splits`` and ``route_row``
    are identical to the flat exchange's. On gloo both stages are ``all_to_all_single`` over the whole group with
    zero splits between ranks that do not talk. ``gather_routes`` stays flat (one row per route).

    Each call syncs (host sizes): for CPUs and eager runs. The async forms return a :class:`CompletedExchange`.
    """

    def __init__(self, group=None, ranks_per_node: Optional[int] = None):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        G = self.num_ranks if ranks_per_node is None else ranks_per_node
        if isinstance(G, bool) or not isinstance(G, int) or G < 1 or self.num_ranks % G:
            raise ValueError(f"ranks_per_node must be an int >= 1 dividing the EP group's size {self.num_ranks}, "
                             f"got {ranks_per_node!r}")
        self.ranks_per_node = G
        # payload rows this rank sent to each rank (cumulative, per direction; the own rank included): what the
        # benchmark's byte counts are checked against (host counters: CPU runs only)
        self.sent_rows = {op: [0] * self.num_ranks for op in ("dispatch", "combine")}

    def _count(self, op: str, splits) -> None:
        for d, n in enumerate(splits):
            self.sent_rows[op][d] += int(n)

    # ----------------------------------------------------------------------------------------- plumbing --
    def _a2a(self, send: torch.Tensor, send_splits, recv_splits) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def _splits_back(self, send_splits):
        """Rows each rank sends this rank when this rank sends ``send_splits`` (host list per rank)."""
        t = torch.tensor(send_splits, dtype=torch.int64)
        back = torch.empty_like(t)
        dist.all_to_all_single(back, t, group=self.group)
        return back.tolist()

    def _gathered_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``[R, R, Lc]`` int64 on the host: every rank's ``send_counts``; negative entries read as 0 and this rank's
        row is its own (each a flagged inconsistency)."""
        own = send_counts.to(torch.int64)
        parts = [torch.empty_like(own) for _ in range(self.num_ranks)]
        dist.all_gather(parts, own.contiguous(), group=self.group)
        g = torch.stack(parts)
        flag_error_if(((g < 0).flatten().any() | (g[self.rank] != own).any()).view(1), EXCHANGE_COUNTS)
        g = g.clamp(min=0)
        g[self.rank] = own.clamp(min=0)
        return g.cpu()

    @staticmethod
    def _check(rows, route_of_slot, send_counts, topk, capacity, weights, R):
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1:
            raise ValueError(f"dispatch: rows must be a tensor [T, ...], got {getattr(rows, 'shape', rows)!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"dispatch: topk must be an int >= 1, got {topk!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"dispatch: capacity must be an int >= 1, got {capacity!r}")
        TK = rows.shape[0] * topk
        if route_of_slot.dim() != 1 or route_of_slot.dtype != torch.int64:
            raise ValueError(f"dispatch: route_of_slot must be a 1-D int64 tensor, got {tuple(route_of_slot.shape)} "
                             f"{route_of_slot.dtype}")
        if send_counts.dim() != 2 or send_counts.shape[0] != R or send_counts.dtype != torch.int64:
            raise ValueError(f"dispatch: send_counts must be an int64 [R={R}, Lc] tensor, got "
                             f"{tuple(send_counts.shape)} {send_counts.dtype}")
        if weights is not None and (weights.dim() != 1 or weights.shape[0] != TK):
            raise ValueError(f"dispatch: weights must be [T*K={TK}] or None, got {tuple(weights.shape)}")

    # ----------------------------------------------------------------------------------------- dispatch --
    def dispatch(self, rows: torch.Tensor, route_of_slot: torch.Tensor, send_counts: torch.Tensor, topk: int,
                 capacity: int, weights: Optional[torch.Tensor] = None, align: int = 1, reader=None) -> FusedDispatch:
        R, r = self.num_ranks, self.rank
        self._check(rows, route_of_slot, send_counts, topk, capacity, weights, R)
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20:
            raise ValueError(f"dispatch: align must be an int in [1, 2^20], got {align!r}")
        Lc, TK, dev = send_counts.shape[1], rows.shape[0] * topk, rows.device
        P = aligned_padded_rows(capacity, Lc, align)  # the receive rows
        counts = self._gathered_counts(send_counts)
        start, fit = _placement(counts, capacity, align)
        flag_error_if((fit[:, r] != counts[:, r]).any().view(1).to(dev), EXCHANGE_COUNTS)  # this rank's buffer
        mine = counts[r].reshape(-1)  # [(dst, l)] this rank's slots, packed in this order
        n_slots = int(mine.sum())
        if n_slots > route_of_slot.shape[0]:
            raise ValueError(f"dispatch: send_counts hold {n_slots} rows but route_of_slot has "
                             f"{route_of_slot.shape[0]} slots")
        chunk = torch.repeat_interleave(torch.arange(R * Lc), mine)
        pos = torch.arange(n_slots) - (mine.cumsum(0) - mine)[chunk]
        keep = pos < fit[r].reshape(-1)[chunk]
        dest_row = ((chunk // Lc) * P + start[r].reshape(-1)[chunk] + pos)[keep].to(dev)
        routes = route_of_slot[:n_slots][keep.to(dev)]  # by destination, local expert, slot order
        route_row = torch.full((TK,), -1, dtype=torch.int64, device=dev).index_copy_(0, routes, dest_row)
        # the rows each source sends this rank, in its slot order -> their final rows here
        recv_rows = _ranges(start[:, r].reshape(-1).tolist(), fit[:, r].reshape(-1).tolist()).to(dev)
        arrived = fit[:, r].sum(0)
        m_splits = (-(-arrived // align) * align).to(dev)
        if self.ranks_per_node == R:
            send_splits, recv_splits = fit[r].sum(1).tolist(), fit[:, r].sum(1).tolist()
            payload = [rows.index_select(0, torch.div(routes, topk, rounding_mode="floor"))]  # one read per route
            if weights is not None:
                payload.append(weights.index_select(0, routes))
            moved = [self._a2a(p, send_splits, recv_splits) for p in payload]
            self._count("dispatch", send_splits)
            placed = [p.new_zeros((P,) + tuple(p.shape[1:])).index_copy_(0, recv_rows, m) for p, m in
                      zip(payload, moved)]
        else:
            placed = self._dispatch_two_level(rows, route_row, topk, P, weights)
        row_weights = placed[1] if weights is not None else None
        expert_in = placed[0] if reader is None else reader(placed[0], m_splits, row_weights)
        return FusedDispatch(expert_in, m_splits, row_weights, route_row, arrived.to(dev))

    def gather_routes(self, expert_out: torch.Tensor, route_row: torch.Tensor) -> torch.Tensor:
        R, TK, dev = self.num_ranks, route_row.shape[0], route_row.device
        cap = expert_out.shape[0]
        if route_row.dim() != 1 or route_row.dtype != torch.int64:
            raise ValueError(f"gather_routes: route_row must be a 1-D int64 tensor, got {tuple(route_row.shape)} "
                             f"{route_row.dtype}")
        bad = route_row >= R * cap
        flag_error_if(bad.any().view(1), EXCHANGE_COUNTS)
        dest = torch.where((route_row >= 0) & ~bad, torch.div(route_row, cap, rounding_mode="floor"), R)
        order = torch.argsort(dest, stable=True)
        ask = torch.bincount(dest, minlength=R + 1)[:R]
        order = order[:int(ask.sum())]
        send_splits = ask.tolist()
        recv_splits = self._splits_back(send_splits)
        req = self._a2a(route_row.index_select(0, order) % cap, send_splits, recv_splits)
        back = self._a2a(expert_out.index_select(0, req), recv_splits, send_splits)  # each route's row read once
        self._count("combine", recv_splits)
        return expert_out.new_zeros((TK,) + tuple(expert_out.shape[1:])).index_copy_(0, order, back)

    def combine(self, expert_out: torch.Tensor, route_row: torch.Tensor, topk: int,
                weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if weights is not None and weights.shape != route_row.shape:
            raise ValueError(f"combine: weights must be [T*K={route_row.shape[0]}] or None, got "
                             f"{tuple(weights.shape)}")
        if self.ranks_per_node == self.num_ranks:
            return reduce_routes(self.gather_routes(expert_out, route_row), route_row, topk, weights)
        return self._combine_two_level(expert_out, route_row, topk, weights)

    def dispatch_async(self, *args, **kwargs) -> CompletedExchange:
        return CompletedExchange(self.dispatch(*args, **kwargs))

    def combine_async(self, *args, **kwargs) -> CompletedExchange:
        return CompletedExchange(self.combine(*args, **kwargs))

    # ---------------------------------------------------------------------------------------- two-level --
    def _pairs(self, route_row: torch.Tensor, topk: int, capacity: int):
        """This rank's (token, destination node) pairs, node-major then token order: ``(pair_token [P], pair_node
        [P], meta [P, K] (route_row of the token's routes to that node, -1 elsewhere), meta_route [P, K] (those
        routes' indices, -1 elsewhere), per_node [nodes] host list)``."""
        G, TK = self.ranks_per_node, route_row.shape[0]
        T, dev = TK // topk, route_row.device
        nodes = self.num_ranks // G
        route = torch.arange(TK, device=dev)
        live = route_row >= 0
        node = torch.where(live, torch.div(route_row, capacity * G, rounding_mode="floor"), 0)
        key = torch.where(live, node * T + torch.div(route, topk, rounding_mode="floor"), -1)
        keys = torch.unique(key[live])  # sorted: node-major, then token
        P = keys.shape[0]
        slot = torch.where(live, torch.searchsorted(keys, key) * topk + route % topk, P * topk)  # P*K: dump
        meta = torch.full((P * topk + 1,), -1, dtype=torch.int64, device=dev).index_copy_(0, slot, route_row)
        meta_route = torch.full((P * topk + 1,), -1, dtype=torch.int64, device=dev).index_copy_(
            0, slot, torch.where(live, route, -1))
        pair_node = torch.div(keys, max(T, 1), rounding_mode="floor")
        per_node = torch.bincount(pair_node, minlength=nodes).tolist()
        return (keys - pair_node * T, pair_node, meta[:-1].view(P, topk), meta_route[:-1].view(P, topk), per_node)

    def _forwarder_splits(self, per_node):
        """Inter-node splits: the pairs for node ``n`` go to rank ``n * G + (this rank's local index)``."""
        G, splits = self.ranks_per_node, [0] * self.num_ranks
        for n, c in enumerate(per_node):
            splits[n * G + self.rank % G] = c
        return splits

    def _fan_out(self, meta: torch.Tensor, capacity: int):
        """At a forwarding rank: the received pairs' routes ``(index [M] into meta.view(-1), row at the destination
        [M], splits per destination rank)``, by destination then pair order."""
        flat = meta.reshape(-1)
        live = flat >= 0
        dest = torch.where(live, torch.div(flat, capacity, rounding_mode="floor"), self.num_ranks)
        order = torch.argsort(dest, stable=True)[:int(live.sum())]
        splits = torch.bincount(dest[order], minlength=self.num_ranks).tolist()
        return order, flat.index_select(0, order) % capacity, splits

    @staticmethod
    def _meta_weights(weights: torch.Tensor, meta_route: torch.Tensor) -> torch.Tensor:
        w = weights.index_select(0, meta_route.reshape(-1).clamp(min=0)).view(meta_route.shape)
        return torch.where(meta_route >= 0, w, 0)

    def _dispatch_two_level(self, rows, route_row, topk, capacity, weights):
        pair_token, _, meta, meta_route, per_node = self._pairs(route_row, topk, capacity)
        s1 = self._forwarder_splits(per_node)
        r1 = self._splits_back(s1)
        x1 = self._a2a(rows.index_select(0, pair_token), s1, r1)  # inter-node: one row per (token, node)
        self._count("dispatch", s1)
        m1 = self._a2a(meta, s1, r1)
        order, row_at, s2 = self._fan_out(m1, capacity)
        r2 = self._splits_back(s2)
        payload = [x1.index_select(0, torch.div(order, topk, rounding_mode="floor"))]  # intra-node fan-out
        if weights is not None:
            w1 = self._a2a(self._meta_weights(weights, meta_route), s1, r1)
            payload.append(w1.reshape(-1).index_select(0, order))
        at = self._a2a(row_at, s2, r2)
        self._count("dispatch", s2)
        return [p.new_zeros((capacity,) + tuple(p.shape[1:])).index_copy_(0, at, self._a2a(p, s2, r2))
                for p in payload]

    def _combine_two_level(self, expert_out, route_row, topk, weights):
        cap, X, dev = expert_out.shape[0], tuple(expert_out.shape[1:]), expert_out.device
        T = route_row.shape[0] // topk
        pair_token, pair_node, meta, meta_route, per_node = self._pairs(route_row, topk, cap)
        s1 = self._forwarder_splits(per_node)
        r1 = self._splits_back(s1)
        m1 = self._a2a(meta, s1, r1)  # the routes of each pair (the CUDA design keeps them from the dispatch)
        order, row_at, s2 = self._fan_out(m1, cap)
        r2 = self._splits_back(s2)
        req = self._a2a(row_at, s2, r2)
        got = self._a2a(expert_out.index_select(0, req), r2, s2)  # intra-node: each route's row to the forwarder
        self._count("combine", r2)
        acc = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
        routes = got.new_zeros((m1.numel(),) + X, dtype=acc).index_copy_(0, order, got.to(acc))
        w1 = None if weights is None else self._a2a(self._meta_weights(weights, meta_route), s1, r1).reshape(-1)
        partial = reduce_routes(routes, m1.reshape(-1), topk, w1)  # [Q, X] fp32: the node's routes, k ascending
        back = self._a2a(partial, r1, s1)  # inter-node: one partial row per (token, node)
        self._count("combine", r1)
        P, nodes = back.shape[0], self.num_ranks // self.ranks_per_node
        rr = torch.full((T, nodes), P, dtype=torch.int64, device=dev)
        rr[pair_token, pair_node] = torch.arange(P, device=dev)
        y = reduce_rows(back.reshape(P, math.prod(X)), rr, torch.arange(P, device=dev))  # node ascending, from +0
        return y.to(expert_out.dtype).view((T,) + X)


def nvlink_available(group=None, device: Optional[torch.device] = None) -> bool:
    """True when ``exchange="auto"`` should take the fused CUDA exchange: a CUDA device, ``moe_graph.ops.nvlink``
    exposes a backend, and every rank of ``group`` is a local peer this device reaches over NVLink / P2P
    (``torch.cuda.can_device_access_peer``; a group spanning hosts, whose local world size is below the group's,
    answers False). Never raises."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        if not kernels_available():
            return False
        n = dist.get_world_size(group)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        if local < n or n > torch.cuda.device_count():
            return False
        me = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        peers = [r - dist.get_rank() + local_rank for r in ranks]  # a one-host group: devices by local rank
        return all(p == me or torch.cuda.can_device_access_peer(me, p) for p in peers if 0 <= p)
    except Exception:  # noqa: BLE001 - a probe: any failure means "not available"
        return False


# ------------------------------------------------------------------------------ autograd over a fused one --
class FusedDispatchFn(torch.autograd.Function):
    """Token rows -> expert input through a fused backend (``state`` takes ``route_row``, ``m_splits`` and the
    carried weights); backward: ``combine(grad, route_row, topk)`` (the plain sum of each token's routes)."""

    @staticmethod
    def forward(ctx, fx, state: FusedState, rows, weights):
        ctx.fx, ctx.state = fx, state
        out = state.take(state.dispatch(fx, rows.contiguous(), weights))
        ctx.point = exchange_issued()  # an exchange point (moe_graph.train.interleave hands the turn over here)
        return out

    @staticmethod
    def backward(ctx, g):
        s = ctx.state
        out = ctx.fx.combine(g.contiguous(), s.route_row, s.topk, None)
        exchange_issued(ctx.point)
        return None, None, out, None


def fused_dispatch_quantized(fx, state: "FusedState", rows: torch.Tensor, weights: Optional[torch.Tensor],
                             recipe) -> QuantizedRows:
    """:class:`FusedDispatchFn` for FP8 experts (``state`` aligned): the receive side writes the expert input's two
    FP8 copies under ``recipe`` straight from the receive buffer (``ops.fp8.quantize_pair`` as the backend's
    ``reader``), the 16-bit expert input never copied out; a ``QuantizedRows`` whose carrier takes the gradient home
    as :class:`FusedDispatchFn`'s backward does (the plain sum of each token's routes); an exchange point each way."""
    out = state.take(state.dispatch(fx, rows.detach().contiguous(), weights,
                                    reader=lambda x, m, w: quantize_pair(x, m, recipe, recipe.fwd_dtype)))
    point = exchange_issued()
    (q, s), columns = out

    def back(g: torch.Tensor) -> torch.Tensor:
        grad = fx.combine(g, state.route_row, state.topk, None)
        exchange_issued(point)
        return grad

    return QuantizedRows(carrier(rows, state.rows, back), q, s, recipe.kind, columns)


class FusedCombineFn(torch.autograd.Function):
    """Expert outputs -> ``[T, *X]`` (weighted or plain sum of each token's routes) through a fused backend;
    backward: the output gradient dispatched like the tokens and scaled at the destination by the carried weights
    (the expert outputs' gradient), and ``<dy[t], gather_routes(expert_out)[t*K+k]>`` (the weights' gradient)."""

    @staticmethod
    def forward(ctx, fx, state: FusedState, expert_out, weights, handoff=None):
        ctx.fx, ctx.state, ctx.handoff = fx, state, handoff
        ctx.save_for_backward(expert_out if ctx.needs_input_grad[3] else None, weights)
        out = fx.combine(expert_out.contiguous(), state.route_row, state.topk, weights)
        ctx.point = exchange_issued()
        return out

    @staticmethod
    def backward(ctx, dy):
        fx, s, handoff = ctx.fx, ctx.state, ctx.handoff
        expert_out, weights = ctx.saved_tensors
        dy = dy.contiguous()
        grad_out = grad_w = None
        if ctx.needs_input_grad[2]:
            w = None if weights is None else weights.detach()

            def dense() -> torch.Tensor:  # the expert outputs' 16-bit gradient
                out = s.dispatch(fx, dy, w)
                if w is None:
                    return out.expert_in
                acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
                scale = out.row_weights.to(acc).view((-1,) + (1,) * (dy.dim() - 1))
                return (out.expert_in.to(acc) * scale).to(dy.dtype)

            if handoff is not None:  # fc2's two FP8 dy copies written from the receive buffer, the weights applied
                read = quantized_reader(handoff.m_splits, handoff.recipe, handoff.recipe.bwd_dtype,
                                        None if w is None else lambda rw: rw.view(-1, 1))
                copies = s.dispatch(fx, dy, w, reader=lambda x, m, rw: read(x, None, rw)).expert_in
                # the 16-bit fallback (another consumer summed into fc2's output gradient) dispatches dy again
                grad_out = handoff.give(copies, (s.rows, dy.shape[1]), dy, dense)
            else:
                grad_out = dense()
        if ctx.needs_input_grad[3]:
            TK = s.route_row.shape[0]
            width = math.prod(expert_out.shape[1:])
            routes = fx.gather_routes(expert_out.contiguous(), s.route_row).reshape(TK, width)
            grad_w = route_dot(dy.reshape(TK // s.topk, width), routes,
                               torch.arange(TK, device=dy.device).view(TK // s.topk, s.topk))
            grad_w = grad_w.reshape(TK).to(weights.dtype)
        exchange_issued(ctx.point)
        return None, None, grad_out, grad_w, None


class RowWeightsFn(torch.autograd.Function):
    """The weights the forward dispatch carried beside the rows (``state.row_weights``), differentiable w.r.t. the
    ``[T*K]`` weights: backward pulls each route's row gradient back (``gather_routes``)."""

    @staticmethod
    def forward(ctx, fx, state: FusedState, weights):
        ctx.fx, ctx.state = fx, state
        return state.row_weights.to(weights.dtype)

    @staticmethod
    def backward(ctx, g):
        s = ctx.state
        return None, None, ctx.fx.gather_routes(g.contiguous().view(-1, 1), s.route_row).view(-1)


def resolve_exchange(exchange: str, group=None, device=None, ranks_per_node: Optional[int] = None,
                     num_sms: Optional[int] = None):
    """``(rule, backend)``: ``("pair", None)`` for the fixed-split all-to-all, ``("destination", backend)`` for the
    variable-size exchange (a plan / ``to_experts`` backend, or a fused one: :func:`is_fused`).

    * ``"symm_mem"``: :class:`SymmMemExchange` on CUDA (raises without NVSHMEM), :class:`HostSizedExchange` on CPU
      process groups.
    * ``"nvlink"``: the fused exchange: on CUDA ``moe_graph.ops.nvlink.NvlinkExchange(group, device,
      num_sms=...)`` (raises, naming what is missing, without the CUDA kernels; ``ranks_per_node`` raises there: the
      inter-node stage is design only), on CPU process groups
      :class:`HostSizedFusedExchange` (``ranks_per_node``: the node-aware two-level exchange).
    * ``"auto"``: on CUDA ``nvlink`` where :func:`nvlink_available` (every EP peer a local NVLink / P2P peer), else
      ``symm_mem`` where :func:`symm_mem_available`, else ``nccl``; on CPUs ``nccl`` (unchanged).

    ``num_sms`` (CUDA fused backend only): its CTA bound (``None``: the backend's default, 20)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if exchange == "auto":
        exchange = ("nvlink" if nvlink_available(group, dev) else
                    "symm_mem" if symm_mem_available(group, dev) else "nccl")
    if exchange == "nccl":
        return "pair", None
    if exchange == "nvlink":
        if dev.type != "cuda":
            return "destination", HostSizedFusedExchange(group, ranks_per_node)
        if not kernels_available():
            raise RuntimeError("exchange='nvlink' on CUDA needs the fused exchange kernels, which this build of "
                               "moe_graph._C lacks (build with MOE_GRAPH_CUDA=1); use exchange='symm_mem' or 'nccl'")
        if ranks_per_node is not None and ranks_per_node != dist.get_world_size(group):
            raise ValueError(f"ranks_per_node={ranks_per_node}: the node-aware exchange's CUDA inter-node stage "
                             "(NVSHMEM) is not built; on CUDA exchange='nvlink' runs within one NVLink domain "
                             "(ranks_per_node=None); the two-level semantics run on CPU process groups")
        return "destination", NvlinkExchange(group, dev, **({} if num_sms is None else {"num_sms": num_sms}))
    if dev.type == "cuda":
        if not symm_mem_available(group, dev):
            raise RuntimeError("exchange='symm_mem' needs torch's NVSHMEM symmetric memory "
                               "(torch.distributed._symmetric_memory.is_nvshmem_available()); use exchange='nccl'")
        return "destination", SymmMemExchange(group, dev)
    return "destination", HostSizedExchange(group)


class ToExperts(torch.autograd.Function):
    """Send-slot rows -> expert rows through a per-destination backend; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, backend, plan, send):
        ctx.backend, ctx.plan, ctx.num_slots = backend, plan, send.shape[0]
        out = backend.to_experts(send.contiguous(), plan)
        ctx.point = exchange_issued()  # an exchange point (moe_graph.train.interleave hands the turn over here)
        return out

    @staticmethod
    def backward(ctx, g):
        out = ctx.backend.to_sources(g.contiguous(), ctx.plan, ctx.num_slots)
        exchange_issued(ctx.point)
        return None, None, out


def quantized_reader(m_splits: torch.Tensor, recipe, dtype: torch.dtype, weights=None):
    """A ``to_experts_read`` / fused ``reader`` that writes the expert rows' two FP8 copies (groups ``m_splits``)
    straight from the received rows: ``ops.permute.expand_quantize_copies`` (``weights``: a function of the
    reader's third argument, the carried row weights, giving ``[rows, 1]`` weights to apply first)."""
    def read(src: torch.Tensor, source_row: Optional[torch.Tensor], carried=None):  # None: src's rows as they are
        return expand_quantize_copies(src, source_row, 1, m_splits, recipe, dtype,
                                      None if weights is None else weights(carried))
    return read


def to_experts_quantized(backend, plan, send: torch.Tensor, m_splits: torch.Tensor, recipe) -> QuantizedRows:
    """The FP8 experts' input through a per-destination backend (``to_experts_read``: the receive side writes both
    FP8 copies, groups ``m_splits``), a ``QuantizedRows`` whose carrier takes the expert input's 16-bit gradient back
    through the reverse exchange to ``send`` (as :class:`ToExperts`' backward); an exchange point each way."""
    (q, s), columns = backend.to_experts_read(send.detach().contiguous(), plan,
                                              quantized_reader(m_splits, recipe, recipe.fwd_dtype))
    point = exchange_issued()

    def back(g: torch.Tensor) -> torch.Tensor:
        out = backend.to_sources(g, plan, send.shape[0])
        exchange_issued(point)
        return out

    return QuantizedRows(carrier(send, plan.capacity, back), q, s, recipe.kind, columns)


class ToSources(torch.autograd.Function):
    """Expert rows -> this rank's send slots (the reverse exchange); backward is the forward exchange. ``handoff``
    (a ``moe_graph.fp8.GradHandoff`` bound to ``rows``, the FP8 fc2's output; the backend's
    ``to_experts_read``): the backward's receive side writes the rows' gradient as its two FP8 copies for
    fc2's backward (the bytes of quantizing the 16-bit gradient) and hands autograd a zero-stride zero."""

    @staticmethod
    def forward(ctx, backend, plan, rows, num_slots, handoff=None):
        ctx.backend, ctx.plan, ctx.handoff = backend, plan, handoff
        out = backend.to_sources(rows.contiguous(), plan, num_slots)
        ctx.point = exchange_issued()
        return out

    @staticmethod
    def backward(ctx, g):
        g, backend, plan, handoff = g.contiguous(), ctx.backend, ctx.plan, ctx.handoff
        if handoff is not None:
            copies = backend.to_experts_read(g, plan, quantized_reader(handoff.m_splits, handoff.recipe,
                                                                       handoff.recipe.bwd_dtype))
            # the 16-bit fallback (another consumer summed into fc2's output gradient) sends the gradient again
            out = handoff.give(copies, (plan.capacity, g.shape[1]), g, lambda: backend.to_experts(g, plan))
        else:
            out = backend.to_experts(g, plan)
        exchange_issued(ctx.point)
        return None, None, out, None, None
