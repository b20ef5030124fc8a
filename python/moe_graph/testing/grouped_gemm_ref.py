"""Independent float64 references for the grouped GEMM ops and random test data (shared by tests/benchmarks).

Written without the op's code path: plain per-expert loops in float64 with the documented clamping rule.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def spans(m_splits: Sequence[int], rows: int):
    """Clamped (start, count) per expert; negative counts count as 0."""
    out, begin = [], 0
    for m in m_splits:
        m = max(int(m), 0)
        start, end = min(begin, rows), min(begin + m, rows)
        out.append((start, end - start))
        begin += m
    return out


def ref_grouped_gemm(a, ws, m_splits, trans_b=True, bias=None, out_dtype=None):
    """float64 reference of grouped_gemm; ws: [E, ., .] tensor or list. Returns float64 [M, N]."""
    ws = list(ws.unbind(0)) if isinstance(ws, torch.Tensor) else list(ws)
    n = ws[0].shape[0] if trans_b else ws[0].shape[1]
    y = torch.zeros(a.shape[0], n, dtype=torch.float64)
    for e, (s, c) in enumerate(spans(m_splits, a.shape[0])):
        if c == 0:
            continue
        w = ws[e].double()
        y[s : s + c] = a[s : s + c].double().cpu() @ (w.t() if trans_b else w).cpu()
        if bias is not None:
            y[s : s + c] += bias[e].double().cpu()
    return y


def ref_wgrad(a, dy, m_splits, out_init: Optional[torch.Tensor] = None, accumulate=None):
    """float64 reference of grouped_gemm_wgrad -> [E, N, K]; accumulate: None/bool/list of bools."""
    E = len(m_splits)
    res = torch.zeros(E, dy.shape[1], a.shape[1], dtype=torch.float64)
    for e, (s, c) in enumerate(spans(m_splits, a.shape[0])):
        if c:
            res[e] = dy[s : s + c].double().cpu().t() @ a[s : s + c].double().cpu()
        acc = accumulate[e] if isinstance(accumulate, (list, tuple)) else bool(accumulate)
        if acc and out_init is not None:
            res[e] += out_init[e].double().cpu()
    return res


def random_splits(num_experts: int, total: int, generator: torch.Generator, zipf: float = 0.0) -> List[int]:
    """Random split of `total` rows over experts (uniform multinomial, or Zipf-skewed with exponent `zipf`)."""
    if zipf > 0:
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        p = ranks.pow(-zipf)
        p = p[torch.randperm(num_experts, generator=generator)]
    else:
        p = torch.ones(num_experts, dtype=torch.float64)
    idx = torch.multinomial(p / p.sum(), total, replacement=True, generator=generator)
    return torch.bincount(idx, minlength=num_experts).tolist()


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double().cpu()
    ref = ref.double().cpu()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)
