"""Multi-process workers for the aligned-dispatch tests (gloo, ``run_distributed``): on each EP rank, one FP8 MoE
layer run with the dispatcher placing the rows at their 16-row-aligned expert rows (``experts.ALIGNED_DISPATCH``)
and with the experts regrouping them (the previous path, the oracle); the aligned handle's index maps against the
previous composition (``helpers.aligned_reference``)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

import moe_graph
import moe_graph.moe.experts as experts
from helpers.aligned_reference import aligned_receive
from moe_graph.moe.echo import AllToAllBackend
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns


def run_layer(layer: MoELayer, x: torch.Tensor, target: torch.Tensor, kind: str, aligned_dispatch: bool):
    """``(output, input gradient, {name: gradient})`` of one forward and backward of ``layer`` under the FP8
    ``kind`` recipe (``None``: no FP8), with ``experts.ALIGNED_DISPATCH`` set to ``aligned_dispatch`` (restored after), and whether the
    dispatcher aligned the rows itself."""
    before = experts.ALIGNED_DISPATCH
    experts.ALIGNED_DISPATCH = aligned_dispatch
    seen = []
    hook = layer.experts.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw.get("aligned")),
                                                   with_kwargs=True)
    try:
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(enabled=kind is not None, recipe=kind):
            y = layer(xx)
        (y * target).sum().backward()
    finally:
        experts.ALIGNED_DISPATCH = before
        hook.remove()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return y.detach(), xx.grad, grads, bool(seen and seen[0])


def busy_expert_layer(rank: int, world: int, capacity_factor: Optional[float], **layer_kwargs):
    """``(layer, x, target)``: an EP ``world`` FP8-sized layer (H 96, F 64, 4 experts per rank, top-2) whose expert 0
    is busy (drops under a capacity, work for echo), the same router on every rank, experts and data per rank."""
    torch.manual_seed(11)
    E, K, T, H = 4 * world, 2, 29, 96
    layer = MoELayer(H, 64, E, K, ep_size=world, capacity_factor=capacity_factor, device="cpu", **layer_kwargs)
    with torch.no_grad():
        layer.router.weight[0] += 0.3
        for p in layer.experts.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(100 + rank))
    g = torch.Generator().manual_seed(1000 + rank)
    return layer, torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def aligned_dispatch_worker(rank: int, world: int, kind: str, exchange: str, capacity_factor: Optional[float],
                            spare: int, fp8_dispatch: bool) -> Dict:
    layer, x, target = busy_expert_layer(rank, world, capacity_factor, exchange=exchange,
                                         num_spare_experts_per_ep_rank=spare, fp8_dispatch=fp8_dispatch)
    y0, dx0, g0, a0 = run_layer(layer, x, target, kind, False)
    y1, dx1, g1, a1 = run_layer(layer, x, target, kind, True)
    return {"out_equal": torch.equal(y0, y1), "dx_equal": torch.equal(dx0, dx1),
            "unequal_grads": sorted(n for n in g0 if not torch.equal(g0[n], g1[n])), "grads": sorted(g0),
            "aligned_before": a0, "aligned_after": a1, "dropped": layer.dispatcher.check_drops()}


def symm_mem_worker(rank: int, world: int, kind: Optional[str], cf: Optional[float], spare: int,
                    fp8_dispatch: bool) -> Dict:
    """The NVSHMEM per-destination exchange (``SymmMemExchange`` on ``helpers.symm_mem_fake``'s model of torch's
    ops) against the host-sized one with the experts regrouping (``HostSizedExchange``, the oracle), the same layer
    and data on both; the local expert 1 of every rank gets no token (``all_to_all_vdev_2d`` leaves a row for it).
    With FP8 (``kind``): the dispatcher aligning the rows and the experts regrouping them."""
    from helpers import symm_mem_fake

    def build():
        layer, x, target = busy_expert_layer(rank, world, cf, exchange="symm_mem", num_spare_experts_per_ep_rank=spare,
                                             fp8_dispatch=fp8_dispatch)
        x[:, 0] = 5.0  # with the router rows below: every token scores the local experts 1 at -25
        with torch.no_grad():
            for e in range(1, layer.router.weight.shape[0], 4):
                layer.router.weight[e] = 0.0
                layer.router.weight[e, 0] = -5.0
        return layer, x, target

    ref, x, target = build()
    sym, _, _ = build()
    calls = symm_mem_fake.install(sym)
    quantized = {"ref": 0, "sym": 0}  # receive sides that wrote the FP8 rows themselves (to_experts_read)
    for name, lay in (("ref", ref), ("sym", sym)):
        backend, inner = lay.dispatcher.exchange_backend, lay.dispatcher.exchange_backend.to_experts_read

        def counted(*args, _inner=inner, _name=name, **kw):
            quantized[_name] += 1
            return _inner(*args, **kw)
        backend.to_experts_read = counted
    seen = []  # the m_splits the experts got (the unaligned run's: the received rows per local expert)
    hook = sym.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    res = {"aligned": {}, "equal": {}}
    y0, dx0, g0, _ = run_layer(ref, x, target, kind, False)  # the oracle: host-sized, the experts regroup
    for aligned in ((False, True) if kind is not None else (False,)):
        _, _, _, a0 = run_layer(ref, x, target, kind, aligned) if aligned else (y0, dx0, g0, False)
        y1, dx1, g1, a1 = run_layer(sym, x, target, kind, aligned)
        res["aligned"][aligned] = (a0, a1)
        res["equal"][aligned] = (torch.equal(y0, y1), torch.equal(dx0, dx1), sorted(g0) == sorted(g1),
                                 [n for n in g0 if not torch.equal(g0[n], g1[n])])
    hook.remove()
    res["calls"] = sorted({c[0] for c in calls.calls})
    res["dropped"] = int(ref.dispatcher.check_drops())
    res["empty_local_expert"] = bool((seen[0] == 0).any())
    res["quantized"] = quantized
    return res


def aligned_handle_worker(rank: int, world: int) -> Dict:
    """The fixed-split exchange's aligned handle (``dispatch(align_rows=a)``) against the unaligned one with
    ``aligned_groups`` of its counts composed in: ``{case: [what differs]}`` (empty lists: equal)."""
    Lc, T, K, H = 3, 29, 2, 8
    E = Lc * world
    g = torch.Generator().manual_seed(50 + rank)
    w = torch.tensor([6.0 if e == 1 else 0.0 if e % Lc == 2 else 1.0 for e in range(E)])  # a busy, some idle experts
    idx = torch.multinomial(w.expand(T, E), K, replacement=False, generator=g)
    x, probs = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    cr, cl = expert_columns(E, world)
    out = {}
    for cap in (None, 5):  # dropless (capacity rows past the routed ones), routes dropped
        d = TokenDispatcher(Lc, world, rank, cr, cl, capacity=cap, backend=AllToAllBackend(), exchange="nccl")
        _, m0, h0 = d.dispatch(x, idx, probs)
        for align in (16, 3):
            _, m1, h1 = d.dispatch(x, idx, probs, align_rows=align)
            src, tgt, pm = aligned_receive(h0.expert_row_source, h0.recv_row_target, h0.m_splits, align)
            pairs = {"route_slot": (h1.route_slot, h0.route_slot), "route_of_slot": (h1.route_of_slot,
                                                                                     h0.route_of_slot),
                     "expert_row_source": (h1.expert_row_source, src), "recv_row_target": (h1.recv_row_target, tgt),
                     "aligned_m_splits": (h1.aligned_m_splits, pm), "m_splits": (h1.m_splits, m0), "splits": (m1, pm)}
            out[f"cap {cap} align {align}"] = [k for k, (a, b) in pairs.items() if not torch.equal(a, b)]
        out[f"cap {cap} dropped"] = int(h0.dropped)
    return out
