"""moe_graph.train.schedules: schedule orders (hand-derived, simulated for deadlock freedom), errors, layer
assignment, CLI, and gloo multi-process runs checking losses and gradients against the unsplit model."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from conftest import full_only
from moe_graph.train import p2p
from moe_graph.train import schedules
from moe_graph.train.schedules import num_warmup_microbatches, schedule_order


def fmt(order):
    return " ".join(schedules.format_step(s) for s in order)


# ---------------------------------------------------------------- hand-derived orders


def test_no_pipelining_order():
    assert fmt(schedule_order(3, 1, 0)) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert fmt(schedule_order(3, 1, 0, forward_only=True)) == "F0.0 F1.0 F2.0"
    assert num_warmup_microbatches(3, 1, 0) == 0


def test_1f1b_orders():
    # pp 4, m 8: rank r warms up with 3 - r forwards
    assert fmt(schedule_order(8, 4, 0)) == (
        "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 F6.0 B3.0 F7.0 B4.0 B5.0 B6.0 B7.0")
    assert fmt(schedule_order(8, 4, 2)) == (
        "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 F4.0 B3.0 F5.0 B4.0 F6.0 B5.0 F7.0 B6.0 B7.0")
    assert fmt(schedule_order(8, 4, 3)) == " ".join(f"F{i}.0 B{i}.0" for i in range(8))
    # fewer microbatches than stages: warm-up is capped at m
    assert fmt(schedule_order(2, 4, 0)) == "F0.0 F1.0 B0.0 B1.0"
    assert [num_warmup_microbatches(8, 4, r) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(2, 4, r) for r in range(4)] == [2, 2, 1, 0]
    # pp 2: rank 0 warms up with one forward, then alternates one forward and one backward
    assert fmt(schedule_order(4, 2, 0)) == "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0"
    assert fmt(schedule_order(4, 2, 0, forward_only=True)) == "F0.0 F1.0 F2.0 F3.0"


def test_interleaved_orders():
    # pp 2, vpp 2, m 4 (group 2): virtual microbatches (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)
    assert fmt(schedule_order(4, 2, 0, vpp_size=2)) == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0")
    assert fmt(schedule_order(4, 2, 1, vpp_size=2)) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0")
    # pp 4, vpp 2, m 8, rank 0: warm-up 2*3 + 1*4 = 10
    assert fmt(schedule_order(8, 4, 0, vpp_size=2)) == (
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 "
        "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 "
        "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0")
    assert [num_warmup_microbatches(8, 4, r, vpp_size=2) for r in range(4)] == [10, 8, 6, 4]
    # m == pp: everything is warm-up on rank 0 (2*3 + 4 = 10 > 8)
    assert num_warmup_microbatches(4, 4, 0, vpp_size=2) == 8
    assert fmt(schedule_order(4, 4, 0, vpp_size=2)) == (
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0")


def test_interleaved_group_size():
    # Megatron's documented example: PP2 VP2 with groups of 3 and m 5
    assert schedules.get_schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0),
                                              (3, 1), (4, 1)]
    # warm-up 2*(2-0-1) + (2-1)*3 = 5 on rank 0
    assert num_warmup_microbatches(5, 2, 0, 2, 3) == 5
    assert fmt(schedule_order(5, 2, 0, 2, 3)) == (
        "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B0.1 F3.0 B1.1 F4.0 B2.1 F3.1 B0.0 F4.1 B1.0 B2.0 B3.1 B4.1 B3.0 B4.0")
    # vpp 1 is a legal interleaved schedule with the interleaved warm-up (2 * (pp - rank - 1))
    assert num_warmup_microbatches(4, 2, 0, 1) == 2
    assert fmt(schedule_order(4, 2, 0, 1)) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0"


# ---------------------------------------------------------------- properties + simulation

CONFIGS = [
    (m, pp, vpp, g)
    for pp in (2, 3, 4)
    for vpp in (None, 2, 3)
    for m in range(1, 11)
    for g in ((None,) if vpp is None else (None, pp + 1))
    if vpp is None or (pp <= (g or pp) <= m and not 0 < m % (g or pp) < pp)
]


def _simulate(m, pp, vpp, g, forward_only=False, fwd_cost=1, bwd_cost=2):
    """Execute every rank's order as early as dependencies allow; return the makespan.

    Virtual stage s = chunk * pp + rank. F(mb, s) needs F(mb, s - 1); B(mb, s) needs F(mb, s) and
    B(mb, s + 1) (the last virtual stage's backward follows its own forward). Raises on deadlock.
    """
    nc = vpp or 1
    nstages = pp * nc
    orders = [schedule_order(m, pp, r, vpp, g, forward_only) for r in range(pp)]
    done = {}
    pos = [0] * pp
    clock = [0] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            f, mb, c = orders[r][pos[r]]
            s = c * pp + r
            deps = []
            if f:
                if s > 0:
                    deps.append((True, mb, s - 1))
            else:
                deps.append((True, mb, s))
                if s < nstages - 1:
                    deps.append((False, mb, s + 1))
            if all(d in done for d in deps):
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + (fwd_cost if f else bwd_cost)
                done[(f, mb, s)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"schedule deadlocks: m={m} pp={pp} vpp={vpp} g={g} at {pos}")
    return max(clock)


@pytest.mark.parametrize("m,pp,vpp,g", CONFIGS)
def test_schedule_properties(m, pp, vpp, g):
    nc = vpp or 1
    for r in range(pp):
        order = schedule_order(m, pp, r, vpp, g)
        fwd = [(mb, c) for f, mb, c in order if f]
        bwd = [(mb, c) for f, mb, c in order if not f]
        every = sorted((mb, c) for mb in range(m) for c in range(nc))
        assert sorted(fwd) == every and sorted(bwd) == every
        w = num_warmup_microbatches(m, pp, r, vpp, g)
        first_b = next(i for i, s in enumerate(order) if not s[0])
        # W warm-up forwards, then the steady state starts with one more forward before the first backward
        assert first_b == (w + 1 if w < m * nc else m * nc)
        for mb in range(m):
            for c in range(nc):
                assert order.index((True, mb, c)) < order.index((False, mb, c))
            # forward visits chunks in order, backward in reverse
            assert [c for f, b, c in order if f and b == mb] == list(range(nc))
            assert [c for f, b, c in order if not f and b == mb] == list(range(nc))[::-1]
        # each chunk sees microbatches in increasing order (FIFO activation queues)
        for c in range(nc):
            assert [b for f, b, cc in order if f and cc == c] == list(range(m))
            assert [b for f, b, cc in order if not f and cc == c] == list(range(m))
    # the per-rank orders fit together: a dependency-respecting execution exists
    _simulate(m, pp, vpp, g)
    _simulate(m, pp, vpp, g, forward_only=True)


def test_forward_only_orders():
    for m, pp, vpp, g in CONFIGS[::7]:
        for r in range(pp):
            fo = schedule_order(m, pp, r, vpp, g, forward_only=True)
            table = schedules.get_schedule_table(m, vpp or 1, g or pp) if vpp else [(i, 0) for i in range(m)]
            assert fo == [(True, mb, c) for mb, c in table]
            assert num_warmup_microbatches(m, pp, r, vpp, g, forward_only=True) == m * (vpp or 1)


def test_interleaving_shrinks_simulated_bubble():
    # unit-cost simulation: the bubble of 1F1B is (pp-1)(f+b); interleaving divides it by vpp
    m, pp = 8, 4
    t1 = _simulate(m, pp, None, None)
    assert t1 == (m + pp - 1) * 3
    t2 = _simulate(m, pp, 2, None, fwd_cost=0.5, bwd_cost=1.0)  # chunks have half the layers
    assert t2 < t1
    assert t2 == pytest.approx(m * 3 + (pp - 1) * 3 / 2)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args,match",
    [
        ((6, 4, 0, 2), r"6 % microbatch_group_size_per_vp_stage=4 = 2"),
        ((3, 4, 0, 2), r"must lie in \[pp_size=4, num_microbatches=3\]"),
        ((8, 4, 0, 2, 3), r"microbatch_group_size_per_vp_stage=3"),
        ((8, 4, 0, 2, 9), r"\[pp_size=4, num_microbatches=8\]"),
        ((7, 2, 0, 2, 3), r"7 % microbatch_group_size_per_vp_stage=3 = 1"),
        ((4, 1, 0, 2), r"needs pp_size > 1"),
        ((4, 2, 2), r"pp_rank 2 out of range"),
        ((0, 2, 0), r"num_microbatches must be an int >= 1"),
        ((4, 2, 0, 0), r"vpp_size must be an int >= 1"),
    ],
)
def test_schedule_errors(args, match):
    with pytest.raises(ValueError, match=match):
        schedule_order(*args)
    with pytest.raises(ValueError, match=match):
        num_warmup_microbatches(*args)


def test_schedule_functions_reject_bad_configs_before_communicating():
    comm = p2p.P2PCommunicator(rank=0, world_size=4, prev_rank=3, next_rank=1)
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    cfg = schedules.PipelineConfig(tensor_shape=(2,))
    with pytest.raises(ValueError, match="6 % microbatch_group_size"):
        schedules.forward_backward_pipelining_with_interleaving(forward_step_func=None, data_iterator=[None, None],
                                                        model=chunks, num_microbatches=6, config=cfg,
                                                        communicator=comm)
    with pytest.raises(ValueError, match="one data iterator per model chunk"):
        schedules.forward_backward_pipelining_with_interleaving(forward_step_func=None, data_iterator=[None], model=chunks,
                                                        num_microbatches=8, config=cfg, communicator=comm)
    with pytest.raises(ValueError, match="takes one model chunk"):
        schedules.forward_backward_pipelining_without_interleaving(forward_step_func=None, data_iterator=None, model=chunks,
                                                           num_microbatches=8, config=cfg, communicator=comm)
    with pytest.raises(ValueError, match="tensor_shape"):
        schedules.forward_backward_pipelining_without_interleaving(forward_step_func=None, data_iterator=None,
                                                           model=chunks[0], num_microbatches=8, communicator=comm)


def test_get_forward_backward_func():
    assert schedules.get_forward_backward_func(1) is schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(4) is schedules.forward_backward_pipelining_without_interleaving
    assert schedules.get_forward_backward_func(4, 2) is schedules.forward_backward_pipelining_with_interleaving
    assert schedules.get_forward_backward_func() is schedules.forward_backward_no_pipelining  # parallel_state not initialized


# ---------------------------------------------------------------- layer assignment


def test_layer_assignment():
    # 8 layers, pp 2, vpp 2: stage 0 holds [0, 1] and [4, 5]; stage 1 [2, 3] and [6, 7]
    assert schedules.chunk_layer_ids(8, 2, 0, 2) == [[0, 1], [4, 5]]
    assert schedules.chunk_layer_ids(8, 2, 1, 2) == [[2, 3], [6, 7]]
    # 16 layers, pp 4, vpp 2 (1-based in Megatron's docstring: GPU 0 [1, 2] [9, 10], GPU 3 [7, 8] [15, 16])
    assert schedules.chunk_layer_ids(16, 4, 0, 2) == [[0, 1], [8, 9]]
    assert schedules.chunk_layer_ids(16, 4, 3, 2) == [[6, 7], [14, 15]]
    # 8 layers, pp 2, vpp 4: one layer per chunk, [0] [2] [4] [6] on stage 0
    assert schedules.chunk_layer_ids(8, 2, 0, 4) == [[0], [2], [4], [6]]
    assert schedules.chunk_layer_ids(8, 2, 1) == [[4, 5, 6, 7]]
    assert schedules.get_layer_offset(16, 4, 2, 2, 1) == 8 + 4
    assert schedules.get_num_layers_per_chunk(16, 4, 2) == 2
    all_ids = sorted(i for r in range(4) for ch in schedules.chunk_layer_ids(24, 4, r, 3) for i in ch)
    assert all_ids == list(range(24))
    with pytest.raises(ValueError, match=r"num_layers=10 is not divisible by pp_size\*vpp_size = 2\*2 = 4"):
        schedules.chunk_layer_ids(10, 2, 0, 2)
    with pytest.raises(ValueError, match="vpp_rank 2 out of range"):
        schedules.get_layer_offset(8, 2, 0, 2, 2)


# ---------------------------------------------------------------- CLI


def test_cli(capsys):
    assert schedules.main(["--pp", "4", "--vpp", "2", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pp=4 vpp=2 microbatches=8 ideal bubble fraction=0.188"
    assert lines[1] == "rank 0 (warmup 10): " + fmt(schedule_order(8, 4, 0, 2))
    assert lines[4].startswith("rank 3 (warmup 4): F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1")
    assert len(lines) == 5


def test_cli_subprocess_error():
    env = dict(os.environ)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "python"))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "moe_graph.train.schedules", "--pp", "4", "--vpp", "2", "--microbatches", "6"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2
    assert "last microbatch group must be empty or hold at least pp_size=4" in res.stderr


# ---------------------------------------------------------------- the model used by the real runs

H = 6      # hidden width
B = 3      # rows per microbatch


class Chunk(torch.nn.Module):
    """Consecutive layers ``tanh(W x + b)`` of the full model, with Megatron's chunk interface."""

    def __init__(self, layers, chunk_id, log):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.input_tensor = None
        self.sync_enabled = True
        self.chunk_id = chunk_id
        self.layers[0].weight.register_hook(lambda g: log.append((self.chunk_id, self.sync_enabled)))

    def set_input_tensor(self, t):
        self.input_tensor = t

    @contextlib.contextmanager
    def no_sync(self):
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def forward(self, x):
        h = self.input_tensor if self.input_tensor is not None else x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def build_layers(num_layers, seed):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        lin = torch.nn.Linear(H, H)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(H, H, generator=g) * 0.5)
            lin.bias.copy_(torch.randn(H, generator=g) * 0.1)
        layers.append(lin)
    return layers


def make_data(m, seed):
    """``m`` microbatches ``(microbatch_id, x, target)``; the id lets the step functions observe the order."""
    g = torch.Generator().manual_seed(seed + 1000)
    return [(i, torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)) for i in range(m)]


class _ObserveBackward(torch.autograd.Function):
    """Identity (a copy, so that the output owns its storage) whose backward appends ``step`` to ``log``.

    Put on a chunk's output, it records the moment the real autograd backward reaches that chunk.
    """

    @staticmethod
    def forward(ctx, x, log, step):
        ctx.log, ctx.step = log, step
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.step)
        return grad, None, None


def make_forward_step(observed, produced=None):
    """``forward_step_func`` that appends ``(True, mb, chunk)`` to ``observed`` when it runs and makes the
    autograd backward of the chunk's output append ``(False, mb, chunk)``: the executed order as it happens."""

    def forward_step_func(data_iterator, model):
        chunk = getattr(model, "module", model)  # DistributedDataParallel wraps the chunk
        mb, x, y = next(data_iterator)
        observed.append((True, mb, chunk.chunk_id))
        out = _ObserveBackward.apply(model(x), observed, (False, mb, chunk.chunk_id))
        if produced is not None:
            produced.append((chunk.chunk_id, out))
        return out, (lambda o: torch.nn.functional.mse_loss(o, y))

    return forward_step_func


def printed_order(m, pp, pp_rank, vpp=None, group=None, forward_only=False):
    """This rank's steps as ``python -m moe_graph.train.schedules`` prints them (``format_schedule``)."""
    line = schedules.format_schedule(m, pp, vpp, group, forward_only).splitlines()[pp_rank]
    return line.split(": ", 1)[1].split()


def reference(num_layers, m, seed):
    layers = build_layers(num_layers, seed)
    data = make_data(m, seed)
    losses = []
    for _, x, y in data:
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        loss = torch.nn.functional.mse_loss(h, y)
        (loss / m).backward()
        losses.append(loss.item())
    return losses, [(l.weight.grad.clone(), l.bias.grad.clone()) for l in layers]


def run_config(pp, pp_rank, vpp, m, seed, *, group=None, batch_p2p=True, forward_only=False, grad_sync=False,
               deallocate=True, communicator=None):
    """Run one pipelined step on this rank; return what the parent checks."""
    nc = vpp or 1
    num_layers = 2 * pp * nc
    layers = build_layers(num_layers, seed)
    ids = schedules.chunk_layer_ids(num_layers, pp, pp_rank, vpp)
    log = []
    chunks = [Chunk([layers[i] for i in chunk_ids], c, log) for c, chunk_ids in enumerate(ids)]
    data = make_data(m, seed)
    sync_calls = []
    trace = []
    observed = []
    cfg = schedules.PipelineConfig(tensor_shape=(B, H), batch_p2p_comm=batch_p2p, microbatch_group_size_per_vp_stage=group,
                           deallocate_pipeline_outputs=deallocate, trace=trace,
                           grad_sync_func=(lambda params: sync_calls.append(sorted(id(p) for p in params)))
                           if grad_sync else None)
    fn = schedules.get_forward_backward_func(pp, vpp)
    produced = []  # (chunk id, stage output) to check deallocation after send
    fstep = make_forward_step(observed, produced)
    kwargs = dict(forward_step_func=fstep, num_microbatches=m, forward_only=forward_only, config=cfg,
                  tensor_shape=(B, H), communicator=communicator)
    if vpp is None:
        out = fn(data_iterator=iter(data), model=chunks[0], **kwargs)
    else:
        out = fn(data_iterator=[iter(data) for _ in range(nc)], model=chunks, **kwargs)
    grads = {}
    for chunk_ids, ch in zip(ids, chunks):
        for i, layer in zip(chunk_ids, ch.layers):
            if layer.weight.grad is not None:
                # plain lists: tensors returned from worker processes would travel as shared fds
                grads[i] = (layer.weight.grad.tolist(), layer.bias.grad.tolist())
    chunk_param_ids = [sorted(id(p) for p in ch.parameters()) for ch in chunks]
    return {
        "losses": [float(l) for l in out],
        "grads": grads,
        "trace": [tuple(s) for s in trace],
        "observed": observed,
        "printed": printed_order(m, pp, pp_rank, vpp, group, forward_only),
        "sync_log": log,
        "sync_calls": [chunk_param_ids.index(c) if c in chunk_param_ids else -1 for c in sync_calls],
        "num_layers": num_layers,
        "output_numels": [(c, o.numel()) for c, o in produced],
    }


def test_no_pipelining_single_process():
    for m in (1, 4):
        res = run_config(1, 0, None, m, seed=7)
        ref_losses, ref_grads = reference(res["num_layers"], m, 7)
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        for i, (gw, gb) in res["grads"].items():
            torch.testing.assert_close(torch.tensor(gw), ref_grads[i][0])
            torch.testing.assert_close(torch.tensor(gb), ref_grads[i][1])
        assert len(res["grads"]) == res["num_layers"]
        _check_observed_order(res, "pp1", 0)
        # gradient reduction only in the last microbatch's backward
        assert [e for _, e in res["sync_log"]] == [False] * (m - 1) + [True]
    res = run_config(1, 0, None, 3, seed=7, forward_only=True)
    assert res["grads"] == {} and len(res["losses"]) == 3 and res["sync_log"] == []
    _check_observed_order(res, "pp1 forward_only", 0)
    assert res["printed"] == ["F0.0", "F1.0", "F2.0"]


def test_p2p_communicator_static_buffers():
    comm = p2p.P2PCommunicator(rank=1, world_size=2, prev_rank=0, next_rank=0, device="cpu")
    a = comm._recv_buffer("fwd", (2, 3), torch.float32)
    b = comm._recv_buffer("fwd", (2, 3), torch.float32)
    c = comm._recv_buffer("bwd", (2, 3), torch.float32)
    assert a is not b and a.requires_grad and not c.requires_grad
    comm.reset_buffers()
    assert comm._recv_buffer("fwd", (2, 3), torch.float32) is a  # same place, next iteration
    assert comm._recv_buffer("fwd", (2, 3), torch.float32) is b
    assert comm.num_buffers() == 3
    assert comm.recv_forward((2, 3), torch.float32, is_first_stage=True) is None
    comm.send_forward(None)  # nothing to send: no communication at all


# ---------------------------------------------------------------- real multi-process runs

PP2_CONFIGS = [
    dict(vpp=None, m=1), dict(vpp=None, m=3), dict(vpp=None, m=5, batch_p2p=False),
    dict(vpp=None, m=4, grad_sync=True), dict(vpp=None, m=3, forward_only=True),
    dict(vpp=None, m=2, deallocate=False),
    dict(vpp=2, m=2), dict(vpp=2, m=4), dict(vpp=2, m=6, batch_p2p=False), dict(vpp=2, m=5, group=3),
    dict(vpp=2, m=4, grad_sync=True), dict(vpp=2, m=4, forward_only=True), dict(vpp=3, m=4),
    dict(vpp=1, m=4),
]
PP4_CONFIGS = [
    dict(vpp=None, m=1), dict(vpp=None, m=3), dict(vpp=None, m=6), dict(vpp=None, m=4, batch_p2p=False),
    dict(vpp=2, m=4), dict(vpp=2, m=8), dict(vpp=2, m=9, group=5), dict(vpp=2, m=8, batch_p2p=False),
    dict(vpp=2, m=8, grad_sync=True), dict(vpp=1, m=8),
]


def _p2p_checks(rank):
    """Module-level p2p helpers on the default (parallel_state) communicator, pp 2."""
    stage = p2p.get_default_communicator().rank
    shape = (2, 3)
    val = lambda tag: torch.full(shape, float(100 * tag + 10 * stage + rank % 2))  # noqa: E731
    got = {}
    if stage == 0:
        p2p.send_forward(val(1))
        got["recv_backward"] = p2p.recv_backward(shape).tolist()
        got["send_forward_recv_backward"] = p2p.send_forward_recv_backward(val(2), shape).tolist()
        assert p2p.recv_forward(shape) is None  # first stage: nothing to receive
    else:
        got["recv_forward"] = p2p.recv_forward(shape).tolist()
        p2p.send_backward(val(1))
        got["send_backward_recv_forward"] = p2p.send_backward_recv_forward(val(2), shape).tolist()
        assert p2p.recv_backward(shape) is None  # last stage
    # both neighbours are the same rank with pp 2: activations and gradients must not swap
    for batch in (True, False):
        comm = p2p.get_default_communicator(batch_p2p_comm=batch)
        x, dy = p2p.send_forward_backward_recv_forward_backward(val(3), val(4), True, True, shape, communicator=comm)
        got[f"both_{batch}"] = (x.tolist(), dy.tolist())
        x = p2p.send_forward_recv_forward(val(5), True, shape, communicator=comm)
        dy = p2p.send_backward_recv_backward(val(6), True, shape, communicator=comm)
        got[f"same_dir_{batch}"] = (x.tolist(), dy.tolist())
    return stage, got


def _pipeline_worker(rank, world_size):
    from moe_graph import parallel_state as ps

    results = {}
    # pp 2 on 4 ranks -> two independent pipelines [0, 2] and [1, 3] (dp 2)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert ps.get_pipeline_model_parallel_global_ranks() == [rank % 2, rank % 2 + 2]
    assert schedules.get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    results["p2p"] = _p2p_checks(rank)
    for i, c in enumerate(PP2_CONFIGS):
        c = dict(c)
        results[("pp2", i)] = run_config(2, ps.get_pipeline_model_parallel_rank(), c.pop("vpp"), c.pop("m"),
                                         seed=100 + i + 50 * (rank % 2), **c)
    ps.destroy_model_parallel()
    # pp 4 on all ranks; explicit communicator built from the group
    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    assert schedules.get_forward_backward_func() is schedules.forward_backward_pipelining_without_interleaving
    comm = p2p.P2PCommunicator(ps.get_pipeline_model_parallel_group())
    comm_plain = p2p.P2PCommunicator(ps.get_pipeline_model_parallel_group(), batch_p2p_comm=False)
    for i, c in enumerate(PP4_CONFIGS):
        c = dict(c)
        use = comm_plain if not c.get("batch_p2p", True) else comm
        results[("pp4", i)] = run_config(4, rank, c.pop("vpp"), c.pop("m"), seed=200 + i, communicator=use, **c)
    # a second step with the same communicator reuses its receive buffers
    before = comm.num_buffers()
    results[("pp4", "again")] = run_config(4, rank, 2, 8, seed=200 + 5, communicator=comm)
    results["buffers"] = (before, comm.num_buffers())
    ps.destroy_model_parallel()
    return results


def _check_observed_order(res, cfg, r):
    """What ran (steps observed in the forward step function and in the autograd backward) is the printed
    schedule; the schedule's own ``trace`` agrees with it."""
    assert [schedules.format_step(s) for s in res["observed"]] == res["printed"], (cfg, r)
    assert res["trace"] == res["observed"], (cfg, r)


def _check(res_by_stage, cfg, seed):
    """res_by_stage: results of one pipeline's ranks, in stage order."""
    vpp, m = cfg["vpp"], cfg["m"]
    pp = len(res_by_stage)
    nc = vpp or 1
    num_layers = res_by_stage[0]["num_layers"]
    ref_losses, ref_grads = reference(num_layers, m, seed)
    for r, res in enumerate(res_by_stage):
        _check_observed_order(res, cfg, r)
        if r == pp - 1:
            assert res["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (cfg, r)
        else:
            assert res["losses"] == [], (cfg, r)
        if cfg.get("forward_only"):
            assert res["grads"] == {}
            continue
        # outputs sent to the next stage are shrunk to one element after the send (unless disabled)
        assert len(res["output_numels"]) == m * nc
        for c, n in res["output_numels"]:
            sent = not (c == nc - 1 and r == pp - 1)
            assert n == (1 if sent and cfg.get("deallocate", True) else B * H), (cfg, r, c, n)
        assert sorted(res["grads"]) == sorted(i for ch in schedules.chunk_layer_ids(num_layers, pp, r, vpp) for i in ch)
        for i, (gw, gb) in res["grads"].items():
            torch.testing.assert_close(torch.tensor(gw), ref_grads[i][0], rtol=1e-5, atol=1e-6, msg=f"{cfg} layer {i}")
            torch.testing.assert_close(torch.tensor(gb), ref_grads[i][1], rtol=1e-5, atol=1e-6, msg=f"{cfg} layer {i}")
        log = res["sync_log"]
        for c in range(nc):
            flags = [e for ch, e in log if ch == c]
            assert len(flags) == m
            if not cfg.get("grad_sync") or (vpp is None and r == 0):
                # reduction enabled exactly in each chunk's last microbatch backward
                assert flags == [False] * (m - 1) + [True], (cfg, r, c, flags)
            else:
                # with grad_sync_func, later 1F1B stages and all interleaved chunks reduce via the function
                assert flags == [False] * m, (cfg, r, c, flags)
        if cfg.get("grad_sync"):
            if vpp is None:
                assert res["sync_calls"] == ([] if r == 0 else [0]), (cfg, r)
            else:
                assert sorted(res["sync_calls"]) == list(range(nc)), (cfg, r)
                assert all(not e for _, e in log)


def test_pipeline_gloo_pp2_pp4():
    from moe_graph.distributed.launch import run_distributed

    results = run_distributed(_pipeline_worker, 4)
    for r in range(4):
        stage, got = results[r]["p2p"]
        assert stage == r // 2
        other = 1 - stage
        peer = lambda tag: [[float(100 * tag + 10 * other + r % 2)] * 3] * 2  # noqa: E731
        if stage == 0:
            assert got["recv_backward"] == peer(1) and got["send_forward_recv_backward"] == peer(2)
        else:
            assert got["recv_forward"] == peer(1) and got["send_backward_recv_forward"] == peer(2)
        for batch in (True, False):
            assert got[f"both_{batch}"] == (peer(3), peer(4))  # (activation from prev, gradient from next)
            assert got[f"same_dir_{batch}"] == (peer(5), peer(6))
    for i, cfg in enumerate(PP2_CONFIGS):
        for pipe in (0, 1):  # pipelines [0, 2] and [1, 3]
            _check([results[pipe][("pp2", i)], results[pipe + 2][("pp2", i)]], cfg, seed=100 + i + 50 * pipe)
    for i, cfg in enumerate(PP4_CONFIGS):
        _check([results[r][("pp4", i)] for r in range(4)], cfg, seed=200 + i)
    _check([results[r][("pp4", "again")] for r in range(4)], dict(vpp=2, m=8), seed=205)
    for r in range(4):
        before, after = results[r]["buffers"]
        assert before == after and before > 0


# ---------------------------------------------------------------- moe_graph.distributed.ddp.DistributedDataParallel chunks


def _record_grad_reduce_launches(ddp, chunk_id, observed, launches, running):
    """Wrap the ``start_grad_sync`` of each bucket group of ``ddp`` to log every real launch: which chunk and
    group, how many backward steps of that chunk had started (observed in autograd), whether the launch came
    from inside an autograd backward (the grad-ready hooks) and whether the schedule was still running."""
    for gi, g in enumerate(ddp.all_bucket_groups):
        def wrapped(g=g, gi=gi, orig=g.start_grad_sync):
            if not g.grad_reduce_dispatched:
                bwd = [mb for f, mb, c in observed if not f and c == chunk_id]
                launches.append(dict(chunk=chunk_id, group=gi, backwards=len(bwd), last_mb=bwd[-1] if bwd else None,
                                     in_backward=torch._C._current_graph_task_id() != -1, running=running[0]))
            orig()

        g.start_grad_sync = wrapped


def run_ddp_config(pp, pp_rank, dp, dp_rank, vpp, m, seed, *, grad_sync=False, dist_opt=False, data_parallel_group=None,
                   communicator=None):
    """One pipelined step with every chunk wrapped in ``DistributedDataParallel`` (overlapped grad reduction).

    Wired as Megatron does: ``no_sync_func = ddp.no_sync`` (and ``grad_sync_func = ddp.start_grad_sync`` when
    ``grad_sync``), one per chunk; ``finish_grad_sync`` after the schedule. This rank takes microbatches
    ``[dp_rank * m, (dp_rank + 1) * m)`` of the global batch ``make_data(dp * m, seed)``. Returns the reduced
    ``main_grad`` of every layer with the mask of elements this rank holds reduced (all of them, or its
    shard of each bucket under the distributed optimizer), and the launches of the bucket reductions.
    """
    from moe_graph.distributed.ddp import DistributedDataParallel

    nc = vpp or 1
    num_layers = 2 * pp * nc
    layers = build_layers(num_layers, seed)
    ids = schedules.chunk_layer_ids(num_layers, pp, pp_rank, vpp)
    data = [(i, x, y) for i, (_, x, y) in enumerate(make_data(dp * m, seed)[dp_rank * m:(dp_rank + 1) * m])]
    observed, launches, running = [], [], [False]
    ddps = []
    for c, chunk_ids in enumerate(ids):
        ddp = DistributedDataParallel(Chunk([layers[i] for i in chunk_ids], c, []),
                                      data_parallel_group=data_parallel_group, overlap_grad_reduce=True,
                                      use_distributed_optimizer=dist_opt, bucket_size=40)  # a bucket per layer
        ddp.zero_grad_buffer()
        _record_grad_reduce_launches(ddp, c, observed, launches, running)
        ddps.append(ddp)
    pick = (lambda fns: fns) if vpp else (lambda fns: fns[0])
    cfg = schedules.PipelineConfig(tensor_shape=(B, H), no_sync_func=pick([d.no_sync for d in ddps]),
                           grad_sync_func=pick([d.start_grad_sync for d in ddps]) if grad_sync else None)
    fn = schedules.get_forward_backward_func(pp, vpp)
    kwargs = dict(forward_step_func=make_forward_step(observed), num_microbatches=m, config=cfg, communicator=communicator)
    running[0] = True
    out = fn(data_iterator=pick([iter(data) for _ in range(nc)]), model=pick(ddps), **kwargs)
    running[0] = False
    for d in ddps:
        d.finish_grad_sync()
    grads = {}
    for chunk_ids, d in zip(ids, ddps):
        for i, layer in zip(chunk_ids, d.module.layers):
            grads[i] = []
            for p in (layer.weight, layer.bias):
                assert p.grad is None  # the hook moved it into main_grad
                buf = next(b for b in d.buffers if p in b.param_index_map)
                valid = torch.zeros(buf.numel, dtype=torch.bool)
                for b in buf.buckets:
                    if dist_opt:
                        n = b.grad_data.numel() // dp
                        valid[b.offset + dp_rank * n:b.offset + (dp_rank + 1) * n] = True
                    else:
                        valid[b.offset:b.offset + b.grad_data.numel()] = True
                start, end, _ = buf.param_index_map[p]
                grads[i].append((p.main_grad.tolist(), valid[start:end].view(p.shape).tolist()))
    return {
        "losses": [float(l) for l in out],
        "grads": grads,
        "num_layers": num_layers,
        "observed": observed,
        "printed": printed_order(m, pp, pp_rank, vpp),
        "launches": launches,
        "num_bucket_groups": [len(d.all_bucket_groups) for d in ddps],
    }


DDP_CONFIGS = [
    dict(vpp=None, m=4), dict(vpp=None, m=4, grad_sync=True), dict(vpp=None, m=3, grad_sync=True, dist_opt=True),
    dict(vpp=2, m=4), dict(vpp=2, m=4, grad_sync=True), dict(vpp=2, m=6, grad_sync=True, dist_opt=True),
    dict(vpp=2, m=4, dist_opt=True),
]


def _ddp_pipeline_worker(rank, world_size):
    from moe_graph import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        assert (pp_rank, dp_rank) == (rank // 2, rank % 2) and ps.get_data_parallel_world_size() == 2
        return {i: run_ddp_config(2, pp_rank, 2, dp_rank, c["vpp"], c["m"], seed=300 + i,
                                  grad_sync=c.get("grad_sync", False), dist_opt=c.get("dist_opt", False),
                                  data_parallel_group=ps.get_data_parallel_group())
                for i, c in enumerate(DDP_CONFIGS)}
    finally:
        ps.destroy_model_parallel()


def _check_ddp(res_by_rank, cfg, seed, pp, dp):
    """res_by_rank[pp_rank][dp_rank]: one run of ``run_ddp_config``."""
    vpp, m = cfg["vpp"], cfg["m"]
    nc = vpp or 1
    num_layers = res_by_rank[0][0]["num_layers"]
    ref_losses, ref_grads = reference(num_layers, dp * m, seed)  # the unsplit model on the whole global batch
    for r in range(pp):
        for d in range(dp):
            res, where = res_by_rank[r][d], (cfg, r, d)
            assert [schedules.format_step(s) for s in res["observed"]] == res["printed"], where
            assert res["losses"] == (pytest.approx(ref_losses[d * m:(d + 1) * m], rel=1e-5, abs=1e-6)
                                     if r == pp - 1 else []), where
            assert sorted(res["grads"]) == sorted(i for ch in schedules.chunk_layer_ids(num_layers, pp, r, vpp) for i in ch)
            for i, pair in res["grads"].items():
                for (got, valid), want in zip(pair, ref_grads[i]):
                    got, valid = torch.tensor(got), torch.tensor(valid)
                    assert cfg.get("dist_opt") or valid.all(), where  # else: its shard (checked below)
                    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-6, msg=f"{where} layer {i}")
            # each bucket group of each chunk reduced exactly once, while the schedule ran, after the backward of
            # that chunk's last microbatch had started (never during the earlier ones: no_sync held them back)
            launches = res["launches"]
            assert sorted((l["chunk"], l["group"]) for l in launches) == [
                (c, g) for c in range(nc) for g in range(res["num_bucket_groups"][c])], where
            assert all(n >= 2 for n in res["num_bucket_groups"])
            for l in launches:
                assert l["running"] and l["backwards"] == m and l["last_mb"] == m - 1, (where, l)
                # launched by the grad-ready hooks inside the last backward, unless the schedule defers it to
                # grad_sync_func (1F1B: every stage but the first; interleaved: all chunks)
                hooks = not cfg.get("grad_sync") or (vpp is None and r == 0)
                assert l["in_backward"] == hooks, (where, l)
        if cfg.get("dist_opt"):  # together the dp ranks hold every reduced element
            for i in res_by_rank[r][0]["grads"]:
                for k in range(2):
                    masks = [torch.tensor(res_by_rank[r][d]["grads"][i][k][1]) for d in range(dp)]
                    assert torch.stack(masks).any(0).all() and not torch.stack(masks).all(0).any()


def test_pipeline_gloo_ddp_chunks():
    """pp 2 x dp 2 on 4 gloo ranks; every model chunk is a moe_graph DistributedDataParallel (overlapped)."""
    from moe_graph.distributed.launch import run_distributed

    results = run_distributed(_ddp_pipeline_worker, 4)
    for i, cfg in enumerate(DDP_CONFIGS):
        by_rank = [[results[2 * r + d][i] for d in range(2)] for r in range(2)]
        _check_ddp(by_rank, cfg, seed=300 + i, pp=2, dp=2)


def test_ddp_wrapper_as_single_stage_chunk():
    """Single process (no process group): pass-through set_input_tensor, Megatron's grad-sync calling convention."""
    from moe_graph.distributed.ddp import DistributedDataParallel

    plain = DistributedDataParallel(torch.nn.Linear(2, 2))
    plain.set_input_tensor(None)  # nothing to pass on: fine without the method
    with pytest.raises(TypeError, match="Linear has no set_input_tensor"):
        plain.set_input_tensor(torch.zeros(2))
    with pytest.raises(TypeError, match="has no set_input_tensor"):
        schedules.forward_step(lambda it, mdl: (mdl(torch.zeros(1, 2)), None), None, plain, 1, torch.zeros(2), [],
                       schedules.PipelineConfig(), False)

    m = 3
    res = run_ddp_config(1, 0, 1, 0, None, m, seed=11, grad_sync=True)
    chunk = DistributedDataParallel(Chunk(build_layers(2, 0), 0, []))
    t = torch.ones(B, H)
    chunk.set_input_tensor(t)
    assert chunk.module.input_tensor is t
    chunk.start_grad_sync(list(chunk.parameters()))  # grad_sync_func(params)
    chunk.finish_grad_sync(list(chunk.parameters()))
    ref_losses, ref_grads = reference(res["num_layers"], m, 11)
    assert res["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    for i, pair in res["grads"].items():
        for (got, valid), want in zip(pair, ref_grads[i]):
            assert torch.tensor(valid).all()
            torch.testing.assert_close(torch.tensor(got), want)
    assert [schedules.format_step(s) for s in res["observed"]] == res["printed"]
    assert len(res["launches"]) == sum(res["num_bucket_groups"]) >= 2
    assert all(l["in_backward"] and l["backwards"] == m and l["running"] for l in res["launches"])


def test_docstring_examples():
    import doctest

    res = doctest.testmod(schedules, verbose=False)
    assert res.failed == 0 and res.attempted >= 5


# ------------------------------------------------------------------- MoE model through the whole training stack --
# (2, None, False) full_only: its 1F1B pp=2 run is (2, None, True)'s without the bias update, and
# (4, 2, False) runs without expert bias
@pytest.mark.parametrize("layers,vpp,expert_bias", [(4, 2, False), (2, None, True), *full_only((2, None, False))])
def test_moe_lm_pipeline_pp2_matches_pp1(layers, vpp, expert_bias):
    """The demo's MoE LM (echo, static dispatcher) with DDP buffers and ZeRO-1 with clipping: 1F1B (or the
    interleaved schedule with 2 model chunks per stage and one optimizer over both) over pp=2 x EP/DP=2 (4 gloo
    ranks) gives the same losses, global grad norms and parameters as pp=1 x EP/DP=2 (2 ranks), float32, 3 steps.
    Exercises the grad norm over the model-parallel group and the expert-tensor-model-pipeline group: without them
    each stage would clip with its own norm. With expert bias, update_expert_bias must reduce the route counts
    within each stage (not over the world, which would mix different layers' counts)."""
    from helpers.pipeline_moe import pipeline_moe_worker
    from moe_graph.distributed.launch import run_distributed

    ref = run_distributed(pipeline_moe_worker, 2, 1, 0.5, layers, None, expert_bias)
    got = run_distributed(pipeline_moe_worker, 4, 2, 0.5, layers, vpp, expert_bias)
    assert all(r["pp_rank"] == 0 for r in ref) and [r["pp_rank"] for r in got] == [0, 0, 1, 1]
    for d in range(2):
        r, last = ref[d], got[2 + d]
        assert r["dp_rank"] == last["dp_rank"] == d
        assert len(r["losses"]) == 3 and all(len(x) == 2 for x in r["losses"])
        torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=1e-6)
        assert got[d]["losses"] == [[], [], []]  # the first stage reports no loss
        for g in (got[d], last):
            torch.testing.assert_close(torch.tensor(g["norms"]), torch.tensor(r["norms"]), rtol=1e-5, atol=1e-6)
    assert min(min(r["norms"]) for r in ref) > 0.5  # clipping was active in every step
    # every parameter (each expert once per holder) equal to the pp=1 run's
    ref_params = {k: v for r in ref for k, v in r["params"].items()}
    got_params: dict = {}
    for g in got:
        got_params.update(g["params"])
    assert sorted(got_params) == sorted(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(got_params[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert sum(r["drops"] for r in ref) == sum(g["drops"] for g in got)
    biases = [k for k in ref_params if k.endswith("expert_bias")]
    assert len(biases) == (layers if expert_bias else 0)
    assert all(float(ref_params[k].abs().max()) > 0 for k in biases)  # the bias moved
