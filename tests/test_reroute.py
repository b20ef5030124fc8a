"""Native token rerouting (moe_graph.ops.reroute_tokens and its index form reroute_indices): CPU kernel vs a
plain-Python reference, edge cases, the device error flag, opcheck and autograd; the index form moves exactly the
routes the dense form moves; CUDA kernels vs CPU, CUDA-graph capture/replay and no-sync checks on a GPU."""

import pytest
import torch

from moe_graph.moe import echo_planner
from moe_graph.testing.echo_reference import reroute_tokens_reference

try:
    from moe_graph.ops import reroute as reroute_ops

    HAVE_OP = reroute_ops.native_available()
except ImportError:  # extension not built
    HAVE_OP = False

pytestmark = pytest.mark.skipif(not HAVE_OP, reason="moe_graph._C with reroute_tokens is not built")

ERR_OVER_ASK = 1 << 2
ERR_PLAN_INVALID = 1 << 3


def read_flag(device):
    return int(torch.ops.moe_graph.read_error_flag(torch.empty(0, device=device)))


def bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_case(g, T, E, S, density=0.3, dtype=torch.float32, over=False, multi_home=False):
    rm = torch.rand(T, E, generator=g) < density
    probs = torch.randn(T, E, generator=g).to(dtype)
    hmap = torch.zeros(E, S, dtype=torch.bool)
    for j in range(S):
        if torch.rand(1, generator=g) < 0.85:
            hmap[int(torch.randint(0, E, (1,), generator=g)), j] = True
            if multi_home and torch.rand(1, generator=g) < 0.3:
                hmap[int(torch.randint(0, E, (1,), generator=g)), j] = True
    routed = rm.sum(0)
    want = torch.zeros(S, dtype=torch.int64)
    homes = hmap.to(torch.int8).argmax(0)
    left = routed.clone()
    for j in range(S):
        if hmap[:, j].any():
            e = int(homes[j])
            hi = int(left[e]) + (5 if over else 0)
            want[j] = int(torch.randint(0, hi + 1, (1,), generator=g))
            left[e] = max(0, int(left[e]) - int(want[j]))
    return rm, probs, want, hmap


def check_against_reference(rm, probs, want, hmap, device="cpu"):
    read_flag(device)
    m, p = reroute_ops.reroute_tokens(rm.to(device), probs.to(device), want.to(device), hmap.to(device))
    flag = read_flag(device)
    rmap, rprobs, over = reroute_tokens_reference(rm, probs, want, hmap)
    assert m.dtype == torch.bool and p.dtype == probs.dtype
    assert torch.equal(m.cpu(), rmap)
    assert torch.equal(bits(p.cpu()), bits(rprobs)), "moved probabilities must be bit-identical"
    assert bool(flag & ERR_OVER_ASK) == over, f"flag {flag}, reference over-ask {over}"
    assert torch.equal(m.sum(1).cpu(), rm.sum(1)), "every token keeps its number of routes"
    return m, p, flag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_matches_reference_random(dtype):
    g = torch.Generator().manual_seed(1)
    for T, E, S in [(1, 1, 1), (7, 4, 2), (100, 8, 8), (3000, 16, 6), (5000, 5, 3)]:
        for density in (0.05, 0.5, 1.0):
            check_against_reference(*random_case(g, T, E, S, density, dtype))


def test_cpu_matches_torch_implementation():
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        rm, probs, want, hmap = random_case(g, 2500, 12, 7, 0.4, over=True)
        m, p = reroute_ops.reroute_tokens(rm, probs, want, hmap)
        tm, tp = echo_planner.reroute_tokens_torch(rm, probs, want, hmap)
        assert torch.equal(m, tm) and torch.equal(bits(p), bits(tp))


def test_order_lowest_tokens_first_in_slot_order():
    # expert 0 routed at tokens 1, 2, 4, 5, 7; slots 0 and 2 host expert 0, slot 1 hosts expert 1
    rm = torch.zeros(8, 2, dtype=torch.bool)
    rm[[1, 2, 4, 5, 7], 0] = True
    rm[[0, 2, 3], 1] = True
    probs = torch.arange(16, dtype=torch.float32).view(8, 2) + 0.5
    hmap = torch.tensor([[True, False, True], [False, True, False]])
    want = torch.tensor([2, 1, 2])
    read_flag("cpu")
    m, p = reroute_ops.reroute_tokens(rm, probs, want, hmap)
    assert m[:, 2].nonzero().flatten().tolist() == [1, 2]  # slot 0 (column E + 0)
    assert m[:, 4].nonzero().flatten().tolist() == [4, 5]  # slot 2
    assert m[:, 3].nonzero().flatten().tolist() == [0]  # slot 1 takes expert 1's first token
    assert m[:, 0].nonzero().flatten().tolist() == [7]
    assert m[:, 1].nonzero().flatten().tolist() == [2, 3]
    assert p[1, 2] == probs[1, 0] and p[1, 0] == 0 and p[0, 3] == probs[0, 1]
    assert read_flag("cpu") == 0


def test_edge_cases():
    g = torch.Generator().manual_seed(3)
    # no tokens
    check_against_reference(*random_case(g, 0, 4, 2))
    # no slots
    rm = torch.rand(10, 4, generator=g) < 0.5
    m, p = reroute_ops.reroute_tokens(rm, torch.rand(10, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(4, 0, dtype=torch.bool))
    assert torch.equal(m, rm) and m.shape == (10, 4)
    # int32 requests, non-contiguous inputs
    rm, probs, want, hmap = random_case(g, 50, 6, 4)
    big = torch.rand(50, 12, generator=g)
    big[:, ::2] = probs
    m, p = reroute_ops.reroute_tokens(rm, big[:, ::2], want.to(torch.int32), hmap)
    rmap, rprobs, _ = reroute_tokens_reference(rm, probs, want, hmap)
    assert torch.equal(m, rmap) and torch.equal(p, rprobs)
    # special probability bits survive the move: -0.0, inf, NaN
    rm = torch.ones(3, 1, dtype=torch.bool)
    probs = torch.tensor([[-0.0], [float("inf")], [float("nan")]])
    m, p = reroute_ops.reroute_tokens(rm, probs, torch.tensor([3]), torch.tensor([[True]]))
    assert torch.equal(bits(p[:, 1]), bits(probs[:, 0]))
    assert torch.equal(bits(p[:, 0]), torch.zeros(3, dtype=torch.int32))


def test_error_flag_over_ask_and_invalid_plans():
    read_flag("cpu")
    rm = torch.zeros(6, 2, dtype=torch.bool)
    rm[[0, 3, 4], 0] = True
    probs = torch.rand(6, 2)
    hmap = torch.tensor([[True, True], [False, False]])
    # asks 2 + 3 = 5 of expert 0's 3 tokens: slot 0 gets 2, slot 1 the last 1
    m, _ = reroute_ops.reroute_tokens(rm, probs, torch.tensor([2, 3]), hmap)
    assert read_flag("cpu") == ERR_OVER_ASK
    assert m[:, 2].nonzero().flatten().tolist() == [0, 3] and m[:, 3].nonzero().flatten().tolist() == [4]
    assert int(m.sum()) == 3
    # a slot without a home asked for tokens
    reroute_ops.reroute_tokens(rm, probs, torch.tensor([0, 1]), torch.tensor([[True, False], [False, False]]))
    assert read_flag("cpu") == ERR_OVER_ASK
    # negative request
    m, _ = reroute_ops.reroute_tokens(rm, probs, torch.tensor([-1, 1]), hmap)
    assert read_flag("cpu") == ERR_PLAN_INVALID
    assert m[:, 3].nonzero().flatten().tolist() == [0]
    # a slot listed for two experts: the first one is used, plan flagged invalid
    rm[1, 1] = True
    m, _ = reroute_ops.reroute_tokens(rm, probs, torch.tensor([1, 0]), torch.tensor([[True, False], [True, False]]))
    assert read_flag("cpu") == ERR_PLAN_INVALID
    assert m[0, 2] and not m[1, 2]
    # exact asks: no flag
    reroute_ops.reroute_tokens(rm, probs, torch.tensor([1, 2]), hmap)
    assert read_flag("cpu") == 0


def test_argument_errors_name_the_tensor():
    rm = torch.zeros(4, 3, dtype=torch.bool)
    probs = torch.rand(4, 3)
    tts = torch.zeros(2, dtype=torch.int64)
    hmap = torch.zeros(3, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="routing_map"):
        reroute_ops.reroute_tokens(rm.float(), probs, tts, hmap)
    with pytest.raises(RuntimeError, match="probs"):
        reroute_ops.reroute_tokens(rm, probs[:, :2], tts, hmap)
    with pytest.raises(RuntimeError, match="probs"):
        reroute_ops.reroute_tokens(rm, probs.to(torch.int32), tts, hmap)
    with pytest.raises(RuntimeError, match="tokens_to_spare"):
        reroute_ops.reroute_tokens(rm, probs, tts[:1], hmap)
    with pytest.raises(RuntimeError, match="tokens_to_spare"):
        reroute_ops.reroute_tokens(rm, probs, tts.float(), hmap)
    with pytest.raises(RuntimeError, match="offload_map"):
        reroute_ops.reroute_tokens(rm, probs, tts, hmap[:2])
    with pytest.raises(RuntimeError, match="offload_map"):
        reroute_ops.reroute_tokens(rm, probs, tts, hmap.int())


def test_opcheck():
    g = torch.Generator().manual_seed(4)
    for T, E, S, dtype in [(20, 4, 2, torch.float32), (33, 6, 4, torch.float64), (0, 3, 1, torch.float32)]:
        rm, probs, want, hmap = random_case(g, T, E, S, 0.4, dtype)
        torch.library.opcheck(torch.ops.moe_graph.reroute_tokens.default, (rm, probs, want, hmap))
        # With grad: opcheck's aot_dispatch_dynamic test sums all outputs into one tensor, which fails for a
        # (bool, float) pair before reaching our op; that path is covered by the torch.compile check below.
        torch.library.opcheck(
            torch.ops.moe_graph.reroute_tokens.default,
            (rm, probs.clone().requires_grad_(), want, hmap),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def test_opcheck_plan_ops():
    from moe_graph.testing.echo_reference import zipf_counts

    if not (reroute_ops.plan_available() and reroute_ops.best_fit_available()):
        pytest.skip("echo_plan / echo_best_fit not built")
    counts = zipf_counts(4, 8, 64, 2, 1.2, torch.Generator().manual_seed(9))
    for k in (1, 2):
        torch.library.opcheck(torch.ops.moe_graph.echo_best_fit.default, (counts, k))
        for mode in (0, 1, 2):
            torch.library.opcheck(torch.ops.moe_graph.echo_plan.default, (counts, k, mode))
    with pytest.raises(RuntimeError, match="counts"):
        torch.ops.moe_graph.echo_plan(torch.zeros(3, 4, dtype=torch.int64), 1, 0)
    with pytest.raises(RuntimeError, match="mode"):
        torch.ops.moe_graph.echo_plan(counts, 1, 5)
    with pytest.raises(RuntimeError, match="num_spare_experts_per_ep_rank"):
        torch.ops.moe_graph.echo_best_fit(counts, 0)
    # no experts: an all-zero plan (the outputs are written, not left uninitialised)
    for _ in range(3):
        torch.empty(1 << 16, dtype=torch.int64).fill_(7)  # dirty the allocator's free blocks
        h, alloc = torch.ops.moe_graph.echo_plan(torch.zeros(4, 0, dtype=torch.int64), 2, 0)
        assert h.shape == (0, 8) and alloc.shape == (4, 8) and not alloc.any()


def test_compile_aot_eager_with_grad():
    g = torch.Generator().manual_seed(8)
    rm, probs, want, hmap = random_case(g, 30, 4, 3, 0.5)
    w = torch.randn(30, 7, generator=g)

    def f(p):
        m, q = reroute_ops.reroute_tokens(rm, p, want, hmap)
        return (q * w).sum() + m.sum()

    p1 = probs.clone().requires_grad_()
    f(p1).backward()
    p2 = probs.clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(p2).backward()
    assert torch.equal(p1.grad, p2.grad)


def test_autograd_through_probs():
    g = torch.Generator().manual_seed(5)
    rm, probs, want, hmap = random_case(g, 40, 5, 3, 0.5, torch.float64)
    probs.requires_grad_()
    torch.autograd.gradcheck(lambda p: reroute_ops.reroute_tokens(rm, p, want, hmap)[1], (probs,))
    # gradient of a weighted sum lands where each probability came from
    w = torch.randn(40, 8, dtype=torch.float64, generator=g)
    _, p = reroute_ops.reroute_tokens(rm, probs, want, hmap)
    (p * w).sum().backward()
    m_ref, _, _ = reroute_tokens_reference(rm, probs.detach(), want, hmap)
    home = hmap.to(torch.int8).argmax(0)
    expect = w[:, :5].clone()
    for t, j in (m_ref[:, 5:]).nonzero().tolist():
        expect[t, int(home[j])] = w[t, 5 + j]
    assert torch.equal(probs.grad, expect)


# ---------------------------------------------------------------------------------------------------------------
# Index form: reroute_indices
# ---------------------------------------------------------------------------------------------------------------

HAVE_IDX = HAVE_OP and torch._C._dispatch_has_kernel_for_dispatch_key("moe_graph::reroute_indices", "CPU")
idx_op = pytest.mark.skipif(not HAVE_IDX, reason="moe_graph._C without reroute_indices")


def random_index_case(g, T, E, K, S, invalid=0.1, over=False, multi_home=False):
    """Top-k indices (distinct experts per token, rows in random order), a validity mask and a plan."""
    K = min(K, E)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K] if E else torch.zeros(T, 0, dtype=torch.int64)
    valid = torch.rand(T, K, generator=g) >= invalid
    rm = torch.zeros(T, E, dtype=torch.bool)
    rm.scatter_(1, idx, valid)
    _, _, want, hmap = random_case(g, 0, E, S, multi_home=multi_home)
    routed = rm.sum(0)
    homes = hmap.to(torch.int8).argmax(0)
    left = routed.clone()
    for j in range(S):  # requests from the real routing (random_case drew them for zero tokens)
        if hmap[:, j].any():
            e = int(homes[j])
            want[j] = int(torch.randint(0, int(left[e]) + (5 if over else 0) + 1, (1,), generator=g))
            left[e] = max(0, int(left[e]) - int(want[j]))
    return idx, valid, rm, want, hmap


def index_map(indices, valid, width):
    m = torch.zeros(indices.shape[0], width, dtype=torch.bool)
    return m.scatter_(1, indices.cpu(), valid.cpu())


def check_index_form(idx, valid, rm, want, hmap, device="cpu"):
    """reroute_indices moves the routes the dense op moves (same map, same flag, positions kept) and returns each
    slot's home; the int64 plan (home_to_spare, read as > 0) and the bool map agree."""
    E, S = hmap.shape
    read_flag("cpu")
    m, _ = reroute_ops.reroute_tokens(rm, torch.rand(rm.shape), want, hmap)
    dense_flag = read_flag("cpu")
    rmap, _, over = reroute_tokens_reference(rm, torch.zeros(rm.shape), want, hmap)
    assert torch.equal(m, rmap)
    read_flag(device)
    plan_int = hmap.to(torch.int64) * torch.randint(1, 9, hmap.shape)
    out = []
    for om in (hmap, plan_int):
        out.append(reroute_ops.reroute_indices(idx.to(device), want.to(device), om.to(device), valid.to(device)))
        assert read_flag(device) == dense_flag, "the index form flags what the dense form flags"
    (ni, home), (ni2, home2) = [(a.cpu(), b.cpu()) for a, b in out]
    assert torch.equal(ni, ni2) and torch.equal(home, home2)
    assert ni.dtype == torch.int64 and ni.shape == idx.shape
    assert torch.equal(index_map(ni, valid, E + S), rmap), "the same routes move to the same slots"
    assert torch.equal(ni[~valid], idx[~valid]), "invalid routes are copied unchanged"
    moved = ni != idx
    assert (ni[moved] >= E).all() and (idx[moved] < E).all()
    expect_home = [next((e for e in range(E) if hmap[e, j]), E) for j in range(S)]
    assert home.tolist() == expect_home
    assert bool(dense_flag & ERR_OVER_ASK) == over
    return ni


@idx_op
def test_index_form_matches_dense_form_random():
    g = torch.Generator().manual_seed(11)
    for T, E, K, S in [(1, 1, 1, 1), (7, 4, 2, 2), (100, 8, 3, 8), (3000, 16, 4, 6), (4500, 5, 5, 3), (0, 4, 2, 2)]:
        for invalid in (0.0, 0.3):
            for over in (False, True):
                check_index_form(*random_index_case(g, T, E, K, S, invalid, over, multi_home=(E == 8)))


@idx_op
def test_index_form_docstring_example_and_order():
    read_flag("cpu")
    idx = torch.tensor([[0], [1], [1], [0], [0]])
    ni, home = reroute_ops.reroute_indices(idx, torch.tensor([2]), torch.tensor([[True], [False]]))
    assert ni.flatten().tolist() == [2, 1, 1, 2, 0] and home.tolist() == [0]
    # expert 0 routed at tokens 1, 2, 4, 5, 7 (in varying positions of the row; token 6's route to it is invalid:
    # not counted, not moved); slots 0 and 2 host expert 0 (2 then 3 tokens), slot 1 expert 1 (routed at tokens
    # 0, 2, 3; 1 token), slot 3 nothing
    idx = torch.tensor([[1, 3], [0, 2], [1, 0], [2, 1], [0, 3], [3, 0], [0, 3], [0, 2]])
    valid = torch.ones(8, 2, dtype=torch.bool)
    valid[6, 0] = False
    ni, home = reroute_ops.reroute_indices(idx, torch.tensor([2, 1, 3, 0]),
                                           torch.tensor([[1, 0, 3, 0], [0, 5, 0, 0], [0] * 4, [0] * 4]), valid)
    assert home.tolist() == [0, 1, 0, 4]
    assert ni.tolist() == [[5, 3], [4, 2], [1, 4], [2, 1], [6, 3], [3, 6], [0, 3], [6, 2]]
    assert read_flag("cpu") == 0


@idx_op
def test_index_form_edge_cases_and_argument_errors():
    # no slots; routes outside [0, E) are neither counted nor moved
    idx = torch.tensor([[0, 5], [-1, 0], [0, 1]])
    ni, home = reroute_ops.reroute_indices(idx, torch.zeros(0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.bool))
    assert torch.equal(ni, idx) and home.shape == (0,)
    read_flag("cpu")
    ni, _ = reroute_ops.reroute_indices(idx, torch.tensor([1], dtype=torch.int32), torch.tensor([[True], [False]]))
    assert ni.tolist() == [[2, 5], [-1, 0], [0, 1]] and read_flag("cpu") == 0
    # non-contiguous indices
    big = torch.stack([idx, idx], dim=2)[:, :, 0]
    assert torch.equal(reroute_ops.reroute_indices(big, torch.tensor([2]), torch.tensor([[True], [False]]))[0],
                       torch.tensor([[2, 5], [-1, 2], [0, 1]]))
    t, hm = torch.zeros(2, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.bool)
    for bad, name in [(dict(indices=idx.int()), "indices"), (dict(indices=idx[0]), "indices"),
                      (dict(tokens_to_spare=t[:1]), "tokens_to_spare"), (dict(tokens_to_spare=t.float()), "tokens_to_spare"),
                      (dict(offload_map=hm.float()), "offload_map"), (dict(offload_map=hm[0]), "offload_map"),
                      (dict(valid=torch.ones(3, 1, dtype=torch.bool)), "valid"),
                      (dict(valid=torch.ones(3, 2)), "valid")]:
        args = dict(indices=idx, tokens_to_spare=t, offload_map=hm, valid=None)
        args.update(bad)
        with pytest.raises(RuntimeError, match=f"reroute_indices: {name}"):
            reroute_ops.reroute_indices(**args)


@idx_op
def test_index_form_opcheck_and_compile():
    g = torch.Generator().manual_seed(12)
    for T, E, K, S in [(20, 4, 2, 2), (33, 6, 3, 4), (0, 3, 1, 1)]:
        idx, valid, _, want, hmap = random_index_case(g, T, E, K, S)
        torch.library.opcheck(torch.ops.moe_graph.reroute_indices.default, (idx, want, hmap, valid))
        torch.library.opcheck(torch.ops.moe_graph.reroute_indices.default, (idx, want, hmap.long()))
    idx, valid, _, want, hmap = random_index_case(g, 30, 6, 2, 3)
    f = lambda i: reroute_ops.reroute_indices(i, want, hmap, valid)[0] * 2  # noqa: E731
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(idx), f(idx))


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

HAVE_CUDA_OP = (
    HAVE_OP
    and torch.cuda.is_available()
    and torch._C._dispatch_has_kernel_for_dispatch_key("moe_graph::reroute_tokens", "CUDA")
)
gpu = pytest.mark.skipif(not HAVE_CUDA_OP, reason="needs CUDA and the CUDA build of reroute_tokens")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(6)
    for T, E, S, over in [(1, 1, 1, False), (63, 4, 2, False), (65, 8, 8, True), (5000, 64, 16, False),
                          (16384, 256, 32, False), (3000, 300, 70, True), (0, 8, 4, False)]:
        for density in (0.05, 0.6):
            read_flag("cpu")
            read_flag("cuda")
            case = random_case(g, T, E, S, density, dtype, over=over, multi_home=(E == 8))
            if T * E <= 200000:  # the Python reference is slow on big cases; those compare CUDA with CPU only
                check_against_reference(*case, device="cuda")
            rm, probs, want, hmap = case
            mc, pc = reroute_ops.reroute_tokens(rm, probs, want, hmap)
            cpu_flag = read_flag("cpu")
            md, pd = reroute_ops.reroute_tokens(rm.cuda(), probs.cuda(), want.cuda(), hmap.cuda())
            assert read_flag("cuda") == cpu_flag
            assert torch.equal(md.cpu(), mc) and torch.equal(bits(pd.cpu()), bits(pc))


@gpu
def test_cuda_graph_capture_replay_and_no_sync():
    from moe_graph.testing.echo_reference import zipf_counts, zipf_routing

    dev = torch.device("cuda")
    R_, E, k, T = 8, 64, 2, 4096
    g = torch.Generator().manual_seed(7)

    def make_inputs():
        rm = zipf_routing(T, E, 4, 1.2, g)
        counts = zipf_counts(R_, E, T, 4, 1.2, g)
        counts[0] = rm.sum(0)
        return rm, torch.rand(T, E, generator=g), counts

    static = [x.to(dev) for x in make_inputs()]
    # warm up (allocates the error flag and the caching allocator's blocks) on a side stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            echo_planner.gen_offloading_plan(static[0], static[1], static[2], 0, R_, k)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = echo_planner.gen_offloading_plan(static[0], static[1], static[2], 0, R_, k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = echo_planner.gen_offloading_plan(static[0], static[1], static[2], 0, R_, k)
    for _ in range(3):
        fresh = make_inputs()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        ref = echo_planner.gen_offloading_plan(fresh[0], fresh[1], fresh[2], 0, R_, k)  # CPU eager
        for a, b in zip(out, ref):
            assert torch.equal(a.cpu(), b)
    assert read_flag("cuda") == 0
    del eager


HAVE_CUDA_IDX = HAVE_CUDA_OP and torch._C._dispatch_has_kernel_for_dispatch_key("moe_graph::reroute_indices", "CUDA")


@pytest.mark.skipif(not HAVE_CUDA_IDX, reason="needs CUDA and the CUDA build of reroute_indices")
def test_cuda_index_form_matches_cpu_and_captures():
    g = torch.Generator().manual_seed(13)
    for T, E, K, S, over in [(1, 1, 1, 1, False), (63, 4, 2, 2, False), (65, 8, 3, 8, True), (5000, 64, 8, 16, False),
                             (16384, 256, 8, 32, False), (3000, 300, 6, 70, True), (0, 8, 2, 4, False)]:
        case = random_index_case(g, T, E, K, S, 0.1, over, multi_home=(E == 8))
        if T * E <= 200000:
            check_index_form(*case, device="cuda")
        idx, valid, _, want, hmap = case
        read_flag("cpu")
        ni, home = reroute_ops.reroute_indices(idx, want, hmap, valid)
        cpu_flag = read_flag("cpu")
        read_flag("cuda")
        nd, hd = reroute_ops.reroute_indices(idx.cuda(), want.cuda(), hmap.cuda(), valid.cuda())
        assert read_flag("cuda") == cpu_flag
        assert torch.equal(nd.cpu(), ni) and torch.equal(hd.cpu(), home)
    idx, valid, _, want, hmap = random_index_case(g, 4096, 64, 8, 16)
    static = [t.cuda() for t in (idx, want, hmap, valid)]
    reroute_ops.reroute_indices(*static)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = reroute_ops.reroute_indices(*static)
    for _ in range(3):
        idx, valid, _, want, hmap = random_index_case(g, 4096, 64, 8, 16)
        for dst, src in zip(static, (idx, want, hmap, valid)):
            dst.copy_(src)
        graph.replay()
        ref = reroute_ops.reroute_indices(idx, want, hmap, valid)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, ref))
