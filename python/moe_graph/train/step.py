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

It returns :class:`TrainStepResult` ``(loss, grad_norm, skipped, overflowed)``: device tensors, no host sync, so the whole
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

Dropless training with a static capacity (``overflow="rerun"``, an option of each MoE layer and of
:func:`train_step`): the step zeroes the dispatchers' per-step counters, a route over the static capacity in any
MoE layer, microbatch or pipeline stage sets this rank's flag, and the optimizer reduces it in the all-reduce of its
inf/nan check and skips the update on every rank (``overflowed``; the loss scaler is left alone, the expert bias
too). :class:`OverflowRerun` reads the flag after the step (after the graph's replay) and reruns the same
microbatches eagerly with the step's observed capacity, so the run trains exactly like a dropless one, and raises
the capacity factor when reruns become frequent::

    step = FullIterationGraph(make_train_step(ddp, opt, overflow="rerun"))
    rerun = OverflowRerun(ddp, opt)                        # window=100 steps, threshold=1 %, margin=10 %
    for it in range(steps):
        res = rerun.step(step, microbatches(it))          # res: the applied (possibly rerun) step
    rerun.statistics()                                     # capacity_factor, reruns, rerun_rate, recaptures
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps
from moe_graph.moe.layer import moe_layers, reset_step_counters, step_max_load_ratio, step_overflow
from moe_graph.moe.router import update_expert_bias as _update_bias
from moe_graph.moe.token_dispatcher import OVERFLOW_MODES
from moe_graph.ops import fp8 as _fp8
from moe_graph.train import schedules

__all__ = ["TrainStepResult", "train_step", "make_train_step", "OverflowRerun"]


class TrainStepResult(NamedTuple):
    """What one :func:`train_step` returns (0-dim device tensors).

    ``loss``: the mean reported loss over the microbatches and the data-parallel ranks (without the MoE aux
    losses, which only reach the gradients), ``None`` on pipeline stages other than the last. ``grad_norm``: the
    global grad norm before clipping. ``skipped``: True when the update was skipped (inf/nan gradients, or an
    overflow). ``overflowed``: with ``overflow="rerun"``, True when a route went over an MoE layer's static
    capacity on some rank of the job (the update was skipped on every rank; :class:`OverflowRerun` reruns the
    step); ``None`` in drop mode.
    """

    loss: Optional[torch.Tensor]
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    overflowed: Optional[torch.Tensor] = None


def _call(chunk, batch):
    if isinstance(batch, dict):
        return chunk(**batch)
    if isinstance(batch, (tuple, list)):
        return chunk(*batch)
    return chunk(batch)


def train_step(model, optimizer, microbatches: Sequence[Any], *, loss_func: Optional[Callable] = None,
               tensor_shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None,
               config=None, forward_backward_func: Optional[Callable] = None,
               update_expert_bias: bool = True, average_loss_over_data_parallel: bool = True,
               overflow: Optional[str] = None, fp8_recipe=None,
               overlap_microbatches: bool = False, interleave_stages: bool = False) -> TrainStepResult:
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
        overflow: ``"rerun"``: a route over any MoE layer's static capacity skips the update on every rank and
            sets ``overflowed`` (see the module docstring); ``"drop"``: such routes are dropped (counted only);
            ``None``: the layers' own ``overflow`` option (rerun when any layer of this rank has it).
        fp8_recipe: run the microbatches' forward and backward under ``moe_graph.fp8.autocast(recipe=...)`` (a
            recipe, TE's recipe object or a name: "blockwise", "mxfp8", "tensorwise"); None: as the caller's
            context (an enclosing autocast still applies).
        overlap_microbatches: two microbatches in flight: microbatch ``i + 1``'s forward beside microbatch ``i``'s
            backward on two microbatch streams, so one's expert-parallel exchange runs while the other computes
            (:func:`moe_graph.train.schedules.forward_backward_overlapped`; bitwise equal to the serial loop; two
            microbatches' activations alive at once). With pipeline parallelism the interleaved schedule only
            (``forward_backward_pipelining_with_interleaving``, any vpp >= 1: one more warm-up forward, then each
            steady step's forward beside its backward; bitwise equal to the schedule without the option); with
            1F1B or another schedule it raises ``ValueError`` before anything is written.
        interleave_stages: with ``overlap_microbatches``, issue the two microbatches in flight (``F(i + 1)`` and
            ``B(i)`` in the plain loop; each steady step's forward and backward in the interleaved pipeline schedule)
            stage by stage, alternating at the token exchanges (:mod:`moe_graph.train.interleave`; bitwise equal to
            the same schedule without it); ``ValueError`` without ``overlap_microbatches`` or with 1F1B / another
            schedule.
    """
    if overflow is not None and overflow not in OVERFLOW_MODES:
        raise ValueError(f"train_step: overflow must be one of {OVERFLOW_MODES} or None, got {overflow!r}")
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
    if not isinstance(overlap_microbatches, bool):
        raise TypeError(f"train_step: overlap_microbatches must be a bool, got {type(overlap_microbatches).__name__}")
    config.overlap_microbatches = config.overlap_microbatches or overlap_microbatches
    if not isinstance(interleave_stages, bool):
        raise ValueError(f"train_step: interleave_stages must be a bool, got {interleave_stages!r}")
    config.interleave_stages = config.interleave_stages or interleave_stages
    if config.interleave_stages and not config.overlap_microbatches:
        raise ValueError("train_step: interleave_stages=True interleaves the two microbatches in flight: it needs "
                         "overlap_microbatches=True")
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
    if config.overlap_microbatches and not (interleaved or
                                            forward_backward_func is schedules.forward_backward_no_pipelining):
        raise ValueError("train_step: overlap_microbatches runs in the plain microbatch loop "
                         "(forward_backward_no_pipelining) and, with pipeline parallelism, in the interleaved schedule "
                         "only (forward_backward_pipelining_with_interleaving: set virtual_pipeline_model_parallel_size "
                         ">= 1, as Megatron-core requires), got "
                         f"{getattr(forward_backward_func, '__name__', forward_backward_func)}")
    # interleave_stages needs overlap_microbatches (checked above): the schedules that take it take it too
    if len(chunks) > 1 and not interleaved:
        raise ValueError(f"train_step: {len(chunks)} model chunks need the interleaved schedule")

    def forward_step(data_iterator, chunk):
        return _call(chunk, next(data_iterator)), (loss_func if loss_func is not None else (lambda out: out))

    modules = _moe_modules(chunks)
    layers = moe_layers(modules)
    rerun = overflow == "rerun" or (overflow is None and any(m.overflow == "rerun" for m in layers))
    if rerun and not isinstance(getattr(optimizer, "found_overflow", None), torch.Tensor):
        raise ValueError("train_step: overflow='rerun' needs an optimizer whose step(overflow=...) reduces the flag "
                         f"(moe_graph.distributed.optimizer.DistributedOptimizer), got {type(optimizer).__name__}")
    reset_step_counters(layers)  # per-step counters, in either mode (device zero_: part of a captured step)
    optimizer.zero_grad()
    iters = [iter(microbatches) for _ in chunks]
    kwargs = dict(forward_step_func=forward_step, data_iterator=iters if interleaved else iters[0],
                  model=chunks if interleaved else chunks[0], num_microbatches=m, config=config)
    with _fp8.autocast(recipe=fp8_recipe) if fp8_recipe is not None else contextlib.nullcontext():
        reported = forward_backward_func(**kwargs)
    overflowed = None
    if rerun:
        ok, grad_norm = optimizer.step(overflow=step_overflow(layers, optimizer.found_overflow.device))
        overflowed = optimizer.found_overflow.clone()
    else:
        ok, grad_norm = optimizer.step()
    if update_expert_bias:
        if overflowed is not None:  # a skipped step leaves the expert bias alone: zero counts give sign 0
            for m in layers:
                if m.router.enable_expert_bias:
                    m.router.local_tokens_per_expert.mul_(torch.logical_not(overflowed))
        _update_bias(modules)
    loss = None
    if reported:
        loss = torch.stack([r.detach().float().reshape(()) for r in reported]).mean()
        group = getattr(chunks[0], "data_parallel_group", None)
        size = getattr(chunks[0], "data_parallel_world_size", 1)
        if average_loss_over_data_parallel and size > 1:
            dist.all_reduce(loss, group=group)
            loss = loss / size
    return TrainStepResult(loss, grad_norm, torch.logical_not(ok), overflowed)


def make_train_step(model, optimizer, **kwargs) -> Callable[[Sequence[Any]], TrainStepResult]:
    """``step(microbatches) -> TrainStepResult``: :func:`train_step` with ``model``, ``optimizer`` and ``kwargs``
    bound (the callable :class:`moe_graph.cuda_graph.FullIterationGraph` captures)."""

    def step(microbatches):
        return train_step(model, optimizer, microbatches, **kwargs)

    step.train_step_kwargs = dict(kwargs)  # what OverflowRerun's eager rerun must use too

    return step


def _moe_modules(chunks) -> torch.nn.ModuleList:
    return torch.nn.ModuleList([getattr(c, "module", c) for c in chunks])


def _rng_state(device) -> Dict[str, torch.Tensor]:
    st = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: Dict[str, torch.Tensor], device) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


_MISSING = object()


class OverflowRerun:
    """Dropless training with a static capacity (``overflow="rerun"``): runs each step through ``step_fn`` (the
    captured graph, or the eager step), reads the job-wide ``overflowed`` flag once after it, and when it is set
    reruns the same microbatches eagerly, from the RNG state the step started with, with every MoE layer's capacity
    raised to the step's observed maximum load ratio (all-reduced over the job: outside the graph, host reads are
    allowed), again at the new ratio while a later layer still overflows (its input changed once the layers before
    it stopped dropping), so the update applied is that of a dropless step. The overflowed pass applied nothing
    (the optimizer skipped it on every rank, without a loss-scaler update).

    Adaptive capacity: when more than ``threshold * window`` of the last ``window`` steps reran, every MoE layer's
    capacity factor becomes ``max(current, max observed load ratio * (1 + margin))`` (never lower than the user's
    setting) and ``step_fn.reset()`` is called (a :class:`moe_graph.cuda_graph.FullIterationGraph` captures again at
    its next step; eager step functions have no ``reset``).

    The adapted factor never passes a layer's ``num_ep_ranks`` (``R``): at ``R`` every route fits under either
    capacity rule (``T * K`` rows per pair, ``R * T * K`` per destination), so a larger factor only wastes memory.

    Args:
        model, optimizer: as :func:`train_step` (the rerun calls it eagerly).
        window, threshold, margin: the adaptive rule above (``threshold=None``: never adapt).
        train_step_kwargs: :func:`train_step`'s keywords for the rerun. A step function from
            :func:`make_train_step` (or a ``FullIterationGraph`` over one) carries its own, and the rerun uses those:
            keywords given here too must equal them (a ``ValueError`` names the one that differs), so the rerun
            never computes another loss than the step.

    ``statistics()`` and ``state_dict()`` / ``load_state_dict()`` (a resumed run keeps the adapted capacity).
    """

    def __init__(self, model, optimizer, *, window: int = 100, threshold: Optional[float] = 0.01,
                 margin: float = 0.1, **train_step_kwargs):
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"OverflowRerun: window must be an int >= 1, got {window!r}")
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
            raise ValueError(f"OverflowRerun: threshold must be in [0, 1) or None (never adapt), got {threshold!r}")
        if not (isinstance(margin, (int, float)) and 0 <= margin < float("inf")):
            raise ValueError(f"OverflowRerun: margin must be a finite number >= 0, got {margin!r}")
        if train_step_kwargs.get("overflow", "rerun") != "rerun":
            raise ValueError("OverflowRerun: the rerun needs overflow='rerun' (the step reports overflowed)")
        self.model, self.optimizer = model, optimizer
        self.window, self.threshold, self.margin = window, threshold, margin
        self.given_kwargs = dict(train_step_kwargs)
        self.train_step_kwargs = dict(train_step_kwargs, overflow="rerun")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.layers = moe_layers(_moe_modules(chunks))
        self.user_capacity_factor = [m.capacity_factor for m in self.layers]
        self.steps = self.reruns = self.rerun_passes = self.recaptures = 0
        self.recent: Deque[bool] = collections.deque(maxlen=window)
        self.max_load_ratio = 0.0  # largest observed load ratio of the steps in ``recent`` that reran
        self.device = getattr(optimizer, "device", None)

    # ------------------------------------------------------------------------------------------------ step --
    def step(self, step_fn: Callable[[Sequence[Any]], TrainStepResult], microbatches: Sequence[Any]) -> TrainStepResult:
        """One training step through ``step_fn`` (a :func:`make_train_step` with ``overflow="rerun"``, or a
        :class:`moe_graph.cuda_graph.FullIterationGraph` over it), rerun eagerly when it overflowed. Reads the
        ``overflowed`` flag on the host (one sync per step, after the replay)."""
        microbatches = list(microbatches)
        self._bind_kwargs(step_fn)
        rng = _rng_state(self.device)
        res = step_fn(microbatches)
        if res.overflowed is None:
            raise ValueError("OverflowRerun: the step function returned no overflowed flag (it needs "
                             "train_step(..., overflow='rerun'))")
        reran = bool(res.overflowed)
        self.steps += 1
        if reran:
            res, ratio = self._rerun(microbatches, rng)
            self.reruns += 1
            self.max_load_ratio = max(self.max_load_ratio, ratio)
        self.recent.append(reran)
        self._adapt(step_fn)
        return res

    def _bind_kwargs(self, step_fn) -> None:
        """The rerun's train_step keywords: the step function's own (when it carries them), checked against the
        ones given to the constructor."""
        bound = getattr(getattr(step_fn, "train_fn", step_fn), "train_step_kwargs", None)
        if bound is None:
            return
        bound = dict(bound, overflow="rerun")
        for key, value in self.given_kwargs.items():
            if key == "overflow":
                continue
            other = bound.get(key, _MISSING)
            if other is not value and other != value:
                raise ValueError(f"OverflowRerun: train_step keyword {key!r} differs from the step function's "
                                 f"({value!r} here, {'not given' if other is _MISSING else repr(other)} there): the "
                                 "rerun would compute another step; give it to make_train_step only")
        self.train_step_kwargs = bound

    def _job_max_load_ratio(self) -> float:
        """The largest load ratio any MoE layer of any rank saw this step (a host read and, with torch.distributed,
        a MAX all-reduce over the job: outside the graph)."""
        ratio = step_max_load_ratio(self.layers, self.optimizer.found_overflow.device).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        return float(ratio)

    def _rerun(self, microbatches, rng) -> Tuple[TrainStepResult, float]:
        """Eager passes from the step's RNG state at the observed load ratio until one fits: ``(result, ratio)``.
        A layer's routing depends on the layers before it (and a pipeline stage's on the stages before), so the
        first pass's ratios are exact only up to the first layer that dropped; each pass that still overflows has
        exact inputs up to its first overflowing layer, whose ratio strictly exceeds the capacity used, so the
        ratio grows every pass and reaches what the step needs (at most ``R``: capacity ``T * K``)."""
        ratio = 0.0
        saved = [m.capacity_factor for m in self.layers]
        try:
            while True:
                seen = self._job_max_load_ratio()
                if seen <= ratio:  # a pass at `ratio` fits every load it saw: only a non-deterministic step gets here
                    raise RuntimeError(f"OverflowRerun: the rerun at capacity factor {ratio:.4g} overflowed without a "
                                       "larger load: the step is not deterministic")
                ratio = seen
                for m, cf in zip(self.layers, saved):
                    if cf is not None:
                        m.capacity_factor = max(cf, ratio)
                res, overflowed = self._pass(microbatches, rng)
                self.rerun_passes += 1
                if not overflowed:
                    return res, ratio
        finally:
            for m, cf in zip(self.layers, saved):
                m.capacity_factor = cf

    def _pass(self, microbatches, rng) -> Tuple[TrainStepResult, bool]:
        """One eager rerun pass from the step's RNG state: ``(result, overflowed)`` (the Megatron loop's
        :class:`moe_graph.integrations.megatron_moe.MegatronOverflowRerun` runs its own step here)."""
        _set_rng_state(rng, self.device)
        res = train_step(self.model, self.optimizer, microbatches, **self.train_step_kwargs)
        return res, bool(res.overflowed)

    def _adapt(self, step_fn) -> None:
        if self.threshold is None or sum(self.recent) <= self.threshold * self.window:
            return
        raised = False
        for m, user in zip(self.layers, self.user_capacity_factor):
            if m.capacity_factor is not None:  # never past R, where every route fits
                new = max(m.capacity_factor, user, min(self.max_load_ratio * (1.0 + self.margin), m.num_ep_ranks))
                raised |= new > m.capacity_factor
                m.capacity_factor = new
        self.recent.clear()
        self.max_load_ratio = 0.0
        if raised and callable(getattr(step_fn, "reset", None)):
            step_fn.reset()  # the captured graph holds the old capacity: capture again
            self.recaptures += 1

    # ------------------------------------------------------------------------------------------ statistics --
    @property
    def capacity_factor(self) -> Optional[float]:
        """The largest capacity factor of the MoE layers (``None``: some layer is ``capacity_factor=None``)."""
        cfs = [m.capacity_factor for m in self.layers]
        return None if not cfs or any(c is None for c in cfs) else max(cfs)

    def statistics(self) -> Dict[str, Any]:
        """Host values: ``capacity_factor`` (current, adapted), ``user_capacity_factor``, ``steps``, ``reruns``
        (steps that overflowed and were rerun), ``rerun_passes`` (eager passes they took, >= ``reruns``),
        ``rerun_rate`` (all steps), ``window_rerun_rate`` (the last ``window`` steps) and ``recaptures``."""
        user = [c for c in self.user_capacity_factor if c is not None]
        return {"capacity_factor": self.capacity_factor, "user_capacity_factor": max(user) if user else None,
                "steps": self.steps, "reruns": self.reruns, "rerun_passes": self.rerun_passes,
                "rerun_rate": self.reruns / max(self.steps, 1),
                "window_rerun_rate": sum(self.recent) / max(len(self.recent), 1), "recaptures": self.recaptures}

    def state_dict(self) -> Dict[str, Any]:
        """JSON-serializable host values (the same on every rank: every decision is job-wide)."""
        return {"capacity_factor": self.capacity_factor, "steps": self.steps, "reruns": self.reruns,
                "rerun_passes": self.rerun_passes, "recaptures": self.recaptures, "recent": list(self.recent), "max_load_ratio": self.max_load_ratio}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the counters and the adapted capacity factor: every MoE layer gets ``max(its own setting,
        the saved one)`` (layers with ``capacity_factor=None`` stay dropless)."""
        saved = state["capacity_factor"]
        if saved is not None and not (isinstance(saved, (int, float)) and 0 < saved < float("inf")):
            raise ValueError(f"OverflowRerun.load_state_dict: capacity_factor must be a finite number > 0 or None, "
                             f"got {saved!r}")
        for m, user in zip(self.layers, self.user_capacity_factor):
            if user is not None and saved is not None:
                m.capacity_factor = max(user, float(saved))
        self.steps, self.reruns, self.recaptures = int(state["steps"]), int(state["reruns"]), int(state["recaptures"])
        self.rerun_passes = int(state.get("rerun_passes", self.reruns))
        self.recent = collections.deque((bool(x) for x in state["recent"]), maxlen=self.window)
        self.max_load_ratio = float(state["max_load_ratio"])
