"""Workers for ``tests/test_fp8_param_gather.py`` (``DistributedOptimizer(fp8_param_gather=...)``), run through
:func:`moe_graph.distributed.launch.run_distributed` (file-store rendezvous, gloo)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from helpers.optimizer_checks import pack
from moe_graph import GroupedLinear
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.moe.layer import MoELayer
from moe_graph.ops import fp8 as _fp8
from moe_graph.train.step import train_step


class GroupedModel(torch.nn.Module):
    """A dense layer then two ``[E, N, K]`` grouped linears (the FP8 weights) with biases, fixed expert splits;
    ``out`` = 96 makes fc2 smaller than fc1, so that the DP shard boundary of the expert bucket falls inside
    fc1's first 128-row tile block (mid-row)."""

    def __init__(self, experts: int, hidden: int, ffn: int, dtype, out: int = 96):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden, dtype=dtype)
        self.fc1 = GroupedLinear(experts, hidden, ffn, bias=True, params_dtype=dtype, single_grouped_weight=True,
                                 device="cpu")
        self.fc2 = GroupedLinear(experts, ffn, out, bias=True, params_dtype=dtype, single_grouped_weight=True,
                                 device="cpu")

        for p in list(self.fc1.parameters()) + list(self.fc2.parameters()):
            p.allreduce = False  # expert parameters (their own buffer), as MoELayer's

    def forward(self, x, splits):
        h = self.inp(x)
        return (self.fc2(torch.nn.functional.gelu(self.fc1(h, splits)), splits).float().square().mean())


class MoEModel(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype):
        super().__init__()
        self.moe = MoELayer(hidden, ffn, num_experts=4, topk=2, ep_size=1, params_dtype=dtype, device="cpu")
        self.head = torch.nn.Linear(hidden, 5, dtype=dtype)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(x + self.moe(x)).float(), y)


def _tile_cut(opt, param) -> bool:
    """Whether a DP shard boundary falls inside one of ``param``'s 128-row tile blocks (a cut scale tile)."""
    for g in opt._fp8_gathers.values():
        if any(param is q for q in g.fp8_params):
            a, b = g.bucket.param_to_index[param]
            K = param.shape[2]
            for r in range(1, g.dp):
                cut = r * g.n
                if a < cut < b and (cut - a) % (128 * K) != 0:
                    return True
    return False


def quantized_weights_worker(rank: int, ws: int, recipe: str, dtype, steps: int) -> bytes:
    """Steps with random gradients under ``fp8_param_gather``; after each: the cached FP8 copies (before any 16-bit
    gather) and, after :meth:`gather_16bit_params`, the gathered 16-bit weights; also the 16-bit values of the
    other parameters right after the step (gathered in the FP8 gather's 16-bit part)."""
    torch.manual_seed(0)
    model = GroupedModel(3, 160, 200, dtype)  # partial 128x128 tiles on both dims
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, fp8_param_gather=recipe)
    out = {"cut": {n: _tile_cut(opt, p) for n, p in model.named_parameters() if p.dim() == 3},
           "bytes": opt.param_gather_bytes(),
           "fp8_bucket_bytes": [g.wire_bytes() for g in opt._fp8_gathers.values()], "steps": []}
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 3)
        opt.step()
        rec = {"cache": {n: tuple(t.clone() for t in p.fp8_gathered.copies(p.fp8_gathered.recipe))
                         for n, p in model.named_parameters() if p.dim() == 3},
               "other": {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() != 3}}
        opt.gather_16bit_params()
        rec["weights"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 3}
        rec["cache_after_16bit_gather"] = {n: tuple(t.clone() for t in p.fp8_gathered.copies(p.fp8_gathered.recipe))
                                           for n, p in model.named_parameters() if p.dim() == 3}
        out["steps"].append(rec)
    return pack(out)


def train_worker(rank: int, ws: int, kind: str, recipe: str, gather: bool, steps: int) -> bytes:
    """``steps`` training steps (DP 2, two microbatches) with or without ``fp8_param_gather``: per-step loss and
    grad norm, then the parameters after a 16-bit gather."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    if kind == "grouped":
        model = GroupedModel(2, 128, 256, dtype)
    else:
        model = MoEModel(128, 256, dtype)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, overlap_grad_reduce=True)
    opt = DistributedOptimizer(ddp, lr=3e-3, fp8_param_gather=recipe if gather else None)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(steps):
        if kind == "grouped":
            mbs = [(torch.randn(96, 128, generator=gen).to(dtype), torch.tensor([40, 56])) for _ in range(2)]
        else:
            mbs = [(torch.randn(24, 128, generator=gen).to(dtype), torch.randint(0, 5, (24,), generator=gen))
                   for _ in range(2)]
        res = train_step(ddp, opt, mbs, fp8_recipe=recipe)
        losses.append(res.loss.detach().clone())
        norms.append(res.grad_norm.detach().clone())
    stale = False
    if gather:  # the FP8 weights' 16-bit copies were not gathered (so the GEMMs must have read the FP8 ones)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 3}
        opt.gather_16bit_params()
        stale = any(not torch.equal(t, dict(model.named_parameters())[n]) for n, t in before.items())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return pack({"losses": losses, "norms": norms, "params": params, "stale_16bit": stale,
                 "main": [s.main_param.clone() for s in opt.shards]})
