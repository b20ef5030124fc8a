"""``MoEConfig``: the options of one :class:`moe_graph.moe.layer.MoELayer`, validated in one place.

``MoELayer(hidden_size, ffn_hidden_size, num_experts, topk, **options)`` builds one from its keywords (the names
and defaults are the fields below); ``MoELayer.from_config(config)`` takes one directly. The process group and the
device are construction arguments of the layer, not options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_graph.moe.echo import PLAN_MODES
from moe_graph.moe.echo_planner import ASSIGNMENTS
from moe_graph.moe.exchange import EXCHANGES
from moe_graph.moe.experts import check_activation
from moe_graph.moe.router import check_loss_options, check_router_options
from moe_graph.moe.token_dispatcher import DROP_POLICIES, OVERFLOW_MODES

__all__ = ["MoEConfig"]


@dataclass(frozen=True)
class MoEConfig:
    """Options of an MoE layer (see :class:`moe_graph.moe.layer.MoELayer` for what each does).

    Routing (:class:`moe_graph.moe.router.TopKRouter`): ``topk``, ``score_func``, ``norm_topk_prob``,
    ``num_groups``, ``group_topk``, ``group_score_topk``, ``topk_scaling_factor``, ``router_bias``,
    ``enable_expert_bias``, ``expert_bias_update_rate``, ``select_on`` (what the top-k ranks: ``"scores"`` or
    ``"logits"``), ``norm_topk_min``, ``norm_topk_eps`` (the renormalization's ``sum + eps``, ``None``: 1e-20),
    ``router_dtype``, ``group_masked_score`` (the score of the experts outside the
    chosen groups, ``None``: ``-inf``; A.X-K2: 0.0), ``num_scored_shared_experts`` ``S`` (Inkling: the last ``S``
    experts are shared experts every token routes to, scored and renormalized with its ``topk - S`` routed ones;
    ``num_experts`` and ``topk`` count them), ``router_global_scale`` (a learned scalar on the probabilities),
    ``logit_softcap`` (Laguna's ``c * tanh(logits / c)``), ``router_logit_multiplier`` (a constant ``m > 0`` times
    the gate's fp32 logits, before the soft cap and the score function: Muse-Spark's ``output_multiplier``),
    ``hash_vocab_size`` (DeepSeek-V4's hash layers: the experts from a ``tid2eid [V, K]`` table indexed by the token
    ids given to ``MoELayer.forward(x, token_ids=...)``); ``score_func`` ``"softmax"``, ``"sigmoid"`` or
    ``"sqrtsoftplus"`` (DeepSeek-V4). ``num_zero_experts`` ``Z`` (LongCat-Flash): the router scores ``E + Z``
    experts, a route to one of the last ``Z`` returns the token times its probability (no GEMM, never dispatched).
    ``router_input_norm`` / ``router_norm_eps`` (the gate sees ``rms_norm(x) * input_scale / sqrt(H)``, Gemma 4),
    ``router_expert_scale`` (a learned per-expert factor on the probabilities, Gemma 4).
    Block output: ``output_norm`` (``"rmsnorm"``: an RMSNorm with weight ``[H]`` and ``output_norm_eps`` on the
    block output, last of all: A.X-K1's ``post_mlp_layernorm``). Losses
    (:class:`moe_graph.moe.router.RouterLoss`): ``aux_loss_coeff``, ``aux_loss_type``, ``sequence_dim``,
    ``z_loss_coeff``. Expert parallelism and echo: ``ep_size``,
    ``num_spare_experts_per_ep_rank``, ``assignment``, ``echo_donors``, ``echo_plan_mode``. Token dispatch:
    ``capacity_factor``, ``token_drop_policy``, ``overflow`` (``"drop"`` or ``"rerun"``: dropless with the static
    capacity), ``exchange`` (``"nccl"``: capacity per (source, destination) pair; ``"symm_mem"``: per destination
    rank, variable-size; ``"nvlink"``: per destination rank through the fused exchange; ``"auto"``:
    :mod:`moe_graph.moe.exchange`), ``ranks_per_node`` (``exchange="nvlink"``: EP ranks per node, the node-aware
    two-level exchange; ``None``: one node), ``exchange_num_sms`` (the fused CUDA exchange's CTA bound; ``None``: its
    default), ``fp8_dispatch`` (under an FP8 recipe, tokens
    travel quantized: ``docs/fp8.md``). Experts (:class:`moe_graph.moe.experts.GroupedMLP`):
    ``activation``, ``swiglu_alpha``, ``swiglu_limit``, ``shared_expert_ffn_size``, ``shared_expert_gate``,
    ``shared_expert_combine``, ``shared_expert_activation``, ``shared_expert_swiglu_limit``, ``shared_expert_bias``
    (the shared expert's own activation, limit and biases; ``None``: the routed experts'), ``latent_size`` /
    ``latent_bias`` (the routed experts work in a latent width: ``latent_in [H -> latent]`` before the dispatch,
    ``latent_out`` after the combine; Nemotron-H's ``moe_latent_size``), ``expert_input_norm`` /
    ``expert_input_norm_eps`` (``"centered_rmsnorm"``: the experts' input, after ``latent_in``, becomes
    ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, ``w [latent or H]`` zero-initialized: Muse-Spark's
    ``pre_expert_norm``), ``expert_output_norm`` / ``expert_output_norm_eps`` (``"scaled_rmsnorm"``: each expert output
    row, before its routing probability weights it, becomes ``rms_norm(x * (1 + w))``, the scaled row rounded to
    the activation dtype first, one ``w`` zero-initialized for all experts: Muse-Spark's ``post_expert_norm``; not
    with ``probs_on_input``), ``probs_on_input``,
    ``output_bias``,
    ``params_dtype``, ``init_std``;
    ``recompute``: activation recomputation of the whole layer. Schedule: ``overlap_shared_expert`` (the shared
    expert and the router losses on a side stream, beside dispatch, experts and combine: :mod:`moe_graph.streams`).

    :attr:`STAGES` names the options of each stage of the layer (the keywords stay flat); :meth:`stage_options`
    returns one stage's values.
    """

    STAGES = {
        "router": ("topk", "score_func", "norm_topk_prob", "num_groups", "group_topk", "group_score_topk",
                   "topk_scaling_factor", "router_bias", "enable_expert_bias", "expert_bias_update_rate", "select_on",
                   "norm_topk_min", "norm_topk_eps", "router_dtype", "group_masked_score", "num_scored_shared_experts",
                   "router_global_scale", "router_logit_multiplier", "logit_softcap", "hash_vocab_size",
                   "num_zero_experts", "router_input_norm", "router_norm_eps", "router_expert_scale"),
        "losses": ("aux_loss_coeff", "aux_loss_type", "sequence_dim", "z_loss_coeff"),
        "balance": ("ep_size", "num_spare_experts_per_ep_rank", "assignment", "echo_donors", "echo_plan_mode"),
        "dispatch": ("capacity_factor", "token_drop_policy", "overflow", "exchange", "ranks_per_node", "exchange_num_sms",
                     "fp8_dispatch"),
        "experts": ("hidden_size", "ffn_hidden_size", "num_experts", "activation", "swiglu_alpha", "swiglu_limit",
                    "add_bias_linear", "latent_size", "latent_bias", "expert_input_norm", "expert_input_norm_eps",
                    "expert_output_norm", "expert_output_norm_eps", "probs_on_input", "params_dtype", "init_std"),
        "shared_expert": ("shared_expert_ffn_size", "shared_expert_gate", "shared_expert_combine",
                          "shared_expert_activation", "shared_expert_swiglu_limit", "shared_expert_bias"),
        "output": ("output_bias", "output_norm", "output_norm_eps"),
        "schedule": ("recompute", "overlap_shared_expert"),
    }

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    topk: int = 2
    score_func: str = "softmax"
    norm_topk_prob: Optional[bool] = None
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    add_bias_linear: bool = False
    aux_loss_coeff: float = 0.0
    aux_loss_type: str = "local"
    sequence_dim: int = 1
    z_loss_coeff: float = 0.0
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    group_score_topk: Optional[int] = None
    topk_scaling_factor: Optional[float] = None
    router_bias: bool = False
    enable_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    select_on: str = "scores"
    norm_topk_min: Optional[float] = None
    norm_topk_eps: Optional[float] = None
    router_dtype: Optional[torch.dtype] = None
    ep_size: Optional[int] = None
    num_spare_experts_per_ep_rank: int = 0
    assignment: str = "auto"
    echo_donors: Optional[int] = None
    echo_plan_mode: str = "microbatch"
    capacity_factor: Optional[float] = None
    token_drop_policy: str = "probs"
    overflow: str = "drop"
    exchange: str = "auto"
    ranks_per_node: Optional[int] = None
    exchange_num_sms: Optional[int] = None
    fp8_dispatch: bool = False
    shared_expert_ffn_size: Optional[int] = None
    shared_expert_gate: bool = False
    shared_expert_combine: str = "sum"
    shared_expert_activation: Optional[str] = None
    shared_expert_swiglu_limit: Optional[float] = None
    shared_expert_bias: Optional[bool] = None
    router_input_norm: bool = False
    router_norm_eps: float = 1e-6
    router_expert_scale: bool = False
    latent_size: Optional[int] = None
    latent_bias: bool = False
    probs_on_input: bool = False
    output_bias: bool = False
    params_dtype: Optional[torch.dtype] = None
    init_std: float = 0.02
    recompute: bool = False
    hash_vocab_size: Optional[int] = None
    logit_softcap: Optional[float] = None
    num_zero_experts: int = 0
    output_norm: Optional[str] = None
    output_norm_eps: float = 1e-6
    group_masked_score: Optional[float] = None
    num_scored_shared_experts: int = 0
    router_global_scale: bool = False
    router_logit_multiplier: Optional[float] = None
    expert_input_norm: Optional[str] = None
    expert_input_norm_eps: float = 1e-6
    expert_output_norm: Optional[str] = None
    expert_output_norm_eps: float = 1e-6
    overlap_shared_expert: bool = False

    def stage_options(self, stage: str) -> dict:
        """The options of ``stage`` (a key of :attr:`STAGES`) with their values."""
        if stage not in self.STAGES:
            raise ValueError(f"stage must be one of {tuple(self.STAGES)}, got {stage!r}")
        return {name: getattr(self, name) for name in self.STAGES[stage]}

    def __post_init__(self):
        if not isinstance(self.overlap_shared_expert, bool):
            raise TypeError(f"overlap_shared_expert must be a bool, got {self.overlap_shared_expert!r}")
        if self.overlap_shared_expert and not self.shared_expert_ffn_size:
            raise ValueError("overlap_shared_expert needs shared_expert_ffn_size (a shared expert to overlap)")
        check_activation(self.activation, self.swiglu_alpha, self.swiglu_limit)
        k = self.num_spare_experts_per_ep_rank
        if k < 0:
            raise ValueError(f"num_spare_experts_per_ep_rank must be >= 0, got {k}")
        check_loss_options(self.aux_loss_type, self.sequence_dim)
        if self.echo_plan_mode not in PLAN_MODES:
            raise ValueError(f"echo_plan_mode must be one of {PLAN_MODES}, got {self.echo_plan_mode!r}")
        if self.echo_plan_mode == "iteration" and self.recompute and k > 0:
            raise ValueError("echo_plan_mode='iteration' cannot be combined with recompute=True")
        if self.assignment not in ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {self.assignment!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf")):
            raise ValueError(f"capacity_factor must be a finite number > 0 or None (dropless), got {cf!r}")
        z = self.num_zero_experts
        if isinstance(z, bool) or not isinstance(z, int) or z < 0:
            raise ValueError(f"num_zero_experts must be an int >= 0, got {z!r}")
        if z and self.num_groups is not None:
            raise ValueError("num_zero_experts cannot be combined with group-limited routing (num_groups)")
        if z and self.aux_loss_type == "global" and self.aux_loss_coeff > 0:
            raise ValueError("num_zero_experts cannot be combined with aux_loss_type='global' (the EP group's "
                             "counts cover the real experts only)")
        check_router_options(self.num_experts + z, self.topk, self.score_func, self.num_groups, self.group_topk,
                             self.enable_expert_bias, self.router_dtype, self.norm_topk_prob, self.group_score_topk,
                             self.select_on, hash_vocab_size=self.hash_vocab_size,
                             logit_softcap=self.logit_softcap, group_masked_score=self.group_masked_score,
                             num_scored_shared_experts=self.num_scored_shared_experts,
                             logit_multiplier=self.router_logit_multiplier, norm_topk_eps=self.norm_topk_eps,
                             norm_topk_min=self.norm_topk_min)
        for name, kinds in (("expert_input_norm", ("centered_rmsnorm",)), ("expert_output_norm", ("scaled_rmsnorm",))):
            if getattr(self, name) not in (None,) + kinds:
                raise ValueError(f"{name} must be None or one of {kinds}, got {getattr(self, name)!r}")
            eps = getattr(self, name + "_eps")
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
                raise ValueError(f"{name}_eps must be a finite number > 0, got {eps!r}")
        if self.expert_output_norm and self.probs_on_input:
            raise ValueError("expert_output_norm cannot be combined with probs_on_input (the norm of each expert "
                             "output row would undo the probability applied to its input)")
        if self.output_norm not in (None, "rmsnorm"):
            raise ValueError(f"output_norm must be None or 'rmsnorm', got {self.output_norm!r}")
        eps = self.output_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise ValueError(f"output_norm_eps must be a finite number > 0, got {eps!r}")
        if self.token_drop_policy not in DROP_POLICIES:
            raise ValueError(f"token_drop_policy must be 'position' or 'probs', got {self.token_drop_policy!r}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(f"ranks_per_node must be None or an int >= 1, got {rpn!r}")
        if rpn is not None and self.exchange != "nvlink":
            raise ValueError(f"ranks_per_node (the node-aware exchange) needs exchange='nvlink', got {self.exchange!r}")
        sms = self.exchange_num_sms
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
            raise ValueError(f"exchange_num_sms must be None or an int >= 1, got {sms!r}")
        if not isinstance(self.fp8_dispatch, bool):
            raise TypeError(f"fp8_dispatch must be a bool, got {self.fp8_dispatch!r}")
        if self.fp8_dispatch and self.probs_on_input:
            raise ValueError("fp8_dispatch cannot be combined with probs_on_input (the probabilities scale the expert "
                             "input after the exchange, so the quantized tokens would have to be requantized)")
        if self.shared_expert_gate and not self.shared_expert_ffn_size:
            raise ValueError("shared_expert_gate needs shared_expert_ffn_size")
        own = dict(shared_expert_activation=self.shared_expert_activation,
                   shared_expert_swiglu_limit=self.shared_expert_swiglu_limit,
                   shared_expert_bias=self.shared_expert_bias)
        ls = self.latent_size
        if ls is not None and (isinstance(ls, bool) or not isinstance(ls, int) or ls < 1):
            raise ValueError(f"latent_size must be an int >= 1 or None, got {ls!r}")
        if self.latent_bias and ls is None:
            raise ValueError("latent_bias needs latent_size")
        if ls is not None and self.num_zero_experts:
            raise ValueError("latent_size cannot be combined with num_zero_experts (an identity expert's token is "
                             "hidden_size wide, the experts' rows latent_size wide)")
        if not self.shared_expert_ffn_size and any(v is not None for v in own.values()):
            raise ValueError(f"{next(k for k, v in own.items() if v is not None)} needs shared_expert_ffn_size")
        if self.shared_expert_ffn_size:
            check_activation(self.shared_activation, self.swiglu_alpha, self.shared_swiglu_limit)
        if self.shared_expert_bias not in (None, True, False):
            raise ValueError(f"shared_expert_bias must be None (add_bias_linear), True or False, got "
                             f"{self.shared_expert_bias!r}")
        eps = self.router_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"router_norm_eps must be a finite number >= 0, got {eps!r}")
        if self.shared_expert_combine not in ("sum", "average"):
            raise ValueError(f"shared_expert_combine must be 'sum' or 'average', got {self.shared_expert_combine!r}")

    @property
    def shared_activation(self) -> str:
        """The shared expert's activation (``shared_expert_activation``, else ``activation``)."""
        return self.shared_expert_activation or self.activation

    @property
    def shared_swiglu_limit(self) -> float:
        """The shared expert's ``swiglu_limit`` (``shared_expert_swiglu_limit``, else ``swiglu_limit``)."""
        return self.swiglu_limit if self.shared_expert_swiglu_limit is None else self.shared_expert_swiglu_limit

    @property
    def shared_bias(self) -> bool:
        """Whether the shared expert has biases (``shared_expert_bias``, else ``add_bias_linear``)."""
        return self.add_bias_linear if self.shared_expert_bias is None else bool(self.shared_expert_bias)
