"""``MoELayer``: router -> echo planner + rerouting -> static token dispatcher -> grouped MLP -> combine.

Everything in :meth:`MoELayer.forward` and its backward is device tensor code with static shapes: top-k routing,
the aux load-balancing loss, the all-gather of the per-rank expert counts, the echo plan
(:mod:`moe_graph.moe.echo_planner`), the expert-weight dispatch to spare slots (:mod:`moe_graph.moe.echo`), the fixed-split
all-to-all (:mod:`moe_graph.moe.token_dispatcher`) and the grouped GEMMs with ``m_splits`` on the device. No host sync, so a
whole training step can be captured in one CUDA graph (:mod:`moe_graph.cuda_graph`).

Layout: ``R`` EP ranks (the ``ep_group``), ``E`` experts, ``L = E // R`` home experts per rank (expert ``e`` on
rank ``e // L``), ``k`` spare (echo) slots per rank. The rank's grouped GEMMs run over ``L + k`` local experts:
its home experts' weights, then copies of the home experts the plan put in its spare slots. Expert parameters are
marked ``param.allreduce = False`` (Megatron's convention, used by :class:`moe_graph.distributed.ddp.DistributedDataParallel`).

Weight gradients: when both expert weights carry ``main_grad`` (:class:`moe_graph.distributed.ddp.DistributedDataParallel`
attaches views into its grad buffer), the expert GEMMs take a fused path: wgrad goes straight into ``main_grad``
(``grad_added_to_main_grad = True``, zero gradients returned to autograd so the DDP hooks fire but add nothing).
With echo, each GEMM's backward runs one ``grouped_gemm_wgrad`` with the per-expert accumulate mask (home experts
accumulate into ``main_grad``, spare slots overwrite static spare-gradient buffers) and then sends the spare
slots' gradients home and adds them into ``main_grad`` before the weight's DDP hook runs. Without ``main_grad``
the gradients reach ``.grad`` through ordinary autograd.

Statistics (device tensors, no sync until read): ``last_aux_loss``, ``last_z_loss``, ``last_load_before`` /
``last_load_after`` (``[R]`` tokens each EP rank's experts receive without / with echo, identical on every rank),
``last_tokens_per_expert`` (``[E]`` global), ``last_m_splits`` (``[L + k]`` rows per local expert) of the last
forward, and the dispatcher's cumulative drop counter. They are non-persistent buffers written in place, so a
reference stays valid across forwards, ``.to()``-free training, and CUDA graph captures: the training and the
validation graph both write the same tensors, and whichever replayed last is what they hold.
:meth:`MoELayer.statistics` names them; :func:`moe_statistics` stacks them over a model (device tensors, no sync)
and :func:`read_moe_statistics` copies them to the host (the one sync, off the hot path). Drops are statistics, not
errors: ``moe_graph.check_errors()`` never raises on them.

Example (one process)::

    layer = MoELayer(64, 128, num_experts=8, topk=2, device="cpu")
    y = layer(x)                  # [..., 64]; the aux loss (if any) flows into backward through y
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import checkpoint
from moe_graph.grouped_linear import GroupedLinear
from moe_graph.moe import echo_planner as P
from moe_graph.moe.echo import (
    PLAN_MODES,
    EchoExpertDispatcher,
    LocalBackend,
    dispatch_spare_weights,
    echo_buffer_bytes,
    echo_grouped_gemm,
    spare_grad_buffers,
    wgrad_accumulate_mask,
)
from moe_graph.moe.token_dispatcher import (
    TokenDispatcher,
    capacity_for,
    counting_enabled,
    expert_columns,
    topk_from_routing_map,
)
from moe_graph.ops.grouped_gemm import _grouped_gemm_autograd, grouped_gemm
from moe_graph.ops.reroute import native_available, reroute_tokens

__all__ = ["MoEAuxLossAutoScaler", "MoELayer", "TopKRouter", "aux_loss_scores", "group_limited_topk", "moe_statistics",
           "read_moe_statistics", "router_aux_loss", "router_z_loss", "sequence_aux_loss", "set_aux_loss_scale",
           "update_expert_bias"]


def router_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                    tokens_per_expert: Optional[torch.Tensor] = None,
                    token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Switch-transformer load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: fraction of the routes that go
    to expert ``e``, ``P_e``: mean score of ``e`` over the local tokens); 1.0 for perfect balance. With
    ``tokens_per_expert`` (e.g. counts summed over the EP group: global-batch balancing, as Qwen3 trains) ``f``
    comes from those counts instead of the local ``routing_map``. ``token_mask`` ``[T]`` (1: real token, 0:
    padding, whose routes must already be off the map): means over the real tokens only. Device-only, no sync."""
    T, E = scores.shape
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

    _scales: dict = {}  # device -> 0-dim fp32 tensor (static address: a captured graph reads the current value)
    _default = 1.0

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
        return MoEAuxLossAutoScaler.apply(out, aux * MoEAuxLossAutoScaler.loss_scale(aux.device).to(aux.dtype))

    @staticmethod
    def loss_scale(device) -> torch.Tensor:
        """The 0-dim fp32 device tensor holding the aux-loss gradient scale on ``device``."""
        device = torch.device(device)
        t = MoEAuxLossAutoScaler._scales.get(device)
        if t is None:
            t = torch.full((), MoEAuxLossAutoScaler._default, dtype=torch.float32, device=device)
            MoEAuxLossAutoScaler._scales[device] = t
        return t

    @staticmethod
    def set_loss_scale(scale) -> None:
        """Set the aux/z-loss gradient scale: a Python number, or a 0-dim / one-element device tensor (e.g.
        ``loss_scaler.scale / num_microbatches``; copied in place, no host sync, capturable)."""
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"set_loss_scale: scale must have one element, got shape {tuple(scale.shape)}")
            scale = scale.detach().reshape(())
            MoEAuxLossAutoScaler.loss_scale(scale.device).copy_(scale)
            for dev, t in MoEAuxLossAutoScaler._scales.items():
                if dev != scale.device:
                    t.copy_(scale)
            return
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"set_loss_scale: scale must be finite, got {scale}")
        MoEAuxLossAutoScaler._default = scale
        for t in MoEAuxLossAutoScaler._scales.values():
            t.fill_(scale)


def set_aux_loss_scale(scale) -> None:
    """Module-level alias of :meth:`MoEAuxLossAutoScaler.set_loss_scale`."""
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """DeepSeek-V3's device/node-limited routing: experts form ``num_groups`` consecutive groups; a group's score
    is the sum of its ``topk // group_topk`` best scores; each token picks its ``group_topk`` best groups and then
    its ``topk`` best experts among those groups. Returns ``(values [T, topk], indices [T, topk])``."""
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(-1)  # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(T, E)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


class TopKRouter(nn.Module):
    """Linear gate + softmax or sigmoid scores + top-k, with the routing options of DeepSeek-V3/Qwen3-style models
    (Megatron-core's ``moe_router_*`` semantics).

    ``score_func="softmax"``: probabilities = the top-k softmax scores (renormalized to sum 1 when
    ``norm_topk_prob``). ``"sigmoid"`` (DeepSeek-V3): the top-k sigmoid scores, renormalized to sum 1 when
    ``topk > 1``.

    * ``num_groups`` / ``group_topk``: group-limited routing (:func:`group_limited_topk`).
    * ``scaling_factor``: multiplies the probabilities (DeepSeek-V3's ``routed_scaling_factor`` 2.5).
    * ``router_dtype`` (``torch.float32`` / ``torch.float64``): run the gate GEMM in that precision (Megatron's
      ``moe_router_dtype``; by default the GEMM runs in the input dtype and the logits are upcast to fp32).
    * ``enable_expert_bias`` (sigmoid only): auxiliary-loss-free balancing. A buffer ``expert_bias [E]`` is added
      to the scores for the *selection* only (the probabilities use the unbiased scores); each training-mode forward
      (once, also under activation recomputation) adds this rank's routes per expert to the buffer ``local_tokens_per_expert``, and
      :func:`update_expert_bias` (after the optimizer step) moves the bias by ``expert_bias_update_rate`` towards
      balance and clears the counts. All of it is device code without host syncs (capturable).

    Returns ``(routing_map [T, E] bool, probs [T, E] (zero off the map), scores [T, E])``; ``last_logits`` keeps
    the fp32 logits of the last call (the z-loss of :class:`MoELayer` uses them).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, score_func: str = "softmax",
                 norm_topk_prob: bool = False, device=None, dtype=None, *, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None, scaling_factor: Optional[float] = None,
                 enable_expert_bias: bool = False, expert_bias_update_rate: float = 1e-3,
                 router_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
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
        if enable_expert_bias and score_func != "sigmoid":
            raise ValueError("enable_expert_bias (auxiliary-loss-free balancing) needs score_func='sigmoid'")
        self.num_experts, self.topk, self.score_func = num_experts, topk, score_func
        self.norm_topk_prob = norm_topk_prob or (score_func == "sigmoid" and topk > 1)
        self.num_groups, self.group_topk = num_groups, group_topk
        self.scaling_factor = scaling_factor
        self.enable_expert_bias = bool(enable_expert_bias)
        self.expert_bias_update_rate = float(expert_bias_update_rate)
        if router_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"router_dtype must be None, torch.float32 or torch.float64, got {router_dtype}")
        self.router_dtype = router_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        if self.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(num_experts, device=device, dtype=torch.float32), persistent=False)
        self.last_logits = None

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        if self.num_groups is not None:
            return group_limited_topk(scores, self.topk, self.num_groups, self.group_topk)[1]
        return torch.topk(scores, self.topk, dim=-1)[1]

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``x`` ``[T, H]``; ``padding_mask`` ``[T]`` bool (True: a padding token, which gets no route)."""
        if self.router_dtype is not None:  # Megatron's moe_router_dtype: the gate GEMM itself in fp32 / fp64
            logits = F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))
        else:
            logits = F.linear(x, self.weight)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 scores (fp64 stays fp64)
        self.last_logits = logits
        scores = torch.softmax(logits, -1) if self.score_func == "softmax" else torch.sigmoid(logits)
        if self.enable_expert_bias:
            idx = self._select(scores.detach() + self.expert_bias.to(scores.dtype))
        else:
            idx = self._select(scores)
        top = scores.gather(1, idx)
        if self.norm_topk_prob:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        if self.scaling_factor:
            top = top * self.scaling_factor
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
        probs = torch.zeros_like(scores).scatter(1, idx, top)
        if padding_mask is not None:
            real = ~padding_mask.reshape(-1, 1).to(torch.bool)
            routing_map = routing_map & real
            probs = probs * real.to(probs.dtype)
        # training forwards count (also the no-grad first pass of a reentrant checkpoint); its recomputation
        # inside backward does not (counting_enabled)
        if self.enable_expert_bias and self.training and counting_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert.add_(routing_map.sum(0).to(torch.float32))
        return routing_map, probs, scores


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
    """Scores the load-balancing losses use (Megatron-core's): the softmax scores, or the sigmoid scores
    normalized to sum 1 per token (so that perfect balance gives 1.0 for both)."""
    if score_func == "sigmoid":
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


def _moe_layers(module: nn.Module):
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"{type(module).__name__} contains no MoELayer")
    return layers


def moe_statistics(module: nn.Module) -> dict:
    """Statistics of every :class:`MoELayer` in ``module`` (in ``module.modules()`` order), stacked per layer on the
    device: ``dropped_routes [layers]`` (cumulative), ``tokens_per_expert [layers, E]``, ``load_before`` /
    ``load_after [layers, R]``, ``m_splits [layers, L + k]``, ``aux_loss`` / ``z_loss [layers]``. Device ops only:
    no sync, capturable (the result of a captured call is a graph output, refreshed by every replay). A statistic
    whose shape differs between layers comes back as a list of per-layer tensors."""
    per_layer = [m.statistics() for m in _moe_layers(module)]
    out = {}
    for key in per_layer[0]:
        ts = [st[key] for st in per_layer]
        same = all(t.shape == ts[0].shape and t.dtype == ts[0].dtype and t.device == ts[0].device for t in ts)
        out[key] = torch.stack(ts) if same else ts
    return out


def read_moe_statistics(module: nn.Module, reset: bool = False) -> dict:
    """:func:`moe_statistics` on the host as Python lists per layer (ints for counts, floats for losses), read with
    one device-to-host copy per device: the one call that syncs, by design (off the hot path, e.g. every N
    iterations). ``reset=True`` then zeroes the cumulative counters (:meth:`MoELayer.reset_statistics`)."""
    layers = _moe_layers(module)
    per_layer = [m.statistics() for m in layers]
    by_device: dict = {}
    for st in per_layer:
        for t in st.values():
            by_device.setdefault(t.device, []).append(t.reshape(-1).to(torch.float64))  # counts < 2**53: exact
    host = {dev: iter(torch.cat(ts).cpu().split([t.numel() for t in ts])) for dev, ts in by_device.items()}
    out = {key: [] for key in per_layer[0]}
    for st in per_layer:
        for key, t in st.items():
            vals = next(host[t.device])
            vals = vals.to(t.dtype) if not t.is_floating_point() else vals
            out[key].append(vals.view(t.shape).tolist())
    if reset:
        for m in layers:
            m.reset_statistics()
    return out


def _all_gather_counts(local: torch.Tensor, group, R: int) -> torch.Tensor:
    if R == 1:
        return local.unsqueeze(0)
    out = torch.empty((R,) + tuple(local.shape), dtype=local.dtype, device=local.device)
    if local.is_cuda:
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    else:
        dist.all_gather(list(out.unbind(0)), local.contiguous(), group=group)
    return out


def _resolve_ep(ep_group, ep_size):
    """``(ep_group, ep_size)`` with the defaults of :class:`MoELayer` (see its ``ep_group`` argument)."""
    dist_on = dist.is_available() and dist.is_initialized()
    if ep_size is not None and (not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1):
        raise ValueError(f"ep_size must be an int >= 1 or None, got {ep_size!r}")
    if ep_group is not None:
        size = dist.get_world_size(ep_group)
        if ep_size is not None and ep_size != size:
            raise ValueError(f"ep_size={ep_size} does not match the size {size} of ep_group")
        return ep_group, size
    if ep_size is not None:
        world = dist.get_world_size() if dist_on else ep_size  # no torch.distributed: MoELayer raises for R > 1
        if ep_size not in (1, world):
            raise ValueError(f"ep_size={ep_size} without ep_group: pass the EP process group (ep_size must be 1 or "
                             f"the world size {world} to use the default group)")
        return None, ep_size

    if ps.model_parallel_is_initialized():
        group = ps.get_expert_model_parallel_group()
        return group, dist.get_world_size(group)
    if dist_on and dist.get_world_size() > 1:
        raise ValueError(
            f"MoELayer: torch.distributed runs {dist.get_world_size()} ranks but neither ep_group/ep_size nor "
            "moe_graph.parallel_state is set, so the expert-parallel layout is ambiguous: call "
            "parallel_state.initialize_model_parallel(expert_model_parallel_size=...), or pass ep_size=1 (every rank "
            "holds all experts) or ep_group=<the EP group>")
    return None, 1


class MoELayer(nn.Module):
    """Mixture-of-experts MLP with expert parallelism, echo balancing and static buffers.

    Args:
        hidden_size, ffn_hidden_size: ``H``, ``F`` (per expert).
        num_experts: ``E`` (global). topk: routes per token.
        score_func: ``"softmax"`` or ``"sigmoid"``. norm_topk_prob: renormalize the top-k softmax probabilities.
        num_groups, group_topk, topk_scaling_factor, enable_expert_bias, expert_bias_update_rate, router_dtype:
            router options (:class:`TopKRouter`; group-limited routing, scaled probabilities, auxiliary-loss-free
            balancing with :func:`update_expert_bias` after each optimizer step, gate GEMM precision).
        activation: ``"swiglu"`` (fc1 is ``[2F, H]``) or ``"gelu"``.
        aux_loss_coeff: weight of the load-balancing loss (0: off); its gradient flows through the output, times
            the factor of :meth:`MoEAuxLossAutoScaler.set_loss_scale` (``loss_scale / num_microbatches``, set for
            you by :func:`moe_graph.train.step.train_step` and the pipeline schedules).
        aux_loss_type: ``"local"`` (expert fractions of this rank's tokens), ``"global"`` (fractions of all the
            EP group's tokens, from the counts the echo planner all-gathers anyway: global-batch balancing) or
            ``"sequence"`` (DeepSeek-V3's sequence-wise loss, :func:`sequence_aux_loss`; the input must be
            ``[B, S, H]``, or ``[S, B, H]`` with ``sequence_dim=0``). Sigmoid scores are normalized per token
            for these losses (:func:`aux_loss_scores`).
        z_loss_coeff: weight of the router z-loss (:func:`router_z_loss`; 0: off), attached the same way.
        ep_group, ep_size: the EP process group and its size ``R``. Defaults: with both ``None``, the expert-model-
            parallel group of :mod:`moe_graph.parallel_state` when it is initialized, else ``R = 1`` in a single
            process; with torch.distributed initialized on several ranks and no parallel_state the setup is
            ambiguous and refused (pass ``ep_size=1`` for experts replicated on every rank, or ``ep_group``).
            ``ep_group`` alone: ``R`` is its size. ``ep_size`` alone: ``1``, or the world size (``ep_group`` then
            is the default group).
        num_spare_experts_per_ep_rank: echo slots ``k`` (0: echo off). assignment: the planner's assignment.
        echo_donors: ``w``, donor-constrained echo: a rank's spare slots host only experts of its ``w`` fixed donor
            ranks (:func:`moe_graph.moe.echo_planner.donor_ranks`, ring pattern), so the weight exchange is ``w`` peer blocks
            and its memory ``O(w*k*N)`` instead of ``O(R*k*N)`` (:func:`moe_graph.moe.echo.echo_buffer_bytes`);
            ``None`` (default) or ``>= ep_size``: unconstrained (today's all-to-all).
        echo_plan_mode: ``"microbatch"`` (default: plan and move weights in every forward) or ``"iteration"``:
            plan and move the weights only in the forward called with ``is_first_microbatch=True`` (or ``None``),
            and reuse that placement in the forwards with ``is_first_microbatch=False``
            (:func:`moe_graph.moe.echo_planner.reuse_plan`: the slots keep their experts, their token amounts follow the
            microbatch's counts). The plan and the spare copies live in static buffers (graph-safe). Not with
            ``recompute`` (a recomputed first microbatch would rewrite buffers later microbatches saved).
        capacity_factor: per (source, destination) rank capacity ``ceil(cf * T * K / R)`` routes; ``None``:
            dropless (``T * K`` rows from each rank, ``R`` times the memory).
        shared_expert_ffn_size: hidden size of a shared expert (an MLP with the same activation that every token
            goes through, added to the routed output, as DeepSeek-V3 and Qwen2-MoE have; ``None``: none).
            shared_expert_gate: scale the shared expert's output by ``sigmoid(x @ w_gate)`` per token (Qwen2-MoE).
        token_drop_policy: ``"probs"`` (drop the least probable routes over the capacity, Megatron's default) or
            ``"position"`` (drop the last ones in token order); see :class:`moe_graph.moe.token_dispatcher.TokenDispatcher`.
        params_dtype, device: of all parameters. init_std: expert weight init.
        recompute: activation recomputation of the whole layer in training (its activations are not kept; backward
            runs the forward again) through :func:`moe_graph.cuda_graph.checkpoint`, the graph-safe recompute, so a
            captured step may contain it. The layer draws no random numbers, so no RNG state is carried. The
            statistics and counters count every token once.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        topk: int = 2,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = False,
        activation: str = "swiglu",
        aux_loss_coeff: float = 0.0,
        aux_loss_type: str = "local",
        sequence_dim: int = 1,
        z_loss_coeff: float = 0.0,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        topk_scaling_factor: Optional[float] = None,
        enable_expert_bias: bool = False,
        expert_bias_update_rate: float = 1e-3,
        router_dtype: Optional[torch.dtype] = None,
        ep_group=None,
        ep_size: Optional[int] = None,
        num_spare_experts_per_ep_rank: int = 0,
        assignment: str = "auto",
        echo_donors: Optional[int] = None,
        echo_plan_mode: str = "microbatch",
        capacity_factor: Optional[float] = None,
        token_drop_policy: str = "probs",
        shared_expert_ffn_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        init_std: float = 0.02,
        recompute: bool = False,
    ):
        super().__init__()

        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation must be 'swiglu' or 'gelu', got {activation!r}")
        ep_group, ep_size = _resolve_ep(ep_group, ep_size)
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP size {ep_size}")
        if ep_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"ep_size={ep_size} needs an initialized torch.distributed")
        if num_spare_experts_per_ep_rank < 0:
            raise ValueError(f"num_spare_experts_per_ep_rank must be >= 0, got {num_spare_experts_per_ep_rank}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.topk = num_experts, topk
        self.activation = activation
        self.aux_loss_coeff = float(aux_loss_coeff)
        if aux_loss_type not in ("local", "global", "sequence"):
            raise ValueError(f"aux_loss_type must be 'local', 'global' or 'sequence', got {aux_loss_type!r}")
        if sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim must be 0 ([S, B, H] input) or 1 ([B, S, H]), got {sequence_dim}")
        self.aux_loss_type = aux_loss_type
        self.sequence_dim = sequence_dim
        self.z_loss_coeff = float(z_loss_coeff)
        self.ep_group = ep_group
        self.R = ep_size
        self.ep_rank = dist.get_rank(ep_group) if ep_size > 1 else 0
        self.L = num_experts // ep_size
        self.k = num_spare_experts_per_ep_rank
        self.assignment = assignment

        if echo_plan_mode not in PLAN_MODES:
            raise ValueError(f"echo_plan_mode must be one of {PLAN_MODES}, got {echo_plan_mode!r}")
        if echo_plan_mode == "iteration" and recompute and self.k > 0:
            raise ValueError("echo_plan_mode='iteration' cannot be combined with recompute=True")
        self.echo_plan_mode = echo_plan_mode
        if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
                                            or not 0 < capacity_factor < float("inf")):
            raise ValueError(f"capacity_factor must be a finite number > 0 or None (dropless), got {capacity_factor!r}")
        self.capacity_factor = capacity_factor
        self.recompute = bool(recompute)
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")

        self.router = TopKRouter(hidden_size, num_experts, topk, score_func, norm_topk_prob, device=device, dtype=dtype,
                                 num_groups=num_groups, group_topk=group_topk, scaling_factor=topk_scaling_factor,
                                 enable_expert_bias=enable_expert_bias,
                                 expert_bias_update_rate=expert_bias_update_rate, router_dtype=router_dtype)
        init = lambda t: nn.init.normal_(t, std=init_std)  # noqa: E731
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.fc1 = GroupedLinear(self.L, hidden_size, fc1_out, bias=False, params_dtype=dtype, device=device,
                                 init_method=init, single_grouped_weight=True)
        self.fc2 = GroupedLinear(self.L, ffn_hidden_size, hidden_size, bias=False, params_dtype=dtype, device=device,
                                 init_method=lambda t: nn.init.normal_(t, std=init_std / math.sqrt(2)),
                                 single_grouped_weight=True)
        for p in list(self.fc1.parameters()) + list(self.fc2.parameters()):
            p.allreduce = False  # expert parameters: reduced over the expert-data-parallel group
        self.shared_expert = None
        if shared_expert_ffn_size:  # dense parameters (reduced over the data-parallel group like any other)
            fs = shared_expert_ffn_size
            self.shared_expert = nn.ModuleDict({
                "fc1": nn.Linear(hidden_size, 2 * fs if activation == "swiglu" else fs, bias=False, device=device,
                                 dtype=dtype),
                "fc2": nn.Linear(fs, hidden_size, bias=False, device=device, dtype=dtype),
            })
            nn.init.normal_(self.shared_expert["fc1"].weight, std=init_std)
            nn.init.normal_(self.shared_expert["fc2"].weight, std=init_std / math.sqrt(2))
            if shared_expert_gate:
                self.shared_expert["gate"] = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype)
                nn.init.normal_(self.shared_expert["gate"].weight, std=init_std)
        elif shared_expert_gate:
            raise ValueError("shared_expert_gate needs shared_expert_ffn_size")

        col_rank, col_local = expert_columns(num_experts, ep_size, self.k)
        self.dispatcher = TokenDispatcher(self.L + self.k, ep_size, self.ep_rank, col_rank, col_local,
                                          capacity=None, group=ep_group, drop_policy=token_drop_policy,
                                          device=device)  # its constant tables are built here, on the device
        self.echo = None
        if self.k > 0:
            backend = LocalBackend() if ep_size == 1 else None
            self.echo = EchoExpertDispatcher(num_experts, ep_size, self.ep_rank, self.k, backend=backend,
                                             group=ep_group, donors=echo_donors if ep_size > 1 else None,
                                             device=device)
            dm = self.echo.donor_mask
            self.register_buffer("_echo_donor_mask", dm.to(device) if dm is not None else None, persistent=False)
            if echo_plan_mode == "iteration":  # the iteration's plan and spare copies (written in place)
                S = ep_size * self.k
                for name, shape, dt in (("_echo_ref_h2s", (num_experts, S), torch.int64),
                                        ("_echo_ref_load", (num_experts,), torch.int64),
                                        ("_echo_ref_omap", (num_experts, S), torch.bool),
                                        ("_echo_spare", (self.k, self.fc1.weight[0].numel()
                                                         + self.fc2.weight[0].numel()), dtype)):
                    self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)
            if ep_size > 1:
                _ = self.echo.backend  # probe the process group now, never during capture
        self._reuse = False  # set by each _forward: it reuses the iteration's plan
        # statistics: non-persistent buffers written in place by every forward (see the module docstring)
        loss_dtype = router_dtype if router_dtype is not None else torch.promote_types(dtype, torch.float32)
        for name, shape, dt in (("last_aux_loss", (), loss_dtype), ("last_z_loss", (), loss_dtype),
                                ("last_load_before", (ep_size,), torch.int64),
                                ("last_load_after", (ep_size,), torch.int64),
                                ("last_tokens_per_expert", (num_experts,), torch.int64),
                                ("last_m_splits", (self.L + self.k,), torch.int64)):
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)

    # --------------------------------------------------------------------------------------- statistics --
    def _stat(self, name: str, value: torch.Tensor) -> None:
        """Writes statistic buffer ``name`` in place (a device copy: no sync, capturable, identity kept)."""
        with torch.no_grad():
            getattr(self, name).copy_(value)

    def statistics(self) -> dict:
        """This layer's statistics: the device buffers themselves (no copy, no sync; the same tensors every call).
        ``dropped_routes`` (0-dim int64, cumulative since :meth:`reset_statistics`), and of the last forward:
        ``tokens_per_expert [E]``, ``load_before [R]``, ``load_after [R]``, ``m_splits [L + k]``, ``aux_loss``,
        ``z_loss`` (0 while the loss is off)."""
        return {"dropped_routes": self.dispatcher.dropped_routes, "tokens_per_expert": self.last_tokens_per_expert,
                "load_before": self.last_load_before, "load_after": self.last_load_after,
                "m_splits": self.last_m_splits, "aux_loss": self.last_aux_loss, "z_loss": self.last_z_loss}

    def echo_buffer_bytes(self, num_microbatches: int = 1) -> dict:
        """Static echo buffer bytes of this layer (:func:`moe_graph.moe.echo.echo_buffer_bytes` for its ``E, R, k, w``,
        both expert weights, their dtype and fp32 gradients); all zeros with echo off."""
        if self.echo is None:
            return {"total": 0}
        w1, w2 = self.expert_weights()
        n = (w1[0].numel() + w2[0].numel()) if self.L else 0
        return echo_buffer_bytes(self.num_experts, self.R, self.k, self.echo.w if self.echo.donors else None, n,
                                 w1.dtype, num_microbatches=num_microbatches)

    def reset_statistics(self) -> None:
        """Zeroes the cumulative counters (the drop counter) in place: a device op, no sync, capturable."""
        self.dispatcher.reset_drop_counter()

    # ------------------------------------------------------------------------------------------ helpers --
    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            a, b = h.chunk(2, dim=-1)
            return F.silu(a) * b
        return F.gelu(h)

    def expert_weights(self):
        """``(fc1 [L, fc1_out, H], fc2 [L, H, F])``: this rank's home expert weights."""
        return self.fc1.weight, self.fc2.weight

    def _plan(self, routing_map, probs):
        """Echo plan from the all-gathered counts: rerouted map/probs ``[T, E+S]``, ``offloading_map [E, S]``."""
        counts = _all_gather_counts(routing_map.sum(0).to(torch.int64), self.ep_group, self.R)  # [R, E]
        self._stat("last_tokens_per_expert", counts.sum(0))
        self._stat("last_load_before", P.rank_loads(counts))
        if self.k == 0:
            self._stat("last_load_after", self.last_load_before)
            return routing_map, probs, None
        if self._reuse:  # the iteration's placement, amounts for this microbatch's counts
            h2s, alloc = P.reuse_plan(counts, self._echo_ref_h2s, self._echo_ref_load)
            omap = self._echo_ref_omap
        else:
            # the whole plan in one native op (moe_graph::echo_plan; the torch functions without the extension)
            h2s, alloc = P.gen_plan(counts, self.k, self.assignment, donor_mask=self._echo_donor_mask)  # [E,S],[R,S]
            omap = h2s > 0
            if self.echo_plan_mode == "iteration":
                with torch.no_grad():
                    self._echo_ref_h2s.copy_(h2s)
                    self._echo_ref_load.copy_(counts.sum(0))
                    self._echo_ref_omap.copy_(omap)
        try:
            native = native_available()
        except ImportError:  # pragma: no cover
            native = False
        if native:
            new_map, new_probs = reroute_tokens(routing_map, probs, alloc[self.ep_rank], omap)
        else:  # pragma: no cover
            new_map, new_probs = P.reroute_tokens_torch(routing_map, probs, alloc[self.ep_rank], omap)
        R, E, k = self.R, self.num_experts, self.k
        self._stat("last_load_after", self.last_load_before - h2s.sum(1).view(R, E // R).sum(1)
                   + h2s.sum(0).view(R, k).sum(1))
        return new_map, new_probs, omap

    def _use_fused_wgrad(self) -> bool:
        """Fused weight-gradient path: grad enabled, both expert weights need grad and have ``main_grad``
        (as :class:`moe_graph.distributed.ddp.DistributedDataParallel` attaches)."""
        if not torch.is_grad_enabled():
            return False
        ws = self.expert_weights()
        return all(w.requires_grad and getattr(w, "main_grad", None) is not None for w in ws)

    def _experts_autograd(self, expert_in, m_splits, omap):
        """Plain autograd: per-expert weight list (home views + spare copies); the weight gradients come back
        through autograd (spare slots' via :func:`moe_graph.moe.echo.dispatch_spare_weights`)."""
        w1, w2 = self.expert_weights()
        if self.echo is not None:
            s1, s2 = dispatch_spare_weights(self.echo, omap, [w1, w2], spare=self._spares(omap, w1, w2))
            # one 2-D weight per local expert (home views + spare copies): no concatenated copy of all weights
            w1 = list(w1.unbind(0)) + list(s1.to(w1.dtype).unbind(0))
            w2 = list(w2.unbind(0)) + list(s2.to(w2.dtype).unbind(0))
        mid = self._activation(grouped_gemm(expert_in, w1, m_splits))
        return grouped_gemm(mid, w2, m_splits)

    def _spares(self, omap, w1, w2):
        """Plan once per iteration: the iteration's spare copies (dispatched into the static buffers by its first
        microbatch); ``None`` in ``"microbatch"`` mode (every forward dispatches)."""
        if self.echo_plan_mode != "iteration":
            return None
        if not self._reuse:  # the dispatch writes straight into the static buffer
            return tuple(self.echo.dispatch(omap, [w1, w2], out=self._echo_spare))
        return tuple(self.echo._unpack(self._echo_spare, [w1, w2], self.k))

    def _echo_wgrad_state(self, w1, w2):
        """``(accumulate_mask [L+k], spare_grad_1 [k, ...], spare_grad_2 [k, ...])``: static device buffers,
        built on the first fused forward (warm-up, before any capture) and reused; rebuilt only if the
        ``main_grad`` dtype/device changes."""
        key = (w1.main_grad.dtype, w2.main_grad.dtype, w1.main_grad.device)
        st = getattr(self, "_fused_wgrad_state", None)
        if st is None or st[0] != key:
            mask = wgrad_accumulate_mask(self.L, self.k, device=w1.main_grad.device)
            b1 = spare_grad_buffers([w1], self.k, dtype=w1.main_grad.dtype)[0]
            b2 = spare_grad_buffers([w2], self.k, dtype=w2.main_grad.dtype)[0]
            st = (key, mask, b1, b2)
            self._fused_wgrad_state = st
        return st[1:]

    def _experts_fused(self, expert_in, m_splits, omap):
        """Weights with ``main_grad``: wgrad fused into ``main_grad`` (``grad_added_to_main_grad`` set, zero
        weight gradients returned). With echo, one ``grouped_gemm_wgrad`` per GEMM with the per-expert mask (home
        experts accumulate into ``main_grad``, spare slots overwrite their own buffers), then the spare slots'
        gradients are aggregated home into ``main_grad`` (:func:`moe_graph.moe.echo.echo_grouped_gemm`)."""
        w1, w2 = self.expert_weights()
        if self.echo is None:
            mid = self._activation(_grouped_gemm_autograd(expert_in, [w1], m_splits, True, None, True))
            return _grouped_gemm_autograd(mid, [w2], m_splits, True, None, True)

        mask, b1, b2 = self._echo_wgrad_state(w1, w2)
        s1, s2 = self._spares(omap, w1, w2) or self.echo.dispatch(omap, [w1, w2])  # detached copies
        mid = self._activation(echo_grouped_gemm(expert_in, w1, s1, m_splits, self.echo, omap, mask, b1))
        return echo_grouped_gemm(mid, w2, s2, m_splits, self.echo, omap, mask, b2)

    # ------------------------------------------------------------------------------------------ forward --
    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``x`` ``[..., H]`` (see :meth:`_forward`); with ``recompute`` and grad enabled, through
        :func:`moe_graph.cuda_graph.checkpoint`. ``is_first_microbatch``: with ``echo_plan_mode="iteration"``,
        ``False`` reuses the plan and spare weights of the iteration's first microbatch (``True``/``None``: plan
        afresh); ignored otherwise."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be a bool or None, got {type(is_first_microbatch).__name__}")
        reuse = self.echo is not None and self.echo_plan_mode == "iteration" and is_first_microbatch is False
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, padding_mask, preserve_rng_state=False)  # no random numbers here
        return self._forward(x, padding_mask, reuse)

    def _forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, reuse: bool = False) -> torch.Tensor:
        """``x`` ``[..., H]``. ``padding_mask`` (shape ``x.shape[:-1]``, bool, True: padding, as in Megatron):
        padding tokens get no route (zero routed output; the shared expert still sees them), and the planner
        counts, the losses and the expert-bias counts leave them out. ``reuse``: see :meth:`forward`."""
        self._reuse = reuse
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        if padding_mask is not None and tuple(padding_mask.shape) != tuple(lead):
            raise ValueError(f"padding_mask must have shape {tuple(lead)} (x without its last dimension), got "
                             f"{tuple(padding_mask.shape)}")
        h = x.reshape(-1, self.hidden_size)
        T = h.shape[0]
        cap = capacity_for(T, self.topk, self.R, self.capacity_factor)
        self.dispatcher.capacity = cap

        pad = padding_mask.reshape(-1) if padding_mask is not None else None
        real = (~pad.to(torch.bool)) if pad is not None else None
        routing_map, probs, scores = self.router(h, pad)
        new_map, new_probs, omap = self._plan(routing_map, probs)  # also all-gathers the per-expert counts

        aux = None
        if self.aux_loss_coeff > 0 and self.training:
            sc = aux_loss_scores(scores, self.router.score_func)
            if self.aux_loss_type == "sequence":
                if len(lead) != 2:
                    raise ValueError(f"aux_loss_type='sequence' needs a [B, S, H] or [S, B, H] input, got shape "
                                     f"{tuple(x.shape)}")
                sc, rm = sc.view(*lead, -1), routing_map.view(*lead, -1)
                m = real.view(*lead) if real is not None else None
                if self.sequence_dim == 0:
                    sc, rm = sc.transpose(0, 1), rm.transpose(0, 1)
                    m = m.transpose(0, 1) if m is not None else None
                aux = self.aux_loss_coeff * sequence_aux_loss(sc, rm, self.topk, m)
            else:
                counts = self.last_tokens_per_expert if self.aux_loss_type == "global" else None
                aux = self.aux_loss_coeff * router_aux_loss(sc, routing_map, self.topk, counts, real)
            self._stat("last_aux_loss", aux.detach())
        if self.z_loss_coeff > 0 and self.training:
            z = self.z_loss_coeff * router_z_loss(self.router.last_logits, real)
            self._stat("last_z_loss", z.detach())
            aux = z if aux is None else aux + z

        indices, top_probs, valid = topk_from_routing_map(new_map, new_probs, self.topk)
        expert_in, m_splits, handle = self.dispatcher.dispatch(h, indices, top_probs, valid)
        self._stat("last_m_splits", m_splits)

        expert_in = expert_in.to(self.fc1.weight.dtype)
        if self._use_fused_wgrad():
            expert_out = self._experts_fused(expert_in, m_splits, omap)
        else:
            expert_out = self._experts_autograd(expert_in, m_splits, omap)
        out = self.dispatcher.combine(expert_out, handle).to(x.dtype)
        if self.shared_expert is not None:
            se = self.shared_expert
            shared = se["fc2"](self._activation(se["fc1"](h)))
            if "gate" in se:
                shared = torch.sigmoid(se["gate"](h)) * shared
            out = out + shared.to(out.dtype)
        if aux is not None:
            out = MoEAuxLossAutoScaler.attach(out, aux)
        return out.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, experts={self.num_experts}, topk={self.topk}, "
                f"ep={self.R}, local={self.L}, spare={self.k}, capacity_factor={self.capacity_factor}, "
                f"activation={self.activation}")
