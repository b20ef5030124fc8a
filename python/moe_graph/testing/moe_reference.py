"""Plain references for the token dispatcher and the MoE layer (loops over tokens, no permutation tricks). The tests
compare :mod:`moe_graph.moe.token_dispatcher` and :class:`moe_graph.moe.layer.MoELayer` against these."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------- references --
def reference_route(h: torch.Tensor, gate_weight: torch.Tensor, topk: int, score_func: str = "softmax",
                    norm_topk_prob: bool = False, *, num_groups=None, group_topk=None, scaling_factor=None,
                    expert_bias=None):
    """``(topk_idx [T, K], topk_probs [T, K], scores [T, E])``: the router written out independently (group-limited
    selection one token at a time, in plain Python)."""
    logits = (h @ gate_weight.t()).float() if h.dtype != torch.float64 else h @ gate_weight.t()
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    sel = scores.detach() + (expert_bias.to(scores.dtype) if expert_bias is not None else 0)
    T, E = scores.shape
    if num_groups is None:
        idx = torch.topk(sel, topk, dim=-1)[1]
    else:
        per = E // num_groups
        rows = []
        for t in range(T):
            s = sel[t].tolist()
            gscore = [sum(sorted(s[g * per:(g + 1) * per], reverse=True)[: topk // group_topk]) for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: -gscore[g])[:group_topk]
            cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
            rows.append(sorted(cand, key=lambda e: -s[e])[:topk])
        idx = torch.tensor(rows, dtype=torch.int64)
    top = scores.gather(1, idx)
    if norm_topk_prob or (score_func == "sigmoid" and topk > 1):
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    if scaling_factor:
        top = top * scaling_factor
    return idx, top, scores


def kept_routes(indices: torch.Tensor, column_rank: torch.Tensor, capacity: int, valid: Optional[torch.Tensor] = None,
                probs: Optional[torch.Tensor] = None):
    """``[T, K]`` bool: which routes survive a per-destination capacity. Without ``probs`` the routes are walked in
    (token, k) order ("position" policy); with ``probs`` in descending probability, ties in (token, k) order
    ("probs" policy)."""
    T, K = indices.shape
    routes = [(t, k) for t in range(T) for k in range(K)]
    if probs is not None:
        routes.sort(key=lambda r: -float(probs[r[0], r[1]]))  # stable: ties keep (token, k) order
    keep = torch.zeros(T, K, dtype=torch.bool)
    used: Dict[int, int] = {}
    for t, k in routes:
        if valid is not None and not bool(valid[t, k]):
            continue
        d = int(column_rank[int(indices[t, k])])
        if used.get(d, 0) < capacity:
            keep[t, k] = True
            used[d] = used.get(d, 0) + 1
    return keep


def dense_moe_reference(h, indices, probs, w1, w2, activation: str = "swiglu", keep: Optional[torch.Tensor] = None):
    """Every token through each of its top-k experts, one at a time: ``sum_k probs[t, k] * mlp_{e_k}(h[t])``.

    ``w1 [E, fc1_out, H]``, ``w2 [E, H, F]`` (``nn.Linear`` layout); ``keep`` masks dropped routes."""
    T, K = indices.shape
    rows = []
    for t in range(T):
        acc = torch.zeros_like(h[t])
        for k in range(K):
            if keep is not None and not bool(keep[t, k]):
                continue
            e = int(indices[t, k])
            a = h[t] @ w1[e].t()
            if activation == "swiglu":
                g, u = a.chunk(2, -1)
                a = F.silu(g) * u
            else:
                a = F.gelu(a)
            acc = acc + probs[t, k].to(h.dtype) * (a @ w2[e].t())
        rows.append(acc)
    return torch.stack(rows)


def reference_aux_loss(scores: torch.Tensor, indices: torch.Tensor, num_experts: int, score_func: str = "softmax"):
    if score_func == "sigmoid":  # Megatron's aux-loss scores: sigmoid normalized per token
        scores = scores / scores.sum(-1, keepdim=True)
    T, K = indices.shape
    f = torch.zeros(num_experts, dtype=scores.dtype)
    for t in range(T):
        for k in range(K):
            f[int(indices[t, k])] += 1.0 / (T * K)
    return num_experts * (f * scores.mean(0)).sum()


def scale_experts(expert_in: torch.Tensor, m_splits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A stand-in "expert": rows of local expert ``l`` times ``scales[l]`` (padding rows stay zero). Test code:
    reads ``m_splits`` on the host."""
    per_row = torch.repeat_interleave(scales, m_splits.cpu())
    pad = expert_in.shape[0] - per_row.shape[0]
    per_row = torch.cat([per_row, per_row.new_zeros(pad)])
    return expert_in * per_row[:, None].to(expert_in.dtype)
