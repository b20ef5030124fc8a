"""Benchmark helpers shared by benchmarks/: device timing and result files (the environment stamp is
:func:`moe_graph.distributed.launch.environment`)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

from moe_graph.distributed.launch import environment, git_commit  # noqa: F401  (re-exported)


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, timed with CUDA events (after ``warmup`` runs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: List[float] = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], warmup: int = 2, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` on the host clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def results_dir() -> str:
    """Where benchmarks write when not given ``--out``: ``$MOE_GRAPH_RESULTS`` or ``./moe_graph_results`` in the
    current directory. Never the package's or the checkout's tree: a benchmark run never modifies tracked files;
    committed results are copied into ``benchmarks/results/`` by hand, with the commit they measured inside."""
    root = os.path.abspath(os.environ.get("MOE_GRAPH_RESULTS") or "moe_graph_results")
    os.makedirs(root, exist_ok=True)
    return root


def results_path(prefix: str, dated: bool = True) -> str:
    """``results_dir()/<prefix>-<gpu or cpu>-<date>.json`` (``<prefix>.json`` with ``dated=False``)."""
    if not dated:
        return os.path.join(results_dir(), f"{prefix}.json")
    dev = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_") if torch.cuda.is_available() else "cpu"
    day = datetime.date.today().isoformat()
    return os.path.join(results_dir(), f"{prefix}-{dev}-{day}.json")


def write_json(path: str, payload: Dict[str, object]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")
