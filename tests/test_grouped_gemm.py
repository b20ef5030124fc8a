"""CPU semantics of the grouped GEMM ops against an independent float64 reference."""

import pytest
import torch

import moe_graph
from moe_graph.ops import check_errors, gmm, grouped_bias_grad, grouped_gemm, grouped_gemm_wgrad, read_error_flag
from moe_graph.ops._lib import ops
from moe_graph.testing.grouped_gemm_ref import random_splits, ref_grouped_gemm, ref_wgrad, rel_err

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def _clean_flag():
    read_error_flag("cpu")
    yield
    read_error_flag("cpu")


def _data(gen, M, K, N, E, dtype, trans_b=True):
    a = torch.randn(M, K, generator=gen).to(dtype)
    shape = (E, N, K) if trans_b else (E, K, N)
    w = (torch.randn(*shape, generator=gen) / K**0.5).to(dtype)
    return a, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("as_list", [False, True])
def test_forward_matches_reference(gen, dtype, trans_b, as_list):
    E, K, N = 5, 40, 24  # not multiples of any tile
    splits = random_splits(E, 37, gen)
    splits[1] = 0  # a zero-token expert
    M = sum(splits) + 7  # capacity rows past the sum
    a, w = _data(gen, M, K, N, E, dtype, trans_b)
    b = list(w.unbind(0)) if as_list else w
    y = grouped_gemm(a, b, torch.tensor(splits), trans_b=trans_b)
    assert y.shape == (M, N) and y.dtype == dtype
    ref = ref_grouped_gemm(a, w, splits, trans_b)
    assert rel_err(y, ref) < TOL[dtype]
    assert torch.all(y[sum(splits):] == 0)


@pytest.mark.parametrize("splits_kind", ["list", "int32", "int64"])
def test_splits_forms_agree(gen, splits_kind):
    E, K, N = 4, 16, 8
    splits = random_splits(E, 20, gen)
    a, w = _data(gen, 20, K, N, E, torch.float32)
    s = {"list": splits, "int32": torch.tensor(splits, dtype=torch.int32), "int64": torch.tensor(splits)}[splits_kind]
    torch.testing.assert_close(grouped_gemm(a, w, s), ref_grouped_gemm(a, w, splits).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "E,pattern", [(1, "all"), (8, "one_takes_all"), (256, "random"), (1024, "random"), (64, "zipf")]
)
def test_expert_count_patterns(gen, E, pattern):
    K, N, T = 24, 16, 300
    if pattern == "all":
        splits = [T]
    elif pattern == "one_takes_all":
        splits = [0] * E
        splits[int(torch.randint(0, E, (1,), generator=gen))] = T
    elif pattern == "zipf":
        splits = random_splits(E, T, gen, zipf=1.2)
    else:
        splits = random_splits(E, T, gen)
    a, w = _data(gen, T, K, N, E, torch.bfloat16)
    y = grouped_gemm(a, w, torch.tensor(splits))
    assert rel_err(y, ref_grouped_gemm(a, w, splits)) < 1e-2


def test_bias_added_per_expert(gen):
    E, K, N = 3, 16, 8
    splits = [4, 0, 5]
    a, w = _data(gen, 12, K, N, E, torch.float32)
    bias = torch.randn(E, N, generator=gen)
    y = grouped_gemm(a, w, splits, bias=bias)
    torch.testing.assert_close(y, ref_grouped_gemm(a, w, splits, bias=bias).float(), rtol=1e-5, atol=1e-5)
    y2 = grouped_gemm(a, w, splits, bias=list(bias.unbind(0)))
    torch.testing.assert_close(y, y2)
    assert torch.all(y[9:] == 0)  # capacity rows get no bias


def test_out_argument_overwrites_every_row(gen):
    E, K, N = 3, 8, 8
    a, w = _data(gen, 10, K, N, E, torch.float32)
    out = torch.full((10, N), float("nan"))
    r = grouped_gemm(a, w, [3, 3, 2], out=out)
    assert r is out and not torch.isnan(out).any()
    torch.testing.assert_close(out, ref_grouped_gemm(a, w, [3, 3, 2]).float())


def test_overflow_is_clamped_and_flagged(gen):
    E, K, N = 3, 8, 8
    a, w = _data(gen, 10, K, N, E, torch.float32)
    y = grouped_gemm(a, w, [4, 4, 4])  # sum 12 > 10 rows
    torch.testing.assert_close(y, ref_grouped_gemm(a, w, [4, 4, 4]).float())  # expert 2 keeps its first 2 rows
    with pytest.raises(RuntimeError, match="exceeded the rows"):
        check_errors("cpu")
    check_errors("cpu")  # cleared by the first check


def test_negative_split_is_flagged(gen):
    a, w = _data(gen, 6, 8, 8, 2, torch.float32)
    y = grouped_gemm(a, w, [-3, 4])
    torch.testing.assert_close(y, ref_grouped_gemm(a, w, [0, 4]).float())
    assert read_error_flag("cpu") == 2


# ------------------------------------------------------------------------------------------------- wgrad --
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wgrad_matches_reference(gen, dtype):
    E, K, N = 4, 24, 16
    splits = [5, 0, 9, 3]
    M = 20
    a = torch.randn(M, K, generator=gen).to(dtype)
    dy = torch.randn(M, N, generator=gen).to(dtype)
    dw = grouped_gemm_wgrad(a, dy, torch.tensor(splits, dtype=torch.int32))
    assert dw.shape == (E, N, K) and dw.dtype == dtype
    ref = ref_wgrad(a, dy, splits)
    assert rel_err(dw, ref) < TOL[dtype]
    assert torch.all(dw[1] == 0)  # zero-token expert


@pytest.mark.parametrize("out_kind", ["fp32_tensor", "fp32_list", "bf16_tensor"])
@pytest.mark.parametrize("accumulate", [False, True, "mask"])
def test_wgrad_out_accumulate(gen, out_kind, accumulate):
    E, K, N, M = 5, 16, 8, 30
    splits = [6, 0, 10, 0, 9]
    a = torch.randn(M, K, generator=gen).bfloat16()
    dy = torch.randn(M, N, generator=gen).bfloat16()
    odt = torch.bfloat16 if out_kind == "bf16_tensor" else torch.float32
    init = torch.randn(E, N, K, generator=gen).to(odt)
    out = init.clone()
    if not accumulate:
        out[1] = float("nan")  # overwritten zero-token expert must become zeros, not NaN
    acc_list = [bool(x) for x in torch.randint(0, 2, (E,), generator=gen)] if accumulate == "mask" else [accumulate] * E
    acc_arg = torch.tensor(acc_list) if accumulate == "mask" else accumulate
    target = list(out.unbind(0)) if out_kind == "fp32_list" else out
    grouped_gemm_wgrad(a, dy, splits, out=target, accumulate=acc_arg)
    ref = ref_wgrad(a, dy, splits, out_init=init, accumulate=acc_list)
    assert rel_err(out, ref) < (1e-2 if odt == torch.bfloat16 else 1e-5)
    for e in (1, 3):
        expect = init[e] if acc_list[e] else torch.zeros_like(init[e])
        assert torch.equal(out[e], expect)


def test_bias_grad(gen):
    dy = torch.randn(12, 8, generator=gen)
    db = grouped_bias_grad(dy, [3, 0, 7])
    torch.testing.assert_close(db, torch.stack([dy[:3].sum(0), torch.zeros(8), dy[3:10].sum(0)]))


# ------------------------------------------------------------------------------------------------ errors --
@pytest.mark.parametrize(
    "case,match",
    [
        ("a_int", r"a must have dtype"),
        ("a_noncontig", r"a must be contiguous"),
        ("a_1d", r"a must be a 2-D tensor"),
        ("b_dtype", r"b must have the dtype of a"),
        ("b_shape", r"b must have shape \[E, N, K\]"),
        ("list_shape", r"b\[1\] must have shape"),
        ("splits_len", r"m_splits must have one entry per expert \(3\), got 2"),
        ("splits_dtype", r"m_splits must have dtype Int or Long"),
        ("splits_2d", r"m_splits must be a 1-D tensor"),
        ("bias_shape", r"bias must have shape \[3, 8\]"),
        ("out_shape", r"out must have shape \[10, 8\]"),
    ],
)
def test_bad_inputs_name_the_tensor(gen, case, match):
    a, w = _data(gen, 10, 16, 8, 3, torch.float32)
    s = torch.tensor([3, 3, 4])
    kw = {}
    if case == "a_int":
        a = a.long()
    elif case == "a_noncontig":
        a = torch.randn(16, 10, generator=gen).t()
    elif case == "a_1d":
        a = a.flatten()
    elif case == "b_dtype":
        w = w.double()
    elif case == "b_shape":
        w = torch.randn(3, 8, 15)
    elif case == "list_shape":
        w = [w[0], torch.randn(8, 15), w[2]]
    elif case == "splits_len":
        s = torch.tensor([3, 7])
    elif case == "splits_dtype":
        s = s.float()
    elif case == "splits_2d":
        s = s[None]
    elif case == "bias_shape":
        kw["bias"] = torch.randn(3, 9)
    elif case == "out_shape":
        kw["out"] = torch.empty(10, 9)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        grouped_gemm(a, w, s, **kw)


def test_wgrad_bad_inputs(gen):
    a = torch.randn(10, 16)
    dy = torch.randn(9, 8)
    with pytest.raises(RuntimeError, match="dy must have as many rows as a"):
        grouped_gemm_wgrad(a, dy, [5, 5])
    dy = torch.randn(10, 8)
    with pytest.raises(RuntimeError, match=r"out must have shape \[2, 8, 16\]"):
        grouped_gemm_wgrad(a, dy, [5, 5], out=torch.empty(2, 8, 15), accumulate=True)
    with pytest.raises(RuntimeError, match="accumulate_mask must have dtype Bool"):
        grouped_gemm_wgrad(a, dy, [5, 5], out=torch.empty(2, 8, 16), accumulate=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="accumulate needs out="):
        grouped_gemm_wgrad(a, dy, [5, 5], accumulate=True)


# ---------------------------------------------------------------------------------------------- autograd --
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("as_list", [False, True])
def test_gradcheck_float64(gen, trans_b, as_list):
    E, K, N = 3, 5, 4
    splits = torch.tensor([2, 0, 3])
    a = torch.randn(7, K, dtype=torch.float64, generator=gen, requires_grad=True)
    shape = (E, N, K) if trans_b else (E, K, N)
    w = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(E, N, dtype=torch.float64, generator=gen, requires_grad=True)
    if as_list:
        ws = [w[e].detach().clone().requires_grad_() for e in range(E)]
        fn = lambda a, bias, *ws: grouped_gemm(a, list(ws), splits, trans_b=trans_b, bias=bias)
        assert torch.autograd.gradcheck(fn, (a, bias, *ws))
    else:
        fn = lambda a, w, bias: grouped_gemm(a, w, splits, trans_b=trans_b, bias=bias)
        assert torch.autograd.gradcheck(fn, (a, w, bias))


def test_backward_matches_reference_bf16(gen):
    E, K, N = 4, 32, 16
    splits = [7, 0, 12, 5]
    M = 30
    a = torch.randn(M, K, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) / 6).bfloat16().requires_grad_()
    y = grouped_gemm(a, w, torch.tensor(splits))
    g = torch.randn(M, N, generator=gen).bfloat16()
    y.backward(g)
    a64 = a.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = torch.cat([a64[s : s + c] @ w64[e].t() for e, (s, c) in enumerate([(0, 7), (7, 0), (7, 12), (19, 5)])])
    ref = torch.cat([ref, torch.zeros(M - 24, N, dtype=torch.float64)])
    ref.backward(g.double())
    assert rel_err(a.grad, a64.grad) < 1e-2 and rel_err(w.grad, w64.grad) < 1e-2
    assert torch.all(a.grad[24:] == 0)


def test_gmm_is_grouped_gemm_package_compatible(gen):
    E, K, N = 3, 16, 8
    batch = torch.tensor([4, 2, 6])  # CPU int64, as grouped_gemm's gmm takes it
    a = torch.randn(12, K, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(E, K, N, generator=gen, dtype=torch.float64, requires_grad=True)
    y = gmm(a, b, batch)
    ref = torch.cat([a[:4] @ b[0], a[4:6] @ b[1], a[6:] @ b[2]])
    torch.testing.assert_close(y, ref)
    bt = b.detach().transpose(1, 2).contiguous().requires_grad_()
    torch.testing.assert_close(gmm(a, bt, batch, trans_b=True), ref)
    y.sum().backward()
    ref_a = torch.cat([b[0].sum(1).expand(4, K), b[1].sum(1).expand(2, K), b[2].sum(1).expand(6, K)])
    torch.testing.assert_close(a.grad, ref_a.detach())


# --------------------------------------------------------------------------------------- opcheck / compile --
def test_opcheck(gen):
    a, w = _data(gen, 10, 16, 8, 3, torch.float32)
    s = torch.tensor([3, 0, 5])
    bias = torch.randn(3, 8, generator=gen)
    torch.library.opcheck(ops.grouped_gemm.default, (a, [w], s, True, bias))
    torch.library.opcheck(ops.grouped_gemm.default, (a, list(w.unbind(0)), s, True, None))
    torch.library.opcheck(ops.grouped_gemm_out.default, (a, [w], s, True, None, torch.empty(10, 8)))
    dy = torch.randn(10, 8, generator=gen)
    torch.library.opcheck(ops.grouped_gemm_wgrad.default, (a, dy, s, torch.float32))
    torch.library.opcheck(
        ops.grouped_gemm_wgrad_out.default, (a, dy, s, [torch.zeros(3, 8, 16)], True, torch.tensor([True, False, True]))
    )
    torch.library.opcheck(ops.grouped_bias_grad.default, (dy, s))


def _grad_inputs(gen, trans_b, as_list, with_bias, dtype=torch.float64):
    E, K, N = 3, 6, 4
    a = torch.randn(9, K, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(*((E, N, K) if trans_b else (E, K, N)), generator=gen, dtype=dtype)
    ws = [x.clone().requires_grad_() for x in w.unbind(0)] if as_list else [w.requires_grad_()]
    bias = torch.randn(E, N, generator=gen, dtype=dtype).requires_grad_() if with_bias else None
    return a, ws, torch.tensor([3, 0, 4]), bias  # 2 capacity rows


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_with_grad(gen, trans_b, as_list, with_bias):
    # All default opcheck utils, test_autograd_registration and the aot_dispatch backward included.
    a, ws, s, bias = _grad_inputs(gen, trans_b, as_list, with_bias)
    torch.library.opcheck(ops.grouped_gemm.default, (a, ws, s, trans_b, bias))


def test_opcheck_wgrad_and_bias_grad_with_grad(gen):
    a = torch.randn(10, 16, generator=gen, requires_grad=True)
    dy = torch.randn(10, 8, generator=gen, requires_grad=True)
    s = torch.tensor([3, 0, 5])
    torch.library.opcheck(ops.grouped_gemm_wgrad.default, (a, dy, s, None))
    torch.library.opcheck(ops.grouped_gemm_wgrad.default, (a, dy, s, torch.float32))
    torch.library.opcheck(ops.grouped_bias_grad.default, (dy, s))


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("as_list", [False, True])
def test_op_gradcheck_and_gradgradcheck(gen, trans_b, as_list):
    # The op itself (not only the Python wrapper) differentiates, twice: its backward uses differentiable ops.
    a, ws, s, bias = _grad_inputs(gen, trans_b, as_list, True)
    fn = lambda a, bias, *ws: ops.grouped_gemm(a, list(ws), s, trans_b, bias)
    assert torch.autograd.gradcheck(fn, (a, bias, *ws))
    assert torch.autograd.gradgradcheck(fn, (a, bias, *ws))


def test_wgrad_and_bias_grad_gradcheck(gen):
    a = torch.randn(9, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    for s in (torch.tensor([3, 0, 4]), torch.tensor([-2, 6, 9])):  # capacity rows; negative count and overflow
        assert torch.autograd.gradcheck(lambda a, dy: grouped_gemm_wgrad(a, dy, s), (a, dy))
        assert torch.autograd.gradcheck(lambda dy: grouped_bias_grad(dy, s), (dy,))
    read_error_flag("cpu")


def test_wgrad_out_with_grad_raises(gen):
    a = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        grouped_gemm_wgrad(a, torch.randn(4, 8), [2, 2], out=torch.zeros(2, 8, 8))


def test_torch_compile_fullgraph(gen):
    a, w = _data(gen, 10, 16, 8, 3, torch.float32)
    s = torch.tensor([3, 2, 5])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(a, w, s):
        return torch.relu(grouped_gemm(a, w, s)) * 2

    torch.testing.assert_close(f(a, w, s), torch.relu(grouped_gemm(a, w, s)) * 2)


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("as_list", [False, True])
def test_torch_compile_fullgraph_backward(gen, trans_b, as_list):
    a, ws, s, bias = _grad_inputs(gen, trans_b, as_list, True, dtype=torch.float32)
    g = torch.randn(a.shape[0], bias.shape[1], generator=gen)
    leaves = [a, bias, *ws]

    def f(a, ws, s, bias):
        return torch.tanh(grouped_gemm(a, ws, s, trans_b=trans_b, bias=bias)) * 2

    def grads(fn):
        return torch.autograd.grad(fn(a, ws, s, bias), leaves, g)

    torch._dynamo.reset()
    compiled = grads(torch.compile(f, backend="aot_eager", fullgraph=True))
    for got, ref in zip(compiled, grads(f)):
        torch.testing.assert_close(got, ref)


def test_top_level_reexports():
    assert moe_graph.grouped_gemm is grouped_gemm and moe_graph.gmm is gmm
    assert moe_graph.check_errors is check_errors


def test_selfcheck_main_passes():
    from moe_graph.selfcheck import main

    assert main(["--seed", "1"]) == 0


# ------------------------------------------------------------------- outputs validated before any write --
def _wgrad_data(gen, E=3, M=12, K=8, N=8):
    return torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen), [4, 3, 5][:E] + [0] * max(0, E - 3)


def test_wgrad_out_inference_tensor_rejected_before_any_write(gen):
    a, dy, splits = _wgrad_data(gen)
    t0, t1 = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    with torch.inference_mode():
        t2 = torch.zeros(8, 8)
    before = (t0.clone(), t1.clone())
    with pytest.raises(RuntimeError, match=r"out\[2\] is an inference tensor"):
        grouped_gemm_wgrad(a, dy, splits, out=[t0, t1, t2])
    assert torch.equal(t0, before[0]) and torch.equal(t1, before[1])


def test_wgrad_out_requires_grad_rejected_before_any_write(gen):
    a, dy, splits = _wgrad_data(gen)
    outs = [torch.randn(8, 8, generator=gen) for _ in range(3)]
    outs[1].requires_grad_(True)
    before = [o.detach().clone() for o in outs]
    with pytest.raises(RuntimeError, match=r"out\[1\] requires grad"):
        ops.grouped_gemm_wgrad_out(a, dy, torch.tensor(splits), outs, False, None)
    assert all(torch.equal(o.detach(), b) for o, b in zip(outs, before))


@pytest.mark.parametrize("case", ["same_twice", "overlapping_views", "out_is_a", "out_overlaps_dy", "stacked_is_dy"])
def test_wgrad_out_overlap_rejected(gen, case):
    a, dy, splits = _wgrad_data(gen)
    buf = torch.randn(3 * 64 + 8, generator=gen)
    t = [torch.randn(8, 8, generator=gen) for _ in range(3)]
    if case == "same_twice":
        out, match = [t[0], t[1], t[0]], r"out\[(0|2)\] overlaps out\[(0|2)\]"
    elif case == "overlapping_views":
        out, match = [buf[:64].view(8, 8), buf[8:72].view(8, 8), t[2]], r"out\[(0|1)\] overlaps out\[(0|1)\]"
    elif case == "out_is_a":
        a = torch.randn(64, 1, generator=gen).expand(64, 1).contiguous().view(8, 8)
        dy = torch.randn(8, 8, generator=gen)
        out, splits, match = [t[0], a, t[2]], [4, 2, 2], r"out\[1\] overlaps a"
    elif case == "out_overlaps_dy":
        dy = buf[: 12 * 8].view(12, 8)
        out, match = [t[0], buf[64:128].view(8, 8), t[2]], r"out\[1\] overlaps dy"
    else:
        big = torch.randn(3 * 8 * 8, generator=gen)
        dy = big[: 12 * 8].view(12, 8)
        out, match = big.view(3, 8, 8), r"out overlaps dy"
    before = [x.clone() for x in (out if isinstance(out, list) else [out])]
    with pytest.raises(RuntimeError, match=match):
        grouped_gemm_wgrad(a, dy, splits, out=out, accumulate=True)
    assert all(torch.equal(x, b) for x, b in zip(out if isinstance(out, list) else [out], before))


@pytest.mark.parametrize("case", ["partial_a", "alias_a", "alias_w", "list_w", "bias"])
def test_forward_out_overlap_rejected(gen, case):
    K = N = 8
    buf = torch.randn(11 * K, generator=gen)
    a = torch.randn(10, K, generator=gen)
    w = torch.randn(2, N, K, generator=gen)
    bias = None
    if case == "partial_a":  # the example: out = buf[:10], a = buf[1:]
        a, out, match = buf[K:].view(10, K), buf[: 10 * K].view(10, N), r"out overlaps a"
    elif case == "alias_a":
        out, match = a, r"out overlaps a"
    elif case == "alias_w":
        big = torch.randn(2 * N * K, generator=gen)
        w, out, match = big.view(2, N, K), big[48 : 48 + 10 * N].view(10, N), r"out overlaps b"
    elif case == "list_w":
        big = torch.randn(10 * N, generator=gen)
        w, out, match = [torch.randn(N, K, generator=gen), big[8:72].view(N, K)], big.view(10, N), r"out overlaps b\[1\]"
    else:
        big = torch.randn(10 * N, generator=gen)
        bias, out, match = big[16:32].view(2, N), big.view(10, N), r"out overlaps bias"
    before = out.clone()
    with pytest.raises(RuntimeError, match=match):
        grouped_gemm(a, w, [4, 6], bias=bias, out=out)
    assert torch.equal(out, before)


def test_forward_out_disjoint_views_of_one_buffer_are_fine(gen):
    buf = torch.randn(20 * 8, generator=gen)
    a, out = buf[: 10 * 8].view(10, 8), buf[10 * 8 :].view(10, 8)
    w = torch.randn(2, 8, 8, generator=gen)
    ref = ref_grouped_gemm(a.clone(), w, [4, 6]).float()
    grouped_gemm(a, w, [4, 6], out=out)
    torch.testing.assert_close(out, ref)


def test_forward_out_inference_tensor_rejected():
    a, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    with torch.inference_mode():
        out = torch.full((4, 8), 3.0)
    with pytest.raises(RuntimeError, match="out is an inference tensor"):
        grouped_gemm(a, w, [2, 2], out=out)
    assert torch.all(out == 3.0)


# ------------------------------------------------------------------------------ m_splits edge values --
@pytest.mark.parametrize("splits", [[2**62, 2**62, 5], [2**63 - 1, 1], [3, 2**63 - 1, 2**63 - 1], [-(2**63), 12]])
def test_huge_splits_clamp_without_int64_overflow(gen, splits):
    E, K, N, M = len(splits), 8, 8, 10
    a, w = _data(gen, M, K, N, E, torch.float64)
    y = grouped_gemm(a, w, torch.tensor(splits, dtype=torch.int64))
    ref = ref_grouped_gemm(a, w, splits)  # Python ints: exact
    torch.testing.assert_close(y, ref)
    dw = grouped_gemm_wgrad(a, y, torch.tensor(splits, dtype=torch.int64))
    torch.testing.assert_close(dw, ref_wgrad(a, y, splits))
    db = grouped_bias_grad(y, torch.tensor(splits, dtype=torch.int64))
    assert db.shape == (E, N)
    with pytest.raises(RuntimeError, match="m_splits"):
        check_errors("cpu")


@pytest.mark.parametrize(
    "splits,match,exc",
    [
        ([4, 2.5, 4], r"m_splits\[1\] must be an int .*float 2.5", TypeError),
        ([4, None, 6], r"m_splits\[1\] must be an int .*NoneType", TypeError),
        ([True, 9], r"m_splits\[0\] must be an int .*bool", TypeError),
        ([4, 2**64], r"m_splits\[1\] = .* does not fit in int64", ValueError),
        (None, r"m_splits must be a tensor or a list of ints, got NoneType", TypeError),
    ],
)
def test_bad_python_splits_name_m_splits(gen, splits, match, exc):
    a, w = _data(gen, 10, 8, 8, 3 if splits is None or len(splits) != 2 else 2, torch.float32)
    with pytest.raises(exc, match=match):
        grouped_gemm(a, w, splits)
    with pytest.raises(exc, match=match):
        grouped_gemm_wgrad(a, torch.randn(10, 8), splits)


def test_integer_like_python_splits_accepted(gen):
    np = pytest.importorskip("numpy")
    a, w = _data(gen, 10, 8, 8, 3, torch.float32)
    y = grouped_gemm(a, w, [np.int64(4), torch.tensor(3), 3])
    torch.testing.assert_close(y, ref_grouped_gemm(a, w, [4, 3, 3]).float())


# --------------------------------------------------------------------------- K = 0 and the rounding rule --
@pytest.mark.parametrize("with_bias", [False, True])
def test_k_zero_gives_bias_rows_and_zero_tail(gen, with_bias):
    E, N = 3, 8
    splits = [2, 0, 3]
    a = torch.randn(7, 0).bfloat16()
    w = torch.randn(E, N, 0).bfloat16()
    bias = torch.randn(E, N, generator=gen).bfloat16() if with_bias else None
    out = torch.full((7, N), float("nan")).bfloat16()
    grouped_gemm(a, w, splits, bias=bias, out=out)
    torch.testing.assert_close(out, ref_grouped_gemm(a, w, splits, bias=bias).bfloat16(), rtol=0, atol=0)


def test_bias_is_added_in_fp32_before_the_one_rounding(gen):
    """y = round_bf16(fp32(a_e @ W_e) + bias_e) exactly: the rounding rule of cuBLASLt/TE and of the CUDA epilogue
    (not round(round(acc) + bias), which differs in the last bit for some elements)."""
    E, K, N = 2, 64, 64
    splits = [50, 78]
    a, w = _data(gen, 128, K, N, E, torch.bfloat16)
    bias = (torch.randn(E, N, generator=gen) * 3).bfloat16()
    y = grouped_gemm(a, w, splits, bias=bias)
    acc = torch.cat([a[:50].float() @ w[0].float().t(), a[50:].float() @ w[1].float().t()])
    b = torch.cat([bias[0].float().expand(50, N), bias[1].float().expand(78, N)])
    one_rounding = (acc + b).bfloat16()
    two_roundings = (acc.bfloat16().float() + b).bfloat16()
    assert torch.equal(y, one_rounding)
    assert not torch.equal(one_rounding, two_roundings)  # the case distinguishes the two rules
