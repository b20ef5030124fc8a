"""``benchmarks/bench_overlap_gpu.py`` on the CPU (the code path the GPU run takes, with a tiny shape, eager steps and
a trace without kernels), and its trace analysis on synthetic kernel traces against a brute-force oracle.

Oracles: the serial schedule's losses (the other schedules issue the same arithmetic in the same order), the
mean of the microbatches' losses computed by a plain forward of the same block (the first step's loss, before any
update), and, for the trace analysis, a per-time-cell count of which streams run a kernel."""

import json
import random

import pytest
import torch

from test_benchmarks import _load_benchmark, _run

SCHEDULES = {"serial", "overlap_shared_expert", "overlap_microbatches", "both", "both+interleave_stages"}


def test_cpu_path_end_to_end(tmp_path, monkeypatch):
    out = tmp_path / "overlap_gpu.json"
    text = _run("bench_overlap_gpu.py", "--device", "cpu", "--steps", "3", "--trace-steps", "1", "--out", str(out),
                timeout=120)
    assert "EP 1: there is no inter-GPU exchange" in text
    d = json.load(open(out))
    assert d["env"]["commit"] and d["ep"] == 1 and d["device"] == "cpu" and "EP 1" in d["assumptions"]
    assert d["shape"]["microbatches"] == 2 and d["exchange_kernel_patterns"]
    rows = {r["schedule"]: r for r in d["rows"]}
    assert set(rows) == SCHEDULES and not any("error" in r for r in rows.values())
    serial = rows["serial"]["losses"]
    assert len(serial) == 3 and serial[-1] < serial[0]  # it trains
    for name, r in rows.items():
        assert r["captured"] is False and r["step_ms"] is None and r["trace_file"] is None
        assert r["trace"]["kernels_per_step"] == 0 and r["trace"]["exchange_hidden_pct"] is None  # no kernels on CPU
        assert r["loss_max_rel_diff_vs_serial"] <= 1e-6, name
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(serial), rtol=1e-6, atol=0)
    assert not list(tmp_path.glob("*trace*"))  # the CPU trace is removed

    # the first step's loss is the mean of the microbatch losses of the initial block (a plain forward, no schedule)
    mod = _load_benchmark("bench_overlap_gpu", monkeypatch)
    block = mod.Block(mod.CPU_SHAPE, False, "cpu", torch.float32)
    with torch.no_grad():
        ref = torch.stack([block(x, t) for x, t in mod.microbatches(mod.CPU_SHAPE, "cpu", torch.float32)]).mean()
    assert serial[0] == pytest.approx(float(ref), rel=1e-6)


def _cells(kernels, patterns, step=0.5):
    """Brute force on a grid of half units (the intervals have integer ends): per cell midpoint, which streams run
    a kernel and which run an exchange kernel."""
    end = max(k["end"] for k in kernels)
    busy = concurrent = exch = exposed = 0.0
    t = step / 2
    while t < end:
        on = {k["stream"] for k in kernels if k["start"] <= t < k["end"]}
        ex = {k["stream"] for k in kernels if k["start"] <= t < k["end"] and any(p in k["name"] for p in patterns)}
        busy += step * bool(on)
        concurrent += step * (len(on) >= 2)
        exch += step * bool(ex)
        exposed += step * sum(1 for s in ex if not (on - {s}))  # an exchange stream with no other stream running
        t += step
    return busy, concurrent, exch, exposed


@pytest.mark.parametrize("seed", range(6))
def test_trace_analysis_against_cells(seed, monkeypatch):
    mod = _load_benchmark("bench_overlap_gpu", monkeypatch)
    rnd = random.Random(seed)
    kernels = []
    for stream in (7, 20, 21):
        for _ in range(rnd.randint(1, 12)):
            a = rnd.randint(0, 60)
            name = rnd.choice(["void moe_graph::permute::(anonymous namespace)::rows_kernel<0, bf16, 8>",
                               "void moe_graph::dispatch::(anonymous namespace)::place_kernel", "sm90_xmma_gemm",
                               "elementwise_kernel"])
            kernels.append({"name": name, "stream": stream, "start": float(a), "end": float(a + rnd.randint(1, 9))})
    steps = rnd.randint(1, 3)
    r = mod.analyse({"kernel": kernels, "gpu_memcpy": [], "gpu_memset": []}, steps)
    busy, concurrent, exch, exposed = _cells(kernels, mod.EXCHANGE_KERNELS)
    assert r["gpu_busy_us"] == pytest.approx(busy / steps)
    assert r["concurrent_us"] == pytest.approx(concurrent / steps)
    assert r["exchange_busy_us"] == pytest.approx(exch / steps)
    assert r["exchange_exposed_us"] == pytest.approx(exposed / steps)
    assert r["kernels_per_step"] == pytest.approx(len(kernels) / steps)
    assert sum(r["exchange_kernel_names"].values()) == sum(
        any(p in k["name"] for p in mod.EXCHANGE_KERNELS) for k in kernels)


def test_exposed_exchange_cases(monkeypatch):
    """Hand-made cases: an exchange kernel alone is all exposed, one under another stream's kernel is hidden, one
    under a kernel of its own stream only (serial) is still exposed; touching intervals do not overlap."""
    mod = _load_benchmark("bench_overlap_gpu", monkeypatch)
    ex = "void moe_graph::permute::(anonymous namespace)::rows_kernel<1, float, 4>"

    def k(name, stream, a, b):
        return {"name": name, "stream": stream, "start": a, "end": b}

    def run(*ks):
        return mod.analyse({"kernel": list(ks), "gpu_memcpy": [], "gpu_memset": []}, 1)

    r = run(k(ex, 1, 0, 10), k("gemm", 1, 10, 30))
    assert (r["exchange_busy_us"], r["exchange_exposed_us"], r["concurrent_us"]) == (10, 10, 0)
    r = run(k(ex, 1, 0, 10), k("gemm", 2, 0, 30))  # the side stream's GEMM covers the exchange
    assert (r["exchange_exposed_us"], r["exchange_hidden_pct"], r["concurrent_us"], r["gpu_busy_us"]) == (0, 100, 10,
                                                                                                          30)
    r = run(k(ex, 1, 0, 10), k("gemm", 2, 4, 8), k("gemm", 2, 10, 12))  # covered 4 of 10; touching at 10
    assert (r["exchange_exposed_us"], r["concurrent_us"], r["exchange_hidden_pct"]) == (6, 4, 40)
    assert set(r["streams"]) == {"1", "2"} and r["streams"]["2"]["busy_us"] == 6


def test_read_trace_kineto_format(tmp_path, monkeypatch):
    """The fields of a kernel event in torch.profiler's Chrome trace as an H200 with torch 2.11 wrote them (a
    two-stream CUDA graph replayed under the profiler, the profiler started after the capture)."""
    mod = _load_benchmark("bench_overlap_gpu", monkeypatch)
    events = [
        {"ph": "X", "cat": "kernel", "name": "sm80_xmma_gemm_f32f32", "pid": 0, "tid": 7, "ts": 5036192321656.685,
         "dur": 2682.281, "args": {"queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "void moe_graph::permute::rows_kernel", "pid": 0, "tid": 143,
         "ts": 5036192322000.0, "dur": 100.0, "args": {"stream": 143}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "pid": 0, "tid": 7, "ts": 5036192320000.0,
         "dur": 5.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": 1.0, "dur": 3.0},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 7, "ts": 2.0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = mod.read_trace(str(path))
    assert [(e["stream"], e["name"][:12]) for e in t["kernel"]] == [(7, "sm80_xmma_ge"), (143, "void moe_gra")]
    assert t["kernel"][0]["end"] - t["kernel"][0]["start"] == pytest.approx(2682.281)
    assert len(t["gpu_memcpy"]) == 1 and t["gpu_memset"] == []
    r = mod.analyse(t, 1)
    assert r["exchange_busy_us"] == pytest.approx(100.0) and r["exchange_exposed_us"] == pytest.approx(0.0)
    assert r["memcpy_us"] == pytest.approx(5.0)
