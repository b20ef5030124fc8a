"""Tiny transformers MoE models built in code (no downloads) for the tests and the benchmark of
:mod:`moe_graph.integrations.hf`: configs, blocks and whole causal LMs of each family, with weights drawn so that
routing is decisive (no near-ties between the k-th and (k+1)-th expert)."""

from __future__ import annotations

from typing import Callable, Dict

import torch
import transformers

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "ernie4_5_moe", "kolibri1", "nemotron_h", "jetmoe",
            "llama4_text")

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
    "jetmoe": ("JetMoeConfig", dict(intermediate_size=24, num_local_experts=8, kv_channels=8)),
    "llama4_text": ("Llama4TextConfig", dict(intermediate_size=24, intermediate_size_mlp=48, num_local_experts=8,
                                             head_dim=8, interleave_moe_layer_step=1, moe_layers=None)),
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
           "llama4_text": "llama4.modeling_llama4.Llama4TextMoe"}
_MODELS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
           "ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "kolibri1": "Kolibri1ForCausalLM",
           "nemotron_h": "NemotronHForCausalLM", "jetmoe": "JetMoeForCausalLM", "llama4_text": "Llama4ForCausalLM"}


def tiny_config(family: str, **overrides):
    """A small transformers config of ``family`` (eager attention, fp32), ``overrides`` applied."""
    cls_name, kw = _CONFIGS[family]
    opts = dict(_COMMON)
    opts.update(kw)
    opts.update(overrides)
    cfg = getattr(transformers, cls_name)(**opts)
    cfg._attn_implementation = "eager"
    return cfg


def _block_class(family: str):
    path, _, cls = _BLOCKS[family].rpartition(".")
    module = __import__(f"transformers.models.{path}", fromlist=[cls])
    return getattr(module, cls)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0, router_std: float = 1.0, std: float = 0.2) -> None:
    """Every parameter and float buffer of ``module`` drawn from ``N(0, std)`` (gates: ``router_std``; norms:
    around 1), so that expert choices are far from ties."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf == "weight":
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.split(".")[-2:-1] in (["gate"], ["router"], ["moe_statics"]):  # router weight / bias / bias
            t.copy_(torch.randn(t.shape, generator=g) * (router_std if leaf == "weight" else 0.5))
        else:
            t.copy_(torch.randn(t.shape, generator=g) * std)


def tiny_block(family: str, seed: int = 0, **overrides):
    """``(config, block)``: one sparse-MoE block of ``family`` in fp32 with random weights."""
    cfg = tiny_config(family, **overrides)
    block = _block_class(family)(cfg)
    randomize(block, seed)
    return cfg, block


def tiny_model(family: str, seed: int = 0, **overrides):
    """``(config, model)``: a two-layer causal LM of ``family`` in fp32 with random weights."""
    cfg = tiny_config(family, **overrides)
    model = getattr(transformers, _MODELS[family])(cfg)
    randomize(model, seed)
    return cfg, model


def hf_router(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The expert indices ``[T, K]`` (sorted per token) the transformers block's own gate picks for ``x``."""
    gate = block.router if hasattr(block, "router") else block.gate
    out = gate(x.reshape(-1, x.shape[-1]))
    if type(block).__name__ in ("JetMoeMoE", "Llama4TextMoe"):  # their gates return the logits last: top-k of them
        k = getattr(gate, "top_k", None) or block.top_k
        return out[-1].topk(k, dim=-1)[1].sort(-1)[0]
    return out[2].sort(-1)[0]


def block_output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's output tensor (GPT-OSS's block also returns its router scores)."""
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor):
    xi = x.clone().requires_grad_()
    y = block_output(module, xi).reshape(x.shape)  # Llama 4's block returns [T, H]
    (y * target).sum().backward()
    return y.detach(), xi.grad


def block_errors(block: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                 to_hf: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Max relative errors (:func:`rel_err`) of ``layer`` (a :class:`moe_graph.moe.layer.MoELayer`) against the
    transformers ``block`` after one forward and backward of ``(out * target).sum()`` each (gradients start at
    None): ``out``, ``dx`` and every block parameter's gradient, the layer's renamed by ``to_hf`` (its gradients by
    parameter name -> the block's names, e.g. :func:`moe_graph.integrations.hf.moe_to_hf_state_dict`); parameters
    without gradients (ERNIE-4.5's selection bias) are left out."""
    y_hf, gx_hf = _fwd_bwd(block, x, target)
    y, gx = _fwd_bwd(layer, x, target)
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
