"""Echo expert weight dispatch and gradient aggregation on real gloo process groups (2, 4, 8 ranks): every rank
computes the same plan from all-gathered counts, spare slots get exact copies of their home experts, and a toy MoE
step with echo gives the outputs and home-expert gradients of the same step without echo."""

import pytest
import torch

from conftest import full_only
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.echo import EchoExpertDispatcher, wgrad_accumulate_mask


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of every rank's input is the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.clone()
        dist.all_reduce(g)
        return g


def _toy_moe(x_all, map_all, probs_all, columns, rank):
    """Every rank computes the experts it hosts for all ranks' tokens (dense then masked, for simplicity); an
    autograd all-reduce sums the partial outputs and each rank keeps its own tokens."""
    partial = torch.zeros_like(x_all)
    for c, w1, w2 in columns:
        h = torch.nn.functional.gelu(x_all @ w1.t()) @ w2.t()
        partial = partial + (probs_all[..., c] * map_all[..., c].to(probs_all.dtype)).unsqueeze(-1) * h
    return _AllReduceSum.apply(partial)[rank]


def _gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _check_spare_copies(s1, s2, offload_map, rank, k, fc1_all, fc2_all):
    """Spare slots hold exact copies of their home experts (zeros when unused)."""
    for i in range(k):
        col = offload_map[:, rank * k + i]
        if col.any():
            e = int(col.to(torch.int8).argmax())
            assert torch.equal(s1[i], fc1_all[e]) and torch.equal(s2[i], fc2_all[e])
        else:
            assert not s1[i].any() and not s2[i].any()


def _echo_worker(rank, world, seed):
    import torch.distributed as dist

    from moe_graph.moe import echo_planner
    from moe_graph.moe.echo import (
        AllGatherBackend,
        AllToAllBackend,
        default_backend,
        dispatch_spare_weights,
        spare_grad_buffers,
    )
    from moe_graph.testing.echo_reference import zipf_routing

    torch.manual_seed(0)
    R, L, T, H, F = world, 2, 24, 8, 12
    E = R * L
    dt = torch.float64
    g = torch.Generator().manual_seed(seed)  # same on every rank: global weights
    fc1_all = torch.randn(E, F, H, generator=g, dtype=dt) / 3
    fc2_all = torch.randn(E, H, F, generator=g, dtype=dt) / 3
    gr = torch.Generator().manual_seed(seed * 1000 + rank)  # per-rank tokens and routing
    rm = zipf_routing(T, E, 2, 1.5, torch.Generator().manual_seed(seed * 1000 + rank), permute=False)
    probs = torch.rand(T, E, generator=gr, dtype=dt)
    x = torch.randn(T, H, generator=gr, dtype=dt)
    target = torch.randn(T, H, generator=gr, dtype=dt)
    counts = _gather(rm.sum(0).to(torch.int64))  # [R, E], identical everywhere
    x_all = _gather(x)
    home_cols = list(range(rank * L, (rank + 1) * L))

    def home_params():
        fc1 = fc1_all[rank * L : (rank + 1) * L].clone().requires_grad_()
        fc2 = fc2_all[rank * L : (rank + 1) * L].clone().requires_grad_()
        return fc1, fc2

    # reference: no echo
    fc1, fc2 = home_params()
    cols = [(c, fc1[i], fc2[i]) for i, c in enumerate(home_cols)]
    out_ref = _toy_moe(x_all, _gather(rm.to(torch.uint8)), _gather(probs), cols, rank)
    (out_ref * target).sum().backward()
    ref = (out_ref.detach(), fc1.grad.clone(), fc2.grad.clone())

    results = {"default_backend": type(default_backend()).__name__, "cases": []}
    # (backend, k, mode): "autograd" (dispatch_spare_weights), "autograd+main_grad" (spare gradients straight into
    # main_grad), "explicit" (separate spare-slot gradient buffers, then aggregate_grads into main_grad). Few
    # combinations keep the spawned runs short.
    combos = [(AllToAllBackend(), 1, "autograd"), (AllToAllBackend(), 2, "autograd+main_grad"),
              (AllGatherBackend(), 2, "explicit")]
    for backend, k, mode in combos:
        use_main_grad = mode != "autograd"
        new_map, new_probs, offload_map = echo_planner.gen_offloading_plan(rm, probs, counts, rank, R, k)
        assert torch.equal(new_map.sum(1), rm.sum(1))
        d = EchoExpertDispatcher(E, R, rank, k, backend=backend)
        fc1, fc2 = home_params()
        if use_main_grad:
            fc1.main_grad = torch.zeros_like(fc1)
            fc2.main_grad = torch.zeros_like(fc2)
        if mode == "explicit":
            s1, s2 = [w.requires_grad_() for w in d.dispatch(offload_map, [fc1, fc2])]  # leaves with their own grads
        else:
            s1, s2 = dispatch_spare_weights(d, offload_map, [fc1, fc2])
        assert s1.shape == (k, F, H) and s2.shape == (k, H, F)
        _check_spare_copies(s1, s2, offload_map, rank, k, fc1_all, fc2_all)
        cols = [(c, fc1[i], fc2[i]) for i, c in enumerate(home_cols)]
        cols += [(E + rank * k + i, s1[i], s2[i]) for i in range(k)]
        out = _toy_moe(x_all, _gather(new_map.to(torch.uint8)), _gather(new_probs), cols, rank)
        (out * target).sum().backward()
        if mode == "explicit":
            spare = spare_grad_buffers([fc1, fc2], k, dtype=dt)
            spare[0].copy_(s1.grad)
            spare[1].copy_(s2.grad)
            d.aggregate_grads(offload_map, spare, home_params=[fc1, fc2])
        g1 = fc1.grad + (fc1.main_grad if use_main_grad else 0)
        g2 = fc2.grad + (fc2.main_grad if use_main_grad else 0)
        if use_main_grad:  # spare-slot gradients went to main_grad (when this rank's experts were copied)
            assert fc1.main_grad.abs().sum() > 0 or not offload_map[rank * L : (rank + 1) * L].any()
        torch.testing.assert_close(out.detach(), ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g1, ref[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g2, ref[2], rtol=1e-12, atol=1e-12)
        # plain lists: tensors sent through the result queue would need the (exited) child's shared memory
        results["cases"].append(
            {"k": k, "backend": type(backend).__name__, "offload_map": offload_map.tolist(), "moved": int(new_map[:, E:].sum()),
             "counts": counts.tolist(), "mode": mode}
        )
    return results


@pytest.mark.parametrize("world", [2, *full_only(4, 8)])  # 4 ranks in CI: test_echo_donors_gloo[4]
def test_echo_gloo(world):
    res = run_distributed(_echo_worker, world, 3 + world)
    for case_idx in range(len(res[0]["cases"])):
        maps = [torch.tensor(r["cases"][case_idx]["offload_map"]) for r in res]
        for m in maps[1:]:
            assert torch.equal(m, maps[0]), "every rank must compute the same offload_map"
        c = res[0]["cases"][case_idx]
        assert maps[0].shape == (2 * world, world * c["k"])
        for r in res:
            assert r["cases"][case_idx]["counts"] == c["counts"]
    # the skewed routing actually moved tokens somewhere (the test exercises the echo path)
    assert sum(r["cases"][0]["moved"] for r in res) > 0
    assert res[0]["default_backend"] in ("AllToAllBackend", "AllGatherBackend")


def test_argument_errors():
    d = EchoExpertDispatcher(8, 4, 1, 2)
    with pytest.raises(ValueError, match="offload_map"):
        d.slot_homes(torch.zeros(8, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"home_weights\[1\]"):
        d.dispatch(torch.zeros(8, 8, dtype=torch.bool), [torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(ValueError, match="divisible"):
        EchoExpertDispatcher(7, 4, 0, 1)
    with pytest.raises(ValueError, match="ep_rank"):
        EchoExpertDispatcher(8, 4, 4, 1)
    assert wgrad_accumulate_mask(3, 2).tolist() == [True, True, True, False, False]


def test_echo_grouped_gemm_mask_and_spare_buffers():
    """One process (R = 1, the rank hosts copies of its own expert 1 in two of its k = 3 slots; the third slot is
    unused): one fused wgrad call accumulates the home experts into main_grad and overwrites the spare buffers,
    then the aggregation adds the spare slots' gradients into expert 1's main_grad; over two microbatches
    main_grad accumulates while the spare buffers hold only the last one."""
    from moe_graph.moe.echo import LocalBackend, echo_grouped_gemm, spare_grad_buffers

    g = torch.Generator().manual_seed(0)
    dt = torch.float64
    L, k, N, K, M = 3, 3, 4, 5, 12
    d = EchoExpertDispatcher(L, 1, 0, k, backend=LocalBackend())
    offload_map = torch.zeros(L, k, dtype=torch.bool)
    offload_map[1, 0] = offload_map[1, 1] = True
    w = torch.randn(L, N, K, generator=g, dtype=dt).requires_grad_()
    mg0 = torch.randn(L, N, K, generator=g, dtype=dt)
    w.main_grad = mg0.clone()
    mask = wgrad_accumulate_mask(L, k)
    (spare_grad,) = spare_grad_buffers([w], k, dtype=dt)
    spare_grad.fill_(7.0)  # stale values: must be overwritten, slot 2 (no tokens) with zeros
    splits = torch.tensor([3, 0, 2, 4, 1, 0])  # expert 1 has no own tokens, only its copies in slots 0 and 1
    owner = [0, 1, 2, 1, 1, None]  # home expert of each local expert (home 0..2, slots 3..5)
    rows = torch.repeat_interleave(torch.arange(L + k), splits)  # 10 rows with an expert, then 2 padding rows
    rows_all = torch.cat([rows, torch.full((M - rows.numel(),), -1)])

    expect_main = mg0.clone()
    for _ in range(2):  # two microbatches
        a = torch.randn(M, K, generator=g, dtype=dt).requires_grad_()
        dy = torch.randn(M, N, generator=g, dtype=dt)
        (spare,) = d.dispatch(offload_map, [w])
        assert torch.equal(spare[0], w[1].detach()) and torch.equal(spare[1], w[1].detach()) and not spare[2].any()
        y = echo_grouped_gemm(a, w, spare, splits, d, offload_map, mask, spare_grad)
        y.backward(dy)

        # reference: every row through its expert's weight (spare rows through their home expert's)
        wr = w.detach().clone().requires_grad_()
        ar = a.detach().clone().requires_grad_()
        yr = torch.zeros(M, N, dtype=dt)
        for i, e in enumerate(rows.tolist()):
            yr = yr.index_put((torch.tensor([i]),), (ar[i] @ wr[owner[e]].t())[None])
        (yr * dy).sum().backward()
        torch.testing.assert_close(y.detach(), yr.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.grad, ar.grad, rtol=1e-12, atol=1e-12)
        expect_main += wr.grad
        torch.testing.assert_close(w.main_grad, expect_main, rtol=1e-12, atol=1e-12)
        # spare buffers: this microbatch's per-slot gradients only (overwritten), zeros for the empty slot
        for j in range(k):
            sel = rows_all == L + j
            torch.testing.assert_close(spare_grad[j], dy[sel].t() @ a.detach()[sel], rtol=1e-12, atol=1e-12)
        assert not spare_grad[2].any()
        assert w.grad_added_to_main_grad and w.grad is not None and not w.grad.any()  # zero grad: DDP hook adds nothing
    with pytest.raises(RuntimeError, match="main_grad"):
        echo_grouped_gemm(a, torch.zeros(L, N, K, dtype=dt, requires_grad=True), spare, splits, d, offload_map, mask,
                          spare_grad)
    with pytest.raises(ValueError, match="spare_grad"):
        echo_grouped_gemm(a, w, spare, splits, d, offload_map, mask, spare_grad.float())


# ---------------------------------------------------------------------------------------------------------------
# donor-constrained placement: w static peer blocks
# ---------------------------------------------------------------------------------------------------------------


def _donor_worker(rank, world, seed):
    import torch.distributed as dist

    from moe_graph.moe import echo_planner
    from moe_graph.moe.echo import AllToAllBackend, PeerBackend, dispatch_spare_weights
    from moe_graph.testing.echo_reference import zipf_routing

    R, L, T, H, F = world, 2, 24, 6, 5
    E = R * L
    dt = torch.float64
    g = torch.Generator().manual_seed(seed)
    fc1_all = torch.randn(E, F, H, generator=g, dtype=dt) / 3
    fc2_all = torch.randn(E, H, F, generator=g, dtype=dt) / 3
    gr = torch.Generator().manual_seed(seed * 1000 + rank)
    rm = zipf_routing(T, E, 2, 1.5, torch.Generator().manual_seed(seed * 1000 + rank), permute=False)
    probs = torch.rand(T, E, generator=gr, dtype=dt)
    x = torch.randn(T, H, generator=gr, dtype=dt)
    target = torch.randn(T, H, generator=gr, dtype=dt)
    counts = _gather(rm.sum(0).to(torch.int64))
    x_all = _gather(x)
    home_cols = list(range(rank * L, (rank + 1) * L))

    def home_params():
        return (fc1_all[rank * L:(rank + 1) * L].clone().requires_grad_(),
                fc2_all[rank * L:(rank + 1) * L].clone().requires_grad_())

    fc1, fc2 = home_params()
    cols = [(c, fc1[i], fc2[i]) for i, c in enumerate(home_cols)]
    out_ref = _toy_moe(x_all, _gather(rm.to(torch.uint8)), _gather(probs), cols, rank)
    (out_ref * target).sum().backward()
    ref = (out_ref.detach(), fc1.grad.clone(), fc2.grad.clone())
    res = {"cases": []}
    k = 2
    for w in sorted(w for w in {1, 2, R - 1} if 1 <= w < R):
        d = EchoExpertDispatcher(E, R, rank, k, donors=w)
        assert isinstance(d.backend, PeerBackend) and d.donors == w
        mask = d.donor_mask
        new_map, new_probs, offload_map = echo_planner.gen_offloading_plan(rm, probs, counts, rank, R, k, donor_mask=mask)
        # the plan honours the constraint: slot j on rank j // k hosts only experts of its donors
        for e, j in offload_map.nonzero().tolist():
            assert mask[j // k, e // L], (e, j)
        fc1, fc2 = home_params()
        s1, s2 = dispatch_spare_weights(d, offload_map, [fc1, fc2])
        _check_spare_copies(s1, s2, offload_map, rank, k, fc1_all, fc2_all)
        cols = [(c, fc1[i], fc2[i]) for i, c in enumerate(home_cols)]
        cols += [(E + rank * k + i, s1[i], s2[i]) for i in range(k)]
        out = _toy_moe(x_all, _gather(new_map.to(torch.uint8)), _gather(new_probs), cols, rank)
        (out * target).sum().backward()
        torch.testing.assert_close(out.detach(), ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fc1.grad, ref[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fc2.grad, ref[2], rtol=1e-12, atol=1e-12)
        res["cases"].append({"w": w, "moved": int(new_map[:, E:].sum()), "copies": int(offload_map.sum())})

    # w = R: the unconstrained behaviour bit for bit. Plans equal the unconstrained planner's; aggregation through
    # the all-to-all and through R - 1 peer blocks both equal the documented sum (each slot's row added into its
    # home expert's gradient one at a time, in ascending slot order), re-implemented here from all-gathered spare
    # gradients.
    _, _, offload_map = echo_planner.gen_offloading_plan(rm, probs, counts, rank, R, k)
    _, _, offload_map_w = echo_planner.gen_offloading_plan(rm, probs, counts, rank, R, k, donor_mask=echo_planner.donor_mask(R, R))
    assert torch.equal(offload_map, offload_map_w)
    gk = torch.Generator().manual_seed(seed * 77 + rank)
    spare = torch.randn(k, F, H, generator=gk, dtype=torch.float32) * 1e3  # float32: summation order matters
    base = torch.randn(L, F, H, generator=gk, dtype=torch.float32)
    all_spare = _gather(spare).reshape(R * k, F * H)
    home = offload_map.to(torch.int8).argmax(0)
    mine = offload_map.any(0) & (home // L == rank)
    today = base.clone().view(L, F * H)
    for j in range(R * k):
        if mine[j]:
            today[int(home[j]) % L] += all_spare[j]
    today = today.view(L, F, H)
    for d in (EchoExpertDispatcher(E, R, rank, k, backend=AllToAllBackend()),
              EchoExpertDispatcher(E, R, rank, k, donors=R),
              EchoExpertDispatcher(E, R, rank, k, donors=R - 1)):
        o = base.clone()
        d.aggregate_grads(offload_map, [spare], out=[o])
        assert torch.equal(o, today), (type(d.backend).__name__, (o - today).abs().max())
        sp = d.dispatch(offload_map, [base])[0]
        o2 = base.clone()
        d.aggregate_grads(offload_map, [spare], out=[o2])
        assert torch.equal(o2, o)  # deterministic: same bits twice
        res.setdefault("spare_sums", []).append(float(sp.double().sum()))
    return res


@pytest.mark.parametrize("world", [2, 4, *full_only(8)])
def test_echo_donors_gloo(world):
    res = run_distributed(_donor_worker, world, 11 + world)
    assert sum(c["copies"] for c in res[0]["cases"]) > 0, "the skewed routing must place copies"
    for r in res:
        assert len(set(r["spare_sums"])) == 1  # the three exchanges deliver the same spare weights


class _LoopbackPeer:
    """One-process stand-in for a group of one rank: the peer exchange's allocation, with a local copy."""

    def __init__(self):
        from moe_graph.moe.echo import PeerBackend

        self.backend = PeerBackend()
        self.backend._send_recv = lambda send, recv, to, frm: recv.copy_(send)


def _new_storage_bytes(fn, known, min_bytes):
    """Bytes of every storage the ops inside ``fn`` create (at least ``min_bytes``), through a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {t.untyped_storage().data_ptr() for t in known}
    sizes = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    p = t.untyped_storage().data_ptr()
                    if p not in seen:
                        seen.add(p)
                        if t.untyped_storage().nbytes() >= min_bytes:
                            sizes.append(t.untyped_storage().nbytes())
            return out

    with Mode():
        fn()
    return sum(sizes), sizes


@pytest.mark.parametrize("donors", [None, 1])
def test_echo_buffer_bytes_matches_allocations(donors):
    from moe_graph.moe import echo_planner
    from moe_graph.moe.echo import LocalBackend, echo_buffer_bytes

    # a one-rank group cannot have donors; emulate rank 0 of R = 4 with w = 1 through a loopback exchange whose
    # block o carries what rank 0 would receive (shapes and allocations are what count here)
    R, L, k, F, H = (1, 3, 2, 16, 12) if donors is None else (4, 2, 2, 16, 12)
    E = R * L
    N = 2 * F * H
    if donors is None:
        d = EchoExpertDispatcher(E, R, 0, k, backend=LocalBackend())
    else:
        d = EchoExpertDispatcher(E, R, 0, k, backend=_LoopbackPeer().backend, donors=donors)
    w1 = torch.randn(L, F, H, dtype=torch.bfloat16)
    w2 = torch.randn(L, H, F, dtype=torch.bfloat16)
    offload_map = torch.zeros(E, R * k, dtype=torch.bool)
    offload_map[0, 0] = True
    g1, g2 = torch.randn(k, F, H), torch.randn(k, H, F)
    o1, o2 = torch.zeros(L, F, H), torch.zeros(L, H, F)
    d.prepare("cpu")
    expect = echo_buffer_bytes(E, R, k, donors, N, torch.bfloat16)
    small = 256  # index tensors (a few int64 per slot) stay below this; every N-sized buffer is above
    got, _ = _new_storage_bytes(lambda: d.dispatch(offload_map, [w1, w2]), [w1, w2, offload_map], small)
    assert got == expect["dispatch_send"] + expect["dispatch_recv"] + expect["spare_weights"]
    got, _ = _new_storage_bytes(lambda: d.aggregate_grads(offload_map, [g1, g2], out=[o1, o2]), [g1, g2, o1, o2, offload_map],
                                small)
    assert got == expect["grad_send"] + expect["grad_recv"]
    assert expect["blocks"] == (R if donors is None else donors)
    # formula sanity: DeepSeek-V3-sized experts at EP 64, k=2: 11.3 GB send buffer unconstrained, w=2: 0.35 GB
    ds = 3 * 7168 * 2048
    assert echo_buffer_bytes(256, 64, 2, None, ds)["dispatch_send"] == 64 * 2 * ds * 2
    assert echo_buffer_bytes(256, 64, 2, 2, ds)["dispatch_send"] == 2 * 2 * ds * 2
    assert echo_buffer_bytes(256, 64, 2, 2, ds, plan_mode="microbatch", num_microbatches=4)["spare_weights"] == \
        4 * echo_buffer_bytes(256, 64, 2, 2, ds, plan_mode="iteration", num_microbatches=4)["spare_weights"]


def test_aggregate_validates_before_writing_and_clear_errors():
    from moe_graph.moe.echo import LocalBackend

    d = EchoExpertDispatcher(4, 1, 0, 2, backend=LocalBackend())
    offload_map = torch.zeros(4, 2, dtype=torch.bool)
    offload_map[1, 0] = offload_map[2, 1] = True
    good, bad = torch.zeros(4, 3, 5), torch.zeros(4, 3, 6)
    g = [torch.ones(2, 3, 5), torch.ones(2, 3, 6)]
    with pytest.raises(ValueError, match="gradient tensor 1"):
        d.aggregate_grads(offload_map, g, out=[good, torch.zeros(3, 3, 6)])
    assert not good.any(), "the first output was written before the second was validated"
    with pytest.raises(ValueError, match="gradient tensor 1"):
        d.aggregate_grads(offload_map, g, out=[good, torch.zeros(4, 3, 7)])
    assert not good.any()
    with pytest.raises(ValueError, match="one tensor per spare gradient"):
        d.aggregate_grads(offload_map, g, out=[good])
    d.aggregate_grads(offload_map, g, out=[good, bad])
    assert good[1].eq(1).all() and good[2].eq(1).all() and not good[0].any()
    with pytest.raises(ValueError, match="num_ep_ranks"):
        EchoExpertDispatcher(8, 0, 0, 1)
    with pytest.raises(ValueError, match="num_experts"):
        EchoExpertDispatcher(0, 2, 0, 1)
    with pytest.raises(TypeError, match="num_ep_ranks"):
        EchoExpertDispatcher(8, 2.0, 0, 1)
    with pytest.raises(ValueError, match="w"):
        EchoExpertDispatcher(8, 4, 0, 1, donors=0)


def test_aggregate_sums_in_fixed_order_without_index_add_atomics():
    """Several slots hosting the same expert: the sum is the sequential slot-order sum, every run (no
    multi-row index_add_, whose CUDA atomics order the adds arbitrarily)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_graph.moe.echo import LocalBackend

    k = 6
    d = EchoExpertDispatcher(2, 1, 0, k, backend=LocalBackend())
    offload_map = torch.zeros(2, k, dtype=torch.bool)
    offload_map[1, :] = True  # all six slots host expert 1
    g = torch.tensor([1e8, 1.0, -1e8, 1.0, 0.5, 3.0]).view(k, 1)
    out = torch.zeros(2, 1)
    calls = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index_add_.default or func is torch.ops.aten.index_add.default:
                calls.append(args[2].numel())
            return func(*args, **(kwargs or {}))

    with Mode():
        d.aggregate_grads(offload_map, [g], out=[out])
    assert calls and max(calls) == 1, "index_add_ with more than one index row"
    seq = torch.zeros(1)
    for v in g[:, 0]:
        seq = seq + v
    assert torch.equal(out[1], seq) and out[0].item() == 0


def test_moe_layer_plans_with_one_native_op(monkeypatch):
    """MoELayer makes its echo plan with planner.gen_plan (the single native echo_plan op when built), not with
    gen_assignment + gen_allocation (~100 small ops); same layer output either way."""
    from moe_graph.moe import echo_planner
    from moe_graph.moe.layer import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=2, device="cpu", params_dtype=torch.float64)
    x = torch.randn(40, 16, dtype=torch.float64)
    with torch.no_grad():
        ref = layer(x)
    calls = []
    monkeypatch.setattr(echo_planner, "gen_assignment", lambda *a, **k: calls.append("gen_assignment"))
    with torch.no_grad():
        out = layer(x)
    assert not calls
    assert torch.equal(out, ref)
    assert layer.echo_buffer_bytes()["total"] > 0 and layer.echo_buffer_bytes()["blocks"] == 1


def _layer_modes_worker(rank, world, seed):
    """MoELayer with donor-constrained echo and plan-once-per-iteration over two microbatches: outputs and
    accumulated expert / router gradients equal the same layer without echo (plain autograd and fused main_grad
    paths); in "iteration" mode the second microbatch moves no weights."""
    from moe_graph.moe.layer import MoELayer

    R, H, Fh, E, K, T = world, 8, 12, 4 * world, 2, 24
    dt = torch.float64
    gw = torch.Generator().manual_seed(seed)
    w1_all = torch.randn(E, 2 * Fh, H, generator=gw, dtype=dt) / 3
    w2_all = torch.randn(E, H, Fh, generator=gw, dtype=dt) / 3
    gate = torch.randn(E, H, generator=gw, dtype=dt)
    gate[0] += 3.0  # expert 0 (rank 0) is hot
    L = E // R
    mbs = []
    for m in range(2):
        g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + m)
        mbs.append((torch.randn(T, H, generator=g, dtype=dt) + 0.5, torch.randn(T, H, generator=g, dtype=dt)))

    def make(k, **kw):
        layer = MoELayer(H, Fh, E, K, num_spare_experts_per_ep_rank=k, ep_size=R, device="cpu", params_dtype=dt,
                         **kw)
        with torch.no_grad():
            layer.experts.fc1.weight.copy_(w1_all[rank * L:(rank + 1) * L])
            layer.experts.fc2.weight.copy_(w2_all[rank * L:(rank + 1) * L])
            layer.router.weight.copy_(gate)
        return layer

    def run(layer, fused):
        if fused:
            for w in layer.experts.weights():
                w.main_grad = torch.zeros_like(w)
        ys = []
        for m, (x, t) in enumerate(mbs):
            y = layer(x, is_first_microbatch=(m == 0))
            (y * t).sum().backward()
            ys.append(y.detach())
        gs = [w.main_grad if fused else w.grad for w in layer.experts.weights()]
        return ys, gs, layer.router.weight.grad

    ref = run(make(0), False)
    out = {}
    for name, kw in (("w1", dict(echo_donors=1)), ("iter", dict(echo_plan_mode="iteration")),
                     ("w1_iter", dict(echo_donors=1, echo_plan_mode="iteration"))):
        for fused in (False, True):
            layer = make(2, **kw)
            calls = []
            orig = layer.echo.dispatcher.dispatch
            layer.echo.dispatcher.dispatch = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
            moved = []
            hooks = layer.register_forward_hook(lambda mod, i, o: moved.append(int(mod.last_m_splits[L:].sum())))
            ys, gs, gg = run(layer, fused)
            hooks.remove()
            err = max([float((a - b).abs().max()) for a, b in zip(ys, ref[0])]
                      + [float((a - b).abs().max()) for a, b in zip(gs, ref[1])] + [float((gg - ref[2]).abs().max())])
            out[(name, fused)] = {"err": err, "dispatches": len(calls), "moved": moved}
    return {f"{n}/{f}": v for (n, f), v in out.items()}


@pytest.mark.parametrize("world", [4])  # w=1 < R-1: a real constraint (2 ranks have one other rank anyway)
def test_moe_layer_donors_and_plan_once_per_iteration_gloo(world):
    res = run_distributed(_layer_modes_worker, world, 21)
    for r in res:
        for key, c in r.items():
            assert c["err"] < 1e-12, (key, c)
            assert c["dispatches"] == (1 if "iter" in key else 2), (key, c)
    for key in res[0]:
        assert sum(sum(r[key]["moved"]) for r in res) > 0, f"{key}: no route went to a spare slot"


def test_plan_once_per_iteration_has_no_data_dependent_ops():
    """CPU proxy for "no host syncs": both microbatches of an iteration-mode MoE layer (fresh plan + dispatch into
    the static buffers, then reuse_plan) forward and backward under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_graph.moe.layer import MoELayer

    layer = MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=2, echo_plan_mode="iteration", device="cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        for first in (True, False):
            x = torch.randn(12, 16, requires_grad=True)
            layer(x, is_first_microbatch=first).sum().backward()
    with pytest.raises(ValueError, match="echo_plan_mode"):
        MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=1, echo_plan_mode="nope", device="cpu")
    with pytest.raises(ValueError, match="recompute"):
        MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=1, echo_plan_mode="iteration", recompute=True,
                 device="cpu")
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(torch.randn(4, 16), is_first_microbatch=1)


def _subgroup_worker(rank, world, seed):
    """Peer exchange inside EP subgroups whose group ranks differ from the global ranks ({0, 2} and {1, 3}),
    R = 2 with w = 1: spare weights are the home experts' and gradients come home."""
    import torch.distributed as dist

    from moe_graph.moe.echo import PeerBackend

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[rank % 2]
    R, L, k, n = 2, 2, 1, 5
    me = dist.get_rank(g)
    d = EchoExpertDispatcher(R * L, R, me, k, group=g, donors=1)
    assert isinstance(d.backend, PeerBackend)
    w_all = torch.arange(R * L * n, dtype=torch.float64).view(R * L, n) + 100 * (rank % 2)
    offload_map = torch.zeros(R * L, R * k, dtype=torch.bool)
    offload_map[1, 1] = True  # rank 1's slot hosts expert 1 (home rank 0)
    spare = d.dispatch(offload_map, [w_all[me * L:(me + 1) * L]])[0]
    out = torch.zeros(L, n, dtype=torch.float64)
    d.aggregate_grads(offload_map, [torch.full((k, n), float(me + 1), dtype=torch.float64)], out=[out])
    return {"me": me, "spare": spare.tolist(), "expect": (w_all[1:2] if me == 1 else torch.zeros(1, n)).tolist(),
            "out": out.tolist()}


def test_peer_exchange_in_subgroups_gloo():
    res = run_distributed(_subgroup_worker, 4, 0)
    for r in res:
        assert r["spare"] == r["expect"]
        expect_out = [[0.0] * 5, [2.0] * 5] if r["me"] == 0 else [[0.0] * 5, [0.0] * 5]
        assert r["out"] == expect_out, r


def _op_footprint(fn, targets):
    """``[(op, largest tensor argument or result in elements)]`` of the non-view ops ``fn`` runs, leaving out the
    tensors that share storage with ``targets`` (the gradients added into), and the index sizes of ``index_add_``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    skip = {t.untyped_storage().data_ptr() for t in targets}
    ops, index_rows = [], []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                ts = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                ops.append((func.overloadpacket.__name__,
                            max([t.numel() for t in ts if t.untyped_storage().data_ptr() not in skip], default=0)))
                if func.overloadpacket is torch.ops.aten.index_add_:
                    index_rows.append(args[2].numel())
            return out

    with Mode():
        fn()
    return ops, index_rows


def test_aggregate_traffic_is_independent_of_the_home_experts():
    """aggregate_grads moves O(k*N), not O(L*N): with a decoded plan it runs the same ops for L = 2 and L = 64 home
    experts, none of them on a tensor larger than the k spare rows except the single-row index_add_ into the
    gradients; the sums equal a float64 loop over the slots."""
    from moe_graph.moe.echo import LocalBackend

    k, F, H = 3, 5, 4
    runs = []
    for L in (2, 64):
        d = EchoExpertDispatcher(L, 1, 0, k, backend=LocalBackend())
        offload_map = torch.zeros(L, k, dtype=torch.bool)
        offload_map[1, 0] = offload_map[1, 2] = True  # slot 1 hosts nothing
        plan = d.decode(d.slot_home(offload_map))
        g = torch.Generator().manual_seed(L)
        spare = [torch.randn(k, F, H, generator=g, dtype=torch.float64), torch.randn(k, H, generator=g,
                                                                                       dtype=torch.float64)]
        base = [torch.randn(L, F, H, generator=g, dtype=torch.float64), torch.randn(L, H, generator=g,
                                                                                      dtype=torch.float64)]
        out = [b.clone() for b in base]
        ops, rows = _op_footprint(lambda: d.aggregate_grads(plan, spare, out=out), out)
        runs.append(ops)
        assert rows and set(rows) == {1}
        assert max(n for _, n in ops) <= k * (F * H + H)
        for o, b, s in zip(out, base, spare):
            expect = b.clone()
            expect[1] += s[0]
            expect[1] += s[2]
            assert torch.equal(o, expect)
    assert runs[0] == runs[1]


def test_moe_layer_echo_uses_indices_and_decodes_once(monkeypatch):
    """The layer's echo path reroutes the top-k indices (reroute_indices; no dense [T, E+S] map), decodes the
    plan once per forward and hands the decoded plan to every expert GEMM and its backward (no offload_map
    decoding); outputs and main_grad equal the layer without echo (one rank: the slot is idle)."""
    from moe_graph.moe import echo_balancer
    from moe_graph.moe.layer import MoELayer
    from moe_graph.ops import reroute as reroute_ops

    calls = {"decode": 0, "slot_home": 0, "dense": 0}
    orig_decode = EchoExpertDispatcher.decode
    orig_home = EchoExpertDispatcher.slot_home
    orig_dense = reroute_ops.reroute_tokens

    def decode(self, *a):
        calls["decode"] += 1
        return orig_decode(self, *a)

    def slot_home(self, *a):
        calls["slot_home"] += 1
        return orig_home(self, *a)

    def dense(*a):
        calls["dense"] += 1
        return orig_dense(*a)

    monkeypatch.setattr(EchoExpertDispatcher, "decode", decode)
    monkeypatch.setattr(EchoExpertDispatcher, "slot_home", slot_home)
    monkeypatch.setattr(reroute_ops, "reroute_tokens", dense)
    assert echo_balancer.reroute_indices is reroute_ops.reroute_indices
    dt = torch.float64
    torch.manual_seed(0)
    x = torch.randn(40, 16, dtype=dt)
    dy = torch.randn(40, 16, dtype=dt)
    res = []
    for k in (0, 1):
        torch.manual_seed(1)
        layer = MoELayer(16, 24, 8, 2, num_spare_experts_per_ep_rank=k, device="cpu", params_dtype=dt)
        for w in layer.experts.weights():
            w.main_grad = torch.zeros_like(w)
        y = layer(x)
        y.backward(dy)
        res.append((y.detach(), [w.main_grad for w in layer.experts.weights()], layer.router.weight.grad))
    assert calls == {"decode": 1, "slot_home": 0, "dense": 0}
    (y0, g0, r0), (y1, g1, r1) = res
    torch.testing.assert_close(y1, y0, rtol=1e-13, atol=1e-13)
    for a, b in zip(g1 + [r1], g0 + [r0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
