"""The demo's command line: train the demo MoE language model (``python -m moe_graph.demo --help``).

:func:`parser` and :func:`resolve_args` check every flag against the others before anything is written (errors
name the flag); :func:`launch` runs :func:`moe_graph.demo.loop.train` in this process (torchrun, or one rank) or
in ``pp x dp`` own processes; :func:`main` writes the summary (``finished`` false until the run completes), the
report and the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from moe_graph import demo
from moe_graph.demo.loop import check_checkpoint_compatible, train
from moe_graph.demo.report import plot, print_report, write_json_atomic
from moe_graph.moe.exchange import EXCHANGES
from moe_graph.distributed.launch import (STOP_EXIT_CODE, Layout, die_with_parent, environment, init_distributed,
                                          resolve_layout, run_distributed, torchrun_env)
from moe_graph.train import checkpoint, schedules

__all__ = ["parser", "resolve_args", "launch", "main"]


def _int_at_least(lo: int):
    def conv(text: str) -> int:
        v = int(text)  # ValueError: argparse says "invalid int value: '...'"
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    conv.__name__ = "int"
    return conv


def _finite_float(lo: float, strict: bool):
    def conv(text: str) -> float:
        v = float(text)  # ValueError: argparse says "invalid float value: '...'"
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {lo}, got {text}")
        return v

    conv.__name__ = "float"
    return conv


_POS, _NONNEG = _int_at_least(1), _int_at_least(0)
# defaults of the flags that --quick changes (None in the parser: --quick never overrides an explicit value)
_DEFAULTS = {"layers": 2, "batch": 8, "microbatches": 2}
_QUICK = {"steps": 60, "layers": 1, "batch": 8, "microbatches": 1}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_graph.demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=demo.__doc__.split("\n\n")[0] + "\n\n" + _LAUNCH_HELP)
    p.add_argument("--quick", action="store_true",
                   help="the CI configuration: 60 steps, 1 layer, 1 microbatch (explicit flags still win)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g = p.add_argument_group("parallel layout (world = pp x dp; each stage's dp ranks = ep x expert-dp; dense tensor "
                             "parallelism is not supported)")
    g.add_argument("--pp", type=_POS, default=1, help="pipeline stages (1F1B schedule; default 1)")
    g.add_argument("--vpp", type=_POS, default=None,
                   help="model chunks per pipeline rank: the interleaved schedule (needs --pp > 1)")
    g.add_argument("--ep", type=_POS, default=None,
                   help="expert-parallel ranks, dividing the data-parallel size (default: the data-parallel size)")
    g.add_argument("--dp", type=_POS, default=None,
                   help="data-parallel ranks per stage; without torchrun the demo starts pp x dp processes (default "
                        "dp: --ep, else 2 on CPU / GPUs / pp on CUDA); under torchrun it is world / pp")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=_POS, default=None, help="transformer blocks (default 2; --quick: 1)")
    m.add_argument("--hidden", type=_POS, default=64)
    m.add_argument("--heads", type=_POS, default=4, help="attention heads (must divide --hidden)")
    m.add_argument("--ffn", type=_POS, default=96)
    m.add_argument("--experts", type=_POS, default=8)
    m.add_argument("--topk", type=_POS, default=2)
    m.add_argument("--spare", type=_NONNEG, default=1, help="echo slots per rank (0: no echo)")
    m.add_argument("--assignment", choices=["auto", "greedy", "best_fit"], default="auto",
                   help="echo planner assignment (moe_graph.moe.echo_planner.gen_assignment)")
    m.add_argument("--capacity", type=_finite_float(0.0, False), default=1.25,
                   help="capacity factor: static routes per (source, destination) pair or per destination rank "
                        "(--exchange), in units of the mean "
                        "(0: capacity_factor=None, every route fits, EP times the memory)")
    m.add_argument("--overflow", choices=["rerun", "drop"], default="rerun",
                   help="a route over the capacity: rerun (default, dropless: the step's update is skipped on the "
                        "device and the step rerun eagerly with the capacity it needed) or drop (dropped and counted)")
    m.add_argument("--exchange", choices=list(EXCHANGES), default="auto",
                   help="the token exchange at EP > 1: nccl (capacity per (source, destination) pair, fixed-split "
                        "all-to-all), symm_mem (capacity per destination rank, only the routed rows travel; on CPUs "
                        "with host-known sizes), nvlink (per destination rank through the fused exchange: rows read "
                        "once, placed at their final rows; on CPUs with host-known sizes) or auto (nvlink where every "
                        "EP peer is an NVLink/P2P peer with the CUDA kernels, else symm_mem where torch's NVSHMEM "
                        "exchange exists, else nccl)")
    m.add_argument("--rerun-window", type=_POS, default=100, metavar="N",
                   help="adaptive capacity: steps over which the rerun rate is measured (default 100)")
    m.add_argument("--rerun-threshold", type=_finite_float(0.0, False), default=0.01, metavar="RATE",
                   help="adaptive capacity: raise the capacity factor (and capture again) when more than RATE of the "
                        "last --rerun-window steps reran (default 0.01; 1: never raise)")
    m.add_argument("--fp8", choices=["blockwise", "mxfp8", "tensorwise"], default=None,
                   help="expert GEMMs in FP8 with this recipe (moe_graph.fp8; CPU semantics)")
    m.add_argument("--fp8-dispatch", action="store_true",
                   help="with --fp8 blockwise|mxfp8: the tokens travel to the experts quantized (MoELayer fp8_dispatch)")
    m.add_argument("--aux", type=_finite_float(0.0, False), default=0.01, help="aux load-balancing loss coefficient")
    m.add_argument("--router", choices=["softmax", "deepseek"], default="softmax",
                   help="deepseek: sigmoid scores, group-limited top-k, auxiliary-loss-free expert bias, "
                        "sequence-wise aux loss 1e-4")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_POS, default=None, help="total steps (default 250 on CPU, 400 on CUDA; --quick: "
                                                            "60); a resumed run trains up to this step")
    t.add_argument("--seq", type=_POS, default=64)
    t.add_argument("--batch", type=_POS, default=None, help="sequences per microbatch per data-parallel rank (default 8)")
    t.add_argument("--microbatches", type=_POS, default=None, help="microbatches per step (default 2; --quick: 1)")
    t.add_argument("--lr", type=_finite_float(0.0, True), default=3e-3)
    t.add_argument("--seed", type=_NONNEG, default=0, help="data seed (the global batch of step k is a function of "
                                                           "seed and k)")
    t.add_argument("--log-every", type=_POS, default=None, help="log (and read the loss on the host) every N steps")
    t.add_argument("--no-graph", dest="graph", action="store_false", help="do not use FullIterationGraph")
    o = p.add_argument_group("output and checkpoints")
    o.add_argument("--out", default=None, help="output folder (default: ./moe_graph_demo in the current directory)")
    o.add_argument("--baseline", default=None, metavar="SUMMARY",
                   help="another run's demo_summary.json: its loss curve is drawn beside this run's (e.g. bf16 beside "
                        "--fp8)")
    o.add_argument("--save", default=None, metavar="DIR", help="checkpoint folder (see README: Checkpoints)")
    o.add_argument("--save-every", type=_POS, default=None, metavar="N",
                   help="save every N steps (default with --save: at the end only)")
    o.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint, or from DIR itself if it is one step_* folder")
    o.add_argument("--stop-grace", type=_finite_float(0.0, True), default=25.0, metavar="SECONDS",
                   help="after SIGTERM the ranks finish the current step, save (--save) and exit with status "
                        f"{STOP_EXIT_CODE}; past this many seconds they exit without a checkpoint (default 25: "
                        "within the 30 s before SIGKILL of torchrun, Kubernetes and SLURM's default KillWait)")
    return p


_LAUNCH_HELP = """launch:
  python -m moe_graph.demo [flags]                       # starts its own pp x dp processes on this machine
  torchrun --nproc-per-node P -m moe_graph.demo [flags]  # one node, P processes (one per GPU)
  torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m moe_graph.demo [flags]
Dense layers are data-parallel (no tensor parallelism); experts are expert-parallel."""


def _fill_defaults(p: argparse.ArgumentParser, args) -> None:
    """The device, then the defaults that depend on it and on ``--quick`` (explicit flags win)."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    for k, v in (_QUICK if args.quick else {}).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in _DEFAULTS.items():
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
    """Fill the defaults and check every flag against the others (``p.error`` names the flag); nothing is written."""
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
    if args.experts % layout.ep:
        p.error(f"--experts {args.experts} must be divisible by --ep {layout.ep}")
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be <= --experts {args.experts}")
    if args.save_every is not None and not args.save:
        p.error("--save-every needs --save DIR")
    if args.save and args.save_every is None:
        args.save_every = args.steps
    if args.capacity == 0:
        args.capacity = None
    if args.fp8_dispatch and args.fp8 not in ("blockwise", "mxfp8"):
        p.error("--fp8-dispatch needs --fp8 blockwise or --fp8 mxfp8 (activation tiles within a row)")
    if args.baseline is not None:
        try:
            with open(args.baseline) as f:
                base = json.load(f)
            base["history"]["step"], base["history"]["loss"]  # noqa: B018 (the curve the plot draws)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--baseline {args.baseline}: not a finished demo's demo_summary.json ({exc})")
    if args.fp8 and args.device == "cuda":
        p.error(f"--fp8 {args.fp8}: the FP8 grouped GEMM has no CUDA kernels yet (CPU semantics only)")
    if args.rerun_threshold > 1:
        p.error(f"--rerun-threshold {args.rerun_threshold}: expected a rate in [0, 1]")
    if args.load:
        try:
            meta = checkpoint.read_meta(checkpoint.resolve_checkpoint(args.load))
            check_checkpoint_compatible(meta, args, layout)
        except (OSError, ValueError, KeyError) as e:
            p.error(str(e) if str(e).startswith("--") else f"--load {args.load}: {e}")
    args.out = os.path.abspath(args.out or os.path.join(os.getcwd(), "moe_graph_demo"))
    for flag in ("save", "load"):
        if getattr(args, flag):
            setattr(args, flag, os.path.abspath(getattr(args, flag)))
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
    args = p.parse_args(argv)

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
