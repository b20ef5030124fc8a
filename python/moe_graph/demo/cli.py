"""The demo's command line: train the demo MoE language model (``python -m moe_graph.demo --help``).

:func:`parser` and :func:`moe_graph.demo.flags.check` (no torch), then :func:`resolve_args` (the machine, the
layout, a checkpoint to load) check every flag before anything is written (errors name the flag); :func:`launch`
runs :func:`moe_graph.demo.loop.train` in this process (torchrun, or one rank) or in ``pp x dp`` own processes; :func:`main` writes the summary (``finished`` false until the run completes), the
report and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from moe_graph.demo.flags import DEFAULTS, QUICK, check, check_experts, parser
from moe_graph.demo.loop import check_checkpoint_compatible, train
from moe_graph.demo.report import plot, print_report, write_json_atomic
from moe_graph.distributed.launch import (STOP_EXIT_CODE, Layout, die_with_parent, environment, init_distributed,
                                          resolve_layout, run_distributed, torchrun_env)
from moe_graph.train import checkpoint, schedules

__all__ = ["parser", "resolve_args", "launch", "main"]  # parser: moe_graph.demo.flags's


def _fill_defaults(p: argparse.ArgumentParser, args) -> None:
    """The device, then the defaults that depend on it and on ``--quick`` (explicit flags win)."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    for k, v in (QUICK if args.quick else {}).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.steps = args.steps or (400 if args.device == "cuda" else 250)
    args.log_every = args.log_every or max(1, args.steps // 15)


def _world_size(p: argparse.ArgumentParser, args, env) -> int:
    """torchrun's world, else the ``pp x dp`` processes the demo starts itself (one GPU per rank on CUDA)."""
    if env is not None:
        return env["world"]
    dp = args.dp or args.ep
    if dp is None:
        dp = max(1, torch.cuda.device_count() // args.pp) if args.device == "cuda" else 2
    world = args.pp * dp
    if args.device == "cuda" and world > torch.cuda.device_count():
        p.error(f"--pp {args.pp} x dp {dp} = {world} processes but only {torch.cuda.device_count()} GPU(s) "
                "(NCCL needs one GPU per rank; use torchrun for several nodes)")
    return world


def resolve_args(p: argparse.ArgumentParser, args, env) -> Layout:
    """Check the flags against each other, fill the defaults and check them against the machine, the layout and a
    checkpoint to load (``p.error`` names the flag); nothing is written. Relative ``--save`` / ``--load`` folders
    are made absolute inside ``--out``."""
    check(p, args)
    _fill_defaults(p, args)
    world = _world_size(p, args, env)
    try:
        layout = resolve_layout(world, args.pp, args.vpp, args.ep, args.dp)
        schedules.get_num_layers_per_chunk(args.layers, args.pp, args.vpp)
    except ValueError as e:
        p.error(str(e).replace("num_layers=", "--layers "))
    try:
        schedules.num_warmup_microbatches(args.microbatches, args.pp, 0, args.vpp)
    except ValueError as e:
        p.error(f"--microbatches {args.microbatches}: {e}")
    args.ep = layout.ep
    check_experts(p, args.experts, layout.ep)
    if args.save and args.save_every is None:
        args.save_every = args.steps
    if args.capacity == 0:
        args.capacity = None
    if args.fp8 and args.device == "cuda":
        p.error(f"--fp8 {args.fp8}: the FP8 grouped GEMM has no CUDA kernels yet (CPU semantics only)")
    args.out = os.path.abspath(args.out or os.path.join(os.getcwd(), "moe_graph_demo"))
    for flag in ("save", "load"):  # a relative folder is inside --out (git-ignored in a checkout by default)
        if getattr(args, flag):
            setattr(args, flag, os.path.join(args.out, getattr(args, flag)))
    if args.load:
        try:
            meta = checkpoint.read_meta(checkpoint.resolve_checkpoint(args.load))
            check_checkpoint_compatible(meta, args, layout)
        except (OSError, ValueError, KeyError) as e:
            p.error(str(e) if str(e).startswith("--") else f"--load {args.load}: {e}")
    return layout




def launch(args, env, world: int) -> Dict:
    """Rank 0's summary: the training loop on this process (torchrun, or one rank) or on ``world`` own processes."""
    if env is not None:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent: do not outlive it
            die_with_parent(os.getppid())
        init_distributed(args.device)
        try:
            return train(env["rank"], env["world"], args)
        finally:
            dist.destroy_process_group()
    if world == 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
        try:
            return train(0, 1, args)
        finally:
            dist.destroy_process_group()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_distributed(train, world, args, backend="nccl" if args.device == "cuda" else "gloo",
                           timeout=None, stop_on_sigterm=True, stop_grace=args.stop_grace)[0]


def _stopped(summary: Dict, args, writer: bool, summary_path: str, wall: float) -> None:
    """A run stopped on request (SIGTERM): the summary says ``interrupted`` (with the step and the checkpoint),
    a message says why, and the process exits with :data:`STOP_EXIT_CODE`."""
    st = summary["stopped"]
    if writer:
        summary.update(wall_s=wall, config=dict(vars(args)), env=environment(), finished=False, status="interrupted")
        write_json_atomic(summary_path, summary)
        saved = (f"checkpoint {st['checkpoint']} (resume with --load {args.save})" if st["checkpoint"] else
                 "no checkpoint (no --save)")
        print(f"moe_graph demo: stopped by {st['reason']} after step {st['step']} of {args.steps}; {saved}; "
              f"summary {summary_path} (status interrupted); exit status {STOP_EXIT_CODE}", file=sys.stderr,
              flush=True)
    raise SystemExit(STOP_EXIT_CODE)


def main(argv: Optional[List[str]] = None) -> Dict:
    p = parser()
    args = p.parse_args(argv)  # resolve_args checks them

    try:
        env = torchrun_env()
    except RuntimeError as e:
        p.error(str(e))
    layout = resolve_args(p, args, env)
    writer = env is None or env["rank"] == 0  # the process that writes the summary and prints the report
    out_dir = args.out
    summary_path = os.path.join(out_dir, "demo_summary.json")
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        if not args.load and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
            os.remove(os.path.join(out_dir, "metrics.jsonl"))  # a new run; a resumed one appends
        write_json_atomic(summary_path, {"finished": False, "status": "running", "config": vars(args)})
    t0 = time.perf_counter()
    try:
        summary = launch(args, env, layout.world)
    except BaseException as exc:
        if writer:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            write_json_atomic(summary_path, {"finished": False, "status": status, "error": repr(exc)[:4000],
                                              "config": vars(args), "wall_s": time.perf_counter() - t0})
        raise
    wall = time.perf_counter() - t0
    if summary.get("stopped"):
        _stopped(summary, args, writer, summary_path, wall)
    if not writer:
        return summary
    print_report(summary)
    png = os.path.join(out_dir, "demo.png")
    baseline = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)
    how = plot(summary, png, baseline=baseline)
    summary["wall_s"] = wall
    summary["config"] = {k: v for k, v in vars(args).items()}
    summary["env"] = environment()  # torch / CUDA versions, the commit measured, date
    summary["finished"], summary["status"] = True, "finished"
    write_json_atomic(summary_path, summary)
    print(f"wrote {png} ({how}), {summary_path} and {os.path.join(out_dir, 'metrics.jsonl')}; total {wall:.1f} s")
    print(f"output folder: {out_dir}")
    return summary
