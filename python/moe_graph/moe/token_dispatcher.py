"""Static-capacity token dispatcher: lay the routes out by (EP rank, local expert), exchange them with a fixed-split
all-to-all, hand the grouped GEMM its rows with per-local-expert ``m_splits`` on the device, and combine the expert
outputs back (a weighted or plain sum of each token's routes).

Every buffer has a static size, so :meth:`TokenDispatcher.dispatch` / :meth:`TokenDispatcher.combine` and their
backward passes are capturable in a CUDA graph and never synchronize with the host: the index bookkeeping is one
native op (:func:`moe_graph.ops.dispatch_layout.dispatch_layout`, plus :func:`~moe_graph.ops.dispatch_layout.receive_layout`
at EP > 1), the rows move with the native row ops :func:`moe_graph.ops.permute.expand_rows` /
:func:`~moe_graph.ops.permute.reduce_rows` (zero rows for the sentinels, gather-only backward, no atomics), and the
all-to-all always moves ``capacity`` rows per (source, destination) pair. With ``exchange="symm_mem"`` the capacity
is per destination rank instead and only the routed rows travel (:mod:`moe_graph.moe.exchange`: the layout op in
quota mode, a variable-size exchange); everything after the exchange is shared.

Layout. ``R`` EP ranks, ``T`` local tokens with ``K`` routes each (``indices [T, K]`` into ``C`` routing
*columns*: the ``E`` home experts and, with echo, the ``S = R * k`` spare slots). Column ``c`` lives on rank
``column_rank[c]`` as local expert ``column_local[c]`` of ``num_local_columns = L + k`` (``L = E // R`` home experts
first, then the ``k`` spare slots; :func:`expert_columns` builds this map). Each rank sends at most ``capacity``
routes to each rank (the send buffer is ``[R, capacity, H]``, each destination's block grouped by local expert, then
token order, padding rows last) and receives ``R * capacity`` rows. At ``R = 1`` the send buffer is the expert input;
at ``R > 1`` the receiver exchanges the ``[R, num_local_columns]`` counts too and regroups its rows by local expert,
then source rank.

Drops. When more than ``capacity`` routes go to one rank, the ones past the capacity are dropped (they contribute
zero to the output, with zero gradient), deterministically: with ``drop_policy="position"`` the routes to one
destination keep the order (token, then k) and the last ones are dropped; with ``"probs"`` (Megatron's default
policy) they are ranked by routing probability, highest first (ties: token, then k), and the least probable ones are
dropped.
Drops are a statistic of normal training with a capacity factor, not an error: every drop is counted on the device
(:attr:`TokenDispatcher.dropped_routes`, cumulative int64; ``handle.dropped`` for one call) and never sets the device
error flag, so ``moe_graph.check_errors()`` does not raise on them. Nothing syncs until asked:
:meth:`TokenDispatcher.check_drops` (or :func:`moe_graph.moe.layer.read_moe_statistics` for a whole model) reads the
counter, the one call that syncs, by design.
``capacity=None`` is dropless (``capacity = T * K``: every route fits even if all go to one rank).

Overflow. Besides the cumulative counter, each dispatch adds its drops to :attr:`TokenDispatcher.step_dropped_routes`
and keeps the step's largest *load ratio* in :attr:`TokenDispatcher.step_max_load_ratio` (the most routes one rank
sends one rank, over the mean ``T * K / R``: the capacity factor at which nothing would have dropped);
:meth:`TokenDispatcher.reset_step_counters` zeroes both (device ops). They are what the dropless mode with a static
capacity (``overflow="rerun"``, :data:`OVERFLOW_MODES`; :func:`moe_graph.train.step.train_step`) reads: a
nonzero step count skips the optimizer update on every rank, and the rerun uses the ratio as its capacity factor.
The layout op updates all three counters in place (not while a backward recomputes the forward:
:func:`counting_enabled`).

Constant tables (the column map, the counters) are built on ``device`` at construction, so the first
:meth:`TokenDispatcher.dispatch` makes no host-to-device copy (it may run under
``torch.cuda.set_sync_debug_mode("error")`` or inside a capture); the dispatcher is an ``nn.Module`` whose
(non-persistent) buffers follow ``.to(device)`` of the model that owns it.

Example (one process, 4 experts, top-2)::

    d = TokenDispatcher(num_local_columns=4, num_ep_ranks=1, ep_rank=0, column_rank=torch.zeros(4, dtype=torch.long),
                        column_local=torch.arange(4), capacity=None)
    expert_in, m_splits, h = d.dispatch(x, indices, probs)      # rows grouped by expert, m_splits on device
    y = d.combine(grouped_mlp(expert_in, m_splits), h)          # [T, H]: sum_k probs[t, k] * expert output
    # or, the probabilities applied inside the experts (e.g. before the second GEMM):
    y = d.combine(grouped_mlp(expert_in, m_splits, row_scale=d.row_weights(h)), h, weighted=False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_graph.moe.echo import default_backend
from moe_graph.moe.exchange import (EXCHANGES, CompletedExchange, FusedCombineFn, FusedDispatchFn, FusedState,
                                    HostSizedExchange, RowWeightsFn, SymmMemExchange, ToExperts, ToSources, capacity_for,
                                    checked_demand, checksum_weights,
                                    destination_capacity, destination_quotas, flag_if_ranks_disagree, is_fused,
                                    fused_dispatch_quantized, resolve_exchange, to_experts_quantized)
from moe_graph.ops.dispatch_layout import dispatch_layout, receive_layout
from moe_graph.ops.fp8 import check_row_local, carrier, pack_rows, unpack_rows
from moe_graph.ops.permute import (expand_pack, expand_pack_available, expand_quantize, expand_quantize_available,
                                   expand_quantize_packed, expand_rows, reduce_rows)
from moe_graph.streams import exchange_issued, minor_exchanges

__all__ = [
    "TokenDispatcher",
    "DispatchHandle",
    "expert_columns",
    "capacity_for",
    "topk_from_routing_map",
    "counting_enabled",
    "DROP_POLICIES",
    "OVERFLOW_MODES",
    "receive_buffer_bytes",
    "take_rows",
]


DROP_POLICIES = ("position", "probs")
# what a route over the static capacity does: "drop" (dropped, counted) or "rerun" (the step's update is skipped and
# the step rerun with the capacity it needed: dropless training; see moe_graph.train.step.OverflowRerun)
OVERFLOW_MODES = ("drop", "rerun")


# ------------------------------------------------------------------------------------------------ helpers --
# FP8 dispatch (``dispatch(fp8_recipe=...)``) with aligned groups (every exchange): the send rows quantized and
# packed by one op (``ops.permute.expand_pack``) and the expert input's rowwise and columnwise copies written from the
# received packed rows by one op (``ops.permute.expand_quantize_packed``; on the fused exchange it reads the receive
# buffer, the packed tokens sent as they are). False: the previous path (``ops.fp8.
# pack_rows``, byte gathers, ``unpack_rows``; the first FP8 GEMM requantizes the columnwise copy), bit-equal results.
FUSED_FP8_DISPATCH = True


def counting_enabled() -> bool:
    """Whether a forward should add to cumulative device statistics (drop counter, expert-bias route counts):
    False while autograd runs a backward, where activation recomputation (``torch.utils.checkpoint``) re-runs the
    forward, so that every token is counted once. A host-side check: no sync, fine under capture. While
    ``torch.compile`` traces a forward it is True (the traced graph's backward never re-runs the Python forward)."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._current_graph_task_id() == -1


def expert_columns(num_experts: int, num_ep_ranks: int, num_spare_experts_per_ep_rank: int = 0, device=None):
    """``(column_rank [E+S], column_local [E+S])`` int64 for ``E`` home experts (``L = E // R`` per rank, expert
    ``e`` on rank ``e // L`` at local index ``e % L``) and ``S = R * k`` spare slots (slot ``j`` on rank ``j // k``
    at local index ``L + j % k``), as in :mod:`moe_graph.moe.echo_planner` and :mod:`moe_graph.moe.echo`."""
    if num_experts % num_ep_ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by num_ep_ranks={num_ep_ranks}")
    L, k = num_experts // num_ep_ranks, num_spare_experts_per_ep_rank
    e = torch.arange(num_experts, device=device)
    j = torch.arange(num_ep_ranks * k, device=device)
    rank = torch.cat([e // L, j // k if k else j])
    local = torch.cat([e % L, L + (j % k) if k else j])
    return rank.to(torch.int64), local.to(torch.int64)


def receive_buffer_bytes(num_tokens: int, topk: int, num_ep_ranks: int, hidden_size: int,
                         capacity_factor: Optional[float], dtype: torch.dtype) -> int:
    """Bytes of one dispatch's receive buffer (``[R * capacity, H]``): ``R * ceil(cf * T * K / R) * H`` elements,
    about ``cf`` times the mean load ``T * K`` rows whatever ``R``; ``capacity_factor=None``: ``R * T * K`` rows."""
    rows = num_ep_ranks * capacity_for(num_tokens, topk, num_ep_ranks, capacity_factor)
    return rows * hidden_size * torch.empty((), dtype=dtype).element_size()


def topk_from_routing_map(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """``(indices [T, K], probs [T, K], valid [T, K])`` from a ``[T, C]`` bool map with at most ``K`` routes per
    token (e.g. the planner's rerouted map): the routed columns in ascending order, padded with invalid entries.
    Sync-free (a stable sort of the map, no ``nonzero``)."""
    if routing_map.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError(
            f"routing_map and probs must both be [T, C]; got {tuple(routing_map.shape)} and {tuple(probs.shape)}"
        )
    if not 1 <= topk <= routing_map.shape[1]:
        raise ValueError(f"topk must be in [1, {routing_map.shape[1]}], got {topk}")
    m = routing_map.to(torch.bool)
    # descending stable sort of 0/1: routed columns first, in ascending column order
    idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True)[:, :topk]
    valid = m.gather(1, idx)
    p = probs.gather(1, idx)
    return idx, p, valid


# ------------------------------------------------------------------------------------------------ autograd --
class _Exchange(torch.autograd.Function):
    """Fixed-split all-to-all of ``[R, ...]`` blocks; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, backend, x):
        ctx.backend = backend
        out = backend.exchange(x.contiguous())
        ctx.point = exchange_issued()  # an exchange point (moe_graph.train.interleave hands the turn over here)
        return out

    @staticmethod
    def backward(ctx, g):
        out = ctx.backend.exchange(g.contiguous())
        exchange_issued(ctx.point)
        return None, out


def take_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[index[i]]``, zeros where ``index[i]`` is outside ``[0, n)`` (the sentinels): index gathers of
    any dtype, bit for bit."""
    n = src.shape[0]
    if n == 0:
        return src.new_zeros((index.shape[0],) + tuple(src.shape[1:]))
    keep = (index >= 0) & (index < n)
    out = src.index_select(0, index.clamp(0, n - 1))
    return out.mul_(keep.view((-1,) + (1,) * (src.dim() - 1)).to(out.dtype))


class _IdentityBackend:
    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        return send


# -------------------------------------------------------------------------------------------------- handle --
@dataclass
class DispatchHandle:
    """What :meth:`TokenDispatcher.combine` / :meth:`TokenDispatcher.row_weights` need from
    :meth:`TokenDispatcher.dispatch` (all device tensors)."""

    route_slot: torch.Tensor  # [T*K] send slot of each route (N = R*capacity: dropped or invalid; R = 1 aligned: P)
    route_of_slot: torch.Tensor  # [N] route in each send slot (T*K: empty; R = 1 aligned: [P])
    # R > 1 only: [N] received row of each expert-input row (N: padding; aligned: [P])
    expert_row_source: Optional[torch.Tensor]
    # R > 1 only: [N] expert-input row of each received row (N: empty; aligned: P)
    recv_row_target: Optional[torch.Tensor]
    probs: torch.Tensor  # [T, K] routing weights (invalid and dropped routes are never read)
    num_tokens: int
    topk: int
    capacity: int
    dropped: torch.Tensor  # 0-dim int64: routes dropped by this call (over capacity)
    m_splits: torch.Tensor  # [num_local_columns] int64: expert-input rows per local expert
    column_counts: torch.Tensor  # [C] int64: valid routes per routing column (before drops)
    # the per-destination backend's plan (exchange="symm_mem"; a FusedState with exchange="nvlink"), else None
    exchange_plan: Optional[object] = None
    # dispatch(align_rows=...) on a path that aligns: the expert groups start at multiples of align_rows rows (the
    # padded counts, what the grouped GEMM reads); route_of_slot / route_slot (R = 1: the send slots are the padded
    # expert rows, P = aligned_padded_rows(capacity, Lc, align_rows)), expert_row_source / recv_row_target (R > 1, per
    # pair: P = aligned_padded_rows(R * capacity, Lc, align_rows)) or the host-sized exchange's plan (per
    # destination) then index the padded rows. None: unpadded
    aligned_m_splits: Optional[torch.Tensor] = None

    @property
    def aligned(self) -> bool:
        """Whether the expert input came out with its groups aligned (:meth:`TokenDispatcher.dispatch`'s
        ``align_rows``)."""
        return self.aligned_m_splits is not None

    @property
    def expert_rows(self) -> int:
        """Rows of the expert input: ``R * capacity`` (per-pair rule) or ``capacity`` (per destination), the
        padded rows (:func:`moe_graph.ops.dispatch_layout.aligned_padded_rows`) when :attr:`aligned`."""
        if isinstance(self.exchange_plan, FusedState):
            return self.exchange_plan.rows
        if self.exchange_plan is not None:
            return self.exchange_plan.capacity
        if self.expert_row_source is not None:
            return self.expert_row_source.shape[0]
        return self.route_of_slot.shape[0]

    @property
    def route_rows(self) -> torch.Tensor:
        """``[T, K]``: the send slot of each route (the inverse of :attr:`route_of_slot`)."""
        return self.route_slot.view(self.num_tokens, self.topk)


# ---------------------------------------------------------------------------------------------- dispatcher --
class TokenDispatcher(nn.Module):
    """Static-buffer token dispatcher over an EP process group.

    Args:
        num_local_columns: routing columns each rank hosts (home experts + spare slots: ``L + k``); the grouped
            GEMM's experts.
        num_ep_ranks: ``R`` (EP group size); ``1``: single process, no communication.
        ep_rank: this rank's index in the EP group.
        column_rank, column_local: ``[C]`` int tensors, the destination rank and local expert of each routing
            column (see :func:`expert_columns`).
        capacity: routes each rank sends to each rank (static); ``None``: dropless (``T * K``, known at the first
            dispatch). See :func:`capacity_for` for ``capacity_factor``.
        group: the EP process group (``None``: the default group when ``R > 1``).
        drop_policy: ``"position"`` or ``"probs"``: which routes are dropped over the capacity (see above).
        backend: an object with ``exchange(send [R, ...]) -> recv [R, ...]`` (default:
            :func:`moe_graph.moe.echo.default_backend`: ``all_to_all_single`` where the group supports it, else an
            ``all_gather`` fallback; chosen once here, never during capture).
        device: where the constant tables and the drop counter live (default: ``column_rank``'s device); the
            tokens given to :meth:`dispatch` must be on it (``.to(device)`` moves them).
        exchange: ``"nccl"`` (the fixed-split all-to-all through ``backend``: ``capacity`` per (source,
            destination) pair), ``"symm_mem"`` (capacity per destination rank, only the routed rows on the wire:
            :mod:`moe_graph.moe.exchange`; on CPU process groups with host-known sizes) or ``"auto"`` (``symm_mem``
            where torch's NVSHMEM exchange serves the group, else ``nccl``), or ``"nvlink"`` (the per-destination
            rule through a fused backend: token rows read once and placed at their final receive rows, the combine
            reduces each token's routes in the same op; :class:`moe_graph.moe.exchange.HostSizedFusedExchange` on
            CPU process groups, ``moe_graph.ops.nvlink`` on CUDA; ``"auto"`` picks it on CUDA where every EP peer
            is a NVLink / P2P peer). Decided here (:attr:`rule`, :attr:`fused`).
        ranks_per_node: ``exchange="nvlink"`` only: EP ranks per node (``None``: all one node); below ``R`` the
            node-aware two-level exchange (one inter-node transfer per (token, destination node)).
        num_sms: ``exchange="nvlink"`` on CUDA only: the fused kernels' CTA bound (``None``: the backend's default).
    """

    def __init__(
        self,
        num_local_columns: int,
        num_ep_ranks: int,
        ep_rank: int,
        column_rank: torch.Tensor,
        column_local: torch.Tensor,
        capacity: Optional[int] = None,
        group=None,
        backend=None,
        drop_policy: str = "position",
        device=None,
        exchange: str = "auto",
        ranks_per_node: Optional[int] = None,
        num_sms: Optional[int] = None,
    ):
        super().__init__()
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be 'position' or 'probs', got {drop_policy!r}")
        self.drop_policy = drop_policy
        if num_local_columns < 1:
            raise ValueError(f"num_local_columns must be >= 1, got {num_local_columns}")
        if num_ep_ranks < 1 or not 0 <= ep_rank < num_ep_ranks:
            raise ValueError("need num_ep_ranks >= 1 and 0 <= ep_rank < num_ep_ranks, got "
                             f"num_ep_ranks={num_ep_ranks}, "
                             f"ep_rank={ep_rank}")
        if column_rank.dim() != 1 or column_local.shape != column_rank.shape:
            raise ValueError(
                f"column_rank and column_local must be 1-D of equal length, got {tuple(column_rank.shape)} and "
                f"{tuple(column_local.shape)}"
            )
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None (dropless), got {capacity}")
        # validated once here (host values at construction, not on the hot path)
        cr, cl = column_rank.detach().cpu(), column_local.detach().cpu()
        if cr.numel() and (cr.min() < 0 or cr.max() >= num_ep_ranks):
            raise ValueError(f"column_rank values must be in [0, {num_ep_ranks}), got {cr.tolist()}")
        if cl.numel() and (cl.min() < 0 or cl.max() >= num_local_columns):
            raise ValueError(f"column_local values must be in [0, {num_local_columns}), got {cl.tolist()}")
        self.num_local_columns = num_local_columns
        self.num_ep_ranks = num_ep_ranks
        self.ep_rank = ep_rank
        self.capacity = capacity
        self.group = group
        self._num_columns = cr.numel()
        device = torch.device(device) if device is not None else column_rank.device
        # every constant table is built here, on the device (never lazily with a blocking copy in dispatch)
        self.register_buffer("column_rank", cr.to(torch.int64).to(device), persistent=False)
        self.register_buffer("column_local", cl.to(torch.int64).to(device), persistent=False)
        # cumulative routes dropped over the capacity (a statistic, written in place: its identity never changes)
        self.register_buffer("dropped_routes", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        # this step's drops and largest load ratio (see the module docstring), zeroed by reset_step_counters()
        self.register_buffer("step_dropped_routes", torch.zeros((), dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("step_max_load_ratio", torch.zeros((), dtype=torch.float64, device=device),
                             persistent=False)
        # the capacity rule: "pair" (fixed-split all-to-all) or "destination" (variable-size exchange)
        self.rule, self.exchange_backend = "pair", None
        if num_ep_ranks == 1:
            self.backend = _IdentityBackend()
        elif backend is not None:
            self.backend = backend
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"TokenDispatcher: num_ep_ranks={num_ep_ranks} needs an initialized torch.distributed")
            if dist.get_world_size(group) != num_ep_ranks:
                raise ValueError(
                    f"num_ep_ranks={num_ep_ranks} must equal the EP group's size {dist.get_world_size(group)}"
                )

            self.backend = default_backend(group)
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1 or num_ep_ranks % ranks_per_node):
            raise ValueError(f"ranks_per_node must be None or an int >= 1 dividing num_ep_ranks={num_ep_ranks}, "
                             f"got {ranks_per_node!r}")
        if ranks_per_node not in (None, num_ep_ranks) and exchange != "nvlink":
            raise ValueError(f"ranks_per_node={ranks_per_node} (the node-aware exchange) needs exchange='nvlink', "
                             f"got exchange={exchange!r}")
        self.ranks_per_node = ranks_per_node
        if num_ep_ranks > 1:
            self.rule, self.exchange_backend = resolve_exchange(exchange, group, device, ranks_per_node, num_sms)
            self.register_buffer("demand_checksum_weights", checksum_weights(num_ep_ranks ** 2, device),
                                 persistent=False)
        # a fused backend (exchange="nvlink"): dispatch / combine / gather_routes, used through the autograd
        # functions of moe_graph.moe.exchange
        self.fused = self.exchange_backend is not None and is_fused(self.exchange_backend)

    def capacity_for(self, num_tokens: int, topk: int, capacity_factor: Optional[float]) -> int:
        """The static capacity of ``num_tokens`` tokens with ``topk`` routes each under this dispatcher's rule:
        :func:`capacity_for` per pair, :func:`moe_graph.moe.exchange.destination_capacity` per destination."""
        if self.rule == "destination":
            return destination_capacity(num_tokens, topk, self.num_ep_ranks, capacity_factor)
        return capacity_for(num_tokens, topk, self.num_ep_ranks, capacity_factor)

    @property
    def num_columns(self) -> int:
        return self._num_columns

    @property
    def device(self) -> torch.device:
        return self.dropped_routes.device

    def reset_drop_counter(self) -> None:
        """Zeroes the cumulative drop counter in place (a device op: no sync, capturable)."""
        self.dropped_routes.zero_()

    def reset_step_counters(self) -> None:
        """Zeroes :attr:`step_dropped_routes` and :attr:`step_max_load_ratio` in place (device ops, capturable)."""
        self.step_dropped_routes.zero_()
        self.step_max_load_ratio.zero_()

    @property
    def drop_flag(self) -> torch.Tensor:
        """0-dim bool device tensor: some route was dropped since the last reset."""
        return self.dropped_routes > 0

    def check_drops(self, raise_on_drop: bool = False) -> int:
        """Reads the cumulative drop count (syncs, by design: call it off the hot path). With ``raise_on_drop``,
        raises RuntimeError when routes were dropped."""
        n = int(self.dropped_routes.item())
        if n and raise_on_drop:
            raise RuntimeError(
                f"TokenDispatcher dropped {n} routes over the static capacity {self.capacity} per "
                f"{'destination rank' if self.rule == 'destination' else '(source, destination) pair'}; raise "
                "capacity_factor or enable echo balancing"
            )
        return n

    # ---------------------------------------------------------------------------------------- dispatch --
    def dispatch(
        self,
        hidden: torch.Tensor,
        indices: torch.Tensor,
        probs: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
        demand: Optional[torch.Tensor] = None,
        fp8_recipe=None,
        align_rows: Optional[int] = None,
        quantize_recipe=None,
    ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token's routes to the ranks hosting their columns.

        Args:
            hidden: ``[T, H]`` tokens. indices: ``[T, K]`` int64 routing columns. probs: ``[T, K]`` weights
                (autograd flows through them in :meth:`combine`). valid: optional ``[T, K]`` bool (invalid routes
                are ignored). demand: per-destination rule only, optional ``[R, R]`` int64, row ``s`` the live
                routes of source ``s`` per destination, when the caller has it from counts it gathered anyway
                (``None``: gathered here, one small exchange).
            fp8_recipe: FP8 dispatch (``moe_graph.fp8`` recipe, "blockwise" or "mxfp8"): the tokens are quantized
                rowwise here, once each, and travel as their FP8 and scale bytes (about half the bytes of 16-bit
                rows); the expert input is then a :class:`moe_graph.ops.fp8.QuantizedRows` (bytes equal, row for
                row, to quantizing the 16-bit expert input) whose input gradient comes back in ``hidden``'s dtype.
                With ``align_rows`` (:data:`FUSED_FP8_DISPATCH`) two ops do it: the send rows quantized and
                packed (:func:`moe_graph.ops.permute.expand_pack`; at R = 1 and on the fused exchange the tokens)
                and the expert input's rowwise and columnwise copies from the received rows
                (:func:`moe_graph.ops.permute.expand_quantize_packed`: ``columns`` set; per destination and fused:
                reading the received rows or the receive buffer, ``to_experts_read`` / the dispatch's ``reader``).
            align_rows: the expert groups should start at multiples of this many rows (the FP8 experts' 16-row
                alignment, :meth:`moe_graph.moe.experts.GroupedMLP.row_alignment`): on the per-pair rule (EP 1 and
                the fixed-split exchange at EP > 1, with or without FP8 dispatch) the layout ops place the groups
                aligned themselves (:func:`~moe_graph.ops.dispatch_layout.dispatch_layout` at EP 1,
                :func:`~moe_graph.ops.dispatch_layout.receive_layout` at EP > 1, their ``align``), so each row moves
                once, straight to its aligned row, and combine reads the padded rows straight back
                (``handle.aligned``); so do the per-destination exchanges, host-sized (gloo,
                :meth:`moe_graph.moe.exchange.HostSizedExchange.align`) and NVSHMEM (the row gather that reads its
                receive buffer, :meth:`moe_graph.moe.exchange.SymmMemExchange.align`), and the fused exchange
                places every row at its aligned row itself (``exchange="nvlink"``: the kernels' ``align``, the
                16-bit rows and FP8 dispatch's packed rows alike; zero rows between the groups, ``row_weights`` 0
                there). Without it the experts regroup (:class:`moe_graph.moe.experts.AlignedGroups`).
            quantize_recipe: the FP8 experts' recipe (``moe_graph.fp8`` ``Recipe``; 16-bit dispatch): on the
                per-pair rule and the per-destination exchanges (not the fused one) with the groups aligned
                (``align_rows``) the expert input is written as its two FP8 copies by the op that places its rows
                (:func:`moe_graph.ops.permute.expand_quantize`: at EP 1 straight from ``hidden``, at EP > 1 the
                receive side's regrouping; per destination the read of the receive buffer,
                :func:`moe_graph.moe.exchange.to_experts_quantized`; the 16-bit expert rows are never written), a
                :class:`moe_graph.ops.fp8.QuantizedRows` bit-equal to quantizing the 16-bit expert input with
                ``ops.fp8.quantize_pair`` (its gradient that of the 16-bit dispatch); elsewhere ignored (16-bit
                rows). ``hidden`` should then have the experts' parameter dtype (the values quantized are its).

        Returns:
            ``(expert_input [rows, H], m_splits [num_local_columns] int64 on the device, handle)``: received rows
            grouped by local expert (expert order, then source rank, then the sender's order), padding rows (zeros)
            at the end; ``rows`` is ``R * capacity`` per pair, ``capacity`` per destination; ``m_splits`` goes
            straight to the grouped GEMM. Aligned (``handle.aligned``): ``rows`` is
            :func:`~moe_graph.ops.dispatch_layout.aligned_padded_rows` of those, zero rows after each group, and
            ``m_splits`` the padded counts (``handle.m_splits`` keeps the routed rows per local expert).
        """
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
        T, H = hidden.shape
        if indices.dim() != 2 or indices.shape[0] != T:
            raise ValueError(f"indices must be [T={T}, K], got shape {tuple(indices.shape)}")
        K = indices.shape[1]
        if probs.shape != indices.shape:
            raise ValueError(f"probs must have the shape of indices {tuple(indices.shape)}, got {tuple(probs.shape)}")
        if valid is not None and valid.shape != indices.shape:
            raise ValueError(f"valid must have the shape of indices {tuple(indices.shape)}, got {tuple(valid.shape)}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be int32/int64, got {indices.dtype}")
        if align_rows is not None and (isinstance(align_rows, bool) or not isinstance(align_rows, int)
                                       or not 1 <= align_rows <= 1 << 20):
            raise ValueError(f"align_rows must be None or an int in [1, 2^20], got {align_rows!r}")
        dev = hidden.device
        if dev != self.device:
            raise ValueError(
                f"TokenDispatcher.dispatch: hidden is on {dev} but the dispatcher's tables were built on {self.device} "
                f"(at construction: device=...); move the dispatcher (or the model owning it) with .to({str(dev)!r})"
            )
        R, TK, Lc = self.num_ep_ranks, T * K, self.num_local_columns
        cap = self.capacity if self.capacity is not None else self.capacity_for(T, K, None)
        if valid is not None and valid.dtype != torch.bool:
            valid = valid.to(torch.bool)
        # drop order: route order ("position") or probability, highest first, ties in route order ("probs")
        order = None
        if self.drop_policy == "probs":
            order = torch.argsort(probs.detach().reshape(-1), descending=True, stable=True)
        counters = None
        if counting_enabled():  # not again when activation recomputation re-runs this forward
            counters = (self.dropped_routes, self.step_dropped_routes, self.step_max_load_ratio)
        # FP8 dispatch with the fused ops (the per-pair rule and the per-destination exchanges; the fused exchange has
        # its own reader below): the send rows quantized and packed by one op, the expert input's two FP8 copies
        # written from the received packed rows by another (lean_fp8)
        lean_fp8 = (fp8_recipe is not None and FUSED_FP8_DISPATCH and not self.fused and align_rows is not None
                    and expand_pack_available(dev.type))
        if fp8_recipe is not None:
            check_row_local(fp8_recipe)  # before anything moves
            # the tokens themselves at R = 1 (each read once; the expert rows gather them), else the send rows
            packed = pack_rows(hidden, fp8_recipe) if not lean_fp8 else \
                expand_pack(hidden, None, 1, fp8_recipe) if R == 1 else None
        if self.rule == "destination":
            handle = self._layout_per_destination(indices, probs, valid, demand, order, counters, cap, align_rows)
            if lean_fp8 and not handle.aligned:  # only the backends that place the rows aligned read them too
                lean_fp8, packed = False, pack_rows(hidden, fp8_recipe)
        else:
            # aligned groups (align_rows): the layout ops place each expert group at a multiple of align_rows rows
            # themselves (R = 1: the send slots are the padded expert rows; R > 1: the receive side's regrouping)
            align = align_rows if align_rows is not None else 1
            lay = dispatch_layout(indices, self.column_rank, self.column_local, R, Lc, cap, valid=valid,
                                  route_order=order, counters=counters, align=align if R == 1 else 1)
            if R > 1:
                recv_counts = self.backend.exchange(lay.send_counts)  # row s: what rank s sends this rank
                source, target, m_splits, aligned_m_splits = receive_layout(recv_counts, cap, align)
            else:  # the send buffer is the expert input
                source, target, m_splits, aligned_m_splits = None, None, lay.send_counts.view(Lc), \
                    lay.aligned_counts.view(Lc)
            handle = DispatchHandle(lay.route_slot, lay.route_of_slot, source, target, probs, T, K, cap, lay.dropped,
                                    m_splits, lay.column_counts,
                                    aligned_m_splits=aligned_m_splits if align_rows is not None else None)
        if lean_fp8:
            splits = handle.m_splits if handle.aligned_m_splits is None else handle.aligned_m_splits
            # the input gradient goes home as the 16-bit dispatch's does: reverse exchange, sum of each token's routes
            rows = carrier(hidden, handle.expert_rows, lambda g: self.combine(g, handle, weighted=False))
            if R == 1:  # the expert rows straight from the packed tokens
                expert_in = expand_quantize_packed(packed, handle.route_of_slot, K, splits, fp8_recipe, rows)
            elif self.rule == "destination":  # the receive side reads the packed rows as they arrived
                with torch.no_grad():
                    send = expand_pack(hidden, handle.route_of_slot, K, fp8_recipe)
                    expert_in = self.exchange_backend.to_experts_read(
                        send, handle.exchange_plan,
                        lambda src, source_row: expand_quantize_packed(src, source_row, 1, splits, fp8_recipe, rows))
                exchange_issued()  # an exchange point (its backward, the carrier's combine, has its own)
            else:  # send rows packed by one op, exchanged, regrouped and requantized columnwise by one op
                with torch.no_grad():
                    send = expand_pack(hidden, handle.route_of_slot, K, fp8_recipe)
                    N, B = send.shape
                    recv = self.backend.exchange(send.view(R, N // R, B)).reshape(N, B)
                exchange_issued()  # an exchange point (its backward, the carrier's combine, has its own)
                expert_in = expand_quantize_packed(recv, handle.expert_row_source, 1, splits, fp8_recipe, rows)
        elif (fp8_recipe is not None and self.fused and FUSED_FP8_DISPATCH and handle.exchange_plan.align > 1
              and expand_pack_available(dev.type)):  # both FP8 copies read out of the receive buffer by one op
            plan = handle.exchange_plan
            # the input gradient goes home as the 16-bit dispatch's does: reverse exchange, sum of each token's routes
            rows = carrier(hidden, plan.rows, lambda g: self.combine(g, handle, weighted=False))

            def read(x, m, w):  # the packed rows at their aligned rows -> rowwise bytes, columnwise requantized
                return expand_quantize_packed(x, None, 1, m, fp8_recipe, rows)  # the buffer's rows as they are
            with torch.no_grad():
                expert_in = plan.take(plan.dispatch(self.exchange_backend, packed, probs.detach().reshape(-1),
                                                    reader=read))
            exchange_issued()  # an exchange point (its backward, the carrier's combine, has its own)
        elif fp8_recipe is not None:
            with torch.no_grad():
                moved = self._move_bytes(packed, handle)
            if R > 1:
                exchange_issued()  # an exchange point (its backward, the carrier's combine, has its own)
            # the input gradient goes home as the 16-bit dispatch's does: reverse exchange, sum of each token's routes
            rows = carrier(hidden, moved.shape[0], lambda g: self.combine(g, handle, weighted=False))
            expert_in = unpack_rows(moved, rows, fp8_recipe)
        elif (quantize_recipe is not None and self.rule != "destination" and handle.aligned
              and expand_quantize_available(dev.type)):  # the FP8 expert input from one read of each row
            if R == 1:  # straight from the tokens
                expert_in = expand_quantize(hidden, handle.route_of_slot, handle.route_rows,
                                            handle.aligned_m_splits, quantize_recipe)
            else:  # the received rows regrouped by local expert and quantized in one op
                send = expand_rows(hidden, handle.route_of_slot, handle.route_rows)
                expert_in = self._to_expert_order(send, handle, quantize_recipe)
        elif (quantize_recipe is not None and self.rule == "destination" and not self.fused and handle.aligned
              and expand_quantize_available(dev.type)):  # the receive side writes the FP8 expert input
            send = expand_rows(hidden, handle.route_of_slot, handle.route_rows)
            expert_in = to_experts_quantized(self.exchange_backend, handle.exchange_plan, send,
                                             handle.aligned_m_splits, quantize_recipe)
        elif (quantize_recipe is not None and self.fused and handle.exchange_plan.align > 1
              and expand_quantize_available(dev.type)):  # the FP8 expert input read out of the receive buffer
            expert_in = fused_dispatch_quantized(self.exchange_backend, handle.exchange_plan, hidden,
                                                 probs.detach().reshape(-1), quantize_recipe)
        elif self.fused:  # each token row read once, placed at its final receive row, the probabilities beside it
            expert_in = FusedDispatchFn.apply(self.exchange_backend, handle.exchange_plan, hidden,
                                              probs.detach().reshape(-1))
        else:
            send = expand_rows(hidden, handle.route_of_slot, handle.route_rows)  # [N, H] by (destination, expert)
            expert_in = self._to_expert_order(send, handle)
        if self.fused:  # known once the rows went: the rows per local expert, the padded counts when aligned
            plan = handle.exchange_plan
            handle.m_splits = plan.counts
            if plan.align > 1:
                handle.aligned_m_splits = plan.m_splits
        elif handle.exchange_plan is not None:  # known once the rows went (the NVSHMEM exchange returns them)
            handle.m_splits = handle.exchange_plan.m_splits
        return expert_in, handle.m_splits if handle.aligned_m_splits is None else handle.aligned_m_splits, handle

    def _local_demand(self, indices: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """``[R]`` int64: this rank's live routes per destination (routes with an index outside the columns are not
        live, as in the layout op, which flags them)."""
        idx = indices.reshape(-1).to(torch.int64)
        live = (idx >= 0) & (idx < self.num_columns)
        if valid is not None:
            live = live & valid.reshape(-1)
        dst = self.column_rank.index_select(0, torch.where(live, idx, 0))
        return torch.zeros(self.num_ep_ranks, dtype=torch.int64, device=idx.device).index_add_(
            0, dst, live.to(torch.int64))

    def _layout_per_destination(self, indices, probs, valid, demand, order, counters, cap,
                                align_rows=None) -> DispatchHandle:
        """The per-destination rule (see :mod:`moe_graph.moe.exchange`): quotas from the all-gathered demand, the
        layout op in quota mode, the variable-size exchange's plan (its ``m_splits`` are set once the rows went).
        ``align_rows``: the host-sized and NVSHMEM exchanges compose the alignment into their placement
        (``align`` of :class:`~moe_graph.moe.exchange.HostSizedExchange` /
        :class:`~moe_graph.moe.exchange.SymmMemExchange`), the fused one takes it into its state
        (:class:`moe_graph.moe.exchange.FusedState`, its ``m_splits`` known once the rows went)."""
        R, (T, K) = self.num_ep_ranks, indices.shape
        local = self._local_demand(indices, valid)
        if demand is None:
            demand = self.backend.exchange(local.expand(R, R).contiguous())  # row s: source s's demand
            if dist.is_available() and dist.is_initialized():  # the same [R, R] on every rank, or flagged
                flag_if_ranks_disagree(demand, self.demand_checksum_weights, self.group)
        elif tuple(demand.shape) != (R, R):
            raise ValueError(f"demand must be [R={R}, R={R}], got shape {tuple(demand.shape)}")
        demand = checked_demand(demand.to(torch.int64), local, self.ep_rank, T * K)
        quota = destination_quotas(demand, cap)
        lay = dispatch_layout(indices, self.column_rank, self.column_local, R, self.num_local_columns, cap,
                              valid=valid, route_order=order,
                              counters=None if counters is None else counters[:2] + (None,),
                              dest_quota=quota[self.ep_rank])
        if counters is not None and T * K:  # the largest destination load of the job over the mean T * K
            ratio = demand.sum(0).max().to(torch.float64) / (T * K)
            counters[2].copy_(torch.maximum(counters[2], ratio.view_as(counters[2])))
        if self.fused:  # the fused exchange places the rows at their aligned rows itself
            plan = FusedState(lay.route_of_slot, lay.send_counts, K, cap, 1 if align_rows is None else align_rows)
        else:
            plan = self.exchange_backend.plan(lay.send_counts, cap)
        aligned = None
        if align_rows is not None and isinstance(self.exchange_backend, (HostSizedExchange, SymmMemExchange)):
            aligned = self.exchange_backend.align(plan, align_rows)
        return DispatchHandle(lay.route_slot, lay.route_of_slot, None, None, probs, T, K, cap, lay.dropped,
                              plan.m_splits, lay.column_counts, plan, aligned)

    def _move_bytes(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Token rows ``[T, B]`` (any dtype, e.g. FP8 dispatch's uint8) -> the expert input's rows ``[rows, B]``,
        bit for bit (index gathers and the same exchanges as :meth:`_to_expert_order`; not differentiable)."""
        if self.fused:  # straight from the token rows (at their aligned rows when aligned), the probabilities beside
            plan = handle.exchange_plan
            return plan.take(plan.dispatch(self.exchange_backend, rows, handle.probs.detach().reshape(-1)))
        send = take_rows(rows, handle.route_of_slot // handle.topk)  # [N, B] (T * K // K = T: empty slot)
        if handle.exchange_plan is not None:
            return self.exchange_backend.to_experts(send, handle.exchange_plan)
        if self.num_ep_ranks == 1:
            return send
        R, (N, B) = self.num_ep_ranks, send.shape
        recv = self.backend.exchange(send.view(R, N // R, B)).reshape(N, B)
        return take_rows(recv, handle.expert_row_source)

    def _to_expert_order(self, send: torch.Tensor, handle: DispatchHandle, quantize_recipe=None):
        """Send-slot rows ``[N, X]`` to the expert input of their destinations (the exchange and the regrouping by
        local expert at R > 1; the send buffer itself at R = 1). ``quantize_recipe`` (R > 1, per pair, aligned):
        the regrouping writes the expert input's FP8 copies (:func:`moe_graph.ops.permute.expand_quantize`)."""
        if handle.exchange_plan is not None:
            return ToExperts.apply(self.exchange_backend, handle.exchange_plan, send)
        if self.num_ep_ranks == 1:
            return send
        R, (N, X) = self.num_ep_ranks, send.shape
        recv = _Exchange.apply(self.backend, send.view(R, N // R, X)).reshape(N, X)
        if quantize_recipe is not None:
            return expand_quantize(recv, handle.expert_row_source, handle.recv_row_target.view(N, 1),
                                   handle.aligned_m_splits, quantize_recipe)
        return expand_rows(recv, handle.expert_row_source, handle.recv_row_target.view(N, 1))

    def _to_send_order(self, rows: torch.Tensor, handle: DispatchHandle, grad_handoff=None) -> torch.Tensor:
        """Expert-input-ordered rows ``[N, X]`` back to this rank's send slots (the reverse exchange at R > 1).
        ``grad_handoff`` (R > 1): the regrouping's backward (per pair: :func:`moe_graph.ops.permute.expand_rows`'
        ``grad_handoff``) or the per-destination exchange's receive side (:class:`moe_graph.moe.exchange.ToSources`)
        writes ``rows``' gradient as its FP8 copies."""
        if handle.exchange_plan is not None:
            return ToSources.apply(self.exchange_backend, handle.exchange_plan, rows, handle.route_of_slot.shape[0],
                                   grad_handoff)
        if self.num_ep_ranks == 1:
            return rows
        N, (M, X) = handle.route_of_slot.shape[0], rows.shape
        back = expand_rows(rows, handle.recv_row_target, handle.expert_row_source.view(M, 1),
                           grad_handoff=grad_handoff)
        return _Exchange.apply(self.backend, back.view(self.num_ep_ranks, N // self.num_ep_ranks, X)).reshape(N, X)

    def row_weights(self, handle: DispatchHandle) -> torch.Tensor:
        """``[N]``: the routing probability of each expert-input row (0 for padding rows), differentiable w.r.t. the
        ``probs`` given to :meth:`dispatch`; for experts that scale their rows themselves (then
        ``combine(..., weighted=False)``)."""
        TK = handle.num_tokens * handle.topk
        if self.fused:  # carried beside the rows by the forward dispatch
            return RowWeightsFn.apply(self.exchange_backend, handle.exchange_plan, handle.probs.reshape(TK))
        w = expand_rows(handle.probs.reshape(TK, 1), handle.route_of_slot, handle.route_slot.view(TK, 1))  # [N, 1]
        with minor_exchanges():  # beside the rows: not an exchange point of its own
            return self._to_expert_order(w, handle).view(handle.expert_rows)

    # ----------------------------------------------------------------------------------------- combine --
    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle, weighted: bool = True,
                grad_handoff=None) -> torch.Tensor:
        """Send the expert outputs back and sum each token's routes, weighted by their probabilities (``weighted``)
        or plainly (``weighted=False``: the probabilities were applied inside the experts, e.g. with
        :meth:`row_weights`): ``[T, H]`` in ``expert_output``'s dtype, accumulated in fp32 for 16-bit outputs;
        dropped routes contribute zero.

        ``grad_handoff``: a ``moe_graph.fp8.GradHandoff`` bound to ``expert_output`` (the FP8 fc2's output,
        :meth:`moe_graph.moe.experts.GroupedMLP.output_grad_handoff`, of ``handle``'s aligned ``m_splits``): at
        EP 1 (per-pair rule, aligned rows) the backward writes fc2's two FP8 ``dy`` copies straight from the
        output gradient, the probabilities applied first (``ops.permute.reduce_rows``' ``grad_handoff``: the
        16-bit ``dy`` is never written); at EP > 1 on the fixed-split exchange the receive side's regrouping of the
        returned gradient writes them (``ops.permute.expand_rows``' ``grad_handoff``; the probabilities were applied
        on the sending side, before the exchange, as without it), on the per-destination exchanges (host-sized,
        NVSHMEM) the receive side of the gradient's exchange (``moe.exchange.ToSources``); elsewhere (the fused
        exchange) ignored (fc2 quantizes its 16-bit ``dy``)."""
        N = handle.expert_rows
        if expert_output.dim() != 2 or expert_output.shape[0] != N:
            raise ValueError(f"expert_output must be [{N}, H] (the dispatched rows), got {tuple(expert_output.shape)}")
        w = None
        if weighted:
            acc = torch.float64 if expert_output.dtype == torch.float64 else torch.float32
            w = handle.probs if handle.probs.dtype in (acc, expert_output.dtype) else handle.probs.to(acc)
        if not (grad_handoff is not None
                and grad_handoff.m_splits is handle.aligned_m_splits and grad_handoff.binds(expert_output)
                and expand_quantize_available(expert_output.device.type)):
            grad_handoff = None
        if self.fused:  # the reverse exchange and the weighted reduction of each token's routes in one op
            return FusedCombineFn.apply(self.exchange_backend, handle.exchange_plan, expert_output,
                                        None if w is None else w.reshape(-1), grad_handoff)
        if self.num_ep_ranks == 1:
            return reduce_rows(expert_output, handle.route_rows, handle.route_of_slot, w, grad_handoff)
        y_send = self._to_send_order(expert_output, handle, grad_handoff)  # the hand-off on the receive side
        return reduce_rows(y_send, handle.route_rows, handle.route_of_slot, w)

    # ------------------------------------------------------------------------------------------- async --
    def dispatch_async(self, *args, **kwargs) -> CompletedExchange:
        """:meth:`dispatch` as a handle: ``.wait()`` returns ``(expert_input, m_splits, handle)``. Every backend
        here completes the work before returning (CPU process groups; the CUDA backends enqueue on the current
        stream), so ``wait()`` only hands the result over; the overlap of the exchange with computation builds on
        this form."""
        return CompletedExchange(self.dispatch(*args, **kwargs))

    def combine_async(self, *args, **kwargs) -> CompletedExchange:
        """:meth:`combine` as a handle: ``.wait()`` returns the ``[T, H]`` output (see :meth:`dispatch_async`)."""
        return CompletedExchange(self.combine(*args, **kwargs))
