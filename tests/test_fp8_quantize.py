"""FP8 quantization op (moe_graph.ops.fp8.quantize, CPU kernel) against the plain-PyTorch transcription of
TransformerEngine's reference quantizers (moe_graph.testing.fp8_reference), bit for bit: q bytes and scale bits."""

import pytest
import torch

from moe_graph.ops import fp8
from helpers import fp8_reference as ref

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without fp8_quantize")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _same_bits(a, b):
    """Equal bits, NaNs equal whatever their sign bit (which x86 and the FP8 encoders set differently)."""
    nan = a.float().isnan()
    return torch.equal(nan, b.float().isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _check(x, m_splits, tiles, qd, eps=0.0, pow2=False):
    tr = fp8.TILES[tiles][0]
    ms = None if m_splits is None else torch.tensor(m_splits, dtype=torch.int32)
    q, s = fp8.quantize(x, ms, tiles=tiles, fp8_dtype=qd, eps=eps, pow2_scales=pow2)
    groups = 0 if m_splits is None or x.dim() == 3 else len(m_splits)
    rt = fp8.row_tile_capacity(x.shape[-2], groups, tr)
    rq, rs = ref.quantize_grouped(x, m_splits, tiles, qd, eps=eps, pow2_scales=pow2, row_tiles=rt)
    assert q.shape == rq.shape and s.shape == rs.shape, (q.shape, rq.shape, s.shape, rs.shape)
    assert q.dtype == qd and s.dtype == rs.dtype
    assert torch.equal(_bits(q), _bits(rq)), f"q differs at {(_bits(q) != _bits(rq)).nonzero()[:5].tolist()}"
    assert torch.equal(_bits(s), _bits(rs)), f"scale differs: {s.flatten()[:8]} vs {rs.flatten()[:8]}"
    return q, s


def _inputs(kind, m, k, dtype, gen):
    if kind == "random":  # magnitudes spread over many binades, signs mixed
        x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=gen).float())
    elif kind == "zero":
        x = torch.zeros(m, k)
    elif kind == "denormal":  # denormals of the input dtype, with a few normal values in some rows
        tiny = {torch.float32: 1e-40, torch.bfloat16: 1e-39, torch.float16: 3e-6}[dtype]
        x = torch.randn(m, k, generator=gen) * tiny
    elif kind == "huge":
        big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
        x = (torch.rand(m, k, generator=gen) * 2 - 1) * big
    else:
        raise ValueError(kind)
    return x.to(dtype)


@pytest.mark.parametrize("tiles", ["1x128", "128x1", "128x128", "tensor", "1x32", "32x1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_equals_te_reference(tiles, dtype):
    gen = torch.Generator().manual_seed(hash((tiles, str(dtype))) % 2**31)
    mx = fp8.TILES[tiles][2]
    for kind in ["random", "zero", "denormal", "huge"]:
        for qd in FP8:
            for m, k in [(130, 300), (7, 33)]:
                x = _inputs(kind, m, k, dtype, gen)
                for pow2 in ([False] if mx or kind != "random" else [False, True]):
                    _check(x, None, tiles, qd, pow2=pow2)


@pytest.mark.parametrize("tiles", ["1x128", "128x1", "128x128", "tensor", "1x32", "32x1"])
def test_grouped_zero_token_groups_and_capacity_rows(tiles):
    gen = torch.Generator().manual_seed(7)
    x = _inputs("random", 300, 160, torch.bfloat16, gen)
    for splits in ([100, 0, 131, 1], [0, 0, 0], [300], [0, 299, 0, 1], [45, 5]):
        _check(x, splits, tiles, torch.float8_e4m3fn)
    if not fp8.TILES[tiles][2]:
        _check(x, [100, 0, 131, 1], tiles, torch.float8_e5m2, eps=1e-3, pow2=True)


def test_eps_and_inf():
    x = torch.tensor([[0.0] * 130, [1e-30] * 130, [float("inf")] + [1.0] * 129, [-float("inf")] * 130])
    for tiles in ["1x128", "128x1", "tensor"]:
        for eps in (0.0, 1e-20):
            for pow2 in (False, True):
                _check(x, None, tiles, torch.float8_e4m3fn, eps=eps, pow2=pow2)


def test_weights_batched_and_columnwise_copy():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 200, 130, generator=gen).to(torch.bfloat16)
    for tiles in ["128x128", "1x32", "1x128"]:
        _check(w, None, tiles, torch.float8_e4m3fn)
    q, s = fp8.quantize(w, tiles="128x128")
    qt, st = fp8.quantize(w, tiles="128x128", transpose=True)  # the columnwise copy: exact transposes
    assert torch.equal(_bits(qt), _bits(q.transpose(1, 2))) and torch.equal(st, s.transpose(1, 2))


def test_dequantize_round_trip_and_bad_splits():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 96, generator=gen)
    ms = torch.tensor([10, 0, 25])
    for tiles in fp8.TILES:
        q, s = fp8.quantize(x, ms, tiles=tiles)
        d = fp8.dequantize(q, s, ms, tiles=tiles)
        assert torch.equal(d[35:], torch.zeros(5, 96))
        assert (d[:35] - x[:35]).abs().max() <= x.abs().max() / 8  # e4m3: 3 mantissa bits
    from moe_graph.ops import check_errors
    check_errors("cpu")
    fp8.quantize(x, torch.tensor([30, 30]), tiles="1x128")
    with pytest.raises(RuntimeError, match="exceeded"):
        check_errors("cpu")


def test_fake_and_opcheck():
    x = torch.randn(20, 70)
    ms = torch.tensor([5, 0, 15], dtype=torch.int32)
    for tiles, (tr, tc, mx, t) in fp8.TILES.items():
        torch.library.opcheck(torch.ops.moe_graph.fp8_quantize.default,
                              (x, ms, tr, tc, torch.float8_e4m3fn, mx, 0.0, False, t),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("rows_tiles, cols_tiles", [("1x128", "128x1"), ("1x32", "32x1")])
@pytest.mark.parametrize("in_dtype", FP8)
@pytest.mark.parametrize("out_dtype", FP8)
def test_fp8_input_requantizes_its_dequantization(rows_tiles, cols_tiles, in_dtype, out_dtype):
    """An FP8 x with its rowwise scales (the rows FP8 dispatch moved) quantized to the columnwise copy equals the TE
    reference quantizer run on torch's own fp32 dequantization (q.float() * the scale of its tile), bit for bit: K
    not a tile multiple, zero-token groups, capacity rows past the groups, a NaN."""
    gen = torch.Generator().manual_seed(5)
    m_splits, M, K = [37, 0, 130, 1], 180, 300
    x = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-8, 8, (M, 1), generator=gen).float())
    x[3, 7] = float("nan")
    ms = torch.tensor(m_splits, dtype=torch.int64)
    q, s = fp8.quantize(x, ms, tiles=rows_tiles, fp8_dtype=in_dtype)
    tc = fp8.TILES[rows_tiles][1]
    deq = q.float() * s.float().repeat_interleave(tc, 1)[:, :K]  # torch's decode of both, fp32 products
    deq[sum(m_splits):] = 0
    rt = fp8.row_tile_capacity(M, len(m_splits), fp8.TILES[cols_tiles][0])
    rq, rs = ref.quantize_grouped(deq, m_splits, cols_tiles, out_dtype, row_tiles=rt)
    q2, s2 = fp8.quantize(q, ms, tiles=cols_tiles, fp8_dtype=out_dtype, x_scale=s)
    assert q2.shape == rq.shape and s2.shape == rs.shape
    assert _same_bits(q2, rq) and _same_bits(s2, rs)
    assert q2.float().isnan().any()  # the NaN's tile
    # the same as dequantize, then quantize (the two-op path it replaces)
    q3, s3 = fp8.quantize(fp8.dequantize(q, s, tiles=rows_tiles), ms, tiles=cols_tiles, fp8_dtype=out_dtype)
    assert _same_bits(q2, q3) and _same_bits(s2, s3)


def test_fp8_input_errors_name_the_argument():
    x = torch.randn(8, 64)
    q, s = fp8.quantize(x, tiles="1x128")
    with pytest.raises(RuntimeError, match="x_scale"):
        fp8.quantize(q, tiles="128x1")  # FP8 x without its scales
    with pytest.raises(RuntimeError, match="x_scale"):
        fp8.quantize(x, tiles="128x1", x_scale=s)  # scales with a 16-bit x
    with pytest.raises(RuntimeError, match="x_scale must have shape"):
        fp8.quantize(q, tiles="128x1", x_scale=s[:4])
    with pytest.raises(RuntimeError, match="x_scale must have dtype"):
        fp8.quantize(q, tiles="128x1", x_scale=s.double())
    # (opcheck's schema test multiplies its inputs, which torch cannot do on FP8 tensors: the fake test only)
    torch.library.opcheck(torch.ops.moe_graph.fp8_quantize.default,
                          (q, torch.tensor([5, 3]), 128, 1, torch.float8_e4m3fn, False, 0.0, False, True, s),
                          test_utils=("test_faketensor",))


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and fp8.native_available("cuda")),
                                reason="needs CUDA and the CUDA build of fp8_quantize")


@needs_cuda
@pytest.mark.parametrize("tiles", list(fp8.TILES))
def test_cuda_equals_cpu_sync_free_and_graph(tiles):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(700, 300, generator=gen) * 3).to(torch.bfloat16)
    ms = torch.tensor([200, 0, 333, 100], dtype=torch.int32)
    q0, s0 = fp8.quantize(x, ms, tiles=tiles, pow2_scales=True)
    xd, msd = x.cuda(), ms.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q1, s1 = fp8.quantize(xd, msd, tiles=tiles, pow2_scales=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(_bits(q1.cpu()), _bits(q0)) and torch.equal(_bits(s1.cpu()), _bits(s0))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qg, sg = fp8.quantize(xd, msd, tiles=tiles, pow2_scales=True)
    msd.copy_(torch.tensor([0, 650, 0, 50], dtype=torch.int32))
    g.replay()
    q2, s2 = fp8.quantize(x, torch.tensor([0, 650, 0, 50]), tiles=tiles, pow2_scales=True)
    assert torch.equal(_bits(qg.cpu()), _bits(q2)) and torch.equal(_bits(sg.cpu()), _bits(s2))
    # FP8 input (the columnwise copy of dispatched rows): the CUDA requantization equals the CPU's
    if tiles in ("128x1", "32x1"):
        rows_tiles = "1x128" if tiles == "128x1" else "1x32"
        qr, sr = fp8.quantize(x, ms, tiles=rows_tiles)
        c0 = fp8.quantize(qr, ms, tiles=tiles, x_scale=sr)
        c1 = fp8.quantize(qr.cuda(), ms.cuda(), tiles=tiles, x_scale=sr.cuda())
        assert all(torch.equal(_bits(a.cpu()), _bits(b)) for a, b in zip(c1, c0))


# ------------------------------------------------------------- TE's MXFP8 rule at the E8M0 boundaries (issue 41) --
def _boundary_amaxes(qd):
    """Block maxima around every E8M0 boundary a finite fp32 block can reach: exponent 0 (amax * (1 / fp8_max) <=
    2^-127, i.e. amax up to about fp8_max * 2^-127) and 1, fp32 denormal inputs, the largest finite fp32 value."""
    fmax = torch.finfo(qd).max
    f32 = torch.float32
    edge = torch.tensor(fmax * 2.0 ** -127, dtype=f32)
    one = torch.tensor(fmax * 2.0 ** -126, dtype=f32)
    out = [edge, one, torch.tensor(1e-37), torch.tensor(1e-40), torch.tensor(1.4e-45), torch.tensor(2.0 ** -127),
           torch.tensor(torch.finfo(f32).max), torch.tensor(1.0), torch.tensor(fmax * 2.0 ** 100, dtype=f32)]
    for v in (edge, one):
        up = down = v
        for _ in range(3):
            up, down = torch.nextafter(up, torch.tensor(float("inf"))), torch.nextafter(down, torch.tensor(0.0))
            out += [up, down]
    return [float(v) for v in out]


def _boundary_rows(qd, width, gen):
    """One row per boundary amax: the amax at a varying column, the rest random fractions of it (signs mixed)."""
    rows = []
    for i, a in enumerate(_boundary_amaxes(qd)):
        frac = (torch.rand(width, generator=gen, dtype=torch.float64) * 2 - 1)
        r = (frac * a).float()
        r[i % width] = a if i % 2 else -a
        rows.append(r)
    return torch.stack(rows)


def test_mxfp8_exponent_zero_block_like_te():
    """TE's exp2f_rcp(0) = 2^127 (the issue's example): a block of 1e-37 is byte 0x59 with E8M0 0, not zero."""
    q, s = fp8.quantize(torch.full((1, 32), 1e-37), tiles="1x32")
    assert _bits(s).tolist() == [[0]] and _bits(q).unique().tolist() == [0x59]
    d = fp8.dequantize(q, s, tiles="1x32")
    assert torch.allclose(d, torch.full((1, 32), 1e-37), rtol=2 ** -3)


@pytest.mark.parametrize("qd", FP8)
@pytest.mark.parametrize("tiles", ["1x32", "32x1"])
def test_mxfp8_boundaries_equal_te_rule(qd, tiles):
    gen = torch.Generator().manual_seed(11)
    x = _boundary_rows(qd, 64, gen)
    x = x if tiles == "1x32" else x.t().contiguous()
    q, s = _check(x, None, tiles, qd)
    e = _bits(s).flatten()
    assert {0, 1}.issubset(set(e.tolist()))  # both sides of the exponent-0 boundary are exercised
    # no block whose max scaled by 2^127 is within FP8's range quantizes to zeros (exponent 0 multiplies by 2^127;
    # only a max below 2^-127 x the smallest FP8 subnormal, e.g. fp32's smallest denormal, rounds to zero)
    rows_q = q.view(torch.uint8) & 0x7F  # the columnwise copy of x = rows^T is in the rows' layout
    amax = (x if tiles == "1x32" else x.t()).abs().reshape(rows_q.shape[0], -1, 32).amax(-1)
    in_range = amax.double() * 2.0 ** 127 >= torch.finfo(qd).smallest_normal * 2.0 ** -3
    assert bool(rows_q.reshape(rows_q.shape[0], -1, 32).amax(-1).gt(0)[in_range].all())
    assert bool(in_range.float().mean() > 0.9)


@pytest.mark.parametrize("tiles", ["1x128", "128x1", "tensor"])
@pytest.mark.parametrize("qd", FP8)
def test_fp32_scales_at_the_same_boundaries_equal_te_reference(tiles, qd):
    gen = torch.Generator().manual_seed(12)
    x = _boundary_rows(qd, 128, gen)
    for dtype in (torch.float32, torch.bfloat16):
        for pow2 in (False, True):
            rows = x.to(dtype)
            if tiles == "tensor":  # one scale per tensor: each boundary row on its own
                for r in rows:
                    _check(r[None], None, tiles, qd, pow2=pow2)
            else:
                _check(rows if tiles == "1x128" else rows.t().contiguous(), None, tiles, qd, pow2=pow2)


# ---------------------------------------------------------------------------------- inf / NaN (docs/fp8.md) --
_MAXCODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


@pytest.mark.parametrize("tiles", list(fp8.TILES))
@pytest.mark.parametrize("qd", FP8)
def test_nonfinite_bytes_follow_the_documented_rule(tiles, qd):
    """Rows (1 x K tiles) / columns (K x 1) / tensors: a NaN tile, a +inf / -inf tile, a finite tile."""
    tr, tc, mx, t = fp8.TILES[tiles]
    K = 32 if mx else 128
    gen = torch.Generator().manual_seed(13)
    base = torch.randn(4, K, generator=gen)
    base[0, 3] = float("nan")
    base[0, 4] = float("inf")
    base[1, 7] = float("inf")
    base[1, 9] = -float("inf")
    cases = [base[i:i + 1] for i in range(4)] if tiles in ("tensor", "128x128") else [base]
    for x0 in cases:
        x = x0.t().contiguous() if t else x0
        flag = fp8.nonfinite_flag("cpu")
        flag.zero_()
        q, s = _check(x, None, tiles, qd)
        d = fp8.dequantize(q, s, tiles=tiles)
        assert torch.equal(~torch.isfinite(d) & ~torch.isfinite(x), ~torch.isfinite(x))  # never finite
        assert int(flag[0]) == int(bool((~torch.isfinite(x)).any()))
        qb = q.view(torch.uint8)  # a transposed copy of x = x0^T is in x0's layout
        xb = x0
        for i in range(xb.shape[0]):
            row, qr = xb[i], qb[i] if tiles not in ("tensor", "128x128") else qb[0]
            si = s.flatten()[i] if tiles not in ("tensor", "128x128") else s.flatten()[0]
            if row.isnan().any():
                assert qr.unique().tolist() == [0x7F]
                assert (_bits(si.reshape(1)).item() == 0xFF) if mx else (_bits(si.reshape(1)).item() == 0x7FC00000)
            elif row.isinf().any():
                inf = row.isinf()
                if mx:
                    assert _bits(si.reshape(1)).item() == 0xFE
                    want = torch.where(row[inf] > 0, _MAXCODE[qd], 0x80 | _MAXCODE[qd])
                    assert torch.equal(qr[inf].long(), want.long())
                else:
                    assert float(si) == float("inf")
                    assert qr[inf].unique().tolist() == [0x7F]
                    assert bool(((qr[~inf] & 0x7F) == 0).all())


def test_nonfinite_flag_stays_clear_on_finite_input():
    flag = fp8.nonfinite_flag("cpu")
    flag.zero_()
    x = torch.randn(64, 256) * 1e30
    for tiles in fp8.TILES:
        fp8.quantize(x, tiles=tiles)
    assert int(flag[0]) == 0
    x[5, 5] = float("nan")
    fp8.quantize(x, torch.tensor([32, 32]), tiles="1x32")
    assert int(flag[0]) == 1
    flag.zero_()


@pytest.mark.parametrize("kind", ["mxfp8", "blockwise"])
def test_fp8_training_with_an_injected_inf_skips_the_step_on_every_rank(kind):
    from helpers.fp8_inf_workers import INF_STEP, fp8_inf_step_worker
    from moe_graph.distributed.launch import run_distributed
    res = run_distributed(fp8_inf_step_worker, 2, kind, timeout=240.0)
    for r in res:
        assert r["ok"] == [i != INF_STEP for i in range(3)], r
        assert r["changed"] == [i != INF_STEP for i in range(3)], r
        assert all(r["params_finite"]) and r["flag_after"] == [0, 0, 0], r
    if kind == "mxfp8":  # the gradients were finite: the quantizer's flag alone skipped the step
        assert all(all(r["grads_finite"]) for r in res), res


# -------------------------------------------------------------- both copies in one op; the fused activation --
RECIPES = ["blockwise", "mxfp8", "tensor"]


@pytest.mark.parametrize("kind", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_pair_equals_rows_and_columns(kind, dtype):
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(150, 96, generator=gen) * torch.logspace(-3, 3, 96)).to(dtype)
    for splits in ([40, 0, 77, 3], [150], [0, 0, 0]):
        ms = torch.tensor(splits)
        for qd in FP8:
            (q, s), (qt, st) = fp8.quantize_pair(x, ms, recipe, qd)
            rq, rs = fp8.quantize_rows(x, ms, recipe, qd)
            cq, cs = fp8.quantize_columns(x, ms, recipe, qd)
            assert torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(s), _bits(rs))
            assert torch.equal(_bits(qt), _bits(cq)) and torch.equal(_bits(st), _bits(cs))


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "limited_swiglu", "post_clamped_swiglu",
                                        "softcapped_swiglu", "geglu_tanh", "squared_relu", "relu", "silu", "gelu"])
@pytest.mark.parametrize("kind", RECIPES)
def test_fused_activation_quantize_equals_activation_then_quantize(activation, kind):
    """The fused producer's bytes equal expert_activation's output quantized (both copies), for every kind, h
    dtype, row scale (none, fp32, h's dtype) and zero-token groups; and the gradients reach h and the row scale
    as through expert_activation."""
    from moe_graph.ops.activation import expert_activation, gated_kind
    recipe = fp8.as_recipe(kind)
    gen = torch.Generator().manual_seed(22)
    F = 72
    ms = torch.tensor([30, 0, 41, 9])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = (torch.randn(85, 2 * F if gated_kind(activation) else F, generator=gen) * 3).to(dtype)
        for sm in (None, torch.float32, dtype):
            rs = None if sm is None else torch.rand(85, generator=gen).to(sm)
            opts = dict(swiglu_alpha=1.5, swiglu_limit=4.0)
            y = expert_activation(h, activation, rs, **opts)
            (q, s), (qt, st) = fp8.quantize_pair(h, ms, recipe, recipe.fwd_dtype, activation=activation,
                                                 row_scale=rs, **opts)
            rq, rsc = fp8.quantize_rows(y, ms, recipe, recipe.fwd_dtype)
            cq, cs = fp8.quantize_columns(y, ms, recipe, recipe.fwd_dtype)
            assert torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(s), _bits(rsc)), (dtype, sm)
            assert torch.equal(_bits(qt), _bits(cq)) and torch.equal(_bits(st), _bits(cs)), (dtype, sm)
    # autograd: the carrier's gradient goes through the activation's backward
    h = torch.randn(85, 2 * F if gated_kind(activation) else F, generator=gen, requires_grad=True)
    rs = torch.rand(85, generator=gen, requires_grad=True)
    g = torch.randn(85, F, generator=gen)
    qr = fp8.quantize_activation(h, ms, recipe, activation, rs)
    assert qr.columns is not None and qr.carrier.shape == (85, F) and qr.kind == kind
    dh, ds = torch.autograd.grad(qr.carrier, (h, rs), g)
    eh, es = torch.autograd.grad(expert_activation(h, activation, rs), (h, rs), g)
    assert torch.equal(dh, eh) and torch.equal(ds, es)


def test_fused_activation_sets_the_nonfinite_flag():
    flag = fp8.nonfinite_flag("cpu")
    flag.zero_()
    h = torch.randn(16, 64)
    recipe = fp8.as_recipe("mxfp8")
    fp8.quantize_pair(h, torch.tensor([16]), recipe, recipe.fwd_dtype, activation="swiglu")
    assert int(flag[0]) == 0
    h[3, 40] = float("inf")  # the up half: silu(a) * inf
    fp8.quantize_pair(h, torch.tensor([16]), recipe, recipe.fwd_dtype, activation="swiglu")
    assert int(flag[0]) == 1
    flag.zero_()


def test_quantize_pair_errors_name_the_argument():
    recipe = fp8.as_recipe("blockwise")
    with pytest.raises(RuntimeError, match="row_scale"):
        torch.ops.moe_graph.fp8_quantize_pair(torch.randn(4, 8), None, [1, 128, 128, 1], torch.float8_e4m3fn,
                                               False, 0.0, False, None, 1.0, 1.0, torch.ones(4))
    with pytest.raises(RuntimeError, match="activation must be one of"):
        fp8.quantize_pair(torch.randn(4, 8), None, recipe, recipe.fwd_dtype, activation="nope")
    with pytest.raises(RuntimeError, match="h"):
        fp8.quantize_pair(torch.randn(4, 7), None, recipe, recipe.fwd_dtype, activation="swiglu")


def test_quantize_pair_fake():
    x = torch.randn(20, 64)
    ms = torch.tensor([5, 0, 15], dtype=torch.int32)
    for act in (None, "swiglu", "relu"):
        torch.library.opcheck(torch.ops.moe_graph.fp8_quantize_pair.default,
                              (x, ms, [1, 32, 32, 1], torch.float8_e4m3fn, True, 0.0, False, act, 1.702, 7.0, None),
                              test_utils=("test_schema", "test_faketensor"))
