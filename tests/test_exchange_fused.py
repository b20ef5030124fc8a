"""The fused ("nvlink") exchange's semantics on CPUs: its host reference (``torch.ops.moe_graph.exchange_*_reference``,
csrc/exchange/exchange_cpu.cpp, which the CUDA kernels equal bit for bit under the emulator: tests/test_emulator.py,
family ``exchange``) against the existing per-destination exchange on gloo (``HostSizedExchange`` after the
dispatcher's layout in quota mode and permute copy, ``reduce_rows`` over the rows sent back), bit for bit, at 2 and 4
ranks; and the ops' argument checks."""

import pytest
import torch

from helpers.exchange_workers import CASES, fused_reference_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.ops import _lib

pytestmark = pytest.mark.skipif(not _lib.has_kernel("moe_graph::exchange_dispatch_reference", "cpu"),
                                reason="moe_graph._C without the exchange ops")

CHECKS = ("expert_in", "m_splits", "row_weights", "combine", "gather_routes", "route_row_rows")


@pytest.mark.parametrize("world", [2, 4])
def test_reference_equals_host_sized_exchange(world):
    res = run_distributed(fused_reference_worker, world, timeout=240.0)
    flat = [r for rank_res in res for r in rank_res]
    bad = [(r["case"], r["rank"], k) for r in flat for k in CHECKS if not r[k]]
    assert not bad, bad
    for case in CASES:
        rs = [r for r in flat if r["case"] == case[0]]
        assert sum(r["route_row_sent"] for r in rs) > 0
        if case[6] is not None:  # the capacity cut some arrivals
            assert sum(r["received"] for r in rs) < sum(r["sent"] for r in rs), case[0]


def _one_rank():
    rows = torch.arange(6, dtype=torch.float32).view(3, 2)
    ros = torch.tensor([2, 0, 4, 6, 6, 6])  # routes 2, 0, 4 kept (K = 2), then empty slots
    sc = torch.tensor([[2, 1]])
    return rows, ros, sc


def test_reference_one_rank_by_hand():
    rows, ros, sc = _one_rank()
    w = torch.tensor([0.5, 0.0, 2.0, 0.0, -1.0, 0.0])
    ei, ms, rw, rr = torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc], [w], 2, 4)
    assert ei[0].tolist() == [[2.0, 3.0], [0.0, 1.0], [4.0, 5.0], [0.0, 0.0]]  # tokens 1, 0, 2; zero padding
    assert ms[0].tolist() == [2, 1] and rw[0].tolist() == [2.0, 0.5, -1.0, 0.0]
    assert rr[0].tolist() == [1, -1, 0, -1, 2, -1]
    y = torch.ops.moe_graph.exchange_combine_reference([ei[0]], [rr[0]], [w], 2)
    assert y[0].tolist() == [[0.0, 0.5], [4.0, 6.0], [-4.0, -5.0]]
    g = torch.ops.moe_graph.exchange_gather_reference([ei[0]], [rr[0]])
    assert g[0][0].tolist() == [0.0, 1.0] and g[0][1].tolist() == [0.0, 0.0]


def test_reference_bad_arguments():
    rows, ros, sc = _one_rank()
    with pytest.raises(RuntimeError, match="send_counts must have shape"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc.view(2, 1)], [], 2, 4)
    with pytest.raises(RuntimeError, match="route_of_slot must have dtype Long"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros.int()], [sc], [], 2, 4)
    with pytest.raises(RuntimeError, match="weights must have shape"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows], [ros], [sc], [torch.zeros(5)], 2, 4)
    with pytest.raises(RuntimeError, match="one tensor per rank"):
        torch.ops.moe_graph.exchange_dispatch_reference([rows, rows], [ros], [sc], [], 2, 4)
    with pytest.raises(RuntimeError, match="expert_out must have dtype"):
        torch.ops.moe_graph.exchange_combine_reference([torch.zeros(4, 2, dtype=torch.uint8)], [ros], [], 2)
    assert list(torch.ops.moe_graph.exchange_layout(2, 3, 5, 37))[:3] == [6 * 2 + 2 * 2 * 2 * 3, 224, 192]


def test_nvlink_module_imports_and_needs_cuda():
    from moe_graph.ops import nvlink

    assert nvlink.layout(4, 2, 10, 16)[1] == 10 * 16 + 48
    if not _lib.has_kernel("moe_graph::exchange_dispatch", "cuda"):
        with pytest.raises(RuntimeError, match="CUDA build"):
            nvlink.NvlinkExchange()
