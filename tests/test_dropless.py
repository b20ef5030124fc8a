"""Dropless MoE training with a static capacity (``overflow="rerun"``).

What is checked, against oracles that do not use the code under test: the dispatcher's per-step drop count and
load ratio (counted here route by route in Python), the optimizer's overflow skip (parameters, Adam step and loss
scale unchanged; an inf step as the contrast halves the scale), a step that overflows on one EP rank only (every
rank skips, none waits), the eager rerun (equal to the same training with ``capacity_factor=None``, whose equality
to the single-process AdamW oracle the equivalence rows check), adaptive capacity, the statistics and state API,
the demo's dropless mode with a resumed run, the memory table of docs/training.md, and on a GPU the captured step with an
overflowing replay, the rerun and the next replay.
"""

import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import FullIterationGraph
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.launch import run_distributed
from moe_graph.distributed.optimizer import DistributedOptimizer, DynamicLossScaler
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, capacity_for, expert_columns, receive_buffer_bytes
from moe_graph.train.step import OverflowRerun, make_train_step, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, F, E, K = 8, 8, 4, 2


# ---------------------------------------------------------------------------------------------- dispatcher --
class _Loopback:
    """An "all-to-all" that hands every block back to its sender: enough to count what one rank sends."""

    def exchange(self, send):
        return send


@pytest.mark.parametrize("cap", [1, 3, 5, 40])
def test_dispatcher_counts_the_step_drops_and_the_load_ratio(cap, gen):
    R, L, T = 2, 2, 10
    col_rank, col_local = expert_columns(E, R)
    d = TokenDispatcher(L, R, 0, col_rank, col_local, capacity=cap, backend=_Loopback())
    steps = []
    for _ in range(3):  # three dispatches in one step (e.g. microbatches): the counters add up / take the max
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        idx[:4] = torch.tensor([0, 1])  # rank 0's experts get more
        d.dispatch(torch.randn(T, H, generator=gen), idx, torch.rand(T, K, generator=gen))
        per_dst = [0] * R
        for e in idx.reshape(-1).tolist():
            per_dst[e // L] += 1
        steps.append((sum(max(0, c - cap) for c in per_dst), max(per_dst) / (T * K / R)))
    assert int(d.step_dropped_routes) == sum(s[0] for s in steps)
    assert float(d.step_max_load_ratio) == pytest.approx(max(s[1] for s in steps), rel=1e-12)
    # the ratio is the capacity factor that fits every pair: capacity_for gives back the largest count
    assert capacity_for(T, K, R, float(d.step_max_load_ratio)) == round(max(s[1] for s in steps) * T * K / R)
    d.reset_step_counters()
    assert int(d.step_dropped_routes) == 0 and float(d.step_max_load_ratio) == 0.0
    assert int(d.dropped_routes) == sum(s[0] for s in steps)  # the cumulative statistic is kept


def test_receive_buffer_is_the_capacity_factor_times_the_mean_load():
    T, K_, Hs = 8192, 8, 2048
    for R in (8, 64):
        assert receive_buffer_bytes(T, K_, R, Hs, 1.25, torch.bfloat16) == R * math.ceil(1.25 * T * K_ / R) * Hs * 2
        assert receive_buffer_bytes(T, K_, R, Hs, None, torch.bfloat16) == R * T * K_ * Hs * 2
    with pytest.raises(ValueError, match="capacity_factor"):
        receive_buffer_bytes(T, K_, 8, Hs, -1.0, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- optimizer --
def _linear_opt(scaler=None):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 3), use_distributed_optimizer=True)
    return ddp, DistributedOptimizer(ddp, lr=0.1, loss_scaler=scaler)


def test_optimizer_skips_an_overflow_without_touching_the_loss_scaler():
    ddp, opt = _linear_opt(DynamicLossScaler(initial_scale=8.0, growth_interval=1, hysteresis=1))
    before = [p.detach().clone() for p in ddp.module.parameters()]
    ddp.zero_grad_buffer()
    (ddp(torch.ones(2, 4)).sum() * opt.loss_scale).backward()
    ok, norm = opt.step(overflow=torch.tensor(True))
    assert not bool(ok) and bool(opt.found_overflow) and float(norm) > 0
    assert all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    assert float(opt.step_count) == 0 and float(opt.loss_scale) == 8.0  # no Adam step, the scale neither grows nor backs off
    ddp.zero_grad_buffer()
    (ddp(torch.ones(2, 4)).sum() * opt.loss_scale).backward()
    ok, _ = opt.step(overflow=torch.tensor(False))
    assert bool(ok) and not bool(opt.found_overflow) and float(opt.step_count) == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))
    assert float(opt.loss_scale) == 16.0  # a good step grows it (growth_interval=1)
    ddp.zero_grad_buffer()
    (ddp(torch.full((2, 4), float("inf"))).sum()).backward()
    ok, _ = opt.step()  # the contrast: an inf/nan step backs the scale off
    assert not bool(ok) and not bool(opt.found_overflow) and float(opt.loss_scale) == 8.0
    with pytest.raises(ValueError, match="overflow"):
        opt.step(overflow=torch.ones(2))


# ------------------------------------------------------------------------------------------ the tiny model --
class TinyMoE(nn.Module):
    """x -> MoE -> squared error. Router rows of the experts on EP rank 0 point along ``u``: inputs shifted by
    ``s * u`` send more routes to rank 0 as ``s`` grows."""

    def __init__(self, capacity_factor, overflow="rerun", ep_size=1, ep_group=None, echo=0, device="cpu"):
        super().__init__()
        self.moe = MoELayer(H, F, E, K, capacity_factor=capacity_factor, overflow=overflow, ep_size=ep_size,
                            ep_group=ep_group, num_spare_experts_per_ep_rank=echo, device=device)

    def forward(self, x, y):
        return (self.moe(x) - y).square().mean()


def _u():
    u = torch.randn(H, generator=torch.Generator().manual_seed(3))
    return u / u.norm()


def _init(model: TinyMoE, ep_rank: int, ep: int):
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        w = torch.randn(E, H, generator=g) * 0.3
        w[: E // 2] += 2.0 * _u()
        model.moe.router.weight.copy_(w)
        L = E // ep  # the global [E, ...] expert weights, then this rank's slice
        for p in (model.moe.experts.fc1.weight, model.moe.experts.fc2.weight):
            full = torch.randn((E,) + tuple(p.shape[1:]), generator=g) * 0.3
            p.copy_(full[ep_rank * L:(ep_rank + 1) * L])


def _batch(step: int, rank: int, skew: float, T: int = 16):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(T, H, generator=g) + skew * _u(), torch.randn(T, H, generator=g))]


def _build(ep: int, cf, overflow="rerun", echo=0, scaler=None):
    ep_group = ps.get_expert_model_parallel_group() if ps.model_parallel_is_initialized() else None
    model = TinyMoE(cf, overflow, ep_size=ep, ep_group=ep_group, echo=echo)
    _init(model, ps.get_expert_model_parallel_rank() if ep > 1 else 0, ep)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True,
                                  data_parallel_group=ps.get_data_parallel_group() if ep > 1 else None,
                                  expert_data_parallel_group=ps.get_expert_data_parallel_group() if ep > 1 else None)
    opt = DistributedOptimizer(ddp, lr=1e-2, loss_scaler=scaler)
    return model, ddp, opt


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_floating_point(v)}


# --------------------------------------------------------------------------------- one rank overflows only --
def _one_rank_worker(rank, world):
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        model, ddp, opt = _build(world, 1.5, scaler=DynamicLossScaler(initial_scale=4.0))
        skew = 6.0 if rank == 0 else 0.0  # only rank 0 sends (nearly) every route to rank 0
        before = _params(model)
        res = train_step(ddp, opt, _batch(0, rank, skew), overflow="rerun")
        out = {"local": int(model.moe.dispatcher.step_dropped_routes), "overflowed": bool(res.overflowed),
               "skipped": bool(res.skipped), "unchanged": all(torch.equal(before[k], v) for k, v in _params(model).items()),
               "adam_steps": float(opt.step_count), "scale": float(opt.loss_scale)}
        runner = OverflowRerun(ddp, opt)
        res = runner.step(make_train_step(ddp, opt, overflow="rerun"), _batch(0, rank, skew))
        out.update(after=_params(model), reran=runner.statistics()["reruns"], rerun_skipped=bool(res.skipped),
                   rerun_overflowed=bool(res.overflowed), loss=float(res.loss))
        ref, ref_ddp, ref_opt = _build(world, None)  # the same step with capacity_factor=None: nothing overflows
        res = train_step(ref_ddp, ref_opt, _batch(0, rank, skew))
        out.update(ref_after=_params(ref), ref_loss=float(res.loss))
        return out
    finally:
        ps.destroy_model_parallel()


def test_an_overflow_on_one_rank_skips_the_update_on_every_rank_and_the_rerun_is_dropless():
    outs = run_distributed(_one_rank_worker, 2, timeout=120)
    assert outs[0]["local"] > 0 and outs[1]["local"] == 0, [o["local"] for o in outs]  # the premise
    for o in outs:  # every rank: overflowed, skipped, nothing applied, the loss scaler untouched
        assert o["overflowed"] and o["skipped"] and o["unchanged"], o
        assert o["adam_steps"] == 0.0 and o["scale"] == 4.0
        assert o["reran"] == 1 and not o["rerun_skipped"] and not o["rerun_overflowed"]
    for o in outs:
        assert o["loss"] == pytest.approx(o["ref_loss"], rel=1e-6)
        for k, v in o["ref_after"].items():
            torch.testing.assert_close(o["after"][k], v, rtol=1e-6, atol=1e-7, msg=k)


# -------------------------------------------------------------------------------------------- adaptive --
def _adaptive_worker(rank, world, steps, skew_from):
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        model, ddp, opt = _build(world, 1.3)
        with pytest.warns(UserWarning, match="running eagerly"):  # CPU: reset() then "captures" eagerly again
            graph = FullIterationGraph(make_train_step(ddp, opt, overflow="rerun"), warmup_steps=1, enabled=False)
        resets = []
        real_reset = graph.reset
        graph.reset = lambda *a: (resets.append(runner.steps), real_reset(*a))
        runner = OverflowRerun(ddp, opt, window=4, threshold=0.25, margin=0.1)
        reran, cf = [], []
        for s in range(steps):
            before = runner.reruns
            runner.step(graph, _batch(s, rank, 0.0 if s < skew_from else 1.5, T=64))  # load ratio ~1.1 -> ~1.75
            reran.append(runner.reruns > before)
            cf.append(runner.capacity_factor)
        return {"reran": reran, "cf": cf, "resets": resets, "stats": runner.statistics(),
                "state": runner.state_dict(), "iteration": graph.iteration()}
    finally:
        ps.destroy_model_parallel()


def test_adaptive_capacity_rises_when_routing_skews_recaptures_and_stops_rerunning():
    steps, skew_from = 16, 4
    outs = run_distributed(_adaptive_worker, 2, steps, skew_from, timeout=180)
    o = outs[0]
    assert outs[1]["reran"] == o["reran"] and outs[1]["cf"] == o["cf"]  # job-wide decisions
    assert not any(o["reran"][:skew_from]), o["reran"]  # balanced routing fits capacity factor 1.3
    assert any(o["reran"][skew_from:skew_from + 4]), o["reran"]  # the skew overflows
    assert len(o["resets"]) >= 1 and o["stats"]["recaptures"] == len(o["resets"])
    assert min(o["cf"]) >= 1.3 and o["cf"][-1] > 1.6  # raised, never below the user's setting
    last = o["resets"][-1]
    assert not any(o["reran"][last:]), (o["reran"], o["resets"])  # no rerun after the last raise
    st = o["stats"]
    assert st["steps"] == steps and st["reruns"] == sum(o["reran"]) and st["capacity_factor"] == o["cf"][-1]
    assert st["user_capacity_factor"] == 1.3 and st["rerun_rate"] == pytest.approx(st["reruns"] / steps)


def test_rerun_state_restores_the_adapted_capacity_never_below_the_setting():
    model, ddp, opt = _build(1, 0.9)
    runner = OverflowRerun(ddp, opt)
    state = dict(runner.state_dict(), capacity_factor=1.7, reruns=5, steps=50)
    fresh = OverflowRerun(ddp, opt)
    fresh.load_state_dict(state)
    assert model.moe.capacity_factor == 1.7 and fresh.statistics()["reruns"] == 5
    model2, ddp2, opt2 = _build(1, 2.0)
    other = OverflowRerun(ddp2, opt2)
    other.load_state_dict(state)
    assert model2.moe.capacity_factor == 2.0  # the user's own setting wins when it is higher
    for bad, match in (({"window": 0}, "window"), ({"threshold": 1.5}, "threshold"), ({"margin": -1}, "margin"),
                       ({"overflow": "drop"}, "overflow")):
        with pytest.raises(ValueError, match=match):
            OverflowRerun(ddp, opt, **bad)
    with pytest.raises(ValueError, match="overflow"):
        MoELayer(H, F, E, K, overflow="sometimes", device="cpu")
    with pytest.raises(ValueError, match="overflow"):
        train_step(ddp, opt, _batch(0, 0, 0.0), overflow="never")


# ------------------------------------------------------------------------ capture, overflow, rerun, replay --
def _padded(step: int, overflow: bool, device, T: int = 32):
    """A batch with (nearly) no padding (every route counts: overflows capacity factor 0.6 on one rank) or with
    half of the tokens padding (fits)."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[: (2 if overflow else T // 2)] = True
    return [(x.to(device), y.to(device), pad.to(device))]


class PaddedMoE(TinyMoE):
    def forward(self, x, y, pad):
        return ((self.moe(x, padding_mask=pad) - y).square().sum(-1) * (~pad)).mean()


def _single(cf, device):
    model = PaddedMoE(cf, device=device)
    _init(model, 0, 1)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    return model, ddp, DistributedOptimizer(ddp, lr=1e-2)


def _capture_overflow_rerun_replay(device):
    model, ddp, opt = _single(0.6, device)
    ref, ref_ddp, ref_opt = _single(None, device)  # dropless: capacity T*K
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU: "running eagerly"
        graph = FullIterationGraph(make_train_step(ddp, opt, overflow="rerun"), warmup_steps=2,
                                   enabled=device.type == "cuda")
    runner = OverflowRerun(ddp, opt, threshold=None)
    pattern = [False, False, False, True, False, True, False]  # warm-up, warm-up, capture, overflow, replay, ...
    for s, over in enumerate(pattern):
        res = runner.step(graph, _padded(s, over, device))
        want = train_step(ref_ddp, ref_opt, _padded(s, over, device), overflow="rerun")
        assert not bool(want.overflowed)
        assert float(res.loss) == pytest.approx(float(want.loss), rel=1e-5), s
        for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            if torch.is_floating_point(a):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {s}: {k}")
    assert runner.statistics()["reruns"] == sum(pattern)
    return graph


def test_overflowing_step_reruns_between_steps_eagerly_on_cpu():
    graph = _capture_overflow_rerun_replay(torch.device("cpu"))
    assert not graph.captured()


@requires_cuda
def test_capture_overflowing_replay_rerun_replay_again_cuda():
    graph = _capture_overflow_rerun_replay(torch.device("cuda"))
    assert graph.captured()


def test_rerun_mode_step_has_no_data_dependent_ops():
    """CPU proxy for "no host sync in the captured step": the rerun-mode step (per-step counters, the flag in the
    optimizer's all-reduce, the skipped update) runs under FakeTensorMode, where .item()/nonzero()/mask indexing or
    a data-dependent shape raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, ddp, opt = _build(1, 0.6)
    step = make_train_step(ddp, opt, overflow="rerun")
    res = step(_batch(0, 0, 0.0))
    assert bool(res.overflowed) and bool(res.skipped)  # capacity factor 0.6 with one rank: every step overflows
    with FakeTensorMode(allow_non_fake_inputs=True):
        res = step(_batch(1, 0, 0.0))
        assert res.overflowed.shape == () and res.overflowed.dtype == torch.bool


# ----------------------------------------------------------------------------------------------- the demo --
def _demo(tmp_path, name, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "moe_graph.demo", "--quick", "--device", "cpu", "--spare", "0",
                           "--capacity", "1.0", "--rerun-window", "8", "--rerun-threshold", "0.2", "--log-every", "1",
                           "--out", str(out), *extra], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    return proc.stdout, metrics, json.load(open(out / "demo_summary.json"))


def test_demo_dropless_mode_reports_reruns_and_a_resumed_run_keeps_the_adapted_capacity(tmp_path):
    ck = tmp_path / "ck"
    out, metrics, s = _demo(tmp_path, "first", "--steps", "24", "--save", str(ck))
    assert s["config"]["overflow"] == "rerun"  # the default
    d = s["dropless"]
    assert d["reruns"] > 0 and d["steps"] == 24 and d["user_capacity_factor"] == 1.0, d
    assert d["capacity_factor"] > 1.0 and d["recaptures"] >= 1, d
    assert "reran" in out and "capacity factor" in out
    for key in ("reran", "reruns", "rerun_rate", "capacity_factor"):
        assert all(key in m for m in metrics), key
    assert sum(m["reran"] for m in metrics) == d["reruns"]
    assert not any(m["skipped"] for m in metrics)  # every overflowed step was rerun and applied
    out2, metrics2, s2 = _demo(tmp_path, "resumed", "--steps", "28", "--load", str(ck))
    assert metrics2[0]["step"] == 25 and metrics2[0]["capacity_factor"] == pytest.approx(d["capacity_factor"])
    assert s2["dropless"]["reruns"] >= d["reruns"]


# ------------------------------------------------------------------------------------------------ docs --
def test_docs_document_the_mode_and_its_memory_table():
    assert "`overflow` drop / rerun" in open(os.path.join(ROOT, "README.md")).read()
    text = open(os.path.join(ROOT, "docs", "training.md")).read()
    m = re.search(r"<!-- dropless-memory[^>]*-->(.*?)<!-- /dropless-memory -->", text, re.S)
    assert m, "docs/training.md lost its dropless memory table"
    rows = [r for r in m.group(1).splitlines() if r.startswith("|") and re.search(r"\d", r.split("|")[1])]
    assert len(rows) >= 4
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        model, ep, hidden = cells[0], int(cells[1]), {"Qwen3-30B-A3B": 2048, "DeepSeek-V3": 7168}
        h = next(v for k, v in hidden.items() if k in model)
        f = {2048: 768, 7168: 2048}[h]
        acts = [float(c.replace(",", "")) for c in cells[5].split("/")]
        for cell, act, cf in zip(cells[2:5], acts, (1.0, 1.25, None)):
            mib = receive_buffer_bytes(8192, 8, ep, h, cf, torch.bfloat16) / 2**20
            assert float(cell.split()[0].replace(",", "")) == pytest.approx(mib, rel=1e-3), (r, cf)
            assert act == pytest.approx(receive_buffer_bytes(8192, 8, ep, 3 * f, cf, torch.bfloat16) / 2**20, rel=1e-3)
    for phrase in ('overflow="rerun"', "FullIterationGraph.reset()", "capacity_factor=None"):
        assert phrase in text, phrase


# ------------------------------------------------------------------------------- fixes of the documented API --
def test_the_rerun_uses_the_step_functions_keywords_and_refuses_different_ones():
    # a hand-written loop that gives loss_func to make_train_step only: the rerun computes the same loss
    loss_func = lambda out: 3.0 * out  # noqa: E731
    model, ddp, opt = _single(0.6, torch.device("cpu"))
    ref, ref_ddp, ref_opt = _single(None, torch.device("cpu"))
    runner = OverflowRerun(ddp, opt, threshold=None)
    step = make_train_step(ddp, opt, overflow="rerun", loss_func=loss_func)
    res = runner.step(step, _padded(0, True, torch.device("cpu")))
    want = train_step(ref_ddp, ref_opt, _padded(0, True, torch.device("cpu")), loss_func=loss_func)
    assert runner.statistics()["reruns"] == 1
    assert float(res.loss) == pytest.approx(float(want.loss), rel=1e-6)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        if torch.is_floating_point(a):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    other = OverflowRerun(ddp, opt, loss_func=lambda out: out)
    with pytest.raises(ValueError, match="loss_func"):
        other.step(step, _padded(1, True, torch.device("cpu")))


def test_drop_mode_step_counters_hold_one_step():
    model, ddp, opt = _single(0.6, torch.device("cpu"))
    model.moe.overflow = "drop"
    d = model.moe.dispatcher
    for s in range(3):
        before = int(d.dropped_routes)
        train_step(ddp, opt, _padded(s, True, torch.device("cpu")))
        step_drops = int(d.dropped_routes) - before
        assert step_drops > 0 and int(d.step_dropped_routes) == step_drops, s  # not accumulated across steps


def test_adapted_capacity_never_passes_the_factor_where_every_route_fits():
    model, ddp, opt = _build(1, 0.9)
    runner = OverflowRerun(ddp, opt, window=2, threshold=0.1)
    runner.recent.extend([True, True])
    runner.max_load_ratio = 5.0  # e.g. a skewed window: 5.0 * 1.1 would be asked for
    runner._adapt(step_fn=None)
    assert model.moe.capacity_factor == 1.0 == model.moe.num_ep_ranks  # at R every route fits
    assert runner.statistics()["capacity_factor"] == 1.0
