"""The stage interleave (``PipelineConfig.interleave_stages``): the plain microbatch loop run serial, with two
microbatches in flight, and with the stage interleave, and the check of a record's issue order against the
definition of :mod:`moe_graph.train.interleave` (used by tests/test_stage_interleave.py, on one process and on gloo
ranks)."""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional

import torch

from helpers.overlap_workers import TinyMoEModel, microbatches
from moe_graph import streams
from moe_graph.streams import RecordedOp, StreamRecorder, unjoined_uses

MODES = ("serial", "overlap", "stages")
COLLECTIVES = ("alltoall_base_", "alltoall_", "allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_")


def run_mode(model, mbs, mode: str, record: bool = False, lr: float = 1e-2):
    """One step of :func:`moe_graph.train.schedules.forward_backward_no_pipelining` over ``mbs`` (``mode``: the
    serial loop, ``overlap_microbatches``, or with ``interleave_stages`` too), then one AdamW step. Returns
    ``{"losses", "grads", "params", "rec"}``."""
    from moe_graph.train import schedules

    model.zero_grad(set_to_none=True)
    rec = StreamRecorder() if record else None
    cfg = schedules.PipelineConfig(overlap_microbatches=mode != "serial", interleave_stages=mode == "stages")
    with rec if rec is not None else torch.enable_grad():
        losses = schedules.forward_backward_no_pipelining(
            forward_step_func=lambda it, m: (m(*next(it)), None), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), config=cfg)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rec": rec}


def mismatches(a: Dict, b: Dict) -> List[str]:
    """Names that differ bitwise between two :func:`run_mode` results (losses, every gradient, every parameter)."""
    out = [f"loss{i}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if not torch.equal(x, y)]
    out += [] if len(a["losses"]) == len(b["losses"]) else ["n_losses"]
    for kind in ("grads", "params"):
        out += [f"{kind}:{n}" for n in sorted(set(a[kind]) | set(b[kind]))
                if n not in a[kind] or n not in b[kind] or not torch.equal(a[kind][n], b[kind][n])]
    return out


def side_of(o: RecordedOp, i: int) -> Optional[str]:
    """``"F"`` for an op of microbatch ``i + 1``'s forward, ``"B"`` for one of microbatch ``i``'s backward (a
    recomputation inside it too), else None."""
    if o.microbatch == i + 1 and o.phase == "forward":
        return "F"
    if o.microbatch == i and o.phase in ("backward", "recompute"):
        return "B"
    return None


def pair_order(rec: StreamRecorder, i: int) -> Dict:
    """The issue order of the pair ``(F(i + 1), B(i))`` in ``rec`` against the definition: each side's ops cut after
    each of its exchange points (``rec.exchange_points``, recorded where the exchange was issued, whatever the
    schedule), merged ``B0 F0 B1 F1 ...`` (the rest of one side after the other ends). Returns ``{"expected":
    [indices], "actual": [indices], "segments": [(side, n ops, last op name)], "handoffs": n}``: ``expected ==
    actual`` when the record follows the definition."""
    ops = rec.ops
    by_index = {o.index: o for o in ops}
    mine = [o for o in ops if side_of(o, i) is not None]
    cut_after = set()  # the last op of each side before each exchange point
    entries = rec.entries
    for p in rec.exchange_points:
        j = p - 1
        while j >= 0 and not isinstance(entries[j], RecordedOp):
            j -= 1
        if j >= 0 and side_of(entries[j], i) is not None:
            cut_after.add(entries[j].index)
    segs = {"F": [[]], "B": [[]]}
    for o in mine:
        s = side_of(o, i)
        segs[s][-1].append(o.index)
        if o.index in cut_after:
            segs[s].append([])
    for s in segs:
        segs[s] = [seg for seg in segs[s] if seg]
    expected, order = [], []
    for k in range(max(len(segs["F"]), len(segs["B"]))):
        for s in ("B", "F"):
            if k < len(segs[s]):
                expected += segs[s][k]
                order.append((s, len(segs[s][k]), by_index[segs[s][k][-1]].name))
    actual = [o.index for o in mine]
    runs = 1 + sum(side_of(by_index[a], i) != side_of(by_index[b], i) for a, b in zip(actual, actual[1:]))
    return {"expected": expected, "actual": actual, "segments": order, "runs": runs}


def interleave_worker(rank: int, world: int, seed: int, fault: Optional[str] = None,
                      layer: Optional[Dict] = None) -> Dict:
    """On each gloo rank (EP = world): 3 microbatches of the tiny MoE model (shared expert on its side stream, echo
    off; ``layer``: more MoE layer options, e.g. ``exchange``, ``recompute``) serial, overlapped and stage-interleaved;
    ``fault`` patches the baton (``"no_handoff"``: a side keeps the
    baton at its exchange points) or the side streams (``"one_event_slot"``: the worker forks and joins with the same
    events as the caller). Returns the mismatches of each against serial, the interleaved record's
    unjoined uses and :func:`pair_order` of each pair, and the threads started during the run still alive."""
    from unittest import mock

    from moe_graph.train import interleave

    before = set(threading.enumerate())
    opts = dict(dict(ep_size=world, num_experts=2 * world, overlap_shared_expert=True), **(layer or {}))
    mbs = microbatches(3, 100 + rank)
    res = {m: run_mode(TinyMoEModel(seed, **opts), mbs, m, record=m == "stages") for m in MODES if fault is None}
    if fault is not None:
        patch = {"no_handoff": lambda: mock.patch.object(interleave.Baton, "hand_off", lambda self, side: None),
                 "one_event_slot": lambda: mock.patch.object(streams, "event_slot",
                                                             lambda slot: contextlib.nullcontext())}[fault]
        with patch():
            res = {"stages": run_mode(TinyMoEModel(seed, **opts), mbs, "stages", record=True)}
    rec = res["stages"]["rec"]
    out = {"unjoined": len(unjoined_uses(rec.entries)), "pairs": [pair_order(rec, i) for i in range(2)],
           "threads": [t.name for t in threading.enumerate() if t not in before]}
    if fault is None:
        out["mismatch"] = {m: mismatches(res["serial"], res[m]) for m in ("overlap", "stages")}
    return out


class Fp8Model(torch.nn.Module):
    """The tiny model at FP8 sizes (H 128): a linear layer and a residual MoE layer with FP8 dispatch
    (``fp8_dispatch``) and a shared expert, EP ``world``; FP8 under the caller's ``moe_graph.fp8.autocast``."""

    def __init__(self, world: int):
        super().__init__()
        from moe_graph.moe.layer import MoELayer

        torch.manual_seed(5)
        self.inp = torch.nn.Linear(128, 128)
        self.moe = MoELayer(128, 64, 2 * world, 2, shared_expert_ffn_size=64, aux_loss_coeff=0.05,
                            capacity_factor=None, fp8_dispatch=True, device="cpu", ep_size=world)

    def forward(self, x, target):
        h = self.inp(x)
        return ((h + self.moe(h)) - target).square().mean()


def fp8_worker(rank: int, world: int) -> Dict:
    """On each gloo rank: 3 microbatches of :class:`Fp8Model` serial and stage-interleaved under
    ``moe_graph.fp8.autocast(recipe="blockwise")`` entered around the schedule (the worker thread must carry it).
    Returns the mismatches, the exchange points and the FP8 ops recorded."""
    import moe_graph

    g = torch.Generator().manual_seed(6 + rank)
    mbs = [(torch.randn(19, 128, generator=g), torch.randn(19, 128, generator=g)) for _ in range(3)]
    with moe_graph.fp8.autocast(recipe="blockwise"):
        res = {mode: run_mode(Fp8Model(world), mbs, mode, record=mode == "stages") for mode in ("serial", "stages")}
    rec = res["stages"]["rec"]
    return {"mismatch": mismatches(res["serial"], res["stages"]), "points": len(rec.exchange_points),
            "unjoined": len(unjoined_uses(rec.entries)), "fp8_ops": sorted({o.name for o in rec.ops if "fp8" in o.name})}
