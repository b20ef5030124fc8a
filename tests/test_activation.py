"""The fused expert activation (``moe_graph.ops.activation.expert_activation``, native op
``torch.ops.moe_graph.expert_activation``) against the float64 definitions of
:func:`moe_graph.testing.moe_reference.reference_activation` times the row scale: forward, gradients of ``h`` and
``row_scale`` (float64 gradcheck and the reference's autograd, clamped values past the limit on both sides),
bf16/fp16 within their rounding, zero rows, bad arguments, non-contiguous inputs, FakeTensor/opcheck and
``torch.compile(fullgraph=True)``; the torch fallback against the same reference; and ``GroupedMLP(x, m_splits,
row_scale=s)`` against a per-expert float64 MLP times ``s`` (output, gradients of x, weights and s, what autograd
saves)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import requires_cuda
from moe_graph.moe.experts import GroupedMLP, SharedExpert
from moe_graph.ops import activation as act_ops
from moe_graph.ops.activation import expert_activation
from moe_graph.testing.moe_reference import reference_activation

GATED = ["swiglu", "clamped_swiglu", "limited_swiglu", "post_clamped_swiglu", "softcapped_swiglu", "geglu_tanh"]
PLAIN = ["squared_relu", "relu", "silu", "gelu"]
ALL = GATED + PLAIN
CLAMPED = ("clamped_swiglu", "limited_swiglu", "post_clamped_swiglu")  # the kinds whose clamps block gradients
ALPHA, LIMIT = 1.3, 2.5
OP = torch.ops.moe_graph.expert_activation

pytestmark = pytest.mark.skipif(not act_ops.native_available("cpu"),
                                reason="the loaded moe_graph._C has no expert_activation op (rebuild)")


def _h(gen, rows, f, dtype=torch.float64, scale=4.0):
    """fc1 output in ``dtype`` with values past the clamp limit on both sides, none within 0.05 of +-LIMIT or of
    ``silu(a) = LIMIT`` (the clamps' kinks: a finite difference there straddles two slopes, and the reference's
    min/max split the gradient of a tie)."""
    h = (torch.randn(rows, 2 * f, generator=gen, dtype=torch.float64) * scale).to(dtype)
    hd = h.double()
    near = ((hd.abs() - LIMIT).abs() < 0.05) | ((torch.nn.functional.silu(hd) - LIMIT).abs() < 0.05)
    return torch.where(near, h * 0.5, h)


def _h_for(activation, gen, rows, f, dtype=torch.float64, scale=4.0):
    """:func:`_h` for ``activation``: ``[rows, 2F]`` for a gated one, its first ``F`` columns for a plain one."""
    h = _h(gen, rows, f, dtype, scale)
    return h if activation in GATED else h[:, :f].contiguous()


def _ref(h, activation, s=None):
    y = reference_activation(h.double(), activation, ALPHA, LIMIT)
    return y if s is None else y * s.double()[..., None]


@pytest.fixture(params=["native", "fallback"])
def impl(request, monkeypatch):
    """The native op, or the plain-torch fallback a build without the op uses."""
    if request.param == "fallback":
        monkeypatch.setattr(act_ops, "native_available", lambda device_type="cpu": False)
    return request.param


@pytest.mark.parametrize("activation", ALL)
@pytest.mark.parametrize("with_scale", [False, True])
def test_forward_and_gradients_match_float64_reference(gen, impl, activation, with_scale):
    h = _h_for(activation, gen, 37, 11).requires_grad_()
    s = (torch.rand(37, generator=gen, dtype=torch.float64) + 0.1).requires_grad_() if with_scale else None
    y = expert_activation(h, activation, s, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    hr = h.detach().clone().requires_grad_()
    sr = s.detach().clone().requires_grad_() if with_scale else None
    yr = _ref(hr, activation, sr)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-12, atol=1e-12)
    if with_scale:
        torch.testing.assert_close(s.grad, sr.grad, rtol=1e-12, atol=1e-12)
    if activation in CLAMPED:  # the reference blocks the gradient past the limit: so does the op
        a, b = h.detach().chunk(2, -1)
        da, db = h.grad.chunk(2, -1)
        past = (torch.nn.functional.silu(a) if activation == "post_clamped_swiglu" else a) > LIMIT
        assert past.any() and (b.abs() > LIMIT).any()
        assert (da[past] == 0).all() and (db[b.abs() > LIMIT] == 0).all()


@pytest.mark.parametrize("activation", ALL)
def test_gradcheck_float64(gen, impl, activation):
    h = _h_for(activation, gen, 6, 5).requires_grad_()
    s = (torch.rand(6, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    fn = lambda h, s: expert_activation(h, activation, s, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, s), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", ["fp32", "same"])
@pytest.mark.parametrize("activation", ALL)
def test_16_bit_within_rounding_of_float64_reference(gen, impl, dtype, scale_dtype, activation):
    h = _h_for(activation, gen, 64, 24, dtype, scale=3.0).requires_grad_()
    s = (torch.rand(64, generator=gen) + 0.1).to(torch.float32 if scale_dtype == "fp32" else dtype).requires_grad_()
    y = expert_activation(h, activation, s, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    assert y.dtype == dtype and y.shape == (64, 24)
    hr = h.detach().double().requires_grad_()
    sr = s.detach().double().requires_grad_()
    yr = _ref(hr, activation, sr)
    torch.testing.assert_close(y.double(), yr, rtol=1.6e-2, atol=1e-2)
    g = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(g)
    yr.backward(g.double())
    assert h.grad.dtype == dtype and s.grad.dtype == s.dtype
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=1.6e-2, atol=2e-2)
    # ds sums F products in fp32 (rounded once): within the rounding of the 16-bit inputs' sum
    torch.testing.assert_close(s.grad.double(), sr.grad, rtol=2e-2, atol=5e-2)


def test_post_clamped_swiglu_boundaries():
    """``min(silu(a), L) * clamp(b, -L, L)`` at its kinks, fp64: with ``L = silu(2)`` as the op computes it
    (``a * (1 / (1 + exp(-a)))``), the gate at ``a = 2`` exactly passes its gradient (``silu(a) <= L``, torch.clamp's
    rule), one ulp above it is blocked (``silu`` grows faster than ``a`` there), one ulp below passes; the up half
    passes at ``b = +-L`` exactly and is blocked one ulp outside. Values and passing gradients equal the float64
    reference's (the native op: torch's silu in the fallback may round silu(2) otherwise)."""
    import math
    a0 = 2.0
    lim = a0 * (1.0 / (1.0 + math.exp(-a0)))
    up, down = math.nextafter(a0, math.inf), math.nextafter(a0, -math.inf)
    a = torch.tensor([a0, up, down, 0.5, 0.5, 0.5], dtype=torch.float64)
    b = torch.tensor([1.5, 1.5, 1.5, lim, -lim, math.nextafter(lim, math.inf)], dtype=torch.float64)
    h = torch.cat([a, b]).view(1, 12).requires_grad_()
    y = expert_activation(h, "post_clamped_swiglu", swiglu_limit=lim)
    y.sum().backward()
    da, db = h.grad.view(2, 6)
    assert y[0, 0] == lim * 1.5 and y[0, 1] == lim * 1.5 and y[0, 2] < lim * 1.5
    assert da[0] != 0 and da[1] == 0 and da[2] != 0
    assert db[3] != 0 and db[4] != 0 and db[5] == 0
    ref_silu_grad = torch.sigmoid(a[0]) * (1 + a[0] * (1 - torch.sigmoid(a[0])))
    torch.testing.assert_close(da[0], 1.5 * ref_silu_grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(db[3:5], torch.nn.functional.silu(a[3:5]), rtol=1e-12, atol=0)


def test_16_bit_rounding_specials(impl):
    """Overflow to inf, NaN through, and the smallest subnormals of fp16 (the CPU converts without torch)."""
    h = torch.tensor([[300.0, float("nan"), 1e-3, 2.0, 300.0, 1.0, 1e-4, 1.0]])  # a | b, F = 4
    y = expert_activation(h.half(), "swiglu")
    ref = reference_activation(h.double(), "swiglu").half()
    assert torch.isinf(y[0, 0]) and torch.isnan(y[0, 1])
    torch.testing.assert_close(y[0, 2:].double(), ref[0, 2:].double(), rtol=1e-3, atol=6e-8)
    yb = expert_activation(h.bfloat16(), "swiglu")
    assert torch.isfinite(yb[0, 0]) and torch.isnan(yb[0, 1])


def test_leading_dims_and_non_contiguous_inputs_are_handled(gen, impl):
    h = _h(gen, 24, 8).view(4, 6, 16)
    s = torch.rand(4, 6, generator=gen, dtype=torch.float64)
    y = expert_activation(h, "swiglu", s)
    assert y.shape == (4, 6, 8)
    torch.testing.assert_close(y, _ref(h, "swiglu", s), rtol=1e-12, atol=1e-12)
    hn = h.transpose(0, 1)  # non-contiguous: copied by the wrapper
    sn = s.t()
    torch.testing.assert_close(expert_activation(hn, "swiglu", sn), _ref(hn, "swiglu", sn), rtol=1e-12, atol=1e-12)


def test_native_op_rejects_non_contiguous_and_bad_arguments(gen):
    h = _h(gen, 8, 4)
    s = torch.rand(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="h must be contiguous"):
        OP(h.t().contiguous().t(), s, "swiglu", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="row_scale must be contiguous"):
        OP(h, torch.rand(16, dtype=torch.float64)[::2], "swiglu", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="activation must be"):
        OP(h, s, "swish", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="even number of columns"):
        OP(h[:, :7].contiguous(), s, "swiglu", ALPHA, LIMIT)
    assert OP(h[:, :7].contiguous(), s, "squared_relu", ALPHA, LIMIT).shape == (8, 7)  # plain: [N, F] as it is
    with pytest.raises(RuntimeError, match=r"row_scale must have shape \[8\]"):
        OP(h, s[:5], "swiglu", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="row_scale must have dtype Float or the dtype of h"):
        OP(h, s.half(), "swiglu", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="limit"):
        OP(h, s, "clamped_swiglu", ALPHA, float("inf"))
    with pytest.raises(RuntimeError, match="h must have dtype"):
        OP(h.to(torch.int32), None, "swiglu", ALPHA, LIMIT)
    with pytest.raises(RuntimeError, match="grad_y must have shape"):
        torch.ops.moe_graph.expert_activation_backward(h, h, s, "swiglu", ALPHA, LIMIT)


def test_wrapper_errors_name_the_argument(gen, impl):
    h = _h(gen, 8, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        expert_activation(h, "swish")
    with pytest.raises(ValueError, match=r"h must be a tensor \[..., 2F\]"):
        expert_activation(h[:, :7], "swiglu")
    with pytest.raises(ValueError, match=r"h must be a tensor \[..., F\]"):
        expert_activation(torch.tensor(1.0), "relu")
    with pytest.raises(ValueError, match=r"row_scale must have shape \(8,\)"):
        expert_activation(h, "swiglu", torch.rand(9, dtype=torch.float64))
    with pytest.raises(TypeError, match="row_scale must have dtype"):
        expert_activation(h, "swiglu", torch.rand(8, dtype=torch.float16))


@pytest.mark.parametrize("rows,f", [(0, 5), (4, 0)])
def test_empty_rows_and_columns(impl, rows, f):
    h = torch.randn(rows, 2 * f, dtype=torch.float64, requires_grad=True)
    s = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    y = expert_activation(h, "clamped_swiglu", s)
    assert y.shape == (rows, f)
    y.sum().backward()
    assert h.grad.shape == h.shape and s.grad.shape == (rows,) and not s.grad.any()


def test_fake_tensor_and_opcheck(gen):
    h = _h(gen, 10, 6, torch.bfloat16)
    s = torch.rand(10, generator=gen)
    with FakeTensorMode() as mode:
        hf, sf = mode.from_tensor(h), mode.from_tensor(s)
        y = expert_activation(hf, "swiglu", sf)
        gh, gs = torch.ops.moe_graph.expert_activation_backward(y, hf, sf, "swiglu", ALPHA, LIMIT)
    assert y.shape == (10, 6) and y.dtype == torch.bfloat16
    assert gh.shape == (10, 12) and gh.dtype == torch.bfloat16 and gs.shape == (10,) and gs.dtype == torch.float32
    with FakeTensorMode() as mode:
        y = expert_activation(mode.from_tensor(h), "squared_relu")
    assert y.shape == (10, 12) and y.dtype == torch.bfloat16
    hd = _h(gen, 5, 3).requires_grad_()
    sd = torch.rand(5, dtype=torch.float64, requires_grad=True)
    for args in ((hd, sd, "clamped_swiglu", ALPHA, LIMIT), (hd, None, "swiglu", ALPHA, LIMIT),
                 (hd, sd, "squared_relu", ALPHA, LIMIT), (hd, None, "gelu", ALPHA, LIMIT)):
        torch.library.opcheck(OP.default, args)


def test_torch_compile_fullgraph_matches_eager(gen):
    h = _h(gen, 16, 8, torch.float32).requires_grad_()
    s = torch.rand(16, generator=gen, requires_grad=True)

    def f(h, s):
        return (expert_activation(h, "clamped_swiglu", s, swiglu_alpha=ALPHA, swiglu_limit=LIMIT) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    ref = f(h, s)
    gh, gs = torch.autograd.grad(ref, (h, s))
    out = compiled(h, s)
    ch, cs = torch.autograd.grad(out, (h, s))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cs, gs)


# ------------------------------------------------------------------------------------------------- experts --
def _mlp_reference(x, m_splits, w1, w2, activation, s, alpha=1.702, limit=7.0):
    """Each expert's rows through its float64 MLP, times the row's scale; padding rows zero."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(m_splits.tolist()):
        rows = slice(start, start + n)
        a = reference_activation(x[rows] @ w1[e].t(), activation, alpha, limit) @ w2[e].t()
        out[rows] = a * s[rows, None]
        start += n
    return out


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "relu", "squared_relu"])
@pytest.mark.parametrize("main_grad", [False, True])
def test_grouped_mlp_row_scale_is_the_scaled_reference(gen, activation, main_grad):
    torch.manual_seed(0)
    mlp = GroupedMLP(3, 8, 6, activation, params_dtype=torch.float64, device="cpu", init_std=0.5)
    m_splits = torch.tensor([4, 0, 5])
    x = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)  # 2 padding rows
    s = (torch.rand(11, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    if main_grad:
        for w in mlp.weights():
            w.main_grad = torch.zeros_like(w)
    y = mlp(x, m_splits, row_scale=s)
    w1 = mlp.fc1.weight.detach().clone().requires_grad_()
    w2 = mlp.fc2.weight.detach().clone().requires_grad_()
    xr, sr = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    yr = _mlp_reference(xr, m_splits, w1, w2, activation, sr)
    torch.testing.assert_close(y, yr, rtol=1e-11, atol=1e-12)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(s.grad, sr.grad, rtol=1e-11, atol=1e-12)
    for w, wr in zip(mlp.weights(), (w1, w2)):
        got = w.main_grad if main_grad else w.grad
        torch.testing.assert_close(got, wr.grad, rtol=1e-11, atol=1e-12)
    # without a scale: the same MLP, unscaled (the scale is the only difference)
    torch.testing.assert_close(mlp(x, m_splits) * s[:, None], y, rtol=1e-12, atol=1e-12)


def test_grouped_mlp_row_scale_with_bias_is_refused():
    mlp = GroupedMLP(2, 8, 6, "swiglu", params_dtype=torch.float64, device="cpu", bias=True)
    with pytest.raises(ValueError, match="row_scale: the experts have biases"):
        mlp(torch.randn(4, 8, dtype=torch.float64), torch.tensor([2, 2]), row_scale=torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("activation", ALL)
def test_grouped_mlp_saves_fc1_output_fc2_input_and_scale_only(gen, activation):
    """Besides the parameters, autograd keeps the expert input and m_splits (fc1), fc1's output ``[N, 2F]`` or
    ``[N, F]`` (the activation), the scaled activation ``[N, F]`` (fc2) and the scale: nothing else."""
    mlp = GroupedMLP(2, 8, 6, activation, params_dtype=torch.float32, device="cpu")
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    x = torch.randn(10, 8, generator=gen, requires_grad=True)
    m_splits = torch.tensor([6, 4])
    s = torch.rand(10, generator=gen, requires_grad=True)
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mlp(x, m_splits, row_scale=s)
    n = x.shape[0]
    fc1_out = 12 if activation in GATED else 6
    expected = x.nbytes + m_splits.nbytes + n * fc1_out * 4 + n * 6 * 4 + s.nbytes
    assert sum(saved.values()) == expected and len(saved) == 5
    y.sum().backward()


@pytest.mark.parametrize("activation", PLAIN)
def test_plain_kinds_equal_torch_including_specials(activation):
    """The plain kinds against torch's own functions (relu(h)^2, relu, silu, exact gelu), value and gradient, at
    zero, +-inf, NaN and ordinary values, fp32 and fp64 (the native op computes them without torch)."""
    fn = {"squared_relu": lambda v: torch.relu(v).square(), "relu": torch.relu,
          "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]
    vals = [0.0, -0.0, 1.5, -1.5, 3.0, -40.0, 40.0, float("nan")]
    if activation in ("squared_relu", "relu"):
        vals += [float("inf"), float("-inf")]
    for dtype in (torch.float32, torch.float64):
        h = torch.tensor([vals], dtype=dtype, requires_grad=True)
        hr = h.detach().clone().requires_grad_()
        y, yr = expert_activation(h, activation), fn(hr)
        torch.testing.assert_close(y, yr, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0, equal_nan=True)
        y.backward(torch.ones_like(y))
        yr.backward(torch.ones_like(yr))
        torch.testing.assert_close(h.grad, hr.grad, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("activation", ALL)
def test_experts_run_the_activation_as_one_native_op(gen, activation):
    """GroupedMLP and SharedExpert dispatch every activation, gated or plain, as the one fused op forward and
    backward (no torch elementwise ops between fc1 and fc2), and match the float64 reference times the scale."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    mlp = GroupedMLP(2, 8, 6, activation, params_dtype=torch.float64, device="cpu", swiglu_alpha=ALPHA,
                     swiglu_limit=LIMIT)
    shared = SharedExpert(8, 6, activation, params_dtype=torch.float64, device="cpu", swiglu_alpha=ALPHA,
                          swiglu_limit=LIMIT)
    x = torch.randn(10, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.rand(10, generator=gen, dtype=torch.float64)
    for run in (lambda: mlp(x, torch.tensor([6, 4]), row_scale=s), lambda: shared(x)):
        with Ops() as ops:
            run().sum().backward()
        names = [n.split("::")[-1].split(".")[0] for n in ops.names]
        assert names.count("expert_activation") == 1 and names.count("expert_activation_backward") == 1, names
        assert not {"relu", "pow", "square", "silu", "gelu", "sigmoid", "threshold_backward"} & set(names), names
    y = mlp(x, torch.tensor([6, 4]), row_scale=s)
    torch.testing.assert_close(y, _mlp_reference(x.detach(), torch.tensor([6, 4]), mlp.fc1.weight.detach(),
                                                 mlp.fc2.weight.detach(), activation, s, ALPHA, LIMIT),
                               rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------------------------------------------- CUDA --
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("f", [64, 13])  # vectorized rows, then the scalar path (F not a multiple of the vector)
@pytest.mark.parametrize("activation", ALL)
def test_cuda_matches_cpu_reference(gen, dtype, f, activation):
    h = _h_for(activation, gen, 300, f, dtype, scale=3.0)
    s = torch.rand(300, generator=gen) + 0.1
    g = torch.randn(300, f, generator=gen).to(dtype)
    hc, sc = h.cuda().requires_grad_(), s.cuda().requires_grad_()
    y = expert_activation(hc, activation, sc, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    y.backward(g.cuda())
    hr, sr = h.double().requires_grad_(), s.double().requires_grad_()
    yr = _ref(hr, activation, sr)
    yr.backward(g.double())
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5) \
        if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(y.double().cpu(), yr, **tol)
    torch.testing.assert_close(hc.grad.double().cpu(), hr.grad, **tol)
    torch.testing.assert_close(sc.grad.double().cpu(), sr.grad, rtol=2e-2 if dtype in (torch.bfloat16, torch.float16)
                               else 1e-5, atol=5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
