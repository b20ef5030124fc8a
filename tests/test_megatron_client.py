"""moe_graph inside real megatron-core 0.19.2 on CPU, checked against Megatron's own SequentialMLP.

Megatron's ``TEGroupedMLP`` built with ``moe_graph.integrations.megatron``'s grouped linears (no TransformerEngine
installed) against ``SequentialMLP`` (one ``ColumnParallelLinear``/``RowParallelLinear`` MLP per expert, Megatron's
reference implementation) with the same weights: outputs and input/probs/weight/bias gradients (gated or not, bias
or not, zero-token experts, one expert taking every token), fused ``main_grad`` over two microbatches, delayed wgrad
(``backward_dw``), Megatron's ``DistributedDataParallel`` with ``overlap_grad_reduce`` on and off,
``sharded_state_dict`` + ``dist_checkpointing`` round trips into ``SequentialMLP`` and back, and the whole
``MoELayer`` (router + all-to-all dispatcher) at EP=1 and EP=2 on gloo, built from
``get_gpt_layer_with_moe_graph_spec``.

megatron-core 0.19.2 declares Python >= 3.12 but the modules used here are pure Python and run on 3.11: the wheel
is fetched once with ``pip download`` and unpacked under ``build/`` (git-ignored; ``MOE_GRAPH_MEGATRON_CACHE``
overrides the folder). Without network or pip the tests skip with the reason.

Megatron's import-time stand-ins for TransformerEngine (``unittest.mock.MagicMock`` objects it installs when TE is
missing, e.g. ``megatron.core.extensions.transformer_engine.te``) must never be called on this path: every test
asserts their call count is zero. The fetch and the CPU shims for Megatron's CUDA calls are in
``benchmarks/megatron_env.py`` (each says why).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_graph.distributed.launch import run_distributed

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "benchmarks"))
from megatron_env import cpu_shims as _cpu_shims  # noqa: E402  (the fetch and the CPU shims, shared with benchmarks)
from megatron_env import provide_megatron as _provide_megatron  # noqa: E402

_SKIP = _provide_megatron()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

H, FFN, E = 16, 24, 4


def _te_stand_in_calls():
    """Calls made to Megatron's import-time TE/kitchen stand-ins (MagicMocks installed when TE is missing)."""
    from unittest.mock import MagicMock

    calls = {}
    for name, mod in list(sys.modules.items()):
        if not (name == "megatron" or name.startswith("megatron.")) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, MagicMock):
                calls[f"{name}.{attr}"] = len(value.mock_calls)
    return calls


def _import_megatron_path():
    """Import every Megatron module this path uses (their import-time use of the stand-ins, e.g. TE dtype enums as
    dict keys, is not a call on this path), then return the stand-ins' call counts as the baseline."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.moe.moe_layer  # noqa: F401

    import moe_graph.integrations.megatron  # noqa: F401

    return _te_stand_in_calls()


def _stand_in_calls_since(baseline):
    return {k: v - baseline.get(k, 0) for k, v in _te_stand_in_calls().items() if v != baseline.get(k, 0)}


_BASELINE = _import_megatron_path() if _SKIP is None else {}


def _assert_no_stand_in_called():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        assert "megatron.core.extensions.transformer_engine.te" in _BASELINE  # the stand-in exists: it is checked
    assert _stand_in_calls_since(_BASELINE) == {}


# ------------------------------------------------------------------------------------------- environment --
def _init_megatron(ep: int = 1):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.fixture(scope="module")
def pg():
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield _init_megatron()
        finally:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            dist.destroy_process_group()
    _assert_no_stand_in_called()


@pytest.fixture(autouse=True)
def _no_te_stand_in_calls():
    yield
    if _SKIP is None:
        _assert_no_stand_in_called()


def _config(gated=False, bias=False, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN, use_cpu_initialization=True, gated_linear_unit=gated, add_bias_linear=bias,
        activation_func=F.silu if gated else F.gelu, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
    )
    # Set after TransformerConfig's validation, which ties these flags to other features: delay_wgrad_compute to
    # the EP-overlapped 1F1B schedule (overlap_moe_expert_parallel_comm, EP > 1; the experts' own delayed-wgrad
    # contract is what is tested here), the single grouped parameters to TE >= 2.14 and its op fuser (TE's
    # GroupedTensor parameters; moe_graph has them without TE).
    late = {k: kw.pop(k) for k in ("delay_wgrad_compute", "moe_single_grouped_weight", "moe_single_grouped_bias") if k in kw}
    args.update(kw)
    cfg = TransformerConfig(moe_grouped_gemm=True, **args)
    for k, v in late.items():
        setattr(cfg, k, v)
    return cfg


def _sequential(cfg, pg, num_local=E):
    from megatron.core.models.backends import LocalSpecProvider

    seq = LocalSpecProvider().grouped_mlp_modules(True)(num_local, cfg, pg_collection=pg)
    for mlp in seq.local_experts:
        # Megatron's RowParallelLinear at expert TP=1/EP=1 returns its output through a no-op all-reduce autograd
        # Function that hands back its input, and SequentialMLP then adds the expert bias in place into it, which
        # autograd forbids (a Megatron bug, on GPU as well). At EP>1 the layer skips that Function
        # (explicit_expert_comm); do the same here so that the reference runs with biases.
        mlp.linear_fc2.explicit_expert_comm = True
    return seq


def _grouped(cfg, pg, num_local=E):
    from moe_graph.integrations.megatron import experts_spec

    return experts_spec()(num_local, cfg, pg_collection=pg)


def _expert_leaves(mg, name, kind):
    """(parameter, index or None) per expert: the grouped parameter and the expert's row, or the expert's own."""
    lin = getattr(mg, name)
    ps = lin._weights() if kind == "weight" else lin._biases()
    grouped = ps[0].dim() == (3 if kind == "weight" else 2)
    return [(ps[0], e) for e in range(lin.num_gemms)] if grouped else [(p, None) for p in ps]


def _pick(t, idx):
    return t if idx is None else t[idx]


def _expert_params(mg, name, kind):
    """One tensor per expert (rows of a grouped parameter are views)."""
    return [_pick(p, i) for p, i in _expert_leaves(mg, name, kind)]


def _randomize_and_copy(mg, seq, gen, bias):
    """Fresh random weights (and biases) in the moe_graph experts, copied into SequentialMLP's experts."""
    with torch.no_grad():
        for p in mg.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias") if bias else ("weight",):
                for e, src in enumerate(_expert_params(mg, name, kind)):
                    getattr(getattr(seq.local_experts[e], name), kind).copy_(src)


def _run(module, x, tpe, probs, g):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    y, ybias = module(x, tpe, probs)
    assert ybias is None
    y.backward(g)
    return y.detach(), x.grad, probs.grad


def _expert_grads(mg, seq, bias, mg_grad=lambda p: p.grad):
    pairs = []
    for name in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias") if bias else ("weight",):
            for e, (p, idx) in enumerate(_expert_leaves(mg, name, kind)):
                ref = getattr(getattr(seq.local_experts[e], name), kind).grad
                pairs.append((f"{name}.{kind}{e}", _pick(mg_grad(p), idx), ref))
    return pairs


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}: {m}")


SPLITS = [[5, 0, 7, 3], [0, 0, 15, 0], [2, 4, 1, 8]]  # zero-token experts; one expert taking every token


# ----------------------------------------------------------------------------------------------- experts --
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_te_grouped_mlp_matches_sequential_mlp(pg, gen, gated, bias, single):
    cfg = _config(gated, bias, moe_single_grouped_weight=single, moe_single_grouped_bias=single)
    mg, seq = _grouped(cfg, pg), _sequential(cfg, pg)
    assert ("weight" in dict(mg.linear_fc1.named_parameters())) == single
    _randomize_and_copy(mg, seq, gen, bias)
    for tpe in SPLITS:
        mg.zero_grad(set_to_none=True)
        seq.zero_grad(set_to_none=True)
        T = sum(tpe)
        x, probs, g = torch.randn(T, H, generator=gen), torch.rand(T, generator=gen), torch.randn(T, H, generator=gen)
        ym, xm, pm = _run(mg, x, torch.tensor(tpe), probs, g)
        ys, xs, ps_ = _run(seq, x, torch.tensor(tpe), probs, g)
        _close(ym, ys, "output")
        _close(xm, xs, "input grad")
        _close(pm, ps_, "probs grad")
        for what, a, b in _expert_grads(mg, seq, bias):
            if b is None:  # an expert without tokens: SequentialMLP's parameter got no gradient at all
                assert torch.count_nonzero(a) == 0, what
            else:
                _close(a, b, what)


def _attach_main_grads(mg, fill=None):
    for p in mg.parameters():
        p.main_grad = torch.full(p.shape, float("nan")) if fill is None else torch.full(p.shape, fill)
        p.grad_added_to_main_grad = False


def _seq_grads_over(seq, mbs):
    for x, tpe, probs, g in mbs:
        _run(seq, x, tpe, probs, g)


def _microbatches(gen, n=2):
    out = []
    for tpe in SPLITS[:n]:
        T = sum(tpe)
        out.append((torch.randn(T, H, generator=gen), torch.tensor(tpe), torch.rand(T, generator=gen),
                    torch.randn(T, H, generator=gen)))
    return out


@pytest.mark.parametrize("gated", [False, True])
def test_fused_main_grad_over_two_microbatches(pg, gen, gated):
    cfg = _config(gated, True, gradient_accumulation_fusion=True)
    mg, seq = _grouped(cfg, pg), _sequential(_config(gated, True), pg)
    _randomize_and_copy(mg, seq, gen, True)
    _attach_main_grads(mg)  # NaN: the first microbatch (is_first_microbatch) must overwrite, not add
    mbs = _microbatches(gen)
    for x, tpe, probs, g in mbs:
        _run(mg, x, tpe, probs, g)
    _seq_grads_over(seq, mbs)
    for what, a, b in _expert_grads(mg, seq, False, mg_grad=lambda p: p.main_grad):
        _close(a, b if b is not None else torch.zeros_like(a), what)
    for w in mg.linear_fc1._weights() + mg.linear_fc2._weights():
        assert w.grad_added_to_main_grad is True and torch.count_nonzero(w.grad) == 0
    for what, a, b in _expert_grads(mg, seq, True):
        if ".bias" in what:  # biases are not fused (TE fuses weights only): plain autograd .grad
            _close(a, b if b is not None else torch.zeros_like(a), what)


@pytest.mark.parametrize("fused", [False, True])
def test_delayed_wgrad_matches_after_backward_dw(pg, gen, fused):
    cfg = _config(True, True, gradient_accumulation_fusion=fused, delay_wgrad_compute=True)
    mg, seq = _grouped(cfg, pg), _sequential(_config(True, True), pg)
    assert mg.linear_fc1.need_backward_dw() and mg.linear_fc2.need_backward_dw()
    _randomize_and_copy(mg, seq, gen, True)
    if fused:
        _attach_main_grads(mg, 0.0)
    mbs = _microbatches(gen)
    for i, (x, tpe, probs, g) in enumerate(mbs):
        _run(mg, x, tpe, probs, g)
        if i == 0:  # before the first backward_dw: weights hold a zero placeholder (as TE); fc1's biases nothing
            # yet (delivered by backward_dw), fc2's (skip_bias_add: returned, added by Megatron) through autograd
            assert all(torch.count_nonzero(w.grad) == 0 for w in mg.linear_fc1._weights() + mg.linear_fc2._weights())
            assert all(b.grad is None for b in mg.linear_fc1._biases())
            assert all(b.grad is not None for b in mg.linear_fc2._biases())
        mg.backward_dw()  # Megatron's TEGroupedMLP.backward_dw: fc2 then fc1
    _seq_grads_over(seq, mbs)
    for what, a, b in _expert_grads(mg, seq, True, mg_grad=lambda p: p.main_grad if fused and p.dim() > 1 else p.grad):
        _close(a, b if b is not None else torch.zeros_like(a), what)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("delay,fused", [(True, True), (True, False), (False, True)])
def test_megatron_ddp(pg, gen, overlap, delay, fused):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = _config(False, True, gradient_accumulation_fusion=fused, delay_wgrad_compute=delay)
    with _cpu_shims():
        mg, seq = _grouped(cfg, pg), _sequential(_config(False, True), pg)
        _randomize_and_copy(mg, seq, gen, True)
        ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, delay_wgrad_compute=delay,
                                                bucket_size=None if not overlap else 1000)
        model = DistributedDataParallel(cfg, ddp_cfg, mg)
        model.zero_grad_buffer()
        mbs = _microbatches(gen)
        for i, (x, tpe, probs, g) in enumerate(mbs):
            ctx = model.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()
            with ctx:
                _run(model, x, tpe, probs, g)
                if delay:
                    mg.backward_dw()
        model.finish_grad_sync()
    _seq_grads_over(seq, mbs)
    for what, a, b in _expert_grads(mg, seq, True, mg_grad=lambda p: p.main_grad):
        _close(a, b if b is not None else torch.zeros_like(a), what)
    assert all(p.grad is None for p in mg.parameters())


# --------------------------------------------------------------------------------------------- checkpoint --
@pytest.mark.parametrize("gated", [False, True])
def test_dist_checkpointing_round_trip_through_sequential_mlp(pg, gen, tmp_path, gated):
    from megatron.core import dist_checkpointing

    cfg = _config(gated, True, moe_single_grouped_weight=gated)
    src, seq = _grouped(cfg, pg), _sequential(cfg, pg)
    with torch.no_grad():
        for p in list(src.parameters()) + list(seq.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    mg_keys = {sh.key for sh in src.sharded_state_dict().values()}
    seq_keys = {sh.key for sh in seq.sharded_state_dict().values()}
    assert mg_keys == seq_keys, (mg_keys, seq_keys)
    (tmp_path / "mg").mkdir()
    (tmp_path / "seq").mkdir()
    with _cpu_shims():
        _checkpoint_round_trip(src, seq, gated, pg, tmp_path)


def _checkpoint_round_trip(src, seq, gated, pg, tmp_path):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(src.sharded_state_dict(), str(tmp_path / "mg"))
    seq.load_state_dict(dist_checkpointing.load(seq.sharded_state_dict(), str(tmp_path / "mg")))
    for name in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias"):
            for e, t in enumerate(_expert_params(src, name, kind)):
                assert torch.equal(getattr(getattr(seq.local_experts[e], name), kind), t)
    # and back: SequentialMLP's checkpoint into fresh moe_graph experts (per-expert layout this time)
    dist_checkpointing.save(seq.sharded_state_dict(), str(tmp_path / "seq"))
    back = _grouped(_config(gated, True), pg)
    back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), str(tmp_path / "seq")))
    for name in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias"):
            for a, b in zip(_expert_params(back, name, kind), _expert_params(src, name, kind)):
                assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- MoELayer --
def _moe_layers(cfg, pg, gen_seed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_graph.integrations.megatron import ColumnParallelGroupedLinear, get_gpt_layer_with_moe_graph_spec

    spec = get_gpt_layer_with_moe_graph_spec(num_experts=E, use_transformer_engine=False)
    experts = spec.submodules.mlp.keywords["submodules"].experts
    assert experts.keywords["submodules"].linear_fc1 is ColumnParallelGroupedLinear
    ref_spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True)
    mg = spec.submodules.mlp(config=cfg, pg_collection=pg)
    ref = ref_spec.submodules.mlp(config=cfg, pg_collection=pg)
    for mlp in ref.experts.local_experts:
        mlp.linear_fc2.explicit_expert_comm = True  # see _sequential
    gen = torch.Generator().manual_seed(gen_seed)
    with torch.no_grad():
        for p in ref.router.parameters():  # same on every rank
            p.copy_(torch.randn(p.shape, generator=gen))
        mg.router.load_state_dict(ref.router.state_dict())
        egen = torch.Generator().manual_seed(gen_seed + 1 + torch.distributed.get_rank())  # per rank: its experts
        for p in mg.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=egen) * 0.2)
        for name in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias") if cfg.add_bias_linear else ("weight",):
                for e, src in enumerate(_expert_params(mg.experts, name, kind)):
                    getattr(getattr(ref.experts.local_experts[e], name), kind).copy_(src)
    return mg, ref


def _moe_step(layer, x, g):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(g)
    return out.detach(), x.grad


def _moe_compare(rank, ep, gated, bias, pg=None, ckpt_dir=None):
    baseline = _import_megatron_path()
    torch.manual_seed(1234 + rank)
    own = pg is None
    if own:
        pg = _init_megatron(ep)
    try:
        with _cpu_shims():
            return _moe_compare_layers(rank, ep, gated, bias, pg, baseline, ckpt_dir)
    finally:
        if own:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()


def _moe_compare_layers(rank, ep, gated, bias, pg, baseline, ckpt_dir):
    cfg = _config(gated, bias, expert_model_parallel_size=ep)
    mg, ref = _moe_layers(cfg, pg, 7)  # the router's seed: the same on every rank
    gen = torch.Generator().manual_seed(99 + rank)  # different tokens on every rank
    x, g = torch.randn(6, 2, H, generator=gen), torch.randn(6, 2, H, generator=gen)
    ym, xm = _moe_step(mg, x, g)
    yr, xr = _moe_step(ref, x, g)
    res = {"out": (ym, yr), "input grad": (xm, xr), "router grad": (mg.router.weight.grad, ref.router.weight.grad)}
    for what, a, b in _expert_grads(mg.experts, ref.experts, bias):
        res[what] = (a, b if b is not None else torch.zeros_like(a))
    experts = {}
    if ckpt_dir is not None:  # the moe_graph layer's distributed checkpoint, written at this EP size
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(mg.sharded_state_dict(), ckpt_dir)
        n_local = mg.experts.num_local_experts
        for name in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias") if bias else ("weight",):
                for e, t in enumerate(_expert_params(mg.experts, name, kind)):
                    experts[(name, kind, rank * n_local + e)] = t.detach().clone()
        experts["router"] = {k: v.clone() for k, v in mg.router.state_dict().items()}
    return res, _stand_in_calls_since(baseline), experts


def _moe_worker(rank, world, gated, bias, ckpt_dir):
    return _moe_compare(rank, world, gated, bias, ckpt_dir=ckpt_dir)


def _check_moe(results):
    for res, calls, _ in results:
        assert calls == {}, calls  # Megatron's TE stand-ins were not called on any rank
        for what, (a, b) in res.items():
            _close(a, b, what)


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_moe_layer_ep1(pg, gated, bias):
    _check_moe([_moe_compare(0, 1, gated, bias, pg)])


@pytest.mark.parametrize("gated,bias", [(True, True)])
def test_moe_layer_ep2_gloo_and_checkpoint_to_ep1(pg, tmp_path, gated, bias):
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    (tmp_path / "ep2").mkdir()
    results = run_distributed(_moe_worker, 2, gated, bias, str(tmp_path / "ep2"), timeout=240)
    _check_moe(results)
    # The EP=2 moe_graph checkpoint loads into Megatron's MoELayer with SequentialMLP experts at EP=1.
    saved = {k: v for _, _, experts in results for k, v in experts.items()}
    with _cpu_shims():
        ref = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True).submodules.mlp(
            config=_config(gated, bias), pg_collection=pg)
        ref.load_state_dict(dist_checkpointing.load(ref.sharded_state_dict(), str(tmp_path / "ep2")))
    for k, v in saved.items():
        if k == "router":
            for n, t in v.items():
                assert torch.equal(ref.router.state_dict()[n], t), n
        else:
            name, kind, e = k
            assert torch.equal(getattr(getattr(ref.experts.local_experts[e], name), kind), v), k
    assert len(saved) == 1 + 2 * (2 if bias else 1) * E


def test_fine_grained_offloading_sets_save_original_input(pg, gen):
    # experts.py: offload_modules=['expert_fc1'] calls extensions.transformer_engine.set_save_original_input on
    # linear_fc1, which requires the attribute TE's GroupedLinear stores.
    cfg = _config(False, False, fine_grained_activation_offloading=True, offload_modules=["expert_fc1"])
    mg = _grouped(cfg, pg)
    assert mg.linear_fc1.save_original_input is True and mg.linear_fc2.save_original_input is False


def test_readme_example(pg):
    # The integrations README's Megatron example, run as written (it builds its own config on the initialized
    # parallel state).
    text = (_ROOT / "python" / "moe_graph" / "integrations" / "README.md").read_text()
    start = text.index("<!-- megatron-example -->")
    block = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    with _cpu_shims():  # the all-to-all dispatcher's stream calls on CPU (the example itself is device-agnostic)
        exec(compile(block, "integrations/README.md:megatron-example", "exec"), scope)
    assert "layer" in scope and "out" in scope


def test_meta_device_init_then_reset_parameters(pg):
    # Megatron-FSDP's init_model_with_meta_device: the experts are built on "meta", materialized with to_empty
    # and initialized by reset_parameters() (Megatron-FSDP raises for a module without it).
    cfg = _config(True, True, use_cpu_initialization=False, init_model_with_meta_device=True)
    mg = _grouped(cfg, pg)
    assert all(p.is_meta for p in mg.parameters())
    # fc2 uses Megatron's output_layer_init_method: std / sqrt(2 * num_layers)
    for lin, std in ((mg.linear_fc1, cfg.init_method_std), (mg.linear_fc2, cfg.init_method_std / (2 * cfg.num_layers) ** 0.5)):
        lin.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in lin.parameters():
                p.fill_(float("nan"))  # to_empty leaves garbage: everything must be written
        lin.reset_parameters()
        w = torch.cat([t.detach().flatten() for t in lin._weights()])
        assert torch.isfinite(w).all() and abs(float(w.std()) - std) < 0.2 * std
        assert all(torch.count_nonzero(b) == 0 for b in lin._biases())
        # Megatron's attributes are set again on the new parameter objects (to_empty replaced them)
        assert all(p.allreduce is True and hasattr(p, "tensor_model_parallel") for p in lin.parameters())


def test_stand_in_call_counter_sees_calls(monkeypatch):
    # The zero-call checks above can fail: a call on a Megatron module's MagicMock is counted.
    from unittest.mock import MagicMock

    import megatron.core.extensions.transformer_engine as te_ext

    monkeypatch.setattr(te_ext, "probe_stand_in", MagicMock(), raising=False)
    baseline = _te_stand_in_calls()
    te_ext.probe_stand_in.pytorch.GroupedLinear(2, 8, 8)
    assert _stand_in_calls_since(baseline) == {"megatron.core.extensions.transformer_engine.probe_stand_in": 1}


# ------------------------------------------------------------------------------------------------------ fp8 --
@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_te_grouped_mlp_with_config_fp8_equals_oracle(pg, gen, recipe):
    """``config.fp8`` / ``fp8_recipe`` run TEGroupedMLP's expert GEMMs in FP8 (no TE): each linear's output equals
    the plain-PyTorch oracle on TE-reference quantize-dequantize (tests/test_fp8_grouped_linear.py), and the whole
    module equals the same module run under ``moe_graph.fp8.autocast`` with the mapped recipe, bit for bit."""
    from test_fp8_grouped_linear import _close as _close_fp8
    from test_fp8_grouped_linear import _oracle

    import moe_graph
    from moe_graph.integrations.megatron import fp8_recipe_from_config

    cfg = _config(True, False)
    cfg.fp8, cfg.fp8_recipe = "e4m3", recipe  # set after TransformerConfig's validation (TE-only checks there)
    plain = _config(True, False)
    mg, ref_mg = _grouped(cfg, pg), _grouped(plain, pg)
    ref_mg.load_state_dict(mg.state_dict(), strict=False)
    r = fp8_recipe_from_config(cfg)
    assert r == moe_graph.fp8.as_recipe(recipe)
    seen = []
    for lin in (mg.linear_fc1, mg.linear_fc2):
        lin.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0].detach(), out[0].detach())))
    tpe = [5, 0, 7, 3]
    T = sum(tpe)
    x, probs, g = torch.randn(T, H, generator=gen), torch.rand(T, generator=gen), torch.randn(T, H, generator=gen)
    ym, xm, pm = _run(mg, x, torch.tensor(tpe), probs, g)
    with moe_graph.fp8.autocast(recipe=r):
        yr, xr, pr = _run(ref_mg, x, torch.tensor(tpe), probs, g)
    assert torch.equal(ym, yr) and torch.equal(xm, xr) and torch.equal(pm, pr)
    assert len(seen) == 2
    for mod, inp, out in seen:
        w = torch.stack(mod._weights()) if not mod.single_grouped_weight else mod.weight
        want = _oracle(inp, w.detach(), torch.zeros_like(out), tpe, r)[0]
        _close_fp8(out, want, want.abs().max())
    with pytest.raises(NotImplementedError, match="fp8_recipe"):
        bad = _config()
        bad.fp8, bad.fp8_recipe = "e4m3", "nvfp4"
        fp8_recipe_from_config(bad)


@pytest.mark.parametrize("recipe,mode,fmt", [(r, m, "e4m3") for r in ("blockwise", "mxfp8")
                                              for m in ("plain", "fused", "delay_fused")]
                         + [("blockwise", "fused", "hybrid"), ("mxfp8", "delay_fused", "hybrid")])
def test_te_grouped_mlp_fp8_trains_like_the_qdq_oracle(pg, gen, recipe, mode, fmt):
    """Megatron's TEGroupedMLP with ``config.fp8`` on moe_graph's grouped linears (the CPU FP8 semantics), over two
    microbatches (zero-token experts, one expert taking every token), plain autograd, fused ``main_grad``
    (``gradient_accumulation_fusion``) or delayed wgrad (``delay_wgrad_compute`` + ``backward_dw``) in FP8: outputs
    and the input, probs and weight gradients equal an oracle written in plain PyTorch (each expert's rows through
    ``helpers.fp8_reference.qdq_swiglu_mlp``: TE-reference quantize-dequantize of every GEMM operand, float64
    products, plain autograd) within fp32 rounding. ``config.fp8="hybrid"``: gradients in E5M2."""
    from helpers.fp8_reference import qdq_swiglu_mlp
    from moe_graph.ops import fp8

    fused, delay = mode != "plain", mode == "delay_fused"
    cfg = _config(True, False, gradient_accumulation_fusion=fused, delay_wgrad_compute=delay)
    cfg.fp8, cfg.fp8_recipe = fmt, recipe  # set after TransformerConfig's validation (TE-only checks there)
    mg = _grouped(cfg, pg)
    with torch.no_grad():
        for p in mg.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    if fused:
        _attach_main_grads(mg)  # NaN: the first microbatch (is_first_microbatch) must overwrite, not add
    ws = {n: [w.detach().clone().requires_grad_() for w in _expert_params(mg, n, "weight")]
          for n in ("linear_fc1", "linear_fc2")}
    r = fp8.as_recipe(recipe)
    if fmt == "hybrid":
        r = fp8.Recipe(r.kind, "HYBRID", r.power_2_scale, r.amax_epsilon)
        assert r.bwd_dtype == torch.float8_e5m2
    tol = 300 * 2.0 ** -23
    for x, tpe, probs, g in _microbatches(gen):
        y, dx, dp = _run(mg, x, tpe, probs, g)
        if delay:
            mg.backward_dw()
        xo, po = x.clone().requires_grad_(), probs.clone().requires_grad_()
        outs, start = [], 0
        for e, m in enumerate(tpe.tolist()):
            outs.append(qdq_swiglu_mlp(xo[start:start + m], ws["linear_fc1"][e], ws["linear_fc2"][e], r,
                                       po[start:start + m]))
            start += m
        yo = torch.cat(outs)
        yo.backward(g)
        for what, a, b in (("output", y, yo.detach()), ("input grad", dx, xo.grad), ("probs grad", dp, po.grad)):
            torch.testing.assert_close(a, b, rtol=0, atol=tol * float(b.abs().max()), msg=lambda m: f"{what}: {m}")
    for name in ("linear_fc1", "linear_fc2"):
        for e, (p, idx) in enumerate(_expert_leaves(mg, name, "weight")):
            got = _pick(p.main_grad if fused else p.grad, idx)
            want = ws[name][e].grad
            torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()) + 1e-30,
                                       msg=lambda m: f"{name} weight {e}: {m}")
            if fused:
                assert p.grad_added_to_main_grad
    # the quantization is visible: the last microbatch (every row to expert 2) is far from the unquantized MLP
    w1, w2 = ws["linear_fc1"][2].detach().double(), ws["linear_fc2"][2].detach().double()
    a, b = (x.double() @ w1.t()).chunk(2, dim=-1)
    plain = (F.silu(a) * b * probs.double()[:, None]) @ w2.t()
    assert (y.double() - plain).abs().max() > 100 * tol * float(plain.abs().max())  # FP8: ~3e-2 relative
