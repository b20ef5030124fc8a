"""Every rank agrees on a failure: the one rule of moe_graph's collective loads and saves.

A collective load or save (``train.checkpoint.save_checkpoint``, the demo's ``--load``,
``integrations.hf_checkpoint.load_hf_checkpoint`` / ``save_hf_pretrained``, ``DistributedOptimizer.load_state_dict``)
reads or writes on every rank, then the ranks meet in a collective. An exception on one rank before that point
would leave the others waiting there until the process group's timeout. :class:`AllOrNone` is the point of
agreement::

    with AllOrNone("load_hf_checkpoint(ckpt)", outcome="nothing was loaded") as step:
        step.at(f"tensor {name!r} of {path} (expected float32 (8, 48, 32))")   # what is being done now
        ...                                              # read and check everything; copy nothing yet
    ...                                                  # reached on every rank only when every rank succeeded

Any exception of any kind raised inside the block is caught; the ranks exchange one message each (an
``all_gather_object`` over each group given, in order: a few hundred bytes, only at load / save time) and, if any
rank failed, every rank raises with every failing rank's message: the failing rank an exception of its own type
when that type takes a message (so ``except ValueError`` still works), else :class:`CollectiveFailure`; the other
ranks :class:`CollectiveFailure` (``"another rank could not ..."``). Every exception raised after the agreement
carries ``failures`` (``[(global rank, message)]``, the same on every rank): an error without it (a peer that died
inside the exchange itself) was not agreed on. The message says what was being done
(:meth:`AllOrNone.at`: the file, the tensor or setting and what was expected) and the original error.
``KeyboardInterrupt`` / ``SystemExit`` are agreed on too, then re-raised unchanged. Without ``torch.distributed``
initialized nothing is exchanged and the error is only named.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch.distributed as dist

__all__ = ["AllOrNone", "CollectiveFailure", "agree_failures", "describe_exception"]


class CollectiveFailure(RuntimeError):
    """A collective load or save failed on some rank; ``failures``: ``[(global rank, message)]`` of every rank
    that failed (the same list on every rank)."""

    def __init__(self, message: str, failures: List[Tuple[int, str]]):
        super().__init__(message)
        self.failures = failures


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def describe_exception(exc: BaseException, where: Optional[str] = None) -> str:
    """``"<where>: <Type>: <message>"`` (a ``KeyError``'s message without its quotes)."""
    text = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str) \
        else str(exc)
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{where}: {text}" if where else text


def agree_failures(message: Optional[str], groups: Iterable = (None,)) -> List[Tuple[int, str]]:
    """Every rank's failure message (``None``: this rank succeeded) exchanged over each of ``groups`` in turn
    (``None``: the world), so that each rank ends with the failures of every rank it shares a group with (through
    the chain of groups). A collective: every rank of every group calls it. Returns ``[(global rank, message)]``
    sorted by rank; empty when every rank succeeded."""
    if not _distributed():
        return [] if message is None else [(0, message)]
    failures = [] if message is None else [(dist.get_rank(), message)]
    for group in groups:
        got: List = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, failures, group=group)
        failures = sorted({tuple(f) for part in got for f in part})
    return failures


def _retyped(exc: Exception, message: str, failures) -> Exception:
    """``exc``'s own type with ``message`` when the type takes one, else :class:`CollectiveFailure`."""
    try:
        new = type(exc)(message)
        if type(new) is type(exc) and message in str(new):
            new.failures = failures
            return new
    except Exception:  # noqa: BLE001 - a constructor that takes other arguments
        pass
    return CollectiveFailure(message, failures)


class AllOrNone:
    """The point of agreement of a collective load or save (see the module docstring). ``what``: the call and its
    argument (``"load_hf_checkpoint(/ckpt)"``), the head of every message; ``action``: what the other ranks say
    they could not do (``"load its part"``); ``outcome``: the state everyone is left in (``"nothing was
    loaded"``); ``groups``: the process groups to agree over, in order (default the world)."""

    def __init__(self, what: str, *, action: str = "load its part", outcome: str = "nothing was loaded",
                 groups: Iterable = (None,)):
        self.what, self.action, self.outcome, self.groups = what, action, outcome, list(groups)
        self.where: Optional[str] = None

    def at(self, where: Optional[str]) -> None:
        """What is being done now (the file, the tensor or setting, what was expected): named if it fails."""
        self.where = where

    def __enter__(self) -> "AllOrNone":
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        message = None if exc is None else describe_exception(exc, self.where)
        failures = agree_failures(message, self.groups)
        if not failures:
            return False
        ranks = _distributed()
        details = "; ".join(f"rank {r}: {m}" if ranks else m for r, m in failures)
        if exc is None:
            raise CollectiveFailure(f"{self.what}: another rank could not {self.action} ({details}); {self.outcome} "
                                    "on any rank", failures)
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: agreed on, re-raised as they are
        tail = f"; {self.outcome} on any rank" if ranks else f"; {self.outcome}"
        raise _retyped(exc, f"{self.what}: {details}{tail}", failures) from exc
