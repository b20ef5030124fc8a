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
# issue 33's router / block options with echo at EP > 1: zero-computation experts (never dispatched) with
# soft-capped logits and the output RMSNorm; hash routing by token id with sqrtsoftplus scores
OPTION_SETS = {
    "clamped": OPTIONS,
    "zero_softcap_norm": dict(num_zero_experts=3, router_bias=True, norm_topk_prob=False, topk_scaling_factor=2.0,
                              logit_softcap=3.0, output_norm="rmsnorm", num_spare_experts_per_ep_rank=1),
    "hash_sqrtsoftplus": dict(score_func="sqrtsoftplus", hash_vocab_size=16, router_bias=True,
                              topk_scaling_factor=1.5, num_spare_experts_per_ep_rank=1),
    # Inkling: the last 2 experts (rank R-1's) are shared experts every token routes to: echo copies them
    "scored_shared": dict(score_func="sigmoid", num_scored_shared_experts=2, router_global_scale=True,
                          norm_topk_prob=True, topk_scaling_factor=2.0, router_bias=True,
                          num_spare_experts_per_ep_rank=1),
    # Muse-Spark: the logit multiplier, latent experts (width 10 > F = 6) with a norm of their input and of each
    # output row (the layer's weight: echo's spare slots use it too)
    "muse_norms": dict(score_func="sigmoid", router_bias=True, router_logit_multiplier=0.5, latent_size=10,
                       expert_input_norm="centered_rmsnorm", expert_output_norm="scaled_rmsnorm",
                       num_spare_experts_per_ep_rank=1),
}


# dense parameters used on the experts' side of the exchange: a rank's gradient comes from the rows its experts (and
# spare slots) ran, whoever's tokens they were; summed over the ranks (the data-parallel all-reduce) it is the
# gradient over all tokens
EXPERT_SIDE = ("expert_output_norm.weight",)


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def option_layer_ep_worker(rank: int, world: int, seed: int, option_sets=("clamped",)) -> Dict:
    """Max abs errors per case (``plain``, ``fused``: expert ``main_grad``; ``<set>-<case>`` for each of
    ``option_sets`` but the first) of this rank's output, input gradient and every parameter gradient (home experts:
    their slice of the global gradient; router and shared expert: this rank's tokens only, as without a
    data-parallel reduction), and the rows the spare slots ran."""
    errors, spare_rows = {}, 0
    for i, name in enumerate(option_sets):
        errs, rows = _option_set(rank, world, seed, OPTION_SETS[name])
        errors.update({(case if i == 0 else f"{name}-{case}"): e for case, e in errs.items()})
        spare_rows += rows
    return {"errors": errors, "spare_rows": spare_rows}


def _option_set(rank: int, world: int, seed: int, options: Dict):
    R, H, Fh, E, K, T = world, 8, 6, 4 * world, 4, 24
    dt = torch.float64
    L = E // R
    g = torch.Generator().manual_seed(seed)
    glob = {}
    probe = MoELayer(H, Fh, E, K, ep_size=R, device="cpu", params_dtype=dt, **options)
    for n, p in probe.named_parameters():
        shape = (E,) + tuple(p.shape[1:]) if n.startswith("experts.") else tuple(p.shape)
        glob[n] = torch.randn(shape, generator=g, dtype=dt) * 0.5
    glob["router.bias"][:L] += 2.0  # rank 0's experts are hot: echo has work to do
    V = options.get("hash_vocab_size")
    buffers = {}
    if V is not None:  # token id -> K distinct experts, rank 0's in front (hot)
        buffers["router.tid2eid"] = torch.stack([torch.cat([torch.randperm(L, generator=g)[:2],
                                                            L + torch.randperm(E - L, generator=g)[:K - 2]])
                                                 for _ in range(V)])
    gx = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=gx, dtype=dt) + 0.5
    target = torch.randn(T, H, generator=gx, dtype=dt)
    ids = torch.randint(0, V, (T,), generator=gx) if V is not None else None
    xs, ts = _gather(x), _gather(target)
    id_all = _gather(ids) if ids is not None else None
    errors, spare_rows = {}, 0
    for case in ("plain", "fused"):
        layer = MoELayer(H, Fh, E, K, ep_size=R, device="cpu", params_dtype=dt, **options)
        with torch.no_grad():
            for n, p in layer.named_parameters():
                p.copy_(glob[n][rank * L:(rank + 1) * L] if n.startswith("experts.") else glob[n])
            for n, b in buffers.items():
                layer.get_buffer(n).copy_(b)
        if case == "fused":
            for w in layer.experts.weights():
                w.main_grad = torch.zeros_like(w)
        xl = x.clone().requires_grad_()
        y = layer(xl, token_ids=ids)
        (y * target).sum().backward()
        spare_rows += int(layer.last_m_splits[L:].sum())

        leaves = {n: t.clone().requires_grad_() for n, t in glob.items()}
        y_ref = x_ref = None
        total = 0
        for r in range(R):  # dense parameters get gradients from this rank's tokens only
            params = {n: (leaves[n] if (r == rank or n.startswith("experts.") or n in EXPERT_SIDE) else t)
                      for n, t in glob.items()}
            params.update(buffers)
            xr = xs[r].clone().requires_grad_()
            yr = reference_moe_layer(xr, params, layer.config, token_ids=id_all[r] if id_all is not None else None)
            total = total + (yr * ts[r]).sum()
            if r == rank:
                y_ref, x_ref = yr, xr
        total.backward()
        errs = {"y": float((y.detach() - y_ref.detach()).abs().max()), "x": float((xl.grad - x_ref.grad).abs().max())}
        for n, p in layer.named_parameters():
            ref = leaves[n].grad[rank * L:(rank + 1) * L] if n.startswith("experts.") else leaves[n].grad
            got = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            if n in EXPERT_SIDE:
                got = got.clone()
                dist.all_reduce(got)
            errs[n] = float((got - ref).abs().max())
        errors[case] = errs
    return errors, spare_rows
