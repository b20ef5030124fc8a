"""The device error flag from Python: flag_error_if sets bits from device tensors without a sync."""

import pytest
import torch

from conftest import requires_cuda
from moe_graph.ops import check_errors, flag_error_if, read_error_flag
from moe_graph.ops.errors import ERROR_BITS, PLAN_INVALID


def test_flag_error_if_sets_only_when_true():
    read_error_flag("cpu")
    flag_error_if(torch.zeros(5, dtype=torch.int64), PLAN_INVALID)
    check_errors("cpu")  # nothing set
    flag_error_if(torch.tensor([0, 0, 3]), PLAN_INVALID)
    flag_error_if(torch.tensor(True), 2)
    assert read_error_flag("cpu") == PLAN_INVALID | 2
    assert read_error_flag("cpu") == 0  # read clears


def test_flag_error_if_rejects_unknown_bits():
    with pytest.raises(ValueError, match="bit must be one of"):
        flag_error_if(torch.tensor(True), 3)
    # bit 16 (capacity drops) is retired: drops are statistics, never errors
    assert sorted(ERROR_BITS) == [1, 2, 4, 8, 32, 64, 128]
    with pytest.raises(ValueError, match="bit must be one of"):
        flag_error_if(torch.tensor(True), 16)


def test_flag_error_if_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        flag_error_if(torch.ones(4), PLAN_INVALID)  # no data-dependent op, no real flag touched
    assert read_error_flag("cpu") == 0


def test_flag_error_if_survives_torch_compile():
    # the flag is global state, not an output: the op is marked side-effectful so compile keeps it
    def f(x):
        flag_error_if(x > 5, PLAN_INVALID)
        return x * 2

    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    g(torch.arange(3.0))
    assert read_error_flag("cpu") == 0
    g(torch.arange(10.0))
    assert read_error_flag("cpu") == PLAN_INVALID
    x = torch.arange(10.0, requires_grad=True)  # with autograd (joint graph)
    g(x).sum().backward()
    assert read_error_flag("cpu") == PLAN_INVALID and torch.equal(x.grad, torch.full((10,), 2.0))


@requires_cuda
def test_flag_error_if_cuda_is_sync_free_and_capturable():
    read_error_flag("cuda")
    cond = torch.zeros(8, device="cuda")
    flag_error_if(cond, PLAN_INVALID)  # eager first: allocates the flag
    torch.cuda.set_sync_debug_mode("error")
    try:
        flag_error_if(cond, PLAN_INVALID)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        flag_error_if(cond, PLAN_INVALID)
    g.replay()
    check_errors("cuda")
    cond.fill_(1)
    g.replay()
    with pytest.raises(RuntimeError, match="offloading plan input was inconsistent"):
        check_errors("cuda")
