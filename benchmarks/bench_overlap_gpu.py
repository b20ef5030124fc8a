"""Measured overlap of a training step on one GPU: step time and stream concurrency of the schedules serial,
``overlap_shared_expert`` (the shared expert and the router losses on a side stream beside dispatch / experts /
combine), ``overlap_microbatches`` (two microbatches in flight on two microbatch streams), both, and both with
``interleave_stages`` (the forward issued from a worker thread into the capture: at EP 1 there is no exchange to
alternate at, so this checks the thread and the capture, not the alternation), each trained as
users do: :func:`moe_graph.train.step.make_train_step` over a ``DistributedDataParallel`` model with a
``DistributedOptimizer``, the whole step captured in one :class:`moe_graph.cuda_graph.FullIterationGraph`.
(``bench_overlap.py`` is the model of the same question at EP 8; this is the measurement at EP 1.)

The block (DeepSeek-V3-like, scaled to one GPU for a quick run): an attention stand-in (one ``H x H`` projection
with a residual), then a residual MoE layer (sigmoid router, 8 groups, 4 groups kept, top-8 of 32 experts, scaling
factor 2.5, expert bias, aux loss 1e-4, one shared expert, SwiGLU, dropless), bf16, 2 microbatches of 8192 tokens,
loss = mean square of the block output minus a target.

On CUDA, per schedule: two eager warm-up steps, the capture, then the median of ``--reps`` steps (CUDA events around
``graph(microbatches)``: the input copy into the static buffers and the replay), and one ``torch.profiler`` trace of
``--trace-steps`` steps. From the trace's kernel intervals, per step: each stream's busy time, the GPU's busy time
(the union over streams), the time where >= 2 streams have a kernel running (the concurrency achieved), and for the
exchange kernels (names matching :data:`EXCHANGE_KERNELS`) their busy time and their *exposed* time: the parts of
their intervals not covered by a kernel of another stream. **At EP 1 there is no inter-GPU exchange**: dispatch and
combine are local row moves (the native ``expand_rows`` / ``reduce_rows`` / ``route_dot`` and the dispatch layout),
and those are what the exchange columns measure; the exposed inter-GPU exchange needs EP > 1 (several GPUs). Also per
schedule: the bytes allocated over the timed and traced replays (the side streams' ``record_stream`` must not grow
the allocator), and each step's loss against the serial schedule's (the same arithmetic in the same order).

On CPU (no GPU): the same code with a tiny shape and eager steps (no graph, no timing, no kernels in the trace; the
profiler still runs and its trace is parsed), for the tests: each schedule's losses per step.

    PYTHONPATH=python python3 benchmarks/bench_overlap_gpu.py [--steps 4 --reps 20 --trace-steps 3 --out X.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from typing import Dict, List, Sequence, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cuda, write_json  # noqa: E402
from moe_graph.cuda_graph import FullIterationGraph  # noqa: E402
from moe_graph.distributed.ddp import DistributedDataParallel  # noqa: E402
from moe_graph.distributed.optimizer import DistributedOptimizer  # noqa: E402
from moe_graph.moe.layer import MoELayer  # noqa: E402
from moe_graph.ops import dispatch_layout as _layout_ops, permute as _permute_ops  # noqa: E402
from moe_graph.train.step import make_train_step  # noqa: E402

# name, (overlap_shared_expert, overlap_microbatches, interleave_stages)
SCHEDULES = {"serial": (False, False, False), "overlap_shared_expert": (True, False, False),
             "overlap_microbatches": (False, True, False), "both": (True, True, False),
             "both+interleave_stages": (True, True, True)}
GPU_SHAPE = dict(H=2048, F=512, E=32, K=8, groups=8, group_topk=4, Fs=2048, T=8192, microbatches=2, dtype="bfloat16")
CPU_SHAPE = dict(H=32, F=16, E=8, K=2, groups=4, group_topk=2, Fs=32, T=64, microbatches=2, dtype="float32")
# kernel name pieces of the exchange stages (dispatch and combine, forward and backward); at EP 1 only the first two
# occur (local row moves and the layout), the last two are the inter-GPU kernels at EP > 1
EXCHANGE_KERNELS = ("moe_graph::permute::", "moe_graph::dispatch::", "moe_graph::exchange::", "nccl")
ASSUMPTIONS = ("EP 1 (one GPU): dispatch and combine are local row moves, no inter-GPU exchange; the exchange "
               "columns are the kernels whose names contain one of EXCHANGE_KERNELS (at EP 1: the native "
               "expand_rows / reduce_rows / route_dot of dispatch, combine and their backward, and the dispatch "
               "layout); exposed = their intervals not covered by a kernel of another stream; step time = median of "
               "CUDA-event-timed graph(microbatches) calls (input copy + replay); per-step trace figures = trace "
               "totals / traced steps; kernels only (memcpy / memset reported apart)")


class Block(torch.nn.Module):
    """``forward(x, target) -> loss``: an attention stand-in (one projection, residual), a residual MoE layer, the
    mean square of the output minus ``target`` (fp32)."""

    def __init__(self, s: Dict, overlap_shared_expert: bool, device, dtype):
        super().__init__()
        torch.manual_seed(0)  # the same weights in every schedule
        self.attn = torch.nn.Linear(s["H"], s["H"], bias=False, device=device, dtype=dtype)
        self.moe = MoELayer(s["H"], s["F"], s["E"], s["K"], score_func="sigmoid", num_groups=s["groups"],
                            group_topk=s["group_topk"], topk_scaling_factor=2.5, enable_expert_bias=True,
                            aux_loss_coeff=1e-4, shared_expert_ffn_size=s["Fs"], capacity_factor=None,
                            overlap_shared_expert=overlap_shared_expert, params_dtype=dtype, device=device)

    def forward(self, x, target):
        h = x + self.attn(x)
        y = h + self.moe(h)
        return (y.float() - target.float()).square().mean()


def microbatches(s: Dict, device, dtype) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(1)
    return [tuple(torch.randn(s["T"], s["H"], generator=g).to(device=device, dtype=dtype) for _ in range(2))
            for _ in range(s["microbatches"])]


# ------------------------------------------------------------------------------------- trace analysis --
def merge(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of ``[start, end)`` intervals as sorted disjoint intervals."""
    out: List[List[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Sequence[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in merge(intervals))


def minus(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> float:
    """The length of ``union(a)`` not covered by ``union(b)``."""
    a, b = merge(a), merge(b)
    covered, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return length(a) - covered


def at_least_two(per_stream: Dict[object, Sequence[Tuple[float, float]]]) -> float:
    """The time where >= 2 streams have a kernel running (a sweep over each stream's union)."""
    points = []
    for iv in per_stream.values():
        for a, b in merge(iv):
            points += [(a, 1), (b, -1)]
    points.sort()
    total, busy, last = 0.0, 0, None
    for t, d in points:
        if busy >= 2:
            total += t - last
        busy, last = busy + d, t
    return total


def read_trace(path: str) -> Dict[str, List[Dict]]:
    """Kineto's Chrome trace -> ``{"kernel": [...], "gpu_memcpy": [...], "gpu_memset": [...]}``, each event
    ``{"name", "stream", "start", "end"}`` (microseconds)."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    out: Dict[str, List[Dict]] = {"kernel": [], "gpu_memcpy": [], "gpu_memset": []}
    for e in events:
        cat = e.get("cat")
        if cat in out and e.get("ph") == "X" and "dur" in e:
            stream = (e.get("args") or {}).get("stream", e.get("tid"))
            start = float(e["ts"])
            out[cat].append({"name": e.get("name", ""), "stream": stream, "start": start,
                             "end": start + float(e["dur"])})
    return out


def analyse(trace: Dict[str, List[Dict]], steps: int, patterns: Sequence[str] = EXCHANGE_KERNELS) -> Dict:
    """Per-step figures (microseconds) of a trace of ``steps`` steps (see the module docstring)."""
    kernels = trace["kernel"]
    per_stream: Dict[object, List[Tuple[float, float]]] = {}
    for k in kernels:
        per_stream.setdefault(k["stream"], []).append((k["start"], k["end"]))
    exch = [k for k in kernels if any(p in k["name"] for p in patterns)]
    exposed = 0.0
    for s in {k["stream"] for k in exch}:  # the exchange kernels of stream s not covered by another stream's kernels
        others = [iv for t, ivs in per_stream.items() if t != s for iv in ivs]
        exposed += minus([(k["start"], k["end"]) for k in exch if k["stream"] == s], others)
    exch_busy = length([(k["start"], k["end"]) for k in exch])
    all_iv = [iv for ivs in per_stream.values() for iv in ivs]
    span = (max(b for _, b in all_iv) - min(a for a, _ in all_iv)) if all_iv else 0.0
    names: Dict[str, int] = {}
    for k in exch:
        names[k["name"][:160]] = names.get(k["name"][:160], 0) + 1
    n = float(steps)
    return {
        "kernels_per_step": len(kernels) / n,
        "streams": {str(s): {"kernels_per_step": len(iv) / n, "busy_us": length(iv) / n}
                    for s, iv in sorted(per_stream.items(), key=lambda kv: -len(kv[1]))},
        "span_us": span / n,
        "gpu_busy_us": length(all_iv) / n,
        "concurrent_us": at_least_two(per_stream) / n,
        "exchange_kernels_per_step": len(exch) / n,
        "exchange_busy_us": exch_busy / n,
        "exchange_exposed_us": exposed / n,
        "exchange_hidden_pct": (100.0 * (1.0 - exposed / exch_busy)) if exch_busy else None,
        "exchange_kernel_names": names,
        "memcpy_us": sum(e["end"] - e["start"] for e in trace["gpu_memcpy"]) / n,
        "memset_us": sum(e["end"] - e["start"] for e in trace["gpu_memset"]) / n,
    }


# ------------------------------------------------------------------------------------------- the run --
def run_schedule(name: str, s: Dict, device: torch.device, steps: int, reps: int, trace_steps: int,
                 trace_path: str) -> Dict:
    """One schedule: its losses per step, and on CUDA the step time and the trace's figures."""
    shared, mbs_overlap, interleave = SCHEDULES[name]
    dtype = getattr(torch, s["dtype"])
    cuda = device.type == "cuda"
    model = DistributedDataParallel(Block(s, shared, device, dtype), use_distributed_optimizer=True)
    opt = DistributedOptimizer(model, lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # on CPU: "CUDA graphs need CUDA; running eagerly"
        step = FullIterationGraph(make_train_step(model, opt, overlap_microbatches=mbs_overlap,
                                                  interleave_stages=interleave), warmup_steps=2,
                                  enabled=cuda)
    data = microbatches(s, device, dtype)
    t0 = time.perf_counter()
    losses = [step(data).loss.detach().clone() for _ in range(steps)]  # warm-up, capture, replays (CUDA)
    losses = torch.stack(losses).double().cpu().tolist()
    r = {"schedule": name, "overlap_shared_expert": shared, "overlap_microbatches": mbs_overlap,
         "interleave_stages": interleave,
         "captured": step.captured(), "losses": losses, "first_steps_s": time.perf_counter() - t0,
         "step_ms": None, "allocated_growth_bytes": None, "trace": None}
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        r["step_ms"] = time_cuda(lambda: step(data), warmup=3, reps=reps)
    # one profiler trace (on CPU: no kernels; the same export and parsing run)
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(trace_steps):
            step(data)
        if cuda:
            torch.cuda.synchronize()
    if cuda:  # replays allocate nothing (the graph's pool; record_stream delays reuse inside it only)
        r["allocated_growth_bytes"] = torch.cuda.memory_allocated(device) - before
    prof.export_chrome_trace(trace_path)
    r["trace_file"] = os.path.basename(trace_path)
    r["trace"] = analyse(read_trace(trace_path), trace_steps)
    if not cuda:
        os.remove(trace_path)  # the CPU trace is op-level only: nothing to keep
        r["trace_file"] = None
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=4, help="steps whose losses are compared (CUDA: 2 warm-up, capture)")
    ap.add_argument("--reps", type=int, default=20, help="timed steps (CUDA)")
    ap.add_argument("--trace-steps", type=int, default=3, help="steps in the profiler trace")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--out", default=None, help="JSON path (default: results_dir()/bench_overlap_gpu-<gpu>-<date>"
                                                ".json); the traces go beside it")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.trace_steps < 1:
        ap.error("--steps, --reps and --trace-steps must be >= 1")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    cuda = device.type == "cuda"
    if cuda and args.steps < 3:
        ap.error("--steps must be >= 3 on CUDA (2 warm-up steps and the capture)")
    s = GPU_SHAPE if cuda else CPU_SHAPE
    out = args.out or results_path("bench_overlap_gpu")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    native = {"permute": _permute_ops.native_available(device.type),
              "dispatch_layout": _layout_ops.native_available(device.type)}
    print(f"bench_overlap_gpu on {device}: " + ", ".join(f"{k} {v}" for k, v in s.items()) +
          f"; native row-move kernels: {native}")
    print("EP 1: there is no inter-GPU exchange here; the exchange columns are the local row moves of dispatch and "
          "combine (kernels named " + " / ".join(EXCHANGE_KERNELS) + ")" +
          ("" if cuda else "; CPU: eager steps, no graph, no timing, no kernels"))
    rows, failed, start = [], [], time.perf_counter()
    for name in args.schedules:
        trace_path = os.path.splitext(out)[0] + f"-trace-{name}.json"
        try:
            r = run_schedule(name, s, device, args.steps, args.reps, args.trace_steps, trace_path)
            rows.append(r)
            print(f"  {name}: {args.steps} steps ({'captured' if r['captured'] else 'eager'}) in "
                  f"{r['first_steps_s']:.1f} s; {time.perf_counter() - start:.1f} s so far", flush=True)
        except Exception as e:  # reported, not hidden: the other schedules still run
            traceback.print_exc()
            rows.append({"schedule": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            failed.append(name)
        if cuda:
            torch.cuda.empty_cache()
    serial = next((r for r in rows if r["schedule"] == "serial" and "losses" in r), None)
    for r in rows:
        if serial is not None and "losses" in r:
            r["loss_max_rel_diff_vs_serial"] = max(abs(a - b) / max(abs(b), 1e-30)
                                                   for a, b in zip(r["losses"], serial["losses"]))

    def f(v, w=9, p=3):
        return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

    print(f"{'schedule':<22} {'graph':>5} {'step ms':>9} {'busy ms':>9} {'>=2 str ms':>10} {'streams':>7} "
          f"{'exch ms':>9} {'exposed ms':>10} {'hidden %':>8} {'alloc +MB':>9} {'loss rel diff':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:<22} FAILED: {r['error'].splitlines()[0][:200]}")
            continue
        t = r["trace"]
        ms = (lambda k: t[k] / 1e3) if cuda else (lambda k: None)
        print(f"{r['schedule']:<22} {str(r['captured']):>5} {f(r['step_ms'])} {f(ms('gpu_busy_us'))} "
              f"{f(ms('concurrent_us'), 10)} {len(t['streams']):>7} {f(ms('exchange_busy_us'))} "
              f"{f(ms('exchange_exposed_us'), 10)} {f(t['exchange_hidden_pct'], 8, 1)} "
              f"{f(r['allocated_growth_bytes'] / 2**20 if cuda else None, 9, 1)} "
              f"{r.get('loss_max_rel_diff_vs_serial', float('nan')):13.2e}")
    write_json(out, {"env": environment(), "device": str(device), "shape": s, "ep": 1,
                     "native_kernels": native, "exchange_kernel_patterns": list(EXCHANGE_KERNELS),
                     "assumptions": ASSUMPTIONS, "steps": args.steps, "reps": args.reps,
                     "trace_steps": args.trace_steps, "rows": rows,
                     "note": "measured" if cuda else "CPU: eager steps, no timing claims (the code path only)"})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
