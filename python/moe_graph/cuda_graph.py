"""Full-iteration CUDA graph: one graph for a whole training step (all microbatches' forward and backward, and
optionally the optimizer step), one for validation, replayed every iteration with the new data copied into static
input buffers (Megatron's ``FullCudaGraphWrapper`` + ``data_read``).

Life of a mode (``"training"`` / ``"validation"``, each with its own state, graph and memory pool)::

    step 0 .. warmup_steps-1   eager on a side stream, on the static buffers (lazy allocations, cuBLAS
                               workspaces, NCCL communicators happen here); the last warm-up step runs under
                               torch.cuda.set_sync_debug_mode("error") so a host sync is reported by name
    step warmup_steps          capture (torch.cuda.graph, after a barrier when torch.distributed is up), replay
    later steps                copy inputs into the static buffers (data_read), replay

Inputs are any nest of lists/tuples/dicts of tensors (e.g. a list of microbatches); tensors are copied into
static buffers allocated at the first call, non-tensor leaves must stay equal. A changed shape, dtype or structure
raises :class:`GraphShapeError` naming the argument (call :meth:`FullIterationGraph.reset` to re-capture). Outputs
of a replay are the graph's static tensors, overwritten by the next replay (``clone_outputs=True`` copies them).
A captured :func:`moe_graph.train.step.train_step` returns its ``TrainStepResult`` this way, ``overflowed`` (dropless
mode) included: :class:`moe_graph.train.step.OverflowRerun` reads it after the replay, reruns an overflowed step
eagerly (outside the graph) and calls :meth:`FullIterationGraph.reset` when it raises the capacity.

RNG: the default CUDA generator is registered by ``torch.cuda.graph`` itself (each replay advances its Philox
offset, so dropout masks differ per replay); extra ``torch.Generator(device="cuda")`` objects given as
``generators=`` are registered with ``CUDAGraph.register_generator_state`` (torch >= 2.5).

Activation recomputation: ``torch.utils.checkpoint`` with its default ``preserve_rng_state=True`` calls
``torch.cuda.get_rng_state()``, which is refused during capture. Use :func:`checkpoint` (the graph-safe recompute:
non-reentrant, RNG through :class:`RecomputeRNG`'s registered generator states), or pass
``use_reentrant=False, preserve_rng_state=False, early_stop=False, context_fn=recompute_rng().context_fn`` to
``torch.utils.checkpoint.checkpoint`` yourself (``preserve_rng_state=False`` alone where the region draws no random
numbers). FullIterationGraph registers :func:`recompute_rng`'s states with every graph it captures.

On CPU (or ``enabled=False``) CUDA graphs do not exist: the wrapper runs the function eagerly every step (same
argument checks), and says so once with a :class:`UserWarning` (``note`` holds the text).

Example::

    def train_step(microbatches):
        ddp.zero_grad_buffer()
        losses = [loss_fn(model(mb["tokens"]), mb["labels"]) for mb in microbatches]
        for l in losses: l.backward()
        opt.step()                       # capturable DistributedOptimizer: part of the graph
        return torch.stack([l.detach() for l in losses])

    graph = FullIterationGraph(train_step, warmup_steps=2)
    for it in range(iters):
        losses = graph(graph.data_read(data_iter, num_microbatches))
"""

from __future__ import annotations

import contextlib
import heapq
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["FullIterationGraph", "FullCudaGraphWrapper", "GraphCaptureError", "GraphShapeError", "RecomputeRNG",
           "captured_graphs", "checkpoint", "cuda_graphs_available", "recompute_rng"]

_SYNC_HINT = (
    "a host-device synchronization (.item(), .tolist(), .cpu(), nonzero(), boolean-mask indexing, a "
    "data-dependent shape, a Python branch on a device value, torch.cuda.synchronize()) cannot be captured; "
    "keep the value on the device"
)


class GraphCaptureError(RuntimeError):
    """The wrapped function cannot be captured (host sync, non-capturable op)."""


class GraphShapeError(ValueError):
    """Inputs changed shape/dtype/structure after the static buffers were allocated."""


def cuda_graphs_available() -> bool:
    return torch.cuda.is_available()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------------ graph-safe recompute --
def _graph_safe_rng_api() -> bool:
    return (hasattr(torch.cuda.CUDAGraph, "register_generator_state") and hasattr(torch.Generator, "clone_state")
            and hasattr(torch.Generator, "graphsafe_set_state") and hasattr(torch.Generator, "graphsafe_get_state"))


def _mix_seed(base: int, index: int) -> int:
    """SplitMix64 of ``(base, index)``: independent, reproducible seeds for the pairs (< 2**63)."""
    m = (1 << 64) - 1
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class _Region:
    """One recomputed region's claim on a pair: its two context managers for ``torch.utils.checkpoint`` (the
    recompute one is entered once per backward through the region, so it is a re-enterable object)."""

    def __init__(self, rng: "RecomputeRNG", index: int):
        self.rng, self.index = rng, index
        self.state = {"recomputed": False}
        weakref.finalize(self, RecomputeRNG._region_gone, weakref.ref(rng), index, self.state)

    def contexts(self):
        return _RegionContext(self, 0), _RegionContext(self, 1)


class _RegionContext:
    def __init__(self, region: _Region, which: int):
        self.region, self.which, self._cm = region, which, None

    def __enter__(self):
        reg = self.region
        if self.which == 1 and reg.state["recomputed"]:
            raise RuntimeError(
                "moe_graph.cuda_graph.checkpoint: this region was already recomputed once (a second backward through "
                "the same graph, retain_graph=True); its random stream was handed to another region. Run the "
                "forward again, or use preserve_rng_state=False if the region draws no random numbers")
        self._cm = reg.rng._use(reg.rng._pairs[reg.index][self.which])
        return self._cm.__enter__()

    def __exit__(self, *exc):
        cm, self._cm = self._cm, None
        suppress = cm.__exit__(*exc)
        if self.which == 1 and exc[0] is None:
            self.region.state["recomputed"] = True
            self.region.rng._release(self.region.index)
        return suppress


class RecomputeRNG:
    """Random streams for recomputed regions (activation checkpointing) that survive CUDA graph capture.

    Each region in flight holds a *pair* of generator states seeded alike: its forward draws from the first, its
    recomputation (in backward) from the second, so dropout masks match between the two. When the recomputation
    ends the pair returns to a free list and a later region reuses it (the two states stay in lockstep, whatever
    the order of the backward passes). Pairs are created outside capture (warm-up) from
    ``initial_seed()`` of the device's default generator; a capture that needs more regions in flight than the
    warm-up had raises :class:`GraphCaptureError`.

    On CUDA (torch >= 2.5) the states are ``clone_state()`` copies of the default generator, switched in with
    ``graphsafe_set_state`` (no ``get_rng_state``: nothing is refused during capture) and registered with each graph
    (:meth:`graph_states`; :class:`FullIterationGraph` does it): every replay advances them like the default
    generator, so masks change per replay and still match between forward and recomputation. On CPU (and CUDA
    without that API, eager only) the pairs are plain generators switched in with ``get_state``/``set_state``. The
    default generator itself is not advanced by a region's random numbers.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RecomputeRNG: device must be cpu or cuda, got {self.device}")
        self.graph_safe = self.device.type == "cuda" and _graph_safe_rng_api()
        self._pairs: List[tuple] = []
        self._free: List[int] = []  # a heap: the lowest free index first (the same sequence every step)

    def _default(self) -> torch.Generator:
        if self.device.type == "cpu":
            return torch.default_generator
        torch.cuda.init()
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]

    def _acquire(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        if _capturing(self.device):
            raise GraphCaptureError(
                f"moe_graph.cuda_graph.checkpoint: the captured step has more recomputed regions in flight than its warm-up "
                f"({len(self._pairs)}): generator states cannot be created or registered during capture. Run a "
                "warm-up step with the same structure first (FullIterationGraph does)")
        default = self._default()
        seed = _mix_seed(default.initial_seed(), len(self._pairs))
        if self.graph_safe:
            pair = (default.clone_state().manual_seed(seed), default.clone_state().manual_seed(seed))
        else:
            pair = tuple(torch.Generator(device=self.device).manual_seed(seed) for _ in range(2))
        self._pairs.append(pair)
        return len(self._pairs) - 1

    def _release(self, index: int) -> None:
        heapq.heappush(self._free, index)

    @staticmethod
    def _region_gone(rng_ref, index: int, state: dict) -> None:
        # A region whose forward ran but whose recomputation never will (its graph was freed without backward):
        # outside capture, bring the recompute state back in step with the forward state and free the pair; during
        # a capture the pair stays taken (it is simply not reused).
        rng = rng_ref()
        if rng is None or state["recomputed"] or _capturing(rng.device):
            return
        try:
            fwd, rec = rng._pairs[index]
            rec.set_state(fwd.get_state())
            rng._release(index)
        except Exception:  # pragma: no cover - never raise from a finalizer
            pass

    @contextlib.contextmanager
    def _use(self, gen: torch.Generator):
        default = self._default()
        if self.graph_safe:
            saved = default.graphsafe_get_state()
            default.graphsafe_set_state(gen)
            try:
                yield
            finally:
                default.graphsafe_set_state(saved)
            return
        if _capturing(self.device):
            raise GraphCaptureError(
                "moe_graph.cuda_graph.checkpoint: random numbers in a recomputed region under CUDA graph capture need "
                "torch >= 2.5 (Generator.graphsafe_set_state, CUDAGraph.register_generator_state); use "
                "preserve_rng_state=False if the region draws no random numbers")
        saved = default.get_state()
        default.set_state(gen.get_state())
        try:
            yield
        finally:
            gen.set_state(default.get_state())
            default.set_state(saved)

    def context_fn(self):
        """``(forward_context, recompute_context)`` for ``torch.utils.checkpoint.checkpoint(context_fn=...)``
        (with ``use_reentrant=False, preserve_rng_state=False, early_stop=False``: the recomputation must run the
        whole region, drawing as many random numbers as the forward did)."""
        return _Region(self, self._acquire()).contexts()

    def graph_states(self) -> List[torch.Generator]:
        """The generator states to register with a CUDA graph that captures recomputed regions
        (``graph.register_generator_state(s)``; empty off CUDA)."""
        return [g for pair in self._pairs for g in pair] if self.graph_safe else []

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    @property
    def in_flight(self) -> int:
        """Regions whose forward ran and whose recomputation has not (yet)."""
        return len(self._pairs) - len(self._free)


_RECOMPUTE_RNGS: Dict[str, RecomputeRNG] = {}


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def recompute_rng(device=None) -> RecomputeRNG:
    """The :class:`RecomputeRNG` of ``device`` (default: the current CUDA device, else CPU), one per device."""
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    if key not in _RECOMPUTE_RNGS:
        _RECOMPUTE_RNGS[key] = RecomputeRNG(dev)
    return _RECOMPUTE_RNGS[key]


def checkpoint(function: Callable, *args, preserve_rng_state: bool = True, **kwargs):
    """Graph-safe activation recomputation: ``function(*args, **kwargs)`` without keeping its activations, run
    again in backward; capturable in a CUDA graph (unlike ``torch.utils.checkpoint``'s default, which reads
    ``torch.cuda.get_rng_state()``).

    Non-reentrant ``torch.utils.checkpoint`` with the whole region recomputed (``early_stop=False``).
    ``preserve_rng_state=True``: random numbers drawn inside (dropout) come from a :class:`RecomputeRNG` pair of the
    first tensor argument's device, identical in forward and recomputation; ``False``: no RNG handling, for regions
    that draw no random numbers (cheaper, and fine under ``torch.compile``). Without grad mode it just calls
    ``function``. Nesting: only the outermost region may draw random numbers."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    from torch.utils.checkpoint import noop_context_fn

    context_fn = noop_context_fn
    if preserve_rng_state:
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        context_fn = recompute_rng(dev).context_fn
    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, early_stop=False,
                            context_fn=context_fn, **kwargs)


_LIVE_GRAPHS: "weakref.WeakSet" = weakref.WeakSet()


def captured_graphs() -> List["FullIterationGraph"]:
    """Live :class:`FullIterationGraph` objects holding at least one captured graph. A hook for state that a graph
    bakes in (e.g. optimizer settings read at capture): while this is non-empty, changing such state has no effect
    on replays, so the owner should refuse the change and name ``FullIterationGraph.reset()``."""
    return [g for g in list(_LIVE_GRAPHS) if any(m.graph is not None for m in g._modes.values())]


class _Mode:
    def __init__(self, name: str, fn: Optional[Callable]):
        self.name = name
        self.fn = fn
        self.iteration = 0
        self.spec = None
        self.static_leaves: Optional[List[Any]] = None  # tensors: static buffers; others: the captured values
        self.graph = None
        self.static_out = None
        self.capture_seconds = None
        self.holders: List[Any] = []  # objects whose settings the capture baked in (see _note_capture)


# The mode being captured. Objects whose Python-side settings a capture bakes in (DistributedOptimizer) call
# _note_capture(self) from inside the captured function; reset() then calls their release_captures(mode).
_CAPTURING: List[_Mode] = []


@contextlib.contextmanager
def _capture_scope(m: _Mode):
    _CAPTURING.append(m)
    try:
        yield
    finally:
        _CAPTURING.pop()


def _note_capture(obj) -> Optional[_Mode]:
    """The token (mode) of the FullIterationGraph capture in progress, recording ``obj`` as held by it; None when
    no FullIterationGraph is capturing (a graph captured by hand)."""
    if not _CAPTURING:
        return None
    _CAPTURING[-1].holders.append(obj)
    return _CAPTURING[-1]


def _release(m: _Mode) -> None:
    for obj in m.holders:
        obj.release_captures(m)
    m.holders.clear()


def _describe_path(spec, i: int) -> str:
    try:
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * spec.num_leaves, spec))[0]]
        return "inputs" + paths[i]
    except Exception:  # pragma: no cover - older torch without key paths
        return f"input leaf #{i}"


class FullIterationGraph:
    """Capture a whole training (and validation) iteration as CUDA graphs.

    Args:
        train_fn: the step function (forward + backward of all microbatches, optionally the optimizer step).
            Called as ``train_fn(*args, **kwargs)`` with the static copies of the inputs.
        eval_fn: the validation function (forward only), used by :meth:`eval_step`; its own graph and buffers.
        warmup_steps: eager steps per mode before capture (>= 1; Megatron's ``cuda_graph_warmup_steps``).
        enabled: ``None``: capture when CUDA is available; ``False``: always eager.
        pool: a memory pool handle (``torch.cuda.graph_pool_handle()`` or another wrapper's ``pool``) for both
            graphs; ``share_pool``: training and validation share one new pool (default: separate pools, so a
            validation replay never overwrites the training step's outputs).
        generators: extra CUDA generators to register with the graphs.
        check_syncs: run the last warm-up step under ``torch.cuda.set_sync_debug_mode("error")``.
        capture_error_mode: passed to ``torch.cuda.graph`` (``"thread_local"`` as Megatron; ``"global"`` and
            ``"relaxed"`` too).
        clone_outputs: return copies of the graph's outputs instead of its static tensors.
        device: the CUDA device of the static buffers (default: the current device).
    """

    def __init__(
        self,
        train_fn: Callable,
        eval_fn: Optional[Callable] = None,
        *,
        warmup_steps: int = 2,
        enabled: Optional[bool] = None,
        pool=None,
        share_pool: bool = False,
        generators: Sequence[torch.Generator] = (),
        check_syncs: bool = True,
        capture_error_mode: str = "thread_local",
        clone_outputs: bool = False,
        device=None,
    ):
        if not callable(train_fn):
            raise TypeError(f"train_fn must be callable, got {type(train_fn).__name__}")
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable or None, got {type(eval_fn).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (lazy initialization must happen before capture), got {warmup_steps}")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', got {capture_error_mode!r}")
        want = torch.cuda.is_available() if enabled is None else bool(enabled)
        if want and not torch.cuda.is_available():
            raise RuntimeError("FullIterationGraph(enabled=True) needs CUDA (CUDA graphs are a CUDA feature)")
        self.enabled = want
        self.warmup_steps = warmup_steps
        self.check_syncs = check_syncs
        self.capture_error_mode = capture_error_mode
        self.clone_outputs = clone_outputs
        self.generators = list(generators)
        if self.generators and self.enabled and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            raise RuntimeError("generators= needs torch.cuda.CUDAGraph.register_generator_state (torch >= 2.5)")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)) \
            if self.enabled else torch.device("cpu")
        self._pool_arg = pool
        self._share_pool = share_pool
        self._pools: Dict[str, Any] = {}
        self._modes = {"training": _Mode("training", train_fn), "validation": _Mode("validation", eval_fn)}
        _LIVE_GRAPHS.add(self)
        self.note = None
        if not self.enabled:
            self.note = ("FullIterationGraph: CUDA graphs need CUDA; running eagerly"
                         + (" (enabled=False)" if enabled is False else " (no CUDA device)"))
            warnings.warn(self.note, UserWarning, stacklevel=2)

    # ----------------------------------------------------------------------------------------- public --

    @property
    def train_fn(self) -> Callable:
        """The training step function this graph captures (e.g. a :func:`moe_graph.train.step.make_train_step`)."""
        return self._modes["training"].fn
    def __call__(self, *args, **kwargs):
        return self.train_step(*args, **kwargs)

    def train_step(self, *args, **kwargs):
        """One training iteration (warm-up, capture or replay)."""
        return self._step(self._modes["training"], args, kwargs)

    def eval_step(self, *args, **kwargs):
        """One validation iteration with ``eval_fn`` (its own graph and static buffers)."""
        if self._modes["validation"].fn is None:
            raise RuntimeError("FullIterationGraph.eval_step needs eval_fn= (the validation function)")
        return self._step(self._modes["validation"], args, kwargs)

    @staticmethod
    def data_read(data_iterator: Iterator, num_microbatches: int) -> List[Any]:
        """Reads ``num_microbatches`` items from ``data_iterator`` (a list of iterators, one per pipeline stage
        with ``None`` for stages without data, gives a list of such lists). The step copies them into the static
        buffers."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if isinstance(data_iterator, (list, tuple)):
            return [None if it is None else [next(it) for _ in range(num_microbatches)] for it in data_iterator]
        return [next(data_iterator) for _ in range(num_microbatches)]

    def reset(self, mode: Optional[str] = None) -> None:
        """Forget the graph(s) and static buffers (e.g. the shapes change): the next step warms up and captures
        again. ``mode``: ``"training"``, ``"validation"`` or ``None`` (both)."""
        names = list(self._modes) if mode is None else [mode]
        for n in names:
            if n not in self._modes:
                raise ValueError(f"mode must be 'training', 'validation' or None, got {mode!r}")
            m = self._modes[n]
            if m.graph is not None:
                m.graph.reset()
            _release(m)
            fn = m.fn
            self._modes[n] = _Mode(n, fn)
            self._pools.pop(n, None)

    def captured(self, mode: str = "training") -> bool:
        return self._modes[mode].graph is not None

    def iteration(self, mode: str = "training") -> int:
        return self._modes[mode].iteration

    def pool(self, mode: str = "training"):
        """The memory pool handle of ``mode``'s graph (``None`` before capture)."""
        return self._pools.get(mode)

    # ---------------------------------------------------------------------------------------- internals --
    def _bind_inputs(self, m: _Mode, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if m.static_leaves is None:
            m.spec = spec
            static = []
            for x in leaves:
                if isinstance(x, torch.Tensor):
                    dev = self.device if self.enabled else "meta"  # eager: only shapes/dtypes are checked
                    buf = torch.empty_like(x, device=dev, memory_format=torch.contiguous_format)
                    if x.requires_grad and x.is_leaf:
                        buf.requires_grad_(True)  # gradients land in the static buffer's .grad
                    static.append(buf)
                else:
                    static.append(x)
            m.static_leaves = static
        elif spec != m.spec:
            raise GraphShapeError(
                f"FullIterationGraph({m.name}): the structure of the inputs changed between steps "
                f"(was {m.spec}, now {spec}); a graph replays fixed inputs: call reset() to capture again"
            )
        for i, (x, s) in enumerate(zip(leaves, m.static_leaves)):
            if isinstance(s, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.shape != s.shape or x.dtype != s.dtype:
                    got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                    raise GraphShapeError(
                        f"FullIterationGraph({m.name}): {_describe_path(spec, i)} changed from {tuple(s.shape)} "
                        f"{s.dtype} to {got}; shapes must stay fixed between steps (pad to static sizes, or call "
                        f"reset() to capture again)"
                    )
            elif x != s and not (x is s):
                raise GraphShapeError(
                    f"FullIterationGraph({m.name}): non-tensor {_describe_path(spec, i)} changed from {s!r} to "
                    f"{x!r}; it is baked into the graph: call reset() to capture again"
                )
        return leaves

    def _run_eager(self, m: _Mode, args, kwargs):
        self._bind_inputs(m, args, kwargs)
        m.iteration += 1
        return m.fn(*args, **kwargs)

    def _copy_in(self, m: _Mode, leaves):
        with torch.no_grad():
            for x, s in zip(leaves, m.static_leaves):
                if isinstance(s, torch.Tensor):
                    s.copy_(x, non_blocking=True)
        return pytree.tree_unflatten(m.static_leaves, m.spec)

    def _get_pool(self, name: str):
        if name in self._pools:
            return self._pools[name]
        if self._pool_arg is not None:
            pool = self._pool_arg
        elif self._share_pool and self._pools:
            pool = next(iter(self._pools.values()))
        else:
            pool = torch.cuda.graph_pool_handle()
        self._pools[name] = pool
        return pool

    def _step(self, m: _Mode, args, kwargs):
        if not self.enabled:
            return self._run_eager(m, args, kwargs)
        leaves = self._bind_inputs(m, args, kwargs)
        s_args, s_kwargs = self._copy_in(m, leaves)
        if m.graph is not None:
            m.graph.replay()
            m.iteration += 1
            return self._outputs(m)
        if m.iteration < self.warmup_steps:
            out = self._warmup(m, s_args, s_kwargs, check=self.check_syncs and m.iteration == self.warmup_steps - 1)
            m.iteration += 1
            return out
        self._capture(m, s_args, s_kwargs)
        m.graph.replay()  # capture records the work without running it
        m.iteration += 1
        return self._outputs(m)

    def _outputs(self, m: _Mode):
        if not self.clone_outputs:
            return m.static_out
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, m.static_out)

    def _warmup(self, m: _Mode, args, kwargs, check: bool):
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            if check:
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out = m.fn(*args, **kwargs)
                except RuntimeError as e:
                    if "synchroniz" in str(e).lower():
                        raise GraphCaptureError(
                            f"FullIterationGraph({m.name}): the step function synchronizes with the host (found in "
                            f"warm-up step {m.iteration} under torch.cuda.set_sync_debug_mode('error')): {_SYNC_HINT}. "
                            f"Original error: {e}"
                        ) from e
                    raise
                finally:
                    torch.cuda.set_sync_debug_mode(prev)
            else:
                out = m.fn(*args, **kwargs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def _capture(self, m: _Mode, args, kwargs):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        for gen in self.generators + recompute_rng(self.device).graph_states():  # pairs made during warm-up
            g.register_generator_state(gen)
        t0 = time.perf_counter()
        prev_stream = torch.cuda.current_stream(self.device)
        try:
            with _capture_scope(m), torch.cuda.graph(g, pool=self._get_pool(m.name),
                                                     capture_error_mode=self.capture_error_mode):
                out = m.fn(*args, **kwargs)
        except GraphCaptureError:
            torch.cuda.set_stream(prev_stream)
            _release(m)
            raise
        except Exception as e:
            # torch.cuda.graph's __exit__ may leave the capture stream current when capture_end fails
            torch.cuda.set_stream(prev_stream)
            _release(m)
            msg = str(e)
            hint = _SYNC_HINT if any(s in msg.lower() for s in ("captur", "synchroniz", "not permitted")) else (
                "an operation in the step function is not capturable")
            raise GraphCaptureError(
                f"FullIterationGraph({m.name}): capture failed: {hint}. Original error: {msg}. (With torch < 2.12 a "
                "failed capture can leave the caching allocator in capture mode: later captures in this process "
                "may fail; restart the process.)") from e
        m.capture_seconds = time.perf_counter() - t0
        m.graph = g
        m.static_out = out


class FullCudaGraphWrapper:
    """Megatron-style wrapper of a pipeline ``forward_backward_func`` (:func:`moe_graph.train.schedules.get_forward_backward_func`):
    ``wrapper(forward_step_func=..., data_iterator=..., model=..., num_microbatches=..., forward_only=False, ...)``
    reads all microbatches from ``data_iterator`` (one iterator, or a list with one per model chunk / ``None``),
    copies them into static buffers and runs the whole schedule (every microbatch, every pipeline stage's sends and
    receives, the grad sync) as the training graph; ``forward_only=True`` uses the validation graph. Only two graphs
    exist, whatever the pipeline depth.

    The other keyword arguments (``forward_step_func``, ``model``, ``config``, ...) are baked into the graphs: they
    must be the same objects on every call (else :class:`GraphShapeError`; call :meth:`reset`).
    """

    def __init__(self, forward_backward_func: Callable, cuda_graph_warmup_steps: int = 2, **graph_kwargs):
        if not callable(forward_backward_func):
            raise TypeError(f"FullCudaGraphWrapper: forward_backward_func must be callable (e.g. "
                            f"pipeline.get_forward_backward_func()), got {type(forward_backward_func).__name__}")
        self.forward_backward_func = forward_backward_func
        self._fixed: Dict[str, Any] = {}
        self.graph = FullIterationGraph(lambda data, n, per_chunk: self._run(data, n, per_chunk, False),
                                        eval_fn=lambda data, n, per_chunk: self._run(data, n, per_chunk, True),
                                        warmup_steps=cuda_graph_warmup_steps, **graph_kwargs)

    def _run(self, data, num_microbatches, per_chunk, forward_only):
        # per_chunk: data_iterator was a list (one iterator per model chunk); a microbatch may itself be a list
        it = [None if d is None else iter(d) for d in data] if per_chunk else iter(data)
        return self.forward_backward_func(data_iterator=it, num_microbatches=num_microbatches,
                                          forward_only=forward_only, **self._fixed[forward_only])

    def __call__(self, *, data_iterator, num_microbatches: int, forward_only: bool = False, **kwargs):
        fixed = self._fixed.get(forward_only)
        if fixed is None:
            self._fixed[forward_only] = dict(kwargs)
        elif fixed.keys() != kwargs.keys() or any(fixed[k] is not kwargs[k] for k in kwargs):
            changed = sorted(k for k in set(fixed) | set(kwargs) if fixed.get(k) is not kwargs.get(k))
            raise GraphShapeError(
                f"FullCudaGraphWrapper: arguments {changed} are not the objects the graph was captured with; "
                "call reset() to capture again"
            )
        data = FullIterationGraph.data_read(data_iterator, num_microbatches)
        step = self.graph.eval_step if forward_only else self.graph.train_step
        return step(data, num_microbatches, isinstance(data_iterator, (list, tuple)))

    def reset(self) -> None:
        self._fixed.clear()
        self.graph.reset()
