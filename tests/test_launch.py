"""Self-spawned processes under a scheduler (moe_graph.distributed.launch): workers die with their launcher (the
parent-death signal, and the watchdog alone), the rendezvous connects again after failed connections, SIGTERM is a
stop request every rank agrees on at the same step, a rank that cannot stop exits after its grace period, and a
run that times out says what it waited for and leaves no worker behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import alive, launched_ranks, proc_state, started, wait_for
from moe_graph.distributed import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


# ------------------------------------------------------------------------------- worker functions (spawned) --
def _blocked_forever(rank, world, pid_dir):
    """Rank 0 blocks in a gloo barrier (inside C++) that rank 1 never joins; rank 1 sleeps in Python."""
    with open(os.path.join(pid_dir, f"{rank}.pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(pid_dir, f"{rank}.pid.tmp"), os.path.join(pid_dir, f"{rank}.pid"))
    if rank == 0:
        dist.barrier()
    while True:
        time.sleep(0.5)


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t), launch.rendezvous_attempts()


def _steps_until_stop(rank, world, signal_at):
    """Steps until every rank agrees to stop; rank 1 sends itself SIGTERM in step ``signal_at``."""
    stop = launch.StopRequest(grace=600.0, announce=False).install()
    try:
        step = 0
        while True:
            step += 1
            if rank == 1 and step == signal_at:
                signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns
            if stop.agreed():
                after = signal.getsignal(signal.SIGTERM)
                return step, stop.reason, after == signal.SIG_DFL
    finally:
        stop.uninstall()


def _one_rank_cannot_stop(rank, world):
    """Rank 1 asks to stop and then never reaches the agreement; its grace timer must end it."""
    stop = launch.StopRequest(grace=2.0, announce=False).install()
    if rank == 1:
        stop.request("test")
        while True:
            time.sleep(0.5)
    while not stop.agreed():
        pass


def _environment(rank, world, names):
    return {n: os.environ.get(n) for n in names}, os.getppid()


# -------------------------------------------------------------------------------------------------- tests --
def test_ranks_start_with_the_launchers_environment_of_each_launch(monkeypatch):
    """The ranks are forked by one fork server (started by the first launch of this process, its environment then):
    each launch's ranks still see the launcher's environment of that launch, variables set and removed since."""
    launch.run_distributed(_environment, 2, [])  # the fork server runs from here on
    monkeypatch.setenv("MOE_GRAPH_TEST_LAUNCH_VAR", "second launch")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    names = ["MOE_GRAPH_TEST_LAUNCH_VAR", "PYTHONHASHSEED", "HOME"]
    res = launch.run_distributed(_environment, 2, names)
    want = {n: os.environ.get(n) for n in names}
    assert [r[0] for r in res] == [want, want]
    assert res[0][1] == res[1][1] != os.getpid()  # both forked by the server, a child of this process
    assert launch.run_distributed(_environment, 2, ["OMP_NUM_THREADS"])[0][0] == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("pdeathsig", ["1", "0"], ids=["parent-death-signal", "watchdog-only"])
def test_sigkill_of_the_launcher_leaves_no_worker(tmp_path, pdeathsig):
    """The launcher of run_distributed SIGKILLed while one worker is blocked in a collective and the other in
    Python: both are gone within seconds (the kernel's parent-death signal; or, without it, the watchdog thread)."""
    code = ("import sys, test_launch; from moe_graph.distributed.launch import run_distributed; "
            f"run_distributed(test_launch._blocked_forever, 2, {str(tmp_path)!r}, timeout=None)")
    with started([sys.executable, "-c", code], env=_env(MOE_GRAPH_PDEATHSIG=pdeathsig), stdout=subprocess.DEVNULL,
                  stderr=subprocess.PIPE, text=True) as proc:
        files = [tmp_path / f"{r}.pid" for r in range(2)]
        wait_for(lambda: all(f.exists() for f in files) or proc.poll() is not None, 240,
                 "both workers to start (their pid files)")
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        workers = [(int(f.read_text()), proc_state(int(f.read_text()))[2]) for f in files]
        assert all(alive(p, t) for p, t in workers)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(p, t) for p, t in workers), 30,
                 f"the workers {[p for p, _ in workers]} to exit after their launcher was SIGKILLed")
        print(f"workers gone {time.monotonic() - t0:.2f} s after SIGKILL of the launcher ({pdeathsig=})")


def test_rendezvous_connects_again_after_failed_connections(monkeypatch):
    """Rank 1's first two connections fail (as gloo's connectFullMesh does on a loaded machine): every rank connects
    again under new store keys, and the third attempt's group reduces correctly."""
    monkeypatch.setenv(launch.RENDEZVOUS_FAULT_ENV, "1:2")
    out = launch.run_distributed(_sum_of_ranks, 3)
    assert out == [(6.0, 3)] * 3  # 1 + 2 + 3, on every rank after 3 attempts


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step():
    """SIGTERM to rank 1 only (as to every rank under torchrun, one of which sees it late): all ranks stop after the
    step it arrived in; from then on SIGTERM has its default action (a second one ends the process at once)."""
    out = launch.run_distributed(_steps_until_stop, 3, 5)
    assert [s for s, _, _ in out] == [5, 5, 5]
    assert [r for _, r, _ in out] == ["another rank's stop request", "SIGTERM", "another rank's stop request"]
    assert all(dfl for _, _, dfl in out)


def test_a_rank_that_cannot_stop_exits_after_its_grace_period():
    with pytest.raises(RuntimeError, match=f"rank 1 exited with code {launch.STOP_EXIT_CODE}"):
        launch.run_distributed(_one_rank_cannot_stop, 2, timeout=600)
    assert not launched_ranks(os.getpid())


def test_timeout_names_what_was_waited_for_and_leaves_no_worker(tmp_path):
    with pytest.raises(RuntimeError, match=r"timeout: _blocked_forever on 2 ranks did not finish within 3 s"):
        launch.run_distributed(_blocked_forever, 2, str(tmp_path), timeout=3)
    assert not launched_ranks(os.getpid())


def test_launcher_stop_seen_late_by_one_rank_keeps_its_reason(monkeypatch):
    """The launcher's forwarded SIGTERM (an event every worker polls) set between this rank's look and another
    rank's: the all-reduce says stop, and this rank's reason is still the launcher's, not "another rank's stop
    request" (which rank looked first is a race)."""
    import threading

    event = threading.Event()
    monkeypatch.setattr(launch, "_LAUNCHER_STOP", event)

    def other_rank_saw_it(flag, op=None, group=None):
        event.set()  # set after this rank's look; the other rank saw it and sends 1
        flag.fill_(1)

    monkeypatch.setattr(dist, "all_reduce", other_rank_saw_it)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    req = launch.StopRequest(grace=60.0, announce=False).install()  # uninstall restores the handlers it changes
    try:
        assert req.agreed() and req.reason == "SIGTERM to the launcher"
    finally:
        req.uninstall()
    event.clear()
    monkeypatch.setattr(dist, "all_reduce", lambda flag, op=None, group=None: flag.fill_(1))
    req = launch.StopRequest(grace=60.0, announce=False).install()
    try:
        assert req.agreed() and req.reason == "another rank's stop request"  # its own SIGTERM, on another rank
    finally:
        req.uninstall()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_stop_request_rejects_a_bad_grace():
    with pytest.raises(ValueError, match="grace"):
        launch.StopRequest(grace=0)
