"""The end-to-end demo in its quick mode (2 gloo processes on CPU): it finishes, the loss clearly decreases, echo
balances the per-rank load, and it writes the summary and the PNG plot."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from conftest import alive, descendants, launched_ranks, proc_state, requires_cuda, run_cmd, started, wait_for
from moe_graph.distributed.launch import STOP_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


COMMITTED = os.path.join(ROOT, "benchmarks", "results", "demo", "demo_summary.json")


def _run_demo(tmp_path, device, *extra):
    """The demo from ``tmp_path`` with the default output folder (``./moe_graph_demo``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    committed = os.stat(COMMITTED).st_mtime_ns if os.path.exists(COMMITTED) else None
    proc = run_cmd([sys.executable, "-m", "moe_graph.demo", "--quick", "--device", device, *extra], 300,
                   "the quick demo", env=env, cwd=str(tmp_path))
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
    return s


def test_demo_quick(tmp_path):
    # the CI configuration on every machine: 2 gloo processes on the CPU, fp32
    s = _run_demo(tmp_path, "cpu")
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


def test_demo_quick_deepseek_router(tmp_path):
    # sigmoid scores, group-limited top-k and the auxiliary-loss-free expert bias, updated inside the train step
    s = _run_demo(tmp_path, "cpu", "--router", "deepseek", "--steps", "40")
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


def test_plot_draws_a_baseline_beside_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    from moe_graph.demo import report

    run = {"history": {"step": [1, 2], "loss": [3.0, 2.0], "imb_before": [1.2, 1.1], "imb_after": [1.0, 1.0]},
           "load_before": [[3, 1]], "load_after": [[2, 2]], "config": {"fp8": "blockwise", "fp8_dispatch": True}}
    base = dict(run, config={}, history=dict(run["history"], loss=[3.0, 2.1]))
    labels = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.plot
    def spy(ax, *a, **kw):  # noqa: E306
        labels.append(kw.get("label"))
        return orig(ax, *a, **kw)
    matplotlib.axes.Axes.plot = spy
    try:
        assert report.plot(run, str(tmp_path / "d.png"), baseline=base) == "matplotlib"
    finally:
        matplotlib.axes.Axes.plot = orig
    assert "this run: FP8 blockwise + FP8 dispatch" in labels and "baseline: no FP8" in labels, labels
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    s = _run_demo(tmp_path, "cuda")
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
    (["--fp8-dispatch"], "--fp8-dispatch"), (["--spare", "0", "--fp8", "tensorwise", "--fp8-dispatch"], "--fp8-dispatch"),
    (["--baseline", "/nonexistent/demo_summary.json"], "--baseline"),
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


def _imported(argv, cwd):
    """(exit status, stderr, the modules imported) of ``python -X importtime ARGV``, its stderr minus the timings."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = run_cmd([sys.executable, "-X", "importtime", *argv], 120, " ".join(argv), env=env, cwd=str(cwd))
    lines = proc.stderr.splitlines()
    modules = {ln.rsplit("|", 1)[1].strip() for ln in lines if ln.startswith("import time:")}
    return proc.returncode, "\n".join(ln for ln in lines if not ln.startswith("import time:")), modules


@pytest.mark.parametrize("argv, flag", [
    (["-m", "moe_graph.demo", "--ep", "0"], "--ep"), (["-m", "moe_graph.demo", "--heads", "3"], "--heads"),
    (["-m", "moe_graph.demo", "--exchange", "x"], "--exchange"),
    (["-m", "moe_graph.demo", "--save-every", "2"], "--save-every"),
    (["-m", "moe_graph.parallel_state", "--world-size", "0"], "--world-size"),
    (["-m", "moe_graph.train.schedules", "--pp", "0", "-m", "4"], "--pp"),
    (["-m", "moe_graph.train.schedules", "--pp", "1", "--vpp", "2", "-m", "4"], "--vpp"),
    (["-m", "moe_graph.train.schedules", "--pp", "2"], "--microbatches"),
    (["-m", "moe_graph.train.checkpoint", "inspect", "ckpt", "--tensor-list"], "--tensor-list"),
    (["-m", "moe_graph.train.checkpoint", "reshard", "ckpt", "out", "--dp", "x"], "--dp"),
    (["-m", "moe_graph.train.checkpoint", "reshard", "ckpt", "out", "--dp", "4", "--ep", "3"], "--ep"),
    (["-m", "moe_graph.train.checkpoint", "reshard", "ckpt", "out", "--vpp", "2"], "--vpp"),
    (["-m", "moe_graph.train.checkpoint", "squash", "ckpt"], "squash"),
    (["-m", "moe_graph.selfcheck", "--seed", "x"], "--seed")])
def test_bad_flag_is_refused_before_torch_is_imported(argv, flag, tmp_path):
    # not a timing test: the refusal must not wait for torch or the extension (seconds on a busy machine)
    code, err, modules = _imported(argv, tmp_path)
    assert code == 2 and flag in err, err
    heavy = sorted(m for m in modules if m.split(".")[0] == "torch" or m in ("moe_graph._C", "moe_graph.demo.cli"))
    assert not heavy, f"imported before the flags were checked: {heavy[:5]}"
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("command", ["moe_graph.train.schedules", "moe_graph.train.checkpoint", "moe_graph.selfcheck",
                                     "moe_graph.parallel_state"])
def test_every_command_help_needs_no_torch(command, tmp_path):
    code, err, modules = _imported(["-m", command, "--help"], tmp_path)
    assert code == 0, err
    heavy = sorted(m for m in modules if m.split(".")[0] == "torch" or m == "moe_graph._C")
    assert not heavy, f"--help imported {heavy[:5]}"


def test_demo_help_needs_no_torch_and_shows_every_default(tmp_path):
    code, _, modules = _imported(["-m", "moe_graph.demo", "--help"], tmp_path)
    assert code == 0 and "torch" not in modules
    from moe_graph.demo.flags import parser

    p = parser()
    fmt = p._get_formatter()
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help"
            if action.default not in (None, False):
                assert "default" in fmt._get_help_string(action), action.option_strings
    text = p.format_help()
    assert "(default: 64)" in text and "(default: 0.003)" in text and "README" not in text


def test_the_light_parser_knows_the_exchanges():
    from moe_graph.demo import flags
    from moe_graph.moe.exchange import EXCHANGES

    assert flags.EXCHANGES == EXCHANGES


def test_relative_save_and_load_are_inside_the_git_ignored_output_folder(tmp_path, monkeypatch):
    # `--save ckpt` in the checkout must leave `git status` clean: the folder lands in ./moe_graph_demo/ckpt
    from moe_graph.demo.cli import parser, resolve_args

    monkeypatch.chdir(ROOT)
    p = parser()
    args = p.parse_args(["--device", "cpu", "--save", "ckpt"])
    resolve_args(p, args, None)
    assert args.save == os.path.join(ROOT, "moe_graph_demo", "ckpt")
    probe = os.path.join(args.save, "step_00000001", "meta.json")
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, f"{probe} would show in git status"
    args = p.parse_args(["--device", "cpu", "--out", str(tmp_path / "o"), "--save", "ck", "--save-every", "1"])
    resolve_args(p, args, None)
    assert args.save == str(tmp_path / "o" / "ck")
    args = p.parse_args(["--device", "cpu", "--save", str(tmp_path / "abs")])  # an absolute folder stays
    resolve_args(p, args, None)
    assert args.save == str(tmp_path / "abs")
    with pytest.raises(SystemExit):  # --load: relative to --out too (there is no tmp_path/o/missing)
        resolve_args(p, p.parse_args(["--device", "cpu", "--out", str(tmp_path / "o"), "--load", "missing"]), None)


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


def _torchrun_cmd(tmp_path, name, *extra, nproc=4):
    # --standalone: the rendezvous store binds a port the kernel picks (no free-port-by-luck that another process on
    # the machine can take first); the workers reuse that store
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "moe_graph.demo", "--device", "cpu", "--pp", "2", "--ep", "2", "--layers", "2", "--hidden", "32",
            "--heads", "2", "--ffn", "48", "--seq", "32", "--batch", "4", "--microbatches", "2", "--steps", "6",
            "--log-every", "1", "--out", str(tmp_path / name), *extra]


def _torchrun(tmp_path, name, *extra, timeout=240):
    cmd = _torchrun_cmd(tmp_path, name, *extra)
    t0 = time.perf_counter()
    proc = run_cmd(cmd, timeout, "torchrun with 4 demo ranks", env=_env(), cwd=str(tmp_path))
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
    proc = run_cmd(base + ["--dp", "2", "--microbatches", "1", "--out", str(out1), "--save", str(ck), "--save-every",
                           "2"], 240, "the demo whose rank 1 is killed mid-save", env=env)
    # the launcher saw rank 1's death (not a timeout: run_cmd fails past 240 s); the conftest leak check sees no rank
    assert proc.returncode != 0 and "rank 1 exited with code -9 (signal 9)" in proc.stderr, proc.stderr[-3000:]
    assert (ck / "latest").read_text().strip() == "step_00000002"
    assert resolve_checkpoint(str(ck)).endswith("step_00000002")
    assert not (ck / "step_00000004").exists() and (ck / ".step_00000004.partial").exists()
    summary = json.loads((out1 / "demo_summary.json").read_text())
    assert summary["finished"] is False and summary["status"] == "failed"
    ref = _metrics(out1)
    assert sorted(ref) == [1, 2, 3, 4]

    out2 = tmp_path / "run2"
    t0 = time.perf_counter()
    proc = run_cmd(base + ["--dp", "1", "--microbatches", "2", "--out", str(out2), "--load", str(ck)], 240,
                   "the demo resumed on 1 rank", env=_env())
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


_SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "48", "--seq", "32", "--batch", "4",
          "--log-every", "1", "--no-graph"]


def _demo_cmd(out, *extra):
    return [sys.executable, "-m", "moe_graph.demo", "--device", "cpu", *_SMALL, "--out", str(out), *extra]


def _default_sigint():
    # A suite started in the background of a non-interactive shell (`pytest ... &` in a script, nohup jobs) inherits
    # SIGINT ignored, and a Python started with SIGINT ignored keeps ignoring it: the demo gets the disposition an
    # interactive user's has.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _started_demo(out, log, *extra):
    """The demo in the background (its whole process tree killed when the block ends), stderr into ``log``, with
    SIGINT at its default disposition whatever this process's is."""
    return started(_demo_cmd(out, *extra), env=_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                   preexec_fn=_default_sigint)


def _training(proc, out, log, steps: int = 1):
    """Wait until the demo has logged ``steps`` steps; returns its two workers' ``(pid, start time)``."""
    def logged():
        assert proc.poll() is None, f"the demo exited ({proc.returncode}): {open(log).read()[-3000:]}"
        return (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= steps
    wait_for(logged, 240, f"the demo to log {steps} step(s) in {out}/metrics.jsonl")
    workers = [(p, proc_state(p)[2]) for p in launched_ranks(proc.pid) if proc_state(p)]
    assert len(workers) == 2, workers
    return workers


def _gone(workers, what):
    wait_for(lambda: not any(alive(p, t) for p, t in workers), 30, f"the workers {[p for p, _ in workers]} to exit "
             f"after {what}")


def test_sigint_to_the_parent_stops_the_workers(tmp_path):
    out, log = tmp_path / "o", tmp_path / "stderr.txt"
    with _started_demo(out, log, "--steps", "100000") as proc:
        workers = _training(proc, out, log)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: proc.poll() is not None, 60, "the demo to exit after SIGINT")
        assert proc.returncode != 0
        _gone(workers, "SIGINT to the parent")
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["finished"] is False and summary["status"] == "interrupted"


def test_sigkill_of_the_parent_leaves_no_worker(tmp_path):
    """The OOM killer or kill -9 on the self-spawned demo's parent: its workers die with it."""
    out, log = tmp_path / "o", tmp_path / "stderr.txt"
    with _started_demo(out, log, "--steps", "100000") as proc:
        workers = _training(proc, out, log)
        proc.kill()
        t0 = time.monotonic()
        _gone(workers, "SIGKILL of their parent")
        print(f"workers gone {time.monotonic() - t0:.2f} s after SIGKILL of the demo's parent")


def test_sigterm_saves_and_the_checkpoint_resumes_exactly(tmp_path):
    """SIGTERM to the self-spawned demo (--save, no periodic save due): both ranks finish the step, save it, the
    summary says interrupted, the exit status is 143 with a message; --load continues with the losses and grad norms
    of an uninterrupted run, bit for bit."""
    ck, out, log = tmp_path / "ck", tmp_path / "stopped", tmp_path / "stderr.txt"
    with _started_demo(out, log, "--steps", "100000", "--save", str(ck), "--save-every", "100000") as proc:
        workers = _training(proc, out, log, steps=2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, 120, "the demo to save and exit after SIGTERM")
        took = time.monotonic() - t0
        _gone(workers, "they stopped on SIGTERM")
    stderr = log.read_text()
    assert proc.returncode == STOP_EXIT_CODE, stderr[-3000:]
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["finished"] is False and summary["status"] == "interrupted"
    stop = summary["stopped"]["step"]
    assert stop >= 2 and summary["stopped"]["reason"] == "SIGTERM to the launcher"
    assert f"stopped by SIGTERM to the launcher after step {stop} of 100000" in stderr, stderr[-3000:]
    assert "grace 25 s" in stderr
    assert (ck / "latest").read_text().strip() == f"step_{stop:08d}"
    size = sum(f.stat().st_size for f in (ck / f"step_{stop:08d}").iterdir())
    print(f"SIGTERM -> exit {took:.1f} s, checkpoint at step {stop}: {size / 2**20:.2f} MiB")
    stopped = _metrics(out)
    assert sorted(stopped) == list(range(1, stop + 1))  # every step logged, the stop step included

    resumed = tmp_path / "resumed"
    proc = run_cmd(_demo_cmd(resumed, "--steps", str(stop + 2), "--load", str(ck)), 240, "the resumed demo",
                   env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {stop}" in proc.stdout and "RNG restored" in proc.stdout
    ref = tmp_path / "ref"
    proc = run_cmd(_demo_cmd(ref, "--steps", str(stop + 2)), 240, "the uninterrupted demo", env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, res = _metrics(ref), _metrics(resumed)
    assert sorted(res) == [stop + 1, stop + 2]
    for s in range(1, stop + 3):
        got = stopped[s] if s <= stop else res[s]
        assert (got["loss"], got["grad_norm"]) == (full[s]["loss"], full[s]["grad_norm"]), s


def test_sigterm_to_torchrun_stops_every_rank_with_a_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to its 4 ranks (pp 2 x ep 2): they agree on one step, save it and exit with 143."""
    ck, out, log = tmp_path / "ck", tmp_path / "o", tmp_path / "stderr.txt"
    cmd = _torchrun_cmd(tmp_path, "o", "--steps", "100000", "--save", str(ck), "--save-every", "100000")
    with started(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=str(tmp_path)) as proc:
        def logged():
            assert proc.poll() is None, f"torchrun exited ({proc.returncode}): {log.read_text()[-3000:]}"
            return (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2
        wait_for(logged, 240, f"torchrun's ranks to log 2 steps in {out}/metrics.jsonl")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, 120, "torchrun to exit after SIGTERM")
    stderr = log.read_text()
    assert proc.returncode != 0
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["status"] == "interrupted", summary["status"]
    # every rank got SIGTERM; rank 0 may see another rank's request first
    assert summary["stopped"]["reason"] in ("SIGTERM", "another rank's stop request"), summary["stopped"]
    stop = summary["stopped"]["step"]
    assert (ck / "latest").read_text().strip() == f"step_{stop:08d}"
    assert sorted(os.listdir(ck / f"step_{stop:08d}")) == ["meta.json"] + [
        f"{k}_rank{r:05d}.pt" for k in ("optim", "state") for r in range(4)]
    assert f"after step {stop} of 100000" in stderr


def test_sigkill_of_torchrun_leaves_no_rank(tmp_path):
    """torchrun's agent killed with SIGKILL: its 4 ranks (each in its own session) die with it."""
    out, log = tmp_path / "o", tmp_path / "stderr.txt"
    with started(_torchrun_cmd(tmp_path, "o", "--steps", "100000"), env=_env(), stdout=subprocess.DEVNULL,
                 stderr=open(log, "w"), cwd=str(tmp_path)) as proc:
        def logged():
            assert proc.poll() is None, f"torchrun exited ({proc.returncode}): {log.read_text()[-3000:]}"
            return (out / "metrics.jsonl").exists()
        wait_for(logged, 240, f"torchrun's ranks to log a step in {out}/metrics.jsonl")
        ranks = [(p, proc_state(p)[2]) for p in descendants(proc.pid) if alive(p)
                 and "moe_graph.demo" in proc_state(p)[3] and "torch.distributed.run" not in proc_state(p)[3]]
        assert len(ranks) == 4, ranks
        proc.kill()
        _gone(ranks, "SIGKILL of torchrun's agent")


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
