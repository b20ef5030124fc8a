"""Workers of tests/test_collective_failures.py for :func:`moe_graph.train.checkpoint.save_checkpoint`: a save
that fails on one rank (a full disk, an exception of any kind) must fail on every rank, naming the file, and leave
the previous checkpoint the one ``latest`` names."""

from __future__ import annotations

import errno
import os
import time
from typing import Dict

from helpers import Injected
from helpers.optimizer_checks import _train, make_model
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import DistributedOptimizer
from moe_graph.train import checkpoint


def save_failure_worker(rank: int, world: int, root: str) -> Dict:
    """DP ``world`` (a tiny model, ZeRO-1): saves step 1, then step 2 with rank 1's optimizer file hitting a full
    disk (``OSError(ENOSPC)`` from the writer), then step 2 again with :class:`helpers.Injected` raised by rank 1's
    ``optimizer.state_dict()``. Per case ``(exception type, message, seconds in save_checkpoint)``."""
    model = make_model()
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2)
    _train(ddp, opt, rank, world, 1)
    state = checkpoint.global_tensors(model) if rank == 0 else {}

    def save(step):
        return checkpoint.save_checkpoint(root, step, rank=rank, world=world, model_state=state, optimizer=opt,
                                          rank_state={}, meta={"layout": {"dp": world}},
                                          naming=checkpoint.naming_of([model], 0))

    save(1)
    out = {}
    real_save, real_state_dict = checkpoint.atomic_torch_save, opt.state_dict

    def full_disk(obj, path):
        if rank == 1 and os.path.basename(path).startswith("optim_"):
            def write(f):
                f.write(b"x" * 100)  # part of the file went out, then the disk was full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return checkpoint._atomic_write(path, write)
        return real_save(obj, path)

    def injected(*a, **k):
        if rank == 1:
            raise Injected("injected in state_dict")
        return real_state_dict(*a, **k)

    for case in ("full_disk", "injected"):
        if case == "full_disk":
            checkpoint.atomic_torch_save = full_disk
        else:
            opt.state_dict = injected
        t0 = time.perf_counter()
        try:
            save(2)
            out[case] = ("none", "", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[case] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
        finally:
            checkpoint.atomic_torch_save = real_save
            opt.state_dict = real_state_dict
    with open(os.path.join(root, "latest")) as f:
        out["latest"] = f.read().strip()
    out["step2"] = os.path.exists(os.path.join(root, "step_00000002"))
    out["after"] = save(3)  # the ranks are still in step: a clean save works
    return out


def tiny_checkpoint_worker(rank: int, world: int, root: str) -> str:
    """One rank (DP ``world`` = 1 in the tests): a tiny model trained one step and saved as step 1 of ``root``
    with the demo's meta keys (layout, coordinates, model). Returns the folder."""
    model = make_model()
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2)
    _train(ddp, opt, rank, world, 1)
    coords = {"rank": rank, "pp_rank": 0, "dp_rank": rank, "ep_rank": 0, "edp_rank": rank}
    layout = {"world": world, "pp": 1, "vpp": None, "ep": 1, "dp": world, "edp": world}
    return checkpoint.save_checkpoint(root, 1, rank=rank, world=world,
                                      model_state=checkpoint.global_tensors(model) if rank == 0 else {},
                                      optimizer=opt, rank_state={"coords": coords},
                                      meta={"layout": layout, "coords": [coords], "model": {"layers": 1}},
                                      naming=checkpoint.naming_of([model], 0))
