"""Multi-process workers and references for the DDP / distributed-optimizer tests.

Every ``*_worker(rank, world_size, ...)`` runs inside :func:`moe_graph.testing.distributed.run_distributed`
and returns plain CPU tensors / numbers. The single-process references (plain
``torch.optim.AdamW`` on the whole batch) live here too so that tests and workers share the model
and data definitions.
"""

from __future__ import annotations

import io
from typing import Dict, List

import torch
import torch.distributed as dist

from ..ddp import DistributedDataParallel
from ..optimizer import DistributedOptimizer, DynamicLossScaler

IN, HID, OUT = 12, 40, 6


def pack(obj) -> bytes:
    """Serialize a result with ``torch.save``: tensors sent through the multiprocessing queue as-is
    would be shared via file descriptors that vanish when the worker exits."""
    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def unpack(blob: bytes):
    """Inverse of :func:`pack`."""
    return torch.load(io.BytesIO(blob), weights_only=False)


def run(fn, world_size: int, *args):
    """``run_distributed`` for the workers below; returns the unpacked per-rank results."""
    from .distributed import run_distributed

    return [unpack(b) for b in run_distributed(fn, world_size, *args)]
GLOBAL_BATCH = 16


class TinyModel(torch.nn.Module):
    """Two dense layers and an "expert" layer (``allreduce = False``), with biases."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HID)
        self.expert = torch.nn.Linear(HID, HID)
        self.fc2 = torch.nn.Linear(HID, OUT)
        for p in self.expert.parameters():
            p.allreduce = False

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        h = h + torch.tanh(self.expert(h))
        return self.fc2(h)


def make_model(dtype=torch.float32, seed=0) -> TinyModel:
    torch.manual_seed(seed)
    m = TinyModel()
    return m.to(dtype)


def batch(step: int, n: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()


def reference_adamw(steps: int, dtype=torch.float32, lr=1e-2, weight_decay=0.1, clip=0.0, start=None,
                    start_opt=None) -> Dict[str, torch.Tensor]:
    """Plain ``torch.optim.AdamW`` on one process over the global batches; fp32 master weights.

    For 16-bit runs the reference starts from the 16-bit-rounded initial weights, kept in fp32.
    """
    m = make_model(dtype).float()
    if start is not None:
        m.load_state_dict(start)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    if start_opt is not None:
        opt.load_state_dict(start_opt)
    for it in range(steps):
        x, y = batch(it)
        opt.zero_grad()
        loss_fn(m(x), y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _local(x, rank, ws):
    n = x.shape[0] // ws
    return x[rank * n:(rank + 1) * n]


def _train(ddp, opt, rank, ws, steps, first_step=0, microbatches=1):
    out = []
    for it in range(first_step, first_step + steps):
        x, y = batch(it)
        x, y = _local(x, rank, ws), _local(y, rank, ws)
        ddp.zero_grad_buffer()
        xs, ys = x.chunk(microbatches), y.chunk(microbatches)
        with ddp.no_sync():
            for mx, my in zip(xs[:-1], ys[:-1]):
                (loss_fn(ddp(mx.to(_dtype(ddp))), my) / microbatches).backward()
        (loss_fn(ddp(xs[-1].to(_dtype(ddp))), ys[-1]) / microbatches).backward()
        if ddp.overlap_grad_reduce:
            out.append(all(g.grad_reduce_dispatched for g in ddp.all_bucket_groups))
        opt.step()
    return out


def _dtype(ddp):
    return next(ddp.module.parameters()).dtype


def _params(module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    g = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(g, t.contiguous())
    return all(torch.equal(g[0], x) for x in g)


# ----------------------------------------------------------------------------------------------
def train_worker(rank: int, ws: int, configs: List[dict]) -> List[dict]:
    """Train ``TinyModel`` with DDP + DistributedOptimizer for each config; return rank-0 params.

    Config keys: ``dtype``, ``steps``, ``overlap`` (bool), ``bucket_size``, ``grad_fp32``, ``impl``,
    ``clip``, ``microbatches``.
    """
    results = []
    expert_group = dist.new_group(list(range(ws)))  # a distinct group object for the expert buffers
    for cfg in configs:
        dtype = cfg.get("dtype", torch.float32)
        model = make_model(dtype)
        ddp = DistributedDataParallel(
            model, use_distributed_optimizer=True, overlap_grad_reduce=cfg.get("overlap", False),
            bucket_size=cfg.get("bucket_size"), grad_reduce_in_fp32=cfg.get("grad_fp32", True),
            expert_data_parallel_group=expert_group)
        opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, impl=cfg.get("impl", "tensor"),
                                   clip_grad=cfg.get("clip", 0.0))
        dispatched = _train(ddp, opt, rank, ws, cfg.get("steps", 3), microbatches=cfg.get("microbatches", 1))
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        results.append({
            "params": _params(model),
            "consistent": _same_on_all_ranks(flat),
            "n_buckets": sum(len(b.buckets) for b in ddp.all_buffers),
            "n_expert_buffers": len(ddp.expert_parallel_buffers),
            "dispatched_in_backward": dispatched,
            "step": float(opt.step_count),
        })
    return pack(results)


def memory_worker(rank: int, ws: int) -> Dict[str, float]:
    """Bytes per parameter counted from the storages actually allocated by buffers and optimizer."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64, bias=False)
            self.b = torch.nn.Linear(64, 64, bias=False)
            self.c = torch.nn.Linear(64, 64, bias=False)

    out = {}
    for name, dtype, grad_fp32 in [("fp32/fp32", torch.float32, True), ("bf16/fp32", torch.bfloat16, True),
                                   ("bf16/bf16", torch.bfloat16, False), ("fp16/fp16", torch.float16, False)]:
        torch.manual_seed(0)
        model = Plain().to(dtype)
        nparams = sum(p.numel() for p in model.parameters())
        ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=grad_fp32)
        opt = DistributedOptimizer(ddp, lr=1e-3)
        storages = {}
        tensors = []
        for b in ddp.all_buffers:
            tensors += [b.param_data, b.grad_data]
        tensors += [t for t in opt.state_tensors() if t.dim() > 0]
        for t in tensors:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        # the model's parameters must live inside the param buffers (no second copy)
        owned = {b.param_data.untyped_storage().data_ptr() for b in ddp.all_buffers}
        assert all(p.untyped_storage().data_ptr() in owned for p in model.parameters())
        assert all(p.main_grad.untyped_storage().data_ptr() in storages for p in model.parameters())
        out[name] = sum(storages.values()) / nparams
    return pack(out)


def inf_and_scaler_worker(rank: int, ws: int) -> dict:
    """An inf grad on one rank skips the update on every rank and backs the loss scale off."""
    model = make_model(torch.float32)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    scaler = DynamicLossScaler(initial_scale=1024.0, hysteresis=1, growth_interval=2)
    opt = DistributedOptimizer(ddp, lr=1e-2, loss_scaler=scaler)
    res = {"scales": [], "ok": [], "changed": []}
    for it in range(4):
        x, y = batch(it)
        x, y = _local(x, rank, ws), _local(y, rank, ws)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        ddp.zero_grad_buffer()
        (loss_fn(ddp(x), y) * opt.loss_scale).backward()
        if it == 1 and rank == ws - 1:
            model.fc1.weight.main_grad[0, 0] = float("inf")
        ok, _ = opt.step()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        res["ok"].append(bool(ok))
        res["changed"].append(not torch.equal(before, after))
        res["scales"].append(float(scaler.scale))
    res["step"] = float(opt.step_count)
    return pack(res)


def checkpoint_save_worker(rank: int, ws: int, path: str, dtype, steps_before: int) -> Dict[str, torch.Tensor]:
    """Train ``steps_before`` steps, save model + optimizer state, train one more step; return params."""
    model = make_model(dtype)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1)
    _train(ddp, opt, rank, ws, steps_before)
    sd = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": sd}, path)
    dist.barrier()
    _train(ddp, opt, rank, ws, 1, first_step=steps_before)
    return pack({"params": _params(model), "main": _main_params(opt, model)})


def checkpoint_load_worker(rank: int, ws: int, path: str, dtype, steps_before: int, dp_size: int = None) -> dict:
    """Load the checkpoint at DP size ``dp_size`` (subgroups of consecutive ranks when smaller than
    the world), check the state round trip, train the next step."""
    dp_size = dp_size or ws
    groups = [dist.new_group(list(range(s, s + dp_size))) for s in range(0, ws, dp_size)]
    group = groups[rank // dp_size]
    dp_rank = rank % dp_size
    model = make_model(dtype, seed=123)  # different init: everything must come from the checkpoint
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                  data_parallel_group=group)
    opt = DistributedOptimizer(ddp, lr=5.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    ck = torch.load(path, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    again = opt.state_dict()
    exact = all(torch.equal(again["params"][k][f], ck["optim"]["params"][k][f])
                for k in ck["optim"]["params"] for f in ("main_param", "exp_avg", "exp_avg_sq"))
    exact = exact and torch.equal(again["step"], ck["optim"]["step"])
    _train(ddp, opt, dp_rank, dp_size, 1, first_step=steps_before)
    return pack({"params": _params(model), "main": _main_params(opt, model), "roundtrip_exact": exact,
                 "dp_size": ddp.data_parallel_world_size, "n_shards": len(opt.shards)})


def _main_params(opt, model) -> Dict[str, torch.Tensor]:
    return {k: v["main_param"] for k, v in opt.state_dict()["params"].items()}


def allreduce_and_hooks_worker(rank: int, ws: int) -> dict:
    """Without the distributed optimizer: main_grad is the average of the ranks' grads (pre-scaled
    sum, and ``ReduceOp.AVG`` with ``average_in_collective``)."""
    out = {}
    for avg in (False, True):
        model = make_model(torch.float32)
        ddp = DistributedDataParallel(model, overlap_grad_reduce=True, bucket_size=200, average_in_collective=avg)
        x, y = batch(0)
        ddp.zero_grad_buffer()
        loss_fn(ddp(_local(x, rank, ws)), _local(y, rank, ws)).backward()
        ddp.finish_grad_sync()
        out["avg" if avg else "sum"] = {
            "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
            "n_groups": len(ddp.all_bucket_groups),
            "grad_is_none": all(p.grad is None for p in model.parameters())}
    return pack(out)


def suite_worker(rank: int, ws: int, tasks: dict) -> bytes:
    """Run several checks in one spawn (each spawn costs seconds of imports).

    ``tasks`` keys: ``train`` (list of configs for :func:`train_worker`), ``memory`` (bool),
    ``inf`` (bool), ``allreduce`` (bool), ``save`` (``(path, dtype, steps_before)``), ``load``
    (``(path, dtype, steps_before, dp_size)``; runs after ``save``).
    Returns a packed dict with the same keys.
    """
    out = {}
    if tasks.get("train"):
        out["train"] = unpack(train_worker(rank, ws, tasks["train"]))
    if tasks.get("memory"):
        out["memory"] = unpack(memory_worker(rank, ws))
    if tasks.get("inf"):
        out["inf"] = unpack(inf_and_scaler_worker(rank, ws))
    if tasks.get("allreduce"):
        out["allreduce"] = unpack(allreduce_and_hooks_worker(rank, ws))
    if tasks.get("save"):
        out["save"] = unpack(checkpoint_save_worker(rank, ws, *tasks["save"]))
        dist.barrier()
    if tasks.get("load"):
        out["load"] = unpack(checkpoint_load_worker(rank, ws, *tasks["load"]))
    return pack(out)
