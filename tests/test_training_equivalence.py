"""Training equivalence against an independent single-process oracle, and the composition fixes it found.

The CI subset of :mod:`helpers.equivalence` (overlap with the ``no_sync`` wiring, overlap without it must
raise, EP 2 x DP 2 with echo k=2 and overlap, loss scaling with aux and z losses, the global aux loss, interleaved
pipeline, delayed fused weight gradients, dropless training at capacity factor 1.0 with reruns (both capacity rules) and
the drop-mode control, the fused exchange, FP8 experts with echo and with the dropless rerun against the per-group quantize-dequantize oracle): the library's machinery on gloo ranks against one process training the
whole global batch with plain autograd and ``torch.optim.AdamW``. The whole matrix, from the checkout's root:
``PYTHONPATH=python:tests python -m helpers.equivalence --all``.
"""

import re

import pytest
import torch

from helpers import equivalence
from moe_graph.distributed.launch import run_distributed


@pytest.fixture(scope="module")
def ci_results():
    rows = [r for r in equivalence.MATRIX if r.name in equivalence.CI_ROWS]
    assert len(rows) == len(equivalence.CI_ROWS)
    return {r["name"]: r for r in equivalence.run_rows(rows)}


@pytest.mark.parametrize("name", equivalence.CI_ROWS)
def test_machinery_trains_like_the_oracle(ci_results, name):
    r = ci_results[name]
    assert r["ok"], equivalence.format_result(r)


def test_matrix_covers_the_issue():
    names = {r.name for r in equivalence.MATRIX}
    assert len(names) == len(equivalence.MATRIX)
    rows = equivalence.MATRIX
    assert {r.microbatches for r in rows if r.dp in (1, 2) and r.ep == 1 and r.pp == 1} >= {1, 2, 4}
    assert any(r.overlap for r in rows) and any(r.expect_error for r in rows)
    assert {r.echo for r in rows if r.ep == 2} >= {0, 1, 2}
    assert {r.aux for r in rows} >= {"local", "global", "sequence"}
    for flag in ("z_loss", "expert_bias", "shared_expert", "padding", "loss_scaler", "default_groups", "bf16"):
        assert any(getattr(r, flag) for r in rows), flag
    assert any(r.clip > 0 for r in rows)
    side = {(r.pp, r.capacity is not None, r.echo > 0) for r in rows if r.side_stream and r.shared_expert}
    assert {(1, False, False), (1, True, False), (2, False, True)} <= side  # overlap_shared_expert: plain, rerun, PP
    mbs = {(r.side_stream, r.capacity is not None, r.echo > 0, r.overlap) for r in rows if r.overlap_microbatches}
    assert {(True, False, False, False), (False, True, False, False), (False, False, True, True)} <= mbs
    assert any(r.recompute and r.overlap_microbatches for r in rows)  # the recomputation beside the next forward
    assert any(r.pp == 2 and r.vpp is None and r.microbatches == 4 for r in rows)
    assert any(r.pp == 2 and r.vpp == 2 and r.microbatches == 4 for r in rows)
    assert {r.grouped for r in rows} >= {"fused", "delay", "delay_fused"}
    dropless = [r for r in rows if r.capacity is not None]
    for mode in ("rerun", "drop"):  # rerun rows equal the oracle; drop rows are the control
        got = {(r.capacity, r.world, r.ep, r.pp, r.echo) for r in dropless if r.overflow == mode}
        assert got >= {(cf, w, 2, pp, e) for cf in (1.0, 1.1) for (w, pp, e) in ((2, 1, 0), (4, 1, 0), (2, 1, 1),
                                                                                  (4, 2, 0))}, mode
    fp8 = {(r.fp8, r.echo, r.capacity) for r in rows if r.fp8 and r.ep == 2}
    for recipe in ("blockwise", "mxfp8", "blockwise_fp32_scales"):  # plain EP 2, with echo, dropless rerun
        assert {(recipe, 0, None), (recipe, 1, None), (recipe, 0, 1.0)} <= fp8, recipe
        assert any(r.fp8 == recipe and r.grouped == "delay_fused" for r in rows), recipe  # delayed wgrad in FP8
    assert any(r.fp8_param_gather and r.ep == 1 for r in rows) and any(r.fp8_param_gather and r.ep == 2 for r in rows)


def test_fp8_rows_pin_down_the_expert_layout():
    """The control of the FP8 rows: with fp32 block scales (scale = 448 / amax) the oracle that quantizes each
    expert's rows as one single-process group (not per rank and microbatch, as the machinery lays them out)
    trains measurably differently, so the row's match proves the layout. With power-of-two scales (TE's default,
    MXFP8's E8M0) a tile's amax only shifts the exponent and the layouts agree to 1e-6 (helpers.equivalence)."""
    row = next(r for r in equivalence.MATRIX if r.name == "fp8_blockwise_fp32_scales_ep2")
    good, naive = equivalence.oracle_train(row), equivalence.oracle_train(row, naive_fp8_layout=True)
    as_machinery = dict(naive, skipped=[False] * equivalence.STEPS, dropped=0)
    res = equivalence.compare(row, good, [as_machinery])
    assert res["param"] > 5 * equivalence.TOL_FP8_FP32_SCALES["param"] and not res["ok"], res


def test_cli_prints_one_line_per_configuration_and_writes_only_with_out(tmp_path, capsys):
    out = tmp_path / "eq.txt"
    assert equivalence.main(["--only", "dp1_mb1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^PASS  dp1_mb1 .*param .* loss .* grad-norm ", printed, re.M)
    assert "total: 1/1 PASS" in printed and out.read_text().strip().endswith(printed.strip().splitlines()[-1])
    with pytest.raises(SystemExit):
        equivalence.main(["--only", "no_such_row"])


# ------------------------------------------------------------------------------------------------ aux scale --
def _router_grad(scale, aux=0.05, z=0.01):
    from moe_graph.moe.layer import MoELayer
    from moe_graph.moe.router import MoEAuxLossAutoScaler

    torch.manual_seed(0)
    layer = MoELayer(8, 8, 4, 2, aux_loss_coeff=aux, z_loss_coeff=z, device="cpu", params_dtype=torch.float64)
    x = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if scale is not None:
        MoEAuxLossAutoScaler.set_loss_scale(scale)
    try:
        layer(x).square().sum().backward()
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(1.0)
    return layer.router.weight.grad


def test_aux_loss_gradient_scale_is_set_per_step():
    # Megatron's MoEAuxLossAutoScaler: the router losses' gradient is multiplied by the scale set for the step
    # (loss_scale / num_microbatches), a device tensor (a captured graph reads the current value).
    from moe_graph.moe.router import MoEAuxLossAutoScaler

    plain = _router_grad(None, aux=0.0, z=0.0)  # the main loss alone
    one = _router_grad(None)
    assert (one - plain).abs().max() > 1e-4  # the aux/z losses do reach the router
    for s in (0.25, torch.tensor(2.0 ** 12 / 4)):
        got = _router_grad(s)
        torch.testing.assert_close(got - plain, float(s) * (one - plain), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="one element"):
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(2))
    with pytest.raises(ValueError, match="finite"):
        MoEAuxLossAutoScaler.set_loss_scale(float("inf"))
    assert float(MoEAuxLossAutoScaler.loss_scale("cpu")) == 1.0


def test_schedules_set_the_aux_scale_and_reset_it():
    from moe_graph.moe.router import MoEAuxLossAutoScaler
    from moe_graph.train import schedules

    seen = []
    model = torch.nn.Linear(2, 1)

    def fwd(it, m):
        seen.append(float(MoEAuxLossAutoScaler.loss_scale("cpu")))
        return m(next(it)).sum(), (lambda loss: loss)

    cfg = schedules.PipelineConfig(grad_scale_func=lambda loss: loss * 8.0)
    schedules.forward_backward_no_pipelining(forward_step_func=fwd, data_iterator=iter([torch.ones(2)] * 4), model=model,
                                     num_microbatches=4, config=cfg)
    assert seen == [2.0] * 4  # loss_scale / num_microbatches
    assert float(MoEAuxLossAutoScaler.loss_scale("cpu")) == 1.0


def test_train_step_validates_its_arguments():
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.distributed.optimizer import DistributedOptimizer
    from moe_graph.train.step import train_step

    ddp = DistributedDataParallel(torch.nn.Linear(2, 1), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-3)
    with pytest.raises(ValueError, match="microbatches is empty"):
        train_step(ddp, opt, [])
    with pytest.raises(ValueError, match="empty list of model chunks"):
        train_step([], opt, [torch.ones(2)])
    with pytest.raises(ValueError, match="several model chunks"):
        train_step([ddp, ddp], opt, [torch.ones(2)])


# --------------------------------------------------------------------------------------- default groups --
def _defaults_worker(rank, world):
    from moe_graph import parallel_state as ps
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.moe.layer import MoELayer

    out = {}

    def err(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    out["ambiguous_layer"] = err(lambda: MoELayer(8, 8, 4, 2, device="cpu"))
    out["ep_size_mismatch"] = err(lambda: MoELayer(8, 8, 4, 2, ep_size=3, device="cpu"))
    replicated = MoELayer(8, 8, 4, 2, ep_size=1, device="cpu")
    ddp = DistributedDataParallel(replicated)
    out["replicated_expert_dp"] = ddp.expert_data_parallel_world_size
    sharded = MoELayer(8, 8, 4, 2, ep_size=world, device="cpu")
    out["ambiguous_ddp"] = err(lambda: DistributedDataParallel(sharded))
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        layer = MoELayer(8, 8, 4, 2, device="cpu")
        ddp = DistributedDataParallel(layer)
        out["ps_R"] = layer.num_ep_ranks
        out["ps_expert_dp"] = ddp.expert_data_parallel_world_size
        out["ps_dp"] = ddp.data_parallel_world_size
    finally:
        ps.destroy_model_parallel()
    return out


def test_defaults_come_from_parallel_state_and_ambiguity_is_refused():
    for r in run_distributed(_defaults_worker, 2):
        assert "ambiguous" in r["ambiguous_layer"] and "ep_size=1" in r["ambiguous_layer"]
        assert "ep_size=3" in r["ep_size_mismatch"]
        assert r["replicated_expert_dp"] == 2  # ep_size=1: every rank holds every expert
        assert "expert_data_parallel_group" in r["ambiguous_ddp"] and "average different experts" in r["ambiguous_ddp"]
        assert (r["ps_R"], r["ps_expert_dp"], r["ps_dp"]) == (2, 1, 2)
