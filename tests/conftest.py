import pytest
import torch


def cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from moe_graph.ops._lib import cuda_built

        return cuda_built()
    except ImportError:
        return False


requires_cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and the CUDA build of moe_graph._C")


@pytest.fixture
def gen():
    """A fresh random generator per test (seeded from the test's random state, so data differs across tests)."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()))
    return g


@pytest.fixture(autouse=True)
def _clear_error_flags():
    """Every test starts with clear device error flags (a test that sets one on purpose must not leak it)."""
    try:
        from moe_graph.ops.errors import read_error_flag
    except ImportError:
        yield
        return
    read_error_flag("cpu")
    if cuda_ready():
        read_error_flag("cuda")
    yield
