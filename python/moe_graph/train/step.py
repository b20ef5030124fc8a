"""The training step, wired correctly: microbatches, ``no_sync``, loss scaling, MoE aux losses, pipeline schedules.

:func:`train_step` runs one optimizer iteration of a :class:`moe_graph.distributed.ddp.DistributedDataParallel` model (or a
list of model chunks for the interleaved pipeline schedule) with a :class:`moe_graph.distributed.optimizer.DistributedOptimizer`:

1. ``optimizer.zero_grad()`` (the grad buffers);
2. forward and backward of every microbatch through the pipeline schedule of the layout
   (:func:`moe_graph.train.schedules.get_forward_backward_func`; no pipelining when parallel_state is not initialized or
   ``pp == 1``). The schedule divides each microbatch's loss by the number of microbatches, multiplies it by the
   optimizer's loss scale (``DynamicLossScaler``), runs every microbatch but the last inside ``ddp.no_sync()`` (so
   ``overlap_grad_reduce`` launches each bucket's reduction once, during the last backward) and sets the MoE
   aux/z-loss gradient scale to ``loss_scale / num_microbatches``
   (:meth:`moe_graph.moe.router.MoEAuxLossAutoScaler.set_loss_scale`);
3. ``optimizer.step()``: finish the reductions, unscale, global grad norm, clipping, Adam, param all-gather;
4. the auxiliary-loss-free expert-bias update of sigmoid routers (:func:`moe_graph.moe.router.update_expert_bias`).

It returns :class:`TrainStepResult` ``(loss, grad_norm, skipped)``: device tensors, no host sync, so the whole
step can be captured in one CUDA graph (:class:`moe_graph.cuda_graph.FullIterationGraph` over
:func:`make_train_step`). Example (one process; the same code runs on every rank of a distributed job)::

    model = MyModel()                      # forward(tokens, labels) -> scalar loss
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, overlap_grad_reduce=True)
    opt = DistributedOptimizer(ddp, lr=1e-3, clip_grad=1.0, loss_scaler=DynamicLossScaler())
    for step in range(steps):
        res = train_step(ddp, opt, [(tokens0, labels0), (tokens1, labels1)])   # two microbatches
        # res.loss: mean loss over microbatches and data-parallel ranks; res.grad_norm; res.skipped (inf/nan)

With pipeline parallelism pass ``tensor_shape`` (the activation of one microbatch between stages); on stages
other than the last, ``loss`` is ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps
from moe_graph.moe.router import update_expert_bias as _update_bias
from moe_graph.train import schedules

__all__ = ["TrainStepResult", "train_step", "make_train_step"]


class TrainStepResult(NamedTuple):
    """What one :func:`train_step` returns (0-dim device tensors).

    ``loss``: the mean reported loss over the microbatches and the data-parallel ranks (without the MoE aux
    losses, which only reach the gradients), ``None`` on pipeline stages other than the last. ``grad_norm``: the
    global grad norm before clipping. ``skipped``: True when the update was skipped (inf/nan gradients).
    """

    loss: Optional[torch.Tensor]
    grad_norm: torch.Tensor
    skipped: torch.Tensor


def _call(chunk, batch):
    if isinstance(batch, dict):
        return chunk(**batch)
    if isinstance(batch, (tuple, list)):
        return chunk(*batch)
    return chunk(batch)


def train_step(model, optimizer, microbatches: Sequence[Any], *, loss_func: Optional[Callable] = None,
               tensor_shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None,
               config=None, forward_backward_func: Optional[Callable] = None,
               update_expert_bias: bool = True, average_loss_over_data_parallel: bool = True) -> TrainStepResult:
    """One training iteration (see the module docstring).

    Args:
        model: a ``DistributedDataParallel`` (or a list of them: the model chunks of the interleaved schedule).
        optimizer: a ``DistributedOptimizer`` over ``model`` (``zero_grad()``, ``step() -> (ok, grad_norm)``,
            optional ``loss_scaler``).
        microbatches: one entry per microbatch: a tuple (``model(*mb)``), a dict (``model(**mb)``) or one
            tensor. Every pipeline stage gets the same list (each stage uses what it needs).
        loss_func: turns the last stage's output into the loss (``loss``, ``(loss, reported)`` or
            ``(loss, num_tokens, reported)``, as :mod:`moe_graph.train.schedules`); default: the output is the loss.
        tensor_shape, dtype: activation shape/dtype between pipeline stages (needed when ``pp > 1``).
        config: a :class:`moe_graph.train.schedules.PipelineConfig` to start from; ``grad_scale_func`` defaults to
            multiplying by the optimizer's loss scale.
        forward_backward_func: the schedule (default: from parallel_state, or the list length of ``model``).
        update_expert_bias: run :func:`moe_graph.moe.router.update_expert_bias` after the optimizer step.
        average_loss_over_data_parallel: average the returned loss over the data-parallel group (one
            all-reduce of a scalar).
    """
    chunks: List = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("train_step: model is an empty list of model chunks")
    microbatches = list(microbatches)
    if not microbatches:
        raise ValueError("train_step: microbatches is empty (expected at least one microbatch)")
    m = len(microbatches)
    if config is None:
        config = schedules.PipelineConfig()
    else:
        config = dataclasses.replace(config)
    if tensor_shape is not None:
        config.tensor_shape = tuple(tensor_shape)
    if dtype is not None:
        config.dtype = dtype
    scaler = getattr(optimizer, "loss_scaler", None)
    if config.grad_scale_func is None and scaler is not None:
        config.grad_scale_func = lambda loss: loss * scaler.scale.to(loss.dtype)
    if forward_backward_func is None:
        if ps.model_parallel_is_initialized():
            forward_backward_func = schedules.get_forward_backward_func()
        elif len(chunks) > 1:
            raise ValueError("train_step: several model chunks need parallel_state (pp, vpp) or forward_backward_func")
        else:
            forward_backward_func = schedules.forward_backward_no_pipelining
    interleaved = forward_backward_func is schedules.forward_backward_pipelining_with_interleaving
    if len(chunks) > 1 and not interleaved:
        raise ValueError(f"train_step: {len(chunks)} model chunks need the interleaved schedule")

    def forward_step(data_iterator, chunk):
        return _call(chunk, next(data_iterator)), (loss_func if loss_func is not None else (lambda out: out))

    optimizer.zero_grad()
    iters = [iter(microbatches) for _ in chunks]
    kwargs = dict(forward_step_func=forward_step, data_iterator=iters if interleaved else iters[0],
                  model=chunks if interleaved else chunks[0], num_microbatches=m, config=config)
    reported = forward_backward_func(**kwargs)
    ok, grad_norm = optimizer.step()
    if update_expert_bias:
        _update_bias(torch.nn.ModuleList([getattr(c, "module", c) for c in chunks]))
    loss = None
    if reported:
        loss = torch.stack([r.detach().float().reshape(()) for r in reported]).mean()
        group = getattr(chunks[0], "data_parallel_group", None)
        size = getattr(chunks[0], "data_parallel_world_size", 1)
        if average_loss_over_data_parallel and size > 1:
            dist.all_reduce(loss, group=group)
            loss = loss / size
    return TrainStepResult(loss, grad_norm, torch.logical_not(ok))


def make_train_step(model, optimizer, **kwargs) -> Callable[[Sequence[Any]], TrainStepResult]:
    """``step(microbatches) -> TrainStepResult``: :func:`train_step` with ``model``, ``optimizer`` and ``kwargs``
    bound (the callable :class:`moe_graph.cuda_graph.FullIterationGraph` captures)."""

    def step(microbatches):
        return train_step(model, optimizer, microbatches, **kwargs)

    return step
