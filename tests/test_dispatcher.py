"""Static-capacity token dispatcher: permutation and m_splits, combine, gradients, deterministic counted drops, and
the multi-process all-to-all (gloo, 2 and 4 ranks; all-to-all and all-gather backends) against one process."""

import pytest
import torch

from conftest import requires_cuda
from helpers.moe_workers import bad_exchange_counts_worker, dispatcher_worker, symm_mem_exchange_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.token_dispatcher import (
    TokenDispatcher,
    capacity_for,
    expert_columns,
    topk_from_routing_map,
)
from moe_graph.moe.exchange import symm_mem_available
from moe_graph.ops import check_errors, read_error_flag
from moe_graph.ops.errors import EXCHANGE_COUNTS, flag_error_if
from moe_graph.testing.moe_reference import kept_routes, scale_experts
from conftest import full_only


def _one_process(E, cap=None):
    return TokenDispatcher(E, 1, 0, torch.zeros(E, dtype=torch.int64), torch.arange(E), capacity=cap)


def _routing(T, E, K, g):
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    return idx, probs


def test_expert_columns_layout():
    r, l = expert_columns(8, 4, 2)
    assert r.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] + [0, 0, 1, 1, 2, 2, 3, 3]
    assert l.tolist() == [0, 1] * 4 + [2, 3] * 4
    r, l = expert_columns(6, 3)
    assert r.tolist() == [0, 0, 1, 1, 2, 2] and l.tolist() == [0, 1] * 3
    with pytest.raises(ValueError, match="divisible"):
        expert_columns(7, 2)


def test_capacity_for():
    assert capacity_for(100, 2, 4, 1.0) == 50
    assert capacity_for(100, 2, 4, 1.1) == 55
    assert capacity_for(100, 2, 4, None) == 200
    assert capacity_for(10, 1, 2, 100.0) == 10  # never more than T*K
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity_for(10, 1, 2, 0.0)


def test_permutation_and_m_splits(gen):
    T, E, K, H = 17, 5, 2, 3
    idx, probs = _routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    d = _one_process(E)
    ein, ms, h = d.dispatch(x, idx, probs)
    assert ein.shape == (T * K, H)
    expected_rows = []
    for e in range(E):
        toks = [t for t in range(T) if e in idx[t].tolist()]
        assert int(ms[e]) == len(toks)
        expected_rows += [x[t] for t in toks]  # token order inside an expert
    assert torch.equal(ein, torch.stack(expected_rows))
    assert ms.device == x.device and ms.dtype == torch.int64


def test_combine_is_weighted_sum_and_padding_is_zero(gen):
    T, E, K, H = 9, 4, 3, 6
    idx, probs = _routing(T, E, K, gen)
    valid = torch.rand(T, K, generator=gen) > 0.3
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    d = _one_process(E)
    ein, ms, h = d.dispatch(x, idx, probs, valid)
    n = int(ms.sum())
    assert n == int(valid.sum())
    assert torch.count_nonzero(ein[n:]) == 0  # padding rows at the end
    scales = torch.arange(1, E + 1, dtype=torch.float64)
    y = d.combine(scale_experts(ein, ms, scales), h)
    ref = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            if valid[t, k]:
                ref[t] += probs[t, k] * scales[idx[t, k]] * x[t]
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)


def test_gradcheck(gen):
    T, E, K, H = 6, 3, 2, 4
    idx, probs = _routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    p = probs.clone().requires_grad_()
    scales = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)

    def f(x, p):
        d = _one_process(E, cap=7)  # drops too: dropped routes get zero gradient
        ein, ms, h = d.dispatch(x, idx, p)
        return d.combine(scale_experts(ein, ms, scales), h)

    assert torch.autograd.gradcheck(f, (x, p))


def test_capacity_drops_are_deterministic_and_counted(gen):
    T, E, K, H = 20, 4, 2, 3
    idx, probs = _routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    cap = 25
    d = _one_process(E, cap=cap)
    read_error_flag("cpu")
    ein, ms, h = d.dispatch(x, idx, probs)
    # drops are a statistic of normal training with a capacity factor, not an error: the periodic check_errors()
    # stays quiet and the error flag is untouched; the drop counter has them
    check_errors("cpu")
    assert read_error_flag("cpu") == 0
    y = d.combine(ein, h)  # identity experts
    keep = kept_routes(idx, torch.zeros(E, dtype=torch.int64), cap)
    assert int(keep.sum()) == cap
    ref = (x[:, None, :] * (probs * keep)[..., None]).sum(1)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    assert int(h.dropped) == T * K - cap
    assert bool(d.drop_flag)
    assert d.check_drops() == T * K - cap
    d.dispatch(x, idx, probs)
    assert d.check_drops() == 2 * (T * K - cap)  # cumulative
    with pytest.raises(RuntimeError, match="dropped 30 routes"):
        d.check_drops(raise_on_drop=True)
    d.reset_drop_counter()
    assert d.check_drops() == 0 and not bool(d.drop_flag)


def test_topk_from_routing_map(gen):
    T, C, K = 8, 6, 2
    m = torch.zeros(T, C, dtype=torch.bool)
    for t in range(T):
        m[t, torch.randperm(C, generator=gen)[: (K if t % 3 else 1)]] = True
    probs = torch.rand(T, C, generator=gen) * m
    idx, p, valid = topk_from_routing_map(m, probs, K)
    for t in range(T):
        cols = [c for c in range(C) if m[t, c]]
        assert idx[t, : len(cols)].tolist() == cols
        assert valid[t].tolist() == [True] * len(cols) + [False] * (K - len(cols))
        assert p[t, : len(cols)].tolist() == probs[t, cols].tolist()


def test_errors_name_arguments():
    d = _one_process(3)
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="indices must be"):
        d.dispatch(x, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="probs must"):
        d.dispatch(x, torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="column_local"):
        TokenDispatcher(2, 1, 0, torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="capacity"):
        TokenDispatcher(2, 1, 0, torch.zeros(2, dtype=torch.long), torch.arange(2), capacity=0)


@pytest.mark.parametrize("world", [2, *full_only(4)])  # more ranks in CI: the per-destination tests [3-*], echo donors [4]
def test_multiprocess_matches_one_process(world):
    res = run_distributed(dispatcher_worker, world, 7)
    dropped = dest_dropped = 0
    for r in res:
        for c in r["cases"]:
            torch.testing.assert_close(c["y"], c["y1"], rtol=0, atol=1e-12, msg=lambda m: f"{c['name']}: {m}")
            torch.testing.assert_close(c["gx"], c["gx1"], rtol=0, atol=1e-12)
            torch.testing.assert_close(c["gp"], c["gp1"], rtol=0, atol=1e-12)
            assert c["dropped"] == c["dropped_ref"], c["name"]
            if c["name"].startswith("a2a_cap"):
                dropped += c["dropped"]
                assert c["recv_rows"] <= world * 3
            elif c["name"].startswith("dest_cap"):  # per destination: a 20-row buffer, only the hot rank drops
                dest_dropped += c["dropped"]
                assert c["rows"] == 20 and c["recv_rows"] <= 20
            else:
                assert c["dropped"] == 0
            if c["name"].startswith("dest"):  # the largest destination load of the job over the mean T * K
                load = [sum(row[d] for row in c["demand"]) for d in range(world)]
                assert c["ratio"] == pytest.approx(max(load) / 24, rel=1e-12)
    assert dropped > 0  # the capacity case really dropped routes (skewed routing)
    assert dest_dropped > 0


def test_constant_tables_are_built_at_construction_on_the_device(gen):
    # Every table dispatch() needs exists on the dispatcher's device right after construction, and dispatch() makes
    # no copy from the host: on the meta device any CPU tensor reaching an op (a lazily built table copied over) is
    # seen by the dispatch mode. The buffers keep their identity across calls (written in place).
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostInputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            out = func(*args, **kwargs)
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves + outs):
                self.seen.append(str(func))  # a host tensor (a table built or copied over lazily)
            return out

    E, T, K, H = 6, 9, 2, 4
    cr, cl = expert_columns(E, 2, 1)
    d = TokenDispatcher(E // 2 + 1, 2, 0, cr, cl, capacity=5, backend=_Loopback(), device="meta")
    names = {n for n, _ in d.named_buffers()}
    assert {"column_rank", "column_local", "dropped_routes", "step_dropped_routes", "step_max_load_ratio"} <= names
    assert all(b.device.type == "meta" for b in d.buffers())
    assert d.state_dict() == {}  # tables and statistics are not checkpoint state
    tables = [d.column_rank, d.column_local, d.dropped_routes]
    idx, probs = _routing(T, E + 2, K, gen)
    x, idx_m, probs_m = torch.randn(T, H, device="meta"), idx.to("meta"), probs.to("meta")
    with HostInputs() as mode:
        ein, ms, h = d.dispatch(x, idx_m, probs_m)
        d.combine(ein, h)
    assert mode.seen == [], f"dispatch touched host tensors / copied to the device: {mode.seen}"
    assert ein.device.type == "meta" and ms.shape == (E // 2 + 1,)
    assert all(a is b for a, b in zip(tables, [d.column_rank, d.column_local, d.dropped_routes]))
    # a dispatcher built for one device refuses tokens on another (naming both), and follows .to()
    with pytest.raises(ValueError, match="hidden is on cpu but the dispatcher's tables were built on meta"):
        d.dispatch(torch.zeros(T, H), idx, probs)
    c = TokenDispatcher(E // 2 + 1, 2, 0, cr, cl, capacity=5, backend=_Loopback())  # default: the columns' device
    assert c.column_rank.tolist() == cr.tolist() and c.column_local.tolist() == cl.tolist()
    assert all(b.device.type == "meta" for b in c.to("meta").buffers())


class _Loopback:
    def exchange(self, send):
        return send


@requires_cuda
def test_cuda_no_host_sync_and_matches_cpu():
    T, E, K, H = 64, 8, 2, 32
    g = torch.Generator().manual_seed(0)
    idx, probs = _routing(T, E, K, g)
    x = torch.randn(T, H, generator=g)
    ref_d = _one_process(E, cap=100)
    ein_c, ms_c, h_c = ref_d.dispatch(x, idx, probs)
    y_c = ref_d.combine(ein_c * 2, h_c)
    d = _one_process(E, cap=100).to("cuda")  # tables built on the device before the first call
    xc = x.cuda().requires_grad_()
    pc = probs.cuda().requires_grad_()
    ic = idx.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the very first call: no lazy host-to-device copy
    try:
        ein, ms, h = d.dispatch(xc, ic, pc)
        y = d.combine(ein * 2, h)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(y.cpu(), y_c.to(y.dtype), rtol=1e-5, atol=1e-5)
    assert ms.cpu().tolist() == ms_c.tolist()
    assert d.check_drops() == T * K - 100


def test_probs_drop_policy_keeps_the_most_probable_routes(gen):
    # Two destination ranks, simulated in one process with an identity "exchange" of [R, cap, H] blocks; every
    # destination keeps its `cap` most probable routes (ties: token order), gradients flow to the kept ones only.
    class Loopback:
        def exchange(self, send):
            return send

    T, E, K, H, cap = 30, 4, 2, 3, 11
    idx, probs = _routing(T, E, K, gen)
    probs[0, 0] = probs[1, 0] = 0.5  # an exact tie, resolved by token order
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    col_rank = torch.tensor([0, 0, 1, 1])
    d = TokenDispatcher(2, 2, 0, col_rank, torch.tensor([0, 1, 0, 1]), capacity=cap, backend=Loopback(),
                        drop_policy="probs")
    pd = probs.clone().requires_grad_()
    ein, ms, h = d.dispatch(x, idx, pd)
    y = d.combine(ein, h)  # identity experts
    keep = kept_routes(idx, col_rank, cap, probs=probs)
    for r in (0, 1):
        on_r = col_rank[idx] == r
        assert int((keep & on_r).sum()) == min(cap, int(on_r.sum()))
        if int(on_r.sum()) > cap:
            assert float(probs[keep & on_r].min()) >= float(probs[~keep & on_r].max())
    ref = (x[:, None, :] * (probs * keep)[..., None]).sum(1)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    assert int(h.dropped) == int((~keep).sum()) > 0
    y.sum().backward()
    assert bool((pd.grad[~keep] == 0).all()) and bool((pd.grad[keep] != 0).all())
    assert not torch.equal(keep, kept_routes(idx, col_rank, cap))  # the policy matters for this routing
    with pytest.raises(ValueError, match="drop_policy"):
        TokenDispatcher(2, 1, 0, torch.zeros(2, dtype=torch.int64), torch.arange(2), drop_policy="random")


@pytest.mark.parametrize("R", [1, 2])
def test_row_weights_and_unweighted_combine(gen, R):
    # row_weights gives each expert-input row its route's probability (0 for padding); experts scaling their rows
    # by it and combine(weighted=False) equal the weighted combine, values and gradients (R = 2: a loopback
    # exchange of one process playing both ranks, with a capacity that drops)
    T, E, K, H = 11, 4, 2, 3
    idx, probs = _routing(T, E, K, gen)
    valid = torch.rand(T, K, generator=gen) > 0.2
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    cr, cl = expert_columns(E, R)
    d = TokenDispatcher(E // R, R, 0, cr, cl, capacity=9 if R == 2 else None, backend=_Loopback())
    scales = torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64)[: E // R]

    def run(x, p, rows):
        ein, ms, h = d.dispatch(x, idx, p, valid)
        ye = scale_experts(ein, ms, scales)
        return d.combine(ye * d.row_weights(h)[:, None], h, weighted=False) if rows else d.combine(ye, h)

    xa, pa = x.clone().requires_grad_(), probs.clone().requires_grad_()
    xb, pb = x.clone().requires_grad_(), probs.clone().requires_grad_()
    ya, yb = run(xa, pa, False), run(xb, pb, True)
    torch.testing.assert_close(yb, ya, rtol=0, atol=1e-12)
    (ya * torch.arange(H)).sum().backward()
    (yb * torch.arange(H)).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, p: run(x, p, True), (xa.detach().requires_grad_(), pa.detach()
                                                                     .requires_grad_()))
    # the weights themselves: each real row carries its route's probability, padding rows 0
    ein, ms, h = d.dispatch(x, idx, probs, valid)
    w = d.row_weights(h)
    n = int(ms.sum())
    assert w.shape == (ein.shape[0],) and bool((w[n:] == 0).all())
    if R == 1:
        expected = [float(probs[t, j]) for e in range(E) for t in range(T) for j in range(K)
                    if valid[t, j] and idx[t, j] == e]
        assert w[:n].tolist() == expected
    assert h.column_counts.tolist() == torch.bincount(idx[valid], minlength=E).tolist()


def test_16bit_tokens_keep_their_dtype(gen):
    T, E, K, H = 40, 6, 3, 16
    idx, probs = _routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen)
    d = _one_process(E)
    ein, ms, h = d.dispatch(x.to(torch.bfloat16), idx, probs.float())
    assert ein.dtype == torch.bfloat16
    y = d.combine(ein, h)
    assert y.dtype == torch.bfloat16
    ref = (x.to(torch.bfloat16).double()[:, None, :] * probs[..., None]).sum(1)  # fp64 of the bf16 inputs
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=2 ** -8)  # one bf16 rounding of the sum


def test_builds_without_the_native_ops_dispatch_the_same(gen, monkeypatch):
    # the pure-torch paths of the layout and row ops (builds without moe_graph._C) give the native results
    import moe_graph.ops.dispatch_layout as DL
    import moe_graph.ops.permute as P

    T, E, K, H, R = 13, 4, 2, 3, 2
    idx, probs = _routing(T, E, K, gen)
    valid = torch.rand(T, K, generator=gen) > 0.2
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    cr, cl = expert_columns(E, R)

    def run():
        d = TokenDispatcher(E // R, R, 0, cr, cl, capacity=7, backend=_Loopback(), drop_policy="probs")
        xd, pd = x.clone().requires_grad_(), probs.clone().requires_grad_()
        ein, ms, h = d.dispatch(xd, idx, pd, valid)
        y = d.combine(ein * d.row_weights(h)[:, None], h, weighted=False) + d.combine(ein * 2, h)
        (y * torch.arange(H)).sum().backward()
        return [ein, ms, y, xd.grad, pd.grad, d.dropped_routes, d.step_max_load_ratio]

    native = run()
    monkeypatch.setattr(DL, "native_available", lambda device_type="cpu": False)
    monkeypatch.setattr(P, "native_available", lambda device_type="cpu": False)
    for a, b in zip(run(), native):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_torch_compile_fullgraph(gen, policy):
    # dispatch / combine / row_weights trace into one graph (the layout op's in-place counters included): outputs,
    # gradients and drop counts equal eager
    T, E, K, H = 16, 8, 2, 4
    idx, probs = _routing(T, E, K, gen)
    x = torch.randn(T, H, generator=gen)
    d = TokenDispatcher(E, 1, 0, torch.zeros(E, dtype=torch.int64), torch.arange(E), capacity=10, drop_policy=policy)

    def f(x, p):
        ein, ms, h = d.dispatch(x, idx, p)
        return d.combine(ein * 2, h) + d.combine(ein * d.row_weights(h)[:, None], h, weighted=False)

    def grads(fn):
        xd, pd = x.clone().requires_grad_(), probs.float().clone().requires_grad_()
        y = fn(xd, pd)
        (y * torch.arange(H)).sum().backward()
        return y.detach(), xd.grad, pd.grad

    eager = grads(f)
    dropped = d.check_drops()
    compiled = grads(torch.compile(f, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    assert d.check_drops() == 2 * dropped > 0


@pytest.mark.parametrize("world,exchange", [(2, "symm_mem"), (3, "symm_mem"), (3, "nvlink")])
def test_per_destination_exchange_clamps_and_flags_inconsistent_counts(world, exchange):
    # a corrupted all-gather, negative counts, counts past the routes a rank has and more rows than a receive buffer
    # holds: clamped (nothing written past the 12-row buffer) and flagged on the device, check_errors names it
    res = run_distributed(bad_exchange_counts_worker, world, exchange)
    for rank, r in enumerate(res):
        assert r["consistent"]["flag"] == 0, r
        for case in ("own_row_differs", "negative", "past_routes"):
            assert r[case]["flag"], (rank, case, r[case])
        assert r["overfull"]["flag"] == (EXCHANGE_COUNTS if rank == 0 else 0), (rank, r["overfull"])
        for case, c in r.items():
            assert c["rows"] == 12 and c["m_splits_sum"] <= 12 and c["finite"], (rank, case, c)


def test_check_errors_names_the_exchange_counts_bit():
    flag_error_if(torch.ones(1, dtype=torch.bool), EXCHANGE_COUNTS)
    with pytest.raises(RuntimeError, match="per-destination exchange's counts were inconsistent"):
        check_errors("cpu")


@requires_cuda
def test_symm_mem_exchange_to_itself_eager_and_captured_cuda():
    # one GPU: the NVSHMEM exchange of a rank sending to itself, in a CUDA graph replayed with changing counts (an
    # empty expert among them: all_to_all_vdev_2d leaves a row for it), unaligned and with 16-row group starts
    if not symm_mem_available(device=torch.device("cuda", 0)):
        pytest.skip("torch's NVSHMEM symmetric memory is not available here")
    res = run_distributed(symm_mem_exchange_worker, 1, backend="nccl")
    for c in res[0]["cases"]:
        assert c["rows"] == 0.0 and c["back"] == 0.0 and c["m_splits"], c
        assert c["aligned_rows"] == 0.0 and c["aligned_back"] == 0.0 and c["aligned_m_splits"], c
