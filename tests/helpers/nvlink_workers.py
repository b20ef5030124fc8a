"""Multi-process workers for the fused ("nvlink") exchange's semantics on gloo (:mod:`moe_graph.moe.exchange`'s
:class:`~moe_graph.moe.exchange.HostSizedFusedExchange`): the same dispatch / experts / combine through
``exchange="nvlink"`` (flat and node-aware), ``"symm_mem"`` (the host-sized per-destination exchange) and
``"nccl"`` (per pair), outputs and every gradient returned for comparison in the parent."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from moe_graph.moe.echo import AllToAllBackend
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns


def _experts(expert_in: torch.Tensor, m_splits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A differentiable stand-in for the grouped GEMM: row ``i`` of local expert ``l`` times ``w[l]`` (``[H, H]``),
    padding rows zero (reads ``m_splits`` on the host: test code)."""
    Lc = w.shape[0]
    per_row = torch.repeat_interleave(torch.arange(Lc), m_splits.cpu())
    n = per_row.shape[0]
    live = torch.einsum("nh,nhg->ng", expert_in[:n], w.index_select(0, per_row))
    return torch.cat([live, expert_in.new_zeros(expert_in.shape[0] - n, w.shape[2])])


def _routing(case: str, rank: int, T: int, K: int, C: int, seed: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    w = torch.ones(C, dtype=torch.float64)
    if case == "zero_token_experts":  # every third column never receives a route
        w[1::3] = 0.0
    elif case == "skewed":  # the columns of rank 0 are hot: its destination overflows small buffers
        w[:2] = 6.0
    idx = torch.multinomial(w.expand(T, C), K, replacement=False, generator=g)
    valid = torch.rand(T, K, generator=g) > 0.15
    if case == "one_expert":  # every live route goes to the last column (the last rank's last expert)
        idx[:, 0] = C - 1
        valid[:, 0] = True
        valid[:, 1:] = False
    probs = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    return idx, probs, valid


def dispatcher_exchange_worker(rank: int, world: int, seed: int, cases: List, spare: int = 0, topk: int = 3) -> Dict:
    """For each ``(case, capacity, dtype, rows_mode, exchanges)``: the dispatcher over ``world`` ranks with every
    exchange in ``exchanges`` (``"nvlink"``, ``"nvlink:G"`` = ``ranks_per_node=G``, ``"symm_mem"``, ``"nccl"``) on
    the same tokens, routing and expert weights; returns the expert input, ``m_splits``, output and the gradients
    of the tokens, the probabilities and the expert weights, per exchange. ``spare``: echo spare slots per rank
    (extra routing columns)."""
    R, T, K, H = world, 10, topk, 6
    E = 2 * R
    Lc = E // R + spare
    cr, cl = expert_columns(E, R, spare)
    C = cr.shape[0]
    out: Dict = {}
    for case, cap, dtype_name, rows_mode, exchanges in cases:
        dtype = getattr(torch, dtype_name)
        idx, probs, valid = _routing(case, rank, T, K, C, seed)
        gx = torch.Generator().manual_seed(seed)
        x_all = torch.randn(R, T, H, generator=gx, dtype=torch.float64).to(dtype)
        w_all = (torch.randn(C, H, H, generator=gx, dtype=torch.float64) / 2).to(dtype)
        x = x_all[rank]
        mine = (cr == rank).nonzero().view(-1)  # this rank's columns in local order
        w_local = w_all.index_select(0, mine[torch.argsort(cl[mine])])
        target = torch.randn(T, H, generator=gx, dtype=torch.float64).to(dtype)
        res = {}
        for ex in exchanges:
            name, _, g = ex.partition(":")
            d = TokenDispatcher(Lc, R, rank, cr, cl, capacity=cap, backend=AllToAllBackend(), exchange=name,
                                ranks_per_node=int(g) if g else None)
            xd = x.clone().requires_grad_()
            pd = probs.clone().requires_grad_()
            wd = w_local.clone().requires_grad_()
            ein, ms, hd = d.dispatch(xd, idx, pd, valid)
            if rows_mode:  # the experts scale their rows, the combine sums plainly
                ye = _experts(ein * d.row_weights(hd)[:, None].to(dtype), ms, wd)
                y = d.combine(ye, hd, weighted=False)
            else:
                y = d.combine(_experts(ein, ms, wd), hd)
            (y.double() * target.double()).sum().backward()
            res[ex] = {"ein": ein.detach().double(), "ms": ms.clone(), "y": y.detach().double(),
                       "gx": xd.grad.double(), "gp": pd.grad.double(), "gw": wd.grad.double(),
                       "dropped": int(d.check_drops()), "fused": d.fused}
        out[(case, cap, dtype_name, rows_mode)] = res
    return out


def layer_exchange_worker(rank: int, world: int, seed: int, exchanges: List[str], spare: int,
                          capacity_factor: Optional[float], fp8_kind: Optional[str] = None,
                          fp8_dispatch: Optional[bool] = None) -> Dict:
    """An EP MoE layer (echo with ``spare`` slots, a capacity factor) built identically with each exchange: output
    and every parameter's and the input's gradient per exchange, and whether the experts got their rows aligned.
    ``fp8_kind``: FP8 experts under that recipe, with FP8 dispatch unless ``fp8_dispatch`` is False."""
    import moe_graph

    R, H, Fh, E, K, T = world, 32, 16, 4 * world, 2, 24
    res = {}
    for ex in exchanges:
        name, _, g = ex.partition(":")
        torch.manual_seed(seed)  # same init on every rank and for every exchange
        dt = torch.bfloat16 if fp8_kind else torch.float64
        layer = MoELayer(H, Fh, E, K, activation="swiglu", num_spare_experts_per_ep_rank=spare, ep_size=R,
                         capacity_factor=capacity_factor, device="cpu", params_dtype=dt, exchange=name,
                         ranks_per_node=int(g) if g else None,
                         fp8_dispatch=fp8_kind is not None if fp8_dispatch is None else fp8_dispatch)
        seen = []
        layer.experts.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw.get("aligned")),
                                                with_kwargs=True)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        with torch.no_grad():
            layer.router.weight[0] += 2.0  # expert 0 is hot: echo and the capacity have work to do
        x = (torch.randn(T, H, generator=gen, dtype=torch.float64) + 0.3).to(dt).requires_grad_()
        target = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dt)
        if fp8_kind:
            with moe_graph.fp8.autocast(recipe=fp8_kind):
                y = layer(x)
        else:
            y = layer(x)
        (y.double() * target.double()).sum().backward()
        res[ex] = {"y": y.detach().double(), "gx": x.grad.double(), "aligned": bool(seen and seen[0]),
                   "grads": {n: p.grad.double().clone() for n, p in layer.named_parameters() if p.grad is not None}}
    return res


def node_traffic_worker(rank: int, world: int, ranks_per_node: int, seed: int) -> Dict:
    """One dispatch + combine (no backward) through the flat and the node-aware fused exchange: the rows each
    stage sent, the routing (to count the (token, node) pairs in the parent) and the results."""
    R, T, K, H = world, 16, 4, 8
    E = 2 * R
    cr, cl = expert_columns(E, R)
    idx, probs, valid = _routing("random", rank, T, K, E, seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    out = {"idx": idx, "valid": valid}
    for g in (None, ranks_per_node):
        d = TokenDispatcher(E // R, R, rank, cr, cl, capacity=None, exchange="nvlink", ranks_per_node=g)
        ein, ms, hd = d.dispatch(x, idx, probs.float(), valid)
        y = d.combine(ein * 1.5, hd)
        sent = d.exchange_backend.sent_rows
        out[g] = {"ein": ein, "y": y, "dispatch_rows": list(sent["dispatch"]), "combine_rows": list(sent["combine"])}
    return out
