"""Workers of tests/test_hf_checkpoint.py: transformers models swapped onto MoELayer, trained with moe_graph's DDP,
ZeRO-1 and expert parallelism (EP 2 on gloo), saved as Hugging Face checkpoints and loaded back EP-sliced."""

from __future__ import annotations

import os
from typing import Dict, Sequence

import torch
from torch import nn

from helpers import Injected
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


def broken_folders(root: str) -> Dict[str, str]:
    """Broken copies of a tiny Mixtral's ``save_pretrained`` folder (one process, no process group), each read by
    :func:`load_failure_worker` on EP 2: ``"truncated"``, a v4 folder split over two safetensors files (an index),
    the second (experts 4..7: EP rank 1's only) cut to 7 bytes (an invalid header length); ``"short_row"``, v4 with
    expert 5's ``w1`` one row short (EP rank 1's); ``"good"``, the v5 folder intact (the injected failure)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    _, model = tiny_model("mixtral")
    swap_moe_blocks(model)
    out = {}
    good = os.path.join(root, "good")
    save_hf_pretrained(model, good, layout="v5")
    out["good"] = good
    v4 = os.path.join(root, "v4")
    save_hf_pretrained(model, v4, layout="v4")
    sd = load_file(os.path.join(v4, "model.safetensors"))
    short = os.path.join(root, "short_row")
    shutil.copytree(v4, short)
    name = "model.layers.0.block_sparse_moe.experts.5.w1.weight"
    save_file(dict(sd, **{name: sd[name][:-1].clone()}), os.path.join(short, "model.safetensors"),
              metadata={"format": "pt"})
    trunc = os.path.join(root, "truncated")
    shutil.copytree(v4, trunc)
    os.remove(os.path.join(trunc, "model.safetensors"))
    second = {k for k in sd if any(f".experts.{e}." in k for e in range(4, 8))}
    save_file({k: v for k, v in sd.items() if k not in second}, os.path.join(trunc, "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(trunc, "model-00002-of-00002.safetensors"), "wb") as f:
        f.write(b"\x01\x02\x03\x04\x05\x06\x07")
    with open(os.path.join(trunc, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: f"model-0000{2 if k in second else 1}-of-00002.safetensors"
                                                  for k in sd}}, f)
    out["truncated"], out["short_row"] = trunc, short
    return out


def load_failure_worker(rank: int, world: int, folders: Dict[str, str]) -> Dict:
    """EP 2: a swapped tiny Mixtral (other weights) loads each broken folder of :func:`broken_folders` and the good
    one with :class:`Injected` raised on rank 1 inside the block conversion. Per case ``(exception type, message,
    seconds in load_hf_checkpoint, model unchanged)``; then the good folder loads (``"clean"``: True); finally
    ``"save"``: ``save_hf_pretrained`` with the writer raising :class:`Injected` on rank 0 (``(type, message,
    seconds)``)."""
    import time

    from moe_graph.integrations import hf_checkpoint

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        _, model = tiny_model("mixtral", seed=3)
        swap_moe_blocks(model, ep_group=ps.get_expert_model_parallel_group())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = {}
        real = hf_checkpoint.hf_to_moe_state_dict
        for case in ("truncated", "short_row", "injected"):
            folder = folders["good" if case == "injected" else case]

            def convert(*a, **k):
                if case == "injected" and rank == 1:
                    raise Injected("injected on rank 1")
                return real(*a, **k)

            hf_checkpoint.hf_to_moe_state_dict = convert
            t0 = time.perf_counter()
            try:
                load_hf_checkpoint(model, folder)
                out[case] = ("none", "", time.perf_counter() - t0, True)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                same = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
                out[case] = (type(exc).__name__, str(exc), time.perf_counter() - t0, same)
            finally:
                hf_checkpoint.hf_to_moe_state_dict = real
        load_hf_checkpoint(model, folders["good"])
        out["clean"] = not all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        # save_hf_pretrained: rank 0 writes, rank 1 waits for it; the writer fails on rank 0
        real_save = hf_checkpoint.save_file

        def failing(*a, **k):
            raise Injected("injected in save_file")

        hf_checkpoint.save_file = failing
        t0 = time.perf_counter()
        try:
            save_hf_pretrained(model, os.path.join(os.path.dirname(folders["good"]), "saved"), layout="v5")
            out["save"] = ("none", "", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["save"] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
        finally:
            hf_checkpoint.save_file = real_save
        return out
    finally:
        ps.destroy_model_parallel()
