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


def _run_demo(tmp_path, device, *extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moe_graph.demo", "--quick", "--device", device, "--out",
                           str(tmp_path), *extra], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for text in ("loss", "tok/s", "before", "echo", "step time", "demo.png"):
        assert text in out, f"{text!r} missing from the demo output:\n{out[-2000:]}"
    return json.load(open(tmp_path / "demo_summary.json")), wall


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
    with open(tmp_path / "demo.png", "rb") as f:
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
    from moe_graph.demo import _png_fallback, build_corpus

    a, b = build_corpus(50, seed=1), build_corpus(50, seed=1)
    assert a == b and a.count("\n") == 50 and a != build_corpus(50, seed=2)
    summary = {"history": {"step": [1, 2, 3], "loss": [3.0, 2.0, 1.5], "imb_before": [1.2, 1.3, 1.1],
                           "imb_after": [1.0, 1.0, 1.0]}}
    _png_fallback(summary, str(tmp_path / "p.png"), W=64, Hh=48)
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"IHDR" in data and data.endswith(b"IEND\xaeB`\x82")


def test_demo_step_has_no_data_dependent_ops():
    """CPU proxy for the GPU's "zero host syncs per iteration": the demo's whole training step (DDP buffers, MoE
    layers with echo, distributed optimizer) runs under FakeTensorMode, where any .item()/nonzero()/mask indexing
    or data-dependent shape raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_graph.ddp import DistributedDataParallel
    from moe_graph.demo import MoETransformerLM, _parser, make_train_step
    from moe_graph.optimizer import DistributedOptimizer

    cfg = _parser().parse_args(["--layers", "1"])
    moe = dict(aux_loss_coeff=0.01, num_spare_experts_per_ep_rank=1, capacity_factor=1.25, assignment="greedy")
    model = MoETransformerLM(cfg, 37, moe, "cpu", torch.float32)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-3, weight_decay=0.0, clip_grad=1.0)
    step = make_train_step(ddp, opt)

    def batch():
        return [(torch.randint(0, 37, (2, 64)), torch.randint(0, 37, (2, 64))) for _ in range(2)]

    assert torch.isfinite(step(batch()))  # real step first (lazy state)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = step(batch())
        assert out.shape == ()


@requires_cuda
def test_demo_quick_cuda(tmp_path):
    # one process per GPU (NCCL), bf16, the full-iteration CUDA graph: it runs and learns
    s, _ = _run_demo(tmp_path, "cuda")
    assert s["world"] == torch.cuda.device_count()
    assert s["final_loss"] < s["first_loss"] - 0.5, (s["first_loss"], s["final_loss"])
