"""The shared expert beside the exchange (``overlap_shared_expert``): one training forward + backward of a layer with
the option and of the same layer without it (the serial schedule), recorded by :class:`moe_graph.streams.StreamRecorder`,
and the checks on the record that the tests run on one process and on gloo ranks."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from moe_graph.moe.layer import MoELayer
from moe_graph.streams import RecordedOp, StreamRecorder, happens_before, unjoined_uses

EXCHANGE = ("dispatch", "combine")
SIDE = ("shared_expert", "router_loss")

OPTIONS = dict(num_experts=4, topk=2, shared_expert_ffn_size=8, shared_expert_gate=True, aux_loss_coeff=0.05,
               z_loss_coeff=0.01, capacity_factor=None)


def layer_pair(seed: int = 0, dtype=torch.float64, **overrides):
    """``(serial, overlapped)``: the same parameters, ``overlap_shared_expert`` off and on."""
    opts = dict(OPTIONS, params_dtype=dtype, device="cpu", **overrides)
    torch.manual_seed(seed)
    serial = MoELayer(16, 12, **opts)
    overlapped = MoELayer(16, 12, overlap_shared_expert=True, **opts)
    overlapped.load_state_dict(serial.state_dict())
    return serial, overlapped


def run(layer: MoELayer, x: torch.Tensor, target: torch.Tensor, record: bool = False):
    """``(output, {name: grad}, recorder or None)`` of one forward + backward of ``(layer(x) - target)^2``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    rec = StreamRecorder() if record else None
    with rec if rec is not None else torch.enable_grad():
        y = layer(x)
        (y - target).square().sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return y.detach(), grads, rec


def ops(rec: StreamRecorder, stages, phase=None) -> List[RecordedOp]:
    return [o for o in rec.ops if o.stage in stages and (phase is None or o.phase == phase)]


def ordered_pairs(rec: StreamRecorder, phase: str, side_stream: Optional[str] = "moe_side") -> int:
    """How many (side op, exchange op) pairs of ``phase`` are ordered (either before the other): 0 when the shared
    expert and the router losses run concurrently with the whole exchange. Side ops: the ops of the shared expert
    and router-loss stages on ``side_stream`` (``None``: on any stream; the engine's accumulation of their input
    gradients into the main stream's is the join, ordered by design)."""
    unjoined_uses(rec.entries)  # fills the clocks
    side = [o for o in ops(rec, SIDE, phase) if side_stream is None or o.stream == side_stream]
    exch = ops(rec, EXCHANGE, phase)
    return sum(happens_before(a, b) or happens_before(b, a) for a in side for b in exch)


def is_side(o: RecordedOp) -> bool:
    return o.stage == "shared_expert" and o.stream != "main"


def is_exchange(o: RecordedOp) -> bool:
    return o.stage in EXCHANGE


def data_dependent(rec: StreamRecorder, src, dst) -> List:
    """``(src, dst)`` op index pairs where an op with ``dst(op)`` reads (transitively, through the recorded
    storages) what an op with ``src(op)`` wrote."""
    reach: Dict[int, set] = {}  # storage -> indices of the source ops it derives from
    hits = []
    for o in rec.ops:
        srcs = set().union(*(reach.get(k, set()) for k in o.reads)) if o.reads else set()
        if dst(o) and srcs:
            hits.append((min(srcs), o.index))
        if src(o):
            srcs = srcs | {o.index}
        for k in o.writes:
            reach[k] = srcs
    return hits


def compare_worker(rank: int, world: int, seed: int) -> Dict:
    """On each gloo rank (EP = world): the overlapped layer against the serial one, bitwise, and its record's
    checks. Returns ``{"mismatch": [names], "unjoined": n, "ordered": {phase: n}, "side_ops": n, "exchange_ops":
    n, "depends": n}``."""
    serial, overlapped = layer_pair(seed, ep_size=world, num_experts=2 * world)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=g)
    target = torch.randn(3, 5, 16, dtype=torch.float64, generator=g)
    y0, g0, _ = run(serial, x, target)
    y1, g1, rec = run(overlapped, x, target, record=True)
    mismatch = [n for n in g0 if not torch.equal(g0[n], g1.get(n))] + ([] if torch.equal(y0, y1) else ["y"])
    mismatch += sorted(set(g1) - set(g0))
    return {"mismatch": mismatch, "unjoined": len(unjoined_uses(rec.entries)),
            "ordered": {p: ordered_pairs(rec, p) for p in ("forward", "backward")},
            "side_ops": len(ops(rec, ("shared_expert",))), "exchange_ops": len(ops(rec, EXCHANGE)),
            "depends": sum(len(data_dependent(rec, a, b)) for phase in ("forward", "backward")
                           for a, b in _pairs(phase))}


def _pairs(phase: str):
    side, exch = (lambda o: is_side(o) and o.phase == phase), (lambda o: is_exchange(o) and o.phase == phase)
    return (side, exch), (exch, side)


# ------------------------------------------------------------------------ two microbatches in flight --
class TinyMoEModel(torch.nn.Module):
    """``forward(x, target) -> loss``: a linear layer (the attention's stand-in), a residual MoE layer, a mean-square
    loss: the model the microbatch-overlap tests run through the schedules."""

    def __init__(self, seed: int = 0, dtype=torch.float64, **overrides):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(16, 16, dtype=dtype)
        self.moe = MoELayer(16, 12, **dict(OPTIONS, params_dtype=dtype, device="cpu", **overrides))

    def forward(self, x, target):
        h = self.inp(x)
        return ((h + self.moe(h)) - target).square().mean()


def microbatches(n: int, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 5, 16, dtype=dtype, generator=g), torch.randn(2, 5, 16, dtype=dtype, generator=g))
            for _ in range(n)]


def run_schedule(model, mbs, overlap: bool, record: bool = False):
    """``(reported losses, {name: grad}, recorder or None)`` of :func:`forward_backward_no_pipelining` over ``mbs``
    with ``overlap_microbatches`` off or on."""
    from moe_graph.train import schedules

    model.zero_grad(set_to_none=True)
    rec = StreamRecorder() if record else None
    with rec if rec is not None else torch.enable_grad():
        losses = schedules.forward_backward_no_pipelining(
            forward_step_func=lambda it, m: (m(*next(it)), None), data_iterator=iter(mbs), model=model,
            num_microbatches=len(mbs), config=schedules.PipelineConfig(overlap_microbatches=overlap))
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, rec


def is_compute(o: RecordedOp) -> bool:
    """An op that does arithmetic (not the exchange, not a view)."""
    return o.stage not in EXCHANGE and o.name not in ("view", "t", "detach", "_unsafe_view", "alias", "reshape",
                                                      "expand", "unsqueeze", "squeeze", "select", "slice")


def cross_microbatch(rec: StreamRecorder, i: int) -> Dict[str, int]:
    """Between microbatch ``i``'s backward and microbatch ``i + 1``'s forward: ``ordered``: how many (exchange op of
    one, compute op of the other) pairs are ordered either way (0: one's exchange may run during all of the other's
    computation); ``depends``: how many of the other's ops read what one's exchange wrote (transitively);
    ``pairs``: how many pairs there are; ``exchange``, ``compute``: the op counts checked."""
    unjoined_uses(rec.entries)  # fills the clocks
    b = [o for o in rec.ops if o.microbatch == i and o.phase == "backward"]
    f = [o for o in rec.ops if o.microbatch == i + 1 and o.phase == "forward"]
    pairs = [([o for o in b if is_exchange(o)], [o for o in f if is_compute(o)]),
             ([o for o in f if is_exchange(o)], [o for o in b if is_compute(o)])]
    ordered = sum(happens_before(x, y) or happens_before(y, x) for ex, comp in pairs for x in ex for y in comp)
    ids = [(set(o.index for o in ex), set(o.index for o in comp)) for ex, comp in pairs]
    depends = sum(len(data_dependent(rec, lambda o, s=s: o.index in s, lambda o, d=d: o.index in d)) for s, d in ids)
    return {"ordered": ordered, "pairs": sum(len(ex) * len(comp) for ex, comp in pairs), "depends": depends,
            "exchange": sum(len(p[0]) for p in pairs),
            "compute": sum(len(p[1]) for p in pairs)}


def microbatch_worker(rank: int, world: int, seed: int) -> Dict:
    """On each gloo rank (EP = world): three microbatches through the plain loop, serial and overlapped, bitwise,
    and the overlapped record's checks."""
    opts = dict(ep_size=world, num_experts=2 * world, overlap_shared_expert=True)
    serial, overlapped = TinyMoEModel(seed, **opts), TinyMoEModel(seed, **opts)
    mbs = microbatches(3, 100 + rank)
    l0, g0, _ = run_schedule(serial, mbs, False)
    l1, g1, rec = run_schedule(overlapped, mbs, True, record=True)
    mismatch = [n for n in g0 if not torch.equal(g0[n], g1.get(n))] + sorted(set(g1) - set(g0))
    mismatch += [f"loss{i}" for i, (a, b) in enumerate(zip(l0, l1)) if not torch.equal(a, b)]
    return {"mismatch": mismatch, "unjoined": len(unjoined_uses(rec.entries)),
            "cross": [cross_microbatch(rec, i) for i in range(2)]}


# ------------------------------------------------------- two microbatches in flight in the interleaved pipeline --
PIPELINE_FAULTS = (None, "early_join", "no_join_wait", "one_lane")


def _pipeline_fault(fault: Optional[str]):
    """A patch of the microbatch streams: ``"early_join"``: the current stream waits for a forward's end right after
    its body (a false dependency: the steady step's backward then waits for its forward); ``"no_join_wait"``: the
    join's wait is left out (a missing join); ``"one_lane"``: every forward on microbatch stream 0 (the steady step's
    backward then runs on its forward's stream, after it). ``None``: no patch."""
    import contextlib
    from unittest import mock

    from moe_graph.streams import SideStream
    from moe_graph.train import schedules

    if fault is None:
        return contextlib.nullcontext()
    if fault == "one_lane":
        cls = schedules._MicrobatchStreams
        real_forward, real_join = cls.forward, cls.join
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(cls, "forward", lambda self, lane, *a, **k: real_forward(self, 0, *a,
                                                                                                          **k)))
        stack.enter_context(mock.patch.object(cls, "join", lambda self, lane, out: real_join(self, 0, out)))
        return stack
    if fault == "early_join":
        real_fork = SideStream.fork

        @contextlib.contextmanager
        def fork(self, *inputs, marked=False):
            with real_fork(self, *inputs, marked=marked):
                yield
            if self.name.startswith("microbatch"):
                self._wait("join")

        return mock.patch.object(SideStream, "fork", fork)
    real_wait = SideStream._wait

    def wait(self, kind):
        if not (self.name.startswith("microbatch") and kind == "join"):
            real_wait(self, kind)

    return mock.patch.object(SideStream, "_wait", wait)


def steady_step_checks(rec: StreamRecorder, table, warmup: int) -> List[Dict[str, int]]:
    """For each steady step ``k`` of an interleaved rank (``table``: :func:`moe_graph.train.schedules.get_schedule_table`;
    forward step ``warmup + k``, backward step ``k``, which runs the graph of the forward step of the same microbatch
    on the mirrored chunk; an op's label is the forward step that made it): ``ordered``: (forward op, backward op)
    pairs ordered either way; ``depends``: ops of one reading (transitively) what the other wrote; ``forward``,
    ``backward``, ``exchange``: the op counts."""
    unjoined_uses(rec.entries)  # fills the clocks
    nc = 1 + max(c for _, c in table)
    out = []
    for k in range(len(table) - warmup):
        j = table.index((table[k][0], nc - 1 - table[k][1]))
        f = [o for o in rec.ops if o.microbatch == warmup + k and o.phase == "forward"]
        b = [o for o in rec.ops if o.microbatch == j and o.phase == "backward"]
        fi, bi = {o.index for o in f}, {o.index for o in b}
        depends = sum(len(data_dependent(rec, lambda o, s=s: o.index in s, lambda o, d=d: o.index in d))
                      for s, d in ((fi, bi), (bi, fi)))
        out.append({"ordered": sum(happens_before(x, y) or happens_before(y, x) for x in f for y in b),
                    "depends": depends, "forward": len(f), "backward": len(b),
                    "exchange": sum(is_exchange(o) for o in f + b)})
    return out


def pipeline_overlap_worker(rank: int, world: int, vpp: int = 2, faults: bool = True, microbatches: int = 4) -> Dict:
    """pp = 2 stages x ``vpp`` model chunks of the demo MoE LM (4 layers) (world = 2 x EP; EP = DP ranks per stage, as
    :func:`helpers.pipeline_moe.pipeline_moe_worker`), one training step of the interleaved schedule, float32:
    ``overlap_microbatches`` off and on (each from the same initial model, on the same microbatches), then one AdamW
    step. Returns the names that differ (bitwise: losses, every gradient, every parameter after the step), both
    traces, and the recorded overlapped run's checks (:func:`steady_step_checks`, unjoined uses) clean and under
    each fault of :data:`PIPELINE_FAULTS` (``faults``; else clean only)."""
    from moe_graph import parallel_state as ps
    from moe_graph.train import schedules

    pp = 2
    setup = pipeline_setup(world, vpp, microbatches)
    try:
        pp_rank, mbs = setup["pp_rank"], setup["mbs"]

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            return model(tokens, labels), (lambda loss: loss)

        def run(overlap: bool, record: bool = False):
            return run_pipeline(setup, forward_step, overlap=overlap, record=record)

        serial, overlapped = run(False), run(True, record=True)
        mismatch = [f"loss{i}" for i, (a, b) in enumerate(zip(serial["losses"], overlapped["losses"]))
                    if not torch.equal(a, b)]
        mismatch += [] if len(serial["losses"]) == len(overlapped["losses"]) else ["n_losses"]
        for kind in ("grads", "params"):
            a, b = serial[kind], overlapped[kind]
            mismatch += [f"{kind}:{n}" for n in sorted(set(a) | set(b)) if n not in a or n not in b
                         or not torch.equal(a[n], b[n])]
        m = len(mbs)
        warmup = schedules.num_warmup_microbatches(m, pp, pp_rank, vpp, overlap_microbatches=True)
        checks = {}
        for fault in PIPELINE_FAULTS if faults else (None,):
            rec = overlapped["rec"]
            if fault is not None:
                with _pipeline_fault(fault):
                    rec = run(True, record=True)["rec"]
            checks[str(fault)] = {"steady": steady_step_checks(rec, schedules.get_schedule_table(m, vpp, pp), warmup),
                                  "unjoined": len(unjoined_uses(rec.entries)),
                                  "lanes": sorted({o.stream for o in rec.ops if o.microbatch is not None}),
                                  "unlabelled": sorted({o.stream for o in rec.ops if o.microbatch is None})}
        return {"pp_rank": pp_rank, "mismatch": mismatch, "n_grads": len(serial["grads"]),
                "n_losses": len(serial["losses"]), "trace": overlapped["trace"], "serial_trace": serial["trace"],
                "warmup": warmup, "checks": checks}
    finally:
        ps.destroy_model_parallel()


def pipeline_setup(world: int, vpp: int, microbatches: int) -> Dict:
    """pp = 2 stages x ``vpp`` model chunks of the demo MoE LM (4 layers), EP = world / 2 (the DP ranks of a stage):
    initializes parallel_state (the caller destroys it) and returns this rank's ``pp_rank``, ``ep_rank``,
    ``chunk_ids``, ``moe_kwargs``, ``vpp`` and its ``mbs`` (``microbatches`` of them)."""
    from helpers import pipeline_moe as pm
    from moe_graph import parallel_state as ps
    from moe_graph.train import schedules

    pp = 2
    dp = world // pp
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=dp,
                                 virtual_pipeline_model_parallel_size=vpp)
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    mbs = [mb for s in range(microbatches // pm.MICROBATCHES) for mb in pm.microbatches(s, dp_rank)]
    return {"pp_rank": pp_rank, "ep_rank": ps.get_expert_model_parallel_rank(), "vpp": vpp,
            "chunk_ids": schedules.chunk_layer_ids(4, pp, pp_rank, vpp), "mbs": mbs[:microbatches],
            "moe_kwargs": dict(ep_group=ps.get_expert_model_parallel_group(), ep_size=dp, aux_loss_coeff=0.01,
                               capacity_factor=None, shared_expert_ffn_size=8)}


def run_pipeline(setup: Dict, forward_step, overlap: bool, stages: bool = False, record: bool = False,
                 on_chunk=None) -> Dict:
    """One step of the interleaved schedule on fresh chunks (:func:`pipeline_setup`; ``on_chunk(c, chunk)`` is
    called on each) with ``overlap_microbatches`` / ``interleave_stages``, then one AdamW step. Returns the losses,
    the gradients and parameters after the step by global name, the trace and the record (``record``)."""
    from helpers import pipeline_moe as pm
    from moe_graph.demo.model import MoETransformerLM
    from moe_graph.train import schedules
    from moe_graph.train.checkpoint import global_name

    pp, vpp, pp_rank = 2, setup["vpp"], setup["pp_rank"]
    chunks = []
    for c, ids in enumerate(setup["chunk_ids"]):
        chunk = MoETransformerLM(pm.CFG, pm.VOCAB, setup["moe_kwargs"], "cpu", pm.DT, layer_ids=ids,
                                 first=pp_rank == 0 and c == 0, last=pp_rank == pp - 1 and c == vpp - 1)
        pm.init_from_global_names(chunk, setup["ep_rank"])
        if on_chunk is not None:
            on_chunk(c, chunk)
        chunks.append(chunk)
    trace: list = []
    cfg = schedules.PipelineConfig(tensor_shape=(pm.BATCH, pm.CFG.seq, pm.CFG.hidden), dtype=pm.DT,
                                   overlap_microbatches=overlap, interleave_stages=stages, trace=trace)
    rec = StreamRecorder() if record else None
    with rec if rec is not None else torch.enable_grad():
        losses = schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step, data_iterator=[iter(setup["mbs"]) for _ in chunks], model=chunks,
            num_microbatches=len(setup["mbs"]), config=cfg)
    named = [(global_name(ch, n), p) for ch in chunks for n, p in ch.named_parameters()]
    grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    torch.optim.AdamW([p for _, p in named], lr=1e-2).step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in named},
            "trace": [tuple(s) for s in trace], "rec": rec}
