"""Contiguous parameter and gradient buffers, buckets and bucket groups (Megatron-core compatible).

A :class:`ParamAndGradBuffer` packs a list of parameters of one ``(param_dtype, grad_dtype)`` into
one flat gradient tensor (``grad_data``) and, under the distributed optimizer, one flat parameter
tensor (``param_data``). Every parameter gets ``param.main_grad``, a view into ``grad_data``; under
the distributed optimizer ``param.data`` is also re-pointed into ``param_data`` so that one
all-gather of a bucket refreshes every parameter in it.

Layout (identical to Megatron-core 0.19.2, quirks included)
-----------------------------------------------------------
Parameters are walked in *reverse* module order (roughly the order backward produces their grads).

Without the distributed optimizer there is no padding at all: parameter ``i`` starts where the
previous one ended, and a bucket closes right after the parameter whose end reaches
``bucket_size`` elements past the bucket start (``end - bucket_start >= bucket_size``). Shared
embeddings are *not* split out in this mode (Megatron-core 0.19.2 only does that in the
distributed-optimizer layout).

With ``use_distributed_optimizer=True``:

* every parameter start is rounded up to a multiple of 64 elements (128-byte alignment for 16-bit
  types);
* a bucket closes after the parameter that reaches ``bucket_size`` (as above), and its end is
  rounded up to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
  ``pad_buckets_for_high_nccl_busbw``) so that it splits evenly into ``dp`` shards;
* a parameter marked ``param.shared_embedding = True`` gets a bucket of its own: the bucket in
  progress is closed first (at the *64-aligned* start of the embedding, so that bucket's
  ``numel_unpadded`` includes the alignment gap), then the embedding's bucket is closed right
  after it;
* ``numel_unpadded`` of a bucket runs from the bucket start to the end of its last parameter:
  it counts the 64-alignment gaps between parameters and excludes only the bucket-end padding.

Example (distributed optimizer, dp=2, no bucket_size, params of 10, 100 and 1000 elements in
module order ``[a, b, c]``)::

    c: (0, 1000, 0)      b: (1024, 1124, 0)      a: (1152, 1162, 0)
    bucket_indices == [(0, 1280)], numel == 1280, numel_unpadded == 1162

Without the distributed optimizer the same params give ``c: (0, 1000)``, ``b: (1000, 1100)``,
``a: (1100, 1110)`` and ``numel == numel_unpadded == 1110``.

fp8 parameters (torch ``float8_*`` dtypes, or TransformerEngine ``Float8Tensor`` whose storage
lives in ``._data``) are stored as ``torch.uint8``; their gradient dtype follows the logical
(high-precision) dtype as in Megatron.

Nothing in this module needs the compiled extension.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "BufferKey",
    "Bucket",
    "BucketGroup",
    "ParamAndGradBuffer",
    "compute_param_layout",
    "group_params_for_buffers",
    "partition_buckets",
    "param_storage_dtype",
    "param_logical_dtype",
    "is_float8_param",
    "pad_to",
    "reduce_scatter_tensor",
    "all_gather_tensor",
]

_FLOAT8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)


# ----------------------------------------------------------------------------------------------
# dtype helpers
# ----------------------------------------------------------------------------------------------
def is_float8_param(param: torch.Tensor) -> bool:
    """True for a torch ``float8_*`` tensor or a TransformerEngine-style ``Float8Tensor``."""
    if param.dtype in _FLOAT8_DTYPES:
        return True
    return type(param).__name__ in ("Float8Tensor", "MXFP8Tensor") or hasattr(param, "_fp8_dtype")


def param_storage_dtype(param: torch.Tensor) -> torch.dtype:
    """Dtype of the buffer that stores ``param``: ``torch.uint8`` for fp8 params, else ``param.dtype``."""
    return torch.uint8 if is_float8_param(param) else param.dtype


def param_logical_dtype(param: torch.Tensor) -> torch.dtype:
    """High-precision dtype of ``param`` (the gradient dtype when grads are not reduced in fp32).

    TE ``Float8Tensor`` reports its fake high-precision dtype as ``param.dtype``; a raw torch
    ``float8_*`` parameter is treated as bf16 (override with ``param.logical_dtype``).
    """
    override = getattr(param, "logical_dtype", None)
    if override is not None:
        return override
    if param.dtype in _FLOAT8_DTYPES:
        return torch.bfloat16
    return param.dtype


BufferKey = namedtuple("BufferKey", ["param_dtype", "grad_dtype", "is_expert_parallel"])
BufferKey.__doc__ = """Identity of one buffer: storage dtype, grad dtype, and whether it holds expert
params (``param.allreduce == False``), which are reduced over the expert-data-parallel group."""


def group_params_for_buffers(
    params: Iterable[torch.nn.Parameter], grad_reduce_in_fp32: bool = False
) -> Dict[BufferKey, Tuple[List[torch.nn.Parameter], List[int]]]:
    """Group trainable params by :class:`BufferKey`, keeping module order inside each group.

    Returns ``{BufferKey: (params, param_indices)}``, where ``param_indices[i]`` is the index of
    ``params[i]`` among the params of the same *logical* dtype (fp8 params count with their
    high-precision dtype), as Megatron-core records for fp8 checkpoint conversion.

    Example: ``[w1 bf16, e1 bf16 (allreduce=False), b1 bf16]`` with ``grad_reduce_in_fp32=True``
    gives ``{(bf16, fp32, False): ([w1, b1], [0, 1]), (bf16, fp32, True): ([e1], [0])}``.
    """
    if params is None or isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise TypeError(f"group_params_for_buffers: params must be an iterable of parameters (e.g. "
                        f"model.parameters()), got {type(params).__name__}")
    out: Dict[BufferKey, Tuple[List[torch.nn.Parameter], List[int]]] = {}
    offsets: Dict[BufferKey, int] = {}
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"group_params_for_buffers: every entry of params must be a parameter, got "
                            f"{type(param).__name__}")
        if not param.requires_grad:
            raise ValueError("group_params_for_buffers: every param must have requires_grad=True")
        logical = param_logical_dtype(param)
        grad_dtype = torch.float32 if grad_reduce_in_fp32 else logical
        expert = not getattr(param, "allreduce", True)
        key = BufferKey(param_storage_dtype(param), grad_dtype, expert)
        plist, idx = out.setdefault(key, ([], []))
        okey = BufferKey(logical, grad_dtype, expert)
        idx.append(offsets.get(okey, 0))
        offsets[okey] = offsets.get(okey, 0) + 1
        plist.append(param)
    return out


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------
def pad_to(value: int, divisor: int) -> int:
    """Round ``value`` up to a multiple of ``divisor`` (``pad_to(65, 64) == 128``)."""
    return int(math.ceil(value / divisor) * divisor)


def _bucket_end_divisor(dp: int, pad_for_high_nccl_busbw: bool) -> int:
    return math.lcm(dp, 128, 2**16) if pad_for_high_nccl_busbw else math.lcm(dp, 128)


def compute_param_layout(
    numels: Sequence[int],
    data_parallel_world_size: int,
    *,
    bucket_size: Optional[int] = None,
    use_distributed_optimizer: bool = False,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embedding: Optional[Sequence[bool]] = None,
) -> Tuple[List[Tuple[int, int, int]], List[Tuple[int, int]], List[int]]:
    """Pure-integer layout of params with ``numels`` (module order) in one buffer.

    Returns ``(param_ranges, bucket_indices, per_bucket_numel_unpadded)`` where ``param_ranges[i]``
    is ``(start, end, bucket_id)`` of param ``i`` (module order; the walk itself is reversed).
    See the module docstring for the rules. Example::

        >>> compute_param_layout([10, 100, 1000], 2, use_distributed_optimizer=True)
        ([(1152, 1162, 0), (1024, 1124, 0), (0, 1000, 0)], [(0, 1280)], [1162])
    """
    if data_parallel_world_size < 1:
        raise ValueError(f"data_parallel_world_size must be >= 1, got {data_parallel_world_size}")
    if bucket_size is not None and (not isinstance(bucket_size, int) or isinstance(bucket_size, bool)
                                    or bucket_size <= 0):
        raise ValueError(f"bucket_size must be a positive int or None, got {bucket_size!r}")
    bad = [i for i, n in enumerate(numels) if not isinstance(n, int) or isinstance(n, bool) or n < 0]
    if bad:
        raise ValueError(f"numels must be ints >= 0, got {numels[bad[0]]!r} at index {bad[0]}")
    n = len(numels)
    if n == 0:
        raise ValueError("compute_param_layout: numels is empty (a buffer needs at least one param)")
    shared = list(shared_embedding) if shared_embedding is not None else [False] * n
    if len(shared) != n:
        raise ValueError(f"shared_embedding has {len(shared)} entries, expected {n} (one per param)")

    ranges: List[Optional[Tuple[int, int, int]]] = [None] * n
    bucket_indices: List[Tuple[int, int]] = []
    unpadded: List[int] = []

    if not use_distributed_optimizer:
        # Megatron-core 0.19.2 `_compute_default_per_buffer_param_layout`: no padding and no
        # shared-embedding split.
        start = bucket_start = 0
        bucket_id = 0
        open_bucket = False
        end = 0
        for i in reversed(range(n)):
            end = start + int(numels[i])
            ranges[i] = (start, end, bucket_id)
            open_bucket = True
            if bucket_size is not None and end - bucket_start >= bucket_size:
                unpadded.append(end - bucket_start)
                bucket_indices.append((bucket_start, end))
                bucket_start = end
                bucket_id += 1
                open_bucket = False
            start = end
        if open_bucket:
            unpadded.append(end - bucket_start)
            bucket_indices.append((bucket_start, end))
        return ranges, bucket_indices, unpadded  # type: ignore[return-value]

    # Megatron-core 0.19.2 `DistributedOptimizer._compute_per_buffer_param_layout`.
    divisor = _bucket_end_divisor(data_parallel_world_size, pad_buckets_for_high_nccl_busbw)
    state = {"bucket_start": 0, "bucket_id": 0}

    def finalize(last_end: int) -> int:
        unpadded.append(last_end - state["bucket_start"])
        bucket_end = pad_to(last_end, divisor)
        bucket_indices.append((state["bucket_start"], bucket_end))
        state["bucket_start"] = bucket_end
        state["bucket_id"] += 1
        return bucket_end

    start = 0
    end = 0
    open_bucket = False
    for i in reversed(range(n)):
        start = pad_to(start, 64)
        if shared[i] and open_bucket:
            start = finalize(start)
            open_bucket = False
        end = start + int(numels[i])
        ranges[i] = (start, end, state["bucket_id"])
        open_bucket = True
        if (bucket_size is not None and end - state["bucket_start"] >= bucket_size) or shared[i]:
            start = finalize(end)
            open_bucket = False
        else:
            start = end
    if open_bucket:
        finalize(end)
    return ranges, bucket_indices, unpadded  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# collectives (gloo and NCCL; the non-deprecated names where this torch has them)
# ----------------------------------------------------------------------------------------------
def reduce_scatter_tensor(output, input, group=None, async_op=False, op=dist.ReduceOp.SUM):
    """``output = sum over ranks of input[rank*n:(rank+1)*n]`` (``n = output.numel()``; may alias input)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def all_gather_tensor(output, input, group=None, async_op=False):
    """``output[rank*n:(rank+1)*n] = input of rank`` (``n = input.numel()``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _group_rank(group) -> int:
    return dist.get_rank(group)


# ----------------------------------------------------------------------------------------------
# buckets and buffers
# ----------------------------------------------------------------------------------------------
class Bucket:
    """A contiguous slice ``[offset, offset + grad_data.numel())`` of a buffer.

    Attributes: ``params_list`` (walk order, i.e. reverse module order), ``params`` (set),
    ``param_data`` (view into the buffer's ``param_data`` or ``None``), ``grad_data`` (view),
    ``offset``, ``numel_unpadded``, ``gradient_scaling_factor``, ``bucket_id``,
    ``param_to_index`` (``{param: (start, end)}`` relative to the bucket).
    """

    def __init__(self, params, param_data, grad_data, offset, numel_unpadded, gradient_scaling_factor,
                 bucket_id, param_index_map):
        self.params_list = list(params)
        self.params = set(self.params_list)
        if len(self.params) != len(self.params_list):
            raise ValueError("Bucket: duplicate parameters")
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index = {}
        for p in self.params_list:
            s, e, _ = param_index_map[p]
            self.param_to_index[p] = (s - offset, e - offset)

    def __repr__(self):
        return (f"Bucket(id={self.bucket_id}, offset={self.offset}, numel={self.grad_data.numel()}, "
                f"numel_unpadded={self.numel_unpadded}, params={len(self.params_list)})")


class ParamAndGradBuffer:
    """Contiguous param/grad storage for ``params`` of one ``(param_dtype, grad_dtype)``.

    Args:
        params: parameters in module order, all with the same storage dtype
            (:func:`param_storage_dtype`) and logical dtype, on one device.
        data_parallel_world_size: number of ranks the buffer is reduced (and, under the
            distributed optimizer, sharded) over.
        bucket_size: elements per bucket (a bucket closes after the param that reaches it);
            ``None`` = one bucket (plus shared-embedding buckets under the distributed optimizer).
        use_distributed_optimizer: pad for even sharding and re-point ``param.data`` into
            ``param_data``.
        pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp, 128, 2**16)``.
        grad_reduce_in_fp32: fp32 grad buffer (else the params' logical dtype).
        device: storage device (default: the params' device).
        data_parallel_group: process group of size ``data_parallel_world_size`` used by
            collectives (``None``: ``torch.distributed.group.WORLD`` when needed).
        gradient_scaling_factor: multiplied into grads before the reduction (default ``1/dp``).

    Attributes: ``param_dtype``, ``grad_dtype``, ``params``, ``param_index_map``
    (``{param: (start, end, bucket_id)}``), ``bucket_indices`` (``[(start, end)]``), ``numel``,
    ``numel_unpadded``, ``buckets`` (:class:`Bucket`), ``param_to_bucket``, ``param_data``
    (``[numel]`` of ``param_dtype`` or ``None``), ``grad_data`` (``[numel]`` of ``grad_dtype``).

    Example::

        >>> ps = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(100))]
        >>> buf = ParamAndGradBuffer(ps, 2, use_distributed_optimizer=True)
        >>> buf.param_index_map[ps[0]], buf.numel
        ((128, 138, 0), 256)
        >>> ps[0].main_grad.shape, ps[0].data.data_ptr() == buf.param_data[128:].data_ptr()
        (torch.Size([10]), True)
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        data_parallel_world_size: int,
        *,
        bucket_size: Optional[int] = None,
        use_distributed_optimizer: bool = False,
        pad_buckets_for_high_nccl_busbw: bool = False,
        grad_reduce_in_fp32: bool = False,
        device=None,
        data_parallel_group=None,
        gradient_scaling_factor: Optional[float] = None,
    ):
        if isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
            raise TypeError(f"ParamAndGradBuffer: params must be a list of parameters, got {type(params).__name__}")
        params = list(params)
        if len(params) == 0:
            raise ValueError("ParamAndGradBuffer: params is empty (expected at least one parameter)")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not (p.is_floating_point() or p.is_complex()
                                                       or is_float8_param(p)):
                got = f"a {p.dtype} tensor" if isinstance(p, torch.Tensor) else type(p).__name__
                raise TypeError(f"ParamAndGradBuffer: params[{i}] must be a floating-point parameter, got {got}")
        if len(set(params)) != len(params):
            raise ValueError("ParamAndGradBuffer: params contains duplicates")
        if not isinstance(data_parallel_world_size, int) or data_parallel_world_size < 1:
            raise ValueError(f"data_parallel_world_size must be an int >= 1, got {data_parallel_world_size!r}")
        storage = {param_storage_dtype(p) for p in params}
        logical = {param_logical_dtype(p) for p in params}
        if len(storage) != 1 or len(logical) != 1:
            raise ValueError(
                f"ParamAndGradBuffer: params must share one (param_dtype, grad_dtype); got storage dtypes "
                f"{sorted(map(str, storage))} and logical dtypes {sorted(map(str, logical))} "
                f"(use group_params_for_buffers to split them)")
        if data_parallel_group is not None and _group_size(data_parallel_group) != data_parallel_world_size:
            raise ValueError(
                f"data_parallel_group has {_group_size(data_parallel_group)} ranks but "
                f"data_parallel_world_size={data_parallel_world_size}")
        if gradient_scaling_factor is not None and not (
                isinstance(gradient_scaling_factor, (int, float)) and not isinstance(gradient_scaling_factor, bool)
                and math.isfinite(gradient_scaling_factor)):
            raise ValueError(f"gradient_scaling_factor must be a finite number or None, got {gradient_scaling_factor!r}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"ParamAndGradBuffer: device must be a torch.device or a device string, "
                                 f"got {device!r}") from exc
        devices = {p.device for p in params}
        if device is None:
            if len(devices) != 1:
                raise ValueError(f"ParamAndGradBuffer: params live on several devices {devices}; pass device=")
            device = next(iter(devices))

        self.params = params
        self.param_dtype = storage.pop()
        self.grad_dtype = torch.float32 if grad_reduce_in_fp32 else logical.pop()
        self.data_parallel_world_size = data_parallel_world_size
        self.data_parallel_group = data_parallel_group
        self.use_distributed_optimizer = use_distributed_optimizer
        self.pad_buckets_for_high_nccl_busbw = pad_buckets_for_high_nccl_busbw
        self.bucket_size = bucket_size
        self.gradient_scaling_factor = (
            1.0 / data_parallel_world_size if gradient_scaling_factor is None else float(gradient_scaling_factor))
        self.device = torch.device(device)

        ranges, self.bucket_indices, self.per_bucket_numel_unpadded = compute_param_layout(
            [p.numel() for p in params],
            data_parallel_world_size,
            bucket_size=bucket_size,
            use_distributed_optimizer=use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
            shared_embedding=[bool(getattr(p, "shared_embedding", False)) for p in params],
        )
        # Insertion order = walk order (reverse module order), as in Megatron.
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {
            params[i]: ranges[i] for i in reversed(range(len(params)))
        }
        self.numel = self.bucket_indices[-1][1]
        self.numel_unpadded = sum(self.per_bucket_numel_unpadded)
        assert self.numel_unpadded <= self.numel
        if use_distributed_optimizer:
            assert self.numel % data_parallel_world_size == 0
        else:
            assert self.numel == self.numel_unpadded

        self.param_data = (
            torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
            if use_distributed_optimizer else None
        )
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=self.device)

        # Map param.data / param.main_grad and build the buckets.
        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        per_bucket: List[List[torch.nn.Parameter]] = [[] for _ in self.bucket_indices]
        for param, (start, end, bucket_id) in self.param_index_map.items():
            if self.param_data is not None:
                self._repoint_param(param, start)
            param.main_grad = self.grad_data[start:end].view(param.shape)
            per_bucket[bucket_id].append(param)
        for bucket_id, (bstart, bend) in enumerate(self.bucket_indices):
            if use_distributed_optimizer:
                assert bstart % data_parallel_world_size == 0 and bend % data_parallel_world_size == 0
            bucket = Bucket(
                per_bucket[bucket_id],
                None if self.param_data is None else self.param_data[bstart:bend],
                self.grad_data[bstart:bend],
                bstart,
                self.per_bucket_numel_unpadded[bucket_id],
                self.gradient_scaling_factor,
                bucket_id,
                self.param_index_map,
            )
            self.buckets.append(bucket)
            for p in bucket.params_list:
                self.param_to_bucket[p] = bucket

    # ------------------------------------------------------------------
    def _repoint_param(self, param: torch.nn.Parameter, start: int) -> None:
        numel = param.numel()
        view = self.param_data[start:start + numel]
        if hasattr(param, "_data") and is_float8_param(param) and param.dtype not in _FLOAT8_DTYPES:
            # TransformerEngine Float8Tensor: the uint8 payload lives in ._data.
            old = param._data
            new = view.view(old.shape)
            new.copy_(old.view(torch.uint8) if old.dtype != torch.uint8 else old)
            param._data = new
            return
        old = param.data
        new = view.view(param.shape)
        if param.dtype != self.param_dtype:  # torch float8 param stored as uint8
            new = new.view(param.dtype)
        with torch.no_grad():
            new.copy_(old)
        param.data = new

    def _get(self, shape, start_index: int, grad: bool = True) -> torch.Tensor:
        """View of ``shape`` into ``grad_data`` (or ``param_data``) starting at ``start_index``."""
        data = self.grad_data if grad else self.param_data
        end = start_index + math.prod(shape)
        if end > self.numel:
            raise ValueError(f"_get: requested [{start_index}, {end}) past numel {self.numel}")
        return data[start_index:end].view(shape)

    def scale_gradients(self, scaling_factor: float) -> None:
        """``grad_data *= scaling_factor``."""
        self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradient buffer (``param.main_grad`` views included)."""
        self.grad_data.zero_()

    def nbytes(self) -> int:
        """Bytes held by ``param_data`` and ``grad_data``."""
        n = self.grad_data.numel() * self.grad_data.element_size()
        if self.param_data is not None:
            n += self.param_data.numel() * self.param_data.element_size()
        return n

    def __repr__(self):
        return (f"ParamAndGradBuffer(param_dtype={self.param_dtype}, grad_dtype={self.grad_dtype}, "
                f"params={len(self.params)}, numel={self.numel}, numel_unpadded={self.numel_unpadded}, "
                f"buckets={len(self.buckets)}, dp={self.data_parallel_world_size})")


# ----------------------------------------------------------------------------------------------
# bucket groups
# ----------------------------------------------------------------------------------------------
class BucketGroup:
    """Buckets whose gradient collectives are launched together.

    With ``overlap_grad_reduce`` the group launches its (async) all-reduce, or reduce-scatter under
    the distributed optimizer, as soon as every param in it reported ready during the last
    microbatch (:meth:`register_grad_ready`); :meth:`finish_grad_sync` waits for it (and launches
    it first if it never fired, e.g. a param got no gradient). Without overlap,
    :meth:`finish_grad_sync` runs the collective synchronously.

    Gradients are multiplied by each bucket's ``gradient_scaling_factor`` (``1/dp``) and summed
    (or, with ``average_in_collective``, multiplied by the factor and averaged by the collective),
    so the reduced grad is the average. Under the distributed optimizer only this rank's shard
    (``grad_data[rank*n:(rank+1)*n]``, ``n = numel/dp``) holds the reduced values afterwards.
    """

    def __init__(self, buckets: List[Bucket], data_parallel_group=None, data_parallel_world_size: int = 1,
                 *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                 average_in_collective: bool = False):
        self.buckets = list(buckets)
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce
        self.average_in_collective = average_in_collective
        self.param_to_bucket = {}
        self.params = set()
        for b in self.buckets:
            for p in b.params_list:
                self.param_to_bucket[p] = b
                self.params.add(p)
        self.ready_params: set = set()
        self.is_last_microbatch = True
        self.grad_reduce_handles: Optional[list] = None
        self.grad_reduce_dispatched = False
        self.param_gather_handles: Optional[list] = None
        # called after every completed 16-bit parameter all-gather (the FP8 parameter caches of
        # ``distributed.fp8_params`` re-quantize the gathered weights there)
        self.after_param_sync: list = []

    # -- helpers --------------------------------------------------------
    def _rank(self) -> int:
        return _group_rank(self.data_parallel_group) if self.data_parallel_world_size > 1 else 0

    def grad_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of ``bucket.grad_data``."""
        n = bucket.grad_data.numel() // self.data_parallel_world_size
        r = self._rank()
        return bucket.grad_data[r * n:(r + 1) * n]

    def param_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of ``bucket.param_data``."""
        n = bucket.param_data.numel() // self.data_parallel_world_size
        r = self._rank()
        return bucket.param_data[r * n:(r + 1) * n]

    def reset(self) -> None:
        """Prepare for the next iteration (called by ``zero_grad_buffer``)."""
        self.ready_params = set()
        self.is_last_microbatch = True
        self.grad_reduce_handles = None
        self.grad_reduce_dispatched = False

    # -- gradient reduction ---------------------------------------------
    def start_grad_sync(self) -> None:
        """Scale and launch the reductions of every bucket (async under overlap)."""
        if self.grad_reduce_dispatched:
            return
        async_op = self.overlap_grad_reduce
        handles = []
        op = dist.ReduceOp.SUM
        with torch.no_grad():
            if self.average_in_collective:
                op = dist.ReduceOp.AVG
            for b in self.buckets:
                if b.gradient_scaling_factor != 1.0:
                    b.grad_data.mul_(b.gradient_scaling_factor)
                if self.data_parallel_world_size == 1:
                    continue
                if self.use_distributed_optimizer:
                    h = reduce_scatter_tensor(self.grad_shard(b), b.grad_data, group=self.data_parallel_group,
                                              async_op=async_op, op=op)
                else:
                    h = dist.all_reduce(b.grad_data, op=op, group=self.data_parallel_group, async_op=async_op)
                if h is not None:
                    handles.append(h)
        self.grad_reduce_handles = handles if async_op else None
        self.grad_reduce_dispatched = True

    def finish_grad_sync(self) -> None:
        """Complete the reductions of this group (launching them first if they never started)."""
        if not self.grad_reduce_dispatched:
            self.start_grad_sync()
        if self.grad_reduce_handles:
            for h in self.grad_reduce_handles:
                h.wait()
        self.grad_reduce_handles = None

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Mark ``param``'s grad ready; launch the group's collective once all params are ready.

        Outside ``no_sync`` (the last microbatch) a parameter may become ready once per iteration: a second
        time raises ``RuntimeError`` (Megatron's "Cannot set grad twice"), since its new gradient would land
        in a buffer whose reduction already started and never be reduced itself."""
        if not self.overlap_grad_reduce:
            raise RuntimeError("register_grad_ready() needs overlap_grad_reduce=True")
        if not self.is_last_microbatch:
            return
        if param not in self.params:
            raise KeyError("register_grad_ready: param does not belong to this bucket group")
        if param in self.ready_params:
            # Megatron-core's "Cannot set grad twice": a second gradient of the same parameter before
            # the reduction finished would be accumulated into a buffer already being reduced and lost.
            raise RuntimeError(
                "register_grad_ready: Cannot set grad twice: a parameter's gradient became ready again after "
                "its bucket's reduction was launched (several microbatches, or a second backward, with "
                "overlap_grad_reduce=True). Run all microbatches but the last inside `with ddp.no_sync():` "
                "(moe_graph.train.step.train_step and the pipeline schedules do), and call "
                "ddp.zero_grad_buffer() before each iteration.")
        self.ready_params.add(param)
        if len(self.ready_params) == len(self.params):
            self.start_grad_sync()

    # -- parameter all-gather (distributed optimizer) ---------------------
    def start_param_sync(self, async_op: bool = False) -> None:
        """All-gather every bucket's ``param_data`` from the ranks' shards."""
        if not self.use_distributed_optimizer:
            raise RuntimeError("start_param_sync() needs use_distributed_optimizer=True")
        handles = []
        if self.data_parallel_world_size > 1:
            for b in self.buckets:
                # In-place: the input shard is a view of the output (fine for NCCL and gloo).
                h = all_gather_tensor(b.param_data, self.param_shard(b), group=self.data_parallel_group,
                                      async_op=async_op)
                if h is not None:
                    handles.append(h)
        self.param_gather_handles = handles if async_op else None
        if not async_op:
            for hook in self.after_param_sync:
                hook()

    def finish_param_sync(self) -> None:
        waited = bool(self.param_gather_handles)
        if self.param_gather_handles:
            for h in self.param_gather_handles:
                h.wait()
        self.param_gather_handles = None
        if waited:
            for hook in self.after_param_sync:
                hook()

    def __repr__(self):
        return f"BucketGroup(buckets={[b.bucket_id for b in self.buckets]}, params={len(self.params)})"


def partition_buckets(
    buffers: List[ParamAndGradBuffer],
    force_single_bucket_group: bool = False,
    *,
    overlap_grad_reduce: bool = False,
    average_in_collective: bool = False,
) -> List[BucketGroup]:
    """Regroup the buckets of ``buffers`` into :class:`BucketGroup` s (Megatron-core's rule).

    1. ``force_single_bucket_group``: every bucket of every buffer in one group.
    2. No fp8 (``uint8``) buffer: one group per bucket, buffers in order.
    3. With an fp8 buffer: one group per fp8 bucket, and every non-fp8 bucket joins the *last*
       fp8 group (the fp8 buckets run from the model's end to its start, so the last group is the
       one whose grads come last anyway; merging small bf16 bias buckets there does not delay
       the earlier reductions).

    Example: fp8 buckets ``[F0, F1, F2]`` and a bf16 buffer with ``[B0]`` give
    ``[[F0], [F1], [F2, B0]]``.
    """
    if len(buffers) == 0:
        return []
    fp8 = [b for b in buffers if b.param_dtype == torch.uint8]
    if len(fp8) > 1:
        raise ValueError("partition_buckets: at most one fp8 (uint8) buffer is supported")
    first = buffers[0]

    def make(buckets, buf):
        return BucketGroup(buckets, buf.data_parallel_group, buf.data_parallel_world_size,
                           use_distributed_optimizer=buf.use_distributed_optimizer,
                           overlap_grad_reduce=overlap_grad_reduce,
                           average_in_collective=average_in_collective)

    if force_single_bucket_group:
        for b in buffers:
            if (b.data_parallel_world_size != first.data_parallel_world_size
                    or b.data_parallel_group is not first.data_parallel_group
                    or b.use_distributed_optimizer != first.use_distributed_optimizer):
                raise ValueError("partition_buckets: buffers of one bucket group must share the DP group and config")
        return [make([bk for b in buffers for bk in b.buckets], first)]
    if not fp8:
        return [make([bk], b) for b in buffers for bk in b.buckets]
    fp8_buffer = fp8[0]
    non_fp8 = [bk for b in buffers if b.param_dtype != torch.uint8 for bk in b.buckets]
    groups = []
    nf = len(fp8_buffer.buckets)
    for i, bk in enumerate(fp8_buffer.buckets):
        groups.append(make([bk] + non_fp8 if i == nf - 1 else [bk], fp8_buffer))
    return groups
