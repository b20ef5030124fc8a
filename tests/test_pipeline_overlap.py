"""Two microbatches in flight in the interleaved pipeline schedule (``PipelineConfig.overlap_microbatches`` with
:func:`moe_graph.train.schedules.forward_backward_pipelining_with_interleaving`): one more warm-up forward (as
Megatron-core's ``get_pp_rank_microbatches`` with ``overlap_moe_expert_parallel_comm``), then each steady step's
forward on one microbatch stream beside its backward on the other.

Oracles: the order (the steps of the schedule without the option, the extra warm-up forward aside) and the same
schedule without the option (the same forwards in the same order and the same backwards in the same order: losses,
gradients and the parameters after an AdamW step bitwise equal). The record (:class:`moe_graph.streams.StreamRecorder`)
of the overlapped schedule must show no ordering and no data dependency between a steady step's forward and backward
and every cross-stream use joined; a false dependency (the forward joined before the backward is issued) and a missing
join are caught.
"""

import pytest

from conftest import full_only
from helpers.overlap_workers import pipeline_overlap_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.train import schedules
from moe_graph.train.schedules import get_schedule_table, num_warmup_microbatches, schedule_order

CONFIGS = [(m, pp, vpp, g) for pp in (2, 3, 4) for vpp in (1, 2, 3) for m in (pp, 2 * pp, 3 * pp + 1, 8)
           for g in (None, m) if (g or pp) <= m and (m % (g or pp) == 0 or m % (g or pp) >= pp)]


def _steady(order, warmup):
    """``(forward, backward)`` step pairs of the steady state."""
    rest = order[warmup:]
    return [(rest[i], rest[i + 1]) for i in range(0, len(rest) - 1, 2) if rest[i][0] and not rest[i + 1][0]]


@pytest.mark.parametrize("m,pp,vpp,g", CONFIGS)
def test_overlap_order_is_the_plain_order_with_one_more_warmup_forward(m, pp, vpp, g):
    for r in range(pp):
        plain, over = schedule_order(m, pp, r, vpp, g), schedule_order(m, pp, r, vpp, g, overlap_microbatches=True)
        w0, w1 = num_warmup_microbatches(m, pp, r, vpp, g), num_warmup_microbatches(m, pp, r, vpp, g,
                                                                                    overlap_microbatches=True)
        assert w1 == min(w0 + 1, m * vpp)
        assert [s for s in over if s[0]] == [s for s in plain if s[0]]  # the same forwards in the same order
        assert [s for s in over if not s[0]] == [s for s in plain if not s[0]]  # the same backwards
        assert all(s[0] for s in over[:w1])  # w1 forwards, then one forward and one backward per steady step
        steady = _steady(over, w1)
        assert len(steady) == m * vpp - w1
        # every steady step: forward and backward of different microbatches (no dependency between them)
        assert all(f.microbatch_id != b.microbatch_id for f, b in steady), (r, steady)


def test_without_the_extra_forward_a_steady_step_depends_on_itself():
    """The control: without the option the last stage's steady step backs up the forward it just ran."""
    order = schedule_order(4, 2, 1, 2)
    steady = _steady(order, num_warmup_microbatches(4, 2, 1, 2))
    assert any(f.microbatch_id == b.microbatch_id and f.model_chunk_id == b.model_chunk_id for f, b in steady)


def test_overlap_printed_schedule():
    assert schedules.format_schedule(4, 2, 2, overlap_microbatches=True).splitlines() == [
        "rank 0 (warmup 5): F0.0 F1.0 F0.1 F1.1 F2.0 F3.0 B0.1 F2.1 B1.1 F3.1 B0.0 B1.0 B2.1 B3.1 B2.0 B3.0",
        "rank 1 (warmup 3): F0.0 F1.0 F0.1 F1.1 B0.1 F2.0 B1.1 F3.0 B0.0 F2.1 B1.0 F3.1 B2.1 B3.1 B2.0 B3.0"]
    # pp == 1: the overlapped plain loop keeps the serial order
    assert schedule_order(3, 1, 0, overlap_microbatches=True) == schedule_order(3, 1, 0)


def test_1f1b_refuses_overlap_naming_the_interleaved_schedule():
    with pytest.raises(ValueError, match="needs the interleaved schedule.*forward_backward_pipelining_with_"
                                         "interleaving, vpp_size >= 1"):
        schedule_order(4, 2, 0, overlap_microbatches=True)
    with pytest.raises(ValueError, match="overlap_microbatches must be a bool"):
        schedule_order(4, 2, 0, 2, overlap_microbatches=1)


@pytest.mark.parametrize("world", [2] + full_only(4))
def test_pp2_vpp2_overlap_equals_the_schedule_without_it_and_overlaps(world):
    """pp 2 x vpp 2 (x EP = world / 2) on gloo: bitwise equal to the same schedule without the option (losses, every
    gradient, the parameters after an AdamW step); the executed steps are schedule_order's with the option; in the
    record every steady step's forward and backward are unordered and independent, and every cross-stream use is
    joined. Joining the forward before the backward (a false dependency) or running the forward on its backward's
    stream orders them; leaving out the join's wait leaves races."""
    results = run_distributed(pipeline_overlap_worker, world, 2, True)
    for r in results:
        rank = r["pp_rank"]
        assert r["mismatch"] == [] and r["n_grads"] >= 20, r["mismatch"]
        assert r["n_losses"] == (4 if rank == 1 else 0)
        assert r["trace"] == [tuple(s) for s in schedule_order(4, 2, rank, 2, overlap_microbatches=True)]
        assert r["serial_trace"] == [tuple(s) for s in schedule_order(4, 2, rank, 2)]
        assert r["warmup"] == num_warmup_microbatches(4, 2, rank, 2) + 1
        clean = r["checks"]["None"]
        assert len(clean["steady"]) == 8 - r["warmup"] > 0
        for c in clean["steady"]:
            assert c["forward"] > 0 and c["backward"] > 0 and c["exchange"] > 0, c
            assert c["ordered"] == 0 and c["depends"] == 0, c
        assert clean["unjoined"] == 0
        assert clean["lanes"] == ["microbatch0", "microbatch1"] and clean["unlabelled"] == ["main"]
        assert all(c["ordered"] > 0 for c in r["checks"]["early_join"]["steady"])
        assert r["checks"]["early_join"]["unjoined"] == 0
        assert r["checks"]["no_join_wait"]["unjoined"] > 0
        assert all(c["ordered"] > 0 for c in r["checks"]["one_lane"]["steady"])  # the other lane matters


@pytest.mark.parametrize("chunks", full_only(1))
def test_pp2_one_chunk_interleaved_overlap_equals_the_schedule_without_it(chunks):
    """The way to overlap microbatches without virtual stages: the interleaved schedule with one model chunk per
    stage (1F1B itself refuses the option). CI: its schedule is checked above (one chunk is the same code with
    ``nc == 1``); the run itself full_only (``MOE_GRAPH_FULL_TESTS=0`` skips it)."""
    for r in run_distributed(pipeline_overlap_worker, 2, chunks, False):
        assert r["mismatch"] == [] and r["n_grads"] >= 20, r["mismatch"]
        assert r["trace"] == [tuple(s) for s in schedule_order(4, 2, r["pp_rank"], 1, overlap_microbatches=True)]
        clean = r["checks"]["None"]
        assert clean["unjoined"] == 0 and clean["steady"]
        assert all(c["ordered"] == 0 and c["depends"] == 0 for c in clean["steady"])
