"""The FP8 experts' 16-row group alignment composed into the dispatcher's index maps
(``TokenDispatcher.dispatch(align_rows=...)``, ``GroupedMLP.forward(aligned=True)``): every row moves once, straight
to its aligned row and straight back. The oracle is the previous path (the dispatcher's unpadded rows regrouped by
the experts, :class:`moe_graph.moe.experts.AlignedGroups`): output and every gradient (tokens, routing
probabilities, weights or ``main_grad``) equal bit for bit. EP 1 (zero-token experts, one expert taking every
route, capacity rows past the routed ones, group sizes off multiples of 16, the probabilities applied in the
experts, FP8 dispatch) and EP 2 on gloo (the fixed-split, the host-sized and NVSHMEM (CPU model) per-destination and
the fused exchanges, drops, echo, FP8 dispatch). The aligned handle's index maps (the layout ops' ``align``) equal
the previous composition (``aligned_groups`` of the counts composed into the unaligned maps) at EP 1 and 2."""

import pytest
import torch

import moe_graph
import moe_graph.moe.experts as experts
from conftest import full_only
from helpers.aligned_dispatch_workers import aligned_dispatch_worker, aligned_handle_worker, run_layer, symm_mem_worker
from helpers.aligned_reference import aligned_send
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.experts import FP8_ROW_ALIGNMENT, GroupedMLP
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns
from moe_graph.ops import fp8
from moe_graph.ops.dispatch_layout import aligned_padded_rows

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without the FP8 ops")

E, H, F = 6, 64, 48


def _routes(case: str, T: int, K: int):
    g = torch.Generator().manual_seed(3)
    if case == "all_one":  # every route to expert 4 (K distinct experts per token: the rest to experts 4 and 5)
        idx = torch.tensor([[4, 5]]).expand(T, K).clone() if K == 2 else torch.full((T, 1), 4)
    elif case == "zero_experts":  # experts 0, 2 and 3 get nothing
        idx = torch.stack([torch.where(torch.rand(T, generator=g) < 0.5, 1, 4),
                           torch.where(torch.rand(T, generator=g) < 0.3, 5, 4)], 1)
        idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], 5, idx[:, 1])
    else:
        idx = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K]
    return idx, torch.rand(T, K, generator=g)


def _dispatch_experts_combine(d, mlp, x, idx, probs, kind, row_scale, aligned_dispatch, dtype):
    """One forward and backward of dispatch -> FP8 experts -> combine; ``aligned_dispatch``: the dispatcher aligns
    the groups (the new path), else the experts regroup (the old path, forced with ``experts.AlignedGroups``)."""
    xx = x.clone().requires_grad_()
    pp = probs.clone().requires_grad_()
    with moe_graph.fp8.autocast(recipe=kind):
        align = mlp.row_alignment() if aligned_dispatch else None
        expert_in, m, h = d.dispatch(xx, idx, pp, align_rows=align)
        assert h.aligned == aligned_dispatch
        rs = d.row_weights(h) if row_scale else None
        out = mlp(expert_in.to(dtype), m, row_scale=rs, aligned=h.aligned)
        y = d.combine(out, h, weighted=not row_scale)
    target = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=y.dtype)
    (y.float() * target.float()).sum().backward()
    grads = []
    for w in mlp.weights():
        grads.append(w.main_grad.clone() if hasattr(w, "main_grad") else w.grad.clone())
        if hasattr(w, "main_grad"):
            w.main_grad.zero_()
        w.grad = None
    return [y.detach(), xx.grad, pp.grad] + grads, (expert_in, m, h)


@pytest.mark.parametrize("kind,case,T,K,cap,row_scale,main_grad,dtype", [
    ("blockwise", "random", 27, 2, None, False, False, torch.float32),   # dropless: capacity rows past the routes
    ("mxfp8", "zero_experts", 23, 2, 30, True, True, torch.bfloat16),     # zero-token experts, probs in the experts
    ("tensor", "all_one", 19, 2, None, False, True, torch.float32),       # one expert takes all, sizes off 16
    ("blockwise", "all_one", 40, 1, 33, True, False, torch.bfloat16),     # routes dropped over the capacity
    ("mxfp8", "random", 5, 2, 64, False, False, torch.float32),           # more capacity rows than routes
])
def test_aligned_dispatch_equals_regrouping_experts(kind, case, T, K, cap, row_scale, main_grad, dtype):
    torch.manual_seed(0)
    cr, cl = expert_columns(E, 1)
    d = TokenDispatcher(E, 1, 0, cr, cl, capacity=cap)
    mlp = GroupedMLP(E, H, F, params_dtype=dtype, device="cpu")
    if main_grad:
        for w in mlp.weights():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    x = torch.randn(T, H, dtype=dtype)
    idx, probs = _routes(case, T, K)
    old, (_, m0, h0) = _dispatch_experts_combine(d, mlp, x, idx, probs, kind, row_scale, False, dtype)
    new, (xin, m1, h1) = _dispatch_experts_combine(d, mlp, x, idx, probs, kind, row_scale, True, dtype)
    for a, b in zip(old, new):
        assert torch.equal(a, b)
    assert new[-1].abs().sum() > 0 and new[2].abs().sum() > 0  # the gradients are not trivially zero
    # the new path's layout: padded counts, groups at multiples of 16, each row where AlignedGroups puts it
    N = h0.expert_rows
    P = aligned_padded_rows(N, E, FP8_ROW_ALIGNMENT)
    assert h1.expert_rows == P and xin.shape[0] == P and torch.equal(h1.m_splits, m0)
    assert torch.equal(m1, ((m0 + 15) // 16) * 16)
    ref = experts.AlignedGroups(m0, N, FP8_ROW_ALIGNMENT)
    x0, _, _ = d.dispatch(x, idx, probs)
    assert torch.equal(xin, ref.pad(x0)) and torch.equal(m1, ref.m_splits)
    if case == "zero_experts":
        assert (m0 == 0).sum() == 3


def test_aligned_dispatch_does_not_regroup(monkeypatch):
    """With the alignment composed into the dispatch the experts never build the regrouping (and the layer's
    statistics keep the routed rows per expert, not the padded ones)."""
    torch.manual_seed(1)
    layer = MoELayer(96, 64, 4, 2)
    x = torch.randn(21, 96)

    def fail(*a, **k):
        raise AssertionError("AlignedGroups built on the aligned path")

    monkeypatch.setattr(experts, "AlignedGroups", fail)
    with moe_graph.fp8.autocast(recipe="blockwise"):
        layer(x).sum().backward()
    assert int(layer.last_m_splits.sum()) == 42
    monkeypatch.setattr(experts, "ALIGNED_DISPATCH", False)
    with pytest.raises(AssertionError, match="AlignedGroups built"):
        with moe_graph.fp8.autocast(recipe="blockwise"):
            layer(x)


@pytest.mark.parametrize("kind,fp8_dispatch,probs_on_input,cf", [("blockwise", False, False, None),
                                                                   ("mxfp8", True, False, 0.7),
                                                                   ("tensor", False, True, None)])
def test_moe_layer_aligned_dispatch_one_rank(kind, fp8_dispatch, probs_on_input, cf):
    """The whole layer (ffn 64 < hidden 96: the probabilities scale the rows inside the experts; or before them):
    output, input gradient and every parameter gradient equal the regrouping experts' bit for bit."""
    torch.manual_seed(2)
    layer = MoELayer(96, 64, 5, 2, fp8_dispatch=fp8_dispatch, probs_on_input=probs_on_input, capacity_factor=cf)
    x, target = torch.randn(37, 96), torch.randn(37, 96)
    y0, dx0, g0, a0 = run_layer(layer, x, target, kind, False)
    y1, dx1, g1, a1 = run_layer(layer, x, target, kind, True)
    assert not a0 and a1
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and sorted(g0) == sorted(g1)
    assert [n for n in g0 if not torch.equal(g0[n], g1[n])] == []


@pytest.mark.parametrize("kind,exchange,cf,spare,fp8_dispatch,composes", [
    ("blockwise", "nccl", 0.6, 0, False, True),   # fixed-split exchange, routes dropped
    ("mxfp8", "nccl", None, 1, True, True),       # dropless, one echo slot per rank, FP8 dispatch
    ("blockwise", "symm_mem", 0.8, 0, False, True),   # per destination (host-sized on gloo), routes dropped
    ("mxfp8", "symm_mem", None, 1, True, True),      # per destination, dropless, echo, FP8 dispatch
    ("blockwise", "nvlink", 0.8, 1, False, True),    # the fused exchange (gloo) places the rows aligned, echo
    ("blockwise", "nvlink", 0.7, 0, True, True),     # the fused exchange, FP8 dispatch's packed rows, drops
    ("mxfp8", "nvlink", None, 0, False, True),       # the fused exchange, dropless
])
def test_aligned_dispatch_two_ranks(kind, exchange, cf, spare, fp8_dispatch, composes):
    res = run_distributed(aligned_dispatch_worker, 2, kind, exchange, cf, spare, fp8_dispatch, timeout=240.0)
    for r in res:
        assert r["out_equal"] and r["dx_equal"] and r["unequal_grads"] == [], r
        assert not r["aligned_before"] and r["aligned_after"] == composes, r
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0


@pytest.mark.parametrize("align", [16, 3])
@pytest.mark.parametrize("case,T,K,cap", [("random", 27, 2, None), ("zero_experts", 23, 2, 30), ("all_one", 19, 2, None),
                                          ("all_one", 40, 1, 33), ("random", 5, 2, 64)])
def test_aligned_handle_equals_the_composition_one_rank(align, case, T, K, cap):
    # EP 1: the aligned handle's maps are the unaligned ones with aligned_groups of the counts composed in
    cr, cl = expert_columns(E, 1)
    d = TokenDispatcher(E, 1, 0, cr, cl, capacity=cap)
    x = torch.randn(T, H)
    idx, probs = _routes(case, T, K)
    _, m0, h0 = d.dispatch(x, idx, probs)
    _, m1, h1 = d.dispatch(x, idx, probs, align_rows=align)
    rs, ros, pm = aligned_send(h0.route_slot, h0.route_of_slot, h0.m_splits, align)
    assert torch.equal(h1.route_slot, rs) and torch.equal(h1.route_of_slot, ros)
    assert torch.equal(h1.aligned_m_splits, pm) and torch.equal(m1, pm) and torch.equal(h1.m_splits, m0)
    assert h1.expert_row_source is None and h1.recv_row_target is None and h1.expert_rows == ros.shape[0]
    if cap == 33:
        assert int(h1.dropped) == 7


def test_aligned_handle_equals_the_composition_two_ranks():
    res = run_distributed(aligned_handle_worker, 2, timeout=240.0)
    for r in res:
        assert all(v == [] for k, v in r.items() if "align" in k), r
    assert sum(r["cap 5 dropped"] for r in res) > 0 and sum(r["cap None dropped"] for r in res) == 0

def test_align_rows_is_checked_before_anything_moves():
    cr, cl = expert_columns(4, 1)
    d = TokenDispatcher(4, 1, 0, cr, cl, capacity=3)
    x, idx = torch.randn(5, 8), torch.zeros(5, 1, dtype=torch.long)
    for bad in (0, True, 2.0, 1 << 21):
        with pytest.raises(ValueError, match="align_rows"):
            d.dispatch(x, idx, torch.ones(5, 1), align_rows=bad)
    assert int(d.dropped_routes) == 0  # the layout op (which counts the drops) never ran


@pytest.mark.parametrize("kind,cf,spare,fp8_dispatch", [
    *full_only((None, 0.8, 0, False)),  # 16-bit rows, drops (the FP8 cases' unaligned runs read that layout too)
    ("blockwise", None, 0, False),  # FP8 experts, dropless: aligned by the exchange vs regrouped by the experts
    ("mxfp8", 0.8, 1, True),        # FP8 dispatch (byte rows), one echo slot, routes dropped
])
def test_symm_mem_exchange_layout_on_a_model_of_torchs_ops(kind, cf, spare, fp8_dispatch):
    """``SymmMemExchange`` (the NVSHMEM per-destination exchange; here on ``helpers.symm_mem_fake``, torch's
    ``all_to_all_vdev_2d`` semantics on gloo, which leave a row per empty expert and uninitialised memory NaN)
    equals the host-sized exchange bit for bit: outputs, input gradients and every parameter gradient, unaligned and
    aligned (FP8: the exchange lays the groups at 16-row starts itself, the experts do not regroup; with 16-bit
    dispatch its receive side writes the two FP8 copies, against the 16-bit rows the experts regroup and quantize)."""
    res = run_distributed(symm_mem_worker, 2, kind, cf, spare, fp8_dispatch, timeout=240.0)
    for r in res:
        assert r["calls"] == ["all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"], r
        assert r["empty_local_expert"], r
        for aligned, eq in r["equal"].items():
            assert eq[0] and eq[1] and eq[2] and eq[3] == [], (aligned, r)
            assert r["aligned"][aligned] == (aligned, aligned), r
        # the aligned run's receive sides, on both exchanges, wrote the FP8 expert input (16-bit dispatch: from the
        # received rows; FP8 dispatch: from the packed rows) and, without echo, fc2's FP8 dy (the combine's backward)
        want = 0 if kind is None else 1 if fp8_dispatch else 2
        assert r["quantized"] == {"ref": want, "sym": want}, r
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0
