"""The flags of ``python -m moe_graph.train.schedules`` and ``python -m moe_graph.train.checkpoint``, parsed without
torch or the extension: each command parses them first, when it is ``__main__``, so a bad flag is refused (exit 2,
naming it; ``--help``) before the heavy imports, as :mod:`moe_graph.demo.flags` does for the demo. Checks that need
the schedule arithmetic or a checkpoint's files come after (still exit 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

__all__ = ["int_at_least", "schedules_parser", "parse_schedules", "checkpoint_parser", "parse_checkpoint",
           "CHECKPOINT_DOC"]


def int_at_least(lo: int):
    """An argparse ``type``: an integer >= ``lo`` (argparse names the flag in its error)."""

    def conv(text: str) -> int:
        v = int(text)  # ValueError: argparse says "invalid int value: '...'"
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    conv.__name__ = "int"
    return conv


_POS = int_at_least(1)


def _argv(argv: Optional[List[str]]) -> List[str]:
    return sys.argv[1:] if argv is None else list(argv)


def schedules_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_graph.train.schedules",
                                description="Print each pipeline rank's schedule (F<mb>.<chunk> / B<mb>.<chunk>).")
    p.add_argument("--pp", type=_POS, required=True, help="pipeline stages")
    p.add_argument("--vpp", type=_POS, default=None, help="model chunks per stage (interleaved; needs --pp > 1)")
    p.add_argument("--microbatches", "-m", type=_POS, required=True)
    p.add_argument("--group", type=_POS, default=None, help="microbatch_group_size_per_vp_stage (default: pp)")
    p.add_argument("--forward-only", action="store_true")
    return p


def parse_schedules(argv: Optional[List[str]] = None):
    """``(parser, args)``; exit 2 naming a bad flag. ``argv`` defaults to ``sys.argv[1:]``."""
    p = schedules_parser()
    args = p.parse_args(_argv(argv))
    if args.vpp is not None and args.pp == 1:
        p.error(f"--vpp {args.vpp} (interleaved schedule) needs --pp > 1")
    return p, args


CHECKPOINT_DOC = """python -m moe_graph.train.checkpoint: inspect, convert and reshard moe_graph.train.checkpoint checkpoints
offline (no process group, no model code: only the files).

    python -m moe_graph.train.checkpoint inspect CKPT [--tensors] [--json]
    python -m moe_graph.train.checkpoint convert CKPT OUT.pt|OUT.safetensors [--optimizer]
    python -m moe_graph.train.checkpoint reshard CKPT OUT --pp P [--vpp V] --ep E --dp D

CKPT is a checkpoint root (its 'latest' file names the newest checkpoint) or one step_* folder, format v1 or v2.

  inspect  format, step, layout, model flags, files and sizes, tensors (count, bytes; each with --tensors).
  convert  one whole-model state dict: every tensor under its whole-model name with the experts of a layer stacked
           again (blocks.N.moe.experts.fc1.weight [E, ...]): the state_dict() of the model built on one rank
           (pp 1, ep 1). --optimizer (.pt only) writes {"model", "optimizer": {name: {"exp_avg", "exp_avg_sq"[,
           "main_param"]}}, "step", "lr", "hyper", "loss_scaler", "meta"}.
  reshard  the same checkpoint written for another layout (OUT/step_<n>, OUT/latest): model tensors and optimizer
           state on the ranks that own them there (whole tensors on data-parallel rank 0 of each stage and expert
           rank: a resume cuts its own data-parallel shard), the index of that layout. Loading it needs no
           resharding work; RNG states are not carried (a resume starts fresh per-rank streams, as after any
           layout change).

convert and reshard write into a temporary folder next to OUT, renamed into place when complete and removed on any
failure (a full disk included): a failed run leaves nothing behind, and nothing a load accepts.
"""


def checkpoint_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_graph.train.checkpoint", description=CHECKPOINT_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="step, layout, files, tensors")
    i.add_argument("ckpt")
    i.add_argument("--tensors", action="store_true", help="list every tensor (name, shape, dtype)")
    i.add_argument("--json", action="store_true", help="print JSON")
    c = sub.add_parser("convert", help="one whole-model state dict (.pt or .safetensors)")
    c.add_argument("ckpt")
    c.add_argument("out")
    c.add_argument("--optimizer", action="store_true", help="include the optimizer state (.pt only)")
    r = sub.add_parser("reshard", help="write the checkpoint for another layout")
    r.add_argument("ckpt")
    r.add_argument("out")
    r.add_argument("--pp", type=_POS, default=1, help="pipeline stages (default 1)")
    r.add_argument("--vpp", type=_POS, default=None, help="virtual pipeline chunks per stage (default none)")
    r.add_argument("--ep", type=_POS, default=1, help="expert-parallel ranks per stage (default 1)")
    r.add_argument("--dp", type=_POS, default=1, help="data-parallel ranks per stage, a multiple of --ep (default 1)")
    return p


def parse_checkpoint(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The parsed flags; exit 2 naming a bad one (the layout is checked against the model by the command)."""
    p = checkpoint_parser()
    a = p.parse_args(_argv(argv))
    if a.cmd == "reshard" and a.vpp is not None and a.pp == 1:
        p.error(f"reshard --vpp {a.vpp}: needs --pp > 1")
    if a.cmd == "reshard" and a.dp % a.ep:
        p.error(f"reshard --ep {a.ep} must divide --dp {a.dp}")
    return a
