"""The fused ("nvlink") exchange's semantics on gloo (:class:`moe_graph.moe.exchange.HostSizedFusedExchange`, the
interface the CUDA kernels of ``moe_graph.ops.nvlink`` implement): against the existing per-destination exchange
(``"symm_mem"``, host-sized) and, where the capacity rules agree (dropless), the per-pair ``"nccl"`` path.

Equality: the flat fused exchange does the same arithmetic as the other paths (the native ``reduce_rows`` /
``route_dot`` over the same rows in the same order, the same ``w * dy`` products), so every result is compared bit
for bit. The node-aware two-level exchange (``ranks_per_node``) moves the same rows (expert inputs, ``m_splits``,
the probabilities' and the expert weights' gradients bit for bit) but sums each token's routes per node first, then
over nodes: the output and the input gradient (the dispatch's backward is an unweighted combine) differ by the
summation order only, checked to 1e-12 (fp64 data) and 1e-2 relative (bf16 outputs, one rounding of the sum)."""


import pytest
import torch

from conftest import full_only
from helpers.nvlink_workers import dispatcher_exchange_worker, layer_exchange_worker, node_traffic_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe import exchange as exchange_mod
from moe_graph.moe.config import MoEConfig
from moe_graph.moe.exchange import EXCHANGES, HostSizedFusedExchange, inter_node_rows, resolve_exchange

_FIELDS = ("ein", "ms", "y", "gx", "gp", "gw")
_TWO_LEVEL_EXACT = ("ein", "ms", "gp", "gw")


def _tol(dtype_name):
    return 1e-12 if dtype_name == "float64" else 1e-2


def _compare(res, two_level_tol=None):
    """Every exchange of every case against the first one listed; returns the number of comparisons made."""
    n, moved = 0, {}
    for r in res:
        for key, per_ex in r.items():
            names = list(per_ex)
            ref = per_ex[names[0]]
            for ex in names[1:]:
                got = per_ex[ex]
                assert got["dropped"] == ref["dropped"], (key, ex)
                assert got["fused"] == ex.startswith("nvlink"), (key, ex)
                for f in _FIELDS:
                    if ":" in ex and f not in _TWO_LEVEL_EXACT:
                        scale = max(1.0, float(ref[f].abs().max()))
                        err = float((got[f] - ref[f]).abs().max())
                        assert err <= _tol(key[2]) * scale, (key, ex, f, err)
                    else:
                        assert torch.equal(got[f], ref[f]), (key, ex, f, float((got[f] - ref[f]).abs().max()))
                n += 1
            moved[key] = moved.get(key, 0.0) + float(ref["ein"].abs().sum() * ref["gw"].abs().sum())
    assert all(v > 0 for v in moved.values()), moved  # rows did move (on some rank) in every case
    return n


# (case, capacity per destination (None: dropless), dtype, experts scale their rows, exchanges: first = reference)
_DROPLESS = ["nccl", "symm_mem", "nvlink"]
_CAPPED = ["symm_mem", "nvlink"]


@pytest.mark.parametrize("world", [2, *full_only(4)])  # 4 ranks in CI: the node-aware and FP8 aligned layer tests
def test_dispatcher_nvlink_equals_symm_mem_and_nccl(world):
    two = [f"nvlink:{world // 2}"] if world == 4 else []  # 2 nodes x 2 ranks
    cases = [
        ("random", None, "float64", False, _DROPLESS + two),
        ("zero_token_experts", None, "float64", False, _DROPLESS + two),
        ("one_expert", None, "float64", True, _DROPLESS + two),
        ("one_expert", 7, "float64", False, _CAPPED + two),  # the last rank's buffer overflows: quotas
        ("skewed", 2 * world + 5, "float64", False, _CAPPED + two),
        ("skewed", 2 * world + 5, "float64", True, _CAPPED + two),  # row_weights + unweighted combine
        ("random", None, "bfloat16", False, _DROPLESS + two),
        ("skewed", 2 * world + 5, "bfloat16", True, _CAPPED + two),
    ]
    res = run_distributed(dispatcher_exchange_worker, world, 5, cases, timeout=300.0)
    assert _compare(res) == world * sum(len(c[4]) - 1 for c in cases)
    # the capacities bind somewhere (the overflow cases are not vacuous)
    for c in cases:
        if c[1] is not None:
            assert sum(r[c[:4]]["nvlink"]["dropped"] for r in res) > 0, c


def test_dispatcher_nvlink_echo_spare_slots():
    cases = [("random", None, "float64", False, _DROPLESS), ("skewed", 9, "float64", True, _CAPPED)]
    res = run_distributed(dispatcher_exchange_worker, 2, 11, cases, 1, timeout=300.0)
    assert _compare(res) == 2 * 3


@pytest.mark.parametrize("R,G", [(4, 2), *full_only((8, 4))])
def test_node_aware_exchange_crosses_each_node_once_per_token(R, G):
    """4 ranks as 2 nodes x 2 (8 as 2 x 4): the two-level dispatch sends one row per (token, other node)
    across nodes where the flat one sends one per route; the combine sends one partial back per (token, other node).
    Expert inputs equal row for row; outputs within fp32 summation order."""
    K = 4
    res = run_distributed(node_traffic_worker, R, G, 3, timeout=240.0)
    flat_inter = two_inter = 0

    def inter(rows, rank):  # rows sent to ranks of other nodes
        return sum(n for d, n in enumerate(rows) if d // G != rank // G)

    for rank, r in enumerate(res):
        assert torch.equal(r[None]["ein"], r[G]["ein"])
        torch.testing.assert_close(r[G]["y"], r[None]["y"], rtol=1e-6, atol=1e-6)
        dest_node = (r["idx"] // 2) // G  # column -> rank (2 experts each) -> node
        me = rank // G
        routes = [(t, int(dest_node[t, k])) for t in range(r["idx"].shape[0]) for k in range(K) if r["valid"][t, k]]
        per_route = sum(1 for _, n in routes if n != me)
        per_pair = len({(t, n) for t, n in routes if n != me})
        assert inter(r[None]["dispatch_rows"], rank) == per_route
        assert inter(r[G]["dispatch_rows"], rank) == per_pair
        assert sum(r[None]["dispatch_rows"]) == len(routes)  # flat: every route's row once
        assert inter_node_rows(r["idx"] // 2, rank, G, r["valid"]) == {"per_route": per_route, "per_node": per_pair}
        flat_inter += per_route
        two_inter += per_pair
    assert two_inter < flat_inter  # the routing has tokens with several routes to one node
    # combine: every rank sends the partials of the pairs it forwarded; summed over ranks, one per pair
    assert sum(inter(r[G]["combine_rows"], rank) for rank, r in enumerate(res)) == two_inter
    assert sum(inter(r[None]["combine_rows"], rank) for rank, r in enumerate(res)) == flat_inter


@pytest.mark.parametrize("world,exchanges,spare,cf", [
    (2, ["nccl", "symm_mem", "nvlink"], 1, None),  # echo, dropless: every rule keeps every route
    (2, ["symm_mem", "nvlink"], 0, 0.8),  # per-destination capacity that drops
])
def test_layer_nvlink_equals_other_exchanges(world, exchanges, spare, cf):
    res = run_distributed(layer_exchange_worker, world, 2, exchanges, spare, cf, timeout=300.0)
    for r in res:
        ref = r[exchanges[0]]
        for ex in exchanges[1:]:
            assert torch.equal(r[ex]["y"], ref["y"]) and torch.equal(r[ex]["gx"], ref["gx"]), ex
            assert r[ex]["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) >= 3
            for n, g in ref["grads"].items():
                assert torch.equal(r[ex]["grads"][n], g), (ex, n)


def test_layer_node_aware_equals_flat_four_ranks():
    res = run_distributed(layer_exchange_worker, 4, 4, ["nvlink", "nvlink:2", "symm_mem"], 1, 1.0, timeout=300.0)
    for r in res:
        ref = r["symm_mem"]
        for ex in ("nvlink", "nvlink:2"):
            tol = 0.0 if ex == "nvlink" else 1e-12
            for a, b in [(r[ex]["y"], ref["y"]), (r[ex]["gx"], ref["gx"])] + [
                    (r[ex]["grads"][n], g) for n, g in ref["grads"].items()]:
                assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max())), ex


def test_layer_fp8_dispatch_nvlink_equals_symm_mem():
    from moe_graph.ops import fp8

    if not fp8.native_available("cpu"):
        pytest.skip("moe_graph._C without the FP8 ops")
    res = run_distributed(layer_exchange_worker, 2, 6, ["symm_mem", "nvlink"], 0, 0.8, "mxfp8", timeout=300.0)
    for r in res:
        assert torch.equal(r["nvlink"]["y"], r["symm_mem"]["y"]) and torch.equal(r["nvlink"]["gx"], r["symm_mem"]["gx"])
        for n, g in r["symm_mem"]["grads"].items():
            assert torch.equal(r["nvlink"]["grads"][n], g), n


@pytest.mark.parametrize("world,fused,fp8_dispatch", [(2, "nvlink", False), (2, "nvlink", True),
                                                      (4, "nvlink:2", False)])
def test_layer_fp8_experts_nvlink_aligned_equals_fixed_split(world, fused, fp8_dispatch):
    """FP8 experts (blockwise), dropless: the fused exchange (flat; node-aware at 4 ranks) places the rows at their
    16-row-aligned expert rows itself (the experts do not regroup) and the layer's output, input gradient and every
    parameter gradient equal the fixed-split exchange's (its per-pair alignment composed into its index maps) bit
    for bit (the node-aware exchange's output and input gradient up to its summation order)."""
    from moe_graph.ops import fp8

    if not fp8.native_available("cpu"):
        pytest.skip("moe_graph._C without the FP8 ops")
    res = run_distributed(layer_exchange_worker, world, 5, ["nccl", fused], 0, None, "blockwise", fp8_dispatch,
                          timeout=300.0)
    for r in res:
        got, ref = r[fused], r["nccl"]
        assert got["aligned"] and ref["aligned"]
        for f in ("y", "gx"):
            err = float((got[f] - ref[f]).abs().max())
            assert err <= (0.0 if fused == "nvlink" else _tol("bfloat16") * max(1.0, float(ref[f].abs().max()))), f
        assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) >= 3
        for n, g in ref["grads"].items():
            assert torch.equal(got["grads"][n], g), n
    assert any(float(r["nccl"]["gx"].abs().sum()) > 0 for r in res)


# --------------------------------------------------------------------------------- construction, options --
def test_exchange_options():
    assert "nvlink" in EXCHANGES
    assert resolve_exchange("auto") == ("pair", None)  # CPU: unchanged
    with pytest.raises(ValueError, match="ranks_per_node"):
        MoEConfig(8, 8, 4, 2, exchange="symm_mem", ranks_per_node=2)
    with pytest.raises(ValueError, match="exchange_num_sms"):
        MoEConfig(8, 8, 4, 2, exchange="nvlink", exchange_num_sms=0)
    MoEConfig(8, 8, 4, 2, exchange="nvlink", ranks_per_node=2, exchange_num_sms=16)


def test_cuda_nvlink_without_the_kernels_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(exchange_mod, "kernels_available", lambda: False)
    with pytest.raises(RuntimeError, match="exchange='nvlink' on CUDA needs the fused exchange kernels"):
        resolve_exchange("nvlink", device="cuda")
    assert not exchange_mod.nvlink_available(device=torch.device("cuda"))  # auto never picks it then


def test_cuda_nvlink_constructs_the_cuda_backend(monkeypatch):
    made = []

    class Fake:
        def __init__(self, group, device, **kwargs):
            made.append((group, device, kwargs))

        dispatch = combine = gather_routes = lambda *a: None

    monkeypatch.setattr(exchange_mod, "kernels_available", lambda: True)
    monkeypatch.setattr(exchange_mod, "NvlinkExchange", Fake)
    rule, fx = resolve_exchange("nvlink", "G", device="cuda:1", num_sms=12)
    assert rule == "destination" and isinstance(fx, Fake) and exchange_mod.is_fused(fx)
    assert made == [("G", torch.device("cuda:1"), {"num_sms": 12})]
    resolve_exchange("nvlink", "G", device="cuda:0")
    assert made[-1] == ("G", torch.device("cuda:0"), {})  # the backend's own default SM budget
    # the node-aware exchange's inter-node stage is design only on CUDA: refused, naming it
    monkeypatch.setattr(exchange_mod.dist, "get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match="ranks_per_node=2.*inter-node stage"):
        resolve_exchange("nvlink", "G", device="cuda:0", ranks_per_node=2)
    resolve_exchange("nvlink", "G", device="cuda:0", ranks_per_node=4)  # one node: the flat exchange
    assert len(made) == 3
    assert not exchange_mod.nvlink_available(device=torch.device("cpu"))


def test_host_fused_exchange_rejects_bad_ranks_per_node(monkeypatch):
    monkeypatch.setattr(exchange_mod.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(exchange_mod.dist, "get_rank", lambda group=None: 0)
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="ranks_per_node"):
            HostSizedFusedExchange(None, bad)
    assert HostSizedFusedExchange(None, 2).ranks_per_node == 2
    assert HostSizedFusedExchange(None).ranks_per_node == 4
