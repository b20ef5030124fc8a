"""Distributed optimizer (ZeRO-1) over the contiguous buffers of :mod:`moe_graph.ddp`.

Each bucket of a :class:`~moe_graph.buffers.ParamAndGradBuffer` (padded to a multiple of ``dp``
elements) is cut into ``dp`` equal contiguous shards; rank ``r`` owns shard ``r`` of every bucket:
it receives the reduced gradients of that shard (reduce-scatter), keeps the optimizer state of that
shard only (fp32 main params for 16-bit params, Adam moments), updates it, and the updated shards
are all-gathered back into the bucket's ``param_data`` (which the model's parameters view).
Shards ignore parameter boundaries: a parameter may be split between ranks.

Bytes per parameter (``d`` = data-parallel size; model param + grad buffer + sharded state)::

    param / grad dtype        non-distributed   distributed
    fp16 or bf16 / same             20            4 + 16/d   (fp32 main param, main grad, m, v)
    fp16 or bf16 / fp32             18            6 + 12/d   (fp32 main param, m, v)
    fp32 / fp32                     16            8 +  8/d   (m, v; the param shard is the main param)

The step is written as device tensor code: the learning rate and the step count are device
tensors, the found-inf check and the global grad norm are reductions whose results never leave
the device, and a skipped update (inf/nan grads) is a multiplication by zero / ``masked_fill``,
not a Python ``if``. Nothing calls ``.item()``, so :meth:`DistributedOptimizer.step` can be
captured in a CUDA graph together with forward and backward.

Checkpoints are sharded like the state: :meth:`DistributedOptimizer.state_dict` returns only this
rank's pieces (per parameter name, the element range it owns and the fp32 slices), so every rank
saves its own file; :meth:`DistributedOptimizer.load_state_dict` takes the list of all the files of
one model-parallel rank and re-shards them for any data-parallel size::

    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"ckpt/mp{mp_rank}_dp{dp_rank}.pt")
    ...                                            # later, at any data-parallel size
    files = [torch.load(f) for f in sorted(glob.glob(f"ckpt/mp{mp_rank}_dp*.pt"))]
    model.load_state_dict(files[0]["model"])   # with expert parallelism: a file of the same EP rank
    opt.load_state_dict([f["optim"] for f in files])

``mp_rank`` identifies the tensor/pipeline (and, for expert params, expert-parallel) position;
the files of the ranks that differ only in their expert-parallel rank may share a set: expert
pieces carry the saving rank's ``ep_rank`` and are only loaded by ranks with the same one.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .buffers import ParamAndGradBuffer

__all__ = ["build_shard_ranges", "DistributedOptimizer", "DynamicLossScaler", "ConstantLossScaler"]

_FORMAT = "moe_graph.distributed_optimizer.sharded.v1"


# ----------------------------------------------------------------------------------------------
# shard ranges
# ----------------------------------------------------------------------------------------------
def build_shard_ranges(buffer: ParamAndGradBuffer, bucket_index: int, dp_rank: int) -> Dict:
    """ZeRO-1 ranges of the params overlapping ``dp_rank``'s shard of bucket ``bucket_index``.

    The bucket ``[offset, offset + size)`` is split into ``dp`` shards of ``size // dp`` elements;
    rank ``r`` owns ``[offset + r*n, offset + (r+1)*n)``. For every param (in the buffer's walk
    order) that overlaps that shard::

        {param: {"gbuf_world":           (s, e),  # in the whole buffer
                 "gbuf_world_in_bucket": (s, e),  # relative to the bucket start
                 "gbuf_local":           (s, e),  # relative to the rank's shard
                 "param":                (s, e)}} # inside the flattened param

    identical to Megatron-core's ``DistributedOptimizer._build_model_gbuf_range``.

    Example: one bucket ``[0, 1280)`` with dp=2 (shards of 640) and a param at ``(256, 1256)``:
    rank 0 gets ``gbuf_world (256, 640)``, ``gbuf_local (256, 640)``, ``param (0, 384)``; rank 1 gets
    ``gbuf_world (640, 1256)``, ``gbuf_world_in_bucket (640, 1256)``, ``gbuf_local (0, 616)``,
    ``param (384, 1000)``.
    """
    if not 0 <= bucket_index < len(buffer.buckets):
        raise ValueError(f"bucket_index must be in [0, {len(buffer.buckets)}), got {bucket_index}")
    dp = buffer.data_parallel_world_size
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank must be in [0, {dp}) (buffer.data_parallel_world_size), got {dp_rank}")
    bucket = buffer.buckets[bucket_index]
    size = bucket.grad_data.numel()
    if size % dp != 0:
        raise ValueError(f"bucket {bucket_index} has {size} elements, not divisible by dp={dp} "
                         "(build the buffer with use_distributed_optimizer=True)")
    n = size // dp
    w_start = bucket.offset + dp_rank * n
    w_end = bucket.offset + min(size, dp_rank * n + n)
    w_size = w_end - w_start
    out = {}
    for param, (p_start, p_end, _) in buffer.param_index_map.items():
        local_start = max(0, p_start - w_start)
        local_end = min(w_size, p_end - w_start)
        if local_end <= local_start:
            continue
        world = (local_start + w_start, local_end + w_start)
        sub_start = max(0, w_start - p_start)
        out[param] = {
            "gbuf_world": world,
            "gbuf_world_in_bucket": (world[0] - bucket.offset, world[1] - bucket.offset),
            "gbuf_local": (local_start, local_end),
            "param": (sub_start, sub_start + local_end - local_start),
        }
    return out


# ----------------------------------------------------------------------------------------------
# loss scaling
# ----------------------------------------------------------------------------------------------
class ConstantLossScaler:
    """A fixed loss scale held in a device tensor. ``update(found_inf)`` does nothing."""

    def __init__(self, scale: float, device=None):
        self.scale = torch.full((), float(scale), dtype=torch.float32, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        pass

    def state_dict(self):
        return {"scale": self.scale.detach().cpu()}

    def load_state_dict(self, sd):
        self.scale.copy_(sd["scale"])


class DynamicLossScaler:
    """Megatron's dynamic grad scaler as branch-free device-tensor updates.

    On an inf/nan step the hysteresis counter drops; when it reaches 0 the scale is multiplied by
    ``backoff_factor`` (not below ``min_scale``). After ``growth_interval`` clean steps in a row the
    scale is multiplied by ``growth_factor`` and the hysteresis counter refills.
    """

    def __init__(self, initial_scale: float = 2.0**16, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2, device=None):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0 and hysteresis > 0):
            raise ValueError("DynamicLossScaler: need growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval > 0 and hysteresis > 0")
        f = dict(dtype=torch.float32, device=device)
        self.scale = torch.full((), float(initial_scale), **f)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = torch.zeros((), **f)
        self._hysteresis_tracker = torch.full((), float(hysteresis), **f)

    def update(self, found_inf: torch.Tensor) -> None:
        inf = found_inf.to(torch.bool)
        hyst = torch.where(inf, self._hysteresis_tracker - 1, self._hysteresis_tracker)
        backoff = inf & (hyst <= 0)
        growth = torch.where(inf, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = growth >= self.growth_interval
        scale = torch.where(backoff, torch.clamp(self.scale * self.backoff_factor, min=self.min_scale), self.scale)
        scale = torch.where(grow, scale * self.growth_factor, scale)
        self.scale.copy_(scale)
        self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(growth), growth))
        self._hysteresis_tracker.copy_(torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst))

    def state_dict(self):
        return {"scale": self.scale.detach().cpu(), "growth_tracker": self._growth_tracker.detach().cpu(),
                "hysteresis_tracker": self._hysteresis_tracker.detach().cpu()}

    def load_state_dict(self, sd):
        self.scale.copy_(sd["scale"])
        self._growth_tracker.copy_(sd["growth_tracker"])
        self._hysteresis_tracker.copy_(sd["hysteresis_tracker"])


# ----------------------------------------------------------------------------------------------
# the optimizer
# ----------------------------------------------------------------------------------------------
def _has_amp_unscale(device) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` runs on ``device``."""
    if device is None or not hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_"):
        return False
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, device=device)], torch.zeros(1, device=device), torch.ones(1, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class _Shard:
    """Optimizer-side view of one rank's shard of one bucket."""

    __slots__ = ("buffer", "bucket_index", "bucket", "group", "rank", "size", "model_param", "grad",
                 "main_param", "main_grad", "exp_avg", "exp_avg_sq", "wd_mask", "norm_views", "ranges")


def _counts_in_grad_norm(p, tensor_parallel_rank: int) -> bool:
    """Megatron's rule: not a tied copy (``shared``) and not a tensor-parallel duplicate on a rank other than 0."""
    if getattr(p, "shared", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tensor_parallel_rank == 0


def _counted_views(main_grad: torch.Tensor, ranges: Dict, counts) -> List[torch.Tensor]:
    """Views of ``main_grad`` (a shard) covering every element except the local ranges of the params for which
    ``counts(p)`` is false: the grad norm reads only these (no mask, no copy). ``[main_grad]`` when all count."""
    skip = sorted(r["gbuf_local"] for p, r in ranges.items() if not counts(p))
    if not skip:
        return [main_grad]
    views, pos = [], 0
    for start, end in skip:
        if start > pos:
            views.append(main_grad[pos:start])
        pos = max(pos, end)
    if pos < main_grad.numel():
        views.append(main_grad[pos:])
    return views


def _range_mask(ranges: Dict, n: int, device, zero_if) -> Optional[torch.Tensor]:
    """A 0/1 float mask over a shard of ``n`` elements, 0 on the local ranges of the params where ``zero_if(p)``;
    None when no param of the shard qualifies."""
    hit = [r for p, r in ranges.items() if zero_if(p)]
    if not hit:
        return None
    mask = torch.ones(n, device=device)
    for r in hit:
        mask[r["gbuf_local"][0]:r["gbuf_local"][1]] = 0.0
    return mask


class _ModelChunks:
    """Several ``DistributedDataParallel`` model chunks (the interleaved pipeline schedule's virtual stages) seen as
    one model by the optimizer: one step, one global grad norm. Parameter names get a ``chunk{i}.`` prefix."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.use_distributed_optimizer = all(getattr(c, "use_distributed_optimizer", False) for c in self.chunks)
        self.all_buffers = [b for c in self.chunks for b in c.all_buffers]
        self.expert_parallel_buffers = [b for c in self.chunks for b in getattr(c, "expert_parallel_buffers", [])]
        self.all_bucket_groups = [g for c in self.chunks for g in c.all_bucket_groups]
        self.param_to_name = {p: f"chunk{i}.{n}" for i, c in enumerate(self.chunks)
                              for p, n in getattr(c, "param_to_name", {}).items()}

    def finish_grad_sync(self) -> None:
        for c in self.chunks:
            c.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()


class DistributedOptimizer:
    """ZeRO-1 Adam/AdamW over a :class:`moe_graph.ddp.DistributedDataParallel` model.

    Args:
        model: a ``DistributedDataParallel`` built with ``use_distributed_optimizer=True`` (or any
            object with ``all_buffers``, ``all_bucket_groups``, ``finish_grad_sync`` and
            ``zero_grad_buffer``), or a list of them (the model chunks of the interleaved pipeline
            schedule: one optimizer, one global grad norm; checkpoint names ``chunk{i}.<name>``).
        lr, betas, eps, weight_decay: Adam hyper-parameters (``lr`` lives in a device tensor;
            change it with :meth:`set_lr`).
        adamw: decoupled weight decay (AdamW, default) or L2 added to the gradient (Adam).
        clip_grad: clip by global grad norm when > 0.
        loss_scaler: ``None``, :class:`ConstantLossScaler` or :class:`DynamicLossScaler`; grads
            are divided by its scale; an inf/nan anywhere skips the update on every rank.
        no_weight_decay_params: params excluded from weight decay (e.g. biases and norms).
        impl: ``"auto"`` (``torch._fused_adamw_`` when available for the device and weight decay
            is uniform), ``"fused"``, or ``"tensor"`` (portable device-tensor code).
        expert_model_parallel_group: with expert parallelism, the group whose ranks hold
            *different* experts: the expert part of the grad norm and the inf flag are summed over
            it as well (the dense part is complete after the data-parallel reduction): Megatron's
            expert-tensor-model-pipeline group (ETP x EP x PP), or the EP group without TP/PP. Its
            rank is also recorded in checkpoints, so that expert params are reloaded from the right
            files.
        model_parallel_group: with tensor or pipeline parallelism, Megatron's model-parallel group
            (TP x PP): the dense part of the grad norm and the inf flag are summed over it, so that
            every stage clips with the same, global norm. As in Megatron, a parameter counts once:
            one without ``tensor_model_parallel = True`` is a copy on every tensor-parallel rank and
            counts only where ``tensor_model_parallel_rank`` (``expert_tensor_parallel_rank`` for
            expert params) is 0, and a parameter marked ``shared = True`` (the tied output
            embedding on the last stage) does not count.
            Defaults (``"auto"`` groups, ``None`` ranks): taken from :mod:`moe_graph.parallel_state`
            when it is initialized (the groups and ranks above), else no group and rank 0. Pass
            ``None`` for a group to leave it out.

    ``step()`` returns ``(update_successful, grad_norm)``, both 0-dim device tensors.
    ``state_dict()`` is this rank's shard (save one file per rank); ``load_state_dict(shards)``
    takes every saved shard of this model-parallel rank and re-shards for the current DP size.
    """

    def __init__(self, model, *, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, adamw: bool = True, clip_grad: float = 0.0, loss_scaler=None,
                 no_weight_decay_params: Optional[Iterable[torch.nn.Parameter]] = None, impl: str = "auto",
                 expert_model_parallel_group="auto", model_parallel_group="auto",
                 tensor_model_parallel_rank: Optional[int] = None, expert_tensor_parallel_rank: Optional[int] = None):
        if isinstance(model, (list, tuple)):
            if not model:
                raise ValueError("DistributedOptimizer: empty list of model chunks")
            model = model[0] if len(model) == 1 else _ModelChunks(model)
        if not getattr(model, "use_distributed_optimizer", False):
            raise ValueError("DistributedOptimizer: model must be a DistributedDataParallel built with "
                             "use_distributed_optimizer=True")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if impl not in ("auto", "fused", "tensor"):
            raise ValueError(f"impl must be 'auto', 'fused' or 'tensor', got {impl!r}")
        from . import parallel_state as ps

        mp_on = ps.model_parallel_is_initialized()  # "auto" / None below: Megatron's groups and ranks from it
        if isinstance(expert_model_parallel_group, str) and expert_model_parallel_group == "auto":
            expert_model_parallel_group = ps.get_expert_tensor_model_pipeline_parallel_group() if mp_on else None
        if isinstance(model_parallel_group, str) and model_parallel_group == "auto":
            model_parallel_group = ps.get_model_parallel_group() if mp_on else None
        if tensor_model_parallel_rank is None:
            tensor_model_parallel_rank = ps.get_tensor_model_parallel_rank() if mp_on else 0
        if expert_tensor_parallel_rank is None:
            expert_tensor_parallel_rank = ps.get_expert_tensor_parallel_rank() if mp_on else 0
        if model_parallel_group is not None and dist.get_world_size(model_parallel_group) == 1:
            model_parallel_group = None  # nothing to combine
        self.model = model
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.adamw = float(eps), float(weight_decay), adamw
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.expert_model_parallel_group = expert_model_parallel_group
        self.model_parallel_group = model_parallel_group
        expert_buffers = set(map(id, getattr(model, "expert_parallel_buffers", [])))
        no_wd = set(no_weight_decay_params or [])
        self.param_to_name = dict(getattr(model, "param_to_name", {}))

        self.shards: List[_Shard] = []
        device = None
        for buf in model.all_buffers:
            if buf.param_dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise NotImplementedError(f"DistributedOptimizer: buffers of {buf.param_dtype} params "
                                          "(fp8) are not supported yet")
            group = buf.data_parallel_group
            rank = dist.get_rank(group) if buf.data_parallel_world_size > 1 else 0
            device = buf.grad_data.device
            for bi, bucket in enumerate(buf.buckets):
                n = bucket.grad_data.numel() // buf.data_parallel_world_size
                s = _Shard()
                s.buffer, s.bucket_index, s.bucket, s.group, s.rank, s.size = buf, bi, bucket, group, rank, n
                s.model_param = bucket.param_data[rank * n:(rank + 1) * n]
                s.grad = bucket.grad_data[rank * n:(rank + 1) * n]
                with torch.no_grad():
                    s.main_param = (s.model_param if buf.param_dtype == torch.float32
                                    else s.model_param.detach().float().clone())
                s.main_grad = s.grad if buf.grad_dtype == torch.float32 else torch.zeros(n, device=device)
                s.exp_avg = torch.zeros(n, device=device)
                s.exp_avg_sq = torch.zeros(n, device=device)
                s.ranges = build_shard_ranges(buf, bi, rank)
                s.wd_mask = _range_mask(s.ranges, n, device, lambda p: p in no_wd)
                tp_rank = expert_tensor_parallel_rank if id(buf) in expert_buffers else tensor_model_parallel_rank
                s.norm_views = _counted_views(s.main_grad, s.ranges, lambda p, t=tp_rank: _counts_in_grad_norm(p, t))
                self.shards.append(s)
        self.device = device
        f32 = dict(dtype=torch.float32, device=device)
        self.lr = torch.full((), float(lr), **f32)
        self.step_count = torch.zeros((), **f32)
        self._one = torch.ones((), **f32)
        # shards grouped by the process group their norm / inf statistics are reduced over
        self._stat_groups: List[Tuple[object, bool, List[int]]] = []  # (dp group or None, is_expert, shards)
        for i, s in enumerate(self.shards):
            key = s.group if s.buffer.data_parallel_world_size > 1 else None
            expert = id(s.buffer) in expert_buffers
            for k, e, idx in self._stat_groups:
                if k is key and e == expert:
                    idx.append(i)
                    break
            else:
                self._stat_groups.append((key, expert, [i]))
        self._amp_check = _has_amp_unscale(device)
        fused_ok = hasattr(torch, "_fused_adamw_") and device is not None and device.type in ("cuda", "cpu")
        uniform_wd = all(s.wd_mask is None for s in self.shards)
        if impl == "fused" and not (fused_ok and uniform_wd):
            raise ValueError("impl='fused' needs torch._fused_adamw_ for this device and no no_weight_decay_params")
        self.impl = "fused" if (impl == "fused" or (impl == "auto" and fused_ok and uniform_wd)) else "tensor"

    # ------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Set the learning rate in place (no sync; replays of a captured graph see the new value)."""
        self.lr.fill_(float(lr))

    def zero_grad(self) -> None:
        """Zero the model's grad buffers (``DistributedDataParallel.zero_grad_buffer``)."""
        self.model.zero_grad_buffer()

    @property
    def loss_scale(self) -> torch.Tensor:
        return self.loss_scaler.scale if self.loss_scaler is not None else self._one

    def state_nbytes(self) -> int:
        """Bytes of optimizer-owned tensors (main params, main grads, moments, masks), excluding views."""
        total = 0
        for s in self.shards:
            for t in (s.main_param, s.main_grad, s.exp_avg, s.exp_avg_sq, s.wd_mask):
                if t is not None and t is not s.model_param and t is not s.grad:
                    total += t.numel() * t.element_size()
        return total

    def state_tensors(self) -> List[torch.Tensor]:
        """Every tensor the optimizer holds (views included), for memory accounting."""
        out = [self.lr, self.step_count]
        for s in self.shards:
            out += [t for t in (s.main_param, s.main_grad, s.exp_avg, s.exp_avg_sq, s.wd_mask) if t is not None]
        return out

    # ------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Finish the grad reductions, update this rank's shards, all-gather the params.

        Returns ``(update_successful, grad_norm)`` as 0-dim device tensors (no host sync).
        """
        self.model.finish_grad_sync()
        grads = []
        for s in self.shards:
            if s.main_grad is not s.grad:
                s.main_grad.copy_(s.grad)
            grads.append(s.main_grad)
        inv_scale = torch.reciprocal(self.loss_scaler.scale) if self.loss_scaler is not None else None

        # [inf flag, sum of squares] per statistics group, all-reduced, then summed
        total = torch.zeros(2, dtype=torch.float32, device=self.device)
        for group, expert, idx in self._stat_groups:
            gs = [grads[i] for i in idx]
            t = torch.zeros(2, dtype=torch.float32, device=self.device)
            if self._amp_check:  # one fused pass: unscale and flag non-finite values
                found = torch.zeros(1, dtype=torch.float32, device=self.device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    gs, found, inv_scale.reshape(1) if inv_scale is not None else self._one.reshape(1))
                t[0] = found[0]
            else:
                if inv_scale is not None:
                    torch._foreach_mul_(gs, inv_scale)
                for g in gs:
                    t[0] += torch.logical_not(torch.isfinite(g)).sum()
            counted = [v for i in idx for v in self.shards[i].norm_views]  # params counted on another rank left out
            t[1] = torch.stack(torch._foreach_norm(counted)).square().sum()
            if group is not None:
                dist.all_reduce(t, group=group)
            if expert and self.expert_model_parallel_group is not None:
                dist.all_reduce(t, group=self.expert_model_parallel_group)
            if not expert and self.model_parallel_group is not None:
                dist.all_reduce(t, group=self.model_parallel_group)
            total += t
        found_inf = total[0] > 0
        grad_norm = total[1].sqrt()
        ok = torch.logical_not(found_inf)
        okf = ok.float()

        if self.clip_grad > 0.0:
            coef = torch.clamp(self.clip_grad / (grad_norm + 1e-6), max=1.0)
            coef = torch.where(ok, coef, torch.ones_like(coef))
            torch._foreach_mul_(grads, coef)

        if self.impl == "fused":
            self._step_fused(grads, found_inf, okf)
        else:
            self._step_tensor(grads, found_inf, okf)

        # main -> model param shards, then all-gather every bucket's param_data
        for s in self.shards:
            if s.main_param is not s.model_param:
                s.model_param.copy_(s.main_param)
        for g in self.model.all_bucket_groups:
            g.start_param_sync(async_op=False)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        return ok, grad_norm

    def _step_fused(self, grads, found_inf, okf):
        # torch's fused AdamW skips the whole update when found_inf == 1 (read on the device). The
        # kernel only reads the step tensors, so every shard can share the one step count.
        self.step_count.add_(okf)
        fn = torch._fused_adamw_ if self.adamw else torch._fused_adam_
        fn([s.main_param for s in self.shards], grads, [s.exp_avg for s in self.shards],
           [s.exp_avg_sq for s in self.shards], [], [self.step_count] * len(self.shards), lr=self.lr, beta1=self.beta1,
           beta2=self.beta2, weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False,
           grad_scale=None, found_inf=found_inf.float())

    def _step_tensor(self, grads, found_inf, okf):
        b1, b2 = self.beta1, self.beta2
        for g in grads:
            g.masked_fill_(found_inf, 0.0)
        self.step_count.add_(okf)
        step = torch.clamp(self.step_count, min=1.0)
        bc1 = 1.0 - torch.pow(b1, step)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, step))
        lr_ok = self.lr * okf
        step_size = lr_ok / bc1
        w1 = (1.0 - b1) * okf
        keep2 = 1.0 - (1.0 - b2) * okf
        for s, g in zip(self.shards, grads):
            p = s.main_param
            if self.weight_decay != 0.0:
                if self.adamw:
                    decay = 1.0 - lr_ok * self.weight_decay
                    if s.wd_mask is None:
                        p.mul_(decay)
                    else:
                        p.mul_(torch.lerp(torch.ones_like(decay), decay, s.wd_mask))
                else:
                    g = g.add(p * s.wd_mask if s.wd_mask is not None else p, alpha=self.weight_decay)
            s.exp_avg.lerp_(g, w1)
            s.exp_avg_sq.mul_(keep2).addcmul_(g, g, value=1.0 - b2)
            # p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps); a skipped step has step_size 0 -> denom inf
            denom = s.exp_avg_sq.sqrt().div_(bc2_sqrt).add_(self.eps).div_(step_size)
            p.addcdiv_(s.exp_avg, denom, value=-1.0)

    # ------------------------------------------------------------------
    # checkpointing: one file per rank, each holding only that rank's shard
    # ------------------------------------------------------------------
    def _name(self, p):
        name = self.param_to_name.get(p)
        if name is None:
            raise KeyError("DistributedOptimizer: parameter has no name (model.param_to_name)")
        return name

    def _checkpoint_metadata(self) -> Dict:
        expert_buffers = set(map(id, getattr(self.model, "expert_parallel_buffers", [])))
        meta = {"dp_size": 1, "dp_rank": 0, "expert_dp_size": None, "expert_dp_rank": None,
                "ep_size": 1, "ep_rank": 0, "params": {}}
        for s in self.shards:
            expert = id(s.buffer) in expert_buffers
            prefix = "expert_dp" if expert else "dp"
            meta[f"{prefix}_size"], meta[f"{prefix}_rank"] = s.buffer.data_parallel_world_size, s.rank
            for p in s.bucket.params_list:
                meta["params"][self._name(p)] = {"shape": tuple(p.shape), "dtype": str(p.dtype), "expert": expert}
        g = self.expert_model_parallel_group
        if g is not None and dist.get_world_size(g) > 1:
            meta["ep_size"], meta["ep_rank"] = dist.get_world_size(g), dist.get_rank(g)
        return meta

    @torch.no_grad()
    def state_dict(self) -> Dict:
        """This rank's shard of the optimizer state (no communication). Save one file per rank.

        ::

            {"format": "moe_graph.distributed_optimizer.sharded.v1",
             "step", "lr": 0-dim tensors, "hyper": {betas, eps, weight_decay, adamw, clip_grad},
             "loss_scaler": its state_dict() or None,
             "metadata": {"dp_size", "dp_rank", "expert_dp_size", "expert_dp_rank", "ep_size", "ep_rank",
                          "params": {name: {"shape", "dtype", "expert"}}},   # every param of the model
             "shard": {name: {"range": (start, end),    # in the flattened param, owned by this rank
                              "exp_avg", "exp_avg_sq": fp32 CPU tensors of end - start elements,
                              "main_param": the same, only for bf16/fp16 params}}}

        Names are ``model.param_to_name`` (``named_parameters`` of the wrapped module). The
        tensors hold about ``1/dp`` of the state: the parts of this rank's bucket shards that are
        not padding. The fp32 params themselves are not included (they are the model's params:
        save the model's ``state_dict()`` as well).

        With expert / tensor / pipeline parallelism every model-parallel rank saves its own set of
        files (expert params share names across expert-parallel ranks but differ; ``ep_rank``
        tells them apart). :meth:`load_state_dict` takes all the files of one set.
        """
        shard: Dict[str, Dict] = {}
        for s in self.shards:
            sixteen_bit = s.main_param is not s.model_param
            for p, r in s.ranges.items():
                l0, l1 = r["gbuf_local"]
                entry = {"range": tuple(r["param"])}
                for k in (("main_param", "exp_avg", "exp_avg_sq") if sixteen_bit else ("exp_avg", "exp_avg_sq")):
                    # clone: a saved view would carry the whole bucket storage into the file
                    entry[k] = getattr(s, k)[l0:l1].detach().to("cpu", copy=True)
                shard[self._name(p)] = entry
        return {
            "format": _FORMAT,
            "step": self.step_count.detach().cpu().clone(),
            "lr": self.lr.detach().cpu().clone(),
            "hyper": {"betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay,
                      "adamw": self.adamw, "clip_grad": self.clip_grad},
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "metadata": self._checkpoint_metadata(),
            "shard": shard,
        }

    def _plan_load(self, shards: List[Dict]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) copies that fill this rank's shards; raises on any inconsistency."""
        my_ep = self._checkpoint_metadata()
        meta: Dict[str, Dict] = {}
        pieces: Dict[str, List[Dict]] = {}
        for sd in shards:
            md = sd["metadata"]
            for name, m in md["params"].items():
                meta.setdefault(name, m)
            for name, entry in sd["shard"].items():
                if md["params"][name]["expert"]:
                    if md["ep_size"] != my_ep["ep_size"]:
                        raise ValueError(f"load_state_dict: the checkpoint was saved with expert-parallel size "
                                         f"{md['ep_size']}, this run uses {my_ep['ep_size']} (not supported)")
                    if md["ep_rank"] != my_ep["ep_rank"]:
                        continue  # another expert-parallel rank's experts under the same name
                pieces.setdefault(name, []).append(entry)
        copies = []
        for s in self.shards:
            sixteen_bit = s.main_param is not s.model_param
            for p, r in s.ranges.items():
                name = self._name(p)
                if name not in meta:
                    raise KeyError(f"load_state_dict: checkpoint has no entry for parameter {name!r}")
                m = meta[name]
                if tuple(m["shape"]) != tuple(p.shape) or m["dtype"] != str(p.dtype):
                    raise ValueError(f"load_state_dict: {name!r} is {m['dtype']} {tuple(m['shape'])} in the "
                                     f"checkpoint, expected {p.dtype} {tuple(p.shape)}")
                q0, q1 = r["param"]
                l0 = r["gbuf_local"][0]
                covered = []
                for e in pieces.get(name, []):
                    e0, e1 = e["range"]
                    a, b = max(q0, e0), min(q1, e1)
                    if a >= b:
                        continue
                    covered.append((a, b))
                    for k in (("main_param", "exp_avg", "exp_avg_sq") if sixteen_bit else ("exp_avg", "exp_avg_sq")):
                        if k not in e:
                            raise ValueError(f"load_state_dict: the checkpoint has no {k} for {name!r}")
                        copies.append((getattr(s, k)[l0 + a - q0:l0 + b - q0], e[k][a - e0:b - e0]))
                at = q0
                for a, b in sorted(covered):
                    if a > at:
                        break
                    at = max(at, b)
                if at < q1:
                    gap_end = min([a for a, _ in covered if a > at] + [q1])
                    raise ValueError(f"load_state_dict: no saved shard covers elements [{at}, {gap_end}) of "
                                     f"parameter {name!r}: pass the files of every data-parallel rank of the "
                                     "saved run")
        return copies

    @torch.no_grad()
    def load_state_dict(self, state) -> None:
        """Load the sharded state saved by :meth:`state_dict` at any data-parallel size.

        ``state`` is the list of every saved shard of this model-parallel rank (``torch.load`` of
        each data-parallel rank's file, in any order); a single dict is taken as a one-shard list
        (a run saved at DP=1). Each rank copies, per parameter, the overlap of every saved range
        with the range it owns now, and checks that its whole range is covered and that names,
        shapes and dtypes match. Expert params are taken from the shards of the same expert-parallel
        rank (the expert-parallel size must not change). A collective over the data-parallel
        groups (every rank must call it): all ranks raise if one fails, then the 16-bit model
        params are refreshed from the loaded fp32 main params and all-gathered. Load the model's
        ``state_dict`` too (for fp32 params the checkpointed values are the model's).
        """
        shards = [state] if isinstance(state, dict) else list(state)
        if not shards:
            raise ValueError("load_state_dict: no shard given")
        for sd in shards:
            if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
                fmt = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
                raise ValueError(f"load_state_dict: unknown checkpoint format {fmt!r} (expected {_FORMAT!r})")
        if any(not torch.equal(sd["step"], shards[0]["step"]) for sd in shards):
            raise ValueError("load_state_dict: the shards were saved at different steps")
        error = None
        try:
            copies = self._plan_load(shards)
        except (KeyError, ValueError) as exc:
            error = exc
        # fail on every rank together, so that no rank waits in the param all-gather below
        flag = torch.full((), 0.0 if error is None else 1.0, dtype=torch.float32, device=self.device)
        for group, _, _ in self._stat_groups:
            if group is not None:
                dist.all_reduce(flag, group=group)
        if error is not None:
            raise error
        if float(flag) > 0:
            raise RuntimeError("load_state_dict: another rank of the data-parallel group could not load its shard")
        for dst, src in copies:
            dst.copy_(src)
        state = shards[0]
        self.step_count.copy_(state["step"])
        self.lr.copy_(state["lr"])
        hyper = state.get("hyper", {})
        if hyper:  # like torch.optim: hyper-parameters come back with the state
            self.beta1, self.beta2 = (float(b) for b in hyper["betas"])
            self.eps, self.weight_decay = float(hyper["eps"]), float(hyper["weight_decay"])
            self.adamw, self.clip_grad = bool(hyper["adamw"]), float(hyper["clip_grad"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for s in self.shards:
            if s.main_param is not s.model_param:
                s.model_param.copy_(s.main_param)
        for g in self.model.all_bucket_groups:
            g.start_param_sync(async_op=False)
