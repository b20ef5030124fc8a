"""Plain-Python references for the echo planner and token rerouting (loops, no vectorization): the tests compare
the tensor code and the native kernels against these."""

from __future__ import annotations

from typing import List, Tuple

import torch


def reroute_tokens_reference(
    routing_map: torch.Tensor, probs: torch.Tensor, tokens_to_spare: torch.Tensor, offload_map: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """Token-by-token reference of ``reroute_tokens``. Returns ``(map [T, E+S], probs [T, E+S], over_ask)``.

    Slot ``j``'s home expert is the first ``True`` row of column ``j`` (none: the slot takes nothing). For each
    home expert, its slots in ascending order take its routed tokens in ascending token order; a request larger
    than what is left is clamped and ``over_ask`` is reported. Negative requests count as 0.
    """
    rm = routing_map.to(torch.bool).cpu()
    pr = probs.cpu()
    T, E = rm.shape
    S = offload_map.shape[1]
    hmap = offload_map.to(torch.bool).cpu()
    want = [max(0, int(v)) for v in tokens_to_spare.cpu().tolist()]
    out_map = torch.zeros(T, E + S, dtype=torch.bool)
    out_probs = torch.zeros(T, E + S, dtype=probs.dtype)
    out_map[:, :E] = rm
    out_probs[:, :E] = pr
    over = False
    slots_of: List[List[int]] = [[] for _ in range(E)]
    for j in range(S):
        homes = [e for e in range(E) if bool(hmap[e, j])]
        if homes:
            slots_of[homes[0]].append(j)
        elif want[j] > 0:
            over = True
    for e in range(E):
        if not slots_of[e]:
            continue
        tokens = [t for t in range(T) if bool(rm[t, e])]
        pos = 0
        for j in slots_of[e]:
            n = want[j]
            if pos + n > len(tokens):
                over = True
                n = len(tokens) - pos
            for t in tokens[pos : pos + n]:
                out_map[t, e] = False
                out_map[t, E + j] = True
                out_probs[t, E + j] = pr[t, e]
                out_probs[t, e] = 0
            pos += n
    return out_map, out_probs, over


def zipf_routing(
    num_tokens: int, num_experts: int, topk: int, skew: float, generator: torch.Generator, permute: bool = True
) -> torch.Tensor:
    """Random ``[T, E]`` bool routing: each token picks ``topk`` distinct experts with probability ~ 1/i**skew
    (``permute``: the popular experts are spread over the EP ranks at random instead of all on rank 0)."""
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    if permute:
        p = p[torch.randperm(num_experts, generator=generator)]
    idx = torch.multinomial(p.expand(num_tokens, num_experts), topk, replacement=False, generator=generator)
    rm = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    rm.scatter_(1, idx, True)
    return rm


def zipf_counts(
    num_ep_ranks: int, num_experts: int, tokens_per_rank: int, topk: int, skew: float, generator: torch.Generator,
    permute: bool = True,
) -> torch.Tensor:
    """``[R, E]`` int64 token counts of Zipf routing on every EP rank (the same expert popularity everywhere)."""
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    if permute:
        p = p[torch.randperm(num_experts, generator=generator)]
    rows = []
    for _ in range(num_ep_ranks):
        idx = torch.multinomial(p.expand(tokens_per_rank, num_experts), topk, replacement=False, generator=generator)
        rows.append(torch.bincount(idx.flatten(), minlength=num_experts))
    return torch.stack(rows).to(torch.int64)


def loads_after(counts: torch.Tensor, home_to_spare: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(before[R], after[R])`` tokens received per EP rank without and with the plan."""
    R, E = counts.shape
    before = counts.sum(0).view(R, E // R).sum(1)
    after = before - home_to_spare.sum(1).view(R, E // R).sum(1) + home_to_spare.sum(0).view(R, k).sum(1)
    return before, after


def water_filling_max_load(counts: torch.Tensor, k: int, donor_mask: torch.Tensor | None, quanta: int = 256,
                           max_moves: int | None = None) -> int:
    """Water-filling reference for a donor-constrained echo plan: the highest rank load it reaches (tokens).

    Repeatedly take the most loaded rank ``q`` (lowest index on ties) and move a share of at most
    ``delta = total // (R * quanta)`` tokens (and at most half the gap) of one of its home experts to the least
    loaded rank ``r`` allowed to host ``q``'s experts (``donor_mask[r, q]``; any other rank when ``None``): into
    ``r``'s replica of that expert if it has one with tokens left to take, else into a new replica (a free slot on
    ``r``, ``k`` per rank) of ``q``'s heaviest remaining expert. Stops when the most loaded rank can move nothing.
    ``max_moves``: stop after that many moves (``None``: no limit). Plain Python, independent of the planner's code.
    """
    R, E = counts.shape
    L = E // R
    per_expert = [int(v) for v in counts.clamp(min=0).sum(0).tolist()]
    load = [sum(per_expert[q * L:(q + 1) * L]) for q in range(R)]
    avail = per_expert[:]
    delta = max(1, sum(per_expert) // (R * quanta))
    slots: List[List[int]] = [[] for _ in range(R)]  # experts hosted per rank
    allowed = [[(bool(donor_mask[r, q]) if donor_mask is not None else True) and r != q for q in range(R)]
               for r in range(R)]
    moves = 0
    while max_moves is None or moves < max_moves:
        q = max(range(R), key=lambda i: (load[i], -i))
        best = None
        for r in range(R):
            gap = load[q] - load[r]
            if not allowed[r][q] or gap < 2:
                continue
            hosted = [e for e in slots[r] if e // L == q and avail[e] > 0]
            if hosted:
                e = max(hosted, key=lambda f: (avail[f], -f))
            elif len(slots[r]) < k:
                e = max(range(q * L, (q + 1) * L), key=lambda f: (avail[f], -f))
            else:
                continue
            amount = min(avail[e], gap // 2, delta)
            if amount > 0 and (best is None or (load[r], r) < best[0]):
                best = ((load[r], r), r, e, amount)
        if best is None:
            return max(load)
        _, r, e, amount = best
        if e not in slots[r]:
            slots[r].append(e)
        avail[e] -= amount
        load[q] -= amount
        load[r] += amount
        moves += 1
    return max(load)


def _max_flow(n: int, edges: List[Tuple[int, int, int]], s: int, t: int) -> int:
    """Edmonds-Karp max flow on ``n`` nodes (``edges``: ``(u, v, capacity)``). Plain Python, small graphs."""
    cap: List[dict] = [dict() for _ in range(n)]
    for u, v, c in edges:
        cap[u][v] = cap[u].get(v, 0) + c
        cap[v].setdefault(u, 0)
    flow = 0
    while True:
        parent = {s: s}
        queue = [s]
        for u in queue:  # breadth-first: shortest augmenting path
            for v, c in cap[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if t not in parent:
            return flow
        path, v = [], t
        while v != s:
            path.append((parent[v], v))
            v = parent[v]
        push = min(cap[u][v] for u, v in path)
        for u, v in path:
            cap[u][v] -= push
            cap[v][u] += push
        flow += push


def best_amounts_max_load(counts: torch.Tensor, k: int, home_to_spare: torch.Tensor) -> int:
    """The lowest highest rank load (tokens) that any amounts reach with ``home_to_spare``'s slot homes kept: each
    non-empty slot ``j`` (on rank ``j // k``) hosts its column's expert and may take any number of its tokens, an
    expert giving at most all of its tokens. Binary search on the level; a level is reachable iff a max flow
    (source -> overloaded rank: its excess; rank -> its experts: their tokens; expert -> the ranks of its slots;
    underloaded rank -> sink: its room) carries every excess. Exact integers, independent of the planner's code."""
    R, E = counts.shape
    L, S = E // R, R * k
    load_e = [int(v) for v in counts.clamp(min=0).sum(0).tolist()]
    load_r = [sum(load_e[q * L:(q + 1) * L]) for q in range(R)]
    h = home_to_spare.tolist()
    slot_edges = set()
    for j in range(S):
        rows = [e for e in range(E) if h[e][j] > 0]
        if rows:
            slot_edges.add((rows[0], j // k))
    src, snk = R + E, R + E + 1

    def reachable(lam: int) -> bool:
        edges = [(e // L, R + e, load_e[e]) for e in range(E)] + [(R + e, r, 1 << 60) for e, r in slot_edges]
        need = 0
        for r in range(R):
            if load_r[r] > lam:
                edges.append((src, r, load_r[r] - lam))
                need += load_r[r] - lam
            elif load_r[r] < lam:
                edges.append((r, snk, lam - load_r[r]))
        return _max_flow(R + E + 2, edges, src, snk) == need

    lo, hi = -(-sum(load_r) // R) - 1, max(load_r)  # lo unreachable (below the mean), hi reachable (no moves)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if reachable(mid):
            hi = mid
        else:
            lo = mid
    return hi
