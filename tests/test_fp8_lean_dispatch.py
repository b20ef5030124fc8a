"""FP8 dispatch's fused ops (``ops.permute.expand_pack``, ``ops.permute.expand_quantize_packed``;
``token_dispatcher.FUSED_FP8_DISPATCH``). Oracles: the previous path's pieces (``ops.fp8.pack_rows`` of
``expand_rows``' rows, byte gathers of the packed rows, ``ops.fp8.unpack_rows``, ``ops.fp8.quantize_columns`` with
``x_scale``) byte for byte, and, for the whole layer, the previous FP8 dispatch path (``FUSED_FP8_DISPATCH = False``):
output, input gradient and every parameter gradient equal bit for bit, at EP 1 and at EP 2 / 4 on gloo."""

import pytest
import torch
from conftest import full_only

import moe_graph
import moe_graph.moe.token_dispatcher as td
from helpers.aligned_dispatch_workers import busy_expert_layer
from helpers.fp8_lean_dispatch_workers import lean_dispatch_worker, run_both
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.layer import MoELayer
from moe_graph.ops import fp8
from moe_graph.ops.permute import expand_pack, expand_pack_available, expand_quantize_packed, expand_rows

pytestmark = pytest.mark.skipif(not expand_pack_available("cpu"), reason="moe_graph._C without expand_quantize_pack")


def _routing(n, K, m, g, sentinel_share=0.2):
    """``route_of_row [m]`` (real routes, repeats allowed, the sentinel ``n*K`` in ``sentinel_share`` of the rows)
    and a ``route_rows [n, K]`` consistent with it for ``expand_rows`` (its backward only)."""
    routes = torch.randint(0, n * K, (m,), generator=g)
    routes = torch.where(torch.rand(m, generator=g) < sentinel_share, n * K, routes)
    return routes, torch.full((n, K), m, dtype=torch.int64)


def _bytes_equal(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,K,m,H", [(7, 2, 19, 200), (5, 1, 5, 130), (12, 3, 40, 256), (1, 1, 3, 17)])
def test_expand_pack_is_pack_rows_of_the_expanded_rows(kind, dtype, n, K, m, H):
    g = torch.Generator().manual_seed(n * 100 + H)
    recipe = fp8.as_recipe(kind)
    x = (torch.randn(n, H, generator=g) * torch.logspace(-3, 3, H)).to(dtype)
    x[0, 3] = float("inf") if n > 1 else x[0, 3]
    routes, route_rows = _routing(n, K, m, g)
    ref = fp8.pack_rows(expand_rows(x, routes, route_rows), recipe)
    ref[routes == n * K] = 0  # the previous path's byte gather: a sentinel row is all zero bytes, scales included
    got = expand_pack(x, routes, K, recipe)
    assert got.dtype == torch.uint8 and got.shape == ref.shape and torch.equal(got, ref)
    assert torch.equal(expand_pack(x, None, 1, recipe), fp8.pack_rows(x, recipe))  # the tokens themselves


@pytest.mark.parametrize("kind", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("n,m,H,splits", [
    (9, 40, 200, [16, 0, 16, 0]),    # zero-token experts, rows past sum(m_splits), H off the tiles
    (6, 32, 130, [32]),              # one expert takes every row
    (20, 48, 64, [0, 16, 32]),
    (4, 200, 96, [144, 0, 48]),      # a group over one 128-row columnwise tile
])
def test_expand_quantize_packed_equals_gather_unpack_and_requantize(kind, n, m, H, splits):
    g = torch.Generator().manual_seed(m + H)
    recipe = fp8.as_recipe(kind)
    x = torch.randn(n, H, generator=g) * torch.logspace(-4, 4, H)
    packed = fp8.pack_rows(x, recipe)
    routes = torch.where(torch.rand(m, generator=g) < 0.25, n, torch.randint(0, n, (m,), generator=g))
    m_splits = torch.tensor(splits, dtype=torch.int64)
    carrier = torch.zeros(()).expand(m, H)
    got = expand_quantize_packed(packed, routes, 1, m_splits, recipe, carrier)
    # the previous path: a byte gather (zero rows for the sentinel), unpack, the GEMM's columnwise requantization
    moved = torch.cat([packed, torch.zeros_like(packed[:1])]).index_select(0, routes)
    ref = fp8.unpack_rows(moved, carrier, recipe)
    used = int(m_splits.sum())
    # past the groups: rows no GEMM reads (zero bytes, as every quantizer writes them there)
    assert _bytes_equal(got.data[:used], ref.data[:used]) and not got.data[used:].view(torch.uint8).any()
    assert _bytes_equal(got.scale[:used], ref.scale[:used])
    qt, st = fp8.quantize_columns(ref.data, m_splits, recipe, recipe.fwd_dtype, x_scale=ref.scale)
    assert _bytes_equal(got.columns[0], qt) and _bytes_equal(got.columns[1], st)
    assert got.data.view(torch.uint8).abs().sum() > 0 and got.columns[0].view(torch.uint8).abs().sum() > 0


def test_packed_source_is_checked_before_anything_is_written():
    recipe = fp8.as_recipe("blockwise")
    packed = fp8.pack_rows(torch.randn(4, 200), recipe)
    routes, splits, carrier = torch.tensor([0, 1, 4]), torch.tensor([3]), torch.zeros(()).expand(3, 200)
    with pytest.raises(RuntimeError, match="packed rows of 208 bytes"):
        expand_quantize_packed(packed[:, :-1], routes, 1, splits, recipe, carrier)
    with pytest.raises(RuntimeError, match="route_of_row holds 5"):
        expand_quantize_packed(packed, torch.tensor([0, 5, 1]), 1, splits, recipe, carrier)
    with pytest.raises(RuntimeError, match="route_of_row holds -1"):
        expand_pack(torch.randn(4, 200), torch.tensor([0, -1]), 1, recipe)
    with pytest.raises(ValueError, match="FP8 dispatch needs a recipe"):
        expand_pack(torch.randn(4, 200), None, 1, fp8.as_recipe("tensor"))


@pytest.mark.parametrize("kind,dtype,H,T,K,E,cf", [
    ("blockwise", torch.float32, 200, 37, 2, 5, None),   # H not a tile multiple, dropless (rows past the routes)
    ("mxfp8", torch.bfloat16, 130, 29, 2, 6, 0.6),       # drops, bf16 tokens
    ("blockwise", torch.bfloat16, 96, 23, 1, 4, None),
    ("mxfp8", torch.float32, 64, 19, 2, 4, None),
])
def test_layer_fused_fp8_dispatch_equals_previous_path_one_rank(kind, dtype, H, T, K, E, cf):
    torch.manual_seed(5)
    layer = MoELayer(H, 64, E, K, fp8_dispatch=True, capacity_factor=cf, params_dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(6)
    x, target = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    res = run_both(layer, x, target, kind)
    assert res["out_equal"] and res["dx_equal"] and res["unequal_grads"] == [] and res["grads"], res
    assert res["fused_used"] and not res["previous_used_fused"], res


@pytest.mark.parametrize("case", ["zero_experts", "all_one"])
def test_layer_fused_fp8_dispatch_skewed_routing(case, monkeypatch):
    """Zero-token experts / one expert taking every route: the router's bias forces the routing."""
    torch.manual_seed(7)
    layer = MoELayer(200, 64, 6, 2, fp8_dispatch=True, device="cpu")
    with torch.no_grad():
        layer.router.weight.zero_()
        if case == "all_one":
            layer.router.weight[4] += 1.0  # experts 4 (and, for the second route, 5 by bias below) take all
            layer.router.weight[5] += 0.5
        else:
            layer.router.weight[1] += 1.0
            layer.router.weight[3] += 0.5
    x = torch.randn(21, 200).abs()  # positive rows: the routing follows the weights' sums
    res = run_both(layer, x, torch.randn(21, 200), "mxfp8" if case == "all_one" else "blockwise")
    assert res["out_equal"] and res["dx_equal"] and res["unequal_grads"] == [], res
    m = layer.last_m_splits
    assert (m == 0).sum() >= (4 if case == "all_one" else 3), m


@pytest.mark.parametrize("world,kind,cf,exchange", [
    (2, "blockwise", None, "nccl"), (2, "mxfp8", 0.6, "nccl"),
    (2, "mxfp8", 0.6, "nvlink"),  # the fused exchange (gloo): the op reads the receive buffer
    (2, "blockwise", 0.6, "symm_mem"),  # per destination (host-sized): the op reads the received rows
    *full_only((4, "mxfp8", None, "nccl"), (2, "blockwise", None, "nvlink"))])  # the 2-rank paths again
def test_layer_fused_fp8_dispatch_equals_previous_path_multi_rank(world, kind, cf, exchange):
    res = run_distributed(lean_dispatch_worker, world, kind, cf, exchange, timeout=300.0)
    for r in res:
        assert r["out_equal"] and r["dx_equal"] and r["unequal_grads"] == [] and r["grads"], r
        assert r["fused_used"] and not r["previous_used_fused"], r
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0
