"""Workers for tests/test_exchange_fused.py (run on gloo by ``run_distributed``): the fused exchange's host
reference (``exchange_*_reference``, all ranks in one process) against the existing per-destination exchange
(``HostSizedExchange`` over ``all_to_all_single``, the dispatcher's permute and ``reduce_rows``) on this rank."""

from __future__ import annotations

from typing import Dict, List

import torch

from moe_graph.moe.exchange import HostSizedExchange, HostSizedFusedExchange
from moe_graph.ops.dispatch_layout import dispatch_layout

# name, tokens, topk, local columns, zero-token columns (every other), quota (fraction of routes per destination;
# None: no quota), capacity (per rank; None: every arrival fits), rows dtype, row width, combine dtype, hidden
CASES = [
    ("bf16 rows", 9, 2, 3, False, None, None, torch.bfloat16, 8, torch.bfloat16, 8),
    ("fp32 rows, quotas bind, zero-token columns", 11, 3, 4, True, 0.3, None, torch.float32, 5, torch.float32, 5),
    ("uint8 FP8-packed rows of 37 bytes, capacity below the arrivals", 10, 2, 2, False, None, 7, torch.uint8, 37,
     torch.float32, 3),
    ("echo-like Lc = 5, one column takes most", 8, 2, 5, False, 0.5, None, torch.float16, 6, torch.float64, 4),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _rank_inputs(case, s: int, R: int):
    name, T, K, Lc, zero_cols, quota, cap, dtype, width, odtype, hidden = case
    g = torch.Generator().manual_seed(1000 * (CASES.index(case) + 1) + s)
    C = R * Lc
    idx = torch.randint(0, C, (T, K), generator=g)
    if zero_cols:
        idx = idx // 2 * 2
    if name.startswith("echo"):
        idx[: T // 2, 0] = 1  # one column takes most
    valid = torch.rand(T, K, generator=g) > 0.15
    if dtype == torch.uint8:
        rows = torch.randint(0, 256, (T, width), generator=g, dtype=torch.uint8)
    else:
        rows = torch.randn(T, width, generator=g).to(dtype)
    weights = torch.randn(T * K, generator=g)
    return idx, valid, rows, weights


def fused_reference_worker(rank: int, world: int) -> List[Dict]:
    R = world
    ex = HostSizedExchange()
    ops = torch.ops.moe_graph
    out = []
    for case in CASES:
        name, T, K, Lc, zero_cols, quota, cap_in, dtype, width, odtype, hidden = case
        n = T * K
        column_rank = torch.arange(R * Lc) // Lc
        column_local = torch.arange(R * Lc) % Lc
        q = torch.full((R,), max(1, int(quota * n)) if quota is not None else n, dtype=torch.int64)
        inputs = [_rank_inputs(case, s, R) for s in range(R)]
        lays = [dispatch_layout(idx, column_rank, column_local, R, Lc, n, valid=valid, dest_quota=q)
                for idx, valid, _, _ in inputs]
        capacity = cap_in if cap_in is not None else R * n
        ref_in, ref_ms, ref_rw, ref_rr, _ = ops.exchange_dispatch_reference(
            [x[2] for x in inputs], [l.route_of_slot for l in lays], [l.send_counts for l in lays],
            [x[3] for x in inputs], K, capacity)
        # the existing path on this rank: the permute copy into send slots, then HostSizedExchange
        idx, valid, rows, w = inputs[rank]
        lay = lays[rank]
        ros = lay.route_of_slot
        live = ros < n
        tok = torch.where(live, ros, 0) // K
        send = torch.where(live.view(-1, 1), rows[tok], torch.zeros((), dtype=rows.dtype))
        wsend = torch.where(live, w[torch.where(live, ros, 0)], 0.0)
        plan = ex.plan(lay.send_counts, capacity)
        expert_in = ex.to_experts(send, plan)
        row_w = ex.to_experts(wsend.view(-1, 1), plan).view(-1)
        res = {"case": name, "rank": rank, "sent": int(live.sum()), "received": int(plan.m_splits.sum())}
        res["expert_in"] = bool(torch.equal(_bits(expert_in), _bits(ref_in[rank])))
        res["m_splits"] = bool(torch.equal(plan.m_splits, ref_ms[rank]))
        res["row_weights"] = bool(torch.equal(_bits(row_w), _bits(ref_rw[rank])))
        # combine and gather_routes: every rank's expert output, the routes' rows back and reduced
        outs = [torch.randn(capacity, hidden, generator=torch.Generator().manual_seed(77 + s)).to(odtype)
                for s in range(R)]
        back = ex.to_sources(outs[rank], plan, ros.shape[0])  # [N, hidden], zeros where a row was cut
        y = ops.reduce_rows(back, lay.route_slot.view(T, K), w.view(T, K))
        ref_y = ops.exchange_combine_reference(outs, list(ref_rr), [x[3] for x in inputs], K)
        res["combine"] = bool(torch.equal(_bits(y), _bits(ref_y[rank])))
        back_z = torch.cat([back, back.new_zeros(1, hidden)])
        gathered = back_z[lay.route_slot.clamp(max=back.shape[0])]
        ref_g = ops.exchange_gather_reference(outs, list(ref_rr))
        res["gather_routes"] = bool(torch.equal(_bits(gathered), _bits(ref_g[rank])))
        # route_row: where each sent route landed (dest * capacity + row), read back from the reference's expert_in
        rr = ref_rr[rank]
        res["route_row_rows"] = bool(all(
            torch.equal(ref_in[int(v) // capacity][int(v) % capacity], rows[r // K])
            for r, v in enumerate(rr.tolist()) if v >= 0))
        res["route_row_sent"] = int((rr >= 0).sum())
        # align 16: the reference against the host-sized exchange with its alignment composed into the placement
        # (HostSizedExchange.align, aligned_groups), and the fused gloo model (HostSizedFusedExchange) against both
        a_in, a_ms, a_rw, a_rr, a_cnt = ops.exchange_dispatch_reference(
            [x[2] for x in inputs], [l.route_of_slot for l in lays], [l.send_counts for l in lays],
            [x[3] for x in inputs], K, capacity, 16)
        plan = ex.plan(lay.send_counts, capacity)
        padded = ex.align(plan, 16)
        res["aligned_expert_in"] = bool(torch.equal(_bits(ex.to_experts(send, plan)), _bits(a_in[rank])))
        res["aligned_row_weights"] = bool(torch.equal(_bits(ex.to_experts(wsend.view(-1, 1), plan).view(-1)),
                                                      _bits(a_rw[rank])))
        res["aligned_m_splits"] = bool(torch.equal(padded, a_ms[rank]) and torch.equal(plan.m_splits, a_cnt[rank]))
        fx = HostSizedFusedExchange().dispatch(rows, ros, lay.send_counts, K, capacity, w, align=16)
        res["fused_gloo_aligned"] = bool(
            torch.equal(_bits(fx.expert_in), _bits(a_in[rank])) and torch.equal(fx.m_splits, a_ms[rank])
            and torch.equal(fx.counts, a_cnt[rank]) and torch.equal(_bits(fx.row_weights), _bits(a_rw[rank]))
            and torch.equal(fx.route_row, a_rr[rank]))
        out.append(res)
    return out
