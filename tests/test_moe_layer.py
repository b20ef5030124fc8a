"""MoELayer against a dense reference (every token through its top-k experts in a Python loop): outputs and
gradients of the input, router and expert weights, with and without echo, with counted capacity drops; multi-process
expert parallelism on gloo; no host syncs on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from conftest import full_only, requires_cuda
from helpers.moe_workers import moe_layer_checks_worker, moe_layer_ddp_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.router import router_aux_loss, routing_map
from moe_graph.testing.moe_reference import dense_moe_reference, kept_routes, reference_aux_loss, reference_route

DT = torch.float64


def _layer(activation="swiglu", score_func="softmax", k=0, cf=None, aux=0.0, E=6, K=2, H=8, F=10, **router_kw):
    torch.manual_seed(0)
    layer = MoELayer(H, F, E, K, activation=activation, score_func=score_func, num_spare_experts_per_ep_rank=k,
                     capacity_factor=cf, aux_loss_coeff=aux, device="cpu", params_dtype=DT, init_std=0.3,
                     **router_kw)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    return layer


def _reference(layer, x, target, keep_fn=None, aux=0.0):
    w1 = layer.experts.fc1.weight.detach().clone().requires_grad_()
    w2 = layer.experts.fc2.weight.detach().clone().requires_grad_()
    gate = layer.router.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    r = layer.router
    idx, p, scores = reference_route(xr, gate, layer.topk, r.score_func, r.norm_topk_prob, num_groups=r.num_groups,
                                     group_topk=r.group_topk, scaling_factor=r.scaling_factor,
                                     expert_bias=r.expert_bias if r.enable_expert_bias else None)
    keep = keep_fn(idx, p.detach()) if keep_fn is not None else None
    y = dense_moe_reference(xr, idx, p, w1, w2, layer.experts.activation, keep)
    shared = {}
    if layer.shared_expert is not None:  # every token through the shared MLP, one at a time
        shared = {k: m.weight.detach().clone().requires_grad_() for k, m in layer.shared_expert.named_children()}
        rows = []
        for t in range(xr.shape[0]):
            a = shared["fc1"] @ xr[t]
            a = F.silu(a[: a.shape[0] // 2]) * a[a.shape[0] // 2:] if layer.experts.activation == "swiglu" else F.gelu(a)
            o = shared["fc2"] @ a
            rows.append(o * torch.sigmoid(shared["gate"] @ xr[t]) if "gate" in shared else o)
        y = y + torch.stack(rows)
    loss = (y * target).sum()
    if aux:
        loss = loss + aux * reference_aux_loss(scores, idx, layer.num_experts, r.score_func)
    loss.backward()
    return y.detach(), xr.grad, gate.grad, w1.grad, w2.grad, {k: w.grad for k, w in shared.items()}


def _check(layer, x, target, keep_fn=None, aux=0.0):
    xl = x.clone().requires_grad_()
    y = layer(xl)
    (y * target).sum().backward()
    y_ref, gx, gg, g1, g2, g_shared = _reference(layer, x, target, keep_fn, aux)
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y.detach(), y_ref, **tol)
    torch.testing.assert_close(xl.grad, gx, **tol)
    torch.testing.assert_close(layer.router.weight.grad, gg, **tol)
    torch.testing.assert_close(layer.experts.fc1.weight.grad, g1, **tol)
    torch.testing.assert_close(layer.experts.fc2.weight.grad, g2, **tol)
    for k, g in g_shared.items():
        torch.testing.assert_close(getattr(layer.shared_expert, k).weight.grad, g, **tol)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_matches_dense_reference(gen, activation, score_func):
    layer = _layer(activation, score_func)
    x = torch.randn(20, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(20, 8, generator=gen, dtype=DT))
    assert layer.dispatcher.check_drops() == 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_gradient_flows_through_output(gen, score_func):
    layer = _layer(score_func=score_func, aux=0.05)
    x = torch.randn(16, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(16, 8, generator=gen, dtype=DT), aux=0.05)
    idx, _, scores = reference_route(x, layer.router.weight.detach(), 2, score_func)
    ref = 0.05 * reference_aux_loss(scores, idx, 6, score_func)
    torch.testing.assert_close(layer.last_aux_loss, ref)
    assert 0.05 * 0.5 < float(layer.last_aux_loss) < 0.05 * 6  # O(1) times the coefficient for both score functions
    # perfectly balanced routing gives 1.0
    s = torch.full((4, 4), 0.25, dtype=DT)
    m = torch.eye(4, dtype=torch.bool)
    assert float(router_aux_loss(s, m, 1)) == pytest.approx(1.0)


def test_echo_single_rank_is_a_no_op(gen):
    layer = _layer(k=1)  # one rank: no other rank to offload to; the spare slot stays empty
    x = torch.randn(12, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(12, 8, generator=gen, dtype=DT))
    assert layer.last_load_after.tolist() == layer.last_load_before.tolist() == [24]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_match_reference_and_are_counted(gen, policy):
    T, K, cf = 15, 2, 0.6
    layer = _layer(cf=cf)
    layer.dispatcher.drop_policy = policy
    cap = 18  # ceil(0.6 * 15 * 2 / 1)
    x = torch.randn(T, 8, generator=gen, dtype=DT)
    # the layer walks each token's routes in the router's order, best first (reference_route's order too)
    keep_fn = lambda idx, p: kept_routes(idx, torch.zeros(6, dtype=torch.int64), cap,  # noqa: E731
                                         probs=p if policy == "probs" else None)
    _check(layer, x, torch.randn(T, 8, generator=gen, dtype=DT), keep_fn)
    assert layer.dispatcher.capacity == cap
    assert layer.dispatcher.check_drops() == T * K - cap


def test_statistics_are_buffers_written_in_place(gen):
    # last_* are device buffers written in place: references taken once (e.g. by a reader set up before a graph
    # was captured) see every later forward; values match the router written out independently.
    layer = _layer(aux=0.05, E=6, K=2)
    layer.router_loss.z_loss_coeff = 0.01
    stats = layer.statistics()
    assert set(stats) == {"dropped_routes", "tokens_per_expert", "load_before", "load_after", "m_splits",
                          "aux_loss", "z_loss"}
    assert stats["tokens_per_expert"] is layer.last_tokens_per_expert
    assert {n for n, _ in layer.named_buffers()} >= {"last_aux_loss", "last_z_loss", "last_load_before",
                                                      "last_tokens_per_expert", "last_m_splits"}
    assert stats["load_after"] is layer.last_load_after is layer.last_load_before  # no echo: no other load
    assert "last_load_after_echo" in {n for n, _ in _layer(k=1).named_buffers()}
    assert not any(k.startswith("last_") for k in layer.state_dict())  # statistics are not checkpoint state
    for step in range(3):
        x = torch.randn(10 + step, 8, generator=gen, dtype=DT)
        layer(x).sum().backward()
        now = layer.statistics()
        assert all(now[k] is stats[k] for k in stats), "a statistic was replaced instead of written in place"
        idx, _, scores = reference_route(x, layer.router.weight.detach(), 2, "softmax")
        counts = torch.bincount(idx.reshape(-1), minlength=6)
        assert stats["tokens_per_expert"].tolist() == counts.tolist()
        assert stats["load_before"].tolist() == stats["load_after"].tolist() == [2 * x.shape[0]]
        assert stats["m_splits"].tolist() == counts.tolist()
        torch.testing.assert_close(stats["aux_loss"], 0.05 * reference_aux_loss(scores, idx, 6, "softmax"))
        logits = x @ layer.router.weight.detach().t()
        torch.testing.assert_close(stats["z_loss"], 0.01 * torch.logsumexp(logits, -1).square().mean())


def test_drops_are_statistics_not_errors(gen):
    # With a capacity factor, drops are normal: check_errors() stays quiet, the per-layer drop counters (stacked by
    # moe_statistics on the device, read once by read_moe_statistics) equal the reference count, reset zeroes them.
    from moe_graph.moe.layer import moe_statistics, read_moe_statistics
    from moe_graph.ops import check_errors

    T, K, cap = 15, 2, 18
    model = torch.nn.Sequential(_layer(cf=0.6), _layer(cf=None))
    x = torch.randn(T, 8, generator=gen, dtype=DT)
    for _ in range(2):
        model(x).sum().backward()
    check_errors("cpu")  # drops are not errors
    st = moe_statistics(model)
    assert st["dropped_routes"].tolist() == [2 * (T * K - cap), 0]
    assert st["tokens_per_expert"].shape == (2, 6) and st["load_before"].shape == (2, 1)
    host = read_moe_statistics(model, reset=True)
    assert host["dropped_routes"] == [2 * (T * K - cap), 0]
    assert host["tokens_per_expert"] == st["tokens_per_expert"].tolist()
    assert host["m_splits"][0] == model[0].last_m_splits.tolist() and sum(host["m_splits"][0]) == cap
    assert isinstance(host["aux_loss"][0], float) and isinstance(host["dropped_routes"][0], int)
    assert read_moe_statistics(model)["dropped_routes"] == [0, 0]
    with pytest.raises(ValueError, match="contains no MoELayer"):
        moe_statistics(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("k,cf,policy", [(0, None, "probs"), (0, 0.6, "probs"), (0, 0.6, "position"),
                                          (1, None, "probs")])
def test_probabilities_on_the_narrow_side_match_dense_reference(gen, k, cf, policy):
    # F < H: the routing probabilities scale each expert row's activation before fc2 (row_weights) and combine
    # sums plainly; outputs and gradients (the router's through the row weights) equal the dense reference, also
    # with capacity drops and with echo
    T, K = 15, 2
    layer = _layer(k=k, cf=cf, H=8, F=4)
    layer.dispatcher.drop_policy = policy
    assert layer.scale_rows and not _layer(H=8, F=10).scale_rows
    keep_fn = None
    if cf is not None:
        cap = layer.dispatcher.capacity = 18  # ceil(0.6 * 15 * 2 / 1)
        keep_fn = lambda idx, p: kept_routes(idx, torch.zeros(6, dtype=torch.int64), cap,  # noqa: E731
                                             probs=p if policy == "probs" else None)
    x = torch.randn(T, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(T, 8, generator=gen, dtype=DT), keep_fn)
    assert layer.dispatcher.check_drops() == (0 if cf is None else T * K - 18)


def test_input_shape_error():
    layer = _layer()
    with pytest.raises(ValueError, match="hidden_size=8"):
        layer(torch.randn(3, 5, dtype=DT))
    with pytest.raises(ValueError, match="activation"):
        MoELayer(8, 8, 4, 2, activation="tanh", device="cpu")
    with pytest.raises(ValueError, match="divisible"):
        MoELayer(8, 8, 6, 2, ep_size=4, device="cpu")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        MoELayer(8, 8, 8, 2, ep_size=4, device="cpu")


def test_multiprocess_with_and_without_echo():
    res = run_distributed(moe_layer_checks_worker, 2, 3)
    for r in res:
        for case in ("no_echo", "echo", "echo_cap"):
            c = r[case]
            for key in ("y_err", "gx_err", "gw1_err", "gw2_err", "ggate_err", "aux_err"):
                assert c[key] < 1e-12, (case, key, c[key])
            assert c["dropped"] == 0, case
        assert r["no_echo"]["load_before"] == r["no_echo"]["load_after"]
        before, after = r["echo"]["load_before"], r["echo"]["load_after"]
        assert sum(before) == sum(after) and max(after) < max(before)  # echo balanced the skewed load
    recv = [r["echo"]["recv"] for r in res]
    assert recv == res[0]["echo"]["load_after"]  # what each rank received is what the plan says
    drops_no_echo = sum(r["drops"][0] for r in res)
    drops_echo = sum(r["drops"][1] for r in res)
    assert drops_no_echo > 0 and drops_echo < drops_no_echo


@pytest.mark.parametrize("k", [0, 1])
def test_main_grad_fused_path_single_process(gen, k):
    """Expert weights with ``main_grad``: the wgrad goes into main_grad (accumulating over microbatches), the
    weights' .grad is a zero tensor and ``grad_added_to_main_grad`` is set; same numbers as plain autograd."""
    layer = _layer(k=k)
    xs = [torch.randn(12, 8, generator=gen, dtype=DT) for _ in range(2)]
    ts = [torch.randn(12, 8, generator=gen, dtype=DT) for _ in range(2)]
    for x, t in zip(xs, ts):
        (layer(x) * t).sum().backward()
    g1, g2 = layer.experts.fc1.weight.grad.clone(), layer.experts.fc2.weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    for w in layer.experts.weights():
        w.main_grad = torch.full_like(w, 0.5)
        w.grad_added_to_main_grad = False
    for x, t in zip(xs, ts):
        (layer(x) * t).sum().backward()
    for w, g in zip(layer.experts.weights(), (g1, g2)):
        torch.testing.assert_close(w.main_grad, g + 0.5, rtol=1e-12, atol=1e-12)
        assert w.grad_added_to_main_grad and not w.grad.any()


@pytest.mark.parametrize("world", [2, *full_only(4)])  # 4 ranks with echo in CI: test_echo_donors_gloo[4]
def test_ddp_fused_wgrad_with_echo_multiprocess(world):
    """DDP-wrapped MoE layers, EP = world, k = 0/1/2 under skewed routing: the home experts' main_grad equals the
    layer without echo and the dense reference, after one microbatch and accumulated over two (with the bucket
    reductions launched from the grad hooks), and spare slots really computed tokens."""
    res = run_distributed(moe_layer_ddp_worker, world, 5)
    for k in (0, 1, 2):
        for r in res:
            c = r[k]
            assert c["fused"] and c["grad_none"], (k, c)
            for key in ("mb1_plain_err", "mb1_dense_err", "mb1_router_err", "mb2_plain_err", "mb2_dense_err"):
                assert c[key] < 1e-10, (world, k, key, c[key])
        if k:
            assert sum(r[k]["moved"] for r in res) > 0, "no tokens were offloaded to spare slots"
            assert any(r[k]["spare_changed"] for r in res)
        else:
            assert sum(r[k]["moved"] for r in res) == 0


_DEEPSEEK_ROUTER = dict(score_func="sigmoid", num_groups=4, group_topk=2, topk_scaling_factor=2.5,
                       enable_expert_bias=True, z_loss_coeff=1e-3)


@requires_cuda
@pytest.mark.parametrize("k,router_kw", [(0, {}), (1, {}), (1, _DEEPSEEK_ROUTER)])
def test_cuda_forward_backward_no_host_sync(k, router_kw):
    from moe_graph.moe.router import update_expert_bias

    torch.manual_seed(0)
    layer = MoELayer(64, 128, 8, 2, num_spare_experts_per_ep_rank=k, capacity_factor=1.5, aux_loss_coeff=0.01,
                     device="cuda", params_dtype=torch.bfloat16, **router_kw)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()  # warm-up (lazy buffers)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            update_expert_bias(layer)  # (no-op without expert bias) before the forward, so y sees the final bias
            y = layer(x)
            y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # against the fp32 CPU reference of the same weights (and expert bias)
    ref = MoELayer(64, 128, 8, 2, device="cpu", params_dtype=torch.float32, **router_kw)
    ref.load_state_dict({k_: v.float().cpu() for k_, v in layer.state_dict().items()}, strict=False)
    y_ref = ref(x.detach().float().cpu())
    # bf16 router logits can flip a near-tie in the top-k: compare the tokens routed the same way in both
    with torch.no_grad():
        same = (layer.router(x.detach()).indices.cpu() == ref.router(x.detach().float().cpu()).indices).all(1)
    assert float(same.float().mean()) > 0.9
    torch.testing.assert_close(y.float().cpu()[same], y_ref.detach()[same], rtol=5e-2,
                               atol=3e-2 * float(y_ref.abs().max()))


def _native_best_fit():
    try:
        from moe_graph.ops.reroute import best_fit_available

        return bool(best_fit_available("cpu"))
    except (ImportError, AttributeError, RuntimeError):
        return False


def test_best_fit_torch_fallback_has_no_data_dependent_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_graph.moe.echo_planner import best_fit_assignment

    counts = torch.randint(0, 100, (4, 8))
    expect = best_fit_assignment(counts, 2, native=False)
    if _native_best_fit():
        assert torch.equal(expect, best_fit_assignment(counts, 2, native=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = best_fit_assignment(counts, 2, native=False)
        assert out.shape == (8, 8)


@pytest.mark.parametrize("k,assignment,main_grad", [(0, "auto", False), (1, "greedy", False), (2, "auto", False),
                                                    (0, "auto", True), (2, "auto", True)])
def test_hot_path_has_no_data_dependent_ops(k, assignment, main_grad):
    """CPU proxy for "no host syncs": forward and backward under FakeTensorMode, where .item(), nonzero(),
    boolean-mask indexing and data-dependent shapes raise. ``main_grad``: the fused weight-gradient path (masked
    wgrad into main_grad + spare buffers, spare-gradient aggregation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=k, assignment=assignment, capacity_factor=1.0,
                     aux_loss_coeff=0.01, device="cpu")
    if main_grad:
        for w in layer.experts.weights():
            w.main_grad = torch.zeros_like(w)
        layer(torch.randn(4, 16)).sum().backward()  # static mask / spare buffers built outside the checked region
        assert layer.experts.fc1.weight.grad_added_to_main_grad
    layer(torch.randn(4, 16))  # lazy state (drop counter, column tables) outside the checked region
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(32, 16, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert y.shape == (32, 16)
    # the check can fail: a host read is caught
    with pytest.raises(Exception, match="local_scalar_dense|DataDependent"):
        with FakeTensorMode(allow_non_fake_inputs=True):
            bool(layer(torch.randn(8, 16)).sum() > 0)


# ----------------------------------------------------------------------------------- router options (DeepSeek-V3) --
def _as_sets(idx):
    return [sorted(r) for r in idx.tolist()]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_routing_matches_per_token_reference(gen, score_func):
    from moe_graph.moe.router import TopKRouter

    E, G, gk, K, H = 16, 4, 2, 4, 12
    router = TopKRouter(H, E, K, score_func, device="cpu", dtype=DT, num_groups=G, group_topk=gk, scaling_factor=2.5)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
    x = torch.randn(64, H, generator=gen, dtype=DT)
    r = router(x)
    idx, top, _ = reference_route(x, router.weight.detach(), K, score_func, num_groups=G, group_topk=gk,
                                  scaling_factor=2.5)
    assert torch.equal(r.indices, idx)  # the same experts, best first
    torch.testing.assert_close(r.probs, top, rtol=1e-12, atol=1e-12)
    assert r.counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    rmap = routing_map(r.indices, E)
    assert torch.equal(rmap, torch.zeros(64, E, dtype=torch.bool).scatter_(1, idx, True))
    # every token's experts lie in at most group_topk groups, and the limit changes the routing of some tokens
    assert int((rmap.view(64, G, E // G).any(-1).sum(-1) > gk).sum()) == 0
    free = TopKRouter(H, E, K, score_func, device="cpu", dtype=DT)
    free.load_state_dict(router.state_dict())
    assert not torch.equal(routing_map(free(x).indices, E), rmap)
    if score_func == "sigmoid":
        torch.testing.assert_close(r.probs.sum(-1), torch.full((64,), 2.5, dtype=DT))


def test_layer_with_deepseek_router_options_matches_dense_reference(gen):
    # group-limited routing, scaled probabilities and a non-zero expert bias, end to end with gradients
    layer = _layer(score_func="sigmoid", E=8, K=3, num_groups=4, group_topk=2, topk_scaling_factor=2.5,
                   enable_expert_bias=True)
    layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(24, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(24, 8, generator=gen, dtype=DT))


@pytest.mark.parametrize("activation,gate", [("swiglu", False), ("gelu", True), ("swiglu", True)])
def test_shared_expert_matches_dense_reference(gen, activation, gate):
    layer = _layer(activation, k=1, cf=1.0, shared_expert_ffn_size=12, shared_expert_gate=gate)
    names = [n for n, _ in layer.named_parameters() if n.startswith("shared_expert")]
    assert names == ["shared_expert.fc1.weight", "shared_expert.fc2.weight"] + (["shared_expert.gate.weight"] if gate else [])
    assert all(getattr(p, "allreduce", True) for n, p in layer.named_parameters() if n in names)  # dense params
    x = torch.randn(20, 8, generator=gen, dtype=DT)
    _check(layer, x, torch.randn(20, 8, generator=gen, dtype=DT),
           keep_fn=lambda idx, p: kept_routes(idx, torch.zeros(6, dtype=torch.int64), layer.dispatcher.capacity,
                                              probs=p))
    with pytest.raises(ValueError, match="shared_expert_gate needs"):
        MoELayer(8, 8, 4, 2, shared_expert_gate=True, device="cpu")


def test_router_option_errors():
    from moe_graph.moe.router import TopKRouter

    with pytest.raises(ValueError, match="go together"):
        TopKRouter(8, 16, 4, num_groups=4)
    with pytest.raises(ValueError, match="must divide"):
        TopKRouter(8, 16, 4, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="group_topk must be in"):
        TopKRouter(8, 16, 4, num_groups=4, group_topk=5)
    with pytest.raises(ValueError, match="topk=9 must be in"):
        TopKRouter(8, 16, 9, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="select_on must be"):
        TopKRouter(8, 16, 4, enable_expert_bias=True, select_on="probs")


def test_expert_bias_steers_selection_not_probabilities(gen):
    from moe_graph.moe.router import TopKRouter

    E, K, H = 8, 2, 6
    router = TopKRouter(H, E, K, "sigmoid", device="cpu", dtype=DT, enable_expert_bias=True)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
        router.expert_bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 0, -5.0, 0]))
    x = torch.randn(40, H, generator=gen, dtype=DT, requires_grad=True)
    r = router(x)
    rmap = routing_map(r.indices, E)
    assert bool(rmap[:, 3].all()) and not bool(rmap[:, 6].any())
    idx, top, _ = reference_route(x, router.weight, K, "sigmoid", expert_bias=router.expert_bias)
    assert torch.equal(r.indices, idx)
    torch.testing.assert_close(r.probs, top)  # unbiased scores
    r.probs.sum().backward()
    assert x.grad is not None and router.weight.grad is not None  # the bias is not a differentiable input
    assert torch.equal(router.local_tokens_per_expert, rmap.sum(0).float())
    router.eval()
    router(x)  # counts only in training mode
    assert torch.equal(router.local_tokens_per_expert, rmap.sum(0).float())


def test_update_expert_bias_sign_rule_and_reset():
    from moe_graph.moe.router import update_expert_bias

    layer = MoELayer(8, 8, 4, 1, score_func="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.01,
                     device="cpu")
    r = layer.router
    r.local_tokens_per_expert.copy_(torch.tensor([3.0, 1.0, 2.0, 6.0]))  # mean 3
    r.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    update_expert_bias(layer)
    torch.testing.assert_close(r.expert_bias, torch.tensor([0.5, 0.01, 0.01, -0.01]))
    assert torch.count_nonzero(r.local_tokens_per_expert) == 0
    assert "router.expert_bias" in layer.state_dict() and "router.local_tokens_per_expert" not in layer.state_dict()


def test_aux_loss_free_balancing_reduces_imbalance(gen):
    # Skewed gate: a few experts win most tokens. Repeated bias updates (no gradient step) must even out the load.
    from moe_graph.moe.router import TopKRouter, update_expert_bias

    E, K, H, T = 16, 2, 32, 2048
    router = TopKRouter(H, E, K, "sigmoid", device="cpu", enable_expert_bias=True, expert_bias_update_rate=2e-3)
    with torch.no_grad():
        router.weight.normal_(0, 0.15, generator=gen)  # unsaturated sigmoid scores, as in a trained router
        router.weight[:3] += 0.1 * router.weight[:3].sign()  # make the first experts popular
    x = torch.randn(T, H, generator=gen)

    def imbalance():
        with torch.no_grad():
            load = routing_map(router(x).indices, E).sum(0).float()
        return float(load.max() / load.mean())

    before = imbalance()
    for _ in range(100):
        router(x)
        update_expert_bias(router)
    after = imbalance()
    assert before > 1.5 and after < 1.1, (before, after)
    assert float(router.expert_bias[:3].max()) < 0 < float(router.expert_bias[3:].max())  # popular experts pushed down


def test_z_loss_gradient_flows_through_output(gen):
    from moe_graph.moe.router import router_z_loss

    layer = _layer(E=6, K=2)
    layer.router_loss.z_loss_coeff = 0.1
    x = torch.randn(12, 8, generator=gen, dtype=DT)
    target = torch.randn(12, 8, generator=gen, dtype=DT)
    layer(x).mul(target).sum().backward()
    g_with = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    layer.router_loss.z_loss_coeff = 0.0
    layer(x).mul(target).sum().backward()
    gate = layer.router.weight.detach().clone().requires_grad_()
    (0.1 * router_z_loss(x @ gate.t())).backward()
    torch.testing.assert_close(g_with - layer.router.weight.grad, gate.grad, rtol=1e-10, atol=1e-12)
    assert layer.last_z_loss is not None


@pytest.mark.parametrize("world", [2])
def test_update_expert_bias_is_identical_across_ranks(world):
    from helpers.moe_workers import expert_bias_worker

    res = run_distributed(expert_bias_worker, world)
    assert all(torch.equal(res[0]["bias"], r["bias"]) for r in res)
    torch.testing.assert_close(res[0]["bias"], res[0]["expect"])


def test_router_options_have_no_data_dependent_ops():
    """CPU proxy for "no host syncs" (as above) with group-limited routing, expert bias, z-loss, a gated shared
    expert, a padding mask and the bias update: forward, backward and update_expert_bias under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_graph.moe.router import update_expert_bias

    layer = MoELayer(16, 24, 8, 2, score_func="sigmoid", num_groups=4, group_topk=2, topk_scaling_factor=2.0,
                     enable_expert_bias=True, z_loss_coeff=1e-3, aux_loss_coeff=1e-2,
                     num_spare_experts_per_ep_rank=1, capacity_factor=1.0, device="cpu", shared_expert_ffn_size=8,
                     shared_expert_gate=True)
    layer(torch.randn(4, 16))  # lazy state outside the checked region
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(32, 16, requires_grad=True)
        layer(x, padding_mask=torch.arange(32) >= 28).sum().backward()
        update_expert_bias(layer)


def test_global_aux_loss_uses_the_ep_groups_counts():
    from helpers.moe_workers import global_aux_loss_worker

    for r in run_distributed(global_aux_loss_worker, 2):
        assert r["aux"] == pytest.approx(r["ref"], rel=1e-12)
        assert r["grad_err"] < 1e-12 and r["grad_norm"] > 1e-3
        assert r["local_f_differs"]  # the global fractions are not this rank's own
    with pytest.raises(ValueError, match="aux_loss_type"):
        MoELayer(8, 8, 4, 2, aux_loss_type="per_token", device="cpu")


@pytest.mark.parametrize("sequence_dim", [0, 1])
def test_sequence_aux_loss_matches_per_sequence_reference(gen, sequence_dim):
    from moe_graph.moe.router import sequence_aux_loss

    B, S, E, K = 3, 7, 6, 2
    layer = _layer(score_func="sigmoid", E=E, K=K)
    loss = layer.router_loss
    loss.aux_loss_coeff, loss.aux_loss_type, loss.sequence_dim = 0.1, "sequence", sequence_dim
    x = torch.randn(B, S, 8, generator=gen, dtype=DT)
    xin = x if sequence_dim == 1 else x.transpose(0, 1).contiguous()
    gate = layer.router.weight.detach().clone().requires_grad_()
    layer(xin).mul(0).sum().backward()  # only the aux loss reaches the router weight
    ref = 0
    for b in range(B):  # one sequence at a time
        idx, _, scores = reference_route(x[b], gate, K, "sigmoid")
        p = scores / scores.sum(-1, keepdim=True)
        counts = torch.zeros(E, dtype=DT).scatter_add_(0, idx.reshape(-1), torch.ones(S * K, dtype=DT))
        ref = ref + (counts * E / (S * K) * p.mean(0)).sum() / B
    ref = 0.1 * ref
    ref.backward()
    torch.testing.assert_close(layer.last_aux_loss, ref.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.router.weight.grad, gate.grad, rtol=1e-10, atol=1e-13)
    # perfect balance within every sequence gives 1.0
    m = torch.eye(4, dtype=torch.bool).expand(2, 4, 4)
    assert float(sequence_aux_loss(torch.full((2, 4, 4), 0.25, dtype=DT), m, 1)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs a \\[B, S, H\\]"):
        layer(torch.randn(5, 8, dtype=DT))
    with pytest.raises(ValueError, match="aux_loss_type"):
        MoELayer(8, 8, 4, 2, aux_loss_type="batch", device="cpu")


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recomputation_counts_once(gen, reentrant):
    # torch.utils.checkpoint re-runs the forward inside backward: gradients equal the plain layer's, and the
    # cumulative device statistics (drop counter, expert-bias route counts) count every token once.
    from torch.utils.checkpoint import checkpoint

    kw = dict(score_func="sigmoid", enable_expert_bias=True, k=1, cf=0.6, aux=0.01)
    plain, ckpt = _layer(**kw), _layer(**kw)
    x = torch.randn(20, 8, generator=gen, dtype=DT)
    xp, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xp).square().sum().backward()
    checkpoint(ckpt, xc, use_reentrant=reentrant).square().sum().backward()
    torch.testing.assert_close(xc.grad, xp.grad, rtol=0, atol=0)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert plain.dispatcher.check_drops() == ckpt.dispatcher.check_drops() > 0
    assert torch.equal(plain.router.local_tokens_per_expert, ckpt.router.local_tokens_per_expert)


@pytest.mark.parametrize("aux_type", ["local", "sequence"])
def test_padding_mask_equals_running_on_the_real_tokens(gen, aux_type):
    # Padding tokens get no route and leave the losses, planner and expert-bias counts untouched: outputs,
    # gradients and statistics equal those of the real tokens alone (aux "local"; for "sequence" the per-sequence
    # reference below).
    B, S, H = 3, 6, 8
    kw = dict(score_func="sigmoid", enable_expert_bias=True, k=1, aux=0.05, E=6, K=2)
    masked, ref = _layer(**kw), _layer(**kw)
    for m in (masked, ref):
        m.router_loss.z_loss_coeff = 0.01
        m.router_loss.aux_loss_type = aux_type
    x = torch.randn(B, S, H, generator=gen, dtype=DT)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 1:] = True  # sequence 2 keeps a single real token
    target = torch.randn(B, S, H, generator=gen, dtype=DT)
    xm = x.clone().requires_grad_()
    ym = masked(xm, padding_mask=pad)
    (ym * target).sum().backward()
    assert torch.all(ym[pad] == 0) and torch.all(xm.grad[pad] == 0)
    if aux_type == "local":
        xr = x[~pad].clone().requires_grad_()  # [n, H]: the real tokens only
        yr = ref(xr)
        (yr * target[~pad]).sum().backward()
        torch.testing.assert_close(ym[~pad], yr, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(xm.grad[~pad], xr.grad, rtol=1e-10, atol=1e-12)
        for p, q in zip(masked.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(masked.last_aux_loss, ref.last_aux_loss)
        torch.testing.assert_close(masked.last_z_loss, ref.last_z_loss)
        assert torch.equal(masked.router.local_tokens_per_expert, ref.router.local_tokens_per_expert)
        assert torch.equal(masked.last_tokens_per_expert, ref.last_tokens_per_expert)
    else:  # one sequence at a time, real tokens only
        gate = masked.router.weight.detach()
        expect = 0
        for b in range(B):
            xs = x[b][~pad[b]]
            idx, _, scores = reference_route(xs, gate, 2, "sigmoid", expert_bias=masked.router.expert_bias)
            p = scores / scores.sum(-1, keepdim=True)
            counts = torch.zeros(6, dtype=DT).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=DT))
            expect = expect + (counts * 6 / (xs.shape[0] * 2) * p.mean(0)).sum() / B
        torch.testing.assert_close(masked.last_aux_loss, 0.05 * expect, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="padding_mask must have shape"):
        masked(x, padding_mask=pad.reshape(-1))


def test_torch_compile_matches_eager(gen):
    # torch.compile of the whole layer (router options, echo, padding): the eager outputs, gradients and counters.
    kw = dict(score_func="sigmoid", enable_expert_bias=True, k=1, cf=1.0, aux=0.01, E=8, K=2, num_groups=2,
              group_topk=1)
    eager, comp = _layer(**kw), _layer(**kw)
    compiled = torch.compile(comp, backend="aot_eager")
    x = torch.randn(2, 10, 8, generator=gen, dtype=DT)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 7:] = True
    for _ in range(2):
        ye, yc = eager(x, padding_mask=pad), compiled(x, padding_mask=pad)
        ye.square().sum().backward()
        yc.square().sum().backward()
        torch.testing.assert_close(yc, ye, rtol=1e-12, atol=1e-12)
    for p, q in zip(eager.parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(eager.router.local_tokens_per_expert, comp.router.local_tokens_per_expert)


def test_router_dtype_runs_the_gate_in_that_precision(gen):
    # bf16 input and weights: the default upcasts the bf16 GEMM's result; router_dtype=float64 computes the gate in
    # fp64 from the same bf16 values (the exact logits of those values).
    from moe_graph.moe.router import TopKRouter

    r64 = TopKRouter(16, 8, 2, device="cpu", dtype=torch.bfloat16, router_dtype=torch.float64)
    x = torch.randn(32, 16, generator=gen).bfloat16()
    r64(x)
    assert r64.last_logits.dtype == torch.float64
    exact = x.double() @ r64.weight.detach().double().t()
    torch.testing.assert_close(r64.last_logits.detach(), exact, rtol=0, atol=1e-12)
    r_def = TopKRouter(16, 8, 2, device="cpu", dtype=torch.bfloat16)
    r_def.load_state_dict(r64.state_dict())
    r_def(x)
    assert r_def.last_logits.dtype == torch.float32
    assert float((r_def.last_logits.detach().double() - exact).abs().max()) > 1e-6  # bf16 GEMM rounding
    with pytest.raises(ValueError, match="router_dtype"):
        TopKRouter(16, 8, 2, router_dtype=torch.float16)


def test_config_and_keywords_build_the_same_layer():
    # The keyword constructor and MoELayer.from_config(MoEConfig(...)) are one construction path: same parameters
    # (names, values with the same seed) and the same output; an unknown keyword names itself.
    from moe_graph.moe.config import MoEConfig

    kw = dict(num_spare_experts_per_ep_rank=1, aux_loss_coeff=0.01, shared_expert_ffn_size=6, capacity_factor=1.5)
    torch.manual_seed(3)
    a = MoELayer(8, 12, 4, 2, device="cpu", **kw)
    torch.manual_seed(3)
    b = MoELayer.from_config(MoEConfig(8, 12, 4, 2, **kw), device="cpu")
    assert a.config == b.config
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(pa) == list(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)
    x = torch.randn(5, 8)
    assert torch.equal(a(x), b(x))
    with pytest.raises(TypeError, match="num_spare_slots"):
        MoELayer(8, 12, 4, 2, device="cpu", num_spare_slots=1)
