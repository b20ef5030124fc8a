"""The stage interleave of two microbatches in flight (``PipelineConfig.interleave_stages``,
:mod:`moe_graph.train.interleave`): ``F(i + 1)`` in a worker thread and ``B(i)`` on the caller, alternating at the
token exchanges, ``B`` first.

Oracles: the serial loop (the same model with both options off; bitwise: losses, every gradient, every parameter
after AdamW) and the definition of the issue order, applied to each side's own ops and exchange points as the
record shows them (:func:`helpers.stage_interleave.pair_order`). Faults: a baton that never hands over, a worker
that is not joined, failures injected in ``F`` and in ``B``. In the interleaved pipeline schedule (each steady step's
forward and backward): the same schedule without the option (bitwise), the same order check, each side's virtual
pipeline rank (control: a baton that sets it at no turn), failures in either side.
"""

import threading

import pytest
import torch

from conftest import full_only
from helpers.overlap_workers import TinyMoEModel, microbatches
from helpers.stage_interleave import (MODES, NoPeerCommunicator, StageChunk, fp8_worker, interleave_worker, mismatches,
                                      pair_order, pipeline_stages_worker, run_mode)
from moe_graph.distributed.launch import run_distributed
from moe_graph.streams import unjoined_uses
from moe_graph.train import interleave, schedules


def _threads():
    return [t for t in threading.enumerate() if t.name.startswith("moe_graph-interleave")]


@pytest.mark.parametrize("overrides", [{}, {"overlap_shared_expert": True}, {"num_spare_experts_per_ep_rank": 1},
                                       {"recompute": True}], ids=["plain", "shared_side", "echo1", "recompute"])
@pytest.mark.parametrize("m", [2, 3])
def test_ep1_equals_serial_and_overlap_bitwise(overrides, m):
    mbs = microbatches(m)
    res = {mode: run_mode(TinyMoEModel(**overrides), mbs, mode, record=mode == "stages") for mode in MODES}
    assert mismatches(res["serial"], res["overlap"]) == []
    assert mismatches(res["serial"], res["stages"]) == []
    assert len(res["serial"]["grads"]) >= 7
    assert unjoined_uses(res["stages"]["rec"].entries) == []
    assert _threads() == []


def test_ep1_has_no_exchange_point_so_each_side_runs_whole():
    """At EP 1 nothing is exchanged: B(i) runs whole at its turn (first), then F(i + 1)."""
    rec = run_mode(TinyMoEModel(), microbatches(3), "stages", record=True)["rec"]
    assert rec.exchange_points == []
    for i in range(2):
        p = pair_order(rec, i)
        assert p["actual"] == p["expected"] and p["runs"] == 2, p["segments"]
        assert [s for s, _, _ in p["segments"]] == ["B", "F"]


@pytest.mark.parametrize("layer", [{}, {"recompute": True}] + full_only({"exchange": "symm_mem"},
                                                                         {"exchange": "nvlink"}),
                         ids=["pair", "recompute", "host_sized", "host_sized_fused"])
def test_ep2_on_gloo_equals_serial_and_alternates_at_the_exchanges(layer):
    """EP 2 on gloo, every exchange backend a CPU process group runs (the fixed-split all-to-all, the host-sized
    per-destination exchange, the host-sized fused one) and recomputed layers (their recomputation in B hands over
    as B): bitwise equal to serial and to the overlap without the interleave, every cross-stream use joined, no
    thread left, and the issue order of each pair as defined (the two host-sized exchanges full_only:
    ``MOE_GRAPH_FULL_TESTS=0`` skips them)."""
    for r in run_distributed(interleave_worker, 2, 5, None, layer):
        assert r["mismatch"] == {"overlap": [], "stages": []}, r["mismatch"]
        assert r["unjoined"] == 0 and r["threads"] == [], r
        for p in r["pairs"]:
            assert p["actual"] == p["expected"], p["segments"]
            sides = [s for s, _, _ in p["segments"]]
            assert sides[:4] == ["B", "F"] * 2 and p["runs"] >= 4, p["segments"]
            if not layer:
                # B(i) and F(i+1) each have 2 exchange points (combine and dispatch backward; dispatch and combine; the
                # routing weights' exchange is none): four hand-offs, each right after the all-to-all, then each
                # side's rest: B F B F B F (Megatron-core's combined-1F1B order)
                assert sides == ["B", "F"] * 3 and p["runs"] == 6, p["segments"]
                assert all(name == "alltoall_base_" for _, _, name in p["segments"][:4]), p["segments"]


def test_ep2_fp8_dispatch_equals_serial_bitwise():
    """FP8 experts and FP8 dispatch at EP 2 (blockwise, ``moe_graph.fp8.autocast`` around the schedule, carried into
    the worker): bitwise equal to serial. Exchange points per microbatch: FP8 dispatch's forward byte move and the
    forward combine and, in the backward, the combine's and the dispatch's (its input gradient goes home as a
    combine): 3 x 4. (Checked once: with the recipe not carried into the worker, the forwards there run in 16 bits and
    the losses and gradients differ.)"""
    for r in run_distributed(fp8_worker, 2):
        assert r["mismatch"] == [] and r["unjoined"] == 0, r
        assert r["points"] == 12 and {"fp8_quantize_pair", "fp8_scaled_grouped_gemm"} <= set(r["fp8_ops"]), r


def test_one_event_slot_for_both_sides_is_reported_as_a_race():
    """The control for the second event slot: a recomputed layer with its shared expert on a side stream forks and
    joins that side stream in B (the recomputation) between F's fork and join of it; with one set of events F's
    join would wait on B's event (a race on a GPU), which the record shows."""
    for r in run_distributed(interleave_worker, 2, 5, "one_event_slot", {"recompute": True}):
        assert r["unjoined"] > 0 and r["threads"] == [], r


def test_a_baton_that_never_hands_over_is_caught():
    """The control: with a baton that keeps the turn at the exchange points, B(i) runs whole before F(i + 1) (today's
    issue order): the order check fails."""
    for r in run_distributed(interleave_worker, 2, 5, "no_handoff"):
        assert r["threads"] == []
        for p in r["pairs"]:
            assert p["actual"] != p["expected"] and p["runs"] == 2


def test_a_worker_that_is_not_joined_is_caught(monkeypatch):
    """The thread check can fail: without the join in ``close`` the worker thread outlives the step."""
    real = interleave.ForwardWorker.close

    def close_without_join(self):
        self._tasks.put(None)  # asked to end, not waited for
        self._thread = _Never(self._thread)
        real(self)

    class _Never:
        def __init__(self, t):
            self.t = t

        def join(self):
            pass

    started = threading.Event()
    gate = threading.Event()
    real_run = interleave.ForwardWorker._run

    def run_then_linger(self, state):
        real_run(self, state)
        started.set()
        gate.wait()  # the thread lingers until the test lets it go

    monkeypatch.setattr(interleave.ForwardWorker, "close", close_without_join)
    monkeypatch.setattr(interleave.ForwardWorker, "_run", run_then_linger)
    try:
        run_mode(TinyMoEModel(), microbatches(2), "stages")
        started.wait()
        assert _threads() != []  # the check sees the thread
    finally:
        gate.set()
        for t in _threads():
            t.join()
    assert _threads() == []


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("side", ["F", "B", "both"])
@pytest.mark.parametrize("at", [1, 2])
def test_a_failure_on_either_side_propagates_and_ends_both(side, at):
    """An exception in F(at) (the forward in the worker) or in B(at - 1) (the backward beside it), or in both (B's
    reaches the caller), reaches the caller; no thread is left and the next step runs normally (bitwise equal to
    serial)."""
    model = TinyMoEModel()
    calls = {"n": 0}
    real_forward = model.forward

    def forward(x, t):
        calls["n"] += 1
        y = real_forward(x, t)
        if side in ("F", "both") and calls["n"] == at + 1:
            raise _Boom("in F")
        if side in ("B", "both") and calls["n"] == at:
            y = _FailInBackward.apply(y)
        return y

    model.forward = forward
    with pytest.raises(_Boom, match="in B" if side == "both" else f"in {side}"):
        run_mode(model, microbatches(3), "stages")
    assert _threads() == []
    model.forward = real_forward
    fresh = TinyMoEModel()
    mbs = microbatches(3)
    assert mismatches(run_mode(fresh, mbs, "serial"), run_mode(TinyMoEModel(), mbs, "stages")) == []
    assert _threads() == []


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        raise _Boom("in B")


def test_thread_state_is_carried_into_the_worker():
    """The forward in the worker sees the caller's grad mode, autocast and FP8 recipe."""
    import moe_graph

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            seen.append((threading.current_thread().name, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                         torch.get_autocast_dtype("cpu"), moe_graph.fp8.current_recipe()))
            return (self.w * x).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16), moe_graph.fp8.autocast(recipe="blockwise"):
        schedules.forward_backward_no_pipelining(
            forward_step_func=lambda it, m: (m(next(it)), None), data_iterator=iter([torch.ones(3)] * 3),
            model=Probe(), num_microbatches=3,
            config=schedules.PipelineConfig(overlap_microbatches=True, interleave_stages=True))
    assert len(seen) == 3 and all(n.startswith("moe_graph-interleave") for n, *_ in seen), seen
    assert all(s[1:4] == (True, True, torch.bfloat16) and s[4] is not None and s[4].kind == "blockwise"
               for s in seen), seen
    assert _threads() == []


def test_option_validation():
    from moe_graph.train.step import train_step

    run = dict(forward_step_func=None, data_iterator=iter([]), model=TinyMoEModel(), num_microbatches=2)
    with pytest.raises(ValueError, match="interleave_stages must be a bool, got 1"):
        schedules.forward_backward_no_pipelining(
            **run, config=schedules.PipelineConfig(overlap_microbatches=True, interleave_stages=1))
    with pytest.raises(ValueError, match="interleave_stages=True .* needs overlap_microbatches=True"):
        schedules.forward_backward_no_pipelining(**run, config=schedules.PipelineConfig(interleave_stages=True))
    with pytest.raises(ValueError, match="interleave_stages must be a bool"):
        train_step(TinyMoEModel(), None, [1], overlap_microbatches=True, interleave_stages="yes")
    with pytest.raises(ValueError, match="needs overlap_microbatches=True"):
        train_step(TinyMoEModel(), None, [1], interleave_stages=True)
    with pytest.raises(ValueError, match="forward_backward_pipelining_without_interleaving: interleave_stages runs in "
                                         "the plain microbatch loop .* interleaved schedule only"):
        schedules.forward_backward_pipelining_without_interleaving(
            **run, config=schedules.PipelineConfig(overlap_microbatches=True, interleave_stages=True))
    with pytest.raises(ValueError, match="forward_backward_pipelining_with_interleaving: interleave_stages=True .* "
                                         "needs overlap_microbatches=True"):
        schedules.forward_backward_pipelining_with_interleaving(
            **dict(run, model=[TinyMoEModel()], data_iterator=[iter([])]),
            config=schedules.PipelineConfig(interleave_stages=True))


# ------------------------------------------------------------- the interleaved pipeline schedule (pp 2 x vpp 2) --
def _check_pipeline_run(r, ep: int) -> None:
    rank = r["pp_rank"]
    assert r["mismatch"] == [] and r["n_grads"] >= 20, r["mismatch"]
    assert r["trace"] == [tuple(s) for s in schedules.schedule_order(4, 2, rank, 2, overlap_microbatches=True)]
    assert r["unjoined"] == 0 and r["threads"] == [], r
    assert r["vp_seen"] >= 16 and r["vp_wrong"] == [], r["vp_wrong"]
    assert len(r["pairs"]) == 8 - schedules.num_warmup_microbatches(4, 2, rank, 2, overlap_microbatches=True) > 0
    for p in r["pairs"]:
        assert p["actual"] == p["expected"], p["segments"]
        sides = [s for s, _, _ in p["segments"]]
        if ep == 1:  # no exchange point: B whole, then F whole
            assert sides == ["B", "F"] and p["runs"] == 2, p["segments"]
        else:  # one MoE layer per chunk, 2 exchange points per side: B F B F, each after an all-to-all, then the rests
            assert sides == ["B", "F"] * 3 and p["runs"] == 6, p["segments"]
            assert all(name == "alltoall_base_" for _, _, name in p["segments"][:4]), p["segments"]


@pytest.mark.parametrize("world", [4] + full_only(2))
def test_pp2_vpp2_stage_interleave_equals_the_overlap_bitwise_and_alternates(world):
    """The interleaved pipeline schedule with ``overlap_microbatches``: each steady step's forward (worker thread) and
    backward (here) alternate at the token exchanges. pp 2 x vpp 2 x EP ``world / 2`` on gloo: bitwise equal to the
    same schedule without ``interleave_stages`` (losses, every gradient, the parameters after AdamW); the executed
    steps are schedule_order's; each steady step's issue order as defined; every cross-stream use joined; no thread
    left; every forward and backward sees its own chunk's virtual pipeline rank after the hand-offs."""
    for r in run_distributed(pipeline_stages_worker, world, None):
        _check_pipeline_run(r, world // 2)


@pytest.mark.parametrize("world", full_only(4))
def test_pp2_vpp2_without_the_vp_rank_at_the_handoffs_a_backward_sees_the_forwards_chunk(world):
    """The control of the per-side virtual pipeline rank: with a baton that sets nothing at the hand-offs, a backward
    resumed after its forward's turn sees the forward's chunk."""
    results = run_distributed(pipeline_stages_worker, world, "no_vp_turn")
    assert any(s[0] == "backward" for r in results for s in r["vp_wrong"]), [r["vp_wrong"] for r in results]
    assert all(r["mismatch"] == [] and r["threads"] == [] for r in results)


def _no_peer_run(rank: int, stages: bool, fail=None, fail_backward_of: int = -1):
    """One step of the interleaved schedule (2 chunks, 4 microbatches) as pipeline rank ``rank`` of 2 with
    :class:`helpers.stage_interleave.NoPeerCommunicator`; ``fail(n)`` may raise in the n-th forward done in the
    worker thread; the backward of forward step ``fail_backward_of`` raises. Returns the reported losses, the
    gradients and the number of forwards done in the worker."""
    torch.manual_seed(3)
    chunks = [StageChunk(), StageChunk()]
    g = torch.Generator().manual_seed(4)
    mbs = [torch.randn(2, 4, generator=g) for _ in range(4)]
    n = {"worker": 0, "all": 0}

    def forward_step(it, model):
        mb = next(it)
        if threading.current_thread().name.startswith("moe_graph-interleave"):
            n["worker"] += 1
            if fail is not None:
                fail(n["worker"])
        n["all"] += 1
        y = model(mb)
        return (_FailInBackward.apply(y) if n["all"] - 1 == fail_backward_of else y), (lambda y: y.square().mean())

    cfg = schedules.PipelineConfig(tensor_shape=(2, 4), overlap_microbatches=True, interleave_stages=stages)
    losses = schedules.forward_backward_pipelining_with_interleaving(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in chunks], model=chunks, num_microbatches=4,
        config=cfg, communicator=NoPeerCommunicator(rank))
    return losses, [p.grad.clone() for c in chunks for p in c.parameters()], n["worker"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("side,at", [("F", 1), ("F", 2), ("B", 2)])
def test_pipeline_failure_in_the_forward_side_reaches_the_caller_with_no_thread_left(rank, side, at):
    """A forward run in the worker thread (a steady step's, the ``at``-th there) that raises, or the backward of
    forward step ``at`` (run as ``B`` of the first steady step on both ranks: microbatch 0, chunk 1): the exception
    reaches the caller of the interleaved pipeline schedule, no thread is left, and the next step runs normally (equal
    to the schedule without the stage interleave)."""

    def fail(n):
        if side == "F" and n == at:
            raise _Boom("in F")

    with pytest.raises(_Boom, match=f"in {side}"):
        _no_peer_run(rank, True, fail, at if side == "B" else -1)
    assert _threads() == []
    plain, stages = _no_peer_run(rank, False), _no_peer_run(rank, True)
    assert stages[2] == 8 - schedules.num_warmup_microbatches(4, 2, rank, 2, overlap_microbatches=True)  # all steady
    assert all(torch.equal(a, b) for a, b in zip(plain[0] + plain[1], stages[0] + stages[1]))
    assert len(plain[0]) == (4 if rank == 1 else 0) and _threads() == []
