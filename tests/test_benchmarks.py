"""Smoke runs of the benchmarks in tiny configurations (CPU): they run to the end, print their table and write
JSON with the fields the results files are read for. Speed itself is never asserted here."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=300, cwd=ROOT, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "MOE_GRAPH_RESULTS"}
    env.update(PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **(env_extra or {}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout


def test_bench_echo(tmp_path):
    out = tmp_path / "echo.json"
    text = _run("bench_echo.py", "--device", "cpu", "--skews", "1.2", "--ranks", "8", "--experts", "64",
                "--spares", "1", "2", "--seeds", "1", "--tokens", "256", "--reps", "1", "--out", str(out))
    assert "target case" in text and "%copy" in text
    d = json.load(open(out))
    assert len(d["rows"]) == 2 and d["env"]["commit"]
    for r in d["rows"]:
        assert r["maxmean_auto"] <= r["maxmean_before"] and r["reroute_pct_of_copy"] > 0
    assert set(d["target_case"]) >= {"k=1", "k=2"}


def test_bench_optimizer(tmp_path):
    out = tmp_path / "opt.json"
    text = _run("bench_optimizer.py", "--device", "cpu", "--max-params", "1e6", "--iters", "1", "--precisions",
                "bf16+fp32grad", "--dp", "1,8", "--out", str(out))
    assert "distopt" in text
    d = json.load(open(out))
    rows = [r for r in d["rows"] if r["impl"].startswith("distopt")]
    assert rows and d["meta"]["commit"]
    for r in rows:  # bf16 params + fp32 grads: 6 + 12/d bytes per parameter (the seed's table), within padding
        assert abs(r["bytes_per_param"]["8"] - (6 + 12 / 8)) < 0.05, r


def test_bench_pipeline_bubble(tmp_path):
    out = tmp_path / "bubble.json"
    _run("bench_pipeline_bubble.py", "--quick", "--t-fwd-ms", "2", "--t-bwd-ms", "4", "--repeats", "1", "--out",
         str(out))
    d = json.load(open(out))
    assert d["results"] and d["meta"]["commit"]
    for r in d["results"]:
        assert r["step_ms"] >= r["ideal_ms"] * 0.95  # a schedule cannot beat its ideal
        assert 0 < r["ideal_bubble"] < 1


def test_benchmarks_default_output_is_outside_the_tree(tmp_path):
    """Without --out a benchmark writes under ./moe_graph_results of the current directory (or $MOE_GRAPH_RESULTS),
    never into the checkout's tracked benchmarks/results/."""
    tracked = os.path.join(ROOT, "benchmarks", "results")
    before = {f: os.path.getmtime(os.path.join(tracked, f)) for f in os.listdir(tracked)}
    _run("bench_pipeline_bubble.py", "--quick", "--t-fwd-ms", "1", "--t-bwd-ms", "2", "--repeats", "1",
         cwd=str(tmp_path))
    assert json.load(open(tmp_path / "moe_graph_results" / "pipeline_bubble.json"))["results"]
    elsewhere = tmp_path / "elsewhere"
    _run("bench_optimizer.py", "--device", "cpu", "--max-params", "1e5", "--iters", "1", "--precisions", "bf16+fp32grad",
         "--dp", "1",
         cwd=str(tmp_path), env_extra={"MOE_GRAPH_RESULTS": str(elsewhere)})
    assert json.load(open(elsewhere / "bench_optimizer_cpu.json"))
    after = {f: os.path.getmtime(os.path.join(tracked, f)) for f in os.listdir(tracked)}
    assert after == before


def test_bench_moe_layer(tmp_path):
    out = tmp_path / "moe.json"
    text = _run("bench_moe_layer.py", "--device", "cpu", "--sizes", "demo", "--reps", "1", "--out", str(out))
    assert "target" in text
    d = json.load(open(out))
    assert d


def test_bench_grouped_gemm_plot(tmp_path, monkeypatch):
    import importlib.util

    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # as when run as a script: benchmarks/common.py
    spec = importlib.util.spec_from_file_location("bench_grouped_gemm", os.path.join(ROOT, "benchmarks",
                                                                                     "bench_grouped_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [dict(model=m, gemm=g, op="forward", skew="zipf",
                 tflops={"moe_graph": 400.0, "torch._grouped_mm": 350.0, "cublas_loop": None, "dense_matmul": 600.0})
            for m in ("Qwen3-30B-A3B", "Mixtral-8x7B") for g in ("fc1", "fc2")]
    path = tmp_path / "gg.png"
    mod.plot(rows, str(path), device_name="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_grouped_gemm_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the full benchmark runs in benchmarks/run_gpu.sh")
    assert "needs a CUDA device" in _run("bench_grouped_gemm.py", "--quick")
