"""Pipeline bubble: measured step time of the moe_graph.train.schedules schedules vs the ideal bubble fraction.

Each pipeline rank is a CPU process (gloo). Stage compute is a ``time.sleep``: a forward of one
microbatch through one model chunk sleeps ``t_fwd / vpp`` (a chunk holds 1/vpp of the stage's
layers), a backward ``t_bwd / vpp``. Without bubbles a step would take
``ideal = m * (t_fwd + t_bwd)``; the schedule's bubble adds ``(pp - 1) * (t_fwd + t_bwd) / vpp``, so

    measured bubble = step_time / ideal - 1     vs     ideal bubble = (pp - 1) / (m * vpp)

Run: ``PYTHONPATH=python python3 benchmarks/bench_pipeline_bubble.py [--quick]``. Prints one line per
configuration and writes ``pipeline_bubble.json`` (``--out``; default ``./moe_graph_results/``). ``zero_ms`` is the same schedule
with no compute: the fixed cost of the p2p exchanges and Python per step, which the sleeps do not
hide and which grows with the number of steps (``2 * m * vpp`` per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from common import environment, results_path  # noqa: E402
from moe_graph import parallel_state as ps  # noqa: E402
from moe_graph.distributed.launch import run_distributed  # noqa: E402
from moe_graph.train import p2p  # noqa: E402
from moe_graph.train import schedules

SHAPE = (4, 16)  # activation passed between stages (tiny: the benchmark measures scheduling, not bandwidth)


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, t_fwd, t_bwd):
        time.sleep(t_fwd)
        ctx.t_bwd = t_bwd
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_bwd)
        return grad, grad.sum().reshape(1), None, None


class SleepChunk(torch.nn.Module):
    def __init__(self, t_fwd, t_bwd):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.t_fwd, self.t_bwd = t_fwd, t_bwd
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = self.input_tensor if self.input_tensor is not None else x
        return _SleepFn.apply(h, self.w, self.t_fwd, self.t_bwd)


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)
    return out, (lambda o: o.float().pow(2).mean())


def _worker(rank, world_size, configs, t_fwd, t_bwd, repeats):
    torch.manual_seed(0)
    out = []
    ps.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    comm = p2p.P2PCommunicator(ps.get_pipeline_model_parallel_group(), device="cpu")
    group = ps.get_pipeline_model_parallel_group()
    for pp, vpp, m in configs:
        assert pp == world_size
        nc = vpp or 1
        fn = schedules.get_forward_backward_func(pp, vpp)
        cfg = schedules.PipelineConfig(tensor_shape=SHAPE)
        res = {}
        # "zero": the same schedule with no compute (p2p + Python overhead only)
        for kind, (tf, tb) in (("zero", (0.0, 0.0)), ("sleep", (t_fwd, t_bwd))):
            chunks = [SleepChunk(tf / nc, tb / nc) for _ in range(nc)]
            times = []
            for it in range(repeats + 1):
                data = [torch.randn(SHAPE) for _ in range(m)]
                its = [iter(data) for _ in range(nc)]
                torch.distributed.barrier(group=group)
                t0 = time.perf_counter()
                fn(forward_step_func=_forward_step, data_iterator=its if vpp else its[0],
                   model=chunks if vpp else chunks[0], num_microbatches=m, config=cfg, communicator=comm)
                torch.distributed.barrier(group=group)
                if it > 0:  # first step allocates receive buffers
                    times.append(time.perf_counter() - t0)
            res[kind] = times
        out.append(res)
    ps.destroy_model_parallel()
    return out


CONFIGS = [
    (2, None, 4), (2, None, 8), (2, 2, 4), (2, 2, 8),
    (4, None, 4), (4, None, 8), (4, None, 16), (4, 2, 8), (4, 2, 16), (4, 4, 8),
]
QUICK = [(2, None, 4), (2, 2, 4), (4, None, 8), (4, 2, 8)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t-fwd-ms", type=float, default=20.0, help="forward time of one microbatch on one stage")
    ap.add_argument("--t-bwd-ms", type=float, default=40.0, help="backward time of one microbatch on one stage")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default: results_path(), outside the tracked tree)")
    args = ap.parse_args(argv)
    t_fwd, t_bwd = args.t_fwd_ms / 1e3, args.t_bwd_ms / 1e3
    configs = QUICK if args.quick else CONFIGS
    rows = []
    header = (f"{'pp':>3} {'vpp':>4} {'m':>3} {'ideal_ms':>9} {'step_ms':>9} {'bubble':>7} "
              f"{'ideal_bubble':>12} {'ratio':>6} {'zero_ms':>8}")
    print(header)
    for pp in sorted({c[0] for c in configs}):
        mine = [c for c in configs if c[0] == pp]
        results = run_distributed(_worker, pp, mine, t_fwd, t_bwd, args.repeats, timeout=900)
        for i, (pp_, vpp, m) in enumerate(mine):
            step = max(statistics.median(results[r][i]["sleep"]) for r in range(pp))  # slowest rank bounds it
            zero = max(statistics.median(results[r][i]["zero"]) for r in range(pp))
            ideal = m * (t_fwd + t_bwd)
            bubble = step / ideal - 1
            ideal_bubble = (pp_ - 1) / (m * (vpp or 1))
            row = dict(pp=pp_, vpp=vpp, microbatches=m, t_fwd_ms=args.t_fwd_ms, t_bwd_ms=args.t_bwd_ms,
                       ideal_ms=ideal * 1e3, step_ms=step * 1e3, measured_bubble=bubble,
                       ideal_bubble=ideal_bubble, ratio=bubble / ideal_bubble, zero_compute_ms=zero * 1e3,
                       per_rank_median_ms=[statistics.median(results[r][i]["sleep"]) * 1e3 for r in range(pp)])
            rows.append(row)
            print(f"{pp_:>3} {str(vpp):>4} {m:>3} {ideal * 1e3:>9.1f} {step * 1e3:>9.1f} {bubble:>7.3f} "
                  f"{ideal_bubble:>12.3f} {bubble / ideal_bubble:>6.2f} {zero * 1e3:>8.1f}")
    args.out = args.out or results_path("pipeline_bubble", dated=False)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = dict(device="cpu", backend="gloo", torch=torch.__version__, python=platform.python_version(),
                machine=platform.machine(), cpus=os.cpu_count(), repeats=args.repeats,
                note="stage compute simulated with time.sleep; bubble = step/ideal - 1", commit=environment()["commit"])
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
