"""MoELayer's routing and expert options against the float64 layer reference written from their definitions
(:func:`moe_graph.testing.moe_reference.reference_moe_layer`): renormalisation independent of the score function,
the group score rule, the router bias, expert biases (fused epilogue, fused ``main_grad`` and echo spare slots) and
the ``relu`` / ``silu`` / ``clamped_swiglu`` activations; outputs, input gradients and every parameter gradient,
in one process (echo with one rank, recompute) and with EP=2 on gloo (echo)."""

import pytest
import torch

from helpers.moe_option_workers import option_layer_ep_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.config import MoEConfig
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.router import TopKRouter, routing_map
from moe_graph.ops.activation import expert_activation
from moe_graph.testing.moe_reference import reference_moe_layer, reference_route

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def _layer(E=8, K=2, H=8, F=6, seed=0, **options):
    torch.manual_seed(seed)
    layer = MoELayer(H, F, E, K, device="cpu", params_dtype=DT, init_std=0.5, **options)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
        for p in layer.parameters():  # biases start at zero: give them values that matter
            if p.dim() <= 2 and p is not layer.router.weight and "bias" in _name(layer, p):
                p.normal_(0, 0.5)
    return layer


def _name(module, param):
    return next(n for n, p in module.named_parameters() if p is param)


def _attach_main_grads(layer):
    for w in layer.experts.weights():  # the fused path: weight gradients into main_grad, biases' through autograd
        w.main_grad = torch.zeros_like(w)


def _grad(p):
    mg = getattr(p, "main_grad", None)
    return mg if mg is not None else p.grad


def _check(layer, x, *, reps=1, token_ids=None):
    """Layer vs :func:`reference_moe_layer` on the same parameters: output, input gradient, every parameter's
    gradient (``main_grad`` where the layer has one). ``reps`` forwards/backwards accumulate. ``token_ids``: for
    hash routing."""
    target = torch.randn(x.shape, dtype=DT, generator=torch.Generator().manual_seed(7))
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    if layer.router.enable_expert_bias:
        params["router.expert_bias"] = layer.router.expert_bias.clone()
    if layer.router.hash_vocab_size is not None:
        params["router.tid2eid"] = layer.router.tid2eid.clone()
    xl, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(reps):
        y = layer(xl, token_ids=token_ids)
        (y * target).sum().backward()
        y_ref = reference_moe_layer(xr, params, layer.config, token_ids=token_ids)
        (y_ref * target).sum().backward()
    torch.testing.assert_close(y.detach(), y_ref.detach(), **TOL)
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(_grad(p), params[n].grad, **TOL, msg=lambda m: f"{n}: {m}")
    return y


# ------------------------------------------------------------------------------------------------- router --
def test_norm_topk_prob_independent_of_score_func(gen):
    x = torch.randn(16, 8, generator=gen, dtype=DT)
    for score_func in ("softmax", "sigmoid"):
        for norm in (None, True, False):
            layer = _layer(score_func=score_func, norm_topk_prob=norm)
            expected = (score_func == "sigmoid") if norm is None else norm  # None: Megatron's rule, unchanged
            assert layer.router.norm_topk_prob == expected
            _check(layer, x)
            sums = layer.router(x.reshape(-1, 8)).probs.sum(-1)
            if expected:
                torch.testing.assert_close(sums, torch.ones_like(sums), **TOL)
            else:
                assert (sums - 1).abs().max() > 1e-3


def test_group_score_topk_rules_differ_and_match(gen):
    """top-6 of 16 experts in 4 groups, 2 groups kept: Megatron's rule sums a group's best 3 scores, DeepSeek's
    best 2; both are reproduced, and they pick different experts for some tokens."""
    E, K, G, gk = 16, 6, 4, 2
    x = torch.randn(64, 8, generator=gen, dtype=DT)
    picks = {}
    for rule in (None, 2):
        layer = _layer(E=E, K=K, score_func="sigmoid", num_groups=G, group_topk=gk, group_score_topk=rule,
                       topk_scaling_factor=2.5)
        _check(layer, x)
        rmap = routing_map(layer.router(x).indices, E)
        picks[rule] = rmap
        idx, _, _ = reference_route(x, layer.router.weight.detach(), K, "sigmoid", num_groups=G, group_topk=gk,
                                    group_score_topk=rule)
        ref_map = torch.zeros(64, E, dtype=torch.bool).scatter_(1, idx, True)
        assert torch.equal(rmap, ref_map)
    assert (picks[None] != picks[2]).any(dim=1).sum() >= 3  # the rules differ on these tokens


def test_group_masked_score(gen):
    """A.X-K2's group mask (the other groups' experts score 0.0, not -inf): with a negative selection bias some
    tokens pick an expert outside their chosen groups, which the -inf mask never does; both match the reference."""
    x = torch.randn(32, 8, generator=gen, dtype=DT)
    picks = {}
    for masked in (None, 0.0):
        layer = _layer(E=16, K=4, score_func="sigmoid", num_groups=4, group_topk=2, group_score_topk=2,
                       enable_expert_bias=True, group_masked_score=masked)
        with torch.no_grad():
            layer.router.expert_bias.fill_(-0.6)  # sigmoid + bias below 0 for the weaker experts
        _check(layer, x)
        picks[masked] = layer.router(x).indices.sort(1)[0]
    assert (picks[None] != picks[0.0]).any(dim=1).sum() >= 1


def test_group_score_topk_with_expert_bias(gen):
    layer = _layer(E=16, K=4, score_func="sigmoid", num_groups=4, group_topk=2, group_score_topk=2,
                   enable_expert_bias=True, norm_topk_prob=False)
    with torch.no_grad():
        layer.router.expert_bias.normal_(0, 0.3)
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT))


@pytest.mark.parametrize("score_func, target, norm", [("softmax", "scores", True), ("sigmoid", "logits", False),
                                                      ("softmax", "logits", True)])
def test_expert_bias_softmax_and_logits(gen, score_func, target, norm):
    """Selection-only expert bias with a softmax router (ERNIE-4.5-MoE, its renormalisation floor) and added to the
    logits (Kolibri-1); the bias changes the selection of some tokens, the probabilities stay the unbiased scores."""
    layer = _layer(score_func=score_func, enable_expert_bias=True, select_on=target, norm_topk_prob=norm,
                   norm_topk_min=0.3 if norm else None)
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    plain = layer.router(x).indices.sort(1)[0]
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-1.5, 1.5, 8))
    assert not torch.equal(layer.router(x).indices.sort(1)[0], plain)
    _check(layer, x)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_select_on_logits_breaks_saturated_ties(gen, score_func):
    """fp32 scores of large logits tie (sigmoid 1.0 past ~17; softmax 0.0 more than ~104 below the maximum) although the
    logits differ: ``select_on="logits"`` ranks the logits (Llama 4), ``"scores"`` the tied scores (lowest index
    first); each matches the reference with the same rule, the probabilities are the same scores either way."""
    torch.manual_seed(0)
    x = torch.randn(32, 8, generator=gen)
    for select_on in ("scores", "logits"):
        r = TopKRouter(8, 16, 3, score_func=score_func, norm_topk_prob=False, select_on=select_on)
        with torch.no_grad():
            r.weight.normal_(0, 8.0 if score_func == "sigmoid" else 30.0, generator=torch.Generator().manual_seed(3))
        routing = r(x)
        idx, top, _ = reference_route(x, r.weight.detach(), 3, score_func, False, select_on=select_on)
        assert torch.equal(routing.indices.sort(1)[0], idx.sort(1)[0]), select_on
        torch.testing.assert_close(routing.probs.gather(1, routing.indices.argsort(1)),
                                   top.gather(1, idx.argsort(1)), rtol=1e-6, atol=0)
        if select_on == "scores":
            by_scores = routing.indices.sort(1)[0]
    assert not torch.equal(routing.indices.sort(1)[0], by_scores)  # the rule matters on these inputs


def test_select_on_is_validated():
    with pytest.raises(ValueError, match="select_on must be one of"):
        TopKRouter(8, 16, 2, select_on="probs")
    with pytest.raises(ValueError, match="select_on='logits'"):
        TopKRouter(8, 16, 2, select_on="logits", hash_vocab_size=10)


def test_norm_topk_eps_matches_reference(gen):
    """``norm_topk_eps``: the renormalization divides by ``sum + eps``; with logits around -25 the sigmoid top-k of
    some tokens sums to ~1e-8, so eps = 1e-6 keeps their probabilities small where 1e-20 makes them sum to 1."""
    x = torch.randn(16, 8, generator=gen).abs()
    r = TopKRouter(8, 8, 2, score_func="sigmoid", norm_topk_prob=True, norm_topk_eps=1e-6, scaling_factor=2.0)
    with torch.no_grad():
        r.weight.copy_(-r.weight.abs())
        r.weight.mul_(25.0 / float(-(x @ r.weight.t()).mean()))
    routing = r(x)
    idx, top, _ = reference_route(x.double(), r.weight.detach().double(), 2, "sigmoid", True, scaling_factor=2.0,
                                  norm_topk_eps=1e-6)
    assert torch.equal(routing.indices, idx)
    torch.testing.assert_close(routing.probs.double(), top, rtol=1e-5, atol=0)
    assert float(routing.probs.detach().sum(-1).min()) < 1e-2  # tokens whose scores sum to ~1e-8 keep tiny weights
    r.norm_topk_eps = 1e-20  # Megatron's: every token's weights sum to the scaling factor
    torch.testing.assert_close(r(x).probs.sum(-1), torch.full((16,), 2.0))
    with pytest.raises(ValueError, match="norm_topk_eps must be"):
        TopKRouter(8, 8, 2, norm_topk_eps=-1.0)
    with pytest.raises(ValueError, match="give one"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=8, topk=2, norm_topk_eps=1e-6, norm_topk_min=0.1)


def test_router_bias(gen):
    layer = _layer(router_bias=True, norm_topk_prob=True)
    assert layer.router.bias.shape == (8,) and layer.router.bias.requires_grad
    with torch.no_grad():
        layer.router.bias.copy_(torch.linspace(-2, 2, 8, dtype=DT))
    _check(layer, torch.randn(20, 8, generator=gen, dtype=DT))
    assert layer.router.bias.grad.abs().max() > 0


def test_router_bias_router_dtype(gen):
    torch.manual_seed(0)
    r = TopKRouter(8, 4, 2, router_bias=True, router_dtype=torch.float64, dtype=torch.float32)
    with torch.no_grad():
        r.bias.normal_()
    x = torch.randn(10, 8, generator=gen)
    routing = r(x)
    idx, top, _ = reference_route(x.double(), r.weight.detach().double(), 2, gate_bias=r.bias.detach().double())
    assert torch.equal(routing.indices, idx)
    torch.testing.assert_close(routing.probs, top)


# ----------------------------------------------------------------------------------------- activations --
def test_clamped_swiglu_clamps():
    h = torch.tensor([[10.0, -10.0], [-10.0, 10.0], [1.0, 0.5]], dtype=DT)  # [gate | up]
    y = expert_activation(h, "clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0)
    g = torch.tensor([7.0, -10.0, 1.0], dtype=DT)
    u = torch.tensor([-7.0, 7.0, 0.5], dtype=DT)
    torch.testing.assert_close(y[:, 0], g * torch.sigmoid(1.702 * g) * (u + 1), **TOL)


@pytest.mark.parametrize("activation", ["relu", "silu", "squared_relu", "clamped_swiglu", "limited_swiglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_activation_and_bias_layer(gen, activation, bias):
    layer = _layer(activation=activation, add_bias_linear=bias, swiglu_limit=1.5, swiglu_alpha=1.2,
                   shared_expert_ffn_size=5, shared_expert_gate=True)
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    _check(layer, x)
    if activation == "clamped_swiglu":  # the clamps are active on these inputs
        fc1 = layer.experts.fc1
        a = x @ fc1.weight[0].detach().t() + (fc1.bias[0].detach() if bias else 0)
        assert (a.abs() > 1.5).any()


# ------------------------------------------------------------------ biases with echo, main_grad, recompute --
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("echo", [0, 1])
def test_bias_echo_fused(gen, fused, echo):
    layer = _layer(activation="clamped_swiglu", add_bias_linear=True, router_bias=True,
                   num_spare_experts_per_ep_rank=echo)
    if fused:
        _attach_main_grads(layer)
        assert layer.experts.uses_fused_wgrad()
    # one rank: the echo paths run with an idle spare slot (test_options_ep2_echo gives the slots tokens)
    _check(layer, torch.randn(32, 8, generator=gen, dtype=DT), reps=2)  # twice: accumulation, buffers reused


@pytest.mark.parametrize("plan_mode", ["microbatch", "iteration"])
def test_bias_echo_recompute(gen, plan_mode):
    kw = dict(recompute=True) if plan_mode == "microbatch" else dict(echo_plan_mode="iteration")
    layer = _layer(activation="relu", add_bias_linear=True, num_spare_experts_per_ep_rank=1, **kw)
    layer.train()
    _check(layer, torch.randn(32, 8, generator=gen, dtype=DT))


@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static", "bias_F_lt_H"])
def test_probs_on_input_and_output_bias(gen, case):
    """Routing probabilities on the expert input (Llama 4) and a block output bias (JetMoE), through the fused
    main_grad + echo path, recompute, the fixed-capacity dispatcher, and with expert biases where F < H."""
    kw = dict(probs_on_input=True, output_bias=True, score_func="sigmoid", norm_topk_prob=False,
              shared_expert_ffn_size=5, shared_expert_combine="average")
    kw.update({"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
               "static": dict(capacity_factor=8.0), "bias_F_lt_H": dict(add_bias_linear=True)}.get(case, {}))
    layer = _layer(**kw)
    assert not layer.scale_rows
    with torch.no_grad():
        layer.output_bias.normal_(0, 0.5)
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT), reps=2 if case == "fused_echo" else 1)


# ------------------------------------- DeepSeek-V4, LongCat-Flash, A.X-K1, Laguna: router and block options --
def _hash_table(V, E, K, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)])


ROUTER_OPTION_SETS = {
    # DeepSeek-V4's hash layers: sqrtsoftplus scores, experts from the token-id table, renormalized and scaled
    "hash_sqrtsoftplus": dict(score_func="sqrtsoftplus", hash_vocab_size=16, topk_scaling_factor=1.5),
    # DeepSeek-V4's learned layers: sqrtsoftplus with the selection bias
    "sqrtsoftplus_bias": dict(score_func="sqrtsoftplus", enable_expert_bias=True, topk_scaling_factor=1.5),
    # LongCat-Flash: 3 zero-computation experts, softmax with the selection bias, not renormalized, scaled
    "zero_experts": dict(num_zero_experts=3, enable_expert_bias=True, norm_topk_prob=False,
                         topk_scaling_factor=2.0),
    # Inkling: 2 shared experts scored by the gate with the 2 routed ones, renormalized jointly, a learned scale
    "scored_shared": dict(K=4, score_func="sigmoid", num_scored_shared_experts=2, router_global_scale=True,
                          enable_expert_bias=True, norm_topk_prob=True, topk_scaling_factor=2.5),
    # Laguna's soft-capped logits; A.X-K1's RMSNorm of the output
    "softcap_output_norm": dict(score_func="sigmoid", logit_softcap=1.5, output_norm="rmsnorm",
                                shared_expert_ffn_size=5),
    # Llama 4 / Cohere2-MoE's top-k of the logits; LFM2-MoE's renormalization by sum + eps (a large eps here, so
    # that it shows in the probabilities)
    "logits_select_eps": dict(score_func="sigmoid", select_on="logits", norm_topk_prob=True, norm_topk_eps=0.05,
                              topk_scaling_factor=1.5),
}


def _option_layer(name, **extra):
    layer = _layer(**ROUTER_OPTION_SETS[name], **extra)
    r = layer.router
    with torch.no_grad():
        if r.enable_expert_bias:
            r.expert_bias.copy_(torch.linspace(-0.3, 0.3, r.num_experts, dtype=torch.float32))
        if r.hash_vocab_size is not None:
            r.tid2eid.copy_(_hash_table(r.hash_vocab_size, 8, 2))
        if layer.output_norm is not None:
            layer.output_norm.weight.normal_(1.0, 0.2)
        if r.global_scale is not None:
            r.global_scale.fill_(0.7)
    return layer


@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static"])
@pytest.mark.parametrize("name", list(ROUTER_OPTION_SETS))
def test_router_and_block_options(gen, name, case):
    """sqrtsoftplus scores, hash routing by token id, zero-computation experts, logit soft-capping, the output
    RMSNorm, the top-k of the logits and the renormalization epsilon against the float64 reference, through the fused main_grad + echo path, recompute and the fixed-capacity
    dispatcher."""
    extra = {"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
             "static": dict(capacity_factor=8.0)}.get(case, {})
    layer = _option_layer(name, **extra)
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    x = torch.randn(4, 6, 8, generator=gen, dtype=DT)
    ids = torch.randint(0, 16, (4, 6), generator=gen)
    _check(layer, x, token_ids=ids, reps=2 if case == "fused_echo" else 1)
    routing = layer.router(x.reshape(-1, 8), token_ids=ids)
    if name == "hash_sqrtsoftplus":
        assert torch.equal(routing.indices, layer.router.tid2eid[ids.reshape(-1)])
    if name == "scored_shared":  # every token routes to the two shared experts, after its two routed ones
        assert torch.equal(routing.indices[:, 2:], torch.tensor([6, 7]).expand(24, 2))
        assert bool((routing.indices[:, :2] < 6).all())
    if name == "zero_experts":  # some routes go to the zero experts, and the statistics count the real ones
        real = routing.indices < 8
        assert 0 < int((~real).sum()) < real.numel()
        expected = torch.bincount(routing.indices[real], minlength=8)
        assert torch.equal(layer.last_tokens_per_expert, expected)


def test_zero_experts_not_dispatched(gen):
    """Routes to zero-computation experts take no capacity: a static capacity of exactly the real routes drops
    nothing (overflow="rerun" sees no overflow) and matches the reference; one row less drops one route."""
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    layer = _option_layer("zero_experts")
    live = int((layer.router(x).indices < 8).sum())
    T, K = 24, 2
    assert live < T * K
    for cap, drops in ((live, 0), (live - 1, 1)):
        layer = _option_layer("zero_experts", capacity_factor=(cap - 0.5) / (T * K), overflow="rerun")
        assert layer.dispatcher.capacity_for(T, K, layer.capacity_factor) == cap
        layer.train()
        if drops == 0:
            _check(layer, x)
        else:
            layer(x)
        assert int(layer.dispatcher.step_dropped_routes) == drops


def test_hash_routing_needs_token_ids(gen):
    layer = _option_layer("hash_sqrtsoftplus")
    x = torch.randn(3, 8, generator=gen, dtype=DT)
    with pytest.raises(ValueError, match="token_ids"):
        layer(x)
    with pytest.raises(ValueError, match="token_ids must have shape"):
        layer(x, token_ids=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_ids must be an integer"):
        layer.router(x, token_ids=torch.zeros(3))
@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static"])
@pytest.mark.parametrize("activation", ["post_clamped_swiglu", "softcapped_swiglu", "geglu_tanh"])
def test_expert_activation_kinds_and_shared_expert_options(gen, case, activation):
    """The activation kinds of issue 33 (Step-3.7's clamp after the activation, Inkling-2's soft caps, Gemma 4's
    gated GELU) in the routed experts, the shared expert with its own activation, limit and biases (HY-V4,
    Step-3.7), through the fused main_grad + echo path, recompute and the fixed-capacity dispatcher; the limit and
    caps are small enough to act on these inputs."""
    kw = dict(activation=activation, swiglu_limit=0.8, swiglu_alpha=0.6, shared_expert_ffn_size=5,
              shared_expert_activation="post_clamped_swiglu", shared_expert_swiglu_limit=0.5,
              shared_expert_bias=True)
    kw.update({"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
               "static": dict(capacity_factor=8.0)}.get(case, {}))
    layer = _layer(**kw)
    assert layer.shared_expert.fc1.bias is not None and layer.experts.fc1.bias is None
    assert layer.shared_expert.activation == "post_clamped_swiglu" and layer.shared_expert.swiglu_limit == 0.5
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT), reps=2 if case == "fused_echo" else 1)


@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static"])
def test_latent_projections(gen, case):
    """Nemotron-H's moe_latent_size: the routed experts in a latent width (6, hidden 8) between ``latent_in`` and
    ``latent_out`` (with biases), the router and the shared expert on the hidden width."""
    kw = dict(latent_size=6, latent_bias=True, activation="squared_relu", shared_expert_ffn_size=5,
              shared_expert_bias=True, score_func="sigmoid")
    kw.update({"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
               "static": dict(capacity_factor=8.0)}.get(case, {}))
    layer = _layer(**kw)
    assert layer.experts.fc1.weight.shape[-1] == 6 and layer.latent_out.weight.shape == (8, 6)
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT), reps=2 if case == "fused_echo" else 1)
    assert layer.latent_in.weight.grad.abs().max() > 0


@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static"])
def test_logit_multiplier_and_expert_norms(gen, case):
    """Muse-Spark's block: the logits times a constant before the sigmoid, a centered RMSNorm of the latent input
    and the input-scaled RMSNorm of each expert output row (F = 4 < latent 6: without the norm the probabilities
    would move into the experts), against the reference; static: capacity rows past the routes stay zero."""
    kw = dict(latent_size=6, score_func="sigmoid", enable_expert_bias=True, router_logit_multiplier=0.3, F=4,
              expert_input_norm="centered_rmsnorm", expert_input_norm_eps=1e-5,
              expert_output_norm="scaled_rmsnorm", expert_output_norm_eps=1e-8)
    kw.update({"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
               "static": dict(capacity_factor=8.0)}.get(case, {}))
    layer = _layer(**kw)
    assert not layer.scale_rows and layer.expert_output_norm.weight.shape == (6,)
    with torch.no_grad():
        layer.expert_input_norm.weight.normal_(0, 0.3)
        layer.expert_output_norm.weight.normal_(0, 0.3)
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8, dtype=torch.float32))
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT), reps=2 if case == "fused_echo" else 1)
    assert layer.expert_output_norm.weight.grad.abs().max() > 0 and layer.expert_input_norm.weight.grad.abs().max() > 0
    # the multiplier changes the routing probabilities (sigmoid is not scale-invariant)
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    r = layer.router
    _, probs, _ = reference_route(x, r.weight.detach(), 2, "sigmoid", expert_bias=r.expert_bias, logit_multiplier=0.3)
    torch.testing.assert_close(r(x).probs.detach(), probs, **TOL)
    _, unscaled, _ = reference_route(x, r.weight.detach(), 2, "sigmoid", expert_bias=r.expert_bias)
    assert (probs - unscaled).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["plain", "fused_echo", "recompute", "static"])
def test_router_input_norm_expert_scale_and_router_input(gen, case):
    """Gemma 4's router: the gate on ``rms_norm(r) * input_scale / sqrt(H)``, each probability times its expert's
    learned factor, the gate fed a separate ``router_input`` ``r`` (the experts see ``x``); gradients reach both
    scales and ``r``."""
    kw = dict(router_input_norm=True, router_norm_eps=1e-3, router_expert_scale=True, norm_topk_prob=True,
              activation="geglu_tanh")
    kw.update({"fused_echo": dict(num_spare_experts_per_ep_rank=1), "recompute": dict(recompute=True),
               "static": dict(capacity_factor=8.0)}.get(case, {}))
    layer = _layer(**kw)
    with torch.no_grad():
        layer.router.input_scale.normal_(1, 0.5)
        layer.router.expert_scale.normal_(1, 0.5)
    if case == "fused_echo":
        _attach_main_grads(layer)
    layer.train()
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    r = (torch.randn(24, 8, generator=gen, dtype=DT) * 3).requires_grad_()
    rr = r.detach().clone().requires_grad_()
    target = torch.randn(x.shape, dtype=DT, generator=gen)
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    xl, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xl, router_input=r)
    y_ref = reference_moe_layer(xr, params, layer.config, router_input=rr)
    (y * target).sum().backward()
    (y_ref * target).sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    for got, ref in ((xl.grad, xr.grad), (r.grad, rr.grad)):
        torch.testing.assert_close(got, ref, **TOL)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(_grad(p), params[n].grad, **TOL, msg=lambda m: f"{n}: {m}")
    assert layer.router.input_scale.grad.abs().max() > 0 and layer.router.expert_scale.grad.abs().max() > 0
    with pytest.raises(ValueError, match="router_input must have the shape of x"):
        layer(x, router_input=r[:5])


def test_options_static_capacity(gen):
    """The fixed-capacity (static) dispatcher with room for every route carries the new options unchanged."""
    layer = _layer(activation="clamped_swiglu", swiglu_limit=1.5, add_bias_linear=True, router_bias=True,
                   capacity_factor=8.0)
    _check(layer, torch.randn(24, 8, generator=gen, dtype=DT))
    assert layer.dispatcher.check_drops() == 0


def test_expert_numel_counts_biases():
    plain = _layer(num_spare_experts_per_ep_rank=1)
    biased = _layer(num_spare_experts_per_ep_rank=1, add_bias_linear=True)
    assert biased.experts.expert_numel == plain.experts.expert_numel + 2 * 6 + 8
    assert len(biased.experts.expert_params()) == 4


# -------------------------------------------------------------------------------------------------- errors --
@pytest.mark.parametrize("kw, match", [
    (dict(activation="tanh"), "activation"),
    (dict(activation="clamped_swiglu", swiglu_limit=0), "swiglu_limit"),
    (dict(swiglu_alpha=float("nan")), "swiglu_alpha"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(shared_expert_combine="mean"), "shared_expert_combine"),
    (dict(group_score_topk=2), "group_score_topk needs"),
    (dict(shared_expert_activation="swiglu"), "shared_expert_activation needs shared_expert_ffn_size"),
    (dict(shared_expert_ffn_size=4, shared_expert_activation="tanh"), "activation must be"),
    (dict(shared_expert_ffn_size=4, shared_expert_swiglu_limit=-1.0), "swiglu_limit"),
    (dict(shared_expert_ffn_size=4, shared_expert_bias="yes"), "shared_expert_bias"),
    (dict(router_norm_eps=-1.0), "router_norm_eps"),
    (dict(latent_size=0), "latent_size"),
    (dict(latent_bias=True), "latent_bias needs latent_size"),
    (dict(num_groups=2, group_topk=1, group_score_topk=5), "group_score_topk must"),
    (dict(num_groups=2, group_topk=1, group_score_topk=True), "group_score_topk must"),
    (dict(score_func="softplus"), "score_func"),
    (dict(hash_vocab_size=0), "hash_vocab_size"),
    (dict(hash_vocab_size=8, enable_expert_bias=True), "hash routing"),
    (dict(logit_softcap=-1.0), "logit_softcap"),
    (dict(num_zero_experts=-1), "num_zero_experts"),
    (dict(num_zero_experts=2, num_groups=2, group_topk=1), "num_zero_experts"),
    (dict(num_zero_experts=2, aux_loss_coeff=0.1, aux_loss_type="global"), "num_zero_experts"),
    (dict(output_norm="layernorm"), "output_norm"),
    (dict(group_masked_score=0.0), "group_masked_score needs"),
    (dict(num_scored_shared_experts=2), "num_scored_shared_experts must"),
    (dict(num_scored_shared_experts=1, score_func="softmax"), "num_scored_shared_experts needs"),
    (dict(num_groups=2, group_topk=1, group_masked_score=float("nan")), "group_masked_score must"),
    (dict(output_norm="rmsnorm", output_norm_eps=0), "output_norm_eps"),
    (dict(router_logit_multiplier=0.0), "router_logit_multiplier"),
    (dict(router_logit_multiplier=float("inf")), "router_logit_multiplier"),
    (dict(expert_input_norm="rmsnorm"), "expert_input_norm must"),
    (dict(expert_output_norm="centered_rmsnorm"), "expert_output_norm must"),
    (dict(expert_output_norm="scaled_rmsnorm", expert_output_norm_eps=-1.0), "expert_output_norm_eps"),
    (dict(expert_input_norm="centered_rmsnorm", expert_input_norm_eps=True), "expert_input_norm_eps"),
    (dict(expert_output_norm="scaled_rmsnorm", probs_on_input=True), "expert_output_norm cannot"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(8, 6, 8, 2, **kw)


# ---------------------------------------------------------------------------------------------- EP=2 gloo --
def test_options_ep2_echo():
    """Two EP ranks on gloo, echo (one spare slot per rank), the new router and expert options, plain and fused
    main_grad: each rank's output, input gradient and home-expert gradients against the reference on all tokens."""
    results = run_distributed(option_layer_ep_worker, 2, 3)
    for res in results:
        for case, errs in res["errors"].items():
            for what, err in errs.items():
                assert err < 1e-10, (case, what, err)
    assert sum(res["spare_rows"] for res in results) > 0  # rank 1's spare slot hosted a hot expert of rank 0


def test_new_router_options_ep2_echo():
    """Zero-computation experts (with soft-capped logits and the output RMSNorm), hash routing by token id
    (sqrtsoftplus), router-scored shared experts (Inkling) and Muse-Spark's norms around latent experts on two EP ranks with echo, plain and fused main_grad, against the reference on all tokens."""
    results = run_distributed(option_layer_ep_worker, 2, 5, ("zero_softcap_norm", "hash_sqrtsoftplus", "scored_shared",
                                                             "muse_norms"))
    for res in results:
        assert len(res["errors"]) == 8
        for case, errs in res["errors"].items():
            for what, err in errs.items():
                assert err < 1e-10, (case, what, err)
    assert sum(res["spare_rows"] for res in results) > 0


@pytest.mark.parametrize("score_func,norm,scale", [("sigmoid", True, 2.5), ("sigmoid", True, None),
                                                   ("softmax", True, 2.5), ("softmax", False, 2.5),
                                                   ("sigmoid", False, None)])
def test_router_probabilities_gradcheck(gen, score_func, norm, scale):
    """The router's probabilities (renormalized and scaled in one op, or the softmax of the top-k logits) against
    finite differences of the input and the gate weight (float64; the selection is constant near the point)."""
    torch.manual_seed(0)
    r = TopKRouter(6, 8, 3, score_func, norm, device="cpu", dtype=DT, scaling_factor=scale)
    x = torch.randn(5, 6, generator=gen, dtype=DT, requires_grad=True)
    w = r.weight.detach().clone().requires_grad_()

    def probs(x_, w_):
        return torch.func.functional_call(r, {"weight": w_}, (x_,)).probs

    assert torch.autograd.gradcheck(probs, (x, w))
    idx, top, _ = reference_route(x.detach(), w.detach(), 3, score_func, norm, scaling_factor=scale)
    routing = r(x.detach())
    assert torch.equal(routing.indices, idx)
    torch.testing.assert_close(routing.probs, top, **TOL)


ISSUE33_LAYER_OPTIONS = {  # the block options of the transformers families beyond the router sets above
    "activations_shared": dict(activation="softcapped_swiglu", swiglu_limit=0.8, swiglu_alpha=0.6,
                               shared_expert_ffn_size=5, shared_expert_activation="post_clamped_swiglu",
                               shared_expert_swiglu_limit=0.5, shared_expert_bias=True),
    "probs_on_input": dict(probs_on_input=True, output_bias=True, score_func="sigmoid", norm_topk_prob=False,
                           select_on="logits", shared_expert_ffn_size=5, shared_expert_combine="average"),
    "latent_squared_relu": dict(latent_size=6, latent_bias=True, activation="squared_relu", shared_expert_ffn_size=5,
                                shared_expert_bias=True, score_func="sigmoid"),
    "expert_norms": dict(latent_size=6, score_func="sigmoid", enable_expert_bias=True, router_logit_multiplier=0.3,
                         F=4, expert_input_norm="centered_rmsnorm", expert_output_norm="scaled_rmsnorm"),
    "gemma4_router": dict(router_input_norm=True, router_expert_scale=True, norm_topk_prob=True,
                          activation="geglu_tanh"),
}


@pytest.mark.parametrize("name", list(ROUTER_OPTION_SETS) + list(ISSUE33_LAYER_OPTIONS))
def test_options_have_no_data_dependent_ops(name):
    """CPU proxy for "sync-free and capturable": every router and block option set, with an echo spare slot and a
    static capacity that drops routes, forward and backward under FakeTensorMode (where .item(), nonzero(),
    boolean-mask indexing and data-dependent shapes raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    extra = dict(num_spare_experts_per_ep_rank=1, capacity_factor=1.0, aux_loss_coeff=0.01)
    layer = _option_layer(name, **extra) if name in ROUTER_OPTION_SETS else _layer(**ISSUE33_LAYER_OPTIONS[name],
                                                                                   **extra)
    layer.train()
    ids = torch.randint(0, 16, (32,))
    layer(torch.randn(32, 8, dtype=DT), token_ids=ids)  # lazy state outside the checked region
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(32, 8, dtype=DT, requires_grad=True)
        y = layer(x, token_ids=ids)
        y.sum().backward()
        assert y.shape == (32, 8)
