"""Expert-parallel exchange at scale (planner and layout level, CPU): the capacity factor a step needs under the
per-pair rule (``exchange="nccl"``: a fixed capacity per (source, destination) pair) and the per-destination rule
(``exchange="symm_mem"``: one receive buffer per rank shared by all sources), the rerun rate of the dropless mode at
given capacity factors, and the receive memory and bytes on the wire per layer of both exchanges.

Routing per step: every source rank routes ``T`` tokens to ``K`` distinct experts of ``E`` (Gumbel top-k sampling)
with Zipf popularity ``1 / i**zipf`` (the popular experts placed on the ranks at random); ``varied``: each source's
popularity is multiplied by a lognormal(0, ``sigma``) factor per expert, drawn afresh every step (ranks see
different documents). Echo (``k`` spare slots per rank, all donors) runs the project's planner
(:func:`moe_graph.moe.echo_planner.gen_plan`, the native op when built) on the step's ``[R, E]`` counts; its
allocation says how many tokens each source sends to each slot, which gives the pair loads after echo.

* ``cf_pair`` / ``cf_dest``: the factor at which nothing overflows: the largest pair load over ``T*K/R``, the largest
  destination load over ``T*K`` (mean, and worst step in brackets);
* ``rerun@cf``: the fraction of steps that overflow at capacity factor ``cf`` (``capacity_for`` /
  ``destination_capacity``, so the rounding is the dispatcher's), and ``drop@cf`` the routes the per-destination rule
  drops then (``destination_quotas``: every source keeps its proportional share);
* memory table: receive buffer and bytes that leave a rank per layer and dispatch (bf16; Qwen3-30B-A3B: H 2048,
  top-8; DeepSeek-V3: H 7168, top-8) for the fixed-split all-to-all (padded: ``R * ceil(cf*T*K/R)`` rows whatever
  the routing) and the variable-size exchange (the routed rows only), at the factors each rule needs.

    PYTHONPATH=python python3 benchmarks/bench_exchange.py                         # the full table (~15 min, 1 core)
    PYTHONPATH=python python3 benchmarks/bench_exchange.py --ranks 8 --steps 2 --tokens 256   # a smoke run

Prints the tables and writes JSON with the commit measured (``--out``, default ``./moe_graph_results/``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, write_json  # noqa: E402
from moe_graph.moe import echo_planner  # noqa: E402
from moe_graph.moe.exchange import destination_capacity, destination_quotas, exchange_bytes  # noqa: E402
from moe_graph.moe.token_dispatcher import capacity_for  # noqa: E402

MODELS = {"Qwen3-30B-A3B": dict(hidden=2048, topk=8), "DeepSeek-V3": dict(hidden=7168, topk=8)}


def sample_counts(R, E, T, K, p, sigma, gen):
    """``[R, E]`` int64: routes of each source rank per expert for one step (see the module docstring)."""
    counts = torch.zeros(R, E, dtype=torch.int64)
    chunk = max(1, (1 << 22) // max(E * T, 1))  # sources per chunk
    for s0 in range(0, R, chunk):
        n = min(chunk, R - s0)
        ps = p.expand(n, E)
        if sigma > 0:
            ps = ps * torch.exp(sigma * torch.randn(n, E, generator=gen, dtype=torch.float64))
        ps = (ps / ps.sum(1, keepdim=True)).float()
        # Gumbel top-k: the K largest p / Exp(1) are a sample of K distinct experts without replacement
        scores = ps.repeat_interleave(T, 0) / torch.empty(n * T, E).exponential_(generator=gen)
        idx = scores.topk(K, dim=1).indices
        src = torch.arange(n).repeat_interleave(T * K)
        counts[s0:s0 + n].view(-1).index_add_(0, src * E + idx.reshape(-1), torch.ones(n * T * K, dtype=torch.int64))
    return counts


def pair_loads(counts, k):
    """``[R, R]`` routes source ``s`` sends rank ``d`` after echo with ``k`` spare slots per rank (0: off)."""
    R, E = counts.shape
    L = E // R
    home = counts.view(R, R, L).sum(2)
    if k == 0:
        return home
    h, alloc = echo_planner.gen_plan(counts, k)  # [E, S], [R, S]: tokens each source sends to each slot
    slot_home, _ = echo_planner._slot_homes(h)
    moved = torch.zeros(R, R, dtype=torch.int64).index_add_(1, slot_home // L, alloc)  # leave the home rank
    arrive = alloc.view(R, R, k).sum(2)  # slot j lives on rank j // k
    return home - moved + arrive


def run_case(R, E, T, K, zipf, sigma, steps, spares, cfs, seed):
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** zipf
    p = p[torch.randperm(E, generator=gen)]
    TK = T * K
    rows = {k: {"cf_pair": [], "cf_dest": [], "over_pair": {c: 0 for c in cfs}, "over_dest": {c: 0 for c in cfs},
                "drop_dest": {c: 0 for c in cfs}, "routed": 0} for k in spares}
    for _ in range(steps):
        counts = sample_counts(R, E, T, K, p, sigma, gen)
        for k in spares:
            pl = pair_loads(counts, k)
            dest = pl.sum(0)
            r = rows[k]
            r["cf_pair"].append(float(pl.max()) / (TK / R))
            r["cf_dest"].append(float(dest.max()) / TK)
            r["routed"] += int(pl.sum())
            for c in cfs:
                r["over_pair"][c] += int(bool((pl > capacity_for(T, K, R, c)).any()))
                cap = destination_capacity(T, K, R, c)
                r["over_dest"][c] += int(bool((dest > cap).any()))
                r["drop_dest"][c] += int(pl.sum() - destination_quotas(pl, cap).sum())
    out = {}
    for k, r in rows.items():
        out[k] = {"cf_pair_mean": sum(r["cf_pair"]) / steps, "cf_pair_worst": max(r["cf_pair"]),
                  "cf_dest_mean": sum(r["cf_dest"]) / steps, "cf_dest_worst": max(r["cf_dest"]),
                  "rerun_pair": {str(c): r["over_pair"][c] / steps for c in cfs},
                  "rerun_dest": {str(c): r["over_dest"][c] / steps for c in cfs},
                  "drop_dest": {str(c): r["drop_dest"][c] / max(r["routed"], 1) for c in cfs}}
    return out


def memory_rows(ranks, T, cf, pair_needed):
    """Receive buffer and wire bytes per layer and dispatch (bf16) for both rules; ``pair_needed[R]``: the per-pair
    factor the measured routing needs (worst step, varied routing, echo k=2)."""
    rows = []
    for name, m in MODELS.items():
        for R in ranks:
            a = exchange_bytes(T, m["topk"], R, m["hidden"], 2, cf)
            b = exchange_bytes(T, m["topk"], R, m["hidden"], 2, pair_needed.get(R, cf))
            rows.append({"model": name, "R": R, "cf": cf, "pair_cf_needed": pair_needed.get(R),
                         "dest_receive_MiB": a["destination"]["receive"] / 2 ** 20,
                         "dest_wire_MiB": a["destination"]["wire"] / 2 ** 20,
                         "pair_receive_MiB_at_cf": a["pair"]["receive"] / 2 ** 20,
                         "pair_wire_MiB_at_cf": a["pair"]["wire"] / 2 ** 20,
                         "pair_receive_MiB_needed": b["pair"]["receive"] / 2 ** 20,
                         "pair_wire_MiB_needed": b["pair"]["wire"] / 2 ** 20,
                         "routed_MiB": T * m["topk"] * m["hidden"] * 2 / 2 ** 20})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    ap.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2])
    ap.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the per-rank variation")
    ap.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2], help="echo slots per rank (0: off)")
    ap.add_argument("--cfs", type=float, nargs="+", default=[1.1, 1.25])
    ap.add_argument("--steps", type=int, default=10, help="steps per case")
    ap.add_argument("--key-steps", type=int, default=100,
                    help="steps of the issue's case (EP 64, varied, echo k=2): the rerun rate's resolution")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for R in a.ranks:
        if a.experts % R:
            ap.error(f"--experts {a.experts} must be divisible by every --ranks value (got {R})")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    env = environment()
    print(f"exchange at scale: E={a.experts}, top-{a.topk}, T={a.tokens}/rank, Zipf {a.zipf}, per-rank variation "
          f"lognormal(0, {a.sigma}), echo k in {a.spares} (all donors), commit {env.get('commit')}")
    hdr = (f"{'R':>4} {'routing':>7} {'zipf':>4} {'k':>2} {'steps':>5} {'cf_pair':>15} {'cf_dest':>15} "
           + " ".join(f"{'rerun@' + str(c) + ' pair/dest':>22}" for c in a.cfs)
           + " " + " ".join(f"{'drop@' + str(c):>10}" for c in a.cfs))
    print(hdr)
    results = []
    t0 = time.perf_counter()
    for R in a.ranks:
        for varied in (False, True):
            for zipf in a.zipf:
                key = R == 64 and varied and a.key_steps > a.steps
                steps = a.key_steps if key else a.steps
                res = run_case(R, a.experts, a.tokens, a.topk, zipf, a.sigma if varied else 0.0, steps, a.spares,
                               a.cfs, a.seed + 1000 * R + int(10 * zipf) + (7 if varied else 0))
                for k, r in res.items():
                    row = dict(R=R, varied=varied, zipf=zipf, k=k, steps=steps, **r)
                    results.append(row)
                    print(f"{R:>4} {'varied' if varied else 'same':>7} {zipf:>4} {k:>2} {steps:>5} "
                          f"{r['cf_pair_mean']:>6.2f} ({r['cf_pair_worst']:>5.2f}) "
                          f"{r['cf_dest_mean']:>6.3f} ({r['cf_dest_worst']:>5.3f}) "
                          + " ".join(f"{100 * r['rerun_pair'][str(c)]:>10.0f}% /{100 * r['rerun_dest'][str(c)]:>6.1f}%"
                                     for c in a.cfs) + " "
                          + " ".join(f"{100 * r['drop_dest'][str(c)]:>9.3f}%" for c in a.cfs), flush=True)
    needed = {}
    for R in a.ranks:
        worst = [r["cf_pair_worst"] for r in results if r["R"] == R and r["varied"] and r["k"] == max(a.spares)]
        needed[R] = max(worst) if worst else None
    mem = memory_rows(a.ranks, a.tokens, min(a.cfs), needed)
    print(f"\nper layer and dispatch, bf16, T={a.tokens}/rank: receive buffer / bytes leaving a rank (MiB); the pair "
          f"rule at cf {min(a.cfs)} and at the factor the varied routing needs with echo k={max(a.spares)}")
    print(f"{'model':>14} {'R':>4} {'routed':>8} {'dest recv':>10} {'dest wire':>10} {'pair recv@cf':>13} "
          f"{'pair wire@cf':>13} {'cf needed':>9} {'pair recv':>10} {'pair wire':>10}")
    for m in mem:
        print(f"{m['model']:>14} {m['R']:>4} {m['routed_MiB']:>8.0f} {m['dest_receive_MiB']:>10.0f} "
              f"{m['dest_wire_MiB']:>10.0f} {m['pair_receive_MiB_at_cf']:>13.0f} {m['pair_wire_MiB_at_cf']:>13.0f} "
              f"{m['pair_cf_needed'] or math.nan:>9.2f} {m['pair_receive_MiB_needed']:>10.0f} "
              f"{m['pair_wire_MiB_needed']:>10.0f}")
    key = [r for r in results if r["R"] == 64 and r["varied"] and r["k"] == 2]
    summary = {}
    if key:
        summary = {"ep64_varied_k2_steps": sum(r["steps"] for r in key),
                   "ep64_varied_k2_rerun_dest": {c: max(r["rerun_dest"][c] for r in key) for c in map(str, a.cfs)},
                   "ep64_varied_k2_rerun_pair": {c: max(r["rerun_pair"][c] for r in key) for c in map(str, a.cfs)}}
        print(f"\nEP 64, varied routing, echo k=2 ({summary['ep64_varied_k2_steps']} steps over Zipf {a.zipf}): rerun "
              f"rate per destination {summary['ep64_varied_k2_rerun_dest']}, per pair "
              f"{summary['ep64_varied_k2_rerun_pair']}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    out = a.out or results_path("bench_exchange", dated=False)
    write_json(out, {"env": env, "args": vars(a), "rows": results, "memory": mem, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
