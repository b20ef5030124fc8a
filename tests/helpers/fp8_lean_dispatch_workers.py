"""The fused FP8 dispatch against the previous FP8 dispatch path (``token_dispatcher.FUSED_FP8_DISPATCH``): one
forward and backward of a layer each way, on one rank or as a multi-process worker (gloo, ``run_distributed``)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

import moe_graph
import moe_graph.moe.token_dispatcher as td
from helpers.aligned_dispatch_workers import busy_expert_layer


def _run(layer, x: torch.Tensor, target: torch.Tensor, kind: str, fused: bool):
    """``(output, input gradient, {name: gradient}, calls of the fused receive op)`` with ``FUSED_FP8_DISPATCH``
    set to ``fused`` (restored after)."""
    before, op = td.FUSED_FP8_DISPATCH, td.expand_quantize_packed
    calls = []
    td.FUSED_FP8_DISPATCH = fused
    td.expand_quantize_packed = lambda *a, **k: calls.append(1) or op(*a, **k)
    try:
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(recipe=kind):
            y = layer(xx)
        (y.float() * target.float()).sum().backward()
    finally:
        td.FUSED_FP8_DISPATCH, td.expand_quantize_packed = before, op
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return y.detach(), xx.grad, grads, len(calls)


def run_both(layer, x: torch.Tensor, target: torch.Tensor, kind: str) -> Dict:
    y0, dx0, g0, c0 = _run(layer, x, target, kind, False)
    y1, dx1, g1, c1 = _run(layer, x, target, kind, True)
    return {"out_equal": torch.equal(y0, y1), "dx_equal": torch.equal(dx0, dx1),
            "unequal_grads": sorted(n for n in set(g0) | set(g1) if n not in g0 or n not in g1
                                    or not torch.equal(g0[n], g1[n])),
            "grads": sorted(g0), "fused_used": c1 > 0, "previous_used_fused": c0 > 0,
            "nonzero_dx": bool(dx1.abs().sum() > 0)}


def lean_dispatch_worker(rank: int, world: int, kind: str, capacity_factor: Optional[float],
                         exchange: str = "nccl") -> Dict:
    layer, x, target = busy_expert_layer(rank, world, capacity_factor, exchange=exchange, fp8_dispatch=True)
    res = run_both(layer, x, target, kind)
    res["dropped"] = layer.dispatcher.check_drops()
    return res
