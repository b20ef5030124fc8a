"""``python -m moe_graph.selfcheck``: quick correctness check of the grouped GEMM on this machine.

CPU: forward/dgrad/wgrad/bias against float64 references on random data (zero-token experts, capacity rows,
overflow flag). CUDA (when present and built): the same against the CPU reference, no host syncs under
``torch.cuda.set_sync_debug_mode("error")``, and a GroupedLinear forward+backward captured in a CUDA graph and
replayed with new ``m_splits``. Prints one line per check; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time


def parser() -> argparse.ArgumentParser:
    """The flags (no torch: ``python -m moe_graph.selfcheck`` refuses a bad one before the heavy imports)."""
    p = argparse.ArgumentParser(prog="python -m moe_graph.selfcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; printed)")
    return p


if __name__ == "__main__":  # a bad flag is refused (exit 2) before torch is imported
    parser().parse_args()

import torch  # noqa: E402

from moe_graph.grouped_linear import GroupedLinear
from moe_graph.ops import check_errors, grouped_bias_grad, grouped_gemm, grouped_gemm_wgrad, read_error_flag
from moe_graph.ops._lib import cuda_built
from moe_graph.testing.grouped_gemm_ref import random_splits, ref_grouped_gemm, ref_wgrad, rel_err, spans


def _check(name, fn, results):
    t0 = time.perf_counter()
    try:
        detail = fn()
        ok = True
    except Exception as e:  # noqa: BLE001 - reported
        detail, ok = f"{type(e).__name__}: {e}", False
    results.append(ok)
    print(f"  [{'ok' if ok else 'FAIL'}] {name:<48} {time.perf_counter() - t0:6.2f}s  {detail or ''}")


def _forward_case(device, dtype, E, K, N, T, zipf, trans_b, g):
    splits = random_splits(E, T, g, zipf=zipf)
    splits[0] = 0
    M = T + 17
    a = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(*((E, N, K) if trans_b else (E, K, N)), generator=g) / K**0.5).to(dtype)
    bias = torch.randn(E, N, generator=g).to(dtype)
    y = grouped_gemm(a.to(device), w.to(device), torch.tensor(splits, device=device), trans_b=trans_b, bias=bias.to(device))
    err = rel_err(y, ref_grouped_gemm(a, w, splits, trans_b, bias=bias))
    assert err < 1e-2, f"relative error {err:.2e}"
    assert bool((y[T:] == 0).all()), "capacity rows not zero"
    return f"rel err {err:.1e}"


def _wgrad_case(device, g, overwrite=False):
    """Into an fp32 main_grad with a per-expert accumulate mask, or (overwrite) with accumulate=False into a
    main_grad full of NaN, which the overwrite kernel must never read."""
    E, K, N = 6, 64, 48
    splits = random_splits(E, 300, g)
    splits[3] = 0
    a = torch.randn(320, K, generator=g).bfloat16()
    dy = torch.randn(320, N, generator=g).bfloat16()
    init = torch.full((E, N, K), float("nan")) if overwrite else torch.randn(E, N, K, generator=g)
    mask = [False] * E if overwrite else [bool(x) for x in torch.randint(0, 2, (E,), generator=g)]
    out = init.to(device, copy=True)
    grouped_gemm_wgrad(a.to(device), dy.to(device), torch.tensor(splits, device=device), out=out,
                       accumulate=False if overwrite else torch.tensor(mask, device=device))
    err = rel_err(out, ref_wgrad(a, dy, splits, out_init=init, accumulate=mask))
    assert err < 5e-3, f"relative error {err:.2e}"
    return f"rel err {err:.1e}"


def _k_zero_case(device, g):
    """K = 0: each expert's rows are its bias, rows past the sum zero (no GEMM may run)."""
    splits = [3, 0, 5]
    bias = torch.randn(3, 16, generator=g).bfloat16()
    a = torch.empty(10, 0, dtype=torch.bfloat16)
    w = torch.empty(3, 16, 0, dtype=torch.bfloat16)
    out = torch.full((10, 16), float("nan"), device=device).bfloat16()
    grouped_gemm(a.to(device), w.to(device), torch.tensor(splits, device=device), bias=bias.to(device), out=out)
    assert torch.equal(out.cpu(), ref_grouped_gemm(a, w, splits, bias=bias).bfloat16()), "K = 0 result wrong"
    return "bias rows, zero tail"


def _bias_grad_case(device, g):
    E, N, M = 9, 40, 260
    splits = random_splits(E, 240, g, zipf=1.2)
    splits[1] = 0
    dy = torch.randn(M, N, generator=g).bfloat16()
    db = grouped_bias_grad(dy.to(device), torch.tensor(splits, device=device))
    ref = torch.stack([dy[s : s + c].double().sum(0) for s, c in spans(splits, M)])
    err = rel_err(db, ref)
    assert err < 1e-5, f"relative error {err:.2e}"
    return f"rel err {err:.1e}"


def _overflow_case(device):
    read_error_flag(device)
    a = torch.randn(16, 16, device=device).bfloat16()
    w = torch.randn(2, 16, 16, device=device).bfloat16()
    grouped_gemm(a, w, torch.tensor([10, 10], device=device))
    try:
        check_errors(device)
    except RuntimeError as e:
        return f"raised: {str(e)[:50]}..."
    raise AssertionError("overflow was not flagged")


def _graph_case(g):
    dev = "cuda"
    layer = GroupedLinear(8, 256, 256, device=dev, params_dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(random_splits(8, 1000, g), device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, splits).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x, splits)
        y.sum().backward()
    gx = x.grad
    worst = 0.0
    for _ in range(3):
        splits.copy_(torch.tensor(random_splits(8, 900, g, zipf=1.2), device=dev))
        graph.replay()
        y_ref = layer(x.detach(), splits)
        worst = max(worst, rel_err(y, y_ref))
    assert worst == 0.0, f"replay differs from eager: {worst:.2e}"
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, splits).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    del gx
    return "replay == eager on 3 new m_splits; no syncs"


def main(argv=None) -> int:
    seed = parser().parse_args(argv).seed
    seed = int(time.time()) if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    results: list = []
    print(f"moe_graph self-check (torch {torch.__version__}, seed {seed}: rerun with --seed {seed})")
    print("CPU:")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for trans_b in (True, False):
            _check(f"forward {str(dtype)[6:]} trans_b={trans_b}", lambda: _forward_case("cpu", dtype, 12, 40, 24, 200, 1.1, trans_b, g), results)
    _check("wgrad fp32 main_grad, per-expert mask", lambda: _wgrad_case("cpu", g), results)
    _check("wgrad fp32 main_grad, overwrite", lambda: _wgrad_case("cpu", g, overwrite=True), results)
    _check("forward K = 0 with bias", lambda: _k_zero_case("cpu", g), results)
    _check("bias grad", lambda: _bias_grad_case("cpu", g), results)
    _check("overflow flag", lambda: _overflow_case("cpu"), results)
    if torch.cuda.is_available() and cuda_built():
        print(f"CUDA ({torch.cuda.get_device_name()}):")
        for dtype in (torch.bfloat16, torch.float16):
            for trans_b in (True, False):
                _check(f"forward {str(dtype)[6:]} trans_b={trans_b} E=128", lambda: _forward_case("cuda", dtype, 128, 512, 256, 8192, 1.2, trans_b, g), results)
        _check("forward bf16 E=1024", lambda: _forward_case("cuda", torch.bfloat16, 1024, 128, 128, 16384, 0.0, True, g), results)
        _check("wgrad fp32 main_grad, per-expert mask", lambda: _wgrad_case("cuda", g), results)
        _check("wgrad fp32 main_grad, overwrite", lambda: _wgrad_case("cuda", g, overwrite=True), results)
        _check("forward K = 0 with bias", lambda: _k_zero_case("cuda", g), results)
        _check("bias grad", lambda: _bias_grad_case("cuda", g), results)
        _check("overflow flag", lambda: _overflow_case("cuda"), results)
        _check("CUDA graph capture/replay + sync-free", lambda: _graph_case(g), results)
    elif torch.cuda.is_available():
        print("CUDA: device present but moe_graph._C was built without CUDA kernels")
    else:
        print("CUDA: no device (CUDA checks skipped)")
    n_ok = sum(results)
    print(f"{n_ok} passed, {len(results) - n_ok} failed")
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
