"""Plain references for the token dispatcher and the MoE layer (loops over tokens, no permutation tricks). The tests
compare :mod:`moe_graph.moe.token_dispatcher` and :class:`moe_graph.moe.layer.MoELayer` against these."""

from __future__ import annotations

from fractions import Fraction
from typing import Dict, Optional

import torch


# ---------------------------------------------------------------------------------------------- references --
def reference_route(h: torch.Tensor, gate_weight: torch.Tensor, topk: int, score_func: str = "softmax",
                    norm_topk_prob: Optional[bool] = None, *, num_groups=None, group_topk=None, scaling_factor=None,
                    expert_bias=None, group_score_topk=None, gate_bias=None, select_on="scores",
                    norm_topk_min=None, norm_topk_eps=None, logit_softcap=None, hash_indices=None,
                    group_masked_score=None,
                    input_scale=None, input_norm_eps=1e-6, expert_scale=None, num_scored_shared_experts=0,
                    global_scale=None, logit_multiplier=None):
    """``(topk_idx [T, K], topk_probs [T, K], scores [T, E])``: the router written out independently (group-limited
    selection one token at a time, in plain Python). ``norm_topk_prob=None``: on for sigmoid with ``topk > 1``,
    dividing by ``sum + norm_topk_eps`` (``None``: 1e-20) or ``max(sum, norm_topk_min)``;
    ``group_score_topk=None``: a group scores the sum of its ``topk // group_topk`` best; ``gate_bias``: added to
    the logits; ``select_on="logits"``: the top-k ranks the logits (plus the expert bias), not the scores;
    ``logit_multiplier`` ``m``: the logits (with the gate bias) times ``m``; ``logit_softcap`` ``c``: then
    ``c * tanh(logits / c)``; ``hash_indices`` ``[T, K]``: the experts, given (hash
    routing: the token-id table's rows) instead of selected; ``group_masked_score``: the score the experts outside
    the chosen groups compete with (``None``: they do not compete);
    ``input_scale [H]``: the gate sees ``h / sqrt(mean(h^2) + input_norm_eps) * input_scale / sqrt(H)``;
    ``expert_scale [E]``: each probability times its expert's factor (after renormalizing and scaling);
    ``num_scored_shared_experts`` ``S``: the last ``S`` experts join every token's ``topk - S`` selected ones;
    ``global_scale``: multiplies the probabilities."""
    if input_scale is not None:
        hn = h / torch.sqrt((h * h).mean(-1, keepdim=True) + input_norm_eps)
        h = hn * input_scale / h.shape[-1] ** 0.5
    logits = (h @ gate_weight.t()).float() if h.dtype != torch.float64 else h @ gate_weight.t()
    if gate_bias is not None:
        logits = logits + gate_bias.to(logits.dtype)
    if logit_multiplier is not None:
        logits = logits * logit_multiplier
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    if score_func == "softmax":
        scores = torch.softmax(logits, -1)
    elif score_func == "sqrtsoftplus":  # sqrt(log(1 + e^x)), written out
        scores = torch.sqrt(torch.log1p(torch.exp(logits)))
    else:
        scores = torch.sigmoid(logits)
    sel = (logits if select_on == "logits" else scores).detach()
    sel = sel + (expert_bias.to(scores.dtype) if expert_bias is not None else 0)
    T, E = scores.shape
    S = num_scored_shared_experts
    if hash_indices is not None:
        idx = hash_indices.to(torch.int64)
    elif S:
        rows = []
        for t in range(T):
            s = sel[t].tolist()
            rows.append(sorted(range(E - S), key=lambda e: -s[e])[:topk - S] + list(range(E - S, E)))
        idx = torch.tensor(rows, dtype=torch.int64)
    elif num_groups is None:
        idx = torch.topk(sel, topk, dim=-1)[1]
    else:
        per = E // num_groups
        n = group_score_topk if group_score_topk is not None else topk // group_topk
        rows = []
        for t in range(T):
            s = sel[t].tolist()
            gscore = [sum(sorted(s[g * per:(g + 1) * per], reverse=True)[:n]) for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: -gscore[g])[:group_topk]
            cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
            if group_masked_score is not None:  # every expert competes, the others with the masked score; they
                # tie, and the tie is broken as torch.topk breaks it (what transformers' A.X-K2 does)
                full = [s[e] if e in cand else group_masked_score for e in range(E)]
                rows.append(torch.topk(torch.tensor(full, dtype=torch.float64), topk)[1].tolist())
            else:
                rows.append(sorted(cand, key=lambda e: -s[e])[:topk])
        idx = torch.tensor(rows, dtype=torch.int64)
    top = scores.gather(1, idx)
    if norm_topk_prob is None:
        norm_topk_prob = score_func != "softmax" and topk > 1
    if norm_topk_prob:
        s = top.sum(-1, keepdim=True)
        eps = 1e-20 if norm_topk_eps is None else norm_topk_eps
        top = top / (s + eps if norm_topk_min is None else torch.maximum(s, torch.full_like(s, norm_topk_min)))
    if scaling_factor:
        top = top * scaling_factor
    if global_scale is not None:
        top = top * global_scale.to(top.dtype)
    if expert_scale is not None:
        top = top * expert_scale[idx].to(top.dtype)
    return idx, top, scores


def kept_routes(indices: torch.Tensor, column_rank: torch.Tensor, capacity, valid: Optional[torch.Tensor] = None,
                probs: Optional[torch.Tensor] = None):
    """``[T, K]`` bool: which routes survive a per-destination capacity (an int, or one limit per destination rank).
    Without ``probs`` the routes are walked in (token, k) order ("position" policy); with ``probs`` in descending
    probability, ties in (token, k) order ("probs" policy)."""
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
        if used.get(d, 0) < (capacity if isinstance(capacity, int) else int(capacity[d])):
            keep[t, k] = True
            used[d] = used.get(d, 0) + 1
    return keep


def apportion_quotas(demand, capacity: int):
    """Per-destination capacity, written out: ``demand[s][d]`` live routes of source ``s`` for destination ``d`` ->
    ``quota[s][d]``. A destination whose total fits keeps everything; otherwise each source gets the integer part of
    its exact share ``demand * capacity / total`` (a Fraction), and the seats left go one each to the sources with
    the largest fractional parts, lower source rank first on ties."""
    R = len(demand)
    quota = [[int(demand[s][d]) for d in range(R)] for s in range(R)]
    for d in range(R):
        total = sum(int(demand[s][d]) for s in range(R))
        if total <= capacity:
            continue
        exact = [Fraction(int(demand[s][d]) * capacity, total) for s in range(R)]
        for s in range(R):
            quota[s][d] = int(exact[s])  # floor: exact >= 0
        left = capacity - sum(quota[s][d] for s in range(R))
        by_remainder = sorted(range(R), key=lambda s: (-(exact[s] - int(exact[s])), s))
        for s in by_remainder[:left]:
            quota[s][d] += 1
    return quota


def reference_activation(a: torch.Tensor, activation: str = "swiglu", swiglu_alpha: float = 1.702,
                         swiglu_limit: float = 7.0) -> torch.Tensor:
    """The expert activations written out from their definitions (gated ones: gate half, then up half;
    ``"softcapped_swiglu"``: ``swiglu_alpha`` is the gate's cap, ``swiglu_limit`` the up half's)."""
    if activation in ("swiglu", "clamped_swiglu", "limited_swiglu", "post_clamped_swiglu", "softcapped_swiglu",
                      "geglu_tanh"):
        g, u = a.chunk(2, -1)
        if activation == "swiglu":
            return g * torch.sigmoid(g) * u
        if activation == "geglu_tanh":
            return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u
        if activation == "softcapped_swiglu":
            cg, cu = swiglu_alpha, swiglu_limit
            return cg * torch.tanh(g / cg) / (1 + torch.exp(-g)) * (cu * torch.tanh(u / cu))
        if activation == "post_clamped_swiglu":  # min(silu(g), L): the clamp after the activation
            lim = torch.full_like(u, swiglu_limit)
            return torch.minimum(g / (1 + torch.exp(-g)), lim) * torch.maximum(torch.minimum(u, lim), -lim)
        u = torch.maximum(torch.minimum(u, torch.full_like(u, swiglu_limit)), torch.full_like(u, -swiglu_limit))
        g = torch.minimum(g, torch.full_like(g, swiglu_limit))
        if activation == "limited_swiglu":
            return g / (1 + torch.exp(-g)) * u
        return g / (1 + torch.exp(-swiglu_alpha * g)) * (u + 1)
    if activation == "gelu":
        return 0.5 * a * (1 + torch.erf(a / 2 ** 0.5))
    if activation == "relu":
        return torch.where(a > 0, a, torch.zeros_like(a))
    if activation == "silu":
        return a / (1 + torch.exp(-a))
    if activation == "squared_relu":
        return torch.where(a > 0, a * a, torch.zeros_like(a))
    raise ValueError(f"unknown activation {activation!r}")


def dense_moe_reference(h, indices, probs, w1, w2, activation: str = "swiglu", keep: Optional[torch.Tensor] = None,
                        b1: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                        swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, probs_on_input: bool = False,
                        out_norm_weight: Optional[torch.Tensor] = None, out_norm_eps: float = 1e-6):
    """Every token through each of its top-k experts, one at a time: ``sum_k probs[t, k] * mlp_{e_k}(h[t])``
    (``probs_on_input``: ``sum_k mlp_{e_k}(probs[t, k] * h[t])``, Llama 4).

    ``w1 [E, fc1_out, H]``, ``w2 [E, H, F]`` (``nn.Linear`` layout), optional biases ``b1 [E, fc1_out]``,
    ``b2 [E, H]``; ``keep`` masks dropped routes; activation: :func:`reference_activation`; ``out_norm_weight``
    ``w``: each expert output becomes ``a * (1 + w) / sqrt(mean((a * (1 + w))^2) + out_norm_eps)`` before its
    probability weights it. An index ``e >= E``
    is a zero-computation expert: its route adds ``probs[t, k] * h[t]``."""
    T, K = indices.shape
    rows = []
    for t in range(T):
        acc = torch.zeros_like(h[t])
        for k in range(K):
            if keep is not None and not bool(keep[t, k]):
                continue
            e = int(indices[t, k])
            p = probs[t, k].to(h.dtype)
            if e >= w1.shape[0]:  # zero-computation (identity) expert
                acc = acc + p * h[t]
                continue
            a = (p * h[t] if probs_on_input else h[t]) @ w1[e].t()
            if b1 is not None:
                a = a + b1[e]
            a = reference_activation(a, activation, swiglu_alpha, swiglu_limit) @ w2[e].t()
            if b2 is not None:
                a = a + b2[e]
            if out_norm_weight is not None:
                a = a * (1 + out_norm_weight)
                a = a / torch.sqrt((a * a).mean() + out_norm_eps)
            acc = acc + (a if probs_on_input else p * a)
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


def reference_moe_layer(x: torch.Tensor, params: Dict[str, torch.Tensor], config,
                        token_ids: Optional[torch.Tensor] = None,
                        router_input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A whole MoE layer from its definition, dropless: ``x [..., H]`` -> ``[..., H]``.

    ``params``: global tensors under :class:`moe_graph.moe.layer.MoELayer`'s state-dict names, every expert on
    dim 0 (``router.weight`` and optionally ``router.bias``, ``router.expert_bias``; ``experts.fc1.weight [E, ...]``,
    ``experts.fc2.weight``, optionally ``experts.fc1.bias`` / ``experts.fc2.bias``; ``shared_expert.fc1.weight``,
    ... when ``config`` has a shared expert). ``config``: anything with :class:`moe_graph.moe.config.MoEConfig`'s
    option attributes. ``token_ids`` (``x.shape[:-1]``): for hash routing, the rows of ``params["router.tid2eid"]``;
    ``output_norm.weight``: the RMSNorm of the output written out; ``expert_input_norm.weight`` /
    ``expert_output_norm.weight``: the norms around the experts (``expert_input_norm_eps`` /
    ``expert_output_norm_eps`` of ``config``). ``router_input``: what the gate sees instead of
    ``x`` (same shape)."""
    c = config
    h = x.reshape(-1, x.shape[-1])
    hr = h if router_input is None else router_input.reshape(h.shape)
    hashed = None
    if getattr(c, "hash_vocab_size", None) is not None:
        table = params["router.tid2eid"]
        hashed = torch.stack([table[int(t)] for t in token_ids.reshape(-1)])
    idx, probs, _ = reference_route(hr, params["router.weight"], c.topk, c.score_func, c.norm_topk_prob,
                                    num_groups=c.num_groups, group_topk=c.group_topk,
                                    scaling_factor=c.topk_scaling_factor, expert_bias=params.get("router.expert_bias"),
                                    group_score_topk=c.group_score_topk, gate_bias=params.get("router.bias"),
                                    select_on=getattr(c, "select_on", "scores"),
                                    norm_topk_min=getattr(c, "norm_topk_min", None),
                                    norm_topk_eps=getattr(c, "norm_topk_eps", None),
                                    logit_softcap=getattr(c, "logit_softcap", None), hash_indices=hashed,
                                    group_masked_score=getattr(c, "group_masked_score", None),
                                    input_scale=params.get("router.input_scale"),
                                    input_norm_eps=getattr(c, "router_norm_eps", 1e-6),
                                    expert_scale=params.get("router.expert_scale"),
                                    num_scored_shared_experts=getattr(c, "num_scored_shared_experts", 0),
                                    global_scale=params.get("router.global_scale"),
                                    logit_multiplier=getattr(c, "router_logit_multiplier", None))
    act = dict(swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
    he = h  # the experts' input: latent_in(h) with latent projections (Nemotron-H's moe_latent_size)
    if "latent_in.weight" in params:
        he = h @ params["latent_in.weight"].t() + (params["latent_in.bias"] if "latent_in.bias" in params else 0)
    if "expert_input_norm.weight" in params:  # the centered RMSNorm: rms_norm(he) * (1 + w)
        eps = getattr(c, "expert_input_norm_eps", 1e-6)
        he = he / torch.sqrt((he * he).mean(-1, keepdim=True) + eps) * (1 + params["expert_input_norm.weight"])
    y = dense_moe_reference(he, idx, probs, params["experts.fc1.weight"], params["experts.fc2.weight"], c.activation,
                            b1=params.get("experts.fc1.bias"), b2=params.get("experts.fc2.bias"),
                            probs_on_input=getattr(c, "probs_on_input", False),
                            out_norm_weight=params.get("expert_output_norm.weight"),
                            out_norm_eps=getattr(c, "expert_output_norm_eps", 1e-6), **act)
    if "latent_out.weight" in params:
        y = y @ params["latent_out.weight"].t() + (params["latent_out.bias"] if "latent_out.bias" in params else 0)
    if c.shared_expert_ffn_size:
        a = h @ params["shared_expert.fc1.weight"].t()
        if "shared_expert.fc1.bias" in params:
            a = a + params["shared_expert.fc1.bias"]
        shared_act = getattr(c, "shared_expert_activation", None) or c.activation
        limit = getattr(c, "shared_expert_swiglu_limit", None)
        s_act = dict(act, swiglu_limit=c.swiglu_limit if limit is None else limit)
        s = reference_activation(a, shared_act, **s_act) @ params["shared_expert.fc2.weight"].t()
        if "shared_expert.fc2.bias" in params:
            s = s + params["shared_expert.fc2.bias"]
        if c.shared_expert_gate:
            s = s / (1 + torch.exp(-(h @ params["shared_expert.gate.weight"].t())))
        y = y + s
        if getattr(c, "shared_expert_combine", "sum") == "average":
            y = y / 2
    if "output_bias" in params:
        y = y + params["output_bias"]
    if "output_norm.weight" in params:
        eps = getattr(c, "output_norm_eps", 1e-6)
        y = params["output_norm.weight"] * (y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps))
    return y.reshape(x.shape)
