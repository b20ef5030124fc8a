"""The fused token exchange's CUDA kernels (``moe_graph.ops.nvlink.NvlinkExchange``, ``exchange="nvlink"``) against
torch's symmetric-memory ``all_to_all_vdev_2d`` path (``moe_graph.moe.exchange.SymmMemExchange``, when NVSHMEM is
available) and NCCL ``all_to_all_single`` with host splits: dispatch and combine time and bandwidth on the GPUs
present (EP = R = their count, one process per GPU, NCCL group). Needs CUDA GPUs; written on a machine without one
(compiled/imported only there, ``--help`` runs anywhere).

Case: 4096 tokens per rank, top-8 over E = 32 * R experts (256 when R = 8), distinct experts per token drawn
uniformly at random; rows of H = 7168 as bf16 (14336 bytes) or FP8 1x128 blockwise packed (7168 + 4 * 56 = 7392
bytes: the FP8 bytes and one fp32 scale per 128); the combine moves bf16 rows (expert outputs) and reduces the K
routes of each token in fp32 with the routing weights. ``nvlink`` runs with ``num_sms`` 20 and 24. Receive capacity:
the largest arrival count over the ranks (dropless).

What each method's time covers (CUDA events on each rank, ``--warmup`` calls, then the median of ``--reps``; the
row reports the slowest rank's median):

- ``nvlink`` dispatch: one ``NvlinkExchange.dispatch`` (``copy=False``, no weights): rows read from the token
  tensor, stored in each destination's receive buffer at their final (expert-major) row. Combine: one
  ``combine`` from the symmetric expert-output buffer (``combine_buffer``, no copy) with the weights, fp32 reduce.
- ``symm_mem`` dispatch: the permute into send order (``index_select``) + ``SymmMemExchange.to_experts`` (copies into
  and out of the symmetric buffers, ``all_to_all_vdev_2d``); combine: ``to_sources`` + a weighted fp32
  ``index_add_`` per token. Runs in its own processes (it fixes the NVSHMEM backend for the process).
- ``nccl`` dispatch: the same permute + ``all_to_all_single`` with host splits (rows arrive source-major: the
  regroup by expert that the two others include is NOT counted, in NCCL's favour); combine: ``all_to_all_single``
  back + the same weighted ``index_add_``.

Bandwidth (per rank, in the JSON as ``bytes`` / ``link_bytes``): ``GB/s`` = the bytes of the rows that leave the
rank (dispatch: T*K routes x row bytes, including routes to the rank itself) or arrive back at it (combine: T*K
bf16 rows) / time; ``link GB/s`` counts only the routes to other ranks (mean over ranks). At R = 1 every route stays
on the GPU (a copy through the peer pointer to itself): the link numbers are not meaningful there and the output
says so. Ratios: the peer's time / ``nvlink``'s (above 1: ``nvlink`` faster). Writes JSON with the commit
(benchmarks/common) under ./moe_graph_results/ ($MOE_GRAPH_RESULTS).

    python benchmarks/bench_exchange_gpu.py [--tokens 4096] [--hidden 7168] [--topk 8] [--sms 20,24] [--world R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cuda, write_json  # noqa: E402
from moe_graph.distributed.launch import run_distributed  # noqa: E402


def experts_for(world: int) -> int:
    return 256 if world == 8 else 32 * world


def row_bytes(kind: str, hidden: int) -> int:
    return 2 * hidden if kind == "bf16" else hidden + 4 * (hidden // 128)


def routing(s: int, cfg: dict) -> torch.Tensor:
    """Rank ``s``'s [T, K] expert indices: K distinct experts per token, uniformly at random (same on every rank)."""
    g = torch.Generator().manual_seed(1234 + s)
    return torch.rand(cfg["tokens"], cfg["E"], generator=g).topk(cfg["topk"], dim=1).indices


def _rows(kind: str, cfg: dict, dev) -> torch.Tensor:
    T, H = cfg["tokens"], cfg["hidden"]
    if kind == "bf16":
        return torch.randn(T, H, device=dev).to(torch.bfloat16)
    return torch.randint(0, 256, (T, row_bytes(kind, H)), dtype=torch.uint8, device=dev)


def _time(fn, cfg) -> float:
    import torch.distributed as dist

    dist.barrier()
    return 1e3 * time_cuda(fn, warmup=cfg["warmup"], reps=cfg["reps"])  # us


def bench_worker(rank: int, world: int, cfg: dict, which: str) -> dict:
    """One rank: ``which`` = ``"nvlink+nccl"`` or ``"symm_mem"``. Returns {(method, op, kind): us} and the counts."""
    import torch.distributed as dist

    from moe_graph.ops.dispatch_layout import dispatch_layout

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    T, K, H, E = cfg["tokens"], cfg["topk"], cfg["hidden"], cfg["E"]
    Lc = E // world
    idx_all = [routing(s, cfg) for s in range(world)]
    dest_all = [i // Lc for i in idx_all]
    # arrivals[s][d]: routes of rank s to rank d
    arrivals = [torch.bincount(d.flatten(), minlength=world) for d in dest_all]
    capacity = int(torch.stack(arrivals).sum(0).max())
    idx = idx_all[rank]
    in_splits = arrivals[rank].tolist()
    out_splits = [int(arrivals[s][rank]) for s in range(world)]
    order = torch.argsort(idx.flatten(), stable=True).to(dev)  # send order: by expert = (destination, local)
    tok = order // K
    w = torch.rand(T * K, device=dev)
    w_sorted = w[order].unsqueeze(1)
    times = {}

    def reduce_back(back):
        return torch.zeros(T, H, dtype=torch.float32, device=dev).index_add_(0, tok, back.float() * w_sorted)

    kinds = ["bf16", "fp8"]
    if which == "nvlink+nccl":
        from moe_graph.ops.nvlink import NvlinkExchange

        lay = dispatch_layout(idx, torch.arange(E) // Lc, torch.arange(E) % Lc, world, Lc, T * K)
        ros, sc = lay.route_of_slot.to(dev), lay.send_counts.to(dev)
        for sms in cfg["sms"]:
            ex = NvlinkExchange(device=dev, num_sms=sms)
            for kind in kinds:
                rows = _rows(kind, cfg, dev)
                d = ex.dispatch(rows, ros, sc, K, capacity, copy=False)  # allocates (collective)
                times[(f"nvlink sms={sms}", "dispatch", kind)] = _time(
                    lambda: ex.dispatch(rows, ros, sc, K, capacity, copy=False), cfg)
            out = ex.combine_buffer(capacity, (H,), torch.bfloat16)
            out.copy_(torch.randn(capacity, H, device=dev).to(torch.bfloat16))
            rr = d.route_row
            ex.combine(out, rr, K, weights=w)
            times[(f"nvlink sms={sms}", "combine", "bf16")] = _time(lambda: ex.combine(out, rr, K, weights=w), cfg)
            del ex
        for kind in kinds:
            rows = _rows(kind, cfg, dev)
            recv = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))

            def nccl_dispatch():
                dist.all_to_all_single(recv, rows.index_select(0, tok), out_splits, in_splits)

            times[("nccl", "dispatch", kind)] = _time(nccl_dispatch, cfg)
        eout = torch.randn(sum(out_splits), H, device=dev).to(torch.bfloat16)
        back = eout.new_empty((T * K, H))

        def nccl_combine():
            dist.all_to_all_single(back, eout, in_splits, out_splits)
            return reduce_back(back)

        times[("nccl", "combine", "bf16")] = _time(nccl_combine, cfg)
    else:
        from torch.distributed import _symmetric_memory as symm

        if not symm.is_nvshmem_available():
            return {"unavailable": "torch without NVSHMEM (is_nvshmem_available() is False)"}
        from moe_graph.moe.exchange import SymmMemExchange

        ex = SymmMemExchange(device=dev)
        sc = torch.bincount(idx.flatten(), minlength=E).view(world, Lc).to(dev)
        for kind in kinds:
            rows = _rows(kind, cfg, dev)
            try:
                plan = ex.plan(sc, capacity)
                ex.to_experts(rows.index_select(0, tok), plan)
            except Exception as e:  # noqa: BLE001  (e.g. a dtype all_to_all_vdev_2d refuses: same on every rank)
                times[("symm_mem", "dispatch", kind)] = f"error: {type(e).__name__}: {e}"[:300]
                continue
            times[("symm_mem", "dispatch", kind)] = _time(
                lambda: ex.to_experts(rows.index_select(0, tok), ex.plan(sc, capacity)), cfg)
        plan = ex.plan(sc, capacity)
        ex.to_experts(torch.zeros(T * K, H, device=dev, dtype=torch.bfloat16), plan)
        eout = torch.randn(capacity, H, device=dev).to(torch.bfloat16)
        times[("symm_mem", "combine", "bf16")] = _time(lambda: reduce_back(ex.to_sources(eout, plan, T * K)), cfg)
    remote = T * K - int(arrivals[rank][rank])
    return {"times": times, "remote_routes": remote, "capacity": capacity}


def summarize(per_rank: list, cfg: dict) -> list:
    T, K, H = cfg["tokens"], cfg["topk"], cfg["hidden"]
    remote = statistics.mean(r["remote_routes"] for r in per_rank)
    rows = []
    for key in per_rank[0]["times"]:
        method, op, kind = key
        vals = [r["times"][key] for r in per_rank]
        if any(isinstance(v, str) for v in vals):
            rows.append({"method": method, "op": op, "rows": kind, "error": next(v for v in vals if isinstance(v, str))})
            continue
        us = max(vals)
        B = row_bytes(kind, H)
        rows.append({"method": method, "op": op, "rows": kind, "us": us, "us_per_rank": vals, "bytes": T * K * B,
                     "link_bytes": remote * B, "GBps": T * K * B / (us * 1e3), "link_GBps": remote * B / (us * 1e3)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", default="20,24", help="num_sms values of the nvlink kernels")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peers", default="symm_mem,nccl", help="peers to run: symm_mem, nccl (nccl runs with nvlink)")
    ap.add_argument("--out", default=None, help="JSON path (default: results dir)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_exchange_gpu: needs CUDA GPUs (none visible)")
    from moe_graph.ops import nvlink

    if not nvlink.kernels_available():
        sys.exit("bench_exchange_gpu: moe_graph._C was built without the CUDA exchange kernels")
    world = args.world or torch.cuda.device_count()
    if args.hidden % 128:
        sys.exit(f"bench_exchange_gpu: --hidden must be a multiple of 128 (FP8 1x128 blocks), got {args.hidden}")
    cfg = {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk, "E": experts_for(world),
           "sms": [int(s) for s in args.sms.split(",")], "warmup": args.warmup, "reps": args.reps}
    peers = set(args.peers.split(","))
    per_rank = run_distributed(bench_worker, world, cfg, "nvlink+nccl", backend="nccl", timeout=600.0)
    rows = summarize(per_rank, cfg)
    symm_note = None
    if "symm_mem" in peers:
        try:
            sm = run_distributed(bench_worker, world, cfg, "symm_mem", backend="nccl", timeout=600.0)
            symm_note = sm[0].get("unavailable")
            if symm_note is None:
                rows += summarize(sm, cfg)
        except RuntimeError as e:
            symm_note = f"failed: {e}"[:500]
    if "nccl" not in peers:
        rows = [r for r in rows if r["method"] != "nccl"]
    by = {(r["method"], r["op"], r["rows"]): r for r in rows}
    print(f"EP {world}, {cfg['tokens']} tokens/rank, top-{cfg['topk']}, E {cfg['E']}, H {cfg['hidden']}"
          + ("  (R = 1: every route stays on this GPU; the link numbers are not meaningful)" if world == 1 else ""))
    if symm_note:
        print(f"symm_mem: {symm_note}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:8s} {r['rows']:4s} {r['method']:14s} {r['error']}")
            continue
        ratios = ""
        if r["method"].startswith("nvlink"):
            for peer in ("symm_mem", "nccl"):
                p = by.get((peer, r["op"], r["rows"]))
                if p is not None and "us" in p:
                    r[f"{peer}_over_nvlink"] = p["us"] / r["us"]
                    ratios += f"  {peer}/nvlink {p['us'] / r['us']:.2f}x"
        print(f"{r['op']:8s} {r['rows']:4s} {r['method']:14s} {r['us']:9.1f} us  {r['GBps']:7.1f} GB/s  "
              f"link {r['link_GBps']:7.1f} GB/s{ratios}")
    write_json(args.out or results_path("exchange_gpu"), {
        "env": environment(), "config": {**cfg, "world": world}, "symm_mem_note": symm_note,
        "link_meaningful": world > 1,
        "definitions": {"us": "slowest rank's median (CUDA events)",
                        "bytes": "per rank: T*K routes x row bytes (dispatch: rows leaving, combine: rows arriving)",
                        "link_bytes": "per rank (mean): routes to other ranks x row bytes",
                        "GBps": "bytes / us / 1e3", "link_GBps": "link_bytes / us / 1e3",
                        "fp8": "1x128 blockwise packed: H FP8 bytes + 4 bytes (fp32 scale) per 128"},
        "rows": rows})


if __name__ == "__main__":
    main()
