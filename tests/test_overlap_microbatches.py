"""Two microbatches in flight in the plain microbatch loop (``overlap_microbatches``): microbatch ``i + 1``'s
forward beside microbatch ``i``'s backward on two alternating microbatch streams
(:func:`moe_graph.train.schedules.forward_backward_overlapped`).

Oracle: the serial loop (``F0 B0 F1 B1 ...``, the same model with the option off). The overlapped schedule issues
the same forwards in the same order and the same backwards in the same order, so losses and gradients must be
bitwise equal. The record (:class:`moe_graph.streams.StreamRecorder`) of the overlapped schedule must show no
ordering and no data dependency between microbatch ``i``'s exchange and microbatch ``i + 1``'s computation (both
ways), every cross-stream use joined, and a race when a fork's or a join's wait is removed.
"""

import importlib.util
import os
import types

import pytest
import torch

import moe_graph

from conftest import requires_cuda
from helpers.overlap_workers import (TinyMoEModel, cross_microbatch, microbatch_worker, microbatches, run_schedule)
from moe_graph import streams
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.layer import MoELayer
from moe_graph.streams import SideStream, unjoined_uses
from moe_graph.train import schedules


def _equal(a, b):
    (l0, g0, _), (l1, g1, _) = a, b
    assert len(l0) == len(l1) and all(torch.equal(x, y) for x, y in zip(l0, l1))
    assert set(g0) == set(g1) and len(g0) >= 7
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("overrides", [{}, {"overlap_shared_expert": True}, {"num_spare_experts_per_ep_rank": 1},
                                       ], ids=["plain", "shared_side", "echo1"])
@pytest.mark.parametrize("m", [2, 3])
def test_overlapped_microbatches_equal_serial_bitwise(overrides, m):
    mbs = microbatches(m)
    serial = run_schedule(TinyMoEModel(**overrides), mbs, False)
    overlapped = run_schedule(TinyMoEModel(**overrides), mbs, True, record=True)
    _equal(serial, overlapped)
    assert unjoined_uses(overlapped[2].entries) == []


@pytest.mark.parametrize("overrides", [{}, {"overlap_shared_expert": True}], ids=["plain", "shared_side"])
def test_record_shows_exchange_beside_the_other_microbatch(overrides):
    rec = run_schedule(TinyMoEModel(**overrides), microbatches(3), True, record=True)[2]
    for i in range(3):  # forward and backward of microbatch i on stream i % 2 (and the shared expert's side stream)
        mine = {o.stream for o in rec.ops if o.microbatch == i}
        assert f"microbatch{i % 2}" in mine and mine <= {f"microbatch{i % 2}", "moe_side"}, (i, mine)
    # the rest (grad zeroing, loss scaling, the accumulations and their hooks) on the main stream
    assert {o.stream for o in rec.ops if o.microbatch is None} == {"main"}
    for i in range(2):
        c = cross_microbatch(rec, i)
        assert c["exchange"] > 0 and c["compute"] > 0 and c["ordered"] == 0 and c["depends"] == 0, (i, c)


def test_serial_record_orders_every_microbatch():
    """The control: the serial loop has everything on the main stream, so the check above sees the exchange of
    one microbatch ordered against the other's computation (it can fail)."""
    rec = run_schedule(TinyMoEModel(), microbatches(3), False, record=True)[2]
    assert {o.stream for o in rec.ops} == {"main"}
    c = cross_microbatch(rec, 0)
    assert c["ordered"] == c["pairs"] > 0  # every pair ordered (no data dependency either way in serial too)


@pytest.mark.parametrize("removed", ["fork", "join"])
def test_a_removed_microbatch_wait_is_reported_as_a_race(monkeypatch, removed):
    real = SideStream._wait

    def wait(self, kind):
        if not (self.name.startswith("microbatch") and kind == removed):
            real(self, kind)

    monkeypatch.setattr(SideStream, "_wait", wait)
    rec = run_schedule(TinyMoEModel(), microbatches(3), True, record=True)[2]
    races = unjoined_uses(rec.entries)
    assert races
    streams_seen = {(p.stream, c.stream) for p, c in races}
    if removed == "fork":  # a microbatch stream reads what the main stream wrote (zeroed grads, scale) unordered
        assert any(p == "main" and c.startswith("microbatch") for p, c in streams_seen), streams_seen
    else:  # the main stream (loss scaling for backward) reads the loss before the microbatch stream made it
        assert any(p.startswith("microbatch") and c == "main" for p, c in streams_seen), streams_seen


def test_a_removed_accumulation_wait_is_reported_as_a_race(monkeypatch):
    """The accumulation of a parameter's gradient runs on the main stream after waiting for the microbatch stream
    (the recorder's model of the engine); without that wait the main stream's add reads the gradient unordered."""
    real = streams.StreamRecorder._event

    def event(self, kind, name, stream=None):
        if kind == "wait" and name.startswith("autograd#") and (stream or streams.current_logical_stream()) == "main" \
                and streams.current_logical_stream() != "main":
            return  # the boundary's wait (issued while the microbatch stream is still current)
        real(self, kind, name, stream)

    monkeypatch.setattr(streams.StreamRecorder, "_event", event)
    rec = run_schedule(TinyMoEModel(), microbatches(2), True, record=True)[2]
    races = unjoined_uses(rec.entries)
    assert any(p.stream.startswith("microbatch") and c.stream == "main" for p, c in races)


def test_accumulation_hooks_run_on_the_main_stream():
    """Every parameter's post-accumulate hook (DDP's ``main_grad`` add, its bucket reduction launch) runs on the
    main stream: the schedule makes the accumulators there before the first fork and keeps them."""
    model = TinyMoEModel()
    seen = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.setdefault(n, set()).add(
            streams.current_logical_stream()))
    run_schedule(model, microbatches(3), True, record=True)
    assert seen and all(v == {"main"} for v in seen.values()), seen


class _Fp8Model(torch.nn.Module):
    """The tiny model at FP8 sizes: the MoE layer's experts (and its dispatch, ``fp8_dispatch``) under ``recipe``."""

    def __init__(self, recipe: str, recompute: bool):
        super().__init__()
        torch.manual_seed(5)
        self.recipe = recipe
        self.inp = torch.nn.Linear(128, 128)
        self.moe = MoELayer(128, 64, 4, 2, shared_expert_ffn_size=64, aux_loss_coeff=0.05, capacity_factor=None,
                            fp8_dispatch=True, recompute=recompute, device="cpu")

    def forward(self, x, target):
        with moe_graph.fp8.autocast(recipe=self.recipe):
            h = self.inp(x)
            return ((h + self.moe(h)) - target).square().mean()


@pytest.mark.parametrize("recipe,recompute", [("blockwise", False), ("mxfp8", True)])
def test_fp8_overlapped_microbatches_equal_serial_bitwise(recipe, recompute):
    """FP8 experts and FP8 dispatch (blockwise; MXFP8 with recompute) with two microbatches in flight: the same
    quantizations in the same order as the serial loop, so bitwise equal."""
    g = torch.Generator().manual_seed(6)
    mbs = [(torch.randn(19, 128, generator=g), torch.randn(19, 128, generator=g)) for _ in range(3)]
    serial = run_schedule(_Fp8Model(recipe, recompute), mbs, False)
    overlapped = run_schedule(_Fp8Model(recipe, recompute), mbs, True, record=True)
    _equal(serial, overlapped)
    assert unjoined_uses(overlapped[2].entries) == []
    assert {"fp8_quantize_pair", "fp8_scaled_grouped_gemm"} <= {o.name for o in overlapped[2].ops}  # FP8 ran


def _bench_moe_cost(monkeypatch):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))  # as when run as a script: benchmarks/common.py
    spec = importlib.util.spec_from_file_location("bench_moe_cost", os.path.join(root, "benchmarks",
                                                                                 "bench_moe_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("inject", [False, True])
def test_overlapped_schedule_makes_no_host_sync(monkeypatch, inject):
    """A step of 3 microbatches in flight (shared expert on its side stream, echo) under bench_moe_cost's host-sync
    meter (``.item()``, ``nonzero``, host reads of device values, ...), on the branch a GPU runs: none. An
    ``.item()`` injected into the forward is caught (the meter can fail)."""
    bench = _bench_moe_cost(monkeypatch)
    model = TinyMoEModel(overlap_shared_expert=True, num_spare_experts_per_ep_rank=1)
    mbs = microbatches(3)
    run_schedule(model, mbs, True)  # warm-up: made-once state (streams, tables)
    if inject:
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda x, t: forward(x, t) + 0 * x.sum().item())
    meter = bench.CostMeter(device_tensors=[*model.parameters(), *model.buffers(), *(t for mb in mbs for t in mb)])
    with bench.device_branch(), bench.host_reads(meter), meter:
        run_schedule(model, mbs, True)
    assert meter.syncs == ([] if not inject else ["fwd:_local_scalar_dense"] * 3), meter.syncs


def test_a_joined_graph_waits_only_in_its_own_backward():
    """Two forwards on two microbatch streams joined before either backward (a pipeline's warm-up) share the
    parameters' accumulators; the first backward must record no event of the second graph (a stray wait there would
    order work a GPU does not order, and could hide a race)."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    lanes = [SideStream("cpu", f"microbatch{i}", whole_graph=True) for i in range(2)]
    acc = torch.autograd.graph.get_gradient_edge(w).node  # made on the main stream, kept for both graphs
    with streams.StreamRecorder() as rec:
        outs = []
        for i, lane in enumerate(lanes):
            x = torch.randn(3, 4)
            with lane.fork(w):
                y = (x @ w).square().sum()
            outs.append(lane.join(y)[0])
        first = len(rec.entries)
        outs[0].backward()
        during_first = rec.entries[first:]
        outs[1].backward()
    names = {e.event.split(".")[0] for e in during_first if isinstance(e, streams.RecordedEvent)}
    assert len(names) == 1, names  # the first graph's autograd events only
    assert {e.stream for e in during_first if isinstance(e, streams.RecordedEvent) and e.kind == "record"
            and e.event.endswith(".done")} == {"microbatch0"}
    assert unjoined_uses(rec.entries) == []
    del acc


def test_ep2_on_gloo_equals_serial_and_overlaps():
    for r in run_distributed(microbatch_worker, 2, 5):
        assert r["mismatch"] == [] and r["unjoined"] == 0, r
        for c in r["cross"]:
            assert c["exchange"] > 0 and c["ordered"] == 0 and c["depends"] == 0, r


def test_recomputed_layers_overlapped_equal_serial_and_the_plain_model_bitwise():
    mbs = microbatches(3)
    plain = run_schedule(TinyMoEModel(), mbs, False)
    serial = run_schedule(TinyMoEModel(recompute=True), mbs, False)
    overlapped = run_schedule(TinyMoEModel(recompute=True), mbs, True, record=True)
    _equal(plain, serial)
    _equal(serial, overlapped)
    assert unjoined_uses(overlapped[2].entries) == []


def _buffer_writes(model, rec, phase):
    keys = {b.untyped_storage().data_ptr() for b in model.buffers()}
    return [o.name for o in rec.ops if o.phase == phase and keys & set(o.writes)]


def test_the_recomputation_writes_no_layer_state():
    """With recompute, microbatch i's backward runs the layer's forward again beside microbatch i + 1's forward: it
    must write none of the layer's buffers (statistics, counters, route counts), which the other forward writes."""
    model = TinyMoEModel(recompute=True, aux_loss_coeff=0.01)
    rec = run_schedule(model, microbatches(3), True, record=True)[2]
    assert any(o.phase == "recompute" for o in rec.ops)  # the recomputation was recorded
    assert _buffer_writes(model, rec, "forward")  # the forward does write them (the check can see writes)
    assert _buffer_writes(model, rec, "recompute") == []


def test_option_validation():
    # 1F1B with pp > 1 refuses (as Megatron-core: virtual pipelining needed) before any communication: the
    # communicator is a stand-in that cannot communicate
    comm = types.SimpleNamespace(world_size=2, rank=1, is_first_stage=False, is_last_stage=True)
    with pytest.raises(ValueError, match="without_interleaving: overlap_microbatches with pp_size=2 needs the "
                                         "interleaved schedule"):
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=None, data_iterator=None, model=TinyMoEModel(), num_microbatches=2,
            config=schedules.PipelineConfig(overlap_microbatches=True, tensor_shape=(2, 5, 16)), communicator=comm)
    from moe_graph.train.step import train_step
    with pytest.raises(TypeError, match="overlap_microbatches must be a bool"):
        train_step(TinyMoEModel(), None, [1], overlap_microbatches=1)
    with pytest.raises(ValueError, match="plain microbatch loop .* interleaved schedule"):
        train_step(TinyMoEModel(), None, [1], overlap_microbatches=True,
                   forward_backward_func=schedules.forward_backward_pipelining_without_interleaving)


# ------------------------------------------------------------------------------------------------- CUDA --
# Written for the GPU: a train_step with overlap_microbatches captured in one graph (the microbatch streams join the
# capture through their fork events), replayed with no host sync, equal to the eager serial step.
class _CudaModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from moe_graph.moe.layer import MoELayer

        torch.manual_seed(0)
        self.inp = torch.nn.Linear(32, 64, device="cuda")
        self.moe = MoELayer(64, 96, 8, 2, capacity_factor=2.0, aux_loss_coeff=0.01, shared_expert_ffn_size=128,
                            device="cuda", overlap_shared_expert=True)
        self.out = torch.nn.Linear(64, 16, device="cuda")

    def forward(self, x, y):
        h = self.inp(x)
        return torch.nn.functional.cross_entropy(self.out(h + self.moe(h)), y)


@requires_cuda
@pytest.mark.parametrize("stages", [False, True], ids=["overlap", "interleave_stages"])
def test_cuda_overlapped_microbatches_in_one_graph(stages):
    """``make_train_step(..., overlap_microbatches=True)`` (``stages``: with ``interleave_stages=True`` too, the
    forwards then issued from the worker thread, into the capture) eager and captured in ``FullIterationGraph`` on one
    GPU: losses equal to the serial loop's (eager: bitwise, with the parameters), replays issue no sync, and no
    worker thread is left. (``interleave_stages``: written, not run on a GPU yet.)"""
    import threading

    from moe_graph.cuda_graph import FullIterationGraph
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.distributed.optimizer import DistributedOptimizer
    from moe_graph.train.step import make_train_step

    g = torch.Generator(device="cuda").manual_seed(1)
    data = [[(torch.randn(128, 32, device="cuda", generator=g), torch.randint(0, 16, (128,), device="cuda",
                                                                             generator=g)) for _ in range(3)]
            for _ in range(5)]
    steps, models = {}, {}
    for k in ("serial", "eager", "graph"):
        models[k] = DistributedDataParallel(_CudaModel(), use_distributed_optimizer=True)
        opt = DistributedOptimizer(models[k], lr=1e-3)
        step = make_train_step(models[k], opt, overlap_microbatches=k != "serial",
                               interleave_stages=stages and k != "serial")
        steps[k] = FullIterationGraph(step, warmup_steps=1) if k == "graph" else step
    losses = {k: [] for k in steps}
    for i, mbs in enumerate(data):
        for k, step in steps.items():
            if k == "graph" and i >= 2:  # warm-up and capture done: replays must not sync
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                losses[k].append(step(mbs).loss.clone())
            finally:
                torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert steps["graph"].captured()
    for a, b, c in zip(losses["serial"], losses["eager"], losses["graph"]):
        assert torch.equal(a, b)  # the streams change no arithmetic
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    for (n, pa), pb in zip(models["serial"].named_parameters(), models["eager"].parameters()):
        assert torch.equal(pa, pb), n
    assert [t for t in threading.enumerate() if t.name.startswith("moe_graph-interleave")] == []
