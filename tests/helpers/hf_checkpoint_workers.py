"""Workers of tests/test_hf_checkpoint.py: transformers models swapped onto MoELayer, trained with moe_graph's DDP,
ZeRO-1 and expert parallelism (EP 2 on gloo), saved as Hugging Face checkpoints and loaded back EP-sliced."""

from __future__ import annotations

import os
from typing import Dict, Sequence

import torch
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.integrations.hf import swap_moe_blocks
from moe_graph.integrations.hf_checkpoint import load_hf_checkpoint, save_hf_pretrained, swapped_from_pretrained
from moe_graph.testing.hf_models import model_loss, tiny_model
from moe_graph.train.step import train_step

STEPS = 3


class ModelLoss(nn.Module):
    """The step's loss of a tiny transformers model (:func:`model_loss`: the LM loss, or for a base model without
    an LM head ``mean(h * R)``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return model_loss(self.model, ids)[1]


def probe_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))


def train_save_load_worker(rank: int, world: int, families: Sequence[str], root: str) -> Dict:
    """Per family: the tiny model (same weights on every rank) swapped with EP 2, trained ``STEPS`` steps (each
    rank its own data; DDP + DistributedOptimizer), its logits on :func:`probe_ids`, saved in both layouts, and a
    swapped model loaded from each folder (v4: built with other weights, then :func:`load_hf_checkpoint`; v5:
    :func:`swapped_from_pretrained`, each rank's experts only): its logits."""
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        ep_group = ps.get_expert_model_parallel_group()
        out = {}
        for fam in families:
            _, model = tiny_model(fam)
            swap_moe_blocks(model, ep_group=ep_group)
            ddp = DistributedDataParallel(ModelLoss(model), use_distributed_optimizer=True,
                                          data_parallel_group=ps.get_data_parallel_group(),
                                          expert_data_parallel_group=ps.get_expert_data_parallel_group())
            opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.0, expert_model_parallel_group=ep_group)
            for step in range(STEPS):
                ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
                train_step(ddp, opt, [(ids,)])
            model.eval()
            with torch.no_grad():
                res = {"logits": model_loss(model, probe_ids())[0]}  # logits, or a base model's last hidden state
            for layout in ("v5", "v4"):
                folder = os.path.join(root, f"{fam}_{layout}")
                save_hf_pretrained(model, folder, layout=layout)
                if layout == "v4":  # a model of other weights, swapped, filled from the folder
                    _, fresh = tiny_model(fam, seed=3)
                    swap_moe_blocks(fresh, ep_group=ep_group)
                    try:
                        load_hf_checkpoint(fresh, folder)
                    except KeyError as e:  # a dense tensor transformers' v4 writer converted (not renamed)
                        res["reloaded_v4"] = str(e)
                        continue
                else:  # built from the folder without materializing every expert
                    fresh = swapped_from_pretrained(folder, ep_group=ep_group, model_class=type(model),
                                                    model_kwargs={"attn_implementation": "eager"})
                fresh.eval()
                with torch.no_grad():
                    res[f"reloaded_{layout}"] = model_loss(fresh, probe_ids())[0]
            out[fam] = res
        return out
    finally:
        ps.destroy_model_parallel()
