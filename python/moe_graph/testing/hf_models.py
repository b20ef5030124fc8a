"""Tiny transformers MoE models built in code (no downloads) for the tests and the benchmark of
:mod:`moe_graph.integrations.hf`: configs, blocks and whole causal LMs of each family, with weights drawn so that
routing is decisive (no near-ties between the k-th and (k+1)-th expert)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable, Dict

import torch
import transformers

from moe_graph.moe.layer import MoELayer


_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, head_dim=4,
            num_key_value_heads=4, index_head_dim=8, index_n_heads=2, index_topk=8)
_FULL_ATTN = dict(layer_types=["full_attention", "full_attention"])
# families whose block repeats another family's (hf._Family.profile): (models/ folder.block class, config class,
# model class or
# None where a tiny whole model needs more than this (attention options; the block is still checked), config kwargs
# on top of _SMALL, which each config takes where it has the field)
_REPEATS: Dict[str, tuple] = {
    "olmoe": ("olmoe.OlmoeSparseMoeBlock", "OlmoeConfig", "OlmoeForCausalLM", {}),
    "flex_olmo": ("flex_olmo.FlexOlmoSparseMoeBlock", "FlexOlmoConfig", "FlexOlmoForCausalLM", dict(pad_token_id=0)),
    "minimax": ("minimax.MiniMaxSparseMoeBlock", "MiniMaxConfig", "MiniMaxForCausalLM", {}),
    "qwen3_vl_moe_text": ("qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock", "Qwen3VLMoeTextConfig",
                          "Qwen3VLMoeTextModel", {}),
    "qwen3_omni_moe_text": ("qwen3_omni_moe.Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen3OmniMoeTextConfig",
                            "Qwen3OmniMoeThinkerTextModel", {}),
    "mellum": ("mellum.MellumSparseMoeBlock", "MellumConfig", "MellumForCausalLM", {}),
    "qwen3_next": ("qwen3_next.Qwen3NextSparseMoeBlock", "Qwen3NextConfig", "Qwen3NextForCausalLM", _FULL_ATTN),
    "qwen3_5_moe_text": ("qwen3_5_moe.Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         _FULL_ATTN),
    "qwen4_exp_text": ("qwen4_exp.Qwen4ExpTextSparseMoeBlock", "Qwen4ExpTextConfig", None, _FULL_ATTN),  # its indexer
    "glm4_moe": ("glm4_moe.Glm4MoeMoE", "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(first_k_dense_replace=0)),
    "glm4_moe_lite": ("glm4_moe_lite.Glm4MoeLiteMoE", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(_MLA,
                      first_k_dense_replace=0)),
    "glm4v_moe_text": ("glm4v_moe.Glm4vMoeTextMoE", "Glm4vMoeTextConfig", None, dict(first_k_dense_replace=0)),
                        # M-RoPE
    "dots1": ("dots1.Dots1MoE", "Dots1Config", "Dots1ForCausalLM", dict(first_k_dense_replace=0)),
    "solar_open": ("solar_open.SolarOpenMoE", "SolarOpenConfig", "SolarOpenForCausalLM", {}),
    "deepseek_v32": ("deepseek_v32.DeepseekV32MoE", "DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_MLA,
                     first_k_dense_replace=0)),
    "glm_moe_dsa": ("glm_moe_dsa.GlmMoeDsaMoE", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(_MLA,
                    first_k_dense_replace=0)),
    "kimi_linear": ("kimi_linear.KimiLinearMoE", "KimiLinearConfig", None, dict(pad_token_id=0)),  # linear attn
    "exaone_moe": ("exaone_moe.ExaoneMoeSparseMoEBlock", "ExaoneMoeConfig", "ExaoneMoeForCausalLM",
                   dict(first_k_dense_replace=0)),
    "mimo_v2_flash": ("mimo_v2_flash.MiMoV2FlashMoE", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", {}),
    "bailing_hybrid": ("bailing_hybrid.BailingHybridMoE", "BailingHybridConfig", None,
                       dict(pad_token_id=0)),  # its tiny model's layers are dense
    "deepseek_ocr2_text": ("deepseek_ocr2.DeepseekOcr2TextMoe", "DeepseekOcr2TextConfig", None, {}),  # an OCR VLM
    "unlimited_ocr_text": ("unlimited_ocr.UnlimitedOcrTextMoe", "UnlimitedOcrTextConfig", None, {}),  # an OCR VLM
    "granitemoe": ("granitemoe.GraniteMoeMoE", "GraniteMoeConfig", "GraniteMoeForCausalLM", {}),
    # its shared MLP sits in the decoder layer, outside the block (a dense part of the model)
    "granitemoeshared": ("granitemoeshared.GraniteMoeSharedMoE", "GraniteMoeSharedConfig",
                         "GraniteMoeSharedForCausalLM", dict(shared_intermediate_size=40)),
    "beam": ("beam.BeamMoE", "BeamConfig", "BeamForCausalLM", dict(num_experts=8, n_group=2, topk_group=1,
                                                                 mlp_layer_types=["sparse", "sparse"])),
    "qwen3_omni_moe_talker_text": ("qwen3_omni_moe.Qwen3OmniMoeTalkerTextSparseMoeBlock",
                                   "Qwen3OmniMoeTalkerTextConfig", None,
                                   dict(shared_expert_intermediate_size=40)),  # the talker of an omni model
    # configs of their own whose model is another family's (transformers' auto mapping); config "folder.Class"
    "sarvam_moe": ("glm4_moe.Glm4MoeMoE", "sarvam_moe.SarvamMoEConfig", "Glm4MoeForCausalLM",
                   dict(first_k_dense_replace=0)),
    "sarvam_mla": ("deepseek_v3.DeepseekV3MoE", "sarvam_mla.SarvamMLAConfig", "DeepseekV3ForCausalLM",
                   dict(_MLA, first_k_dense_replace=0)),
    "granitemoe_swa": ("granitemoe_swa.GraniteMoeSWAMoE", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", {}),
    "granitemoehybrid": ("granitemoehybrid.GraniteMoeHybridMoE", "GraniteMoeHybridConfig", None,
                         dict(mamba_n_heads=4, mamba_d_head=16)),  # Mamba layers
    "inkling2_loop_text": ("inkling2_loop.Inkling2LoopSparseMoeBlock", "Inkling2LoopTextConfig",
                           "Inkling2LoopForCausalLM", dict(unpadded_vocab_size=64, eos_token_id=0, mlp_gate_softcap=0.5,
                                                           mlp_up_softcap=0.7)),
    "hy_v4_vl_text": ("hy_v4_vl.HYV4VLMoE", "HYV4VLTextConfig", None, dict(
        _MLA, n_group=2, topk_group=1, swiglu_limit=1.0, hc_mult=2, mlp_layer_types=["sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}, pad_token_id=0,
        bos_token_id=0, eos_token_id=0)),  # M-RoPE
}
_SMALL = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=8, n_routed_experts=8,
              num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, shared_expert_intermediate_size=40,
              n_shared_experts=1, num_shared_experts=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              vocab_size=64, num_hidden_layers=2, routed_scaling_factor=2.5, max_position_embeddings=64)

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "ernie4_5_moe", "kolibri1", "nemotron_h",
            "jetmoe", "llama4_text", "glm5_next_text", "cohere2_moe", "jamba", "deepseek_v2", "deepseek_v4",
            "longcat_flash", "axk1", "axk2", "laguna", "minimax_m2", "lfm2_moe", "mistral4", "hunyuan_v1_moe",
            "aria_text", "dbrx", "step3p5", "inkling2_text", "hy_v4", "gemma4_text", "hy_v3", "afmoe", "flint",
            "lara_mini", "mistral_large4_text", "inkling_text", "minimax_m3_vl_text", "dots3_note_text",
            "openai_privacy_filter", "muse_spark_text", "diffusion_gemma_text") + \
    tuple(_REPEATS)

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
               max_position_embeddings=64, num_experts_per_tok=2)
_CONFIGS: Dict[str, tuple] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                         shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                         norm_topk_prob=True, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16,
                                             num_experts_per_tok=6, n_group=4, topk_group=2, n_shared_experts=2,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                                             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
                                             qk_nope_head_dim=4, head_dim=4, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=24, num_local_experts=8, head_dim=8, swiglu_limit=1.0,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, moe_num_experts=8,
                                                moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=0)),
    "kolibri1": ("Kolibri1Config", dict(moe_intermediate_size=24, num_experts=8, shared_expert_intermediate_size=40,
                                        head_dim=8, sliding_window=8, norm_topk_prob=True)),
    "nemotron_h": ("NemotronHConfig", dict(num_hidden_layers=3, layers_block_type=["moe", "full_attention", "moe"],
                                           head_dim=8, moe_intermediate_size=24, n_routed_experts=8,
                                           moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5)),
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16,
                                             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                             routed_scaling_factor=2.5, topk_method="group_limited_greedy",
                                             first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
                                             qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, head_dim=4,
                                             num_key_value_heads=4)),
    "jamba": ("JambaConfig", dict(intermediate_size=24, num_experts=8, attn_layer_period=1, attn_layer_offset=0,
                                  expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False)),
    "cohere2_moe": ("Cohere2MoeConfig", dict(intermediate_size=24, num_experts=8, num_shared_experts=2)),
    "jetmoe": ("JetMoeConfig", dict(intermediate_size=24, num_local_experts=8, kv_channels=8)),
    "glm5_next_text": ("Glm5NextTextConfig", dict(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, swiglu_limit=1.0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0,
        v_head_dim=8, qk_nope_head_dim=4, head_dim=8, num_key_value_heads=4, index_topk=8, index_head_dim=8,
        index_n_heads=2, linear_head_dim=8, linear_num_heads=4, hc_mult=2, index_kpool=4,
        mlp_layer_types=["sparse", "sparse"], layer_types=["full_attention", "linear_attention"], pad_token_id=0)),
    "llama4_text": ("Llama4TextConfig", dict(intermediate_size=24, intermediate_size_mlp=48, num_local_experts=8,
                                             head_dim=8, interleave_moe_layer_step=1, moe_layers=None)),
    # layer 0 a hash layer (experts from gate.tid2eid[input_ids]), layer 1 a learned one; the block is layer 0's
    "deepseek_v4": ("DeepseekV4Config", dict(moe_intermediate_size=24, n_routed_experts=8, head_dim=16,
                                             num_key_value_heads=1, q_lora_rank=16, mlp_layer_types=["hash_moe", "moe"],
                                             swiglu_limit=1.0, sliding_window=8, o_groups=2, o_lora_rank=16,
                                             index_n_heads=2, index_head_dim=8, index_topk=4, hc_mult=2,
                                             num_nextn_predict_layers=0)),
    "longcat_flash": ("LongcatFlashConfig", dict(num_layers=1, ffn_hidden_size=48, expert_ffn_hidden_size=24,
                                                 n_routed_experts=8, zero_expert_num=3, num_experts_per_tok=3,
                                                 routed_scaling_factor=2.0, kv_lora_rank=16, q_lora_rank=24,
                                                 qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, head_dim=4,
                                                 num_key_value_heads=4)),
    "axk1": ("AXK1Config", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16,
                                num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                mlp_layer_types=["sparse", "sparse"], kv_lora_rank=16, q_lora_rank=24,
                                qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, head_dim=4,
                                num_key_value_heads=4)),
    "axk2": ("AXK2Config", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                                mlp_layer_types=["sparse", "sparse"], kv_lora_rank=16, q_lora_rank=24,
                                qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, head_dim=4,
                                num_key_value_heads=4, index_n_heads=2, index_head_dim=8, index_topk=8)),
    "laguna": ("LagunaConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                    shared_expert_intermediate_size=40, mlp_layer_types=["sparse", "sparse"],
                                    moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=1.5, head_dim=8,
                                    sliding_window=8)),
    "minimax_m2": ("MiniMaxM2Config", dict(intermediate_size=24, num_local_experts=8, head_dim=8)),
    "inkling_text": ("InklingTextConfig", dict(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=2, route_scale=2.0,
        head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8,
        mlp_layer_types=["sparse", "sparse"])),
    "lfm2_moe": ("Lfm2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                       num_dense_layers=0, routed_scaling_factor=2.0,
                                       layer_types=["conv", "full_attention"])),
    "mistral4": ("Mistral4Config", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16,
                                        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                                        qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4, num_key_value_heads=4,
                                        first_k_dense_replace=0)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(intermediate_size=24, num_experts=8, moe_topk=2, head_dim=8)),
    "aria_text": ("AriaTextConfig", dict(intermediate_size=24, moe_num_experts=8, moe_topk=2,
                                         moe_num_shared_experts=2)),
    "dbrx": ("DbrxConfig", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                                ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2),
                                attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0))),
    # Step-3.7's text model: layer 0 clamps the routed experts at 1 and the shared expert at 1.5, layer 1 only the
    # shared expert (at 2); the shared expert has biases (mlp_bias) where the routed experts have none
    "step3p5": ("Step3p7TextConfig", dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8,
                                          share_expert_dim=40, head_dim=8, swiglu_limits=[1.0, 0.0],
                                          swiglu_limits_shared=[1.5, 2.0], moe_router_scaling_factor=2.5,
                                          mlp_layer_types=["sparse", "sparse"], sliding_window=8, mlp_bias=True)),
    "inkling2_text": ("Inkling2TextConfig", dict(moe_intermediate_size=24, n_routed_experts=8, head_dim=8,
                                                 unpadded_vocab_size=64, eos_token_id=0, mlp_gate_softcap=0.5,
                                                 mlp_up_softcap=0.7)),  # caps the weights reach
    "diffusion_gemma_text": ("DiffusionGemmaTextConfig", dict(head_dim=8, intermediate_size=48, num_experts=8,
                                                              top_k_experts=2, moe_intermediate_size=24,
                                                              sliding_window=8,
                                                              layer_types=["sliding_attention", "full_attention"])),
    "gemma4_text": ("Gemma4TextConfig", dict(head_dim=8, intermediate_size=48, enable_moe_block=True, num_experts=8,
                                             top_k_experts=2, moe_intermediate_size=24, hidden_size_per_layer_input=0,
                                             sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                             pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "hy_v3": ("HYV3Config", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8, num_shared_experts=2,
                                 router_scaling_factor=2.5, head_dim=8, mlp_layer_types=["sparse", "sparse"])),
    "afmoe": ("AfmoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8, num_shared_experts=2,
                                  route_scale=2.5, num_dense_layers=0, head_dim=8, sliding_window=8)),
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", dict(intermediate_size=24, num_local_experts=8,
                                                          shared_intermediate_size=40, dense_intermediate_size=48,
                                                          swiglu_limit=1.0, routed_scaling_factor=2.0, head_dim=8,
                                                          mlp_layer_types=["sparse", "sparse"])),
    "dots3_note_text": ("Dots3NoteTextConfig", dict(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, shared_experts_intermediate_size=20, routed_scaling_factor=2.5, head_dim=8,
        num_key_value_heads=4,
        first_k_dense_replace=0)),
    "openai_privacy_filter": ("OpenAIPrivacyFilterConfig", dict(intermediate_size=24, num_local_experts=8, head_dim=8,
                                                                swiglu_limit=1.0, sliding_window=8)),
    "lara_mini": ("LaraMiniConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                         shared_expert_intermediate_size=40, head_dim=8)),
    "mistral_large4_text": ("MistralLarge4TextConfig", dict(
        _MLA, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=0)),
    "flint": ("FlintConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                  shared_expert_intermediate_size=40, head_dim=8, mlp_only_layers=[])),
    # latent width 24 > the experts' 16: the probabilities could only move into the experts without the row norm
    "muse_spark_text": ("MuseSparkTextConfig", dict(intermediate_size=48, moe_intermediate_size=16, moe_hidden_size=24,
                                                    num_local_experts=8, head_dim=8, routed_scaling_factor=2.5,
                                                    sliding_window=8, rms_norm_eps=1e-5, post_norm_eps=1e-6)),
    "hy_v4": ("HYV4Config", dict(_MLA, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_group=2,
                                 topk_group=1, n_shared_experts=1, swiglu_limit=1.0, hc_mult=2,
                                 mlp_layer_types=["sparse", "sparse"], pad_token_id=0, bos_token_id=0,
                                 eos_token_id=0)),
}
_BLOCKS = {"mixtral": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
           "qwen2_moe": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
           "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
           "deepseek_v3": "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
           "gpt_oss": "gpt_oss.modeling_gpt_oss.GptOssMLP",
           "ernie4_5_moe": "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeSparseMoeBlock",
           "kolibri1": "kolibri1.modeling_kolibri1.Kolibri1SparseMoeBlock",
           "nemotron_h": "nemotron_h.modeling_nemotron_h.NemotronHMoE",
           "jetmoe": "jetmoe.modeling_jetmoe.JetMoeMoE",
           "cohere2_moe": "cohere2_moe.modeling_cohere2_moe.Cohere2MoeSparseMoeBlock",
           "jamba": "jamba.modeling_jamba.JambaSparseMoeBlock",
           "deepseek_v2": "deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",
           "llama4_text": "llama4.modeling_llama4.Llama4TextMoe",
           "glm5_next_text": "glm5_next.modeling_glm5_next.Glm5NextTextMoE",
           "deepseek_v4": "deepseek_v4.modeling_deepseek_v4.DeepseekV4SparseMoeBlock",
           "longcat_flash": "longcat_flash.modeling_longcat_flash.LongcatFlashMoE",
           "axk1": "axk1.modeling_axk1.AXK1MoE", "axk2": "axk2.modeling_axk2.AXK2MoE",
           "laguna": "laguna.modeling_laguna.LagunaSparseMoeBlock",
           "minimax_m2": "minimax_m2.modeling_minimax_m2.MiniMaxM2SparseMoeBlock",
           "lfm2_moe": "lfm2_moe.modeling_lfm2_moe.Lfm2MoeSparseMoeBlock",
           "mistral4": "mistral4.modeling_mistral4.Mistral4MoE",
           "hunyuan_v1_moe": "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Moe",
           "aria_text": "aria.modeling_aria.AriaTextMoELayer", "dbrx": "dbrx.modeling_dbrx.DbrxFFN",
           "step3p5": "step3p7.modeling_step3p7.Step3p7SparseMoeBlock",
           "inkling2_text": "inkling2.modeling_inkling2.Inkling2SparseMoeBlock",
           "hy_v4": "hy_v4.modeling_hy_v4.HYV4MoE",
           "hy_v3": "hy_v3.modeling_hy_v3.HYV3MoE", "afmoe": "afmoe.modeling_afmoe.AfmoeSparseMoeBlock",
           "flint": "flint.modeling_flint.FlintSparseMoeBlock",
           "lara_mini": "lara_mini.modeling_lara_mini.LaraMiniSparseMoeBlock",
           "openai_privacy_filter": "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterMLP",
           "dots3_note_text": "dots3_note.modeling_dots3_note.Dots3NoteTextMoE",
           "minimax_m3_vl_text": "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLSparseMoeBlock",
           "mistral_large4_text": "mistral_large4.modeling_mistral_large4.MistralLarge4TextMoE",
           "gemma4_text": None,  # Gemma4MoEBlock
           "inkling_text": "inkling.modeling_inkling.InklingMoE",
           "muse_spark_text": "muse_spark.modeling_muse_spark.MuseSparkMoE",
           "diffusion_gemma_text": None}  # DiffusionGemmaMoEBlock
_MODELS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
           "ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "kolibri1": "Kolibri1ForCausalLM",
           "nemotron_h": "NemotronHForCausalLM", "jetmoe": "JetMoeForCausalLM",
           "cohere2_moe": "Cohere2MoeForCausalLM", "jamba": "JambaForCausalLM",
           "deepseek_v2": "DeepseekV2ForCausalLM", "llama4_text": "Llama4ForCausalLM",
           "glm5_next_text": "Glm5NextTextModel",  # GLM5-Next's and Step-3.7's text models have no LM head of their own
           "deepseek_v4": "DeepseekV4ForCausalLM", "longcat_flash": "LongcatFlashForCausalLM",
           "axk1": "AXK1ForCausalLM", "axk2": "AXK2ForCausalLM", "laguna": "LagunaForCausalLM",
           "minimax_m2": "MiniMaxM2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM", "mistral4": "Mistral4ForCausalLM",
           "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM", "aria_text": "AriaTextForCausalLM",
           "dbrx": "DbrxForCausalLM", "step3p5": "Step3p7TextModel", "inkling2_text": "Inkling2ForCausalLM",
           "hy_v4": "HYV4ForCausalLM", "gemma4_text": "Gemma4ForCausalLM", "hy_v3": "HYV3ForCausalLM",
           "afmoe": "AfmoeForCausalLM", "flint": "FlintForCausalLM", "lara_mini": "LaraMiniForCausalLM",
           "mistral_large4_text": None,  # its indexer attention
           "inkling_text": "InklingForCausalLM", "minimax_m3_vl_text": "MiniMaxM3VLForCausalLM",
           "dots3_note_text": None,  # its indexed attention and vision / audio towers
           "openai_privacy_filter": None,  # a token classifier (no LM head)
           "muse_spark_text": "MuseSparkTextModel",
           # its encoder's text stack, the text model of a multimodal model without an LM head of its own (the
           # block-diffusion LM's decoder layers hold the same block: the block test)
           "diffusion_gemma_text": "DiffusionGemmaEncoderTextModel"}


def has_tiny_model(family: str) -> bool:
    """False for the families whose tiny whole model is not built here (their block is)."""
    return _REPEATS[family][2] is not None if family in _REPEATS else _MODELS[family] is not None


def _models_module(folder: str, kind: str = "modeling"):
    return importlib.import_module(f"transformers.models.{folder}.{kind}_{folder}")


def tiny_config(family: str, **overrides):
    """A small transformers config of ``family`` (eager attention, fp32), ``overrides`` applied."""
    if family in _REPEATS:
        folder, cls_name, _, kw = _REPEATS[family]
        if "." in cls_name:  # the config's own folder
            folder, _, cls_name = cls_name.partition(".")
        cls = getattr(_models_module(folder.partition(".")[0], "configuration"), cls_name)
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(
            inspect.signature(cls.__init__).parameters)
        opts = {k: v for k, v in _SMALL.items() if k in fields}
    else:
        cls_name, kw = _CONFIGS[family]
        cls = getattr(transformers, cls_name)
        opts = dict(_COMMON)
    opts.update(kw)
    opts.update(overrides)
    cfg = cls(**opts)
    cfg._attn_implementation = "eager"
    return cfg


class Gemma4MoEBlock(torch.nn.Module):
    """Gemma 4's MoE, which has no module of its own (its decoder layer calls ``router`` and ``experts``), as one
    block for the block tests: transformers' own ``Gemma4TextRouter`` and ``Gemma4TextExperts`` under the decoder
    layer's names, both on the block input (the decoder layer feeds the experts ``pre_feedforward_layernorm_2`` of
    the router's input: the whole-model test covers that)."""

    folder, prefix = "gemma4", "Gemma4"  # transformers' models/ folder and class-name prefix

    def __init__(self, config):
        super().__init__()
        m = _models_module(self.folder)
        self.router = getattr(m, f"{self.prefix}TextRouter")(config)
        self.experts = getattr(m, f"{self.prefix}TextExperts")(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.router(flat)
        return self.experts(flat, index, weights).reshape(x.shape)


class DiffusionGemmaMoEBlock(Gemma4MoEBlock):
    """DiffusionGemma's router and experts (those of its encoder and decoder layers: Gemma 4's), as one block."""
    folder, prefix = "diffusion_gemma", "DiffusionGemma"


_SPLIT_BLOCKS = {"gemma4_text": Gemma4MoEBlock, "diffusion_gemma_text": DiffusionGemmaMoEBlock}


def _block_class(family: str):
    if family in _SPLIT_BLOCKS:
        return _SPLIT_BLOCKS[family]
    if family in _REPEATS:
        folder, _, block = _REPEATS[family][0].partition(".")
        return getattr(_models_module(folder), block)
    path, _, cls = _BLOCKS[family].rpartition(".")
    module = __import__(f"transformers.models.{path}", fromlist=[cls])
    return getattr(module, cls)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0, router_std: float = 1.0, std: float = 0.2) -> None:
    """Every parameter and float buffer of ``module`` drawn from ``N(0, std)`` (gates: ``router_std``; norms and
    Gemma 4's router scales: around 1), so that expert choices are far from ties."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith("tid2eid"):  # DeepSeek-V4's hash table: K distinct experts per token id
            E = module.get_submodule(name.rpartition(".")[0]).num_experts  # the hash router's
            t.copy_(torch.stack([torch.randperm(E, generator=g)[:t.shape[1]] for _ in range(t.shape[0])]))
            continue
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight" or leaf in ("scale", "per_expert_scale"):  # Gemma 4's router scales
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.split(".")[-2:-1] in (["gate"], ["router"], ["moe_statics"]) or \
                name.split(".")[-3:-1] == ["router", "proj"]:  # router weight / bias / bias (Gemma 4: router.proj)
            t.copy_(torch.randn(t.shape, generator=g) * (router_std if leaf == "weight" else 0.5))
        else:
            t.copy_(torch.randn(t.shape, generator=g) * std)


def _zero_dead_rows(module: torch.nn.Module) -> None:
    """LongCat-Flash's experts hold fc1 rows for the zero-computation experts that nothing reads: zeros (what
    :func:`moe_graph.integrations.hf.moe_to_hf_state_dict` writes back), so that state dicts round-trip."""
    for m in module.modules():
        if type(m).__name__ == "LongcatFlashExperts" and m.gate_up_proj is not None:
            with torch.no_grad():
                m.gate_up_proj[m.num_routed_experts:].zero_()


def tiny_block(family: str, seed: int = 0, **overrides):
    """``(config, block)``: one sparse-MoE block of ``family`` in fp32 with random weights (a block class that
    takes the layer index gets layer 0's)."""
    cfg = tiny_config(family, **overrides)
    cls = _block_class(family)
    block = cls(cfg, 0) if "layer_idx" in inspect.signature(cls.__init__).parameters else cls(cfg)
    randomize(block, seed)
    _zero_dead_rows(block)
    return cfg, block


def tiny_model(family: str, seed: int = 0, **overrides):
    """``(config, model)``: a two-layer causal LM of ``family`` in fp32 with random weights."""
    cfg = tiny_config(family, **overrides)
    if family in _REPEATS:
        if _REPEATS[family][2] is None:
            raise ValueError(f"{family}: no tiny whole model (see _REPEATS)")
        model = getattr(_models_module(_REPEATS[family][0].partition(".")[0]), _REPEATS[family][2])(cfg)
    else:
        model = getattr(transformers, _MODELS[family])(cfg)
    randomize(model, seed)
    _zero_dead_rows(model)
    return cfg, model


def model_loss(model: torch.nn.Module, ids: torch.Tensor):
    """``(output, loss)`` of a tiny model on ``ids``: a causal LM's logits and its LM loss (labels = ids), or for a
    base model without an LM head (GLM5-Next's text model) its last hidden state and ``mean(h * R)`` with ``R`` a
    fixed random tensor."""
    if hasattr(model, "lm_head"):
        out = model(ids, labels=ids)
        return out.logits, out.loss
    h = model(ids).last_hidden_state
    r = torch.randn(h.shape, generator=torch.Generator().manual_seed(5), dtype=h.dtype).to(h.device)
    return h, (h * r).mean()


def hf_router(block: torch.nn.Module, x: torch.Tensor, input_ids=None) -> torch.Tensor:
    """The expert indices ``[T, K]`` (sorted per token) the transformers block's own gate picks for ``x`` (and
    ``input_ids``, which DeepSeek-V4's hash gate reads)."""
    gate = block.router if hasattr(block, "router") else block.gate
    h = x.reshape(-1, x.shape[-1])
    name = type(block).__name__
    if hasattr(gate, "tid2eid"):
        out = gate(h, input_ids)
    elif name in ("MiniMaxM2SparseMoeBlock", "HYV3MoE"):  # the selection bias is the block's
        out = gate(h, block.e_score_correction_bias)
    elif name == "AfmoeSparseMoeBlock":
        out = gate(x, block.expert_bias)
    elif name == "Lfm2MoeSparseMoeBlock":
        out = gate(h, block.expert_bias if block.use_expert_bias else None)
    elif name == "InklingMoE":  # its shared experts are the layer's last ones, routed to by every token
        out = gate(h)
        S, E = gate.n_shared_experts, gate.num_experts
        return torch.cat([out[2], torch.arange(E, E + S).expand(h.shape[0], S)], dim=1).sort(-1)[0]
    elif name == "DbrxFFN":  # the gate returns the logits; the block picks
        return block.route_tokens_to_experts(gate(h))[1].sort(-1)[0]
    else:
        out = gate(h)
    if type(block).__name__ in ("JetMoeMoE", "Llama4TextMoe"):  # their gates return the logits last: top-k of them
        k = getattr(gate, "top_k", None) or block.top_k
        return out[-1].topk(k, dim=-1)[1].sort(-1)[0]
    return out[2].sort(-1)[0]


def block_output(block: torch.nn.Module, x: torch.Tensor, input_ids=None) -> torch.Tensor:
    """The block's output tensor (GPT-OSS's block also returns its router scores). ``input_ids``: the token ids of
    ``x``, for blocks that take them (DeepSeek-V4's; a MoELayer gets them as ``token_ids``)."""
    if input_ids is None:
        out = block(x)
    elif isinstance(block, MoELayer):
        out = block(x, token_ids=input_ids)
    else:
        out = block(x, input_ids=input_ids)
    return out[0] if isinstance(out, tuple) else out


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, input_ids=None):
    xi = x.clone().requires_grad_()
    y = block_output(module, xi, input_ids).reshape(x.shape)  # Llama 4's block returns [T, H]
    (y * target).sum().backward()
    return y.detach(), xi.grad


def block_errors(block: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                 to_hf: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]], input_ids=None
                 ) -> Dict[str, float]:
    """Max relative errors (:func:`rel_err`) of ``layer`` (a :class:`moe_graph.moe.layer.MoELayer`) against the
    transformers ``block`` after one forward and backward of ``(out * target).sum()`` each (gradients start at
    None): ``out``, ``dx`` and every block parameter's gradient, the layer's renamed by ``to_hf`` (its gradients by
    parameter name -> the block's names, e.g. :func:`moe_graph.integrations.hf.moe_to_hf_state_dict`); parameters
    without gradients (ERNIE-4.5's selection bias) are left out. ``input_ids``: as :func:`block_output`."""
    y_hf, gx_hf = _fwd_bwd(block, x, target, input_ids)
    y, gx = _fwd_bwd(layer, x, target, input_ids)
    errs = {"out": rel_err(y, y_hf), "dx": rel_err(gx, gx_hf)}
    grads = to_hf({n: p.grad for n, p in layer.named_parameters()})
    for n, p in block.named_parameters():
        if p.requires_grad:
            errs[n] = rel_err(grads[n], p.grad)
    return errs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 for two zero tensors)."""
    den = b.detach().abs().max()
    num = (a.detach() - b.detach()).abs().max()
    return float(num / den) if float(den) > 0 else float(num)
