"""Routing: :class:`TopKRouter` (gate, softmax/sigmoid scores, top-k with the DeepSeek-V3/Qwen3 options) handing
the layer a :class:`Routing` (the top-k indices and probabilities, the per-expert route counts), the
auxiliary losses (:func:`router_aux_loss`, :func:`sequence_aux_loss`, :func:`router_z_loss`, combined per layer by
:class:`RouterLoss`), :class:`MoEAuxLossAutoScaler` that feeds their gradient into backward through the layer
output, and auxiliary-loss-free balancing (:func:`update_expert_bias`).

All of it is device code without host syncs (capturable). Notation: the legend of :mod:`moe_graph.moe`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.moe.token_dispatcher import counting_enabled

__all__ = ["AUX_LOSS_TYPES", "SELECT_ON", "MoEAuxLossAutoScaler", "RouterLoss", "Routing", "SCORE_FUNCS",
           "TopKRouter", "aux_loss_scores", "check_loss_options", "check_router_options", "group_limited_topk",
           "route_counts",
           "router_aux_loss", "router_scores", "router_z_loss", "routing_map", "sequence_aux_loss",
           "set_aux_loss_scale", "update_expert_bias"]

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
SELECT_ON = ("scores", "logits")  # what the top-k selection ranks (the selection-only expert bias joins it)
AUX_LOSS_TYPES = ("local", "global", "sequence")


def router_aux_loss(scores: torch.Tensor, routing_map: Optional[torch.Tensor], topk: int,
                    tokens_per_expert: Optional[torch.Tensor] = None,
                    token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Switch-transformer load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: fraction of the routes that go
    to expert ``e``, ``P_e``: mean score of ``e`` over the local tokens); 1.0 for perfect balance. With
    ``tokens_per_expert`` (e.g. counts summed over the EP group: global-batch balancing, as Qwen3 trains) ``f``
    comes from those counts instead of the local ``routing_map`` (this rank's own counts, :attr:`Routing.counts`,
    give the local loss without a map: they sum to ``T * topk``). ``token_mask`` ``[T]`` (1: real token, 0:
    padding, whose routes must already be off the map): means over the real tokens only. Device-only, no sync."""
    T, E = scores.shape
    if routing_map is None and tokens_per_expert is None:
        raise ValueError("router_aux_loss needs routing_map or tokens_per_expert")
    if token_mask is None:
        n = max(T, 1)  # a Python number: no host-to-device copy on the hot path (capturable)
    else:
        m = token_mask.to(scores.dtype)
        scores = scores * m[:, None]
        n = m.sum().clamp(min=1)
    if tokens_per_expert is None:
        f = routing_map.to(scores.dtype).sum(0) / (n * topk)
    else:
        counts = tokens_per_expert.to(scores.dtype)
        f = counts / counts.sum().clamp(min=1)
    p = scores.sum(0) / n
    return E * (f * p).sum()


# device -> 0-dim fp32 tensor holding the aux-loss gradient scale (static address: a captured graph reads the current
# value); module state rather than attributes of the autograd Function, which torch.compile cannot read in a graph
_AUX_LOSS_SCALES: dict = {}
_AUX_LOSS_DEFAULT = [1.0]


def _aux_loss_scale(device: torch.device) -> torch.Tensor:
    t = _AUX_LOSS_SCALES.get(device)
    if t is None:
        t = torch.full((), _AUX_LOSS_DEFAULT[0], dtype=torch.float32, device=device)
        _AUX_LOSS_SCALES[device] = t
    return t


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``out``; its backward also feeds the gradient ``loss_scale`` to ``aux`` (Megatron-core's
    ``MoEAuxLossAutoScaler``), so the router losses reach backward through the layer output without being added
    to the reported loss.

    The aux gradient must carry the same factors as the main loss's gradient: ``1 / num_microbatches`` (each
    microbatch's loss is divided by it) and the loss scale (``DynamicLossScaler``: the optimizer divides every
    gradient by it). :meth:`set_loss_scale` sets that factor in a device tensor, once per step;
    :func:`moe_graph.train.step.train_step` and the pipeline schedules (:mod:`moe_graph.train.schedules`) set it to
    ``loss_scale / num_microbatches`` for you. Its default is 1 (one microbatch, no loss scaling).
    """

    @staticmethod
    def forward(ctx, out, aux):
        """``aux``: the router losses already multiplied by the scale tensor (:meth:`attach`)."""
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.ones_like(aux)

    @staticmethod
    def attach(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged; backward adds the gradient of ``aux * loss_scale`` (the current scale, read from the
        device tensor when backward runs the graph: no host value is frozen)."""
        return MoEAuxLossAutoScaler.apply(out, aux * _aux_loss_scale(aux.device).to(aux.dtype))

    @staticmethod
    def loss_scale(device) -> torch.Tensor:
        """The 0-dim fp32 device tensor holding the aux-loss gradient scale on ``device``."""
        return _aux_loss_scale(torch.device(device))

    @staticmethod
    def set_loss_scale(scale) -> None:
        """Set the aux/z-loss gradient scale: a Python number, or a 0-dim / one-element device tensor (e.g.
        ``loss_scaler.scale / num_microbatches``; copied in place, no host sync, capturable)."""
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"set_loss_scale: scale must have one element, got shape {tuple(scale.shape)}")
            scale = scale.detach().reshape(())
            _aux_loss_scale(scale.device).copy_(scale)
            for dev, t in _AUX_LOSS_SCALES.items():
                if dev != scale.device:
                    t.copy_(scale)
            return
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"set_loss_scale: scale must be finite, got {scale}")
        _AUX_LOSS_DEFAULT[0] = scale
        for t in _AUX_LOSS_SCALES.values():
            t.fill_(scale)


def set_aux_loss_scale(scale) -> None:
    """Module-level alias of :meth:`MoEAuxLossAutoScaler.set_loss_scale`."""
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int,
                       group_score_topk: Optional[int] = None, masked_score: Optional[float] = None):
    """DeepSeek-V3's device/node-limited routing: experts form ``num_groups`` consecutive groups; a group's score
    is the sum of its ``group_score_topk`` best scores (``None``: ``topk // group_topk``, Megatron's rule;
    DeepSeek-V3's reference code and Hugging Face transformers sum the best 2); each token picks its ``group_topk``
    best groups and then its ``topk`` best experts among those groups (``masked_score`` ``m``: the other groups'
    experts score ``m`` instead of ``-inf``, A.X-K2's 0.0, so that one of them is chosen where fewer than ``topk``
    chosen-group scores exceed ``m``). Returns ``(values [T, topk], indices [T, topk])``."""
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    n = group_score_topk if group_score_topk is not None else topk // group_topk
    group_scores = grouped.topk(n, dim=-1)[0].sum(-1)  # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    if masked_score is not None:
        chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return grouped.masked_fill(~chosen.unsqueeze(-1), masked_score).view(T, E).topk(topk, dim=-1)
    keep = torch.full_like(group_scores, float("-inf")).scatter_(1, group_idx, 0.0)  # 0: a chosen group
    return (grouped + keep.unsqueeze(-1)).view(T, E).topk(topk, dim=-1)  # -inf outside the chosen groups


def check_router_options(num_experts: int, topk: int, score_func: str = "softmax", num_groups: Optional[int] = None,
                         group_topk: Optional[int] = None, enable_expert_bias: bool = False,
                         router_dtype: Optional[torch.dtype] = None, norm_topk_prob: Optional[bool] = None,
                         group_score_topk: Optional[int] = None, select_on: str = "scores", *,
                         hash_vocab_size: Optional[int] = None, logit_softcap: Optional[float] = None,
                         group_masked_score: Optional[float] = None, num_scored_shared_experts: int = 0,
                         logit_multiplier: Optional[float] = None, norm_topk_eps: Optional[float] = None,
                         norm_topk_min: Optional[float] = None) -> None:
    """Raises ``ValueError`` naming the first bad routing option (:class:`TopKRouter`'s arguments)."""
    if norm_topk_min is not None and (isinstance(norm_topk_min, bool) or not isinstance(norm_topk_min, (int, float))
                                      or not 0 <= norm_topk_min < 1):
        raise ValueError(f"norm_topk_min must be None or a number in [0, 1), got {norm_topk_min!r}")
    if norm_topk_eps is not None:
        if isinstance(norm_topk_eps, bool) or not isinstance(norm_topk_eps, (int, float)) \
                or not 0 <= norm_topk_eps < 1:
            raise ValueError(f"norm_topk_eps must be None (1e-20) or a number in [0, 1), got {norm_topk_eps!r}")
        if norm_topk_min is not None:
            raise ValueError("norm_topk_eps (sum + eps) and norm_topk_min (max(sum, min)) are two rules for the same "
                             "denominator: give one")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if select_on not in SELECT_ON:
        raise ValueError(f"select_on must be one of {SELECT_ON}, got {select_on!r}")
    if hash_vocab_size is not None:
        if isinstance(hash_vocab_size, bool) or not isinstance(hash_vocab_size, int) or hash_vocab_size < 1:
            raise ValueError(f"hash_vocab_size must be None or an int >= 1 (the token-id table's rows), got "
                             f"{hash_vocab_size!r}")
        if num_groups is not None or enable_expert_bias or select_on != "scores":
            raise ValueError("hash routing (hash_vocab_size) picks the experts from the token-id table: it cannot "
                             "be combined with num_groups/group_topk, enable_expert_bias or select_on='logits'")
    S = num_scored_shared_experts
    if isinstance(S, bool) or not isinstance(S, int) or not 0 <= S < min(topk, num_experts):
        raise ValueError(f"num_scored_shared_experts must be an int in [0, min(topk, num_experts)) (the last experts, "
                         f"routed to by every token, counted in topk and num_experts), got {S!r}")
    if S and (num_groups is not None or hash_vocab_size is not None or score_func == "softmax"):
        raise ValueError("num_scored_shared_experts needs an elementwise score_func (sigmoid, sqrtsoftplus) and "
                         "neither group-limited nor hash routing")
    if group_masked_score is not None:
        if num_groups is None:
            raise ValueError("group_masked_score needs group-limited routing (num_groups and group_topk)")
        if isinstance(group_masked_score, bool) or not isinstance(group_masked_score, (int, float)) \
                or not math.isfinite(group_masked_score):
            raise ValueError(f"group_masked_score must be None (-inf) or a finite number, got {group_masked_score!r}")
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                                      or not 0 < logit_softcap < float("inf")):
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got {logit_softcap!r}")
    if logit_multiplier is not None and (isinstance(logit_multiplier, bool)
                                         or not isinstance(logit_multiplier, (int, float))
                                         or not 0 < logit_multiplier < float("inf")):
        raise ValueError(f"router_logit_multiplier must be None or a finite number > 0, got {logit_multiplier!r}")
    if norm_topk_prob not in (None, True, False):
        raise ValueError(f"norm_topk_prob must be None (the score function's default), True or False, got "
                         f"{norm_topk_prob!r}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError(f"num_groups and group_topk go together, got num_groups={num_groups}, group_topk={group_topk}")
    if num_groups is not None:
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk must be in [1, num_groups={num_groups}], got {group_topk}")
        if topk < group_topk or topk > group_topk * (num_experts // num_groups):
            raise ValueError(
                f"topk={topk} must be in [group_topk={group_topk}, group_topk * experts per group = "
                f"{group_topk * (num_experts // num_groups)}] for group-limited routing")
    if group_score_topk is not None:
        if num_groups is None:
            raise ValueError("group_score_topk needs group-limited routing (num_groups and group_topk)")
        per = num_experts // num_groups
        n = group_score_topk
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= per:
            raise ValueError(f"group_score_topk must be an int in [1, experts per group = {per}] or None "
                             f"(topk // group_topk), got {group_score_topk!r}")
    if router_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"router_dtype must be None, torch.float32 or torch.float64, got {router_dtype}")


def check_loss_options(aux_loss_type: str = "local", sequence_dim: int = 1) -> None:
    """Raises ``ValueError`` naming a bad :class:`RouterLoss` option."""
    if aux_loss_type not in AUX_LOSS_TYPES:
        raise ValueError(f"aux_loss_type must be 'local', 'global' or 'sequence', got {aux_loss_type!r}")
    if sequence_dim not in (0, 1):
        raise ValueError(f"sequence_dim must be 0 ([S, B, H] input) or 1 ([B, S, H]), got {sequence_dim}")


class Routing(NamedTuple):
    """What :class:`TopKRouter` hands the layer for ``T`` tokens (``K`` routes each, ``E`` experts):

    * ``indices`` ``[T, K]`` int64: each token's experts, best selection score first;
    * ``probs`` ``[T, K]``: their routing probabilities (differentiable; 0 for padding tokens);
    * ``counts`` ``[E]`` int64: routes of the real tokens per expert;
    * ``logits`` ``[T, E]``: the fp32 (fp64 with ``router_dtype``) gate logits;
    * ``scores`` ``[T, E]``: the softmax/sigmoid scores, or ``None`` where the selection did not need them
      (:func:`router_scores` of ``logits`` gives them);
    * ``token_mask`` ``[T]`` bool (True: a real token), ``None`` without a padding mask.

    The dense ``[T, E]`` map is :func:`routing_map` (built only where something needs it)."""

    indices: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor
    logits: torch.Tensor
    scores: Optional[torch.Tensor]
    token_mask: Optional[torch.Tensor]


def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """``[T, E]`` scores of the gate logits: ``softmax`` over the experts, elementwise ``sigmoid``, or elementwise
    ``sqrtsoftplus`` (``sqrt(softplus(logits))``, DeepSeek-V4)."""
    if score_func == "softmax":
        return torch.softmax(logits, -1)
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return torch.sigmoid(logits)


def routing_map(indices: torch.Tensor, num_experts: int, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense ``[T, E]`` bool map of ``indices [T, K]`` (True where a token routes; no route for tokens whose
    ``token_mask [T]`` is False)."""
    T, K = indices.shape
    hit = (torch.ones((), dtype=torch.bool, device=indices.device) if token_mask is None
           else token_mask.to(torch.bool).view(T, 1)).expand(T, K)
    return torch.zeros(T, num_experts, dtype=torch.bool, device=indices.device).scatter_(1, indices, hit)


def route_counts(indices: torch.Tensor, num_experts: int, per_token: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[E]`` int64 routes per expert of ``indices [T, K]``, each route of token ``t`` adding ``per_token[t]``
    (``[T]`` int64: 1 for a real token, 0 for padding; or a 0-dim 1 for every token): one scatter-add, written
    into ``out`` (an ``[E]`` int64 tensor, e.g. a statistics buffer) when given."""
    T, K = indices.shape
    src = per_token.reshape(-1, 1).expand(T, K).reshape(-1)
    out = torch.zeros(num_experts, dtype=torch.int64, device=indices.device) if out is None else out.zero_()
    return out.scatter_add_(0, indices.reshape(-1), src)


def normed_router_input(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's gate input: ``x / sqrt(mean(x^2) + eps)`` (in fp32, fp64 for fp64; back in ``x``'s dtype) times
    ``scale [H]`` times ``H^-0.5``."""
    xf = x if x.dtype == torch.float64 else x.float()
    xn = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)
    return xn * scale * x.shape[-1] ** -0.5


class _RenormalizedTopK(torch.autograd.Function):
    """``top * scale / (top.sum(-1) + eps)`` for ``top [T, K]``: the top-k probabilities renormalized to sum
    ``scale``, computed as ``top / d`` with ``d = (sum + eps) / scale``; backward in four ops,
    ``grad_top = (g - sum(g * p) / scale) / d``."""

    @staticmethod
    def forward(ctx, top: torch.Tensor, scale: float, eps: float):
        d = top.sum(-1, keepdim=True) + eps
        if scale != 1.0:
            d = d / scale
        p = top / d
        ctx.save_for_backward(p, d)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, g):
        p, d = ctx.saved_tensors
        c = (g * p).sum(-1, keepdim=True)
        return torch.sub(g, c, alpha=1.0 / ctx.scale) / d, None, None


class TopKRouter(nn.Module):
    """Linear gate + softmax or sigmoid scores + top-k, with the routing options of DeepSeek-V3/Qwen3-style models
    (Megatron-core's ``moe_router_*`` semantics).

    ``score_func="softmax"``: probabilities = the top-k softmax scores; ``"sigmoid"`` (DeepSeek-V3): the top-k
    sigmoid scores. ``norm_topk_prob``: renormalize the top-k probabilities to sum 1 (``True``/``False``, for either
    score function; ``None``: Megatron's rule, on for sigmoid with ``topk > 1``, off for softmax). Softmax with
    ``norm_topk_prob`` and no groups computes them as the softmax of the top-k logits (the same numbers: the
    softmax's denominator cancels), without the ``[T, E]`` scores.

    * ``num_scored_shared_experts`` ``S`` (Inkling): the last ``S`` of the ``num_experts`` experts are shared experts
      that every token routes to, scored by the gate like the others: each token selects ``topk - S`` of the first
      ``num_experts - S`` experts and appends the ``S`` shared ones, and their scores are renormalized together
      (``norm_topk_prob``) and scaled. ``global_scale``: a learned scalar ``global_scale [1]`` (ones) multiplying
      the probabilities.
    * ``num_groups`` / ``group_topk`` / ``group_score_topk`` / ``group_masked_score``: group-limited routing
      (:func:`group_limited_topk`; ``group_masked_score=0.0``: A.X-K2's mask of the other groups).
    * ``scaling_factor``: multiplies the probabilities (DeepSeek-V3's ``routed_scaling_factor`` 2.5).
    * ``router_bias``: a learned bias ``bias [E]`` added to the logits (GPT-OSS; Megatron's router gets one with
      ``add_bias_linear``). It moves both the selection and the probabilities, unlike ``expert_bias``.
    * ``norm_topk_eps``: renormalize by ``sum + norm_topk_eps`` (``None``: ``1e-20``, Megatron's; LFM2-MoE
      ``1e-6``, Muse-Spark ``1e-15``: a top-k of sigmoid scores that sum to ~1e-8 stays ~1e-2, not 1).
      ``norm_topk_min``: renormalize by ``max(sum, norm_topk_min)`` instead (ERNIE-4.5's ``moe_norm_min``: a
      selection-biased top-k whose scores sum to almost nothing stays almost nothing).
    * ``input_norm``: the gate sees :func:`normed_router_input` of its input (RMS norm with ``input_norm_eps``, a
      learned ``input_scale [H]``, ``1 / sqrt(H)``); ``expert_scale``: a learned ``expert_scale [E]`` multiplies
      each route's probability after the renormalization and scaling (both Gemma 4; initialized to ones).
    * ``router_dtype`` (``torch.float32`` / ``torch.float64``): run the gate GEMM in that precision (Megatron's
      ``moe_router_dtype``; by default the GEMM runs in the input dtype and the logits are upcast to fp32).
    * ``score_func="sqrtsoftplus"`` (DeepSeek-V4): scores ``sqrt(softplus(logits))``, elementwise like sigmoid
      (``norm_topk_prob=None`` renormalizes them as sigmoid's).
    * ``select_on``: what the top-k ranks, ``"scores"`` (default) or ``"logits"`` (Llama 4, Cohere2-MoE's sigmoid
      router, Kolibri-1). The score functions are monotone, so the two pick the same experts except where the
      scores tie although the logits do not: a saturated fp32 sigmoid (logits 21.1 and 17.9 both score 1.0), where
      ``"scores"`` takes the lower index and ``"logits"`` the larger logit.
    * ``logit_multiplier`` ``m``: the gate's logits (fp32, or the ``router_dtype``) times ``m``, first (Muse-Spark's
      ``output_multiplier``); ``last_logits`` and the z-loss see the scaled logits.
    * ``logit_softcap`` ``c``: the logits become ``c * tanh(logits / c)`` before anything else (Laguna's
      ``moe_router_logit_softcapping``); ``last_logits`` and the z-loss see the capped logits.
    * ``hash_vocab_size`` ``V`` (DeepSeek-V4's hash layers): the experts of a token come from the buffer
      ``tid2eid [V, K]`` (int64, persistent; a checkpoint fills it) indexed by its token id, which
      :meth:`forward` then needs (``token_ids``, the model's input ids). The gate still gives the scores that weight
      the chosen experts (renormalized and scaled as configured). A device gather: no sync, capturable; token ids
      must lie in ``[0, V)`` (checked by the gather itself, on CUDA as a device assert).
    * ``enable_expert_bias``: auxiliary-loss-free balancing. A buffer ``expert_bias [E]`` is added to the scores
      (softmax or sigmoid: DeepSeek-V3, ERNIE-4.5-MoE) or, with ``select_on="logits"``, to the logits
      (Kolibri-1: the top-k of ``logits + bias``) for the *selection* only (the probabilities use the unbiased
      scores); each training-mode forward
      (once, also under activation recomputation) adds this rank's routes per expert to the buffer
      ``local_tokens_per_expert``, and :func:`update_expert_bias` (after the optimizer step) moves the bias by
      ``expert_bias_update_rate`` towards balance and clears the counts. All of it is device code without host
      syncs (capturable).

    Returns a :class:`Routing`; ``last_logits`` keeps the logits of the last call (e.g. for
    :func:`moe_graph.integrations.hf.hf_load_balancing_loss`).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, score_func: str = "softmax",
                 norm_topk_prob: Optional[bool] = None, device=None, dtype=None, *, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None, group_score_topk: Optional[int] = None,
                 scaling_factor: Optional[float] = None, router_bias: bool = False,
                 enable_expert_bias: bool = False, expert_bias_update_rate: float = 1e-3,
                 router_dtype: Optional[torch.dtype] = None, select_on: str = "scores",
                 norm_topk_min: Optional[float] = None, hash_vocab_size: Optional[int] = None,
                 logit_softcap: Optional[float] = None, group_masked_score: Optional[float] = None,
                 input_norm: bool = False, input_norm_eps: float = 1e-6, expert_scale: bool = False,
                 num_scored_shared_experts: int = 0, global_scale: bool = False,
                 logit_multiplier: Optional[float] = None, norm_topk_eps: Optional[float] = None):
        super().__init__()
        check_router_options(num_experts, topk, score_func, num_groups, group_topk, enable_expert_bias, router_dtype,
                             norm_topk_prob, group_score_topk, select_on, hash_vocab_size=hash_vocab_size,
                             logit_softcap=logit_softcap, group_masked_score=group_masked_score,
                             num_scored_shared_experts=num_scored_shared_experts, logit_multiplier=logit_multiplier,
                             norm_topk_eps=norm_topk_eps, norm_topk_min=norm_topk_min)
        self.norm_topk_min = norm_topk_min
        self.norm_topk_eps = 1e-20 if norm_topk_eps is None else float(norm_topk_eps)
        self.logit_multiplier = float(logit_multiplier) if logit_multiplier is not None else None
        self.num_scored_shared_experts = num_scored_shared_experts
        self.group_masked_score = float(group_masked_score) if group_masked_score is not None else None
        self.select_on = select_on
        self.hash_vocab_size = hash_vocab_size
        self.logit_softcap = float(logit_softcap) if logit_softcap is not None else None
        self.num_experts, self.topk, self.score_func = num_experts, topk, score_func
        if norm_topk_prob is None:
            norm_topk_prob = score_func != "softmax" and topk > 1
        self.norm_topk_prob = bool(norm_topk_prob)
        self.num_groups, self.group_topk, self.group_score_topk = num_groups, group_topk, group_score_topk
        self.scaling_factor = scaling_factor
        self.enable_expert_bias = bool(enable_expert_bias)
        self.expert_bias_update_rate = float(expert_bias_update_rate)
        self.router_dtype = router_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if router_bias else None
        # Gemma 4: the gate's own input norm and learned scales (ones: no effect until trained)
        self.input_norm_eps = float(input_norm_eps)
        self.input_scale = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype)) if input_norm else None
        self.expert_scale = nn.Parameter(torch.ones(num_experts, device=device, dtype=dtype)) if expert_scale \
            else None
        if self.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, device=device, dtype=torch.float32), persistent=False)
        scale_dtype = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)  # fp32 (fp64 stays)
        self.global_scale = nn.Parameter(torch.ones(1, device=device, dtype=scale_dtype)) if global_scale else None
        if num_scored_shared_experts:  # the shared experts' indices, appended to every token's selection
            self.register_buffer("shared_indices", torch.arange(num_experts - num_scored_shared_experts, num_experts,
                                                                device=device), persistent=False)
        if hash_vocab_size is not None:  # token id -> its top-k experts (DeepSeek-V4's tid2eid)
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, topk, device=device, dtype=torch.int64))
        # the 1 each route of a token without padding counts (a constant: no fill per forward)
        self.register_buffer("route_one", torch.ones((), dtype=torch.int64, device=device), persistent=False)
        self.last_logits = None

    @property
    def softmax_of_topk(self) -> bool:
        """True where the probabilities are the softmax of the top-k logits (see the class docstring)."""
        return (self.score_func == "softmax" and self.norm_topk_prob and self.num_groups is None
                and not self.enable_expert_bias and self.hash_vocab_size is None and self.global_scale is None)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = normed_router_input(x, self.input_scale, self.input_norm_eps)
        if self.router_dtype is not None:  # Megatron's moe_router_dtype: the gate GEMM itself in fp32 / fp64
            bias = self.bias.to(self.router_dtype) if self.bias is not None else None
            return F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype), bias)
        logits = F.linear(x, self.weight, self.bias)
        return logits if logits.dtype == torch.float64 else logits.float()  # fp32 scores (fp64 stays fp64)

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        S = self.num_scored_shared_experts
        if S:  # top (topk - S) of the routed experts, then the S shared ones
            idx = torch.topk(scores[:, :-S], self.topk - S, dim=-1)[1]
            return torch.cat([idx, self.shared_indices.expand(idx.shape[0], S)], dim=1)
        if self.num_groups is not None:
            return group_limited_topk(scores, self.topk, self.num_groups, self.group_topk, self.group_score_topk,
                                      self.group_masked_score)[1]
        return torch.topk(scores, self.topk, dim=-1)[1]

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                counts_out: Optional[torch.Tensor] = None, token_ids: Optional[torch.Tensor] = None) -> Routing:
        """``x`` ``[T, H]``; ``padding_mask`` ``[T]`` bool (True: a padding token, which gets no route);
        ``counts_out``: an ``[E]`` int64 tensor the route counts are written into (:func:`route_counts`);
        ``token_ids`` ``[T]`` integer: the tokens' ids, needed by hash routing (``hash_vocab_size``) and ignored
        otherwise."""
        hashed = None
        if self.hash_vocab_size is not None:
            if token_ids is None:
                raise ValueError("hash routing (hash_vocab_size) needs token_ids, the [T] input token ids")
            if token_ids.numel() != x.shape[0] or token_ids.is_floating_point() or token_ids.is_complex():
                raise ValueError(f"token_ids must be an integer tensor of {x.shape[0]} elements (one per token), got "
                                 f"{token_ids.dtype} of shape {tuple(token_ids.shape)}")
            hashed = self.tid2eid[token_ids.reshape(-1).to(device=x.device, dtype=torch.int64)]
        logits = self._logits(x)
        if self.logit_multiplier is not None:  # Muse-Spark: a constant on the fp32 logits
            logits = logits * self.logit_multiplier
        if self.logit_softcap is not None:  # Laguna: c * tanh(logits / c)
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        self.last_logits = logits
        scores = None
        if self.softmax_of_topk:
            top, idx = torch.topk(logits, self.topk, dim=-1)
            top = torch.softmax(top, -1)
            if self.scaling_factor:
                top = top * self.scaling_factor
        else:
            scores = router_scores(logits, self.score_func)
            sel = None if hashed is not None else logits.detach() if self.select_on == "logits" \
                else scores.detach()
            if self.enable_expert_bias:
                sel = sel + self.expert_bias.to(sel.dtype)
            idx = self._select(sel) if hashed is None else hashed
            top = scores.gather(1, idx)
            if self.norm_topk_prob and self.norm_topk_min is not None:  # ERNIE-4.5: sum clamped, not offset
                top = top / top.sum(-1, keepdim=True).clamp(min=self.norm_topk_min)
                if self.scaling_factor:
                    top = top * self.scaling_factor
            elif self.norm_topk_prob:  # scaled in the same op
                top = _RenormalizedTopK.apply(top, float(self.scaling_factor or 1.0), self.norm_topk_eps)
            elif self.scaling_factor:
                top = top * self.scaling_factor
            if self.global_scale is not None:  # Inkling's learned scale
                top = top * self.global_scale.to(top.dtype)
        if self.expert_scale is not None:  # Gemma 4: a learned factor per expert on its probability
            top = top * self.expert_scale[idx]
        token_mask = None
        if padding_mask is not None:
            pad = padding_mask.reshape(-1).to(torch.bool)
            top = top.masked_fill(pad.view(-1, 1), 0)
            token_mask = ~pad
        counts = route_counts(idx, self.num_experts, self.route_one if token_mask is None
                              else token_mask.to(torch.int64), counts_out)
        # training forwards count (also the no-grad first pass of a reentrant checkpoint); its recomputation
        # inside backward does not (counting_enabled)
        if self.enable_expert_bias and self.training and counting_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert.add_(counts)
        return Routing(idx, top, counts, logits, scores, token_mask)


@torch.no_grad()
def update_expert_bias(module: nn.Module, group=None) -> None:
    """Auxiliary-loss-free balancing step (DeepSeek-V3; Megatron's ``get_updated_expert_bias``) for every
    :class:`TopKRouter` with ``enable_expert_bias`` in ``module``: sum the routes counted since the last call over
    ``group``, then ``expert_bias += rate * sign(mean - count)`` per expert, and clear the counts. One all-reduce
    for all routers; device code only, capturable.

    ``group`` must hold the ranks whose routers are the same layers: the data-, expert-, context- and
    tensor-parallel ranks of one pipeline stage (Megatron's TP x DP x CP group). Default: that group from
    :mod:`moe_graph.parallel_state` when it is initialized, else the whole world (when torch.distributed is
    initialized; no pipeline parallelism then)."""
    routers = [m for m in module.modules() if isinstance(m, TopKRouter) and m.enable_expert_bias]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])  # [layers, E]
    if group is None:
        if ps.model_parallel_is_initialized():
            group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if dist.is_available() and dist.is_initialized() and (group is not None or dist.get_world_size() > 1):
        dist.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for r, off in zip(routers, offset.unbind(0)):
        r.expert_bias.add_(torch.sign(off), alpha=r.expert_bias_update_rate)
        r.local_tokens_per_expert.zero_()


def aux_loss_scores(scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores the load-balancing losses use (Megatron-core's): the softmax scores, or the elementwise (sigmoid,
    sqrtsoftplus) scores normalized to sum 1 per token (so that perfect balance gives 1.0 for all)."""
    if score_func != "softmax":
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return scores


def sequence_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                      token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss on ``[B, S, E]`` scores / routing map: per sequence
    ``sum_e f_e * P_e`` with ``f_e = E / (S * K) * (routes of the sequence to e)`` and ``P_e`` the mean score of
    ``e`` over the sequence, averaged over the ``B`` sequences; 1.0 for perfect balance. ``token_mask`` ``[B, S]``
    (1: real token): ``S`` counts the real tokens of each sequence, sequences without any are left out.
    Device-only, no sync."""
    B, S, E = scores.shape
    m = scores.new_ones(B, S) if token_mask is None else token_mask.to(scores.dtype)
    n = m.sum(1, keepdim=True)  # [B, 1] real tokens per sequence
    f = routing_map.to(scores.dtype).sum(1) * E / (n * topk).clamp(min=1)  # [B, E]
    p = (scores * m[..., None]).sum(1) / n.clamp(min=1)
    per_seq = (f * p).sum(1)
    has = (n[:, 0] > 0).to(scores.dtype)
    return (per_seq * has).sum() / has.sum().clamp(min=1)


def router_z_loss(logits: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ST-MoE router z-loss ``mean(logsumexp(logits)^2)`` over the (real, with ``token_mask``) tokens (scale it
    by the coefficient)."""
    z = torch.logsumexp(logits, dim=-1).square()
    if token_mask is None:
        return z.mean()
    m = token_mask.to(z.dtype)
    return (z * m).sum() / m.sum().clamp(min=1)


class RouterLoss:
    """The router losses of one MoE layer, weighted by their coefficients (0: off; computed in training mode only).

    ``aux_loss_type``: ``"local"`` (:func:`router_aux_loss` over this rank's tokens), ``"global"`` (expert
    fractions from the EP group's counts: global-batch balancing) or ``"sequence"`` (:func:`sequence_aux_loss`;
    the tokens must form ``[B, S]`` or, with ``sequence_dim=0``, ``[S, B]``). Scores are normalized per token for
    these losses (:func:`aux_loss_scores`). ``z_loss_coeff`` weights :func:`router_z_loss`."""

    def __init__(self, topk: int, score_func: str, aux_loss_coeff: float = 0.0, aux_loss_type: str = "local",
                 sequence_dim: int = 1, z_loss_coeff: float = 0.0):
        check_loss_options(aux_loss_type, sequence_dim)
        self.topk, self.score_func = topk, score_func
        self.aux_loss_coeff, self.aux_loss_type = float(aux_loss_coeff), aux_loss_type
        self.sequence_dim, self.z_loss_coeff = sequence_dim, float(z_loss_coeff)

    def __call__(self, routing: Routing, input_shape: Sequence[int], tokens_per_expert: Optional[torch.Tensor] = None
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(aux, z)``: the weighted losses (``None`` when off) of the router's :class:`Routing` of ``T`` tokens;
        ``input_shape``: the layer input's shape ``[..., H]`` (``T`` tokens before ``H``); ``tokens_per_expert``
        ``[E]``: the EP group's counts (``"global"``)."""
        aux = z = None
        token_shape = tuple(input_shape[:-1])
        token_mask = routing.token_mask
        if self.aux_loss_coeff > 0:
            scores = routing.scores if routing.scores is not None else router_scores(routing.logits, self.score_func)
            sc = aux_loss_scores(scores, self.score_func)
            if self.aux_loss_type == "sequence":
                if len(token_shape) != 2:
                    raise ValueError(f"aux_loss_type='sequence' needs a [B, S, H] or [S, B, H] input, got shape "
                                     f"{tuple(input_shape)}")
                rm = routing_map(routing.indices, sc.shape[-1], token_mask)
                sc, rm = sc.view(*token_shape, -1), rm.view(*token_shape, -1)
                m = token_mask.view(*token_shape) if token_mask is not None else None
                if self.sequence_dim == 0:
                    sc, rm = sc.transpose(0, 1), rm.transpose(0, 1)
                    m = m.transpose(0, 1) if m is not None else None
                aux = self.aux_loss_coeff * sequence_aux_loss(sc, rm, self.topk, m)
            else:
                counts = tokens_per_expert if self.aux_loss_type == "global" else routing.counts
                aux = self.aux_loss_coeff * router_aux_loss(sc, None, self.topk, counts, token_mask)
        if self.z_loss_coeff > 0:
            z = self.z_loss_coeff * router_z_loss(routing.logits, token_mask)
        return aux, z
