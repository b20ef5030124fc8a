"""End-to-end demo: train a small MoE transformer language model with expert parallelism, echo load balancing,
the static-buffer token dispatcher, the ZeRO-1 distributed optimizer and, on a GPU, the full-iteration CUDA graph.

    python -m moe_graph.demo              # CPU: 2 gloo processes, about 1-2 minutes on 2 cores
    python -m moe_graph.demo --quick      # the CI run: < 40 s
    python -m moe_graph.demo --ep 4 --steps 300 --out /tmp/demo

Data: a built-in synthetic corpus (sentences from a small grammar, generated deterministically), modelled
character by character; every rank samples its own windows. Model: token + position embeddings, ``--layers``
pre-norm blocks of causal self-attention and a :class:`moe_graph.moe_layer.MoELayer` (top-k softmax router with
the aux load-balancing loss, SwiGLU experts, ``E / R`` experts per rank plus ``--spare`` echo slots), a final norm
and the LM head. Dense parameters are data-parallel over all ranks, expert parameters expert-parallel; gradients go
through :class:`moe_graph.ddp.DistributedDataParallel` buffers into the
:class:`moe_graph.optimizer.DistributedOptimizer`. One training step (``--microbatches`` forward/backward passes
and the optimizer step) runs through :class:`moe_graph.graph.FullIterationGraph`: one CUDA graph on a GPU, eager on
a CPU (it says so).

Output: a progress line with the loss and tokens/s, the per-rank load (tokens received by each rank's experts)
before and after echo, the tokens dropped over capacity, eager vs graph step time on a GPU, and in ``--out``
(default ``benchmarks/results/demo``) ``demo_summary.json`` and ``demo.png`` (loss and load balance).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import struct
import sys
import time
import zlib
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_corpus", "MoETransformerLM", "main"]


# --------------------------------------------------------------------------------------------------- data --
_NAMES = ["anna", "bob", "carla", "dev", "emil", "fatima", "gus", "hana", "ivan", "jules"]
_ADJ = ["red", "small", "quiet", "bright", "old", "green", "heavy", "soft", "quick", "lazy"]
_NOUN = ["cat", "lamp", "river", "garden", "train", "letter", "window", "cloud", "drum", "boat"]
_VERB = ["sees", "paints", "finds", "carries", "likes", "builds", "follows", "hears"]
_PLACE = ["in the park", "at home", "by the sea", "under the bridge", "on the hill", "near the mill"]


def build_corpus(num_sentences: int = 4000, seed: int = 0) -> str:
    """A deterministic synthetic text: sentences like ``"anna sees the red cat by the sea."`` and counting lines
    (``"3 4 5 6."``), enough structure for a small LM to learn quickly."""
    rng = random.Random(seed)
    out = []
    for i in range(num_sentences):
        if i % 7 == 6:
            s = rng.randint(0, 5)
            out.append(" ".join(str(s + j) for j in range(4)) + ".")
        else:
            n = rng.choice(_NAMES)
            s = f"{n} {rng.choice(_VERB)} the {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
            if rng.random() < 0.5:
                s += " " + rng.choice(_PLACE)
            out.append(s + ".")
    return "\n".join(out) + "\n"


class CharData:
    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, gen: torch.Generator, batch: int, seq: int):
        starts = torch.randint(0, self.data.numel() - seq - 1, (batch,), generator=gen)
        win = torch.stack([self.data[s : s + seq + 1] for s in starts.tolist()])
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()


# -------------------------------------------------------------------------------------------------- model --
class Block(nn.Module):
    def __init__(self, cfg, moe_kwargs, device, dtype):
        super().__init__()
        from .moe_layer import MoELayer

        H = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(H, device=device, dtype=dtype)
        self.qkv = nn.Linear(H, 3 * H, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(H, H, bias=False, device=device, dtype=dtype)
        self.ln2 = nn.LayerNorm(H, device=device, dtype=dtype)
        self.moe = MoELayer(H, cfg.ffn, cfg.experts, cfg.topk, device=device, params_dtype=dtype, **moe_kwargs)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, H))
        return x + self.moe(self.ln2(x))


class MoETransformerLM(nn.Module):
    """The demo's language model. With ``layer_ids`` / ``first`` / ``last`` it is one pipeline stage: blocks
    ``layer_ids`` only, the embeddings on the first stage, the final norm, head and loss on the last;
    ``set_input_tensor`` receives the previous stage's activation (the pipeline schedules call it)."""

    def __init__(self, cfg, vocab_size: int, moe_kwargs: Dict, device, dtype, layer_ids: Optional[List[int]] = None,
                 first: bool = True, last: bool = True):
        super().__init__()
        H = cfg.hidden
        self.layer_ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        self.first, self.last = first, last
        if first:
            self.emb = nn.Embedding(vocab_size, H, device=device, dtype=dtype)
            self.pos = nn.Embedding(cfg.seq, H, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([Block(cfg, moe_kwargs, device, dtype) for _ in self.layer_ids])
        if last:
            self.ln = nn.LayerNorm(H, device=device, dtype=dtype)
            self.head = nn.Linear(H, vocab_size, bias=False, device=device, dtype=dtype)
        if first:
            with torch.no_grad():
                self.emb.weight.normal_(0, 0.5)
                self.pos.weight.normal_(0, 0.1)
        self.input_tensor = None

    def set_input_tensor(self, t) -> None:
        self.input_tensor = t

    def moe_layers(self):
        return [b.moe for b in self.blocks]

    def forward(self, tokens, labels):
        x = self.emb(tokens) + self.pos.weight[: tokens.shape[1]] if self.first else self.input_tensor
        for b in self.blocks:
            x = b(x)
        if not self.last:
            return x
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# ------------------------------------------------------------------------------------------------ training --
def make_train_step(ddp, opt):
    """One training iteration: zero the grad buffers, forward/backward every microbatch, the optimizer step (grad
    reduce-scatter, Adam on the shard, param all-gather) and, for routers with expert bias, the auxiliary-loss-free
    bias update (one all-reduce). Device work only: the whole function is one CUDA graph."""
    from .moe_layer import update_expert_bias

    def step(microbatches):
        ddp.zero_grad_buffer()
        losses = []
        for tokens, labels in microbatches:
            loss = ddp(tokens, labels)
            (loss / len(microbatches)).backward()
            losses.append(loss.detach())
        opt.step()
        update_expert_bias(ddp.module)  # no-op without enable_expert_bias
        return torch.stack(losses).mean()

    return step


def _train(rank: int, world: int, cfg) -> Dict:
    import torch.distributed as dist

    from . import parallel_state as ps
    from .ddp import DistributedDataParallel
    from .graph import FullIterationGraph
    from .optimizer import DistributedOptimizer

    is_cuda = cfg.device == "cuda"
    if is_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    distributed = world > 1
    ep_group = edp_group = None
    if distributed:
        ps.initialize_model_parallel(expert_model_parallel_size=world)
        ep_group = ps.get_expert_model_parallel_group()
        edp_group = ps.get_expert_data_parallel_group()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)

    data = CharData(build_corpus(seed=0))
    moe_kwargs = dict(aux_loss_coeff=cfg.aux, num_spare_experts_per_ep_rank=cfg.spare, capacity_factor=cfg.capacity,
                      assignment=cfg.assignment, ep_group=ep_group, ep_size=world)
    if cfg.router == "deepseek":  # sigmoid scores, group-limited top-k, aux-loss-free expert bias, and a tiny
        # sequence-wise aux loss (DeepSeek-V3's alpha = 1e-4)
        moe_kwargs.update(score_func="sigmoid", num_groups=min(4, cfg.experts), group_topk=min(2, cfg.topk),
                          enable_expert_bias=True, expert_bias_update_rate=1e-3, aux_loss_coeff=1e-4,
                          aux_loss_type="sequence")
    torch.manual_seed(1234 + rank)  # experts differ per rank; dense weights are broadcast from rank 0 below
    model = MoETransformerLM(cfg, data.vocab_size, moe_kwargs, device, dtype)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, expert_data_parallel_group=edp_group)
    ddp.broadcast_params()
    opt = DistributedOptimizer(ddp, lr=cfg.lr, weight_decay=0.0, clip_grad=1.0,
                               expert_model_parallel_group=ep_group)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"moe_graph demo: {world} rank(s) on {device.type} ({'nccl' if is_cuda and distributed else 'gloo' if distributed else 'single process'}), "
        f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.topk} ({cfg.experts // world} per rank "
        f"+ {cfg.spare} echo slot(s)), capacity factor {cfg.capacity}, {n_params / 1e3:.0f}k params per rank, "
        f"vocab {data.vocab_size}, {cfg.microbatches} x {cfg.batch} x {cfg.seq} tokens per rank per step")

    step = make_train_step(ddp, opt)

    gen = torch.Generator().manual_seed(100 + rank)

    def next_batch():
        mbs = []
        for _ in range(cfg.microbatches):
            x, y = data.batch(gen, cfg.batch, cfg.seq)
            mbs.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
        return mbs

    tokens_per_step = world * cfg.microbatches * cfg.batch * cfg.seq
    history = {"step": [], "loss": [], "imb_before": [], "imb_after": [], "tok_s": []}
    eager_ms: List[float] = []
    graph_ms: List[float] = []

    def loads():
        lb = torch.stack([m.last_load_before for m in model.moe_layers()]).float().cpu()  # [layers, R]
        la = torch.stack([m.last_load_after for m in model.moe_layers()]).float().cpu()
        return lb, la

    def run(fn, first, last, times: Optional[List[float]], t_start):
        t_log = time.perf_counter()
        n_log = 0
        for it in range(first, last):
            t0 = time.perf_counter()
            loss = fn(next_batch())
            if is_cuda and times is not None:
                torch.cuda.synchronize()
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
            n_log += 1
            if (it + 1) % cfg.log_every == 0 or it == last - 1 or it == 0:
                lval = float(loss)  # host read, outside the graph
                lb, la = loads()
                now = time.perf_counter()
                tok_s = tokens_per_step * n_log / max(now - t_log, 1e-9)
                t_log, n_log = now, 0
                history["step"].append(it + 1)
                history["loss"].append(lval)
                history["imb_before"].append(float((lb.max(1).values / lb.mean(1)).mean()))
                history["imb_after"].append(float((la.max(1).values / la.mean(1)).mean()))
                history["tok_s"].append(tok_s)
                done = (it + 1) / cfg.steps
                bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
                say(f"[{bar}] step {it + 1:4d}/{cfg.steps}  loss {lval:6.3f}  {tok_s:8.0f} tok/s  "
                    f"max/mean load {history['imb_before'][-1]:.2f} -> {history['imb_after'][-1]:.2f} with echo  "
                    f"({time.perf_counter() - t_start:5.1f} s)")

    t_start = time.perf_counter()
    graph = None
    if cfg.graph:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the note is printed once below instead of a warning per rank
            graph = FullIterationGraph(step, warmup_steps=2)
    if graph is not None and not graph.enabled:
        say(f"note: {graph.note}")
    if is_cuda and graph is not None:
        n_eager = max(4, min(20, cfg.steps // 4))
        run(step, 0, n_eager, eager_ms, t_start)  # plain eager steps, timed
        run(graph, n_eager, cfg.steps, graph_ms, t_start)  # warm-up (eager), capture, then replays
        graph_ms = graph_ms[3:]  # drop warm-up and capture
        eager_ms = eager_ms[2:]
    else:
        run(graph if graph is not None else step, 0, cfg.steps, eager_ms, t_start)
        eager_ms = eager_ms[2:]
    total_s = time.perf_counter() - t_start

    lb, la = loads()
    drops = sum(m.dispatcher.check_drops() for m in model.moe_layers())
    routes = cfg.steps * cfg.microbatches * cfg.batch * cfg.seq * cfg.topk * cfg.layers
    summary = {
        "rank": rank, "world": world, "device": device.type, "steps": cfg.steps, "history": history,
        "first_loss": history["loss"][0], "final_loss": history["loss"][-1],
        "load_before": lb.tolist(), "load_after": la.tolist(), "dropped_routes": drops, "routes": routes,
        "eager_step_ms": (sum(eager_ms) / len(eager_ms)) if eager_ms else None,
        "graph_step_ms": (sum(graph_ms) / len(graph_ms)) if graph_ms else None,
        "total_s": total_s, "tokens_per_step": tokens_per_step, "config": vars(cfg),
        "graph_note": graph.note if graph is not None else "graph disabled (--no-graph)",
        "expert_bias": [m.router.expert_bias.float().cpu().tolist() for m in model.moe_layers()
                        if m.router.enable_expert_bias],
    }
    if distributed:
        out = [None] * world
        dist.all_gather_object(out, drops)
        summary["dropped_routes_all_ranks"] = out
        ps.destroy_model_parallel()
    return summary


# ---------------------------------------------------------------------------------------------------- plot --
def _plot(summary: Dict, path: str) -> str:
    h = summary["history"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        ax[0].plot(h["step"], h["loss"], "-o", ms=3)
        ax[0].set(title="training loss (rank 0)", xlabel="step", ylabel="cross entropy")
        ax[1].plot(h["step"], h["imb_before"], label="without echo")
        ax[1].plot(h["step"], h["imb_after"], label="with echo")
        ax[1].axhline(1.0, color="gray", lw=0.5)
        ax[1].set(title="load imbalance (max/mean tokens per rank)", xlabel="step")
        ax[1].legend()
        R = len(summary["load_before"][0])
        xs = list(range(R))
        ax[2].bar([x - 0.2 for x in xs], summary["load_before"][0], 0.4, label="before echo")
        ax[2].bar([x + 0.2 for x in xs], summary["load_after"][0], 0.4, label="after echo")
        ax[2].set(title="tokens per EP rank (layer 0, last step)", xlabel="EP rank", xticks=xs)
        top = max(max(summary["load_before"][0]), max(summary["load_after"][0]))
        ax[2].set_ylim(0, 1.3 * top)  # headroom for the legend
        ax[2].legend(loc="upper center", ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return "matplotlib"
    except ImportError:
        _png_fallback(summary, path)
        return "built-in PNG writer (matplotlib is not installed: no text labels)"


def _png_fallback(summary: Dict, path: str, W: int = 640, Hh: int = 400) -> None:
    """A minimal line plot without matplotlib: top panel loss (blue), bottom panel load imbalance before (red) and
    after (green) echo; white background, gray axes."""
    img = bytearray(b"\xff" * (W * Hh * 3))

    def px(x, y, c):
        if 0 <= x < W and 0 <= y < Hh:
            i = (y * W + x) * 3
            img[i : i + 3] = bytes(c)

    def line(x0, y0, x1, y1, c):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for t in range(n + 1):
            px(round(x0 + (x1 - x0) * t / n), round(y0 + (y1 - y0) * t / n), c)

    def panel(top, bottom, series):
        left, right = 40, W - 20
        line(left, top, left, bottom, (128, 128, 128))
        line(left, bottom, right, bottom, (128, 128, 128))
        vals = [v for _, ys, _ in series for v in ys]
        lo, hi = min(vals), max(vals)
        hi = hi if hi > lo else lo + 1
        for xs, ys, c in series:
            x0, x1 = min(xs), max(max(xs), min(xs) + 1)
            pts = [(left + (x - x0) * (right - left) / (x1 - x0), bottom - (y - lo) * (bottom - top) / (hi - lo))
                   for x, y in zip(xs, ys)]
            for (a, b), (c2, d) in zip(pts, pts[1:]):
                line(round(a), round(b), round(c2), round(d), c)

    h = summary["history"]
    panel(20, 190, [(h["step"], h["loss"], (30, 90, 200))])
    panel(220, 380, [(h["step"], h["imb_before"], (210, 50, 50)), (h["step"], h["imb_after"], (40, 160, 60))])
    raw = b"".join(b"\x00" + bytes(img[y * W * 3 : (y + 1) * W * 3]) for y in range(Hh))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, Hh, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


# ---------------------------------------------------------------------------------------------------- main --
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_graph.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CI configuration: fewer steps and a smaller model")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ep", type=int, default=None,
                   help="EP ranks = processes (default: 2 on CPU, the number of GPUs on CUDA)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=96)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--spare", type=int, default=1, help="echo slots per rank (0: no echo)")
    p.add_argument("--assignment", choices=["auto", "greedy", "best_fit"], default="auto",
                   help="echo planner assignment (moe_graph.planner.gen_assignment)")
    p.add_argument("--capacity", type=float, default=1.25, help="capacity factor (0: dropless)")
    p.add_argument("--aux", type=float, default=0.01, help="aux load-balancing loss coefficient")
    p.add_argument("--router", choices=["softmax", "deepseek"], default="softmax",
                   help="deepseek: sigmoid scores, group-limited top-k, auxiliary-loss-free expert bias, "
                        "sequence-wise aux loss 1e-4")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch per rank")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="do not use FullIterationGraph")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results/demo)")
    return p


def main(argv: Optional[List[str]] = None) -> Dict:
    args = _parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if args.ep is None:
        args.ep = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and args.ep > torch.cuda.device_count():
        raise SystemExit(f"--ep {args.ep}: only {torch.cuda.device_count()} GPU(s) (NCCL needs one GPU per rank)")
    if args.quick:
        args.steps = args.steps or 60
        args.layers, args.batch, args.microbatches = 1, 8, 1
    args.steps = args.steps or (400 if args.device == "cuda" else 250)
    args.log_every = args.log_every or max(1, args.steps // 15)
    if args.capacity == 0:
        args.capacity = None
    if args.experts % args.ep:
        raise SystemExit(f"--experts {args.experts} must be divisible by --ep {args.ep}")
    out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks",
                                       "results", "demo")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    if args.ep == 1:
        summary = _train(0, 1, args)
    else:
        from .testing.distributed import run_distributed

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        summary = run_distributed(_train, args.ep, args, backend="nccl" if args.device == "cuda" else "gloo",
                                  timeout=3600)[0]
    wall = time.perf_counter() - t0

    lb, la = summary["load_before"][0], summary["load_after"][0]
    print("\nper-rank load of layer 0 at the last step (tokens received by each EP rank's experts):")
    print("  rank   " + " ".join(f"{r:>7d}" for r in range(len(lb))) + "   max/mean")
    for name, v in (("before", lb), ("echo  ", la)):
        print(f"  {name} " + " ".join(f"{int(x):>7d}" for x in v) + f"   {max(v) / (sum(v) / len(v)):.3f}")
    h = summary["history"]
    n = len(h["imb_before"])
    print(f"mean max/mean load over training: {sum(h['imb_before']) / n:.3f} without echo -> "
          f"{sum(h['imb_after']) / n:.3f} with echo; dropped routes over capacity (all ranks): "
          f"{sum(summary.get('dropped_routes_all_ranks', [summary['dropped_routes']]))}")
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in {summary['steps']} steps; "
          f"{sum(h['tok_s'][1:]) / max(len(h['tok_s']) - 1, 1):.0f} tokens/s")
    if summary["graph_step_ms"] is not None:
        e, g = summary["eager_step_ms"], summary["graph_step_ms"]
        print(f"step time: eager {e:.2f} ms, full-iteration CUDA graph {g:.2f} ms ({e / g:.2f}x)")
    else:
        ms = summary["eager_step_ms"]
        print(f"step time: eager {ms:.1f} ms ({summary['graph_note']})" if ms else summary["graph_note"])
    png = os.path.join(out_dir, "demo.png")
    how = _plot(summary, png)
    summary["wall_s"] = wall
    summary["config"] = {k: v for k, v in vars(args).items()}
    from .testing.bench import environment

    summary["env"] = environment()  # torch / CUDA versions, the commit measured, date
    with open(os.path.join(out_dir, "demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"wrote {png} ({how}) and {os.path.join(out_dir, 'demo_summary.json')}; total {wall:.1f} s")
    return summary


if __name__ == "__main__":
    main()
