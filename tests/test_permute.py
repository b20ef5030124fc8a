"""Row expansion / reduction (moe_graph.ops.expand_rows / reduce_rows and the native route_dot) against the float64
loop references of moe_graph.testing.permute_reference: forward, backward (gradcheck and the weights' gradient),
sentinels, duplicate routes, zero-token rows, K=1 permutations, 16-bit data with float32 accumulation, empty
tensors, error messages, FakeTensor and torch.compile; the pure-torch path (builds without the ops) against the same
references; CUDA against the references and the device error flag on a GPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_graph.ops import permute as P
from moe_graph.ops.errors import INDEX_OUT_OF_RANGE, read_error_flag
from moe_graph.testing.permute_reference import (
    expand_rows_reference,
    random_routing,
    reduce_rows_reference,
    route_dot_reference,
)

HAVE_OP = P.native_available("cpu")
native = pytest.mark.skipif(not HAVE_OP, reason="moe_graph._C with the permute ops is not built")
HAVE_CUDA = torch.cuda.is_available() and P.native_available("cuda")
gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs CUDA and the CUDA build of the permute ops")

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2),
       torch.float16: (2e-3, 1e-3)}

# The three ops of one implementation: the native ops, or the pure-torch path of builds without them.
IMPLS = {
    "native": (lambda s, r, K, w=None: torch.ops.moe_graph.expand_rows(s, r, K, w),
               lambda s, r, w=None: torch.ops.moe_graph.reduce_rows(s, r, w),
               lambda a, b, r: torch.ops.moe_graph.route_dot(a, b, r)),
    "torch": (P._expand_torch, P._reduce_torch, P._route_dot_torch),
}
impls = pytest.mark.parametrize("impl", [pytest.param("native", marks=native), "torch"])


def close(out, ref, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), rtol=rtol, atol=atol)


def close_dot(out, a, b, route_rows, dtype):
    """route_dot against the float64 reference within the error bound of a length-H sum (accumulated in fp32, or
    fp64 for fp64 inputs): |err| <= H * u * sum|a_i * b_i| + the output's rounding (the elementwise tolerance
    alone is too tight for a 256-term fp32 dot product that cancels to a small value)."""
    ref = route_dot_reference(a, b, route_rows)
    bound = route_dot_reference(a.abs(), b.abs(), route_rows) * a.shape[1] * (2.0 ** (-53 if dtype == torch.float64
                                                                                      else -24))
    rtol, atol = TOL[dtype]
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound + atol + rtol * ref.abs()).all()), (err - bound).max()


def case(g, n, K, m, H, dtype, keep=0.8, device="cpu"):
    route_rows, route_of_row = random_routing(n, K, m, keep, g)
    return (torch.randn(n, H, generator=g).to(dtype).to(device), torch.randn(m, H, generator=g).to(dtype).to(device),
            route_rows.to(device), route_of_row.to(device), torch.rand(n, K, generator=g).to(device))


@impls
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [1, 7, 64, 129])
def test_forward_matches_reference(impl, dtype, H):
    expand, reduce, dot = IMPLS[impl]
    g = torch.Generator().manual_seed(H)
    n, K, m = 13, 3, 40
    tokens, rows, route_rows, route_of_row, w = case(g, n, K, m, H, dtype)
    for weights in (None, w, w.to(dtype)):
        close(expand(tokens, route_of_row, K, weights), expand_rows_reference(tokens, route_of_row, K, weights), dtype)
        close(reduce(rows, route_rows, weights), reduce_rows_reference(rows, route_rows, weights), dtype)
    close_dot(dot(tokens, rows, route_rows), tokens, rows, route_rows, dtype)
    assert expand(tokens, route_of_row, K).dtype == dtype and reduce(rows, route_rows, w).dtype == dtype
    assert dot(tokens, rows, route_rows).dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@impls
def test_unweighted_expand_is_an_exact_copy_and_sentinels_are_zero(impl):
    expand, reduce, _ = IMPLS[impl]
    g = torch.Generator().manual_seed(1)
    tokens, rows, route_rows, route_of_row, _w = case(g, 9, 2, 30, 24, torch.bfloat16, keep=0.6)
    out = expand(tokens, route_of_row, 2)
    for i, r in enumerate(route_of_row.tolist()):
        assert torch.equal(out[i], tokens[r // 2] if r < 18 else torch.zeros(24, dtype=torch.bfloat16))
    assert (route_of_row == 18).any() and (route_rows == 30).any()  # both sentinels occur
    # a token whose routes all lack a row (zero-token row of the reduction) is a zero row
    route_rows[4] = 30
    assert torch.equal(reduce(rows, route_rows)[4], torch.zeros(24, dtype=torch.bfloat16))


@impls
def test_permutation_k1_round_trip_is_exact(impl):
    expand, reduce, _ = IMPLS[impl]
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(50, 33, generator=g).to(dtype)
        perm = torch.randperm(50, generator=g)
        inv = torch.argsort(perm)
        y = expand(x, perm, 1)  # y[i] = x[perm[i]]
        assert torch.equal(y, x[perm])
        assert torch.equal(reduce(y, inv.view(-1, 1)), x)  # x[j] = y[inv[j]]


@impls
def test_duplicate_routes_to_one_row(impl):
    expand, reduce, _ = IMPLS[impl]
    rows = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    route_rows = torch.tensor([[1, 1, 3], [0, 2, 0]])  # token 0 reads row 1 twice; 3 = m: skipped
    w = torch.tensor([[0.5, 0.25, 9.0], [1.0, 2.0, 3.0]])
    out = reduce(rows, route_rows, w)
    close(out, reduce_rows_reference(rows, route_rows, w), torch.float32)
    assert torch.equal(out, torch.tensor([[7.5, 15.0], [204.0, 408.0]]))
    tokens = torch.tensor([[1.0], [2.0]])
    out = expand(tokens, torch.tensor([3, 3, 0, 4]), 2)  # two rows carry route 3
    assert torch.equal(out, torch.tensor([[2.0], [2.0], [1.0], [0.0]]))


@impls
def test_16bit_accumulates_in_float32(impl):
    _, reduce, _ = IMPLS[impl]
    # 1 + 3*2^-10 + 3*2^-10: bfloat16 partial sums stay at 1; the float32 sum rounds up to 1 + 2^-7
    src = torch.tensor([[1.0], [3 * 2**-10], [3 * 2**-10]], dtype=torch.bfloat16)
    out = reduce(src, torch.tensor([[0, 1, 2]]))
    assert out.dtype == torch.bfloat16 and float(out) == 1 + 2**-7


@impls
def test_empty_tensors(impl):
    expand, reduce, dot = IMPLS[impl]
    e = torch.empty(0, dtype=torch.int64)
    assert expand(torch.randn(3, 5), e, 2).shape == (0, 5)
    assert expand(torch.randn(0, 5), torch.zeros(4, dtype=torch.int64), 2).abs().sum() == 0  # n=0: all sentinel
    assert expand(torch.randn(3, 0), torch.tensor([0, 6]), 2).shape == (2, 0)
    assert reduce(torch.randn(0, 5), torch.zeros(3, 2, dtype=torch.int64)).abs().sum() == 0  # m=0: all sentinel
    assert reduce(torch.randn(4, 5), torch.empty(3, 0, dtype=torch.int64)).abs().sum() == 0  # K=0
    assert reduce(torch.randn(4, 5), torch.empty(0, 2, dtype=torch.int64)).shape == (0, 5)
    assert dot(torch.randn(3, 5), torch.randn(0, 5), torch.zeros(3, 2, dtype=torch.int64)).abs().sum() == 0


def _fresh(g, n, K, m, H, dtype):
    tokens, rows, route_rows, route_of_row, w = case(g, n, K, m, H, dtype)
    return (tokens.requires_grad_(), rows.requires_grad_(), route_rows, route_of_row,
            w.to(dtype).requires_grad_())


@pytest.mark.parametrize("impl", [pytest.param("native", marks=native), "torch"])
def test_gradcheck_float64(impl, monkeypatch):
    if impl == "torch":
        monkeypatch.setattr(P, "native_available", lambda device_type="cpu": False)
    g = torch.Generator().manual_seed(3)
    tokens, rows, route_rows, route_of_row, w = _fresh(g, 6, 3, 14, 5, torch.float64)
    assert torch.autograd.gradcheck(lambda s, ww: P.expand_rows(s, route_of_row, route_rows, ww), (tokens, w))
    assert torch.autograd.gradcheck(lambda s: P.expand_rows(s, route_of_row, route_rows), (tokens,))
    assert torch.autograd.gradcheck(lambda s, ww: P.reduce_rows(s, route_rows, route_of_row, ww), (rows, w))
    assert torch.autograd.gradcheck(lambda s: P.reduce_rows(s, route_rows, route_of_row), (rows,))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_against_reference(dtype):
    g = torch.Generator().manual_seed(4)
    tokens, rows, route_rows, route_of_row, w = _fresh(g, 11, 4, 50, 37, dtype)
    go = torch.randn(50, 37, generator=g).to(dtype)
    P.expand_rows(tokens, route_of_row, route_rows, w).backward(go)
    # d/dsrc[j] = sum_k w[j,k] go[route_rows[j,k]];  d/dw[j,k] = dot(go[route_rows[j,k]], src[j])
    close(tokens.grad, reduce_rows_reference(go, route_rows, w), dtype)
    close(w.grad, route_dot_reference(tokens, go, route_rows), dtype)
    w.grad = None
    gr = torch.randn(11, 37, generator=g).to(dtype)
    P.reduce_rows(rows, route_rows, route_of_row, w).backward(gr)
    close(rows.grad, expand_rows_reference(gr, route_of_row, 4, w), dtype)
    close(w.grad, route_dot_reference(gr, rows, route_rows), dtype)
    assert w.grad.dtype == dtype


@native
def test_weights_dtype_float32_with_16bit_rows():
    g = torch.Generator().manual_seed(5)
    tokens, rows, route_rows, route_of_row, w = _fresh(g, 5, 2, 12, 8, torch.bfloat16)
    w32 = w.detach().float().requires_grad_()
    P.reduce_rows(rows, route_rows, route_of_row, w32).sum().backward()
    assert w32.grad.dtype == torch.float32
    close(w32.grad, route_dot_reference(torch.ones(5, 8), rows, route_rows), torch.bfloat16)


@impls
def test_out_of_range_index_raises_naming_the_argument(impl):
    expand, reduce, dot = IMPLS[impl]
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"route_of_row holds 7 .*outside \[0, 6\]"):
        expand(x, torch.tensor([0, 7]), 2)
    with pytest.raises(RuntimeError, match=r"route_of_row holds -1"):
        expand(x, torch.tensor([-1, 0]), 2)
    with pytest.raises(RuntimeError, match=r"route_rows holds 4 at flat position 3, outside \[0, 3\]"):
        reduce(x, torch.tensor([[0, 1], [3, 4]]))
    with pytest.raises(RuntimeError, match=r"route_rows holds -2"):
        dot(x, x, torch.tensor([[0], [-2], [1]]))


@native
def test_bad_arguments_named():
    x, i1, i2 = torch.randn(3, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)
    op = torch.ops.moe_graph
    with pytest.raises(RuntimeError, match="expand_rows: src must be a 2-D tensor"):
        op.expand_rows(torch.randn(3), i1, 2)
    with pytest.raises(RuntimeError, match="expand_rows: src must have dtype"):
        op.expand_rows(x.int(), i1, 2)
    with pytest.raises(RuntimeError, match="expand_rows: route_of_row must have dtype Long"):
        op.expand_rows(x, i1.int(), 2)
    with pytest.raises(RuntimeError, match="expand_rows: K must be >= 0"):
        op.expand_rows(x, i1, -1)
    with pytest.raises(RuntimeError, match=r"expand_rows: weights must have shape \[3, 2\]"):
        op.expand_rows(x, i1, 2, torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="reduce_rows: weights must have the dtype of src"):
        op.reduce_rows(x, i2, torch.ones(3, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="reduce_rows: route_rows must be a 2-D tensor"):
        op.reduce_rows(x, i1)
    with pytest.raises(RuntimeError, match="route_dot: src must have the dtype of rows"):
        op.route_dot(x, x.double(), i2)
    with pytest.raises(RuntimeError, match=r"route_dot: src must have shape \[m, H\] with H = 4"):
        op.route_dot(x, torch.randn(3, 5), i2)
    with pytest.raises(ValueError, match="expand_rows: route_rows must have shape"):
        P.expand_rows(x, i1, torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="reduce_rows: route_of_row must be a 1-D int64"):
        P.reduce_rows(x, i2, i1.int())
    with pytest.raises(ValueError, match="reduce_rows: route_of_row must have shape"):
        P.reduce_rows(x, i2, i1)


@native
def test_non_contiguous_src():
    g = torch.Generator().manual_seed(6)
    big = torch.randn(20, 9, generator=g)
    src = big[::2, 1:8]
    route_rows, route_of_row = random_routing(10, 2, 15, 0.7, g)
    close(P.expand_rows(src, route_of_row, route_rows), expand_rows_reference(src, route_of_row, 2), torch.float32)
    src = torch.randn(15, 9, generator=g)[:, ::2]
    close(P.reduce_rows(src, route_rows, route_of_row), reduce_rows_reference(src, route_rows), torch.float32)


@native
def test_opcheck():
    g = torch.Generator().manual_seed(7)
    tokens, rows, route_rows, route_of_row, w = case(g, 7, 2, 16, 6, torch.float32)
    op = torch.ops.moe_graph
    for args in ((tokens, route_of_row, 2, None), (tokens, route_of_row, 2, w), (tokens.bfloat16(), route_of_row, 2, w)):
        torch.library.opcheck(op.expand_rows.default, args, test_utils=("test_schema", "test_faketensor"))
    for args in ((rows, route_rows, None), (rows, route_rows, w)):
        torch.library.opcheck(op.reduce_rows.default, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(op.route_dot.default, (tokens, rows, route_rows), test_utils=("test_schema", "test_faketensor"))


@native
def test_fake_tensor_shapes():
    with FakeTensorMode():
        src = torch.empty(5, 12, dtype=torch.bfloat16)
        route_rows = torch.empty(5, 3, dtype=torch.int64)
        route_of_row = torch.empty(20, dtype=torch.int64)
        w = torch.empty(5, 3, requires_grad=True)
        out = P.expand_rows(src, route_of_row, route_rows, w)
        assert out.shape == (20, 12) and out.dtype == torch.bfloat16
        back = P.reduce_rows(out, route_rows, route_of_row, w)
        assert back.shape == (5, 12) and back.dtype == torch.bfloat16
        back.float().sum().backward()
        assert w.grad.shape == (5, 3) and w.grad.dtype == torch.float32


@native
def test_torch_compile_fullgraph_forward_and_backward():
    g = torch.Generator().manual_seed(8)
    tokens, rows, route_rows, route_of_row, w = case(g, 9, 2, 24, 16, torch.float32)

    def layer(x, probs):
        h = P.expand_rows(x, route_of_row, route_rows)
        return P.reduce_rows(torch.tanh(h) * 2, route_rows, route_of_row, probs)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (layer, compiled):
        x, probs = tokens.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(x, probs)
        y.pow(2).sum().backward()
        outs.append((y, x.grad, probs.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------------- GPU --
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [1, 8, 13, 256, 1000, 2056])
def test_cuda_matches_reference(dtype, H):
    g = torch.Generator().manual_seed(H)
    n, K, m = 37, 4, 160
    tokens, rows, route_rows, route_of_row, w = case(g, n, K, m, H, dtype, device="cuda")
    op = torch.ops.moe_graph
    for weights in (None, w, w.to(dtype)):
        close(op.expand_rows(tokens, route_of_row, K, weights), expand_rows_reference(tokens, route_of_row, K, weights),
              dtype)
        close(op.reduce_rows(rows, route_rows, weights), reduce_rows_reference(rows, route_rows, weights), dtype)
    close_dot(op.route_dot(tokens, rows, route_rows), tokens, rows, route_rows, dtype)
    # misaligned rows (a storage offset of one element): the scalar path
    t2 = torch.cat([tokens.new_zeros(1), tokens.reshape(-1)])[1:].view(n, H)
    close(op.expand_rows(t2, route_of_row, K, w), expand_rows_reference(tokens, route_of_row, K, w), dtype)
    # CPU and CUDA agree exactly where no rounding order is involved (copies)
    assert torch.equal(op.expand_rows(tokens, route_of_row, K).cpu(),
                       op.expand_rows(tokens.cpu(), route_of_row.cpu(), K))


@gpu
def test_cuda_out_of_range_sets_flag_and_reads_sentinel():
    read_error_flag("cuda")
    x = torch.randn(3, 8, device="cuda")
    out = torch.ops.moe_graph.expand_rows(x, torch.tensor([0, 99, -5], device="cuda"), 2)
    assert read_error_flag("cuda") == INDEX_OUT_OF_RANGE
    assert torch.equal(out[1:], torch.zeros(2, 8, device="cuda")) and torch.equal(out[0], x[0])
    out = torch.ops.moe_graph.reduce_rows(x, torch.tensor([[0, 7], [-1, 3]], device="cuda"))
    assert read_error_flag("cuda") == INDEX_OUT_OF_RANGE
    assert torch.equal(out, torch.stack([x[0], torch.zeros(8, device="cuda")]))


@gpu
def test_cuda_graph_capture_and_deterministic():
    g = torch.Generator().manual_seed(9)
    tokens, rows, route_rows, route_of_row, w = case(g, 64, 8, 600, 256, torch.bfloat16, device="cuda")
    tokens.requires_grad_()
    w.requires_grad_()

    def step():
        y = P.reduce_rows(P.expand_rows(tokens, route_of_row, route_rows) * 3, route_rows, route_of_row, w)
        (gt, gw) = torch.autograd.grad(y.float().pow(2).sum(), (tokens, w))
        return y, gt, gw

    ref = step()
    assert all(torch.equal(a, b) for a, b in zip(ref, step()))  # deterministic: no atomics
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
