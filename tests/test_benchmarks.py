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


def test_bench_optimizer_fp8_param_gather(tmp_path):
    out = tmp_path / "fp8pg.json"
    _run("bench_optimizer.py", "--fp8-param-gather", "--out", str(out))
    d = json.load(open(out))
    assert d["rows"] and d["meta"]["commit"]
    for r in d["rows"]:  # FP8 bytes (1 per element) + amax (4 per 128x128 tile) over bf16 (2 per element)
        assert r["bf16_all_gather_bytes"] == 2 * r["params"] and 0.5 <= r["ratio"] <= 0.5002, r


def test_bench_pipeline_bubble_and_default_output_outside_the_tree(tmp_path):
    """The pipeline bubble benchmark's smoke run, without --out: a benchmark writes under ./moe_graph_results of the
    current directory (or $MOE_GRAPH_RESULTS), never into the checkout's tracked benchmarks/results/."""
    tracked = os.path.join(ROOT, "benchmarks", "results")
    before = {f: os.path.getmtime(os.path.join(tracked, f)) for f in os.listdir(tracked)}
    _run("bench_pipeline_bubble.py", "--quick", "--t-fwd-ms", "2", "--t-bwd-ms", "4", "--repeats", "1",
         cwd=str(tmp_path))
    d = json.load(open(tmp_path / "moe_graph_results" / "pipeline_bubble.json"))
    assert d["results"] and d["meta"]["commit"]
    for r in d["results"]:
        assert r["step_ms"] >= r["ideal_ms"] * 0.95  # a schedule cannot beat its ideal
        assert 0 < r["ideal_bubble"] < 1
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


def _load_benchmark(name, monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # as when run as a script: benchmarks/common.py
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_moe_cost_smoke(tmp_path):
    """The smallest configuration (Mixtral-like, 8 experts) with few tokens: every system measured (Megatron's rows
    skipped only with the reason) with the same routing and weights (outputs equal moe_graph's), moe_graph and the
    native MoE free of host syncs (and Megatron's MoELayer on moe_graph's dispatcher), Megatron's all-to-all
    dispatcher with its one."""
    out = tmp_path / "cost.json"
    text = _run("bench_moe_cost.py", "--configs", "mixtral", "--tokens", "64", "--reps", "1", "--out", str(out))
    assert "launches fwd/bwd" in text
    d = json.load(open(out))
    assert d["env"]["commit"]
    rows = {r["system"]: r for r in d["rows"]}
    assert set(rows) == {"megatron_sequential", "megatron_grouped", "megatron_moe_graph", "native", "moe_graph",
                         "moe_graph_fused", "moe_graph_echo", "moe_graph_bf16", "moe_graph_fp8",
                         "moe_graph_fp8_dispatch"}
    fp8_rows = ("moe_graph_fp8", "moe_graph_fp8_dispatch")
    for key, r in rows.items():
        if "skipped" in r:
            assert key.startswith("megatron") and r["skipped"], r
            continue
        assert r["launches_fwd"] > 0 and r["launches_bwd"] > 0 and r["non_gemm_bytes_per_token"] > 0, r
        # FP8 rows against the bf16 layer: the quantization error of both GEMMs, not a different routing
        assert r["saved_bytes_per_token"] > 0 and r["max_abs_diff"] < (0.5 if key in fp8_rows else 1e-4), r
        assert (r["quantize_bytes_per_token"] > 0) == (key in fp8_rows), r
        # Megatron's all-to-all dispatcher: one; moe_graph's dispatcher inside Megatron's MoELayer: none
        assert r["host_syncs"] == (1 if key in ("megatron_sequential", "megatron_grouped") else 0), (key, r["sync_points"])
    # echo adds the plan, the spare-weight dispatch and the gradient aggregation
    assert rows["moe_graph_echo"]["launches_fwd"] > rows["moe_graph"]["launches_fwd"]
    # FP8 dispatch: the same output as the FP8 experts on a 16-bit dispatch, about half the bytes per routed row
    assert rows["moe_graph_fp8_dispatch"]["max_abs_diff"] == rows["moe_graph_fp8"]["max_abs_diff"]
    wire = {k: rows[k]["dispatch_bytes_per_token"] for k in ("moe_graph_bf16", "moe_graph_fp8_dispatch")}
    assert 0.5 < wire["moe_graph_fp8_dispatch"] / wire["moe_graph_bf16"] < 0.53, wire
    # the production-like rows at --tokens: the three precisions at EP 1 and 8, printed with the FP8 breakdown
    prod = d["production"]
    assert prod["tokens"] == [64] and prod["ep"] == [1, 8] and prod["microbatches"] == 8
    assert sorted((r["ep"], r["system"]) for r in prod["rows"]) == sorted(
        (ep, s) for ep in (1, 8) for s in ("moe_graph_bf16", "moe_graph_fp8", "moe_graph_fp8_dispatch"))
    assert "Production-like rows" in text and "differ most from the bf16 row" in text


def test_moe_cost_production_rows(monkeypatch):
    """The production-like rows' accounting on a tiny configuration (8 experts, top-2, EP 1 and 8): the counts
    without GEMM arithmetic equal the real run's; the FP8 quantize column is the sum of the quantize ops in the
    breakdown plus the weight quantization per step over tokens x microbatches, whose bytes follow from the
    weights' shapes alone (blockwise: 2 B read + 1 B written per element, the transposed copy 1 + 1, the fp32 scale
    grid written, read and written again) and are 1/8 at EP 8 (a rank holds 1/8 of the experts, and receives as many
    rows as at EP 1: the balanced routing's T*K); the exchange is counted at EP 8 only and is smaller with FP8
    dispatch."""
    import torch

    from moe_graph.ops.dispatch_layout import aligned_padded_rows

    bench = _load_benchmark("bench_moe_cost", monkeypatch)
    cfg = dict(H=256, F=256, E=8, K=2, T=32, score="softmax")  # 2-D scale grids: their transposes are copies
    T, mb = 32, 4
    rows = {}
    for ep in (1, 8):
        for arithmetic in (False, True):
            for r in bench.production_rows("mixtral", cfg, T, ep, mb, arithmetic=arithmetic):
                rows[(ep, arithmetic, r["system"])] = r
    keys = ("launches_fwd", "launches_bwd", "non_gemm_bytes_per_token", "saved_bytes_per_token", "ops",
            "op_bytes_per_token", "quantize_bytes_per_token", "exchange_bytes_per_token")
    for (ep, arithmetic, system), r in rows.items():
        if not arithmetic:  # GemmStub changes values only, no count
            real = rows[(ep, True, system)]
            assert {k: r[k] for k in keys} == {k: real[k] for k in keys}, (ep, system)
        # the FP8 experts get their groups 16-row aligned straight from the dispatcher (the padded rows)
        rows_in = T * cfg["K"] if system == "moe_graph_bf16" else aligned_padded_rows(T * cfg["K"], cfg["E"] // ep, 16)
        assert r["host_syncs"] == 0 and r["local_experts"] == cfg["E"] // ep and r["expert_input_rows"] == rows_in
        listed = sum(b for k, b in r["op_bytes_per_token"].items()
                     if k.startswith("moe_graph.fp8_quantize") or k == "moe_graph.expand_quantize_pair")
        assert r["quantize_bytes_per_token"] == pytest.approx(listed + r["weight_quantize_bytes_per_token_amortized"],
                                                              rel=1e-12), r
        # the independent figure of the weight quantization: fc1 [L, 2F, H], fc2 [L, H, F] in 128 x 128 tiles
        L = cfg["E"] // ep
        numel = L * 2 * cfg["F"] * cfg["H"] + L * cfg["H"] * cfg["F"]
        tiles = L * (2 * cfg["F"] // 128) * (cfg["H"] // 128) + L * (cfg["H"] // 128) * (cfg["F"] // 128)
        fp8 = system != "moe_graph_bf16"
        assert r["weight_quantize_bytes_per_step"] == ((2 + 1 + 1 + 1) * numel + 3 * 4 * tiles if fp8 else 0), r
        assert r["weight_quantize_bytes_per_token_amortized"] == r["weight_quantize_bytes_per_step"] / (T * mb)
        assert (r["quantize_bytes_per_token"] > 0) == fp8
        assert (r["exchange_bytes_per_token"] > 0) == (ep > 1), r["op_bytes_per_token"]
        assert r["non_gemm_bytes_per_token"] == pytest.approx(
            r["microbatch_non_gemm_bytes_per_token"] + r["weight_quantize_bytes_per_token_amortized"], rel=1e-12)
    for system in bench.PRODUCTION_SYSTEMS:
        assert rows[(1, False, system)]["weight_quantize_bytes_per_step"] == \
            8 * rows[(8, False, system)]["weight_quantize_bytes_per_step"]
    assert rows[(8, False, "moe_graph_fp8_dispatch")]["exchange_bytes_per_token"] < \
        rows[(8, False, "moe_graph_fp8")]["exchange_bytes_per_token"]
    assert not torch.distributed.is_initialized()  # the simulated EP group is gone


def test_cost_meter_counts(monkeypatch):
    """The meter on known ops: views and allocations launch nothing, GEMMs move no counted bytes, reads of device
    values on the host are syncs (reads of host copies are not), saved-tensor counting skips nothing it should."""
    import torch

    bench = _load_benchmark("bench_moe_cost", monkeypatch)
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    meter = bench.CostMeter(device_tensors=[x, w])
    with meter, bench.host_reads(meter):
        y = (x * 2).view(32)  # one launch: 128 B read, 128 B written; the view is free
        torch.empty(3)  # free
        z = x @ w  # GEMM: a launch, no counted bytes
        y.sum().item()  # sum (launch, 128 B + 4 B) and _local_scalar_dense (launch, 4 B read: a sync)
        z.tolist()  # host read of a device value: a sync
        z.cpu()  # a device-to-host copy: a sync
        meter.host_copy(z)  # as Megatron's maybe_move_tensor_to_cpu reports its result (megatron_env.cpu_shims)
        z.tolist()  # a host copy: no sync
    assert meter.launches["fwd"] == 4, meter.ops
    assert meter.bytes["fwd"] == 128 + 128 + 128 + 4 + 4
    assert [s.split(":")[1] for s in meter.syncs] == ["_local_scalar_dense", "Tensor.tolist", "Tensor.cpu"]
    # an in-place indexed write touches the indexed rows of its target only (read + write), not all of it
    acc, src, rows = torch.zeros(100, 8), torch.ones(2, 8), torch.tensor([3, 7])
    meter.bytes["fwd"] = 0
    with meter:
        acc.index_add_(0, rows, src)
    assert meter.bytes["fwd"] == 2 * (2 * 8 * 4) + 2 * 8 + 2 * 8 * 4, meter.bytes
    meter.bytes["fwd"] = 0
    with meter:
        acc.add_(src.sum(0))  # not indexed: the whole target, read and written
    assert meter.bytes["fwd"] == (2 * 8 * 4 + 8 * 4) + (100 * 8 * 4 * 2 + 8 * 4), meter.bytes
    meter.bytes["fwd"] = 0
    with meter:
        acc.new_zeros(3)  # a factory reads nothing of its tensor argument: 12 B written
        torch.zeros_like(src)  # 64 B written
    assert meter.bytes["fwd"] == 3 * 4 + 2 * 8 * 4, meter.bytes
    before = len(meter.syncs)
    with meter, bench.host_reads(meter):
        torch.arange(3, device="cpu").tolist()  # a factory's result counts as a device value
        idx = torch.tensor([2, 0, 1])  # host values (lift_fresh) and values computed from them only
        (idx + 1).tolist()
    assert len(meter.syncs) == before + 1, meter.syncs


def test_bench_exchange_smoke(tmp_path):
    out = tmp_path / "exchange.json"
    text = _run("bench_exchange.py", "--ranks", "8", "--experts", "64", "--tokens", "128", "--steps", "2",
                "--key-steps", "2", "--zipf", "1.2", "--out", str(out))
    assert "rerun@1.1" in text and "dest wire" in text
    d = json.load(open(out))
    assert d["env"]["commit"] and len(d["rows"]) == 2 * 3  # same / varied x echo off, k=1, k=2
    for r in d["rows"]:
        assert r["cf_dest_worst"] <= r["cf_pair_worst"] + 1e-9  # a destination's load is the sum of its pairs
    for m in d["memory"]:  # the variable-size exchange sends the routed rows only
        assert m["dest_wire_MiB"] == m["routed_MiB"] <= m["pair_wire_MiB_at_cf"]


def test_bench_overlap_smoke(tmp_path):
    """The exposed-communication estimate over the recorded schedule: the serial schedule hides nothing (its step is
    compute + exchange), the shared expert beside the exchange hides some, never more than the side work."""
    out = tmp_path / "overlap.json"
    text = _run("bench_overlap.py", "--configs", "deepseek_v3", "--tokens", "512", "--out", str(out))
    assert "assumptions:" in text and "NVLink" in text
    d = json.load(open(out))
    assert d["env"]["commit"] and d["hardware_assumed"]["link_bytes_per_s"] == 450e9
    assert d["executors"] == ["ready_first", "issue_order"]
    rows = {(r["schedule"], r["executor"]): r for r in d["rows"]}
    assert len(rows) == len(d["rows"]) == 12
    for executor in d["executors"]:
        serial, over = rows[("serial", executor)], rows[("overlap_shared_expert", executor)]
        assert serial["step_us"] == pytest.approx(serial["compute_us"] + serial["exchange_us"])
        assert serial["hidden_pct"] == 0.0 and 0.0 < over["hidden_pct"] < 50.0
        assert over["compute_us"] == pytest.approx(serial["compute_us"])
    # issue order lets B(i), issued first, keep the SMs, so F(i+1)'s exchanges end up exposed: it hides less
    mb = [rows[("overlap_microbatches+shared_expert", e)]["hidden_pct"] for e in d["executors"]]
    assert mb[0] > mb[1] > 0.0
    # the stage interleave (interleave_stages) issues each side's exchange right before the other's computation:
    # the two executors then hide about the same, and more than issue order does without it
    st = [rows[("overlap_microbatches+shared_expert+stages", e)]["hidden_pct"] for e in d["executors"]]
    assert abs(st[0] - st[1]) < 5.0 and st[1] > mb[1] + 10.0, (st, mb)


def test_bench_exchange_cost_smoke(tmp_path):
    out = tmp_path / "exchange_cost.json"
    text = _run("bench_exchange_cost.py", "--skip-gloo", "--node-tokens", "64", "--out", str(out))
    assert "design counts" in text and "per (token, node)" in text
    d = json.load(open(out))
    assert d["env"]["commit"]
    s = {(r["backend"], r["direction"]): r for r in d["design"]["DeepSeek-V3-like"]["summary"]}
    for direction in ("dispatch", "combine"):  # the fused path: one launch, no staging copy, the fewest HBM bytes
        assert s[("nvlink", direction)]["launches"] == 1 and s[("nvlink", direction)]["staging_copies"] == 0
        assert s[("nvlink", direction)]["hbm_per_token"] < min(s[(b, direction)]["hbm_per_token"]
                                                              for b in ("symm_mem", "nccl"))
    for c in d["node_aware"].values():  # node-limited routing: fewer rows cross once per (token, node)
        assert 0 < c["per_node_rows_per_token"] < c["per_route_rows_per_token"] <= 8


def test_bench_fused_align_cost_smoke(tmp_path):
    """The fused exchange placing FP8 experts' rows aligned: the experts then get aligned rows and the layer makes
    fewer launches and moves fewer non-GEMM bytes than with the experts' regrouping (16-bit and FP8 dispatch)."""
    out = tmp_path / "fused_align.json"
    _run("bench_fused_align_cost.py", "--tokens", "64", "--out", str(out), timeout=600)
    rows = json.load(open(out))["rows"]
    for disp in ("bf16_dispatch", "fp8_dispatch"):
        old, new = rows[f"{disp}/regroup"], rows[f"{disp}/fused_align"]
        assert new["experts_got_aligned_rows"] and not old["experts_got_aligned_rows"]
        assert new["launches_fwd"] + new["launches_bwd"] < old["launches_fwd"] + old["launches_bwd"]
        assert new["non_gemm_bytes_per_token"] < old["non_gemm_bytes_per_token"]
        assert "moe_graph.aligned_groups" in old["ops"]["fwd"] and "moe_graph.aligned_groups" not in new["ops"]["fwd"]


def test_bench_exchange_gpu_help_and_rows_without_cuda(monkeypatch):
    """The GPU exchange benchmark: ``--help`` runs without CUDA, a run without GPUs stops with a message naming what
    is missing, and its row arithmetic (slowest rank, bytes per rank, FP8 row bytes) on made-up times."""
    assert "--sms" in _run("bench_exchange_gpu.py", "--help")
    env = {k: v for k, v in os.environ.items() if k != "MOE_GRAPH_RESULTS"}
    env.update(PYTHONPATH=os.path.join(ROOT, "python"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_exchange_gpu.py")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "needs CUDA" in p.stderr
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_exchange_gpu as b

    assert b.row_bytes("fp8", 7168) == 7168 + 4 * 56 and b.row_bytes("bf16", 7168) == 14336
    assert b.experts_for(8) == 256 and b.experts_for(4) == 128 and b.experts_for(1) == 32
    cfg = {"tokens": 4, "topk": 2, "hidden": 128}
    per_rank = [{"times": {("nccl", "dispatch", "bf16"): us}, "remote_routes": rem} for us, rem in ((2.0, 6), (4.0, 2))]
    (row,) = b.summarize(per_rank, cfg)
    assert row["us"] == 4.0 and row["bytes"] == 8 * 256 and row["link_bytes"] == 4 * 256
    assert row["GBps"] == pytest.approx(8 * 256 / 4e3) and row["link_GBps"] == pytest.approx(4 * 256 / 4e3)
