"""CUDA grouped GEMM vs the CPU/float64 reference, sync-freedom and CUDA-graph capture (skipped without CUDA)."""

import pytest
import torch

from conftest import requires_cuda
from moe_graph import GroupedLinear
from moe_graph.ops import check_errors, grouped_bias_grad, grouped_gemm, grouped_gemm_wgrad, read_error_flag
from moe_graph.testing.grouped_gemm_ref import random_splits, ref_grouped_gemm, ref_wgrad, rel_err, spans

pytestmark = requires_cuda
DEV = "cuda"


def _tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize(
    "E,K,N,T,pattern",
    [
        (8, 256, 512, 1000, "random"),
        (8, 136, 264, 700, "zipf"),  # K, N multiples of 8 but not of any tile
        (1, 128, 128, 333, "random"),
        (16, 512, 256, 2048, "one"),
        (4, 256, 512, 2048, "random"),  # rows/E >= 256 and N >= 256: the SM100 2-SM config (cooperative on SM90)
        (256, 128, 64, 4096, "random"),
        (1024, 64, 64, 4096, "zipf"),
    ],
)
def test_forward_matches_reference(gen, dtype, trans_b, E, K, N, T, pattern):
    splits = [0] * E if pattern == "one" else random_splits(E, T, gen, zipf=1.2 if pattern == "zipf" else 0.0)
    if pattern == "one":
        splits[E // 2] = T
    M = T + 40  # capacity rows
    a = torch.randn(M, K, generator=gen).to(dtype)
    shape = (E, N, K) if trans_b else (E, K, N)
    w = (torch.randn(*shape, generator=gen) / K**0.5).to(dtype)
    bias = torch.randn(E, N, generator=gen).to(dtype)
    y = grouped_gemm(a.to(DEV), w.to(DEV), torch.tensor(splits, device=DEV), trans_b=trans_b, bias=bias.to(DEV))
    torch.cuda.synchronize()
    ref = ref_grouped_gemm(a, w, splits, trans_b, bias=bias)
    assert rel_err(y, ref) < _tol(dtype)
    assert torch.all(y[T:] == 0)
    check_errors()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_list_weights_and_poisoned_out(gen, dtype):
    E, K, N = 5, 64, 128
    splits = [30, 0, 17, 0, 50]
    a = torch.randn(110, K, generator=gen).to(dtype)
    ws = [(torch.randn(N, K, generator=gen) / 8).to(dtype) for _ in range(E)]
    out = torch.full((110, N), float("nan"), dtype=dtype, device=DEV)
    grouped_gemm(a.to(DEV), [w.to(DEV) for w in ws], torch.tensor(splits, dtype=torch.int32, device=DEV), out=out)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref_grouped_gemm(a, ws, splits)) < _tol(dtype)


def test_device_and_alignment_errors():
    a = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="m_splits must be on cuda"):
        grouped_gemm(a, w, torch.tensor([8, 8]))
    with pytest.raises(RuntimeError, match="b must be on cuda"):
        grouped_gemm(a, w.cpu(), torch.tensor([8, 8], device=DEV))
    with pytest.raises(RuntimeError, match="K \\(a.size\\(1\\)\\) must be a multiple of 8"):
        grouped_gemm(a[:, :60].contiguous(), w[:, :, :60].contiguous(), torch.tensor([8, 8], device=DEV))
    with pytest.raises(RuntimeError, match="a must have dtype BFloat16 or Half"):
        grouped_gemm(a.float(), w.float(), torch.tensor([8, 8], device=DEV))
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        grouped_gemm(a.view(-1)[4:4 + 15 * 64].view(15, 64), w, torch.tensor([8, 7], device=DEV))


def test_overflow_sets_flag_and_stays_in_bounds(gen):
    a = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device=DEV, dtype=torch.bfloat16)
    guard = torch.full((64 * 2, 64), 7.0, device=DEV, dtype=torch.bfloat16)
    out = guard[:64]  # rows 64.. of `guard` must stay untouched
    grouped_gemm(a, w, torch.tensor([40, 40], device=DEV), out=out)
    assert torch.all(guard[64:] == 7.0)
    assert rel_err(out, ref_grouped_gemm(a.cpu(), w.cpu(), [40, 40])) < 1e-2
    with pytest.raises(RuntimeError, match="exceeded the rows"):
        check_errors()
    check_errors()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True, "mask"])
def test_wgrad_matches_reference(gen, out_dtype, accumulate):
    E, K, N, M = 6, 192, 128, 900
    splits = random_splits(E, 800, gen)
    splits[2] = 0
    a = torch.randn(M, K, generator=gen).bfloat16()
    dy = torch.randn(M, N, generator=gen).bfloat16()
    init = torch.randn(E, N, K, generator=gen).to(out_dtype)
    acc_list = [bool(x) for x in torch.randint(0, 2, (E,), generator=gen)] if accumulate == "mask" else [accumulate] * E
    acc = torch.tensor(acc_list, device=DEV) if accumulate == "mask" else accumulate
    out = init.to(DEV, copy=True)
    if not accumulate:
        out[2] = float("nan")
    grouped_gemm_wgrad(a.to(DEV), dy.to(DEV), torch.tensor(splits, device=DEV), out=list(out.unbind(0)), accumulate=acc)
    ref = ref_wgrad(a, dy, splits, out_init=init, accumulate=acc_list)
    assert rel_err(out, ref) < (1e-2 if out_dtype == torch.bfloat16 else 2e-3)
    assert not torch.isnan(out).any()


def test_no_host_sync_on_hot_path(gen):
    layer = GroupedLinear(8, 256, 512, device=DEV, params_dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(random_splits(8, 1000, gen), device=DEV)
    layer(x, splits).sum().backward()  # warm-up (allocates the error flag)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, splits)
        y.float().pow(2).sum().backward()
        grouped_gemm_wgrad(x.detach(), y.detach(), splits)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_cuda_graph_capture_replay_with_changing_splits(gen, fuse, delay):
    E, fin, fout, M = 8, 256, 384, 2048
    layer = GroupedLinear(E, fin, fout, device=DEV, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=fuse,
                          delay_wgrad_compute=delay)
    ws = layer._weights()
    if fuse:
        for w in ws:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEV)
    x = torch.randn(M, fin, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, fout, device=DEV, dtype=torch.bfloat16)
    splits = torch.zeros(E, dtype=torch.int64, device=DEV)

    def step():
        y = layer(x, splits)
        y.backward(g)
        layer.backward_dw()  # delay_wgrad_compute: the queued weight-gradient GEMM (no-op otherwise)
        return y

    def grads():
        return [(w.main_grad if fuse else w.grad) for w in ws] + [x.grad]

    def reset():
        x.grad = None
        for w in ws:
            w.grad = None
            if fuse:
                w.main_grad.zero_()

    splits.copy_(torch.tensor(random_splits(E, M - 100, gen), device=DEV))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(s)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    static_grads = grads()  # the tensors the graph writes on every replay
    for trial in range(4):
        new = random_splits(E, M - 50 * trial, gen, zipf=0.0 if trial % 2 else 1.3)
        if trial == 3:
            new = [0] * E
            new[1] = M
        splits.copy_(torch.tensor(new, device=DEV))
        if fuse:
            for w in ws:
                w.main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got_y, got = y_static.clone(), [t.clone() for t in static_grads]
        # eager on the same inputs
        reset()
        y_eager = step()
        torch.cuda.synchronize()
        torch.testing.assert_close(got_y, y_eager, rtol=0, atol=0)
        for a_, b_ in zip(got, grads()):
            torch.testing.assert_close(a_, b_, rtol=1e-3, atol=1e-3)
        assert torch.all(got_y[sum(new):] == 0)
    check_errors()


def test_list_m_splits_inside_capture_raises():
    a = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device=DEV, dtype=torch.bfloat16)
    y = grouped_gemm(a, w, [30, 34])  # eager: a list is fine (pinned copy, no host sync)
    assert rel_err(y, ref_grouped_gemm(a.cpu(), w.cpu(), [30, 34])) < 1e-2
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="frozen into the graph"):
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            grouped_gemm(a, w, [30, 34])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_grad_matches_reference(gen, dtype):
    E, N, M = 12, 264, 1500
    splits = random_splits(E, 1400, gen, zipf=1.2)
    splits[3] = 0
    dy = torch.randn(M, N, generator=gen).to(dtype)
    db = grouped_bias_grad(dy.to(DEV), torch.tensor(splits, device=DEV))
    ref = torch.zeros(E, N, dtype=torch.float64)
    for e, (st, c) in enumerate(spans(splits, M)):
        ref[e] = dy[st : st + c].double().sum(0)
    assert db.dtype == torch.float32 and db.shape == (E, N)
    torch.testing.assert_close(db.double().cpu(), ref, rtol=1e-4, atol=1e-3)
    for _ in range(3):  # deterministic: no atomics, the same bits on every call
        assert torch.equal(grouped_bias_grad(dy.to(DEV), torch.tensor(splits, device=DEV)), db)
    check_errors()


@pytest.mark.parametrize("E,pattern,dtype", [(256, "random", torch.bfloat16), (1024, "zipf", torch.bfloat16),
                                             (16, "one", torch.float16), (1, "random", torch.float16)])
def test_wgrad_many_experts_and_skew(gen, E, pattern, dtype):
    K, N, T = 64, 128, 4096
    splits = [0] * E if pattern == "one" else random_splits(E, T, gen, zipf=1.2 if pattern == "zipf" else 0.0)
    if pattern == "one":
        splits[E - 1] = T
    a = torch.randn(T + 24, K, generator=gen).to(dtype)
    dy = torch.randn(T + 24, N, generator=gen).to(dtype)
    init = torch.randn(E, N, K, generator=gen)
    out = init.to(DEV, copy=True)
    grouped_gemm_wgrad(a.to(DEV), dy.to(DEV), torch.tensor(splits, device=DEV), out=out, accumulate=True)
    ref = ref_wgrad(a, dy, splits, out_init=init, accumulate=True)
    assert rel_err(out, ref) < 2e-3
    fresh = grouped_gemm_wgrad(a.to(DEV), dy.to(DEV), torch.tensor(splits, device=DEV))  # new tensor in a's dtype
    assert fresh.dtype == dtype and rel_err(fresh, ref_wgrad(a, dy, splits)) < 1e-2
    check_errors()


def test_wgrad_and_bias_grad_overflow_stay_in_bounds(gen):
    K, N, rows = 64, 64, 64
    a_big = torch.full((2 * rows, K), float("nan"), device=DEV, dtype=torch.bfloat16)
    dy_big = torch.full((2 * rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    a_big[:rows] = torch.randn(rows, K, generator=gen).bfloat16().to(DEV)
    dy_big[:rows] = torch.randn(rows, N, generator=gen).bfloat16().to(DEV)
    a, dy = a_big[:rows], dy_big[:rows]  # rows past `rows` are NaN: reading them would poison the result
    splits = [40, 40]  # sum 80 > 64 rows: clamped to [40, 24]
    out = grouped_gemm_wgrad(a, dy, torch.tensor(splits, device=DEV))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_wgrad(a.cpu(), dy.cpu(), splits)) < 1e-2
    with pytest.raises(RuntimeError, match="exceeded the rows"):
        check_errors()
    db = grouped_bias_grad(dy, torch.tensor(splits, device=DEV))
    assert torch.isfinite(db).all()
    with pytest.raises(RuntimeError, match="exceeded the rows"):
        check_errors()


def test_overlapping_outputs_rejected_on_cuda(gen):
    buf = torch.randn(11 * 64, device=DEV).bfloat16()
    w = torch.randn(2, 64, 64, device=DEV).bfloat16()
    before = buf.clone()
    with pytest.raises(RuntimeError, match="out overlaps a"):
        grouped_gemm(buf[64:].view(10, 64), w, torch.tensor([4, 6], device=DEV), out=buf[: 640].view(10, 64))
    a, dy = torch.randn(16, 64, device=DEV).bfloat16(), torch.randn(16, 64, device=DEV).bfloat16()
    t = torch.zeros(64, 64, device=DEV)
    with pytest.raises(RuntimeError, match=r"out\[(0|1)\] overlaps out\[(0|1)\]"):
        grouped_gemm_wgrad(a, dy, torch.tensor([8, 8], device=DEV), out=[t, t], accumulate=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, before) and torch.all(t == 0)


@pytest.mark.parametrize("with_bias", [False, True])
def test_k_zero_gives_bias_rows_without_a_gemm(gen, with_bias):
    E, N = 3, 64
    splits = torch.tensor([20, 0, 30], device=DEV)
    a = torch.empty(60, 0, device=DEV, dtype=torch.bfloat16)
    w = torch.empty(E, N, 0, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(E, N, device=DEV).bfloat16() if with_bias else None
    out = torch.full((60, N), float("nan"), device=DEV).bfloat16()
    grouped_gemm(a, w, splits, bias=bias, out=out)
    ref = ref_grouped_gemm(a.cpu(), w.cpu(), [20, 0, 30], bias=None if bias is None else bias.cpu())
    assert torch.equal(out.cpu(), ref.bfloat16())


def test_fused_bias_rounds_once(gen):
    # small integers: the fp32 accumulation is exact, so the only rounding is the final one of acc + bias
    E, K, N = 2, 64, 128
    a = torch.randint(-3, 4, (256, K), device=DEV).bfloat16()
    w = torch.randint(-3, 4, (E, N, K), device=DEV).bfloat16()
    bias = (torch.randn(E, N, device=DEV) * 100).bfloat16() + 0.5
    y = grouped_gemm(a, w, torch.tensor([100, 156], device=DEV), bias=bias.bfloat16())
    ref = ref_grouped_gemm(a.cpu(), w.cpu(), [100, 156], bias=bias.bfloat16().cpu())
    assert torch.equal(y.cpu(), ref.bfloat16())


def test_fp32_wgrad_overwrite_never_reads_out(gen):
    E, K, N, T = 6, 128, 64, 700
    splits = random_splits(E, T, gen)
    splits[2] = 0
    a = torch.randn(T, K, device=DEV).bfloat16()
    dy = torch.randn(T, N, device=DEV).bfloat16()
    out = torch.full((E, N, K), float("nan"), device=DEV)
    grouped_gemm_wgrad(a, dy, torch.tensor(splits, device=DEV), out=out, accumulate=False)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref_wgrad(a.cpu(), dy.cpu(), splits)) < 1e-5


def test_sm_carveout_is_honoured(gen):
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        pytest.skip("this torch has no SM carve-out setting")
    E, K, N, T = 8, 256, 256, 2048
    splits = random_splits(E, T, gen)
    a = torch.randn(T, K, device=DEV).bfloat16()
    w = torch.randn(E, N, K, device=DEV).bfloat16()
    try:
        setter(torch.cuda.get_device_properties(0).multi_processor_count - 8)
        y = grouped_gemm(a, w, torch.tensor(splits, device=DEV))
    finally:
        setter(None)
    assert rel_err(y, ref_grouped_gemm(a.cpu(), w.cpu(), splits)) < 1e-2


@pytest.mark.parametrize("left", [17, 1])
def test_sm_carveout_leaving_odd_sm_counts(gen, left):
    # 1x2-cluster configurations need an even grid: the launch rounds the SMs left down to whole clusters (at least
    # one); small and large groups cover both SM90 configurations (ping-pong and cooperative)
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        pytest.skip("this torch has no SM carve-out setting")
    for E, T in [(64, 2048), (4, 2048)]:
        K, N = 256, 256
        splits = random_splits(E, T, gen)
        a = torch.randn(T, K, device=DEV).bfloat16()
        w = torch.randn(E, N, K, device=DEV).bfloat16()
        dy = torch.randn(T, N, device=DEV).bfloat16()
        try:
            setter(torch.cuda.get_device_properties(0).multi_processor_count - left)
            y = grouped_gemm(a, w, torch.tensor(splits, device=DEV))
            dw = grouped_gemm_wgrad(a, dy, torch.tensor(splits, device=DEV))
            torch.cuda.synchronize()
        finally:
            setter(None)
        assert rel_err(y, ref_grouped_gemm(a.cpu(), w.cpu(), splits)) < 1e-2
        assert rel_err(dw, ref_wgrad(a.cpu(), dy.cpu(), splits)) < 1e-2
    check_errors()


def test_large_tail_zeroed_by_the_argument_kernel(gen):
    # rows past sum(m_splits) (here most of a poisoned buffer) are zeroed by the argument kernel's extra blocks
    E, K, N, T, M = 8, 64, 4096, 100, 8192
    splits = random_splits(E, T, gen)
    a = torch.randn(M, K, device=DEV).bfloat16()
    w = torch.randn(E, N, K, device=DEV).bfloat16()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    grouped_gemm(a, w, torch.tensor(splits, device=DEV), out=out)
    assert torch.all(out[T:] == 0)
    assert rel_err(out[:T], ref_grouped_gemm(a.cpu()[:T], w.cpu(), splits)) < 1e-2


def test_fp32_denormals_kept_in_main_grad_accumulation():
    # the GEMM objects are built without --use_fast_math: C = main_grad is read without flushing denormals
    E, K, N, T = 4, 64, 64, 256
    a = torch.zeros(T, K, device=DEV).bfloat16()
    dy = torch.zeros(T, N, device=DEV).bfloat16()
    tiny = torch.finfo(torch.float32).tiny / 4  # a denormal
    out = torch.full((E, N, K), tiny, device=DEV)
    grouped_gemm_wgrad(a, dy, torch.tensor([64] * E, device=DEV), out=out, accumulate=True)
    assert torch.all(out == tiny)
