"""Workers for tests/test_exchange_cuda.py (GPU only: NCCL process group, one CUDA device per rank): the CUDA
exchange kernels (``moe_graph.ops.nvlink.NvlinkExchange``) against the host reference ops
``exchange_*_reference`` run on the CPU over every rank's inputs. Every rank builds every rank's inputs from the
same seeds (no collective needed to share them) and compares its own results; the parent asserts."""

from __future__ import annotations

from typing import Dict, List

import torch

from moe_graph.ops.dispatch_layout import dispatch_layout

T, K, LC, HIDDEN = 24, 3, 3, 16
ROWS = {"bf16": (torch.bfloat16, 32), "fp8_packed": (torch.uint8, 128 + 4)}  # uint8: 128 FP8 bytes + 1 fp32 scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def rank_inputs(seed: int, s: int, R: int, rows_kind: str):
    """Rank ``s``'s routing (column 1, local expert 1 of rank 0, never chosen; most routes to the last rank, so its
    receive buffer overflows), rows, weights and dispatch layout (every route kept on the send side)."""
    g = torch.Generator().manual_seed(7919 * seed + 31 * s + 1)
    C = R * LC
    idx = torch.randint(0, C, (T, K), generator=g)
    idx = torch.where(idx == 1, torch.zeros_like(idx), idx)  # a zero-token expert
    idx[: T // 2, 0] = C - 1  # the last rank's last expert takes more than its share
    valid = torch.rand(T, K, generator=g) > 0.1
    dtype, width = ROWS[rows_kind]
    if dtype == torch.uint8:
        rows = torch.randint(0, 256, (T, width), generator=g, dtype=torch.uint8)
    else:
        rows = torch.randn(T, width, generator=g).to(dtype)
    weights = torch.randn(T * K, generator=g)
    lay = dispatch_layout(idx, torch.arange(C) // LC, torch.arange(C) % LC, R, LC, T * K, valid=valid)
    return rows, lay.route_of_slot, lay.send_counts, weights


def capacity_for(R: int, rows_kind: str) -> int:
    """Receive rows per rank: 3 below the largest arrival count of seed 0 (that destination overflows)."""
    arrivals = sum(rank_inputs(0, s, R, rows_kind)[2].sum(1) for s in range(R))
    return int(arrivals.max()) - 3


def reference(seed: int, R: int, rows_kind: str, capacity: int, align: int = 1):
    ops = torch.ops.moe_graph
    inp = [rank_inputs(seed, s, R, rows_kind) for s in range(R)]
    ein, ms, rw, rr, cnt = ops.exchange_dispatch_reference([x[0] for x in inp], [x[1] for x in inp],
                                                           [x[2] for x in inp], [x[3] for x in inp], K, capacity,
                                                           align)
    outs = [torch.randn(ein[0].shape[0], HIDDEN, generator=torch.Generator().manual_seed(500 + 17 * seed + s))
            for s in range(R)]
    y = ops.exchange_combine_reference(outs, list(rr), [x[3] for x in inp], K)
    gr = ops.exchange_gather_reference(outs, list(rr))
    arrivals = sum(x[2].sum(1) for x in inp)
    return {"inputs": inp, "outs": outs, "ein": ein, "ms": ms, "rw": rw, "rr": rr, "y": y, "gr": gr, "cnt": cnt,
            "dropped": int((arrivals - torch.stack(list(cnt)).sum(1)).sum())}


def _check(rank: int, ref: Dict, got) -> Dict:
    ein, ms, rw, rr, y, gr, cnt = (t.cpu() for t in got)
    return {"expert_in": bool(torch.equal(_bits(ein), _bits(ref["ein"][rank]))),
            "m_splits": bool(torch.equal(ms, ref["ms"][rank]) and torch.equal(cnt, ref["cnt"][rank])),
            "row_weights": bool(torch.equal(_bits(rw), _bits(ref["rw"][rank]))),
            "route_row": bool(torch.equal(rr, ref["rr"][rank])),
            "combine": bool(torch.equal(_bits(y), _bits(ref["y"][rank]))),
            "gather_routes": bool(torch.equal(_bits(gr), _bits(ref["gr"][rank]))),
            "dropped": ref["dropped"], "zero_expert": bool((torch.stack(list(ref["cnt"])) == 0).any()),
            "received": int(ref["cnt"][rank].sum())}


def exchange_cuda_worker(rank: int, world: int, mode: str, rows_kind: str, num_sms: int = 3,
                         align: int = 1) -> List[Dict]:
    """``mode``: ``"eager"`` (seeds 0, 1), ``"graph"`` (eager seed 0 allocates, then one capture replayed with
    seeds 1 and 2: new routing, rows and counts copied into the captured inputs) or ``"no_sync"`` (seed 1 under
    ``torch.cuda.set_sync_debug_mode("error")`` after an eager seed-0 call) or ``"two_streams"`` (seeds 0 and 1 issued
    from two streams with no order between them: the exchange's own stream orders them)."""
    from moe_graph.ops.nvlink import NvlinkExchange

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    ex = NvlinkExchange(device=dev, num_sms=num_sms)
    capacity = capacity_for(world, rows_kind)
    refs = {seed: reference(seed, world, rows_kind, capacity, align) for seed in (0, 1, 2)}

    def to_dev(seed):
        rows, ros, sc, w = refs[seed]["inputs"][rank]
        return [t.to(dev) for t in (rows, ros, sc, w)] + [refs[seed]["outs"][rank].to(dev)]

    def step(rows, ros, sc, w, out):
        d = ex.dispatch(rows, ros, sc, K, capacity, weights=w, align=align)
        y = ex.combine(out, d.route_row, K, weights=w)
        gr = ex.gather_routes(out, d.route_row)
        return d.expert_in, d.m_splits, d.row_weights, d.route_row, y, gr, d.counts

    res = []
    if mode == "eager":
        for seed in (0, 1):
            got = step(*to_dev(seed))
            torch.cuda.synchronize()
            res.append(_check(rank, refs[seed], got))
    elif mode == "graph":
        static = to_dev(0)
        step(*static)  # eager: allocates and rendezvouses the symmetric buffers (collective) before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(*static)
        for seed in (1, 2):
            for dst, src in zip(static, to_dev(seed)):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            res.append(_check(rank, refs[seed], got))
    elif mode == "no_sync":
        step(*to_dev(0))
        args = to_dev(1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        res.append(_check(rank, refs[1], got))
    elif mode == "two_streams":  # as overlap_microbatches issues them: seed 0's step and seed 1's on two streams
        step(*to_dev(0))
        inputs = [to_dev(seed) for seed in (0, 1)]
        torch.cuda.synchronize()
        outs = []
        for args in inputs:
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                outs.append(step(*args))
        torch.cuda.synchronize()
        res += [_check(rank, refs[seed], got) for seed, got in zip((0, 1), outs)]
    else:
        raise ValueError(f"exchange_cuda_worker: unknown mode {mode!r}")
    return res
