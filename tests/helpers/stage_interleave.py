"""The stage interleave (``PipelineConfig.interleave_stages``): the plain microbatch loop run serial, with two
microbatches in flight, and with the stage interleave, and the check of a record's issue order against the
definition of :mod:`moe_graph.train.interleave` (used by tests/test_stage_interleave.py, on one process and on gloo
ranks); the interleaved pipeline schedule (pp 2 x vpp 2) with ``overlap_microbatches`` without and with the stage
interleave, and a communicator with no peer for the pipeline failure tests."""

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


def pair_order(rec: StreamRecorder, i: int, side=None) -> Dict:
    """The issue order of the pair ``(F(i + 1), B(i))`` in ``rec`` against the definition: each side's ops cut after
    each of its exchange points (``rec.exchange_points``, recorded where the exchange was issued, whatever the
    schedule), merged ``B0 F0 B1 F1 ...`` (the rest of one side after the other ends). Returns ``{"expected":
    [indices], "actual": [indices], "segments": [(side, n ops, last op name)], "handoffs": n}``: ``expected ==
    actual`` when the record follows the definition. ``side(op)``: ``"F"``, ``"B"`` or None (default
    :func:`side_of` with ``i``)."""
    if side is None:
        side = lambda o: side_of(o, i)  # noqa: E731
    ops = rec.ops
    by_index = {o.index: o for o in ops}
    mine = [o for o in ops if side(o) is not None]
    cut_after = set()  # the last op of each side before each exchange point
    entries = rec.entries
    for p in rec.exchange_points:
        j = p - 1
        while j >= 0 and not isinstance(entries[j], RecordedOp):
            j -= 1
        if j >= 0 and side(entries[j]) is not None:
            cut_after.add(entries[j].index)
    segs = {"F": [[]], "B": [[]]}
    for o in mine:
        s = side(o)
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
    runs = 1 + sum(side(by_index[a]) != side(by_index[b]) for a, b in zip(actual, actual[1:]))
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


# ------------------------------------------------------------------ the interleaved pipeline schedule (pp 2 x vpp 2) --
PIPELINE_STAGE_FAULTS = (None, "no_vp_turn")


def pipeline_stages_worker(rank: int, world: int, fault: Optional[str] = None) -> Dict:
    """pp = 2 stages x 2 model chunks of the demo MoE LM (4 layers; EP = world / 2, as
    :func:`helpers.overlap_workers.pipeline_overlap_worker`), one training step of
    :func:`moe_graph.train.schedules.forward_backward_pipelining_with_interleaving` with ``overlap_microbatches``, without
    and with ``interleave_stages`` (each from the same initial model, on the same microbatches), then one AdamW step.
    Every forward notes its chunk's virtual pipeline rank as parallel_state has it when the chunk's forward returns,
    every backward when the gradient of the chunk's first parameter is made (after the chunk's exchanges): ``vp_wrong``
    lists those that are not the chunk's own. ``fault="no_vp_turn"``: the baton sets no state at the hand-offs (the vp
    rank is then the one the other side set last). Returns the mismatches (bitwise: losses, every gradient, every
    parameter), the interleaved run's trace, :func:`pair_order` of every steady step, unjoined uses and the threads
    started during the run still alive."""
    from unittest import mock

    from helpers.overlap_workers import pipeline_setup, run_pipeline
    from moe_graph import parallel_state as ps
    from moe_graph.train import interleave, schedules

    pp, vpp, m = 2, 2, 4
    before = set(threading.enumerate())
    setup = pipeline_setup(world, vpp, m)
    try:
        pp_rank = setup["pp_rank"]
        vp_seen: List = []  # (phase, chunk, vp rank)

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            out = model(tokens, labels)
            vp_seen.append(("forward", model.chunk_id, ps.get_virtual_pipeline_model_parallel_rank()))
            return out, (lambda loss: loss)

        def on_chunk(c, chunk):
            chunk.chunk_id = c
            next(chunk.parameters()).register_hook(lambda g: vp_seen.append(
                ("backward", c, ps.get_virtual_pipeline_model_parallel_rank())))

        def run(stages: bool, record: bool):
            return run_pipeline(setup, forward_step, overlap=True, stages=stages, record=record, on_chunk=on_chunk)

        overlap = run(False, False)
        vp_seen.clear()
        if fault == "no_vp_turn":
            real_init = interleave.Baton.__init__
            with mock.patch.object(interleave.Baton, "__init__", lambda self, on_turn=None: real_init(self)):
                stages = run(True, True)
        else:
            stages = run(True, True)
        rec = stages["rec"]
        table = schedules.get_schedule_table(m, vpp, pp)
        warmup = schedules.num_warmup_microbatches(m, pp, pp_rank, vpp, overlap_microbatches=True)
        pairs = []
        for k in range(len(table) - warmup):
            j = table.index((table[k][0], vpp - 1 - table[k][1]))  # the forward step whose graph backward k runs
            pairs.append(pair_order(rec, k, lambda o, f=warmup + k, j=j: (
                "F" if o.microbatch == f and o.phase == "forward" else
                "B" if o.microbatch == j and o.phase in ("backward", "recompute") else None)))
        return {"pp_rank": pp_rank, "mismatch": mismatches(overlap, stages), "n_grads": len(overlap["grads"]),
                "trace": stages["trace"], "pairs": pairs, "unjoined": len(unjoined_uses(rec.entries)),
                "points": len(rec.exchange_points), "vp_seen": len(vp_seen),
                "vp_wrong": [s for s in vp_seen if s[1] != s[2]],
                "threads": [t.name for t in threading.enumerate() if t not in before]}
    finally:
        ps.destroy_model_parallel()


class NoPeerCommunicator:
    """A pipeline communicator for one process playing rank ``rank`` of ``world_size`` stages: sends go nowhere,
    receives return zeros (an activation requires grad, as :class:`moe_graph.train.p2p.P2PCommunicator`'s). For the
    schedule's control flow only (the failure tests: a real peer would wait for ever for a rank that raised)."""

    def __init__(self, rank: int, world_size: int = 2):
        self.rank, self.world_size = rank, world_size
        self.is_first_stage, self.is_last_stage = rank == 0, rank == world_size - 1

    def reset_buffers(self) -> None:
        pass

    @staticmethod
    def _recv(shape, dtype, forward: bool):
        return torch.zeros(tuple(shape), dtype=dtype, requires_grad=forward)

    def recv_forward(self, shape, dtype, is_first_stage=None):
        return self._recv(shape, dtype, True)

    def recv_backward(self, shape, dtype, is_last_stage=None):
        return self._recv(shape, dtype, False)

    def send_forward_recv_forward(self, y, recv_prev, shape, dtype):
        return self._recv(shape, dtype, True) if recv_prev else None

    def send_backward_recv_backward(self, dx, recv_next, shape, dtype):
        return self._recv(shape, dtype, False) if recv_next else None

    def send_forward_backward_recv_forward_backward(self, y, dx, recv_prev, recv_next, shape, dtype):
        return (self._recv(shape, dtype, True) if recv_prev else None,
                self._recv(shape, dtype, False) if recv_next else None)


class StageChunk(torch.nn.Module):
    """A model chunk of width ``h`` for :class:`NoPeerCommunicator` runs: a linear layer on the received activation
    (or on the microbatch, on the first chunk of the first stage)."""

    def __init__(self, h: int = 4):
        super().__init__()
        self.lin = torch.nn.Linear(h, h)
        self.x = None

    def set_input_tensor(self, x):
        self.x = x

    def forward(self, mb):
        return torch.tanh(self.lin(mb if self.x is None else self.x))
