"""Float64 references of the permute ops (``moe_graph.ops.permute``): plain loops over rows and routes, written
from the definitions, no index tricks shared with the implementations. Also builds the two inverse indices of a
routing for tests."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def expand_rows_reference(src: torch.Tensor, route_of_row: torch.Tensor, K: int,
                          weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[i] = w[r] * src[r // K]`` for ``r = route_of_row[i]``; the sentinel ``n*K``: a zero row. Float64."""
    n, H = src.shape
    s = src.detach().cpu().double()
    w = None if weights is None else weights.detach().cpu().double().reshape(-1)
    routes = [int(v) for v in route_of_row.cpu()]
    out = torch.zeros(len(routes), H, dtype=torch.float64)
    for i, r in enumerate(routes):
        if r == n * K:
            continue
        assert 0 <= r < n * K, f"route {r} out of range"
        out[i] = s[r // K] * (1.0 if w is None else w[r])
    return out


def reduce_rows_reference(src: torch.Tensor, route_rows: torch.Tensor,
                          weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[j] = sum_k w[j, k] * src[route_rows[j, k]]``; the sentinel ``m``: skipped. Float64."""
    m, H = src.shape
    n, K = route_rows.shape
    s = src.detach().cpu().double()
    w = None if weights is None else weights.detach().cpu().double()
    out = torch.zeros(n, H, dtype=torch.float64)
    for j in range(n):
        for k in range(K):
            r = int(route_rows[j, k])
            if r == m:
                continue
            assert 0 <= r < m, f"row {r} out of range"
            out[j] += s[r] * (1.0 if w is None else w[j, k])
    return out


def route_dot_reference(rows: torch.Tensor, src: torch.Tensor, route_rows: torch.Tensor) -> torch.Tensor:
    """``out[j, k] = dot(rows[j], src[route_rows[j, k]])``; the sentinel ``m``: 0. Float64."""
    m = src.shape[0]
    n, K = route_rows.shape
    a = rows.detach().cpu().double()
    b = src.detach().cpu().double()
    out = torch.zeros(n, K, dtype=torch.float64)
    for j in range(n):
        for k in range(K):
            r = int(route_rows[j, k])
            if r != m:
                out[j, k] = float((a[j] * b[r]).sum())
    return out


def random_routing(n: int, K: int, m: int, keep: float = 0.8,
                   generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random routing of ``n`` tokens x ``K`` routes onto ``m`` rows: each route keeps a row with probability
    ``keep`` (while rows are left), rows are assigned in a random order, the rest are padding. Returns
    ``(route_rows [n, K], route_of_row [m])`` int64, inverses of each other (sentinels ``m`` and ``n*K``)."""
    route_rows = torch.full((n, K), m, dtype=torch.int64)
    route_of_row = torch.full((m,), n * K, dtype=torch.int64)
    free = torch.randperm(m, generator=generator).tolist()
    for r in torch.randperm(n * K, generator=generator).tolist():
        if free and float(torch.rand((), generator=generator)) < keep:
            i = free.pop()
            route_rows[r // K, r % K] = i
            route_of_row[i] = r
    return route_rows, route_of_row
