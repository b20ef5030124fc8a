"""The training step the CUDA-graph tests capture: ``inp`` -> ``h + moe(h)`` -> ``out`` -> cross entropy, each
microbatch's loss averaged into one backward per microbatch, one optimizer step; returns the stacked losses."""

import torch


def moe_block_step(model, opt, dropout: float = 0.0):
    """``step(microbatches)`` for a ``ModuleDict`` with ``inp``, ``moe`` and ``out`` (each microbatch a dict with
    ``x`` and the labels ``y``); ``dropout`` after ``inp`` (RNG inside the captured step)."""
    def step(mbs):
        opt.zero_grad(set_to_none=False)
        losses = []
        for mb in mbs:
            h = torch.nn.functional.dropout(model["inp"](mb["x"]), dropout)
            h = h + model["moe"](h)
            loss = torch.nn.functional.cross_entropy(model["out"](h).float(), mb["y"])
            (loss / len(mbs)).backward()
            losses.append(loss.detach())
        opt.step()
        return torch.stack(losses)

    return step
