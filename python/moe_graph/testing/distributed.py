"""Run a function on N real ``torch.distributed`` processes (gloo by default) and collect the results.

Used by the multi-process tests: every rank runs ``fn(rank, world_size, *args)`` inside an initialized
process group; the return values (picklable) come back in rank order. An exception on any rank is
re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, init_file, backend, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: tensors are copied by value (a multiprocessing queue would share them through file
        # descriptors that vanish when this worker exits).
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: Optional[float] = 300.0
) -> List[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return results by rank.

    ``fn`` must be a module-level (picklable) function. ``timeout``: seconds for the whole run (None: no limit).
    A rank that raises, or dies without a result (killed, crashed), ends the run at once: the other ranks are
    killed (they may be blocked in a collective) and ``RuntimeError`` names the rank. The workers are stopped on
    every way out of this function, including ``KeyboardInterrupt`` (SIGINT) in the parent.
    """
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs: list = []
    failed = True
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        try:
            for r in range(world_size):
                p = ctx.Process(target=_worker, args=(r, world_size, init_file, backend, fn, args, queue))
                p.start()
                procs.append(p)
            results: dict = {}
            errors = []
            dead = []
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(results) + len(errors) < world_size:
                if deadline is not None and time.monotonic() > deadline:
                    break
                if queue.empty():
                    # a rank that exited without reporting (SIGKILL, segfault, os._exit) never will
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                    if dead and queue.empty():
                        break
                    time.sleep(0.01)
                    continue
                rank, ok, payload = queue.get()
                if ok:
                    results[rank] = pickle.loads(payload)
                else:
                    errors.append((rank, payload))
                    break  # one failure is enough; peers may be blocked in a collective
            failed = bool(errors or dead) or len(results) != world_size
            died = {r: p.exitcode for r, p in enumerate(procs) if not p.is_alive() and p.exitcode}
        finally:
            _stop(procs, grace=1.0 if failed else 30.0)
        gone = "".join(f"; rank {r} exited with code {c}" + (f" (signal {-c})" if c < 0 else "")
                       for r, c in sorted(died.items()))
        if errors:
            rank, tb = errors[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed{gone}:\n{tb}")
        if len(results) != world_size:
            missing = sorted(set(range(world_size)) - set(results))
            codes = [p.exitcode for p in procs]
            raise RuntimeError(
                f"ranks {missing} of {world_size} returned no result (timeout {timeout}s or crash; exit codes {codes})"
                + gone
            )
        return [results[r] for r in range(world_size)]


def _stop(procs, grace: float) -> None:
    """Join the workers (``grace`` seconds in all), then terminate and kill the ones still running."""
    import time

    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 2.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
