"""fc2's FP8 output gradient written by the combine's backward (``ops.fp8.GradHandoff``; ``ops.permute.reduce_rows``'
``grad_handoff``; the weighted ``expand_quantize_pair``, ``csrc/permute/expand_quantize.h``;
``moe.experts.FUSED_FP8_COMBINE_BACKWARD``).

Oracles: for the op, the gradient rows built with plain torch (gather, the row weight applied in fp32 and rounded to
the gradient's dtype, a zero row for the sentinel), then ``ops.fp8.quantize_pair`` (itself tested against TE's
reference quantizers in tests/test_fp8_quantize.py): every byte and scale equal. For the autograd chain (fc2 ->
combine) and the whole ``MoELayer``: the current path (the combine's backward writes the 16-bit ``dy``, fc2's
backward quantizes it) with the hand-off off; output and every gradient (input, probabilities, weights) equal bit
for bit, for blockwise / MXFP8 / per-tensor recipes, fp32 / bf16 / fp16, hidden sizes off the tiles, zero-token
experts, one expert taking every row, rows past ``sum(m_splits)``, NaN / inf; a second consumer of fc2's output
falls back to the 16-bit gradient and stays equal.

EP > 1 (the fixed-split exchange: ``ops.permute.expand_rows``' ``grad_handoff``, ``expand_quantize_pair``'s
``plus_zero``; the per-destination exchanges: ``moe.exchange.ToSources``' hand-off): the op against plain torch (the gathered rows with every zero made +0, as ``reduce_rows``' sum from
+0 writes them), the receive side's chain against the hand-off off, and the layer at EP 2 and 4 on gloo (drops,
zero-token experts, one expert pair taking every token, -0 / inf / NaN in the gradient, ``main_grad``), bit for
bit."""

import pytest
import torch
from conftest import full_only

import moe_graph
import moe_graph.moe.experts as experts
from helpers.permute_quantize_workers import OpNames, bits, combine_backward_worker, layer_case, run_switched
from moe_graph.distributed.launch import run_distributed
from moe_graph.grouped_linear import fp8_grouped_linear
from moe_graph.moe.layer import MoELayer
from moe_graph.ops import fp8
from moe_graph.ops.permute import expand_quantize_available, expand_quantize_copies, expand_rows, reduce_rows

pytestmark = pytest.mark.skipif(not expand_quantize_available("cpu"), reason="moe_graph._C without expand_quantize")

RECIPES = {
    "blockwise": fp8.Float8BlockScaling(),
    "blockwise_hybrid_fp32_scales": fp8.Float8BlockScaling(fp8_format="HYBRID", power_2_scale=False),
    "mxfp8": fp8.MXFP8BlockScaling(),
    "mxfp8_hybrid": fp8.MXFP8BlockScaling(fp8_format="HYBRID"),
    "tensor": fp8.Float8CurrentScaling(),
}

CASES = [  # n, K, H, splits, m (rows; > sum(splits): rows past the groups)
    (7, 2, 200, [3, 0, 5, 0, 6], 14),        # zero-token experts, H off the 128 / 32 blocks
    (9, 2, 64, [18], 18),                    # one expert takes every row
    (12, 3, 130, [5, 17, 0, 2], 40),         # rows past sum(m_splits), routes left without a row
    (5, 1, 33, [0, 0, 0], 8),                # no routed row at all
    (40, 4, 256, [30, 50, 0, 33, 47], 180),  # groups over several 128-row tiles
]


def _routing(n, K, m, splits, g):
    """``route_of_row [m]`` (the first ``sum(splits)`` rows take distinct routes in random order, the rest the
    sentinel ``n*K``), ``route_rows [n, K]`` (its inverse, ``m`` for a route without a row) and ``m_splits``."""
    used = int(sum(splits))
    route_of_row = torch.full((m,), n * K, dtype=torch.long)
    take = min(used, n * K)
    route_of_row[:take] = torch.randperm(n * K, generator=g)[:take]
    route_rows = torch.full((n * K,), m, dtype=torch.long)
    route_rows[route_of_row[:take]] = torch.arange(take)
    return route_of_row, route_rows.view(n, K), torch.tensor(splits, dtype=torch.long)


def _weighted_rows(g, route_of_row, K, w):
    """The oracle's 16-bit dy: row i is ``(w[r] * g[r // K]).to(g.dtype)`` in fp32 for ``r = route_of_row[i]``,
    a zero row for the sentinel (plain torch indexing)."""
    n = g.shape[0]
    tok = torch.where(route_of_row == n * K, n, route_of_row // max(K, 1))
    rows = torch.cat([g, g.new_zeros(1, g.shape[1])])[tok]
    if w is None:
        return rows
    wr = torch.cat([w.reshape(-1).float(), w.new_zeros(1, dtype=torch.float32)])[route_of_row.clamp(max=n * K)]
    return (wr[:, None] * rows.float()).to(g.dtype)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _assert_copies_equal(got, want):
    for (a, b), what in zip(((got[0][0], want[0][0]), (got[0][1], want[0][1]), (got[1][0], want[1][0]),
                             (got[1][1], want[1][1])), ("rowwise bytes", "rowwise scales", "columnwise bytes",
                                                        "columnwise scales")):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("weights", ["fp32", "same", None])
def test_weighted_expand_quantize_equals_weighted_rows_then_quantize(recipe, dtype, case, weights):
    n, K, H, splits, m = CASES[case]
    g = torch.Generator().manual_seed(case + 31)
    grad = (torch.randn(n, H, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 3)).to(dtype)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    w = None if weights is None else torch.rand(n, K, generator=g) * 1.7 - 0.2  # a few negative weights
    if w is not None:
        w[0, 0] = 0.0
        w = w if weights == "fp32" else w.to(dtype)
    r = RECIPES[recipe]
    got = expand_quantize_copies(grad, route_of_row, K, m_splits, r, r.bwd_dtype, w)
    want = fp8.quantize_pair(_weighted_rows(grad, route_of_row, K, w), m_splits, r, r.bwd_dtype)
    _assert_copies_equal(got, want)
    # the native expand_rows writes the same 16-bit rows (the current path's dy)
    assert torch.equal(expand_rows(grad, route_of_row, route_rows, w), _weighted_rows(grad, route_of_row, K, w))
    if sum(splits) > 0:
        assert got[0][0].view(torch.uint8)[:sum(splits)].any()


def test_weighted_expand_quantize_non_finite():
    """NaN / inf in the gradient and an inf weight times zero (NaN): the quantizer's bytes, scales and flag."""
    g = torch.Generator().manual_seed(4)
    grad = torch.randn(6, 160, generator=g).to(torch.bfloat16)
    grad[1, 5] = float("nan")
    grad[4, 140] = float("inf")
    grad[2, 7] = 0.0
    route_of_row, _, m_splits = _routing(6, 2, 16, [5, 7], g)
    w = torch.rand(6, 2, generator=g)
    w[2, :] = float("inf")
    for r in (RECIPES["blockwise"], RECIPES["mxfp8"], RECIPES["tensor"]):
        flag = fp8.nonfinite_flag(grad.device)
        flag.zero_()
        got = expand_quantize_copies(grad, route_of_row, 2, m_splits, r, r.bwd_dtype, w)
        _assert_copies_equal(got, fp8.quantize_pair(_weighted_rows(grad, route_of_row, 2, w), m_splits, r,
                                                    r.bwd_dtype))
        assert int(flag) != 0
        flag.zero_()


def test_weighted_expand_quantize_bad_weights():
    src = torch.randn(4, 16)
    route_of_row, _, m_splits = _routing(4, 2, 8, [3, 5], torch.Generator().manual_seed(0))
    r = RECIPES["blockwise"]
    with pytest.raises(RuntimeError, match="weights"):
        expand_quantize_copies(src, route_of_row, 2, m_splits, r, r.bwd_dtype, torch.rand(4, 3))
    with pytest.raises(RuntimeError, match="weights must have the dtype of src"):
        expand_quantize_copies(src, route_of_row, 2, m_splits, r, r.bwd_dtype, torch.rand(4, 2).double())


def _chain(x, w2, probs, route_rows, route_of_row, m_splits, r, handoff_on, extra=None):
    """fc2 (the FP8 grouped linear) then the weighted combine: ``(out, dx, dw, dprobs, backward op names)``;
    ``extra``: a second consumer of fc2's output (``(y * extra).sum()`` added to the loss)."""
    x = x.clone().requires_grad_()
    w = w2.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    h = fp8.GradHandoff(r, m_splits) if handoff_on else None
    y = fp8_grouped_linear(x, m_splits, [w], None, r, grad_handoff=h)
    out = reduce_rows(y, route_rows, route_of_row, p, h)
    loss = (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()
    if extra is not None:
        loss = loss + (y.float() * extra).sum()
    mode = OpNames()
    with mode:
        loss.backward()
    return out.detach(), x.grad, w.grad, p.grad, mode.seen


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8_hybrid", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_combine_backward_hands_fc2_its_fp8_dy(recipe, dtype, case):
    n, K, H, splits, m = CASES[case]
    E, F = len(splits), 48
    g = torch.Generator().manual_seed(case + 100)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    x = torch.randn(m, F, generator=g).to(dtype)
    w2 = (torch.randn(E, H, F, generator=g) * 0.1).to(dtype)
    probs = torch.rand(n, K, generator=g).to(dtype)
    r = RECIPES[recipe]
    ref = _chain(x, w2, probs, route_rows, route_of_row, m_splits, r, False)
    got = _chain(x, w2, probs, route_rows, route_of_row, m_splits, r, True)
    for a, b, what in zip(ref[:4], got[:4], ("out", "dx", "dw", "dprobs")):
        assert torch.equal(a, b), what
    if sum(splits) > 0:
        assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0 and got[3].abs().sum() > 0
    # one op instead of expand_rows (the 16-bit dy) and fc2's quantize of it
    assert ref[4].count("moe_graph.expand_rows") == 1 and got[4].count("moe_graph.expand_rows") == 0
    assert ref[4].count("moe_graph.fp8_quantize_pair") == 1 and got[4].count("moe_graph.fp8_quantize_pair") == 0
    assert got[4].count("moe_graph.expand_quantize_pair") == 1


def test_second_consumer_falls_back_to_the_16_bit_gradient():
    """fc2's output also feeds another loss term: autograd sums that gradient into the combine's zero-stride one,
    so fc2's backward adds the combine's 16-bit gradient back and quantizes the sum (the current path's result)."""
    n, K, H, splits, m = CASES[2]
    g = torch.Generator().manual_seed(9)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    x, w2 = torch.randn(m, 40, generator=g).bfloat16(), (torch.randn(4, H, 40, generator=g) * 0.1).bfloat16()
    probs, extra = torch.rand(n, K, generator=g), torch.randn(m, H, generator=g)
    r = RECIPES["blockwise"]
    ref = _chain(x, w2, probs, route_rows, route_of_row, m_splits, r, False, extra)
    got = _chain(x, w2, probs, route_rows, route_of_row, m_splits, r, True, extra)
    for a, b, what in zip(ref[:4], got[:4], ("out", "dx", "dw", "dprobs")):
        assert torch.equal(a, b), what
    assert got[4].count("moe_graph.fp8_quantize_pair") == 1  # fc2 quantized the summed 16-bit dy


def test_retained_graph_backward_twice():
    """A retained graph's second backward hands the copies over again (the gradients accumulate as without)."""
    n, K, H, splits, m = CASES[0]
    g = torch.Generator().manual_seed(8)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    x0, w0 = torch.randn(m, 32, generator=g), torch.randn(len(splits), H, 32, generator=g)
    r = RECIPES["mxfp8"]
    grads = []
    for on in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        h = fp8.GradHandoff(r, m_splits) if on else None
        out = reduce_rows(fp8_grouped_linear(x, m_splits, [w], None, r, grad_handoff=h), route_rows, route_of_row,
                          None, h)
        out.sum().backward(retain_graph=True)
        first = x.grad.clone()
        out.sum().backward()
        grads.append((first, x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and torch.equal(grads[1][1], 2 * grads[1][0])


def test_handoff_refused_where_it_would_be_wrong():
    """The combine's input must be fc2's output itself (not a later op's), fc2 no bias, the same recipe / splits;
    the layer asks only with aligned rows, no echo, no fc2 bias and the switch on."""
    n, K, H, splits, m = CASES[0]
    g = torch.Generator().manual_seed(1)
    route_of_row, route_rows, m_splits = _routing(n, K, m, splits, g)
    r = RECIPES["blockwise"]
    x, w2 = torch.randn(m, 32, generator=g), torch.randn(len(splits), H, 32, generator=g)
    h = fp8.GradHandoff(r, m_splits)
    y = fp8_grouped_linear(x, m_splits, [w2], None, r, grad_handoff=h)
    with pytest.raises(ValueError, match="grad_handoff must be bound to src"):
        reduce_rows(y * 2, route_rows, route_of_row, None, h)
    with pytest.raises(ValueError, match="grad_handoff needs no bias"):
        fp8_grouped_linear(x, m_splits, [w2], torch.zeros(len(splits), H), r, grad_handoff=fp8.GradHandoff(r, m_splits))
    with pytest.raises(ValueError, match="grad_handoff needs no bias"):
        fp8_grouped_linear(x, m_splits, [w2], None, RECIPES["mxfp8"], grad_handoff=fp8.GradHandoff(r, m_splits))
    mlp = experts.GroupedMLP(4, 96, 64, device="cpu")
    assert mlp.output_grad_handoff(m_splits, True) is None  # no recipe
    with moe_graph.fp8.autocast(recipe="blockwise"):
        assert mlp.output_grad_handoff(m_splits, True) is not None
        assert mlp.output_grad_handoff(m_splits, False) is None
        assert mlp.output_grad_handoff(m_splits, True, echo=True) is None
        assert experts.GroupedMLP(4, 96, 64, device="cpu", bias=True).output_grad_handoff(m_splits, True) is None
        with torch.no_grad():
            assert mlp.output_grad_handoff(m_splits, True) is None


def _run_layer(layer, x, target, kind, fused):
    return run_switched(layer, x, target, kind, fused, switch="FUSED_FP8_COMBINE_BACKWARD", record="backward")


@pytest.mark.parametrize("kind,dtype,case,main_grad", [
    ("blockwise", torch.float32, "random", False),
    ("mxfp8", torch.bfloat16, "one_expert", True),   # one expert pair takes every token
    ("tensor", torch.bfloat16, "few_tokens", False),  # most experts get no token
    ("blockwise", torch.float16, "few_tokens", True),
    ("mxfp8", torch.bfloat16, "scale_rows", False),  # F < H: probabilities applied in the experts, a plain combine
])
def test_moe_layer_fused_combine_backward_changes_nothing(kind, dtype, case, main_grad):
    torch.manual_seed(5)
    H, F = (96, 64) if case == "scale_rows" else (72, 96)  # F >= H: the probabilities weight the combine
    layer, x, target = layer_case(H, F, dtype, case, main_grad)
    assert layer.scale_rows == (case == "scale_rows")
    y0, dx0, g0, ops0 = _run_layer(layer, x, target, kind, False)
    y1, dx1, g1, ops1 = _run_layer(layer, x, target, kind, True)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and sorted(g0) == sorted(g1)
    assert [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert dx1.abs().sum() > 0 and all(g.abs().sum() > 0 for n, g in g1.items() if "experts" in n or "router" in n)
    # the fused backward: one op instead of expand_rows (the 16-bit dy) and fc2's quantize of it
    assert ops1.count("moe_graph.expand_quantize_pair") == ops0.count("moe_graph.expand_quantize_pair") + 1
    assert ops0.count("moe_graph.expand_rows") == ops1.count("moe_graph.expand_rows") + 1
    assert ops0.count("moe_graph.fp8_quantize_pair") == ops1.count("moe_graph.fp8_quantize_pair") + 1


@pytest.mark.parametrize("variant", ["expert_output_norm", "unaligned"])
def test_moe_layer_where_the_combine_does_not_read_fc2s_output(variant, monkeypatch):
    """An op between fc2 and the combine (the expert output norm) or the experts' own regrouping (no aligned
    dispatch): the combine does not take the hand-off (its input is not fc2's output); the same ops and results
    as with the switch off."""
    torch.manual_seed(7)
    kw = {"expert_output_norm": "scaled_rmsnorm"} if variant == "expert_output_norm" else {}
    if variant == "unaligned":
        monkeypatch.setattr(experts, "ALIGNED_DISPATCH", False)
    layer = MoELayer(72, 96, 4, 2, **kw)
    x, target = torch.randn(9, 72), torch.randn(9, 72)
    y0, dx0, g0, ops0 = _run_layer(layer, x, target, "blockwise", False)
    y1, dx1, g1, ops1 = _run_layer(layer, x, target, "blockwise", True)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert sorted(ops0) == sorted(ops1) and "moe_graph.expand_quantize_pair" not in ops1


def test_moe_layer_with_bias_keeps_the_16_bit_dy():
    """fc2's bias gradient sums the 16-bit dy: the layer does not ask for the hand-off (the same ops as off)."""
    torch.manual_seed(6)
    layer = MoELayer(72, 96, 4, 2, add_bias_linear=True)
    x, target = torch.randn(9, 72), torch.randn(9, 72)
    _, _, _, ops0 = _run_layer(layer, x, target, "blockwise", False)
    _, _, _, ops1 = _run_layer(layer, x, target, "blockwise", True)
    assert sorted(ops0) == sorted(ops1) and "moe_graph.fp8_quantize_pair" in ops1


# ------------------------------------------------------------------------------------------------- EP > 1 --
def _plus_zero_rows(g, route_of_row):
    """The oracle's dy at EP > 1: row i is the received gradient row ``route_of_row[i]`` (a zero row for the
    sentinel ``N``), every zero made +0 (what ``reduce_rows``' one-route sum from +0 writes; plain torch)."""
    n = g.shape[0]
    rows = torch.cat([g, g.new_zeros(1, g.shape[1])])[route_of_row.clamp(max=n)]
    return torch.where(rows == 0, torch.zeros_like(rows), rows)


def _signed_gradient(n, H, dtype, g, nonfinite=False):
    grad = (torch.randn(n, H, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 3)).to(dtype)
    grad[::2, ::3] = -0.0
    grad[1::4, 1::7] = 0.0
    if nonfinite:
        grad[1, 5] = float("nan")
        grad[-1, 2] = float("-inf")
    return grad


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_plus_zero_expand_quantize_equals_one_route_sum_then_quantize(recipe, dtype, case):
    N, _, H, splits, M = CASES[case]  # N received rows, M expert rows (K = 1: the regrouping is a permutation)
    N = max(N * 2, sum(splits))
    g = torch.Generator().manual_seed(case + 57)
    grad = _signed_gradient(N, H, dtype, g, nonfinite=case == 2)
    route_of_row, route_rows, m_splits = _routing(N, 1, M, splits, g)
    want_rows = _plus_zero_rows(grad, route_of_row)
    # today's dy: reduce_rows over the one route of each expert row writes exactly these rows
    assert torch.equal(bits(reduce_rows(grad, route_of_row.view(M, 1), route_rows.view(N))), bits(want_rows))
    r = RECIPES[recipe]
    got = expand_quantize_copies(grad, route_of_row, 1, m_splits, r, r.bwd_dtype, plus_zero=True)
    _assert_copies_equal(got, fp8.quantize_pair(want_rows, m_splits, r, r.bwd_dtype))
    if sum(splits) > 0 and case != 2:  # the protection: a plain read keeps -0 (byte 0x80)
        plain = expand_quantize_copies(grad, route_of_row, 1, m_splits, r, r.bwd_dtype)
        assert not torch.equal(bits(plain[0][0]), bits(got[0][0]))
        assert (bits(plain[0][0]) == 0x80).any() and not (bits(got[0][0])[:sum(splits)] == 0x80).any()


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "tensor"])
def test_plus_zero_opcheck(recipe):
    """The schema's ``plus_zero`` argument and the fake implementation (torch.library.opcheck)."""
    from moe_graph.ops.permute import _pair_tiles
    g = torch.Generator().manual_seed(12)
    src = _signed_gradient(30, 130, torch.bfloat16, g)
    route_of_row, _, m_splits = _routing(30, 1, 40, [5, 17, 0, 2], g)
    r = RECIPES[recipe]
    tr, tc, ctr, ctc, mx = _pair_tiles(r)
    torch.library.opcheck(torch.ops.moe_graph.expand_quantize_pair.default,
                          (src, route_of_row, 1, m_splits, [tr, tc, ctr, ctc], r.bwd_dtype, mx, 0.0, True),
                          {"weights": None, "plus_zero": True}, test_utils=("test_schema", "test_faketensor"))


def test_plus_zero_refusals():
    src, r = torch.randn(4, 16), RECIPES["blockwise"]
    route_of_row, route_rows, m_splits = _routing(4, 1, 8, [3, 1], torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="plus_zero"):
        expand_quantize_copies(src, route_of_row, 1, m_splits, r, r.bwd_dtype, torch.rand(4, 1), plus_zero=True)
    x, w2 = torch.randn(8, 32), torch.randn(2, 16, 32)
    h = fp8.GradHandoff(r, m_splits)
    y = fp8_grouped_linear(x, m_splits, [w2], None, r, grad_handoff=h)
    with pytest.raises(ValueError, match="grad_handoff needs K = 1"):
        expand_rows(y, route_rows.view(4), route_of_row.view(8, 1), torch.rand(8, 1), grad_handoff=h)
    with pytest.raises(ValueError, match="grad_handoff needs K = 1"):
        expand_rows(y * 1, route_rows.view(4), route_of_row.view(8, 1), grad_handoff=h)


class _Copies(OpNames):
    """:class:`OpNames` that also keeps the results ``(q, scale, q_t, scale_t)`` of the ops that write fc2's FP8 dy
    (``fp8_quantize_pair`` with the hand-off off, ``expand_quantize_pair`` with it on)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if str(func.overloadpacket) in ("moe_graph.fp8_quantize_pair", "moe_graph.expand_quantize_pair"):
            self.copies.append(out)
        return out


def _receive_chain(x, w2, probs, maps, r, handoff_on, target):
    """fc2, the receive side's regrouping back to the send slots (``expand_rows`` over the received rows, as
    ``TokenDispatcher._to_send_order`` at EP > 1; the exchange itself is the identity here) and the weighted sum of
    each token's routes: ``(out, dx, dw, dprobs, backward op names, fc2's FP8 dy copies)``."""
    expert_row_source, recv_row_target, route_of_slot, route_slot, m_splits = maps
    x, w, p = x.clone().requires_grad_(), w2.clone().requires_grad_(), probs.clone().requires_grad_()
    h = fp8.GradHandoff(r, m_splits) if handoff_on else None
    y = fp8_grouped_linear(x, m_splits, [w], None, r, grad_handoff=h)
    send = expand_rows(y, recv_row_target, expert_row_source.view(-1, 1), grad_handoff=h)
    out = reduce_rows(send, route_slot, route_of_slot, p)
    mode = _Copies()
    with mode:
        (out.float() * target).sum().backward()
    return out.detach(), x.grad, w.grad, p.grad, mode.seen, mode.copies


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8_hybrid", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", [0, 1, 2, 4])
def test_receive_side_regrouping_hands_fc2_its_fp8_dy(recipe, dtype, case):
    """-0 in the output gradient (times a positive probability: -0 at the receive side), inf / NaN in one case."""
    T, K, H, splits, M = CASES[case]
    N = 2 * T * K  # send slots (two ranks' worth), some empty
    g = torch.Generator().manual_seed(case + 200)
    expert_row_source, recv_rows, m_splits = _routing(N, 1, M, splits, g)
    route_of_slot, route_slot, _ = _routing(T, K, N, [N], g)
    maps = (expert_row_source, recv_rows.view(N), route_of_slot, route_slot, m_splits)
    x = torch.randn(M, 48, generator=g).to(dtype)
    w2 = (torch.randn(len(splits), H, 48, generator=g) * 0.1).to(dtype)
    probs = (torch.rand(T, K, generator=g) + 0.05).to(dtype)
    target = torch.randn(T, H, generator=g)
    target[::2, ::3] = -0.0
    if case == 2:
        target[1, 4], target[3, 9] = float("inf"), float("nan")
    r = RECIPES[recipe]
    ref = _receive_chain(x, w2, probs, maps, r, False, target)
    got = _receive_chain(x, w2, probs, maps, r, True, target)
    for a, b, what in zip(ref[:4], got[:4], ("out", "dx", "dw", "dprobs")):
        assert torch.equal(bits(a), bits(b)), what
    if sum(splits) > 0:
        assert got[1].nan_to_num().abs().sum() > 0 and got[3].nan_to_num().abs().sum() > 0
    # one op instead of the regrouping's reduce_rows (the 16-bit dy) and fc2's quantize of it
    assert ref[4].count("moe_graph.reduce_rows") == got[4].count("moe_graph.reduce_rows") + 1
    assert ref[4].count("moe_graph.fp8_quantize_pair") == 1 and got[4].count("moe_graph.fp8_quantize_pair") == 0
    assert got[4].count("moe_graph.expand_quantize_pair") == 1
    # fc2's dy bytes themselves (zero bytes: 0x00, as the 16-bit dy's +0 quantizes; a plain gather's -0 is 0x80)
    (q0, s0, qt0, st0), (q1, s1, qt1, st1) = ref[5][0], got[5][0]
    assert torch.equal(bits(q0), bits(q1)) and torch.equal(bits(s0), bits(s1)) and torch.equal(bits(qt0), bits(qt1))
    assert torch.equal(bits(st0), bits(st1.expand_as(st0)))


@pytest.mark.parametrize("world,kind,cf,dtype,case,exchange", [
    (2, "blockwise", 0.6, "bfloat16", "signed_zeros", "nccl"),  # routes dropped at the capacity
    (2, "mxfp8", None, "float32", "one_expert", "nccl"),        # experts 3 and 1 take every row; rank 1's none
    (2, "tensor", None, "bfloat16", "nonfinite", "nccl"),
    (2, "blockwise", None, "float32", "main_grad", "nccl"),
    (2, "blockwise", 0.6, "bfloat16", "signed_zeros", "symm_mem"),  # per destination, host-sized
    (2, "mxfp8", None, "float32", "one_expert", "symm_fake"),       # per destination, NVSHMEM (CPU model)
    (2, "blockwise", 0.6, "bfloat16", "signed_zeros", "nvlink"),    # the fused exchange (gloo), weighted dy
    (2, "blockwise", 0.6, "bfloat16", "second_consumer", "nvlink"),   # the fallbacks: dy sent again in 16 bits
    (2, "mxfp8", None, "float32", "second_consumer", "symm_fake"),
    # full_only (MOE_GRAPH_FULL_TESTS=0 skips them): 4-rank repeats of the 2-rank cases above, other recipes on the other exchanges
    *full_only((4, "mxfp8", 0.6, "bfloat16", "one_expert", "nccl"), (4, "tensor", 0.6, "float32", "signed_zeros", "nccl"),
               (4, "blockwise", None, "float32", "main_grad", "nccl"), (2, "tensor", 0.6, "bfloat16", "nonfinite", "symm_fake"),
               (2, "tensor", None, "float32", "nonfinite", "nvlink")),
])
def test_moe_layer_fused_combine_backward_multi_rank(world, kind, cf, dtype, case, exchange):
    """EP 2 / 4 on gloo: on the fixed-split exchange the regrouping of the returned gradient writes fc2's FP8 dy
    (one op instead of reduce_rows and fc2's quantize), on the per-destination and fused exchanges the receive side
    of the gradient's exchange (instead of its row gather or buffer copy and fc2's quantize); output, input gradient and every gradient
    (router: the probabilities' too; main_grad) equal the switch off bit for bit on every rank."""
    res = run_distributed(combine_backward_worker, world, kind, cf, dtype, case, exchange, timeout=300.0)
    for r in res:
        assert r["out_equal"] and r["dx_equal"] and r["unequal_grads"] == [] and r["grads"] == r["grads_on"], r
        assert r["dx_nonzero"] and "router.weight" in r["nonzero"], r
        if case == "second_consumer":  # the hand-off's copies were written, then fc2 quantized the summed 16-bit dy
            assert r["fused_ops"] == 1 and r["quantize_saved"] == 0 and r["exchanges_added"] >= 1, r
            continue
        assert r["fused_ops"] == 1 and r["quantize_saved"] == 1, r
        assert r["reduce_rows_saved"] == (1 if exchange == "nccl" else 0), r
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0
