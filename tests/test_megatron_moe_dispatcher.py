"""moe_graph's token dispatcher inside real megatron-core 0.19.2's ``MoELayer``, against Megatron's own all-to-all
dispatcher in dropless mode (the oracle), on CPU and gloo.

The two layers are built from the same spec (``get_gpt_layer_with_moe_graph_spec``, ``dispatcher="megatron"`` vs
``"moe_graph"``) with the same weights: the same router (Megatron's, with its options), the same experts
(``TEGroupedMLP`` on moe_graph's grouped linears) and shared experts; only the dispatcher differs. Compared: the
output, the input gradient, every parameter gradient (router, experts, shared experts) and the aux losses Megatron
logs, at EP 1 and EP 2 (two gloo processes), top-2 and top-8, softmax and sigmoid routers (group-limited top-k,
expert bias, scaling factor), with and without shared experts; then the host syncs of one forward + backward
(``benchmarks/bench_moe_cost.py``'s dispatch-level trace). Runs in CI's Megatron step beside
``tests/test_megatron_client.py`` (the same fetch and CPU shims, ``benchmarks/megatron_env.py``).
"""

from __future__ import annotations

import pytest
import torch

from moe_graph.distributed.launch import run_distributed
from test_megatron_client import _SKIP, _assert_no_stand_in_called, _cpu_shims, _init_megatron, pg  # noqa: F401

pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

H, FFN, E = 16, 24, 8

# router / layer options per case (the Megatron config keywords); every case runs at EP 1 and EP 2
CASES = {
    "softmax-top2-aux": dict(moe_router_topk=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
                             moe_z_loss_coeff=1e-3, gated_linear_unit=True),
    "sigmoid-top8-groups-bias-shared": dict(
        moe_router_topk=8, moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=4,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01,
        moe_shared_expert_intermediate_size=FFN, gated_linear_unit=True),
    "softmax-top2-bias-global": dict(  # Megatron's shared experts take no bias
        moe_router_topk=2, moe_router_pre_softmax=True, add_bias_linear=True,
        moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1),
    "sigmoid-top8-shared-gate-overlap": dict(
        moe_router_topk=8, moe_router_score_function="sigmoid", moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=FFN, moe_shared_expert_gate=True, moe_shared_expert_overlap=True,
        gated_linear_unit=True),
}


def _config(ep: int, **kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_ffn_hidden_size=FFN,
                ffn_hidden_size=FFN, use_cpu_initialization=True, add_bias_linear=False, bias_activation_fusion=False,
                bias_dropout_fusion=False, gradient_accumulation_fusion=False, params_dtype=torch.float32,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, expert_model_parallel_size=ep,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    args.update(kw)
    args["activation_func"] = F.silu if args.get("gated_linear_unit") else F.gelu
    return TransformerConfig(**args)


def _layers(cfg, pg, dispatcher_options=None, seed=7):
    """(Megatron's alltoall MoELayer, the moe_graph one) with the same weights (router and shared experts the same on
    every rank, experts per rank)."""
    from moe_graph.integrations.megatron import get_gpt_layer_with_moe_graph_spec
    from moe_graph.integrations.megatron_moe import MoeGraphMoELayer

    ref = get_gpt_layer_with_moe_graph_spec(E, use_transformer_engine=False).submodules.mlp(config=cfg, pg_collection=pg)
    spec = get_gpt_layer_with_moe_graph_spec(E, use_transformer_engine=False, dispatcher="moe_graph",
                                             dispatcher_options=dispatcher_options)
    mg = spec.submodules.mlp(config=cfg, pg_collection=pg)
    assert isinstance(mg, MoeGraphMoELayer) and type(ref).__name__ == "MoELayer"
    for layer in (ref, mg):
        layer.set_layer_number(1)
    shared_gen = torch.Generator().manual_seed(seed)
    rank_gen = torch.Generator().manual_seed(seed + 1 + torch.distributed.get_rank())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            g = rank_gen if name.startswith("experts.") else shared_gen
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if name.startswith("experts.") else 0.5))
    missing, unexpected = mg.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return ref, mg


def _step(layer, x, g, padding_mask=None):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    x = x.clone().requires_grad_()
    out, bias = layer(x) if padding_mask is None else layer(x, padding_mask=padding_mask)
    assert bias is None
    out.backward(g)
    logged = {k: e.values.clone() for k, e in tracker.metrics.items()}
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    buffers = {n: b.clone() for n, b in layer.named_buffers() if not n.startswith("moe_graph_")}
    return {"out": out.detach(), "input grad": x.grad, **{f"grad {n}": t for n, t in grads.items()},
            **{f"logged {k}": v for k, v in logged.items()}, **{f"buffer {n}": t for n, t in buffers.items()}}


def _compare_case(rank, ep, case, pg, tokens=(6, 2), dispatcher_options=None, padding=False):
    cfg = _config(ep, **CASES[case])
    gen = torch.Generator().manual_seed(99 + rank)  # different tokens on every rank
    x, g = torch.randn(*tokens, H, generator=gen), torch.randn(*tokens, H, generator=gen)
    # Megatron's padding_mask: [batch, sequence], True for real tokens (its losses and expert-bias counts skip the rest)
    pad = (torch.rand(tokens[1], tokens[0], generator=gen) < 0.7) if padding else None
    with _cpu_shims():  # Megatron's CUDA stream calls (its dispatcher's, the overlapped shared expert's) on CPU
        ref, mg = _layers(cfg, pg, dispatcher_options)
        want = _step(ref, x, g, pad)
        got = _step(mg, x, g, pad)
    # moe_graph's own metrics in Megatron's tracker: nothing dropped (dropless), the loads of this dispatch
    ours = {k: got.pop(k) for k in list(got) if k.startswith("logged moe_graph_")}
    for k in [k for k in want if k.startswith("logged moe_graph_")]:  # entries of earlier layers (the tracker
        assert want.pop(k).count_nonzero() == 0, k  # is global and keeps them), none written by Megatron's layer
    echo = bool((dispatcher_options or {}).get("num_spare_experts_per_ep_rank"))
    names = ["dropped_routes", "expert_rows", "load_ratio"]
    names += ["load_imbalance_after_echo", "load_imbalance_before_echo"] if echo else []
    assert sorted(ours) == sorted(f"logged moe_graph_{n}" for n in names), sorted(ours)
    assert ours["logged moe_graph_dropped_routes"].sum() == 0 and ours["logged moe_graph_load_ratio"].sum() >= 1
    if ep == 1:  # every route stays on the one rank: the mean load exactly
        assert ours["logged moe_graph_expert_rows"].tolist() == [1.0], ours
    gain = 0.0
    if echo:  # echo never makes the busiest rank busier
        gain = (ours["logged moe_graph_load_imbalance_before_echo"]
                - ours["logged moe_graph_load_imbalance_after_echo"]).item()
        assert gain >= 0, ours
    assert want.keys() == got.keys(), (sorted(want.keys() ^ got.keys()))
    errors = {k: (got[k].double() - want[k].double()).abs().max().item() if want[k].numel() else 0.0 for k in want}
    logged = sorted(k for k in want if k.startswith("logged") and want[k].abs().sum() > 0)
    if CASES[case]["moe_router_load_balancing_type"] != "none":  # the loss was logged (and compared)
        assert logged, (case, sorted(want))
    return errors, mg.dispatcher.dropped_routes.item(), gain


ECHO = {"num_spare_experts_per_ep_rank": 1}
ECHO_CASES = ["softmax-top2-aux", "softmax-top2-bias-global", "sigmoid-top8-groups-bias-shared"]


def _worker(rank, world, cases, echo_cases=()):
    pg = _init_megatron(world)
    try:
        res = {case: _compare_case(rank, world, case, pg) for case in cases}
        res.update({f"{case}+echo": _compare_case(rank, world, case, pg, dispatcher_options=ECHO)
                    for case in echo_cases})
        return res
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


TOL = 2e-5


def _check(results):
    for per_case in results:
        for case, (errors, dropped, _) in per_case.items():
            assert dropped == 0, (case, dropped)
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, (case, bad)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_megatron_alltoall_ep1(pg, case):  # noqa: F811
    _check([{case: _compare_case(0, 1, case, pg)}])


def test_matches_megatron_alltoall_ep2_gloo():
    results = run_distributed(_worker, 2, list(CASES), ECHO_CASES, timeout=300)
    _check(results)
    # echo moved tokens: the busiest rank's load over the mean went down (the same on both ranks; top-8 of 8
    # experts sends every token everywhere: balanced already, nothing moves)
    gains = {case: results[0][f"{case}+echo"][2] for case in ECHO_CASES}
    assert gains["softmax-top2-aux"] > 0 and gains["softmax-top2-bias-global"] > 0, gains


@pytest.mark.parametrize("case", ["softmax-top2-aux", "softmax-top2-bias-global"])
def test_padding_mask_matches_megatron_alltoall_ep1(pg, case):  # noqa: F811
    # (Megatron 0.19.2's own router fails with a padding mask and its sequence-wise aux loss: not a dispatcher case)
    _check([{case: _compare_case(0, 1, case, pg, padding=True)}])


@pytest.mark.parametrize("case", ECHO_CASES)
def test_echo_matches_megatron_alltoall_ep1(pg, case):  # noqa: F811
    # one spare slot: the busiest experts' routes move to a copy of their weights; the same results (rounding: the
    # moved rows' weight gradients are summed in another order)
    _check([{case: _compare_case(0, 1, case, pg, dispatcher_options=ECHO)}])


# ------------------------------------------------------------------------------------------- host syncs --
def _host_syncs(layer, x, g, sync_hook):
    """Host syncs of one forward + backward (after a warm-up step): ``benchmarks/bench_moe_cost.py``'s
    dispatch-level trace (``.item()``, data-dependent shapes, ``.tolist()``/``.cpu()`` of device values, stream and
    event synchronizes)."""
    import bench_moe_cost as bench

    meter = bench.CostMeter()
    sync_hook.append(meter)
    with bench.device_branch():  # moe_graph's eager host checks of CPU values: the branch a GPU takes
        res = bench.measure(lambda t: layer(t.unsqueeze(1))[0].squeeze(1), x, g, layer, meter, reps=1)
    return res["host_syncs"], res["sync_points"]


@pytest.mark.parametrize("case", ["softmax-top2-aux", "sigmoid-top8-groups-bias-shared"])
def test_no_host_sync_in_forward_backward(pg, case):  # noqa: F811
    cfg = _config(1, **CASES[case])
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(16, H, generator=gen), torch.randn(16, H, generator=gen)
    meters = []
    with _cpu_shims(on_sync=lambda what: meters[-1].sync(what),
                    on_host_copy=lambda value: meters[-1].host_copy(value)):
        ref, mg = _layers(cfg, pg)
        ref_syncs, ref_points = _host_syncs(ref, x, g, meters)
        mg_syncs, mg_points = _host_syncs(mg, x, g, meters)
    assert ref_syncs == 1, ref_points  # Megatron's alltoall: the device-to-host copy of the token counts
    assert mg_syncs == 0, mg_points


# ----------------------------------------------------------------------------- static capacity and rerun --
class _Optimizer:
    """SGD with Megatron's optimizer contract: ``step() -> (update_successful, grad_norm, num_zeros_in_grad)``."""

    def __init__(self, module):
        self.opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        self.opt.step()
        return True, None, None


def _train_step(forward_step_func, data_iterator, model, optimizer, num_microbatches=2):
    """Megatron's train_step in small: zero the grads, forward + backward of each microbatch, the optimizer step."""
    optimizer.zero_grad()
    for _ in range(num_microbatches):
        x, g = next(data_iterator)
        forward_step_func(model, x).backward(g)
    return optimizer.step()


def _forward(model, x):
    return model(x)[0]


def _data(rank, steps, mbs=2):
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 2, H, generator=gen), torch.randn(8, 2, H, generator=gen)) for _ in range(steps * mbs)]


def _train(rank, ep, case, pg, capacity_factor, overflow, steps=3, rerun_kwargs=None):
    """(parameters after ``steps`` steps, statistics) of the moe_graph layer trained at the given capacity."""
    from moe_graph.integrations.megatron_moe import MegatronOverflowRerun

    cfg = _config(ep, **CASES[case])
    opts = dict(capacity_factor=capacity_factor, overflow=overflow)
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    with _cpu_shims():  # Megatron's router moves a CPU gate weight to torch.cuda.current_device()
        _, mg = _layers(cfg, pg, opts)
        opt = _Optimizer(mg)
        data = iter(_data(rank, steps))
        rerun = MegatronOverflowRerun(mg, opt, **(rerun_kwargs or {})) if overflow == "rerun" else None
        skipped = 0
        for _ in range(steps):
            if rerun is not None:
                ok, _, _ = rerun.train_step(_train_step, _forward, data, mg, opt)
            else:
                ok, _, _ = _train_step(_forward, data, mg, opt)
            skipped += not ok
    state = {n: t.detach().clone() for n, t in mg.state_dict().items() if torch.is_tensor(t) and t.numel()}
    stats = rerun.statistics() if rerun is not None else {"dropped": mg.dispatcher.dropped_routes.item()}
    # the drops Megatron's tracker logged (summed over the EP group at report time) are the dispatcher's
    stats["logged_dropped"] = get_moe_metrics_tracker().metrics["moe_graph_dropped_routes"].values.sum().item()
    return state, dict(stats, skipped=skipped)


def _rerun_compare(rank, ep, case, pg):
    dropless, _ = _train(rank, ep, case, pg, None, "drop")
    rerun, stats = _train(rank, ep, case, pg, 0.5, "rerun", rerun_kwargs=dict(threshold=None))
    adapted, adapted_stats = _train(rank, ep, case, pg, 0.5, "rerun", rerun_kwargs=dict(window=2, threshold=0.4))
    dropped, drop_stats = _train(rank, ep, case, pg, 0.5, "drop")
    err = lambda other: max((other[k].double() - v.double()).abs().max().item() for k, v in dropless.items())  # noqa: E731
    return {"rerun": err(rerun), "adapted": err(adapted), "drop": err(dropped), "stats": stats,
            "adapted_stats": adapted_stats, "drop_stats": drop_stats}


def _check_rerun(res, ep):
    assert res["rerun"] <= TOL and res["adapted"] <= TOL, res  # the rerun trains exactly as the dropless layer
    assert res["drop"] > 1e-3 and res["drop_stats"]["dropped"] > 0, res  # the control: dropping changes training
    assert res["drop_stats"]["logged_dropped"] == res["drop_stats"]["dropped"], res
    assert res["stats"]["logged_dropped"] == 0, res  # a rerun step's overflowed pass is not logged: it never happened
    assert res["stats"]["reruns"] == 3 and res["stats"]["skipped"] == 0, res  # every step reran; none skipped
    # the adaptive rule raised the capacity after the first rerun (past the largest observed load ratio)
    assert res["adapted_stats"]["capacity_factor"] > 0.5 and res["adapted_stats"]["reruns"] < 3, res


def _rerun_worker(rank, world, case):
    pg = _init_megatron(world)
    try:
        return _rerun_compare(rank, world, case, pg)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def test_rerun_at_tight_capacity_equals_dropless_ep1(pg):  # noqa: F811
    _check_rerun(_rerun_compare(0, 1, "sigmoid-top8-groups-bias-shared", pg), 1)


def test_rerun_at_tight_capacity_equals_dropless_ep2_gloo():
    for res in run_distributed(_rerun_worker, 2, "softmax-top2-aux", timeout=300):
        _check_rerun(res, 2)


# ------------------------------------------------------------------------------------ full-iteration graph --
def _gpt(spec, seed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=E,
                            moe_ffn_hidden_size=32, ffn_hidden_size=128, moe_router_topk=2, moe_grouped_gemm=True,
                            moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                            bias_dropout_fusion=False, add_bias_linear=False, params_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
                            cuda_graph_impl="full_iteration")
    return GPTModel(cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=32).cuda()


def _gpt_batches(steps, mbs, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps * mbs):
        tokens = torch.randint(0, 128, (2, 32), generator=gen)
        out.append({"tokens": tokens.cuda(), "labels": torch.roll(tokens, -1, 1).cuda()})
    return out


def _gpt_forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    pos = torch.arange(32, device=batch["tokens"].device).unsqueeze(0).expand(2, -1)
    out = model(batch["tokens"], pos, None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, partial(loss_func)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron's full-iteration CUDA graph needs a GPU")
def test_megatron_full_iteration_graph_of_a_moe_gpt_replays_on_changing_data_cuda(tmp_path):
    """A 2-layer MoE GPT with moe_graph's dispatcher (dropless) under Megatron's ``FullCudaGraphWrapper``
    (``--cuda-graph-impl full_iteration``: forward + backward of every microbatch in one graph, the optimizer outside
    it): the captured iterations replay on new microbatches each step and match the same model trained eagerly."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from moe_graph.integrations.megatron import get_gpt_layer_with_moe_graph_spec

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        spec = get_gpt_layer_with_moe_graph_spec(E, use_transformer_engine=False, dispatcher="moe_graph")
        steps, mbs = 5, 2
        losses = {}
        for mode in ("eager", "graph"):
            model = _gpt(spec, seed=3)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            fbf = get_forward_backward_func()
            if mode == "graph":
                FullCudaGraphWrapper.curr_iteration["training"] = 0
                fbf = FullCudaGraphWrapper(fbf, cuda_graph_warmup_steps=2)
            data = iter(_gpt_batches(steps, mbs, seed=11))
            losses[mode] = []
            for _ in range(steps):
                opt.zero_grad(set_to_none=False)  # the captured backward writes into the same .grad tensors
                res = fbf(forward_step_func=_gpt_forward_step, data_iterator=data, model=[model],
                          num_microbatches=mbs, seq_length=32, micro_batch_size=2, forward_only=False)
                opt.step()  # outside the graph, as Megatron's optimizer
                losses[mode].append(torch.stack([r["lm loss"] for r in res]).mean().item())
            if mode == "graph":
                assert FullCudaGraphWrapper.cuda_graph["training"] is not None  # captured, then replayed
                fbf.reset_cuda_graph()
        assert len(set(losses["graph"])) == steps  # new data every replay
        torch.testing.assert_close(torch.tensor(losses["graph"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-4)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


# ------------------------------------------------------- Megatron's own dispatcher checks, on moe_graph's --
# tests/unit_tests/transformer/moe/test_token_dispatcher.py of Megatron-LM checks every dispatcher through its six
# methods, on CUDA with its test utilities: a dropless round trip (dispatch, scale each row by its probability with
# probabilities 1/K, combine: the input comes back, and so does its gradient) and a round trip with Megatron's own
# capacity (moe_expert_capacity_factor: the router drops per expert; at most capacity * EP rows per local expert; the
# input comes back times the kept probabilities). The same checks, written here for CPU and gloo, on moe_graph's
# dispatcher. Not applicable: drop-and-pad (moe_pad_expert_input_to_capacity raises: the static capacity is
# capacity_factor's), the fp8 router padding (raises), expert TP > 1 (raises).
def _round_trip(layer, hidden, probs, routing_map):
    d = layer.token_dispatcher
    h, p = d.dispatch_preprocess(hidden, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    rows, tokens_per_expert, row_probs = d.dispatch_postprocess(h, p)
    rows = rows * row_probs.unsqueeze(-1)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows)))
    return out, tokens_per_expert.tolist(), rows.shape[0]


def _megatron_dispatcher_checks(rank, ep, pg):
    from megatron.core.transformer.moe.moe_utils import get_capacity

    out = {}
    for capacity_factor in (None, 0.5):
        kw = dict(CASES["softmax-top2-aux"], moe_router_dtype="fp32")
        if capacity_factor is not None:
            kw.update(moe_expert_capacity_factor=capacity_factor, moe_token_drop_policy="probs")
        cfg = _config(ep, **kw)
        with _cpu_shims():
            _, mg = _layers(cfg, pg)
            gen = torch.Generator().manual_seed(31 + rank)
            hidden = torch.randn(16, H, generator=gen).requires_grad_()
            probs, routing_map = mg.router(hidden)
        probs = routing_map.to(probs.dtype) / cfg.moe_router_topk  # Megatron's test: probability 1/K per route
        kept = probs.sum(1, keepdim=True)
        restored, tokens_per_expert, rows = _round_trip(mg, hidden, probs, routing_map)
        restored.backward(hidden.detach())
        want = hidden.detach() * kept
        err = max((restored - want).abs().max().item(), (hidden.grad - want).abs().max().item())
        capacity = None
        if capacity_factor is not None:
            capacity = get_capacity(16 * cfg.moe_router_topk, E, capacity_factor) * ep
        out[capacity_factor] = dict(err=err, tokens_per_expert=tokens_per_expert.tolist(), capacity=capacity,
                                    kept=kept.min().item(), rows=rows)
    return out


def _check_megatron_dispatcher(res):
    assert res[None]["err"] <= 1e-6 and res[None]["kept"] == 1.0, res  # dropless: the input itself comes back
    assert res[0.5]["err"] <= 1e-6 and res[0.5]["kept"] < 1.0, res  # the router dropped some routes
    assert max(res[0.5]["tokens_per_expert"]) <= res[0.5]["capacity"], res


def _megatron_dispatcher_worker(rank, world):
    pg = _init_megatron(world)
    try:
        return _megatron_dispatcher_checks(rank, world, pg)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()


def test_megatron_dispatcher_round_trips_ep1(pg):  # noqa: F811
    _check_megatron_dispatcher(_megatron_dispatcher_checks(0, 1, pg))


def test_megatron_dispatcher_round_trips_ep2_gloo():
    for res in run_distributed(_megatron_dispatcher_worker, 2, timeout=300):
        _check_megatron_dispatcher(res)


def test_unsupported_combinations_raise_naming_them(pg):  # noqa: F811
    from moe_graph.integrations.megatron_moe import _check_config

    cfg = _config(1, **CASES["softmax-top2-aux"])
    with pytest.raises(NotImplementedError, match="expert_tensor_parallel_size=2"):
        _check_config(cfg, 2)
    for kw, name in ((dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0),
                      "moe_pad_expert_input_to_capacity"),):
        bad = _config(1, **dict(CASES["softmax-top2-aux"], **kw))
        with pytest.raises(NotImplementedError, match=name), _cpu_shims():
            _layers(bad, pg, dict(ECHO))
    with pytest.raises(ValueError, match="capacity_factor"), _cpu_shims():
        _layers(cfg, pg, dict(overflow="rerun"))


def _sequence_parallel_worker(rank, world):
    # attention TP 2 with sequence parallelism, expert TP 1, EP 2 over the same two ranks: each rank routes and
    # dispatches its own sequence shard over the EP group, as Megatron's all-to-all dispatcher does
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups()
        cfg = _config(2, **dict(CASES["softmax-top2-aux"], tensor_model_parallel_size=2, sequence_parallel=True,
                                expert_tensor_parallel_size=1))
        gen = torch.Generator().manual_seed(99 + rank)
        x, g = torch.randn(6, 2, H, generator=gen), torch.randn(6, 2, H, generator=gen)
        with _cpu_shims():
            ref, mg = _layers(cfg, pg)
            want, got = _step(ref, x, g), _step(mg, x, g)
        return {k: (got[k].double() - want[k].double()).abs().max().item() for k in want if k in got and want[k].numel()}
    finally:
        ps.destroy_model_parallel()


def test_sequence_parallel_attention_tp2_ep2_matches_megatron_gloo():
    for errors in run_distributed(_sequence_parallel_worker, 2, timeout=300):
        assert errors and max(errors.values()) <= TOL, errors


def test_rerun_restores_megatron_rng_tracker_states_tensors_and_generators(monkeypatch):
    # Megatron's CudaRNGStatesTracker holds byte-tensor states, or generators with use_cudagraphable_rng
    from moe_graph.integrations import megatron_moe

    class Tracker:
        def __init__(self):
            self.states = {"expert": torch.Generator().manual_seed(1), "model": torch.Generator().manual_seed(2).get_state()}

        def is_initialized(self):
            return True

        def get_states(self):
            return dict(self.states)

        def set_states(self, states):
            self.states = states

    tracker = Tracker()
    monkeypatch.setattr(megatron_moe, "get_cuda_rng_tracker", lambda: tracker)
    saved = megatron_moe._rng_state(None)
    first = torch.rand(3, generator=tracker.states["expert"])
    tracker.states["model"] = torch.Generator().manual_seed(3).get_state()
    megatron_moe._set_rng_state(saved, None)
    assert torch.equal(torch.rand(3, generator=tracker.states["expert"]), first)
    assert torch.equal(tracker.states["model"], torch.Generator().manual_seed(2).get_state())
