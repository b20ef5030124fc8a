"""Data-parallel wrapper over contiguous param/grad buffers (Megatron-core's ``DistributedDataParallel``).

``DistributedDataParallel(module, ...)`` groups the module's trainable parameters by
``(param_dtype, grad_dtype, is_expert)`` (:func:`moe_graph.distributed.buffers.group_params_for_buffers`),
builds one :class:`~moe_graph.distributed.buffers.ParamAndGradBuffer` per group (expert parameters, marked
``param.allreduce = False``, go to buffers sized for and reduced over the expert-data-parallel
group), regroups the buckets into bucket groups (:func:`~moe_graph.distributed.buffers.partition_buckets`) and
registers one gradient-accumulation hook per parameter (for weights with delayed weight gradients,
``skip_backward_post_hook``, on their module's ``register_wgrad_accumulation_and_reduce_hooks``: the hook
then runs at the end of ``module.backward_dw()``).

The hook (``register_post_accumulate_grad_hook``) adds ``param.grad`` into ``param.main_grad``
unless a fused GEMM already did (``param.grad_added_to_main_grad = True``), then drops
``param.grad``. It has no data-dependent Python branch and no host sync, so it runs unchanged
while a CUDA graph is being captured (the ``add_`` is recorded like any other kernel).

Typical iteration::

    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, overlap_grad_reduce=True)
    opt = moe_graph.distributed.optimizer.DistributedOptimizer(ddp, lr=1e-3)
    ddp.zero_grad_buffer()
    with ddp.no_sync():                    # all microbatches but the last: no communication
        for mb in microbatches[:-1]:
            loss_fn(ddp(mb)).backward()
    loss_fn(ddp(microbatches[-1])).backward()   # buckets launch their reductions when ready
    opt.step()                             # finish_grad_sync, Adam on the shard, all-gather params

As a pipeline model chunk (:mod:`moe_graph.train.schedules`), the wrapper forwards ``set_input_tensor`` to
the module, and its methods plug into the schedule as in Megatron::

    config = PipelineConfig(..., no_sync_func=ddp.no_sync, grad_sync_func=ddp.start_grad_sync)
    forward_backward_func(..., model=ddp, config=config)
    ddp.finish_grad_sync()

(one entry per chunk in lists for the interleaved schedule).

Gradients are scaled by ``1/dp`` (``dp`` = size of the dense data-parallel group, also for expert
params, as in Megatron with ``average_in_collective=False``) before the sum-reduction.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps
from moe_graph.distributed.buffers import BucketGroup, ParamAndGradBuffer, group_params_for_buffers, partition_buckets

__all__ = ["DistributedDataParallel"]


def _resolve_group(group):
    """(group, size): the given group, else WORLD when torch.distributed is initialized, else (None, 1)."""
    if group is None:
        if dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        else:
            return None, 1
    return group, dist.get_world_size(group)


def _check_ddp_args(module, data_parallel_group, expert_data_parallel_group, bucket_size) -> None:
    """Argument checks of :class:`DistributedDataParallel` (before anything is built)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
    for name, g in (("data_parallel_group", data_parallel_group),
                    ("expert_data_parallel_group", expert_data_parallel_group)):
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"DistributedDataParallel: {name} must be None or a torch.distributed ProcessGroup, "
                            f"got {type(g).__name__}")
    if bucket_size is not None and (not isinstance(bucket_size, int) or isinstance(bucket_size, bool)
                                    or bucket_size <= 0):
        raise ValueError(f"DistributedDataParallel: bucket_size must be a positive int or None, got {bucket_size!r}")


def _check_experts_replicated(module: torch.nn.Module, dp: int) -> None:
    """Refuse to reduce expert params over the dense DP group unless every rank of it holds the same experts."""
    if dp == 1 or all(getattr(p, "allreduce", True) for p in module.parameters()):
        return
    sharded = [name for name, m in module.named_modules()
               if getattr(m, "num_ep_ranks", 1) > 1 and hasattr(m, "experts")]  # MoELayer with EP
    if sharded:
        raise ValueError(
            f"DistributedDataParallel: MoE layers {sharded[:3]} use expert parallelism but no "
            "expert_data_parallel_group was given and moe_graph.parallel_state is not initialized; reducing expert "
            f"parameters over the dense data-parallel group ({dp} ranks) would average different experts. Pass "
            "expert_data_parallel_group=<the ranks holding the same experts> or call "
            "parallel_state.initialize_model_parallel(expert_model_parallel_size=...)")


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` with contiguous grad buffers, bucketed reductions and grad hooks.

    Args:
        module: the model (parameters may be fp32, bf16, fp16 or fp8).
        data_parallel_group: dense data-parallel group. Default: :mod:`moe_graph.parallel_state`'s
            data-parallel group (with context parallelism, as Megatron) when it is initialized, else WORLD
            when torch.distributed is initialized, else none.
        expert_data_parallel_group: group for expert params (``allreduce=False``): the ranks holding the
            *same* experts. Default: parallel_state's expert-data-parallel group when it is initialized; else
            the dense group, unless a ``MoELayer`` in the module has ``ep_size > 1``: then ``ValueError`` (the
            dense group holds different experts, and averaging them would silently corrupt them).
        use_distributed_optimizer: reduce-scatter instead of all-reduce; pad buffers for even
            sharding and move ``param.data`` into the buffers (needed by
            :class:`moe_graph.distributed.optimizer.DistributedOptimizer`).
        overlap_grad_reduce: launch each bucket group's collective asynchronously as soon as all
            its params have their grads (last microbatch only); :meth:`finish_grad_sync` waits.
        bucket_size: elements per bucket. ``None``: Megatron's default, ``max(40M, 1M * dp)`` with
            overlap and a single bucket without it.
        grad_reduce_in_fp32: fp32 grad buffers for 16-bit params.
        pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp, 128, 2**16)``.
        average_in_collective: use ``ReduceOp.AVG`` (NCCL) instead of pre-scaling and summing.
        disable_bucketing: one bucket group for everything (and no size-based bucket split).

    Attributes: ``module``, ``buffers``, ``expert_parallel_buffers``, ``bucket_groups``,
    ``expert_parallel_bucket_groups``, ``param_to_bucket_group``, ``data_parallel_group``,
    ``data_parallel_world_size``, ``expert_data_parallel_group``, ``bucket_size``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        data_parallel_group=None,
        expert_data_parallel_group=None,
        use_distributed_optimizer: bool = False,
        overlap_grad_reduce: bool = False,
        bucket_size: Optional[int] = None,
        grad_reduce_in_fp32: bool = False,
        pad_buckets_for_high_nccl_busbw: bool = False,
        average_in_collective: bool = False,
        disable_bucketing: bool = False,
    ):
        super().__init__()
        _check_ddp_args(module, data_parallel_group, expert_data_parallel_group, bucket_size)
        self.module = module
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.average_in_collective = average_in_collective

        ps_on = ps.model_parallel_is_initialized()
        if data_parallel_group is None and ps_on:
            data_parallel_group = ps.get_data_parallel_group(with_context_parallel=True)
        if expert_data_parallel_group is None and ps_on:
            expert_data_parallel_group = ps.get_expert_data_parallel_group()
        self.data_parallel_group, self.data_parallel_world_size = _resolve_group(data_parallel_group)
        if expert_data_parallel_group is None:
            _check_experts_replicated(module, self.data_parallel_world_size)
            self.expert_data_parallel_group = self.data_parallel_group
            self.expert_data_parallel_world_size = self.data_parallel_world_size
        else:
            self.expert_data_parallel_group, self.expert_data_parallel_world_size = _resolve_group(
                expert_data_parallel_group)
        dp = self.data_parallel_world_size
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = max(40_000_000, 1_000_000 * dp)
        if not overlap_grad_reduce or disable_bucketing:
            bucket_size = None  # Megatron: buckets only matter when reductions overlap backward
        self.bucket_size = bucket_size

        params: List[torch.nn.Parameter] = []
        self.param_to_name: Dict[torch.nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            p.grad_added_to_main_grad = False
            self.param_to_name[p] = name
            params.append(p)
        if not params:
            raise ValueError("DistributedDataParallel: module has no parameter with requires_grad=True")

        if average_in_collective:
            dense_scale = 1.0
            expert_scale = self.expert_data_parallel_world_size / dp
        else:
            dense_scale = expert_scale = 1.0 / dp

        self.buffers: List[ParamAndGradBuffer] = []
        self.expert_parallel_buffers: List[ParamAndGradBuffer] = []
        for key, (plist, _indices) in group_params_for_buffers(params, grad_reduce_in_fp32).items():
            group, size = ((self.expert_data_parallel_group, self.expert_data_parallel_world_size)
                           if key.is_expert_parallel else (self.data_parallel_group, dp))
            buf = ParamAndGradBuffer(
                plist, size, bucket_size=bucket_size,
                use_distributed_optimizer=use_distributed_optimizer,
                pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
                grad_reduce_in_fp32=grad_reduce_in_fp32,
                data_parallel_group=group,
                gradient_scaling_factor=expert_scale if key.is_expert_parallel else dense_scale,
            )
            (self.expert_parallel_buffers if key.is_expert_parallel else self.buffers).append(buf)

        kw = dict(overlap_grad_reduce=overlap_grad_reduce, average_in_collective=average_in_collective)
        self.bucket_groups: List[BucketGroup] = partition_buckets(self.buffers, disable_bucketing, **kw)
        self.expert_parallel_bucket_groups: List[BucketGroup] = partition_buckets(
            self.expert_parallel_buffers, disable_bucketing, **kw)
        self.param_to_bucket_group: Dict[torch.nn.Parameter, BucketGroup] = {}
        for g in self.all_bucket_groups:
            for p in g.params:
                self.param_to_bucket_group[p] = g

        delayed = [p for p in params if getattr(p, "skip_backward_post_hook", False)]
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                              for p in params if not getattr(p, "skip_backward_post_hook", False)]
        self._register_delayed_wgrad_hooks(delayed)

    # ------------------------------------------------------------------
    @property
    def all_buffers(self) -> List[ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    @property
    def all_bucket_groups(self) -> List[BucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _register_delayed_wgrad_hooks(self, delayed: List[torch.nn.Parameter]) -> None:
        """Weights whose gradient is computed later by their module's ``backward_dw()`` (TE/moe_graph
        ``delay_wgrad_compute``, marked ``skip_backward_post_hook``) get their grad-ready hook through the module's
        ``register_wgrad_accumulation_and_reduce_hooks``, as in Megatron's DDP."""
        if not delayed:
            return
        todo = {id(p): p for p in delayed}
        for module in self.module.modules():
            register = getattr(module, "register_wgrad_accumulation_and_reduce_hooks", None)
            if register is None:
                continue
            for p in module.parameters(recurse=False):
                if todo.pop(id(p), None) is not None:
                    hook = self._make_hook(p)
                    register(lambda p=p, hook=hook: hook(p))
        if todo:
            names = [self.param_to_name[p] for p in todo.values()]
            raise ValueError(
                f"DistributedDataParallel: parameters {names} are marked skip_backward_post_hook (delayed weight "
                "gradients) but no module owning them has register_wgrad_accumulation_and_reduce_hooks")

    def _make_hook(self, param: torch.nn.Parameter):
        group = None

        def hook(p: torch.nn.Parameter) -> None:
            nonlocal group
            if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                p.main_grad.add_(p.grad)
            p.grad = None
            if self.overlap_grad_reduce:
                if group is None:
                    group = self.param_to_bucket_group[p]
                group.register_grad_ready(p)

        return hook

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, input_tensor) -> None:
        """Pass the previous pipeline stage's activation to the wrapped model chunk (as Megatron's wrapper).

        The pipeline schedules (:mod:`moe_graph.train.schedules`) call ``model_chunk.set_input_tensor(t)``
        before each forward step (with ``None`` on the first stage). A module without the method
        accepts ``None`` (nothing to pass on) and raises ``TypeError`` for a real activation.
        """
        fn = getattr(self.module, "set_input_tensor", None)
        if fn is None:
            if input_tensor is None:
                return
            raise TypeError(
                f"DistributedDataParallel: wrapped module {type(self.module).__name__} has no "
                "set_input_tensor(tensor), so it cannot be a pipeline model chunk"
            )
        fn(input_tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate grads without launching reductions (all microbatches but the last)."""
        for g in self.all_bucket_groups:
            g.is_last_microbatch = False
        try:
            yield
        finally:
            for g in self.all_bucket_groups:
                g.is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer, clear ``grad_added_to_main_grad`` and reset the bucket groups."""
        for p in self.param_to_name:
            p.grad_added_to_main_grad = False
            p.grad = None
        for b in self.all_buffers:
            b.reset()
        for g in self.all_bucket_groups:
            g.reset()

    def start_grad_sync(self, *unused) -> None:
        """Launch the reductions of every bucket group that has not launched yet.

        Positional arguments are ignored, so the method can be the pipeline schedules'
        ``grad_sync_func``, which is called with the chunk's parameters (Megatron's signature).
        """
        for g in self.all_bucket_groups:
            g.start_grad_sync()

    def finish_grad_sync(self, *unused) -> None:
        """Complete every reduction (launching the ones not yet started). Idempotent per iteration.

        Positional arguments are ignored (same calling convention as :meth:`start_grad_sync`).
        """
        for g in self.all_bucket_groups:
            g.finish_grad_sync()

    def start_param_sync(self) -> None:
        """All-gather ``param_data`` of every bucket from the ranks' shards (distributed optimizer)."""
        for g in self.all_bucket_groups:
            g.start_param_sync(async_op=False)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy every parameter from the first rank of its data-parallel group to the others."""
        for p, _ in self.param_to_name.items():
            expert = not getattr(p, "allreduce", True)
            group = self.expert_data_parallel_group if expert else self.data_parallel_group
            if group is None or dist.get_world_size(group) == 1:
                continue
            src = dist.get_global_rank(group, 0)
            dist.broadcast(p.data, src=src, group=group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
