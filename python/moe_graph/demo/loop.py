"""One rank's training run (:func:`train`), the same under torchrun and under the demo's own processes.

:class:`Trainer` builds the rank's part of the model (its pipeline stages, their DDP wrappers, the ZeRO-1
optimizer and the train step), resumes from a checkpoint, runs the steps (eager, or through
:class:`moe_graph.cuda_graph.FullIterationGraph`) with periodic logging and checkpoints, and returns the summary.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import FullIterationGraph
from moe_graph.demo.data import CharData, build_corpus
from moe_graph.demo.model import MoETransformerLM, moe_options
from moe_graph.demo.report import append_metrics, metrics_record, progress_line
from moe_graph.distributed.agreement import AllOrNone
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.launch import Layout, StopRequest, resolve_layout
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.train import checkpoint, schedules
from moe_graph.train.step import OverflowRerun, make_train_step

__all__ = ["CHECKPOINT_MODEL_KEYS", "check_checkpoint_compatible", "Trainer", "train"]

# the flags that define the model: a checkpoint resumes only into the same values
CHECKPOINT_MODEL_KEYS = ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq", "router", "spare")


def check_checkpoint_compatible(meta: Dict, cfg, layout: Layout) -> None:
    """Raise ``ValueError`` naming the flag when the run cannot resume from the checkpoint ``meta``."""
    saved = meta["model"]
    for k in CHECKPOINT_MODEL_KEYS:
        if saved.get(k) != getattr(cfg, k):
            raise ValueError(f"--load: the checkpoint was saved with --{k} {saved.get(k)}, this run uses "
                             f"--{k} {getattr(cfg, k)} (the model must be the same)")
    if meta["step"] >= cfg.steps:
        raise ValueError(f"--steps {cfg.steps}: the checkpoint is at step {meta['step']}; nothing left to train")


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


def train(rank: int, world: int, cfg) -> Dict:
    """The training run of one rank; expects ``torch.distributed`` initialized (any world size, 1 included).
    Returns the rank's summary (:meth:`Trainer.summary`)."""
    layout = resolve_layout(world, cfg.pp, cfg.vpp, cfg.ep)
    is_cuda = cfg.device == "cuda"
    if is_cuda and os.environ.get("LOCAL_RANK") is None:  # own processes on one machine (torchrun: LOCAL_RANK)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    ps.initialize_model_parallel(pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
                                 virtual_pipeline_model_parallel_size=layout.vpp)
    # SIGTERM: every rank stops after the same step (agreed over a CPU group: no device sync)
    stop = StopRequest(cfg.stop_grace, group=dist.new_group(backend="gloo") if is_cuda else None,
                       announce=rank == 0).install()
    try:
        trainer = Trainer(rank, world, cfg, layout, device, dtype)
        trainer.stop = stop
        if cfg.load:
            trainer.resume(cfg.load)
        trainer.describe()
        trainer.run()
        return trainer.summary()
    finally:
        stop.uninstall()
        ps.destroy_model_parallel()


class Trainer:
    """One rank's training run: built by the constructor (under an initialized ``parallel_state``), then
    :meth:`resume` (optional), :meth:`run` and :meth:`summary`. Host-side bookkeeping only (history, timings):
    nothing here is read inside the captured step."""

    def __init__(self, rank: int, world: int, cfg, layout: Layout, device: torch.device, dtype: torch.dtype):
        self.rank, self.world, self.cfg, self.layout, self.device = rank, world, cfg, layout, device
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.ep_rank, self.edp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
        ep_group = ps.get_expert_model_parallel_group()
        self.data = CharData(build_corpus(seed=0))
        # the same seed on the expert-data-parallel replicas of a shard; dense weights are broadcast below
        torch.manual_seed(1234 + 7919 * self.pp_rank + self.ep_rank)
        chunk_ids = schedules.chunk_layer_ids(cfg.layers, layout.pp, self.pp_rank, layout.vpp)
        moe_kwargs = moe_options(cfg, ep_group, layout.ep)
        self.stages = [MoETransformerLM(cfg, self.data.vocab_size, moe_kwargs, device, dtype, layer_ids=ids,
                                        first=self.pp_rank == 0 and c == 0,
                                        last=self.pp_rank == layout.pp - 1 and c == len(chunk_ids) - 1)
                       for c, ids in enumerate(chunk_ids)]
        ddps = [DistributedDataParallel(s, use_distributed_optimizer=True,
                                        data_parallel_group=ps.get_data_parallel_group(),
                                        expert_data_parallel_group=ps.get_expert_data_parallel_group())
                for s in self.stages]
        for d in ddps:
            d.broadcast_params()
        model = ddps if layout.vpp else ddps[0]
        self.opt = DistributedOptimizer(model, lr=cfg.lr, weight_decay=0.0, clip_grad=1.0,
                                        expert_model_parallel_group=ep_group)
        # the training step (moe_graph.train.step): microbatches through the layout's pipeline schedule with
        # no_sync on all but the last, MoE aux-loss gradient scale, the optimizer step, the expert-bias update
        step_kwargs = dict(tensor_shape=(cfg.batch, cfg.seq, cfg.hidden), dtype=dtype, overflow=cfg.overflow)
        if getattr(cfg, "fp8", None):  # the experts' GEMMs in FP8 (moe_graph.fp8 recipes)
            step_kwargs["fp8_recipe"] = cfg.fp8
        self.step = make_train_step(model, self.opt, **step_kwargs)
        self.rerun = self.overflow_rerun(model, step_kwargs)
        self.reran = False  # whether the last step reran (host value)
        self.moe_layers = [m for s in self.stages for m in s.moe_layers()]
        self.samples_per_step = layout.dp * cfg.microbatches * cfg.batch  # the global batch, in sequences
        self.start, self.resumed = 0, None
        self.stop: Optional[StopRequest] = None  # checked after every step; train() installs one
        self.stopped: Optional[Dict] = None  # {"step", "reason", "checkpoint"} when the run stopped on request
        self.history: Dict[str, List] = {k: [] for k in ("step", "loss", "grad_norm", "skipped", "imb_before",
                                                         "imb_after", "tok_s")}
        self.eager_ms: List[float] = []
        self.graph_ms: List[float] = []
        self.graph_note = "graph disabled (--no-graph)"
        self.total_s = 0.0
        self.t_start = time.perf_counter()
        self.metrics_path = os.path.join(cfg.out, "metrics.jsonl")

    def overflow_rerun(self, model, step_kwargs) -> Optional[OverflowRerun]:
        """The dropless mode's rerun and adaptive capacity (``--overflow rerun``, ``--rerun-window``,
        ``--rerun-threshold``), or ``None`` in drop mode."""
        cfg = self.cfg
        if cfg.overflow != "rerun":
            return None
        return OverflowRerun(model, self.opt, window=cfg.rerun_window,
                             threshold=None if cfg.rerun_threshold >= 1 else cfg.rerun_threshold, **step_kwargs)

    def train_one(self, fn: Callable, microbatches):
        """One step through ``fn`` (the eager step or the graph); in dropless mode rerun when it overflowed."""
        if self.rerun is None:
            return fn(microbatches)
        before = self.rerun.reruns
        res = self.rerun.step(fn, microbatches)
        self.reran = self.rerun.reruns > before
        return res

    def dropless_record(self) -> Dict:
        """The metrics fields of the dropless mode (host values): this step reran, the reruns so far, their
        rate and the capacity factor in use."""
        if self.rerun is None:
            return {}
        st = self.rerun.statistics()
        return {"reran": self.reran, "reruns": st["reruns"], "rerun_rate": st["rerun_rate"],
                "capacity_factor": st["capacity_factor"]}

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def model_tensors(self) -> Dict[str, torch.Tensor]:
        """This rank's model tensors under their whole-model names (views: writing one writes the model)."""
        out: Dict[str, torch.Tensor] = {}
        for stage in self.stages:
            out.update(checkpoint.global_tensors(stage, self.ep_rank))
        return out

    # ---------------------------------------------------------------------------------------------- resume --
    def naming(self) -> Dict:
        """How this rank's optimizer names map to whole-model names (:func:`moe_graph.train.checkpoint.naming_of`)."""
        return checkpoint.naming_of(self.stages, self.ep_rank)

    def resume(self, path: str) -> None:
        """Load the model and the optimizer state from ``path``, saved at any pipeline / virtual pipeline / expert /
        data-parallel layout of the same model (each rank reads only the files holding its tensors; the ZeRO-1
        state is resharded to this rank's parameters and data-parallel shard), the dropless mode's adapted capacity,
        and, with the same layout, the RNG states; every rank fails together if any rank cannot read its part."""
        cfg, layout = self.cfg, self.layout
        t_load = time.perf_counter()
        # every rank fails together on any error (none waits in the optimizer's collectives), naming the file
        with AllOrNone(f"--load {path}", action="read its part of the checkpoint",
                       outcome="nothing was loaded") as step:
            step.at(f"reading {path} (expected a checkpoint root or a step_* folder)")
            folder = checkpoint.resolve_checkpoint(path)
            meta = checkpoint.read_meta(folder)
            step.at(f"{folder}/meta.json: comparing its model and layout with this run's")
            check_checkpoint_compatible(meta, cfg, layout)
            step.at(f"reading this rank's model tensors from {folder}")
            mine = self.model_tensors()
            plan = checkpoint.copy_plan(mine, checkpoint.read_model_state(folder, meta, wanted=mine))
            step.at(f"reading and resharding this rank's optimizer state from {folder}")
            target, naming = self.opt.checkpoint_metadata(), self.naming()
            ranks = checkpoint.files_holding(meta, "optim", checkpoint.optimizer_tensor_names(target, naming))
            saved = checkpoint.read_optimizer_shards(folder, ranks, migrate=meta["format"] == checkpoint.FORMAT_V1)
            shards = checkpoint.reshard_optimizer(saved, [meta["index"][r]["naming"] for r in ranks], target, naming)
            # per-rank RNG streams carry over only to the same rank of the same layout
            step.at(f"reading this rank's RNG state from {folder}")
            rng = (checkpoint.read_rank_state(folder, self.rank).get("rng") if meta["layout"] == layout.as_dict()
                   else None)
        self.opt.load_state_dict(shards, verify_checksum=False)  # the files' checksums were checked on reading
        with torch.no_grad():
            for dst, src in plan:
                dst.copy_(src)
        self.start = meta["step"]
        if self.rerun is not None and meta.get("dropless"):
            self.rerun.load_state_dict(meta["dropless"])  # the adapted capacity and the rerun counts
        if rng is not None:
            _set_rng_state(rng)
        self.resumed = {"from": folder, "step": self.start, "layout": meta["layout"],
                        "rng": "restored" if rng is not None else
                        "fresh (other layout)" if meta["layout"] != layout.as_dict() else "fresh (none saved)"}
        saved = Layout(**meta["layout"])
        self.say(f"resumed from {folder} at step {self.start} (saved at {saved}"
                 f"{'' if saved == layout else ', resharded'}; RNG {self.resumed['rng']}; "
                 f"{time.perf_counter() - t_load:.2f} s)")

    def describe(self) -> None:
        cfg, layout = self.cfg, self.layout
        n_params = sum(p.numel() for s in self.stages for p in s.parameters())
        self.say(f"moe_graph demo: {layout} on {self.device.type} ({dist.get_backend()}), "
                 f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.topk} "
                 f"({cfg.experts // layout.ep} per rank + {cfg.spare} echo slot(s)), capacity factor {cfg.capacity} "
                 f"(overflow: {cfg.overflow}), "
                 f"{n_params / 1e3:.0f}k params on rank 0, vocab {self.data.vocab_size}, {cfg.microbatches} x "
                 f"{cfg.batch} x {cfg.seq} tokens per data-parallel rank per step")
        if self.moe_layers:
            mib = self.moe_layers[0].echo_buffer_bytes(cfg.microbatches)["total"] / 2**20
            self.say(f"echo buffers per MoE layer: {mib:.2f} MiB (moe_graph.moe.echo.echo_buffer_bytes)")
        else:
            self.say("echo buffers: no MoE layer on this rank")

    # ---------------------------------------------------------------------------------------------- saving --
    def save(self, step: int) -> str:
        """A checkpoint at ``step`` (a collective): dense tensors from data-parallel rank 0 of each stage, experts
        from expert-data-parallel rank 0, each under its whole-model name. Returns its folder."""
        cfg, layout = self.cfg, self.layout
        state = {k: v for k, v in self.model_tensors().items()
                 if (self.edp_rank == 0 if checkpoint.is_expert_name(k) else self.dp_rank == 0)}
        coords = {"rank": self.rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "ep_rank": self.ep_rank,
                  "edp_rank": self.edp_rank}
        all_coords = [None] * self.world
        dist.all_gather_object(all_coords, coords)
        t0 = time.perf_counter()
        folder = checkpoint.save_checkpoint(
            cfg.save, step, rank=self.rank, world=self.world, model_state=state, optimizer=self.opt,
            naming=self.naming(),
            rank_state={"rng": _rng_state(), "data": {"step": step, "samples": step * self.samples_per_step},
                        "coords": coords},
            meta={"layout": layout.as_dict(), "coords": all_coords,
                  "model": {k: getattr(cfg, k) for k in CHECKPOINT_MODEL_KEYS},
                  "data": {"step": step, "seed": cfg.seed, "global_batch": self.samples_per_step},
                  "dropless": self.rerun.state_dict() if self.rerun is not None else None})
        self.say(f"saved {folder} ({time.perf_counter() - t0:.2f} s)")
        return folder

    # ------------------------------------------------------------------------------------------------- run --
    def microbatches(self, step: int):
        cfg = self.cfg
        return self.data.step_microbatches(cfg.seed, step, self.layout.dp, self.dp_rank, cfg.microbatches,
                                           cfg.batch, cfg.seq, self.device)

    def loads(self):
        """Tokens per expert-parallel rank ``[layers, R]`` before and after echo at the last step (host copies)."""
        lb = torch.stack([m.last_load_before for m in self.moe_layers]).float().cpu()
        la = torch.stack([m.last_load_after for m in self.moe_layers]).float().cpu()
        return lb, la

    def log(self, step: int, res, n_steps: int, t_window: float) -> float:
        """Read step ``step``'s loss, grad norm and skipped flag on the host (outside the graph), record and print
        them with the tokens/s of the ``n_steps`` steps since ``t_window``; returns the time the window ends."""
        last_stage = self.stages[-1].last
        red = torch.stack([res.loss.float() if last_stage else torch.zeros((), device=self.device),
                           res.grad_norm.float().reshape(()), res.skipped.float().reshape(())])
        dist.all_reduce(red)  # the loss of the last stages (already the data-parallel mean)
        lb, la = self.loads()
        now = time.perf_counter()
        tok_s = self.samples_per_step * self.cfg.seq * n_steps / max(now - t_window, 1e-9)
        rec = metrics_record(step + 1, float(red[0]) / self.layout.dp,
                             float(red[1]) / self.world,  # every rank holds the same global norm and skipped flag
                             bool(red[2] > 0), lb, la, tok_s)
        rec.update(self.dropless_record())
        for k, v in rec.items():
            self.history.setdefault(k, []).append(v)
        if self.rank == 0:
            append_metrics(self.metrics_path, rec)
        self.say(progress_line(rec, self.cfg.steps, time.perf_counter() - self.t_start))
        return now

    def run_steps(self, fn: Callable, first: int, last: int, times: List[float]) -> None:
        """Steps ``first .. last - 1`` through ``fn`` (the eager step or the graph), each timed into ``times``;
        logs every ``--log-every`` steps and the first and last, saves every ``--save-every`` and at the end.
        A stop request (:attr:`stop`, agreed by all ranks after each step) ends the run after that step, logged and
        saved (with ``--save``), in :attr:`stopped`."""
        cfg = self.cfg
        t_window, n_steps = time.perf_counter(), 0
        for it in range(first, last):
            t0 = time.perf_counter()
            res = self.train_one(fn, self.microbatches(it))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            n_steps += 1
            stop = self.stop is not None and self.stop.agreed()
            if (it + 1) % cfg.log_every == 0 or it == last - 1 or it == first or stop:
                t_window, n_steps = self.log(it, res, n_steps, t_window), 0
            folder = None
            if cfg.save and ((it + 1) % cfg.save_every == 0 or it == cfg.steps - 1 or stop):
                folder = self.save(it + 1)
            if stop:
                self.stopped = {"step": it + 1, "reason": self.stop.reason, "checkpoint": folder}
                return

    def run(self) -> None:
        """Train from :attr:`start` to ``--steps``: through the full-iteration graph where it applies (one CUDA
        graph with ``pp = 1``; on a GPU the first steps run eagerly for the eager-vs-graph timing), else eagerly."""
        cfg = self.cfg
        self.t_start = time.perf_counter()
        graph = None
        if cfg.graph and self.layout.pp > 1:
            self.graph_note = ("eager: the full-iteration graph is not used with pipeline parallelism "
                               "(point-to-point schedule)")
        elif cfg.graph:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the note is printed once below instead of a warning per rank
                graph = FullIterationGraph(self.step, warmup_steps=2)
            self.graph_note = graph.note
            if not graph.enabled:
                self.say(f"note: {graph.note}")
        if self.device.type == "cuda" and graph is not None and graph.enabled:
            n_eager = max(4, min(20, (cfg.steps - self.start) // 4))
            self.run_steps(self.step, self.start, self.start + n_eager, self.eager_ms)  # plain eager steps, timed
            if self.stopped is None:
                self.run_steps(graph, self.start + n_eager, cfg.steps, self.graph_ms)  # warm-up, capture, replays
            self.graph_ms = self.graph_ms[3:]  # without warm-up and capture
        else:
            self.run_steps(graph if graph is not None else self.step, self.start, cfg.steps, self.eager_ms)
        self.eager_ms = self.eager_ms[2:]
        self.total_s = time.perf_counter() - self.t_start

    # ---------------------------------------------------------------------------------------------- report --
    def summary(self) -> Dict:
        """The rank's summary: history, loads before/after echo at the last step, drops (a collective), timings."""
        cfg, layout = self.cfg, self.layout
        lb, la = self.loads()
        drops = sum(m.dispatcher.check_drops() for m in self.moe_layers)
        all_drops = [None] * self.world
        dist.all_gather_object(all_drops, drops)
        h = self.history
        return {
            "rank": self.rank, "world": self.world, "layout": layout.as_dict(), "device": self.device.type,
            "steps": cfg.steps, "start_step": self.start, "resumed": self.resumed, "stopped": self.stopped,
            "history": h,
            "first_loss": h["loss"][0], "final_loss": h["loss"][-1],
            "load_before": lb.tolist(), "load_after": la.tolist(), "dropped_routes": drops,
            "dropped_routes_all_ranks": all_drops,
            "routes": ((self.stopped or {}).get("step", cfg.steps) - self.start) * self.samples_per_step * cfg.seq
                      * cfg.topk * cfg.layers,
            "eager_step_ms": _mean(self.eager_ms), "graph_step_ms": _mean(self.graph_ms),
            "total_s": self.total_s, "tokens_per_step": self.samples_per_step * cfg.seq, "config": vars(cfg),
            "graph_note": self.graph_note,
            "dropless": self.rerun.statistics() if self.rerun is not None else None,
            "expert_bias": [m.router.expert_bias.float().cpu().tolist() for m in self.moe_layers
                            if m.router.enable_expert_bias],
        }


def _mean(xs: List[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None
