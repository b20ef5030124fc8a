"""The FP8 expert input written straight from the tokens (``ops.permute.expand_quantize``, the native op
``expand_quantize_pair``, ``csrc/permute/expand_quantize.h``; ``TokenDispatcher.dispatch(quantize_recipe=...)``;
``moe.experts.FUSED_FP8_EXPERT_INPUT``).

Oracle: the rows gathered with plain torch indexing (a zero row for the sentinel), then ``ops.fp8.quantize_pair``
(the quantizer, itself tested against TE's reference quantizers in tests/test_fp8_quantize.py): every byte and
scale equal, for blockwise (power-of-two and fp32 scales), MXFP8 and per-tensor recipes, both FP8 formats, fp32 /
bf16 / fp16 tokens, hidden sizes off the 128 / 32 blocks, zero-token experts, one expert taking every row, rows
past ``sum(m_splits)`` (that do or do not name a route), non-finite values. The input gradient equals
``expand_rows``' (the 16-bit dispatch's) bit for bit. The whole ``MoELayer`` with the fusion on and off: output
and every gradient bit-equal, and the forward no longer runs ``expand_rows`` nor quantizes 16-bit expert rows."""

import pytest
import torch

import moe_graph
import moe_graph.moe.experts as experts
from helpers.permute_quantize_workers import fused_input_worker, layer_case, run_switched
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns
from moe_graph.ops import fp8
from moe_graph.ops.permute import expand_quantize, expand_quantize_available, expand_rows

pytestmark = pytest.mark.skipif(not expand_quantize_available("cpu"), reason="moe_graph._C without expand_quantize")

RECIPES = {
    "blockwise": fp8.Float8BlockScaling(),
    "blockwise_fp32_scales": fp8.Float8BlockScaling(power_2_scale=False),
    "mxfp8": fp8.MXFP8BlockScaling(),
    "tensor": fp8.Float8CurrentScaling(),
    "tensor_pow2_eps": fp8.Float8CurrentScaling(power_2_scale=True, amax_epsilon=1e-3),
}


def _routing(n: int, K: int, m: int, splits, g, extra_routes: bool = False):
    """``route_of_row [m]`` (rows ``[0, sum(splits))`` take distinct routes in random order, the rest the sentinel,
    or with ``extra_routes`` real routes too), ``route_rows [n, K]`` (its inverse over the routed rows) and
    ``m_splits``."""
    used = int(sum(splits))
    perm = torch.randperm(n * K, generator=g)
    route_of_row = torch.full((m,), n * K, dtype=torch.long)
    take = min(used, n * K)
    route_of_row[:take] = perm[:take]
    if extra_routes and m > used:  # rows past the groups that name routes (read by no tile: still zero)
        route_of_row[used:] = torch.randint(0, n * K, (m - used,), generator=g)
    route_rows = torch.full((n * K,), m, dtype=torch.long)
    route_rows[route_of_row[:used][route_of_row[:used] < n * K]] = torch.arange(used)[route_of_row[:used] < n * K]
    return route_of_row, route_rows.view(n, K), torch.tensor(splits, dtype=torch.long)


def _gather(src: torch.Tensor, route_of_row: torch.Tensor, K: int) -> torch.Tensor:
    """The oracle's expanded rows: plain torch indexing, a zero row for the sentinel."""
    n = src.shape[0]
    tok = torch.where(route_of_row == n * K, n, route_of_row // max(K, 1))
    return torch.cat([src, src.new_zeros(1, src.shape[1])])[tok]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_pair_equal(got, want):
    (q, s), (qt, st) = want
    assert torch.equal(_bits(got.data), _bits(q)), "rowwise bytes"
    assert torch.equal(_bits(got.scale), _bits(s)), "rowwise scales"
    assert torch.equal(_bits(got.columns[0]), _bits(qt)), "columnwise bytes"
    assert torch.equal(_bits(got.columns[1]), _bits(st)), "columnwise scales"


CASES = [  # n, K, H, splits, m (rows; > sum(splits): rows past the groups)
    (7, 2, 200, [3, 0, 5, 0, 6], 14),        # zero-token experts, H off the 128 / 32 blocks, every route placed
    (9, 2, 64, [18], 18),                    # one expert takes every row
    (12, 3, 130, [5, 17, 0, 2], 40),         # rows past sum(m_splits), routes left without a row
    (5, 1, 33, [0, 0, 0], 8),                # no routed row at all
    (40, 4, 256, [30, 50, 0, 33, 47], 180),  # groups over several 128-row tiles
]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_expand_quantize_equals_gather_then_quantize(recipe, dtype, case):
    n, K, H, splits, m = CASES[case]
    g = torch.Generator().manual_seed(case + 7)
    src = (torch.randn(n, H, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 3)).to(dtype)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g, extra_routes=case % 2 == 0)
    r = RECIPES[recipe]
    got = expand_quantize(src, route_of_row, route_rows, m_splits, r)
    want = fp8.quantize_pair(_gather(src, route_of_row, K), m_splits, r, r.fwd_dtype)
    _assert_pair_equal(got, want)
    assert got.kind == r.kind and got.carrier.shape == (m, H) and got.carrier.dtype == dtype
    if sum(splits) > 0:
        assert got.data.view(torch.uint8)[:sum(splits)].any()  # not trivially zero


def test_expand_quantize_non_finite_values_and_flag():
    """NaN and inf tokens: the quantizer's bytes and scales (docs/fp8.md) and the non-finite flag."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(6, 160, generator=g).to(torch.bfloat16)
    src[1, 5] = float("nan")
    src[4, 140] = float("inf")
    route_of_row, route_rows, m_splits = _routing(6, 2, 16, [5, 7], g)
    for r in (RECIPES["blockwise"], RECIPES["mxfp8"], RECIPES["tensor"]):
        flag = fp8.nonfinite_flag(src.device)
        if flag is not None:
            flag.zero_()
        got = expand_quantize(src, route_of_row, route_rows, m_splits, r)
        _assert_pair_equal(got, fp8.quantize_pair(_gather(src, route_of_row, 2), m_splits, r, r.fwd_dtype))
        if flag is not None:
            assert int(flag) != 0
            flag.zero_()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expand_quantize_gradient_is_the_16_bit_dispatch_gradient(dtype):
    n, K, H, splits, m = CASES[2]
    g = torch.Generator().manual_seed(5)
    src = torch.randn(n, H, generator=g).to(dtype)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    grad = torch.randn(m, H, generator=g).to(dtype)
    a = src.clone().requires_grad_()
    expand_rows(a, route_of_row, route_rows).backward(grad)
    b = src.clone().requires_grad_()
    out = expand_quantize(b, route_of_row, route_rows, m_splits, RECIPES["blockwise"])
    out.carrier.backward(grad)
    assert torch.equal(a.grad, b.grad)
    # and the float64 sum of each token's routes (an independent check of that gradient)
    ref = torch.zeros(n, H, dtype=torch.float64)
    for i in range(m):
        r = int(route_of_row[i])
        if i < sum(splits) and r < n * K:
            ref[r // K] += grad[i].double()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(b.grad.double(), ref, rtol=tol, atol=tol) and ref.abs().sum() > 0


def test_expand_quantize_bad_input():
    src = torch.randn(4, 16)
    route_of_row, route_rows, m_splits = _routing(4, 2, 8, [3, 5], torch.Generator().manual_seed(0))
    r = RECIPES["blockwise"]
    bad = route_of_row.clone()
    bad[6] = 9  # sentinel 8
    with pytest.raises(RuntimeError, match=r"route_of_row holds 9 at flat position 6, outside \[0, 8\]"):
        expand_quantize(src, bad, route_rows, m_splits, r)
    with pytest.raises(RuntimeError, match="src"):
        expand_quantize(src.double(), route_of_row, route_rows, m_splits, r)
    with pytest.raises(RuntimeError, match="m_splits"):
        expand_quantize(src, route_of_row, route_rows, m_splits.float(), r)
    with pytest.raises(ValueError, match="route_of_row"):
        expand_quantize(src, route_of_row.int(), route_rows, m_splits, r)
    with pytest.raises(ValueError, match="route_rows must have shape"):
        expand_quantize(src, route_of_row, route_rows[:3], m_splits, r)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensor"])
def test_no_row_map_reads_the_rows_as_they_are(recipe):
    """``route_of_row=None`` (a receive buffer already in the expert rows' layout, read in place): the pair of the
    rows themselves, bit-equal to ``quantize_pair`` of ``src`` (16-bit rows, with and without row weights) and to
    ``unpack_rows`` + ``quantize_columns`` of packed rows; the op's shapes under fake tensors; K must be 1."""
    from moe_graph.ops.permute import expand_pack, expand_quantize_copies, expand_quantize_packed
    r = RECIPES[recipe]
    m_splits = torch.tensor([3, 0, 21, 16, 0])  # zero-token groups, rows past sum(m_splits)
    g = torch.Generator().manual_seed(5)
    src = (torch.randn(48, 130, generator=g) * torch.exp(torch.randn(48, 1, generator=g) * 3)).to(torch.bfloat16)
    got = expand_quantize_copies(src, None, 1, m_splits, r, r.fwd_dtype)
    want = fp8.quantize_pair(src, m_splits, r, r.fwd_dtype)
    _assert_pair_equal(fp8.QuantizedRows(src, got[0][0], got[0][1], r.kind, got[1]), want)
    w = torch.rand(48, 1, generator=g)
    got = expand_quantize_copies(src, None, 1, m_splits, r, r.fwd_dtype, w)
    want = fp8.quantize_pair((src.float() * w).to(src.dtype), m_splits, r, r.fwd_dtype)
    _assert_pair_equal(fp8.QuantizedRows(src, got[0][0], got[0][1], r.kind, got[1]), want)
    with pytest.raises(RuntimeError, match="K must be 1 without route_of_row"):
        expand_quantize_copies(src, None, 2, m_splits, r, r.fwd_dtype)
    if recipe != "tensor":  # packed rows (FP8 dispatch) are row-local recipes
        packed = expand_pack(src, None, 1, r)
        got = expand_quantize_packed(packed, None, 1, m_splits, r, src)
        ident = expand_quantize_packed(packed, torch.arange(48), 1, m_splits, r, src)
        _assert_pair_equal(got, ((ident.data, ident.scale), ident.columns))
        assert got.data.view(torch.uint8)[:40].any()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = expand_quantize_copies(mode.from_tensor(src), None, 1, mode.from_tensor(m_splits), r, r.fwd_dtype)
    real = expand_quantize_copies(src, None, 1, m_splits, r, r.fwd_dtype)
    for a, b in ((fake[0][0], real[0][0]), (fake[1][0], real[1][0]), (fake[1][1], real[1][1])):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_dispatcher_writes_the_fp8_expert_input():
    """``TokenDispatcher.dispatch(quantize_recipe=...)`` at EP 1 with aligned groups: a ``QuantizedRows`` equal to
    quantizing the 16-bit dispatch's expert input; ignored without the alignment (16-bit rows)."""
    torch.manual_seed(0)
    E, T, K, H = 5, 23, 2, 96
    cr, cl = expert_columns(E, 1)
    d = TokenDispatcher(E, 1, 0, cr, cl)
    x, idx, probs = torch.randn(T, H), torch.argsort(torch.rand(T, E), 1)[:, :K], torch.rand(T, K)
    r = RECIPES["mxfp8"]
    plain, m0, _ = d.dispatch(x, idx, probs, align_rows=16)
    got, m1, h = d.dispatch(x, idx, probs, align_rows=16, quantize_recipe=r)
    assert isinstance(got, fp8.QuantizedRows) and h.aligned and torch.equal(m0, m1)
    _assert_pair_equal(got, fp8.quantize_pair(plain, m0, r, r.fwd_dtype))
    unaligned, _, _ = d.dispatch(x, idx, probs, quantize_recipe=r)
    assert isinstance(unaligned, torch.Tensor)


def _run(layer, x, target, kind, fused):
    return run_switched(layer, x, target, kind, fused)


@pytest.mark.parametrize("kind,dtype,case,main_grad", [
    ("blockwise", torch.float32, "random", False),
    ("mxfp8", torch.bfloat16, "one_expert", True),   # one expert pair takes every token
    ("tensor", torch.bfloat16, "few_tokens", False),  # most experts get no token
    ("blockwise", torch.bfloat16, "few_tokens", True),
])
def test_moe_layer_fused_expert_input_changes_nothing(kind, dtype, case, main_grad, monkeypatch):
    torch.manual_seed(2)
    layer, x, target = layer_case(96, 64, dtype, case, main_grad)
    y0, dx0, g0, ops0 = _run(layer, x, target, kind, False)
    y1, dx1, g1, ops1 = _run(layer, x, target, kind, True)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and sorted(g0) == sorted(g1)
    assert [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert dx1.abs().sum() > 0 and all(g.abs().sum() > 0 for n, g in g1.items() if "experts" in n)
    # the fused forward: one op instead of expand_rows and the quantize of the 16-bit expert rows
    assert "moe_graph.expand_quantize_pair" in ops1 and "moe_graph.expand_quantize_pair" not in ops0
    assert ops0.count("moe_graph.expand_rows") == ops1.count("moe_graph.expand_rows") + 1
    assert ops0.count("moe_graph.fp8_quantize_pair") == ops1.count("moe_graph.fp8_quantize_pair") + 1
    if case == "one_expert":
        assert int((layer.last_m_splits > 0).sum()) == 2
    if case == "few_tokens":
        assert int((layer.last_m_splits == 0).sum()) >= 6


def test_fused_expert_input_not_taken_where_it_would_change_bits(monkeypatch):
    """Rows of another dtype than the parameters (the 16-bit path casts the expanded rows; the gradient would sum
    in the other dtype), echo, no recipe, the switch off: no recipe for the dispatcher; the probabilities applied
    to the input: the layer does not ask."""
    torch.manual_seed(3)
    mlp = experts.GroupedMLP(4, 96, 64, params_dtype=torch.bfloat16, device="cpu")
    bf, f32 = torch.randn(3, 96, dtype=torch.bfloat16), torch.randn(3, 96)
    assert mlp.input_recipe(bf) is None  # no recipe
    with moe_graph.fp8.autocast(recipe="blockwise"):
        assert mlp.input_recipe(bf) is not None
        assert mlp.input_recipe(f32) is None and mlp.input_recipe(bf, echo=True) is None
        monkeypatch.setattr(experts, "FUSED_FP8_EXPERT_INPUT", False)
        assert mlp.input_recipe(bf) is None
    layer = MoELayer(96, 64, 4, 2, probs_on_input=True)
    *_, ops = _run(layer, torch.randn(11, 96), torch.randn(11, 96), "blockwise", True)
    assert "moe_graph.expand_quantize_pair" not in ops and "moe_graph.expand_rows" in ops


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensor"])
@pytest.mark.parametrize("weighted", [False, True])  # the combine backward's row weights (fc2's FP8 dy)
def test_fake_tensor_and_opcheck(recipe, weighted):
    """The fake (meta) implementation gives the real op's shapes and dtypes (torch.library.opcheck: schema, fake
    tensors, no autograd kernel), and ``expand_quantize`` runs under fake tensors (torch.compile's tracing)."""
    n, K, H, splits, m = CASES[2]
    g = torch.Generator().manual_seed(11)
    src = torch.randn(n, H, generator=g).to(torch.bfloat16)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    r = RECIPES[recipe]
    from moe_graph.ops.permute import _pair_tiles
    tr, tc, ctr, ctc, mx = _pair_tiles(r)
    args = (src, route_of_row, K, m_splits, [tr, tc, ctr, ctc], r.fwd_dtype, mx, 0.0, True,
            torch.rand(n, K, generator=g) if weighted else None)
    torch.library.opcheck(torch.ops.moe_graph.expand_quantize_pair.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = expand_quantize(src, route_of_row, route_rows, m_splits, r)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = expand_quantize(mode.from_tensor(src), mode.from_tensor(route_of_row), mode.from_tensor(route_rows),
                               mode.from_tensor(m_splits), r)
    for a, b in ((fake.data, real.data), (fake.scale, real.scale), (fake.columns[0], real.columns[0]),
                 (fake.columns[1], real.columns[1])):
        assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("kind,cf", [("blockwise", 0.6), ("mxfp8", None), ("tensor", None)])
def test_moe_layer_fused_expert_input_two_ranks(kind, cf):
    """EP 2 on gloo, the fixed-split exchange (routes dropped over a capacity, or dropless): the receive side's
    regrouping writes the FP8 copies (one op instead of expand_rows and the quantize of the 16-bit rows); output,
    input gradient and every gradient equal the unfused layer's bit for bit on both ranks."""
    res = run_distributed(fused_input_worker, 2, kind, cf, timeout=240.0)
    for r in res:
        assert r["out_equal"] and r["dx_equal"] and r["unequal_grads"] == [] and r["dx_nonzero"], r
        assert r["fused_ops"] == 1 and r["unfused_ops"] == 0 and r["expand_rows_saved"] == 1, r
        assert r["quantize_saved"] == 1, r
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0
