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
from typing import Optional

import torch
import torch.distributed as dist

try:  # torch's symmetric memory (NVSHMEM exchange): optional
    from torch.distributed import _symmetric_memory as _symm
except ImportError:  # pragma: no cover - torch without it
    _symm = None

from moe_graph.ops.errors import EXCHANGE_COUNTS, flag_error_if

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
    "resolve_exchange",
    "exchange_bytes",
]

# "nccl": fixed-split all-to-all, capacity per (source, destination) pair; "symm_mem": variable-size exchange,
# capacity per destination; "auto": symm_mem where torch's NVSHMEM exchange exists for the group, else nccl
EXCHANGES = ("nccl", "symm_mem", "auto")


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

    def to_experts(self, send: torch.Tensor, p: _Plan) -> torch.Tensor:
        """Send-slot rows ``[n, X]`` (packed, by destination) -> expert input ``[capacity, X]``."""
        X = send.shape[1:]
        recv = send.new_empty((sum(p.recv_splits),) + tuple(X))
        dist.all_to_all_single(recv, send[:sum(p.send_splits)].contiguous(), p.recv_splits, p.send_splits,
                               group=self.group)
        out = send.new_zeros((p.capacity,) + tuple(X))
        return out.index_copy_(0, p.expert_index, recv.index_select(0, p.recv_index))

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
    collective: run one eager step before capture (``FullIterationGraph``'s warm-up does)."""

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
        self._buffers = {}

    def _buffer(self, tag: str, rows: int, row_shape, dtype) -> torch.Tensor:
        key = (tag, rows, tuple(row_shape), dtype)
        if key not in self._buffers:
            buf = self._symm.empty((rows,) + tuple(row_shape), dtype=dtype, device=self.device)
            self._symm.rendezvous(buf, self.group_name)
            self._buffers[key] = buf
        return self._buffers[key]

    def plan(self, send_counts: torch.Tensor, capacity: int) -> _Plan:
        # the splits live in the plan (ordinary memory), copied into the shared symmetric buffers at each call: a
        # later layer's dispatch reuses those buffers before this one's backward runs
        p = _Plan(send_counts, capacity)
        p.splits_offsets = None  # [2, R * Lc] of the forward exchange (expert-major), kept for the reverse one
        return p

    def to_experts(self, send: torch.Tensor, p: _Plan) -> torch.Tensor:
        R, Lc = p.send_counts.shape
        X = tuple(send.shape[1:])
        splits = self._buffer("in_splits", R * Lc, (), torch.int64)
        splits.copy_(p.send_counts.reshape(-1))
        so = self._buffer("out_splits_offsets", 2, (R * Lc,), torch.int64)
        src = self._buffer("send", send.shape[0], X, send.dtype)
        src.copy_(send)
        dst = self._buffer("recv", p.capacity, X, send.dtype)
        torch.ops.symm_mem.all_to_all_vdev_2d(src, dst, splits, so, self.group_name)
        p.splits_offsets = so.clone()
        # row 0: rows per (local expert, source), expert-major
        p.m_splits = p.splits_offsets[0].view(Lc, R).sum(1)
        pos = torch.arange(p.capacity, device=send.device).view((-1,) + (1,) * len(X))
        return torch.where(pos < p.m_splits.sum(), dst, 0)  # a copy: the buffer is reused by the next call

    def to_sources(self, rows: torch.Tensor, p: _Plan, num_slots: int) -> torch.Tensor:
        if p.splits_offsets is None:
            raise RuntimeError("SymmMemExchange.to_sources: the plan has not been sent forward (to_experts) yet")
        X = tuple(rows.shape[1:])
        so_in = self._buffer("in_splits_offsets", 2, (p.splits_offsets.shape[1],), torch.int64)
        so_in.copy_(p.splits_offsets)
        so_out = self._buffer("back_splits_offsets", 2, (p.splits_offsets.shape[1],), torch.int64)
        src = self._buffer("recv_back", rows.shape[0], X, rows.dtype)
        src.copy_(rows)
        dst = self._buffer("send_back", num_slots, X, rows.dtype)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(src, dst, so_in, so_out, self.group_name)
        pos = torch.arange(num_slots, device=rows.device).view((-1,) + (1,) * len(X))
        return torch.where(pos < p.send_counts.sum(), dst, 0)


def resolve_exchange(exchange: str, group=None, device=None):
    """``(rule, backend)``: ``("pair", None)`` for the fixed-split all-to-all, ``("destination", backend)`` for the
    variable-size exchange. ``"auto"`` picks ``symm_mem`` where :func:`symm_mem_available`, else ``nccl``;
    ``"symm_mem"`` on a CPU process group runs the same semantics with host-known sizes (:class:`HostSizedExchange`),
    on CUDA without NVSHMEM it raises."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if exchange == "nccl" or (exchange == "auto" and not symm_mem_available(group, dev)):
        return "pair", None
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
        return backend.to_experts(send.contiguous(), plan)

    @staticmethod
    def backward(ctx, g):
        return None, None, ctx.backend.to_sources(g.contiguous(), ctx.plan, ctx.num_slots)


class ToSources(torch.autograd.Function):
    """Expert rows -> this rank's send slots (the reverse exchange); backward is the forward exchange."""

    @staticmethod
    def forward(ctx, backend, plan, rows, num_slots):
        ctx.backend, ctx.plan = backend, plan
        return backend.to_sources(rows.contiguous(), plan, num_slots)

    @staticmethod
    def backward(ctx, g):
        return None, None, ctx.backend.to_experts(g.contiguous(), ctx.plan), None
