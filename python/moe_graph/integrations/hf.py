"""Hugging Face transformers MoE blocks as :class:`moe_graph.moe.layer.MoELayer`: configs, checkpoints in and out,
and swapping the blocks of a loaded model.

Families (``config.model_type``; block class -> what the layer reproduces):

* ``mixtral`` (``MixtralSparseMoeBlock``): softmax, top-k renormalized, SwiGLU experts.
* ``qwen2_moe`` (``Qwen2MoeSparseMoeBlock``): softmax, ``norm_topk_prob``, SwiGLU experts, a shared expert scaled
  by ``sigmoid(shared_expert_gate(x))``.
* ``qwen3_moe`` (``Qwen3MoeSparseMoeBlock``): softmax, ``norm_topk_prob``, SwiGLU experts.
* ``deepseek_v3`` (``DeepseekV3MoE``): fp32 gate GEMM, sigmoid scores, ``e_score_correction_bias`` added for the
  selection only (``router.expert_bias``), ``n_group`` groups of which ``topk_group`` are kept, a group scoring the
  sum of its best 2 (``group_score_topk=2``), ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts``
  shared SwiGLU experts as one.
* ``gpt_oss`` (``GptOssMLP``): a gate with a bias (``router_bias``), softmax over the top-k logits (the
  renormalized top-k softmax), expert biases (``add_bias_linear``) and the clamped SwiGLU (``swiglu_alpha``,
  ``swiglu_limit``); its checkpoints store ``gate_up_proj [E, H, 2F]`` with gate and up interleaved along the last
  dimension, and ``down_proj [E, F, H]``.
* ``ernie4_5_moe`` (``Ernie4_5_MoeSparseMoeBlock``): fp32 gate, softmax, ``moe_statics.e_score_correction_bias``
  (``[1, E]``) added to the softmax scores for the selection only (``enable_expert_bias`` with softmax),
  renormalized top-k, ``moe_num_shared_experts`` shared SwiGLU experts as one.
* ``kolibri1`` (``Kolibri1SparseMoeBlock``): fp32 gate, ``e_score_correction_bias`` added to the *logits* for the
  selection (``select_on="logits"``), the sigmoid of the chosen logits, ``norm_topk_prob``, a shared
  SwiGLU expert.
* ``glm5_next_text`` (``Glm5NextTextMoE``, the text model of ``glm5_next``): DeepSeek-V3's router, experts and
  shared experts with ``silu(min(g, L)) * clamp(u, -L, L)`` (``activation="limited_swiglu"``,
  ``swiglu_limit=L``).
* ``deepseek_v2`` (``DeepseekV2Moe``; also ``deepseek_ocr2_text``, ``unlimited_ocr_text``): fp32 gate, softmax,
  ``greedy`` or ``group_limited_greedy`` top-k (groups scored by their best expert: ``group_score_topk=1``), the
  top-k scores not renormalized, ``routed_scaling_factor``, shared experts.
* ``jamba`` (``JambaSparseMoeBlock``): softmax, the top-k scores as they are (``norm_topk_prob=False``).
* ``cohere2_moe`` (``Cohere2MoeSparseMoeBlock``): the softmax or sigmoid (``expert_selection_fn``) of the top-k
  logits (``select_on="logits"``), shared SwiGLU experts combined by ``shared_expert_combination_strategy``
  (``"average"``, the default: ``shared_expert_combine="average"``, or ``"sum"``).
* ``nemotron_h`` (``NemotronHMoE``, the ``mixer`` of its ``moe`` layers): DeepSeek-V3's router, non-gated experts
  with ``mlp_hidden_act`` (``relu2`` -> ``activation="squared_relu"``; ``experts.up_proj [E, F, H]``) and a
  non-gated shared expert.
* ``jetmoe`` (``JetMoeMoE``): softmax over the top-k logits, SwiGLU experts (``input_linear`` / ``output_linear``),
  the block's ``bias [H]`` added after combining (``output_bias``).
* ``llama4_text`` (``Llama4TextMoe``): the sigmoid of the top-k logits (``select_on="logits"``) applied to the
  expert *input* (``probs_on_input``), a shared SwiGLU expert; experts stored transposed
  (``gate_up_proj [E, H, 2F]``, ``down_proj [E, F, H]``). The block returns ``(out, router_logits)``: the swapped
  block ``(out, None)``.

* ``deepseek_v4`` (``DeepseekV4SparseMoeBlock``): the gate in the input dtype, ``sqrtsoftplus`` (or sigmoid) scores,
  the chosen ones renormalized and times ``routed_scaling_factor``, experts and one shared expert
  (``moe_intermediate_size``) with ``limited_swiglu``; learned layers select with ``e_score_correction_bias``,
  ``hash_moe`` layers take the experts of each token from ``gate.tid2eid[input_ids]`` (``hash_vocab_size``; the
  layer needs the token ids: ``MoELayer.forward(x, token_ids=...)``, which :class:`HFMoEBlock` passes from the
  decoder's ``input_ids``). Which kind a layer is comes from the block (``moe_config_from_hf(config, block=...)``
  or ``hash_layer=True``); its state dict tells (``gate.tid2eid``).
* ``longcat_flash`` (``LongcatFlashMoE``): fp32 gate over ``E + Z`` experts, softmax, the correction bias on the
  scores for the selection, not renormalized, scaled; ``zero_expert_num`` zero-computation experts
  (``num_zero_experts``); ``experts.gate_up_proj`` has ``E + Z`` rows, the last ``Z`` never read (written as
  zeros).
* ``axk1`` (``AXK1MoE``): DeepSeek-V3's block, its output through an RMSNorm (``post_mlp_layernorm`` ->
  ``output_norm``); ``axk2`` (``AXK2MoE``): DeepSeek-V3's block, its group mask scoring the other groups' experts
  0.0 (``group_masked_score=0.0``), or without groups (``n_group=None``, A.X-K2-Light).
* ``muse_spark_text`` (``MuseSparkMoE``, Muse-Spark's text model or the text config of a ``muse_spark`` model): the
  fp32 gate times ``output_multiplier`` (``router_logit_multiplier``), sigmoid, the correction bias for the
  selection, renormalized, ``routed_scaling_factor``; the experts in the width ``moe_hidden_size``
  (``pre_expert_proj`` / ``post_expert_proj`` -> ``latent_in`` / ``latent_out``), their input through a centered
  RMSNorm (``pre_expert_norm`` -> ``expert_input_norm``) and each expert output row through an input-scaled RMSNorm
  before its probability weights it (``experts.post_expert_norm`` -> ``expert_output_norm``). Renormalized by
  ``sum + 1e-15`` (``norm_topk_eps``).
* ``laguna`` (``LagunaSparseMoeBlock``): soft-capped logits (``logit_softcap``), sigmoid, the correction bias,
  renormalized, times ``moe_routed_scaling_factor``, a shared expert.

* ``minimax_m2`` (sigmoid, the block's ``e_score_correction_bias``, renormalized), ``lfm2_moe`` (sigmoid, the block's
  ``expert_bias``, renormalized by ``sum + 1e-6`` (``norm_topk_eps``), scaled),
  ``mistral4`` (softmax, groups scoring their best 2, renormalized, scaled, shared experts), ``hunyuan_v1_moe`` (fp32
  gate ``gate.wg``, softmax renormalized, ``shared_mlp``), ``aria_text`` (softmax of the top-k logits, experts
  stored transposed, shared experts), ``dbrx`` (``DbrxFFN``: softmax, top-k over their L1 norm or not; experts
  ``experts.mlp.w1/v1/w2`` stored ``[E * F, H]``), ``granitemoeshared`` (as ``granitemoe``; its shared MLP is
  outside the block).

* ``inkling_text`` (``InklingMoE``): fp32 gate over ``E + S`` rows, sigmoid, the correction bias, the ``S`` shared
  experts scored by the gate and renormalized with the routed top-k (``num_scored_shared_experts``: they are the
  layer's last ``S`` experts, ``topk = K + S``), ``route_scale`` and the learned ``global_scale``
  (``router_global_scale``).

Families MoELayer cannot express raise naming the reason (``_UNSUPPORTED``: ERNIE-4.5-VL's token-type expert sets,
PhiMoE's SparseMixer, Zaya's MLP router, Doge's product keys).
* ``step3p5`` (``Step3p7SparseMoeBlock``, Step-3.7's text model): sigmoid, correction bias, renormalized, scaled;
  ``min(silu(g), L) * clamp(u, -L, L)`` (``activation="post_clamped_swiglu"``) with per-layer limits for the experts
  (``swiglu_limits``) and the shared expert (``swiglu_limits_shared``: its own activation and limit), the shared
  expert's biases (``mlp_bias``: ``shared_expert_bias``). The layer's limits come from the block (``block=``) or
  its index (``layer_idx=``).
* ``inkling2_text`` (``Inkling2SparseMoeBlock``; ``inkling2_loop_text`` repeats it): fp32 gate, sigmoid,
  correction bias, renormalized, scaled; soft-capped SwiGLU (``activation="softcapped_swiglu"``).
* ``hy_v4`` (``HYV4MoE``; ``hy_v4_vl_text`` repeats it): DeepSeek-V3's router, ``limited_swiglu`` experts and a plain
  SwiGLU shared expert (``shared_expert_activation="swiglu"``).
* ``gemma4_text`` (no block module: ``Gemma4TextRouter`` and ``Gemma4TextExperts`` of the decoder layer, state dicts
  named relative to it): the gate on ``rms_norm(x) * scale / sqrt(H)`` (``router_input_norm``), softmax,
  renormalized, times ``per_expert_scale`` (``router_expert_scale``), gated GELU (``activation="geglu_tanh"``). The
  decoder layer routes its residual stream and feeds the experts ``pre_feedforward_layernorm_2`` of it: the swap
  puts :class:`HFRouterInput` in the router's place and :class:`HFSplitExperts` (``MoELayer(x, router_input=...)``)
  in the experts'. ``diffusion_gemma_text`` (DiffusionGemma) repeats it in two decoder-layer classes (its encoder's
  ``DiffusionGemmaEncoderTextLayer`` and its decoder's ``DiffusionGemmaDecoderTextLayer``), both swapped.

Reviewed for issue 33 with the existing options: ``hy_v3`` / ``afmoe`` (sigmoid, the block's own selection-bias
buffer, renormalized, scaled, shared experts), ``flint`` (fp32 sigmoid gate, an ungated shared expert), ``beam`` (as
``deepseek_v3``), ``granitemoe_swa`` / ``granitemoehybrid`` (as ``granitemoe``).

Blocks that repeat one of these (``_Family.profile``): ``olmoe``, ``flex_olmo``, ``minimax``, ``granitemoe`` as
``mixtral``;
``qwen3_vl_moe_text``, ``qwen3_omni_moe_text``, ``mellum`` as ``qwen3_moe``; ``qwen3_next``, ``qwen3_5_moe_text``,
``qwen4_exp_text`` as ``qwen2_moe``; ``glm4_moe``, ``glm4_moe_lite``, ``glm4v_moe_text``, ``dots1``, ``solar_open``,
``deepseek_v32``, ``glm_moe_dsa``, ``kimi_linear``, ``exaone_moe``, ``mimo_v2_flash``, ``bailing_hybrid`` as
``deepseek_v3``. Configs whose model transformers builds from a family's model classes (its auto mapping) are read
as that family: ``sarvam_moe`` (``Glm4MoeModel``) as ``glm4_moe``, ``sarvam_mla`` (``DeepseekV3Model``) as
``deepseek_v3``. A composite config is read through its text config (``get_text_config``): e.g. the
``nemotron_h`` language model of ``nemotron3_5_transcribe``.

Checkpoint layouts (names relative to the block, e.g. ``model.layers.3.mlp.``): transformers v5 fuses the experts
(``experts.gate_up_proj [E, 2F, H]``: the gate rows, then the up rows; ``experts.down_proj [E, H, F]``), which is
MoELayer's ``experts.fc1.weight`` / ``experts.fc2.weight`` layout; v4 checkpoints have one module per expert
(``experts.{e}.w1/w3/w2.weight`` for Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj.weight`` for the others).
:func:`hf_to_moe_state_dict` reads either, :func:`moe_to_hf_state_dict` writes either. With ``ep_size > 1`` both
take this rank's experts (``experts.fc1.weight`` holds ``L = E / ep_size`` of them).

Auxiliary loss: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE, GPT-OSS; added as
``router_aux_loss_coef * aux`` when ``output_router_logits``) pools the router logits of *all* layers: with
``f_e`` the fraction of all layers' routes that go to expert ``e`` and ``P_e`` the mean softmax score of ``e`` over
all layers' tokens, ``aux = K * E * sum_e f_e P_e``. MoELayer's loss (``aux_loss_coeff``) is per layer,
``E * sum_e f_e P_e`` over the layer's own tokens, and the layers' losses add up. The two agree (up to the factor
``K``) only for one layer; to reproduce a transformers training run after :func:`swap_moe_blocks`, leave
MoELayer's loss off (the default here), call the model with ``output_router_logits=False`` and add
``router_aux_loss_coef * hf_load_balancing_loss(model, attention_mask)`` (:func:`hf_load_balancing_loss`) to the
loss.

Example::

    model = AutoModelForCausalLM.from_pretrained(...)          # fp32 or bf16
    swapped = swap_moe_blocks(model)                           # every sparse-MoE block -> MoELayer, same weights
    out = model(input_ids, labels=labels)                      # same logits and gradients as before
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_graph.moe.config import MoEConfig
from moe_graph.moe.experts import GATED_ACTIVATIONS
from moe_graph.moe.layer import MoELayer

__all__ = ["BLOCK_CLASSES", "HFMoEBlock", "HFRouterInput", "HFSplitExperts", "hf_load_balancing_loss",
           "hf_to_moe_state_dict", "moe_config_from_hf", "moe_layer_from_hf", "moe_to_hf_state_dict", "swap_moe_blocks"]


@dataclass(frozen=True)
class _Family:
    block: str  # the transformers class of the sparse-MoE block
    router: str  # the gate module's name in the block
    v4_experts: Optional[Tuple[str, str, str]]  # per-expert (gate, up, down) module names of v4 checkpoints
    shared: Optional[str] = None  # the shared expert's module name (gate_proj / up_proj / down_proj inside)
    shared_gate: Optional[str] = None  # Qwen2-MoE's sigmoid gate of the shared expert
    returns_router_scores: bool = False  # the block returns (out, router_scores)
    fc1: str = "experts.gate_up_proj"  # v5 fused expert tensors ([E, 2F, H] / [E, H, F]), names in the block
    fc2: str = "experts.down_proj"
    expert_bias: str = "e_score_correction_bias"  # the selection bias's name in the router module
    expert_bias_2d: bool = False  # stored as [1, E] (ERNIE-4.5's moe_statics)
    transposed: bool = False  # fused experts stored [E, H, 2F] / [E, F, H] (Llama 4)
    output_bias: Optional[str] = None  # the block's output bias [H] (JetMoE)
    profile: Optional[str] = None  # the family whose block this one repeats (its config reader; None: its own)
    expert_bias_path: Optional[str] = None  # the selection bias's full name in the block (default router.expert_bias)
    output_norm: Optional[str] = None  # the block output's RMSNorm module (A.X-K1)
    dead_fc1_rows: bool = False  # fc1 stored with E + Z rows, the Z past E never read (LongCat-Flash)
    takes_input_ids: bool = False  # forward(hidden_states, input_ids): hash layers (DeepSeek-V4)
    router_extras: Tuple[Tuple[str, str], ...] = ()  # (name in the block, MoELayer name) of further router tensors
    split: bool = False  # router and experts are separate modules of the block (Gemma 4's decoder layer)
    latent: Optional[Tuple[str, str]] = None  # the block's projections into / out of the experts' latent width
    more_blocks: Tuple[str, ...] = ()  # further classes holding the same block (DiffusionGemma's encoder layers)
    shared_fused: bool = False  # the shared expert stores gate_up_proj [2F, H] (gate rows, then up rows): MiniMax-M3


_GEMMA4_ROUTER_EXTRAS = (("router.scale", "router.input_scale"), ("router.per_expert_scale", "router.expert_scale"))
_FAMILIES: Dict[str, _Family] = {
    "mixtral": _Family("MixtralSparseMoeBlock", "gate", ("w1", "w3", "w2")),
    "qwen2_moe": _Family("Qwen2MoeSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                         shared="shared_expert", shared_gate="shared_expert_gate"),
    "qwen3_moe": _Family("Qwen3MoeSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": _Family("DeepseekV3MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts"),
    "gpt_oss": _Family("GptOssMLP", "router", None, returns_router_scores=True),
    "ernie4_5_moe": _Family("Ernie4_5_MoeSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                            shared="shared_experts", expert_bias="moe_statics.e_score_correction_bias",
                            expert_bias_2d=True),
    "kolibri1": _Family("Kolibri1SparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                        shared="shared_experts"),
    "nemotron_h": _Family("NemotronHMoE", "gate", (None, "up_proj", "down_proj"), shared="shared_experts",
                          fc1="experts.up_proj", latent=("fc1_latent_proj", "fc2_latent_proj")),
    "jetmoe": _Family("JetMoeMoE", "router.layer", None, fc1="input_linear.weight", fc2="output_linear.weight",
                      output_bias="bias"),
    "glm5_next_text": _Family("Glm5NextTextMoE", "gate", ("gate_proj", "up_proj", "down_proj"),
                              shared="shared_experts"),
    "deepseek_v2": _Family("DeepseekV2Moe", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts"),
    "deepseek_ocr2_text": _Family("DeepseekOcr2TextMoe", "gate", ("gate_proj", "up_proj", "down_proj"),
                                  shared="shared_experts", profile="deepseek_v2"),
    "unlimited_ocr_text": _Family("UnlimitedOcrTextMoe", "gate", ("gate_proj", "up_proj", "down_proj"),
                                  shared="shared_experts", profile="deepseek_v2"),
    "jamba": _Family("JambaSparseMoeBlock", "router", ("gate_proj", "up_proj", "down_proj")),
    "cohere2_moe": _Family("Cohere2MoeSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                           shared="shared_experts"),
    "llama4_text": _Family("Llama4TextMoe", "router", None, shared="shared_expert", returns_router_scores=True,
                           transposed=True),
    # blocks that repeat one of the families above (modular copies in transformers), with their config reader
    "olmoe": _Family("OlmoeSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"), profile="mixtral"),
    "flex_olmo": _Family("FlexOlmoSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"), profile="mixtral"),
    "minimax": _Family("MiniMaxSparseMoeBlock", "gate", ("w1", "w3", "w2"), profile="mixtral"),
    "qwen3_vl_moe_text": _Family("Qwen3VLMoeTextSparseMoeBlock", "gate", None, profile="qwen3_moe"),
    "qwen3_omni_moe_text": _Family("Qwen3OmniMoeThinkerTextSparseMoeBlock", "gate", None, profile="qwen3_moe"),
    "mellum": _Family("MellumSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"), profile="qwen3_moe"),
    "qwen3_next": _Family("Qwen3NextSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                          shared="shared_expert", shared_gate="shared_expert_gate", profile="qwen2_moe"),
    "qwen3_5_moe_text": _Family("Qwen3_5MoeSparseMoeBlock", "gate", None, shared="shared_expert",
                                shared_gate="shared_expert_gate", profile="qwen2_moe"),
    "qwen4_exp_text": _Family("Qwen4ExpTextSparseMoeBlock", "gate", None, shared="shared_expert",
                              shared_gate="shared_expert_gate", profile="qwen2_moe"),
    "glm4_moe": _Family("Glm4MoeMoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                        profile="deepseek_v3"),
    "glm4_moe_lite": _Family("Glm4MoeLiteMoE", "gate", ("gate_proj", "up_proj", "down_proj"),
                             shared="shared_experts", profile="deepseek_v3"),
    "glm4v_moe_text": _Family("Glm4vMoeTextMoE", "gate", None, shared="shared_experts", profile="deepseek_v3"),
    "dots1": _Family("Dots1MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                     profile="deepseek_v3"),
    "solar_open": _Family("SolarOpenMoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                          profile="deepseek_v3"),
    "deepseek_v32": _Family("DeepseekV32MoE", "gate", ("gate_proj", "up_proj", "down_proj"),
                            shared="shared_experts", profile="deepseek_v3"),
    "glm_moe_dsa": _Family("GlmMoeDsaMoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                           profile="deepseek_v3"),
    "kimi_linear": _Family("KimiLinearMoE", "gate", ("gate_proj", "up_proj", "down_proj"),
                           shared="shared_experts", profile="deepseek_v3"),
    "exaone_moe": _Family("ExaoneMoeSparseMoEBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                          shared="shared_experts", profile="deepseek_v3"),
    "bailing_hybrid": _Family("BailingHybridMoE", "gate",
                              ("gate_proj", "up_proj", "down_proj"), shared="shared_experts", profile="deepseek_v3"),
    "mimo_v2_flash": _Family("MiMoV2FlashMoE", "gate", ("gate_proj", "up_proj", "down_proj"), profile="deepseek_v3"),
    "granitemoe": _Family("GraniteMoeMoE", "router", None, profile="mixtral"),
    "deepseek_v4": _Family("DeepseekV4SparseMoeBlock", "gate", ("w1", "w3", "w2"), shared="shared_experts",
                           takes_input_ids=True),
    "longcat_flash": _Family("LongcatFlashMoE", "router.classifier", ("gate_proj", "up_proj", "down_proj"),
                             expert_bias_path="router.e_score_correction_bias", dead_fc1_rows=True),
    "axk1": _Family("AXK1MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                    output_norm="post_mlp_layernorm"),
    "axk2": _Family("AXK2MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts"),
    "laguna": _Family("LagunaSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                      shared="shared_experts"),
    "minimax_m2": _Family("MiniMaxM2SparseMoeBlock", "gate", ("w1", "w3", "w2"),
                          expert_bias_path="e_score_correction_bias"),
    "lfm2_moe": _Family("Lfm2MoeSparseMoeBlock", "gate", ("w1", "w3", "w2"), expert_bias_path="expert_bias"),
    "mistral4": _Family("Mistral4MoE", "gate", None, shared="shared_experts"),
    "hunyuan_v1_moe": _Family("HunYuanMoEV1Moe", "gate.wg", ("gate_proj", "up_proj", "down_proj"),
                              shared="shared_mlp"),
    "aria_text": _Family("AriaTextMoELayer", "router", None, shared="shared_experts", transposed=True),
    "dbrx": _Family("DbrxFFN", "router.layer", None, fc1="experts.mlp.w1", fc2="experts.mlp.w2"),
    "granitemoeshared": _Family("GraniteMoeSharedMoE", "router", None, profile="mixtral"),
    # expert-side options: per-layer clamped SwiGLU after the activation (Step-3.7's text model, model_type
    # step3p5), soft-capped SwiGLU (Inkling-2), a shared expert with its own activation (HY-V4)
    "step3p5": _Family("Step3p7SparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts"),
    "inkling2_text": _Family("Inkling2SparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj")),
    "inkling2_loop_text": _Family("Inkling2LoopSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                                  profile="inkling2_text"),
    "hy_v4": _Family("HYV4MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts"),
    "hy_v4_vl_text": _Family("HYV4VLMoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                             profile="hy_v4"),
    # reviewed for issue 33: blocks the existing options express
    "granitemoe_swa": _Family("GraniteMoeSWAMoE", "router", None, profile="mixtral"),
    "granitemoehybrid": _Family("GraniteMoeHybridMoE", "router", None, profile="mixtral"),
    "hy_v3": _Family("HYV3MoE", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
                     expert_bias_path="e_score_correction_bias"),
    "afmoe": _Family("AfmoeSparseMoeBlock", "router.gate", ("gate_proj", "up_proj", "down_proj"),
                     shared="shared_experts", expert_bias_path="expert_bias"),
    "flint": _Family("FlintSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"), shared="shared_expert"),
    "beam": _Family("BeamMoE", "gate", ("gate_proj", "up_proj", "down_proj"), profile="deepseek_v3"),
    "qwen3_omni_moe_talker_text": _Family("Qwen3OmniMoeTalkerTextSparseMoeBlock", "gate", None, shared="shared_expert",
                                          shared_gate="shared_expert_gate", profile="qwen2_moe"),
    "minimax_m3_vl_text": _Family("MiniMaxM3VLSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                                  shared="shared_experts", shared_fused=True),
    "dots3_note_text": _Family("Dots3NoteTextMoE", "gate", ("gate_proj", "up_proj", "down_proj"),
                               shared="shared_experts"),
    "openai_privacy_filter": _Family("OpenAIPrivacyFilterMLP", "router", None, returns_router_scores=True,
                                     transposed=True),
    "lara_mini": _Family("LaraMiniSparseMoeBlock", "gate", ("gate_proj", "up_proj", "down_proj"),
                         shared="shared_expert"),
    "mistral_large4_text": _Family("MistralLarge4TextMoE", "gate", None, shared="shared_experts"),
    # Gemma 4: no block module; the decoder layer calls its router (on the residual stream) and its experts (on
    # pre_feedforward_layernorm_2 of it) itself
    "gemma4_text": _Family("Gemma4TextDecoderLayer", "router.proj", None, split=True,
                           router_extras=_GEMMA4_ROUTER_EXTRAS),
    "diffusion_gemma_text": _Family("DiffusionGemmaDecoderTextLayer", "router.proj", None, split=True,
                                    router_extras=_GEMMA4_ROUTER_EXTRAS, profile="gemma4_text",
                                    more_blocks=("DiffusionGemmaEncoderTextLayer",)),
    "inkling_text": _Family("InklingMoE", "gate", None),  # its shared experts become the last routed ones
    "muse_spark_text": _Family("MuseSparkMoE", "gate", None, latent=("pre_expert_proj", "post_expert_proj"),
                               router_extras=(("pre_expert_norm.weight", "expert_input_norm.weight"),
                                              ("experts.post_expert_norm.weight", "expert_output_norm.weight"))),
}
# transformers MoE families MoELayer cannot express, with the reason (moe_config_from_hf raises it)
_UNSUPPORTED: Dict[str, str] = {
    "ernie4_5_vl_moe": "token-type expert sets: text and vision tokens route to separate expert sets (the token "
                       "types are an input of the block), one MoELayer routes every token over one set",
    "ernie4_5_vl_moe_text": "token-type expert sets: text and vision tokens route to separate expert sets (the "
                            "token types are an input of the block), one MoELayer routes every token over one set",
    "phimoe": "SparseMixer routing: in training it samples the experts (exponential noise, Heun's third-order "
              "gradient estimate); MoELayer draws no random numbers and its gradient is the plain one",
    "zaya": "an MLP router (RMSNorm, two GELU layers, a skip class and states carried between layers); MoELayer's "
            "router is one linear gate",
    "doge": "product-key routing (experts chosen from the product of two key sets) over single-unit experts (a row "
            "of two embedding tables each), added to a dense MLP; MoELayer's router is one linear gate over the "
            "experts",
}
# transformers' hidden_act of non-gated experts -> MoELayer's activation
_PLAIN_ACTS = {"relu2": "squared_relu", "relu": "relu", "silu": "silu", "gelu": "gelu"}
BLOCK_CLASSES = {b: t for t, f in _FAMILIES.items() for b in (f.block,) + f.more_blocks}  # block class -> model_type


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _same_model_family(model_type: Optional[str]) -> Optional[str]:
    """The supported family whose model classes transformers also builds for ``model_type`` (its auto mapping:
    ``sarvam_moe`` -> ``Glm4MoeModel``, the model of ``glm4_moe``; ``sarvam_mla`` -> ``deepseek_v3``'s), else
    None."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    except ImportError:
        return None
    model = MODEL_MAPPING_NAMES.get(model_type) if model_type is not None else None
    if model is None:
        return None
    return next((f for f in _FAMILIES if MODEL_MAPPING_NAMES.get(f) == model), None)


def _family(config) -> Tuple[str, _Family]:
    t = getattr(config, "model_type", None)
    if t not in _FAMILIES and t not in _UNSUPPORTED:
        t = _same_model_family(t) or t
    if t in _UNSUPPORTED:
        raise ValueError(f"config.model_type={t!r} cannot be expressed by MoELayer: {_UNSUPPORTED[t]}")
    if t not in _FAMILIES:
        raise ValueError(f"config.model_type={t!r} is not a supported MoE family; supported: {sorted(_FAMILIES)}")
    return t, _FAMILIES[t]


def _gated_silu(config, model_type: str) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act={act!r} cannot be expressed: MoELayer's gated experts are SwiGLU "
                         f"(hidden_act='silu')")


def _first(c, *names):
    """The first of the config attributes ``names`` that is set (families name the same option differently)."""
    for n in names:
        v = getattr(c, n, None)
        if v is not None:
            return v
    raise ValueError(f"{getattr(c, 'model_type', type(c).__name__)}: the config has none of {names}")


def _best2_groups(c, num_experts: int, model_type: str) -> Dict:
    """Mistral 4's group-limited routing options (``n_group`` groups, each scored by its best 2 experts, the best
    ``topk_group`` kept); none for ``n_group`` of 0 or 1."""
    if not c.n_group or c.n_group <= 1:
        return {}
    if num_experts % c.n_group or num_experts // c.n_group < 2:
        raise ValueError(f"{model_type}: n_group={c.n_group} must divide n_routed_experts={num_experts} into groups "
                         "of at least 2 (a group scores its best 2)")
    return dict(num_groups=c.n_group, group_topk=c.topk_group, group_score_topk=2)


def _deepseek_routing(c, model_type: str) -> Dict:
    """DeepSeek-V3's router (also Nemotron-H's): fp32 gate, sigmoid, the correction bias for the selection, groups
    scoring their best 2, ``norm_topk_prob``, ``routed_scaling_factor``."""
    opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
                num_experts=_first(c, "n_routed_experts", "num_local_experts", "num_experts"),
                topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob),
                topk_scaling_factor=float(c.routed_scaling_factor), enable_expert_bias=True,
                router_dtype=torch.float32)
    E = opts["num_experts"]
    if c.n_group and c.n_group > 1:
        if E % c.n_group or E // c.n_group < 2:
            raise ValueError(f"{model_type}: n_group={c.n_group} must divide n_routed_experts={E} into groups of at "
                             "least 2 (a group scores its best 2)")
        opts.update(num_groups=c.n_group, group_topk=c.topk_group, group_score_topk=2)
    return opts


def _per_layer(c, name: str, layer_idx: Optional[int], model_type: str):
    """Entry ``layer_idx`` of the per-layer list option ``name`` (``None`` when the config has no list); without
    ``layer_idx`` the entries must all agree."""
    v = getattr(c, name, None)
    if not v:
        return None
    if layer_idx is None:
        if len(set(v)) > 1:
            raise ValueError(f"{model_type}: {name}={list(v)} differs between layers: pass block= or layer_idx= "
                             "(swap_moe_blocks passes each block)")
        return v[0]
    if not 0 <= layer_idx < len(v):
        raise ValueError(f"{model_type}: layer_idx={layer_idx} is outside {name} ({len(v)} layers)")
    return v[layer_idx]


def moe_config_from_hf(config, *, block=None, hash_layer: Optional[bool] = None, layer_idx: Optional[int] = None,
                       **overrides) -> MoEConfig:
    """The :class:`moe_graph.moe.config.MoEConfig` of one sparse-MoE block of a transformers ``config`` (a
    ``PretrainedConfig`` of a supported family, or a multimodal one whose text config is). ``overrides``: further
    MoELayer options (``ep_size``, ``num_spare_experts_per_ep_rank``, ``capacity_factor``, ``params_dtype``,
    ``aux_loss_coeff``, ...). Per-layer options (DeepSeek-V4's hash layers, Step-3.7's SwiGLU limits) come from
    ``block``, the transformers block the layer replaces, or ``hash_layer`` (default: a learned-router layer) and
    ``layer_idx`` (the block's decoder layer: Step-3.7's ``swiglu_limits`` entry). Raises ``ValueError`` naming
    the option for a config it cannot express."""
    config = _text_config(config)
    t, fam = _family(config)
    c = config
    p = fam.profile or t
    if hash_layer is None:
        hash_layer = bool(getattr(block, "is_hash", False))
    opts: Dict = {}
    if p == "mixtral":
        _gated_silu(c, t)
        jitter = getattr(c, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise ValueError(f"{t}: router_jitter_noise={jitter} cannot be expressed: the jitter is random per "
                             "forward and MoELayer draws no random numbers (set router_jitter_noise=0)")
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
                    num_experts=_first(c, "num_local_experts", "num_experts"), topk=c.num_experts_per_tok,
                    norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)))
    elif p in ("qwen2_moe", "qwen3_moe"):
        _gated_silu(c, t)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)))
        if p == "qwen2_moe" and c.shared_expert_intermediate_size:
            opts.update(shared_expert_ffn_size=c.shared_expert_intermediate_size, shared_expert_gate=True)
    elif p == "deepseek_v3":
        _gated_silu(c, t)
        opts = _deepseek_routing(c, t)
        n_shared = getattr(c, "n_shared_experts", None) or getattr(c, "num_shared_experts", None)
        if n_shared:
            opts.update(shared_expert_ffn_size=c.moe_intermediate_size * n_shared)
    elif p == "deepseek_v2":
        _gated_silu(c, t)
        method = getattr(c, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{t}: topk_method={method!r} cannot be expressed (greedy, group_limited_greedy)")
        # fp32 gate, softmax, the top-k scores not renormalized, times routed_scaling_factor; groups scored by
        # their best expert
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
                    num_experts=_first(c, "n_routed_experts", "num_experts"), topk=c.num_experts_per_tok,
                    norm_topk_prob=False, topk_scaling_factor=float(c.routed_scaling_factor),
                    router_dtype=torch.float32)
        if method == "group_limited_greedy":
            opts.update(num_groups=c.n_group, group_topk=c.topk_group, group_score_topk=1)
        if c.n_shared_experts:
            opts.update(shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts)
    elif t == "jamba":
        _gated_silu(c, t)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=False)
    elif t == "cohere2_moe":
        _gated_silu(c, t)
        fn = c.expert_selection_fn
        if fn not in ("softmax", "sigmoid"):
            raise ValueError(f"cohere2_moe: expert_selection_fn={fn!r} cannot be expressed")
        # softmax over the top-k logits (the renormalized top-k softmax), or the sigmoid of the top-k logits
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func=fn,
                    norm_topk_prob=True if fn == "softmax" else bool(c.norm_topk_prob), select_on="logits")
        if c.num_shared_experts:
            combine = c.shared_expert_combination_strategy
            if combine not in ("sum", "average"):
                raise ValueError(f"cohere2_moe: shared_expert_combination_strategy={combine!r} cannot be expressed")
            opts.update(shared_expert_ffn_size=c.intermediate_size * c.num_shared_experts,
                        shared_expert_combine=combine)
    elif t == "glm5_next_text":
        _gated_silu(c, t)
        opts = _deepseek_routing(c, t)
        opts.update(activation="limited_swiglu", swiglu_limit=float(c.swiglu_limit))
        if c.n_shared_experts:
            opts.update(shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts)
    elif t == "nemotron_h":
        act = c.mlp_hidden_act
        if act not in _PLAIN_ACTS:
            raise ValueError(f"nemotron_h: mlp_hidden_act={act!r} cannot be expressed (non-gated experts: "
                             f"{sorted(_PLAIN_ACTS)})")
        opts = _deepseek_routing(c, t)
        # mlp_bias: biases on the shared expert and the latent projections, none on the routed experts
        opts.update(activation=_PLAIN_ACTS[act], shared_expert_ffn_size=c.moe_shared_expert_intermediate_size,
                    shared_expert_bias=bool(c.mlp_bias))
        if c.moe_latent_size is not None:  # fc1_latent_proj / fc2_latent_proj around the routed experts
            opts.update(latent_size=c.moe_latent_size, latent_bias=bool(c.mlp_bias))
    elif t == "jetmoe":
        act = c.activation_function
        if act != "silu":
            raise ValueError(f"jetmoe: activation_function={act!r} cannot be expressed: MoELayer's gated experts are "
                             "SwiGLU ('silu')")
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=True, output_bias=True)
    elif t == "llama4_text":
        _gated_silu(c, t)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=False, probs_on_input=True,
                    shared_expert_ffn_size=c.intermediate_size, select_on="logits")
    elif t == "ernie4_5_moe":
        _gated_silu(c, t)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=True, enable_expert_bias=True,
                    router_dtype=torch.float32,
                    norm_topk_min=float(c.moe_norm_min) if c.moe_norm_min is not None else None)
        if c.moe_num_shared_experts:  # use_bias: biases on the shared experts only (shared_expert_bias)
            opts.update(shared_expert_ffn_size=c.moe_intermediate_size * c.moe_num_shared_experts,
                        shared_expert_bias=bool(c.use_bias))
    elif t == "kolibri1":
        _gated_silu(c, t)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob),
                    enable_expert_bias=True, select_on="logits", router_dtype=torch.float32,
                    shared_expert_ffn_size=c.shared_expert_intermediate_size)
    elif t == "deepseek_v4":
        _gated_silu(c, t)
        if c.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise ValueError(f"deepseek_v4: scoring_func={c.scoring_func!r} cannot be expressed (sqrtsoftplus, sigmoid)")
        if c.mlp_bias:
            raise ValueError("deepseek_v4: mlp_bias=True cannot be expressed: the shared expert would have biases and "
                             "the routed experts none (MoELayer's add_bias_linear sets both)")
        # the gate in the input dtype; the chosen scores always renormalized (+1e-20) and scaled; one shared expert
        # of moe_intermediate_size; experts and shared expert silu(min(g, L)) * clamp(u, -L, L)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
                    num_experts=c.n_routed_experts, topk=c.num_experts_per_tok, score_func=c.scoring_func,
                    norm_topk_prob=True, topk_scaling_factor=float(c.routed_scaling_factor),
                    activation="limited_swiglu", swiglu_limit=float(c.swiglu_limit),
                    shared_expert_ffn_size=c.moe_intermediate_size)
        if hash_layer:  # experts from gate.tid2eid[input_ids]; no selection bias
            opts.update(hash_vocab_size=c.vocab_size)
        else:
            opts.update(enable_expert_bias=True)
    elif t == "longcat_flash":
        _gated_silu(c, t)
        if getattr(c, "router_bias", False):
            raise ValueError("longcat_flash: router_bias=True cannot be expressed: transformers' router never applies "
                             "the classifier's bias")
        if not c.n_routed_experts:
            raise ValueError("longcat_flash: n_routed_experts=0 (only zero-computation experts) cannot be expressed")
        # fp32 gate, softmax over the E + Z experts, the selection bias on the scores, not renormalized, scaled;
        # the zero-computation experts return the token times its probability
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.expert_ffn_hidden_size,
                    num_experts=c.n_routed_experts, topk=c.moe_topk, num_zero_experts=int(c.zero_expert_num or 0),
                    norm_topk_prob=False, topk_scaling_factor=float(c.routed_scaling_factor),
                    enable_expert_bias=True, router_dtype=torch.float32)
    elif t in ("axk1", "axk2"):
        _gated_silu(c, t)
        opts = _deepseek_routing(c, t)
        if t == "axk2" and "num_groups" in opts:  # its group mask scores the other groups' experts 0.0, not -inf
            opts.update(group_masked_score=0.0)
        opts.update(shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts)
        if t == "axk1":  # post_mlp_layernorm: an RMSNorm of the block output
            opts.update(output_norm="rmsnorm", output_norm_eps=float(c.rms_norm_eps))
    elif t == "laguna":
        _gated_silu(c, t)
        # the gate in the input dtype, logits soft-capped, sigmoid, the selection bias on the scores, renormalized,
        # the routed output times moe_routed_scaling_factor (= scaled probabilities), a shared expert
        cap = float(c.moe_router_logit_softcapping or 0.0)
        scale = float(c.moe_routed_scaling_factor)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=True,
                    topk_scaling_factor=scale if scale != 1.0 else None, enable_expert_bias=True,
                    logit_softcap=cap if cap > 0 else None,
                    shared_expert_ffn_size=c.shared_expert_intermediate_size)
    elif t == "minimax_m2":
        _gated_silu(c, t)
        jitter = c.router_jitter_noise or 0.0
        if jitter > 0:
            raise ValueError(f"minimax_m2: router_jitter_noise={jitter} cannot be expressed: the jitter is random per "
                             "forward and MoELayer draws no random numbers (set router_jitter_noise=0)")
        # sigmoid, the block's e_score_correction_bias for the selection, renormalized, no scaling
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=True, enable_expert_bias=True)
    elif t == "lfm2_moe":
        _gated_silu(c, t)
        # sigmoid, the block's expert_bias for the selection (use_expert_bias), renormalized by sum + 1e-6 (not a
        # rounding detail: a top-k of sigmoid scores summing to ~1e-8 keeps weights ~1e-2), routed_scaling_factor
        scale = float(c.routed_scaling_factor)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob),
                    topk_scaling_factor=scale if scale != 1.0 else None, enable_expert_bias=bool(c.use_expert_bias),
                    norm_topk_eps=1e-6)
    elif t == "mistral4":
        _gated_silu(c, t)
        # the gate in the input dtype, softmax, groups scored by their best 2 (the other groups' experts masked with
        # 0.0: softmax scores are positive and topk <= topk_group * group size, so as with -inf), norm_topk_prob,
        # routed_scaling_factor, shared experts
        E = c.n_routed_experts
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=E,
                    topk=c.num_experts_per_tok, norm_topk_prob=bool(c.norm_topk_prob),
                    topk_scaling_factor=float(c.routed_scaling_factor),
                    shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts or None)
        opts.update(_best2_groups(c, E, t))
    elif t == "hunyuan_v1_moe":
        _gated_silu(c, t)
        E, K = c.num_experts, c.moe_topk
        if isinstance(E, (list, tuple)) or isinstance(K, (list, tuple)):  # per-layer values: the block's own
            gate = getattr(block, "gate", None)
            if gate is None:
                if len(set(E if isinstance(E, (list, tuple)) else [E])) > 1 or \
                        len(set(K if isinstance(K, (list, tuple)) else [K])) > 1:
                    raise ValueError("hunyuan_v1_moe: num_experts / moe_topk differ per layer: pass block= (the "
                                     "HunYuanMoEV1Moe the layer replaces)")
                E = E[0] if isinstance(E, (list, tuple)) else E
                K = K[0] if isinstance(K, (list, tuple)) else K
            else:
                E, K = gate.num_experts, gate.top_k
        # fp32 gate (wg is fp32), softmax, top-k renormalized, a shared SwiGLU MLP of intermediate_size
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=E, topk=K,
                    norm_topk_prob=True, router_dtype=torch.float32, shared_expert_ffn_size=c.intermediate_size)
    elif t == "aria_text":
        if c.hidden_act != "silu":
            raise ValueError(f"aria_text: hidden_act={c.hidden_act!r} cannot be expressed: the shared experts would "
                             "use it and the routed experts SiLU (MoELayer's activation is one setting)")
        if c.mlp_bias:
            raise ValueError("aria_text: mlp_bias=True cannot be expressed: the shared experts would have biases and "
                             "the routed experts none (MoELayer's add_bias_linear sets both)")
        # softmax over the top-k logits; experts stored [E, H, 2F] / [E, F, H]; shared experts
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.moe_num_experts,
                    topk=c.moe_topk, norm_topk_prob=True,
                    shared_expert_ffn_size=c.intermediate_size * c.moe_num_shared_experts or None)
    elif t == "dbrx":
        f = c.ffn_config
        act = (f.ffn_act_fn or {}).get("name", "silu")
        if act != "silu":
            raise ValueError(f"dbrx: ffn_act_fn={f.ffn_act_fn!r} cannot be expressed: MoELayer's gated experts are "
                             "SwiGLU ('silu')")
        if f.moe_jitter_eps:
            raise ValueError(f"dbrx: moe_jitter_eps={f.moe_jitter_eps} cannot be expressed: the jitter is random per "
                             "forward and MoELayer draws no random numbers (set moe_jitter_eps=None)")
        p = f.moe_normalize_expert_weights
        if p not in (None, 1, 1.0):
            raise ValueError(f"dbrx: moe_normalize_expert_weights={p} cannot be expressed: MoELayer renormalizes the "
                             "top-k by their sum (p=1) or not at all (None)")
        # softmax, top-k divided by their L1 norm (their sum) or not; experts w1/v1/w2 stored [E * F, H] each
        opts = dict(hidden_size=c.d_model, ffn_hidden_size=f.ffn_hidden_size, num_experts=f.moe_num_experts,
                    topk=f.moe_top_k, norm_topk_prob=p is not None)
    elif t == "step3p5":
        _gated_silu(c, t)
        # sigmoid scores, the correction bias for the selection, the top-k always renormalized, scaled; the experts'
        # and the shared expert's SwiGLU clamped after the activation with per-layer limits (0 / None: no clamp)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
                    num_experts=c.num_local_experts, topk=c.num_experts_per_tok, score_func="sigmoid",
                    norm_topk_prob=True, topk_scaling_factor=float(c.moe_router_scaling_factor),
                    enable_expert_bias=True, shared_expert_ffn_size=c.share_expert_dim,
                    shared_expert_bias=bool(c.mlp_bias))
        if block is not None:  # the block's own limits (inf: no clamp)
            limit, shared_limit = block.experts.limit, block.shared_experts.limit
        else:
            limit = _per_layer(c, "swiglu_limits", layer_idx, t)
            shared_limit = _per_layer(c, "swiglu_limits_shared", layer_idx, t)
        limit, shared_limit = (v if v and v != float("inf") else None for v in (limit, shared_limit))
        if limit:
            opts.update(activation="post_clamped_swiglu", swiglu_limit=float(limit))
        opts.update(dict(shared_expert_activation="post_clamped_swiglu", shared_expert_swiglu_limit=float(shared_limit))
                    if shared_limit else dict(shared_expert_activation="swiglu"))
    elif p == "inkling2_text":
        if c.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"{t}: scoring_func={c.scoring_func!r} cannot be expressed (sigmoid, softmax)")
        # fp32 gate, scores + correction bias for the selection, the top-k renormalized and scaled; experts with
        # cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
                    num_experts=c.n_routed_experts, topk=c.num_experts_per_tok, score_func=c.scoring_func,
                    norm_topk_prob=True, topk_scaling_factor=float(c.routed_scaling_factor), enable_expert_bias=True,
                    router_dtype=torch.float32, activation="softcapped_swiglu",
                    swiglu_alpha=float(c.mlp_gate_softcap), swiglu_limit=float(c.mlp_up_softcap))
    elif p == "hy_v4":
        _gated_silu(c, t)
        # DeepSeek-V3's router; routed experts silu(min(g, L)) * clamp(u, -L, L), the shared expert plain SwiGLU
        opts = _deepseek_routing(c, t)
        opts.update(activation="limited_swiglu", swiglu_limit=float(c.swiglu_limit))
        if c.n_shared_experts:
            opts.update(shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts,
                        shared_expert_activation="swiglu")
    elif t in ("hy_v3", "afmoe"):
        _gated_silu(c, t)
        # sigmoid (HY-V3: fp32 gate; AFMoE: the gate in the input dtype), the block's selection bias, renormalized
        # (+1e-20), scaled; shared experts of num_shared_experts * moe_intermediate_size
        scale = float(c.router_scaling_factor if t == "hy_v3" else c.route_scale)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=True, enable_expert_bias=True,
                    topk_scaling_factor=scale if scale != 1.0 else None,
                    router_dtype=torch.float32 if t == "hy_v3" else None,
                    shared_expert_ffn_size=c.moe_intermediate_size * c.num_shared_experts or None)
    elif t == "minimax_m3_vl_text":
        # the gate in the weight dtype, sigmoid, the correction bias for the selection, renormalized, the routed
        # output times routed_scaling_factor; experts and shared expert GPT-OSS's clamped SwiGLU (not interleaved)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=True, enable_expert_bias=True,
                    topk_scaling_factor=float(c.routed_scaling_factor), activation="clamped_swiglu",
                    swiglu_alpha=float(c.swiglu_alpha), swiglu_limit=float(c.swiglu_limit),
                    shared_expert_ffn_size=c.shared_intermediate_size)
    elif t == "dots3_note_text":
        _gated_silu(c, t)
        # DeepSeek-V3's router; the shared experts have their own size (shared_experts_intermediate_size each)
        opts = _deepseek_routing(c, t)
        opts.update(shared_expert_ffn_size=c.shared_experts_intermediate_size * c.n_shared_experts)
    elif t == "openai_privacy_filter":
        # GPT-OSS's block in fp32 without the interleaving: the gate with a bias, the softmax of the top-k logits
        # (divided by K, the block's output times K: the renormalized top-k), expert biases, clamped SwiGLU
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=True, router_bias=True, router_dtype=torch.float32,
                    add_bias_linear=True, activation="clamped_swiglu", swiglu_alpha=float(c.swiglu_alpha),
                    swiglu_limit=float(c.swiglu_limit))
    elif t == "lara_mini":
        _gated_silu(c, t)
        # fp32 gate, softmax, norm_topk_prob, an ungated shared SwiGLU expert
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=bool(c.norm_topk_prob), router_dtype=torch.float32,
                    shared_expert_ffn_size=c.shared_expert_intermediate_size)
    elif t == "mistral_large4_text":
        _gated_silu(c, t)
        # fp32 gate, softmax, groups scored by their best 2 (the 0.0 mask of the other groups equals -inf for
        # softmax scores), the top-k always renormalized (+1e-20), routed_scaling_factor, shared experts
        E = c.n_routed_experts
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=E,
                    topk=c.num_experts_per_tok, norm_topk_prob=True, router_dtype=torch.float32,
                    topk_scaling_factor=float(c.routed_scaling_factor),
                    shared_expert_ffn_size=c.moe_intermediate_size * c.n_shared_experts or None)
        opts.update(_best2_groups(c, E, t))
    elif t == "flint":
        _gated_silu(c, t)
        # fp32 gate, sigmoid, norm_topk_prob, an ungated shared SwiGLU expert
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=bool(c.norm_topk_prob),
                    router_dtype=torch.float32, shared_expert_ffn_size=c.shared_expert_intermediate_size)
    elif p == "gemma4_text":
        if not getattr(c, "enable_moe_block", bool(c.num_experts)):  # DiffusionGemma: num_experts=None, dense
            raise ValueError(f"{t}: enable_moe_block=False / num_experts=None: the model has no MoE block")
        act = c.hidden_activation
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{t}: hidden_activation={act!r} cannot be expressed: MoELayer's gated GELU is "
                             "the tanh approximation ('gelu_pytorch_tanh')")
        # the gate sees rms_norm(x) * scale / sqrt(H); softmax, the top-k renormalized, times per_expert_scale;
        # gelu_tanh(g) * u experts
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_experts,
                    topk=c.top_k_experts, norm_topk_prob=True, activation="geglu_tanh", router_input_norm=True,
                    router_norm_eps=float(c.rms_norm_eps), router_expert_scale=True)
    elif t == "inkling_text":
        _gated_silu(c, t)
        # fp32 gate over E + S rows, sigmoid, the correction bias for the routed selection, the S shared experts
        # appended to every token's top-k and all K + S scores renormalized together (exp(logsigmoid - logsumexp)),
        # times route_scale and the learned global_scale; the shared experts (moe_intermediate_size) are the
        # layer's last S experts, their per-token weight on their output (transformers applies it before
        # down_proj: the same product, rounded in another order)
        S, E, K = c.n_shared_experts, c.n_routed_experts, c.num_experts_per_tok
        if not S:
            raise ValueError("inkling_text: n_shared_experts=0 cannot be expressed (transformers' router slices "
                             "[..., :-0])")
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=E + S,
                    topk=K + S, num_scored_shared_experts=S, score_func="sigmoid", norm_topk_prob=True,
                    topk_scaling_factor=float(c.route_scale), enable_expert_bias=True, router_global_scale=True,
                    router_dtype=torch.float32)
    elif t == "muse_spark_text":
        _gated_silu(c, t)
        # fp32 gate times output_multiplier, sigmoid, the correction bias for the selection, renormalized, scaled;
        # the experts in moe_hidden_size between pre_expert_proj / post_expert_proj, normed around them
        scale = float(c.routed_scaling_factor)
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, score_func="sigmoid", norm_topk_prob=True,
                    topk_scaling_factor=scale if scale != 1.0 else None, enable_expert_bias=True,
                    router_dtype=torch.float32, router_logit_multiplier=float(c.output_multiplier),
                    latent_size=c.moe_hidden_size, expert_input_norm="centered_rmsnorm",
                    expert_input_norm_eps=float(c.rms_norm_eps), expert_output_norm="scaled_rmsnorm",
                    expert_output_norm_eps=float(c.post_norm_eps), norm_topk_eps=1e-15)
    elif t == "gpt_oss":
        opts = dict(hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size, num_experts=c.num_local_experts,
                    topk=c.num_experts_per_tok, norm_topk_prob=True, router_bias=True, add_bias_linear=True,
                    activation="clamped_swiglu", swiglu_alpha=float(c.swiglu_alpha),
                    swiglu_limit=float(c.swiglu_limit))
    opts.update(overrides)
    return MoEConfig(**opts)


def _latent_names(fam: _Family, cfg: MoEConfig) -> Tuple[Tuple[str, str], ...]:
    """(name in the block, MoELayer name) of the latent projections' tensors (none without ``latent_size``)."""
    if not cfg.latent_size:
        return ()
    kinds = ("weight", "bias") if cfg.latent_bias else ("weight",)
    return tuple((f"{hf}.{k}", f"{ours}.{k}") for hf, ours in zip(fam.latent, ("latent_in", "latent_out"))
                 for k in kinds)


def moe_layer_from_hf(config, *, ep_group=None, device=None, block=None, **overrides) -> MoELayer:
    """A :class:`MoELayer` for one sparse-MoE block of ``config`` (:func:`moe_config_from_hf`, ``block``,
    ``hash_layer`` and ``layer_idx`` as there; freshly initialized: load a block's weights with
    :func:`hf_to_moe_state_dict`)."""
    return MoELayer.from_config(moe_config_from_hf(config, block=block, **overrides), ep_group=ep_group, device=device)


# ------------------------------------------------------------------------------------------- state dicts --
def _ep_slice(ep_rank: int, ep_size: int, num_experts: int) -> slice:
    if ep_size < 1 or num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank}, ep_size={ep_size}: ep_size must divide num_experts={num_experts} and "
                         f"0 <= ep_rank < ep_size")
    L = num_experts // ep_size
    return slice(ep_rank * L, (ep_rank + 1) * L)


def _v4_expert_ids(sd: Dict[str, torch.Tensor]) -> List[int]:
    return sorted({int(m.group(1)) for k in sd if (m := re.match(r"experts\.(\d+)\.", k))})


def _expert_bias_key(fam: _Family) -> str:
    return fam.expert_bias_path or f"{fam.router}.{fam.expert_bias}"


def _take(sd: Dict[str, torch.Tensor], key: str, model_type: str) -> torch.Tensor:
    if key not in sd:
        raise KeyError(f"{model_type} block state dict has no {key!r} (keys: {sorted(sd)[:8]}...)")
    return sd[key]


def hf_to_moe_state_dict(hf_state_dict: Dict[str, torch.Tensor], config, *, ep_rank: int = 0,
                         ep_size: int = 1) -> Dict[str, torch.Tensor]:
    """A transformers MoE block's state dict (names relative to the block; v5 fused or v4 per-expert experts,
    detected from the names) -> :class:`MoELayer`'s state dict holding experts ``[ep_rank * L, (ep_rank + 1) * L)``
    (``L = E / ep_size``). Tensors that need no reshaping are returned as they are (the same objects); nothing
    is read for another rank's experts."""
    config = _text_config(config)
    t, fam = _family(config)

    sd = hf_state_dict
    hashed = f"{fam.router}.tid2eid" in sd  # a DeepSeek-V4 hash layer
    cfg = moe_config_from_hf(config, hash_layer=hashed, layer_idx=0)  # Step-3.7's per-layer limits keep the layout
    sl = _ep_slice(ep_rank, ep_size, cfg.num_experts)
    out: Dict[str, torch.Tensor] = {"router.weight": _take(sd, f"{fam.router}.weight", t)}
    if cfg.router_bias:
        out["router.bias"] = _take(sd, f"{fam.router}.bias", t)
    if cfg.enable_expert_bias:
        out["router.expert_bias"] = _take(sd, _expert_bias_key(fam), t).reshape(-1)
    if cfg.router_global_scale:
        out["router.global_scale"] = _take(sd, f"{fam.router}.global_scale", t)
    S = cfg.num_scored_shared_experts
    if S and "router.expert_bias" in out:  # the shared experts take no part in the selection: bias 0
        b = out["router.expert_bias"]
        out["router.expert_bias"] = torch.cat([b, b.new_zeros(S)])
    if hashed:
        out["router.tid2eid"] = sd[f"{fam.router}.tid2eid"]
    if fam.output_norm is not None:
        out["output_norm.weight"] = _take(sd, f"{fam.output_norm}.weight", t)
    for hf_name, name in fam.router_extras + _latent_names(fam, cfg):
        out[name] = _take(sd, hf_name, t)
    whole = sl.start == 0 and sl.stop == cfg.num_experts and not fam.dead_fc1_rows
    if t == "gpt_oss":
        gu = _take(sd, "experts.gate_up_proj", t)[sl]  # [L, H, 2F], gate/up interleaved
        gub = _take(sd, "experts.gate_up_proj_bias", t)[sl]
        out["experts.fc1.weight"] = torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        out["experts.fc1.bias"] = torch.cat([gub[..., 0::2], gub[..., 1::2]], dim=-1).contiguous()
        out["experts.fc2.weight"] = _take(sd, "experts.down_proj", t)[sl].transpose(1, 2).contiguous()
        b2 = _take(sd, "experts.down_proj_bias", t)
        out["experts.fc2.bias"] = b2 if whole else b2[sl]
    elif t == "inkling_text":  # the routed experts, then the S shared ones ([S, F, H] gate / up, [S, H, F] down)
        gu = torch.cat([_take(sd, "experts.gate_up_proj", t), torch.cat(
            [_take(sd, "shared_experts.gate_proj", t), _take(sd, "shared_experts.up_proj", t)], dim=1)])
        dp = torch.cat([_take(sd, "experts.down_proj", t), _take(sd, "shared_experts.down_proj", t)])
        out["experts.fc1.weight"], out["experts.fc2.weight"] = gu[sl], dp[sl]
    elif t == "dbrx":  # w1 (gate), v1 (up), w2 (down, transposed) stored [E * F, H]
        E, F, H = cfg.num_experts, cfg.ffn_hidden_size, cfg.hidden_size
        w1, v1, w2 = (_take(sd, f"experts.mlp.{n}", t).view(E, F, H)[sl] for n in ("w1", "v1", "w2"))
        out["experts.fc1.weight"] = torch.cat([w1, v1], dim=1)
        out["experts.fc2.weight"] = w2.transpose(1, 2).contiguous()
    elif fam.fc1 in sd:  # v5
        gu, dp = sd[fam.fc1], _take(sd, fam.fc2, t)
        gu, dp = (gu, dp) if whole else (gu[sl], dp[sl])  # LongCat-Flash: fc1's zero-expert rows left out
        if fam.transposed:
            gu, dp = gu.transpose(1, 2).contiguous(), dp.transpose(1, 2).contiguous()
        out["experts.fc1.weight"], out["experts.fc2.weight"] = gu, dp
        if cfg.add_bias_linear:  # fused expert biases next to the weights (the OpenAI privacy filter)
            b1, b2 = _take(sd, f"{fam.fc1}_bias", t), _take(sd, f"{fam.fc2}_bias", t)
            out["experts.fc1.bias"], out["experts.fc2.bias"] = (b1, b2) if whole else (b1[sl], b2[sl])
    else:  # v4: one module per expert
        if not _v4_expert_ids(sd):
            raise KeyError(f"{t} block state dict has neither {fam.fc1} (v5) nor experts.<e>.* (v4) keys")
        g, u, d = fam.v4_experts
        ids = range(sl.start, sl.stop)
        out["experts.fc1.weight"] = torch.stack([torch.cat([_take(sd, f"experts.{e}.{n}.weight", t)
                                                            for n in (g, u) if n is not None]) for e in ids])
        out["experts.fc2.weight"] = torch.stack([_take(sd, f"experts.{e}.{d}.weight", t) for e in ids])
    if fam.output_bias is not None:
        out["output_bias"] = _take(sd, fam.output_bias, t)
    if fam.shared is not None and cfg.shared_expert_ffn_size:
        s = fam.shared
        gated = cfg.shared_activation in GATED_ACTIVATIONS
        out["shared_expert.fc1.weight"] = _take(sd, f"{s}.gate_up_proj.weight", t) if fam.shared_fused else \
            torch.cat([_take(sd, f"{s}.{n}.weight", t) for n in (("gate_proj",) if gated else ()) + ("up_proj",)])
        out["shared_expert.fc2.weight"] = _take(sd, f"{s}.down_proj.weight", t)
        if cfg.shared_bias:
            out["shared_expert.fc1.bias"] = torch.cat([_take(sd, f"{s}.{n}.bias", t)
                                                       for n in (("gate_proj",) if gated else ()) + ("up_proj",)])
            out["shared_expert.fc2.bias"] = _take(sd, f"{s}.down_proj.bias", t)
        if fam.shared_gate is not None:
            out["shared_expert.gate.weight"] = _take(sd, f"{fam.shared_gate}.weight", t)
    return out


def moe_to_hf_state_dict(moe_state_dict: Dict[str, torch.Tensor], config, *, layout: str = "v5", ep_rank: int = 0,
                         ep_size: int = 1) -> Dict[str, torch.Tensor]:
    """:class:`MoELayer`'s state dict (this rank's ``L`` experts with ``ep_size > 1``) -> the transformers block's,
    in ``layout`` ``"v5"`` (fused experts; with EP the ``[L, ...]`` slices of this rank, to concatenate over the
    ranks on dim 0) or ``"v4"`` (per-expert modules, named by global expert index; GPT-OSS has one layout, its
    fused one). Echo and statistics buffers are not part of either."""
    if layout not in ("v4", "v5"):
        raise ValueError(f"layout must be 'v4' or 'v5', got {layout!r}")
    config = _text_config(config)
    t, fam = _family(config)
    cfg = moe_config_from_hf(config, layer_idx=0)  # per-layer options (Step-3.7's limits) keep the layout
    sd = moe_state_dict
    sl = _ep_slice(ep_rank, ep_size, cfg.num_experts)
    first = sl.start
    out: Dict[str, torch.Tensor] = {f"{fam.router}.weight": sd["router.weight"]}
    if cfg.router_bias:
        out[f"{fam.router}.bias"] = sd["router.bias"]
    if cfg.router_global_scale:
        out[f"{fam.router}.global_scale"] = sd["router.global_scale"]
    if "router.expert_bias" in sd:  # a buffer: absent from e.g. a gradient dict (and from hash layers)
        b = sd["router.expert_bias"]
        if cfg.num_scored_shared_experts:  # the routed experts' entries
            b = b[:cfg.num_experts - cfg.num_scored_shared_experts]
        out[_expert_bias_key(fam)] = b.view(1, -1) if fam.expert_bias_2d else b
    if "router.tid2eid" in sd:  # a buffer of DeepSeek-V4's hash layers
        out[f"{fam.router}.tid2eid"] = sd["router.tid2eid"]
    if fam.output_norm is not None:
        out[f"{fam.output_norm}.weight"] = sd["output_norm.weight"]
    for hf_name, name in fam.router_extras + _latent_names(fam, cfg):
        out[hf_name] = sd[name]
    w1, w2 = sd["experts.fc1.weight"], sd["experts.fc2.weight"]
    F = w2.shape[-1]
    if t == "gpt_oss":
        b1 = sd["experts.fc1.bias"]
        gu = torch.stack([w1[:, :F], w1[:, F:]], dim=2).reshape(w1.shape).transpose(1, 2)  # rows interleaved
        out["experts.gate_up_proj"] = gu.contiguous()
        out["experts.gate_up_proj_bias"] = torch.stack([b1[:, :F], b1[:, F:]], dim=-1).reshape(b1.shape).contiguous()
        out["experts.down_proj"] = w2.transpose(1, 2).contiguous()
        out["experts.down_proj_bias"] = sd["experts.fc2.bias"]
    elif t == "inkling_text":  # this rank's rows: global experts first..first+L, the routed ones below E
        n = min(max(cfg.num_experts - cfg.num_scored_shared_experts - first, 0), w1.shape[0])
        out["experts.gate_up_proj"], out["experts.down_proj"] = w1[:n], w2[:n]
        out["shared_experts.gate_proj"], out["shared_experts.up_proj"] = w1[n:, :F], w1[n:, F:]
        out["shared_experts.down_proj"] = w2[n:]
    elif t == "dbrx":  # this rank's [L * F, H] rows of w1, v1, w2
        H = w1.shape[-1]
        out["experts.mlp.w1"] = w1[:, :F].reshape(-1, H)
        out["experts.mlp.v1"] = w1[:, F:].reshape(-1, H)
        out["experts.mlp.w2"] = w2.transpose(1, 2).reshape(-1, H)
    elif layout == "v5" or fam.v4_experts is None:  # v5, or a family with one (fused) layout
        if fam.transposed:
            w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        if fam.dead_fc1_rows and sl.stop == cfg.num_experts and cfg.num_zero_experts:
            # LongCat-Flash allocates fc1 rows for its zero experts that it never reads: zeros, after the last rank's
            w1 = torch.cat([w1, w1.new_zeros((cfg.num_zero_experts,) + tuple(w1.shape[1:]))])
        if cfg.add_bias_linear:
            out[f"{fam.fc1}_bias"], out[f"{fam.fc2}_bias"] = sd["experts.fc1.bias"], sd["experts.fc2.bias"]
        out[fam.fc1], out[fam.fc2] = w1, w2
    else:
        g, u, d = fam.v4_experts
        for i in range(w1.shape[0]):
            e = first + i
            if g is None:  # non-gated experts: fc1 is the up projection
                out[f"experts.{e}.{u}.weight"] = w1[i]
            else:
                out[f"experts.{e}.{g}.weight"], out[f"experts.{e}.{u}.weight"] = w1[i, :F], w1[i, F:]
            out[f"experts.{e}.{d}.weight"] = w2[i]
    if fam.output_bias is not None:
        out[fam.output_bias] = sd["output_bias"]
    if fam.shared is not None and cfg.shared_expert_ffn_size:
        s = fam.shared
        for kind in ("weight", "bias") if cfg.shared_bias else ("weight",):
            sw1 = sd[f"shared_expert.fc1.{kind}"]
            if fam.shared_fused:
                out[f"{s}.gate_up_proj.{kind}"] = sw1
            elif cfg.shared_activation in GATED_ACTIVATIONS:
                Fs = sw1.shape[0] // 2
                out[f"{s}.gate_proj.{kind}"], out[f"{s}.up_proj.{kind}"] = sw1[:Fs], sw1[Fs:]
            else:
                out[f"{s}.up_proj.{kind}"] = sw1
            out[f"{s}.down_proj.{kind}"] = sd[f"shared_expert.fc2.{kind}"]
        if fam.shared_gate is not None:
            out[f"{fam.shared_gate}.weight"] = sd["shared_expert.gate.weight"]
    return out


# ------------------------------------------------------------------------------------------------ swapping --
class HFMoEBlock(nn.Module):
    """A :class:`MoELayer` in the place of a transformers sparse-MoE block: same input ``[B, S, H]`` and output
    (``(out, None)`` where the block returned ``(out, router_scores)``, GPT-OSS; no caller reads the scores)."""

    def __init__(self, layer: MoELayer, returns_router_scores: bool = False):
        super().__init__()
        self.moe = layer
        self.returns_router_scores = returns_router_scores

    def forward(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None):
        """``input_ids``: the model's token ids (DeepSeek-V4's decoder layers pass them to every MoE block; its hash
        layers route by them, the others ignore them)."""
        out = self.moe(hidden_states, token_ids=input_ids)
        return (out, None) if self.returns_router_scores else out


class HFRouterInput(nn.Module):
    """In the place of a split family's router (Gemma 4): hands its input, the tensor the gate must see, on to the
    experts through the router's return value ``(logits, top_k_weights, top_k_index)`` as ``top_k_weights`` (the
    :class:`HFSplitExperts` after it routes it; no other caller reads it)."""

    def forward(self, hidden_states: torch.Tensor):
        return None, hidden_states, None


class HFSplitExperts(HFMoEBlock):
    """A :class:`MoELayer` in the place of a split family's experts (Gemma 4's ``experts(x, top_k_index,
    top_k_weights)``): the experts see ``x`` and the layer's gate sees what :class:`HFRouterInput` passed on."""

    def forward(self, hidden_states: torch.Tensor, top_k_index=None, top_k_weights=None):
        if not isinstance(top_k_weights, torch.Tensor) or top_k_weights.shape != hidden_states.shape:
            raise ValueError("HFSplitExperts: expected the router input from HFRouterInput as top_k_weights")
        return self.moe(hidden_states, router_input=top_k_weights)


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner) if owner else module
    current = getattr(owner, attr)
    if isinstance(value, nn.Parameter) and isinstance(current, nn.Parameter) and value.shape == current.shape \
            and value.dtype == current.dtype and value.device == current.device:
        if hasattr(current, "allreduce"):
            value.allreduce = current.allreduce
        setattr(owner, attr, value)  # the block's own parameter: shared, not copied
    else:
        with torch.no_grad():
            current.copy_(value)


def swap_moe_blocks(model: nn.Module, *, ep_group=None, **overrides) -> List[str]:
    """Replaces every sparse-MoE block of a transformers ``model`` (the classes of :data:`BLOCK_CLASSES`) by an
    :class:`HFMoEBlock` around a :class:`MoELayer` with the block's weights, on the block's device and dtype, and
    returns the replaced modules' names. Parameters whose layout is MoELayer's (the router, v5 fused experts without
    EP) are the block's own parameter objects; the others (shared-expert fc1 = gate and up rows, GPT-OSS's experts,
    this rank's slice with EP) are copies, so build the optimizer after swapping. With expert parallelism
    (``ep_group``, or ``overrides`` such as ``ep_size``) each rank keeps its experts. ``overrides``: further
    MoELayer options (:func:`moe_config_from_hf`)."""
    config = _text_config(model.config)
    t, fam = _family(config)
    names = [n for n, m in model.named_modules() if type(m).__name__ in (fam.block,) + fam.more_blocks
             and (not fam.split or isinstance(getattr(m, "experts", None), nn.Module))]
    if not names:
        raise ValueError(f"{type(model).__name__} has no {fam.block} block to swap")
    for name in names:
        block = model.get_submodule(name)
        ref = next(block.parameters())
        opts = dict(params_dtype=ref.dtype)
        opts.update(overrides)
        layer = moe_layer_from_hf(config, ep_group=ep_group, device=ref.device, block=block, **opts)
        ep_size = layer.num_ep_ranks
        ep_rank = dist.get_rank(layer.ep_group) if ep_size > 1 else 0
        src: Dict[str, torch.Tensor] = {}
        for prefix, part in (("router", block.router), ("experts", block.experts)) if fam.split else (("", block),):
            src.update(part.named_parameters(prefix=prefix))
            src.update(part.named_buffers(prefix=prefix))
        for key, value in hf_to_moe_state_dict(src, config, ep_rank=ep_rank, ep_size=ep_size).items():
            _set_tensor(layer, key, value)
        layer.train(block.training)
        if fam.split:
            block.router, block.experts = HFRouterInput(), HFSplitExperts(layer)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                HFMoEBlock(layer, fam.returns_router_scores))
    return names


def hf_load_balancing_loss(model: nn.Module, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over the router logits of every :class:`MoELayer` of ``model``
    from its last forward (``router.last_logits``, in module order): ``K * E * sum_e f_e P_e`` with the route
    fractions ``f`` and mean softmax scores ``P`` pooled over all layers' (unpadded, ``attention_mask [B, S]``
    1 = real) tokens. Differentiable, device-only (no host sync)."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers or any(m.router.last_logits is None for m in layers):
        raise ValueError("hf_load_balancing_loss: the model has no MoELayer that ran a forward")
    E, K = layers[0].num_experts, layers[0].topk
    counts = torch.zeros(E, dtype=torch.float32, device=layers[0].router.last_logits.device)
    prob_sum = torch.zeros_like(counts)
    rows = counts.new_zeros(())
    for m in layers:
        logits = m.router.last_logits
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, K, dim=-1)[1]
        w = (torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device) if attention_mask is None
             else attention_mask.reshape(-1).to(device=logits.device, dtype=torch.float32))
        counts = counts + torch.zeros_like(counts).scatter_add_(0, top.reshape(-1), w.repeat_interleave(K))
        prob_sum = prob_sum + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
    return E * ((counts / rows) * (prob_sum / rows)).sum()
