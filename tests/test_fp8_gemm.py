"""Scaled (FP8) grouped GEMM, CPU semantics: forward / dgrad form and wgrad against a float64 reference on the
dequantized operands (per-K-block products, the same scales), within fp32 rounding; zero-token experts, capacity
rows past sum(m_splits), partial blocks, fp32 and E8M0 scales, bias, main_grad accumulation."""

import pytest
import torch

from moe_graph.ops import fp8

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without the FP8 ops")


def _ref_gemm(a, sa, b, sb, splits, bk, bn, bias):
    """float64: out[r, n] = sum_kb (a . b)_kb * sa[r, kb] * sb[e, n // bn, kb]."""
    M, K = a.shape
    E, N, _ = b.shape
    af, bf = a.double(), b.double()
    sa, sb = sa.double(), sb.double()
    bk_, bn_ = bk or K, bn or N
    out = torch.zeros(M, N, dtype=torch.float64)
    r = 0
    for e, m in enumerate(splits):
        for kb in range(-(-K // bk_)):
            ks = slice(kb * bk_, (kb + 1) * bk_)
            part = af[r:r + m, ks] @ bf[e, :, ks].T
            out[r:r + m] += part * sa[r:r + m, kb:kb + 1] * sb[e, torch.arange(N) // bn_, kb][None, :]
        if bias is not None:
            out[r:r + m] += bias[e].double()
        r += m
    return out


def _bound(a, sa, b, sb, splits, bk, bn):
    """fp32 rounding bound: K * 2^-23 times the sum of |products| (the float64 reference on absolute values)."""
    return _ref_gemm(a.abs() if a.dtype.is_floating_point else a.float().abs(), sa.float().abs(), b.float().abs(),
                     sb.float().abs(), splits, bk, bn, None) * (a.shape[1] + 4) * 2.0 ** -23 + 1e-30


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensor"])
def test_forward_equals_float64_reference(recipe):
    gen = torch.Generator().manual_seed(1)
    M, K, N, E = 200, 300, 70, 4
    splits = [60, 0, 100, 17]  # zero-token expert, 23 capacity rows past the sum
    ms = torch.tensor(splits, dtype=torch.int32)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, N, K, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(E, N, generator=gen)
    if recipe == "blockwise":
        qa, sa = fp8.quantize(x, ms, tiles="1x128")
        qb, sb = fp8.quantize(w, tiles="128x128")
        bk, bn = 128, 128
    elif recipe == "mxfp8":
        qa, sa = fp8.quantize(x, ms, tiles="1x32")
        qb, sb = fp8.quantize(w, tiles="1x32")
        bk, bn = 32, 1
    else:  # per-tensor: expand the per-group scale to the rows (sync-free gather)
        qa, sg = fp8.quantize(x, ms, tiles="tensor")
        qb, sb = fp8.quantize(w, tiles="tensor")
        group = torch.searchsorted(torch.cumsum(ms.long(), 0), torch.arange(M), right=True).clamp(max=E - 1)
        sa = sg[group]
        bk, bn = 0, 0
    y = fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=bk, block_n=bn, bias=bias, out_dtype=torch.float32)
    ref = _ref_gemm(qa.float(), sa.float(), qb.float(), sb.float(), splits, bk, bn, bias)
    tol = _bound(qa.float(), sa, qb, sb, splits, bk, bn) + bias.abs().max().double() * 2.0 ** -23
    assert torch.all((y.double() - ref).abs() <= tol)
    assert torch.equal(y[177:], torch.zeros(23, N))
    # bf16 output: the fp32 result rounded once
    yb = fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=bk, block_n=bn, bias=bias, out_dtype=torch.bfloat16)
    assert torch.equal(yb, y.to(torch.bfloat16))
    # and close to the unquantized product (FP8's accuracy, not a rounding check)
    full = torch.cat([x[:60].float() @ w[0].float().T, x[60:160].float() @ w[2].float().T,
                      x[160:177].float() @ w[3].float().T])
    b_rows = torch.cat([bias[0].expand(60, N), bias[2].expand(100, N), bias[3].expand(17, N)])
    assert (y[:177] - (full + b_rows)).abs().max() < 0.1 * (full.abs().max() + 1)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensor"])
def test_wgrad_equals_float64_reference(recipe):
    gen = torch.Generator().manual_seed(2)
    M, K, N = 300, 96, 40
    splits = [130, 0, 1, 150]
    E = len(splits)
    ms = torch.tensor(splits)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    dy = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    tiles, bm = {"blockwise": ("128x1", 128), "mxfp8": ("32x1", 32), "tensor": ("tensor", 0)}[recipe]
    qd, sd = fp8.quantize(dy, ms, tiles=tiles, transpose=True)
    qx, sx = fp8.quantize(x, ms, tiles=tiles, transpose=True)
    if recipe == "tensor":  # one scale per group for every row of the transposed copy
        sd, sx = sd.expand(N, E).contiguous(), sx.expand(K, E).contiguous()
    main_grad = torch.randn(E, N, K, generator=gen)
    start = main_grad.clone()
    out = fp8.scaled_grouped_wgrad(qd, sd, qx, sx, ms, block_m=bm, out=main_grad, accumulate=True)
    assert out is main_grad
    fresh = fp8.scaled_grouped_wgrad(qd, sd, qx, sx, ms, block_m=bm)
    # float64 reference over the groups' tiles
    ref = torch.zeros(E, N, K, dtype=torch.float64)
    bound = torch.zeros(E, N, K, dtype=torch.float64)
    r, t0 = 0, 0
    for e, m in enumerate(splits):
        tm = bm or max(m, 1)
        nt = 1 if bm == 0 else -(-m // bm)
        for t in range(nt):
            rs = slice(r + t * tm, min(r + m, r + (t + 1) * tm))
            s = sd[:, t0 + t].double()[:, None] * sx[:, t0 + t].double()[None, :]
            ref[e] += (qd[:, rs].double() @ qx[:, rs].double().T) * s
            bound[e] += (qd[:, rs].double().abs() @ qx[:, rs].double().abs().T) * s.abs()
        r += m
        t0 += nt
    assert torch.all((fresh.double() - ref).abs() <= bound * (M + 4) * 2.0 ** -23)
    assert torch.equal(fresh[1], torch.zeros(N, K))  # the zero-token expert
    assert torch.equal(main_grad, start + fresh)  # accumulation: one fp32 add of the fp32 sum


def test_opcheck_and_bad_splits():
    from moe_graph.ops import check_errors
    x = torch.randn(20, 64)
    w = torch.randn(3, 8, 64)
    ms = torch.tensor([5, 0, 10], dtype=torch.int32)
    qa, sa = fp8.quantize(x, ms, tiles="1x32")
    qb, sb = fp8.quantize(w, tiles="1x32")
    torch.library.opcheck(torch.ops.moe_graph.fp8_scaled_grouped_gemm.default,
                          (qa, sa, qb, sb, ms, 32, 1, None, torch.float32), test_utils=("test_faketensor",))
    check_errors("cpu")
    fp8.scaled_grouped_gemm(qa, sa, qb, sb, torch.tensor([15, 0, 10]), block_k=32, block_n=1)
    with pytest.raises(RuntimeError, match="exceeded"):
        check_errors("cpu")
