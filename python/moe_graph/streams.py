"""Side streams with fork / join events, and the stream structure as data.

Work that does not need a stage's result (the shared expert beside the token exchange) runs on a *side stream*:
:class:`SideStream` forks it from the current stream (the side stream waits on an event recorded on the current
stream), runs the work there, records a join event, and :meth:`SideStream.join` makes the current stream wait on
that event before the result is used. Streams and events are made once per device and owner (never during a CUDA
graph capture); the fork event is what makes the side stream part of a capture (multi-stream capture: the side
stream must wait on an event of the capturing stream before it issues anything).

Autograd runs the backward of an op on the stream its forward ran on and joins streams itself where a gradient
crosses them (the engine's input buffers wait on the producing stream; the end of ``backward()`` waits on every
stream a leaf's gradient was made on): the side stream's backward needs no code of ours.

**Recording.** Every stream switch, event record and event wait goes through this module, so the same code path
can be recorded: inside :class:`StreamRecorder` (a ``TorchDispatchMode``) each aten op is listed with the *logical*
stream it was issued on (``"main"`` or a side stream's name), the stage it belongs to (:func:`stage`), the storages
it reads and writes, and every event record / wait in issue order. On CPU there are no streams: the side stream's
work runs in order on the host and only the record shows the structure. :func:`unjoined_uses` walks a record with
vector clocks and lists every read of a tensor produced on another stream with no event wait in between (a race
on a GPU); :func:`happens_before` tells whether one recorded op is ordered before another.

Example::

    side = SideStream(device, "shared_expert")       # once, at construction
    with side.fork(h):                               # side waits on the current stream, then runs the body
        y = shared(h)
    ...                                              # the current stream's work, concurrent with the body
    side.join(y)                                     # the current stream waits on the body's end
    out = out + y
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SideStream", "StreamRecorder", "RecordedOp", "RecordedEvent", "stage", "microbatch",
           "current_logical_stream", "unjoined_uses", "happens_before", "MAIN", "exchange_issued", "exchange_hook",
           "thread_state", "event_slot", "minor_exchanges"]

MAIN = "main"
_state = threading.local()
_cuda_streams: Dict[Tuple[torch.device, str], "torch.cuda.Stream"] = {}


def current_logical_stream() -> str:
    """The logical stream work is issued on now: ``"main"`` (the caller's stream) or a side stream's name."""
    return getattr(_state, "stream", MAIN)


def _current_stage() -> Optional[str]:
    return getattr(_state, "stage", None)


def stage(name: str):
    """A context that labels the ops issued inside for an active :class:`StreamRecorder`; without one (and under
    ``torch.compile``) a no-op context."""
    if torch.compiler.is_compiling() or _recorder() is None:
        return contextlib.nullcontext()
    return _labelled(name)


def microbatch(index: int):
    """A context that labels the ops issued inside (and the backward ops of the autograd nodes made inside) with the
    microbatch ``index`` for an active :class:`StreamRecorder`; without one (and under ``torch.compile``) a no-op."""
    if torch.compiler.is_compiling() or _recorder() is None:
        return contextlib.nullcontext()
    return _labelled(index, "microbatch")


@contextlib.contextmanager
def _labelled(name, attr: str = "stage") -> Iterator[None]:
    prev = getattr(_state, attr, None)
    setattr(_state, attr, name)
    first = torch._C._autograd._get_sequence_nr()  # the autograd nodes made inside get the label too
    try:
        yield
    finally:
        setattr(_state, attr, prev)
        rec = _recorder()
        if rec is not None:
            (rec._stage_nodes if attr == "stage" else rec._microbatch_nodes).append(
                (first, torch._C._autograd._get_sequence_nr(), name))


def _recorder() -> Optional["StreamRecorder"]:
    return getattr(_state, "recorder", None)


def _event_slot() -> int:
    return getattr(_state, "slot", 0)


@contextlib.contextmanager
def event_slot(slot: int) -> Iterator[None]:
    """In this thread, every :class:`SideStream` forks and joins with its second set of events (``slot`` 1; 0: the
    default set): two threads that issue forks and joins of the same side stream interleaved (the forward in the
    stage interleave's worker, a recomputation in the backward beside it) then never record over each other's
    events (a fork and its join must be issued in the same thread)."""
    if slot not in (0, 1):
        raise ValueError(f"event_slot: slot must be 0 or 1, got {slot!r}")
    prev = _event_slot()
    _state.slot = slot
    try:
        yield
    finally:
        _state.slot = prev


# ------------------------------------------------------------------------------------------ exchange points --
_exchange_hook: Optional[Callable[[], None]] = None  # process-wide: autograd may run a backward in its own thread


def exchange_issued(point: bool = True) -> bool:
    """Called right after a token exchange was issued (the dispatcher's dispatch / combine rows in the forward and
    their exchanges in the backward: the autograd functions of :mod:`moe_graph.moe.token_dispatcher` and
    :mod:`moe_graph.moe.exchange`, every backend). It is an *exchange point* unless ``point`` is False or it is issued
    inside :func:`minor_exchanges` (the routing weights' exchange beside the rows); returns whether it is one (a
    forward keeps it for its backward's call). At an exchange point the hook (:func:`exchange_hook`) runs, if one is
    installed (the stage interleave of :mod:`moe_graph.train.interleave` hands the other microbatch the turn there),
    and an active :class:`StreamRecorder` notes the point (``exchange_points``)."""
    point = point and not getattr(_state, "minor", False)
    if not point or torch.compiler.is_compiling():
        return point
    rec = _recorder()
    if rec is not None:
        rec.exchange_points.append(len(rec.entries))
    hook = _exchange_hook
    if hook is not None:
        hook()
    return point


@contextlib.contextmanager
def minor_exchanges() -> Iterator[None]:
    """The exchanges issued inside (in this thread) are no exchange points (see :func:`exchange_issued`)."""
    prev = getattr(_state, "minor", False)
    _state.minor = True
    try:
        yield
    finally:
        _state.minor = prev


@contextlib.contextmanager
def exchange_hook(fn: Callable[[], None]) -> Iterator[None]:
    """Installs ``fn`` as the hook :func:`exchange_issued` calls (in every thread), for the body; one at a time."""
    global _exchange_hook
    if _exchange_hook is not None:
        raise RuntimeError("exchange_hook: another exchange hook is installed (one stage interleave at a time)")
    _exchange_hook = fn
    try:
        yield
    finally:
        _exchange_hook = None


def thread_state() -> Callable[[], ContextManager[None]]:
    """This thread's recording state, for another thread: the returned factory's context, entered in that thread,
    sets the same logical stream, stage and microbatch labels and active :class:`StreamRecorder`, and pushes the same
    ``TorchDispatchMode`` stack (``TorchDispatchMode`` and this module's state are thread-local), so the ops that
    thread issues are recorded into the same record, in the order they are issued."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    saved = {k: getattr(_state, k, None) for k in ("stream", "stage", "microbatch", "recorder")}
    modes = list(_get_current_dispatch_mode_stack())

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        before = {k: getattr(_state, k, None) for k in saved}
        for k, v in saved.items():
            if v is not None:
                setattr(_state, k, v)
        pushed = 0
        try:
            for mode in modes:
                _push_mode(mode)
                pushed += 1
            yield
        finally:
            for _ in range(pushed):
                _pop_mode()
            for k, v in before.items():
                setattr(_state, k, v)

    return enter


def _side_cuda_stream(device: torch.device, name: str) -> "torch.cuda.Stream":
    key = (device, name)
    if key not in _cuda_streams:  # one side stream per (device, name), shared by every owner
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"SideStream {name!r}: the side stream must be created before a CUDA graph capture")
        _cuda_streams[key] = torch.cuda.Stream(device=device)
    return _cuda_streams[key]


class SideStream:
    """A side stream of ``device`` named ``name`` (one CUDA stream per device and name) with this owner's fork and
    join events. On a non-CUDA device the body runs in order and only a :class:`StreamRecorder` sees the streams.
    ``whole_graph``: the body makes the whole autograd graph of what it returns, apart from the fork's inputs (a
    microbatch's forward on a microbatch stream): the recorder models the engine's gradient accumulation between
    its nodes on this stream (see :meth:`StreamRecorder._backward_on`)."""

    _ids = itertools.count()

    def __init__(self, device, name: str, whole_graph: bool = False):
        device = torch.device(device)
        if not isinstance(name, str) or not name or name == MAIN:
            raise ValueError(f"name must be a non-empty string other than {MAIN!r}, got {name!r}")
        self.device, self.name, self.whole_graph = device, name, bool(whole_graph)
        self._id = next(SideStream._ids)
        # per event slot (:func:`event_slot`): the fork's inputs, until the join (the recorder's backward model reads
        # them), and the fork / join events
        self._inputs: List[Tuple] = [(), ()]
        self.cuda = device.type == "cuda"
        if self.cuda:
            if device.index is None:
                device = self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = _side_cuda_stream(device, name)
            self._events = [{"fork": torch.cuda.Event(), "join": torch.cuda.Event()} for _ in range(2)]
        else:
            self.stream, self._events = None, None

    def _event_name(self, kind: str) -> str:
        slot = _event_slot()
        return f"{self.name}#{self._id}{'' if slot == 0 else f'/{slot}'}.{kind}"

    def _record(self, kind: str) -> None:
        rec = _recorder()
        if rec is not None:
            rec._event("record", self._event_name(kind))
        if self.cuda:
            self._events[_event_slot()][kind].record(torch.cuda.current_stream(self.device))

    def _wait(self, kind: str) -> None:
        rec = _recorder()
        if rec is not None:
            rec._event("wait", self._event_name(kind))
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[_event_slot()][kind])

    def mark_fork(self) -> None:
        """Records the fork event on the current stream now, for a later ``fork(..., marked=True)``: the body then
        waits only for the work issued before this call (work issued in between runs beside it)."""
        self._record("fork")

    @contextlib.contextmanager
    def fork(self, *inputs: torch.Tensor, marked: bool = False) -> Iterator[None]:
        """Records the fork event on the current stream (``marked``: :meth:`mark_fork` did), runs the body on the
        side stream after waiting on it, and records the join event there at the end. ``inputs``: tensors made on
        the current stream that the body reads (their memory is kept from reuse until the side stream is done with
        them)."""
        if not marked:
            self._record("fork")
        self._inputs[_event_slot()] = inputs
        prev = current_logical_stream()
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            _state.stream = self.name
            try:
                self._wait("fork")
                if self.cuda:
                    for t in inputs:
                        if isinstance(t, torch.Tensor) and t.is_cuda:
                            t.record_stream(self.stream)
                yield
                self._record("join")
            finally:
                _state.stream = prev

    def join(self, *outputs):
        """The current stream waits on the join event (the body's end); ``outputs`` (made on the side stream, used
        on the current one; ``None`` allowed) are kept from reuse until the current stream is done with them.
        Returns ``outputs`` (under a :class:`StreamRecorder`, the tensors pass through an identity whose backward
        marks when their gradient is ready)."""
        self._wait("join")
        slot = _event_slot()
        inputs, self._inputs[slot] = self._inputs[slot], ()
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(cur)
        rec = _recorder()
        if rec is not None:
            outputs = rec._backward_on(self.name, outputs, inputs, self.whole_graph)
        return outputs


# ------------------------------------------------------------------------------------------------ recording --
@dataclass
class RecordedOp:
    """One aten op: its index in the record, logical stream, stage label, and the storages it reads / writes."""
    index: int
    name: str
    stream: str
    stage: Optional[str]
    reads: Tuple[int, ...]
    writes: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...] = ()
    out_shapes: Tuple[Tuple[int, ...], ...] = ()
    dtypes: Tuple[str, ...] = ()
    phase: str = "forward"  # "backward" (run by the autograd engine), "recompute" (a labelled stage run again there)
    microbatch: Optional[int] = None  # the microbatch (:func:`microbatch`) whose forward or backward issued it
    clock: Dict[str, int] = field(default_factory=dict)  # vector clock after the op (see unjoined_uses)


@dataclass
class RecordedEvent:
    """An event ``record`` or ``wait`` issued on ``stream`` (``event``: the event's name)."""
    index: int
    kind: str
    event: str
    stream: str


class StreamRecorder(TorchDispatchMode):
    """Records, in issue order, every aten op (with its logical stream and stage) and every event record / wait
    of :class:`SideStream` (``self.entries``). Keeps every tensor it saw alive while it is active, so storage
    addresses are unique within a record. Use as a context manager, around a forward and its backward."""

    def __init__(self):
        super().__init__()
        self.entries: List = []
        self._keep: List[torch.Tensor] = []
        self._nodes = itertools.count()
        self._stage_nodes: List[Tuple[int, int, str]] = []  # [first, end) autograd sequence numbers of a stage
        self._microbatch_nodes: List[Tuple[int, int, int]] = []  # the same for a microbatch
        self._caller: Optional[str] = None  # the stream a backward() in progress was called on
        self._claimed: Dict = {}  # autograd node -> the stream a _backward_on gave it (an inner side stream first)
        # where exchange_issued() was called: the number of entries recorded before it (an exchange point follows
        # the entry before it, the exchange just issued)
        self.exchange_points: List[int] = []

    @property
    def ops(self) -> List[RecordedOp]:
        return [e for e in self.entries if isinstance(e, RecordedOp)]

    def __enter__(self):
        if _recorder() is not None:
            raise RuntimeError("StreamRecorder: a recorder is already active in this thread")
        _state.recorder = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.recorder = None
        return super().__exit__(*exc)

    def _backward_on(self, stream: str, outputs, inputs, whole: bool = False):
        """Models autograd's stream rule in the record (torch: the backward of an op runs on the stream its forward
        ran on; where a gradient crosses streams the engine makes the consumer wait on an event recorded on the
        producer when the gradient was made; at the end of ``backward()`` the caller's stream waits on the streams
        of the leaves' gradients). The nodes between ``outputs`` and ``inputs`` are recorded on ``stream`` (nodes
        an inner side stream already claimed keep it); the stream the join runs on (``outer``) is where the engine
        continues after them. ``whole``: these nodes are the whole graph of ``outputs`` apart from ``inputs`` (a
        microbatch stream): the engine's accumulation of one node's output into another's input buffer happens on this
        stream, and only a consumer outside (a parameter's accumulator) waits; otherwise the engine continues on
        ``outer`` after each node (the nodes of the graph not between ``outputs`` and ``inputs`` have no hooks). A
        leaf (parameter) among ``inputs``: its gradient accumulator was made on ``outer``
        (the caller made it there and keeps it), so its accumulation and hooks run there, after a wait. Each output
        passes through an identity that records the "gradient ready" event on the current stream."""
        if not torch.is_grad_enabled():
            return outputs
        n = next(self._nodes)
        ready, done = f"autograd#{n}.ready", f"autograd#{n}.done"
        outer = current_logical_stream()
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        stop |= {torch.autograd.graph.get_gradient_edge(t).node for t in inputs
                 if isinstance(t, torch.Tensor) and t.grad_fn is None and t.requires_grad}
        todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        roots, seen = set(todo), set()
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stop:
                continue
            seen.add(node)
            todo.extend(f for f, _ in node.next_functions)
        side = {node for node in seen if node not in self._claimed}
        handles = []
        running = [False]  # this graph's backward is under way (between its first root and its end)

        def finish():  # end of backward(): the caller's stream waits on the streams that made gradients
            running[0] = False
            self._event("wait", done)
            for h in handles:
                h.remove()

        for node in side:
            self._claimed[node] = stream
            to_outer = any(f not in seen for f, _ in node.next_functions if f is not None)

            def enter(grad_outputs, root=node in roots):
                if root:
                    self._in_backward()
                _state.stream = stream
                if root:
                    running[0] = True
                    self._event("wait", ready)
                    torch.autograd.Variable._execution_engine.queue_callback(finish)

            def leave(grad_inputs, grad_outputs, to_outer=to_outer):
                self._event("record", done)
                if whole:  # the engine adds the outputs into their consumers' buffers next, here for a consumer
                    return  # on this stream; one outside waits for them (``boundary`` below)
                _state.stream = outer  # the other nodes run on ``outer``; the engine accumulates a gradient for
                if to_outer:  # an outer-stream node after waiting on the producer
                    self._event("wait", done)

            handles += [node.register_prehook(enter), node.register_hook(leave)]
        if whole:
            def boundary(grad_outputs):  # a consumer outside waits for this stream's work so far, runs on ``outer``
                if not running[0]:  # a consumer shared with another graph (a parameter's accumulator), reached by
                    return  # that graph's backward: nothing of this stream precedes it
                self._event("record", done, stream)
                self._event("wait", done, outer)
                _state.stream = outer

            handles += [f.register_prehook(boundary) for f in
                        {f for node in side for f, _ in node.next_functions if f is not None and f not in seen}]
        return tuple(_GradReady.apply(t, self, ready) if isinstance(t, torch.Tensor) and t.requires_grad else t
                     for t in outputs)

    def _in_backward(self) -> None:
        """At the first hooked node of a ``backward()``: the engine returns to the caller's stream at its end
        (this callback runs before the per-side-stream ones, whose waits are then recorded there)."""
        if self._caller is not None:
            return
        self._caller = current_logical_stream()

        def end():
            _state.stream, self._caller = self._caller, None

        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _event(self, kind: str, event: str, stream: Optional[str] = None) -> None:
        self.entries.append(RecordedEvent(len(self.entries), kind, event, stream or current_logical_stream()))

    def _key(self, t: torch.Tensor) -> Optional[int]:
        if t.numel() == 0 or t.device.type == "meta":
            return None
        self._keep.append(t)
        return t.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written = set()
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                for t in pytree.tree_leaves(v):
                    if isinstance(t, torch.Tensor):
                        written.add(id(t))
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        reads = tuple(k for k in (self._key(t) for t in ins) if k is not None)
        # an output sharing an input's storage is a view (not a write) unless the schema says the op writes it
        written_keys = {self._key(t) for t in ins if id(t) in written}
        writes = tuple(k for k in {self._key(t) for t in outs} - (set(reads) - written_keys) | written_keys
                       if k is not None)
        node = torch._C._current_autograd_node()
        label = _current_stage()
        mb = getattr(_state, "microbatch", None)
        if node is not None:  # a backward op: the stage (and microbatch) whose forward made its node
            seq = node._sequence_nr()
            if label is None:
                label = next((name for a, b, name in reversed(self._stage_nodes) if a <= seq < b), None)
            if mb is None:
                mb = next((i for a, b, i in reversed(self._microbatch_nodes) if a <= seq < b), None)
        self.entries.append(RecordedOp(len(self.entries), func.overloadpacket.__name__, current_logical_stream(),
                                       label, reads, writes, tuple(tuple(t.shape) for t in ins),
                                       tuple(tuple(t.shape) for t in outs), tuple(str(t.dtype) for t in ins),
                                       clock={}, phase="forward" if node is None else
                                       "recompute" if _current_stage() is not None else "backward",
                                       microbatch=mb))
        return out


class _GradReady(torch.autograd.Function):
    """Identity; its backward records the event ``name`` on the current logical stream (recording only)."""

    @staticmethod
    def forward(ctx, t, recorder, name):
        ctx.recorder, ctx.name = recorder, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder._event("record", ctx.name)
        return grad, None, None


def _clocks(entries) -> None:
    """Fills each op's vector clock: ``clock[s]`` = how many ops of stream ``s`` are ordered before it (inclusive)."""
    vc: Dict[str, Dict[str, int]] = {}
    events: Dict[str, Dict[str, int]] = {}
    for e in entries:
        mine = vc.setdefault(e.stream, {})
        if isinstance(e, RecordedOp):
            mine[e.stream] = mine.get(e.stream, 0) + 1
            e.clock = dict(mine)
        elif e.kind == "record":
            events[e.event] = dict(mine)
        else:
            if e.event not in events:
                raise ValueError(f"entry {e.index}: wait on event {e.event!r} that was never recorded")
            for s, n in events[e.event].items():
                mine[s] = max(mine.get(s, 0), n)


def happens_before(a: RecordedOp, b: RecordedOp) -> bool:
    """Whether op ``a`` is ordered before op ``b`` by stream order and event waits (after :func:`unjoined_uses` or
    any call that filled the clocks)."""
    return b.clock.get(a.stream, 0) >= a.clock[a.stream] and a.index < b.index


def unjoined_uses(entries) -> List[Tuple[RecordedOp, RecordedOp]]:
    """``(producer, consumer)`` pairs where ``consumer`` reads or overwrites a storage that ``producer`` last wrote
    on another stream, with no event wait ordering them: each would be a race on a GPU. Empty: every cross-stream
    use is joined."""
    _clocks(entries)
    last_write: Dict[int, RecordedOp] = {}
    bad = []
    for e in entries:
        if not isinstance(e, RecordedOp):
            continue
        for k in set(e.reads) | set(e.writes):
            p = last_write.get(k)
            if p is not None and p.stream != e.stream and not happens_before(p, e):
                bad.append((p, e))
        for k in e.writes:
            last_write[k] = e
    return bad
