"""Grouped GEMM benchmark: moe_graph vs torch._grouped_mm vs a per-expert cuBLAS loop (TE's default path, with a
``.tolist()`` sync) vs dense torch.matmul of equal FLOPs, on real MoE shapes, balanced and Zipf-skewed routing.

Ops: forward (fc1 and fc2 shapes), forward with bias (fused in moe_graph's epilogue; peers add it after), dgrad,
wgrad with fp32 accumulation into a main_grad (peers: their wgrad followed by a separate add) and wgrad overwriting
the fp32 main_grad (peers: followed by a copy). Each row records the kernel configuration the launch plan chose. Prints one line per case and writes JSON (+ a PNG plot of TFLOP/s) under
./moe_graph_results/ ($MOE_GRAPH_RESULTS). Needs a GPU.

    python benchmarks/bench_grouped_gemm.py [--quick] [--models qwen3,deepseek,mixtral] [--no-plot]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cuda, write_json  # noqa: E402
from moe_graph.ops import grouped_gemm, grouped_gemm_wgrad  # noqa: E402
from moe_graph.testing.grouped_gemm_ref import random_splits  # noqa: E402

# (name, hidden, expert ffn, local experts, tokens routed to this rank)
MODELS = {
    "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 32768),  # 4096 tokens x top-8, all 128 experts local
    "deepseek": ("DeepSeek-V3 EP8", 7168, 2048, 32, 32768),  # 256 experts over EP=8, 4096 tokens x top-8
    "mixtral": ("Mixtral-8x7B", 4096, 14336, 8, 16384),  # 8192 tokens x top-2
    # fine-grained experts, 32 rows each on average: SM90 ping-pong 64-row tiles (SM100 keeps 128-row tiles: a hot
    # expert may have far more rows than the average)
    "finegrained": ("fine-grained E256", 2048, 512, 256, 8192),
}


def peers_forward(a, w, splits_dev, offs, splits_list_fn, trans_b=True):
    """Callables computing a_e @ w_e^T (trans_b, forward) or a_e @ w_e (dgrad: a = dy) for each method
    (w: [E, N, K], the nn.Linear layout of the weights in both cases)."""
    out = {}
    out["moe_graph"] = lambda: grouped_gemm(a, w, splits_dev, trans_b=trans_b)
    # torch._grouped_mm wants mat_b as [E, K', N']: the transposed view for forward, w itself for dgrad
    wb = w.transpose(1, 2) if trans_b else w
    if hasattr(torch, "_grouped_mm"):
        out["torch._grouped_mm"] = lambda: torch._grouped_mm(a, wb, offs=offs)

    def loop():
        sizes = splits_list_fn()  # .tolist(): the host sync of TE's default path
        y = torch.empty(a.shape[0], wb.shape[2], dtype=a.dtype, device=a.device)
        start = 0
        for e, m in enumerate(sizes):
            if m:
                torch.mm(a[start : start + m], wb[e], out=y[start : start + m])
            start += m
        return y

    out["cublas_loop"] = loop
    return out


def peers_wgrad(a, dy, splits_dev, offs, splits_list_fn, main_grad, accumulate=True):
    """accumulate: main_grad += dW (peers: their wgrad, then an add); else main_grad = dW (moe_graph: the
    no-source fp32 kernel; peers: their wgrad, then a copy)."""
    out = {}
    out["moe_graph"] = lambda: grouped_gemm_wgrad(a, dy, splits_dev, out=main_grad, accumulate=accumulate)
    if hasattr(torch, "_grouped_mm"):
        dyt = dy.t()

        def gm():
            dw = torch._grouped_mm(dyt, a, offs=offs)
            main_grad.add_(dw) if accumulate else main_grad.copy_(dw)

        out["torch._grouped_mm"] = gm

    def loop():
        sizes = splits_list_fn()
        start = 0
        for e, m in enumerate(sizes):
            if m:
                dw = torch.mm(dy[start : start + m].t(), a[start : start + m])
                main_grad[e].add_(dw) if accumulate else main_grad[e].copy_(dw)  # fp32 (+)= bf16
            start += m

    out["cublas_loop"] = loop
    return out


def run_case(model_key, gemm, op, skew, g, reps):
    name, hidden, ffn, E, T = MODELS[model_key]
    # fc1: hidden -> 2*ffn (gate+up); fc2: ffn -> hidden
    K, N = (hidden, 2 * ffn) if gemm == "fc1" else (ffn, hidden)
    dev, dt = "cuda", torch.bfloat16
    splits = random_splits(E, T, g, zipf=1.2 if skew == "zipf" else 0.0)
    splits_dev = torch.tensor(splits, device=dev, dtype=torch.int64)
    offs = torch.cumsum(splits_dev, 0).to(torch.int32)
    a = torch.randn(T, K, device=dev, dtype=dt)
    w = torch.randn(E, N, K, device=dev, dtype=dt) / K**0.5
    flops = 2.0 * T * N * K
    lst = lambda: splits_dev.tolist()  # noqa: E731
    if op == "forward":
        fns = peers_forward(a, w, splits_dev, offs, lst)
    elif op == "fwd_bias":  # bias fused in the epilogue (peers: their GEMM, then a per-row bias gather + add)
        bias = torch.randn(E, N, device=dev, dtype=dt)
        rows_bias = torch.repeat_interleave(bias, splits_dev, dim=0, output_size=T)
        fns = {k: (lambda f=f: f().add_(rows_bias)) for k, f in peers_forward(a, w, splits_dev, offs, lst).items()}
        fns["moe_graph"] = lambda: grouped_gemm(a, w, splits_dev, bias=bias)
    elif op == "dgrad":  # dx = dy @ W_e (dy: [T, N]): the backward's call, B = the [E, N, K] weights as stored
        dy = torch.randn(T, N, device=dev, dtype=dt)
        fns = peers_forward(dy, w, splits_dev, offs, lst, trans_b=False)
    else:  # wgrad (accumulate into fp32 main_grad) or wgrad_ow (overwrite it)
        dy = torch.randn(T, N, device=dev, dtype=dt)
        main_grad = torch.zeros(E, N, K, device=dev, dtype=torch.float32)
        fns = peers_wgrad(a, dy, splits_dev, offs, lst, main_grad, accumulate=(op == "wgrad"))
    res = {}
    for k, fn in fns.items():
        try:
            res[k] = time_cuda(fn, reps=reps)
        except Exception as e:  # noqa: BLE001 - a peer may not support a layout; recorded
            res[k] = None
            print(f"    {k}: failed ({type(e).__name__}: {str(e)[:80]})")
    # dense matmul of equal FLOPs
    ad = torch.randn(T, K, device=dev, dtype=dt)
    wd_ = torch.randn(K, N, device=dev, dtype=dt)
    res["dense_matmul"] = time_cuda(lambda: torch.matmul(ad, wd_), reps=reps)
    row = dict(model=name, gemm=gemm, op=op, skew=skew, E=E, T=T, N=N, K=K, flops=flops, ms=res,
               config=kernel_config(op, T, E, N, K))
    row["tflops"] = {k: (flops / (v * 1e-3) / 1e12 if v else None) for k, v in res.items()}
    row["speedup_vs"] = {k: (v / res["moe_graph"] if v and res.get("moe_graph") else None) for k, v in res.items() if k != "moe_graph"}
    return row


def kernel_config(op, T, E, N, K):
    """The configuration the launch plan picks on this GPU (grouped_plan.cpp), recorded with each row."""
    from moe_graph.ops._lib import ops

    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    try:
        if op.startswith("wgrad"):
            cfg = ops._grouped_plan_wgrad(arch, T, E, N, K, 2, op == "wgrad", False, False, 0)[0]
        else:
            cfg = ops._grouped_plan_forward(arch, T, E, N, K, op == "fwd_bias", False, 0)[0]
        return ops._grouped_config_name(cfg)
    except RuntimeError as e:  # e.g. an architecture without kernels
        return f"n/a ({str(e)[:40]})"


def argument_kernel_time(E=1024, reps=50):
    """(device time of the argument kernel alone in us, from the profiler; whole-call time in ms) for E experts."""
    splits = torch.full((E,), 1, device="cuda", dtype=torch.int64)
    a = torch.randn(E, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 64, 64, device="cuda", dtype=torch.bfloat16)
    call_ms = time_cuda(lambda: grouped_gemm(a, w, splits), reps=reps)
    kernel_us = None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                grouped_gemm(a, w, splits)
            torch.cuda.synchronize()
        times = [ev.device_time for ev in prof.events() if "args_kernel" in ev.name]
        kernel_us = sum(times) / len(times) if times else None
    except Exception as e:  # noqa: BLE001 - profiler unavailable: only the whole-call time
        print(f"  profiler failed: {type(e).__name__}: {e}")
    return kernel_us, call_ms


def plot(rows, path, device_name=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    labels = [f"{r['model'][:10]} {r['gemm']} {r['op'][:3]} {r['skew'][:3]}" for r in rows]
    methods = ["moe_graph", "torch._grouped_mm", "cublas_loop", "dense_matmul"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 5))
    width = 0.2
    for i, m in enumerate(methods):
        vals = [r["tflops"].get(m) or 0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=m)
    ax.set_xticks([x + 1.5 * width for x in range(len(rows))])
    ax.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    ax.set_title(f"grouped GEMM, {device_name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    ap.add_argument("--models", default="qwen3,deepseek,mixtral,finegrained")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_grouped_gemm: needs a CUDA device; nothing measured")
        return 0
    g = torch.Generator().manual_seed(args.seed)
    reps = 5 if args.quick else 20
    rows = []
    header = f"{'model':<16}{'gemm':<5}{'op':<8}{'skew':<6}{'moe_graph ms':>13}{'TFLOP/s':>9}  vs _grouped_mm  vs loop  vs dense  config"
    print(header)
    for mk in args.models.split(","):
        for gemm in ("fc1", "fc2"):
            for op in ("forward", "fwd_bias", "dgrad", "wgrad", "wgrad_ow"):
                for skew in ("balanced", "zipf"):
                    if args.quick and (gemm == "fc2" or skew == "balanced") and op != "forward":
                        continue
                    if op in ("fwd_bias", "wgrad_ow") and (gemm == "fc2" or skew == "zipf"):
                        continue  # one shape per model for the fused-bias and overwrite paths
                    r = run_case(mk, gemm, op, skew, g, reps)
                    rows.append(r)
                    sp = r["speedup_vs"]
                    fmt = lambda x: f"{x:6.2f}x" if x else "   n/a"  # noqa: E731
                    ms = r["ms"]["moe_graph"]
                    print(f"{r['model'][:15]:<16}{gemm:<5}{op:<8}{skew:<6}{(ms or float('nan')):13.3f}"
                          f"{(r['tflops']['moe_graph'] or 0):9.1f}  {fmt(sp.get('torch._grouped_mm')):>14}  {fmt(sp.get('cublas_loop')):>7}  {fmt(sp.get('dense_matmul')):>7}  {r['config']}")
    kernel_us, call_ms = argument_kernel_time()
    ktxt = f"{kernel_us:.1f} us" if kernel_us is not None else "n/a"
    print(f"argument kernel, 1024 experts: {ktxt} device time (target < 5 us); whole grouped_gemm call with "
          f"1024 experts of 1 row: {call_ms * 1e3:.1f} us")
    path = results_path("grouped_gemm")
    write_json(path, {"env": environment(), "rows": rows, "argument_kernel_1024_experts_us": kernel_us,
                      "argument_call_1024_experts_us": call_ms * 1e3})
    if not args.no_plot:
        plot(rows, path.replace(".json", ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
