"""The fused producer of fc1's FP8 output gradient (issue 41): the quantizer computes the activation backward's
``grad_h`` per element from (g, h, row_scale) and writes both FP8 copies, without ``grad_h`` in memory
(``ops.fp8.quantize_pair(h, ..., grad_y=g)``, ``LoadActGrad`` in csrc/fp8/quantize.h), and fc1 + the activation as
one autograd node (``grouped_linear.fp8_grouped_linear_activation``). Oracles: the unfused ops
(``expert_activation_backward`` then the quantizers; fc1's FP8 node then ``ops.fp8.quantize_activation``), bit for
bit; the row-scale gradient written by the same op (``grad_scale``) against expert_activation_backward's, bit for
bit, and the float64 definition within fp32 summation rounding; the byte count of the backward's non-GEMM ops
against the arithmetic of what the fusion leaves out, and no zero gradients written for the FP8 copies."""

import importlib.util
import os

import pytest
import torch

import moe_graph
from moe_graph.grouped_linear import fp8_grouped_linear, fp8_grouped_linear_activation
from moe_graph.ops import fp8
from moe_graph.ops.activation import ACTIVATIONS, gated_kind

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without the FP8 ops")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTS = dict(swiglu_alpha=1.5, swiglu_limit=4.0)  # clamps and caps that the values below cross


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _same(a, b):
    """Equal bits (NaNs equal whatever their sign), for FP8 bytes, scales and gradients alike."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() == 2:
        a, b = a.float(), b.float()
    nan = a.float().isnan()
    return torch.equal(nan, b.float().isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


# ------------------------------------------------------------------------------------------ the op itself --
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["blockwise", "mxfp8", "tensor"])
def test_backward_quantize_equals_activation_backward_then_quantize(activation, kind):
    """Both FP8 copies from (g, h, s) equal expert_activation_backward's grad_h quantized by the quantizers, bit
    for bit, for every activation kind, h dtype, row scale (none, fp32, h's dtype), both FP8 formats, zero-token
    groups, one group taking every row and rows past sum(m_splits); and the row-scale gradient without grad_h
    written equals the one with it."""
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(41)
    F, M = 72, 85
    W = 2 * F if gated_kind(activation) else F
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = (torch.randn(M, W, generator=gen) * 3).to(dtype)
        g = (torch.randn(M, F, generator=gen) * torch.logspace(-2, 2, M)[:, None]).to(dtype)
        for sm in (None, torch.float32, dtype):
            rs = None if sm is None else torch.rand(M, generator=gen).to(sm)
            act = (activation, OPTS["swiglu_alpha"], OPTS["swiglu_limit"])
            grad_h, ds = torch.ops.moe_graph.expert_activation_backward(g, h, rs, *act)
            empty, ds_only = torch.ops.moe_graph.expert_activation_backward(g, h, rs, *act, False)
            assert empty.numel() == 0 and _same(ds_only, ds), (dtype, sm)
            for splits in ([30, 0, 41, 9], [M], [0, 50, 0]):  # the last: rows 50.. past sum(m_splits)
                ms = torch.tensor(splits)
                for qd in (torch.float8_e4m3fn, torch.float8_e5m2):
                    (q, s), (qt, st) = fp8.quantize_pair(h, ms, recipe, qd, activation=activation, row_scale=rs,
                                                         grad_y=g, **OPTS)
                    (rq, rsc), (cq, cs) = fp8.quantize_pair(grad_h, ms, recipe, qd)
                    assert q.shape == (M, W) and qt.shape == (W, M)
                    assert _same(q, rq) and _same(s, rsc), (dtype, sm, splits, qd)
                    assert _same(qt, cq) and _same(st, cs), (dtype, sm, splits, qd)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["blockwise", "mxfp8"])
def test_backward_quantize_writes_the_row_scale_gradient(activation, kind):
    """With ``grad_scale`` the same op writes the row-scale gradient: bit-equal to expert_activation_backward's
    (the CPU's column-order sums) for every h dtype and scale dtype (fp32, h's dtype), several column tiles per
    row, zero-token groups, one group taking every row and rows past sum(m_splits) (their gradient too), both FP8
    formats; the FP8 copies are those made without it."""
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(43)
    F, M = 200, 85  # 2F = 400: four 1 x 128 / thirteen 1 x 32 tiles per row, the last one partial
    W = 2 * F if gated_kind(activation) else F
    act = (activation, OPTS["swiglu_alpha"], OPTS["swiglu_limit"])
    assert fp8.fuses_row_scale_gradient(recipe)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = (torch.randn(M, W, generator=gen) * 3).to(dtype)
        g = (torch.randn(M, F, generator=gen) * torch.logspace(-2, 2, M)[:, None]).to(dtype)
        for sm in (torch.float32, dtype):
            rs = torch.rand(M, generator=gen).to(sm)
            want = torch.ops.moe_graph.expert_activation_backward(g, h, rs, *act)[1]
            assert want.abs().max() > 0
            for splits, qd in (([30, 0, 41, 9], torch.float8_e4m3fn), ([M], torch.float8_e5m2),
                               ([0, 50, 0], torch.float8_e4m3fn)):  # the last: rows 50.. past sum(m_splits)
                ms = torch.tensor(splits)
                ds = torch.full((M,), float("nan"), dtype=sm)  # every row is written
                got = fp8.quantize_pair(h, ms, recipe, qd, activation=activation, row_scale=rs, grad_y=g,
                                        grad_scale=ds, **OPTS)
                plain = fp8.quantize_pair(h, ms, recipe, qd, activation=activation, row_scale=rs, grad_y=g, **OPTS)
                assert _same(ds, want), (dtype, sm, splits)
                for a, b in zip((*got[0], *got[1]), (*plain[0], *plain[1])):
                    assert _same(a, b), (dtype, sm, splits)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_row_scale_gradient_within_fp32_summation_of_the_float64_definition(activation):
    """The fused row-scale gradient against the float64 definition sum_f g * act(h) (moe_reference's activations),
    fp32 data: within (F + 32) units of fp32 rounding of sum_f |g * act| (F - 1 additions in any order, the
    product's rounding, a few units for act's own fp32 evaluation): the bound any summation order meets, so the
    CUDA kernel's order (csrc/fp8/quantize.h) meets it too."""
    from moe_graph.testing.moe_reference import reference_activation
    recipe = fp8.as_recipe("blockwise")
    gen = torch.Generator().manual_seed(44)
    F, M = 300, 40
    W = 2 * F if gated_kind(activation) else F
    h = torch.randn(M, W, generator=gen) * 3
    g = torch.randn(M, F, generator=gen)
    rs = torch.rand(M, generator=gen)
    ds = torch.empty(M)
    fp8.quantize_pair(h, torch.tensor([M]), recipe, recipe.bwd_dtype, activation=activation, row_scale=rs,
                      grad_y=g, grad_scale=ds, **OPTS)
    terms = g.double() * reference_activation(h.double(), activation, OPTS["swiglu_alpha"], OPTS["swiglu_limit"])
    bound = (F + 32) * 2.0 ** -24 * terms.abs().sum(1)
    err = (ds.double() - terms.sum(1)).abs()
    assert (err <= bound).all(), (err / bound).max()


def test_row_scale_gradient_errors_name_the_argument():
    """grad_scale needs grad_y and row_scale, rowwise tiles of one row, and [M] of row_scale's dtype; nothing is
    written when refused."""
    h, g, rs = torch.randn(6, 16), torch.randn(6, 8), torch.rand(6)
    op = torch.ops.moe_graph.fp8_quantize_pair
    args = (h, None, [1, 128, 128, 1], torch.float8_e4m3fn, False, 0.0, False, "swiglu", 1.0, 1.0)
    ds = torch.full((6,), 5.0)
    with pytest.raises(RuntimeError, match="grad_scale .* goes with grad_y and row_scale"):
        op(*args, None, g, ds)
    with pytest.raises(RuntimeError, match="grad_scale .* goes with grad_y and row_scale"):
        op(*args, rs, None, ds)
    with pytest.raises(RuntimeError, match="grad_scale needs rowwise tiles of one row"):
        op(h, None, [0, 0, 0, 0], torch.float8_e4m3fn, False, 0.0, False, "swiglu", 1.0, 1.0, rs, g, ds)
    for bad in (torch.zeros(5), torch.zeros(6, dtype=torch.bfloat16), torch.zeros(6, 1), torch.zeros(12)[::2]):
        with pytest.raises(RuntimeError, match="fp8_quantize_pair: grad_scale"):
            op(*args, rs, g, bad)
    assert torch.equal(ds, torch.full((6,), 5.0))


def test_backward_quantize_sets_the_nonfinite_flag():
    flag = fp8.nonfinite_flag("cpu")
    flag.zero_()
    recipe = fp8.as_recipe("blockwise")
    h, g = torch.randn(16, 64), torch.randn(16, 32)
    fp8.quantize_pair(h, torch.tensor([16]), recipe, recipe.bwd_dtype, activation="swiglu", grad_y=g)
    assert int(flag[0]) == 0
    g[5, 3] = float("inf")
    fp8.quantize_pair(h, torch.tensor([16]), recipe, recipe.bwd_dtype, activation="swiglu", grad_y=g)
    assert int(flag[0]) == 1
    flag.zero_()


def test_backward_quantize_errors_name_the_argument():
    recipe = fp8.as_recipe("blockwise")
    h = torch.randn(6, 16)
    with pytest.raises(RuntimeError, match="grad_y goes with an activation"):
        torch.ops.moe_graph.fp8_quantize_pair(h, None, [1, 128, 128, 1], torch.float8_e4m3fn, False, 0.0, False,
                                               None, 1.0, 1.0, None, torch.randn(6, 8))
    for bad in (torch.randn(6, 16), torch.randn(5, 8), torch.randn(6, 8, dtype=torch.float64), torch.randn(8, 6).t(),
                torch.randn(6, 8, 1)):
        with pytest.raises(RuntimeError, match="fp8_quantize_pair: grad_y"):
            torch.ops.moe_graph.fp8_quantize_pair(h, None, [1, 128, 128, 1], recipe.bwd_dtype, False, 0.0, False,
                                                   "swiglu", 1.0, 1.0, None, bad)


def test_backward_quantize_and_scale_gradient_fakes():
    h, g = torch.randn(20, 64), torch.randn(20, 32)
    ms = torch.tensor([5, 0, 15], dtype=torch.int32)
    for act, gy in (("swiglu", g), ("relu", torch.randn(20, 64))):
        torch.library.opcheck(torch.ops.moe_graph.fp8_quantize_pair.default,
                              (h, ms, [1, 32, 32, 1], torch.float8_e4m3fn, True, 0.0, False, act, 1.702, 7.0, None,
                               gy), test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.moe_graph.fp8_quantize_pair.default,  # the row-scale gradient written
                              (h, ms, [1, 128, 128, 1], torch.float8_e4m3fn, False, 0.0, False, act, 1.702, 7.0,
                               torch.rand(20), gy, torch.empty(20)), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.moe_graph.expert_activation_backward.default,
                          (g, h, torch.rand(20), "swiglu", 1.702, 7.0, False),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------- fc1 + activation, one node --
def _chain(fused, x, splits, w1, b1, w2, rs, recipe, activation, fuse=False, x_rows=None):
    """fc1 -> activation -> fc2 in FP8: the one node (fused) or fc1's node then quantize_activation (the path
    before it). ``x_rows``: x as FP8-dispatched rows (QuantizedRows) instead."""
    xin = x if x_rows is None else x_rows
    if fused:
        mid = fp8_grouped_linear_activation(xin, splits, [w1], b1, recipe, activation, rs, fuse=fuse, **OPTS)
    else:
        h = fp8_grouped_linear(xin, splits, [w1], b1, recipe, fuse=fuse)
        mid = fp8.quantize_activation(h, splits, recipe, activation, rs, **OPTS)
    return fp8_grouped_linear(mid, splits, [w2], None, recipe, fuse=fuse)


def _run(fused, inputs, splits, recipe, activation, fuse=False, fp8_rows=False):
    x0, w10, b10, w20, rs0, gy = inputs
    x = x0.clone().requires_grad_()
    w1, w2 = w10.clone().requires_grad_(), w20.clone().requires_grad_()
    b1 = None if b10 is None else b10.clone().requires_grad_()
    rs = None if rs0 is None else rs0.clone().requires_grad_()
    if fuse:
        w1.main_grad = torch.full(w1.shape, 0.25)
        w2.main_grad = torch.full(w2.shape, 0.25)
    x_rows = None
    if fp8_rows:  # FP8 dispatch: the rows arrive quantized, the input gradient goes back through a carrier
        packed = fp8.pack_rows(x.detach(), recipe)
        x_rows = fp8.unpack_rows(packed, fp8.carrier(x, x.shape[0], lambda g: g), recipe)
    y = _chain(fused, x, splits, w1, b1, w2, rs, recipe, activation, fuse, x_rows)
    y.backward(gy)
    grads = [x.grad, w2.main_grad if fuse else w2.grad, w1.main_grad if fuse else w1.grad]
    grads += [None if b1 is None else b1.grad, None if rs is None else rs.grad]
    return [y.detach()] + grads


def _inputs(gen, M, H, F, E, activation, dtype, bias, scale):
    W = 2 * F if gated_kind(activation) else F
    x = torch.randn(M, H, generator=gen).to(dtype)
    w1 = (torch.randn(E, W, H, generator=gen) * 3 / H ** 0.5).to(dtype)  # h ~ N(0, 3): the clamps are crossed
    w2 = (torch.randn(E, H, F, generator=gen) / F ** 0.5).to(dtype)
    b1 = (torch.randn(E, W, generator=gen) * 0.5).to(dtype) if bias else None
    rs = None if scale is None else torch.rand(M, generator=gen).to(scale)
    gy = torch.randn(M, H, generator=gen).to(dtype)
    return x, w1, b1, w2, rs, gy


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["blockwise", "mxfp8"])
def test_fused_fc1_activation_equals_the_separate_nodes(activation, kind):
    """fc1 and the activation as one node give the forward output and every gradient (x, fc1 and fc2 weights, fc1
    bias, row scale) of fc1's node followed by quantize_activation, bit for bit: bf16 and fp32, with and without a
    row scale, zero-token experts, one expert taking every row, rows past sum(m_splits), fc1 with a bias (grad_h
    then written, as before)."""
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(hash((activation, kind)) % 2**31)
    M, H, F, E = 48, 64, 32, 4
    cases = [([20, 0, 28, 0], torch.bfloat16, None, False), ([0, 48, 0, 0], torch.bfloat16, torch.float32, False),
             ([9, 0, 17, 5], torch.float32, torch.float32, False),  # 17 rows past sum(m_splits)
             ([16, 16, 0, 16], torch.bfloat16, torch.bfloat16, False), ([30, 0, 0, 18], torch.bfloat16, None, True)]
    for splits, dtype, scale, bias in cases:
        inputs = _inputs(gen, M, H, F, E, activation, dtype, bias, scale)
        ms = torch.tensor(splits)
        with moe_graph.fp8.autocast(recipe=recipe):
            want = _run(False, inputs, ms, recipe, activation)
            got = _run(True, inputs, ms, recipe, activation)
        names = ["y", "dx", "dw2", "dw1", "db1", "drow_scale"]
        for n, a, b in zip(names, got, want):
            assert _same(a, b), (n, splits, dtype, scale, bias)
        assert want[1].abs().max() > 0 and want[3].abs().max() > 0  # gradients that reach fc1 at all
        if scale is not None:
            assert want[5].abs().max() > 0


@pytest.mark.parametrize("kind", ["blockwise", "mxfp8", "tensor"])
def test_fused_fc1_activation_fused_main_grad_and_fp8_rows(kind):
    """The one node with the weight gradients into main_grad (accumulated) and with FP8-dispatched input rows
    (QuantizedRows): every result bit-equal to the separate nodes."""
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(7)
    inputs = _inputs(gen, 40, 64, 32, 3, "swiglu", torch.bfloat16, False, torch.float32)
    ms = torch.tensor([12, 0, 21])
    for fuse, rows in ((True, False), (False, kind != "tensor")):
        with moe_graph.fp8.autocast(recipe=recipe):
            want = _run(False, inputs, ms, recipe, "swiglu", fuse, rows)
            got = _run(True, inputs, ms, recipe, "swiglu", fuse, rows)
        assert all(_same(a, b) for a, b in zip(got, want)), (fuse, rows)


# --------------------------------------------------------------------------------------- what it saves --
def _cost_meter(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # as when run as a script: benchmarks/common.py
    spec = importlib.util.spec_from_file_location("bench_moe_cost", os.path.join(ROOT, "benchmarks",
                                                                                 "bench_moe_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CostMeter


@pytest.mark.parametrize("scale", [None, torch.float32])
def test_fused_activation_backward_bytes(scale, capsys, monkeypatch):
    """The backward's non-GEMM bytes per token (bench_moe_cost's TorchDispatchMode count) of fc1 -> activation ->
    fc2 in FP8 (bf16, SwiGLU), before and after: the fusion leaves out exactly grad_h's write and read
    (2 x 2 x 2F bytes per token), with a row scale too (its gradient written by the same op: no second read of g,
    h and s)."""
    CostMeter = _cost_meter(monkeypatch)
    recipe = fp8.as_recipe("blockwise")
    M, H, F, E = 64, 128, 96, 4
    gen = torch.Generator().manual_seed(3)
    x0, w1, _, w2, rs, gy = _inputs(gen, M, H, F, E, "swiglu", torch.bfloat16, False, scale)
    ms = torch.tensor([20, 0, 30, 14])
    per_token = {}
    for fused in (False, True):
        x = x0.clone().requires_grad_()
        ww1, ww2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        r = None if rs is None else rs.clone().requires_grad_()
        meter = CostMeter([x, ww1, ww2, gy, ms] + ([r] if r is not None else []))
        with moe_graph.fp8.autocast(recipe=recipe):
            y = _chain(fused, x, ms, ww1, None, ww2, r, recipe, "swiglu")
            with meter:
                meter.phase = "bwd"
                y.backward(gy)
        per_token[fused] = meter.bytes["bwd"] / M
        assert not meter.syncs
    es = 2  # bf16
    expect = 2 * es * 2 * F  # grad_h [M, 2F] written by the activation backward and read by the quantizer
    saved = per_token[False] - per_token[True]
    with capsys.disabled():
        print(f"\nFP8 backward non-GEMM bytes/token (F={F}, bf16, row_scale={scale is not None}): "
              f"{per_token[False]:.0f} -> {per_token[True]:.0f} (saved {saved:.0f})")
    assert saved == expect, (per_token, expect)


ZERO_FILL_OPS = ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like", "new_full")


@pytest.mark.parametrize("fused", [False, True])
def test_no_zero_gradients_for_the_fp8_copies(fused, monkeypatch):
    """The FP8 copies the activation node returns (bytes and scales, non-differentiable) get no gradient tensor:
    autograd writes no zeros for them in the backward (before: one zero tensor each, 4 x [rows, ...] writes per
    step), in the one node and in the separate nodes (``quantize_activation``'s)."""
    CostMeter = _cost_meter(monkeypatch)
    recipe = fp8.as_recipe("blockwise")
    gen = torch.Generator().manual_seed(5)
    x0, w1, _, w2, rs, gy = _inputs(gen, 64, 128, 96, 4, "swiglu", torch.bfloat16, False, torch.float32)
    x, ww1, ww2 = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    r = rs.clone().requires_grad_()
    ms = torch.tensor([20, 0, 30, 14])
    meter = CostMeter([x, ww1, ww2, gy, ms, r])
    with moe_graph.fp8.autocast(recipe=recipe):
        y = _chain(fused, x, ms, ww1, None, ww2, r, recipe, "swiglu")
        with meter:
            meter.phase = "bwd"
            y.backward(gy)
    zero_fills = {k: n for k, n in meter.ops["bwd"].items() if k.split(".")[-1] in ZERO_FILL_OPS}
    assert not zero_fills, zero_fills
    assert r.grad is not None and r.grad.abs().max() > 0 and ww1.grad.abs().max() > 0
