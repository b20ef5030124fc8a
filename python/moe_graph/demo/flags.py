"""The demo's flags, checked without torch or the extension: ``python -m moe_graph.demo`` refuses a bad flag (exit 2,
naming it) before the heavy imports. :func:`parser` (every flag's type, range and choices) and :func:`check` (the
flags against each other) import neither; :func:`moe_graph.demo.cli.resolve_args` then checks what needs the
machine, the parallel layout or a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional, Tuple

from moe_graph import demo
from moe_graph.distributed import STOP_EXIT_CODE
from moe_graph.train.flags import int_at_least

__all__ = ["parser", "check", "parse", "check_experts", "DEFAULTS", "QUICK"]

# moe_graph.moe.exchange.EXCHANGES (that module imports torch); tests/test_demo.py checks they are the same
EXCHANGES = ("nccl", "symm_mem", "nvlink", "auto")


def _finite_float(lo: float, strict: bool):
    def conv(text: str) -> float:
        v = float(text)  # ValueError: argparse says "invalid float value: '...'"
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {lo}, got {text}")
        return v

    conv.__name__ = "float"
    return conv


_POS, _NONNEG = int_at_least(1), int_at_least(0)
# defaults of the flags that --quick changes (None in the parser: --quick never overrides an explicit value)
DEFAULTS = {"layers": 2, "batch": 8, "microbatches": 2}
QUICK = {"steps": 60, "layers": 1, "batch": 8, "microbatches": 1}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default unless it names it (a None default is described in words)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_graph.demo", formatter_class=_HelpFormatter,
        description=demo.__doc__.split("\n\n")[0] + "\n\n" + _LAUNCH_HELP)
    p.add_argument("--quick", action="store_true",
                   help="the CI configuration: 60 steps, 1 layer, 1 microbatch (explicit flags still win)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu")
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
    m.add_argument("--hidden", type=_POS, default=64, help="model width")
    m.add_argument("--heads", type=_POS, default=4, help="attention heads (must divide --hidden)")
    m.add_argument("--ffn", type=_POS, default=96, help="each expert's hidden size")
    m.add_argument("--experts", type=_POS, default=8, help="experts per MoE layer, divisible by --ep")
    m.add_argument("--topk", type=_POS, default=2, help="experts each token is routed to")
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
    t.add_argument("--seq", type=_POS, default=64, help="sequence length in characters")
    t.add_argument("--batch", type=_POS, default=None, help="sequences per microbatch per data-parallel rank")
    t.add_argument("--microbatches", type=_POS, default=None, help="microbatches per step (default 2; --quick: 1)")
    t.add_argument("--lr", type=_finite_float(0.0, True), default=3e-3, help="AdamW learning rate")
    t.add_argument("--seed", type=_NONNEG, default=0, help="data seed (the global batch of step k is a function of "
                                                           "seed and k)")
    t.add_argument("--log-every", type=_POS, default=None, help="log (and read the loss on the host) every N steps")
    t.add_argument("--no-graph", dest="graph", action="store_false", help="do not use FullIterationGraph")
    o = p.add_argument_group("output and checkpoints")
    o.add_argument("--out", default=None, help="output folder (default: ./moe_graph_demo in the current directory)")
    o.add_argument("--baseline", default=None, metavar="SUMMARY",
                   help="another run's demo_summary.json: its loss curve is drawn beside this run's (e.g. bf16 beside "
                        "--fp8)")
    o.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint folder (docs/training.md); a relative DIR is inside --out (git-ignored by default)")
    o.add_argument("--save-every", type=_POS, default=None, metavar="N",
                   help="save every N steps (default with --save: at the end only)")
    o.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint, or from DIR itself if it is one step_* folder; a relative "
                        "DIR is inside --out, as for --save")
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


def check_experts(p: argparse.ArgumentParser, experts: int, ep: int) -> None:
    if experts % ep:
        p.error(f"--experts {experts} must be divisible by --ep {ep}")


def check(p: argparse.ArgumentParser, args) -> None:
    """The flags against each other (``p.error`` names the flag); needs neither torch nor the machine."""
    if args.ep is not None:  # else the data-parallel size, known with the layout
        check_experts(p, args.experts, args.ep)
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be <= --experts {args.experts}")
    if args.save_every is not None and not args.save:
        p.error("--save-every needs --save DIR")
    if args.fp8_dispatch and args.fp8 not in ("blockwise", "mxfp8"):
        p.error("--fp8-dispatch needs --fp8 blockwise or --fp8 mxfp8 (activation tiles within a row)")
    if args.rerun_threshold > 1:
        p.error(f"--rerun-threshold {args.rerun_threshold}: expected a rate in [0, 1]")
    if args.baseline is not None:
        try:
            with open(args.baseline) as f:
                base = json.load(f)
            base["history"]["step"], base["history"]["loss"]  # noqa: B018 (the curve the plot draws)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--baseline {args.baseline}: not a finished demo's demo_summary.json ({exc})")


def parse(argv: Optional[List[str]] = None) -> Tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse and :func:`check` the flags (exit 2 naming a bad one); ``argv`` defaults to ``sys.argv[1:]``."""
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    check(p, args)
    return p, args
