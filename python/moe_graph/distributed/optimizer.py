"""Distributed optimizer (ZeRO-1) over the contiguous buffers of :mod:`moe_graph.distributed.ddp`.

Each bucket of a :class:`~moe_graph.distributed.buffers.ParamAndGradBuffer` (padded to a multiple of ``dp``
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
the device, and a skipped update (inf/nan grads, or a dispatcher overflow in dropless mode: the
``overflow`` flag of :meth:`DistributedOptimizer.step`) is a multiplication by zero / ``masked_fill``,
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

Each saved shard carries a sha256 checksum over its tensors' bytes and values; a load checks every shard (checksum,
keys, types, sizes, ranges, coverage) before the first write and the ranks agree on the outcome before anything
is copied, so a failed load raises on every rank and leaves the live state unchanged.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps
from moe_graph.cuda_graph import _note_capture
from moe_graph.distributed.agreement import AllOrNone
from moe_graph.distributed.buffers import ParamAndGradBuffer, all_gather_tensor
from moe_graph.distributed.fp8_params import Fp8BucketGather, Fp8GatheredWeight, fp8_weight_tiles
from moe_graph.ops import fp8 as _fp8

__all__ = ["build_shard_ranges", "DistributedOptimizer", "DynamicLossScaler", "ConstantLossScaler", "state_checksum"]

_FORMAT = "moe_graph.distributed_optimizer.sharded.v1"
_TENSOR_SETTINGS = ("beta1", "beta2", "eps", "weight_decay", "clip_grad")  # held in device tensors as well
_STATE_KEYS = ("step", "lr", "hyper", "loss_scaler", "metadata", "shard")  # besides "format" and "checksum"
_HYPER_KEYS = ("betas", "eps", "weight_decay", "adamw", "clip_grad")
_PIECE_FIELDS = ("main_param", "exp_avg", "exp_avg_sq")
_SIXTEEN_BIT = (str(torch.float16), str(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
def _as_real(value) -> Optional[float]:
    """``value`` as a Python float when it is a real number or a one-element real CPU tensor, else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.device.type != "cpu":
            return None
        return float(value.detach().reshape(()))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _check_real(where: str, name: str, value, *, expected: str = "a finite number >= 0", ok=None) -> float:
    """``value`` as a float; raises naming ``name`` unless it is finite, >= 0 and satisfies ``ok``."""
    v = _as_real(value)
    if v is None or not math.isfinite(v) or v < 0 or (ok is not None and not ok(v)):
        raise ValueError(f"{where}: {name} must be {expected}, got {value!r}")
    return v


def _keys(d: dict) -> list:
    """The keys of ``d`` for a message (sorted; keys of mixed types shown as they are)."""
    return sorted(d, key=repr)


def _check_settings(where: str, betas, eps, weight_decay, adamw, clip_grad) -> Dict[str, object]:
    """The validated optimizer settings as plain Python values (also used for the checkpoint's ``hyper``)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r}")
    b1, b2 = (_check_real(where, "betas", b, expected="a pair (beta1, beta2) of numbers in [0, 1)",
                          ok=lambda x: x < 1.0) for b in betas)
    if not isinstance(adamw, bool):
        raise ValueError(f"{where}: adamw must be a bool (True: decoupled weight decay, False: L2), got {adamw!r}")
    return {"beta1": b1, "beta2": b2, "eps": _check_real(where, "eps", eps),
            "weight_decay": _check_real(where, "weight_decay", weight_decay), "adamw": adamw,
            "clip_grad": _check_real(where, "clip_grad", clip_grad, expected="a finite number >= 0 (0: no clipping)")}


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
    """A fixed loss scale held in a device tensor. ``update(found_inf, skip=None)`` does nothing."""

    def __init__(self, scale: float, device=None):
        scale = _check_real("ConstantLossScaler", "scale", scale, expected="a finite number > 0", ok=lambda v: v > 0)
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)

    def update(self, found_inf: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        pass

    def state_dict(self):
        return {"scale": self.scale.detach().to("cpu", copy=True)}  # a copy, also on CPU (no alias of live state)

    def load_state_dict(self, sd):
        self.scale.copy_(sd["scale"])


class DynamicLossScaler:
    """Megatron's dynamic grad scaler as branch-free device-tensor updates.

    On an inf/nan step the hysteresis counter drops; when it reaches 0 the scale is multiplied by
    ``backoff_factor`` (not below ``min_scale``). After ``growth_interval`` clean steps in a row the
    scale is multiplied by ``growth_factor`` and the hysteresis counter refills. ``update(found_inf, skip)``
    leaves everything as it was where the device flag ``skip`` is set (a step skipped for a reason that says
    nothing about the scale: an MoE capacity overflow, whose rerun updates the scaler).
    """

    def __init__(self, initial_scale: float = 2.0**16, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2, device=None):
        w = "DynamicLossScaler"
        pos = dict(expected="a finite number > 0", ok=lambda v: v > 0)
        initial_scale = _check_real(w, "initial_scale", initial_scale, **pos)
        min_scale = _check_real(w, "min_scale", min_scale, **pos)
        growth_factor = _check_real(w, "growth_factor", growth_factor, expected="a finite number > 1",
                                    ok=lambda v: v > 1)
        backoff_factor = _check_real(w, "backoff_factor", backoff_factor, expected="a number in (0, 1)",
                                     ok=lambda v: 0 < v < 1)
        for name, v in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{w}: {name} must be an int >= 1, got {v!r}")
        if min_scale > initial_scale:
            raise ValueError(f"{w}: min_scale ({min_scale}) must not exceed initial_scale ({initial_scale})")
        f = dict(dtype=torch.float32, device=device)
        self.scale = torch.full((), float(initial_scale), **f)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker = torch.zeros((), **f)
        self._hysteresis_tracker = torch.full((), float(hysteresis), **f)

    def update(self, found_inf: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        inf = found_inf.to(torch.bool)
        hyst = torch.where(inf, self._hysteresis_tracker - 1, self._hysteresis_tracker)
        backoff = inf & (hyst <= 0)
        growth = torch.where(inf, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = growth >= self.growth_interval
        scale = torch.where(backoff, torch.clamp(self.scale * self.backoff_factor, min=self.min_scale), self.scale)
        scale = torch.where(grow, scale * self.growth_factor, scale)
        growth = torch.where(grow, torch.zeros_like(growth), growth)
        hyst = torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst)
        if skip is not None:
            keep = skip.to(torch.bool)
            scale = torch.where(keep, self.scale, scale)
            growth = torch.where(keep, self._growth_tracker, growth)
            hyst = torch.where(keep, self._hysteresis_tracker, hyst)
        self.scale.copy_(scale)
        self._growth_tracker.copy_(growth)
        self._hysteresis_tracker.copy_(hyst)

    def state_dict(self):
        # copies, also on CPU: a saved state must not alias the live tensors
        return {"scale": self.scale.detach().to("cpu", copy=True),
                "growth_tracker": self._growth_tracker.detach().to("cpu", copy=True),
                "hysteresis_tracker": self._hysteresis_tracker.detach().to("cpu", copy=True)}

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


def _stream_capturing(device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    """ZeRO-1 Adam/AdamW over a :class:`moe_graph.distributed.ddp.DistributedDataParallel` model.

    Args:
        model: a ``DistributedDataParallel`` built with ``use_distributed_optimizer=True`` (or any
            object with ``all_buffers``, ``all_bucket_groups``, ``finish_grad_sync`` and
            ``zero_grad_buffer``), or a list of them (the model chunks of the interleaved pipeline
            schedule: one optimizer, one global grad norm; checkpoint names ``chunk{i}.<name>``).
        lr, betas, eps, weight_decay: Adam hyper-parameters (``lr`` lives in a device tensor;
            change it with :meth:`set_lr`). The settings are attributes (``beta1``, ``beta2``, ``eps``,
            ``weight_decay``, ``adamw``, ``clip_grad``); with ``impl="tensor"`` the numbers also live in device
            tensors written in place, so replays of a captured step see changes. A change a captured step
            cannot see (``adamw``; betas/eps/weight decay with ``impl="fused"``; clipping or weight decay
            turned on from 0) raises RuntimeError while a graph holds the step: call
            ``FullIterationGraph.reset()`` (or :meth:`release_captures` for a graph captured by hand).
        adamw: decoupled weight decay (AdamW, default) or L2 added to the gradient (Adam).
        clip_grad: clip by global grad norm when > 0.
        loss_scaler: ``None``, :class:`ConstantLossScaler` or :class:`DynamicLossScaler`; grads
            are divided by its scale; an inf/nan anywhere skips the update on every rank. With
            ``step(overflow=...)`` its ``update`` takes ``skip=`` as well.
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
                 tensor_model_parallel_rank: Optional[int] = None, expert_tensor_parallel_rank: Optional[int] = None,
                 fp8_param_gather=None):
        w = "DistributedOptimizer"
        if isinstance(model, (list, tuple)):
            if not model:
                raise ValueError("DistributedOptimizer: empty list of model chunks")
            for i, chunk in enumerate(model):
                if not getattr(chunk, "use_distributed_optimizer", False):
                    raise ValueError(f"DistributedOptimizer: model[{i}] must be a DistributedDataParallel built with "
                                     f"use_distributed_optimizer=True, got {type(chunk).__name__}")
            model = model[0] if len(model) == 1 else _ModelChunks(model)
        if not getattr(model, "use_distributed_optimizer", False):
            raise ValueError("DistributedOptimizer: model must be a DistributedDataParallel built with "
                             f"use_distributed_optimizer=True, got {type(model).__name__}")
        lr = _check_real(w, "lr", lr)
        settings = _check_settings(w, betas, eps, weight_decay, adamw, clip_grad)
        if impl not in ("auto", "fused", "tensor"):
            raise ValueError(f"impl must be 'auto', 'fused' or 'tensor', got {impl!r}")
        if loss_scaler is not None and not (isinstance(getattr(loss_scaler, "scale", None), torch.Tensor)
                                            and all(callable(getattr(loss_scaler, a, None))
                                                    for a in ("update", "state_dict", "load_state_dict"))):
            raise ValueError("DistributedOptimizer: loss_scaler must be None, a ConstantLossScaler or a "
                             f"DynamicLossScaler (a .scale tensor, update, state_dict, load_state_dict), got {loss_scaler!r}")
        for name, r in (("tensor_model_parallel_rank", tensor_model_parallel_rank),
                        ("expert_tensor_parallel_rank", expert_tensor_parallel_rank)):
            if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
                raise ValueError(f"DistributedOptimizer: {name} must be None or an int >= 0, got {r!r}")
        for name, g in (("expert_model_parallel_group", expert_model_parallel_group),
                        ("model_parallel_group", model_parallel_group)):
            if not (g is None or (isinstance(g, str) and g == "auto") or isinstance(g, dist.ProcessGroup)):
                raise ValueError(f"DistributedOptimizer: {name} must be 'auto', None or a torch.distributed "
                                 f"ProcessGroup, got {g!r}")

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
        self._settings: Dict[str, object] = settings  # Python values; the tensor path reads _settings_t
        self._captures: Dict[object, Dict[str, object]] = {}  # capture token -> settings captured
        self.loss_scaler = loss_scaler
        self.expert_model_parallel_group = expert_model_parallel_group
        self.model_parallel_group = model_parallel_group
        expert_buffers = set(map(id, getattr(model, "expert_parallel_buffers", [])))
        no_wd = list(no_weight_decay_params or [])
        in_model = {p for buf in model.all_buffers for p in buf.param_index_map}
        for i, p in enumerate(no_wd):
            if not isinstance(p, torch.Tensor) or p not in in_model:
                raise ValueError(f"DistributedOptimizer: no_weight_decay_params[{i}] is not a trainable parameter of "
                                 f"the model (got {type(p).__name__}{' ' + str(tuple(p.shape)) if isinstance(p, torch.Tensor) else ''})")
        no_wd = set(no_wd)
        self.param_to_name = dict(getattr(model, "param_to_name", {}))

        self.shards: List[_Shard] = []
        device = None
        for buf in model.all_buffers:
            if buf.param_dtype not in (torch.float32, torch.float16, torch.bfloat16):
                kind = ("fp8 parameters (stored as torch.uint8) are not supported yet" if buf.param_dtype == torch.uint8
                        else f"parameters of dtype {buf.param_dtype} are not supported")
                names = [self.param_to_name.get(p, "?") for p in buf.params][:3]
                raise NotImplementedError(f"DistributedOptimizer: {kind} (params {names}...); supported parameter "
                                          "dtypes: torch.float32, torch.float16, torch.bfloat16")
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
        self.lr = torch.full((), lr, **f32)
        # settings read on the device by the tensor path (replays of a captured graph see new values)
        self._settings_t = {k: torch.full((), float(settings[k]), **f32) for k in _TENSOR_SETTINGS}
        self.step_count = torch.zeros((), **f32)
        # job-wide overflow flag of the last step (written in place: a captured step's output keeps its identity)
        self.found_overflow = torch.zeros((), dtype=torch.bool, device=device)
        # the device's FP8 non-finite flag (an alias, None without the extension), allocated here outside any graph
        # capture; cleared now: quantizations run before this optimizer existed are not its steps'
        self._fp8_inf = _fp8.nonfinite_flag(device)
        self._clear_fp8_inf()
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
        self._fp8_gathers: Dict[int, Fp8BucketGather] = {}
        if fp8_param_gather is not None and fp8_param_gather is not False:
            self._setup_fp8_param_gather(fp8_param_gather)

    def _setup_fp8_param_gather(self, recipe) -> None:
        """Mark the FP8 weights (``param.fp8_gathered``), build each bucket's FP8 gather and hook the FP8 caches
        to every full 16-bit gather (a checkpoint load, :meth:`gather_16bit_params`)."""
        try:
            recipe = _fp8.Float8BlockScaling() if recipe is True else _fp8.as_recipe(recipe)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"DistributedOptimizer: fp8_param_gather must be None, True or an FP8 recipe "
                             f"('blockwise', 'tensorwise', a moe_graph.fp8 or TE recipe), got {recipe!r}") from exc
        chunks = getattr(self.model, "chunks", [self.model])
        for chunk in chunks:
            module = getattr(chunk, "module", None)
            for m in (module.modules() if module is not None else ()):
                if getattr(m, "num_spare_experts_per_ep_rank", 0):
                    raise NotImplementedError("DistributedOptimizer: fp8_param_gather with echo spare slots "
                                              "(num_spare_experts_per_ep_rank > 0) is not supported: the spare "
                                              "copies are made from the 16-bit home weights, which are not gathered")
        weights = [p for buf in self.model.all_buffers for p in buf.params
                   if getattr(p, "fp8_grouped_weight", False) and p.dim() == 3]
        if not weights:
            raise ValueError("DistributedOptimizer: fp8_param_gather found no FP8 expert weight in the model "
                             "(GroupedLinear(single_grouped_weight=True) weights, e.g. MoELayer's experts)")
        for p in weights:  # every check before anything is written
            fp8_weight_tiles(recipe, tuple(p.shape))
        for p in weights:
            p.fp8_gathered = Fp8GatheredWeight(p, recipe)  # quantized here from the current weight
        self.fp8_param_gather = recipe
        for s in self.shards:
            if any(getattr(p, "fp8_gathered", None) is not None for p in s.bucket.params_list):
                self._fp8_gathers[id(s.bucket)] = Fp8BucketGather(
                    s.bucket, s.buffer, s.group, s.buffer.data_parallel_world_size, s.rank, recipe)
        for g in self.model.all_bucket_groups:
            params = [p for b in g.buckets if id(b) in self._fp8_gathers
                      for p in self._fp8_gathers[id(b)].fp8_params]
            if params:
                g.after_param_sync.append(lambda params=params: [p.fp8_gathered.refresh_local(p.detach())
                                                                 for p in params])

    def _param_sync(self) -> None:
        """After the update: all-gather every bucket's parameters; buckets with FP8 weights under
        ``fp8_param_gather`` move those as FP8 bytes (``Fp8BucketGather.sync``)."""
        for g in self.model.all_bucket_groups:
            if not any(id(b) in self._fp8_gathers for b in g.buckets):
                g.start_param_sync(async_op=False)
                continue
            for b in g.buckets:
                fg = self._fp8_gathers.get(id(b))
                if fg is not None:
                    fg.sync()
                elif g.data_parallel_world_size > 1:
                    all_gather_tensor(b.param_data, g.param_shard(b), group=g.data_parallel_group)

    def gather_16bit_params(self) -> None:
        """All-gather every bucket's 16-bit parameters (under ``fp8_param_gather`` the FP8 weights' 16-bit copy
        is otherwise current only on this rank's shard): before saving the model's ``state_dict``, evaluating
        it in 16 bits or reading those weights otherwise. The FP8 copies are re-quantized from the gathered
        weights (the same bytes). A collective: every rank calls it."""
        for g in self.model.all_bucket_groups:
            g.start_param_sync(async_op=False)

    def param_gather_bytes(self) -> Dict[str, int]:
        """Bytes each rank sends and receives per step in the parameter all-gathers (the full gathered size
        of every bucket: ``numel * element_size``, or the FP8 gather's padded blocks and its amax all-reduce
        under ``fp8_param_gather``) and what the 16-bit all-gather of the same buckets moves."""
        out = {"all_gather": 0, "amax_all_reduce": 0, "sixteen_bit_all_gather": 0}
        for s in self.shards:
            fg = self._fp8_gathers.get(id(s.bucket))
            if fg is not None:
                for k, v in fg.wire_bytes().items():
                    out[k] += v
            else:
                n = s.bucket.param_data.numel() * s.bucket.param_data.element_size()
                out["all_gather"] += n
                out["sixteen_bit_all_gather"] += n
        return out

    # ------------------------------------------------------------------
    def set_lr(self, lr) -> None:
        """Set the learning rate in place (no sync; replays of a captured graph see the new value).

        ``lr``: a finite number >= 0, or a one-element tensor (copied on its device without a check)."""
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            if lr.numel() != 1:
                raise ValueError(f"DistributedOptimizer.set_lr: lr must have one element, got shape {tuple(lr.shape)}")
            self.lr.copy_(lr.reshape(()))
            return
        self.lr.fill_(_check_real("DistributedOptimizer.set_lr", "lr", lr))

    # ------------------------------------------------------------------
    # settings and CUDA-graph capture
    # ------------------------------------------------------------------
    def _frozen_by_capture(self, new: Dict[str, object]) -> List[str]:
        """The settings in ``new`` whose change a captured graph of :meth:`step` would not see."""
        frozen = []
        for captured in self._captures.values():
            for name, value in new.items():
                old = captured[name]
                if value == old or name in frozen:
                    continue
                if (name == "adamw"  # picks the update rule (Python branch / kernel)
                        or (self.impl == "fused" and name in ("beta1", "beta2", "eps", "weight_decay"))  # kernel floats
                        or (name == "clip_grad" and old == 0.0)  # captured without the clipping code
                        or (name == "weight_decay" and old == 0.0)):  # captured without the decay code
                    frozen.append(name)
        return frozen

    def _check_settings_change(self, new: Dict[str, object]) -> None:
        frozen = self._frozen_by_capture(new)
        if frozen:
            raise RuntimeError(
                f"DistributedOptimizer: cannot change {', '.join(frozen)} while a captured CUDA graph holds this "
                f"optimizer's step (impl={self.impl!r} bakes {'it' if len(frozen) == 1 else 'them'} into the graph): "
                "call FullIterationGraph.reset() (the next step captures again with the new value), or "
                "release_captures() after discarding a graph captured by hand. Held in device tensors (changeable "
                f"under a graph): lr{', ' + ', '.join(self._device_settings()) if self._device_settings() else ''}.")

    def _device_settings(self) -> List[str]:
        """Settings a captured step reads from device tensors (changes reach replays)."""
        if self.impl == "fused":
            return ["clip_grad"]
        return [k for k in _TENSOR_SETTINGS]

    def _apply_settings(self, new: Dict[str, object]) -> None:
        """Commit validated settings: the Python values and, in place, their device tensors."""
        self._settings.update(new)
        for k, v in new.items():
            if k in self._settings_t:
                self._settings_t[k].fill_(float(v))

    def _set_setting(self, name: str, value) -> None:
        cur = self._settings
        merged = {**cur, name: value}
        betas = (merged["beta1"], merged["beta2"])
        new = _check_settings(f"DistributedOptimizer.{name}", betas, merged["eps"], merged["weight_decay"],
                              merged["adamw"], merged["clip_grad"])
        self._check_settings_change({name: new[name]})
        self._apply_settings({name: new[name]})

    def note_capture(self, token=None) -> None:
        """Record that :meth:`step` is being captured into a CUDA graph (called by ``step()`` itself when the
        current stream captures; ``token`` identifies the graph, given by :class:`moe_graph.cuda_graph.FullIterationGraph`).
        While a capture is held, changing a setting the graph baked in raises."""
        self._captures[token] = dict(self._settings)

    def release_captures(self, token=None) -> None:
        """Forget the capture ``token`` (``FullIterationGraph.reset()`` calls this), or every capture when
        ``token`` is None (after discarding a graph captured with ``torch.cuda.graph`` directly)."""
        if token is None:
            self._captures.clear()
        else:
            self._captures.pop(token, None)

    def zero_grad(self) -> None:
        """Zero the model's grad buffers (``DistributedDataParallel.zero_grad_buffer``) and clear the device's FP8
        non-finite flag (:func:`moe_graph.ops.fp8.nonfinite_flag`): the next :meth:`step` counts the quantizations
        of its own forward and backward passes, not those run before (an evaluation pass, an earlier model)."""
        self.model.zero_grad_buffer()
        self._clear_fp8_inf()

    def _clear_fp8_inf(self) -> None:
        if self._fp8_inf is not None:
            self._fp8_inf.zero_()

    beta1 = property(lambda self: self._settings["beta1"], lambda self, v: self._set_setting("beta1", v),
                     doc="Adam beta1 (a device tensor on the tensor path; a kernel constant on the fused path).")
    beta2 = property(lambda self: self._settings["beta2"], lambda self, v: self._set_setting("beta2", v),
                     doc="Adam beta2 (a device tensor on the tensor path; a kernel constant on the fused path).")
    eps = property(lambda self: self._settings["eps"], lambda self, v: self._set_setting("eps", v),
                   doc="Adam eps (a device tensor on the tensor path; a kernel constant on the fused path).")
    weight_decay = property(lambda self: self._settings["weight_decay"],
                            lambda self, v: self._set_setting("weight_decay", v),
                            doc="Weight decay (a device tensor on the tensor path; a kernel constant on the fused "
                                "path). A step captured with 0 has no decay code.")
    adamw = property(lambda self: self._settings["adamw"], lambda self, v: self._set_setting("adamw", v),
                     doc="Decoupled weight decay (True) or L2 (False): fixed in a captured step.")
    clip_grad = property(lambda self: self._settings["clip_grad"], lambda self, v: self._set_setting("clip_grad", v),
                         doc="Max global grad norm (0: no clipping), a device tensor. A step captured with 0 has no "
                             "clipping code.")

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
    def step(self, overflow: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Finish the grad reductions, update this rank's shards, all-gather the params.

        ``overflow``: this rank's one-element device flag (nonzero: set), e.g. an MoE dispatcher that met a route
        over its static capacity in ``overflow="rerun"`` mode (:func:`moe_graph.train.step.train_step`). It is summed
        in the all-reduce of the inf/nan check; set on any rank, the update is skipped on every rank as for an
        inf/nan step, and the loss scaler is left as it was (``update(found_inf, skip=...)``: the rerun updates
        it). The job-wide flag is written to :attr:`found_overflow` (0-dim bool, in place).

        Returns ``(update_successful, grad_norm)`` as 0-dim device tensors (no host sync).
        """
        if overflow is not None and (not isinstance(overflow, torch.Tensor) or overflow.numel() != 1
                                     or overflow.device != self.found_overflow.device):
            got = (f"a tensor of shape {tuple(overflow.shape)} on {overflow.device}" if isinstance(overflow, torch.Tensor)
                   else type(overflow).__name__)
            raise ValueError(f"DistributedOptimizer.step: overflow must be None or a one-element tensor on "
                             f"{self.found_overflow.device}, got {got}")
        if _stream_capturing(self.device):
            self.note_capture(_note_capture(self))
        self.model.finish_grad_sync()
        grads = []
        for s in self.shards:
            if s.main_grad is not s.grad:
                s.main_grad.copy_(s.grad)
            grads.append(s.main_grad)
        inv_scale = torch.reciprocal(self.loss_scaler.scale) if self.loss_scaler is not None else None

        # [inf flag, sum of squares, overflow flag] per statistics group, all-reduced, then summed: each group's
        # reduction spans every rank of the job (data- x model-parallel, or expert-data- x expert-model-parallel)
        total = torch.zeros(3, dtype=torch.float32, device=self.device)
        # an FP8 quantizer met an inf/NaN amax since the last step (ops.fp8.nonfinite_flag): counted as an inf
        fp8_inf = self._fp8_inf
        for group, expert, idx in self._stat_groups:
            gs = [grads[i] for i in idx]
            t = torch.zeros(3, dtype=torch.float32, device=self.device)
            if overflow is not None:
                t[2] = overflow.reshape(()).to(torch.float32)
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
            if fp8_inf is not None:
                t[0] += fp8_inf[0]
            counted = [v for i in idx for v in self.shards[i].norm_views]  # params counted on another rank left out
            t[1] = torch.stack(torch._foreach_norm(counted)).square().sum()
            if group is not None:
                dist.all_reduce(t, group=group)
            if expert and self.expert_model_parallel_group is not None:
                dist.all_reduce(t, group=self.expert_model_parallel_group)
            if not expert and self.model_parallel_group is not None:
                dist.all_reduce(t, group=self.model_parallel_group)
            total += t
        self._clear_fp8_inf()
        found_inf = total[0] > 0
        grad_norm = total[1].sqrt()
        overflowed = total[2] > 0
        self.found_overflow.copy_(overflowed)
        skip = found_inf | overflowed
        ok = torch.logical_not(skip)
        okf = ok.float()

        if self.clip_grad > 0.0:  # the value is read on the device: a captured step sees changes
            clip = self._settings_t["clip_grad"]
            coef = torch.clamp(clip / (grad_norm + 1e-6), max=1.0)
            coef = torch.where(ok & (clip > 0), coef, torch.ones_like(coef))
            torch._foreach_mul_(grads, coef)

        if self.impl == "fused":
            self._step_fused(grads, skip, okf)
        else:
            self._step_tensor(grads, skip, okf)

        # main -> model param shards, then all-gather every bucket's param_data
        for s in self.shards:
            if s.main_param is not s.model_param:
                s.model_param.copy_(s.main_param)
        self._param_sync()
        if self.loss_scaler is not None:  # an overflowed step leaves it alone: its rerun updates it
            if overflow is not None:
                self.loss_scaler.update(found_inf, skip=overflowed)
            else:
                self.loss_scaler.update(found_inf)
        return ok, grad_norm

    def _step_fused(self, grads, skip, okf):
        # torch's fused AdamW skips the whole update when found_inf == 1 (read on the device): here ``skip``
        # (inf/nan or overflow). The kernel only reads the step tensors, so every shard can share the one step count.
        self.step_count.add_(okf)
        fn = torch._fused_adamw_ if self.adamw else torch._fused_adam_
        fn([s.main_param for s in self.shards], grads, [s.exp_avg for s in self.shards],
           [s.exp_avg_sq for s in self.shards], [], [self.step_count] * len(self.shards), lr=self.lr,
           beta1=self.beta1, beta2=self.beta2, weight_decay=self.weight_decay, eps=self.eps, amsgrad=False,
           maximize=False, grad_scale=None, found_inf=skip.float())

    def _step_tensor(self, grads, skip, okf):
        # every setting is read from a device tensor: replays of a captured step see set values
        b1, b2, eps, wd = (self._settings_t[k] for k in ("beta1", "beta2", "eps", "weight_decay"))
        for g in grads:
            g.masked_fill_(skip, 0.0)
        self.step_count.add_(okf)
        step = torch.clamp(self.step_count, min=1.0)
        bc1 = 1.0 - torch.pow(b1, step)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, step))
        lr_ok = self.lr * okf
        step_size = lr_ok / bc1
        w1 = (1.0 - b1) * okf
        w2 = (1.0 - b2) * okf
        keep2 = 1.0 - w2
        for s, g in zip(self.shards, grads):
            p = s.main_param
            if self.weight_decay != 0.0:
                if self.adamw:
                    decay = 1.0 - lr_ok * wd
                    if s.wd_mask is None:
                        p.mul_(decay)
                    else:
                        p.mul_(torch.lerp(torch.ones_like(decay), decay, s.wd_mask))
                else:
                    g = torch.addcmul(g, p, wd * s.wd_mask if s.wd_mask is not None else wd)
            s.exp_avg.lerp_(g, w1)
            s.exp_avg_sq.mul_(keep2).addcmul_(g, g * w2)
            # p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps); a skipped step has step_size 0 -> denom inf
            denom = s.exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps).div_(step_size)
            p.addcdiv_(s.exp_avg, denom, value=-1.0)

    # ------------------------------------------------------------------
    # checkpointing: one file per rank, each holding only that rank's shard
    # ------------------------------------------------------------------
    def _name(self, p):
        name = self.param_to_name.get(p)
        if name is None:
            raise KeyError("DistributedOptimizer: parameter has no name (model.param_to_name)")
        return name

    def checkpoint_metadata(self) -> Dict:
        """The ``"metadata"`` of :meth:`state_dict` (sizes, ranks, every parameter's name, shape, dtype and whether
        it is an expert parameter), without copying any state."""
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
    def state_dict(self, checksum: bool = True) -> Dict:
        """This rank's shard of the optimizer state (no communication). Save one file per rank.

        ::

            {"format": "moe_graph.distributed_optimizer.sharded.v1",
             "step", "lr": 0-dim tensors, "hyper": {betas, eps, weight_decay, adamw, clip_grad},
             "loss_scaler": its state_dict() or None,
             "metadata": {"dp_size", "dp_rank", "expert_dp_size", "expert_dp_rank", "ep_size", "ep_rank",
                          "params": {name: {"shape", "dtype", "expert"}}},   # every param of the model
             "shard": {name: {"range": (start, end),    # in the flattened param, owned by this rank
                              "exp_avg", "exp_avg_sq": fp32 CPU tensors of end - start elements,
                              "main_param": the same, only for bf16/fp16 params}},
             "checksum": "sha256:<hex>"}   # over everything above (every tensor's bytes); see state_checksum

        Names are ``model.param_to_name`` (``named_parameters`` of the wrapped module). The
        tensors hold about ``1/dp`` of the state: the parts of this rank's bucket shards that are
        not padding. The fp32 params themselves are not included (they are the model's params:
        save the model's ``state_dict()`` as well).

        With expert / tensor / pipeline parallelism every model-parallel rank saves its own set of
        files (expert params share names across expert-parallel ranks but differ; ``ep_rank``
        tells them apart). :meth:`load_state_dict` takes all the files of one set.

        ``checksum=False`` leaves the checksum out (hashing runs at about 1 GB/s on the host); such a
        state must then be loaded with ``verify_checksum=False``.
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
        st = self._settings
        out = {
            "format": _FORMAT,
            "step": self.step_count.detach().cpu().clone(),
            "lr": self.lr.detach().cpu().clone(),
            "hyper": {"betas": (st["beta1"], st["beta2"]), "eps": st["eps"], "weight_decay": st["weight_decay"],
                      "adamw": st["adamw"], "clip_grad": st["clip_grad"]},
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "metadata": self.checkpoint_metadata(),
            "shard": shard,
        }
        if checksum:
            out["checksum"] = state_checksum(out)
        return out

    # ------------------------------------------------------------------ load: validate everything first --
    def _validate_shard(self, i: int, sd) -> Dict:
        """Checks the structure and values of saved shard ``i``; returns the parsed scalars
        ``{"step", "lr", "settings", "loss_scaler"}``. Raises ValueError naming the shard and the key."""
        w = f"load_state_dict: shard {i}"
        if not isinstance(sd, dict):
            raise ValueError(f"{w} must be a dict saved by DistributedOptimizer.state_dict(), got {type(sd).__name__}")
        if sd.get("format") != _FORMAT:
            raise ValueError(f"{w}: unknown checkpoint format {sd.get('format')!r} (expected {_FORMAT!r})")
        missing = [k for k in _STATE_KEYS if k not in sd]
        if missing:
            raise ValueError(f"{w} has no {missing} (a state saved by DistributedOptimizer.state_dict() has "
                             f"{list(_STATE_KEYS)})")
        step = _as_real(sd["step"])
        if step is None or not math.isfinite(step) or step < 0 or step != int(step):
            raise ValueError(f"{w}: 'step' must be a whole number >= 0 (a 0-dim tensor or a number), "
                             f"got {sd['step']!r}")
        lr = _check_real(w, "'lr'", sd["lr"], expected="a finite number >= 0 (a 0-dim tensor or a number)")
        hyper = sd["hyper"]
        if not isinstance(hyper, dict) or set(hyper) != set(_HYPER_KEYS):
            got = _keys(hyper) if isinstance(hyper, dict) else type(hyper).__name__
            raise ValueError(f"{w}: 'hyper' must be a dict with keys {sorted(_HYPER_KEYS)}, got {got}")
        settings = _check_settings(f"{w} 'hyper'", hyper["betas"], hyper["eps"], hyper["weight_decay"],
                                   hyper["adamw"], hyper["clip_grad"])
        scaler = sd["loss_scaler"]
        if scaler is not None and not isinstance(scaler, dict):
            raise ValueError(f"{w}: 'loss_scaler' must be None or a dict, got {type(scaler).__name__}")
        if scaler is not None and self.loss_scaler is not None:
            own = self.loss_scaler.state_dict()
            if set(scaler) != set(own):
                raise ValueError(f"{w}: 'loss_scaler' has keys {_keys(scaler)}, this optimizer's "
                                 f"{type(self.loss_scaler).__name__} expects {sorted(own)}")
            parsed = {}
            for k, v in scaler.items():
                x = _as_real(v)
                if x is None or not math.isfinite(x) or (k == "scale" and x <= 0):
                    raise ValueError(f"{w}: 'loss_scaler'[{k!r}] must be a finite number"
                                     f"{' > 0' if k == 'scale' else ''}, got {v!r}")
                parsed[k] = torch.full_like(own[k], x)
            scaler = parsed
        md = sd["metadata"]
        if not isinstance(md, dict) or not isinstance(md.get("params"), dict):
            raise ValueError(f"{w}: 'metadata' must be a dict with a 'params' dict")
        for k in ("ep_size", "ep_rank"):
            if not isinstance(md.get(k), int) or md[k] < 0:
                raise ValueError(f"{w}: 'metadata'[{k!r}] must be an int >= 0, got {md.get(k)!r}")
        numels = {}
        for name, m in md["params"].items():
            ok = (isinstance(m, dict) and isinstance(m.get("shape"), (tuple, list))
                  and all(isinstance(d, int) and d >= 0 for d in m["shape"])
                  and isinstance(m.get("dtype"), str) and isinstance(m.get("expert"), bool))
            if not ok:
                raise ValueError(f"{w}: 'metadata'['params'][{name!r}] must be {{'shape': ints, 'dtype': str, "
                                 f"'expert': bool}}, got {m!r}")
            numels[name] = math.prod(m["shape"])
        if not isinstance(sd["shard"], dict):
            raise ValueError(f"{w}: 'shard' must be a dict {{name: piece}}, got {type(sd['shard']).__name__}")
        for name, e in sd["shard"].items():
            where = f"{w}: piece {name!r}"
            if name not in numels:
                raise ValueError(f"{where} is not in the shard's 'metadata'['params']")
            if not isinstance(e, dict):
                raise ValueError(f"{where} must be a dict with 'range', 'exp_avg', 'exp_avg_sq', got {e!r}")
            r = e.get("range")
            if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(x, int) for x in r)
                    and 0 <= r[0] <= r[1] <= numels[name]):
                raise ValueError(f"{where}: 'range' must be (start, end) with 0 <= start <= end <= {numels[name]} "
                                 f"(the parameter's numel), got {r!r}")
            want = _PIECE_FIELDS if md["params"][name]["dtype"] in _SIXTEEN_BIT else _PIECE_FIELDS[1:]
            if set(e) != {"range", *want}:
                raise ValueError(f"{where} has keys {_keys(e)}, expected {sorted(('range',) + want)} "
                                 f"(for a {md['params'][name]['dtype']} parameter)")
            for k in want:
                t = e[k]
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 \
                        or t.numel() != r[1] - r[0]:
                    got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise ValueError(f"{where}: {k!r} must be a 1-D torch.float32 tensor of {r[1] - r[0]} elements "
                                     f"(range {tuple(r)}), got {got}")
        return {"step": step, "lr": lr, "settings": settings, "loss_scaler": scaler}

    def _plan_load(self, shards: List[Dict]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) copies that fill this rank's shards; raises on any inconsistency.
        The shards' structure has been checked by :meth:`_validate_shard`."""
        my_ep = self.checkpoint_metadata()
        meta: Dict[str, Dict] = {}
        pieces: Dict[str, List[Dict]] = {}
        for i, sd in enumerate(shards):
            md = sd["metadata"]
            for name, m in md["params"].items():
                first = meta.setdefault(name, m)
                if (tuple(first["shape"]), first["dtype"], first["expert"]) != (tuple(m["shape"]), m["dtype"], m["expert"]):
                    raise ValueError(f"load_state_dict: shard {i} describes {name!r} as {m}, an earlier shard as "
                                     f"{first} (files of different runs?)")
            for name, entry in sd["shard"].items():
                if md["params"][name]["expert"]:
                    if md["ep_size"] != my_ep["ep_size"]:
                        raise ValueError(f"load_state_dict: the checkpoint was saved with expert-parallel size "
                                         f"{md['ep_size']}, this run uses {my_ep['ep_size']} (not supported)")
                    if md["ep_rank"] != my_ep["ep_rank"]:
                        continue  # another expert-parallel rank's experts under the same name
                pieces.setdefault(name, []).append(entry)
        extra = sorted(set(meta) - set(my_ep["params"]))
        if extra:
            raise ValueError(f"load_state_dict: the checkpoint has parameters this model does not have: {extra[:5]}"
                             f"{' ...' if len(extra) > 5 else ''} (a different model, or files of another "
                             "model-parallel rank?)")
        for name, entries in pieces.items():  # the same element saved twice: a file passed twice, or mixed runs
            spans = sorted(tuple(e["range"]) for e in entries if e["range"][0] < e["range"][1])
            for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
                if b0 < a1:
                    raise ValueError(f"load_state_dict: elements [{b0}, {min(a1, b1)}) of {name!r} are in two shards "
                                     "(the same file passed twice?)")
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

    def _agreement_groups(self) -> List:
        """The process groups of :meth:`step` that a failing rank must release, in order: the data-parallel groups,
        then the model-parallel and expert model-parallel groups (:class:`~moe_graph.distributed.agreement.AllOrNone`
        agrees over them in turn)."""
        groups = [g for g, _, _ in self._stat_groups if g is not None]
        if self.model_parallel_group is not None and any(not e for _, e, _ in self._stat_groups):
            groups.append(self.model_parallel_group)
        if self.expert_model_parallel_group is not None and any(e for _, e, _ in self._stat_groups):
            groups.append(self.expert_model_parallel_group)
        return groups

    @torch.no_grad()
    def load_state_dict(self, state, verify_checksum: bool = True) -> None:
        """Load the sharded state saved by :meth:`state_dict` at any data-parallel size.

        ``state`` is the list of every saved shard of this model-parallel rank (``torch.load`` of
        each data-parallel rank's file, in any order); a single dict is taken as a one-shard list
        (a run saved at DP=1). Each rank copies, per parameter, the overlap of every saved range
        with the range it owns now. Expert params are taken from the shards of the same expert-parallel
        rank (the expert-parallel size must not change). Load the model's ``state_dict`` too (for fp32
        params the checkpointed values are the model's).

        Transactional: every shard is checked before anything is written (its checksum unless
        ``verify_checksum=False``, keys, types, hyper-parameters, loss-scaler keys, names, shapes, dtypes,
        each piece's numel and range, coverage of this rank's range, no element saved twice); then the ranks
        agree (:class:`~moe_graph.distributed.agreement.AllOrNone`: one exchange of the error messages per
        process group of :meth:`step`; a collective: every rank must call it). If any rank failed (any
        exception), every rank raises naming it (the failing one an error of its own type, the others a
        ``CollectiveFailure``, a RuntimeError) and the live state is left bit-identical. Otherwise the moments, fp32 main params, step,
        lr, hyper-parameters and loss-scaler state are copied, and the 16-bit model params are refreshed and
        all-gathered. While a captured CUDA graph holds :meth:`step`, a checkpoint whose hyper-parameters
        differ in a setting the graph baked in is refused (call ``FullIterationGraph.reset()`` first).
        """
        # every rank fails together, before anything is written, so that no rank waits in the all-gather
        with AllOrNone("load_state_dict", action="load its checkpoint shards",
                       outcome="nothing was loaded", groups=self._agreement_groups()) as agreement:
            if state is None or isinstance(state, (str, bytes)) or not isinstance(state, (dict, list, tuple)):
                raise ValueError("load_state_dict: state must be the dict returned by state_dict() or a list of "
                                 f"them (one per saved data-parallel rank), got {type(state).__name__}")
            shards = [state] if isinstance(state, dict) else list(state)
            if not shards:
                raise ValueError("load_state_dict: no shard given (an empty list)")
            parsed = []
            for i, sd in enumerate(shards):
                agreement.at(f"checking saved shard {i}")
                parsed.append(self._validate_shard(i, sd))
            if verify_checksum:
                for i, sd in enumerate(shards):
                    agreement.at(f"checking saved shard {i}")
                    if "checksum" not in sd:
                        raise ValueError(f"load_state_dict: shard {i} has no 'checksum' (saved with "
                                         "state_dict(checksum=False)?): pass verify_checksum=False to load it")
                    if sd["checksum"] != state_checksum(sd):
                        raise ValueError(f"load_state_dict: shard {i} fails its checksum (the file is corrupted or "
                                         "was edited; verify_checksum=False skips the check)")
            for i, p in enumerate(parsed[1:], 1):
                for k in ("step", "lr", "settings"):
                    if p[k] != parsed[0][k]:
                        raise ValueError(f"load_state_dict: shard {i} has {k} {p[k]}, shard 0 {parsed[0][k]} "
                                         "(the shards were saved at different steps or by different runs)")
            agreement.at("matching the saved shards to this rank's parameters")
            copies = self._plan_load(shards)
            new = parsed[0]
            agreement.at("comparing the saved hyper-parameters with those a captured graph baked in")
            self._check_settings_change(new["settings"])
        for dst, src in copies:
            dst.copy_(src)
        self.step_count.fill_(new["step"])
        self.lr.fill_(new["lr"])
        self._apply_settings(new["settings"])  # like torch.optim: hyper-parameters come back with the state
        if self.loss_scaler is not None and new["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(new["loss_scaler"])
        for s in self.shards:
            if s.main_param is not s.model_param:
                s.model_param.copy_(s.main_param)
        for g in self.model.all_bucket_groups:
            g.start_param_sync(async_op=False)


def state_checksum(state: Dict) -> str:
    """``"sha256:<hex>"`` over a saved optimizer state without its ``"checksum"`` entry: every tensor's dtype,
    shape and bytes and every other value, walked in sorted key order (tuples and lists alike)."""
    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(v.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().data)
        elif isinstance(v, dict):
            keys = sorted((k for k in v if not (v is state and k == "checksum")), key=repr)
            h.update(f"D{len(keys)};".encode())
            for k in keys:
                h.update(f"K{k!r};".encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)};".encode())
            for x in v:
                feed(x)
        else:
            h.update(f"V{v!r};".encode())

    feed(state)
    return "sha256:" + h.hexdigest()
