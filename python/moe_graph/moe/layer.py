"""``MoELayer``: router -> echo plan + rerouting -> token dispatcher -> grouped MLP -> combine.

The layer composes small pieces, each with its own module: :class:`moe_graph.moe.router.TopKRouter` and
:class:`moe_graph.moe.router.RouterLoss`, :class:`moe_graph.moe.echo_balancer.EchoBalancer` (plan, reroute, spare
weight copies), :class:`moe_graph.moe.token_dispatcher.TokenDispatcher` (fixed-split all-to-all) and
:class:`moe_graph.moe.experts.GroupedMLP` (+ :class:`moe_graph.moe.experts.SharedExpert`); its options are a
:class:`moe_graph.moe.config.MoEConfig`. Everything in :meth:`MoELayer.forward` and its backward is device tensor
code with static shapes (the per-rank expert counts are all-gathered on the device, the grouped GEMMs take
``m_splits`` on the device): no host sync, so a whole training step can be captured in one CUDA graph
(:mod:`moe_graph.cuda_graph`).

Layout (legend in :mod:`moe_graph.moe`): expert ``e`` lives on EP rank ``e // L``; each rank's grouped GEMMs run
over ``L + k`` local experts, its home experts, then the copies the plan put in its spare slots.

Statistics (device tensors, no sync until read): ``last_aux_loss``, ``last_z_loss``, ``last_load_before`` /
``last_load_after`` (``[R]`` tokens each EP rank's experts receive without / with echo, identical on every rank),
``last_tokens_per_expert`` (``[E]`` global), ``last_m_splits`` (``[L + k]`` rows per local expert) of the last
forward, and the dispatcher's cumulative drop counter. They are non-persistent buffers written in place, so a
reference stays valid across forwards, ``.to()``-free training, and CUDA graph captures: the training and the
validation graph both write the same tensors, and whichever replayed last is what they hold.
:meth:`MoELayer.statistics` names them; :func:`moe_statistics` stacks them over a model (device tensors, no sync)
and :func:`read_moe_statistics` copies them to the host (the one sync, off the hot path). Drops are statistics, not
errors: ``moe_graph.check_errors()`` never raises on them. With ``overflow="rerun"`` a route over the capacity is
not a statistic but a reason to redo the step: :func:`moe_graph.train.step.train_step` zeroes the per-step
counters (:func:`reset_step_counters`), reduces :func:`step_overflow` with the optimizer's inf/nan check and skips
the update, and :class:`moe_graph.train.step.OverflowRerun` reruns the step at :func:`step_max_load_ratio`.

Example (one process)::

    layer = MoELayer(64, 128, num_experts=8, topk=2, device="cpu")
    y = layer(x)                  # [..., 64]; the aux loss (if any) flows into backward through y
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import checkpoint
from moe_graph.moe.config import MoEConfig
from moe_graph.moe.echo_balancer import EchoBalancer
from moe_graph.moe.exchange import checksum_weights, flag_if_ranks_disagree
from moe_graph.moe.experts import GroupedMLP, SharedExpert
from moe_graph.moe.router import MoEAuxLossAutoScaler, RouterLoss, Routing, TopKRouter
from moe_graph.moe.token_dispatcher import TokenDispatcher, counting_enabled, expert_columns
from moe_graph.ops import fp8 as _fp8
from moe_graph.streams import SideStream, stage

__all__ = ["MoELayer", "moe_statistics", "read_moe_statistics", "moe_layers", "reset_step_counters", "step_overflow",
           "step_max_load_ratio"]


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


class _OutputRMSNorm(nn.Module):
    """The block output's RMSNorm (``output_norm="rmsnorm"``, A.X-K1's ``post_mlp_layernorm``): in fp32,
    ``weight * (y * rsqrt(mean(y^2) + eps))`` rounded to ``y``'s dtype before the weight, as transformers'
    ``RMSNorm``s do."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = float(eps)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        yf = y.float() if y.dtype != torch.float64 else y
        yf = yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * yf.to(y.dtype)


class _OffsetRMSNorm(nn.Module):
    """Muse-Spark's norms around the experts, weight ``w`` zero-initialized and applied as ``1 + w``, computed in
    fp32 (fp64 stays): ``"centered_rmsnorm"`` (``expert_input_norm``): ``rms_norm(y) * (1 + w)``;
    ``"scaled_rmsnorm"`` (``expert_output_norm``, per expert output row): ``rms_norm(y * (1 + w))``, the scaled row
    rounded to ``y``'s dtype before the norm, as transformers does. A zero row stays zero."""

    def __init__(self, width: int, eps: float, kind: str, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, device=device, dtype=dtype))
        self.eps, self.scale_first = float(eps), kind == "scaled_rmsnorm"

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        f = torch.float64 if y.dtype == torch.float64 else torch.float32
        scale = (1.0 + self.weight).to(f)
        yf = (y.to(f) * scale).to(y.dtype).to(f) if self.scale_first else y.to(f)
        yf = yf * torch.rsqrt(yf.square().mean(-1, keepdim=True) + self.eps)
        return (yf if self.scale_first else yf * scale).to(y.dtype)


class MoELayer(nn.Module):
    """Mixture-of-experts MLP with expert parallelism, echo balancing and static buffers.

    Args (router and loss names from :mod:`moe_graph.moe.router`):
        hidden_size, ffn_hidden_size: ``H``, ``F`` (per expert).
        num_experts: ``E`` (global). topk: routes per token.
        score_func: ``"softmax"`` or ``"sigmoid"``. norm_topk_prob: renormalize the top-k probabilities (``None``:
            on for sigmoid with ``topk > 1``, off for softmax, Megatron's rule; ``True``/``False`` for either).
        num_groups, group_topk, group_score_topk, topk_scaling_factor, router_bias, enable_expert_bias,
            expert_bias_update_rate, select_on, norm_topk_min, norm_topk_eps, router_dtype: router options
            (:class:`TopKRouter`;
            group-limited routing and its group score rule, scaled probabilities, a learned gate bias,
            auxiliary-loss-free balancing with :func:`update_expert_bias` after each optimizer step, the selection
            bias, the top-k on the scores or the logits, gate GEMM precision).
        activation: ``"swiglu"`` (fc1 is ``[2F, H]``), ``"clamped_swiglu"`` (GPT-OSS's, with ``swiglu_alpha`` and
            ``swiglu_limit``; fc1 ``[2F, H]``), ``"limited_swiglu"`` (``swiglu_limit``:
            DeepSeek-V4 / GLM5-Next / HY-V4), ``"post_clamped_swiglu"`` (``min(silu(g), L)``: Step-3.7),
            ``"softcapped_swiglu"`` (``swiglu_alpha``: the gate's cap, ``swiglu_limit``: the up half's: Inkling-2),
            ``"geglu_tanh"`` (Gemma 4), or the non-gated ``"gelu"``, ``"relu"``, ``"silu"``, ``"squared_relu"``
            (fc1 ``[F, H]``); all one fused native op (:func:`moe_graph.ops.activation.expert_activation`).
            add_bias_linear: biases on the experts' (and the shared
            expert's) fc1 and fc2, fused into the grouped GEMM epilogue. The routing probabilities weight the
            narrower side of the expert MLP: with ``F < H`` (and no biases) each row's ``[F]`` activation before
            fc2 (``scale_rows``: :meth:`TokenDispatcher.row_weights`, a plain sum in combine), else the ``[H]``
            outputs in combine.
        shared_expert_activation, shared_expert_swiglu_limit, shared_expert_bias: the shared expert's own
            activation, ``swiglu_limit`` and biases (``None``: ``activation``, ``swiglu_limit``,
            ``add_bias_linear``; HY-V4's and Step-3.7's shared experts differ from their routed ones).
        latent_size, latent_bias: the routed experts work in width ``latent_size``: ``latent_in`` (``H -> latent``,
            ``nn.Linear``) before the dispatch (the exchanged rows are latent-wide), ``latent_out`` after the combine
            (its bias added once); the router and the shared expert see ``x`` (Nemotron-H's ``moe_latent_size``).
        router_input_norm, router_norm_eps, router_expert_scale: Gemma 4's router (:class:`TopKRouter`: the gate
            sees the RMS-normed input times a learned ``input_scale [H]`` over ``sqrt(H)``; a learned
            ``expert_scale [E]`` multiplies each route's probability).
        shared_expert_combine: ``"sum"`` (default) or ``"average"``: the block output is ``(routed + shared) / 2``
            (Cohere2-MoE's default); without a shared expert it has no effect.
        probs_on_input: weight each expert's *input* row by its routing probability instead of its output (Llama 4:
            ``sum_k mlp_k(p_k * x)``; combine then sums plainly).
        output_bias: a learned ``output_bias [H]`` (zero-initialized) added once to the block output, after the
            routed and shared outputs are combined (JetMoE).
        expert_input_norm, expert_input_norm_eps, expert_output_norm, expert_output_norm_eps: Muse-Spark's norms
            around the experts (:class:`_OffsetRMSNorm`, weights ``expert_input_norm.weight`` /
            ``expert_output_norm.weight`` of the experts' width, zeros): ``"centered_rmsnorm"`` of the experts' input
            (after ``latent_in``, before the dispatch); ``"scaled_rmsnorm"`` of each expert output row before the
            probabilities weight it in combine (the probabilities then never move into the experts, the norm not
            being linear; padding rows stay zero; with echo the weight is the layer's, nothing is dispatched). With
            EP, a rank's ``expert_output_norm.weight`` gradient comes from the rows its experts ran (all ranks'
            tokens): the data-parallel all-reduce of dense parameters sums it to the whole batch's.
        output_norm, output_norm_eps: ``"rmsnorm"``: an RMSNorm (``output_norm.weight [H]``, ones) of the block
            output, the last step (after the shared expert and ``output_bias``; A.X-K1).
        num_zero_experts: ``Z`` zero-computation experts (LongCat-Flash): the router scores ``E + Z`` experts (its
            gate, ``expert_bias`` and counts have ``E + Z`` entries), a route to expert ``E + z`` adds the token
            itself times its probability. Such routes are not dispatched (invalid for the dispatcher and echo: no
            GEMM rows, no exchange, no capacity) and the layer's statistics count the ``E`` real experts only.
        logit_softcap, hash_vocab_size, group_masked_score, num_scored_shared_experts, router_global_scale: router
            options (the scored shared experts are ordinary experts of the grouped GEMM, dispatched and echoed like
            the others); (:class:`TopKRouter`); with hash routing
            :meth:`forward` needs ``token_ids``.
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
            ``None`` (default) or ``>= ep_size``: unconstrained (an all-to-all of ``R`` blocks).
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
        overflow: ``"drop"`` (default: routes over the capacity are dropped and counted) or ``"rerun"`` (dropless
            training with the static capacity: a route over it skips the step's update on every rank and the step
            is rerun eagerly with the capacity it needed; :class:`moe_graph.train.step.OverflowRerun`).
        exchange: ``"auto"`` (default), ``"nccl"``, ``"symm_mem"`` or ``"nvlink"``: the capacity rule and the token
            exchange at EP > 1 (per (source, destination) pair with a fixed-split all-to-all, or per destination rank
            with a variable-size exchange, ``"nvlink"`` through the fused one; :mod:`moe_graph.moe.exchange`).
            ranks_per_node (``"nvlink"``: the node-aware two-level exchange) and exchange_num_sms (its CUDA kernels'
            CTA bound) go with it.
        fp8_dispatch: under an FP8 recipe with rowwise activation tiles (``moe_graph.fp8.autocast`` with
            "blockwise" or "mxfp8"), quantize the tokens before the exchange, once per token, and send their FP8 and
            scale bytes (about half the bytes of 16-bit rows); the first expert GEMM reads them as they arrive (the
            same bytes as quantizing its 16-bit input row by row), its weight gradient uses a columnwise copy
            quantized from their dequantization (DeepSeek-V3's FP8 dispatch), the combine stays in the
            activation dtype. Without an active recipe the dispatch is 16-bit. Not with ``probs_on_input``.
        params_dtype, device: of all parameters. init_std: expert weight init.
        The options (all but ``ep_group`` and ``device``) form a :class:`moe_graph.moe.config.MoEConfig`
        (:meth:`from_config`).
        recompute: activation recomputation of the whole layer in training (its activations are not kept; backward
            runs the forward again) through :func:`moe_graph.cuda_graph.checkpoint`, the graph-safe recompute, so a
            captured step may contain it. The layer draws no random numbers, so no RNG state is carried. The
            statistics and counters count every token once.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int = 2, *, ep_group=None,
                 device=None, **options):
        """``options``: the keyword options above, with :class:`moe_graph.moe.config.MoEConfig`'s names and
        defaults (an unknown keyword raises ``TypeError``)."""
        self._build(MoEConfig(hidden_size, ffn_hidden_size, num_experts, topk, **options), ep_group, device)

    @classmethod
    def from_config(cls, config: MoEConfig, ep_group=None, device=None) -> "MoELayer":
        """The layer for ``config`` (the constructor's keywords as one validated object)."""
        layer = cls.__new__(cls)
        layer._build(config, ep_group, device)
        return layer

    def _build(self, config: MoEConfig, ep_group, device) -> None:
        super().__init__()
        c = self.config = config
        ep_group, ep_size = _resolve_ep(ep_group, c.ep_size)
        if c.num_experts % ep_size:
            raise ValueError(f"num_experts={c.num_experts} must be divisible by the EP size {ep_size}")
        if ep_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"ep_size={ep_size} needs an initialized torch.distributed")
        self.hidden_size, self.ffn_hidden_size = c.hidden_size, c.ffn_hidden_size
        self.num_experts, self.topk = c.num_experts, c.topk
        self.ep_group, self.num_ep_ranks = ep_group, ep_size
        self.ep_rank = dist.get_rank(ep_group) if ep_size > 1 else 0
        self.num_local_experts = c.num_experts // ep_size
        self.num_spare_experts_per_ep_rank = k = c.num_spare_experts_per_ep_rank
        self.capacity_factor, self.recompute = c.capacity_factor, bool(c.recompute)
        self.overflow = c.overflow
        # the routing probabilities scale the narrower side of the expert MLP: the [rows, F] activation before fc2
        # when F < H (no fc2 bias, which the scale would miss), else the [rows, H] outputs in combine
        self.probs_on_input = bool(c.probs_on_input)
        self.fp8_dispatch = c.fp8_dispatch
        self.shared_average = c.shared_expert_combine == "average"
        expert_width = c.latent_size or c.hidden_size  # the routed experts' input / output width
        self.scale_rows = c.ffn_hidden_size < expert_width and not c.add_bias_linear and not self.probs_on_input \
            and not c.expert_output_norm  # the per-row norm is not linear: the probabilities weight its output
        dtype = c.params_dtype if c.params_dtype is not None else torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")

        self.num_zero_experts = c.num_zero_experts
        self.router = TopKRouter(c.hidden_size, c.num_experts + c.num_zero_experts, c.topk, c.score_func, c.norm_topk_prob, device=device,
                                 dtype=dtype, num_groups=c.num_groups, group_topk=c.group_topk,
                                 group_score_topk=c.group_score_topk, scaling_factor=c.topk_scaling_factor,
                                 router_bias=c.router_bias, enable_expert_bias=c.enable_expert_bias,
                                 expert_bias_update_rate=c.expert_bias_update_rate, router_dtype=c.router_dtype,
                                 select_on=c.select_on, norm_topk_min=c.norm_topk_min, norm_topk_eps=c.norm_topk_eps,
                                 hash_vocab_size=c.hash_vocab_size, logit_softcap=c.logit_softcap,
                                 group_masked_score=c.group_masked_score,
                                 input_norm=c.router_input_norm, input_norm_eps=c.router_norm_eps,
                                 expert_scale=c.router_expert_scale,
                                 num_scored_shared_experts=c.num_scored_shared_experts,
                                 global_scale=c.router_global_scale,
                                 logit_multiplier=c.router_logit_multiplier)
        self.router_loss = RouterLoss(c.topk, c.score_func, c.aux_loss_coeff, c.aux_loss_type, c.sequence_dim,
                                      c.z_loss_coeff)
        act = dict(swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit, bias=c.add_bias_linear)
        self.latent_in = self.latent_out = None
        if c.latent_size:  # Nemotron-H: the routed experts in a latent width, projected in and out around them
            self.latent_in = nn.Linear(c.hidden_size, c.latent_size, bias=c.latent_bias, device=device, dtype=dtype)
            self.latent_out = nn.Linear(c.latent_size, c.hidden_size, bias=c.latent_bias, device=device, dtype=dtype)
        self.expert_input_norm = _OffsetRMSNorm(expert_width, c.expert_input_norm_eps, c.expert_input_norm, device,
                                                dtype) if c.expert_input_norm else None
        self.expert_output_norm = _OffsetRMSNorm(expert_width, c.expert_output_norm_eps, c.expert_output_norm,
                                                 device, dtype) if c.expert_output_norm else None
        self.experts = GroupedMLP(self.num_local_experts, expert_width, c.ffn_hidden_size, c.activation, k,
                                  params_dtype=dtype, device=device, init_std=c.init_std, **act)
        self.output_bias = nn.Parameter(torch.zeros(c.hidden_size, device=device, dtype=dtype)) \
            if c.output_bias else None
        self.output_norm = _OutputRMSNorm(c.hidden_size, c.output_norm_eps, device, dtype) \
            if c.output_norm == "rmsnorm" else None
        self.shared_expert = None
        if c.shared_expert_ffn_size:
            self.shared_expert = SharedExpert(c.hidden_size, c.shared_expert_ffn_size, c.shared_activation,
                                              c.shared_expert_gate, params_dtype=dtype, device=device,
                                              init_std=c.init_std, swiglu_alpha=c.swiglu_alpha,
                                              swiglu_limit=c.shared_swiglu_limit, bias=c.shared_bias)
        # overlap_shared_expert: the shared expert and the router losses on a side stream beside the exchange (its
        # CUDA stream and events made here, never during a capture)
        self.side = SideStream(device, "moe_side") if c.overlap_shared_expert else None
        col_rank, col_local = expert_columns(c.num_experts, ep_size, k)
        self.dispatcher = TokenDispatcher(self.num_local_experts + k, ep_size, self.ep_rank, col_rank, col_local,
                                          capacity=None, group=ep_group, drop_policy=c.token_drop_policy,
                                          device=device, exchange=c.exchange,
                                          ranks_per_node=c.ranks_per_node, num_sms=c.exchange_num_sms)  # its constant tables are built here, on the device
        if ep_size > 1:  # the gathered counts' checksum across ranks (moe.exchange.flag_if_ranks_disagree)
            self.register_buffer("counts_checksum_weights", checksum_weights(
                ep_size * (c.num_experts + c.num_zero_experts), device), persistent=False)
        self.echo = None
        if k > 0:
            self.echo = EchoBalancer(c.num_experts, ep_size, self.ep_rank, k, assignment=c.assignment,
                                     plan_mode=c.echo_plan_mode, donors=c.echo_donors, group=ep_group,
                                     expert_numel=self.experts.expert_numel, dtype=dtype, device=device)
        # statistics: non-persistent buffers written in place by every forward (see the module docstring); without
        # echo the load after it is the load before (last_load_after)
        loss_dtype = c.router_dtype if c.router_dtype is not None else torch.promote_types(dtype, torch.float32)
        for name, shape, dt in (("last_aux_loss", (), loss_dtype), ("last_z_loss", (), loss_dtype),
                                ("last_load_before", (ep_size,), torch.int64),
                                ("last_tokens_per_expert", (c.num_experts,), torch.int64),
                                ("last_m_splits", (self.num_local_experts + k,), torch.int64)
                                ) + ((("last_load_after_echo", (ep_size,), torch.int64),) if k > 0 else ()):
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)
        if c.aux_loss_coeff > 0 or c.z_loss_coeff > 0:
            MoEAuxLossAutoScaler.loss_scale(device)  # made here, not inside a forward that torch.compile traces

    # --------------------------------------------------------------------------------------- statistics --
    @property
    def last_load_after(self) -> torch.Tensor:
        """``[R]`` tokens each EP rank's experts receive with echo: the buffer ``last_load_after_echo``, without echo the
        load before it (``last_load_before``, the same tensor)."""
        return self.last_load_after_echo if self.echo is not None else self.last_load_before

    def _stat(self, name: str, value: torch.Tensor) -> None:
        """Writes statistic buffer ``name`` in place (a device copy: no sync, capturable, identity kept). Not while a
        backward recomputes the forward (``counting_enabled``): the forward wrote the same values, and a
        recomputation must write no state shared between microbatches (with ``overlap_microbatches`` microbatch
        ``i + 1``'s forward writes these buffers at the same time on another stream)."""
        if counting_enabled():
            with torch.no_grad():
                getattr(self, name).copy_(value)

    def _stat_out(self, name: str) -> Optional[torch.Tensor]:
        """Statistic buffer ``name`` as the ``out=`` of the op that computes it; ``None`` (a fresh tensor) while a
        backward recomputes the forward (see :meth:`_stat`)."""
        return getattr(self, name) if counting_enabled() else None

    def statistics(self) -> dict:
        """This layer's statistics: the device buffers themselves (no copy, no sync; the same tensors every call).
        ``dropped_routes`` (0-dim int64, cumulative since :meth:`reset_statistics`), and of the last forward:
        ``tokens_per_expert [E]``, ``load_before [R]``, ``load_after [R]``, ``m_splits [L + k]``, ``aux_loss``,
        ``z_loss`` (0 while the loss is off). The current step's overflow counters are the dispatcher's
        (``step_dropped_routes``, ``step_max_load_ratio``; :func:`step_overflow`)."""
        return {"dropped_routes": self.dispatcher.dropped_routes, "tokens_per_expert": self.last_tokens_per_expert,
                "load_before": self.last_load_before, "load_after": self.last_load_after,
                "m_splits": self.last_m_splits, "aux_loss": self.last_aux_loss, "z_loss": self.last_z_loss}

    def echo_buffer_bytes(self, num_microbatches: int = 1) -> dict:
        """Static echo buffer bytes of this layer (:meth:`moe_graph.moe.echo_balancer.EchoBalancer.buffer_bytes`
        for both expert weights, their dtype and fp32 gradients); ``{"total": 0}`` with echo off."""
        if self.echo is None:
            return {"total": 0}
        return self.echo.buffer_bytes(self.experts.expert_numel, self.experts.fc1.weight.dtype, num_microbatches)

    def reset_statistics(self) -> None:
        """Zeroes the cumulative counters (the drop counter) in place: a device op, no sync, capturable."""
        self.dispatcher.reset_drop_counter()

    # ------------------------------------------------------------------------------------------ forward --
    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, token_ids: Optional[torch.Tensor] = None, *,
                router_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` ``[..., H]`` (see :meth:`_forward`); with ``recompute`` and grad enabled, through
        :func:`moe_graph.cuda_graph.checkpoint`. ``is_first_microbatch``: with ``echo_plan_mode="iteration"``,
        ``False`` reuses the plan and spare weights of the iteration's first microbatch (``True``/``None``: plan
        afresh); ignored otherwise. ``token_ids`` (shape ``x.shape[:-1]``, integer, on ``x``'s device): the input
        token ids, which hash routing (``hash_vocab_size``) reads; ignored by the other routers. ``router_input``
        (``x``'s shape, optional): what the gate sees instead of ``x`` (Gemma 4 routes the residual stream and feeds
        the experts its normed copy)."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"is_first_microbatch must be a bool or None, got {type(is_first_microbatch).__name__}")
        reuse = self.echo is not None and self.echo.plan_mode == "iteration" and is_first_microbatch is False
        if self.recompute and torch.is_grad_enabled():  # no random numbers here; the recomputation (in backward,
            # outside the caller's FP8 autocast) runs under the forward's recipe
            return checkpoint(self._forward_in_recipe, x, padding_mask, token_ids, _fp8.current_recipe(),
                              router_input, preserve_rng_state=False)
        return self._forward(x, padding_mask, reuse, token_ids, router_input)

    def _forward_in_recipe(self, x, padding_mask, token_ids, recipe, router_input=None):
        with _fp8.autocast(enabled=recipe is not None, recipe=recipe):
            return self._forward(x, padding_mask, False, token_ids, router_input)

    def _forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, reuse: bool = False,
                 token_ids: Optional[torch.Tensor] = None, router_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` ``[..., H]``. ``padding_mask`` (shape ``x.shape[:-1]``, bool, True: padding, as in Megatron):
        padding tokens get no route (zero routed output; the shared expert still sees them), and the planner
        counts, the losses and the expert-bias counts leave them out. ``reuse``: see :meth:`forward`."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        if padding_mask is not None and tuple(padding_mask.shape) != tuple(lead):
            raise ValueError(f"padding_mask must have shape {tuple(lead)} (x without its last dimension), got "
                             f"{tuple(padding_mask.shape)}")
        if router_input is not None and router_input.shape != x.shape:
            raise ValueError(f"router_input must have the shape of x {tuple(x.shape)}, got {tuple(router_input.shape)}")
        h = x.reshape(-1, self.hidden_size)
        self.dispatcher.capacity = self.dispatcher.capacity_for(h.shape[0], self.topk, self.capacity_factor)

        pad = padding_mask.reshape(-1) if padding_mask is not None else None
        # one EP rank: the router's counts are the statistic itself, written in place
        if token_ids is not None and self.router.hash_vocab_size is not None and tuple(token_ids.shape) != tuple(lead):
            raise ValueError(f"token_ids must have shape {tuple(lead)} (x without its last dimension), got "
                             f"{tuple(token_ids.shape)}")
        Z, E = self.num_zero_experts, self.num_experts
        with stage("router"):
            routing = self.router(h if router_input is None else router_input.reshape(h.shape), pad,
                                  self._stat_out("last_tokens_per_expert") if self.num_ep_ranks == 1 and not Z
                                  else None,
                                  token_ids=token_ids)
        routed, identity = routing, None
        if Z:  # zero-computation experts: routes past E are the token times its probability, never dispatched
            zero = routing.indices >= E
            identity = (routing.probs * zero).sum(-1, keepdim=True)  # [T, 1]
            routed = routing._replace(indices=routing.indices.masked_fill(zero, 0), counts=routing.counts[:E])
        with stage("balance"):
            indices, valid, plan, demand, tokens = self._balance(routed, reuse, None if identity is None else ~zero)

        weights = self._shared_weights()
        (aux, shared), out = self._beside_exchange(
            lambda: (self._router_losses(routing, x.shape, tokens), self._shared(h, weights)),
            lambda: self._routed(h, x.dtype, routing, indices, valid, plan, demand, reuse),
            h, *[t for t in routing if isinstance(t, torch.Tensor)], *(weights or {}).values())
        if identity is not None:
            out = out + (h.to(identity.dtype) * identity).to(out.dtype)
        if shared is not None:
            out = out + shared.to(out.dtype)
            if self.shared_average:
                out = out * 0.5
        if self.output_bias is not None:
            out = out + self.output_bias.to(out.dtype)
        if self.output_norm is not None:
            out = self.output_norm(out)
        if aux is not None:
            out = MoEAuxLossAutoScaler.attach(out, aux)
        return out.reshape(*lead, self.hidden_size)

    def _beside_exchange(self, side_fn, routed_fn, *side_inputs):
        """Runs ``side_fn`` (work independent of the exchange: router losses, shared expert) and ``routed_fn``
        (dispatch, experts, combine), issued in this order; with ``overlap_shared_expert`` ``side_fn`` runs on the
        side stream (reading ``side_inputs``, made on the current stream) while ``routed_fn`` runs on the current
        stream, which waits for the side work before its results are returned. Both schedules issue the same ops in
        the same order (the autograd engine accumulates gradients in that order), so they are bitwise equal. The
        seam for the exchange's async form: dispatch can be begun before the fork and waited for inside
        ``routed_fn`` without changing the callers. Returns ``(side_fn(), routed_fn())``."""
        if self.side is None:  # serial: everything in turn on the current stream
            side = side_fn()
            return side, routed_fn()
        with self.side.fork(*side_inputs):
            side = side_fn()
        routed = routed_fn()
        return self.side.join(*side), routed

    def _router_losses(self, routing: Routing, shape, tokens: torch.Tensor):
        """The router losses of a training forward (statistics written), summed; ``None`` when off or in eval.
        ``tokens`` ``[E]``: the routes per expert over the EP group (:meth:`_balance`)."""
        if not self.training:
            return None
        with stage("router_loss"):
            aux, z = self.router_loss(routing, shape, tokens)
            if aux is not None:
                self._stat("last_aux_loss", aux.detach())
            if z is not None:
                self._stat("last_z_loss", z.detach())
                aux = z if aux is None else aux + z
        return aux

    def _shared_weights(self) -> Optional[dict]:
        """With the side stream in a differentiable forward: a view of each shared-expert parameter, made on the
        current stream, for the side stream to use. Autograd runs a parameter's gradient accumulation (and the
        hooks on it: DDP's ``main_grad`` add and its bucket's reduction launch) on the stream where the parameter's
        accumulator node was made, i.e. where it was first used; through these views that is the current stream,
        never the side stream (whose adds a reduction launched on the current stream would not wait for)."""
        if self.side is None or self.shared_expert is None or not torch.is_grad_enabled():
            return None
        return {n: p.view_as(p) for n, p in self.shared_expert.named_parameters()}

    def _shared(self, h: torch.Tensor, weights: Optional[dict] = None) -> Optional[torch.Tensor]:
        if self.shared_expert is None:
            return None
        with stage("shared_expert"):
            if weights is None:
                return self.shared_expert(h)
            return torch.func.functional_call(self.shared_expert, weights, (h,))

    def _routed(self, h, out_dtype, routing, indices, valid, plan, demand, reuse) -> torch.Tensor:
        """Dispatch, the routed experts and combine (with ``latent_in`` / ``latent_out`` around them): ``[T, H]``."""
        recipe = _fp8.current_recipe() if self.fp8_dispatch else None
        h_in = h if self.latent_in is None else self.latent_in(h)
        if self.expert_input_norm is not None:
            h_in = self.expert_input_norm(h_in)
        h_in = h_in if recipe is None else h_in.to(self.experts.fc1.weight.dtype)  # quantized as the experts would
        # FP8 experts without FP8 dispatch: the dispatcher may write the expert input's FP8 copies itself
        quantize = None if recipe is not None or self.probs_on_input else \
            self.experts.input_recipe(h_in, self.echo is not None)
        with stage("dispatch"):
            expert_in, m_splits, handle = self.dispatcher.dispatch(h_in, indices, routing.probs, valid, demand,
                                                                   fp8_recipe=recipe,
                                                                   align_rows=self.experts.row_alignment(),
                                                                   quantize_recipe=quantize)
        self._stat("last_m_splits", handle.m_splits)  # the routed rows (m_splits: padded when handle.aligned)

        if self.probs_on_input:  # Llama 4: each row scaled by its probability before the experts
            w = self.dispatcher.row_weights(handle)
            w = w.to(expert_in.dtype if expert_in.dtype == torch.float64 else torch.float32)
            expert_in = expert_in * w[:, None]
        if recipe is None and not isinstance(expert_in, _fp8.QuantizedRows):
            expert_in = expert_in.to(self.experts.fc1.weight.dtype)
        row_scale = self.dispatcher.row_weights(handle) if self.scale_rows else None
        handoff = None  # fc2's FP8 output gradient written by the combine's backward (GradHandoff)
        with stage("experts"):
            if self.echo is None:
                handoff = self.experts.output_grad_handoff(m_splits, handle.aligned)
                expert_out = self.experts(expert_in, m_splits, row_scale=row_scale, aligned=handle.aligned,
                                          grad_handoff=handoff)
            else:
                spares = self.echo.iteration_spares(plan, self.experts.expert_params(), reuse)
                expert_out = self.experts(expert_in, m_splits, self.echo.dispatcher, plan, spares,
                                          row_scale=row_scale, aligned=handle.aligned)
            if self.expert_output_norm is not None:  # Muse-Spark: each expert output row normed, then weighted
                expert_out = self.expert_output_norm(expert_out)
        weighted = not (self.scale_rows or self.probs_on_input)
        with stage("combine"):
            out = self.dispatcher.combine(expert_out, handle, weighted=weighted, grad_handoff=handoff).to(out_dtype)
        if self.latent_out is not None:
            out = self.latent_out(out)
        return out

    def _balance(self, routing: Routing, reuse: bool, live: Optional[torch.Tensor] = None):
        """Statistics (the per-expert counts all-gathered over the EP group) and, with echo, the plan and the
        rerouted routes: ``(indices [T, K]`` in ``[0, E+S)``, ``valid [T, K]`` bool or ``None``, the plan
        (:meth:`EchoBalancer.plan`), the per-destination demand or ``None``, ``tokens [E]`` the routes per expert
        over the EP group)``; without echo the router's own indices and no plan. ``live`` ``[T, K]`` bool: routes to
        dispatch (the others, zero-computation experts' routes, are invalid)."""
        R = self.num_ep_ranks
        if R > 1:
            counts = _all_gather_counts(routing.counts, self.ep_group, R)  # [R, E]
            flag_if_ranks_disagree(counts, self.counts_checksum_weights, self.ep_group)  # a corrupted gather
            tokens = torch.sum(counts, 0, out=self._stat_out("last_tokens_per_expert"))
        else:
            counts = routing.counts.unsqueeze(0)  # the router wrote last_tokens_per_expert (not with zero experts)
            tokens = routing.counts
            if self.num_zero_experts:
                self._stat("last_tokens_per_expert", routing.counts)
        load_before = torch.sum(tokens.view(R, -1), 1, out=self._stat_out("last_load_before"))
        mask = routing.token_mask
        valid = None if mask is None else mask.view(-1, 1).expand(routing.indices.shape)
        if live is not None:
            valid = live if valid is None else valid & live
        if self.echo is None:  # the per-destination exchange's demand is the gathered counts per rank
            demand = counts.view(R, R, -1).sum(2) if R > 1 and self.dispatcher.rule == "destination" else None
            return routing.indices, valid, None, demand, tokens
        indices, plan, home_to_spare = self.echo.plan(counts, routing.indices, valid, reuse)
        self._stat("last_load_after_echo", self.echo.load_after(load_before, home_to_spare))
        return indices, valid, plan, None, tokens


    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, experts={self.num_experts}, topk={self.topk}, "
                f"ep={self.num_ep_ranks}, local={self.num_local_experts}, spare={self.num_spare_experts_per_ep_rank}, "
                f"capacity_factor={self.capacity_factor}, overflow={self.overflow}")


def moe_layers(module: nn.Module) -> list:
    """Every :class:`MoELayer` in ``module`` (``module.modules()`` order; may be empty)."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def reset_step_counters(layers) -> None:
    """Zeroes the per-step overflow counters of ``layers`` (device ops: the first thing of a captured step)."""
    for m in layers:
        m.dispatcher.reset_step_counters()


def step_overflow(layers, device) -> torch.Tensor:
    """0-dim bool on ``device``: some route of this step went over the capacity in one of ``layers`` (no sync)."""
    if not layers:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([m.dispatcher.step_dropped_routes for m in layers]).sum() > 0


def step_max_load_ratio(layers, device) -> torch.Tensor:
    """0-dim float64: the largest load ratio of this step over ``layers`` (0 when there are none)."""
    if not layers:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([m.dispatcher.step_max_load_ratio for m in layers]).max()


def _moe_layers(module: nn.Module):
    layers = moe_layers(module)
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
