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
from typing import Any, Callable, List

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
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 300.0
) -> List[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return results by rank.

    ``fn`` must be a module-level (picklable) function.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, backend, fn, args, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict = {}
        errors = []
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                break
            if queue.empty():
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                time.sleep(0.01)
                continue
            rank, ok, payload = queue.get()
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append((rank, payload))
                break  # one failure is enough; peers may be blocked in a collective
        for p in procs:
            p.join(timeout=1 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            rank, tb = errors[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
        if len(results) != world_size:
            missing = sorted(set(range(world_size)) - set(results))
            codes = [p.exitcode for p in procs]
            raise RuntimeError(
                f"ranks {missing} of {world_size} returned no result (timeout {timeout}s or crash; exit codes {codes})"
            )
        return [results[r] for r in range(world_size)]
