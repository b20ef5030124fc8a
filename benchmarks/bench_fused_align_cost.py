"""The cost of the FP8 experts' 16-row group alignment on the fused ("nvlink") exchange, measured on the CPU: one
moe_graph MoELayer (FP8 blockwise experts, bf16, fused ``main_grad``) forward + backward at EP 2 on gloo through
``HostSizedFusedExchange`` (the fused exchange's CPU model), with the fused exchange placing the rows at their
aligned expert rows itself (``align``: the rows move once) against the previous path, where the exchange packs the
groups back to back and the experts regroup them (``moe.experts.AlignedGroups``: a row gather into the padded
layout and one back, forward and backward; selected with ``moe.experts.ALIGNED_DISPATCH = False``, which is what
the fused exchange did before it took ``align``). With 16-bit dispatch and with FP8 dispatch.

Counts as ``bench_moe_cost.py``'s :class:`CostMeter` (ops reaching the dispatcher = launches, non-GEMM bytes of
their tensor arguments and results over the rank's tokens; the grouped GEMMs stubbed, :class:`GemmStub`, so the
counts depend on shapes only). Rank 0's counts. On gloo the exchange itself is a handful of ops (all-gather of the
counts, index bookkeeping, ``all_to_all_single``) where the CUDA backend launches one kernel; those ops are the same
in both columns, so the difference is the alignment's.

    PYTHONPATH=python python3 benchmarks/bench_fused_align_cost.py [--tokens 512] [--out benchmarks/results/...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# a Qwen3-like layer scaled down (8 experts per rank at EP 2), a capacity factor as in training
CFG = dict(H=256, F=96, E=16, K=4, cf=1.25)


def _worker(rank: int, world: int, tokens: int) -> Dict:
    import bench_moe_cost as bmc
    import moe_graph.moe.experts as experts
    from moe_graph.moe.layer import MoELayer
    from moe_graph.ops import fp8 as moe_graph_fp8

    out = {}
    for fp8_dispatch in (False, True):
        for aligned in (False, True):
            torch.manual_seed(0)
            layer = MoELayer(CFG["H"], CFG["F"], CFG["E"], CFG["K"], ep_size=world, exchange="nvlink",
                             capacity_factor=CFG["cf"],
                             fp8_dispatch=fp8_dispatch, activation="swiglu", device="cpu",
                             params_dtype=torch.bfloat16)
            for p in layer.experts.weights():
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            seen = []
            layer.experts.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("aligned")),
                                                    with_kwargs=True)

            def fwd(x):
                with moe_graph_fp8.autocast(recipe="blockwise"):
                    return layer(x.to(torch.bfloat16)).float()

            g = torch.Generator().manual_seed(10 + rank)
            x = torch.randn(tokens, CFG["H"], generator=g)
            dy = torch.randn(tokens, CFG["H"], generator=g)
            before = experts.ALIGNED_DISPATCH
            experts.ALIGNED_DISPATCH = aligned
            try:
                res = bmc.measure(fwd, x, dy, layer, bmc.CostMeter(), 0, arithmetic=False)
            finally:
                experts.ALIGNED_DISPATCH = before
            res.pop("out")
            res["experts_got_aligned_rows"] = bool(seen[-1])
            res["ops"] = {ph: dict(sorted(v.items())) for ph, v in res["ops"].items()}
            out[f"{'fp8_dispatch' if fp8_dispatch else 'bf16_dispatch'}/{'fused_align' if aligned else 'regroup'}"] = res
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    from moe_graph.distributed.launch import run_distributed

    res = run_distributed(_worker, 2, args.tokens, timeout=1200.0)[0]
    keys = ("launches_fwd", "launches_bwd", "non_gemm_bytes_per_token", "non_gemm_bytes_per_token_fwd",
            "saved_bytes_per_token", "host_syncs")
    print(f"FP8 blockwise MoE layer, EP 2 on gloo, fused exchange; H {CFG['H']}, F {CFG['F']}, E {CFG['E']}, "
          f"top-{CFG['K']}, cf {CFG['cf']}, {args.tokens} tokens per rank (rank 0; GEMMs stubbed)")
    print(f"{'row':34s} " + " ".join(f"{k:>28s}" for k in keys))
    for name, r in res.items():
        print(f"{name:34s} " + " ".join(f"{r[k]:>28.1f}" if isinstance(r[k], float) else f"{r[k]:>28d}"
                                        for k in keys))
    for disp in ("bf16_dispatch", "fp8_dispatch"):
        old, new = res[f"{disp}/regroup"], res[f"{disp}/fused_align"]
        diff = {k: new["op_bytes_per_token"].get(k, 0) - old["op_bytes_per_token"].get(k, 0)
                for k in set(old["op_bytes_per_token"]) | set(new["op_bytes_per_token"])}
        print(f"{disp}: bytes/token by op, fused_align - regroup (largest changes):")
        for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8]:
            if v:
                print(f"    {k:44s} {v:+12.1f}")
    doc = {"benchmark": "bench_fused_align_cost", "commit": _commit(), "config": dict(CFG, T=args.tokens, ep=2),
           "rows": {n: {k: r[k] for k in keys + ("quantize_bytes_per_token", "experts_got_aligned_rows",
                                                 "op_bytes_per_token", "ops")} for n, r in res.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.out)
    return doc


if __name__ == "__main__":
    main()
