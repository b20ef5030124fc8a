"""The dispatcher's layout ops against a plain-Python reference (loops over routes): kept routes under both drop
policies, send slots by (destination, local expert, route), counts, counters; the receive order of a simulated
multi-rank exchange; errors naming the argument; fake tensors and opcheck. The aligned layouts (``align``) against
the previous composition (``aligned_groups`` of the counts composed into the align-1 maps,
``helpers.aligned_reference``). CUDA vs CPU where a GPU exists."""

import pytest
import torch

from conftest import requires_cuda
from helpers.aligned_reference import aligned_receive, aligned_send
from moe_graph.moe.token_dispatcher import expert_columns
import moe_graph.ops.dispatch_layout as DL
from moe_graph.ops.dispatch_layout import aligned_groups, aligned_padded_rows, dispatch_layout, receive_layout
from moe_graph.testing.moe_reference import kept_routes


@pytest.fixture(params=["native", "torch"])
def impl(request, monkeypatch):
    """The native ops, or the pure-torch path of builds without them (which must compute the same)."""
    if request.param == "torch":
        monkeypatch.setattr(DL, "native_available", lambda device_type="cpu": False)
    return request.param


def reference_layout(indices, valid, col_rank, col_local, R, Lc, cap, probs=None, quota=None):
    """Plain loops: (route_slot, route_of_slot, send_counts, column_counts, dropped, max_live). ``quota``: one limit
    per destination instead of ``cap`` and packed send slots (quota mode)."""
    T, K = indices.shape
    n = T * K
    N = n if quota is not None else R * cap
    limit = [max(int(q), 0) for q in quota] if quota is not None else [cap] * R
    idx = [int(v) for v in indices.reshape(-1)]
    ok = [True] * n if valid is None else [bool(v) for v in valid.reshape(-1)]
    order = list(range(n))
    if probs is not None:
        pf = [float(v) for v in probs.reshape(-1)]
        order.sort(key=lambda r: -pf[r])  # stable: ties in route order
    live = [0] * R
    kept = set()
    for r in order:
        if not ok[r]:
            continue
        d = int(col_rank[idx[r]])
        if live[d] < limit[d]:
            kept.add(r)
        live[d] += 1
    route_slot, route_of_slot = [N] * n, [n] * N
    send_counts = [[0] * Lc for _ in range(R)]
    before = 0  # kept routes of the destinations before d (packed slots)
    for d in range(R):
        mine = sorted((int(col_local[idx[r]]), r) for r in kept if int(col_rank[idx[r]]) == d)
        base = before if quota is not None else d * cap
        for p, (l, r) in enumerate(mine):
            route_slot[r] = base + p
            route_of_slot[base + p] = r
            send_counts[d][l] += 1
        before += len(mine)
    column_counts = [0] * len(col_rank)
    for r in range(n):
        if ok[r]:
            column_counts[idx[r]] += 1
    dropped = sum(max(v - lim, 0) for v, lim in zip(live, limit))
    return route_slot, route_of_slot, send_counts, column_counts, dropped, max(live) if live else 0


def _order(probs):
    return torch.argsort(probs.reshape(-1), descending=True, stable=True)


def _routing(T, C, K, g, p_invalid=0.0, skew=None):
    if skew is None:
        idx = torch.stack([torch.randperm(C, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    else:  # every route to the first `skew` columns
        idx = torch.stack([torch.randperm(skew, generator=g)[:K] for _ in range(T)])
    idx = idx.to(torch.int64)
    valid = torch.rand(T, K, generator=g) >= p_invalid
    probs = torch.rand(T, K, generator=g)
    return idx, valid, probs


def _check(idx, valid, cr, cl, R, Lc, cap, probs=None):
    counters = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64),
                torch.zeros((), dtype=torch.float64))
    out = dispatch_layout(idx, cr, cl, R, Lc, cap, valid=valid, route_order=None if probs is None else _order(probs),
                          counters=counters)
    rs, ros, sc, cc, dropped, max_live = reference_layout(idx, valid, cr, cl, R, Lc, cap, probs)
    assert out.route_slot.tolist() == rs
    assert out.route_of_slot.tolist() == ros
    assert out.send_counts.tolist() == sc
    assert out.column_counts.tolist() == cc
    assert int(out.dropped) == dropped
    assert int(counters[0]) == int(counters[1]) == dropped
    n = idx.numel()
    assert float(counters[2]) == (max_live * R / n if n else 0.0)
    if n:  # the kept routes are the ones the MoE reference keeps
        keep = kept_routes(idx, cr, cap, valid=valid, probs=probs)
        assert (out.route_slot.view_as(idx) < R * cap).tolist() == keep.tolist()
    return out


@pytest.mark.parametrize("policy", ["position", "probs"])
@pytest.mark.parametrize("R,E,k", [(1, 8, 0), (2, 8, 0), (4, 8, 1), (3, 6, 2)])
def test_layout_matches_reference(gen, impl, policy, R, E, k):
    cr, cl = expert_columns(E, R, k)
    Lc, C = E // R + k, E + R * k
    for T, K, cf, p_invalid in [(40, 2, 1.0, 0.0), (33, 3, 0.6, 0.2), (25, 4, 2.0, 0.5), (17, 1, 0.3, 0.0)]:
        idx, valid, probs = _routing(T, C, K, gen, p_invalid)
        cap = max(1, int(cf * T * K / R))
        _check(idx, valid, cr, cl, R, Lc, cap, probs if policy == "probs" else None)
        _check(idx, None, cr, cl, R, Lc, T * K, probs if policy == "probs" else None)  # dropless


def test_one_expert_takes_everything_and_zero_token_experts(gen, impl):
    R, E = 2, 8
    cr, cl = expert_columns(E, R)
    T = 30
    idx = torch.full((T, 1), 5, dtype=torch.int64)  # all on rank 1, local expert 1
    out = _check(idx, None, cr, cl, R, E // R, 10)
    assert out.send_counts.tolist() == [[0, 0, 0, 0], [0, 10, 0, 0]]
    assert out.column_counts.tolist() == [0] * 5 + [30, 0, 0]
    assert out.route_of_slot[:10].tolist() == [T] * 10  # rank 0's block is empty
    assert out.route_of_slot[10:].tolist() == list(range(10))  # the first ten routes, in order
    idx, valid, probs = _routing(T, E, 2, gen, skew=3)  # experts 3..7 get nothing
    out = _check(idx, valid, cr, cl, R, E // R, 12, probs)
    assert out.send_counts[:, 3].tolist() == [0, 0] and out.send_counts[1].tolist() == [0] * 4


def test_docstring_example_and_r1_send_buffer_is_the_expert_input(gen, impl):
    out = dispatch_layout(torch.tensor([[2, 0], [0, 1]]), torch.zeros(3, dtype=torch.int64), torch.arange(3), 1, 3, 4)
    assert out.route_slot.tolist() == [3, 0, 1, 2] and out.route_of_slot.tolist() == [1, 2, 3, 0]
    assert out.send_counts.tolist() == [[2, 1, 1]]
    # R = 1: slot order is expert order, then token order; padding after the real rows
    T, E, K = 23, 5, 2
    idx, valid, _ = _routing(T, E, K, gen, 0.3)
    out = dispatch_layout(idx, torch.zeros(E, dtype=torch.int64), torch.arange(E), 1, E, T * K, valid=valid)
    expected = [t * K + j for e in range(E) for t in range(T) for j in range(K) if valid[t, j] and idx[t, j] == e]
    n = len(expected)
    assert out.route_of_slot[:n].tolist() == expected and out.route_of_slot[n:].tolist() == [T * K] * (T * K - n)
    assert out.send_counts[0].tolist() == [int(((idx == e) & valid).sum()) for e in range(E)]


def test_empty_and_int32_and_no_counters(gen, impl):
    cr, cl = expert_columns(4, 2)
    out = dispatch_layout(torch.zeros(0, 2, dtype=torch.int64), cr, cl, 2, 2, 3)
    assert out.route_slot.shape == (0,) and out.route_of_slot.tolist() == [0] * 6
    assert out.send_counts.tolist() == [[0, 0], [0, 0]] and int(out.dropped) == 0
    idx, valid, _ = _routing(9, 4, 2, gen)
    a = dispatch_layout(idx.to(torch.int32), cr, cl, 2, 2, 5, valid=valid)
    b = dispatch_layout(idx, cr, cl, 2, 2, 5, valid=valid)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # counters: cumulative drops add up, the load ratio keeps the step's largest
    c = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64))
    dispatch_layout(idx, cr, cl, 2, 2, 5, counters=c)
    first = (int(c[0]), float(c[2]))
    dispatch_layout(idx[:, :1], cr, cl, 2, 2, 100, counters=c)  # no drops, another ratio
    assert int(c[0]) == int(c[1]) == first[0] > 0
    assert float(c[2]) == max(first[1], float(torch.bincount(cr[idx[:, 0]], minlength=2).max()) * 2 / 9)


def test_invalid_routes_ignore_their_index(impl):
    cr, cl = expert_columns(4, 1)
    idx = torch.tensor([[0, -1], [99, 3]])
    valid = torch.tensor([[True, False], [False, True]])
    out = dispatch_layout(idx, cr, cl, 1, 4, 4, valid=valid)
    assert out.route_slot.tolist() == [0, 4, 4, 1] and out.column_counts.tolist() == [1, 0, 0, 1]


def test_receive_layout_of_a_simulated_exchange(gen, impl):
    # R ranks each lay out their routes; rank `me` receives block s = rank s's slots for `me`; the expert input must
    # be its rows grouped by local expert, then source rank, then the sender's order.
    for R, E, k, T, K, cf in [(2, 8, 0, 20, 2, 1.0), (4, 8, 1, 15, 3, 0.7), (3, 3, 0, 10, 2, 3.0)]:
        cr, cl = expert_columns(E, R, k)
        Lc = E // R + k
        cap = max(1, int(cf * T * K / R))
        lays, idxs = [], []
        for s in range(R):
            idx, valid, probs = _routing(T, E + R * k, K, gen, 0.1)
            lays.append(dispatch_layout(idx, cr, cl, R, Lc, cap, valid=valid))
            idxs.append(idx)
        for me in range(R):
            recv_counts = torch.stack([lays[s].send_counts[me] for s in range(R)])
            # payload: (source, route, local expert) per receive row
            recv = [(s, int(r), int(cl[idxs[s].reshape(-1)[r]]) if r < T * K else None)
                    for s in range(R) for r in lays[s].route_of_slot[me * cap:(me + 1) * cap]]
            src, tgt, m_splits, aligned_m_splits = receive_layout(recv_counts, cap)
            assert torch.equal(aligned_m_splits, m_splits)  # align 1
            N = R * cap
            got = [recv[i] if i < N else None for i in src.tolist()]
            real = sorted([x for x in recv if x[2] is not None], key=lambda x: (x[2], x[0]))  # stable: sender order
            assert got == real + [None] * (N - len(real))
            assert m_splits.tolist() == [sum(1 for x in real if x[2] == l) for l in range(Lc)]
            for i, t in enumerate(tgt.tolist()):  # the inverse; empty receive rows map to N
                assert (t == N) == (recv[i][2] is None)
                if t < N:
                    assert src[t] == i


# ------------------------------------------------------------------------------------------- aligned layouts --
def _aligned_cases(gen):
    """(name, indices, valid, probs, E, capacity): R = 1 routings covering the aligned layout's corners."""
    E = 6
    idx, valid, probs = _routing(37, E, 2, gen, 0.1)
    yield "random", idx, valid, probs, E, 74  # dropless: capacity rows past the routed ones
    idx, valid, probs = _routing(40, E, 2, gen, skew=3)
    yield "zero-token experts", idx, valid, probs, E, 80  # experts 3..5 get nothing
    yield "drops at capacity", idx, valid, probs, E, 29  # 80 routes into 29 rows
    idx = torch.full((33, 1), 4, dtype=torch.int64)
    yield "one expert takes everything", idx, None, torch.rand(33, 1, generator=gen), E, 33
    yield "one expert over capacity", idx, None, torch.rand(33, 1, generator=gen), E, 17
    idx, valid, probs = _routing(5, E, 2, gen)
    yield "rows past the routes", idx, valid, probs, E, 64
    yield "no tokens", torch.zeros(0, 2, dtype=torch.int64), None, torch.zeros(0, 2), E, 3


@pytest.mark.parametrize("align", [1, 16, 3])
@pytest.mark.parametrize("policy", ["position", "probs"])
def test_aligned_dispatch_layout_equals_the_composition(gen, impl, align, policy):
    # R = 1: dispatch_layout(align=a) must be the align-1 layout with aligned_groups of its counts composed in
    for name, idx, valid, probs, E, cap in _aligned_cases(gen):
        cr, cl = torch.zeros(E, dtype=torch.int64), torch.arange(E)
        order = _order(probs) if policy == "probs" else None
        plain = dispatch_layout(idx, cr, cl, 1, E, cap, valid=valid, route_order=order)
        counters = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64),
                    torch.zeros((), dtype=torch.float64))
        got = dispatch_layout(idx, cr, cl, 1, E, cap, valid=valid, route_order=order, counters=counters, align=align)
        rs, ros, m = aligned_send(plain.route_slot, plain.route_of_slot, plain.send_counts, align)
        P = aligned_padded_rows(cap, E, align)
        assert ros.shape == (P,) and got.route_of_slot.shape == (P,), name
        assert torch.equal(got.route_slot, rs), name
        assert torch.equal(got.route_of_slot, ros), name
        assert torch.equal(got.aligned_counts.view(E), m), name
        for a, b in zip(got[2:5], plain[2:5]):  # send_counts, column_counts, dropped: the real ones
            assert torch.equal(a, b), name
        assert int(counters[0]) == int(plain.dropped), name
        if align == 1:  # today's layout, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(got, plain))
            assert torch.equal(got.aligned_counts, plain.send_counts)


def _synthetic_recv_counts(R, Lc, cap, gen, case):
    if case == "zero":
        return torch.zeros(R, Lc, dtype=torch.int64)
    if case == "one expert takes everything":
        c = torch.zeros(R, Lc, dtype=torch.int64)
        c[:, Lc - 1] = cap
        return c
    if case == "full":  # every source sends its whole capacity, sizes off multiples of 16
        c = torch.zeros(R, Lc, dtype=torch.int64)
        for s in range(R):
            cut = torch.sort(torch.randint(0, cap + 1, (Lc - 1,), generator=gen)).values
            c[s] = torch.diff(torch.cat([torch.tensor([0]), cut, torch.tensor([cap])]))
        return c
    c = torch.zeros(R, Lc, dtype=torch.int64)  # random, below the capacity, some zero-token local experts
    for s in range(R):
        left = int(torch.randint(0, cap + 1, (1,), generator=gen))
        for l in range(Lc):
            v = 0 if torch.rand(1, generator=gen) < 0.3 else int(torch.randint(0, left + 1, (1,), generator=gen))
            c[s, l] = v
            left -= v
    return c


@pytest.mark.parametrize("align", [1, 16, 3])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_aligned_receive_layout_equals_the_composition(gen, impl, align, R):
    # receive_layout(align=a) must be the align-1 receive layout with aligned_groups of its m_splits composed in
    for Lc, cap in [(3, 7), (5, 40), (1, 17), (4, 16)]:
        for case in ["random", "zero", "one expert takes everything", "full"]:
            counts = _synthetic_recv_counts(R, Lc, cap, gen, case)
            plain = receive_layout(counts, cap)
            got = receive_layout(counts, cap, align=align)
            src, tgt, m = aligned_receive(plain.expert_row_source, plain.recv_row_target, plain.m_splits, align)
            P = aligned_padded_rows(R * cap, Lc, align)
            what = (Lc, cap, case)
            assert got.expert_row_source.shape == (P,) and src.shape == (P,), what
            assert torch.equal(got.expert_row_source, src), what
            assert torch.equal(got.recv_row_target, tgt), what
            assert torch.equal(got.m_splits, plain.m_splits), what
            assert torch.equal(got.aligned_m_splits, m), what
            if align == 1:
                assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_align_errors_name_the_argument(impl):
    cr, cl = torch.zeros(4, dtype=torch.int64), torch.arange(4)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    for bad in [0, -1, (1 << 20) + 1, True, 2.0]:
        with pytest.raises(ValueError, match=r"dispatch_layout: align must be an int in \[1, 2\^20\]"):
            dispatch_layout(idx, cr, cl, 1, 4, 4, align=bad)
        with pytest.raises(ValueError, match=r"receive_layout: align must be an int in \[1, 2\^20\]"):
            receive_layout(torch.ones(2, 4, dtype=torch.int64), 4, align=bad)
    with pytest.raises(ValueError, match=r"align > 1 needs num_ep_ranks == 1.*num_ep_ranks=2"):
        dispatch_layout(idx, cr % 2, cl % 2, 2, 2, 4, align=16)
    with pytest.raises(ValueError, match=r"align > 1 needs num_ep_ranks == 1 and dest_quota None"):
        dispatch_layout(idx, cr, cl, 1, 4, 4, align=16, dest_quota=torch.tensor([3]))


def test_align_native_op_checks():
    op, recv = torch.ops.moe_graph.dispatch_layout, torch.ops.moe_graph.receive_layout
    cr, cl = torch.zeros(4, dtype=torch.int64), torch.arange(4)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"dispatch_layout: align must be in \[1, 2\^20\], got 0"):
        op(idx, None, cr, cl, None, 1, 4, 4, align=0)
    with pytest.raises(RuntimeError, match=r"dispatch_layout: align > 1 needs num_ep_ranks == 1"):
        op(idx, None, cr % 2, cl % 2, None, 2, 2, 4, align=16)
    with pytest.raises(RuntimeError, match=r"dispatch_layout: align > 1 needs dest_quota None"):
        op(idx, None, cr, cl, None, 1, 4, 4, dest_quota=torch.tensor([3]), align=16)
    with pytest.raises(RuntimeError, match=r"receive_layout: align must be in \[1, 2\^20\], got -3"):
        recv(torch.ones(2, 4, dtype=torch.int64), 4, -3)
    with pytest.raises(RuntimeError, match=r"receive_layout: the padded rows overflow int64"):
        recv(torch.ones(2, 4, dtype=torch.int64), 1 << 61, 16)


def test_errors_name_the_argument():
    cr, cl = expert_columns(4, 2)
    idx = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"indices must be in \[0, 4\).*indices\[1, 0\] = 7"):
        dispatch_layout(torch.tensor([[0, 1], [7, 0]]), cr, cl, 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"indices must be a 2-D tensor"):
        dispatch_layout(idx.view(-1), cr, cl, 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"indices must have dtype"):
        dispatch_layout(idx.float(), cr, cl, 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"valid must have shape"):
        dispatch_layout(idx, cr, cl, 2, 2, 4, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"column_rank values must be in \[0, num_ep_ranks=2\); column_rank\[3\] = 2"):
        dispatch_layout(idx, torch.tensor([0, 0, 1, 2]), cl, 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"column_local values must be in \[0, num_local_columns=2\)"):
        dispatch_layout(idx, cr, torch.tensor([0, 1, 0, 5]), 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"column_local must have shape"):
        dispatch_layout(idx, cr, cl[:3], 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"route_order must be a permutation.*route 1 appears again"):
        dispatch_layout(idx, cr, cl, 2, 2, 4, route_order=torch.tensor([0, 1, 2, 3, 4, 1]))
    with pytest.raises(RuntimeError, match=r"route_order must be a permutation.*route_order\[0\] = 6"):
        dispatch_layout(idx, cr, cl, 2, 2, 4, route_order=torch.tensor([6, 1, 2, 3, 4, 5]))
    with pytest.raises(RuntimeError, match=r"capacity must be >= 1, got 0"):
        dispatch_layout(idx, cr, cl, 2, 2, 0)
    with pytest.raises(RuntimeError, match=r"step_max_load_ratio must have dtype Double"):
        dispatch_layout(idx, cr, cl, 2, 2, 4, counters=(torch.zeros((), dtype=torch.int64),) * 3)
    with pytest.raises(RuntimeError, match=r"step_max_load_ratio requires grad"):
        dispatch_layout(idx, cr, cl, 2, 2, 4, counters=(torch.zeros((), dtype=torch.int64),) * 2 +
                        (torch.zeros((), dtype=torch.float64, requires_grad=True),))
    with pytest.raises(RuntimeError, match=r"recv_counts must be >= 0; recv_counts\[1, 0\] = -1"):
        receive_layout(torch.tensor([[1, 1], [-1, 0]]), 3)
    with pytest.raises(RuntimeError, match=r"recv_counts must sum to at most capacity=3; recv_counts\[0, 1\] = 3"):
        receive_layout(torch.tensor([[1, 3], [0, 0]]), 3)
    with pytest.raises(RuntimeError, match=r"recv_counts must have dtype Long"):
        receive_layout(torch.tensor([[1.0, 1.0]]), 3)


def test_torch_path_errors(monkeypatch):
    monkeypatch.setattr(DL, "native_available", lambda device_type="cpu": False)
    cr, cl = expert_columns(4, 2)
    with pytest.raises(RuntimeError, match=r"indices must be in \[0, 4\).*indices\[1, 0\] = 7"):
        dispatch_layout(torch.tensor([[0, 1], [7, 0]]), cr, cl, 2, 2, 4)
    with pytest.raises(RuntimeError, match=r"recv_counts must be >= 0; recv_counts\[1, 0\] = -1"):
        receive_layout(torch.tensor([[1, 1], [-1, 0]]), 3)
    with pytest.raises(RuntimeError, match=r"recv_counts must sum to at most capacity=3; recv_counts\[0, 1\] = 3"):
        receive_layout(torch.tensor([[1, 3], [0, 0]]), 3)


def test_fake_tensors_and_opcheck(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    cr, cl = expert_columns(6, 2, 1)
    cr0 = torch.zeros_like(cr)  # every column on the one rank (R = 1, aligned)
    idx, valid, probs = _routing(7, 8, 2, gen, 0.2)
    c = (torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64))
    torch.library.opcheck(torch.ops.moe_graph.dispatch_layout.default,
                          (idx, valid, cr, cl, _order(probs), 2, 4, 5, *c))
    torch.library.opcheck(torch.ops.moe_graph.dispatch_layout.default, (idx, None, cr, cl, None, 2, 4, 5))
    torch.library.opcheck(torch.ops.moe_graph.receive_layout.default, (torch.tensor([[1, 2, 0, 1], [0, 0, 3, 0]]), 5))
    with FakeTensorMode() as mode:
        out = dispatch_layout(mode.from_tensor(idx), mode.from_tensor(cr), mode.from_tensor(cl), 2, 4, 5)
        recv = receive_layout(mode.from_tensor(torch.zeros(2, 4, dtype=torch.int64)), 5)
        one = dispatch_layout(mode.from_tensor(idx), mode.from_tensor(cr0), mode.from_tensor(cl), 1, 4, 5, align=16)
        recv16 = receive_layout(mode.from_tensor(torch.zeros(2, 4, dtype=torch.int64)), 5, align=16)
    assert [tuple(t.shape) for t in out] == [(14,), (10,), (2, 4), (8,), (), (2, 4)]
    assert [tuple(t.shape) for t in recv] == [(10,), (10,), (4,), (4,)]
    assert [tuple(t.shape) for t in one] == [(14,), (80,), (1, 4), (8,), (), (1, 4)]  # ceil((5 + 15 * 4) / 16) * 16
    assert [tuple(t.shape) for t in recv16] == [(80,), (10,), (4,), (4,)]  # ceil((10 + 15 * 4) / 16) * 16
    torch.library.opcheck(torch.ops.moe_graph.dispatch_layout.default, (idx, valid, cr0, cl, None, 1, 4, 5),
                          {"align": 3})
    torch.library.opcheck(torch.ops.moe_graph.receive_layout.default,
                          (torch.tensor([[1, 2, 0, 1], [0, 0, 3, 0]]), 5, 16))


def reference_aligned(m_splits, rows, align):
    """aligned_groups written out row by row: each group's rows (counts >= 0, clamped to the rows left) copied from
    the next aligned start."""
    pm, src, tgt = [], {}, {}
    used = pos = 0
    for m in m_splits.tolist():
        n = min(max(m, 0), rows - used)
        for j in range(n):
            src[pos + j], tgt[used + j] = used + j, pos + j
        padded = -(-n // align) * align
        pm.append(padded)
        used += n
        pos += padded
    P = -(-(rows + (align - 1) * len(pm)) // align) * align
    assert pos <= P
    return (torch.tensor(pm, dtype=torch.int64), torch.tensor([src.get(q, rows) for q in range(P)], dtype=torch.int64),
            torch.tensor([tgt.get(r, P) for r in range(rows)], dtype=torch.int64))


@pytest.mark.parametrize("m_splits, rows, align", [
    ([0, 5, 16, 17, 0, 1], 42, 16),  # zero-token groups, exact and partial multiples, capacity rows past the groups
    ([40], 40, 16),  # one group takes everything
    ([3, -2, 7], 10, 4),  # a negative count reads as 0
    ([10, 10, 10], 25, 8),  # groups past the rows are clamped (the last one partly)
    ([2, 3], 5, 1),  # align 1: the identity layout
    ([], 7, 16),  # no groups: every row past them
    ([0, 0], 0, 16),  # no rows
])
def test_aligned_groups_match_the_row_by_row_reference(impl, m_splits, rows, align):
    m = torch.tensor(m_splits, dtype=torch.int64)
    got = aligned_groups(m, rows, align)
    for a, b in zip(got, reference_aligned(m, rows, align)):
        assert torch.equal(a, b), (a, b)
    assert got[1].shape[0] % align == 0


def test_aligned_groups_random_and_errors(gen, impl):
    for _ in range(20):
        G = int(torch.randint(1, 40, (1,), generator=gen))
        m = torch.randint(0, 50, (G,), generator=gen)
        rows = int(m.sum()) + int(torch.randint(-20, 30, (1,), generator=gen)).__abs__()
        align = int(torch.tensor([1, 2, 16, 32])[torch.randint(0, 4, (1,), generator=gen)])
        assert all(torch.equal(a, b) for a, b in zip(aligned_groups(m, rows, align), reference_aligned(m, rows, align)))
    with pytest.raises(ValueError, match="align must be"):
        aligned_groups(torch.tensor([1]), 4, 0)
    with pytest.raises(ValueError, match="rows must be"):
        aligned_groups(torch.tensor([1]), -1, 16)
    with pytest.raises(ValueError, match=r"m_splits must be a 1-D tensor \[G\]"):
        aligned_groups(torch.ones(2, 2, dtype=torch.int64), 4, 16)


def test_aligned_groups_native_op_checks_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.moe_graph.aligned_groups
    with pytest.raises(RuntimeError, match="m_splits must have dtype"):
        op(torch.ones(3, dtype=torch.int32), 4, 16)
    with pytest.raises(RuntimeError, match="align must be in"):
        op(torch.ones(3, dtype=torch.int64), 4, 0)
    torch.library.opcheck(op.default, (torch.tensor([0, 5, 16, 17]), 40, 16))
    with FakeTensorMode() as mode:
        pm, src, tgt = aligned_groups(mode.from_tensor(torch.tensor([1, 2, 3])), 9, 16)
    assert [tuple(t.shape) for t in (pm, src, tgt)] == [(3,), (64,), (9,)]  # ceil((9 + 15 * 3) / 16) * 16


@requires_cuda
def test_cuda_matches_cpu_without_sync(gen):
    from moe_graph.ops import check_errors

    for R, E, k, T, K, cf in [(1, 8, 0, 1000, 2, 1.0), (4, 64, 2, 3000, 8, 0.8), (8, 128, 0, 517, 8, 1.3)]:
        cr, cl = expert_columns(E, R, k)
        Lc = E // R + k
        cap = max(1, int(cf * T * K / R))
        idx, valid, probs = _routing(T, E + R * k, K, gen, 0.1)
        ref = dispatch_layout(idx, cr, cl, R, Lc, cap, valid=valid, route_order=_order(probs))
        dev = [t.cuda() for t in (idx, valid, cr, cl, _order(probs))]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = dispatch_layout(dev[0], dev[2], dev[3], R, Lc, cap, valid=dev[1], route_order=dev[4])
            got = receive_layout(out.send_counts, cap)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, ref))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, receive_layout(ref.send_counts, cap)))
        torch.cuda.set_sync_debug_mode("error")
        try:
            aligned = aligned_groups(got[2], R * cap, 16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(aligned, aligned_groups(got[2].cpu(), R * cap, 16)))
        # the aligned layouts (no extra launch): R = 1 send slots, the receive side's regrouping
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv16 = receive_layout(out.send_counts, cap, align=16)
            one16 = dispatch_layout(dev[0], torch.zeros_like(dev[2]), dev[3] % Lc, 1, Lc, cap, valid=dev[1],
                                    align=16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(recv16, receive_layout(ref.send_counts, cap, align=16)))
        one_ref = dispatch_layout(idx, torch.zeros_like(cr), cl % Lc, 1, Lc, cap, valid=valid, align=16)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(one16, one_ref))
    check_errors()
    bad = dispatch_layout(torch.tensor([[0, 10**6]], device="cuda"), cr.cuda(), cl.cuda(), R, Lc, 4)
    assert bad.route_slot.tolist() == [0, R * 4]  # the bad route is not live; the flag says why
    with pytest.raises(RuntimeError, match="out of range|outside"):
        check_errors()


@pytest.mark.parametrize("T,K,E,R,k", [(37, 2, 8, 4, 0), (300, 4, 16, 4, 1), (0, 2, 4, 2, 0), (513, 8, 32, 8, 2)])
@pytest.mark.parametrize("policy", ["position", "probs"])
def test_quota_mode_packs_the_kept_routes_by_destination(impl, gen, T, K, E, R, k, policy):
    # the per-destination exchange's layout: per-destination limits (some below, some above the live routes, one
    # negative, one zero) and packed send slots, against the plain loops; CPU native and torch path alike
    cr, cl = expert_columns(E, R, k)
    Lc = E // R + k
    idx, valid, probs = _routing(T, E + R * k, K, gen, p_invalid=0.1, skew=K + 2 if T > 100 else None)
    quota = torch.randint(-2, max(T * K // R, 1) + 3, (R,), generator=gen)
    quota[0] = 0
    pr = probs if policy == "probs" else None
    dropped_routes = torch.zeros((), dtype=torch.int64)
    out = dispatch_layout(idx, cr, cl, R, Lc, 1, valid=valid, route_order=None if pr is None else _order(pr),
                          counters=(dropped_routes, torch.zeros((), dtype=torch.int64), None), dest_quota=quota)
    rs, ros, sc, cc, dropped, _ = reference_layout(idx, valid, cr, cl, R, Lc, 1, pr, quota=quota.tolist())
    assert out.route_of_slot.shape == (T * K,)
    assert out.route_slot.tolist() == rs
    assert out.route_of_slot.tolist() == ros
    assert out.send_counts.tolist() == sc
    assert out.column_counts.tolist() == cc
    assert int(out.dropped) == dropped == int(dropped_routes)
