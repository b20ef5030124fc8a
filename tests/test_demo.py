"""The end-to-end demo in its quick mode (2 gloo processes on CPU): it finishes, the loss clearly decreases, echo
balances the per-rank load, and it writes the summary and the PNG plot."""

import json
import os
import subprocess
import sys
import time

import torch

from conftest import requires_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


COMMITTED = os.path.join(ROOT, "benchmarks", "results", "demo", "demo_summary.json")


def _run_demo(tmp_path, device, *extra):
    """The demo from ``tmp_path`` with the default output folder (``./moe_graph_demo``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    committed = os.stat(COMMITTED).st_mtime_ns if os.path.exists(COMMITTED) else None
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moe_graph.demo", "--quick", "--device", device, *extra], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for text in ("loss", "tok/s", "before", "echo", "step time", "demo.png"):
        assert text in out, f"{text!r} missing from the demo output:\n{out[-2000:]}"
    out_dir = tmp_path / "moe_graph_demo"
    assert f"output folder: {out_dir}" in out  # printed at the end
    # the package's committed results are never the default output
    assert committed is None or os.stat(COMMITTED).st_mtime_ns == committed
    s = json.load(open(out_dir / "demo_summary.json"))
    assert s["finished"] is True and s["status"] == "finished"
    assert not [f for f in os.listdir(out_dir) if ".tmp" in f]  # written atomically
    return s, wall


def test_demo_quick(tmp_path):
    # the CI configuration on every machine: 2 gloo processes on the CPU, fp32
    s, wall = _run_demo(tmp_path, "cpu")
    assert s["world"] == 2
    assert "commit" in s["env"] and "torch" in s["env"]
    assert s["final_loss"] < s["first_loss"] - 1.0, (s["first_loss"], s["final_loss"])  # clearly learns
    losses = s["history"]["loss"]
    assert max(losses[-3:]) < min(losses[:3]) - 0.5  # not a lucky last batch
    for before, after in zip(s["load_before"], s["load_after"]):
        assert sum(before) == sum(after)  # echo moves tokens, it does not lose any
        assert max(after) <= max(before)
    with open(tmp_path / "moe_graph_demo" / "demo.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert wall < 120, f"quick demo took {wall:.0f} s"


def test_demo_quick_deepseek_router(tmp_path):
    # sigmoid scores, group-limited top-k and the auxiliary-loss-free expert bias, updated inside the train step
    s, _ = _run_demo(tmp_path, "cpu", "--router", "deepseek", "--steps", "40")
    assert s["config"]["router"] == "deepseek"
    assert s["final_loss"] < s["first_loss"] - 0.5, (s["first_loss"], s["final_loss"])
    (bias,) = s["expert_bias"]  # one MoE layer in quick mode; 40 updates of +-1e-3 each
    assert len(bias) == 8 and 0 < max(abs(b) for b in bias) <= 40 * 1e-3 + 1e-6
    assert min(bias) < 0 < max(bias)  # pushed both ways: popular experts down, idle ones up


def test_corpus_and_png_fallback(tmp_path):
    from moe_graph.demo.data import build_corpus
    from moe_graph.demo.report import png_fallback

    a, b = build_corpus(50, seed=1), build_corpus(50, seed=1)
    assert a == b and a.count("\n") == 50 and a != build_corpus(50, seed=2)
    summary = {"history": {"step": [1, 2, 3], "loss": [3.0, 2.0, 1.5], "imb_before": [1.2, 1.3, 1.1],
                           "imb_after": [1.0, 1.0, 1.0]}}
    png_fallback(summary, str(tmp_path / "p.png"), width=64, height=48)
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"IHDR" in data and data.endswith(b"IEND\xaeB`\x82")


def test_demo_step_has_no_data_dependent_ops():
    """CPU proxy for the GPU's "zero host syncs per iteration": the demo's whole training step (DDP buffers, MoE
    layers with echo, distributed optimizer) runs under FakeTensorMode, where any .item()/nonzero()/mask indexing
    or data-dependent shape raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_graph.demo.cli import parser
    from moe_graph.demo.model import MoETransformerLM
    from moe_graph.distributed.ddp import DistributedDataParallel
    from moe_graph.distributed.optimizer import DistributedOptimizer
    from moe_graph.train.step import make_train_step

    cfg = parser().parse_args(["--layers", "1", "--batch", "2"])
    moe = dict(aux_loss_coeff=0.01, num_spare_experts_per_ep_rank=1, capacity_factor=1.25, assignment="greedy")
    model = MoETransformerLM(cfg, 37, moe, "cpu", torch.float32)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    step = make_train_step(ddp, opt)  # the demo's step

    def batch():
        return [(torch.randint(0, 37, (2, 64)), torch.randint(0, 37, (2, 64))) for _ in range(2)]

    res = step(batch())  # real step first (lazy state)
    assert torch.isfinite(res.loss) and torch.isfinite(res.grad_norm) and not res.skipped
    with FakeTensorMode(allow_non_fake_inputs=True):
        res = step(batch())
        assert res.loss.shape == () and res.grad_norm.numel() == 1


@requires_cuda
def test_demo_quick_cuda(tmp_path):
    # one process per GPU (NCCL), bf16, the full-iteration CUDA graph: it runs and learns
    s, _ = _run_demo(tmp_path, "cuda")
    assert s["world"] == torch.cuda.device_count()
    assert s["final_loss"] < s["first_loss"] - 0.5, (s["first_loss"], s["final_loss"])


# ------------------------------------------------------------------------------------------ CLI validation --
import pytest  # noqa: E402


@pytest.mark.parametrize("argv, flag", [
    (["--ep", "0"], "--ep"), (["--ep", "-1"], "--ep"), (["--steps", "-5"], "--steps"), (["--steps", "0"], "--steps"),
    (["--batch", "0"], "--batch"), (["--layers", "0"], "--layers"), (["--microbatches", "0"], "--microbatches"),
    (["--heads", "3"], "--heads"), (["--hidden", "0"], "--hidden"), (["--log-every", "0"], "--log-every"),
    (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"), (["--lr", "0"], "--lr"), (["--capacity", "-1"], "--capacity"),
    (["--spare", "-1"], "--spare"), (["--topk", "9"], "--topk"), (["--pp", "0"], "--pp"), (["--vpp", "0"], "--vpp"),
    (["--pp", "1", "--vpp", "2"], "--vpp"), (["--ep", "3"], "--experts"), (["--dp", "4", "--ep", "3"], "--ep"),
    (["--pp", "2", "--layers", "3"], "--layers"), (["--pp", "2", "--vpp", "2", "--layers", "4", "--microbatches", "3"],
                                                   "--microbatches"),
    (["--save-every", "2"], "--save-every"), (["--load", "/nonexistent/ckpt"], "--load"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--ep", "x"], "--"),
])
def test_demo_flags_rejected_before_anything_is_written(argv, flag, tmp_path, capsys):
    from moe_graph.demo.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--out", str(out), *argv] if "--device" not in argv else ["--out", str(out), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert not out.exists()  # validated before the output folder is created


def test_demo_quick_keeps_explicit_flags_and_defaults():
    from moe_graph.demo.cli import parser, resolve_args

    p = parser()
    args = p.parse_args(["--quick", "--device", "cpu", "--batch", "4", "--layers", "3", "--steps", "7"])
    layout = resolve_args(p, args, None)
    assert (args.batch, args.layers, args.steps, args.microbatches) == (4, 3, 7, 1)  # quick fills only the rest
    assert (layout.world, layout.pp, layout.dp, layout.ep) == (2, 1, 2, 2)
    args = p.parse_args(["--device", "cpu", "--pp", "2", "--ep", "1", "--dp", "2", "--layers", "2"])
    layout = resolve_args(p, args, {"rank": 0, "world": 4, "local_rank": 0})  # under torchrun: world from the env
    assert (layout.world, layout.pp, layout.dp, layout.ep, layout.edp) == (4, 2, 2, 1, 2)
    assert args.out.endswith("moe_graph_demo") and os.path.isabs(args.out)  # default: under the current directory


def test_torchrun_env_detection():
    from moe_graph.distributed.launch import torchrun_env

    assert torchrun_env({}) is None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert torchrun_env(env) == {"rank": 3, "world": 4, "local_rank": 1}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"})


@pytest.mark.parametrize("argv, flag", [(["--pp", "0", "-m", "4"], "--pp"), (["--pp", "2", "-m", "0"], "-m"),
                                        (["--pp", "1", "--vpp", "2", "-m", "4"], "--vpp"),
                                        (["--pp", "2", "--group", "0", "-m", "4"], "--group")])
def test_pipeline_cli_rejects_bad_sizes(argv, flag, capsys):
    from moe_graph.train.schedules import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


# ------------------------------------------------------------------------- launch, checkpoint and resume --
def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, name, *extra, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "moe_graph.demo", "--device", "cpu", "--pp", "2", "--ep", "2",
           "--layers", "2", "--hidden", "32", "--heads", "2", "--ffn", "48", "--seq", "32", "--batch", "4",
           "--microbatches", "2", "--steps", "6", "--log-every", "1", "--out", str(tmp_path / name), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, time.perf_counter() - t0


def test_torchrun_pp2_ep2_save_and_exact_resume(tmp_path):
    """torchrun --nproc-per-node 4 with pp=2 x ep=2 (1F1B, echo, DDP, ZeRO-1): a run saving at steps 3 and 6, then a
    run resumed from step 3 whose losses and grad norms for steps 4-6 equal the uninterrupted run's bit for bit."""
    ck = tmp_path / "ck"
    out, wall = _torchrun(tmp_path, "full", "--save", str(ck), "--save-every", "3")
    assert "pp 2 x dp 2 (ep 2 x expert-dp 1) = 4 ranks on cpu (gloo)" in out, out
    print(f"torchrun 4 ranks, 6 steps + 2 saves: {wall:.1f} s")
    full = _metrics(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6]["loss"] < full[1]["loss"]
    assert (ck / "latest").read_text().strip() == "step_00000006"
    meta = json.loads((ck / "step_00000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["layout"]["pp"] == 2 and meta["layout"]["ep"] == 2
    assert sorted(os.listdir(ck / "step_00000003")) == ["meta.json"] + [
        f"{k}_rank{r:05d}.pt" for k in ("optim", "state") for r in range(4)]
    summary = json.loads((tmp_path / "full" / "demo_summary.json").read_text())
    assert summary["finished"] is True and summary["layout"]["world"] == 4

    out, _ = _torchrun(tmp_path, "resumed", "--load", str(ck / "step_00000003"))
    assert "resumed from" in out and "RNG restored" in out
    res = _metrics(tmp_path / "resumed")
    assert sorted(res) == [4, 5, 6]
    for s in (4, 5, 6):
        assert (res[s]["loss"], res[s]["grad_norm"]) == (full[s]["loss"], full[s]["grad_norm"]), s


def test_killed_save_leaves_previous_checkpoint_and_resume_at_other_dp(tmp_path):
    """A rank SIGKILLed in the middle of the step-4 save: the run fails at once (no rank left waiting), 'latest'
    still names step 2, which loads; resumed at data-parallel size 1 (the optimizer reshards 2 -> 1) with the same
    global batch, steps 3-4 reproduce the 2-rank run's losses (fp32; only the reduction order differs)."""
    from moe_graph.train.checkpoint import FAULT_ENV, resolve_checkpoint

    ck, out1 = tmp_path / "ck", tmp_path / "run1"
    base = [sys.executable, "-m", "moe_graph.demo", "--device", "cpu", "--ep", "1", "--layers", "1", "--hidden", "32",
            "--heads", "2", "--ffn", "48", "--seq", "32", "--batch", "4", "--steps", "4", "--log-every", "1",
            "--no-graph"]
    env = _env()
    env[FAULT_ENV] = "1:4"
    t0 = time.perf_counter()
    proc = subprocess.run(base + ["--dp", "2", "--microbatches", "1", "--out", str(out1), "--save", str(ck),
                                  "--save-every", "2"], env=env, capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - t0
    assert proc.returncode != 0 and "rank 1 exited with code -9 (signal 9)" in proc.stderr, proc.stderr[-3000:]
    assert wall < 120
    assert (ck / "latest").read_text().strip() == "step_00000002"
    assert resolve_checkpoint(str(ck)).endswith("step_00000002")
    assert not (ck / "step_00000004").exists() and (ck / ".step_00000004.partial").exists()
    summary = json.loads((out1 / "demo_summary.json").read_text())
    assert summary["finished"] is False and summary["status"] == "failed"
    ref = _metrics(out1)
    assert sorted(ref) == [1, 2, 3, 4]

    out2 = tmp_path / "run2"
    t0 = time.perf_counter()
    proc = subprocess.run(base + ["--dp", "1", "--microbatches", "2", "--out", str(out2), "--load", str(ck)],
                          env=_env(), capture_output=True, text=True, timeout=240)
    print(f"load + 2 steps on 1 rank: {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at step 2" in proc.stdout and "RNG fresh" in proc.stdout, proc.stdout
    res = _metrics(out2)
    assert sorted(res) == [3, 4]
    # step 3 runs the loaded model: only summation order differs; step 4 also used the resharded Adam moments
    # (Adam amplifies rounding in tiny gradients; wrong or missing moments change the loss by > 1e-2)
    for s, tol in ((3, 1e-5), (4, 1e-4)):
        assert abs(res[s]["loss"] - ref[s]["loss"]) <= tol * abs(ref[s]["loss"]), (s, res[s], ref[s])
        assert abs(res[s]["grad_norm"] - ref[s]["grad_norm"]) <= 10 * tol * ref[s]["grad_norm"], (s, res[s], ref[s])
    # a corrupted tensor is refused (checksum) before anything is copied
    from moe_graph.train.checkpoint import read_meta, read_model_state, tensor_crc32

    folder = resolve_checkpoint(str(ck))
    f = ck / "step_00000002" / "state_rank00000.pt"
    st = torch.load(f, weights_only=True)
    name = next(iter(st["model"]))
    assert st["crc32"][name] == tensor_crc32(st["model"][name])
    st["model"][name].view(-1)[0] += 1.0
    torch.save(st, f)
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_model_state(folder, read_meta(folder))


def test_sigint_to_the_parent_stops_the_workers(tmp_path):
    import signal

    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "moe_graph.demo", "--device", "cpu", "--layers", "1", "--steps",
                             "100000", "--log-every", "1", "--no-graph", "--out", str(out)], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the demo did not start training"
            time.sleep(0.2)
        workers = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline") as f:
                    cmd = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == proc.pid and "spawn_main" in cmd:
                workers.append(int(pid))
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [w for w in alive if os.path.exists(f"/proc/{w}") and
                 open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.1)
    assert not alive, f"workers {alive} still running after SIGINT to the parent"
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["finished"] is False and summary["status"] == "interrupted"


def test_whole_model_names_of_a_pipeline_stage_on_an_expert_rank():
    """One naming rule for checkpoints and layout comparisons: blocks by global layer, experts one entry per global
    expert, persistent buffers included, per-step buffers not; the entries are views of the module's tensors."""
    from torch import nn

    from moe_graph.train.checkpoint import copy_plan, global_tensors, is_expert_name

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(6.0).view(2, 3))
            self.experts = nn.Parameter(torch.arange(8.0).view(2, 4))  # 2 local experts
            self.experts.allreduce = False
            self.register_buffer("bias", torch.zeros(3))
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    stage = nn.Module()
    stage.layer_ids = [3, 5]
    stage.blocks = nn.ModuleList([Blk(), Blk()])
    stage.head = nn.Linear(2, 2, bias=False)
    names = global_tensors(stage, ep_rank=1)
    assert sorted(names) == ["blocks.3.bias", "blocks.3.experts[2]", "blocks.3.experts[3]", "blocks.3.w",
                             "blocks.5.bias", "blocks.5.experts[2]", "blocks.5.experts[3]", "blocks.5.w",
                             "head.weight"]
    assert [is_expert_name(n) for n in ("blocks.3.experts[2]", "blocks.3.w")] == [True, False]
    assert names["blocks.5.experts[3]"].tolist() == [4.0, 5.0, 6.0, 7.0]
    saved = {k: torch.full_like(v, 9.0) for k, v in names.items()}
    with torch.no_grad():
        for dst, src in copy_plan(names, saved):
            dst.copy_(src)
    assert bool((stage.blocks[1].experts == 9.0).all()) and bool((stage.blocks[0].bias == 9.0).all())
    del saved["blocks.5.experts[3]"]
    with pytest.raises(KeyError, match=r"blocks\.5\.experts\[3\]"):
        copy_plan(names, saved)
