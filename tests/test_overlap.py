"""The shared expert and the router losses on a side stream beside the exchange (``overlap_shared_expert``), and the
stream structure as data (:mod:`moe_graph.streams`).

Oracle: the serial schedule (the same layer with the option off, itself tested against the plain references); the
side stream changes no arithmetic, so forward and every gradient must be bitwise equal. The record of a forward +
backward (:class:`moe_graph.streams.StreamRecorder`, from the code path that issues the CUDA stream switches and
events) must show the shared expert concurrent with dispatch and combine (no ordering, no data dependency) and every
cross-stream use joined; removing the fork's or the join's wait must make the checker report a race.
"""

import pytest
import torch

from conftest import requires_cuda
from helpers.steps import moe_block_step as _cuda_step
from helpers.overlap_workers import (EXCHANGE, SIDE, compare_worker, data_dependent, is_exchange, is_side, layer_pair,
                                     ops, ordered_pairs, run)
from moe_graph import streams
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.config import MoEConfig
from moe_graph.moe.layer import MoELayer
from moe_graph.streams import SideStream, StreamRecorder, unjoined_uses


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 7, 16, dtype=torch.float64, generator=g), torch.randn(2, 7, 16, dtype=torch.float64,
                                                                                 generator=g)


@pytest.mark.parametrize("overrides", [{}, {"recompute": True}, {"shared_expert_combine": "average"},
                                       {"num_spare_experts_per_ep_rank": 1}, {"aux_loss_type": "sequence"}],
                         ids=["plain", "recompute", "average", "echo1", "aux_sequence"])
def test_overlapped_equals_serial_bitwise(overrides):
    serial, overlapped = layer_pair(**overrides)
    x, target = _inputs()
    y0, g0, _ = run(serial, x, target)
    y1, g1, rec = run(overlapped, x, target, record=True)
    assert torch.equal(y0, y1)
    assert set(g0) == set(g1) and len(g0) >= 7  # x, router, experts fc1 / fc2, shared fc1 / fc2 / gate
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    assert torch.equal(serial.last_aux_loss, overlapped.last_aux_loss)
    assert torch.equal(serial.last_z_loss, overlapped.last_z_loss)
    assert unjoined_uses(rec.entries) == []


@pytest.mark.parametrize("recompute", [False, True])
def test_fp8_dispatch_overlapped_equals_serial_bitwise(recompute):
    """Under an FP8 recipe with the tokens dispatched in FP8 (and the shared expert's GEMMs in 16 bits)."""
    import moe_graph

    opts = dict(num_experts=4, topk=2, shared_expert_ffn_size=64, aux_loss_coeff=0.05, capacity_factor=None,
                fp8_dispatch=True, recompute=recompute, device="cpu")
    torch.manual_seed(3)
    serial = MoELayer(128, 64, **opts)
    overlapped = MoELayer(128, 64, overlap_shared_expert=True, **opts)
    overlapped.load_state_dict(serial.state_dict())
    g = torch.Generator().manual_seed(4)
    x, target = torch.randn(19, 128, generator=g), torch.randn(19, 128, generator=g)
    res = []
    for layer in (serial, overlapped):
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(recipe="blockwise"):
            y = layer(xx)
        (y * target).sum().backward()
        res.append((y.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    for n, gr in res[0][2].items():
        assert gr is not None and torch.equal(gr, res[1][2][n]), n


@pytest.mark.parametrize("recompute", [False, True])
def test_record_shows_the_shared_expert_beside_the_exchange(recompute):
    _, overlapped = layer_pair(recompute=recompute)
    x, target = _inputs()
    rec = run(overlapped, x, target, record=True)[2]
    for phase in ("forward", "backward") + (("recompute",) if recompute else ()):
        assert ops(rec, ("shared_expert",), phase) and ops(rec, EXCHANGE, phase), phase
        if phase != "backward":  # (in backward, the engine accumulates their input gradients on main: the join)
            assert all(o.stream == "moe_side" for o in ops(rec, SIDE, phase))
        assert all(o.stream == "main" for o in ops(rec, EXCHANGE, phase))
        assert ordered_pairs(rec, phase) == 0, phase  # concurrent with dispatch and combine in both directions
        side, exch = (lambda o: is_side(o) and o.phase == phase), (lambda o: is_exchange(o) and o.phase == phase)
        assert data_dependent(rec, side, exch) == [] and data_dependent(rec, exch, side) == [], phase
    events = [(e.kind, e.stream) for e in rec.entries if isinstance(e, streams.RecordedEvent)]
    assert events[:4] == [("record", "main"), ("wait", "moe_side"), ("record", "moe_side"), ("wait", "main")]
    if recompute:  # the recomputation in backward forks and joins again
        assert sum(e.event.endswith(".fork") for e in rec.entries if isinstance(e, streams.RecordedEvent)) == 4
    assert unjoined_uses(rec.entries) == []


def test_serial_record_orders_the_shared_expert_after_the_exchange():
    """The control: without the option every op is on the main stream, so the checks above see the shared expert
    ordered after dispatch and combine (they can fail)."""
    serial, _ = layer_pair()
    x, target = _inputs()
    rec = run(serial, x, target, record=True)[2]
    assert {o.stream for o in rec.ops} == {"main"}
    assert ordered_pairs(rec, "forward", None) == len(ops(rec, SIDE, "forward")) * len(ops(rec, EXCHANGE,
                                                                                          "forward")) > 0
    assert ordered_pairs(rec, "backward", None) > 0


def test_parameter_gradients_accumulate_on_the_main_stream():
    """Autograd runs a leaf's gradient accumulation and its post-accumulate hooks (DDP's ``main_grad`` add and
    bucket reduction launch) on the stream where its accumulator was made; the side stream uses views of the shared
    expert's parameters made on the main stream, so every hook runs there (without the views: on the side stream,
    where a reduction launched from the main stream would not wait for the add)."""
    _, overlapped = layer_pair()
    seen = {}
    for n, p in overlapped.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, streams.current_logical_stream()))
    x, target = _inputs()
    rec = run(overlapped, x, target, record=True)[2]
    assert seen and set(seen.values()) == {"main"}, seen
    assert any(n.startswith("shared_expert.") for n in seen)
    assert unjoined_uses(rec.entries) == []


@pytest.mark.parametrize("removed", ["fork", "join"])
def test_a_removed_wait_is_reported_as_a_race(monkeypatch, removed):
    real = SideStream._wait

    def wait(self, kind):
        if kind != removed:
            real(self, kind)

    monkeypatch.setattr(SideStream, "_wait", wait)
    _, overlapped = layer_pair()
    x, target = _inputs()
    rec = run(overlapped, x, target, record=True)[2]
    races = unjoined_uses(rec.entries)
    assert races
    producer, consumer = races[0]
    if removed == "fork":  # the side stream reads the input the main stream made
        assert (producer.stream, consumer.stream) == ("main", "moe_side")
    else:  # the main stream adds the shared expert's output before it is done
        assert (producer.stream, consumer.stream) == ("moe_side", "main") and producer.stage in SIDE


def test_a_false_dependency_is_reported():
    """Issuing the shared expert after the routed output exists (a dependency on combine) orders it after the
    exchange: the concurrency check fails."""
    _, overlapped = layer_pair()

    def serialized(side_fn, routed_fn, *inputs):
        routed = routed_fn()
        with overlapped.side.fork(routed, *inputs):
            side = side_fn()
        return overlapped.side.join(*side), routed

    overlapped._beside_exchange = serialized
    x, target = _inputs()
    rec = run(overlapped, x, target, record=True)[2]
    assert unjoined_uses(rec.entries) == []
    assert ordered_pairs(rec, "forward") > 0


def test_ep2_on_gloo_equals_serial_and_overlaps():
    results = run_distributed(compare_worker, 2, 3)
    for r in results:
        assert r["mismatch"] == [], r
        assert r["unjoined"] == 0 and r["ordered"] == {"forward": 0, "backward": 0}, r
        assert r["side_ops"] > 0 and r["exchange_ops"] > 0 and r["depends"] == 0, r


def test_config_option_and_stages():
    with pytest.raises(ValueError, match="overlap_shared_expert needs shared_expert_ffn_size"):
        MoEConfig(16, 12, 4, overlap_shared_expert=True)
    with pytest.raises(TypeError, match="overlap_shared_expert must be a bool"):
        MoEConfig(16, 12, 4, shared_expert_ffn_size=8, overlap_shared_expert=1)
    import dataclasses
    names = [f.name for f in dataclasses.fields(MoEConfig)]
    grouped = [n for v in MoEConfig.STAGES.values() for n in v]
    assert sorted(grouped) == sorted(names)  # every option in exactly one stage
    c = MoEConfig(16, 12, 4, shared_expert_ffn_size=8, overlap_shared_expert=True)
    assert c.stage_options("schedule") == {"recompute": False, "overlap_shared_expert": True}
    with pytest.raises(ValueError, match="stage must be one of"):
        c.stage_options("nope")
    layer = MoELayer(16, 12, 4, device="cpu", shared_expert_ffn_size=8, overlap_shared_expert=True)
    assert layer.side is not None and layer.side.stream is None  # CPU: no CUDA stream


def test_recorder_is_exclusive_and_stage_is_inert_without_it():
    with StreamRecorder():
        with pytest.raises(RuntimeError, match="already active"):
            with StreamRecorder():
                pass
    with streams.stage("x"):
        assert streams._current_stage() is None
    with pytest.raises(ValueError, match="name must be"):
        SideStream("cpu", "main")


# ------------------------------------------------------------------------------------------------- CUDA --
# Written for the GPU, not run on one yet: the overlapped step captured in one graph (the side stream joins the
# capture through the fork event), replayed with no host sync, equal to the eager serial model.
def _cuda_model(overlap: bool, recompute: bool):
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "inp": torch.nn.Linear(32, 64, device="cuda", dtype=torch.bfloat16),
        "moe": MoELayer(64, 96, 8, 2, capacity_factor=2.0, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                        shared_expert_ffn_size=128, shared_expert_gate=True, device="cuda", params_dtype=torch.bfloat16,
                        recompute=recompute, overlap_shared_expert=overlap),
        "out": torch.nn.Linear(64, 16, device="cuda", dtype=torch.bfloat16),
    })


@requires_cuda
@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_overlapped_step_in_one_graph_without_syncs(recompute):
    from moe_graph.cuda_graph import FullIterationGraph

    g = torch.Generator(device="cuda").manual_seed(1)
    data = [[{"x": torch.randn(128, 32, device="cuda", generator=g).bfloat16(),
              "y": torch.randint(0, 16, (128,), device="cuda", generator=g)} for _ in range(2)] for _ in range(6)]
    models = {k: _cuda_model(k != "serial", recompute) for k in ("serial", "eager", "graph")}
    opts = {}
    for k, m in models.items():
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opts[k] = torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True)
    serial, eager = _cuda_step(models["serial"], opts["serial"]), _cuda_step(models["eager"], opts["eager"])
    graph = FullIterationGraph(_cuda_step(models["graph"], opts["graph"]), warmup_steps=1, clone_outputs=True)
    ls, le, lg = [], [], []
    for i, mbs in enumerate(data):
        ls.append(serial(mbs))
        le.append(eager(mbs))
        if i >= 2:  # warm-up (under sync debug mode "error") and capture done: replays must not sync either
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            lg.append(graph(mbs))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert graph.captured()
    for a, b, c in zip(ls, le, lg):
        assert torch.equal(a, b)  # the side stream changes no arithmetic
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2)
    for (n, pa), pb, pc in zip(models["serial"].named_parameters(), models["eager"].parameters(),
                               models["graph"].parameters()):
        assert torch.equal(pa, pb), n
        torch.testing.assert_close(pa.float(), pc.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}: {m}")
