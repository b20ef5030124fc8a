"""CUDA FP8 scaled grouped GEMM (CUTLASS: blockwise on sm_90, MXFP8 on sm_100) against the CPU implementation that
defines the semantics (csrc/fp8/scaled_gemm.h) on the same quantized operands: forward / dgrad form with bias and
bf16 output, wgrad with main_grad accumulation and overwrite, zero-token experts, capacity rows past
sum(m_splits), sizes that are not tile multiples, the error flag of unaligned wgrad starts, and a CUDA graph
replayed with changing m_splits. Skipped without a GPU of the recipe's architecture."""

import pytest
import torch

from conftest import requires_cuda
from moe_graph.ops import check_errors, fp8

pytestmark = requires_cuda
DEV = "cuda"

# recipe -> (compute capability, activation tiles, weight tiles, columnwise tiles, block_k, block_n, block_m)
RECIPES = {
    "blockwise": ((9, 0), "1x128", "128x128", "128x1", 128, 128, 128),
    "mxfp8": ((10, 0), "1x32", "1x32", "32x1", 32, 1, 32),
}


def _need(recipe):
    cc = RECIPES[recipe][0]
    if torch.cuda.get_device_capability() != cc:
        pytest.skip(f"{recipe} runs on compute capability {cc}")


def _close(got, ref, what):
    """The GPU sums each K block on tensor cores (another order than the CPU's k loop; Hopper's FP8 MMA keeps a
    reduced-precision partial sum inside a block) and rounds once to bf16: within 2 bf16 ulps of the row's scale."""
    ref = ref.float()
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = (got.float() - ref).abs() / scale
    assert err.max().item() <= 2 ** -6, f"{what}: max error {err.max().item():.3e} of the row maximum"


def _operands(gen, recipe, splits, M, K, N):
    _, ta, tw, _, bk, bn, _ = RECIPES[recipe]
    ms = torch.tensor(splits, dtype=torch.int32, device=DEV)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(len(splits), N, K, generator=gen) / K ** 0.5).to(torch.bfloat16).to(DEV)
    qa, sa = fp8.quantize(x, ms, tiles=ta)
    qb, sb = fp8.quantize(w, tiles=tw)
    return ms, qa, sa, qb, sb, bk, bn


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("splits,M,K,N", [
    ([300, 0, 517, 64], 1000, 512, 256),     # zero-token expert, 119 capacity rows
    ([0, 0, 2048, 0], 2048, 256, 520),       # one expert takes everything; N not a tile multiple
    ([1, 2, 3, 5, 8, 13, 21, 34], 100, 128, 136),
])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_matches_cpu(gen, recipe, splits, M, K, N, bias):
    _need(recipe)
    ms, qa, sa, qb, sb, bk, bn = _operands(gen, recipe, splits, M, K, N)
    b = torch.randn(len(splits), N, generator=gen).to(DEV) if bias else None
    y = fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=bk, block_n=bn, bias=b, out_dtype=torch.bfloat16)
    ref = fp8.scaled_grouped_gemm(qa.cpu(), sa.cpu(), qb.cpu(), sb.cpu(), ms.cpu(), block_k=bk, block_n=bn,
                                  bias=None if b is None else b.cpu(), out_dtype=torch.float32)
    total = min(sum(splits), M)
    _close(y[:total].cpu(), ref[:total], f"{recipe} forward")
    assert torch.equal(y[total:].cpu(), torch.zeros(M - total, N, dtype=torch.bfloat16))
    check_errors(DEV)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_matches_cpu(gen, recipe, accumulate):
    _need(recipe)
    _, _, _, tc, _, _, bm = RECIPES[recipe]
    splits = [256, 0, 16, 400, 112]  # starts multiples of 16; 48 capacity rows
    M, K, N = 832, 256, 136
    ms = torch.tensor(splits, device=DEV)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEV)
    dy = torch.randn(M, N, generator=gen).to(torch.bfloat16).to(DEV)
    qd, sd = fp8.quantize(dy, ms, tiles=tc, transpose=True)
    qx, sx = fp8.quantize(x, ms, tiles=tc, transpose=True)
    main_grad = torch.randn(len(splits), N, K, generator=gen).to(DEV)
    start = main_grad.clone()
    fp8.scaled_grouped_wgrad(qd, sd, qx, sx, ms, block_m=bm, out=main_grad, accumulate=accumulate)
    ref = start.cpu().clone()
    fp8.scaled_grouped_wgrad(qd.cpu(), sd.cpu(), qx.cpu(), sx.cpu(), ms.cpu(), block_m=bm, out=ref,
                             accumulate=accumulate)
    got = main_grad.cpu()
    assert torch.equal(got[1], ref[1])  # zero-token expert: zero, or main_grad unchanged
    _close(got, ref, f"{recipe} wgrad")
    check_errors(DEV)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_wgrad_unaligned_start_is_flagged(recipe):
    _need(recipe)
    _, _, _, tc, _, _, bm = RECIPES[recipe]
    ms = torch.tensor([5, 27], device=DEV)  # expert 1 starts at token 5
    x = torch.randn(32, 64, device=DEV)
    qx, sx = fp8.quantize(x, ms, tiles=tc, transpose=True)
    out = fp8.scaled_grouped_wgrad(qx, sx, qx, sx, ms, block_m=bm)
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        check_errors(DEV)
    assert torch.equal(out[1].cpu(), torch.zeros(64, 64))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cuda_graph_replay_with_changing_splits(gen, recipe):
    _need(recipe)
    _, ta, tw, tc, bk, bn, bm = RECIPES[recipe]
    E, M, K, N = 4, 512, 256, 128
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(E, N, K, generator=gen) / 16).to(torch.bfloat16).to(DEV)
    ms = torch.tensor([128, 128, 128, 128], device=DEV)
    main_grad = torch.zeros(E, N, K, device=DEV)

    def step():
        qa, sa = fp8.quantize(x, ms, tiles=ta)
        qb, sb = fp8.quantize(w, tiles=tw)
        y = fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=bk, block_n=bn)
        qy, sy = fp8.quantize(y, ms, tiles=tc, transpose=True)
        qx, sx = fp8.quantize(x, ms, tiles=tc, transpose=True)
        fp8.scaled_grouped_wgrad(qy, sy, qx, sx, ms, block_m=bm, out=main_grad, accumulate=True)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (error flag, workspace)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    for splits in ([128, 128, 128, 128], [0, 400, 16, 48], [512, 0, 0, 0], [0, 0, 0, 32]):
        ms.copy_(torch.tensor(splits))
        main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        msc = ms.cpu()
        qa, sa = fp8.quantize(x.cpu(), msc, tiles=ta)
        qb, sb = fp8.quantize(w.cpu(), tiles=tw)
        ref = fp8.scaled_grouped_gemm(qa, sa, qb, sb, msc, block_k=bk, block_n=bn, out_dtype=torch.float32)
        total = sum(splits)
        _close(y_static[:total].cpu(), ref[:total], f"replay {splits}")
        assert torch.equal(y_static[total:].cpu(), torch.zeros(M - total, N, dtype=torch.bfloat16))
        qy, sy = fp8.quantize(y_static.cpu(), msc, tiles=tc, transpose=True)
        qx, sx = fp8.quantize(x.cpu(), msc, tiles=tc, transpose=True)
        ref_w = fp8.scaled_grouped_wgrad(qy, sy, qx, sx, msc, block_m=bm)
        _close(main_grad.cpu(), ref_w, f"replay wgrad {splits}")
    check_errors(DEV)


def test_unsupported_inputs_are_clear_errors():
    cc = torch.cuda.get_device_capability()
    ms = torch.tensor([64, 64], device=DEV)
    x = torch.randn(128, 256, device=DEV)
    w = torch.randn(2, 128, 256, device=DEV)
    qa, sa = fp8.quantize(x, ms, tiles="1x128")
    qb, sb = fp8.quantize(w, tiles="128x128")
    if cc != (9, 0):
        with pytest.raises(RuntimeError, match="built for sm_90a"):
            fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=128, block_n=128)
        return
    with pytest.raises(RuntimeError, match="write BFloat16"):
        fp8.scaled_grouped_gemm(qa, sa, qb, sb, ms, block_k=128, block_n=128, out_dtype=torch.float32)
    q5, s5 = fp8.quantize(x, ms, tiles="1x128", fp8_dtype=torch.float8_e5m2)
    with pytest.raises(RuntimeError, match="E4M3 operands"):
        fp8.scaled_grouped_gemm(q5, s5, qb, sb, ms, block_k=128, block_n=128)
    qk, sk = fp8.quantize(torch.randn(128, 200, device=DEV), ms, tiles="1x128")
    qbk, sbk = fp8.quantize(torch.randn(2, 128, 200, device=DEV), tiles="128x128")
    with pytest.raises(RuntimeError, match="multiple of 128"):
        fp8.scaled_grouped_gemm(qk, sk, qbk, sbk, ms, block_k=128, block_n=128)
