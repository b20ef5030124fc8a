"""Multi-process worker for the MoE option tests (run on gloo by ``run_distributed``): an EP layer with echo and
the routing / expert options compared with :func:`moe_graph.testing.moe_reference.reference_moe_layer` on the
tokens of all ranks."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from moe_graph.moe.layer import MoELayer
from moe_graph.testing.moe_reference import reference_moe_layer

OPTIONS = dict(activation="clamped_swiglu", swiglu_limit=2.0, add_bias_linear=True, router_bias=True,
               score_func="sigmoid", norm_topk_prob=False, num_groups=4, group_topk=2, group_score_topk=2,
               num_spare_experts_per_ep_rank=1, shared_expert_ffn_size=4)


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def option_layer_ep_worker(rank: int, world: int, seed: int) -> Dict:
    """Max abs errors per case (``plain``, ``fused``: expert ``main_grad``) of this rank's output, input gradient
    and every parameter gradient (home experts: their slice of the global gradient; router and shared expert: this
    rank's tokens only, as without a data-parallel reduction), and the rows the spare slots ran."""
    R, H, Fh, E, K, T = world, 8, 6, 4 * world, 4, 24
    dt = torch.float64
    L = E // R
    g = torch.Generator().manual_seed(seed)
    glob = {}
    probe = MoELayer(H, Fh, E, K, ep_size=R, device="cpu", params_dtype=dt, **OPTIONS)
    for n, p in probe.named_parameters():
        shape = (E,) + tuple(p.shape[1:]) if n.startswith("experts.") else tuple(p.shape)
        glob[n] = torch.randn(shape, generator=g, dtype=dt) * 0.5
    glob["router.bias"][:L] += 2.0  # rank 0's experts are hot: echo has work to do
    gx = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=gx, dtype=dt) + 0.5
    target = torch.randn(T, H, generator=gx, dtype=dt)
    xs, ts = _gather(x), _gather(target)
    errors, spare_rows = {}, 0
    for case in ("plain", "fused"):
        layer = MoELayer(H, Fh, E, K, ep_size=R, device="cpu", params_dtype=dt, **OPTIONS)
        with torch.no_grad():
            for n, p in layer.named_parameters():
                p.copy_(glob[n][rank * L:(rank + 1) * L] if n.startswith("experts.") else glob[n])
        if case == "fused":
            for w in layer.experts.weights():
                w.main_grad = torch.zeros_like(w)
        xl = x.clone().requires_grad_()
        y = layer(xl)
        (y * target).sum().backward()
        spare_rows += int(layer.last_m_splits[L:].sum())

        leaves = {n: t.clone().requires_grad_() for n, t in glob.items()}
        y_ref = x_ref = None
        total = 0
        for r in range(R):  # dense parameters get gradients from this rank's tokens only
            params = {n: (leaves[n] if (r == rank or n.startswith("experts.")) else t) for n, t in glob.items()}
            xr = xs[r].clone().requires_grad_()
            yr = reference_moe_layer(xr, params, layer.config)
            total = total + (yr * ts[r]).sum()
            if r == rank:
                y_ref, x_ref = yr, xr
        total.backward()
        errs = {"y": float((y.detach() - y_ref.detach()).abs().max()), "x": float((xl.grad - x_ref.grad).abs().max())}
        for n, p in layer.named_parameters():
            ref = leaves[n].grad[rank * L:(rank + 1) * L] if n.startswith("experts.") else leaves[n].grad
            got = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            errs[n] = float((got - ref).abs().max())
        errors[case] = errs
    return {"errors": errors, "spare_rows": spare_rows}
