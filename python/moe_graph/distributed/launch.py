"""Process launch and parallel layout for the training entry point (:mod:`moe_graph.demo`).

Two ways to start the same training loop:

* under ``torchrun`` (one process per GPU, one or many nodes): :func:`torchrun_env` finds ``RANK`` /
  ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` and :func:`init_distributed` joins the
  ``env://`` rendezvous with NCCL on GPUs, gloo on CPUs;
* without it, the entry point spawns its own processes (:func:`run_distributed`, a file-store rendezvous) - one
  command on one machine. The tests' multi-process workers run through :func:`run_distributed` too.

:func:`resolve_layout` maps the world size and the ``--pp / --vpp / --ep`` flags to the data-parallel and
expert-data-parallel sizes, with errors that name the flag for impossible layouts. The run stamp
(:func:`environment`: torch / CUDA versions, GPU, :func:`git_commit`, date) goes into every summary and benchmark
result.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Layout", "resolve_layout", "torchrun_env", "init_distributed", "run_distributed", "environment", "git_commit"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Layout:
    """``world = pp * dp`` ranks; per pipeline stage ``dp = ep * edp`` (expert-data-parallel replicas of each expert
    shard); ``vpp`` model chunks per pipeline rank (interleaved schedule) or None. Dense tensor parallelism is not
    used (``tp = 1``)."""

    world: int
    pp: int
    vpp: Optional[int]
    ep: int
    dp: int
    edp: int

    def as_dict(self) -> Dict:
        return asdict(self)

    def __str__(self) -> str:
        v = f" x vpp {self.vpp}" if self.vpp else ""
        return f"pp {self.pp}{v} x dp {self.dp} (ep {self.ep} x expert-dp {self.edp}) = {self.world} ranks"


def resolve_layout(world: int, pp: int = 1, vpp: Optional[int] = None, ep: Optional[int] = None,
                   dp: Optional[int] = None) -> Layout:
    """The layout of ``world`` ranks; ``ep`` defaults to the data-parallel size ``world / pp``.

    Raises ``ValueError`` naming the flag (``--pp``, ``--vpp``, ``--ep``, ``--dp``) when the sizes do not fit.
    """
    for flag, v, lo in (("world size", world, 1), ("--pp", pp, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{flag} must be an integer >= {lo}, got {v!r}")
    if world % pp:
        raise ValueError(f"--pp {pp} does not divide the world size {world} (world = pp x dp)")
    d = world // pp
    if dp is not None and dp != d:
        raise ValueError(f"--dp {dp} does not match the world size: {world} ranks / --pp {pp} = {d}")
    if vpp is not None:
        if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
            raise ValueError(f"--vpp must be an integer >= 1, got {vpp!r}")
        if pp == 1:
            raise ValueError(f"--vpp {vpp} (interleaved schedule) needs --pp > 1")
    e = d if ep is None else ep
    if not isinstance(e, int) or isinstance(e, bool) or e < 1:
        raise ValueError(f"--ep must be an integer >= 1, got {ep!r}")
    if d % e:
        raise ValueError(f"--ep {e} does not divide the data-parallel size {d} (= {world} ranks / --pp {pp}); "
                         "expert parallelism splits each stage's data-parallel ranks")
    return Layout(world=world, pp=pp, vpp=vpp, ep=e, dp=d, edp=d // e)


def torchrun_env(environ=None) -> Optional[Dict[str, int]]:
    """``{"rank", "world", "local_rank"}`` when this process was started by ``torchrun`` (or another launcher that
    sets the ``env://`` variables), else None. Raises ``RuntimeError`` if only some of the variables are set."""
    env = os.environ if environ is None else environ
    present = [k for k in _TORCHRUN_VARS if k in env]
    if not present:
        return None
    missing = [k for k in _TORCHRUN_VARS if k not in env]
    if missing:
        raise RuntimeError(f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} "
                           "missing (launch with torchrun, or unset them to let the demo spawn its own processes)")
    try:
        out = {"rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]), "local_rank": int(env["LOCAL_RANK"])}
    except ValueError as exc:
        raise RuntimeError(f"torchrun environment: RANK / WORLD_SIZE / LOCAL_RANK must be integers ({exc})") from None
    if not 0 <= out["rank"] < out["world"]:
        raise RuntimeError(f"torchrun environment: RANK={out['rank']} outside WORLD_SIZE={out['world']}")
    return out


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> Dict[str, int]:
    """Join the ``env://`` rendezvous of a torchrun job: NCCL on CUDA (device ``LOCAL_RANK``), gloo on CPU.
    Returns :func:`torchrun_env`'s dict."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError("init_distributed: not started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR unset)")
    if device_type == "cuda":
        n = torch.cuda.device_count()
        if env["local_rank"] >= n:
            raise RuntimeError(f"LOCAL_RANK {env['local_rank']} but only {n} GPU(s) on this node: use "
                               f"--nproc-per-node <= {n}")
        torch.cuda.set_device(env["local_rank"])
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method="env://",
                            rank=env["rank"], world_size=env["world"], timeout=datetime.timedelta(minutes=timeout_minutes))
    return env


# ---------------------------------------------------------------- self-spawned processes (one machine) --

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


# ------------------------------------------------------------------------------------------ run stamp --
def git_commit() -> str:
    """HEAD of the checkout, or $MOE_GRAPH_COMMIT (set by run_gpu.sh on machines that get a copy without .git)."""
    if os.environ.get("MOE_GRAPH_COMMIT"):
        return os.environ["MOE_GRAPH_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def environment() -> Dict[str, object]:
    """The run stamp: torch and CUDA versions, the commit measured, the UTC date and, on a GPU, its name, SM count and
    compute capability."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
    return env
