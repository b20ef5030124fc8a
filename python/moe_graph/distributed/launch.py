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

Under a scheduler (:func:`die_with_parent`, :class:`StopRequest`): a self-spawned worker dies with its launcher
(Linux parent-death signal, plus a watchdog on the launcher's pid that also ends a worker blocked in a collective);
SIGTERM asks every rank to stop after the same step (the demo then saves and exits with :data:`STOP_EXIT_CODE`); a
second SIGTERM or SIGINT ends the process at once. The self-spawned rendezvous (:func:`run_distributed`) waits on
its file store for every rank to start, then connects, and connects again (new store keys) while any rank's
connection failed, within a deadline.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_graph.distributed import STOP_EXIT_CODE

__all__ = ["Layout", "resolve_layout", "torchrun_env", "init_distributed", "run_distributed", "die_with_parent",
           "StopRequest", "STOP_EXIT_CODE", "rendezvous_attempts", "environment", "git_commit"]

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


# --------------------------------------------------------------------------- living under a scheduler --
PDEATHSIG_ENV = "MOE_GRAPH_PDEATHSIG"  # testing only: "0" leaves the watchdog alone to end an orphaned worker
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` to this process when its parent thread exits
    (Linux only; False elsewhere or when the call fails)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process (SIGKILL) when ``parent_pid``, its launcher, dies: the Linux parent-death signal (armed
    against this process's parent: the launcher itself, or :func:`run_distributed`'s fork server, which exits when
    its launcher does), and a daemon thread that checks every ``poll_s`` seconds that the launcher still runs and
    this process was not re-parented. The thread needs no Python in the main thread, so it also ends a process
    blocked in a collective whose peers are gone. Call it first thing in the child."""
    if os.environ.get(PDEATHSIG_ENV, "1") != "0":
        _set_pdeathsig(signal.SIGKILL)
    os_parent = os.getppid()

    def orphaned() -> bool:  # re-parented to init or a subreaper, or the launcher gone
        return os.getppid() != os_parent or not _running(parent_pid)

    if orphaned():  # the launcher died before the parent-death signal was armed
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while not orphaned():
            time.sleep(poll_s)
        os.write(2, f"moe_graph: launcher (pid {parent_pid}) is gone; worker {os.getpid()} exits\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="moe_graph-parent-watchdog", daemon=True).start()


def _running(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (a dead launcher its own parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: existence is all there is to know


_LAUNCHER_STOP = None  # the self-spawning launcher's stop event, in its workers (run_distributed(stop_on_sigterm))


class StopRequest:
    """A request to stop at the next step boundary: SIGTERM to this process (torchrun forwards it to every rank;
    SLURM and Kubernetes send it before SIGKILL), or the self-spawning launcher's forwarded request.

    :meth:`agreed` (a collective over ``group``, every step) is true on every rank once any rank has a request, so
    all ranks stop after the same step. Once requested, SIGTERM and SIGINT get their default action (a second one
    ends the process at once, even inside a collective), and the process ends itself ``grace`` seconds later
    (exit :data:`STOP_EXIT_CODE`): a rank waiting on a rank that cannot stop does not keep the job waiting.
    ``group``: a CPU (gloo) group, so the check never waits on the device. Use :meth:`install` /
    :meth:`uninstall` from the main thread.
    """

    def __init__(self, grace: float, group=None, announce: bool = True):
        if not grace > 0:
            raise ValueError(f"StopRequest: grace must be > 0 seconds, got {grace!r}")
        self.grace, self.group, self.announce = float(grace), group, announce
        self.reason: Optional[str] = None
        self._previous: Dict[int, Any] = {}
        self._timer: Optional[threading.Timer] = None

    def install(self) -> "StopRequest":
        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_signal),
                          signal.SIGINT: signal.getsignal(signal.SIGINT)}
        return self

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        """Ask to stop (idempotent): from now on SIGTERM / SIGINT end the process, and so does the grace timer."""
        if self.reason is not None:
            return
        self.reason = reason
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        self._timer = threading.Timer(self.grace, self._expired)
        self._timer.daemon = True
        self._timer.start()
        if self.announce:
            print(f"moe_graph: {reason}: stopping after the current step (checkpoint if --save); grace "
                  f"{self.grace:g} s, then exit without one; a second SIGTERM or SIGINT exits at once",
                  file=sys.stderr, flush=True)

    def _expired(self) -> None:
        os.write(2, f"moe_graph: {self.reason}: not stopped within the grace period ({self.grace:g} s); process "
                    f"{os.getpid()} exits now\n".encode())
        os._exit(STOP_EXIT_CODE)

    def requested(self) -> bool:
        """This process's request (its own signal, or the launcher's event)."""
        if self.reason is None and _LAUNCHER_STOP is not None and _LAUNCHER_STOP.is_set():
            self.request("SIGTERM to the launcher")
        return self.reason is not None

    def agreed(self) -> bool:
        """True on every rank when any rank has a request (a MAX all-reduce of one CPU integer over ``group``)."""
        flag = torch.tensor([1 if self.requested() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        # a rank that saw the launcher's event set just after this rank looked: the event is set now, so the
        # reason is the launcher's on every rank, not the order in which they looked
        if flag[0] and not self.requested():
            self.request("another rank's stop request")
        return bool(flag[0])


# ---------------------------------------------------------------- self-spawned processes (one machine) --
RENDEZVOUS_FAULT_ENV = "MOE_GRAPH_RENDEZVOUS_FAULT"  # testing only: "RANK:N" -> RANK's first N connections fail
_RETRIABLE = ("connectFullMesh", "Connection closed by peer", "Connection reset by peer", "Connection refused",
              "Socket Timeout", "Timed out")
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # collectives: torch's default for gloo
_CAN_SET_TIMEOUT = hasattr(dist, "set_timeout")  # torch >= 2.12
_ATTEMPTS = 0  # connection attempts of this process's rendezvous (rendezvous_attempts())


def rendezvous_attempts() -> int:
    """How many connection attempts the rendezvous of this (self-spawned) worker took."""
    return _ATTEMPTS


def _store_wait(store, keys: List[str], deadline: float, what: str) -> None:
    """``store.wait(keys)`` until ``deadline``; on timeout a ``RuntimeError`` naming what was waited for and the
    keys still missing."""
    try:
        store.wait(keys, datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except RuntimeError as exc:  # DistStoreError on timeout
        missing = [k for k in keys if not store.check([k])]
        raise RuntimeError(f"rendezvous: timed out waiting for {what} (missing: {', '.join(missing)})") from exc


def _rendezvous(init_file: str, rank: int, world: int, backend: str, deadline: float, attempt_s: float) -> None:
    """Every rank arrives on the file store (however slowly it started), then ``init_process_group``; each rank
    posts whether it connected, and all try again under a new key prefix while any failed with a connection
    error (gloo's ``connectFullMesh ... Connection closed by peer`` on a loaded machine), until ``deadline``."""
    global _ATTEMPTS
    store = dist.FileStore(init_file, world)
    store.set(f"arrived/{rank}", "1")
    _store_wait(store, [f"arrived/{r}" for r in range(world)], deadline, f"all {world} ranks to start")
    fault = os.environ.get(RENDEZVOUS_FAULT_ENV, "")
    n_fail = int(fault.split(":")[1]) if fault.startswith(f"{rank}:") else 0
    for attempt in range(1_000_000):
        _ATTEMPTS = attempt + 1
        prefix = f"attempt{attempt}/"
        error = None
        try:
            # a short timeout for the connection attempt, then torch's default for the collectives; a torch
            # without dist.set_timeout (before 2.12) keeps the collectives' timeout from the start
            timeout = datetime.timedelta(seconds=attempt_s) if _CAN_SET_TIMEOUT else _COLLECTIVE_TIMEOUT
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                    timeout=timeout)
            if attempt < n_fail:
                raise RuntimeError(f"Gloo connectFullMesh failed (injected by {RENDEZVOUS_FAULT_ENV}={fault})")
        except RuntimeError as exc:
            error = exc
        retry = error is not None and any(m in str(error) for m in _RETRIABLE)
        store.set(f"{prefix}ok/{rank}", "ok" if error is None else "retry" if retry else f"fatal: {error}"[:2000])
        keys = [f"{prefix}ok/{r}" for r in range(world)]
        _store_wait(store, keys, deadline, f"every rank's outcome of connection attempt {attempt + 1}")
        outcomes = [store.get(k).decode() for k in keys]
        if all(o == "ok" for o in outcomes):
            if _CAN_SET_TIMEOUT:
                dist.set_timeout(_COLLECTIVE_TIMEOUT)
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        fatal = [(r, o) for r, o in enumerate(outcomes) if o.startswith("fatal")]
        if fatal:
            raise RuntimeError(f"rendezvous: rank {fatal[0][0]} could not connect: {fatal[0][1][7:]}") from error
        if time.monotonic() > deadline:
            raise RuntimeError(f"rendezvous: {world} ranks failed to connect {attempt + 1} times before the "
                               f"deadline; this rank's last error: {error}") from error
    raise AssertionError("unreachable")


# run_distributed's ranks are forked by multiprocessing's fork server, which imports these once (then a launch
# starts no interpreter and imports no torch per rank: ~2 s of CPU per rank on a small machine; the server does not
# initialize CUDA, so the ranks can). It is started by the first launch, serves every later one in this process and
# exits with this process. The ranks start with the launcher's environment of the launch (_worker), not the
# server's: what this package and torch read from the environment when called, not at import, is then as spawned.
_PRELOAD = ["torch", "moe_graph.distributed.launch", "moe_graph.ops"]  # ops: the extension, torch._dynamo


def _context():
    if "forkserver" not in mp.get_all_start_methods():  # not a POSIX system: an interpreter per rank
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank, world_size, init_file, backend, fn, args, queue, parent_pid, stop_event, rdzv_s, environ):
    os.environ.clear()
    os.environ.update(environ)  # the launcher's at the launch (the fork server's may be older)
    die_with_parent(parent_pid)
    global _LAUNCHER_STOP
    _LAUNCHER_STOP = stop_event
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        _rendezvous(init_file, rank, world_size, backend, time.monotonic() + rdzv_s, attempt_s=min(60.0, rdzv_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: tensors are copied by value (a multiprocessing queue would share them through file
        # descriptors that vanish when this worker exits).
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, False, traceback.format_exc()))


class _SecondSignal(KeyboardInterrupt):
    """A second SIGTERM / SIGINT to a launcher that forwarded a stop request: stop the workers at once."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: Optional[float] = 300.0,
    rendezvous_timeout: float = 300.0, stop_on_sigterm: bool = False, stop_grace: float = 25.0
) -> List[Any]:
    """Start ``world_size`` processes running ``fn(rank, world_size, *args)``; return results by rank. They are
    forked by a fork server that imported torch once for this process (:data:`_PRELOAD`), with this process's
    environment of the call.

    ``fn`` must be a module-level (picklable) function. ``timeout``: seconds for the whole run (None: no limit);
    ``rendezvous_timeout``: seconds for every rank to start and connect (retried on connection failures).
    A rank that raises, or dies without a result (killed, crashed), ends the run at once: the other ranks are
    killed (they may be blocked in a collective) and ``RuntimeError`` names the rank. The workers are stopped on
    every way out of this function, including ``KeyboardInterrupt`` (SIGINT) in the parent, and die with this
    process if it is killed (:func:`die_with_parent`).

    ``stop_on_sigterm`` (called from the main thread): the first SIGTERM to this process is forwarded as a stop
    request (:class:`StopRequest` in the workers; ``fn`` decides where to stop and returns normally) and the
    workers get ``stop_grace`` seconds (plus 5 s to exit) before they are killed; a second SIGTERM or SIGINT kills
    them at once. Otherwise SIGTERM keeps its default action (this process ends, so do the workers).
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    stop_event = ctx.Event()
    procs: list = []
    failed = True
    stop_deadline: List[float] = []
    previous: Dict[int, Any] = {}

    def second_signal(signum, frame):
        raise _SecondSignal(f"{signal.Signals(signum).name} after the stop request: workers killed")

    def on_sigterm(signum, frame):
        if stop_deadline:
            second_signal(signum, frame)
        stop_event.set()
        stop_deadline.append(time.monotonic() + stop_grace + 5.0)
        signal.signal(signal.SIGINT, second_signal)
        print(f"moe_graph: SIGTERM: the {world_size} ranks stop after their current step (checkpoint if --save); "
              f"grace {stop_grace:g} s, then they are killed; a second SIGTERM or SIGINT kills them at once",
              file=sys.stderr, flush=True)

    if stop_on_sigterm:
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
                    signal.SIGINT: signal.getsignal(signal.SIGINT)}
    waited = f"{getattr(fn, '__name__', fn)!s} on {world_size} ranks"
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        try:
            for r in range(world_size):
                p = ctx.Process(target=_worker, args=(r, world_size, init_file, backend, fn, args, queue,
                                                      os.getpid(), stop_event, rendezvous_timeout, dict(os.environ)))
                p.start()
                procs.append(p)
            results: dict = {}
            errors = []
            dead = []
            why = ""
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(results) + len(errors) < world_size:
                if deadline is not None and time.monotonic() > deadline:
                    why = f"timeout: {waited} did not finish within {timeout:g} s"
                    break
                if stop_deadline and time.monotonic() > stop_deadline[0]:
                    why = f"the ranks did not stop within the grace period ({stop_grace:g} s + 5 s) after SIGTERM"
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
        except _SecondSignal:
            _stop(procs, grace=0.0, kill=True)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
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
                f"ranks {missing} of {world_size} returned no result ({why or 'crash'}; exit codes {codes})" + gone
            )
        return [results[r] for r in range(world_size)]


def _stop(procs, grace: float, kill: bool = False) -> None:
    """Join the workers (``grace`` seconds in all), then terminate and kill the ones still running (``kill``:
    SIGKILL at once, without the SIGTERM that a stop-aware worker would take as a request to finish its step)."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill() if kill else p.terminate()
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
