"""The token exchange's cost per kernel / op, counted on the CPU: ``exchange="nvlink"`` (the fused exchange) next to
``"symm_mem"`` (torch's NVSHMEM ``all_to_all_vdev_2d`` with the copies around it) and ``"nccl"`` (fixed-split
all-to-all, capacity per pair), at the same inputs; and the node-aware exchange's inter-node bytes.

1. **Design counts** (formulas, per rank and layer, divided by the tokens ``T``): for dispatch and combine, per
   kernel or op on the row path, HBM bytes read and written, link bytes (rows that leave the rank), and the
   launches of the row path (the layout / demand / quota bookkeeping is the same for ``symm_mem`` and ``nvlink`` and
   not listed). ``n = T*K`` kept routes, ``n_remote = n (R-1)/R`` (uniform routing), ``B = H * element size``,
   per-pair capacity ``cp = ceil(cf T K / R)``, per-destination ``cd = ceil(cf T K)``. The ``nvlink`` rows are the
   CUDA design's counts (``moe_graph.ops.nvlink``: each kept route's token row read once from the layer input and
   written once at its final receive row, the weight beside it; the combine reads each route once and writes the
   output row once); nothing of it has run on a GPU. The ``symm_mem`` / ``nccl`` rows follow the code paths of
   :mod:`moe_graph.moe.exchange` / :mod:`moe_graph.moe.token_dispatcher` (NCCL's internal FIFO copies not counted).
2. **Measured on gloo** (``--ranks`` processes, small shapes): the rows the host-sized fused exchange
   (:class:`moe_graph.moe.exchange.HostSizedFusedExchange`) sent to other ranks per token against the formula on
   the same routing, and the row-sized tensors each path's forward ops write (a ``TorchDispatchMode``; the gloo
   path's send and receive buffers stand for the CUDA kernel's remote stores; the gloo collectives themselves do
   not pass the dispatch mode). A capacity factor of 2 there: nothing drops, so the remote rows equal the routing's.
3. **Node-aware exchange**: inter-node bytes per token for DeepSeek-V3-like routing (256 experts, top-8,
   node-limited to 4 of 8 nodes by :func:`moe_graph.moe.router.group_limited_topk`, EP 64 = 8 nodes x 8), per-route
   sending vs once per (token, node) (:func:`moe_graph.moe.exchange.inter_node_rows`).

    PYTHONPATH=python python3 benchmarks/bench_exchange_cost.py             # ~1 min
    PYTHONPATH=python python3 benchmarks/bench_exchange_cost.py --skip-gloo

Prints the tables and writes JSON with the commit measured (``--out``, default ``./moe_graph_results/``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, write_json  # noqa: E402
from moe_graph.moe.exchange import inter_node_rows  # noqa: E402
from moe_graph.moe.router import group_limited_topk  # noqa: E402

SHAPES = {"DeepSeek-V3-like": dict(hidden=7168, topk=8, tokens=4096, ranks=8),
          "Qwen3-30B-A3B-like": dict(hidden=2048, topk=8, tokens=4096, ranks=8)}


# ------------------------------------------------------------------------------------------ 1. design counts --
def design_counts(T: int, K: int, H: int, R: int, cf: float, es: int = 2, ws: int = 4) -> List[Dict]:
    """One row per (backend, direction, op): bytes read / written in HBM and over links, per rank and layer."""
    B = H * es
    n = T * K
    remote = n * (R - 1) / R
    cp = math.ceil(round(cf * T * K / R, 6))
    cd = math.ceil(round(cf * T * K, 6))
    rows = []

    def op(backend, direction, name, read, write, link, staging=False):
        rows.append(dict(backend=backend, direction=direction, op=name, hbm_read=read, hbm_write=write, link=link,
                         staging=staging))

    # nvlink: the CUDA design (one kernel per direction; design counts, compiled only)
    op("nvlink", "dispatch", "fused dispatch (count + data phase)", n * (B + ws), cd * B + n * ws, remote * (B + ws))
    op("nvlink", "combine", "fused combine (pull K routes, fp32 weighted sum)", n * (B + ws), T * B, remote * B)
    # symm_mem: expand_rows -> copy into the symmetric send buffer -> all_to_all_vdev_2d -> copy out (where)
    N = T * K  # packed send slots (quota mode)
    op("symm_mem", "dispatch", "expand_rows (permute into send slots)", n * B, N * B, 0)
    op("symm_mem", "dispatch", "copy into symmetric send buffer", N * B, N * B, 0, True)
    op("symm_mem", "dispatch", "all_to_all_vdev_2d", n * B, n * B, remote * B)
    op("symm_mem", "dispatch", "copy out of the receive buffer (where)", cd * B, cd * B, 0, True)
    op("symm_mem", "combine", "copy into symmetric buffer", cd * B, cd * B, 0, True)
    op("symm_mem", "combine", "all_to_all_vdev_2d_offset", n * B, n * B, remote * B)
    op("symm_mem", "combine", "copy out (where)", N * B, N * B, 0, True)
    op("symm_mem", "combine", "reduce_rows (weighted sum of K)", n * B, T * B, 0)
    # nccl: expand_rows into [R, cp] blocks (padding rows written) -> all_to_all_single -> regroup (expand_rows)
    P = R * cp
    op("nccl", "dispatch", "expand_rows (permute into [R, cp] blocks)", n * B, P * B, 0)
    op("nccl", "dispatch", "all_to_all_single (padded)", P * B, P * B, (R - 1) * cp * B)
    op("nccl", "dispatch", "regroup by local expert (expand_rows)", P * B, P * B, 0, True)
    op("nccl", "combine", "regroup back (expand_rows)", P * B, P * B, 0, True)
    op("nccl", "combine", "all_to_all_single (padded)", P * B, P * B, (R - 1) * cp * B)
    op("nccl", "combine", "reduce_rows (weighted sum of K)", n * B, T * B, 0)
    for r in rows:
        for k in ("hbm_read", "hbm_write", "link"):
            r[k + "_per_token"] = r.pop(k) / T
    return rows


def summarize(rows: List[Dict]) -> List[Dict]:
    out = []
    for be in ("nvlink", "symm_mem", "nccl"):
        for d in ("dispatch", "combine"):
            sel = [r for r in rows if r["backend"] == be and r["direction"] == d]
            out.append(dict(backend=be, direction=d, launches=len(sel), staging_copies=sum(r["staging"] for r in sel),
                            hbm_per_token=sum(r["hbm_read_per_token"] + r["hbm_write_per_token"] for r in sel),
                            link_per_token=sum(r["link_per_token"] for r in sel)))
    return out


# ---------------------------------------------------------------------------------------- 2. gloo measured --
class RowWrites(TorchDispatchMode):
    """Ops whose result is a row tensor (last dim ``H``), with the rows they write."""

    def __init__(self, H: int):
        super().__init__()
        self.H, self.ops = H, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        res = out if isinstance(out, (tuple, list)) else (out,)
        for t in res:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.H and name not in (
                    "view", "_unsafe_view", "detach", "alias", "slice", "t", "empty", "new_empty", "empty_like"):
                self.ops.append((name, int(t.shape[0])))
        return out


def gloo_worker(rank: int, world: int, T: int, K: int, H: int, E: int, cf: float, seed: int) -> Dict:
    from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns

    cr, cl = expert_columns(E, world)
    g = torch.Generator().manual_seed(seed + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    probs = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g, dtype=torch.bfloat16)
    out = {"remote_routes": int((cr[idx] != rank).sum())}
    for ex in ("nvlink", "symm_mem", "nccl"):
        d = TokenDispatcher(E // world, world, rank, cr, cl, capacity=None, exchange=ex)
        d.capacity = d.capacity_for(T, K, cf)
        with RowWrites(H) as m:
            ein, ms, h = d.dispatch(x, idx, probs)
        disp = m.ops
        with RowWrites(H) as m:
            d.combine(ein, h)
        out[ex] = {"dispatch_row_ops": disp, "combine_row_ops": m.ops}
        if ex == "nvlink":
            sent = d.exchange_backend.sent_rows
            out[ex]["sent_remote"] = {k: sum(v for dd, v in enumerate(rows) if dd != rank) for k, rows in sent.items()}
    return out


def gloo_measure(R: int, T: int, K: int, H: int, E: int, cf: float) -> Dict:
    from moe_graph.distributed.launch import run_distributed

    res = run_distributed(gloo_worker, R, T, K, H, E, cf, 0, timeout=300.0)
    remote = sum(r["remote_routes"] for r in res)
    nv = {k: sum(r["nvlink"]["sent_remote"][k] for r in res) for k in ("dispatch", "combine")}
    per = {}
    for ex in ("nvlink", "symm_mem", "nccl"):
        per[ex] = {d: {"ops": res[0][ex][d + "_row_ops"],
                       "rows_written_per_token": sum(n for _, n in res[0][ex][d + "_row_ops"]) / T}
                   for d in ("dispatch", "combine")}
    return {"ranks": R, "tokens": T, "topk": K, "hidden": H, "experts": E, "cf": cf,
            "remote_routes_per_token": remote / (R * T),
            "nvlink_sent_remote_rows_per_token": {k: v / (R * T) for k, v in nv.items()},
            "link_check": {k: v == remote for k, v in nv.items()}, "row_ops_rank0": per}


# ------------------------------------------------------------------------------------------ 3. node-aware --
def node_routing(E: int, K: int, R: int, G: int, T: int, group_topk: int, seed: int) -> Dict:
    """Inter-node rows per token for DeepSeek-V3-like routing: sigmoid scores, experts in ``R // G`` groups (one per
    node), each token limited to ``group_topk`` nodes; every source rank's tokens."""
    nodes = R // G
    gen = torch.Generator().manual_seed(seed)
    per_route = per_node = 0
    for src in range(R):
        scores = torch.sigmoid(torch.randn(T, E, generator=gen))
        _, idx = group_limited_topk(scores, K, nodes, group_topk)
        c = inter_node_rows(idx // (E // R), src, G)
        per_route += c["per_route"]
        per_node += c["per_node"]
    return {"per_route_rows_per_token": per_route / (R * T), "per_node_rows_per_token": per_node / (R * T)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cf", type=float, default=1.1, help="capacity factor of both rules")
    ap.add_argument("--ranks", type=int, default=4, help="gloo processes of the measured part")
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--node-tokens", type=int, default=512, help="tokens per rank of the node-aware count")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    env = environment()
    print(f"exchange cost per rank and layer, commit {env.get('commit')}; nvlink rows: design counts (CUDA kernels "
          f"compiled only, never run on a GPU)")
    design = {}
    for name, s in SHAPES.items():
        rows = design_counts(s["tokens"], s["topk"], s["hidden"], s["ranks"], a.cf)
        design[name] = {"shape": s, "cf": a.cf, "ops": rows, "summary": summarize(rows)}
        print(f"\n{name}: H {s['hidden']} bf16, top-{s['topk']}, {s['tokens']} tokens/rank, EP {s['ranks']}, "
              f"cf {a.cf} (KB per token)")
        print("| backend | direction | row-path launches | staging copies | HBM read+write | link |")
        print("|---|---|---|---|---|---|")
        for r in design[name]["summary"]:
            print(f"| {r['backend']} | {r['direction']} | {r['launches']} | {r['staging_copies']} | "
                  f"{r['hbm_per_token'] / 1024:.1f} | {r['link_per_token'] / 1024:.1f} |")
    measured = None
    if not a.skip_gloo:
        measured = gloo_measure(a.ranks, 64, 4, 96, 4 * a.ranks, 2.0)
        print(f"\ngloo, {a.ranks} ranks: routes to other ranks per token {measured['remote_routes_per_token']:.3f}; "
              f"rows the fused exchange sent to other ranks per token {measured['nvlink_sent_remote_rows_per_token']} "
              f"(equal to the routing's count: {measured['link_check']})")
        for ex, per in measured["row_ops_rank0"].items():
            for d, v in per.items():
                print(f"  {ex:8s} {d:8s} row-writing ops (rank 0): {[o for o, _ in v['ops']]}  "
                      f"rows written/token {v['rows_written_per_token']:.2f}")
    node = {}
    for G, group_topk in ((8, 4), (8, 8)):
        c = node_routing(256, 8, 64, G, a.node_tokens, group_topk, 0)
        B = 7168 * 2
        c.update(per_route_bytes_per_token=c["per_route_rows_per_token"] * B,
                 per_node_bytes_per_token=c["per_node_rows_per_token"] * B)
        c["saving"] = 1 - c["per_node_rows_per_token"] / c["per_route_rows_per_token"]
        node[f"EP64_8x8_nodes_limit{group_topk}"] = c
        print(f"\nDeepSeek-V3-like routing (256 experts, top-8, at most {group_topk} of 8 nodes), EP 64 = 8 nodes x 8, "
              f"bf16 H 7168: inter-node rows per token {c['per_route_rows_per_token']:.2f} per route vs "
              f"{c['per_node_rows_per_token']:.2f} per (token, node): {c['per_route_bytes_per_token'] / 1024:.1f} -> "
              f"{c['per_node_bytes_per_token'] / 1024:.1f} KB per token per direction ({100 * c['saving']:.0f}% less)")
    out = a.out or results_path("exchange_cost")
    write_json(out, {"env": env, "args": vars(a), "design": design, "gloo": measured, "node_aware": node,
                     "notes": "nvlink rows are design counts of the CUDA kernels (compiled only); the gloo backend "
                              "adds a send buffer and a receive buffer around all_to_all_single that the CUDA "
                              "kernel replaces with direct remote stores"})


if __name__ == "__main__":
    main()
