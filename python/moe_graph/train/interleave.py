"""The stage interleave of two microbatches in flight (``PipelineConfig.interleave_stages``): the forward ``F`` of one
microbatch and the backward ``B`` of another are issued stage by stage, alternating at the token exchanges, so that
each side's exchange is issued right before the other side's computation (as Megatron-core's combined 1F1B and
DualPipe plan it) without the model being cut into stages by hand.

How. ``F`` runs in a worker thread (:class:`ForwardWorker`, one per schedule call), ``B`` where autograd runs it
(the caller's thread on CPU, the engine's device thread on CUDA). A :class:`Baton` lets one side run at a time. Every
token exchange calls :func:`moe_graph.streams.exchange_issued` right after it is issued (the dispatcher's dispatch
and combine rows in the forward, their exchanges in the backward: the autograd functions of
:mod:`moe_graph.moe.token_dispatcher` and :mod:`moe_graph.moe.exchange`, every backend; the routing weights'
exchange beside the rows, ``TokenDispatcher.row_weights``, is not a point of its own), and there the side that
issued it hands the baton to the other and waits for it back. Definition, for one pair ``(F(i + 1), B(i))``:

* ``B`` goes first: it runs until it has issued its first exchange, then ``F`` until it has issued its first, then
  ``B`` again, ...; the issue order is ``B-compute B-exchange F-compute F-exchange B-compute B-exchange ...``. For
  one MoE block per side (attention, then the MoE layer) that is Megatron-core's combined-1F1B order: B's combine
  backward exchange | F's attention, router, dispatch | B's experts backward, dispatch backward exchange | F's
  experts, combine | B's router and attention backward | F's rest (the loss).
* A side that finishes (its last op issued, or it raised) hands the baton over for good: the other runs free to its
  end. A side with no exchange left thus runs to its end at its next turn, and a side with no exchange at all (EP 1)
  runs whole at its turn (``B(i)`` whole, then ``F(i + 1)`` whole: today's issue order).
* Whatever autograd runs inside ``B`` is ``B``: a recomputation (``recompute``) of the forward inside the backward
  hands over at its exchanges as ``B``.
* Which side is which: the worker thread is ``F``; any other thread that issues an exchange while the pair runs is
  ``B``. The first forward ``F(0)`` and the last backward run alone. In the interleaved pipeline schedule
  (:func:`moe_graph.train.schedules.forward_backward_pipelining_with_interleaving`) a pair is one steady step's
  forward and backward (different microbatches, maybe different model chunks); the warm-up forwards and cool-down
  backwards run alone, and process-wide state that must be a side's own while it runs (the virtual pipeline rank of
  its chunk) is set by that side each time it gets the turn (``Baton(on_turn)``).
* Streams: exactly those of ``overlap_microbatches`` (:func:`moe_graph.train.schedules.forward_backward_overlapped`):
  ``F(i + 1)`` forks its microbatch stream from a mark made before ``B(i)`` and is joined after ``B(i)``; the worker
  forks and joins side streams with their second set of events (:func:`moe_graph.streams.event_slot`), so a
  recomputation in ``B`` that forks the same side stream (the shared expert) between ``F``'s fork and join of it
  records its own events.

The two sides touch no common state apart from what the serial loop also orders (forwards write the MoE layers'
statistics and counters, backwards accumulate gradients; the interleave keeps every forward in order and every
backward in order), and their arithmetic is not changed: the results are bitwise equal to the serial loop.

Failures: an exception on either side finishes that side (the other runs free to its end); the caller waits for
both ends, then raises (``B``'s exception when ``B`` failed, else ``F``'s); the worker thread is joined before the
schedule returns or raises (:meth:`ForwardWorker.close` in a ``finally``).

Thread-local state carried into the worker (:func:`carry_thread_state`, captured when the worker is made): grad mode,
``torch.autocast`` (enabled and dtype per device type, cache), ``moe_graph.fp8.autocast``'s recipe, the current CUDA
stream of the models' device, and :func:`moe_graph.streams.thread_state` (logical stream, stage / microbatch labels,
the active :class:`moe_graph.streams.StreamRecorder` and the ``TorchDispatchMode`` stack). Not carried: saved-tensor
hooks (``torch.autograd.graph.saved_tensors_hooks`` entered around the schedule), ``torch.inference_mode``, other
``TorchFunctionMode``s; enter them inside the forward step function instead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from moe_graph import streams
from moe_graph.ops import fp8 as _fp8

__all__ = ["F", "B", "Baton", "ForwardWorker", "carry_thread_state", "run_pair"]

F, B = "F", "B"
_OTHER = {F: B, B: F}
_tls = threading.local()  # .side == F in a ForwardWorker's thread


class Baton:
    """Lets one of two sides run at a time (see the module docstring). ``start`` a pair (``B`` first), then each side
    calls :meth:`wait_turn` before its first op, :meth:`hand_off` at each exchange point (via the hook) and
    :meth:`finish` at its end (also when it raised). ``on_turn(side)``, if given, is called by a side each time it
    gets the turn (in :meth:`wait_turn` and when :meth:`hand_off` gives it back): there it sets process-wide state
    that must be its own while it runs (the interleaved pipeline schedule sets the virtual pipeline rank of the side's
    model chunk); the other side is waiting then."""

    def __init__(self, on_turn: Optional[Callable[[str], None]] = None):
        self._cond = threading.Condition()
        self._on_turn = on_turn
        self.holder: Optional[str] = None
        self.done = {F: True, B: True}

    def start(self, sides=(F, B)) -> None:
        """A new pair (or ``F`` alone: ``sides=(F,)``); ``B`` holds the baton first."""
        with self._cond:
            self.done = {F: F not in sides, B: B not in sides}
            self.holder = B if B in sides else F

    def _mine(self, side: str) -> bool:
        return self.holder == side or self.done[_OTHER[side]]

    def wait_turn(self, side: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._mine(side))
        self._turn(side)

    def _turn(self, side: str) -> None:
        if self._on_turn is not None:
            self._on_turn(side)

    def hand_off(self, side: str) -> None:
        """At an exchange point of ``side``: the other side's turn (if it is still running), then wait for ours."""
        with self._cond:
            if self.done[side] or self.done[_OTHER[side]]:
                return  # not in a pair (or the other side ended): run free
            self.holder = _OTHER[side]
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._mine(side))
        self._turn(side)

    def finish(self, side: str) -> None:
        with self._cond:
            self.done[side] = True
            self.holder = _OTHER[side]
            self._cond.notify_all()

    def hook(self) -> None:
        """The :func:`moe_graph.streams.exchange_hook`: the worker thread is ``F``, any other thread ``B``."""
        self.hand_off(F if getattr(_tls, "side", None) == F else B)


def carry_thread_state(device: Optional[torch.device] = None) -> Callable[[], ContextManager[None]]:
    """This thread's state a forward needs, for the worker: a factory whose context sets it in the thread it is
    entered in (see the module docstring for what is carried)."""
    grad = torch.is_grad_enabled()
    autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in ("cpu", "cuda")]
    cache = torch.is_autocast_cache_enabled()
    recipe = getattr(_fp8._STATE, "recipe", None)  # moe_graph.fp8.autocast's (thread-local)
    stream = (torch.cuda.current_stream(device)
              if device is not None and device.type == "cuda" else None)
    recording = streams.thread_state()

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for t, enabled, dtype in autocast:
                if enabled:
                    stack.enter_context(torch.autocast(t, dtype=dtype, cache_enabled=cache))
            if recipe is not None:
                stack.enter_context(_fp8.autocast(recipe=recipe))
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(recording())
            yield

    return enter


class ForwardWorker:
    """One thread that runs the forwards of a schedule call as side ``F`` of a :class:`Baton`, one task at a time:
    :meth:`submit` a callable, :meth:`result` waits for its end (returns its value or raises its exception),
    :meth:`close` ends the thread and joins it (always call it, in a ``finally``)."""

    def __init__(self, baton: Baton, state: Callable[[], ContextManager[None]]):
        self.baton = baton
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._results: "queue.SimpleQueue" = queue.SimpleQueue()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, args=(state,), name="moe_graph-interleave-F", daemon=True)
        self._thread.start()

    def _run(self, state) -> None:
        _tls.side = F
        try:
            with state(), streams.event_slot(1):  # the side streams' second events (a recompute in B uses the first)
                while True:
                    task = self._tasks.get()
                    if task is None:
                        return
                    value, error = None, None
                    try:
                        self.baton.wait_turn(F)
                        value = task()
                    except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
                        error = e
                    finally:
                        self.baton.finish(F)
                    self._results.put((value, error))
                    del task, value, error
        except BaseException as e:  # noqa: BLE001 - entering the carried state failed: every task fails with it
            while True:
                task = self._tasks.get()
                if task is None:
                    return
                self.baton.finish(F)
                self._results.put((None, e))

    def submit(self, task: Callable[[], Any]) -> None:
        self._pending += 1
        self._tasks.put(task)

    def result(self) -> Any:
        self._pending -= 1
        value, error = self._results.get()
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """Waits for a task still running (its result is dropped), ends the thread and joins it."""
        while self._pending > 0:
            self._pending -= 1
            self._results.get()
        self._tasks.put(None)
        self._thread.join()


def run_pair(baton: Baton, worker: ForwardWorker, forward: Callable[[], Any], backward: Callable[[], Any]):
    """One pair: ``forward()`` as ``F`` in ``worker`` beside ``backward()`` as ``B`` in this thread, ``B`` first,
    alternating at the exchange points (the hook must be installed). Both sides have ended when this returns or
    raises; ``B``'s exception when ``B`` failed (``F``'s is dropped), else ``F``'s. Returns ``(F's value, B's value)``."""
    baton.start()
    worker.submit(forward)
    failed = True
    try:
        baton.wait_turn(B)
        b = backward()
        failed = False
    finally:
        baton.finish(B)  # F runs free to its end
        try:
            f = worker.result()  # waits for F's end
        except BaseException:
            if not failed:  # F's exception; when B failed too, B's propagates
                raise
    return f, b
