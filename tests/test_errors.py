"""The device error flag from Python: flag_error_if sets bits from device tensors without a sync."""

import pytest
import torch

from conftest import requires_cuda
from moe_graph.ops import check_errors, flag_error_if, read_error_flag
from moe_graph.ops.errors import CAPACITY_DROP


def test_flag_error_if_sets_only_when_true():
    read_error_flag("cpu")
    flag_error_if(torch.zeros(5, dtype=torch.int64), CAPACITY_DROP)
    check_errors("cpu")  # nothing set
    flag_error_if(torch.tensor([0, 0, 3]), CAPACITY_DROP)
    flag_error_if(torch.tensor(True), 2)
    assert read_error_flag("cpu") == CAPACITY_DROP | 2
    assert read_error_flag("cpu") == 0  # read clears


def test_flag_error_if_rejects_unknown_bits():
    with pytest.raises(ValueError, match="bit must be one of"):
        flag_error_if(torch.tensor(True), 3)


def test_flag_error_if_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        flag_error_if(torch.ones(4), CAPACITY_DROP)  # no data-dependent op, no real flag touched
    assert read_error_flag("cpu") == 0


def test_flag_error_if_survives_torch_compile():
    # the flag is global state, not an output: the op is marked side-effectful so compile keeps it
    def f(x):
        flag_error_if(x > 5, CAPACITY_DROP)
        return x * 2

    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    g(torch.arange(3.0))
    assert read_error_flag("cpu") == 0
    g(torch.arange(10.0))
    assert read_error_flag("cpu") == CAPACITY_DROP
    x = torch.arange(10.0, requires_grad=True)  # with autograd (joint graph)
    g(x).sum().backward()
    assert read_error_flag("cpu") == CAPACITY_DROP and torch.equal(x.grad, torch.full((10,), 2.0))


@requires_cuda
def test_flag_error_if_cuda_is_sync_free_and_capturable():
    read_error_flag("cuda")
    cond = torch.zeros(8, device="cuda")
    flag_error_if(cond, CAPACITY_DROP)  # eager first: allocates the flag
    torch.cuda.set_sync_debug_mode("error")
    try:
        flag_error_if(cond, CAPACITY_DROP)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        flag_error_if(cond, CAPACITY_DROP)
    g.replay()
    check_errors("cuda")
    cond.fill_(1)
    g.replay()
    with pytest.raises(RuntimeError, match="tokens were dropped"):
        check_errors("cuda")
