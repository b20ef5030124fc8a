"""End-to-end demo and training entry point: train a small MoE transformer language model with pipeline, expert and
data parallelism, echo load balancing, the static-buffer token dispatcher, the ZeRO-1 distributed optimizer and, on a
GPU, the full-iteration CUDA graph.

    python -m moe_graph.demo              # CPU: 2 gloo processes, about 1-2 minutes on 2 cores
    python -m moe_graph.demo --quick      # the CI run: < 40 s
    python -m moe_graph.demo --ep 4 --steps 300 --out /tmp/demo
    torchrun --nproc-per-node 4 -m moe_graph.demo --pp 2 --ep 2 --save ckpt --save-every 50   # one node
    torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m moe_graph.demo ...

Launch: under torchrun (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` set) every process joins the
``env://`` rendezvous (NCCL on GPUs, gloo on CPUs) and runs the training loop; without torchrun the demo starts
``pp x dp`` processes itself (:func:`moe_graph.distributed.launch.run_distributed`). Both run :func:`_train`.

Layout (:func:`moe_graph.distributed.launch.resolve_layout`): ``world = pp x dp``; each stage's ``dp`` ranks are ``ep`` expert-
parallel x ``dp / ep`` expert-data-parallel; ``--vpp`` chunks per pipeline rank select the interleaved schedule.
Dense tensor parallelism is not supported here (dense layers are data-parallel).

Data: a built-in synthetic corpus (sentences from a small grammar, generated deterministically), modelled
character by character; the global batch of step ``k`` is a function of ``--seed`` and ``k``, cut into equal parts
by data-parallel rank (the data position of a checkpoint is the step). Model: token + position embeddings,
``--layers`` pre-norm blocks of causal self-attention and a :class:`moe_graph.moe.layer.MoELayer` (top-k softmax
router with the aux load-balancing loss, SwiGLU experts, ``E / ep`` experts per rank plus ``--spare`` echo slots), a
final norm and the LM head, cut into pipeline stages. Dense parameters are data-parallel, expert parameters expert-
parallel; gradients go through :class:`moe_graph.distributed.ddp.DistributedDataParallel` buffers into the
:class:`moe_graph.distributed.optimizer.DistributedOptimizer`. One training step (``--microbatches`` forward/backward passes
through the pipeline schedule and the optimizer step) runs through :class:`moe_graph.cuda_graph.FullIterationGraph`: one
CUDA graph on a GPU with ``pp = 1``, eager otherwise (it says so).

Checkpoints (:mod:`moe_graph.train.checkpoint`): ``--save DIR --save-every N`` and ``--load DIR`` (exact resume with the
same layout; another data-parallel size reshards the optimizer).

Output: a progress line with the loss and tokens/s, the per-rank load (tokens received by each rank's experts)
before and after echo, the tokens dropped over capacity, eager vs graph step time on a GPU, and in ``--out``
(default ``./moe_graph_demo``) ``demo_summary.json`` (atomic; ``finished`` says whether the run completed),
``metrics.jsonl`` (one line per logged step) and ``demo.png`` (loss and load balance).
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

from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import FullIterationGraph
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.launch import environment, init_distributed, resolve_layout, run_distributed, torchrun_env
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.moe.layer import MoELayer
from moe_graph.train import checkpoint as C
from moe_graph.train import schedules as P
from moe_graph.train.step import make_train_step

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
def _global_name(stage, name: str) -> str:
    """A pipeline stage's tensor name in the whole model (``blocks.<i>`` numbered by the stage's ``layer_ids``)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{stage.layer_ids[int(i)]}.{rest}"
    return name


def _local_tensors(stages, ep_rank: int):
    """(dense, experts): this rank's model tensors by global name, and the expert ones ``[L, ...]`` with the global
    expert index of each row."""
    dense, experts, slices = {}, {}, {}
    for stage in stages:
        expert_names = {n for n, p in stage.named_parameters() if not getattr(p, "allreduce", True)}
        for name, t in stage.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue  # GroupedLinear's _extra_state
            g = _global_name(stage, name)
            if name in expert_names:
                experts[g] = t.data
                slices[g] = range(ep_rank * t.shape[0], (ep_rank + 1) * t.shape[0])
            else:
                dense[g] = t.data
    return dense, experts, slices


_CKPT_MODEL_KEYS = ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq", "router", "spare")


def _rng_state() -> Dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: Dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def check_checkpoint_compatible(meta: Dict, cfg, layout) -> None:
    """Raise ``ValueError`` naming the flag when the run cannot resume from the checkpoint ``meta``."""
    saved = meta["model"]
    for k in _CKPT_MODEL_KEYS:
        if saved.get(k) != getattr(cfg, k):
            raise ValueError(f"--load: the checkpoint was saved with --{k} {saved.get(k)}, this run uses "
                             f"--{k} {getattr(cfg, k)} (the model must be the same)")
    lay = meta["layout"]
    for k in ("pp", "vpp", "ep"):
        if lay[k] != getattr(layout, k):
            raise ValueError(f"--load: the checkpoint was saved with --{k} {lay[k]}, this run uses --{k} "
                             f"{getattr(layout, k)} (the optimizer state is sharded per pipeline stage and expert "
                             "rank; only the data-parallel size may change)")
    if meta["step"] >= cfg.steps:
        raise ValueError(f"--steps {cfg.steps}: the checkpoint is at step {meta['step']}; nothing left to train")


def _train(rank: int, world: int, cfg) -> Dict:
    """The training loop of one rank, the same under torchrun and under the demo's own processes; expects
    ``torch.distributed`` initialized (any world size, 1 included)."""
    layout = resolve_layout(world, cfg.pp, cfg.vpp, cfg.ep)
    is_cuda = cfg.device == "cuda"
    if is_cuda and os.environ.get("LOCAL_RANK") is None:  # own processes on one machine (torchrun: LOCAL_RANK)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    ps.initialize_model_parallel(pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
                                 virtual_pipeline_model_parallel_size=layout.vpp)
    try:
        return _train_loop(rank, world, cfg, layout, device, dtype)
    finally:
        ps.destroy_model_parallel()


def _train_loop(rank: int, world: int, cfg, layout, device: torch.device, dtype: torch.dtype) -> Dict:
    import torch.distributed as dist

    is_cuda = device.type == "cuda"
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    ep_rank, edp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
    ep_group = ps.get_expert_model_parallel_group()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)
    out_dir = cfg.out

    data = CharData(build_corpus(seed=0))
    moe_kwargs = dict(aux_loss_coeff=cfg.aux, num_spare_experts_per_ep_rank=cfg.spare, capacity_factor=cfg.capacity,
                      assignment=cfg.assignment, ep_group=ep_group, ep_size=layout.ep)
    if cfg.router == "deepseek":  # sigmoid scores, group-limited top-k, aux-loss-free expert bias, and a tiny
        # sequence-wise aux loss (DeepSeek-V3's alpha = 1e-4)
        moe_kwargs.update(score_func="sigmoid", num_groups=min(4, cfg.experts), group_topk=min(2, cfg.topk),
                          enable_expert_bias=True, expert_bias_update_rate=1e-3, aux_loss_coeff=1e-4,
                          aux_loss_type="sequence")
    # the same seed on the expert-data-parallel replicas of a shard; dense weights are broadcast below
    torch.manual_seed(1234 + 7919 * pp_rank + ep_rank)
    chunk_ids = P.chunk_layer_ids(cfg.layers, layout.pp, pp_rank, layout.vpp)
    stages = [MoETransformerLM(cfg, data.vocab_size, moe_kwargs, device, dtype, layer_ids=ids,
                               first=pp_rank == 0 and c == 0,
                               last=pp_rank == layout.pp - 1 and c == len(chunk_ids) - 1)
              for c, ids in enumerate(chunk_ids)]
    ddps = [DistributedDataParallel(s, use_distributed_optimizer=True, data_parallel_group=ps.get_data_parallel_group(),
                                    expert_data_parallel_group=ps.get_expert_data_parallel_group()) for s in stages]
    for d in ddps:
        d.broadcast_params()
    opt = DistributedOptimizer(ddps if layout.vpp else ddps[0], lr=cfg.lr, weight_decay=0.0, clip_grad=1.0,
                               expert_model_parallel_group=ep_group)
    moe_layers = [m for s in stages for m in s.moe_layers()]
    last_stage = stages[-1].last
    n_params = sum(p.numel() for s in stages for p in s.parameters())

    # ---- resume
    start = 0
    resumed = None
    if cfg.load:
        t_load = time.perf_counter()
        folder = C.resolve_checkpoint(cfg.load)
        meta = C.read_meta(folder)
        check_checkpoint_compatible(meta, cfg, layout)
        dense, experts, slices = _local_tensors(stages, ep_rank)
        error = None
        try:
            saved = C.read_model_state(folder, meta)
            plan = C.copy_plan({**dense, **experts}, saved, slices)
        except (KeyError, ValueError, FileNotFoundError, RuntimeError) as exc:
            error = exc
        flag = torch.tensor([0.0 if error is None else 1.0], device=device)
        dist.all_reduce(flag)  # every rank fails together: none waits in the optimizer's collectives
        if error is not None:
            raise ValueError(f"--load {cfg.load}: {error}") from error
        if float(flag) > 0:
            raise RuntimeError(f"--load {cfg.load}: another rank could not read its part of the checkpoint")
        same_stage = [r for r, c in enumerate(meta["coords"]) if c["pp_rank"] == pp_rank]
        opt.load_state_dict(C.read_optimizer_shards(folder, same_stage))  # reshards to this DP size
        with torch.no_grad():
            for dst, src in plan:
                dst.copy_(src)
        start = meta["step"]
        same_layout = meta["layout"] == layout.as_dict()
        if same_layout:
            _set_rng_state(C.read_rank_state(folder, rank)["rng"])
        resumed = {"from": folder, "step": start, "rng": "restored" if same_layout else "fresh (other layout)"}
        say(f"resumed from {folder} at step {start} (saved on {meta['layout']['world']} ranks; RNG "
            f"{resumed['rng']}; {time.perf_counter() - t_load:.2f} s)")

    say(f"moe_graph demo: {layout} on {device.type} ({dist.get_backend()}), "
        f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.topk} ({cfg.experts // layout.ep} "
        f"per rank + {cfg.spare} echo slot(s)), capacity factor {cfg.capacity}, {n_params / 1e3:.0f}k params on "
        f"rank 0, vocab {data.vocab_size}, {cfg.microbatches} x {cfg.batch} x {cfg.seq} tokens per data-parallel "
        f"rank per step")
    say(f"echo buffers per MoE layer: {moe_layers[0].echo_buffer_bytes(cfg.microbatches)['total'] / 2**20:.2f} MiB "
        f"(moe_graph.moe.echo.echo_buffer_bytes)" if moe_layers else "echo buffers: no MoE layer on this rank")

    # the training step (moe_graph.train.step): microbatches through the layout's pipeline schedule with no_sync on
    # all but the last, MoE aux-loss gradient scale, the optimizer step, the expert-bias update
    step = make_train_step(ddps if layout.vpp else ddps[0], opt, tensor_shape=(cfg.batch, cfg.seq, cfg.hidden),
                           dtype=dtype)
    per_rank = cfg.microbatches * cfg.batch

    def next_batch(it: int):
        """Step ``it``'s microbatches of this data-parallel rank: the global batch of step ``it`` is a fixed function
        of the step (the data position), cut into equal parts by data-parallel rank, so a resumed run (at any
        data-parallel size with the same global batch) sees the same data."""
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it)
        starts = torch.randint(0, data.data.numel() - cfg.seq - 1, (layout.dp * per_rank,), generator=gen)
        mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank].view(cfg.microbatches, cfg.batch, 1)
        win = data.data[mine + torch.arange(cfg.seq + 1)]  # [M, B, S + 1]
        return [(w[:, :-1].contiguous().to(device, non_blocking=True), w[:, 1:].contiguous().to(device, non_blocking=True))
                for w in win]

    tokens_per_step = layout.dp * per_rank * cfg.seq
    history = {"step": [], "loss": [], "grad_norm": [], "skipped": [], "imb_before": [], "imb_after": [], "tok_s": []}
    eager_ms: List[float] = []
    graph_ms: List[float] = []
    metrics_path = os.path.join(out_dir, "metrics.jsonl")

    def loads():
        lb = torch.stack([m.last_load_before for m in moe_layers]).float().cpu()  # [layers, R]
        la = torch.stack([m.last_load_after for m in moe_layers]).float().cpu()
        return lb, la

    def save(it: int):
        dense, experts, slices = _local_tensors(stages, ep_rank)
        state = {k: v for k, v in dense.items()} if dp_rank == 0 else {}
        if edp_rank == 0:
            for g, t in experts.items():
                state.update({f"{g}[{e}]": t[i] for i, e in enumerate(slices[g])})
        coords = {"rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "ep_rank": ep_rank, "edp_rank": edp_rank}
        all_coords = [None] * world
        dist.all_gather_object(all_coords, coords)
        t0 = time.perf_counter()
        folder = C.save_checkpoint(cfg.save, it, rank=rank, world=world, model_state=state, optimizer=opt,
                                   rank_state={"rng": _rng_state(), "data": {"step": it, "samples": it * layout.dp
                                                                             * per_rank}, "coords": coords},
                                   meta={"layout": layout.as_dict(), "coords": all_coords,
                                         "model": {k: getattr(cfg, k) for k in _CKPT_MODEL_KEYS},
                                         "data": {"step": it, "seed": cfg.seed, "global_batch": layout.dp * per_rank}})
        say(f"saved {folder} ({time.perf_counter() - t0:.2f} s)")

    def run(fn, first, last, times: Optional[List[float]], t_start):
        t_log = time.perf_counter()
        n_log = 0
        for it in range(first, last):
            t0 = time.perf_counter()
            res = fn(next_batch(it))
            if is_cuda and times is not None:
                torch.cuda.synchronize()
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
            n_log += 1
            if (it + 1) % cfg.log_every == 0 or it == last - 1 or it == first:
                # host reads, outside the graph: the loss (already the data-parallel mean) from the last stage
                red = torch.stack([res.loss.float() if last_stage else torch.zeros((), device=device),
                                   res.grad_norm.float().reshape(()), res.skipped.float().reshape(())])
                dist.all_reduce(red)
                lval = float(red[0]) / layout.dp
                gnorm = float(red[1]) / world  # every rank holds the same global norm and skipped flag
                skipped = bool(red[2] > 0)
                lb, la = loads()
                now = time.perf_counter()
                tok_s = tokens_per_step * n_log / max(now - t_log, 1e-9)
                t_log, n_log = now, 0
                rec = {"step": it + 1, "loss": lval, "grad_norm": gnorm, "skipped": skipped,
                       "imb_before": float((lb.max(1).values / lb.mean(1)).mean()),
                       "imb_after": float((la.max(1).values / la.mean(1)).mean()), "tok_s": tok_s}
                for k, v in rec.items():
                    history[k].append(v)
                if rank == 0:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                done = (it + 1) / cfg.steps
                bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
                say(f"[{bar}] step {it + 1:4d}/{cfg.steps}  loss {lval:6.3f}  {tok_s:8.0f} tok/s  "
                    f"max/mean load {rec['imb_before']:.2f} -> {rec['imb_after']:.2f} with echo  "
                    f"({time.perf_counter() - t_start:5.1f} s)")
            if cfg.save and ((it + 1) % cfg.save_every == 0 or it == cfg.steps - 1):
                save(it + 1)

    t_start = time.perf_counter()
    graph = None
    note = "graph disabled (--no-graph)"
    if cfg.graph and layout.pp > 1:
        note = "eager: the full-iteration graph is not used with pipeline parallelism (point-to-point schedule)"
    elif cfg.graph:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the note is printed once below instead of a warning per rank
            graph = FullIterationGraph(step, warmup_steps=2)
        note = graph.note
        if not graph.enabled:
            say(f"note: {graph.note}")
    n = cfg.steps - start
    if is_cuda and graph is not None and graph.enabled:
        n_eager = max(4, min(20, n // 4))
        run(step, start, start + n_eager, eager_ms, t_start)  # plain eager steps, timed
        run(graph, start + n_eager, cfg.steps, graph_ms, t_start)  # warm-up (eager), capture, then replays
        graph_ms = graph_ms[3:]  # drop warm-up and capture
        eager_ms = eager_ms[2:]
    else:
        run(graph if graph is not None else step, start, cfg.steps, eager_ms, t_start)
        eager_ms = eager_ms[2:]
    total_s = time.perf_counter() - t_start

    lb, la = loads()
    drops = sum(m.dispatcher.check_drops() for m in moe_layers)
    all_drops = [None] * world
    dist.all_gather_object(all_drops, drops)
    routes = (cfg.steps - start) * layout.dp * per_rank * cfg.seq * cfg.topk * cfg.layers
    return {
        "rank": rank, "world": world, "layout": layout.as_dict(), "device": device.type, "steps": cfg.steps,
        "start_step": start, "resumed": resumed, "history": history,
        "first_loss": history["loss"][0], "final_loss": history["loss"][-1],
        "load_before": lb.tolist(), "load_after": la.tolist(), "dropped_routes": drops,
        "dropped_routes_all_ranks": all_drops, "routes": routes,
        "eager_step_ms": (sum(eager_ms) / len(eager_ms)) if eager_ms else None,
        "graph_step_ms": (sum(graph_ms) / len(graph_ms)) if graph_ms else None,
        "total_s": total_s, "tokens_per_step": tokens_per_step, "config": vars(cfg), "graph_note": note,
        "expert_bias": [m.router.expert_bias.float().cpu().tolist() for m in moe_layers
                        if m.router.enable_expert_bias],
    }


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
def _int_at_least(lo: int):
    def conv(text: str) -> int:
        v = int(text)  # ValueError: argparse says "invalid int value: '...'"
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    conv.__name__ = "int"
    return conv


def _finite_float(lo: float, strict: bool):
    def conv(text: str) -> float:
        v = float(text)  # ValueError: argparse says "invalid float value: '...'"
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>' if strict else '>='} {lo}, got {text}")
        return v

    conv.__name__ = "float"
    return conv


_POS, _NONNEG = _int_at_least(1), _int_at_least(0)
# defaults of the flags that --quick changes (None in the parser: --quick never overrides an explicit value)
_DEFAULTS = {"layers": 2, "batch": 8, "microbatches": 2}
_QUICK = {"steps": 60, "layers": 1, "batch": 8, "microbatches": 1}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_graph.demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + _LAUNCH_HELP)
    p.add_argument("--quick", action="store_true",
                   help="the CI configuration: 60 steps, 1 layer, 1 microbatch (explicit flags still win)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g = p.add_argument_group("parallel layout (world = pp x dp; each stage's dp ranks = ep x expert-dp; dense tensor "
                             "parallelism is not supported)")
    g.add_argument("--pp", type=_POS, default=1, help="pipeline stages (1F1B schedule; default 1)")
    g.add_argument("--vpp", type=_POS, default=None,
                   help="model chunks per pipeline rank: the interleaved schedule (needs --pp > 1)")
    g.add_argument("--ep", type=_POS, default=None,
                   help="expert-parallel ranks, dividing the data-parallel size (default: the data-parallel size)")
    g.add_argument("--dp", type=_POS, default=None,
                   help="data-parallel ranks per stage; without torchrun the demo starts pp x dp processes (default "
                        "dp: --ep, else 2 on CPU / GPUs / pp on CUDA); under torchrun it is world / pp")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=_POS, default=None, help="transformer blocks (default 2; --quick: 1)")
    m.add_argument("--hidden", type=_POS, default=64)
    m.add_argument("--heads", type=_POS, default=4, help="attention heads (must divide --hidden)")
    m.add_argument("--ffn", type=_POS, default=96)
    m.add_argument("--experts", type=_POS, default=8)
    m.add_argument("--topk", type=_POS, default=2)
    m.add_argument("--spare", type=_NONNEG, default=1, help="echo slots per rank (0: no echo)")
    m.add_argument("--assignment", choices=["auto", "greedy", "best_fit"], default="auto",
                   help="echo planner assignment (moe_graph.moe.echo_planner.gen_assignment)")
    m.add_argument("--capacity", type=_finite_float(0.0, False), default=1.25, help="capacity factor (0: dropless)")
    m.add_argument("--aux", type=_finite_float(0.0, False), default=0.01, help="aux load-balancing loss coefficient")
    m.add_argument("--router", choices=["softmax", "deepseek"], default="softmax",
                   help="deepseek: sigmoid scores, group-limited top-k, auxiliary-loss-free expert bias, "
                        "sequence-wise aux loss 1e-4")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_POS, default=None, help="total steps (default 250 on CPU, 400 on CUDA; --quick: "
                                                            "60); a resumed run trains up to this step")
    t.add_argument("--seq", type=_POS, default=64)
    t.add_argument("--batch", type=_POS, default=None, help="sequences per microbatch per data-parallel rank (default 8)")
    t.add_argument("--microbatches", type=_POS, default=None, help="microbatches per step (default 2; --quick: 1)")
    t.add_argument("--lr", type=_finite_float(0.0, True), default=3e-3)
    t.add_argument("--seed", type=_NONNEG, default=0, help="data seed (the global batch of step k is a function of "
                                                           "seed and k)")
    t.add_argument("--log-every", type=_POS, default=None, help="log (and read the loss on the host) every N steps")
    t.add_argument("--no-graph", dest="graph", action="store_false", help="do not use FullIterationGraph")
    o = p.add_argument_group("output and checkpoints")
    o.add_argument("--out", default=None, help="output folder (default: ./moe_graph_demo in the current directory)")
    o.add_argument("--save", default=None, metavar="DIR", help="checkpoint folder (see README: Checkpoints)")
    o.add_argument("--save-every", type=_POS, default=None, metavar="N",
                   help="save every N steps (default with --save: at the end only)")
    o.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint, or from DIR itself if it is one step_* folder")
    return p


_LAUNCH_HELP = """launch:
  python -m moe_graph.demo [flags]                       # starts its own pp x dp processes on this machine
  torchrun --nproc-per-node P -m moe_graph.demo [flags]  # one node, P processes (one per GPU)
  torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m moe_graph.demo [flags]
Dense layers are data-parallel (no tensor parallelism); experts are expert-parallel."""


def _resolve(p: argparse.ArgumentParser, args, env) -> "Layout":  # noqa: F821
    """Fill the defaults and check every flag against the others (``p.error`` names the flag); nothing is written."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    for k, v in (_QUICK if args.quick else {}).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in _DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.steps = args.steps or (400 if args.device == "cuda" else 250)
    args.log_every = args.log_every or max(1, args.steps // 15)
    if env is not None:
        world = env["world"]
    else:
        dp = args.dp or args.ep
        if dp is None:
            dp = max(1, torch.cuda.device_count() // args.pp) if args.device == "cuda" else 2
        world = args.pp * dp
        if args.device == "cuda" and world > torch.cuda.device_count():
            p.error(f"--pp {args.pp} x dp {dp} = {world} processes but only {torch.cuda.device_count()} GPU(s) "
                    "(NCCL needs one GPU per rank; use torchrun for several nodes)")
    try:
        layout = resolve_layout(world, args.pp, args.vpp, args.ep, args.dp)
        P.get_num_layers_per_chunk(args.layers, args.pp, args.vpp)
    except ValueError as e:
        p.error(str(e).replace("num_layers=", "--layers "))
    try:
        P.num_warmup_microbatches(args.microbatches, args.pp, 0, args.vpp)
    except ValueError as e:
        p.error(f"--microbatches {args.microbatches}: {e}")
    args.ep = layout.ep
    if args.experts % layout.ep:
        p.error(f"--experts {args.experts} must be divisible by --ep {layout.ep}")
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be <= --experts {args.experts}")
    if args.save_every is not None and not args.save:
        p.error("--save-every needs --save DIR")
    if args.save and args.save_every is None:
        args.save_every = args.steps
    if args.capacity == 0:
        args.capacity = None
    if args.load:
        try:
            meta = C.read_meta(C.resolve_checkpoint(args.load))
            check_checkpoint_compatible(meta, args, layout)
        except (OSError, ValueError, KeyError) as e:
            p.error(str(e) if str(e).startswith("--") else f"--load {args.load}: {e}")
    args.out = os.path.abspath(args.out or os.path.join(os.getcwd(), "moe_graph_demo"))
    for flag in ("save", "load"):
        if getattr(args, flag):
            setattr(args, flag, os.path.abspath(getattr(args, flag)))
    return layout


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _run(args, env, world: int) -> Dict:
    """Rank 0's summary: the training loop on this process (torchrun, or one rank) or on ``world`` own processes."""
    import torch.distributed as dist

    if env is not None:
        init_distributed(args.device)
        try:
            return _train(env["rank"], env["world"], args)
        finally:
            dist.destroy_process_group()
    if world == 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
        try:
            return _train(0, 1, args)
        finally:
            dist.destroy_process_group()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_distributed(_train, world, args, backend="nccl" if args.device == "cuda" else "gloo",
                           timeout=None)[0]


def main(argv: Optional[List[str]] = None) -> Dict:
    p = _parser()
    args = p.parse_args(argv)

    try:
        env = torchrun_env()
    except RuntimeError as e:
        p.error(str(e))
    layout = _resolve(p, args, env)
    writer = env is None or env["rank"] == 0  # the process that writes the summary and prints the report
    out_dir = args.out
    summary_path = os.path.join(out_dir, "demo_summary.json")
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        if not args.load and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
            os.remove(os.path.join(out_dir, "metrics.jsonl"))  # a new run; a resumed one appends
        _write_json_atomic(summary_path, {"finished": False, "status": "running", "config": vars(args)})
    t0 = time.perf_counter()
    try:
        summary = _run(args, env, layout.world)
    except BaseException as exc:
        if writer:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            _write_json_atomic(summary_path, {"finished": False, "status": status, "error": repr(exc)[:4000],
                                              "config": vars(args), "wall_s": time.perf_counter() - t0})
        raise
    wall = time.perf_counter() - t0
    if not writer:
        return summary
    _report(summary)
    png = os.path.join(out_dir, "demo.png")
    how = _plot(summary, png)
    summary["wall_s"] = wall
    summary["config"] = {k: v for k, v in vars(args).items()}
    summary["env"] = environment()  # torch / CUDA versions, the commit measured, date
    summary["finished"], summary["status"] = True, "finished"
    _write_json_atomic(summary_path, summary)
    print(f"wrote {png} ({how}), {summary_path} and {os.path.join(out_dir, 'metrics.jsonl')}; total {wall:.1f} s")
    print(f"output folder: {out_dir}")
    return summary


def _report(summary: Dict) -> None:
    lb, la = summary["load_before"][0], summary["load_after"][0]
    print("\nper-rank load of layer 0 at the last step (tokens received by each EP rank's experts):")
    print("  rank   " + " ".join(f"{r:>7d}" for r in range(len(lb))) + "   max/mean")
    for name, v in (("before", lb), ("echo  ", la)):
        print(f"  {name} " + " ".join(f"{int(x):>7d}" for x in v) + f"   {max(v) / (sum(v) / len(v)):.3f}")
    h = summary["history"]
    n = len(h["imb_before"])
    print(f"mean max/mean load over training: {sum(h['imb_before']) / n:.3f} without echo -> "
          f"{sum(h['imb_after']) / n:.3f} with echo; dropped routes over capacity (all ranks): "
          f"{sum(summary['dropped_routes_all_ranks'])}")
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in steps {summary['start_step'] + 1}-"
          f"{summary['steps']}; {sum(h['tok_s'][1:]) / max(len(h['tok_s']) - 1, 1):.0f} tokens/s")
    if summary["graph_step_ms"] is not None:
        e, g = summary["eager_step_ms"], summary["graph_step_ms"]
        print(f"step time: eager {e:.2f} ms, full-iteration CUDA graph {g:.2f} ms ({e / g:.2f}x)")
    else:
        ms = summary["eager_step_ms"]
        print(f"step time: eager {ms:.1f} ms ({summary['graph_note']})" if ms else summary["graph_note"])


if __name__ == "__main__":
    main()
