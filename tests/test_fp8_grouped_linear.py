"""GroupedLinear under moe_graph.fp8.autocast (blockwise, MXFP8, per-tensor recipes) against an oracle written in
plain PyTorch from TE's reference quantizers (tests/helpers/fp8_reference.py): each operand quantized per expert
group as the recipe says, dequantized, multiplied in float64; the layer's forward, dgrad and wgrad equal it within
fp32 rounding. Weight caching across microbatches, fused main_grad, _extra_state round trip, TE recipe objects."""

import pytest
import torch

import moe_graph
from helpers import fp8_reference as ref
from moe_graph.ops import fp8

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without the FP8 ops")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


_deq = ref.dequantized
PLAN = {k: (v[0], v[1], v[3]) for k, v in ref.PLAN.items()}


def _oracle(x, w, dy, splits, recipe):
    """(y, dx, dw) in float64 from the dequantized operands."""
    rows, wt, cols = PLAN[recipe.kind]
    pow2, bd = recipe.power_2_scale, recipe.bwd_dtype
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    r = 0
    for e, m in enumerate(splits):
        xs, dys = x[r:r + m], dy[r:r + m]
        wq = _deq(w[e], wt, E4, pow2)
        wq_t = _deq(w[e], "32x1", E4, pow2) if recipe.kind == "mxfp8" else wq  # dgrad's columnwise weight copy
        y[r:r + m] = _deq(xs, rows, E4, pow2) @ wq.T
        dx[r:r + m] = _deq(dys, rows, bd, pow2) @ wq_t
        dw[e] = _deq(dys, cols, bd, pow2).T @ _deq(xs, cols, E4, pow2)
        r += m
    return y, dx, dw


def _close(got, want, scale_ref):
    tol = scale_ref * 300 * 2.0 ** -23 + 1e-30
    assert torch.all((got.double() - want).abs() <= tol), (got.double() - want).abs().max()


@pytest.mark.parametrize("recipe", [fp8.Float8BlockScaling(), fp8.MXFP8BlockScaling(), fp8.Float8CurrentScaling()],
                         ids=["blockwise", "mxfp8", "tensor"])
def test_grouped_linear_fp8_equals_oracle(recipe):
    torch.manual_seed(0)
    E, K, N = 3, 160, 96
    splits = [50, 0, 70]
    layer = moe_graph.GroupedLinear(E, K, N, bias=False, device="cpu", params_dtype=torch.float32)
    x = torch.randn(130, K, requires_grad=True)  # 10 capacity rows past the sum
    ms = torch.tensor(splits)
    with moe_graph.fp8.autocast(recipe=recipe):
        y = layer(x, ms)
    assert layer.fp8 and layer.fp8_meta["recipe"] == recipe
    dy = torch.randn_like(y)
    y.backward(dy)
    w = torch.stack([getattr(layer, f"weight{e}").detach() for e in range(E)])
    yo, dxo, dwo = _oracle(x.detach(), w, dy, splits, recipe)
    _close(y, yo, _oracle(x.detach().abs(), w.abs(), dy.abs(), splits, recipe)[0].abs() + yo.abs())
    _close(x.grad, dxo, dxo.abs().max())
    _close(torch.stack([getattr(layer, f"weight{e}").grad for e in range(E)]), dwo, dwo.abs().max())
    assert torch.equal(y[120:], torch.zeros(10, N)) and torch.equal(x.grad[120:], torch.zeros(10, K))
    assert torch.equal(layer.weight1.grad, torch.zeros(N, K))


def test_weight_cache_fused_main_grad_bias_and_extra_state():
    torch.manual_seed(1)
    layer = moe_graph.GroupedLinear(2, 64, 32, bias=True, device="cpu", params_dtype=torch.float32,
                                    fuse_wgrad_accumulation=True, single_grouped_weight=True)
    layer.weight.main_grad = torch.zeros(2, 32, 64)
    ms = torch.tensor([20, 12])
    x1, x2 = torch.randn(32, 64), torch.randn(32, 64)
    recipe = fp8.Float8BlockScaling()
    with moe_graph.fp8.autocast(recipe=recipe):
        y1 = layer(x1, ms, is_first_microbatch=True)
        y1.sum().backward()
        g1 = layer.weight.main_grad.clone()
        with torch.no_grad():
            layer.weight.mul_(2)  # not seen by the next microbatch: its weights come from the step's cache
        y2 = layer(x2, ms, is_first_microbatch=False)
        y2.sum().backward()
        y2_fresh = layer(x2, ms)  # None: quantized again
    assert layer.weight.grad_added_to_main_grad
    assert not torch.equal(y2, y2_fresh)
    with torch.no_grad():
        layer.weight.div_(2)
    with moe_graph.fp8.autocast(recipe=recipe):
        assert torch.equal(layer(x2, ms), y2)
    # main_grad: the first microbatch wrote, the second added (one fp32 add of its fp32 wgrad)
    qd, sd = fp8.quantize_columns(torch.ones(32, 32), ms, recipe, recipe.bwd_dtype)
    qx, sx = fp8.quantize_columns(x2, ms, recipe, recipe.fwd_dtype)
    dw2 = fp8.scaled_grouped_wgrad(qd, sd, qx, sx, ms, block_m=128)
    assert torch.equal(layer.weight.main_grad, g1 + dw2)
    assert torch.equal(layer.bias.grad, 2 * torch.stack([torch.full((32,), 20.0), torch.full((32,), 12.0)]))
    # _extra_state: the recipe round-trips through a state dict
    sd_ = layer.state_dict()
    assert sd_["_extra_state"].numel() > 0
    fresh = moe_graph.GroupedLinear(2, 64, 32, bias=True, device="cpu", params_dtype=torch.float32,
                                    single_grouped_weight=True)
    assert fresh.get_extra_state().numel() == 0
    fresh.load_state_dict(sd_)
    assert fresh.fp8_meta["recipe"] == recipe and torch.equal(fresh.get_extra_state(), sd_["_extra_state"])


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_accumulates_in_the_gemm(monkeypatch, mg_dtype, delay):
    """Fused delivery to a stacked weight with an fp32 main_grad: the FP8 wgrad GEMM writes (first microbatch) and
    then adds into main_grad itself (out=main_grad, no fp32 dw and no main_grad.add_); a bf16 main_grad takes the
    unfused delivery (a fresh fp32 dw, then one add). Either way main_grad equals the float64 oracle of the
    dequantized operands plus the prior main_grad, within fp32 rounding (bf16: its rounding)."""
    torch.manual_seed(7)
    E, K, N = 3, 64, 48
    recipe = fp8.Float8BlockScaling()
    layer = moe_graph.GroupedLinear(E, K, N, bias=False, device="cpu", params_dtype=torch.float32,
                                    fuse_wgrad_accumulation=True, single_grouped_weight=True,
                                    delay_wgrad_compute=delay)
    prior = torch.randn(E, N, K)
    layer.weight.main_grad = prior.clone().to(mg_dtype)
    mg = layer.weight.main_grad
    outs = []
    real = fp8.scaled_grouped_wgrad

    def spy(*args, out=None, accumulate=False, **kw):
        outs.append((out, accumulate))
        return real(*args, out=out, accumulate=accumulate, **kw)

    monkeypatch.setattr(fp8, "scaled_grouped_wgrad", spy)
    w = layer.weight.detach().clone()
    dw_ref = torch.zeros(E, N, K, dtype=torch.float64)
    for first, splits in ((True, [20, 0, 30]), (False, [5, 40, 3])):
        x = torch.randn(56, K)
        ms = torch.tensor(splits)
        with moe_graph.fp8.autocast(recipe=recipe):
            y = layer(x, ms, is_first_microbatch=first)
        dy = torch.randn_like(y)
        y.backward(dy)
        layer.backward_dw()
        dw_ref += _oracle(x, w, dy, splits, recipe)[2]
    assert layer.weight.main_grad is mg and layer.weight.grad_added_to_main_grad
    if mg_dtype == torch.float32:
        assert [(o is mg, a) for o, a in outs] == [(True, False), (True, True)]  # written, then added, by the GEMM
        _close(mg, dw_ref, dw_ref.abs().max())  # the first microbatch overwrote the prior main_grad
    else:
        assert [o for o, _ in outs] == [None, None]
        err = (mg.double() - dw_ref).abs().max()
        assert err <= dw_ref.abs().max() * 2.0 ** -7, err
    # accumulating from the start: main_grad = prior + dW (one fp32 add per microbatch)
    layer.weight.main_grad = prior.clone().to(mg_dtype)
    x = torch.randn(56, K)
    ms = torch.tensor([20, 0, 30])
    with moe_graph.fp8.autocast(recipe=recipe):
        y = layer(x, ms)
    dy = torch.randn_like(y)
    y.backward(dy)
    layer.backward_dw()
    want = prior.to(mg_dtype).double() + _oracle(x, w, dy, [20, 0, 30], recipe)[2]
    tol = 2.0 ** -7 if mg_dtype == torch.bfloat16 else 300 * 2.0 ** -23
    assert torch.all((layer.weight.main_grad.double() - want).abs() <= want.abs().max() * tol)


def test_recipe_objects_and_autocast_nesting():
    class Format:  # TE's enum members have .name
        def __init__(self, name):
            self.name = name

    class QParams:
        def __init__(self, power_2_scale, amax_epsilon):
            self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon

    class Float8BlockScaling:  # the shape of TE's recipe object
        fp8_format = Format("HYBRID")
        fp8_quant_fwd_inp = QParams(False, 1e-6)

    class MXFP8BlockScaling:
        fp8_format = Format("E4M3")

    assert fp8.as_recipe(Float8BlockScaling()) == fp8.Recipe("blockwise", "HYBRID", False, 1e-6)
    assert fp8.as_recipe(MXFP8BlockScaling()).kind == "mxfp8"
    assert fp8.as_recipe("tensorwise").kind == "tensor" and fp8.as_recipe("delayed").kind == "tensor"
    with pytest.raises(ValueError, match="unsupported FP8 recipe"):
        fp8.as_recipe(object())
    assert fp8.current_recipe() is None
    with moe_graph.fp8.autocast(recipe="mxfp8"):
        with moe_graph.fp8.autocast(enabled=False):
            assert fp8.current_recipe() is None
        assert fp8.current_recipe().kind == "mxfp8"
    assert fp8.current_recipe() is None


@pytest.mark.parametrize("recipe", [fp8.Float8BlockScaling(), fp8.MXFP8BlockScaling()], ids=["blockwise", "mxfp8"])
def test_grouped_mlp_fp8_each_gemm_equals_oracle(recipe, monkeypatch):
    import moe_graph.moe.experts as experts
    from moe_graph.moe.experts import FP8_ROW_ALIGNMENT, AlignedGroups, GroupedMLP
    # fc1 and the activation as two nodes, so that fc1's output is seen (the one node gives the same results bit
    # for bit: tests/test_fp8_activation_backward.py)
    monkeypatch.setattr(experts, "FUSED_FP8_ACTIVATION_BACKWARD", False)
    torch.manual_seed(2)
    L, H, F = 3, 64, 96
    mlp = GroupedMLP(L, H, F, activation="swiglu", params_dtype=torch.float32, device="cpu", init_std=0.1)
    splits = [40, 0, 25]
    x = torch.randn(70, H)
    seen = {}
    orig = mlp._fp8_act

    def act(h, m_splits, r, s):  # records fc1's output and fc2's input (the 16-bit values fc2 quantizes: the fused
        if "h" not in seen:      # activation's bytes are theirs, tests/test_fp8_quantize.py) of the first call
            seen.update(h=h, mid=mlp._act(h, s))
        return orig(h, m_splits, r, s)

    mlp._fp8_act = act
    with moe_graph.fp8.autocast(recipe=recipe):
        y = mlp(x, torch.tensor(splits))
        y2 = mlp(x, torch.tensor(splits))
    assert torch.equal(y, y2)
    w1, w2 = mlp.weights()
    # the FP8 experts run their groups at 16-row boundaries (test_fp8_dispatch checks the regrouping): fc1's output
    # and fc2's input back in the rows of x
    groups = AlignedGroups(torch.tensor(splits), 70, FP8_ROW_ALIGNMENT)
    seen_h, seen_mid = groups.unpad(seen["h"]), groups.unpad(seen["mid"])
    h_ref = _oracle(x, w1.detach(), torch.zeros(70, 2 * F), splits, recipe)[0]
    y_ref = _oracle(seen_mid.detach(), w2.detach(), torch.zeros(70, H), splits, recipe)[0]
    _close(seen_h, h_ref, h_ref.abs().max())
    _close(y, y_ref, y_ref.abs().max())
    # and close to the unquantized MLP (FP8's accuracy)
    y32 = mlp(x, torch.tensor(splits))
    assert (y - y32).abs().max() < 0.15 * y32.abs().max()


def test_moe_layer_fp8_trains_close_to_fp32():
    from moe_graph.moe.layer import MoELayer
    torch.manual_seed(3)
    layer = MoELayer(64, 96, 4, 2, device="cpu", params_dtype=torch.float32)
    x = torch.randn(2, 16, 64, requires_grad=True)
    y32 = layer(x)
    y32.square().mean().backward()
    g32 = layer.experts.fc1.weight.grad.clone()
    layer.zero_grad()
    with moe_graph.fp8.autocast(recipe="blockwise"):
        y8 = layer(x)
    y8.square().mean().backward()
    g8 = layer.experts.fc1.weight.grad
    assert (y8 - y32).abs().max() < 0.1 * y32.abs().max()
    assert (g8 - g32).norm() < 0.2 * g32.norm()


def test_train_step_with_fp8_recipe():
    """train_step(fp8_recipe=...): the MoE experts (fused main_grad under DDP) run in FP8, losses stay finite."""
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.distributed.optimizer import DistributedOptimizer
    from moe_graph.moe.layer import MoELayer
    from moe_graph.train.step import train_step

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoELayer(32, 48, num_experts=4, topk=2, device="cpu")
            self.head = torch.nn.Linear(32, 5)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(x + self.moe(x)), y)

    torch.manual_seed(4)
    ddp = DistributedDataParallel(Model(), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-3)
    fc1 = ddp.module.moe.experts.fc1
    for _ in range(2):
        mbs = [(torch.randn(8, 32), torch.randint(0, 5, (8,))) for _ in range(2)]
        res = train_step(ddp, opt, mbs, fp8_recipe="mxfp8")
        assert torch.isfinite(res.loss) and torch.isfinite(res.grad_norm)
    assert fc1.weight.grad_added_to_main_grad and fc1.weight.main_grad.abs().sum() > 0
    assert fp8.current_recipe() is None


def test_demo_fp8_flag_is_checked():
    from moe_graph.demo.cli import parser, resolve_args
    p = parser()
    for spare in ("0", "1"):  # with and without echo
        args = p.parse_args(["--device", "cpu", "--fp8", "mxfp8", "--spare", spare, "--layers", "1"])
        resolve_args(p, args, None)
        assert args.fp8 == "mxfp8"
    with pytest.raises(SystemExit):
        resolve_args(p, p.parse_args(["--device", "cuda", "--fp8", "blockwise"]), None)  # no CUDA kernels yet


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recipe", [fp8.Float8BlockScaling(), fp8.MXFP8BlockScaling()], ids=["blockwise", "mxfp8"])
def test_delay_wgrad_compute_fp8(recipe, fused):
    """delay_wgrad_compute in FP8: backward gives dgrad and placeholders only; backward_dw runs the FP8 wgrad
    (into main_grad or .grad) and delivers the bias gradients; two microbatches add up; every gradient equals the
    float64 oracle on the TE-reference quantize-dequantize within fp32 rounding."""
    torch.manual_seed(5)
    E, K, N = 3, 40, 72
    layer = moe_graph.GroupedLinear(E, K, N, bias=True, device="cpu", params_dtype=torch.float32,
                                    delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    ws = [getattr(layer, f"weight{e}") for e in range(E)]
    if fused:
        for w in ws:
            w.main_grad = torch.zeros_like(w)
    hooks = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: hooks.append(1))
    mbs = [([30, 0, 45], torch.randn(80, K)), ([1, 70, 9], torch.randn(80, K))]  # 5 capacity rows in the first
    dw_ref = torch.zeros(E, N, K, dtype=torch.float64)
    db_ref = torch.zeros(E, N, dtype=torch.float64)
    w = torch.stack([x.detach() for x in ws])
    for i, (splits, x) in enumerate(mbs):
        x = x.requires_grad_()
        with moe_graph.fp8.autocast(recipe=recipe):
            y = layer(x, torch.tensor(splits))
        dy = torch.randn_like(y)
        y.backward(dy)
        yo, dxo, dwo = _oracle(x.detach(), w, dy, splits, recipe)
        _close(x.grad, dxo, dxo.abs().max())
        if i == 0:  # before backward_dw: placeholders, no bias gradient, the wgrad queued
            assert all(torch.count_nonzero(t.grad) == 0 for t in ws)
            assert all(getattr(layer, f"bias{e}").grad is None for e in range(E))
            assert len(layer._wgrad_queue) == 1 and not hooks
        layer.backward_dw()
        dw_ref += dwo
        r = 0
        for e, m in enumerate(splits):
            db_ref[e] += dy[r:r + m].double().sum(0)
            r += m
    assert len(hooks) == 2 and not layer._wgrad_queue
    got = torch.stack([t.main_grad if fused else t.grad for t in ws])
    _close(got, dw_ref, dw_ref.abs().max())
    _close(torch.stack([getattr(layer, f"bias{e}").grad for e in range(E)]), db_ref, db_ref.abs().max())
    if fused:
        assert all(t.grad_added_to_main_grad for t in ws)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recipe", [fp8.Float8BlockScaling(), fp8.MXFP8BlockScaling()], ids=["blockwise", "mxfp8"])
def test_grouped_mlp_fp8_with_echo_equals_oracle(recipe, fused):
    """FP8 experts with an echo spare slot (one process, R = 1: slot 0 hosts expert 1), with the fused fp32
    main_grad path (echo_grouped_gemm with the recipe) or without (autograd): outputs, input gradient and every
    expert's weight gradient (home rows + the spare slot's rows, each group quantized on its own) equal the
    plain-PyTorch oracle (helpers.fp8_reference.qdq_swiglu_mlp per group) within fp32 rounding."""
    from moe_graph.moe.echo import EchoExpertDispatcher, LocalBackend
    from moe_graph.moe.experts import GroupedMLP

    torch.manual_seed(6)
    L, H, F, k = 3, 48, 40, 1
    mlp = GroupedMLP(L, H, F, activation="swiglu", num_spare_experts_per_ep_rank=k, params_dtype=torch.float32,
                     device="cpu", init_std=0.2)
    w1, w2 = mlp.weights()
    if fused:
        w1.main_grad, w2.main_grad = torch.zeros_like(w1), torch.zeros_like(w2)
    disp = EchoExpertDispatcher(L, 1, 0, k, backend=LocalBackend())
    offload = torch.zeros(L, k, dtype=torch.bool)
    offload[1, 0] = True
    splits = [37, 40, 0, 33]  # expert 1's tokens split between home (40) and the spare slot (33)
    M = sum(splits) + 6  # capacity rows past the sum
    x = torch.randn(M, H, requires_grad=True)
    scale = torch.rand(M)
    with moe_graph.fp8.autocast(recipe=recipe):
        y = mlp(x, torch.tensor(splits), disp, offload, row_scale=scale)
    dy = torch.randn_like(y)
    y.backward(dy)
    xo = x.detach().clone().requires_grad_()
    w1o, w2o = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    outs, r = [], 0
    for g, (m, e) in enumerate(zip(splits, [0, 1, 2, 1])):
        outs.append(ref.qdq_swiglu_mlp(xo[r:r + m], w1o[e], w2o[e], recipe, scale[r:r + m]))
        r += m
    yo = torch.cat(outs + [torch.zeros(M - r, H)])
    yo.backward(dy)
    tol = 2.0 ** -23 * 300
    torch.testing.assert_close(y, yo, rtol=0, atol=tol * float(yo.detach().abs().max()))
    torch.testing.assert_close(x.grad, xo.grad, rtol=0, atol=tol * float(xo.grad.abs().max()))
    for w, wo in ((w1, w1o), (w2, w2o)):
        got = w.main_grad if fused else w.grad
        torch.testing.assert_close(got, wo.grad, rtol=0, atol=tol * float(wo.grad.abs().max()))
        if fused:
            assert w.grad_added_to_main_grad and torch.count_nonzero(w.grad) == 0
    assert torch.count_nonzero(w1o.grad[1]) > 0 and torch.equal(y[r:], torch.zeros(M - r, H))
    # FP8 dispatch: rows quantized before they moved (QuantizedRows) give the same output and input gradient
    carrier = x.detach().clone().requires_grad_()
    xq = fp8.unpack_rows(fp8.pack_rows(x.detach(), recipe), carrier, recipe)
    with moe_graph.fp8.autocast(recipe=recipe):
        yq = mlp(xq, torch.tensor(splits), disp, offload, row_scale=scale)
    yq.backward(dy)
    assert torch.equal(yq, y) and torch.equal(carrier.grad, x.grad)
