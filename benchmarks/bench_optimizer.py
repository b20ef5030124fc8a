"""Step time and memory of ``moe_graph.distributed.optimizer.DistributedOptimizer`` vs ``torch.optim.AdamW``.

Runs in one process (dp=1) on one device. For every size (parameters) and precision it times:

* ``distopt-tensor``: the portable device-tensor Adam step (capturable);
* ``distopt-fused``: the same step through ``torch._fused_adamw_`` (when the device has it);
* ``torch-adamw``: ``torch.optim.AdamW(fused=True)`` where supported, else ``foreach=True``, on
  plain parameters of the same total size and dtype (for 16-bit params torch keeps no fp32
  master copy, so the peer does strictly less work there).

The distributed optimizer's step includes everything a training step needs after backward:
grad-sync bookkeeping, fp32 grad copy (16-bit grads), global grad norm and inf check, clipping,
Adam, main -> model copy and the (dp=1: empty) all-gather. Effective bandwidth assumes the
minimal Adam traffic (read p, g, m, v; write p, m, v).

Bytes per parameter are measured from the allocated buffers and optimizer state at dp=1 and
extrapolated to larger DP sizes with the shard math (``state / d``); the seed table is
``4 + 16/d`` (16-bit params and grads), ``6 + 12/d`` (16-bit params, fp32 grads), ``8 + 8/d`` (fp32).

``--fp8-param-gather``: instead, the bytes each rank moves per step in the parameter all-gather of DeepSeek-V3-like
expert weights (``fc1 [L, 2 * 2048, 7168]``, ``fc2 [L, 7168, 2048]`` bf16, ``L`` local experts, expert buckets
of Megatron's 40M-element default or one bucket) in 16 bits against ``DistributedOptimizer(fp8_param_gather=...)``
("blockwise": FP8 bytes per rank shard padded to the largest shard, plus the tile-amax all-reduce), from the
buffer layout and the FP8 gather's own byte count (``distributed.fp8_params.gather_bytes``); no timing.

Usage::

    python benchmarks/bench_optimizer.py                 # CPU default: up to 10M params (< 1 min)
    python benchmarks/bench_optimizer.py --max-params 1e9 --device cuda
    python benchmarks/bench_optimizer.py --fp8-param-gather --out benchmarks/results/fp8_param_gather.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path  # noqa: E402
from moe_graph.distributed.ddp import DistributedDataParallel  # noqa: E402
from moe_graph.distributed.buffers import compute_param_layout  # noqa: E402
from moe_graph.distributed.fp8_params import gather_bytes  # noqa: E402
from moe_graph.distributed.optimizer import DistributedOptimizer  # noqa: E402

SIZES = [1_000_000, 10_000_000, 100_000_000, 1_000_000_000]
PRECISIONS = {  # name: (param dtype, grad_reduce_in_fp32)
    "fp32": (torch.float32, True),
    "bf16+fp32grad": (torch.bfloat16, True),
    "bf16": (torch.bfloat16, False),
}
SEED_TABLE = {"fp32": (8, 8), "bf16+fp32grad": (6, 12), "bf16": (4, 16)}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(numel, dtype, device, n_tensors=8):
    chunk = numel // n_tensors
    sizes = [chunk] * (n_tensors - 1) + [numel - chunk * (n_tensors - 1)]
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in sizes])
    return m


def _time(fn, device, iters, warmup=2):
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def bench_distopt(numel, dtype, grad_fp32, device, impl, iters):
    model = _model(numel, dtype, device)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=grad_fp32)
    opt = DistributedOptimizer(ddp, lr=1e-4, weight_decay=0.01, clip_grad=1.0, impl=impl)
    for b in ddp.all_buffers:
        b.grad_data.normal_(0, 1e-3)
    saved = [b.grad_data.clone() for b in ddp.all_buffers]

    def step():
        for b, g in zip(ddp.all_buffers, saved):  # keep the grads (step scales them in place)
            b.grad_data.copy_(g)
        for grp in ddp.all_bucket_groups:
            grp.grad_reduce_dispatched = False
        opt.step()

    t_copy = _time(lambda: [b.grad_data.copy_(g) for b, g in zip(ddp.all_buffers, saved)], device, iters)
    t = max(_time(step, device, iters) - t_copy, 1e-9)
    buf_bytes = sum(b.nbytes() for b in ddp.all_buffers)
    state_bytes = opt.state_nbytes()
    return t, buf_bytes / numel, state_bytes / numel, opt.impl


def bench_torch(numel, dtype, device, iters):
    model = _model(numel, dtype, device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kw = {}
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        opt.step()
        kw = {"fused": True}
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
        kw = {"foreach": True}

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return _time(step, device, iters), "fused" if kw.get("fused") else "foreach"


def fp8_param_gather_rows(local_experts=(8, 32), dps=(2, 8, 64), hidden=7168, ffn=2048, bucket_size=40_000_000):
    """All-gather bytes per rank and step, 16-bit vs FP8 (see the module doc), from the optimizer's layout."""
    rows = []
    for L in local_experts:
        shapes = [(L, 2 * ffn, hidden), (L, hidden, ffn)]  # module order: fc1, fc2
        numels = [a * b * c for a, b, c in shapes]
        for dp in dps:
            for bs in (None, bucket_size):
                ranges, buckets, _ = compute_param_layout(numels, dp, bucket_size=bs, use_distributed_optimizer=True)
                b16 = fp8 = amax = 0
                for bi, (b0, b1) in enumerate(buckets):
                    spans = [(s - b0, e - b0) for (s, e, b), shp in zip(ranges, shapes) if b == bi]
                    b16 += (b1 - b0) * 2
                    fp8 += gather_bytes(b1 - b0, spans, dp, 2) * dp
                    amax += sum(4 * sh[0] * -(-sh[1] // 128) * -(-sh[2] // 128)
                                for (s, e, b), sh in zip(ranges, shapes) if b == bi)
                rows.append(dict(local_experts=L, params=sum(numels), dp=dp, bucket_size=bs, buckets=len(buckets),
                                 bf16_all_gather_bytes=b16, fp8_all_gather_bytes=fp8, amax_all_reduce_bytes=amax,
                                 ratio=(fp8 + amax) / b16))
                print(f"L={L:>3} params={sum(numels):>13,} dp={dp:>3} buckets={len(buckets):>3} bf16 {b16:>14,} B  "
                      f"fp8 {fp8:>14,} B + amax {amax:>9,} B  ratio {(fp8 + amax) / b16:.4f}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-params", type=float, default=None,
                    help="largest size to run (default: 1e9 on CUDA, 1e7 on CPU)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per case (default 20 CUDA / 3 CPU)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of " + ",".join(PRECISIONS))
    ap.add_argument("--dp", default="1,8,64", help="DP sizes for the bytes-per-param shard math")
    ap.add_argument("--out", default=None, help="JSON path (default: results_path(), outside the tracked tree)")
    ap.add_argument("--fp8-param-gather", action="store_true",
                    help="only the FP8 parameter all-gather bytes of DeepSeek-V3-like expert weights (no timing)")
    args = ap.parse_args(argv)
    if args.fp8_param_gather:
        rows = fp8_param_gather_rows()
        out = args.out or results_path("fp8_param_gather", dated=False)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": dict(commit=environment()["commit"], recipe="blockwise", dtype="bfloat16"),
                       "rows": rows}, f, indent=1)
        print(f"# wrote {out}")
        return
    device = torch.device(args.device)
    max_params = args.max_params if args.max_params is not None else (1e9 if device.type == "cuda" else 1e7)
    iters = args.iters or (20 if device.type == "cuda" else 3)
    dps = [int(d) for d in args.dp.split(",")]
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))

    rows = []
    hdr = (f"{'params':>13} {'precision':>14} {'impl':>15} {'ms/step':>10} {'GB/s':>8} {'vs torch':>9} "
           f"{'B/param (dp=1 meas.)':>21} " + " ".join(f"{'dp=' + str(d):>8}" for d in dps) + f" {'seed':>10}")
    print(f"# device={device} torch={torch.__version__} iters={iters}")
    print(hdr)
    for numel in [s for s in SIZES if s <= max_params]:
        for pname in args.precisions.split(","):
            dtype, grad_fp32 = PRECISIONS[pname]
            elt = torch.tensor([], dtype=dtype).element_size()
            traffic = numel * (2 * elt + (4 if grad_fp32 else elt) + 4 * 4 + (8 if dtype != torch.float32 else 0))
            t_ref, ref_impl = bench_torch(numel, dtype, device, iters)
            rows.append(dict(params=numel, precision=pname, impl=f"torch-adamw-{ref_impl}", ms=t_ref * 1e3))
            print(f"{numel:>13,} {pname:>14} {'torch-' + ref_impl:>15} {t_ref * 1e3:>10.3f} "
                  f"{traffic / t_ref / 1e9:>8.1f} {1.0:>9.2f}")
            for impl in ("tensor", "fused"):
                if impl == "fused" and not hasattr(torch, "_fused_adamw_"):
                    continue
                t, buf_bpp, state_bpp, used = bench_distopt(numel, dtype, grad_fp32, device, impl, iters)
                per_dp = [buf_bpp + state_bpp / d for d in dps]
                a, b = SEED_TABLE[pname]
                rows.append(dict(params=numel, precision=pname, impl=f"distopt-{used}", ms=t * 1e3,
                                 ratio_vs_torch=t_ref / t, buffer_bytes_per_param=buf_bpp,
                                 state_bytes_per_param_dp1=state_bpp,
                                 bytes_per_param={str(d): v for d, v in zip(dps, per_dp)},
                                 seed_formula=f"{a} + {b}/d", shard_numel={str(d): numel // d for d in dps}))
                print(f"{numel:>13,} {pname:>14} {'distopt-' + used:>15} {t * 1e3:>10.3f} "
                      f"{traffic / t / 1e9:>8.1f} {t_ref / t:>9.2f} {buf_bpp + state_bpp:>21.3f} "
                      + " ".join(f"{v:>8.3f}" for v in per_dp) + f" {f'{a}+{b}/d':>10}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out = args.out or results_path(f"bench_optimizer_{device.type}", dated=False)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = dict(device=str(device), torch=torch.__version__, python=platform.python_version(), iters=iters,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                commit=environment()["commit"])
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
