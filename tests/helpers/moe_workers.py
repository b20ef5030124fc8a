"""Multi-process workers for the dispatcher and MoE-layer tests (run on gloo by ``run_distributed``): each compares
the distributed machinery with the plain references in :mod:`moe_graph.testing.moe_reference`."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.moe.echo import AllGatherBackend, AllToAllBackend
from moe_graph.moe.exchange import SymmMemExchange
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.router import update_expert_bias
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns
from moe_graph.ops.errors import EXCHANGE_COUNTS, read_error_flag
from moe_graph.testing.moe_reference import (
    apportion_quotas,
    dense_moe_reference,
    kept_routes,
    reference_aux_loss,
    reference_route,
    scale_experts,
)


# ------------------------------------------------------------------------------------ multi-process workers --
def _gather(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def dispatcher_worker(rank: int, world: int, seed: int) -> Dict:
    """Every rank dispatches its tokens to ``E = 2 * world`` experts over the real process group and through a
    one-process dispatcher holding all experts; returns both results (outputs and gradients) for comparison, with
    the all-to-all and the all-gather backends, dropless and with a small capacity."""
    R, T, K, H = world, 12, 2, 5
    E = 2 * R
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    # skewed: experts of rank 0 are popular, so small capacities drop
    w = torch.tensor([4.0 if e < 2 else 1.0 for e in range(E)], dtype=torch.float64)
    idx = torch.multinomial(w.expand(T, E), K, replacement=False, generator=g)
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    valid = torch.rand(T, K, generator=g) > 0.1
    scales = torch.arange(1, E + 1, dtype=torch.float64)  # global expert e scales by e + 1
    out: Dict = {"cases": []}
    # "_rows": the experts scale their rows by the dispatcher's row_weights and combine sums without weights
    # "dest": the per-destination rule (exchange="symm_mem": host-sized on gloo); capacity 20 rows per destination
    # rank of the R * T * K = 24 R routes: the hot rank 0 overflows, the others fit
    cr, cl = expert_columns(E, R)
    local = [int((valid & (cr[idx] == dd)).sum()) for dd in range(R)]
    demand = [[int(v) for v in row] for row in _gather(torch.tensor(local)).tolist()]
    for name, backend, cap in [("a2a", AllToAllBackend(), None), ("allgather", AllGatherBackend(), None),
                               ("a2a_cap", AllToAllBackend(), 3), ("a2a_cap_rows", AllToAllBackend(), 3),
                               ("dest", AllToAllBackend(), None), ("dest_cap", AllToAllBackend(), 20),
                               ("dest_cap_rows", AllGatherBackend(), 20)]:
        per_dest = name.startswith("dest")
        d = TokenDispatcher(E // R, R, rank, cr, cl, capacity=cap, backend=backend,
                            exchange="symm_mem" if per_dest else "nccl")
        xd = x.clone().requires_grad_()
        pd = probs.clone().requires_grad_()
        ein, ms, hd = d.dispatch(xd, idx, pd, valid)
        ye = scale_experts(ein, ms, scales[rank * (E // R):(rank + 1) * (E // R)])
        if name.endswith("_rows"):
            y = d.combine(ye * d.row_weights(hd)[:, None], hd, weighted=False)
        else:
            y = d.combine(ye, hd)
        (y * torch.arange(H, dtype=torch.float64)).sum().backward()
        # one process, all experts local, same capacity per destination rank
        cr1 = torch.zeros(E, dtype=torch.int64)
        d1 = TokenDispatcher(E, 1, 0, cr1, torch.arange(E), capacity=None)
        if per_dest:
            keep = kept_routes(idx, cr, apportion_quotas(demand, cap if cap is not None else R * T * K)[rank], valid)
        else:
            keep = kept_routes(idx, cr, cap if cap is not None else T * K, valid)
        x1 = x.clone().requires_grad_()
        p1 = probs.clone().requires_grad_()
        ein1, ms1, h1 = d1.dispatch(x1, idx, p1, valid & keep)
        y1 = d1.combine(scale_experts(ein1, ms1, scales), h1)
        (y1 * torch.arange(H, dtype=torch.float64)).sum().backward()
        out["cases"].append({
            "name": name, "y": y.detach(), "y1": y1.detach(), "gx": xd.grad, "gx1": x1.grad, "gp": pd.grad,
            "gp1": p1.grad, "dropped": int(d.check_drops()), "dropped_ref": int((valid & ~keep).sum()),
            "m_splits": ms.clone(), "recv_rows": int(ms.sum()), "rows": int(ein.shape[0]),
            "demand": demand, "ratio": float(d.step_max_load_ratio),
        })
    return out


def moe_layer_worker(rank: int, world: int, seed: int, k: int, capacity_factor: Optional[float]) -> Dict:
    """A 2+-rank MoE layer (EP over the group, echo with ``k`` spare slots) vs the dense reference on the
    all-gathered tokens and weights. Returns errors and statistics."""
    torch.manual_seed(seed)  # same init on every rank for the router; experts are re-set below
    R, H, Fh, E, K, T = world, 8, 12, 4 * world, 2, 24
    dt = torch.float64
    layer = MoELayer(H, Fh, E, K, activation="swiglu", num_spare_experts_per_ep_rank=k, ep_size=R,
                     capacity_factor=capacity_factor, device="cpu", params_dtype=dt, aux_loss_coeff=0.01)
    gw = torch.Generator().manual_seed(seed)
    w1_all = torch.randn(E, 2 * Fh, H, generator=gw, dtype=dt) / 3
    w2_all = torch.randn(E, H, Fh, generator=gw, dtype=dt) / 3
    gate = torch.randn(E, H, generator=gw, dtype=dt)
    gate[0] += 3.0  # expert 0 (rank 0) is hot: echo has work to do
    L = E // R
    with torch.no_grad():
        layer.experts.fc1.weight.copy_(w1_all[rank * L:(rank + 1) * L])
        layer.experts.fc2.weight.copy_(w2_all[rank * L:(rank + 1) * L])
        layer.router.weight.copy_(gate)
    gx = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(T, H, generator=gx, dtype=dt) + 0.5).requires_grad_()
    target = torch.randn(T, H, generator=gx, dtype=dt)
    y = layer(x)
    (y * target).sum().backward()

    # reference on all ranks' tokens: this rank's output and its home experts' gradients
    xs = _gather(x.detach())
    ts = _gather(target)
    w1r = w1_all.clone().requires_grad_()
    w2r = w2_all.clone().requires_grad_()
    gater = gate.clone().requires_grad_()
    total = 0
    y_ref = None
    gx_ref = None
    aux_ref = None
    for r in range(R):
        xr = xs[r].clone().requires_grad_()
        idx, p, scores = reference_route(xr, gater if r == rank else gate, K)  # gate grads: local tokens only
        yr = dense_moe_reference(xr, idx, p, w1r, w2r, "swiglu")
        loss = (yr * ts[r]).sum()
        if r == rank:
            aux_ref = 0.01 * reference_aux_loss(scores, idx, E)
            loss = loss + aux_ref
        total = total + loss
        if r == rank:
            y_ref, x_keep = yr, xr
    total.backward()
    gx_ref = x_keep.grad
    sl = slice(rank * L, (rank + 1) * L)
    return {
        "y_err": float((y.detach() - y_ref.detach()).abs().max()),
        "gx_err": float((x.grad - gx_ref).abs().max()),
        "gw1_err": float((layer.experts.fc1.weight.grad - w1r.grad[sl]).abs().max()),
        "gw2_err": float((layer.experts.fc2.weight.grad - w2r.grad[sl]).abs().max()),
        "ggate_err": float((layer.router.weight.grad - gater.grad).abs().max()),
        "aux_err": float((layer.last_aux_loss - aux_ref.detach()).abs()),
        "load_before": layer.last_load_before.tolist(),
        "load_after": layer.last_load_after.tolist(),
        "recv": int(layer.last_m_splits.sum()),
        "dropped": layer.dispatcher.check_drops(),
    }


def moe_capacity_worker(rank: int, world: int, seed: int) -> List[int]:
    """Dropped routes per rank with and without echo (k=1) at capacity factor 1.0 under skewed routing."""
    out = []
    for k in (0, 1):
        torch.manual_seed(seed)
        R, H, E, T = world, 8, 4 * world, 64
        layer = MoELayer(H, 8, E, 2, num_spare_experts_per_ep_rank=k, ep_size=R, capacity_factor=1.0, device="cpu",
                         params_dtype=torch.float64)
        with torch.no_grad():
            layer.router.weight[0] += 3.0
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64) + 0.5
        with torch.no_grad():
            layer(x)
        out.append(layer.dispatcher.check_drops())
    return out


def moe_layer_checks_worker(rank: int, world: int, seed: int) -> Dict:
    """All multi-process MoE layer checks in one spawn: without echo, with echo (``k = 1``), and the capacity
    drops with and without echo."""
    return {
        "no_echo": moe_layer_worker(rank, world, seed, 0, None),
        "echo": moe_layer_worker(rank, world, seed, 1, None),
        "echo_cap": moe_layer_worker(rank, world, seed, 1, 2.0),
        "drops": moe_capacity_worker(rank, world, seed),
    }


def _dense_expert_grads(x: torch.Tensor, target: torch.Tensor, gate: torch.Tensor, w1_all: torch.Tensor,
                        w2_all: torch.Tensor, K: int, rank: int, L: int):
    """This rank's home experts' gradients ``(g1 [L, ...], g2 [L, ...])`` of ``sum_r (y_r * target_r)`` over all
    ranks' tokens (all-gathered), from the dense loop reference."""
    xs, ts = _gather(x), _gather(target)
    w1r = w1_all.clone().requires_grad_()
    w2r = w2_all.clone().requires_grad_()
    total = 0
    for r in range(xs.shape[0]):
        idx, p, _ = reference_route(xs[r], gate, K)
        total = total + (dense_moe_reference(xs[r], idx, p, w1r, w2r, "swiglu") * ts[r]).sum()
    total.backward()
    sl = slice(rank * L, (rank + 1) * L)
    return w1r.grad[sl].clone(), w2r.grad[sl].clone()


def moe_layer_ddp_worker(rank: int, world: int, seed: int, ks=(0, 1, 2)) -> Dict:
    """MoE layers wrapped in :class:`moe_graph.distributed.ddp.DistributedDataParallel` (EP = world, expert params reduced
    over a one-rank expert-data-parallel group): the fused weight-gradient path writes the home experts' gradients
    into ``main_grad`` and, with echo (``k`` spare slots), aggregates the spare slots' gradients home.

    Two microbatches under skewed routing: the first inside ``no_sync()`` (``main_grad`` after it is checked),
    the second with ``overlap_grad_reduce=True`` (bucket reductions launched from the grad hooks during backward),
    then ``finish_grad_sync``. Returns, per ``k``, the max errors of ``main_grad`` against the same layer without
    echo or DDP (plain ``.grad``) and against the dense reference, plus how many routes went to spare slots."""
    import torch.distributed as dist

    R, H, Fh, E, K, T = world, 8, 12, 4 * world, 2, 24
    L = E // R
    dt = torch.float64
    singletons = [dist.new_group([r]) for r in range(R)]  # collective: every rank creates every group
    gw = torch.Generator().manual_seed(seed)
    w1_all = torch.randn(E, 2 * Fh, H, generator=gw, dtype=dt) / 3
    w2_all = torch.randn(E, H, Fh, generator=gw, dtype=dt) / 3
    gate = torch.randn(E, H, generator=gw, dtype=dt)
    gate[0] += 3.0  # expert 0 (rank 0) is hot: spare slots get tokens
    mbs = []
    for m in range(2):
        g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + m)
        mbs.append((torch.randn(T, H, generator=g, dtype=dt) + 0.5, torch.randn(T, H, generator=g, dtype=dt)))

    def make(k):
        layer = MoELayer(H, Fh, E, K, activation="swiglu", num_spare_experts_per_ep_rank=k, ep_size=R,
                         capacity_factor=None, device="cpu", params_dtype=dt)
        with torch.no_grad():
            layer.experts.fc1.weight.copy_(w1_all[rank * L:(rank + 1) * L])
            layer.experts.fc2.weight.copy_(w2_all[rank * L:(rank + 1) * L])
            layer.router.weight.copy_(gate)
        return layer

    # (a) no echo, no DDP: plain autograd .grad per microbatch; (b) the dense reference per microbatch
    plain = []
    for x, t in mbs:
        layer = make(0)
        (layer(x) * t).sum().backward()
        plain.append((layer.experts.fc1.weight.grad.clone(), layer.experts.fc2.weight.grad.clone(), layer.router.weight.grad.clone()))
    dense = [_dense_expert_grads(x, t, gate, w1_all, w2_all, K, rank, L) for x, t in mbs]

    def err(a, b):
        return float((a - b).abs().max())

    out: Dict = {}
    for k in ks:
        layer = make(k)
        ddp = DistributedDataParallel(layer, expert_data_parallel_group=singletons[rank], overlap_grad_reduce=True)
        ddp.zero_grad_buffer()
        w1, w2 = layer.experts.fc1.weight, layer.experts.fc2.weight
        res: Dict = {"moved": 0}
        with ddp.no_sync():
            (ddp(mbs[0][0]) * mbs[0][1]).sum().backward()
        res["moved"] += int(layer.last_m_splits[L:].sum())
        res["fused"] = bool(w1.grad_added_to_main_grad and w2.grad_added_to_main_grad)
        res["grad_none"] = w1.grad is None and w2.grad is None
        res["mb1_plain_err"] = max(err(w1.main_grad, plain[0][0]), err(w2.main_grad, plain[0][1]))
        res["mb1_dense_err"] = max(err(w1.main_grad, dense[0][0]), err(w2.main_grad, dense[0][1]))
        res["mb1_router_err"] = err(layer.router.weight.main_grad, plain[0][2])
        spare1 = [b.clone() for b in (layer.experts.spare_grads or ())] if k else []
        (ddp(mbs[1][0]) * mbs[1][1]).sum().backward()  # last microbatch: reductions launch from the hooks
        res["moved"] += int(layer.last_m_splits[L:].sum())
        ddp.finish_grad_sync()
        scale = 1.0 / R  # expert grads: pre-scaled by 1/dp, summed over the one-rank expert-DP group
        res["mb2_plain_err"] = max(err(w1.main_grad, scale * (plain[0][0] + plain[1][0])),
                                   err(w2.main_grad, scale * (plain[0][1] + plain[1][1])))
        res["mb2_dense_err"] = max(err(w1.main_grad, scale * (dense[0][0] + dense[1][0])),
                                   err(w2.main_grad, scale * (dense[0][1] + dense[1][1])))
        if k:
            spare2 = list(layer.experts.spare_grads)
            # overwritten, not accumulated: the buffers hold the second microbatch's spare gradients only
            res["spare_changed"] = any(not torch.equal(a, b) for a, b in zip(spare1, spare2))
        out[k] = res
    return out


def expert_bias_worker(rank: int, world_size: int):
    """Each rank routes different tokens; after ``update_expert_bias`` every rank holds the bias computed from the
    global counts (checked against a sign rule on the all-gathered counts)."""
    import torch.distributed as dist


    torch.manual_seed(0)
    layer = MoELayer(8, 8, 8, 2, score_func="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.01,
                     device="cpu", ep_size=1)
    g = torch.Generator().manual_seed(100 + rank)
    layer(torch.randn(50 + 30 * rank, 8, generator=g))
    local = layer.router.local_tokens_per_expert.clone()
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    total = torch.stack(gathered).sum(0)
    update_expert_bias(layer)
    return {"bias": layer.router.expert_bias.clone(), "expect": 0.01 * torch.sign(total.mean() - total)}


def global_aux_loss_worker(rank: int, world_size: int):
    """EP over ``world_size`` ranks with ``aux_loss_type="global"``: the loss and the router gradient it produces
    against a reference built from the all-gathered routing counts and this rank's scores."""
    import torch.distributed as dist


    E, K, H = 4 * world_size, 2, 8
    torch.manual_seed(0)
    layer = MoELayer(H, 8, E, K, aux_loss_coeff=0.1, aux_loss_type="global", ep_size=world_size, device="cpu",
                     params_dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(30, H, generator=g, dtype=torch.float64)
    (layer(x) * 0).sum().backward()  # only the aux loss reaches the router weight
    gate = layer.router.weight.detach().clone().requires_grad_()
    idx, _, scores = reference_route(x, gate, K)
    local = torch.zeros(E, dtype=torch.float64).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.float64))
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    f = torch.stack(gathered).sum(0) / (30 * K * world_size)
    ref = 0.1 * E * (f * scores.mean(0)).sum()
    ref.backward()
    return {"aux": float(layer.last_aux_loss), "ref": float(ref), "grad_err": float((layer.router.weight.grad - gate.grad).abs().max()),
            "grad_norm": float(gate.grad.norm()), "local_f_differs": bool((local / (30 * K) - f).abs().max() > 1e-3)}


def bad_exchange_counts_worker(rank: int, world: int, exchange: str = "symm_mem") -> Dict:
    """The per-destination exchange given inconsistent counts on gloo: a demand row that disagrees with the rank's
    own count, a negative count, one past the routes a rank has, and (from a corrupted view on rank 0) more rows
    arriving than its buffer holds. Returns what each case flagged and the shapes written."""
    R, T, K, H = world, 10, 2, 3
    E = 2 * R
    g = torch.Generator().manual_seed(rank)
    idx = torch.zeros(T, K, dtype=torch.int64)
    idx[:, 1] = 1  # every route to rank 0's experts: destination 0 is over its 12-row buffer
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    cr, cl = expert_columns(E, R)
    out: Dict = {}
    read_error_flag("cpu")  # clean slate
    true_demand = torch.tensor([[T * K] + [0] * (R - 1)] * R)
    cases = {
        "consistent": true_demand.clone(),
        "own_row_differs": true_demand.clone().index_fill_(0, torch.tensor([rank]), 1),
        "negative": true_demand.clone().index_fill_(0, torch.tensor([(rank + 1) % R]), -5),
        "past_routes": true_demand.clone().index_fill_(0, torch.tensor([(rank + 1) % R]), 10 ** 6),
        # rank 0 alone believes the others send nothing to it: it keeps the whole buffer for itself while the
        # others still send their shares, so more rows arrive than rank 0's buffer holds
        "overfull": (true_demand * torch.tensor([1] + [0] * (R - 1)).unsqueeze(1)) if rank == 0 else true_demand,
    }
    for name, demand in cases.items():
        d = TokenDispatcher(E // R, R, rank, cr, cl, capacity=12, backend=AllToAllBackend(), exchange=exchange)
        xd = x.clone().requires_grad_()
        ein, ms, hd = d.dispatch(xd, idx, probs, demand=demand)
        y = d.combine(ein * 2.0, hd)
        y.sum().backward()
        out[name] = {"flag": read_error_flag("cpu") & EXCHANGE_COUNTS, "rows": int(ein.shape[0]),
                     "m_splits_sum": int(ms.sum()), "finite": bool(torch.isfinite(y).all() and torch.isfinite(xd.grad).all())}
    return out


def symm_mem_exchange_worker(rank: int, world: int) -> Dict:
    """GPU only (NCCL + NVSHMEM): the symmetric-memory exchange of one rank sending to itself, eager and captured in
    a CUDA graph replayed with changing counts, against the host-known result (at R = 1 the expert input is the send
    buffer's kept rows, grouped by local expert, zeros after them) and the fixed-split path."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    Lc, H, n, cap = 3, 16, 64, 80
    ex = SymmMemExchange(device=dev)
    counts = torch.zeros(1, Lc, dtype=torch.int64, device=dev)
    send = torch.zeros(n, H, device=dev)
    errors = []

    def run(align=None):
        plan = ex.plan(counts, cap)
        padded = ex.align(plan, align) if align else None
        rows = ex.to_experts(send, plan)
        back = ex.to_sources(rows * 2.0, plan, n)
        return rows, back, plan.m_splits, padded

    def fill(c):
        counts.copy_(torch.tensor([c], device=dev))
        send.copy_(torch.randn(n, H, device=dev) * (torch.arange(n, device=dev) < sum(c)).unsqueeze(1))

    fill([5, 0, 11])
    run()  # eager warm-up: allocates and rendezvouses the symmetric buffers (collective) before capture
    run(16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, back, ms, _ = run()
        arows, aback, ams, apadded = run(16)  # the groups at 16-row starts, zero rows between
    for c in ([5, 0, 11], [0, 0, 0], [40, 20, 4], [1, 63, 0]):
        fill(c)
        graph.replay()
        total = sum(c)
        want = torch.zeros(cap, H, device=dev)
        want[:total] = send[:total]
        padded = [-(-m // 16) * 16 for m in c]
        awant = torch.zeros(arows.shape, device=dev)
        for g, m in enumerate(c):
            awant[sum(padded[:g]):sum(padded[:g]) + m] = send[sum(c[:g]):sum(c[:g]) + m]
        errors.append({"counts": c, "rows": float((rows - want).abs().max()),
                       "back": float((back - 2.0 * send).abs().max()), "m_splits": ms.tolist() == c,
                       "aligned_rows": float((arows - awant).abs().max()),
                       "aligned_back": float((aback - 2.0 * send).abs().max()),
                       "aligned_m_splits": ams.tolist() == c and apadded.tolist() == padded})
    return {"cases": errors}


def corrupted_counts_worker(rank: int, world: int, case: str) -> Dict:
    """EP 2 (echo with one spare slot: the plan reads every rank's counts) on one batch, run clean and then with
    ``case`` corrupting what rank 1 received, every value still in range: ``"counts"``, rank 1's copy of rank 0's
    gathered ``[E]`` counts rolled by two experts (the layer's all-gather); ``"demand"`` (per-destination rule),
    rank 1's copy of rank 0's ``[R]`` demand rolled by one (the dispatcher's own exchange). Returns the
    ``EXCHANGE_COUNTS`` bit after each run."""
    import torch.distributed as dist

    torch.manual_seed(0)  # the same layer on every rank
    R, H, Fh, E, K, T = world, 8, 12, 4 * world, 2, 24
    layer = MoELayer(H, Fh, E, K, num_spare_experts_per_ep_rank=1, ep_size=R, device="cpu",
                     params_dtype=torch.float64, exchange="symm_mem" if case == "demand" else "nccl")
    with torch.no_grad():
        layer.router.weight[0] += 3.0  # expert 0 is hot: echo has work to do
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    read_error_flag("cpu")  # clean slate
    out = {}
    with torch.no_grad():
        layer(x)
    out["clean_flag"] = read_error_flag("cpu") & EXCHANGE_COUNTS
    real_gather, backend = dist.all_gather, layer.dispatcher.backend
    real_exchange = backend.exchange

    def gather(tensors, t, *a, **k):
        res = real_gather(tensors, t, *a, **k)
        if rank == 1 and t.dtype == torch.int64 and tuple(t.shape) == (E,):
            tensors[0].copy_(tensors[0].roll(2))
        return res

    def exchange(t):
        got = real_exchange(t)
        if rank == 1 and t.dtype == torch.int64 and tuple(t.shape) == (R, R):
            got = got.clone()
            got[0] = got[0].roll(1)
        return got

    if case == "counts":
        dist.all_gather = gather
    else:
        backend.exchange = exchange
    try:
        with torch.no_grad():
            layer(x)
    finally:
        dist.all_gather, backend.exchange = real_gather, real_exchange
    out["corrupted_flag"] = read_error_flag("cpu") & EXCHANGE_COUNTS
    return out
