"""Worker of tests/test_fp8_quantize.py's training check: FP8 training (``GroupedLinear`` under
``moe_graph.fp8.autocast``, data parallel on 2 gloo ranks, ``DistributedOptimizer``) with an inf injected into one
rank's input at one step: the step must be skipped on every rank and the parameters stay finite.

The inf sits in a row whose output the loss does not use (its output gradient is exactly 0), so under MXFP8 the
gradients stay finite (the inf's 1 x 32 / 32 x 1 blocks quantize to +-448 x 2^127 and the rest of those blocks to
0, and the zero gradient row multiplies them by 0): only the quantizer's non-finite flag can skip that step.
Before another step an evaluation pass on an inf input sets the flag outside training: that step's ``zero_grad``
clears it and the step is applied."""

from __future__ import annotations

from typing import Dict

import torch

from moe_graph import GroupedLinear
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.ops import fp8

INF_STEP = 1
EVAL_INF_STEP = 2


def fp8_inf_step_worker(rank: int, world: int, kind: str) -> Dict:
    torch.manual_seed(0)  # the same parameters on every rank
    model = GroupedLinear(2, 64, 32, bias=False, device="cpu")
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2)
    m_splits = torch.tensor([16, 16])
    res: Dict[str, list] = {"ok": [], "changed": [], "params_finite": [], "grads_finite": [], "flag_after": []}
    for it in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * it + rank))
        if it == INF_STEP and rank == 0:
            x[0, 5] = float("inf")
        if it == EVAL_INF_STEP:  # an evaluation pass on non-finite input before this step sets the flag ...
            with torch.no_grad(), fp8.autocast(recipe=kind):
                ddp(torch.full((32, 64), float("inf")), m_splits)
            assert int(fp8.nonfinite_flag("cpu")[0]) == 1
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        opt.zero_grad()  # ... which the step's zero_grad clears: the step counts its own passes only
        with fp8.autocast(recipe=kind):
            y = ddp(x, m_splits)
        (y[1:].float() ** 2).sum().backward()  # row 0 (the inf's row) gets a zero output gradient
        res["grads_finite"].append(all(bool(torch.isfinite(p.main_grad).all()) for p in model.parameters()))
        ok, _ = opt.step()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        res["ok"].append(bool(ok))
        res["changed"].append(not torch.equal(before, after))
        res["params_finite"].append(bool(torch.isfinite(after).all()))
        res["flag_after"].append(int(fp8.nonfinite_flag("cpu")[0]))
    return res
