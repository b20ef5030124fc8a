"""``DistributedOptimizer(fp8_param_gather=...)``: FP8 expert weights quantized once per step, shard by shard, and
all-gathered in FP8 (2 gloo ranks). Oracle: ``moe_graph.fp8.quantize_weight`` (the native quantizer) of the fully
gathered 16-bit weight, and training without the option."""

import pytest
import torch

from helpers import fp8_param_workers as w
from helpers.optimizer_checks import run
from moe_graph.ops import fp8 as _fp8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("recipe", ["blockwise", _fp8.Float8BlockScaling(power_2_scale=False), "tensorwise"],
                         ids=["blockwise", "blockwise_fp32_scales", "tensorwise"])
def test_gathered_fp8_weights_equal_quantizing_the_gathered_weight(recipe):
    ranks = run(w.quantized_weights_worker, 2, recipe, torch.bfloat16, 2)
    # the layout puts a shard boundary inside a 128x128 tile block of fc1's weight (the case a rank cannot
    # quantize alone: the amax all-reduce completes it)
    assert any(ranks[0]["cut"].values()), ranks[0]["cut"]
    b = ranks[0]["bytes"]
    assert b["all_gather"] < b["sixteen_bit_all_gather"], b
    for g in ranks[0]["fp8_bucket_bytes"]:  # the expert bucket: FP8 weights and 16-bit biases
        assert g["all_gather"] <= 0.51 * g["sixteen_bit_all_gather"] and g["amax_all_reduce"] < 100, g
    r = _fp8.as_recipe(recipe)
    for step in range(2):
        for rk in range(2):
            st = ranks[rk]["steps"][step]
            for name, wt in st["weights"].items():
                assert torch.equal(wt, ranks[0]["steps"][step]["weights"][name])  # the same weight on both ranks
                ref = _fp8.quantize_weight(wt.contiguous(), r)
                for got, want in zip(st["cache"][name], ref):
                    assert torch.equal(_bits(got), _bits(want.reshape(got.shape))), (step, rk, name)
                for got, want in zip(st["cache_after_16bit_gather"][name], ref):
                    assert torch.equal(_bits(got), _bits(want.reshape(got.shape)))
            for name, t in st["other"].items():  # biases and the dense layer: gathered in 16 bits
                assert torch.equal(t, ranks[1 - rk]["steps"][step]["other"][name]), name


def _single_process(recipe, model=None):
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.distributed.optimizer import DistributedOptimizer
    torch.manual_seed(0)
    model = model or w.GroupedModel(3, 160, 200, torch.bfloat16)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    return model, DistributedOptimizer(ddp, lr=1e-2, fp8_param_gather=recipe)


@pytest.mark.parametrize("recipe, error, match", [
    ("mxfp8", NotImplementedError, "mxfp8"),
    ("no-such-recipe", ValueError, "fp8_param_gather must be"),
])
def test_bad_fp8_param_gather_is_refused_before_anything_is_written(recipe, error, match):
    model = w.GroupedModel(3, 160, 200, torch.bfloat16)
    with pytest.raises(error, match=match):
        _single_process(recipe, model)
    assert not any(hasattr(p, "fp8_gathered") for p in model.parameters())


def test_a_model_without_fp8_weights_is_refused():
    with pytest.raises(ValueError, match="no FP8 expert weight"):
        _single_process("blockwise", torch.nn.Linear(4, 4))


def test_one_rank_caches_the_quantized_weights_of_every_step():
    model, opt = _single_process("blockwise")
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        opt.step()
        for p in (model.fc1.weight, model.fc2.weight):
            want_all = _fp8.quantize_weight(p.detach(), _fp8.as_recipe("blockwise"))
            for got, want in zip(p.fp8_gathered.copies("blockwise"), want_all):
                assert torch.equal(_bits(got), _bits(want.reshape(got.shape)))
    with pytest.raises(ValueError, match="active recipe"):
        model.fc1.weight.fp8_gathered.copies("tensorwise")


@pytest.mark.parametrize("kind", ["grouped", "moe"])
def test_training_with_fp8_param_gather_equals_training_without(kind):
    """Same arithmetic (the GEMMs read bytes equal to quantizing the gathered 16-bit weights): bit for bit."""
    base = run(w.train_worker, 2, kind, "blockwise", False, 3)
    fp8 = run(w.train_worker, 2, kind, "blockwise", True, 3)
    for rk in range(2):
        for a, b in zip(base[rk]["losses"], fp8[rk]["losses"]):
            assert torch.equal(a, b)
        for a, b in zip(base[rk]["norms"], fp8[rk]["norms"]):
            assert torch.equal(a, b)
        for n, t in base[rk]["params"].items():
            assert torch.equal(t, fp8[rk]["params"][n]), n
        for a, b in zip(base[rk]["main"], fp8[rk]["main"]):
            assert torch.equal(a, b)
        assert fp8[rk]["stale_16bit"]  # the 16-bit copies were stale: the FP8 GEMMs read the gathered FP8 weights
    # the run trained (the parameters moved)
    assert not torch.equal(base[0]["losses"][0], base[0]["losses"][-1])
