"""Pipeline parallelism: point-to-point stage communication and the 1F1B / interleaved 1F1B schedules.

The model is cut into ``pp_size`` stages (and, interleaved, each stage into ``vpp_size`` model chunks;
virtual stage ``v * pp_size + r`` lives on pipeline rank ``r`` as its chunk ``v``). A global batch is
``num_microbatches`` (``m``) microbatches. Each rank runs a fixed sequence of forward (F) and backward
(B) steps, given by :func:`schedule_order`::

    >>> [f"{'F' if f else 'B'}{mb}" for f, mb, _ in schedule_order(4, 2, 0)]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']

* pp == 1 (:func:`forward_backward_no_pipelining`): ``F0 B0 F1 B1 ...``.
* 1F1B (:func:`forward_backward_pipelining_without_interleaving`): ``pp - rank - 1`` warm-up
  forwards, then alternate one forward and one backward, then drain the remaining backwards.
* interleaved 1F1B (:func:`forward_backward_pipelining_with_interleaving`): microbatches run in
  groups of ``microbatch_group_size_per_vp_stage`` (default ``pp``) per chunk; warm-up is
  ``2 * (pp - rank - 1) + (vpp - 1) * group`` forwards. Bubble fraction ``(pp - 1) / (m * vpp)``.
  With ``PipelineConfig.overlap_microbatches`` one more warm-up forward, and each steady step's forward
  runs beside its backward on two microbatch streams (1F1B refuses the option).

The schedule functions execute exactly :func:`schedule_order` (they consume it step by step and fail
loudly on any mismatch), which equals Megatron-core 0.19.2's order for the same arguments.

Communication goes through :class:`P2PCommunicator` (``_communicate`` with ``batch_isend_irecv`` or
plain ``isend``/``irecv``); received tensors land in preallocated buffers that are reused every
iteration (the k-th receive of a step always uses the same buffer), so addresses are static, as a
CUDA-graph capture of a whole step with NCCL requires.

Model-chunk contract (as in Megatron): ``forward_step_func(data_iterator, model_chunk)`` returns
``(output_tensor, loss_func)``; before it runs, ``model_chunk.set_input_tensor(t)`` receives the
previous stage's activation (``None`` on the first virtual stage). On the last virtual stage
``loss_func(output_tensor)`` returns ``loss``, ``(loss, reported)`` or ``(loss, num_tokens, reported)``;
the loss is divided by ``num_microbatches`` (and ``num_tokens``) before backward, and ``reported``
(default ``loss.detach()``) is appended to the list the schedule returns (empty on other stages).

A chunk wrapped in :class:`moe_graph.distributed.ddp.DistributedDataParallel` works as is (the wrapper passes
``set_input_tensor`` through); wire it as Megatron does: ``PipelineConfig(no_sync_func=ddp.no_sync,
grad_sync_func=ddp.start_grad_sync)`` (lists, one per chunk, when interleaved), then
``ddp.finish_grad_sync()`` after the schedule.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from moe_graph.train import flags

if __name__ == "__main__":  # a bad flag is refused (exit 2) before torch is imported
    flags.parse_schedules()

import torch  # noqa: E402

from moe_graph import parallel_state as ps
from moe_graph import streams
from moe_graph.moe.router import MoEAuxLossAutoScaler
from moe_graph.train import interleave
from moe_graph.train.p2p import P2PCommunicator, Shape, get_default_communicator

# ==================================================================================================
# Schedule order (pure Python)
# ==================================================================================================


class ScheduleStep(NamedTuple):
    """One step of a rank's schedule; equal to the plain tuple ``(is_forward, microbatch_id, model_chunk_id)``."""

    is_forward: bool
    microbatch_id: int
    model_chunk_id: int


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _resolve_schedule_args(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int],
    microbatch_group_size_per_vp_stage: Optional[int],
    overlap_microbatches: bool = False,
) -> int:
    """Validate schedule arguments; return the microbatch group size (interleaved) or 1."""
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("pp_size", pp_size, 1)
    _check_int("pp_rank", pp_rank, 0)
    if pp_rank >= pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if not isinstance(overlap_microbatches, bool):
        raise ValueError(f"overlap_microbatches must be a bool, got {overlap_microbatches!r}")
    if vpp_size is None:
        if overlap_microbatches and pp_size > 1:
            raise ValueError(
                f"overlap_microbatches with pp_size={pp_size} needs the interleaved schedule "
                "(forward_backward_pipelining_with_interleaving, vpp_size >= 1; one model chunk per stage, "
                "vpp_size=1, is allowed), as Megatron-core requires: in 1F1B the last stage's forward and backward "
                "of a steady step are the same microbatch, so they cannot run beside each other"
            )
        return 1
    _check_int("vpp_size", vpp_size, 1)
    if pp_size == 1:
        raise ValueError(
            f"vpp_size={vpp_size} (interleaved schedule) needs pp_size > 1; with pp_size=1 use vpp_size=None"
        )
    group = pp_size if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    _check_int("microbatch_group_size_per_vp_stage", group, 1)
    if group > num_microbatches or group < pp_size:
        raise ValueError(
            f"microbatch_group_size_per_vp_stage={group} (contiguous microbatches per virtual stage) must lie "
            f"in [pp_size={pp_size}, num_microbatches={num_microbatches}]"
        )
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        raise ValueError(
            f"num_microbatches={num_microbatches} % microbatch_group_size_per_vp_stage={group} = {remainder}: "
            f"the last microbatch group must be empty or hold at least pp_size={pp_size} microbatches "
            "(otherwise the interleaved pipeline stalls on dependency bubbles)"
        )
    return group


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> List[Tuple[int, int]]:
    """``(microbatch_id, model_chunk_id)`` of each virtual microbatch id, in forward order.

    Microbatches go through the chunks in groups of ``microbatch_group_size_per_vp_stage``: all
    chunks for group 0, then all chunks for group 1, ...; the last group takes what is left. Example
    (5 microbatches, 2 chunks, groups of 3)::

        >>> get_schedule_table(5, 2, 3)
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    """
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("num_model_chunks", num_model_chunks, 1)
    _check_int("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage, 1)
    table = []
    for start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        end = min(start + microbatch_group_size_per_vp_stage, num_microbatches)
        for chunk in range(num_model_chunks):
            table.extend((mb, chunk) for mb in range(start, end))
    return table


def num_warmup_microbatches(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
    overlap_microbatches: bool = False,
) -> int:
    """Forward steps a rank runs before its first backward (capped at ``m * (vpp or 1)``).

    ``0`` for pp == 1, ``pp - rank - 1`` for 1F1B, ``2 * (pp - rank - 1) + (vpp - 1) * group`` for
    the interleaved schedule (``group`` defaults to ``pp``); all steps when ``forward_only``.
    ``overlap_microbatches`` (interleaved only; 1F1B with pp > 1 raises): one more warm-up forward, as
    Megatron-core's ``get_pp_rank_microbatches`` schedules with ``overlap_moe_expert_parallel_comm``, so that
    the forward and the backward of every steady step are of different microbatches.

        >>> [num_warmup_microbatches(8, 4, r, vpp_size=2) for r in range(4)]
        [10, 8, 6, 4]
        >>> [num_warmup_microbatches(8, 4, r, vpp_size=2, overlap_microbatches=True) for r in range(4)]
        [11, 9, 7, 5]
    """
    group = _resolve_schedule_args(num_microbatches, pp_size, pp_rank, vpp_size, microbatch_group_size_per_vp_stage,
                                   overlap_microbatches)
    total = num_microbatches * (vpp_size or 1)
    if forward_only:
        warmup = total
    elif pp_size == 1:
        warmup = 0
    elif vpp_size is None:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * group + int(overlap_microbatches)
    return min(warmup, total)


def schedule_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
    overlap_microbatches: bool = False,
) -> List[ScheduleStep]:
    """The exact sequence of ``(is_forward, microbatch_id, model_chunk_id)`` steps of one rank.

    ``vpp_size=None`` selects 1F1B (or no pipelining when ``pp_size == 1``); an int selects the
    interleaved schedule with that many chunks. Forward step ``k`` runs virtual microbatch ``k`` of
    :func:`get_schedule_table`; backward step ``k`` runs the same microbatch on the mirrored chunk
    ``vpp - 1 - chunk``. After ``W = num_warmup_microbatches(...)`` forwards, forward ``W + i`` and
    backward ``i`` alternate; the last ``W`` backwards drain the pipeline. ``overlap_microbatches``: one more
    warm-up forward (interleaved; see :func:`num_warmup_microbatches`).

    Raises ``ValueError`` for configurations Megatron rejects (e.g. interleaving with
    ``num_microbatches % pp_size != 0`` at the default group size).

        >>> " ".join(format_step(s) for s in schedule_order(4, 2, 1, vpp_size=2))
        'F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0'
    """
    group = _resolve_schedule_args(num_microbatches, pp_size, pp_rank, vpp_size, microbatch_group_size_per_vp_stage,
                                   overlap_microbatches)
    chunks = vpp_size or 1
    table = get_schedule_table(num_microbatches, chunks, group)
    total = len(table)
    warmup = num_warmup_microbatches(
        num_microbatches, pp_size, pp_rank, vpp_size, microbatch_group_size_per_vp_stage, forward_only,
        overlap_microbatches
    )

    def fwd(k):
        return ScheduleStep(True, table[k][0], table[k][1])

    def bwd(k):
        return ScheduleStep(False, table[k][0], chunks - 1 - table[k][1])

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(fwd(warmup + k))
        order.append(bwd(k))
    if not forward_only:
        order.extend(bwd(k) for k in range(total - warmup, total))
    return order


def format_step(step: Tuple[bool, int, int]) -> str:
    """``F3.1`` = forward of microbatch 3 on model chunk 1; ``B0.0`` = backward of microbatch 0, chunk 0."""
    return f"{'F' if step[0] else 'B'}{step[1]}.{step[2]}"


def format_schedule(
    num_microbatches: int,
    pp_size: int,
    vpp_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
    overlap_microbatches: bool = False,
) -> str:
    """One line per pipeline rank: ``rank 0 (warmup 3): F0.0 F1.0 ...``."""
    lines = []
    for r in range(pp_size):
        args = (num_microbatches, pp_size, r, vpp_size, microbatch_group_size_per_vp_stage, forward_only,
                overlap_microbatches)
        order = schedule_order(*args)
        w = num_warmup_microbatches(*args)
        lines.append(f"rank {r} (warmup {w}): " + " ".join(format_step(s) for s in order))
    return "\n".join(lines)


# ==================================================================================================
# Layer assignment
# ==================================================================================================


def get_num_layers_per_chunk(num_layers: int, pp_size: int, vpp_size: Optional[int] = None) -> int:
    """Layers per model chunk (per stage when ``vpp_size`` is None); raises if they do not divide."""
    _check_int("num_layers", num_layers, 1)
    _check_int("pp_size", pp_size, 1)
    chunks = pp_size * (vpp_size or 1)
    if vpp_size is not None:
        _check_int("vpp_size", vpp_size, 1)
    if num_layers % chunks:
        raise ValueError(
            f"num_layers={num_layers} is not divisible by pp_size*vpp_size = {pp_size}*{vpp_size or 1} = {chunks}"
        )
    return num_layers // chunks


def get_layer_offset(
    num_layers: int, pp_size: int, pp_rank: int, vpp_size: Optional[int] = None, vpp_rank: int = 0
) -> int:
    """Index of the first layer of chunk ``vpp_rank`` on pipeline rank ``pp_rank``.

    ``pp_rank * L/pp`` without interleaving; ``vpp_rank * L/vpp + pp_rank * L/(pp*vpp)`` with it.
    8 layers, pp 2, vpp 2: rank 0 holds layers [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7]::

        >>> [get_layer_offset(8, 2, r, 2, v) for r in range(2) for v in range(2)]
        [0, 4, 2, 6]
    """
    per_chunk = get_num_layers_per_chunk(num_layers, pp_size, vpp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if vpp_size is None:
        if vpp_rank != 0:
            raise ValueError(f"vpp_rank {vpp_rank} given without vpp_size")
        return pp_rank * per_chunk
    if not 0 <= vpp_rank < vpp_size:
        raise ValueError(f"vpp_rank {vpp_rank} out of range for vpp_size {vpp_size}")
    return vpp_rank * (num_layers // vpp_size) + pp_rank * per_chunk


def chunk_layer_ids(num_layers: int, pp_size: int, pp_rank: int, vpp_size: Optional[int] = None) -> List[List[int]]:
    """Layer indices of each model chunk of ``pp_rank``: ``chunk_layer_ids(16, 4, 0, 2) == [[0, 1], [8, 9]]``."""
    per_chunk = get_num_layers_per_chunk(num_layers, pp_size, vpp_size)
    out = []
    for v in range(vpp_size or 1):
        start = get_layer_offset(num_layers, pp_size, pp_rank, vpp_size, v if vpp_size else 0)
        out.append(list(range(start, start + per_chunk)))
    return out


# ==================================================================================================
# Forward / backward steps
# ==================================================================================================


@dataclass
class PipelineConfig:
    """Knobs of the schedules (a subset of Megatron's ``ModelParallelConfig``).

    Attributes:
        tensor_shape: shape of the activation passed between stages for one microbatch, e.g.
            ``(seq, micro_batch, hidden)``. Required when ``pp > 1``.
        dtype: its dtype.
        batch_p2p_comm: ``batch_isend_irecv`` (True) or plain isend/irecv.
        deallocate_pipeline_outputs: after an activation is sent, shrink its storage to one
            element (only its autograd graph is still needed); backward then calls the autograd
            engine directly, skipping the shape check.
        no_sync_func: context-manager factory (or list, one per chunk) that disables gradient
            reduction; default: each chunk's ``no_sync`` if it has one.
        grad_sync_func: ``f(params)`` (or list per chunk) launching the gradient reduction of a
            chunk; called once per chunk after its last backward (e.g. ``ddp.start_grad_sync``).
        grad_scale_func: applied to the loss before backward (loss scaling). The schedules also set the
            MoE aux/z-loss gradient scale to ``grad_scale_func(1) / num_microbatches``
            (:func:`set_aux_loss_scale_for_step`), and back to 1 when they return.
        microbatch_group_size_per_vp_stage: interleaved group size (default ``pp``).
        trace: a list to which every executed step ``(is_forward, mb, chunk)`` is appended.
        overlap_microbatches: two microbatches in flight on two microbatch streams:
            :func:`forward_backward_no_pipelining` runs microbatch ``i + 1``'s forward beside microbatch ``i``'s
            backward (see :func:`forward_backward_overlapped`); :func:`forward_backward_pipelining_with_interleaving`
            runs one more warm-up forward and then each steady step's forward beside its backward (different
            microbatches). 1F1B rejects it (as Megatron-core does: pp > 1 needs virtual pipelining).
        interleave_stages: with ``overlap_microbatches``, issue the two microbatches in flight (``F(i + 1)`` and
            ``B(i)`` in the plain loop; each steady step's forward and backward in the interleaved pipeline schedule)
            stage by stage, alternating at the token exchanges (``B`` first: B-compute, B-exchange, F-compute,
            F-exchange, ...; :mod:`moe_graph.train.interleave`), so that the hiding of the exchange does not depend
            on which ready kernel the GPU runs first. ``F`` runs in a worker thread. Bitwise equal to the same
            schedule without it. Needs ``overlap_microbatches=True`` (``ValueError`` otherwise, naming both); 1F1B
            raises.
    """

    tensor_shape: Optional[Sequence[int]] = None
    dtype: torch.dtype = torch.float32
    batch_p2p_comm: bool = True
    deallocate_pipeline_outputs: bool = True
    no_sync_func: Optional[Union[Callable, List[Callable]]] = None
    grad_sync_func: Optional[Union[Callable, List[Callable]]] = None
    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None
    trace: Optional[list] = None
    overlap_microbatches: bool = False
    interleave_stages: bool = False


def _check_interleave_stages(config: "PipelineConfig", where: str) -> bool:
    """Validates ``config.interleave_stages``; returns it."""
    v = config.interleave_stages
    if not isinstance(v, bool):
        raise ValueError(f"{where}: interleave_stages must be a bool, got {v!r}")
    if v and not config.overlap_microbatches:
        raise ValueError(f"{where}: interleave_stages=True interleaves the two microbatches in flight: it needs "
                         "overlap_microbatches=True")
    return v


def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = True) -> None:
    """Replace ``out``'s storage by one element; its ``grad_fn`` (all backward needs) stays.

    Views are left alone (freeing them would not release their base's memory).
    """
    if out is None or not deallocate_pipeline_outputs or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _run_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """``output.backward(grad_output)`` through the C++ engine (no shape check, for freed outputs)."""
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True,
    )


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, input_tensor,
                 forward_data_store: list, config: PipelineConfig, is_last_stage: bool):
    """Run one microbatch through one model chunk; on the last stage, turn the output into the loss.

    Returns the stage output (or the scaled loss ``loss / num_microbatches`` on the last stage).
    """
    set_input = getattr(model, "set_input_tensor", None)
    if set_input is not None:
        set_input(input_tensor)
    elif input_tensor is not None:
        raise TypeError(
            f"model chunk {type(model).__name__} receives a pipeline activation but has no set_input_tensor(tensor)"
        )
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor
    if loss_func is None:
        forward_data_store.append(output_tensor)
        return output_tensor
    out = loss_func(output_tensor)
    if isinstance(out, torch.Tensor):
        loss, reported = out, out.detach()
    elif len(out) == 2:
        loss, reported = out
    elif len(out) == 3:
        loss, num_tokens, reported = out
        loss = loss / torch.clamp(torch.as_tensor(num_tokens, device=loss.device), min=1)
    else:
        raise TypeError("loss_func must return loss, (loss, reported) or (loss, num_tokens, reported)")
    forward_data_store.append(reported)
    return loss / num_microbatches


def backward_step(input_tensor, output_tensor, output_tensor_grad, config: PipelineConfig):
    """Backpropagate one microbatch through one chunk; returns the gradient of its input (or None)."""
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if config.deallocate_pipeline_outputs:
        _run_backward(output_tensor, output_tensor_grad)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    if input_tensor is None:
        return None
    grad = input_tensor.grad
    input_tensor.grad = None  # receive buffers are reused; do not accumulate into them
    return grad


def set_aux_loss_scale_for_step(config: PipelineConfig, models, num_microbatches: int) -> None:
    """Set the MoE aux/z-loss gradient scale (:class:`moe_graph.moe.router.MoEAuxLossAutoScaler`) to
    ``loss_scale / num_microbatches``, the factors the main loss gets (``loss_scale`` from
    ``config.grad_scale_func``, 1 without one), as Megatron's schedules do. Device work only (capturable)."""
    if config.grad_scale_func is None:
        MoEAuxLossAutoScaler.set_loss_scale(1.0 / num_microbatches)
        return
    device = None
    for m in models:
        for p in m.parameters():
            device = p.device
            break
        if device is not None:
            break
    one = torch.ones((), dtype=torch.float32, device=device)
    MoEAuxLossAutoScaler.set_loss_scale(config.grad_scale_func(one) / num_microbatches)


def _reset_aux_loss_scale() -> None:
    """Back to 1 after a schedule, so that a later hand-written backward does not inherit this step's factor."""
    MoEAuxLossAutoScaler.set_loss_scale(1.0)


class _GradSync:
    """Enter the no-sync context (grad reduction off) and leave it (on) on demand."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.ctx = None

    def disable(self):
        if self.ctx is None:
            self.ctx = self.factory()
            self.ctx.__enter__()

    def enable(self):
        if self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)

    @property
    def disabled(self) -> bool:
        return self.ctx is not None


def _no_sync_factory(config: PipelineConfig, models: List[Any]) -> Callable[[], Any]:
    fns = config.no_sync_func
    if fns is None:
        fns = [m.no_sync for m in models if callable(getattr(m, "no_sync", None))]
    elif not isinstance(fns, (list, tuple)):
        fns = [fns]

    def factory():
        stack = contextlib.ExitStack()
        for fn in fns:
            stack.enter_context(fn())
        return stack

    return factory


class _Steps:
    """Walks a rank's :func:`schedule_order`; every executed step must be the next one in it."""

    def __init__(self, order: List[ScheduleStep], trace: Optional[list]):
        self.order, self.trace, self.i = order, trace, 0

    def take(self, is_forward: bool, microbatch_id: int, chunk: int) -> None:
        want = self.order[self.i] if self.i < len(self.order) else None
        got = ScheduleStep(is_forward, microbatch_id, chunk)
        if want != got:
            raise RuntimeError(f"pipeline schedule drift at step {self.i}: executing {got}, schedule_order says {want}")
        self.i += 1
        if self.trace is not None:
            self.trace.append(got)

    def finish(self) -> None:
        if self.i != len(self.order):
            raise RuntimeError(f"pipeline schedule ran {self.i} of {len(self.order)} steps")


def _as_list(x, n: int, what: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(f"{what}: expected {n} entries (one per model chunk), got {len(x)}")
        return list(x)
    return [x] * n


def _single_chunk(model, data_iterator, name: str):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"{name} takes one model chunk, got {len(model)}; use the interleaved schedule")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError(f"{name} takes one data iterator, got {len(data_iterator)}")
        data_iterator = data_iterator[0]
    return model, data_iterator


def _shape_dtype(config: PipelineConfig, tensor_shape, dtype):
    shape = tensor_shape if tensor_shape is not None else config.tensor_shape
    if shape is None:
        raise ValueError("pipeline schedules need tensor_shape (activation shape of one microbatch between stages)")
    return tuple(shape), (dtype if dtype is not None else config.dtype)


# ==================================================================================================
# Schedules
# ==================================================================================================


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator,
    model,
    num_microbatches: int,
    forward_only: bool = False,
    config: Optional[PipelineConfig] = None,
    **unused,
) -> list:
    """All microbatches on one stage: ``F0 B0 F1 B1 ...``; grad sync only for the last microbatch.

    Returns the list of per-microbatch reported losses.
    """
    config = config or PipelineConfig()
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_no_pipelining")
    _check_interleave_stages(config, "forward_backward_no_pipelining")
    if config.overlap_microbatches and not forward_only and num_microbatches > 1:
        return forward_backward_overlapped(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                           model=model, num_microbatches=num_microbatches, config=config)
    steps = _Steps(schedule_order(num_microbatches, 1, 0, forward_only=forward_only), config.trace)
    set_aux_loss_scale_for_step(config, [model], num_microbatches)
    sync = _GradSync(_no_sync_factory(config, [model]))
    store: list = []
    try:
        for mb in range(num_microbatches):
            if mb == num_microbatches - 1:
                sync.enable()  # the last microbatch runs with gradient reduction on
            else:
                sync.disable()
            steps.take(True, mb, 0)
            with streams.microbatch(mb):  # a label for a StreamRecorder only
                out = forward_step(forward_step_func, data_iterator, model, num_microbatches, None, store, config,
                                   True)
            if not forward_only:
                steps.take(False, mb, 0)
                backward_step(None, out, None, config)
            del out
    finally:
        sync.enable()
    steps.finish()
    _reset_aux_loss_scale()
    return store


_LANES: Dict[torch.device, Tuple[streams.SideStream, streams.SideStream]] = {}


def _microbatch_lanes(device: torch.device) -> Tuple[streams.SideStream, streams.SideStream]:
    """The two microbatch streams of ``device`` (made once: never during a CUDA graph capture)."""
    if device not in _LANES:
        _LANES[device] = tuple(streams.SideStream(device, f"microbatch{i}", whole_graph=True) for i in range(2))
    return _LANES[device]


class _MicrobatchStreams:
    """The shared part of the overlapped schedules: forwards on the two microbatch streams of the models' device
    (:func:`_microbatch_lanes`) and every gradient accumulator on the current stream.

    Each parameter's gradient accumulator is made on the current stream before the first fork (and a received
    activation's before the fork of the forward that reads it) and kept until :meth:`close`: autograd runs a node on
    the stream it was made on, so every microbatch's gradient accumulation, and the hooks on it (DDP's ``main_grad``
    add and bucket reduction launch), run on the current stream after waiting for the microbatch stream, and the
    schedule reads ``input.grad`` there. A forward's body runs on a lane after waiting for what the current stream
    issued before its fork (or before :meth:`mark`); :meth:`join` makes the current stream wait for the body's end.
    A backward is issued on the current stream and autograd runs its nodes on the lane of their forward.
    """

    def __init__(self, models: Sequence[Any]):
        self.params = [p for m in models for p in m.parameters() if p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.lanes = _microbatch_lanes(device)
        self._pinned = [torch.autograd.graph.get_gradient_edge(p).node for p in self.params]

    def mark(self, lane: int) -> None:
        """The next forward on ``lane`` waits only for what is issued before this call."""
        self.lanes[lane].mark_fork()

    @contextlib.contextmanager
    def forward(self, lane: int, label: int, *inputs, marked: bool = False):
        """Runs the body (one forward) on microbatch stream ``lane``, labelled ``label`` for a StreamRecorder.
        ``inputs``: tensors made on the current stream that the body reads (a received activation; ``None``
        allowed)."""
        inputs = tuple(t for t in inputs if isinstance(t, torch.Tensor))
        self._pinned += [torch.autograd.graph.get_gradient_edge(t).node for t in inputs
                         if t.requires_grad and t.grad_fn is None]
        with streams.microbatch(label), self.lanes[lane].fork(*self.params, *inputs, marked=marked):
            yield

    def join(self, lane: int, out):
        """The current stream waits for the end of the last forward on ``lane``; returns ``out`` (its output)."""
        (out,) = self.lanes[lane].join(out)
        return out

    def close(self) -> None:
        self._pinned = []


def forward_backward_overlapped(*, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                                config: PipelineConfig) -> list:
    """Two microbatches in flight on one stage (``PipelineConfig.overlap_microbatches``): microbatch ``i + 1``'s
    forward runs beside microbatch ``i``'s backward, as the steady state of Megatron-core's combined 1F1B does.

    Streams: microbatch ``i``'s forward runs on microbatch stream ``i % 2`` (a :class:`moe_graph.streams.SideStream`
    forked from the current stream), and autograd runs its backward on the same stream; the two streams alternate,
    so the forward of ``i + 1`` (stream ``(i + 1) % 2``) and the backward of ``i`` (stream ``i % 2``) have no
    ordering between them, and the exchange (dispatch, combine and their backward) of one is free to run while the
    other computes. Issue order (the serial loop's: ``F0 B0 F1 B1 ...``), per microbatch ``i``::

        mark the fork of F(i+1) on the current stream | backward B(i) (root on the current stream, nodes on stream
        i%2) | F(i+1) on stream (i+1)%2, waiting on the mark only | join F(i+1) into the current stream

    so forwards stay in order (they write the MoE layers' statistics and step counters), and so do the backwards
    (their gradient accumulations). Each parameter's gradient accumulator is made on the current stream before the
    first fork and kept for the schedule: the accumulation of every microbatch's gradient, and the hooks on it
    (DDP's ``main_grad`` add and bucket reduction launch), run on the current stream after waiting for the
    microbatch stream. The arithmetic and its order are those of the serial loop (the same forwards in the same
    order, the same backwards in the same order): the results are bitwise equal. Memory: two microbatches'
    activations are alive at once (``F(i+1)``'s before ``B(i)`` has freed ``i``'s). With recomputed MoE layers
    (``recompute``) the recomputation inside ``B(i)`` writes no state shared between microbatches (the statistics,
    counters and route counts are written by the forward only: ``counting_enabled``), so it may run beside
    ``F(i+1)``.
    """
    lanes = _MicrobatchStreams([model])  # the accumulators made here, on the current stream, and kept
    steps = _Steps(schedule_order(num_microbatches, 1, 0), config.trace)
    set_aux_loss_scale_for_step(config, [model], num_microbatches)
    sync = _GradSync(_no_sync_factory(config, [model]))
    store: list = []
    stages = config.interleave_stages
    baton = worker = None
    if stages:  # F in a worker thread, B here (or in autograd's device thread), alternating at the exchanges
        baton = interleave.Baton()
        device = lanes.params[0].device if lanes.params else None
        worker = interleave.ForwardWorker(baton, interleave.carry_thread_state(device))

    def forward_body(mb: int, marked: bool):
        with lanes.forward(mb % 2, mb, marked=marked):
            return forward_step(forward_step_func, data_iterator, model, num_microbatches, None, store, config, True)

    def forward(mb: int, marked: bool):
        steps.take(True, mb, 0)
        if worker is None:
            return lanes.join(mb % 2, forward_body(mb, marked))
        baton.start((interleave.F,))  # alone: no backward beside it
        worker.submit(lambda: forward_body(mb, marked))
        return join_worker_forward(mb, worker.result())

    def join_worker_forward(mb: int, y):
        with streams.event_slot(1):  # the worker forked the lane with the second events
            return lanes.join(mb % 2, y)

    def backward(mb: int):
        steps.take(False, mb, 0)
        backward_step(None, out, None, config)

    def backward_beside_forward(mb: int):
        """B(mb) here and F(mb + 1) in the worker, stage by stage (B first); both ended when this returns or
        raises. Returns F(mb + 1)'s output, joined."""
        steps.take(False, mb, 0)
        steps.take(True, mb + 1, 0)
        # B first; F(mb + 1) waits only for the mark (made before B(mb), with the worker's events); its join is
        # issued here after B(mb) (joined earlier, the current stream would wait for F(mb + 1)'s end before B(mb)'s
        # last accumulations)
        y, _ = interleave.run_pair(baton, worker, lambda: forward_body(mb + 1, True),
                                   lambda: backward_step(None, out, None, config))
        return join_worker_forward(mb + 1, y)

    try:
        with streams.exchange_hook(baton.hook) if stages else contextlib.nullcontext():
            out = forward(0, False)
            for mb in range(num_microbatches):
                last = mb == num_microbatches - 1
                if not last:
                    with streams.event_slot(1) if stages else contextlib.nullcontext():  # the worker's events
                        lanes.mark((mb + 1) % 2)  # F(mb+1) waits for what is issued so far, not for B(mb)
                if last:
                    sync.enable()  # the last microbatch's backward runs with gradient reduction on
                else:
                    sync.disable()
                if last or not stages:
                    backward(mb)
                    del out
                    if not last:
                        out = forward(mb + 1, True)
                else:
                    out = backward_beside_forward(mb)
    finally:
        sync.enable()
        if worker is not None:
            worker.close()  # no thread outlives the step
    lanes.close()
    steps.finish()
    _reset_aux_loss_scale()
    return store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator,
    model,
    num_microbatches: int,
    forward_only: bool = False,
    config: Optional[PipelineConfig] = None,
    communicator: Optional[P2PCommunicator] = None,
    tensor_shape: Optional[Shape] = None,
    dtype: Optional[torch.dtype] = None,
) -> list:
    """1F1B: ``pp - rank - 1`` warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Returns the reported losses on the last stage, ``[]`` elsewhere. Grad reduction is disabled
    until the last backward (with a ``grad_sync_func``, non-first stages launch it at the end).
    """
    config = config or PipelineConfig()
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_pipelining_without_interleaving")
    if _check_interleave_stages(config, "forward_backward_pipelining_without_interleaving"):
        raise ValueError("forward_backward_pipelining_without_interleaving: interleave_stages runs in the plain "
                         "microbatch loop (forward_backward_no_pipelining) and, with pipeline parallelism, in the "
                         "interleaved schedule only (forward_backward_pipelining_with_interleaving, vpp_size >= 1)")
    shape, dtype = _shape_dtype(config, tensor_shape, dtype)
    comm = communicator or get_default_communicator(config.batch_p2p_comm)
    pp, rank = comm.world_size, comm.rank
    first, last = comm.is_first_stage, comm.is_last_stage
    m = num_microbatches
    overlap = config.overlap_microbatches and not forward_only
    try:  # validates (overlap_microbatches needs the interleaved schedule when pp > 1)
        order = schedule_order(m, pp, rank, forward_only=forward_only, overlap_microbatches=overlap)
    except ValueError as e:
        raise ValueError(f"forward_backward_pipelining_without_interleaving: {e}") from None
    steps = _Steps(order, config.trace)
    set_aux_loss_scale_for_step(config, [model], m)
    warmup = num_warmup_microbatches(m, pp, rank) if not forward_only else min(pp - rank - 1, m)
    remaining = m - warmup
    comm.reset_buffers()
    sync = _GradSync(_no_sync_factory(config, [model]))
    store: list = []
    inputs: Dict[int, Any] = {}
    outputs: Dict[int, Any] = {}
    next_fwd, next_bwd = 0, 0

    def run_forward(x):
        nonlocal next_fwd
        mb = next_fwd
        next_fwd += 1
        steps.take(True, mb, 0)
        y = forward_step(forward_step_func, data_iterator, model, m, x, store, config, last)
        if not forward_only:
            inputs[mb], outputs[mb] = x, y
        return y

    def run_backward(dy):
        nonlocal next_bwd
        mb = next_bwd
        next_bwd += 1
        steps.take(False, mb, 0)
        return backward_step(inputs.pop(mb), outputs.pop(mb), dy, config)

    def enable_for_last_backward():
        if config.grad_sync_func is None or first:
            sync.enable()

    try:
        sync.disable()
        for _ in range(warmup):
            x = comm.recv_forward(shape, dtype)
            y = run_forward(x)
            comm.send_forward(y)
            if not forward_only:
                deallocate_output_tensor(y, config.deallocate_pipeline_outputs)
        x = comm.recv_forward(shape, dtype) if remaining > 0 else None
        for i in range(remaining):
            last_iteration = i == remaining - 1
            y = run_forward(x)
            if forward_only:
                comm.send_forward(y)
                if not last_iteration:
                    x = comm.recv_forward(shape, dtype)
                continue
            dy = comm.send_forward_recv_backward(y, shape, dtype)
            deallocate_output_tensor(y, config.deallocate_pipeline_outputs)
            if warmup == 0 and last_iteration:
                enable_for_last_backward()
            dx = run_backward(dy)
            if last_iteration:
                x = None
                comm.send_backward(dx)
            else:
                x = comm.send_backward_recv_forward(dx, shape, dtype)
        if not forward_only:
            for i in range(warmup):
                if i == warmup - 1:
                    enable_for_last_backward()
                dy = comm.recv_backward(shape, dtype)
                dx = run_backward(dy)
                comm.send_backward(dx)
            if sync.disabled:
                sync.enable()
                if config.grad_sync_func is not None:
                    config.grad_sync_func(list(model.parameters()))
    finally:
        sync.enable()
    steps.finish()
    _reset_aux_loss_scale()
    return store


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator,
    model,
    num_microbatches: int,
    forward_only: bool = False,
    config: Optional[PipelineConfig] = None,
    communicator: Optional[P2PCommunicator] = None,
    tensor_shape: Optional[Shape] = None,
    dtype: Optional[torch.dtype] = None,
) -> list:
    """Interleaved 1F1B over ``len(model)`` chunks per rank (chunk ``v`` = virtual stage ``v*pp + rank``).

    ``model`` and ``data_iterator`` are lists with one entry per chunk. The executed steps are
    :func:`schedule_order` with ``vpp_size=len(model)``; configurations it rejects raise
    ``ValueError`` before any communication. Returns the reported losses on the last stage.

    ``config.overlap_microbatches`` (training only), as Megatron-core's combined 1F1B: one more warm-up forward
    (:func:`num_warmup_microbatches`), so that the forward ``W + k`` and the backward ``k`` of every steady step are
    of different microbatches, with no dependency between them; the forward runs on one microbatch stream and the
    backward on the other (:class:`_MicrobatchStreams`): autograd runs backward ``k`` on the lane of the forward
    whose graph it is (the same microbatch, the mirrored chunk), and forward ``W + k`` takes the other lane
    (warm-up forwards alternate). Issue order per steady step: fork the forward on
    its lane (it waits for what was issued before) | the backward (root on the current stream, its nodes on the
    lane of its forward, accumulations on the current stream) | join the forward | the step's sends and receives.
    The steps and their order are those of the schedule without the option except for the extra warm-up forward;
    the arithmetic is the same (same forwards in the same order, same backwards in the same order): losses and
    gradients are bitwise equal to it. Memory: one more microbatch's activations in flight on each rank.

    ``config.interleave_stages`` (with ``overlap_microbatches``): each steady step's forward runs in a worker thread
    (:class:`moe_graph.train.interleave.ForwardWorker`) beside its backward here, alternating at the token exchanges
    (``B`` first; :func:`moe_graph.train.interleave.run_pair`); the forward forks its lane from a mark made before
    the backward; the gradient-reduction launch, the join and the step's sends and receives follow both. The virtual
    pipeline rank (process-wide) is set by each side to its chunk's whenever it gets the turn. Bitwise equal to the
    schedule without it.
    """
    config = config or PipelineConfig()
    _check_interleave_stages(config, "forward_backward_pipelining_with_interleaving")
    if not isinstance(model, (list, tuple)) or len(model) < 1:
        raise ValueError("interleaved pipeline schedule expects a list of model chunks")
    nc = len(model)
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != nc:
        raise ValueError(f"interleaved pipeline schedule expects one data iterator per model chunk ({nc})")
    shape, dtype = _shape_dtype(config, tensor_shape, dtype)
    comm = communicator or get_default_communicator(config.batch_p2p_comm)
    pp, rank = comm.world_size, comm.rank
    first, last = comm.is_first_stage, comm.is_last_stage
    m = num_microbatches
    group = config.microbatch_group_size_per_vp_stage
    overlap = config.overlap_microbatches and not forward_only
    order = schedule_order(m, pp, rank, nc, group, forward_only, overlap)  # validates
    group = pp if group is None else group
    table = get_schedule_table(m, nc, group)
    total = m * nc
    warmup = num_warmup_microbatches(m, pp, rank, nc, group, forward_only, overlap)
    remaining = total - warmup
    all_warmup = warmup >= total
    steps = _Steps(order, config.trace)
    set_aux_loss_scale_for_step(config, list(model), m)
    grad_sync_funcs = None if config.grad_sync_func is None else _as_list(config.grad_sync_func, nc, "grad_sync_func")
    comm.reset_buffers()
    sync = _GradSync(_no_sync_factory(config, list(model)))
    synced = set()
    store: list = []
    inputs = [dict() for _ in range(nc)]
    outputs = [dict() for _ in range(nc)]
    grads = [dict() for _ in range(nc)]
    n_inputs = [0] * nc  # activations received so far per chunk (they arrive in microbatch order)
    n_grads = [0] * nc
    lanes = _MicrobatchStreams(model) if overlap else None  # the accumulators made here, on the current stream

    set_vp_rank = ps.get_virtual_pipeline_model_parallel_world_size() == nc  # keep parallel_state's vp rank current
    stages = overlap and config.interleave_stages
    baton = worker = None
    vp_of: Dict[str, int] = {}  # the model chunk of each side of the pair in flight (stage interleave)
    if stages:  # a steady step's forward in a worker thread, its backward here, alternating at the exchanges

        def on_turn(side: str) -> None:  # the vp rank is process-wide: each side sets its own when it gets the turn
            if side in vp_of:
                ps.set_virtual_pipeline_model_parallel_rank(vp_of[side])

        baton = interleave.Baton(on_turn if set_vp_rank else None)
        worker = interleave.ForwardWorker(baton, interleave.carry_thread_state(
            lanes.params[0].device if lanes.params else None))

    def chunk_of(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else nc - 1 - c

    def is_last_microbatch(k: int) -> bool:
        return k < total and table[k][0] == m - 1

    def recv_plan(k: int, forward: bool) -> Tuple[bool, int]:
        """Whether a tensor arrives during step ``k`` (direction ``forward``) and for which chunk.

        The leading rank (first in forward, last in backward) runs ``pp - 1`` steps ahead of the
        trailing one, whose step ``k - (pp - 1)`` produced the tensor; nothing comes from the
        trailing rank's final chunk, and the tensor feeds the next (forward) or previous
        (backward) chunk. Any other rank receives for its own step ``k + 1``.
        """
        leading = first if forward else last
        if not leading:
            return True, chunk_of(k + 1, forward)
        recv = k >= pp - 1
        c = chunk_of(k - (pp - 1), forward) if recv else chunk_of(k + 1, forward)
        if c == (nc - 1 if forward else 0):
            recv = False
        return recv, (c + 1 if forward else c - 1)

    def add_input(c: int, t) -> None:
        inputs[c][n_inputs[c]] = t
        n_inputs[c] += 1

    def add_grad(c: int, t) -> None:
        grads[c][n_grads[c]] = t
        n_grads[c] += 1

    forward_index = {(mb, c): k for k, (mb, c) in enumerate(table)}
    lane_of: Dict[int, int] = {}  # forward step -> microbatch stream; autograd runs its backward there too

    def forward_of_backward(k: int) -> int:
        """The forward step whose graph backward step ``k`` runs (the same microbatch, the mirrored chunk)."""
        return forward_index[(table[k][0], nc - 1 - table[k][1])]

    def assign_lane(k: int) -> int:  # a steady step's forward on the other lane than its backward's
        if k not in lane_of:
            b = k - warmup
            lane_of[k] = 1 - lane_of[forward_of_backward(b)] if b >= 0 else k % 2
        return lane_of[k]

    def take_forward(k: int) -> Tuple[int, Any]:
        """Takes forward step ``k`` in the order; returns its chunk and input."""
        mb, c = table[k][0], chunk_of(k, True)
        steps.take(True, mb, c)
        if c == 0 and first:
            return c, None
        if mb not in inputs[c]:
            raise RuntimeError(f"pipeline rank {rank}: no activation received for microbatch {mb} of chunk {c}")
        return c, inputs[c][mb]

    def forward_body(k: int, c: int, x, marked: bool = False):
        """Issues forward step ``k`` of chunk ``c`` (virtual microbatch ``k``, the label a StreamRecorder sees); with
        overlap on its lane, not joined yet: :func:`finish_forward` joins it and keeps its output."""
        if set_vp_rank:
            ps.set_virtual_pipeline_model_parallel_rank(c)
        with lanes.forward(assign_lane(k), k, x, marked=marked) if lanes is not None else streams.microbatch(k):
            return forward_step(forward_step_func, data_iterator[c], model[c], m, x, store, config,
                                c == nc - 1 and last)

    def start_forward(k: int):
        return forward_body(k, *take_forward(k))

    def finish_forward(k: int, y):
        mb, c = table[k][0], chunk_of(k, True)
        if lanes is not None:
            y = lanes.join(lane_of[k], y)
        if forward_only:
            inputs[c].pop(mb, None)
        else:
            outputs[c][mb] = y
        return y

    def take_backward(k: int) -> Tuple[int, Any, Any, Any]:
        """Takes backward step ``k`` in the order (gradient reduction on for a chunk's last one); returns its chunk,
        input, output and output gradient."""
        mb, c = table[k][0], chunk_of(k, False)
        steps.take(False, mb, c)
        if grad_sync_funcs is None and is_last_microbatch(k):
            sync.enable()  # this chunk's last backward reduces its gradients
            synced.add(c)
        x = None if (c == 0 and first) else inputs[c].pop(mb)
        y = outputs[c].pop(mb)
        dy = None if (c == nc - 1 and last) else grads[c].pop(mb)
        return c, x, y, dy

    def backward_body(c: int, x, y, dy):
        if set_vp_rank:
            ps.set_virtual_pipeline_model_parallel_rank(c)
        return backward_step(x, y, dy, config)

    def run_backward(k: int):
        dx = backward_body(*take_backward(k))
        end_backward(k)
        return dx

    def end_backward(k: int) -> None:
        if grad_sync_funcs is not None:
            # launch chunk grad reductions at the same time on all ranks (rank r is r steps behind)
            ks = k - rank
            if ks >= 0 and is_last_microbatch(ks):
                cs = chunk_of(ks, False)
                sync.enable()
                grad_sync_funcs[cs](list(model[cs].parameters()))
                synced.add(cs)
        sync.disable()

    def steady_pair(k: int, fk: int):
        """Steady step ``k``: forward step ``fk`` in the worker (``F``) beside backward step ``k`` here (``B``), stage
        by stage, ``B`` first (:func:`moe_graph.train.interleave.run_pair`). ``F`` forks its lane from a mark made
        before ``B`` (with the worker's events); both are ended before the chunk's gradient reduction launch and the
        join. Returns ``(y, dx)``."""
        fc, x = take_forward(fk)
        bwd = take_backward(k)
        with streams.event_slot(1):  # the worker forks with the second events
            lanes.mark(assign_lane(fk))
        vp_of[interleave.F], vp_of[interleave.B] = fc, bwd[0]
        try:
            y, dx = interleave.run_pair(baton, worker, lambda: forward_body(fk, fc, x, marked=True),
                                        lambda: backward_body(*bwd))
        finally:
            vp_of.clear()
        if set_vp_rank:
            ps.set_virtual_pipeline_model_parallel_rank(bwd[0])  # as without the interleave: the backward's chunk
        end_backward(k)
        with streams.event_slot(1):
            return finish_forward(fk, y), dx

    hook = contextlib.ExitStack()
    try:
        if stages:
            hook.enter_context(streams.exchange_hook(baton.hook))
        sync.disable()
        if not first:
            add_input(0, comm.recv_forward(shape, dtype, is_first_stage=False))
        for k in range(warmup):
            c = chunk_of(k, True)
            recv_prev, next_c = recv_plan(k, True)
            if k == total - 1:
                recv_prev = False
            y = finish_forward(k, start_forward(k))
            send = None if (c == nc - 1 and last) else y
            if k == warmup - 1 and not forward_only and not all_warmup:
                recv_next = not last
                x, dy = comm.send_forward_backward_recv_forward_backward(send, None, recv_prev, recv_next, shape, dtype)
                if recv_next:
                    add_grad(nc - 1, dy)
            else:
                x = comm.send_forward_recv_forward(send, recv_prev, shape, dtype)
            if recv_prev:
                add_input(next_c, x)
            if not forward_only:
                deallocate_output_tensor(send, config.deallocate_pipeline_outputs)
        for k in range(remaining):
            fk = k + warmup
            if stages:
                y, dx = steady_pair(k, fk)
            else:
                y = start_forward(fk)
                if lanes is None:  # without overlap the last stage's backward k may be forward fk's own microbatch
                    y = finish_forward(fk, y)
                dx = run_backward(k)  # with overlap: beside the forward (different microbatches, different lanes)
                if lanes is not None:
                    y = finish_forward(fk, y)
            send_y = None if (chunk_of(fk, True) == nc - 1 and last) else y
            send_dx = None if (chunk_of(k, False) == 0 and first) else dx
            recv_prev, next_fc = recv_plan(fk, True)
            recv_next, next_bc = recv_plan(k, False)
            if k == remaining - 1:
                recv_prev = False
            x, dy = comm.send_forward_backward_recv_forward_backward(send_y, send_dx, recv_prev, recv_next, shape, dtype)
            deallocate_output_tensor(send_y, config.deallocate_pipeline_outputs)
            if recv_prev:
                add_input(next_fc, x)
            if recv_next:
                add_grad(next_bc, dy)
        if not forward_only:
            if all_warmup and not last:
                add_grad(nc - 1, comm.recv_backward(shape, dtype, is_last_stage=False))
            for k in range(remaining, total):
                c = chunk_of(k, False)
                recv_next, next_bc = recv_plan(k, False)
                if k == total - 1:
                    recv_next = False
                dx = run_backward(k)
                send_dx = None if (c == 0 and first) else dx
                dy = comm.send_backward_recv_backward(send_dx, recv_next, shape, dtype)
                if recv_next:
                    add_grad(next_bc, dy)
            sync.enable()
            if grad_sync_funcs is not None:
                for c in range(nc):
                    if c not in synced:
                        grad_sync_funcs[c](list(model[c].parameters()))
                        synced.add(c)
    finally:
        sync.enable()
        hook.close()
        if worker is not None:
            worker.close()  # no thread outlives the step
        if lanes is not None:
            lanes.close()
    steps.finish()
    leftovers = [c for c in range(nc) if inputs[c] or outputs[c] or grads[c]]
    if leftovers:
        raise RuntimeError(f"pipeline rank {rank}: unconsumed tensors for chunks {leftovers}")
    _reset_aux_loss_scale()
    return store


def get_forward_backward_func(pp_size: Optional[int] = None, vpp_size: Optional[int] = None) -> Callable:
    """The schedule for a layout: no pipelining (pp == 1), 1F1B (vpp None) or interleaved.

    With both arguments None, sizes come from :mod:`moe_graph.parallel_state` (pp = 1 if it is not
    initialized). ``get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving``.
    """
    if pp_size is None:
        if ps.model_parallel_is_initialized():
            pp_size = ps.get_pipeline_model_parallel_world_size()
            if vpp_size is None:
                vpp_size = ps.get_virtual_pipeline_model_parallel_world_size()
        else:
            pp_size = 1
    _check_int("pp_size", pp_size, 1)
    if pp_size > 1:
        if vpp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


# ==================================================================================================
# CLI
# ==================================================================================================


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moe_graph.train.schedules --pp 4 [--vpp 2] --microbatches 8 [--group N] [--forward-only]``."""
    p, args = flags.parse_schedules(argv)
    try:
        text = format_schedule(args.microbatches, args.pp, args.vpp, args.group, args.forward_only)
    except ValueError as e:
        p.error(str(e))
    bubble = (args.pp - 1) / (args.microbatches * (args.vpp or 1))
    print(f"pp={args.pp} vpp={args.vpp} microbatches={args.microbatches} ideal bubble fraction={bubble:.3f}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
