"""moe_graph.integrations.hf against Hugging Face transformers itself (tiny configs built in code, fp32, CPU): every
family's sparse-MoE block and MoELayer give the same outputs, input gradients and weight gradients (1e-5 relative)
with identical expert selection, including configs where DeepSeek's group score rule and renormalisation matter;
whole models swapped end to end (logits, loss, every gradient); state dicts both ways (v4 per-expert, v5 fused,
expert-parallel slices); transformers' load-balancing loss; configs it cannot express."""

import copy
import importlib.util
import json
import os
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_graph.integrations.hf import (  # noqa: E402
    BLOCK_CLASSES,
    HFMoEBlock,
    HFSplitExperts,
    hf_load_balancing_loss,
    hf_to_moe_state_dict,
    moe_config_from_hf,
    moe_layer_from_hf,
    moe_to_hf_state_dict,
    swap_moe_blocks,
)
from moe_graph.moe.layer import MoELayer  # noqa: E402
from moe_graph.testing.hf_models import (  # noqa: E402
    FAMILIES,
    block_errors,
    block_output,
    has_tiny_model,
    hf_router,
    model_loss,
    rel_err,
    tiny_block,
    tiny_config,
    tiny_model,
)

TOL = 1e-5
VARIANTS = [  # (family, config overrides)
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(norm_topk_prob=False)),
    ("deepseek_v3", {}),  # top-6 of 16 in 4 groups, 2 kept: the best-2 group score differs from Megatron's best-3
    ("deepseek_v3", dict(norm_topk_prob=False)),
    ("gpt_oss", {}),  # swiglu_limit=1: the clamps are active
    ("ernie4_5_moe", {}),  # softmax router, selection bias on the softmax scores
    ("ernie4_5_moe", dict(hidden_size=64)),
    ("ernie4_5_moe", dict(use_bias=True)),  # biases on the shared experts, none on the routed ones  # top-k sums below moe_norm_min: the clamped renormalisation matters
    ("kolibri1", {}),  # selection bias on the logits, sigmoid of the chosen logits
    ("kolibri1", dict(norm_topk_prob=False)),
    ("nemotron_h", {}),  # squared-ReLU experts and shared expert, DeepSeek-V3's router
    ("nemotron_h", dict(n_group=2, topk_group=1)),
    ("nemotron_h", dict(moe_latent_size=16, mlp_bias=True)),  # latent projections (with biases) around the experts
    ("jetmoe", {}),  # output bias
    ("llama4_text", {}),  # probabilities on the expert input, sigmoid of the top-k logits
    ("glm5_next_text", {}),  # silu(min(g, L)) * clamp(u, -L, L) with L = 1: the clamps are active
    ("cohere2_moe", {}),  # softmax of the top-k logits, shared and routed outputs averaged
    ("cohere2_moe", dict(expert_selection_fn="sigmoid", norm_topk_prob=False,
                         shared_expert_combination_strategy="sum")),
    ("jamba", {}),  # softmax, top-k not renormalized
    ("deepseek_v2", {}),  # softmax, group-limited greedy (groups scored by their best expert), not renormalized
    ("deepseek_v2", dict(topk_method="greedy")),
    ("deepseek_v4", {}),  # a hash layer: experts from gate.tid2eid[input_ids], sqrtsoftplus scores, limited SwiGLU
    ("deepseek_v4", dict(mlp_layer_types=["moe", "moe"])),  # a learned layer: sqrtsoftplus + selection bias
    ("deepseek_v4", dict(mlp_layer_types=["moe", "moe"], scoring_func="sigmoid")),
    ("longcat_flash", {}),  # 3 zero-computation experts of 11, softmax + selection bias, scaled
    ("axk1", {}),  # DeepSeek-V3's router, the block output RMSNorm-ed
    ("axk2", {}),  # DeepSeek-V3's router without groups (A.X-K2-Light)
    ("axk2", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)),  # groups masked with 0.0
    ("laguna", {}),  # soft-capped logits, sigmoid + selection bias, scaled routed output
    ("minimax_m2", {}),  # sigmoid + the block's selection bias, renormalized
    ("lfm2_moe", {}),  # sigmoid + the block's expert_bias, renormalized (+1e-6), scaled
    ("lfm2_moe", dict(use_expert_bias=False, norm_topk_prob=False)),
    ("mistral4", {}),  # softmax, groups scored by their best 2, renormalized, scaled, shared experts
    ("hunyuan_v1_moe", {}),  # fp32 gate, softmax renormalized, shared MLP
    ("aria_text", {}),  # softmax of the top-k logits, experts stored transposed, shared experts
    ("dbrx", {}),  # softmax, top-k / L1 norm, experts w1/v1/w2 [E * F, H]
    ("inkling_text", {}),  # 2 shared experts scored by the gate and renormalized with the top-2, global scale
    ("dbrx", dict(ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2,
                                  moe_normalize_expert_weights=None))),
    ("step3p5", {}),  # layer 0: min(silu(g), 1) * clamp(u, -1, 1), the shared expert's at 1.5 with biases
    ("step3p5", dict(swiglu_limits=None, swiglu_limits_shared=None, mlp_bias=False)),  # no clamps: plain SwiGLU
    ("inkling2_text", {}),  # soft-capped SwiGLU (caps 0.5 and 0.7: active), fp32 sigmoid router
    ("hy_v4", {}),  # limited SwiGLU (L = 1) in the routed experts, plain SwiGLU in the shared expert
    ("diffusion_gemma_text", {}),  # Gemma 4's router and experts
    ("gemma4_text", {}),  # gated GELU (tanh); the gate on rms_norm(x) * scale / sqrt(H); per-expert scale
    ("hy_v3", {}),  # fp32 gate, sigmoid + the block's selection bias, renormalized, scaled, shared experts
    ("afmoe", {}),  # sigmoid + the block's expert_bias, renormalized, route_scale, shared experts
    ("flint", {}),  # fp32 gate, sigmoid, renormalized, an ungated shared expert
    ("lara_mini", {}),  # fp32 softmax, renormalized, an ungated shared expert
    ("dots3_note_text", {}),
    ("openai_privacy_filter", {}),  # GPT-OSS's block, not interleaved, in fp32; swiglu_limit=1: the clamps act  # DeepSeek-V3's router, shared experts of their own size
    ("minimax_m3_vl_text", {}),  # clamped SwiGLU (L = 1) in experts and the fused shared expert, sigmoid + bias
    ("muse_spark_text", {}),  # logits times output_multiplier, sigmoid + bias; latent width, norms around the experts
    ("muse_spark_text", dict(moe_hidden_size=32, routed_scaling_factor=1.0, num_experts_per_tok=3)),
    ("mistral_large4_text", {}),  # fp32 softmax, 2 of 4 groups by their best 2, renormalized, scaled, shared experts
] + [(f, {}) for f in FAMILIES[FAMILIES.index("olmoe"):]]  # blocks that repeat one of the above (2 groups of 4)
ONE_LAYOUT = ("gpt_oss", "jetmoe", "llama4_text", "qwen3_vl_moe_text", "qwen3_omni_moe_text", "qwen3_5_moe_text",
              "qwen4_exp_text", "glm4v_moe_text", "granitemoe", "mistral4", "aria_text", "dbrx",
              "granitemoeshared", "gemma4_text", "granitemoe_swa", "granitemoehybrid", "qwen3_omni_moe_talker_text",
              "mistral_large4_text", "inkling_text", "openai_privacy_filter", "muse_spark_text",
              "diffusion_gemma_text")  # fused experts only: no v4 modules
V4_NAMES = {"mixtral": ("w1", "w3", "w2"), "minimax": ("w1", "w3", "w2"), "nemotron_h": (None, "up_proj", "down_proj"),
            "deepseek_v4": ("w1", "w3", "w2"), "minimax_m2": ("w1", "w3", "w2"), "lfm2_moe": ("w1", "w3", "w2")}
# whole models swapped by default (each family's block is checked regardless): every family with its own semantics
# and one of each repeated block; MOE_GRAPH_HF_ALL=1 swaps every family's tiny model
WHOLE_MODEL = FAMILIES if os.environ.get("MOE_GRAPH_HF_ALL") == "1" else FAMILIES[:FAMILIES.index("olmoe")] + (
    "olmoe", "qwen3_next", "glm4_moe", "sarvam_moe")  # sarvam_moe: a config read as another family (glm4_moe)


# tiny whole models whose fp32 forward/backward is ill-conditioned: checked in float64 (MoELayer and transformers
# both run it), within 1e-10. DBRX: transformers' fp32 model against its own fp64 differs by 3.4e-4 (a LayerNorm
# weight's gradient); MoELayer's fp32 swap by 3.2e-4, the same; in fp64 the two agree to 1e-13
FP64_WHOLE = ("dbrx",)
# Gemma 4's tiny model amplifies fp32 rounding through its post-norms: transformers' own grouped_mm and eager experts
# differ by 5.2e-6 in its weight gradients, the swapped model by up to 1.1e-5; in fp64 with transformers' fp32 casts
# (router softmax, RMS norms) removed the swapped model matches to 3e-15 (transformers' casts keep FP64_WHOLE out)
# DiffusionGemma's encoder text model (Gemma 4's norms): transformers' eager experts against its own batched_mm differ
# by 1.5e-5 in the weight gradients, the swapped model by 1.4e-5
GRAD_TOL = {"gemma4_text": 2e-5, "diffusion_gemma_text": 2e-5}


def _ids(v):
    fam, kw = v
    return fam + "".join(f"-{k}={val}" for k, val in kw.items())


def _layer_for(cfg, block, **overrides):
    layer = moe_layer_from_hf(cfg, device="cpu", params_dtype=torch.float32, block=block, **overrides)
    layer.load_state_dict(hf_to_moe_state_dict(block.state_dict(), cfg), strict=True)
    return layer


def _selection(layer, x, ids=None):
    # ascending expert index per token
    return layer.router(x.reshape(-1, x.shape[-1]), token_ids=ids).indices.sort(1)[0]


def _input_ids(cfg, block, x):
    """Token ids for the blocks that take them (DeepSeek-V4's hash layers), else None."""
    if not getattr(block, "is_hash", False):
        return None
    return torch.randint(0, cfg.vocab_size, x.shape[:-1], generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_block_matches_transformers(variant):
    fam, kw = variant
    cfg, block = tiny_block(fam, **kw)
    layer = _layer_for(cfg, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, cfg.hidden_size, generator=g)
    target = torch.randn(x.shape, generator=g)
    ids = _input_ids(cfg, block, x)
    assert torch.equal(_selection(layer, x, ids), hf_router(block, x, ids))
    errs = block_errors(block, layer, x, target, lambda grads: moe_to_hf_state_dict(grads, cfg), ids)
    assert len(errs) == 2 + len([p for p in block.parameters() if p.requires_grad])  # every trained weight
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, bad


def test_axk2_group_mask_picks_outside_the_groups():
    """A.X-K2's group mask scores the other groups' experts 0.0: with the correction bias pushed negative some
    tokens take experts outside their chosen groups (ties at 0.0, broken as torch.topk does); the layer picks the
    same experts and matches the block's outputs and gradients."""
    cfg, block = tiny_block("axk2", n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    with torch.no_grad():
        block.gate.e_score_correction_bias.sub_(0.9)
    layer = _layer_for(cfg, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, cfg.hidden_size, generator=g)
    idx = hf_router(block, x)
    assert torch.equal(_selection(layer, x), idx)
    s = torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ block.gate.weight.t()) + block.gate.e_score_correction_bias
    chosen = torch.zeros(s.shape[0], 4, dtype=torch.bool).scatter_(1, s.view(-1, 4, 4).topk(2, -1)[0].sum(-1)
                                                                   .topk(2, -1)[1], True)
    assert (~chosen.gather(1, idx // 4)).sum() > 0  # some routes leave the chosen groups
    errs = block_errors(block, layer, x, torch.randn(x.shape, generator=g), lambda gr: moe_to_hf_state_dict(gr, cfg))
    assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("family, kw", [
    ("llama4_text", {}),
    ("cohere2_moe", dict(expert_selection_fn="sigmoid", norm_topk_prob=True)),
])
def test_saturated_sigmoid_selects_on_the_logits(family, kw):
    """Llama 4 and Cohere2-MoE's sigmoid router take the top-k of the *logits*: with the gate scaled up many
    logits pass ~17, where the fp32 sigmoid is exactly 1.0 and the scores tie although the logits do not. The
    layer (``select_on="logits"``) picks transformers' experts and matches its outputs and gradients; ranking the
    tied scores instead picks other experts."""
    cfg, block = tiny_block(family, **kw)
    gate = block.router if hasattr(block, "router") else block.gate
    with torch.no_grad():
        gate.weight.mul_(400.0)
    layer = _layer_for(cfg, block)
    assert layer.router.select_on == "logits"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, cfg.hidden_size, generator=g)
    h = x.reshape(-1, cfg.hidden_size)
    scores = torch.sigmoid(h @ gate.weight.t())
    assert int((scores == 1.0).sum(1).gt(cfg.num_experts_per_tok).sum()) > 0  # ties above the top-k cut
    idx = hf_router(block, x)
    assert torch.equal(_selection(layer, x), idx)
    errs = block_errors(block, layer, x, torch.randn(x.shape, generator=g), lambda gr: moe_to_hf_state_dict(gr, cfg))
    assert max(errs.values()) <= TOL, errs
    on_scores = _layer_for(cfg, block, select_on="scores")
    assert not torch.equal(_selection(on_scores, x), idx)


@pytest.mark.parametrize("family, eps", [("lfm2_moe", 1e-6), ("muse_spark_text", 1e-15)])
def test_renormalization_eps_of_tiny_score_sums(family, eps):
    """LFM2-MoE and Muse-Spark renormalize the top-k sigmoid scores by ``sum + eps`` (1e-6, 1e-15): with every logit
    around -30 the chosen scores sum to ~1e-13, so the eps decides the weights. The layer (``norm_topk_eps``)
    matches the block; with Megatron's ``sum + 1e-20`` the block output is far off."""
    cfg, block = tiny_block(family)
    gate = block.router if hasattr(block, "router") else block.gate
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, cfg.hidden_size, generator=g).abs()
    with torch.no_grad():  # logits of about -30 for every token and expert
        gate.weight.copy_(-gate.weight.abs())
        logits = x.reshape(-1, cfg.hidden_size) @ gate.weight.t() * getattr(cfg, "output_multiplier", 1.0)
        gate.weight.mul_(30.0 / float(-logits.mean()))
    layer = _layer_for(cfg, block)
    assert layer.router.norm_topk_eps == eps
    errs = block_errors(block, layer, x, torch.randn(x.shape, generator=g), lambda gr: moe_to_hf_state_dict(gr, cfg))
    assert max(errs.values()) <= TOL, errs
    megatron = _layer_for(cfg, block, norm_topk_eps=None)
    assert rel_err(block_output(megatron, x), block_output(block, x)) > 1e-2  # far outside TOL


@pytest.mark.parametrize("overrides, what", [
    (dict(group_score_topk=None), "Megatron's group score rule (best topk // group_topk = 3)"),
    (dict(norm_topk_prob=None), "Megatron's renormalisation rule (always on for sigmoid)"),
])
def test_megatron_rules_would_fail(overrides, what):
    """The DeepSeek-V3 configs above need the new options: with Megatron's rules the layer picks other experts or
    other weights, and the block test's tolerance fails."""
    fam_kw = dict(norm_topk_prob=False) if "norm_topk_prob" in overrides else {}
    cfg, block = tiny_block("deepseek_v3", **fam_kw)
    layer = _layer_for(cfg, block, **overrides)
    x = torch.randn(3, 11, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    if "group_score_topk" in overrides:
        assert not torch.equal(_selection(layer, x), hf_router(block, x)), what
    with torch.no_grad():
        assert rel_err(layer(x), block_output(block, x)) > 100 * TOL, what


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_round_trips(family):
    cfg, block = tiny_block(family)
    v5 = block.state_dict()
    moe = hf_to_moe_state_dict(v5, cfg)
    back = moe_to_hf_state_dict(moe, cfg)
    assert sorted(back) == sorted(v5)
    for k, t in v5.items():
        assert torch.equal(back[k], t), k
    c = moe_config_from_hf(cfg, layer_idx=0)  # per-layer options (Step-3.7) do not change the layout
    E, F = c.num_experts, c.ffn_hidden_size
    if family not in ONE_LAYOUT:
        # v4: one module per expert, gate_up_proj[e] = cat(gate, up) (transformers' conversion mapping)
        g, u, d = V4_NAMES.get(family, ("gate_proj", "up_proj", "down_proj"))
        v4 = {k: t for k, t in v5.items() if not k.startswith("experts.")}
        for e in range(E):
            if g is None:  # non-gated: experts.up_proj [E, F, H]
                v4[f"experts.{e}.{u}.weight"] = v5["experts.up_proj"][e].clone()
            else:
                v4[f"experts.{e}.{g}.weight"] = v5["experts.gate_up_proj"][e, :F].clone()
                v4[f"experts.{e}.{u}.weight"] = v5["experts.gate_up_proj"][e, F:].clone()
            v4[f"experts.{e}.{d}.weight"] = v5["experts.down_proj"][e].clone()
        moe4 = hf_to_moe_state_dict(v4, cfg)
        assert sorted(moe4) == sorted(moe) and all(torch.equal(moe4[k], moe[k]) for k in moe)
        out4 = moe_to_hf_state_dict(moe, cfg, layout="v4")
        assert sorted(out4) == sorted(v4) and all(torch.equal(out4[k], v4[k]) for k in v4)
    # expert parallelism: each rank's experts; together the whole layer
    for layout in ("v5", "v4"):
        src = v5 if layout == "v5" or family in ONE_LAYOUT else moe_to_hf_state_dict(moe, cfg, layout="v4")
        parts = [hf_to_moe_state_dict(src, cfg, ep_rank=r, ep_size=2) for r in range(2)]
        for k, t in moe.items():
            whole = torch.cat([p[k] for p in parts]) if k.startswith("experts.") else parts[1][k]
            assert torch.equal(whole, t), (layout, k)
        back1 = moe_to_hf_state_dict(parts[1], cfg, layout=layout, ep_rank=1, ep_size=2)
        if layout == "v4" and family not in ONE_LAYOUT:
            assert all(torch.equal(back1[k], src[k]) for k in back1)  # global expert names E/2 .. E-1
            assert f"experts.{E - 1}.{V4_NAMES.get(family, ('', '', 'down_proj'))[2]}.weight" in back1
    with pytest.raises(ValueError, match="ep_size"):
        hf_to_moe_state_dict(v5, cfg, ep_rank=0, ep_size=3)


@pytest.mark.parametrize("family", WHOLE_MODEL)
def test_whole_model_swapped(family):
    if not has_tiny_model(family):
        pytest.skip(f"{family}: no tiny whole model (its block is checked)")
    cfg, model = tiny_model(family)
    if family in FP64_WHOLE:
        model = model.double()
    ref = copy.deepcopy(model)
    names = swap_moe_blocks(model)
    # the family whose blocks the model holds (sarvam_*: glm4_moe's and deepseek_v3's)
    holds = BLOCK_CLASSES.get(type(tiny_block(family)[1]).__name__, family)
    expected = [n for n, m in ref.named_modules() if BLOCK_CLASSES.get(type(m).__name__) == holds]
    assert names == expected and len(names) >= 1
    if family == "deepseek_v3":
        assert names == [f"model.layers.{i}.mlp" for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)]
    # Gemma 4 (split router and experts): the decoder layer keeps its modules, its experts are the HFMoEBlock
    assert all(isinstance(model.get_submodule(n), HFMoEBlock) or isinstance(model.get_submodule(n).experts,
                                                                              HFSplitExperts) for n in names)
    moe_of = {n: next(m for m in model.get_submodule(n).modules() if isinstance(m, MoELayer)) for n in names}
    moe_params = {id(p) for m in moe_of.values() for p in m.parameters()}
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    (y_ref, loss_ref), (y, loss) = model_loss(ref, ids), model_loss(model, ids)
    tol = 1e-10 if family in FP64_WHOLE else TOL
    assert rel_err(y, y_ref) <= tol
    assert abs(float(loss.detach() - loss_ref.detach())) <= tol * abs(float(loss_ref.detach()))
    loss_ref.backward()
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in model.named_parameters() if id(p) not in moe_params}
    for name in names:
        layer = moe_of[name]
        moe_grads = {n: p.grad for n, p in layer.named_parameters()}
        got.update({f"{name}.{k}": g for k, g in moe_to_hf_state_dict(moe_grads, cfg).items()})
    assert sorted(got) == sorted(ref_grads)
    assert all(got[n] is None for n, g in ref_grads.items() if g is None)  # parameters the loss does not reach
    bad = {n: rel_err(got[n], g) for n, g in ref_grads.items()
           if g is not None and not rel_err(got[n], g) <= _tol(n, GRAD_TOL.get(family, tol))}
    assert not bad, bad


def _tol(name, tol):
    """DeepSeek-V4's hyper-connection parameters (``hc_*``: Sinkhorn-normalized mixing; also HY-V4's ``*_hc.``)
    amplify fp32 rounding: transformers against itself with another expert backend (``batched_mm`` vs
    ``grouped_mm``) differs by 2.3e-5 on ``hc_head.hc_base``; everything else stays within ``tol``."""
    return 1e-4 if ".hc_" in name or "_hc." in name else tol


def test_swap_shares_parameters():
    cfg, model = tiny_model("mixtral")
    gate, experts = model.model.layers[0].mlp.gate.weight, model.model.layers[0].mlp.experts.gate_up_proj
    swap_moe_blocks(model)
    layer = model.model.layers[0].mlp.moe
    assert layer.router.weight is gate and layer.experts.fc1.weight is experts
    assert experts.allreduce is False  # an expert parameter for moe_graph's DDP


def test_hf_load_balancing_loss():
    """The HF form of the aux loss, from the swapped layers, equals transformers' own (pooled over the layers, times
    top-k), with and without padding."""
    cfg, model = tiny_model("mixtral", router_aux_loss_coef=0.02)
    ref = copy.deepcopy(model)
    swap_moe_blocks(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    for am in (None, mask):
        out_ref = ref(ids, attention_mask=am, labels=ids, output_router_logits=True)
        out = model(ids, attention_mask=am, labels=ids)
        aux = hf_load_balancing_loss(model, am)
        assert abs(float(aux - out_ref.aux_loss)) <= 1e-6 * float(out_ref.aux_loss)
        total = out.loss + cfg.router_aux_loss_coef * aux
        assert abs(float(total - out_ref.loss)) <= TOL * float(out_ref.loss)


@pytest.mark.parametrize("family, kw, match", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act"),
    ("deepseek_v3", dict(n_routed_experts=8, n_group=8, topk_group=2), "n_group"),
    ("mistral4", dict(n_group=3), "mistral4: n_group=3 must divide"),
    ("mistral_large4_text", dict(n_group=3), "mistral_large4_text: n_group=3 must divide"),
    ("jetmoe", dict(activation_function="gelu"), "activation_function"),
    ("deepseek_v4", dict(mlp_bias=True), "mlp_bias"),
    ("longcat_flash", dict(router_bias=True), "never applies"),
    ("diffusion_gemma_text", dict(num_experts=None), "no MoE block"),
    ("step3p5", {}, "swiglu_limits=.* differs between layers: pass block= or layer_idx="),
])
def test_unsupported_configs(family, kw, match):
    with pytest.raises(ValueError, match=match):
        moe_config_from_hf(tiny_config(family, **kw))


def test_per_layer_options_follow_the_block():
    """Step-3.7's per-layer limits: each swapped block gets its layer's (layer 0 clamps its routed experts, layer 1
    only its shared expert), and the block names give the layer index."""
    cfg, model = tiny_model("step3p5")
    swap_moe_blocks(model)
    c0, c1 = (model.layers[i].mlp.moe.config for i in range(2))
    assert (c0.activation, c0.swiglu_limit, c0.shared_activation, c0.shared_swiglu_limit) == \
        ("post_clamped_swiglu", 1.0, "post_clamped_swiglu", 1.5)
    assert (c1.activation, c1.shared_activation, c1.shared_swiglu_limit) == ("swiglu", "post_clamped_swiglu", 2.0)
    assert c0.shared_bias and not c0.add_bias_linear


def test_configs_read_through_another_family():
    """transformers configs without a block of their own: Sarvam's are built as GLM-4-MoE / DeepSeek-V3 models (its
    auto mapping), so they are read as those families; Nemotron-3.5-Transcribe's MoE is its nemotron_h language
    model, read through get_text_config."""
    from transformers.models.nemotron3_5_transcribe.configuration_nemotron3_5_transcribe import (
        Nemotron3_5TranscribeConfig,
    )
    sarvam = tiny_config("sarvam_moe")
    assert sarvam.model_type == "sarvam_moe"
    glm = transformers.Glm4MoeConfig(**{k: getattr(sarvam, k) for k in (
        "hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        "n_shared_experts", "routed_scaling_factor", "norm_topk_prob")})
    assert moe_config_from_hf(sarvam) == moe_config_from_hf(glm)
    text = tiny_config("nemotron_h")
    speech = Nemotron3_5TranscribeConfig(text_config=text.to_dict())
    assert speech.model_type != "nemotron_h" and moe_config_from_hf(speech) == moe_config_from_hf(text)
    with pytest.raises(ValueError, match="model_type='llama'"):  # an auto-mapped dense model stays unsupported
        moe_config_from_hf(transformers.LlamaConfig())


def test_unsupported_family():
    with pytest.raises(ValueError, match="model_type='llama'"):
        moe_config_from_hf(transformers.LlamaConfig())


@pytest.mark.parametrize("model_type, reason", [
    ("ernie4_5_vl_moe", "token-type expert sets"), ("phimoe", "SparseMixer"), ("zaya", "an MLP router"),
    ("doge", "product-key routing"),
])
def test_unsupported_families_name_the_reason(model_type, reason):
    """transformers' own configs of the families MoELayer cannot express: the error names the semantics missing."""
    cfg = transformers.AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=reason):
        moe_config_from_hf(cfg)


def test_doge_message_matches_transformers_block():
    """The doge message's semantics read from transformers' own DogeCDMoE: with the experts' output rows zeroed the
    block returns its dense MLP's output unscaled (added, not averaged), and each expert is one embedding row."""
    from transformers.models.doge.modeling_doge import DogeCDMoE

    cfg = transformers.AutoConfig.for_model("doge", hidden_size=16, intermediate_size=24, num_experts=16,
                                            num_experts_per_tok=2, is_moe=True)
    torch.manual_seed(0)
    block = DogeCDMoE(cfg).eval()
    assert block.down_embed.weight.shape == block.up_embed.weight.shape == (16, 16)  # single-unit experts
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        routed = block(x)[0] - block.down_proj(block.act_fn(block.gate_proj(x)) * block.up_proj(x))
        block.up_embed.weight.zero_()
        dense_only = block(x)[0]
    assert routed.abs().max() > 0 and torch.equal(dense_only, block.down_proj(block.act_fn(block.gate_proj(x)) *
                                                                                block.up_proj(x)))
    with pytest.raises(ValueError, match="added to a dense MLP") as e:
        moe_config_from_hf(cfg)
    assert "averag" not in str(e.value)


def test_readme_example():
    """The example of python/moe_graph/integrations/README.md runs as written and keeps the logits."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "moe_graph",
                        "integrations", "README.md")
    text = open(path).read()
    code = re.search(r"<!-- example: hf-example -->\n```python\n(.*?)```", text, re.S).group(1)
    ns = {"__name__": "hf_readme_example"}
    torch.manual_seed(0)
    exec(compile(code, "integrations/README.md (hf-example)", "exec"), ns)  # noqa: S102
    assert ns["swapped"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert rel_err(ns["out"].logits, ns["logits"]) <= TOL
    assert "experts.7.down_proj.weight" in ns["v4"]


def test_bench_hf_blocks_smoke(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_hf_blocks.py in a tiny configuration: its table and JSON (commit, errors within the
    tolerance, both timings); speed itself is not asserted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_hf_blocks", os.path.join(root, "benchmarks",
                                                                                  "bench_hf_blocks.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "hf.json"
    monkeypatch.setattr(sys, "argv", ["bench_hf_blocks.py", "--families", "gpt_oss", "--tokens", "32",
                                      "--hidden", "32", "--ffn", "16", "--reps", "1", "--out", str(out)])
    bench.main()
    assert "speedup" in capsys.readouterr().out
    d = json.load(open(out))
    assert d["env"]["commit"] and [r["family"] for r in d["rows"]] == ["gpt_oss"]
    for r in d["rows"]:
        assert max(r["errors"].values()) <= TOL and r["ms_hf"] > 0 and r["ms_moe_graph"] > 0, r
