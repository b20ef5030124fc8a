"""Exposed expert-parallel communication of a training step (``MICROBATCHES`` microbatches of one block: an attention
stand-in and an MoE layer, forward + backward), serial vs the shared expert beside the exchange
(``overlap_shared_expert``) vs two microbatches in flight (``overlap_microbatches``) vs both, each of the last two
also with the stage interleave (``interleave_stages``: ``F(i+1)`` and ``B(i)`` issued alternately at the token
exchanges), estimated from the recorded stream schedule. A model, not a measurement.

How:

1. **Schedule** (recorded, not assumed): a small layer of the same structure (router with aux loss, dispatch,
   grouped experts, combine, one shared expert; H 32, F 16, 8 experts, top-2, 64 tokens, fp32, CPU, EP 2 on gloo
   (``--record-ep``; rank 0's record: the token exchanges, and so the stage interleave's hand-offs, exist at EP > 1
   only; at EP 1 the schedules without the interleave hide the same shares, the compute totals differ by < 2%) runs
   one
   training step of ``MICROBATCHES`` microbatches through ``forward_backward_no_pipelining`` under
   :class:`moe_graph.streams.StreamRecorder`, for each schedule of ``SCHEDULES``: the ordered list of aten ops with their logical stream and stage, and every event
   record / wait, from the code path that issues the CUDA streams and events.
2. **Costs at the target shape** (roofline, bf16): each stage's flops and HBM bytes at the target shape (T tokens per
   rank, EP R, balanced routing: every rank's experts get ``T * K`` rows) give the stage's time ``max(flops / peak,
   bytes / HBM)``; it is spread over the stage's recorded ops in proportion to their own roofline cost at the
   recorded shape. Ops outside a stage (the residual adds, the loss) scale with ``T * H``. Views cost nothing.
3. **Exchange**: at EP R each rank sends and receives ``T * K * H * 2 * (R - 1) / R`` bytes per direction in each of
   dispatch, combine, and their two backward exchanges; time = bytes / link bandwidth, placed on the stream that
   issues the stage, at the stage's first op (the caller reads its result right after, so an exchange on its own
   stream, as the CUDA exchanges run, waits the same). The count all-gather
   and the echo planner are left out (bytes ~ E * R * 8).
4. **Critical path**: the streams execute their ops in issue order; an event wait holds its stream until the event's
   record; compute ops share one resource (the SMs: two compute ops never overlap), exchange ops use the link. No
   SM share is taken by the exchange (its kernels' SMs are not modelled) and no launch latency (one CUDA graph).
   When the SMs free up and ops of several streams are ready, which one goes first is the executor's choice, and the
   result depends on it, so both are reported (``EXECUTORS``):

   - ``ready_first``: the op that became ready first (its stream's previous op ended, or its event wait was met,
     earliest) goes first: a replayed CUDA graph launches each kernel node when its last dependency completes, so
     a node that has waited longer is already queued in the hardware when a newer one arrives (FIFO by readiness).
   - ``issue_order``: the op issued first by the host goes first (pessimistic for two microbatches in flight: the
     backward ``B(i)`` is issued before ``F(i+1)`` and then keeps the SMs whenever it has work, so ``F(i+1)``'s
     computation runs only while ``B(i)`` waits for the link, and ``F(i+1)``'s own exchanges end up exposed after
     ``B(i)``; with ``interleave_stages`` the host issues the two alternately at the exchanges, so issue order
     runs each side's computation while the other's exchange is in flight). A GPU decides between the two, within a
     stream priority: measured by ``bench_overlap_gpu.py``.

Exposed communication = step time - compute time; hidden = 1 - exposed / exchange time.

    PYTHONPATH=python python3 benchmarks/bench_overlap.py --out benchmarks/results/bench_overlap-<commit>.json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, write_json  # noqa: E402
from moe_graph.moe.layer import MoELayer  # noqa: E402
from moe_graph.streams import RecordedEvent, RecordedOp, StreamRecorder, stage  # noqa: E402
from moe_graph.train import schedules  # noqa: E402

HW = {"name": "H100 SXM (assumed)", "hbm_bytes_per_s": 3.35e12, "bf16_flops_per_s": 989e12,
      "link_bytes_per_s": 450e9, "link": "NVLink 4, 450 GB/s per direction"}
CONFIGS = {
    # Qwen3-30B-A3B has no shared expert: this variant adds one of the routed experts' width
    "qwen3_30b_a3b_shared": dict(H=2048, F=768, E=128, K=8, Fs=768),
    "deepseek_v3": dict(H=7168, F=2048, E=256, K=8, Fs=2048),
}
SMALL = dict(H=32, F=16, E=8, K=2, Fs=16, T=64)
MICROBATCHES = 8
# name: (overlap_shared_expert, overlap_microbatches, interleave_stages)
SCHEDULES = {"serial": (False, False, False), "overlap_shared_expert": (True, False, False),
             "overlap_microbatches": (False, True, False), "overlap_microbatches+shared_expert": (True, True, False),
             "overlap_microbatches+stages": (False, True, True),
             "overlap_microbatches+shared_expert+stages": (True, True, True)}
EXCHANGE_STAGES = ("dispatch", "combine")
EXECUTORS = ("ready_first", "issue_order")  # which ready op takes a free resource first (module docstring, step 4)
FREE = {"view", "t", "expand", "detach", "unsqueeze", "squeeze", "reshape", "_unsafe_view", "alias", "slice",
        "select", "permute", "transpose", "as_strided", "new_empty_strided", "empty", "empty_like", "new_empty",
        "_reshape_alias", "unbind", "split", "split_with_sizes", "lift_fresh"}
GEMMS = {"mm", "addmm", "bmm", "grouped_gemm", "grouped_gemm_wgrad"}


class _Block(torch.nn.Module):
    """One transformer block's structure: the attention's stand-in (one projection, labelled ``attention``; its
    cost at the target shape is :func:`stage_costs`'s) with a residual, then the MoE layer."""

    def __init__(self, layer: MoELayer, H: int):
        super().__init__()
        self.attn, self.moe = torch.nn.Linear(H, H, bias=False), layer

    def forward(self, x):
        with stage("attention"):
            h = x + self.attn(x)
        return self.moe(h)


def _record_rank(rank: int, world: int, overlap: bool, microbatches: bool, stages: bool):
    """One rank's record (EP = ``world``; ``world`` 1: this process, no exchange); the entries only."""
    s = SMALL
    torch.manual_seed(0)
    layer = MoELayer(s["H"], s["F"], s["E"], s["K"], shared_expert_ffn_size=s["Fs"], capacity_factor=None,
                     aux_loss_coeff=1e-3, overlap_shared_expert=overlap, device="cpu", ep_size=world)
    block = _Block(layer, s["H"])
    torch.manual_seed(1 + rank)
    xs = [torch.randn(s["T"], s["H"], requires_grad=True) for _ in range(MICROBATCHES)]  # the previous block's output
    with StreamRecorder() as rec:
        schedules.forward_backward_no_pipelining(
            forward_step_func=lambda it, m: (m(next(it)).square().sum(), None), data_iterator=iter(xs), model=block,
            num_microbatches=MICROBATCHES, config=schedules.PipelineConfig(overlap_microbatches=microbatches,
                                                                           interleave_stages=stages))
    return rec.entries


def record(overlap: bool, microbatches: bool = False, stages: bool = False, ep: int = 1):
    """The record (``.entries``, ``.ops``) of one step of ``MICROBATCHES`` microbatches of one block through the plain
    loop (:func:`moe_graph.train.schedules.forward_backward_no_pipelining`), serial or with ``overlap_microbatches``
    (and ``interleave_stages``), recorded on rank 0 of ``ep`` gloo ranks (``ep`` 1: this process; the token exchange,
    and so the stage interleave's hand-off points, exist at ``ep`` > 1 only)."""
    if ep == 1:
        entries = _record_rank(0, 1, overlap, microbatches, stages)
    else:
        from moe_graph.distributed.launch import run_distributed

        entries = run_distributed(_record_rank, ep, overlap, microbatches, stages)[0]
    return SimpleNamespace(entries=entries, ops=[e for e in entries if isinstance(e, RecordedOp)])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def small_cost(op: RecordedOp) -> float:
    """Roofline seconds of ``op`` at its recorded shape (4-byte elements)."""
    if op.name in FREE:
        return 0.0
    bytes_ = 4 * (sum(_numel(s) for s in op.shapes) + sum(_numel(s) for s in op.out_shapes))
    flops = 0.0
    if op.name in GEMMS:
        if op.name == "grouped_gemm_wgrad":  # x [M, K], dy [M, N]
            (m, k), (_, n) = op.shapes[0], op.shapes[1]
        elif op.name == "grouped_gemm":  # x [M, K], w [G, N, K]
            (m, k), n = op.shapes[0], op.out_shapes[0][-1]
        else:
            a, b = op.shapes[-2], op.shapes[-1]
            m, k, n = a[-2], a[-1], b[-1]
        flops = 2.0 * m * k * n
    return max(flops / HW["bf16_flops_per_s"], bytes_ / HW["hbm_bytes_per_s"])


def stage_costs(c: Dict, T: int, R: int) -> Dict:
    """Roofline seconds per ``(phase, stage)`` at the target shape (bf16, balanced routing), and the exchange
    seconds per ``(phase, stage)`` of dispatch / combine."""
    H, F, E, K, Fs, b = c["H"], c["F"], c["E"], c["K"], c["Fs"], 2
    peak, hbm = HW["bf16_flops_per_s"], HW["hbm_bytes_per_s"]
    rows = T * K  # rows each rank's experts receive (balanced)

    def t(flops, bytes_):
        return max(flops / peak, bytes_ / hbm)

    fwd = {
        # a multi-head attention of width H over a causal sequence of T tokens: Q, K, V, O projections and the
        # score / value products (half the T x T square)
        "attention": t(2 * T * 4 * H * H + 2 * T * T * H, 4 * H * H * b + 6 * T * H * b),
        "router": t(2 * T * H * E, T * H * b + H * E * b + 3 * T * E * 4),
        "router_loss": t(0, 4 * T * E * 4),
        "balance": t(0, 2 * E * 8),
        "dispatch": t(0, T * H * b + rows * H * b),
        "experts": t(6 * rows * H * F, (E // R) * 3 * H * F * b + rows * (2 * H + 4 * F) * b),
        "combine": t(0, rows * H * b + T * H * b),
        "shared_expert": t(6 * T * H * Fs + 2 * T * H, 3 * H * Fs * b + T * (2 * H + 4 * Fs) * b),
    }
    compute = {}
    for stage, sec in fwd.items():
        compute[("forward", stage)] = sec
        compute[("backward", stage)] = 2 * sec  # data and weight gradients
    link = T * K * H * b * (R - 1) / R / HW["link_bytes_per_s"]
    exchange = {(p, s): link for p in ("forward", "backward") for s in EXCHANGE_STAGES}
    return {"compute": compute, "exchange": exchange, "exchange_bytes": T * K * H * b * (R - 1) / R}


def simulate(rec: StreamRecorder, c: Dict, T: int, R: int, executor: str = "ready_first") -> Dict:
    """List scheduling of the recorded streams: each stream runs its items in issue order; an event wait holds its
    stream until the record it refers to (the last one issued before it) has run; among the streams whose next op
    is ready, the op that can start first takes its resource, so a side stream fills the gaps the main stream
    leaves while it waits for the link. Ties (several ops could start when the resource frees up): ``executor``
    ``"ready_first"`` takes the op whose stream could have run it earliest, then the first issued;
    ``"issue_order"`` the first issued."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    costs = stage_costs(c, T, R)
    small_total = defaultdict(float)
    for o in rec.ops:
        small_total[(o.microbatch, o.phase, o.stage)] += small_cost(o)
    glue = (T * c["H"]) / (SMALL["T"] * SMALL["H"]) / 2  # bf16 at the target, fp32 recorded
    queues, last_record, placed = defaultdict(list), {}, set()
    for e in rec.entries:
        if isinstance(e, RecordedEvent):
            if e.kind == "record":
                last_record[e.event] = e.index
                queues[e.stream].append(("record", e.index))
            else:
                queues[e.stream].append(("wait", last_record[e.event]))
            continue
        key, mkey = (e.phase, e.stage), (e.microbatch, e.phase, e.stage)
        if key in costs["exchange"] and mkey not in placed:  # the stage's exchange, issued at its first op
            placed.add(mkey)
            queues[e.stream].append(("link", costs["exchange"][key], e.index))
        if e.stage is None:
            sec = small_cost(e) * glue
        else:
            sec = costs["compute"][key] * small_cost(e) / small_total[mkey] if small_total[mkey] else 0.0
        queues[e.stream].append(("sm", sec, e.index))
    missing = set(costs["exchange"]) - {(p, st) for _, p, st in placed}
    if missing:
        raise RuntimeError(f"the record has no ops of the exchange stages {sorted(missing)}")
    stream_t, res_t, done = defaultdict(float), defaultdict(float), {}
    heads = {s: 0 for s in queues}
    busy = {"sm": 0.0, "link": 0.0}
    while any(heads[s] < len(q) for s, q in queues.items()):
        progressed, best = False, None
        for s, q in queues.items():
            while heads[s] < len(q) and q[heads[s]][0] in ("record", "wait"):
                kind, ref = q[heads[s]]
                if kind == "record":
                    done[ref] = stream_t[s]
                elif ref in done:
                    stream_t[s] = max(stream_t[s], done[ref])
                else:
                    break  # blocked on a record another stream has not reached
                heads[s] += 1
                progressed = True
            if heads[s] < len(q) and q[heads[s]][0] not in ("record", "wait"):
                res, sec, index = q[heads[s]]
                start = max(stream_t[s], res_t[res])
                key = (start, stream_t[s] if executor == "ready_first" else 0.0, index)
                if best is None or key < best[0]:
                    best = (key, s, res, sec)
        if best is not None:
            (start, _, _), s, res, sec = best
            stream_t[s] = res_t[res] = start + sec
            busy[res] += sec
            heads[s] += 1
        elif not progressed:
            raise RuntimeError("the recorded schedule deadlocks (a wait on an event never recorded)")
    step = max(stream_t.values())
    exposed = step - busy["sm"]
    return {"step_us": step * 1e6, "compute_us": busy["sm"] * 1e6, "exchange_us": busy["link"] * 1e6,
            "exposed_us": exposed * 1e6, "hidden_pct": round(100.0 * (1 - exposed / busy["link"]), 3) + 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per rank")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS,
                    help="tie rules of the list schedule (module docstring, step 4)")
    ap.add_argument("--record-ep", type=int, default=2, choices=(1, 2),
                    help="EP of the recorded run (gloo ranks; 2: the exchange and the stage interleave's hand-offs "
                         "are in the record; 1: one process, no exchange op)")
    ap.add_argument("--out", default=None, help="JSON path (default: results_dir()/bench_overlap.json)")
    args = ap.parse_args(argv)
    if args.ep < 2:
        ap.error("--ep must be >= 2 (an exchange to hide)")
    print("assumptions: " + ", ".join(f"{k}={v}" for k, v in HW.items()) + "; bf16 rows and weights, balanced "
          "routing, roofline per stage (no efficiency factor), each exchange on the stream that issues it (its result "
          "is read right after), its SMs and the count all-gather not modelled, executors " + "/".join(args.executors) +
          " (ties when a resource frees up); schedule recorded from a small layer (" +
          ", ".join(f"{k} {v}" for k, v in SMALL.items()) + f", recorded at EP {args.record_ep}) on the CPU")
    recs = {name: record(*flags, ep=args.record_ep) for name, flags in SCHEDULES.items()}
    rows = []
    hdr = (f"{'config':<22} {'T/rank':>6} {'EP':>3} {'schedule':<34} {'executor':<11} {'step us':>9} {'compute':>9} "
           f"{'exchange':>9} {'exposed':>9} {'hidden':>7}")
    print(hdr)
    for name in args.configs:
        for T in args.tokens:
            for sched, rec in recs.items():
                for executor in args.executors:
                    r = dict(config=name, tokens_per_rank=T, ep=args.ep, schedule=sched, executor=executor,
                             **CONFIGS[name], **simulate(rec, CONFIGS[name], T, args.ep, executor))
                    rows.append(r)
                    print(f"{name:<22} {T:>6} {args.ep:>3} {sched:<34} {executor:<11} {r['step_us']:>9.1f} "
                          f"{r['compute_us']:>9.1f} {r['exchange_us']:>9.1f} {r['exposed_us']:>9.1f} "
                          f"{r['hidden_pct']:>6.1f}%")
    out = args.out or results_path("bench_overlap", dated=False)
    write_json(out, {"env": environment(), "hardware_assumed": HW, "recorded_shape": SMALL,
                     "recorded_ep": args.record_ep,
                     "microbatches": MICROBATCHES, "executors": list(args.executors), "rows": rows,
                     "note": "a roofline model over the recorded stream schedule, not a measurement"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
