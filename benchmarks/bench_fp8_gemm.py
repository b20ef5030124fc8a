"""FP8 grouped GEMM benchmark: moe_graph's scaled grouped GEMM (blockwise on sm_90, MXFP8 on sm_100) vs its bf16
grouped GEMM and, where the installed torch has it, torch._scaled_grouped_mm (rowwise FP8 on sm_90), on MoE shapes
with device m_splits: forward, dgrad and wgrad into an fp32 main_grad (moe_graph: fused D = acc + C). TFLOP/s of
the GEMM alone (operands quantized once, outside the timing) and of quantize + GEMM. Prints a table, writes JSON
with the commit under ./moe_graph_results/ ($MOE_GRAPH_RESULTS). Needs a GPU of one of the two architectures.

    python benchmarks/bench_fp8_gemm.py [--quick] [--models deepseek,qwen3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cuda, write_json  # noqa: E402
from moe_graph.ops import fp8, grouped_gemm, grouped_gemm_wgrad  # noqa: E402
from moe_graph.testing.grouped_gemm_ref import random_splits  # noqa: E402

# (name, hidden, expert ffn, local experts, tokens routed to this rank)
MODELS = {
    "deepseek": ("DeepSeek-V3 EP8", 7168, 2048, 32, 32768),
    "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 32768),
    "mixtral": ("Mixtral-8x7B", 4096, 14336, 8, 16384),
}


def recipe_for_device():
    cc = torch.cuda.get_device_capability()
    if cc == (9, 0):
        return "blockwise", ("1x128", "128x128", "128x1", 128, 128, 128)
    if cc == (10, 0):
        return "mxfp8", ("1x32", "1x32", "32x1", 32, 1, 32)
    return None, None


def padded_splits(E, T, g, mult):
    """Routing counts rounded down to multiples of `mult` (FP8 wgrad needs 16-aligned expert starts)."""
    s = [m // mult * mult for m in random_splits(E, T, g)]
    s[0] += T - sum(s)
    return s


def run_case(model, op, g, reps, recipe, plan):
    name, H, F, E, T = MODELS[model]
    ta, tw, tc, bk, bn, bm = plan
    K, N = H, 2 * F  # fc1: [T, H] x [E, 2F, H]^T
    splits = padded_splits(E, T, g, 16)
    ms = torch.tensor(splits, device="cuda")
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * T * K * N
    res = {"model": name, "op": op, "recipe": recipe, "T": T, "E": E, "K": K, "N": N, "ms": {}, "tflops": {}}
    if op == "forward":
        qa, sa = fp8.quantize(x, ms, tiles=ta)
        qb, sb = fp8.quantize(w, tiles=tw)
        fns = {"fp8": lambda: fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=bk, block_n=bn),
               "fp8+quantize": lambda: fp8.scaled_grouped_gemm(*fp8.quantize(x, ms, tiles=ta), qb, sb, ms,
                                                               block_k=bk, block_n=bn),
               "bf16": lambda: grouped_gemm(x, w, ms, trans_b=True)}
        if hasattr(torch, "_scaled_grouped_mm") and recipe == "blockwise":
            offs = torch.cumsum(ms, 0).to(torch.int32)
            xa = x.to(torch.float8_e4m3fn)
            wb = w.to(torch.float8_e4m3fn).transpose(1, 2)
            s_a = torch.ones(T, device="cuda")
            s_b = torch.ones(E, N, device="cuda")
            fns["torch._scaled_grouped_mm (rowwise)"] = lambda: torch._scaled_grouped_mm(
                xa, wb, s_a, s_b, offs=offs, out_dtype=torch.bfloat16)
    elif op == "dgrad":  # dx [T, K] = dy [T, N] x w [E, N, K]: the forward form with w's transposed copy
        qd, sd = fp8.quantize(dy, ms, tiles=ta)
        _, _, qt, st = fp8.quantize_weight(w, fp8.as_recipe(recipe))
        fns = {"fp8": lambda: fp8.scaled_grouped_gemm(qd, sd, qt, st, ms, block_k=bk, block_n=bn),
               "bf16": lambda: grouped_gemm(dy, w, ms, trans_b=False)}
    else:  # wgrad into an fp32 main_grad
        qd, sd = fp8.quantize(dy, ms, tiles=tc, transpose=True)
        qx, sx = fp8.quantize(x, ms, tiles=tc, transpose=True)
        mg = torch.zeros(E, N, K, device="cuda")
        fns = {"fp8": lambda: fp8.scaled_grouped_wgrad(qd, sd, qx, sx, ms, block_m=bm, out=mg, accumulate=True),
               "bf16": lambda: grouped_gemm_wgrad(x, dy, ms, out=mg, accumulate=True)}
    for k, fn in fns.items():
        try:
            t = time_cuda(fn, warmup=3, reps=reps)
            res["ms"][k], res["tflops"][k] = t, flops / t / 1e9
        except Exception as e:  # noqa: BLE001 - report what does not run on this GPU / torch
            res["ms"][k], res["tflops"][k] = None, None
            res.setdefault("errors", {})[k] = str(e).splitlines()[0][:200]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="deepseek,qwen3,mixtral")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_gemm: needs a CUDA device; nothing measured")
        return 0
    recipe, plan = recipe_for_device()
    if recipe is None:
        print(f"bench_fp8_gemm: no FP8 kernel for compute capability {torch.cuda.get_device_capability()}; "
              "nothing measured")
        return 0
    g = torch.Generator().manual_seed(args.seed)
    reps = 5 if args.quick else 20
    rows = []
    print(f"{'model':<18}{'op':<9}" + "".join(f"{m:>24}" for m in ("fp8", "fp8+quantize", "bf16",
                                                                     "torch._scaled_grouped_mm")) + "  (TFLOP/s)")
    for mk in args.models.split(","):
        for op in ("forward", "dgrad", "wgrad"):
            if args.quick and op != "forward" and mk != "deepseek":
                continue
            r = run_case(mk, op, g, reps, recipe, plan)
            rows.append(r)
            cells = []
            for m in ("fp8", "fp8+quantize", "bf16", "torch._scaled_grouped_mm (rowwise)"):
                v = r["tflops"].get(m)
                cells.append(f"{v:24.1f}" if v else f"{'-':>24}")
            print(f"{r['model'][:17]:<18}{op:<9}" + "".join(cells))
            for k, e in r.get("errors", {}).items():
                print(f"    {k}: {e}")
    path = results_path("fp8_gemm")
    write_json(path, {"env": environment(), "recipe": recipe, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
