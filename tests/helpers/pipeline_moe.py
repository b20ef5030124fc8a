"""Integration of the training machinery: the demo's MoE language model
(:class:`moe_graph.demo.model.MoETransformerLM`) cut into pipeline stages, trained with the 1F1B schedule, expert
parallelism with echo, DDP buffers and the ZeRO-1 optimizer with global grad-norm clipping.

:func:`pipeline_moe_worker` runs the same training on any ``pp`` (world = ``pp * dp``, EP = DP = ``dp`` ranks per
stage, expert DP = 1). Parameters are initialized from their whole-model names
(:func:`moe_graph.train.checkpoint.global_name`), so every layout starts from the same model, and data-parallel rank
``d`` trains on the same microbatches in every layout: ``pp = 1`` and ``pp = 2`` must give the same losses, grad
norms and parameters (compared under the names of :func:`moe_graph.train.checkpoint.global_tensors`).
"""

from __future__ import annotations

import types
import zlib
from typing import Dict

import torch
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.demo.model import MoETransformerLM
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.moe.router import update_expert_bias
from moe_graph.train import schedules
from moe_graph.train.checkpoint import global_name, global_tensors, is_expert

CFG = types.SimpleNamespace(hidden=16, heads=2, ffn=24, experts=4, topk=2, seq=8, layers=2)
VOCAB, BATCH, MICROBATCHES, STEPS = 11, 2, 2, 3
DT = torch.float32  # the optimizer keeps fp32 main params


def init_from_global_names(stage: nn.Module, ep_rank: int) -> None:
    """Every parameter from a generator seeded by its global name (experts: the global ``[E, ...]`` tensor, then
    this EP rank's slice), so that any pipeline/expert layout holds the same model."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            g = global_name(stage, name)
            if ".ln" in name or name.startswith("ln."):
                continue  # LayerNorm keeps its deterministic ones / zeros
            gen = torch.Generator().manual_seed(zlib.crc32(g.encode()))
            if is_expert(p):
                L = p.shape[0]
                full = torch.randn((CFG.experts,) + tuple(p.shape[1:]), generator=gen, dtype=DT) * 0.2
                p.copy_(full[ep_rank * L:(ep_rank + 1) * L])
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=DT) * (0.5 if "router" in name else 0.2))


def microbatches(step: int, dp_rank: int):
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    out = []
    for _ in range(MICROBATCHES):
        t = torch.randint(0, VOCAB, (BATCH, CFG.seq + 1), generator=gen)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def pipeline_moe_worker(rank: int, world: int, pp: int, clip: float, layers: int = 2, vpp=None,
                        expert_bias: bool = False) -> Dict:
    """``STEPS`` training steps of a ``layers``-layer model on ``pp`` stages (``vpp`` model chunks per stage:
    the interleaved schedule, one DDP wrapper per chunk, one optimizer over all of them). ``expert_bias``: sigmoid
    routers with auxiliary-loss-free balancing, ``update_expert_bias`` after every step (default group)."""
    dp = world // pp
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=dp,
                                 virtual_pipeline_model_parallel_size=vpp)
    try:
        pp_rank, dp_rank, ep_rank = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                                     ps.get_expert_model_parallel_rank())
        assert ps.get_expert_data_parallel_world_size() == 1 and ep_rank == dp_rank
        chunk_ids = schedules.chunk_layer_ids(layers, pp, pp_rank, vpp)
        nc = len(chunk_ids)
        moe_kwargs = dict(ep_group=ps.get_expert_model_parallel_group(), ep_size=dp, num_spare_experts_per_ep_rank=1,
                          capacity_factor=1.25, aux_loss_coeff=0.01)
        if expert_bias:
            moe_kwargs.update(score_func="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.05)
        stages, ddps = [], []
        for c, ids in enumerate(chunk_ids):
            stage = MoETransformerLM(CFG, VOCAB, moe_kwargs, "cpu", DT, layer_ids=ids, first=pp_rank == 0 and c == 0,
                                     last=pp_rank == pp - 1 and c == nc - 1)
            init_from_global_names(stage, ep_rank)
            stages.append(stage)
            ddps.append(DistributedDataParallel(stage, use_distributed_optimizer=True,
                                                data_parallel_group=ps.get_data_parallel_group(),
                                                expert_data_parallel_group=ps.get_expert_data_parallel_group()))
        # the norm groups (TP x PP, ETP x EP x PP) default from parallel_state
        opt = DistributedOptimizer(ddps, lr=1e-2, weight_decay=0.0, clip_grad=clip, impl="tensor")
        pick = (lambda xs: xs) if vpp else (lambda xs: xs[0])
        cfg = schedules.PipelineConfig(tensor_shape=(BATCH, CFG.seq, CFG.hidden), dtype=DT,
                               no_sync_func=pick([d.no_sync for d in ddps]))
        fb = schedules.get_forward_backward_func(pp, vpp)

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            return model(tokens, labels), (lambda loss: loss)

        losses, norms = [], []
        for step in range(STEPS):
            opt.zero_grad()
            mbs = microbatches(step, dp_rank)
            out = fb(forward_step_func=forward_step, data_iterator=pick([iter(mbs) for _ in range(nc)]),
                     model=pick(ddps), num_microbatches=MICROBATCHES, config=cfg)
            ok, norm = opt.step()
            assert bool(ok)
            update_expert_bias(nn.ModuleList(stages))  # no-op without expert bias
            losses.append([float(x) for x in out])
            norms.append(float(norm))
        params = {k: v.clone() for stage in stages for k, v in global_tensors(stage, ep_rank).items()}
        drops = sum(b.moe.dispatcher.check_drops() for stage in stages for b in stage.blocks)
        return {"pp_rank": pp_rank, "dp_rank": dp_rank, "losses": losses, "norms": norms, "params": params,
                "drops": drops}
    finally:
        ps.destroy_model_parallel()
