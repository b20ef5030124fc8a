"""Echo offloading planner: which home experts get copied into which spare slots, and which tokens move there.

Notation: the legend of :mod:`moe_graph.moe` (``T``, ``E``, ``R``, ``k``, ``S = R * k``). ``counts[r, e]`` is the
number of tokens that source rank ``r`` routes to expert ``e`` (the all-gathered per-rank histograms, identical on
every rank).

Every function here is pure tensor code on the inputs' device: integer arithmetic only (int64), no host syncs
(no ``.item()``, ``.tolist()``, ``nonzero()``, boolean-mask indexing or data-dependent shapes), a fixed sequence
of kernels for fixed shapes (capturable in a CUDA graph), and deterministic: ties are broken by the lowest index
and sorts are stable, so the same ``counts`` give the same plan on every rank and in every run. That is what
lets each EP rank compute the plan independently from the all-gathered counts.

Pipeline (``gen_offloading_plan``)::

    counts[R, E] --gen_assignment--> home_to_spare[E, S]        (tokens of expert e that slot j takes)
                 --breadth_first_allocation + depth_first_allocation--> allocation[R, S]
                                                                 (tokens source rank r sends to slot j)
                 (both steps at once: gen_plan)
    routing_map, probs, allocation[ep_rank], offload_map = home_to_spare > 0
                 --reroute_tokens--> rerouted map / probs [T, E + S]

This module imports without the compiled extension. When ``moe_graph._C`` is built, the same results come from
native ops: :func:`gen_plan` (assignment + allocation) from ``moe_graph::echo_plan`` (one kernel launch on CUDA
instead of ~100 tiny ones), :func:`best_fit_assignment` from ``moe_graph::echo_best_fit``, and the rerouting from
``moe_graph::reroute_tokens``; otherwise the pure-torch code here runs (:func:`reroute_tokens_torch` for the
rerouting). Tests check that both give identical results.
"""

from __future__ import annotations

from typing import Tuple

import torch

from moe_graph.ops.errors import PLAN_INVALID, flag_error_if
from moe_graph.ops import reroute as reroute_ops
from moe_graph.ops.reroute import (
    MAX_TOTAL_TOKENS,
    best_fit_available,
    echo_best_fit,
    echo_plan,
    plan_available,
    real_host_values,
)

__all__ = [
    "gen_intermediate",
    "one_shot_greedy_assignment",
    "gen_assignment",
    "assign_spillover",
    "greedy_assignment",
    "best_fit_assignment",
    "breadth_first_allocation",
    "depth_first_allocation",
    "gen_allocation",
    "gen_plan",
    "reuse_plan",
    "gen_offloading_plan",
    "rank_loads",
    "rank_loads_after",
    "reroute_tokens",
    "reroute_tokens_torch",
    "donor_ranks",
    "donor_mask",
    "ASSIGNMENTS",
    "DONOR_PATTERNS",
    "LEVEL_CANDIDATES",
    "LEVEL_ROUNDS",
    "WATER_QUANTA",
    "RELEVEL_SWEEPS",
    "MAX_TOTAL_TOKENS",
]

ASSIGNMENTS = ("auto", "greedy", "best_fit")
DONOR_PATTERNS = ("ring", "node")
# Donor-constrained best fit: rounds of the level search and levels per round (csrc/reroute/echo_plan_impl.h:
# kLevelRounds, kLevelCandidates; the native op evaluates one level per warp).
LEVEL_ROUNDS = 6
LEVEL_CANDIDATES = 16
# Donor-constrained best fit: water-filling candidates next to the level search, one per quantum Q (shares of at most
# total // (R * Q) tokens, at most R * Q moves; echo_plan_impl.h: kWaterQuanta).
WATER_QUANTA = (8, 16)
# Donor-constrained best fit: sweeps over the slots of the re-levelling pass on the chosen plan (echo_plan_impl.h:
# kRelevelSweeps).
RELEVEL_SWEEPS = 4
# Receiver key classes of a donor-constrained fill step and demand steps inside class 2 (echo_plan_impl.h:
# kRecvClass, kDemandUnit).
_RECV_CLASS = 1 << 50
_DEMAND_UNIT = 1 << 34



def donor_ranks(num_ep_ranks: int, w: int | None, pattern: str = "ring", node_size: int | None = None):
    """The ``w`` fixed donor ranks of every EP rank: ``donors[r]`` lists the ranks whose experts rank ``r``'s spare
    slots may host (in offset order), or ``None`` when placement is unconstrained (``w`` is ``None`` or ``>= R``).

    Patterns (each offset ``o = 1..w`` is a permutation of the ranks, so the weight exchange is ``w`` steps in which
    every rank sends one block and receives one block: no rank is a hot spot, and the same static pattern holds on
    every rank, which is what lets the exchange be ``w`` fixed peer blocks):

    * ``"ring"`` (default): ``donors[r] = [(r + 1) % R, ..., (r + w) % R]``, the next ``w`` ranks. With EP ranks
      numbered node-major (consecutive ranks share a node), most blocks stay inside the NVLink domain.
    * ``"node"``: the same ring inside each group of ``node_size`` consecutive ranks (one NVLink domain):
      ``donors[r] = [base + (r - base + o) % node_size]``; needs ``w < node_size`` and ``R % node_size == 0``. All
      weight traffic stays inside the node, at some cost in balance when a node's experts are hot together.

    ``w = R - 1`` allows every other rank (the same plans as unconstrained, exchanged as ``R - 1`` peer blocks).

    Example: ``donor_ranks(8, 2)[7] == [0, 1]``; ``donor_ranks(8, 2, "node", 4)[7] == [4, 5]``.
    """
    R = _positive_int(num_ep_ranks, "num_ep_ranks")
    if w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= R):
        return None
    w = _positive_int(w, "w (donor ranks per rank)")
    if pattern == "ring":
        return [[(r + o) % R for o in range(1, w + 1)] for r in range(R)]
    if pattern == "node":
        G = _positive_int(node_size, "node_size") if node_size is not None else None
        if G is None or R % G or w >= G:
            raise ValueError(
                f"donor pattern 'node' needs node_size dividing num_ep_ranks={R} and w={w} < node_size, got "
                f"node_size={node_size}")
        return [[(r - r % G) + (r % G + o) % G for o in range(1, w + 1)] for r in range(R)]
    raise ValueError(f"donor pattern must be one of {DONOR_PATTERNS}, got {pattern!r}")


def donor_mask(num_ep_ranks: int, w: int | None, pattern: str = "ring", node_size: int | None = None,
               device=None) -> torch.Tensor | None:
    """``[R, R]`` bool, ``mask[r, q]``: a spare slot on rank ``r`` may host an expert whose home is rank ``q``
    (:func:`donor_ranks`); ``None`` when unconstrained. Built on the host once (setup time), never per step."""
    donors = donor_ranks(num_ep_ranks, w, pattern, node_size)
    if donors is None:
        return None
    m = torch.zeros(num_ep_ranks, num_ep_ranks, dtype=torch.bool)
    for r, ds in enumerate(donors):
        m[r, ds] = True
    return m.to(device) if device is not None else m


def _positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _check_donor_mask(donor_mask_: torch.Tensor | None, R: int, device) -> torch.Tensor | None:
    if donor_mask_ is None:
        return None
    if not isinstance(donor_mask_, torch.Tensor) or donor_mask_.dtype != torch.bool or donor_mask_.shape != (R, R):
        raise ValueError(
            f"donor_mask must be a [R, R] = [{R}, {R}] bool tensor (planner.donor_mask), got "
            f"{getattr(donor_mask_, 'dtype', type(donor_mask_).__name__)} {tuple(getattr(donor_mask_, 'shape', ()))}")
    return donor_mask_.to(device)


def _check_counts(counts: torch.Tensor, num_ep_ranks: int | None = None) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"counts must be a torch.Tensor [R, E], got {type(counts).__name__}")
    if counts.dim() != 2:
        raise ValueError(f"counts must be a 2-D tensor [R, E] (tokens from EP rank r to expert e), got shape {tuple(counts.shape)}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"counts must have an integer dtype, got {counts.dtype}")
    R, E = counts.shape
    if num_ep_ranks is not None and R != num_ep_ranks:
        raise ValueError(f"counts must have num_ep_ranks={num_ep_ranks} rows, got shape {tuple(counts.shape)}")
    if R < 1 or E % R != 0:
        raise ValueError(f"counts [R, E]: the number of experts E={E} must be divisible by the number of EP ranks R={R}")
    counts = counts.to(torch.int64)
    if counts.device.type == "cpu" and real_host_values(counts):  # no device sync: check and raise
        if counts.numel() and int(counts.clamp(min=0).sum()) > MAX_TOTAL_TOKENS:
            raise ValueError(
                f"counts: the total token count {int(counts.clamp(min=0).sum())} exceeds the planner's limit "
                f"MAX_TOTAL_TOKENS={MAX_TOTAL_TOKENS} (int64 products of two counts would overflow)")
    elif counts.numel():  # device: flag it and plan nothing (raising would need a sync)
        over = counts.clamp(min=0).sum() > MAX_TOTAL_TOKENS
        flag_error_if(over, PLAN_INVALID)
        counts = torch.where(over, torch.zeros((), dtype=counts.dtype, device=counts.device), counts)
    # Negative counts are meaningless; treat them as 0 (no sync to report them).
    return counts.clamp(min=0)


def rank_loads(counts: torch.Tensor) -> torch.Tensor:
    """Tokens received by each EP rank's home experts: ``[R]`` int64 from ``counts[R, E]``."""
    counts = _check_counts(counts)
    R, E = counts.shape
    return counts.sum(0).view(R, E // R).sum(1)


def gen_intermediate(counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spillover per home expert and spare capacity per EP rank.

    Args:
        counts: ``[R, E]`` integer, tokens that source rank ``r`` routes to expert ``e``.

    Returns:
        ``(spillover[E], spare_capacity[R], avg)``, all int64 on ``counts.device``; ``avg`` is a 0-d tensor.

        * ``avg = counts.sum() // R``: the balanced load per rank.
        * ``spare_capacity[r] = max(0, avg - load[r])`` where ``load[r]`` sums the tokens of rank ``r``'s experts.
        * ``spillover``: within each rank, experts sorted ascending by load (stable: ties keep expert order) keep
          their tokens while the running sum stays at or below ``avg``; what exceeds ``avg`` is attributed to the
          expert that crosses it and to the heavier ones after it (clamped cumsum, then difference). Per rank the
          spillover sums to ``max(0, load[r] - avg)``; light experts spill nothing.

    Example (one rank of four experts, ``avg = 250``)::

        loads [50, 100, 150, 200] -> cumsum [50, 150, 300, 500] -> minus avg, clamp [0, 0, 50, 250]
        -> difference: spillover [0, 0, 50, 200]  (sums to 500 - 250)
    """
    counts = _check_counts(counts)
    R, E = counts.shape
    per_expert = counts.sum(0).view(R, E // R)
    per_rank = per_expert.sum(1)
    avg = per_rank.sum() // R
    spare_capacity = (avg - per_rank).clamp(min=0)
    sorted_loads, order = torch.sort(per_expert, dim=1, stable=True)
    over = (sorted_loads.cumsum(1) - avg).clamp(min=0)
    spill_sorted = torch.diff(over, dim=1, prepend=torch.zeros_like(over[:, :1]))
    spillover = torch.empty_like(spill_sorted).scatter_(1, order, spill_sorted)
    return spillover.reshape(E), spare_capacity, avg


def one_shot_greedy_assignment(chunks: torch.Tensor, capacities: torch.Tensor) -> torch.Tensor:
    """Assign ``N`` chunks to ``M`` buckets by overlapping consecutive intervals on one number line.

    Chunk ``i`` occupies ``[sum(chunks[:i]), sum(chunks[:i+1]))`` and bucket ``b`` occupies
    ``[sum(capacities[:b]), sum(capacities[:b+1]))``; ``out[i, b]`` is the length of their intersection. Rows sum
    to the chunks (as far as the buckets reach) and columns to the capacities (as far as the chunks reach).

    Args:
        chunks: ``[N]`` non-negative integers. capacities: ``[M]`` non-negative integers (same device).

    Returns:
        ``[N, M]`` int64.

    Example::

        chunks [100, 150], capacities [80, 120]
        intervals [0,100) [100,250)  vs  [0,80) [80,200)
        -> [[80, 20],
            [ 0, 100]]
    """
    if chunks.dim() != 1 or capacities.dim() != 1:
        raise ValueError(
            f"one_shot_greedy_assignment: chunks and capacities must be 1-D, got shapes {tuple(chunks.shape)} "
            f"and {tuple(capacities.shape)}"
        )
    chunks = chunks.to(torch.int64)
    capacities = capacities.to(torch.int64)
    c_end = chunks.cumsum(0)
    c_start = c_end - chunks
    b_end = capacities.cumsum(0)
    b_start = b_end - capacities
    lo = torch.maximum(c_start[:, None], b_start[None, :])
    hi = torch.minimum(c_end[:, None], b_end[None, :])
    return (hi - lo).clamp(min=0)


def _top_k_per_column(amount: torch.Tensor, k: int) -> torch.Tensor:
    """``amount[E, R]`` (tokens of expert e offloaded to rank r) -> ``home_to_spare[E, R*k]``: each rank column
    keeps its ``k`` largest entries (stable: ties go to the lower expert index), one per spare slot in order."""
    E, R = amount.shape
    vals, rows = torch.sort(amount, dim=0, descending=True, stable=True)
    kk = min(k, E)
    vals = vals[:kk].t()  # [R, kk]
    rows = rows[:kk].t()
    if kk < k:  # more slots than experts: the extra slots stay empty
        pad = k - kk
        vals = torch.cat([vals, vals.new_zeros(R, pad)], dim=1)
        rows = torch.cat([rows, rows.new_zeros(R, pad)], dim=1)
    out = amount.new_zeros(E, R * k)
    return out.scatter_(0, rows.reshape(1, R * k), vals.reshape(1, R * k))


def assign_spillover(spillover: torch.Tensor, spare_capacity: torch.Tensor, num_spare_experts_per_ep_rank: int = 1,
                     donor_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy core: ``spillover[E]`` and ``spare_capacity[R]`` -> ``home_to_spare[E, R*k]`` int64.

    Spillover (descending, stable) is laid on one number line and the ranks' spare capacities (descending,
    stable) on another; :func:`one_shot_greedy_assignment` gives ``[E, R]`` tokens per (home expert, receiving
    rank), and each rank keeps the ``k`` largest entries of its column (ties: lower expert), slot ``r*k + i``
    taking the ``i``-th largest. What a rank cannot take (more than ``k`` experts overlap its interval) stays home.

    Example (8 experts on 4 ranks, ``k = 1``): spillover ``[0, 80, 0, 0, 50, 100, 0, 30]`` and spare capacity
    ``[0, 120, 60, 0]``: sorted ``[100, 80, 50, 30, 0...]`` vs ``[120, 60, 0, 0]`` overlap as expert 5 -> rank 1:
    100, expert 1 -> rank 1: 20 and rank 2: 60. Top-1 per rank: slot 1 takes 100 tokens of expert 5, slot 2 takes
    60 of expert 1 (the 20 of expert 1 on rank 1 stay home); with ``k = 2`` slot 3 also takes those 20.

    ``donor_mask`` (``[R, R]`` bool, :func:`donor_mask`): overlaps of an expert with a rank that may not host it
    (its home rank is not one of the rank's donors) are dropped before the top-k (those tokens stay home).
    """
    k = int(num_spare_experts_per_ep_rank)
    spill_sorted, idx_e = torch.sort(spillover.to(torch.int64), descending=True, stable=True)
    cap_sorted, idx_r = torch.sort(spare_capacity.to(torch.int64), descending=True, stable=True)
    a_sorted = one_shot_greedy_assignment(spill_sorted, cap_sorted)
    amount = torch.zeros_like(a_sorted)
    amount[idx_e[:, None], idx_r[None, :]] = a_sorted
    if donor_mask is not None:
        E, R = amount.shape
        home = torch.arange(E, device=amount.device) // (E // R)
        amount = torch.where(donor_mask.t().index_select(0, home), amount, 0)  # [E, R]: mask[r, home(e)]
    return _top_k_per_column(amount, k)


def greedy_assignment(counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1,
                      donor_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Interval-overlap assignment: :func:`gen_intermediate` then :func:`assign_spillover`. ``[E, R*k]`` int64."""
    spill, cap, _ = gen_intermediate(counts)
    mask = _check_donor_mask(donor_mask, counts.shape[0], counts.device)
    return assign_spillover(spill, cap, num_spare_experts_per_ep_rank, mask)


def _native_best_fit(counts: torch.Tensor):
    """The native ``echo_best_fit`` op when the extension has it for ``counts``' device."""
    return echo_best_fit if best_fit_available(counts.device.type) else None


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[i]`` for a 0-dim index tensor ``i`` without a host sync (plain indexing with a 0-dim tensor reads it)."""
    return t.index_select(0, i.view(1)).squeeze(0)


def best_fit_assignment(
    counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1, native: bool | None = None,
    donor_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Best-fit placement of rank overload into spare slots. Returns ``home_to_spare[E, R*k]`` int64.

    Works at the rank level instead of with fixed per-expert spillover: each overloaded rank must shed
    ``load - avg`` tokens and may take them from any of its experts (the heaviest remaining one first), so a
    slot is filled by a single expert instead of splitting its capacity between two. ``R*k`` steps, each a fixed
    handful of tiny kernels (capturable, no syncs):

    1. the rank ``q`` with the largest remaining excess (lowest index on ties) offers a piece of
       ``x = min(excess[q], tokens left on q's heaviest remaining expert e)``;
    2. among ranks with a free slot and spare capacity, the smallest capacity ``>= x`` takes it (best fit);
       if none is large enough, the largest capacity takes ``capacity`` tokens of it;
    3. the piece goes into that rank's next free slot; excess, capacity and the expert's tokens shrink.

    Example (1 slot per rank, loads per rank ``[400, 100, 200, 100, ...]``): the greedy interval overlap may
    put two experts' pieces on one rank and keep only one; here each receiving slot is filled by one expert up to
    its full capacity, taking the tokens from whichever of the overloaded rank's experts has most left.

    ``native``: ``None`` (default) runs the native op ``moe_graph::echo_best_fit`` (one kernel) when the extension
    has it and otherwise this loop in torch; ``True`` requires the op, ``False`` forces the torch loop. Both give
    identical results.

    ``donor_mask`` (``[R, R]`` bool, :func:`donor_mask`; ``None``: unconstrained). A mask that allows every pair
    of distinct ranks gives the unconstrained plan (steps 1 and 2 skip ranks without an open allowed receiver). A
    mask that forbids some pair aims above the mean: filling receivers only up to ``avg`` would leave a hot rank's
    few donors (already near the mean) almost no room. Instead a level search (:func:`_level_search`) finds the
    lowest level that a fill (:func:`_level_fill`: the steps above with capacities ``level - load``, receivers
    that pass their own home tokens on to their receivers, ``S + R`` steps) reaches, and a hot expert is split
    over as many donor slots as that level needs. Next to it run two water fills (:func:`_water_fill`, quanta
    :data:`WATER_QUANTA`); the plan with the lowest maximum rank load wins (:func:`_constrained_best_fit`), and its
    amounts are re-levelled with its slot homes kept (:func:`_relevel`).
    """
    counts = _check_counts(counts)
    k = int(num_spare_experts_per_ep_rank)
    mask = _check_donor_mask(donor_mask, counts.shape[0], counts.device)
    if native is not False:
        op = _native_best_fit(counts)
        if op is not None:
            return op(counts, k, mask)
        if native:
            raise RuntimeError("best_fit_assignment(native=True): moe_graph._C has no echo_best_fit for this device")
    if mask is None:
        return _best_fit_at_avg(counts, k, None)
    restrictive = _restrictive(mask)
    if isinstance(restrictive, bool):  # host-readable mask: run only the branch that counts
        return _constrained_best_fit(counts, k, mask) if restrictive else _best_fit_at_avg(counts, k, mask)
    return torch.where(restrictive, _constrained_best_fit(counts, k, mask), _best_fit_at_avg(counts, k, mask))


def _restrictive(mask: torch.Tensor):
    """Whether ``mask`` forbids some pair of distinct ranks: a bool for a host-readable mask, else a 0-d tensor."""
    R = mask.shape[0]
    eye = torch.eye(R, dtype=torch.bool, device=mask.device)
    flag = (~mask & ~eye).any()
    return bool(flag) if mask.device.type == "cpu" and real_host_values(mask) else flag


def _level_fill(load_e: torch.Tensor, load_r: torch.Tensor, allowed: torch.Tensor, k: int, lam: torch.Tensor,
                cascade: torch.Tensor, demand: torch.Tensor, record: bool):
    """Donor-constrained fill at each level of ``lam`` ``[B]`` side by side (the native ``level_fill`` per warp).

    Donors shed what exceeds the level, receivers take up to it. ``S + R`` steps; each takes the most loaded
    donor ``q`` (the largest excess, lowest rank on ties) and either tops up a replica of one of ``q``'s experts
    that a receiver already hosts (no new slot; the receiver with the most room below the level), or puts a
    piece of ``q``'s heaviest remaining expert into a new slot of a receiver (the smallest room that fits, else
    the largest room, else, with ``cascade``, the smallest cascade capacity that fits, else the largest), or marks
    ``q`` stuck when no allowed receiver can take anything (final: room only shrinks). A receiver's cascade
    capacity is its room plus what it could pass on from its home experts to the room of its own receivers (those
    with a free slot or hosting one of its experts); taking more than its room makes it a donor in turn. With
    ``demand`` (``[B]`` bool), a new slot that no room fits goes to the receiver that the fewest other donors still
    shedding may use (then the largest room), so that one hot rank's cascade leaves a neighbouring hot rank's only
    cold receiver alone.

    Returns ``(ex [B, R], cap [B, R], plan)``: rank ``r``'s load afterwards is ``lam + ex[r] - cap[r]``;
    ``plan`` is ``[B, E * S]`` (the pieces) when ``record`` else ``None``.
    """
    B, R, E = lam.shape[0], load_r.shape[0], load_e.shape[0]
    L, S, dev = E // R, R * k, load_e.device
    ex = (load_r[None, :] - lam[:, None]).clamp(min=0)
    cap = (lam[:, None] - load_r[None, :]).clamp(min=0)
    used = torch.zeros(B, R, dtype=torch.int64, device=dev)
    stuck = torch.zeros(B, R, dtype=torch.bool, device=dev)
    hl = load_r[None, :].repeat(B, 1)
    avail = load_e[None, :].repeat(B, 1)
    slot_e = torch.full((B, S), -1, dtype=torch.int64, device=dev)  # expert hosted by each slot, -1: free
    a_int = allowed.to(torch.int64)  # [r, q]
    a_dbl = allowed.to(torch.float64)
    pot = (cap[:, :, None] * a_int[None]).sum(1)  # pot[b, p]: room of the receivers that p could pass tokens to
    nfree = (k * a_int).sum(0)[None, :].repeat(B, 1)  # nfree[b, p]: free slots of the receivers of p
    ntop = torch.zeros(B, R, dtype=torch.int64, device=dev)  # ntop[b, p]: slots hosting an expert of p
    ranks = torch.arange(R, device=dev)
    experts = torch.arange(E, device=dev)
    kk = torch.arange(k, device=dev)
    bi = torch.arange(B, device=dev)
    plan = torch.zeros(B, E * S + 1, dtype=torch.int64, device=dev) if record else None  # last: sink
    c = _RECV_CLASS
    for _ in range(S + R):
        key = torch.where(stuck, 0, ex)
        q = torch.argmax(key, 1)
        kq = key.gather(1, q[:, None]).squeeze(1)
        av_q = avail.view(B, R, L).gather(1, q.view(B, 1, 1).expand(B, 1, L)).squeeze(1)
        e_loc = torch.argmax(av_q, 1)
        e_new = q * L + e_loc
        x = torch.minimum(kq, av_q.gather(1, e_loc[:, None]).squeeze(1))[:, None]
        passable = torch.minimum(torch.minimum(hl - ex, pot), (nfree + ntop) * avail.view(B, R, L).max(2).values)
        ceff = torch.where(used < k, cap + torch.where(cascade[:, None], passable.clamp(min=0), 0), 0)
        # top-up: the first slot of r hosting an expert of q with tokens left
        se = slot_e.view(B, R, k)
        se_av = avail.gather(1, se.clamp(min=0).view(B, S)).view(B, R, k)
        top = (se >= 0) & (se // L == q[:, None, None]) & (se_av > 0)
        top_i = torch.argmax(top.to(torch.int8), 2)  # [B, R]
        has_top = top.any(2)
        allowed_q = allowed.index_select(1, q).t() & (ranks[None, :] != q[:, None])
        is_top = allowed_q & has_top & (cap > 0)
        is_open = allowed_q & (ceff > 0)
        act = ((ex > 0) & ~stuck).to(torch.float64)  # donors still shedding; demand: r's others (q is one)
        dem = torch.where(demand[:, None], (act @ a_dbl.t()).to(torch.int64) - 1, 0)  # exact: counts <= R
        u = _DEMAND_UNIT
        rkey = torch.where(cap >= x, c + cap, torch.where(cap > 0, 2 * c + dem * u + (u // 2 - cap), torch.where(
            ceff >= x, 3 * c + ceff, 4 * c + (c // 2 - ceff))))
        rkey = torch.where(is_top, c // 2 - cap, torch.where(is_open, rkey, 5 * c))
        r = torch.argmin(rkey, 1)
        rk = rkey.gather(1, r[:, None]).squeeze(1)
        none = rk == 5 * c
        topup = rk < c
        active = (kq > 0) & ~none
        is_q = ranks[None, :] == q[:, None]
        is_r = ranks[None, :] == r[:, None]
        stuck = stuck | (is_q & ((kq > 0) & none)[:, None])
        cap_r = cap.gather(1, r[:, None]).squeeze(1)
        used_r = used.gather(1, r[:, None]).squeeze(1)
        ceff_r = ceff.gather(1, r[:, None]).squeeze(1)
        t_slot = r * k + top_i.gather(1, r[:, None]).squeeze(1)
        e_top = slot_e.gather(1, t_slot[:, None]).squeeze(1).clamp(min=0)
        e = torch.where(topup, e_top, e_new)
        slot = torch.where(topup, t_slot, r * k + used_r.clamp(max=k - 1))
        amt_top = torch.minimum(torch.minimum(kq, avail.gather(1, e[:, None]).squeeze(1)), cap_r)
        amt = torch.where(active, torch.where(topup, amt_top, torch.minimum(x.squeeze(1), ceff_r)), 0)
        cap_new = torch.where(amt > cap_r, 0, cap_r - amt)
        new_slot = active & ~topup
        used_new = used_r + new_slot.to(torch.int64)
        # r's contribution to pot[p] (p: the ranks r may host): its room while it has a free slot or hosts p's expert
        se_r = slot_e.gather(1, (r[:, None] * k + kk[None, :]))  # [B, k]
        hosts = torch.zeros(B, R + 1, dtype=torch.bool, device=dev)
        hosts[bi[:, None], torch.where(se_r >= 0, se_r // L, R)] = True
        hosts_old = hosts[:, :R]
        hosts_new = hosts_old | ((ranks[None, :] == q[:, None]) & new_slot[:, None])
        c_old = torch.where((used_r < k)[:, None] | hosts_old, cap_r[:, None], 0)
        c_new = torch.where((used_new < k)[:, None] | hosts_new, cap_new[:, None], 0)
        if record:
            plan.scatter_add_(1, torch.where(active, e * S + slot, E * S)[:, None], amt[:, None])
        slot_e = slot_e.scatter(1, slot[:, None], torch.where(new_slot, e, slot_e.gather(1, slot[:, None]).squeeze(1))[:, None])
        ex = ex - torch.where(is_q, amt[:, None], 0) + torch.where(is_r, (amt - cap_r).clamp(min=0)[:, None], 0)
        hl = hl - torch.where(is_q, amt[:, None], 0)
        avail = avail - torch.where(experts[None, :] == e[:, None], amt[:, None], 0)
        cap = torch.where(is_r, cap_new[:, None], cap)
        used = torch.where(is_r, used_new[:, None], used)
        pot = pot + a_int.index_select(0, r) * torch.where(active[:, None], c_new - c_old, 0)
        nfree = nfree - a_int.index_select(0, r) * new_slot.to(torch.int64)[:, None]
        ntop = ntop + (is_q & new_slot[:, None]).to(torch.int64)
    return ex, cap, (plan[:, : E * S] if record else None)


def _level_search(counts: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
    """Donor-constrained best fit: ``home_to_spare [E, R*k]`` of :func:`_level_fill` at the best level found.

    Two searches side by side, one without and one with cascading receivers (the latter ranking receivers by
    demand; each does better on some cases),
    candidate ``2 * j + cascade`` evaluating level ``j`` of its search, ``H = LEVEL_CANDIDATES // 2`` levels per
    search and round. Per search ``lo`` starts at ``avg - 1`` (below the mean no level is reached) and ``hi`` at
    the highest rank load (nothing to shed); each of :data:`LEVEL_ROUNDS` rounds evaluates ``H`` levels evenly
    inside ``(lo, hi)`` and zooms in to the neighbours of its best one (the lowest maximum rank load after the
    fill). The plan is the fill of the best evaluated (level, cascade) pair (first in evaluation order on ties;
    the empty plan at the highest load to start), so it never loads a rank more than no plan does.
    """
    R, E = counts.shape
    dev = counts.device
    load_e = counts.sum(0)
    load_r = load_e.view(R, E // R).sum(1)
    H = LEVEL_CANDIDATES // 2
    big = torch.iinfo(torch.int64).max
    hi = load_r.max().repeat(2)  # per search (no cascade, cascade)
    lo = (load_r.sum() // R - 1).repeat(2)
    best_lam, best_m, best_cascade = hi[0], hi[0], torch.zeros((), dtype=torch.bool, device=dev)
    g = torch.arange(1, H + 1, device=dev)[:, None]  # [H, 1]
    j = torch.arange(H, device=dev)[:, None]
    cascade = torch.tensor([False, True], device=dev).repeat(H)  # candidate 2 * j + c
    demand = cascade  # the cascading search ranks receivers by demand (echo_plan_impl.h: search_demand)
    for _ in range(LEVEL_ROUNDS):
        lam = lo[None, :] + (hi - lo)[None, :] * g // (H + 1)  # [H, 2]
        valid = lam > lo[None, :]
        ex, cap, _ = _level_fill(load_e, load_r, mask, k, lam.reshape(-1), cascade, demand, False)
        m = torch.where(valid, lam + (ex - cap).max(1).values.view(H, 2), big)  # [H, 2]
        i = torch.argmin(m.reshape(-1))
        better = _at(m.reshape(-1), i) < best_m
        best_m = torch.where(better, _at(m.reshape(-1), i), best_m)
        best_lam = torch.where(better, _at(lam.reshape(-1), i), best_lam)
        best_cascade = torch.where(better, _at(cascade, i), best_cascade)
        f = torch.argmin(m, 0)  # [2]: per search, zoom in around its best level
        lo_new = torch.where(f > 0, lam.gather(0, (f - 1).clamp(min=0)[None, :]).squeeze(0), lo)
        hi = torch.where(f < H - 1, lam.gather(0, (f + 1).clamp(max=H - 1)[None, :]).squeeze(0), hi)
        lo = torch.maximum(lo, lo_new)
    _, _, plan = _level_fill(load_e, load_r, mask, k, best_lam.view(1), best_cascade.view(1), best_cascade.view(1),
                             True)
    return plan.view(E, R * k)


def _water_fill(load_e: torch.Tensor, load_r: torch.Tensor, allowed: torch.Tensor, k: int):
    """Donor-constrained water filling, one candidate per quantum of :data:`WATER_QUANTA` side by side (the native
    ``water_fill`` per warp). Returns ``(plan [B, E * S], max_load [B])``.

    Each of at most ``R * Q`` moves takes the most loaded rank ``q`` (lowest index on ties) and moves
    ``min(tokens left, gap // 2, total // (R * Q))`` tokens of one of its experts to the least loaded rank ``r``
    (lowest index on ties) that may host ``q``'s experts and can take some: into ``r``'s replica of ``q``'s expert
    with the most tokens left (lowest expert on ties) if it has one with tokens left, else into a new slot with
    ``q``'s heaviest remaining expert. A move never raises the maximum load; when none is possible the state stays.
    """
    R, E = load_r.shape[0], load_e.shape[0]
    L, S, dev = E // R, R * k, load_e.device
    B = len(WATER_QUANTA)
    quanta = torch.tensor(WATER_QUANTA, dtype=torch.int64, device=dev)
    delta = (load_r.sum() // (R * quanta)).clamp(min=1)  # [B]
    moves = R * quanta  # [B]
    load = load_r[None, :].repeat(B, 1)
    avail = load_e[None, :].repeat(B, 1)
    used = torch.zeros(B, R, dtype=torch.int64, device=dev)
    slot_e = torch.full((B, S), -1, dtype=torch.int64, device=dev)
    plan = torch.zeros(B, E * S + 1, dtype=torch.int64, device=dev)  # last: sink
    ranks = torch.arange(R, device=dev)
    experts = torch.arange(E, device=dev)
    kk = torch.arange(k, device=dev)
    big = torch.iinfo(torch.int64).max
    for i in range(R * max(WATER_QUANTA)):
        q = torch.argmax(load, 1)  # [B]
        gap = load.gather(1, q[:, None]) - load  # [B, R]
        se = slot_e.view(B, R, k)
        se_av = avail.gather(1, se.clamp(min=0).view(B, S)).view(B, R, k)
        hosted = (se >= 0) & (se // L == q[:, None, None]) & (se_av > 0)
        h_av = torch.where(hosted, se_av, -1).max(2).values  # [B, R]
        e_h = torch.where(hosted & (se_av == h_av[:, :, None]), se, E).min(2).values  # heaviest, lowest expert
        has_h = hosted.any(2)
        av_q = avail.view(B, R, L).gather(1, q.view(B, 1, 1).expand(B, 1, L)).squeeze(1)
        e_new = q * L + torch.argmax(av_q, 1)  # q's heaviest remaining expert (lowest on ties)
        e_r = torch.where(has_h, e_h, e_new[:, None])  # [B, R]
        a_r = torch.minimum(torch.minimum(avail.gather(1, e_r.clamp(max=E - 1)), gap // 2), delta[:, None])
        ok = allowed.index_select(1, q).t() & (ranks[None, :] != q[:, None]) & (has_h | (used < k)) & (a_r > 0)
        ok = ok & (i < moves)[:, None]
        r = torch.argmin(torch.where(ok, load, big), 1)
        active = ok.gather(1, r[:, None]).squeeze(1)
        e = e_r.gather(1, r[:, None]).squeeze(1).clamp(max=E - 1)
        a = torch.where(active, a_r.gather(1, r[:, None]).squeeze(1), 0)
        hosted_r = has_h.gather(1, r[:, None]).squeeze(1)
        new_slot = active & ~hosted_r
        se_r = slot_e.gather(1, r[:, None] * k + kk[None, :])  # [B, k]
        slot = r * k + torch.where(hosted_r, torch.argmax((se_r == e[:, None]).to(torch.int8), 1),
                                   used.gather(1, r[:, None]).squeeze(1).clamp(max=k - 1))
        plan.scatter_add_(1, torch.where(active, e * S + slot, E * S)[:, None], a[:, None])
        slot_e = slot_e.scatter(1, slot[:, None], torch.where(new_slot, e, slot_e.gather(1, slot[:, None]).squeeze(1))[:, None])
        is_r = ranks[None, :] == r[:, None]
        used = used + (is_r & new_slot[:, None]).to(torch.int64)
        avail = avail - torch.where(experts[None, :] == e[:, None], a[:, None], 0)
        load = load - torch.where(ranks[None, :] == q[:, None], a[:, None], 0) + torch.where(is_r, a[:, None], 0)
    return plan[:, : E * S], load.max(1).values


def _constrained_best_fit(counts: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
    """Donor-constrained best fit: the level search's plan or a water-filling candidate, whichever leaves the lowest
    maximum rank load (the level search's on ties, then the first quantum), re-levelled (:func:`_relevel`)."""
    R, E = counts.shape
    load_e = counts.sum(0)
    load_r = load_e.view(R, E // R).sum(1)
    level = _level_search(counts, k, mask)
    water, water_max = _water_fill(load_e, load_r, mask, k)
    plans = torch.cat([level.view(1, -1), water], 0)
    maxes = torch.cat([rank_loads_after(counts, level).max().view(1), water_max])
    best = plans.index_select(0, torch.argmin(maxes).view(1)).view(E, R * k)
    return _relevel(counts, best, k)


def _relevel(counts: torch.Tensor, home_to_spare: torch.Tensor, k: int) -> torch.Tensor:
    """Re-levels a plan's amounts with every slot's home expert kept (the native ``relevel``).

    The candidates decide which expert each slot hosts; their amounts are greedy (a fill never takes tokens back,
    so a receiver loaded early stays loaded even when a cascade later raises its donor's other receivers). Here
    :data:`RELEVEL_SWEEPS` sweeps over the slots in order move tokens along each slot's (home rank ``q``, slot
    rank ``r``) edge: ``min(tokens of the home expert still at home, gap // 2)`` from ``q`` to ``r`` when
    ``gap = load[q] - load[r] >= 2``, or ``min(the slot's tokens, -gap // 2)`` back when ``gap <= -2``. Each move
    leaves both ranks at most at the larger of their two loads, so the maximum rank load never rises; the sweeps
    converge to the best amounts for the slot homes (the LP optimum on the sweep's worst cases within ~2%).
    Empty slots stay empty. Sequential: ``RELEVEL_SWEEPS * S`` steps of a few scalar updates.
    """
    R, E = counts.shape
    L, S = E // R, home_to_spare.shape[1]
    dev = home_to_spare.device
    h = home_to_spare
    home, x = _slot_homes(h)  # [S]: home expert (0 for an empty slot), tokens (one non-zero per column)
    has = x > 0
    avail = counts.sum(0) - h.sum(1)  # [E] tokens of each expert still at home
    load = rank_loads_after(counts, h)
    q_of = home // L
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    for _ in range(RELEVEL_SWEEPS):
        for j in range(S):
            e, q = home[j : j + 1], q_of[j : j + 1]
            r = j // k
            gap = load.index_select(0, q) - load[r : r + 1]
            up = torch.minimum(avail.index_select(0, e), gap // 2)
            down = torch.minimum(x[j : j + 1], (-gap) // 2)
            d = torch.where(has[j : j + 1], torch.where(gap >= 2, up, torch.where(gap <= -2, -down, zero)), zero)
            x[j : j + 1] += d
            avail.index_add_(0, e, -d)
            load.index_add_(0, q, -d)
            load[r : r + 1] += d
    return h.scatter(0, home[None, :], x[None, :])  # an empty slot's x stays h[0, j] = 0


def _best_fit_at_avg(counts: torch.Tensor, k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Best fit with every receiver filled up to the mean (unconstrained, or a mask that allows every pair)."""
    R, E = counts.shape
    epr = E // R
    S = R * k
    dev = counts.device
    load_e = counts.sum(0)
    load_r = load_e.view(R, epr).sum(1)
    avg = load_r.sum() // R
    excess = (load_r - avg).clamp(min=0)
    cap = (avg - load_r).clamp(min=0)
    avail = load_e.clone().view(R, epr)
    used_slots = torch.zeros(R, dtype=torch.int64, device=dev)
    flat = torch.zeros(E * S + 1, dtype=torch.int64, device=dev)  # last entry: sink for no-op steps
    big = torch.iinfo(torch.int64).max
    ranks = torch.arange(R, device=dev)
    for _ in range(S):
        if mask is None:
            q = torch.argmax(excess)  # first maximum: deterministic
            ex_q = _at(excess, q)
        else:  # donors with an open receiver they may use; the others count as 0
            open_any = (used_slots < k) & (cap > 0)
            key = torch.where((mask & open_any[:, None]).any(0), excess, 0)
            q = torch.argmax(key)
            ex_q = _at(key, q)
        av_q = _at(avail, q)
        e_loc = torch.argmax(av_q)
        x = torch.minimum(ex_q, _at(av_q, e_loc))
        open_bin = (used_slots < k) & (cap > 0)
        if mask is not None:
            open_bin = open_bin & mask.index_select(1, q.view(1)).squeeze(1)
        fits = open_bin & (cap >= x)
        r_fit = torch.argmin(torch.where(fits, cap, big))
        r_big = torch.argmax(torch.where(open_bin, cap, -1))
        r = torch.where(fits.any(), r_fit, r_big)
        a = torch.minimum(x, _at(cap, r))
        a = torch.where(_at(open_bin, r) & (x > 0), a, torch.zeros_like(a))
        e = q * epr + e_loc
        slot = r * k + _at(used_slots, r).clamp(max=k - 1)
        pos = torch.where(a > 0, e * S + slot, torch.full_like(e, E * S))
        flat.index_add_(0, pos.view(1), a.view(1))
        excess = excess - torch.where(ranks == q, a, 0)
        cap = cap - torch.where(ranks == r, a, 0)
        avail = avail - torch.where((ranks == q)[:, None] & (torch.arange(epr, device=dev) == e_loc)[None, :], a, 0)
        used_slots = used_slots + ((ranks == r) & (a > 0)).to(torch.int64)
    return flat[: E * S].view(E, S)


def rank_loads_after(counts: torch.Tensor, home_to_spare: torch.Tensor) -> torch.Tensor:
    """Tokens received by each EP rank with the plan: ``[R]`` int64, :func:`rank_loads` minus what its home
    experts send to spare slots plus what its own slots take (``home_to_spare [E, R*k]``)."""
    R = counts.shape[0]
    E, S = home_to_spare.shape
    sent = home_to_spare.sum(1).view(R, E // R).sum(1)  # [R] tokens of each rank's experts that moved away
    taken = home_to_spare.sum(0).view(R, S // R).sum(1)  # [R] tokens each rank's slots take
    return rank_loads(counts) - sent + taken


def gen_assignment(
    counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1, assignment: str = "auto", native: bool | None = None,
    donor_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many tokens of each home expert each spare slot takes.

    Args:
        counts: ``[R, E]`` integer token counts (source rank x home expert), identical on every rank.
        num_spare_experts_per_ep_rank: ``k >= 1`` spare slots per rank.
        assignment: ``"greedy"`` (interval overlap + top-k per rank column, :func:`greedy_assignment`),
            ``"best_fit"`` (:func:`best_fit_assignment`) or ``"auto"`` (default: both, keeping the one with the
            lower maximum rank load after offloading; ties keep greedy, so never worse than greedy).
        native: passed to :func:`best_fit_assignment` (``False``: pure torch).
        donor_mask: ``[R, R]`` bool from :func:`donor_mask` (``None``: any rank may host any other rank's expert):
            a slot on rank ``r`` hosts only experts whose home rank ``q`` has ``donor_mask[r, q]``.

    Returns:
        ``home_to_spare[E, S]`` int64, ``S = R * k``: at most one non-zero per column (a slot hosts one home
        expert); a slot on rank ``r`` only takes experts of other ranks; the slots of a rank take at most its spare
        capacity in total; the tokens taken from expert ``e`` never exceed its total count.

    Example (8 experts on 4 ranks, greedy, ``k = 1``): slot 1 takes 100 tokens of expert 5, slot 2
    takes 60 tokens of expert 1, slots 0 and 3 are empty.
    """
    counts = _check_counts(counts)
    k = int(num_spare_experts_per_ep_rank)
    if k < 1:
        raise ValueError(f"num_spare_experts_per_ep_rank must be >= 1, got {num_spare_experts_per_ep_rank}")
    if counts.shape[1] == 0:  # no experts: nothing to place (the native op gives the same empty plan)
        if assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
        return counts.new_zeros(0, counts.shape[0] * k)
    if assignment == "greedy":
        return greedy_assignment(counts, k, donor_mask)
    if assignment == "best_fit":
        return best_fit_assignment(counts, k, native, donor_mask)
    if assignment != "auto":
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    g = greedy_assignment(counts, k, donor_mask)
    b = best_fit_assignment(counts, k, native, donor_mask)
    better = rank_loads_after(counts, b).max() < rank_loads_after(counts, g).max()
    return torch.where(better, b, g)


def _slot_homes(home_to_spare: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(home[S], amount[S])``: the home expert of each slot (0 for an empty slot) and its token count."""
    amount = home_to_spare.sum(0)
    home = torch.argmax((home_to_spare > 0).to(torch.int8), dim=0)  # first non-zero row
    return home, amount


def breadth_first_allocation(counts: torch.Tensor, home_to_spare: torch.Tensor) -> torch.Tensor:
    """Phase 1 of the allocation: every source rank contributes to a slot in proportion to its tokens.

    Args:
        counts: ``[R, E]`` integer token counts. home_to_spare: ``[E, S]`` from :func:`gen_assignment`.

    Returns:
        ``[R, S]`` int64: ``floor(counts[r, e] * amount_j / sum_r counts[r, e])`` for slot ``j`` of home expert
        ``e`` taking ``amount_j`` tokens (exact integer arithmetic). Floors may leave a few tokens per slot
        unallocated; :func:`depth_first_allocation` places them.

    Example: one expert with ``[30, 50, 20]`` tokens from 3 ranks and a slot taking 80 -> ``[24, 40, 16]``;
    a slot taking 83 -> ``floor([24.9, 41.5, 16.6]) = [24, 41, 16]`` (2 tokens left over).
    """
    counts = _check_counts(counts)
    home, amount = _slot_homes(home_to_spare.to(torch.int64))
    c = counts[:, home]  # [R, S]
    total = counts.sum(0)[home]  # [S]
    return (c * amount[None, :]) // total.clamp(min=1)[None, :]


def depth_first_allocation(
    counts: torch.Tensor, home_to_spare: torch.Tensor, breadth_first: torch.Tensor
) -> torch.Tensor:
    """Phase 2: place what the proportional floors left over, source rank by source rank.

    For each home expert, the tokens each source rank still has (``counts`` minus its breadth-first shares over
    all slots of that expert) are laid on a number line in rank order, the slots' leftovers (in slot order) on
    another, and their interval overlap is added to the breadth-first shares.

    Returns:
        ``[R, S]`` int64: tokens source rank ``r`` sends to slot ``j``. Column ``j`` sums to the slot's amount in
        ``home_to_spare``; per (rank, expert) the shares never exceed ``counts``.

    Example: ``[30, 50, 20]`` tokens, a slot taking 83, breadth-first ``[24, 41, 16]``: ranks still hold
    ``[6, 9, 4]``, the 2 leftover tokens fall in rank 0's interval ``[0, 6)`` -> ``[26, 41, 16]``.
    """
    counts = _check_counts(counts)
    R, E = counts.shape
    bf = breadth_first.to(torch.int64)
    home, amount = _slot_homes(home_to_spare.to(torch.int64))
    S = home.shape[0]
    rem = amount - bf.sum(0)  # [S]
    used = torch.zeros_like(counts).index_add_(1, home, bf)  # [R, E] (integer adds: deterministic)
    left = counts - used
    c_end = left.cumsum(0)  # [R, E]
    c_start = c_end - left
    j = torch.arange(S, device=counts.device)
    before = (home[:, None] == home[None, :]) & (j[None, :] < j[:, None])  # [S, S]: same expert, earlier slot
    b_start = (before.to(torch.int64) * rem[None, :]).sum(1)
    b_end = b_start + rem
    lo = torch.maximum(c_start[:, home], b_start[None, :])
    hi = torch.minimum(c_end[:, home], b_end[None, :])
    return bf + (hi - lo).clamp(min=0)


def gen_allocation(counts: torch.Tensor, home_to_spare: torch.Tensor) -> torch.Tensor:
    """Breadth-first then depth-first allocation: ``[R, S]`` tokens each source rank sends to each slot."""
    if counts.shape[1] == 0:  # no experts: nothing moves
        return counts.new_zeros(counts.shape[0], home_to_spare.shape[1], dtype=torch.int64)
    return depth_first_allocation(counts, home_to_spare, breadth_first_allocation(counts, home_to_spare))


def _native_plan(counts: torch.Tensor):
    return echo_plan if plan_available(counts.device.type) else None


def gen_plan(
    counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1, assignment: str = "auto", native: bool | None = None,
    donor_mask: torch.Tensor | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(home_to_spare [E, S], allocation [R, S])``: :func:`gen_assignment` then :func:`gen_allocation`.

    ``native``: ``None`` (default) uses the native op ``moe_graph::echo_plan`` when the extension has it for the
    device (the whole plan in one step: one kernel launch on CUDA instead of ~100 small ones), otherwise the torch
    functions; ``True`` requires the op; ``False`` forces torch. Both give identical results. ``donor_mask``: see
    :func:`gen_assignment`.

    Example: ``gen_plan(torch.tensor([[60, 20, 5, 5], [60, 20, 5, 5]]))`` ->
    ``([[0, 70], [0, 0], [0, 0], [0, 0]], [[0, 35], [0, 35]])``.
    """
    counts = _check_counts(counts)
    k = int(num_spare_experts_per_ep_rank)
    if k < 1:
        raise ValueError(f"num_spare_experts_per_ep_rank must be >= 1, got {num_spare_experts_per_ep_rank}")
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    mask = _check_donor_mask(donor_mask, counts.shape[0], counts.device)
    if native is not False:
        op = _native_plan(counts)
        if op is not None:
            return op(counts, k, assignment, mask)
        if native:
            raise RuntimeError("gen_plan(native=True): moe_graph._C has no echo_plan for this device")
    h = gen_assignment(counts, k, assignment, native=native, donor_mask=mask)
    return h, gen_allocation(counts, h)


def reuse_plan(
    counts: torch.Tensor, home_to_spare_ref: torch.Tensor, expert_loads_ref: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plan once per iteration: keep a reference plan's placement (which expert each slot hosts, so the weights
    need not move again) and rescale its amounts to new ``counts``. Returns ``(home_to_spare [E, S],
    allocation [R, S])`` like :func:`gen_plan`.

    Slot ``j`` hosting expert ``e`` takes the same share of ``e``'s tokens as in the reference:
    ``floor(load_e * home_to_spare_ref[e, j] / expert_loads_ref[e])`` (exact integer arithmetic, so the slots of an
    expert never take more than its tokens); the allocation over source ranks is :func:`gen_allocation`. With
    ``counts`` equal to the reference counts the reference plan comes back unchanged.

    Args:
        counts: ``[R, E]`` this microbatch's all-gathered counts. home_to_spare_ref: ``[E, S]`` the reference plan.
        expert_loads_ref: ``[E]`` the reference counts' ``sum(0)``.
    """
    counts = _check_counts(counts)
    R, E = counts.shape
    h_ref = home_to_spare_ref.to(torch.int64)
    if h_ref.dim() != 2 or h_ref.shape[0] != E or h_ref.shape[1] % R:
        raise ValueError(f"home_to_spare_ref must have shape [E, R*k] with E={E}, R={R}, got {tuple(h_ref.shape)}")
    if tuple(expert_loads_ref.shape) != (E,):
        raise ValueError(f"expert_loads_ref must have shape [E] = [{E}], got {tuple(expert_loads_ref.shape)}")
    load = counts.sum(0)
    h = h_ref * load[:, None] // expert_loads_ref.to(torch.int64).clamp(min=1)[:, None]
    return h, gen_allocation(counts, h)


def reroute_tokens_torch(
    routing_map: torch.Tensor, probs: torch.Tensor, tokens_to_spare: torch.Tensor, offload_map: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch equivalent of ``moe_graph.ops.reroute_tokens`` (same results, bit for bit).

    For each home expert ``e`` and its slots ``j1 < j2 < ...`` (``offload_map[e, j]``), the routed tokens of
    ``e`` in ascending token order move: the first ``tokens_to_spare[j1]`` to slot ``j1``, the next ones to
    ``j2``... A moved token's route leaves column ``e`` for column ``E + j`` together with its probability; if the
    plan asks for more tokens than are routed, the request is clamped (the native op also sets the device error
    flag). A slot's expert is the first ``True`` of its column.
    """
    T, E = routing_map.shape
    S = offload_map.shape[1]
    dev = routing_map.device
    if E == 0:  # no home experts: no routes, nothing moves (as the native op)
        return (torch.zeros(T, S, dtype=torch.bool, device=dev), torch.zeros(T, S, dtype=probs.dtype, device=dev))
    hmap = offload_map.to(torch.bool)
    first = torch.argmax(hmap.to(torch.int8), dim=0)  # [S]
    has_home = hmap.any(0)
    owner = torch.zeros(E, S, dtype=torch.bool, device=dev)
    owner[first, torch.arange(S, device=dev)] = has_home
    want = torch.where(owner, tokens_to_spare.to(torch.int64).clamp(min=0)[None, :], 0)  # [E, S]
    ends = want.cumsum(1)  # [E, S] non-decreasing
    rm = routing_map.to(torch.bool)
    rank = rm.to(torch.int64).cumsum(0) - 1  # [T, E]: index of the token among e's routed tokens
    slot = torch.searchsorted(ends, rank.t().contiguous(), right=True).t()  # [T, E] in [0, S]
    moved = rm & (slot < S)
    out_map = torch.zeros(T, E + S + 1, dtype=torch.bool, device=dev)
    out_probs = torch.zeros(T, E + S + 1, dtype=probs.dtype, device=dev)
    out_map[:, :E] = rm & ~moved
    out_probs[:, :E] = torch.where(moved, torch.zeros((), dtype=probs.dtype, device=dev), probs)
    col = torch.where(moved, E + slot, E + S)  # moved routes go to their slot, others to a sink column
    out_map.scatter_(1, col, moved)  # distinct slots per token (a slot has one home expert) -> no collisions
    out_probs.scatter_(1, col, torch.where(moved, probs, torch.zeros((), dtype=probs.dtype, device=dev)))
    return out_map[:, : E + S].contiguous(), out_probs[:, : E + S].contiguous()


def reroute_tokens(routing_map: torch.Tensor, probs: torch.Tensor, tokens_to_spare: torch.Tensor,
                   offload_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move routed tokens to their spare slots: the native op :func:`moe_graph.ops.reroute.reroute_tokens` when the
    extension has it (decided once per process, :func:`moe_graph.ops.reroute.native_available`), else
    :func:`reroute_tokens_torch`; both give the same bits. Arguments and result as the native op's."""
    if reroute_ops.native_available():
        return reroute_ops.reroute_tokens(routing_map, probs, tokens_to_spare, offload_map)
    return reroute_tokens_torch(routing_map, probs, tokens_to_spare, offload_map)


def gen_offloading_plan(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    counts: torch.Tensor,
    ep_rank: int,
    num_ep_ranks: int,
    num_spare_experts_per_ep_rank: int = 1,
    assignment: str = "auto",
    donor_mask: torch.Tensor | None = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plan echo offloading and reroute this rank's tokens.

    Args:
        routing_map: ``[T, E]`` bool, this rank's tokens' routes (to home experts).
        probs: ``[T, E]`` float, their probabilities.
        counts: ``[R, E]`` integer, all-gathered ``routing_map.sum(0)`` of every EP rank (identical everywhere).
        ep_rank: this rank's index in the EP group; num_ep_ranks: ``R``.
        num_spare_experts_per_ep_rank: ``k``. assignment, donor_mask: see :func:`gen_assignment`.

    Returns:
        ``(rerouted_routing_map [T, E+S] bool, rerouted_probs [T, E+S], offload_map [E, S] bool)``.
        Columns ``0..E-1`` are the home experts, ``E..E+S-1`` the spare slots. ``offload_map[e, j]``
        says slot ``j`` hosts a copy of home expert ``e``; it depends only on ``counts`` so every rank gets the
        same one. Every token keeps its number of routes, and moved probabilities are bit-identical.

    Example: 2 ranks, 2 experts each, ``k = 1``, counts ``[[60, 20, 5, 5], [60, 20, 5, 5]]``: rank loads
    ``[160, 20]``, avg 90; rank 1's slot (slot 1) hosts a copy of expert 0 and takes 70 of its tokens, 35 from
    each source rank, so both ranks receive 90 tokens.
    """
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map must be a 2-D bool tensor [T, E], got shape {tuple(routing_map.shape)}")
    if probs.shape != routing_map.shape:
        raise ValueError(f"probs must have the shape of routing_map {tuple(routing_map.shape)}, got {tuple(probs.shape)}")
    counts = _check_counts(counts, num_ep_ranks)
    if counts.shape[1] != routing_map.shape[1]:
        raise ValueError(
            f"counts [R, E] must have E={routing_map.shape[1]} columns (routing_map's experts), got shape {tuple(counts.shape)}"
        )
    if not 0 <= ep_rank < num_ep_ranks:
        raise ValueError(f"ep_rank must be in [0, {num_ep_ranks}), got {ep_rank}")
    counts = counts.to(routing_map.device)
    home_to_spare, allocation = gen_plan(counts, num_spare_experts_per_ep_rank, assignment, donor_mask=donor_mask)
    offload_map = home_to_spare > 0
    new_map, new_probs = reroute_tokens(routing_map, probs, allocation[ep_rank], offload_map)
    return new_map, new_probs, offload_map
