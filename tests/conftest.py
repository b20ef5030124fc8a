import contextlib
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch


def cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from moe_graph.ops._lib import cuda_built

        return cuda_built()
    except ImportError:
        return False


# The 8-rank variants of the multi-process tests and variants whose paths other cases run (each says which where it
# is marked): run by default (CI too, since the ranks are forked from a preloaded fork server: the whole suite took
# 11.1 min with them, 11.2 without, on 2 cores); MOE_GRAPH_FULL_TESTS=0 skips them on a slow machine.
FULL_TESTS = os.environ.get("MOE_GRAPH_FULL_TESTS", "1") != "0"


def full_only(*values):
    """``values`` as pytest params that ``MOE_GRAPH_FULL_TESTS=0`` skips (saying so)."""
    mark = pytest.mark.skipif(not FULL_TESTS, reason="MOE_GRAPH_FULL_TESTS=0 skips it")
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=mark) for v in values]


def pytest_collection_modifyitems(config, items):
    """``MOE_GRAPH_TEST_SHUFFLE=<seed>``: run the collected tests in a random order (every test of every file mixed,
    reproducible by the seed), to find tests that depend on what ran before them."""
    seed = os.environ.get("MOE_GRAPH_TEST_SHUFFLE")
    if seed:
        import random
        random.Random(int(seed)).shuffle(items)


requires_cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and the CUDA build of moe_graph._C")


@pytest.fixture
def gen():
    """A fresh random generator per test (seeded from the test's random state, so data differs across tests)."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()))
    return g


@pytest.fixture(autouse=True)
def _clear_error_flags():
    """Every test starts with clear device error flags and FP8 non-finite flags (a test that sets one on purpose
    must not leak it into the next)."""
    try:
        from moe_graph.ops.errors import read_error_flag
        from moe_graph.ops.fp8 import nonfinite_flag
    except ImportError:
        yield
        return
    for device in ("cpu", "cuda") if cuda_ready() else ("cpu",):
        read_error_flag(device)
        flag = nonfinite_flag(device)
        if flag is not None:
            flag.zero_()
    yield


# ----------------------------------------------------------------------------- processes the tests start --
# pytest is a child subreaper: workers orphaned by a test (their launcher killed) are re-parented here rather than to
# init, so the fixture below finds and ends them; every process a test starts is gone when the test ends.
_PR_SET_CHILD_SUBREAPER = 36
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

# command lines of the processes tests start (the demo, torchrun, multiprocessing workers, the launch helpers); a
# process pool that lives across tests (torch's compile workers, multiprocessing's resource tracker) is left alone
_TEST_PROCESS_MARKS = ("moe_graph", "spawn_main", "torch.distributed.run", "torchrun", "helpers.")


def proc_state(pid: int):
    """``(state, parent pid, start time, command line)`` of a live process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19]), cmd


def alive(pid: int, start_time=None) -> bool:
    """``pid`` runs (not a zombie; with ``start_time``: the same process, not a reuse of its pid)."""
    st = proc_state(pid)
    return st is not None and st[0] not in ("Z", "X") and (start_time is None or st[2] == start_time)


def launched_ranks(root: int):
    """Pids of the live run_distributed ranks below ``root``: the processes a multiprocessing fork server forked
    (their command line is the server's, so is their parent's)."""
    def forkserver(pid):
        st = proc_state(pid)
        return st is not None and "multiprocessing.forkserver" in st[3]

    return [p for p in descendants(root) if alive(p) and forkserver(p) and forkserver(proc_state(p)[1])]


def descendants(root: int):
    """Pids of the processes below ``root`` (children, theirs, ...)."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_state(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def wait_for(cond, timeout: float, what: str, poll: float = 0.1):
    """Poll ``cond()`` until it returns a true value (returned) or ``timeout`` seconds pass: then fail naming
    ``what`` was waited for."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session=True``, its process group and whatever else runs below
    it; reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def started(cmd, **kwargs):
    """``subprocess.Popen(cmd)`` in its own session whose whole tree is killed when the block ends, failed or not."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        kill_tree(proc)


def run_cmd(cmd, timeout: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end (text output captured); past ``timeout`` seconds its whole tree is killed and the test
    fails naming ``what`` it waited for, with the output so far."""
    with started(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, err = proc.communicate()
            pytest.fail(f"timed out after {timeout:g} s waiting for {what} to finish; output tail:\n"
                        f"{(out or '')[-2000:]}\n{(err or '')[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _reap_zombie_children() -> None:
    for pid in descendants(os.getpid()):
        st = proc_state(pid)
        if st is not None and st[0] == "Z" and st[1] == os.getpid():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """After each test: the processes it started (by their command lines) are gone; any left (a failed test's, or
    orphans re-parented to pytest) are killed and reaped, with a warning."""
    before = set(descendants(os.getpid()))
    yield
    left = []
    # A multiprocessing manager's server started in this process (e.g. megatron-core's cached results queue of its
    # async checkpoint writer) and run_distributed's fork server (it forks the ranks of every launch of this
    # process and exits with it) are meant to outlive the test that first needed them: not leaks.
    managers = {p.pid for p in multiprocessing.active_children() if "Manager" in p.name}
    for pid in set(descendants(os.getpid())) - managers:
        st = proc_state(pid)
        if st is not None and st[1] == os.getpid() and "multiprocessing.forkserver" in st[3]:
            continue
        if pid not in before and st is not None and st[0] not in ("Z", "X") and any(m in st[3] for m in
                                                                                     _TEST_PROCESS_MARKS):
            left.append((pid, st[3][:200]))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 10.0
    while any(alive(pid) for pid, _ in left) and time.monotonic() < end:
        time.sleep(0.05)
    _reap_zombie_children()
    if left:
        warnings.warn(f"the test left {len(left)} process(es) running, killed now: {left}")
