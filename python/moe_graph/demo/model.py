"""The demo's MoE transformer language model: token + position embeddings, pre-norm blocks of causal
self-attention and a :class:`moe_graph.moe.layer.MoELayer`, a final norm and the LM head; cut into pipeline stages
by ``layer_ids`` / ``first`` / ``last``."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_graph.moe.layer import MoELayer

__all__ = ["Block", "MoETransformerLM", "moe_options"]


def moe_options(cfg, ep_group=None, ep_size: Optional[int] = None) -> Dict:
    """The :class:`MoELayer` keyword arguments of the demo's flags (``--aux``, ``--spare``, ``--capacity``,
    ``--overflow``, ``--exchange``, ``--fp8-dispatch``, ``--assignment``, ``--router``)."""
    kw = dict(aux_loss_coeff=cfg.aux, num_spare_experts_per_ep_rank=cfg.spare, capacity_factor=cfg.capacity,
              overflow=cfg.overflow, exchange=cfg.exchange, assignment=cfg.assignment, ep_group=ep_group,
              ep_size=ep_size, fp8_dispatch=bool(getattr(cfg, "fp8_dispatch", False)))
    if cfg.router == "deepseek":  # sigmoid scores, group-limited top-k, aux-loss-free expert bias, and a tiny
        # sequence-wise aux loss (DeepSeek-V3's alpha = 1e-4)
        kw.update(score_func="sigmoid", num_groups=min(4, cfg.experts), group_topk=min(2, cfg.topk),
                  enable_expert_bias=True, expert_bias_update_rate=1e-3, aux_loss_coeff=1e-4,
                  aux_loss_type="sequence")
    return kw


class Block(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MoE layer, each with a residual connection."""

    def __init__(self, cfg, moe_kwargs, device, dtype):
        super().__init__()
        H = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(H, device=device, dtype=dtype)
        self.qkv = nn.Linear(H, 3 * H, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(H, H, bias=False, device=device, dtype=dtype)
        self.ln2 = nn.LayerNorm(H, device=device, dtype=dtype)
        self.moe = MoELayer(H, cfg.ffn, cfg.experts, cfg.topk, device=device, params_dtype=dtype, **moe_kwargs)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, H))
        return x + self.moe(self.ln2(x))


class MoETransformerLM(nn.Module):
    """The demo's language model. With ``layer_ids`` / ``first`` / ``last`` it is one pipeline stage: blocks
    ``layer_ids`` only (their whole-model names: :func:`moe_graph.train.checkpoint.global_name`), the embeddings on
    the first stage, the final norm, head and loss on the last; ``set_input_tensor`` receives the previous stage's
    activation (the pipeline schedules call it)."""

    def __init__(self, cfg, vocab_size: int, moe_kwargs: Dict, device, dtype, layer_ids: Optional[List[int]] = None,
                 first: bool = True, last: bool = True):
        super().__init__()
        H = cfg.hidden
        self.layer_ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        self.first, self.last = first, last
        if first:
            self.emb = nn.Embedding(vocab_size, H, device=device, dtype=dtype)
            self.pos = nn.Embedding(cfg.seq, H, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([Block(cfg, moe_kwargs, device, dtype) for _ in self.layer_ids])
        if last:
            self.ln = nn.LayerNorm(H, device=device, dtype=dtype)
            self.head = nn.Linear(H, vocab_size, bias=False, device=device, dtype=dtype)
        if first:
            with torch.no_grad():
                self.emb.weight.normal_(0, 0.5)
                self.pos.weight.normal_(0, 0.1)
        self.input_tensor = None

    def set_input_tensor(self, t) -> None:
        self.input_tensor = t

    def moe_layers(self):
        return [b.moe for b in self.blocks]

    def forward(self, tokens, labels):
        x = self.emb(tokens) + self.pos.weight[: tokens.shape[1]] if self.first else self.input_tensor
        for b in self.blocks:
            x = b(x)
        if not self.last:
            return x
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
