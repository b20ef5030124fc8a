"""The fused ("nvlink") exchange's semantics on CPUs: its host reference (``torch.ops.moe_graph.exchange_*_reference``,
csrc/exchange/exchange_cpu.cpp, which the CUDA kernels equal bit for bit under the emulator: tests/test_emulator.py,
family ``exchange``) against the existing per-destination exchange on gloo (``HostSizedExchange`` after the
dispatcher's layout in quota mode and permute copy, ``reduce_rows`` over the rows sent back), bit for bit, at 2 and 4
ranks; and the ops' argument checks."""

import pytest
import torch

from helpers.exchange_workers import CASES, fused_reference_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.experts import FP8_ROW_ALIGNMENT, AlignedGroups
from moe_graph.ops import _lib
from moe_graph.ops.dispatch_layout import aligned_padded_rows

pytestmark = pytest.mark.skipif(not _lib.has_kernel("moe_graph::exchange_dispatch_reference", "cpu"),
                                reason="moe_graph._C without the exchange ops")

CHECKS = ("expert_in", "m_splits", "row_weights", "combine", "gather_routes", "route_row_rows", "aligned_expert_in",
          "aligned_row_weights", "aligned_m_splits", "fused_gloo_aligned")


@pytest.mark.parametrize("world", [2, 4])
def test_reference_equals_host_sized_exchange(world):
    res = run_distributed(fused_reference_worker, world, timeout=240.0)
    flat = [r for rank_res in res for r in rank_res]
    bad = [(r["case"], r["rank"], k) for r in flat for k in CHECKS if not r[k]]
    assert not bad, bad
    for case in CASES:
        rs = [r for r in flat if r["case"] == case[0]]
        assert sum(r["route_row_sent"] for r in rs) > 0
        if case[6] is not None:  # the capacity cut some arrivals
            assert sum(r["received"] for r in rs) < sum(r["sent"] for r in rs), case[0]


def _one_rank():
    rows = torch.arange(6, dtype=torch.float32).view(3, 2)
    ros = torch.tensor([2, 0, 4, 6, 6, 6])  # routes 2, 0, 4 kept (K = 2), then empty slots
    sc = torch.tensor([[2, 1]])
    return rows, ros, sc


def test_reference_one_rank_by_hand():
    rows, ros, sc = _one_rank()
    w = torch.tensor([0.5, 0.0, 2.0, 0.0, -1.0, 0.0])
    ei, ms, rw, rr, cnt = torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc], [w], 2, 4)
    assert ei[0].tolist() == [[2.0, 3.0], [0.0, 1.0], [4.0, 5.0], [0.0, 0.0]]  # tokens 1, 0, 2; zero padding
    assert ms[0].tolist() == [2, 1] == cnt[0].tolist() and rw[0].tolist() == [2.0, 0.5, -1.0, 0.0]
    assert rr[0].tolist() == [1, -1, 0, -1, 2, -1]
    y = torch.ops.moe_graph.exchange_combine_reference([ei[0]], [rr[0]], [w], 2)
    assert y[0].tolist() == [[0.0, 0.5], [4.0, 6.0], [-4.0, -5.0]]
    g = torch.ops.moe_graph.exchange_gather_reference([ei[0]], [rr[0]])
    assert g[0][0].tolist() == [0.0, 1.0] and g[0][1].tolist() == [0.0, 0.0]


def test_reference_bad_arguments():
    rows, ros, sc = _one_rank()
    with pytest.raises(RuntimeError, match="send_counts must have shape"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc.view(2, 1)], [], 2, 4)
    with pytest.raises(RuntimeError, match="route_of_slot must have dtype Long"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros.int()], [sc], [], 2, 4)
    with pytest.raises(RuntimeError, match="weights must have shape"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc], [torch.zeros(5)], 2, 4)
    with pytest.raises(RuntimeError, match="one tensor per rank"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows, rows], [ros], [sc], [], 2, 4)
    with pytest.raises(RuntimeError, match="expert_out must have dtype"):
        torch.ops.moe_graph.exchange_combine_reference([torch.zeros(4, 2, dtype=torch.uint8)], [ros], [], 2)
    assert list(torch.ops.moe_graph.exchange_layout(2, 3, 5, 37))[:3] == [6 * 2 + 2 * 2 * 2 * 3, 224, 192]


def test_nvlink_module_imports_and_needs_cuda():
    from moe_graph.ops import nvlink

    assert nvlink.layout(4, 2, 10, 16)[1] == 10 * 16 + 48
    assert nvlink.layout(4, 2, 10, 16, 16)[1:] == (48 * 16 + 192, 48 * 16, 4, 1535, 48)  # P = 48 rows
    if not _lib.has_kernel("moe_graph::exchange_dispatch", "cuda"):
        with pytest.raises(RuntimeError, match="CUDA build"):
            nvlink.NvlinkExchange()


# ------------------------------------------------------------------------------------------ aligned groups --
def _derive(rows, ros, counts, weights, K, capacity, align):
    """exchange.h's dispatch re-derived in plain Python loops (all ranks): the cut in source-major order at
    ``capacity`` real rows, local expert ``l``'s group at ``sum_{l' < l} ceil(m_l' / align) * align``, zeros
    elsewhere in ``P = ceil((capacity + (align - 1) * Lc) / align) * align`` rows."""
    R, Lc = counts[0].shape
    P = -(-(capacity + (align - 1) * Lc) // align) * align
    table = [[[max(0, int(counts[s][d][l])) for l in range(Lc)] for d in range(R)] for s in range(R)]
    fit = [[[0] * Lc for _ in range(R)] for _ in range(R)]
    for d in range(R):
        cum = 0
        for s in range(R):
            for l in range(Lc):
                f = min(table[s][d][l], max(0, capacity - cum))
                fit[s][d][l], cum = f, cum + f
    out = []
    for d in range(R):
        m = [sum(fit[s][d][l] for s in range(R)) for l in range(Lc)]
        padded = [-(-x // align) * align for x in m]
        out.append({"expert_in": torch.zeros((P,) + tuple(rows[0].shape[1:]), dtype=rows[0].dtype),
                    "row_weights": torch.zeros(P), "m_splits": padded, "counts": m,
                    "start": [sum(padded[:l]) for l in range(Lc)]})
    route_row = []
    for s in range(R):
        n = rows[s].shape[0] * K
        rr = [-1] * n
        slot = 0
        for d in range(R):
            for l in range(Lc):
                base = out[d]["start"][l] + sum(fit[s2][d][l] for s2 in range(s))
                for j in range(fit[s][d][l]):
                    q = int(ros[s][slot + j])
                    if 0 <= q < n:
                        out[d]["expert_in"][base + j] = rows[s][q // K]
                        out[d]["row_weights"][base + j] = float(weights[s][q])
                        rr[q] = d * P + base + j
                slot += table[s][d][l]
        route_row.append(rr)
    return out, route_row, P


def _aligned_case(R, case, capacity_scale, seed):
    """Per rank: rows [T, 3] fp32, route_of_slot, send_counts [R, Lc], weights, as the quota-mode layout packs them
    (slots by destination, local expert, route order; empty slots T*K)."""
    g = torch.Generator().manual_seed(seed)
    Lc, K = 3, 2
    rows, ros, counts, weights = [], [], [], []
    for s in range(R):
        T = 7 + 5 * s  # sizes off multiples of 16
        col = torch.randint(0, R * Lc, (T * K,), generator=g)
        if case == "zero_experts":  # only local expert 1 of every rank gets rows
            col = col // Lc * Lc + 1
        elif case == "one_takes_all":  # everything to local expert 2 of rank 0
            col = torch.full_like(col, 2)
        order = torch.argsort(col, stable=True)
        c = torch.bincount(col, minlength=R * Lc).view(R, Lc)
        rows.append(torch.randn(T, 3, generator=g))
        ros.append(torch.cat([order, torch.full((3,), T * K)]))
        counts.append(c)
        weights.append(torch.randn(T * K, generator=g))
    total = max(int(sum(c[d].sum() for c in counts)) for d in range(R))
    return rows, ros, counts, weights, K, max(1, int(total * capacity_scale))


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("case,capacity_scale", [("random", 1.0), ("random", 0.6), ("zero_experts", 1.3),
                                                 ("one_takes_all", 1.0), ("one_takes_all", 0.5)])
@pytest.mark.parametrize("align", [1, 16])
def test_reference_aligned_equals_plain_derivation(R, case, capacity_scale, align):
    rows, ros, counts, weights, K, cap = _aligned_case(R, case, capacity_scale, 7 * R + len(case))
    ei, ms, rw, rr, cnt = torch.ops.moe_graph.exchange_dispatch_reference(rows, ros, counts, weights, K, cap, align)
    want, want_rr, P = _derive(rows, ros, counts, weights, K, cap, align)
    for d in range(R):
        assert ei[d].shape[0] == P and torch.equal(ei[d], want[d]["expert_in"]), d
        assert torch.equal(rw[d], want[d]["row_weights"]), d
        assert ms[d].tolist() == want[d]["m_splits"] and cnt[d].tolist() == want[d]["counts"], d
        assert rr[d].tolist() == want_rr[d], d
        if align > 1:
            assert all(x % align == 0 for x in ms[d].tolist())
    assert P == aligned_padded_rows(cap, counts[0].shape[1], align)
    if capacity_scale < 1:  # the cut kept exactly `capacity` real rows on the busiest rank
        assert max(int(c.sum()) for c in cnt) == cap


@pytest.mark.parametrize("R,case", [(2, "random"), (4, "zero_experts"), (2, "one_takes_all")])
def test_reference_aligned_equals_unaligned_then_regrouped(R, case):
    """The oracle independent of the new layout: today's unaligned reference followed by the experts' regrouping
    (``experts.AlignedGroups.pad``); route_row through its ``padded_of_source``; combine / gather_routes over the
    padded expert outputs equal to those over the unaligned ones."""
    rows, ros, counts, weights, K, cap = _aligned_case(R, case, 0.8, 3 + R)
    ei0, ms0, rw0, rr0, cnt0 = torch.ops.moe_graph.exchange_dispatch_reference(rows, ros, counts, weights, K, cap)
    ei, ms, rw, rr, cnt = torch.ops.moe_graph.exchange_dispatch_reference(rows, ros, counts, weights, K, cap, 16)
    groups = [AlignedGroups(ms0[d], cap, FP8_ROW_ALIGNMENT) for d in range(R)]
    P = groups[0].padded_rows
    for d in range(R):
        assert torch.equal(cnt0[d], ms0[d]) and torch.equal(cnt[d], ms0[d])
        assert torch.equal(ms[d], groups[d].m_splits)
        assert torch.equal(ei[d], groups[d].pad(ei0[d]))
        assert torch.equal(rw[d], groups[d].pad(rw0[d].view(-1, 1)).view(-1))
    padded_of = torch.stack([g.padded_of_source for g in groups])  # [R, cap]
    for s in range(R):
        r0 = rr0[s]
        d, row = torch.where(r0 >= 0, r0 // cap, 0), torch.where(r0 >= 0, r0 % cap, 0)
        assert torch.equal(rr[s], torch.where(r0 >= 0, d * P + padded_of[d, row], -1))
    outs0 = [torch.randn(cap, 4, generator=torch.Generator().manual_seed(40 + d)) for d in range(R)]
    outs = [groups[d].pad(outs0[d]) for d in range(R)]
    y0 = torch.ops.moe_graph.exchange_combine_reference(outs0, list(rr0), weights, K)
    y1 = torch.ops.moe_graph.exchange_combine_reference(outs, list(rr), weights, K)
    g0 = torch.ops.moe_graph.exchange_gather_reference(outs0, list(rr0))
    g1 = torch.ops.moe_graph.exchange_gather_reference(outs, list(rr))
    assert all(torch.equal(a, b) for a, b in zip(y0, y1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_reference_align_is_checked():
    rows, ros, sc = _one_rank()
    for bad in (0, -3, (1 << 20) + 1):
        with pytest.raises(RuntimeError, match="align must be in"):
            torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc], [], 2, 4, bad)
    assert list(torch.ops.moe_graph.exchange_layout(2, 3, 5, 37, 16))[5] == aligned_padded_rows(5, 3, 16) == 64
