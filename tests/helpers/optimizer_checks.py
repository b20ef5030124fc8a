"""Multi-process workers and references for the DDP / distributed-optimizer tests.

Every ``*_worker(rank, world_size, ...)`` runs inside :func:`moe_graph.distributed.launch.run_distributed`
and returns plain CPU tensors / numbers. The single-process references (plain
``torch.optim.AdamW`` on the whole batch) live here too so that tests and workers share the model
and data definitions.
"""

from __future__ import annotations

import io
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from helpers import Injected
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.launch import run_distributed
from moe_graph.distributed.optimizer import DistributedOptimizer, DynamicLossScaler
from moe_graph.train.checkpoint import global_tensors, is_expert_name

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


def shard_path(prefix: str, rank: int) -> str:
    """The file of data-parallel rank ``rank`` of a sharded checkpoint."""
    return f"{prefix}.rank{rank}.pt"


def assemble_shards(shards: List[dict]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Full flattened per-parameter tensors from every shard of a sharded optimizer state (no EP);
    asserts that the pieces tile each parameter exactly."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, m in shards[0]["metadata"]["params"].items():
        numel = int(torch.Size(m["shape"]).numel())
        pieces = sorted((sd["shard"][name] for sd in shards if name in sd["shard"]), key=lambda e: e["range"])
        assert [e["range"][0] for e in pieces] == [0] + [e["range"][1] for e in pieces[:-1]], name
        assert pieces[-1]["range"][1] == numel, name
        out[name] = {k: torch.cat([e[k] for e in pieces]) for k in pieces[0] if k != "range"}
    return out


def _gather_shards(opt, group=None) -> List[dict]:
    sds = [None] * dist.get_world_size(group)
    dist.all_gather_object(sds, opt.state_dict(), group=group)
    return sds


def _main_params(opt, model, group=None) -> Dict[str, torch.Tensor]:
    """Full fp32 main params (the model's own params where they are fp32) from the group's shards."""
    full = assemble_shards(_gather_shards(opt, group))
    return {n: full[n]["main_param"].view(p.shape) if "main_param" in full[n] else p.detach().float().clone()
            for n, p in model.named_parameters()}


def checkpoint_save_worker(rank: int, ws: int, prefix: str, dtype, steps_before: int) -> dict:
    """Train ``steps_before`` steps, save model + this rank's optimizer shard to its own file, train
    one more step; return the params, the full main params and the sizes of the saved shard."""
    model = make_model(dtype)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1)
    _train(ddp, opt, rank, ws, steps_before)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, shard_path(prefix, rank))
    dist.barrier()
    saved = torch.load(shard_path(prefix, rank), weights_only=True)["optim"]
    fields = {}
    for e in saved["shard"].values():
        for k, t in e.items():
            if k != "range":
                fields[k] = fields.get(k, 0) + t.numel()
                # each tensor owns its storage: no bucket-sized storage behind a saved slice
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    _train(ddp, opt, rank, ws, 1, first_step=steps_before)
    return pack({"params": _params(model), "main": _main_params(opt, model), "shard_numel": fields,
                 "numel": sum(p.numel() for p in model.parameters()),
                 "padding": sum(b.numel - sum(p.numel() for p in b.params) for b in ddp.all_buffers),
                 "shard_bound": sum(b.numel // b.data_parallel_world_size for b in ddp.all_buffers),
                 "metadata": {k: v for k, v in saved["metadata"].items() if k != "params"}})


def _dp_subgroup(rank: int, ws: int, dp_size: int):
    """Consecutive-rank groups of ``dp_size`` (every rank creates every group); this rank's one."""
    groups = [dist.new_group(list(range(s, s + dp_size))) for s in range(0, ws, dp_size)]
    return groups[rank // dp_size]


def checkpoint_load_worker(rank: int, ws: int, prefix: str, dtype, steps_before: int, dp_size: int = None,
                           saved_ws: int = None) -> dict:
    """Load the ``saved_ws`` files of a sharded checkpoint at DP size ``dp_size`` (subgroups of
    consecutive ranks when smaller than the world), check the state round trip, train the next step."""
    dp_size, saved_ws = dp_size or ws, saved_ws or ws
    group = _dp_subgroup(rank, ws, dp_size)
    dp_rank = rank % dp_size
    model = make_model(dtype, seed=123)  # different init: everything must come from the checkpoint
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                  data_parallel_group=group)
    opt = DistributedOptimizer(ddp, lr=5.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    files = [torch.load(shard_path(prefix, r), weights_only=True) for r in reversed(range(saved_ws))]
    model.load_state_dict(files[0]["model"])
    opt.load_state_dict([f["optim"] for f in files])
    saved = assemble_shards([f["optim"] for f in files])
    again = assemble_shards(_gather_shards(opt, group))
    exact = set(saved) == set(again) and all(
        set(saved[k]) == set(again[k]) and all(torch.equal(again[k][f], saved[k][f]) for f in saved[k])
        for k in saved)
    exact = exact and torch.equal(opt.step_count.cpu(), files[0]["optim"]["step"])
    _train(ddp, opt, dp_rank, dp_size, 1, first_step=steps_before)
    return pack({"params": _params(model), "main": _main_params(opt, model, group), "roundtrip_exact": exact,
                 "dp_size": ddp.data_parallel_world_size, "n_shards": len(opt.shards), "lr": float(opt.lr)})


def checkpoint_missing_shard_worker(rank: int, ws: int, prefix: str, dtype, dp_size: int, saved_ws: int) -> str:
    """Load all files but the last one at DP size ``dp_size``: every rank must raise (not hang)."""
    group = _dp_subgroup(rank, ws, dp_size)
    ddp = DistributedDataParallel(make_model(dtype), use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                  data_parallel_group=group)
    opt = DistributedOptimizer(ddp, lr=1e-2)
    files = [torch.load(shard_path(prefix, r), weights_only=True)["optim"] for r in range(saved_ws - 1)]
    try:
        opt.load_state_dict(files)
    except (KeyError, ValueError, RuntimeError) as exc:
        return pack(f"{type(exc).__name__}: {exc}")
    return pack("no error")


# ----------------------------------------------------------------------------------------------
# expert parallelism: expert DP size != dense DP size
# ----------------------------------------------------------------------------------------------
NUM_EXPERTS = 4


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums the gradient over the group (every rank
    used the gathered tensor in its own loss) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _Experts(torch.nn.Module):
    """``L`` expert layers ``tanh(x W_e^T + b_e)`` stored as the library stores experts: one ``[L, ...]`` weight
    and bias marked ``allreduce = False`` (row ``e``: local expert ``e``)."""

    def __init__(self, layers: List[torch.nn.Linear]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.stack([e.weight.detach() for e in layers]))
        self.bias = torch.nn.Parameter(torch.stack([e.bias.detach() for e in layers]))
        for p in self.parameters():
            p.allreduce = False

    def forward(self, x):  # [T, HID] -> [L, T, HID]
        w = self.weight
        return torch.tanh(torch.baddbmm(self.bias.unsqueeze(1), x.expand(w.shape[0], -1, -1), w.transpose(1, 2)))


class TinyMoEModel(torch.nn.Module):
    """Dense layers, a dense softmax gate and ``NUM_EXPERTS`` expert MLPs (:class:`_Experts`), every token
    weighted over every expert. With ``ep_group`` the rank keeps the experts of its expert-parallel rank
    (contiguous blocks, as the library's MoE layer) and the tokens of the expert-parallel group are gathered
    through them; without it, all experts run locally (reference). Whole-model names:
    :func:`moe_graph.train.checkpoint.global_tensors` with ``ep_rank``."""

    def __init__(self, ep_group=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HID)
        self.gate = torch.nn.Linear(HID, NUM_EXPERTS)
        experts = [torch.nn.Linear(HID, HID) for _ in range(NUM_EXPERTS)]
        self.fc2 = torch.nn.Linear(HID, OUT)
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.local = NUM_EXPERTS // ep
        self.experts = _Experts(experts[self.ep_rank * self.local:(self.ep_rank + 1) * self.local])

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        probs = torch.softmax(self.gate(h), dim=-1)
        tokens = h if self.ep_group is None else _GatherFromGroup.apply(h, self.ep_group)
        ys = self.experts(tokens)  # (local experts, tokens, HID)
        if self.ep_group is not None:
            ys = _GatherFromGroup.apply(ys, self.ep_group)  # (all experts, group tokens, HID)
            n = h.shape[0]
            ys = ys[:, self.ep_rank * n:(self.ep_rank + 1) * n]
        return self.fc2(h + torch.einsum("te,eth->th", probs, ys))


def _whole_model(model: TinyMoEModel) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in global_tensors(model, model.ep_rank).items()}


def moe_reference(steps: int, clip: float) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """One process, all experts, whole global batch, ``torch.optim.AdamW`` + ``clip_grad_norm_``:
    the parameters after ``steps`` steps and the global grad norm of every step."""
    m = TinyMoEModel()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    norms = []
    for it in range(steps):
        x, y = batch(it)
        opt.zero_grad()
        loss_fn(m(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        opt.step()
    return _whole_model(m), norms


def expert_dp_worker(rank: int, ws: int, prefix: str, ep: int, steps: int, clip: float) -> dict:
    """Dense DP = ``ws``, EP = ``ep`` (groups of consecutive ranks), expert DP = ``ws // ep`` (ranks
    ``ep`` apart), as ``etp-ep-edp-pp`` with etp = pp = 1 lays them out. Train ``steps`` steps
    with grad clipping (saving the sharded checkpoint before the last one); then, in the same
    processes, resume that last step at dense DP = ``ep`` (expert DP = 1) from the saved files."""
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, ws, ep)]
    edp_groups = [dist.new_group(list(range(r, ws, ep))) for r in range(ep)]
    ep_group, edp_group = ep_groups[rank // ep], edp_groups[rank % ep]

    def build(dp_group, expert_dp_group, seed):
        model = TinyMoEModel(ep_group, seed=seed)
        ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                      data_parallel_group=dp_group, expert_data_parallel_group=expert_dp_group)
        opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, clip_grad=clip, impl="tensor",
                                   expert_model_parallel_group=ep_group)
        return model, ddp, opt

    def train(model, ddp, opt, dp_rank, dp, its):
        norms = []
        for it in its:
            x, y = batch(it)
            ddp.zero_grad_buffer()
            loss_fn(ddp(_local(x, dp_rank, dp)), _local(y, dp_rank, dp)).backward()
            ok, norm = opt.step()
            assert bool(ok)
            norms.append(float(norm))
        return norms

    model, ddp, opt = build(None, edp_group, seed=0)
    out = {"dp": ddp.buffers[0].data_parallel_world_size,
           "expert_dp": ddp.expert_parallel_buffers[0].data_parallel_world_size,
           "expert_names": sorted(k for k in global_tensors(model, model.ep_rank) if is_expert_name(k))}
    norms = train(model, ddp, opt, rank, ws, range(steps - 1))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, shard_path(prefix, rank))
    dist.barrier()
    norms += train(model, ddp, opt, rank, ws, [steps - 1])
    out.update(norms=norms, params=_whole_model(model))

    # resume the last step at dense DP = ep: replicas = the expert-parallel groups, expert DP = 1
    singles = [dist.new_group([r]) for r in range(ws)]
    model, ddp, opt = build(ep_group, singles[rank], seed=123)
    model.load_state_dict(torch.load(shard_path(prefix, rank), weights_only=True)["model"])  # same EP rank
    opt.load_state_dict([torch.load(shard_path(prefix, r), weights_only=True)["optim"] for r in range(ws)])
    out["resumed_norm"] = train(model, ddp, opt, rank % ep, ep, [steps - 1])[0]
    out["resumed_params"] = _whole_model(model)
    return pack(out)


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
    ``inf`` (bool), ``allreduce`` (bool), ``save`` (list of ``(prefix, dtype, steps_before)``),
    ``load`` (list of ``(prefix, dtype, steps_before, dp_size)``; runs after ``save``), ``missing``
    (list of ``(prefix, dtype, dp_size)``: load without the last saved file), ``load_failure`` (the arguments of
    :func:`load_failure_worker` after ``rank, ws``).
    Returns a packed dict with the same keys (lists in the same order).
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
        out["save"] = [unpack(checkpoint_save_worker(rank, ws, *t)) for t in tasks["save"]]
        dist.barrier()
    if tasks.get("load"):
        out["load"] = [unpack(checkpoint_load_worker(rank, ws, *t)) for t in tasks["load"]]
    if tasks.get("missing"):
        out["missing"] = [unpack(checkpoint_missing_shard_worker(rank, ws, *t, ws)) for t in tasks["missing"]]
    if tasks.get("load_failure"):
        out["load_failure"] = unpack(load_failure_worker(rank, ws, *tasks["load_failure"]))
    return pack(out)


# ------------------------------------------------------------------------- grad norm over TP x PP ranks --
def tp_pp_module(tp_rank: int, last_stage: bool) -> torch.nn.Module:
    """One pipeline stage's share: ``w`` (this TP rank's 3 of 6 rows, ``tensor_model_parallel``), ``b`` (a
    tensor-parallel duplicate) and ``emb`` (a tied embedding, marked ``shared`` on the last stage, as Megatron
    marks the output layer's copy)."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(3, 4))
    m.w.tensor_model_parallel = True
    m.b = torch.nn.Parameter(torch.zeros(4))
    m.emb = torch.nn.Parameter(torch.zeros(5))
    if last_stage:
        m.emb.shared = True
    return m


def tp_pp_grads(pp: int = 2) -> Dict:
    """Full (unsplit) gradients per stage ``{stage: (w [6, 4], b [4])}`` and the tied embedding's ``[5]``."""
    g = torch.Generator().manual_seed(7)
    stages = {s: (torch.randn(6, 4, generator=g), torch.randn(4, generator=g)) for s in range(pp)}
    return {"stages": stages, "emb": torch.randn(5, generator=g)}


def tp_pp_norm_worker(rank: int, ws: int, clip: float, use_mp_group: bool) -> dict:
    """pp = 2 x tp = 2 (tp fastest), dp = 1: gradients written by hand into ``main_grad``, one optimizer step.
    Returns the grad norm and this rank's ``w`` gradient after clipping."""
    tp = 2
    tp_rank, pp_rank = rank % tp, rank // tp
    singles = [dist.new_group([r]) for r in range(ws)]  # dp = 1 (every rank must create every group)
    module = tp_pp_module(tp_rank, last_stage=pp_rank == 1)
    ddp = DistributedDataParallel(module, use_distributed_optimizer=True, data_parallel_group=singles[rank])
    opt = DistributedOptimizer(ddp, lr=1e-2, clip_grad=clip, impl="tensor",
                               model_parallel_group=dist.group.WORLD if use_mp_group else None,
                               tensor_model_parallel_rank=tp_rank)
    grads = tp_pp_grads()
    gw, gb = grads["stages"][pp_rank]
    ddp.zero_grad_buffer()
    module.w.main_grad.copy_(gw[3 * tp_rank:3 * tp_rank + 3])
    module.b.main_grad.copy_(gb)
    module.emb.main_grad.copy_(grads["emb"])  # after the embedding all-reduce both stages hold the same grad
    ok, norm = opt.step()
    return pack({"ok": bool(ok), "norm": float(norm), "w_grad": module.w.main_grad.clone()})


# ------------------------------------------------------------------ failed checkpoint loads (issue 12) --
def optimizer_snapshot(opt) -> Dict:
    """Everything a checkpoint load may write, as bit-exact CPU copies: every shard's model param (the bucket's
    ``param_data``), main param and moments, step, lr, the settings (Python values and device tensors) and the
    loss scaler's state."""
    snap = {"step": opt.step_count.detach().cpu().clone(), "lr": opt.lr.detach().cpu().clone(),
            "settings": {k: getattr(opt, k) for k in ("beta1", "beta2", "eps", "weight_decay", "adamw", "clip_grad")},
            "settings_t": {k: t.detach().cpu().clone() for k, t in getattr(opt, "_settings_t", {}).items()},
            "scaler": opt.loss_scaler.state_dict() if opt.loss_scaler is not None else None}
    for i, s in enumerate(opt.shards):
        snap[f"param_data{i}"] = s.bucket.param_data.detach().cpu().clone()
        for k in ("main_param", "exp_avg", "exp_avg_sq"):
            snap[f"{k}{i}"] = getattr(s, k).detach().cpu().clone()
    return snap


def snapshots_identical(a: Dict, b: Dict) -> bool:
    """Bit-for-bit equality of two :func:`optimizer_snapshot` results (NaNs included)."""
    def same(x, y):
        if isinstance(x, torch.Tensor):
            return (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y
    return same(a, b)


def _piece(sd: dict, name: str, **changes) -> dict:
    """A shallow copy of ``sd`` whose piece ``name`` has ``changes`` applied (the other pieces shared)."""
    return {**sd, "shard": {**sd["shard"], name: {**sd["shard"][name], **changes}}}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _flip_byte(sd: dict, name: str, field: str) -> dict:
    t = sd["shard"][name][field].clone()
    t.view(torch.uint8)[5] ^= 0x10  # one flipped bit, as a damaged file would have
    return _piece(sd, name, **{field: t})


# name -> (corrupt(state dict of one shard, parameter name) -> bad state, exception type, message regex,
#          verify_checksum). Each must be refused before anything is written.
CORRUPTIONS = {
    "short_piece": (lambda sd, n: _piece(sd, n, exp_avg=sd["shard"][n]["exp_avg"][:-1]), ValueError,
                    r"'exp_avg' must be a 1-D torch.float32 tensor of \d+ elements", False),
    "fp16_piece": (lambda sd, n: _piece(sd, n, exp_avg_sq=sd["shard"][n]["exp_avg_sq"].half()), ValueError,
                   r"'exp_avg_sq' must be a 1-D torch.float32 tensor .* got torch.float16", False),
    "list_piece": (lambda sd, n: _piece(sd, n, exp_avg=sd["shard"][n]["exp_avg"].tolist()), ValueError,
                   r"'exp_avg' must be a 1-D torch.float32 tensor .* got list", False),
    "range_none": (lambda sd, n: _piece(sd, n, range=None), ValueError, r"'range' must be \(start, end\)", False),
    "range_past_end": (lambda sd, n: _piece(sd, n, range=(0, 10**6)), ValueError, r"'range' must be", False),
    "piece_none": (lambda sd, n: {**sd, "shard": {**sd["shard"], n: None}}, ValueError, r"must be a dict", False),
    "unknown_field": (lambda sd, n: _piece(sd, n, exp_avg_sq2=sd["shard"][n]["exp_avg_sq"]), ValueError,
                      r"has keys .*'exp_avg_sq2'", False),
    "no_lr": (lambda sd, n: _without(sd, "lr"), ValueError, r"has no \['lr'\]", False),
    "no_step": (lambda sd, n: _without(sd, "step"), ValueError, r"has no \['step'\]", False),
    "step_fraction": (lambda sd, n: {**sd, "step": torch.tensor(2.5)}, ValueError,
                      r"'step' must be a whole number", False),
    "lr_nan": (lambda sd, n: {**sd, "lr": torch.tensor(float("nan"))}, ValueError, r"'lr' must be a finite", False),
    "hyper_no_eps": (lambda sd, n: {**sd, "hyper": _without(sd["hyper"], "eps")}, ValueError,
                     r"'hyper' must be a dict with keys", False),
    "hyper_bad_betas": (lambda sd, n: {**sd, "hyper": {**sd["hyper"], "betas": (1.5, 0.9)}}, ValueError,
                        r"betas must be a pair", False),
    "scaler_missing_key": (lambda sd, n: {**sd, "loss_scaler": _without(sd["loss_scaler"], "growth_tracker")},
                           ValueError, r"'loss_scaler' has keys", False),
    "scaler_zero_scale": (lambda sd, n: {**sd, "loss_scaler": {**sd["loss_scaler"], "scale": torch.tensor(0.0)}},
                          ValueError, r"'loss_scaler'\['scale'\] must be a finite number > 0", False),
    "metadata_none": (lambda sd, n: {**sd, "metadata": None}, ValueError, r"'metadata' must be a dict", False),
    "missing_piece": (lambda sd, n: {**sd, "shard": _without(sd["shard"], n)}, ValueError,
                      r"no saved shard covers elements", False),
    "unknown_param": (lambda sd, n: {**sd, "metadata": {**sd["metadata"], "params": {
        **sd["metadata"]["params"], "zzz": sd["metadata"]["params"][n]}}}, ValueError,
        r"parameters this model does not have: \['zzz'\]", False),
    "flipped_bit": (lambda sd, n: _flip_byte(sd, n, "exp_avg_sq"), ValueError, r"fails its checksum", True),
    "no_checksum": (lambda sd, n: _without(sd, "checksum"), ValueError, r"has no 'checksum'", True),
    # any exception of any kind (here one no moe_graph code knows) on one rank: every rank raises, naming it
    "injected": (lambda sd, n: _Raising(sd), Injected, r"checking saved shard \d+: Injected: injected", False),
}


class _Raising(dict):
    """A saved shard whose ``"metadata"`` raises :class:`helpers.Injected` when read."""

    def __getitem__(self, key):
        if key == "metadata":
            raise Injected("injected while reading 'metadata'")
        return super().__getitem__(key)


def load_failure_worker(rank: int, ws: int, cases: List[str], group_timeout_s: float, dp_size: int = None) -> bytes:
    """DP = ``dp_size`` (default ``ws``; groups of consecutive ranks, with a ``group_timeout_s`` timeout), and with
    ``ws // dp_size > 1`` model-parallel groups across them (ranks ``dp_size`` apart, passed as
    ``model_parallel_group``, as pipeline stages would be); fp32 + dynamic loss scaler: train 2 steps, save (every
    rank gathers its DP group's shards), train 1 more. Then per case, the last rank loads a list of files in which
    its own shard is corrupted by :data:`CORRUPTIONS` ``[case]`` while every other rank loads clean files.
    Returns per case ``(exception type, message, seconds in load_state_dict, state unchanged)``; finally a clean
    load on every rank (the groups are still usable) and whether it restored the saved state exactly."""
    import time
    from datetime import timedelta

    dp_size = dp_size or ws
    timeout = timedelta(seconds=group_timeout_s)
    dp_groups = [dist.new_group(list(range(s, s + dp_size)), timeout=timeout) for s in range(0, ws, dp_size)]
    mp_groups = [dist.new_group(list(range(r, ws, dp_size)), timeout=timeout) for r in range(dp_size)]
    group = dp_groups[rank // dp_size]
    mp_group = mp_groups[rank % dp_size] if ws > dp_size else None
    ddp = DistributedDataParallel(make_model(), use_distributed_optimizer=True, data_parallel_group=group)
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, clip_grad=1.0, impl="tensor",
                               loss_scaler=DynamicLossScaler(initial_scale=1024.0), model_parallel_group=mp_group)
    rank, ws = rank % dp_size, dp_size  # the data-parallel position from here on
    last = dist.get_rank() == dist.get_world_size() - 1
    _train(ddp, opt, rank, ws, 2)
    files = [None] * ws
    dist.all_gather_object(files, opt.state_dict(), group=group)
    _train(ddp, opt, rank, ws, 1, first_step=2)
    before = optimizer_snapshot(opt)
    name = sorted(files[-1]["shard"])[0]
    out = {}
    for case in cases:
        corrupt, _, _, verify = CORRUPTIONS[case]
        mine = list(files)
        if last:
            mine[-1] = corrupt(files[-1], name)
        t0 = time.monotonic()
        try:
            opt.load_state_dict(mine, verify_checksum=verify)
            err = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            err = (type(exc).__name__, str(exc))
        out[case] = err + (time.monotonic() - t0, snapshots_identical(before, optimizer_snapshot(opt)))
    opt.load_state_dict(files)
    again = [None] * ws
    dist.all_gather_object(again, opt.state_dict(), group=group)
    # the whole saved state (step, lr, hyper, scaler, every piece) came back: equal checksums
    out["clean_load_roundtrip"] = [x["checksum"] == y["checksum"] for x, y in zip(files, again)]
    return pack(out)
